"""The run's directories (``--checkpoint``, ``--log-dir``) checked before any process starts; torch-free, like
:mod:`persia_planner.modules.train.config`, which runs these checks."""

from __future__ import annotations

import errno
import importlib.util
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from persia_planner.errors import PlannerError
from persia_planner.modules.train.run_lock import refuse_held
from persia_planner.outputs import RUN_MARKER, check_run_folder, in_passing, unwritable

if TYPE_CHECKING:  # pragma: no cover
    from persia_planner.modules.train.config import TrainConfig

__all__ = [
    "METRICS_FILE",
    "SUMMARY_FILE",
    "check_checkpoint_dir",
    "check_log_dir",
    "check_resume_exists",
    "run_folders",
    "run_inputs",
]


def run_folders(cfg: TrainConfig) -> dict[str, str | None]:
    """The folders the run writes, by option: what it holds while it runs (:mod:`.run_lock`)."""
    return {"--checkpoint": cfg.checkpoint, "--log-dir": cfg.log_dir}


def run_inputs(cfg: TrainConfig) -> dict[str, list[Path]]:
    """The run's input files and folders a run folder must stay out of (``--data``'s and ``--eval-data``'s)."""
    found: dict[str, list[Path]] = {}
    for option, data in (("--data", cfg.data), ("--eval-data", cfg.eval_data)):
        kind, sep, path = (data or "").partition(":")
        if sep and path and kind != "synthetic":
            found[option] = [Path(path)]
    return found


def _check_run_folder(cfg: TrainConfig, option: str, path: Path) -> None:
    """``path`` is no input, lies in no checkpoint nor another run's folder, and no other run holds it now."""
    own = [Path(p) for p in (cfg.checkpoint, cfg.log_dir) if p]
    check_run_folder(option, path, run_inputs(cfg), own=own)
    refuse_held(option, path)


def check_checkpoint_dir(cfg: TrainConfig) -> None:
    """``--checkpoint`` must be a writable directory or a path one can become (it is created here), that no input
    is, outside any other run's folders and held by no other run: found out before training, not at its end."""
    if not cfg.checkpoint:
        return
    path = Path(cfg.checkpoint)
    _check_not_under_a_file("--checkpoint", path)
    _check_run_folder(cfg, "--checkpoint", path)
    # A run from scratch replaces what the directory holds at its first save: never silently.
    # Another trainer of the run (torchrun, a shared file system) may be probing the folder at this moment.
    if not (cfg.resume or cfg.overwrite) and path.is_dir() and any(not in_passing(p.name) for p in path.iterdir()):
        raise PlannerError(
            f"--checkpoint {path} is not empty; training from scratch would replace what it holds",
            fixes=("add --resume to continue its checkpoint", "add --overwrite to replace it", "pass another dir"),
        )
    _check_writable("--checkpoint", path)


METRICS_FILE = "metrics.jsonl"
"""The per-step metrics in ``--log-dir`` (:mod:`.metrics_log` writes them)."""
SUMMARY_FILE = "summary.json"
"""The run's summary in ``--log-dir``, replaced at its end."""


def _check_log_files_are_ours(path: Path) -> None:
    """A folder no persia run holds (no marker) must not hold a file the run replaces by name that persia did not
    write: ``summary.json``, or a ``metrics.jsonl`` whose first line is no step of ours (a run of an earlier version,
    which left no marker, wrote steps). The process logs are only ever appended to."""
    if not path.is_dir() or (path / RUN_MARKER).exists() or _steps_of_ours(path / METRICS_FILE):
        return
    for name in (SUMMARY_FILE, METRICS_FILE):
        if (path / name).exists():
            raise PlannerError(
                f"--log-dir {path} holds {name}, which persia train did not write: the run would replace it",
                fixes=("pass a new or empty folder",),
            )


def _steps_of_ours(metrics: Path) -> bool:
    """Whether ``metrics`` starts with a step record as :mod:`.metrics_log` writes them."""
    try:
        with open(metrics, "rb") as f:
            first = json.loads(f.readline(1 << 16) or b"null")
    except (OSError, ValueError):
        return False
    return isinstance(first, dict) and isinstance(first.get("step"), int) and "loss" in first


def check_log_dir(cfg: TrainConfig) -> None:
    """``--log-dir`` must be a writable directory or a path one can become (it is created here); a run from scratch
    does not mix its metrics into an earlier run's (``--resume`` appends, ``--overwrite`` replaces them); and the
    TensorBoard writer must be installed (found, not imported: it imports torch)."""
    if not cfg.log_dir:
        return
    if importlib.util.find_spec("tensorboard") is None:
        raise PlannerError(
            "--log-dir writes TensorBoard event files: the tensorboard package is not installed",
            fixes=("pip install tensorboard", "leave out --log-dir"),
        )
    path = Path(cfg.log_dir)
    _check_not_under_a_file("--log-dir", path)
    _check_run_folder(cfg, "--log-dir", path)
    _check_log_files_are_ours(path)
    metrics = path / METRICS_FILE
    if not (cfg.resume or cfg.overwrite) and metrics.is_file() and metrics.stat().st_size > 0:
        raise PlannerError(
            f"--log-dir {path} holds the metrics of an earlier run ({METRICS_FILE})",
            fixes=("add --resume to continue them", "add --overwrite to replace them", "pass another dir"),
        )
    _check_writable("--log-dir", path)


def _check_not_under_a_file(option: str, path: Path) -> None:
    for p in (path, *path.parents):
        # A symbolic link that leads back to itself (directly or through others) neither exists nor can be made: say
        # so, rather than mkdir's "File exists".
        if p.is_symlink() and not p.exists() and _loops(p):
            raise PlannerError(
                f"{option} {path}: {p} is a symbolic link that loops back to itself",
                fixes=("point the link at a directory, or pass another path",),
            )
    blocker = next((p for p in (path, *path.parents) if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        raise PlannerError(
            f"{option} {path}: {blocker} is a file, not a directory",
            fixes=("pass a directory (it is created if missing)",),
        )


def _loops(link: Path) -> bool:
    """Whether following ``link`` comes back to a link on the way (Python says "Symlink loop", the OS ELOOP)."""
    try:
        link.resolve(strict=True)
    except RuntimeError:
        return True
    except OSError as err:
        return err.errno == errno.ELOOP
    return False


def _check_writable(option: str, path: Path) -> None:
    # Created now and probed, rather than train for hours and fail at the save.
    try:
        path.mkdir(parents=True, exist_ok=True)
        problem = unwritable(path)
    except OSError as err:
        problem = err.strerror or str(err)
    if problem is not None:
        raise PlannerError(f"{option} {path}: cannot write there ({problem})", fixes=("pass a writable directory",))


def check_resume_exists(directory: str | os.PathLike[str]) -> Path:
    """The newest checkpoint directory of ``directory`` (``--resume``), which must hold one whose files are all there
    (sizes, not checksums). :func:`persia_planner.modules.train.trainer_state.check_resume` checks it whole, falling
    back to an older one: it reads the trainer state with torch.

    Raises:
        PlannerError: No checkpoint in ``directory``, or none whose files are all there.
    """
    from persia_planner.modules.train.job_checkpoints import newest_complete

    refuse_held("--checkpoint", directory)  # a checkpoint another run is writing is not resumed, nor half read
    return newest_complete(directory, checksums=False).path
