"""Crash-safe file writes for the checkpoints (the job's and the PS's) and the PS's incremental dumps.

Every file is written to a unique temporary name in its final directory, flushed, ``fsync``'ed and ``os.replace``'d
onto its name, then the directory is ``fsync``'ed; so a file name either does not exist or holds a complete file.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["atomic_json", "atomic_torch_save", "atomic_write", "fsync_dir"]


def fsync_dir(directory: Path) -> None:
    """Make the entries of ``directory`` (a rename, a deletion) durable, where the platform allows it."""
    # The rename is durable only once the directory entry is on disk. Not every platform lets a directory be opened.
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write(path: Path, write: Callable[[Any], None]) -> None:
    """Write ``path`` through a temp file in the same directory (same filesystem, so ``os.replace`` is atomic)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


def atomic_torch_save(obj: Any, path: Path) -> None:
    """``torch.save`` ``obj`` to ``path`` atomically."""
    import torch  # here: the launcher's checks use this module's other writers before torch is imported

    atomic_write(path, lambda f: torch.save(obj, f))


def atomic_json(obj: Any, path: Path) -> None:
    """Write ``obj`` to ``path`` as indented, key-sorted JSON, atomically."""
    atomic_write(path, lambda f: f.write(json.dumps(obj, indent=1, sort_keys=True).encode()))
