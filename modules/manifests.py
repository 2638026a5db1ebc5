"""What a checkpoint's manifest records of each file it holds, the check of a file against that record, and the
removal of checkpoint directories that are no longer kept: the job's checkpoints
(:mod:`persia_planner.modules.train.job_checkpoints`) and the parameter servers'
(:mod:`persia_planner.modules.ps.table_checkpoints`) both use them. Torch-free.
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from persia_planner.modules.atomic import fsync_dir

__all__ = ["file_problem", "file_record", "remove_directories"]

_CHUNK_BYTES = 1 << 20


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def file_record(path: Path, *, checksum: bool = True) -> dict[str, Any]:
    """What a manifest records of the file at ``path``: its ``bytes``, and its ``sha256`` with ``checksum``."""
    record: dict[str, Any] = {"bytes": path.stat().st_size}
    if checksum:
        record["sha256"] = _sha256(path)
    return record


def file_problem(path: Path, record: Mapping[str, Any], *, checksums: bool = True) -> str | None:
    """Why ``path`` is not the file ``record`` describes, in a few words; None where it is.

    A record without ``bytes`` (a manifest of an older save) checks that the file is there; its ``sha256`` is
    compared only with ``checksums`` (reading the whole file), where the record has one.
    """
    if not path.is_file():
        return "missing"
    size, recorded = path.stat().st_size, record.get("bytes")
    if recorded is not None and size != recorded:
        return f"{size} bytes, its manifest recorded {recorded}: truncated or replaced"
    if checksums and "sha256" in record and _sha256(path) != record["sha256"]:
        return "its bytes do not match the checksum its manifest recorded: the file changed"
    return None


def remove_directories(root: Path, directories: Iterable[Path]) -> list[Path]:
    """Delete ``directories`` (checkpoints of ``root`` no longer kept) and make their removal durable.

    Returns:
        The directories deleted.
    """
    deleted = []
    for directory in directories:
        shutil.rmtree(directory, ignore_errors=True)
        deleted.append(directory)
    if deleted:
        with contextlib.suppress(OSError):
            fsync_dir(root)
    return deleted
