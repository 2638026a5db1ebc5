"""The processes of one local cluster run (:func:`persia_planner.modules.launcher.launch.local_cluster`): started, their
trainers' reports awaited while the launcher watches for lost workers, hangs and signals, shut down, and the
trainers' values or the failure that caused the others.
"""

from __future__ import annotations

import multiprocessing.connection as mp_connection
import os
import pickle
import queue
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from persia_planner.errors import Interrupted, PlannerError
from persia_planner.modules.launcher.progress import NOT_STARTED, ProgressWatch
from persia_planner.modules.launcher.workers import describe_exit, server_main, trainer_main
from persia_planner.modules.ps.protocol import server_name
from persia_planner.modules.stopping import request_stop

__all__ = ["POLL_S", "LocalJob", "TrainerError", "Waits"]

POLL_S = 1.0
"""How often the launcher looks at its workers (exits, progress) while it waits for the trainers' results."""


class TrainerError(PlannerError):
    """A trainer's ``fn`` raised (or the run failed). The message is one line, the trainer's exception;
    ``detail`` holds its traceback (also appended to the message when ``PERSIA_DEBUG`` is set).

    Attributes:
        detail: The trainer's traceback, if any.
        internal: True when the trainer's exception was not a ``PlannerError`` (a bug, not bad input).
    """

    def __init__(self, message: str, detail: str = "", internal: bool = False, fixes: tuple[str, ...] = ()) -> None:
        self.detail, self.internal = detail, internal
        shown = f"{message}\n{detail}" if detail and os.environ.get("PERSIA_DEBUG") else message
        super().__init__(shown, fixes=fixes)


@dataclass(frozen=True)
class Waits:
    """How long :func:`persia_planner.modules.launcher.launch.local_cluster` waits for what (its arguments of the same
    names)."""

    run_timeout_s: float
    shutdown_timeout_s: float
    failure_grace_s: float
    drain_s: float
    end_on_lost_server: bool


