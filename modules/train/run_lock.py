"""A training run's hold on its folders: a ``--checkpoint`` or ``--log-dir`` folder belongs to one run at a time.

The run keeps :data:`~persia_planner.outputs.RUN_MARKER` in each of its folders and holds an exclusive ``flock`` on it
for its life; the marker says who holds it (pid, host, start, torchrun run id). A second run, or a ``--resume`` of a
checkpoint another run is writing, is refused in one line naming the holder before anything starts
(:func:`refuse_held`); the lock goes with the process that held it, however it ends, so a killed run never leaves its
folder locked. The marker stays after the run: it says the folder is a run's (no other command writes inside it,
:mod:`persia_planner.outputs`).

Torch-free: the launcher checks and takes the folders before any process starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import fcntl
import json
import os
import socket
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from persia_planner.errors import PlannerError, clip
from persia_planner.outputs import RUN_MARKER

__all__ = ["RUN_FORMAT", "RunHolder", "hold_run_folders", "refuse_held", "this_run"]

RUN_FORMAT = "persia-run/1"
_MAX_MARKER_BYTES = 4096


@dataclass(frozen=True)
class RunHolder:
    """Who holds a run folder, as its marker says.

    Attributes:
        pid: The holding process.
        host: Its host name.
        started: When it took the folder (UTC, ISO 8601).
        run_id: Its torchrun run (:func:`this_run`); None outside torchrun.
    """

    pid: int | None
    host: str
    started: str
    run_id: str | None

    @classmethod
    def of_this_process(cls) -> RunHolder:
        now = datetime.datetime.now(datetime.UTC).replace(microsecond=0).isoformat()
        return cls(os.getpid(), socket.gethostname(), now, this_run())

    def describe(self) -> str:
        """``pid 123 on host h since 2026-12-06T16:07:25+00:00`` (what is known of it)."""
        parts = [f"pid {self.pid}" if self.pid is not None else "a process", f"on host {clip(self.host, 60)}"]
        if self.started:
            parts.append(f"since {clip(self.started, 40)}")
        return " ".join(parts)


def this_run() -> str | None:
    """This process's torchrun run, as the processes of one job alone share it: ``TORCHELASTIC_RUN_ID`` (a fixed
    ``--rdzv-id``, or torch's default ``none``, may name another job too) at the job's store,
    ``MASTER_ADDR:MASTER_PORT``, which one live job at a time serves. None outside torchrun."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if not run_id:
        return None
    return f"{run_id}@{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"


# How long another process of a torchrun run waits for the first trainer, which holds the folder, to name the run in
# its marker (it takes the lock, then writes): an instant, but not none.
_SAME_RUN_WAIT_S = 2.0


def _read_holder(fd: int) -> RunHolder | None:
    """The marker's holder; None for an empty marker (its run crashed before writing it) or one that is not ours."""
    raw = os.pread(fd, _MAX_MARKER_BYTES, 0)
    if not raw.strip():
        return RunHolder(None, "?", "", None)
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(data, dict) or data.get("format") != RUN_FORMAT:
        return None
    pid = data.get("pid")
    run_id = data.get("run_id")
    return RunHolder(
        pid if isinstance(pid, int) else None,
        str(data.get("host", "?")),
        str(data.get("started", "")),
        str(run_id) if run_id else None,
    )


def _open_marker(option: str, folder: Path, *, create: bool) -> int | None:
    """The marker of ``folder`` opened for locking (None: there is none and ``create`` is False).

    Raises:
        PlannerError: The marker's name holds something persia did not write (a link, a folder, another file).
    """
    marker = folder / RUN_MARKER
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    try:
        fd = os.open(marker, flags, 0o644)
    except FileNotFoundError:
        return None
    except OSError as err:  # ELOOP: a symbolic link; EISDIR: a folder
        raise _not_ours(option, folder, err.strerror or str(err)) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode) or _read_holder(fd) is None:
        os.close(fd)
        raise _not_ours(option, folder, "not a marker of persia train")
    return fd


def _not_ours(option: str, folder: Path, why: str) -> PlannerError:
    return PlannerError(
        f"{option} {folder} holds {RUN_MARKER}, which persia did not write ({why}): it is kept as it is",
        fixes=("pass another folder",),
    )


def _held_by_other(option: str, folder: Path, fd: int) -> PlannerError:
    holder = _read_holder(fd) or RunHolder(None, "?", "", None)
    what = "checkpoint" if option == "--checkpoint" else "logs"
    return PlannerError(
        f"{option} {folder} is in use by another persia train run ({holder.describe()}): its {what} would be mixed "
        "with this run's",
        fixes=("wait for that run to end", "pass another folder"),
    )


def refuse_held(option: str, folder: str | os.PathLike[str]) -> None:
    """Refuse ``folder`` while a run other than this torchrun run holds it (a probe: nothing is taken or created).

    Raises:
        PlannerError: Another run holds it (one line naming its pid, host and start), or its marker is not ours.
    """
    path = Path(folder)
    if not path.is_dir():
        return
    fd = _open_marker(option, path, create=False)
    if fd is None:
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            ours = this_run()
            deadline = time.monotonic() + (_SAME_RUN_WAIT_S if ours is not None else 0.0)
            while True:
                holder = _read_holder(fd)
                if holder is not None and ours is not None and holder.run_id == ours:
                    return  # this torchrun run's first trainer, which took it: the folder is this run's
                if time.monotonic() >= deadline:
                    raise _held_by_other(option, path, fd) from None
                time.sleep(0.05)
    finally:
        os.close(fd)  # releases the probe's shared lock


@contextlib.contextmanager
def hold_run_folders(folders: dict[str, str | os.PathLike[str] | None]) -> Iterator[None]:
    """Hold each folder (by its option: ``{"--checkpoint": DIR, "--log-dir": DIR}``) for the body's life.

    Raises:
        PlannerError: Another run holds one of them (nothing is taken then), or its marker is not ours.
    """
    held: list[int] = []
    seen: set[str] = set()
    try:
        for option, folder in folders.items():
            if folder is None or os.path.realpath(folder) in seen:
                continue
            seen.add(os.path.realpath(folder))
            path = Path(folder)
            path.mkdir(parents=True, exist_ok=True)
            fd = _open_marker(option, path, create=True)
            assert fd is not None
            held.append(fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise _held_by_other(option, path, fd) from None
            holder = RunHolder.of_this_process()
            record = {"format": RUN_FORMAT, "role": option, **dataclasses.asdict(holder)}
            text = json.dumps(record, sort_keys=True).encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, text + b"\n", 0)
        yield
    finally:
        for fd in held:
            os.close(fd)
