"""One log file per process of a job under ``--log-dir``: ``ps0.log``, ``trainer0.log``, ... and ``launcher.log``.

A worker calls :func:`log_to_file` first thing: its file descriptors 1 and 2 are pointed at ``DIR/<name>.log``
(appended to), so everything the process writes lands there: Python's logging (INFO and up), ``print``, warnings,
and what C++ (torch, gloo, TensorPipe) writes to stderr, even just before a crash. The terminal keeps what it showed
before: records at the job's log level and above are also written to the terminal, and the progress bar draws there
(:func:`terminal`). A worker's failure reaches the terminal as before, as the launcher's one line.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
from pathlib import Path
from typing import TextIO

__all__ = ["LAUNCHER_LOG", "LOG_FORMAT", "launcher_log", "log_failure", "log_file", "log_to_file", "terminal"]

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LAUNCHER_LOG = "launcher"

_terminal: TextIO | None = None  # this process's stderr as it was before log_to_file redirected it


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
    global _terminal
    if log_dir is None:
        logging.basicConfig(level=level, format=LOG_FORMAT)
        return None
    path = log_file(log_dir, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    if _terminal is None:
        _terminal = os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8", errors="replace")
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