@dataclass
class LocalJob:
    """The processes of one :func:`persia_planner.modules.launcher.launch.local_cluster` run and what their trainers
    reported."""

    servers: list[Any]
    trainers: list[Any]
    results: Any
    # Held for the job's life: a started Process drops its arguments, and a semaphore that nobody holds is unlinked,
    # maybe before the fork server's child opens it ("FileNotFoundError" while it unpickles its arguments).
    barrier: Any
    watch: ProgressWatch
    store: tuple[int, str]  # the job's store: its port on loopback and the trainers' prefix in it
    environ: dict[str, str]
    outcome: dict[int, tuple[bool, Any, float]] = field(default_factory=dict)  # trainer -> (ok, value, when)
    killed: dict[str, str] = field(default_factory=dict)  # name -> how, of the workers killed at the first failure
    given_up: bool = False  # the trainers that had not reported after a failure were left to be killed
    draining: int | None = None  # the signal that asked the trainers to stop together

    @classmethod
    def of(
        cls,
        ctx: Any,
        n_servers: int,
        n_clients: int,
        work: tuple[Callable[..., Any], tuple[Any, ...]],
        store: tuple[int, str],
        environ: dict[str, str],
        client: tuple[Any, ...],
        hang_timeout_s: float,
    ) -> LocalJob:
        """The job's processes, not started: ``n_servers`` servers and ``n_clients`` trainers running ``work``
        (``fn``, ``args``) with ``client`` (the trainers' client settings)."""
        world_size, port = n_servers + n_clients, store[0]
        results = ctx.Queue()
        trainer_barrier = ctx.Barrier(n_clients)
        progress = ctx.RawArray("q", [NOT_STARTED] * n_clients)
        log_settings = client[2]
        servers = [
            ctx.Process(
                target=server_main,
                args=(i, world_size, port, client[1], log_settings, environ, results),
                name=server_name(i),
                daemon=True,
            )
            for i in range(n_servers)
        ]
        trainers = [
            ctx.Process(
                target=trainer_main,
                args=(j, n_servers, world_size, port, client, results, (trainer_barrier, progress), *work, environ),
                name=f"trainer{j}",
                daemon=True,
            )
            for j in range(n_clients)
        ]
        watch = ProgressWatch(progress, hang_timeout_s)
        return cls(servers, trainers, results, trainer_barrier, watch, store, environ)

    @property
    def procs(self) -> list[Any]:
        return self.servers + self.trainers

    def started(self) -> list[Any]:
        return [p for p in self.procs if p.pid is not None]

    def start(self, tuning: dict[str, str], signals: Any, on_start: Callable[[dict[str, int]], None] | None) -> None:
        """Start every process. The children inherit the environment at start: they get the allocator setting that
        keeps request buffers warm (see allocator.allocator_env) and the C++ log level (lifecycle.quiet_cpp_logs),
        without changing this process's environment for longer than the start."""
        before = {name: os.environ.get(name) for name in tuning}
        try:
            os.environ.update(tuning)
            with signals.held():
                for p in self.procs:
                    p.start()  # may raise (e.g. fn or args do not pickle): the ones started are killed after
        finally:
            for name, value in before.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        if on_start is not None:
            on_start({p.name: p.pid for p in self.procs})

    def await_trainers(self, signals: Any, waits: Waits) -> None:
        """Collect every trainer's report, or stop waiting once a failure's grace is over.

        Raises:
            TrainerError: A server failed, a worker was lost, the trainers hung or ran past ``run_timeout_s``.
            Stop: The trainers did not stop in time after a signal asked them to.
        """
        deadline = time.monotonic() + waits.run_timeout_s
        while len(self.outcome) < len(self.trainers):
            if self.draining is None and signals.received is not None and waits.drain_s > 0:
                # Asked to stop: the trainers stop together at a step they agree on, and report as usual.
                self.draining = signals.received
                deadline = time.monotonic() + waits.drain_s
                request_stop("127.0.0.1", *self.store, signal.Signals(self.draining).name)
            failed_at = [t for ok, _value, t in self.outcome.values() if not ok]
            if failed_at and time.monotonic() > min(failed_at) + waits.failure_grace_s:
                self.given_up = True  # the rest are killed after; the failure is raised then
                return
            try:
                who, ok, value = self.results.get(timeout=min(POLL_S, waits.failure_grace_s) if failed_at else POLL_S)
            except queue.Empty:
                if self._nothing_reported(failed_at, deadline, waits, signals):
                    return
                continue
            if isinstance(who, str):  # a server failed (a trainer's failure follows from it)
                if not failed_at:  # after a trainer's failure, it failed because of it: the trainer's is reported
                    self._raise_server_failure(who, value)
                continue
            if not ok and not failed_at:
                others = [p for j, p in enumerate(self.trainers) if j != who] + self.servers
                self.killed = _killed_within(others, POLL_S)
            self.outcome[who] = (ok, value, time.monotonic())

    def _nothing_reported(self, failed_at: list[float], deadline: float, waits: Waits, signals: Any) -> bool:
        """A poll without a report: whether to stop waiting (after a failure, no trainer left that may report).

        A worker that ends before the trainers reported (killed, or failed to join the group) would otherwise leave
        the launcher waiting for the trainers' timeouts, or the whole ``run_timeout_s``. (After a trainer's failure,
        what ends is its consequence: that failure is reported.)
        """
        lost = (
            ""
            if failed_at
            else _lost(self.servers if waits.end_on_lost_server else [], self.trainers, set(self.outcome))
        )
        if failed_at and all(p.exitcode is not None for j, p in enumerate(self.trainers) if j not in self.outcome):
            self.given_up = True  # the grace is for trainers that may still report: none is left
            return True
        if self.draining is not None and not lost and time.monotonic() > deadline:
            raise signals.stop(self.draining) from None  # the trainers did not stop in time
        if lost or time.monotonic() > deadline:
            why = lost or f"the trainers did not finish within {waits.run_timeout_s:g} s"
            raise TrainerError(f"local cluster failed: {why}") from None
        stall = self.watch.check(
            [(p.name, p.pid) for p in self.trainers], [(p.name, p.pid) for p in self.servers], set(self.outcome)
        )
        if stall is not None:
            raise TrainerError(stall.message, fixes=stall.fixes) from None
        return False

    def _raise_server_failure(self, who: str, value: Any) -> None:
        message, tb, internal = value
        # A worker killed meanwhile is what it failed of (the rendezvous or a request reports only a reset
        # connection): name that one.
        killed = _killed_within([p for p in self.procs if p.name != who], POLL_S)
        if killed:
            raise TrainerError(f"local cluster failed: {', '.join(killed.values())}", detail=tb) from None
        raise TrainerError(f"{who} failed: {message}", detail=tb, internal=internal) from None

    def shut_down(self, waits: Waits) -> None:
        """Wait for the graceful shutdown. It needs every worker: once a server died (or the launcher gave up on
        the trainers) it cannot complete, so it is not waited for."""
        server_died = any(p.exitcode not in (None, 0) for p in self.servers)
        grace = time.monotonic() + (0.0 if server_died or self.given_up else waits.shutdown_timeout_s)
        for p in self.procs:
            p.join(max(0.0, grace - time.monotonic()))

    def values(self) -> list[Any]:
        """The trainers' return values, in trainer order.

        Raises:
            TrainerError: A trainer failed (the first cause, or the worker whose loss it reports).
            Interrupted: The trainers stopped together after a signal; its ``results`` are their values.
        """
        failed = [(j, value, t) for j, (ok, value, t) in sorted(self.outcome.items()) if not ok]
        if failed:
            j, (message, tb, internal), _t = _first_cause(failed)
            if self.killed and not any(re.search(rf"\b{name}\b", message) for name in self.killed):
                # The trainer reports losing a peer by its address (gloo): name the lost one instead.
                raise TrainerError(f"local cluster failed: {', '.join(self.killed.values())}", detail=tb)
            raise TrainerError(f"trainer{j} failed: {message}", detail=tb, internal=internal)
        values = [pickle.loads(self.outcome[j][1]) for j in range(len(self.trainers))]
        if self.draining is not None:
            raise Interrupted(
                self.draining,
                f"interrupted ({signal.Signals(self.draining).name}); the trainers stopped together",
                values,
            )
        return values


