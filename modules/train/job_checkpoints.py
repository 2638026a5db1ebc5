"""A training job's checkpoints: one directory per step, published whole, the newest complete one resumed.

Layout of ``--checkpoint DIR``::

    DIR/
      step-000000400/           everything the job needs to go on after step 400
        MANIFEST.json           written last: format, step, world, lineage, every other file with its size and sha256
        trainer.pt              dense model and optimizer, local tables and their optimizer state, RNG states, step
        plan.json               the placement every table ran with
        model.yaml              the model as the run read its data (the columns, their measured statistics): what
                                persia predict scores new rows with
        ps/                     the parameter servers' tables (:mod:`persia_planner.modules.ps.table_checkpoints`'s
        layout, one committed version)
      .step-000000600.tmp-1a2b  a checkpoint being written: renamed to step-000000600 once its manifest is in it

A ``step-*`` directory exists only once it is complete (the rename is atomic), so a crash at any point leaves the
older checkpoints as they were. A file damaged later (a truncated copy, a disk error) is found by the manifest's
sizes and checksums; :func:`newest_complete` then falls back to the next older checkpoint and says why.

Lineage: a run from scratch starts a new lineage, a resumed run continues the lineage it resumed. :func:`prune`
keeps the ``keep`` newest checkpoints of the current lineage and deletes its others (older ones, and those newer than
the run's own newest, left by the timeline a resume abandoned); the checkpoints of another lineage only when the run
replaces them (``--overwrite``). A folder belongs to one run at a time (:mod:`.run_lock`), and a checkpoint is
deleted file by file, as its manifest lists them: a file someone put into it is left where it is.

Torch-free: the launcher checks a checkpoint before any process starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from persia_planner.errors import PlannerError
from persia_planner.modules.atomic import atomic_json, fsync_dir
from persia_planner.modules.manifests import file_problem, file_record, remove_directories
from persia_planner.modules.train.best_checkpoint import read_best
from persia_planner.outputs import CHECKPOINT_FORMAT, MANIFEST

__all__ = [
    "MANIFEST",
    "MODEL_FILE",
    "PLAN_FILE",
    "PS_DIR",
    "TRAINER_STATE",
    "Checkpoint",
    "complete_checkpoints",
    "new_lineage",
    "newest_complete",
    "prune",
    "publish",
    "remove_checkpoint",
    "staging_dir",
    "verify",
    "written_by_run",
]

MODEL_FILE = "model.yaml"
PLAN_FILE = "plan.json"
"""The placement every table ran with."""
PS_DIR = "ps"
"""The parameter servers' tables (:mod:`persia_planner.modules.ps.table_checkpoints`)."""
TRAINER_STATE = "trainer.pt"
"""The trainers' state (:mod:`persia_planner.modules.train.trainer_state`)."""
_STEP_RE = re.compile(r"^step-(\d{9,})$")
_STAGING_RE = re.compile(r"^\.step-(\d{9,})\.tmp-[0-9a-f]+$")


@dataclass(frozen=True)
class Checkpoint:
    """One published checkpoint directory and what its manifest says.

    Attributes:
        path: The ``step-*`` directory.
        step: Global steps trained when it was taken.
        lineage: The run (and the runs resumed from it) that wrote it.
        world: ``{"trainers": T, "servers": S}`` of the job that wrote it.
        run_id: The torchrun run (``TORCHELASTIC_RUN_ID``) that wrote it; None outside torchrun.
    """

    path: Path
    step: int
    lineage: str
    world: dict[str, int]
    run_id: str | None = None


def new_lineage() -> str:
    """A fresh lineage id, for a run from scratch."""
    return uuid.uuid4().hex[:16]


def staging_dir(root: str | os.PathLike[str], step: int) -> Path:
    """A new, empty directory in ``root`` to write the checkpoint of ``step`` into before :func:`publish`."""
    path = Path(root) / f".step-{step:09d}.tmp-{uuid.uuid4().hex[:8]}"
    path.mkdir(parents=True)
    return path


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)


