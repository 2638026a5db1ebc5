"""One log file per process of a job under ``--log-dir``: ``ps0.log``, ``trainer0.log``, ... and ``launcher.log``.

A worker of the local launcher calls :func:`log_to_file` first thing: its file descriptors 1 and 2 are pointed at
``DIR/<name>.log`` (appended to), so everything the process writes lands there: Python's logging (INFO and up),
``print``, warnings, and what C++ (torch, gloo, TensorPipe) writes to stderr, even just before a crash. The terminal
keeps what it showed before: records at the job's log level and above are also written to the terminal, and the
progress bar draws there (:func:`terminal`). A worker's failure reaches the terminal as before, as the launcher's
one line. Under torchrun, where each process prints its own result and error, :func:`process_log` sends the output
to the file for the job's length only.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

__all__ = [
    "LAUNCHER_LOG",
    "LOG_FORMAT",
    "launcher_log",
    "log_failure",
    "log_file",
    "log_to_file",
    "process_log",
    "terminal",
]

log = logging.getLogger(__name__)

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LAUNCHER_LOG = "launcher"

_terminal: TextIO | None = None  # this process's stderr as it was before log_to_file redirected it
_saved_stdout: int | None = None  # a copy of fd 1 from before, for process_log to put back


def log_file(log_dir: str | os.PathLike[str], name: str) -> Path:
    """The log file of process ``name`` (``ps0``, ``trainer1``, ``launcher``)."""
    return Path(log_dir) / f"{name}.log"


def terminal() -> TextIO:
    """Where this process's terminal output goes: its stderr before :func:`log_to_file`, else ``sys.stderr``."""
    return _terminal or sys.stderr


def _header(name: str) -> str:
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    return f"==== {name} (pid {os.getpid()}) started {now} ====\n"


def log_to_file(log_dir: str | os.PathLike[str] | None, name: str, level: int = logging.WARNING) -> Path | None:
    """Send this process's output to ``DIR/<name>.log`` and set up its logging; without a log dir, only logging.

    Call it once, at the start of a worker process: it replaces the process's fds 1 and 2 and the root logger's
    handlers.

    Args:
        log_dir: The job's log directory (created if missing); None: log to stderr at ``level``, as before.
        name: The process's name in the job (``ps0``, ``trainer1``).
        level: What also reaches the terminal (the file gets INFO and up).

    Returns:
        The log file, or None without a log dir.
    """
    global _terminal, _saved_stdout
    if log_dir is None:
        logging.basicConfig(level=level, format=LOG_FORMAT)
        return None
    path = log_file(log_dir, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    if _terminal is None:
        _terminal = os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8", errors="replace")
        _saved_stdout = os.dup(1)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, _header(name).encode())
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    finally:
        os.close(fd)
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    into_file = logging.StreamHandler(sys.stderr)  # fd 2: the file, beside C++'s own lines in the order written
    into_file.setLevel(logging.INFO)
    to_terminal = logging.StreamHandler(_terminal)
    to_terminal.setLevel(level)
    for handler in (into_file, to_terminal):
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        root.addHandler(handler)
    root.setLevel(min(level, logging.INFO))
    logging.captureWarnings(True)
    return path


def _restore(level: int) -> None:
    """Undo :func:`log_to_file`: fds 1 and 2 and the logging as they were."""
    global _terminal, _saved_stdout
    if _terminal is None or _saved_stdout is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(_saved_stdout, 1)
    os.dup2(_terminal.fileno(), 2)
    os.close(_saved_stdout)
    _terminal.close()
    _terminal = _saved_stdout = None
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    logging.basicConfig(level=level, format=LOG_FORMAT, force=True)


@contextlib.contextmanager
def process_log(log_dir: str | os.PathLike[str] | None, name: str, level: int = logging.WARNING) -> Iterator[None]:
    """:func:`log_to_file` for the block only (a torchrun process, which prints its result and its error itself
    after the job); a failure's traceback goes into the file first. Without a log dir, nothing changes."""
    if log_dir is None:
        yield
        return
    log_to_file(log_dir, name, level)
    try:
        yield
    except BaseException:
        log.info("%s failed", name, exc_info=True)  # the file only: the process's own error line follows
        raise
    finally:
        _restore(level)


def launcher_log(log_dir: str | os.PathLike[str], job: str) -> logging.Handler:
    """Add ``DIR/launcher.log`` to the launching process's logging (its terminal output is left as it is), starting
    with the line ``job`` (what was asked); remove the handler it returns when the job ends."""
    path = log_file(log_dir, LAUNCHER_LOG)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(_header(LAUNCHER_LOG) + job.rstrip() + "\n")
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logging.getLogger().addHandler(handler)
    return handler


def log_failure(handler: logging.Handler, err: BaseException) -> None:
    """Write the job's failure into one log file only (the terminal shows it once, as the CLI's one line), with the
    failed worker's traceback where the error carries one (``detail``)."""
    detail = getattr(err, "detail", "")
    message = f"{type(err).__name__}: {err}" + (f"\n{detail.rstrip()}" if detail else "")
    handler.handle(
        logging.makeLogRecord({"name": __name__, "levelno": logging.ERROR, "levelname": "ERROR", "msg": message})
    )