def _lost(servers: list[Any], trainers: list[Any], reported: set[int]) -> str:
    """The workers that ended while the trainers were still running (``""``: none): a trainer that ended before it
    reported, or any server (servers end only after the trainers are done)."""
    ended = [p for p in servers if p.exitcode is not None]
    ended += [p for j, p in enumerate(trainers) if p.exitcode is not None and j not in reported]
    return ", ".join(describe_exit(p.name, p.exitcode) for p in ended)


def _killed(procs: list[Any]) -> dict[str, str]:
    """The workers a signal killed: name -> how (``ps0 was killed (SIGKILL)``)."""
    return {p.name: describe_exit(p.name, p.exitcode) for p in procs if p.exitcode is not None and p.exitcode < 0}


# What a trainer reports when a peer of its process group went away: the consequence of that peer's failure.
_PEER_LOST = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|\[gloo\].*(closed|reset)", re.IGNORECASE
)


def _first_cause(failed: list[tuple[int, Any, float]]) -> tuple[int, Any, float]:
    """Of the trainers that failed (index, (message, traceback, internal), when reported), the one whose failure
    caused the others': the first to report that did not only lose a peer (a trainer that stops on bad data makes
    the others' collectives fail), else the first to report."""
    causes = [f for f in failed if not _PEER_LOST.search(str(f[1][0]))]
    return min(causes or failed, key=lambda f: (f[2], f[0]))


def _killed_within(procs: list[Any], timeout_s: float) -> dict[str, str]:
    """:func:`_killed` of ``procs``, waiting up to ``timeout_s`` for one to end (the fork server reports a child's
    end a moment after the others saw its connections reset)."""
    deadline = time.monotonic() + timeout_s
    while not (killed := _killed(procs)):
        running = [p.sentinel for p in procs if p.exitcode is None]
        left = deadline - time.monotonic()
        if not running or left <= 0:
            break
        mp_connection.wait(running, timeout=left)  # wakes when one of them ends
    return killed