def publish(staging: Path, *, step: int, lineage: str, world: dict[str, int], run_id: str | None = None) -> Checkpoint:
    """Write the manifest of ``staging`` (every file with its size and sha256), then rename it to ``step-NNNNNNNNN``.

    A checkpoint of the same step already there (a run that went back to an older checkpoint) is replaced: moved
    aside first, deleted once the new one is in place.
    """
    files = {p.relative_to(staging).as_posix(): file_record(p) for p in _files(staging)}
    manifest = {"format": CHECKPOINT_FORMAT, "step": step, "lineage": lineage, "world": dict(world), "files": files}
    if run_id is not None:
        manifest["run_id"] = run_id
    atomic_json(manifest, staging / MANIFEST)
    root = staging.parent
    final = root / f"step-{step:09d}"
    old = None
    if final.exists():
        old = root / f".step-{step:09d}.old-{uuid.uuid4().hex[:8]}"  # not a staging name: it is deleted file by file
        os.replace(final, old)
    os.replace(staging, final)
    fsync_dir(root)
    if old is not None:
        remove_checkpoint(old)
    return Checkpoint(final, step, lineage, dict(world), run_id)


def remove_checkpoint(path: Path) -> bool:
    """Delete the checkpoint at ``path`` as its manifest lists it: first renamed aside (so that no half-deleted
    checkpoint keeps a checkpoint's name), then its files, the manifest, and the folders they leave empty. Anything
    else in it (a file someone put there) is kept, and so is the folder holding it. A name the manifest gives that
    leads out of the folder (absolute, ``..``, through a link) is never followed.

    Returns:
        Whether the folder is gone.
    """
    try:
        manifest = json.loads((path / MANIFEST).read_bytes())
        names = list(manifest["files"]) if isinstance(manifest, dict) and isinstance(manifest["files"], dict) else []
    except (OSError, ValueError, KeyError, TypeError):
        return False  # not a checkpoint whose files are known: nothing in it is deleted
    if _STEP_RE.match(path.name):
        aside = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(path, aside)
        path = aside
    base = os.path.realpath(path) + os.sep
    for name in names:
        file = path / name
        inside = not Path(name).is_absolute() and os.path.realpath(file).startswith(base)
        if inside and not file.is_symlink() and file.is_file():
            file.unlink(missing_ok=True)
    (path / MANIFEST).unlink(missing_ok=True)
    for folder in sorted((p for p in path.rglob("*") if p.is_dir() and not p.is_symlink()), reverse=True):
        with contextlib.suppress(OSError):
            folder.rmdir()  # only if empty
    with contextlib.suppress(OSError):
        path.rmdir()
    return not path.exists()


def _read_manifest(path: Path) -> dict[str, Any]:
    file = path / MANIFEST
    try:
        manifest = json.loads(file.read_bytes())
    except FileNotFoundError:
        raise PlannerError(f"{file} is missing: the checkpoint is incomplete") from None
    except (OSError, ValueError) as err:
        raise PlannerError(f"{file} is not readable ({type(err).__name__}: {str(err)[:200]})") from None
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != CHECKPOINT_FORMAT
        or not isinstance(manifest.get("files"), dict)
    ):
        raise PlannerError(f"{file} is not a manifest of {CHECKPOINT_FORMAT}")
    step = manifest.get("step")
    if not isinstance(step, int) or _STEP_RE.match(path.name) is None or int(path.name[5:]) != step:
        raise PlannerError(f"{file} names step {step!r}, its directory is {path.name}")
    return manifest


def verify(path: str | os.PathLike[str], *, checksums: bool = True) -> Checkpoint:
    """The checkpoint at ``path`` after checking that every file its manifest names is there, whole and unchanged.

    Raises:
        PlannerError: One line naming the file that is missing, truncated or changed, or the manifest's problem.
    """
    path = Path(path)
    manifest = _read_manifest(path)
    for name, entry in sorted(manifest["files"].items()):
        problem = file_problem(path / name, entry if isinstance(entry, dict) else {}, checksums=checksums)
        if problem is not None:
            raise PlannerError(f"{path / name}: {problem}")
    world = manifest.get("world") if isinstance(manifest.get("world"), dict) else {}
    run_id = manifest.get("run_id")
    return Checkpoint(
        path, int(manifest["step"]), str(manifest.get("lineage", "")), dict(world), str(run_id) if run_id else None
    )


