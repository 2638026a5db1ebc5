"""Run a small parameter-server cluster on localhost: ``n_servers`` servers and ``n_clients`` trainer processes.

Rank layout (what :func:`.server.serve` and :func:`.trainer.connect` assume): servers ``0 .. n_servers-1`` named
``ps{i}``, trainers ``n_servers + j`` named ``trainer{j}``. Every process is forked from a ``forkserver`` that has
imported the modules once (:func:`_context`; no fork of a parent that may hold threads or an RPC agent), takes the
launching process's environment, and rendezvous at ``127.0.0.1`` in a TCPStore that the launching process hosts
before any of them starts (:func:`hosted_store`, torchrun's agent-store convention). Every socket of the job listens
on loopback only: the store, the RPC agents (TensorPipe) and the trainers' gloo pairs.

Each trainer runs ``fn(trainer_index, client, *args)`` and sends its return value (or its traceback) back through a
queue; the trainers may synchronise with each other through :func:`barrier`. After all trainers reported, the
processes shut down gracefully (every worker reaches ``rpc.shutdown()``); if a server died (as in the failure tests)
no graceful shutdown is possible and the survivors are terminated instead. Once a trainer reported a failure, the
others get a few seconds (``failure_grace_s``) to report theirs, then every process is killed: they may be waiting
for the failed one in a collective.

The processes end with the launching process: killed with it, even by SIGKILL
(:func:`.lifecycle.die_with_the_launcher`); on SIGINT or SIGTERM it stops them (terminate, then kill after
``stop_grace_s``) and raises :class:`~persia_planner.errors.Interrupted`.

Used by the tests and the benchmarks::

    results = local_cluster(2, 4, train_step, table_config)
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import multiprocessing.forkserver as mp_forkserver
import os
import pickle
import queue
import signal
import socket
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp

from persia_planner.errors import Interrupted, PlannerError

from ..rpcenv import listen_on_loopback_if_asked, master_address
from ..stopping import request_stop
from .allocator import allocator_env
from .client import PsClient
from .group import host_store
from .lifecycle import Stop, StopOnSignals, adopt_environment, die_with_the_launcher, exit_now, stop_processes
from .protocol import check_wire_dtype, server_name
from .server import serve
from .trainer import connect

__all__ = [
    "TrainerError",
    "barrier",
    "free_port",
    "hosted_store",
    "local_cluster",
    "trainers_prefix",
    "trainers_store",
    "use_hosted_store",
]

log = logging.getLogger(__name__)

_BARRIER: Any = None  # the trainers' multiprocessing barrier, set in each trainer process


class TrainerError(PlannerError):
    """A trainer's ``fn`` raised (or the run failed). The message is one line, the trainer's exception;
    ``detail`` holds its traceback (also appended to the message when ``PERSIA_DEBUG`` is set).

    Attributes:
        detail: The trainer's traceback, if any.
        internal: True when the trainer's exception was not a ``PlannerError`` (a bug, not bad input).
    """

    def __init__(self, message: str, detail: str = "", internal: bool = False) -> None:
        self.detail, self.internal = detail, internal
        shown = f"{message}\n{detail}" if detail and os.environ.get("PERSIA_DEBUG") else message
        super().__init__(shown)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def barrier(timeout_s: float | None = 60.0) -> None:
    """Block until every trainer of the :func:`local_cluster` reached this call (call it from ``fn`` only)."""
    if _BARRIER is None:
        raise RuntimeError("barrier() is only available inside a trainer started by local_cluster")
    _BARRIER.wait(timeout_s)


@contextlib.contextmanager
def hosted_store(timeout_s: float = 300.0) -> Iterator[int]:
    """Host the rendezvous store in this process, on a port the OS picks, for children started inside the block.

    Letting rank 0 of the children bind a port chosen in advance is racy twice over: another process may take the
    port before rank 0 binds it, and a rank that connects before rank 0 listens can have the kernel pick that very
    port as its own source port and talk to itself (TCP self-connect), reading its own request as the reply. Here
    the store listens before any child exists. Children call :func:`use_hosted_store` with the port (as torchrun's
    agent store: every rank is a client, ``TORCHELASTIC_USE_AGENT_STORE``).

    Yields:
        The store's port on 127.0.0.1.
    """
    store = host_store("127.0.0.1", 0, datetime.timedelta(seconds=timeout_s))  # loopback only, not every interface
    try:
        yield store.port
    finally:
        del store


def use_hosted_store(port: int) -> None:
    """In a child of :func:`hosted_store`: rendezvous (``env://``, rpc, process groups) in the parent's store."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    listen_on_loopback_if_asked()


def trainers_store(timeout_s: float = 300.0) -> dist.Store:
    """The trainers' own namespace in the job's rendezvous store (torchrun's agent store or :func:`hosted_store`).

    The trainers' process group rendezvous there under a prefix (with torchrun's run id and restart count, so a
    restarted job never reads the keys of its previous attempt), so it needs no port of its own and trainer 0 may
    live on any machine.

    Raises:
        PlannerError: ``MASTER_ADDR`` or ``MASTER_PORT`` is not set.
    """
    addr, port = master_address("the trainers' group")
    listen_on_loopback_if_asked()  # gloo reads GLOO_SOCKET_IFNAME when the group is made with this store
    agent = dist.TCPStore(addr, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.PrefixStore(trainers_prefix(os.environ), agent)


def trainers_prefix(environ: Mapping[str, str]) -> str:
    """The trainers' namespace in the job's store (:func:`trainers_store`) for a process with ``environ``."""
    run, restart = environ.get("TORCHELASTIC_RUN_ID", ""), environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"persia-trainers-{run}-{restart}"


def _server_main(
    rank: int, world_size: int, port: int, rpc_timeout_s: float, log_level: int, environ: dict[str, str]
) -> None:
    die_with_the_launcher()
    adopt_environment(environ)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    use_hosted_store(port)
    # No peer watch: this launcher supervises its children itself (run_timeout_s, failure_grace_s) and names the
    # trainer that failed; a server giving up first would make the others report the server instead.
    serve(rank, world_size, rpc_timeout_s=rpc_timeout_s, peer_timeout_s=None)


def _trainer_main(
    j: int,
    n_servers: int,
    world_size: int,
    port: int,
    opts: tuple[float, float, int, float, torch.dtype],
    results: Any,
    trainer_barrier: Any,
    fn: Callable[..., Any],
    args: tuple,
    environ: dict[str, str],
) -> None:
    global _BARRIER
    die_with_the_launcher()
    adopt_environment(environ)
    timeout_s, rpc_timeout_s, log_level, delay_ms, wire_dtype = opts
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    use_hosted_store(port)
    _BARRIER = trainer_barrier
    client: PsClient | None = None
    if n_servers:  # a job without parameter-server tables runs no RPC group at all
        client = connect(
            f"trainer{j}",
            n_servers + j,
            world_size,
            servers=[server_name(i) for i in range(n_servers)],
            timeout_s=timeout_s,
            rpc_timeout_s=rpc_timeout_s,
            delay_ms=delay_ms,
            wire_dtype=wire_dtype,
        )
    failed = False
    try:
        try:
            value = fn(j, client, *args)
            # Before reporting success: a push still in flight that fails is this trainer's failure (its gradients
            # are lost), not something to find only in the child's exit code after the parent has moved on.
            if client is not None:
                client.flush()
            # Plain pickle, not the queue's: torch's reducers would pass tensors as shared-memory handles that
            # the parent can only open while this process lives, and it may be gone (or killed) by then.
            results.put((j, True, pickle.dumps(value)))
        except BaseException as err:
            message = f"{type(err).__name__}: {err}".strip().splitlines()[0]
            results.put((j, False, (message, traceback.format_exc(), not isinstance(err, PlannerError))))
            if not isinstance(err, Exception):
                raise  # an interrupt or exit goes on as it came
            failed = True
    finally:
        if client is not None:
            client.close()
            rpc.shutdown()  # graceful: waits for the servers and the other trainers
    # Flushed, then ended without finalizing the interpreter (exit_now: a gloo collective's thread may still hold
    # Python objects). On failure the parent reports the error (its traceback travelled with it); raising here would
    # make multiprocessing print that traceback on the user's terminal before the parent's one-line error.
    results.close()
    results.join_thread()
    exit_now(1 if failed else 0)


def _context(fn: Callable[..., Any]) -> Any:
    """The ``forkserver`` context, its server preloading this module and ``fn``'s.

    Why not ``spawn``: every spawned process imports torch, numba and, for a trainer, torchrec and fbgemm again
    (3-8 s of CPU each); a cluster of 2 servers + 2 trainers spent ~12 s of a 2-core machine on imports before its
    first request. The fork server imports them once per launching process, and each child is a fork of it: a fresh
    process that has imported modules but never run a thread pool, an RPC agent or user code (what ``fork`` of the
    launching process would risk).
    """
    ctx = mp.get_context("forkserver")
    modules = [__name__]
    module = getattr(fn, "__module__", None)
    if module and module not in ("__main__", "__mp_main__"):  # a script's functions are imported by the child itself
        modules.append(module)
    ctx.set_forkserver_preload(modules)  # takes effect when the fork server starts: the first launch
    return ctx


# GLIBC_TUNABLES the running fork server was started with (None: not started by a launch of ours, or without them).
_forkserver_tunables: str | None = None


def _restart_forkserver_unless(tunables: str | None) -> None:
    """Stop the fork server if it was started with other glibc tunables than ``tunables``; the next start forks a
    fresh one with them.

    Why: glibc reads its tunables (:func:`.allocator.allocator_env`) only when a process image starts, and every child
    is a fork of the fork server, so without this a launch with ``PS_TUNE_MALLOC=0`` after a default one (or the
    other way round) would silently run with the first launch's allocator. Uses the standard library's own
    ``ForkServer._stop`` (what its tests use); where that is missing the fork server is left as it is.
    """
    global _forkserver_tunables
    server = getattr(mp_forkserver, "_forkserver", None)
    running = getattr(server, "_forkserver_pid", None) is not None
    if running and _forkserver_tunables != tunables and hasattr(server, "_stop"):
        server._stop()
        running = False
    if not running:
        _forkserver_tunables = tunables


def local_cluster(
    n_servers: int,
    n_clients: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout_s: float = 10.0,
    rpc_timeout_s: float = 60.0,
    run_timeout_s: float = 300.0,
    shutdown_timeout_s: float = 30.0,
    failure_grace_s: float = 5.0,
    log_level: int = logging.WARNING,
    delay_ms: float = 0.0,
    wire_dtype: torch.dtype = torch.float32,
    stop_grace_s: float = 5.0,
    drain_s: float = 0.0,
    on_start: Callable[[dict[str, int]], None] | None = None,
) -> list[Any]:
    """Run ``fn(trainer_index, client, *args)`` in ``n_clients`` trainers against ``n_servers`` fresh servers.

    ``fn`` and ``args`` must be picklable (a module-level function); ``fn`` may call :func:`barrier`.

    Args:
        n_servers: Server processes (``ps0 ..``); 0: no RPC group, ``fn`` gets ``None`` as its client.
        n_clients: Trainer processes (``trainer0 ..``).
        fn: The trainer body; its return value must be picklable.
        timeout_s: The clients' per-request timeout.
        rpc_timeout_s: Default RPC timeout of every process (rendezvous, shutdown barrier).
        run_timeout_s: Give up (and kill everything) if the trainers have not all reported by then.
        shutdown_timeout_s: Time allowed for the graceful shutdown after the trainers reported.
        failure_grace_s: Once a trainer reported a failure, how long the others still have to report before
            everything is killed: a trainer may wait for the failed one in a collective (a barrier, an all-gather)
            until its own timeout, minutes later, and the run has failed anyway.
        log_level: Logging level of the child processes.
        delay_ms: Latency the trainers' clients inject before every request (``PsClient(delay_ms=...)``).
        wire_dtype: The dtype the trainers' clients send rows and gradients in (``PsClient(wire_dtype=...)``).
        stop_grace_s: On SIGINT or SIGTERM (in the main thread), how long the workers have to end after SIGTERM
            before they are killed.
        drain_s: If above 0, the first SIGINT or SIGTERM asks the trainers to stop at a step they agree on
            (:mod:`..stopping`: ``persia train`` then saves a final checkpoint) and waits this long for them to
            report; a second signal, or the end of the wait, stops the workers as without it.
        on_start: Called once every process has started, with each one's pid by name (``ps0 ..``,
            ``trainer0 ..``): how a caller watches the job's processes (``benchmarks/soak.py`` samples their
            memory). It runs in the launching thread before the trainers are awaited, so it must return at once.

    Returns:
        The trainers' return values, in trainer order.

    Raises:
        TrainerError: A trainer raised (first in trainer order), or the run timed out.
        Interrupted: SIGINT or SIGTERM reached this process; the workers were stopped first. After a drain in
            which every trainer reported, its ``results`` are the trainers' return values.
    """
    if n_servers < 0 or n_clients < 1:
        raise ValueError(f"need servers >= 0 and at least one client, got {n_servers} and {n_clients}")
    check_wire_dtype(wire_dtype)
    ctx = _context(fn)
    world_size = n_servers + n_clients
    tuning = allocator_env()
    environ = dict(os.environ) | tuning
    _restart_forkserver_unless(environ.get("GLIBC_TUNABLES"))
    stopped: list[int] = []  # how many workers were running when a signal stopped the job
    try:
        with (
            StopOnSignals(defer_first=drain_s > 0).installed() as signals,
            hosted_store(max(timeout_s, run_timeout_s)) as port,
        ):
            results = ctx.Queue()
            trainer_barrier = ctx.Barrier(n_clients)
            servers = [
                ctx.Process(
                    target=_server_main,
                    args=(i, world_size, port, rpc_timeout_s, log_level, environ),
                    name=server_name(i),
                    daemon=True,
                )
                for i in range(n_servers)
            ]
            trainers = [
                ctx.Process(
                    target=_trainer_main,
                    args=(
                        j,
                        n_servers,
                        world_size,
                        port,
                        (timeout_s, rpc_timeout_s, log_level, delay_ms, wire_dtype),
                        results,
                        trainer_barrier,
                        fn,
                        args,
                        environ,
                    ),
                    name=f"trainer{j}",
                    daemon=True,
                )
                for j in range(n_clients)
            ]
            procs = servers + trainers
            # The children inherit the environment at start: give them the allocator setting that keeps request buffers
            # warm (see allocator.allocator_env), without changing this process's environment for longer than the start.
            # Only GLIBC_TUNABLES changes, and only while the processes start.
            before = os.environ.get("GLIBC_TUNABLES")
            outcome: dict[int, tuple[bool, Any, float]] = {}  # trainer -> (ok, value, when reported)
            draining: int | None = None  # the signal that asked the trainers to stop together
            try:
                try:
                    os.environ.update(tuning)
                    with signals.held():
                        for p in procs:
                            p.start()  # may raise (e.g. fn or args do not pickle): the ones started are killed below
                finally:
                    if before is None:
                        os.environ.pop("GLIBC_TUNABLES", None)
                    else:
                        os.environ["GLIBC_TUNABLES"] = before
                if on_start is not None:
                    on_start({p.name: p.pid for p in procs})
                deadline = time.monotonic() + run_timeout_s
                given_up = False
                while len(outcome) < n_clients:
                    if draining is None and signals.received is not None and drain_s > 0:
                        # Asked to stop: the trainers stop together at a step they agree on, and report as usual.
                        draining = signals.received
                        deadline = time.monotonic() + drain_s
                        request_stop("127.0.0.1", port, trainers_prefix(environ), signal.Signals(draining).name)
                    failed_at = [t for ok, _value, t in outcome.values() if not ok]
                    if failed_at and time.monotonic() > min(failed_at) + failure_grace_s:
                        given_up = True  # the rest are killed below; the failure is raised after
                        break
                    try:
                        j, ok, value = results.get(timeout=min(1.0, failure_grace_s) if failed_at else 1.0)
                        outcome[j] = (ok, value, time.monotonic())
                    except queue.Empty:
                        # A process that exits before its trainer reported (e.g. failed to join the group) would
                        # otherwise leave us waiting for the whole run_timeout_s.
                        # (A dead server is not checked here: the trainers' requests to it fail within their timeout.)
                        early = [p for j, p in enumerate(trainers) if p.exitcode is not None and j not in outcome]
                        if draining is not None and time.monotonic() > deadline:
                            raise signals.stop(draining) from None  # the trainers did not stop in time
                        if early or time.monotonic() > deadline:
                            why = (
                                f"{', '.join(f'{p.name} exited with {p.exitcode}' for p in early)}"
                                if early
                                else f"the trainers did not finish within {run_timeout_s:g} s"
                            )
                            raise TrainerError(f"local cluster failed: {why}") from None
                # Graceful shutdown needs every worker; once a server died it cannot complete, so do not wait for it.
                server_died = any(p.exitcode not in (None, 0) for p in servers)
                grace = time.monotonic() + (0.0 if server_died or given_up else shutdown_timeout_s)
                for p in procs:
                    p.join(max(0.0, grace - time.monotonic()))
            except Stop:
                stopped.append(stop_processes([p for p in procs if p.pid is not None], stop_grace_s))
                raise
            finally:
                stop_processes([p for p in procs if p.pid is not None], 0.0)  # those still running: at once
                results.close()
            failed = [(j, value) for j, (ok, value, _t) in sorted(outcome.items()) if not ok]
            if failed:
                j, (message, tb, internal) = failed[0]
                raise TrainerError(f"trainer{j} failed: {message}", detail=tb, internal=internal)
            values = [pickle.loads(outcome[j][1]) for j in range(n_clients)]
            if draining is not None:
                raise Interrupted(
                    draining, f"interrupted ({signal.Signals(draining).name}); the trainers stopped together", values
                )
            return values
    except Stop as stop:
        n = stopped[0] if stopped else 0
        raise Interrupted(
            stop.signum, f"interrupted ({signal.Signals(stop.signum).name}); stopped {n} worker{'' if n == 1 else 's'}"
        ) from None
