"""How the local cluster's processes live and end: workers that die with their launcher, and a launcher that stops
its workers on SIGINT or SIGTERM (:func:`.launch.local_cluster` uses both)."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing.forkserver as mp_forkserver
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any, NoReturn

__all__ = [
    "PR_SET_PDEATHSIG",
    "Stop",
    "StopOnSignals",
    "adopt_environment",
    "die_with_the_launcher",
    "end_torchrun_worker",
    "exit_now",
    "name_process",
    "quiet_cpp_logs",
    "set_death_signal",
    "stop_processes",
]

log = logging.getLogger(__name__)


def exit_now(code: int = 0) -> NoReturn:
    """End this worker process at once, skipping interpreter finalization; call it last, with everything written.

    torch 2.13's gloo worker threads free a finished collective's work object after the caller already returned from
    it, and that object can hold a Python object (its captured thread-local state, e.g. under TorchRec's DMP). If the
    interpreter is finalizing at that moment, the thread dies in ``pthread_exit`` inside a destructor and the process
    aborts (SIGABRT, about 1 run in 14 of a 2-rank DMP job that returns right after a barrier). ``mp.spawn`` children
    finalize on return, so such workers end with this instead. It also skips the flush of ``multiprocessing.Queue``
    feeder threads: workers that report through a queue must ``close()`` and ``join_thread()`` it first.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def end_torchrun_worker() -> None:
    """End this process with :func:`exit_now` if torchrun started it (a command's last call, everything written);
    elsewhere return.

    A torchrun worker ends right after its last gloo collective: finalizing the interpreter then can abort it
    (SIGABRT, see :func:`exit_now`), which torchrun reports as a failed job and every other node as a lost peer.
    """
    if "TORCHELASTIC_RUN_ID" in os.environ:
        exit_now(0)


def adopt_environment(environ: dict[str, str]) -> None:
    """Take the launching process's environment as it was at the start (a forked child has the fork server's)."""
    os.environ.clear()
    os.environ.update(environ)


def quiet_cpp_logs() -> dict[str, str]:
    """The environment that keeps the workers' C++ warnings off the terminal: ``TORCH_CPP_LOG_LEVEL=ERROR``, unless
    the user set that variable or ``PERSIA_DEBUG`` (then nothing changes).

    Why: when a worker dies, every survivor's TensorPipe agent logs a warning per broken connection and per request in
    flight (15 to 79 lines of ``tensorpipe_agent.cpp ... EOF`` for one killed server) before the launcher can name
    the lost process in one line. Torch reads the level when it is imported, so it must be in the environment the
    fork server starts with (:func:`.launch.local_cluster` restarts it when the level changes).
    """
    if "TORCH_CPP_LOG_LEVEL" in os.environ or os.environ.get("PERSIA_DEBUG"):
        return {}
    return {"TORCH_CPP_LOG_LEVEL": "ERROR"}


# linux/prctl.h
PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15


def name_process(name: str) -> None:
    """Show this worker as ``name`` (``ps0``, ``trainer1``) in ``ps``, ``top`` and ``/proc/PID/comm`` (Linux; at
    most 15 bytes kept), so that a user can tell the job's processes apart, and signal the right one."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


def set_death_signal() -> bool:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux ``PR_SET_PDEATHSIG``); False if refused."""
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0


def die_with_the_launcher() -> None:
    """Make this worker die (SIGKILL) when the launching process dies, however it dies; call it first in a worker.

    A worker is a child of the fork server, which ends once the launcher's end of its "alive" pipe closes, that is
    when the launcher dies. So the worker asks the kernel for SIGKILL when its parent dies (``PR_SET_PDEATHSIG``:
    nothing of the worker needs to run, unlike a watchdog thread), and closes its own copy of that pipe's write
    end: the fork server hands one to every child (for a child's own fork-server children, which ours never start),
    and while any worker held it the fork server outlived the launcher, with the workers running unwatched.
    """
    # Ctrl-C in a terminal reaches every process of the foreground group: the launcher stops the workers itself,
    # without a traceback from each.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    if not set_death_signal():
        log.warning(
            "prctl(PR_SET_PDEATHSIG) failed (errno %d): this worker may outlive its launcher", ctypes.get_errno()
        )
    elif os.getppid() != parent:  # the fork server died before the request took effect: nobody would send it
        os._exit(1)
    server = getattr(mp_forkserver, "_forkserver", None)
    alive_fd = getattr(server, "_forkserver_alive_fd", None)
    if alive_fd is not None:
        with contextlib.suppress(OSError):
            os.close(alive_fd)
        server._forkserver_alive_fd = None  # this process starts a fork server of its own if it ever needs one


class Stop(BaseException):
    """SIGINT or SIGTERM reached the launcher (a BaseException: no ``except Exception`` on the way may take it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class StopOnSignals:
    """While installed, the first SIGINT or SIGTERM raises :class:`Stop` in the main thread, at once or, inside
    :meth:`held`, when that block ends; later ones are ignored while the workers are being stopped (that is bounded).
    Outside the main thread Python cannot take signals, and nothing changes.

    Args:
        defer_first: The first signal is only recorded (:attr:`received`: the launcher asks the workers to stop by
            themselves); the second one raises.
    """

    def __init__(self, defer_first: bool = False) -> None:
        self.received: int | None = None
        self.holding = False
        self.defer_first = defer_first
        self.count = 0
        self.stopping = False  # Stop was raised: the workers are being stopped

    def _due(self) -> bool:
        return self.count > (1 if self.defer_first else 0)

    def stop(self, signum: int) -> Stop:
        """The :class:`Stop` to raise (by the signal handler, or by the launcher that gives up waiting)."""
        self.stopping = True
        return Stop(signum)

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.stopping:
            return
        self.count += 1
        self.received = self.received or signum
        if self._due() and not self.holding:
            raise self.stop(self.received)

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopOnSignals]:
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """A signal in the block stops the job once the block is done. Starting a process is one: interrupted while
        it sends the process its work, the launcher would not know its pid (and not stop it), and the process would
        print a traceback about the truncated message."""
        self.holding = True
        try:
            yield
        finally:
            self.holding = False
        if self._due() and not self.stopping and self.received is not None:
            raise self.stop(self.received)


def stop_processes(procs: list[Any], grace_s: float) -> int:
    """Stop the live ones of ``procs``: SIGTERM, then SIGKILL for any left after ``grace_s`` (0: SIGKILL at once);
    returns how many were alive."""
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        if grace_s > 0:
            p.terminate()
        else:
            p.kill()
    deadline = time.monotonic() + grace_s
    for p in alive:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in alive:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join()
    return len(alive)