def complete_checkpoints(root: str | os.PathLike[str]) -> list[Path]:
    """The ``step-*`` directories of ``root``, newest first (not verified)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_RE.match(p.name) and p.is_dir()]
    return sorted(found, key=lambda p: int(p.name[5:]), reverse=True)


def newest_complete(
    root: str | os.PathLike[str],
    *,
    on_skip: Callable[[str], None] | None = None,
    checksums: bool = True,
    option: str = "--resume",
) -> Checkpoint:
    """The newest checkpoint of ``root`` that :func:`verify` accepts; each newer one that it refuses is reported to
    ``on_skip`` as one line, and skipped. ``option``: the command-line option the errors name.

    Raises:
        PlannerError: No checkpoint in ``root``, or none that is whole (the newest one's problem is named).
    """
    root = Path(root)
    candidates = complete_checkpoints(root)
    if not candidates:
        legacy = root / TRAINER_STATE
        if legacy.is_file():
            raise PlannerError(
                f"{option}: {root} holds a checkpoint of an earlier version of persia train (trainer.pt at the top)",
                fixes=("train from scratch into another directory",),
            )
        raise PlannerError(
            f"{option}: no checkpoint in {root} (no step-* directory)",
            fixes=("train once with --checkpoint DIR first",),
        )
    first: PlannerError | None = None
    for path in candidates:
        try:
            return verify(path, checksums=checksums)
        except PlannerError as err:
            first = first or err
            if on_skip is not None:
                on_skip(f"skipping checkpoint {path.name}: {err.message}")
    assert first is not None
    raise PlannerError(
        f"{option}: no whole checkpoint in {root}; the newest: {first.message}",
        fixes=("train from scratch without --resume" if option == "--resume" else "point it at another checkpoint",),
    )


def written_by_run(root: str | os.PathLike[str], run_id: str) -> bool:
    """Whether the newest checkpoint of ``root`` was written by the torchrun run ``run_id`` (not checked whole)."""
    found = complete_checkpoints(root)
    try:
        return bool(found) and json.loads((found[0] / MANIFEST).read_bytes()).get("run_id") == run_id
    except (OSError, ValueError, AttributeError):
        return False


def prune(root: str | os.PathLike[str], newest: Checkpoint, keep: int, *, replacing: bool = False) -> list[Path]:
    """After ``newest`` was published: keep it and the ``keep - 1`` next older checkpoints of its lineage, delete
    its others (and, ``replacing``: those of every other lineage, the runs ``--overwrite`` replaces) and any staging
    directory left by a crash. The best evaluation's checkpoint of the lineage (:mod:`.best_checkpoint`) is kept
    too. The caller holds the folder (:mod:`.run_lock`). Returns what was deleted.

    Raises:
        ValueError: ``keep < 1``.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    root = Path(root)
    kept: list[Path] = []
    dropped: list[Path] = []
    best = read_best(root)
    for path in complete_checkpoints(root):
        step = int(path.name[5:])
        try:
            lineage = json.loads((path / MANIFEST).read_bytes()).get("lineage")
        except (OSError, ValueError, AttributeError):
            lineage = None
        if lineage == newest.lineage and step <= newest.step and len(kept) < keep:
            kept.append(path)
        elif best is not None and lineage == best.lineage == newest.lineage and path.name == best.checkpoint:
            continue
        elif lineage == newest.lineage or replacing:
            dropped.append(path)
    deleted = [path for path in dropped if remove_checkpoint(path)]
    # Only trainer 0 writes checkpoints, in the folder its run holds, and it is done with its own staging directory:
    # one left here was a crashed attempt's of this folder's runs, all of whose files are persia's.
    deleted += remove_directories(root, [path for path in root.iterdir() if _STAGING_RE.match(path.name)])
    if deleted:
        fsync_dir(root)
    return deleted
