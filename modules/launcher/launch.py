"""Run a small parameter-server cluster on localhost: ``n_servers`` servers and ``n_clients`` trainer processes.

Rank layout (what :func:`.ps.server.serve` and :func:`.ps.connection.connect` assume): servers ``0 .. n_servers-1``
named ``ps{i}``, trainers ``n_servers + j`` named ``trainer{j}``. Every process is forked from a
``forkserver`` that has imported the modules once (:func:`_context`; no fork of a parent that may hold threads or an RPC
agent), takes the launching process's environment, and rendezvous at ``127.0.0.1`` in a TCPStore that the launching
process hosts before any of them starts (:func:`hosted_store`, torchrun's agent-store convention). Every socket of the
job listens on loopback only: the store, the RPC agents (TensorPipe) and the trainers' gloo pairs.

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
import signal
import socket
import subprocess
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from persia_planner.errors import Interrupted
from persia_planner.modules.launcher.lifecycle import Stop, StopOnSignals, quiet_cpp_logs, stop_processes
from persia_planner.modules.launcher.local_job import LocalJob, Waits
from persia_planner.modules.launcher.workers import barrier, use_hosted_store
from persia_planner.modules.ps.allocator import allocator_env
from persia_planner.modules.ps.group import DEFAULT_PEER_TIMEOUT_S, host_store
from persia_planner.modules.ps.protocol import check_wire_dtype
from persia_planner.modules.rpc_environment import listen_where_the_rendezvous_is, master_address
from persia_planner.tiers import Memory, Tier

__all__ = [
    "barrier",
    "hosted_store",
    "local_cluster",
    "reserved_port",
    "trainers_prefix",
    "trainers_store",
    "use_hosted_store",
]

log = logging.getLogger(__name__)


@contextlib.contextmanager
def reserved_port() -> Iterator[int]:
    """A port on 127.0.0.1 kept for a child process that binds it itself (``persia ps`` rank 0 or torchrun hosting
    their store on ``MASTER_PORT``), for as long as the block runs.

    A port that was merely free a moment ago (bind, read, close) may be taken by another process, or picked by the
    kernel as some connection's source port, before the child binds it. Here a socket holds it, bound with
    ``SO_REUSEADDR`` and never listening: a process that binds with ``SO_REUSEADDR`` as well (torch's store,
    :func:`.ps.group.host_store`) may still bind and listen on it, nobody else may, and until the child listens a
    connection to it is refused. Prefer :func:`hosted_store` where the children can use a store hosted for them.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


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


def trainers_store(timeout_s: float = 300.0) -> dist.Store:
    """The trainers' own namespace in the job's rendezvous store (torchrun's agent store or :func:`hosted_store`).

    The trainers' process group rendezvous there under a prefix (with torchrun's run id and restart count, so a
    restarted job never reads the keys of its previous attempt), so it needs no port of its own and trainer 0 may
    live on any machine.

    Raises:
        PlannerError: ``MASTER_ADDR`` or ``MASTER_PORT`` is not set.
    """
    addr, port = master_address("the trainers' group")
    listen_where_the_rendezvous_is()  # gloo reads GLOO_SOCKET_IFNAME when the group is made with this store
    agent = dist.TCPStore(addr, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.PrefixStore(trainers_prefix(os.environ), agent)


def trainers_prefix(environ: Mapping[str, str]) -> str:
    """The trainers' namespace in the job's store (:func:`trainers_store`) for a process with ``environ``."""
    run, restart = environ.get("TORCHELASTIC_RUN_ID", ""), environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"persia-trainers-{run}-{restart}"


def _context(fn: Callable[..., Any]) -> Any:
    """The ``forkserver`` context, its server preloading this module and ``fn``'s.

    Why not ``spawn``: every spawned process imports torch, numba and, for a trainer, torchrec and fbgemm again
    (3-8 s of CPU each); a cluster of 2 servers + 2 trainers spent ~12 s of a 2-core machine on imports before its
    first request. The fork server imports them once per launching process, and each child is a fork of it: a fresh
    process that has imported modules but never run a thread pool, an RPC agent or user code (what ``fork`` of the
    launching process would risk).

    The main module is preloaded too (``"__main__"``: the fork server imports the launching script, as
    ``__mp_main__``, once): otherwise every child imports it before it runs anything of ours, ``persia``'s CLI and
    the planner with it, seconds on a loaded machine during which it cannot die with its launcher yet.
    """
    ctx = mp.get_context("forkserver")
    modules = ["__main__", __name__, f"{__package__}.forkserver_hooks"]
    module = getattr(fn, "__module__", None)
    if module and module not in ("__main__", "__mp_main__"):  # a script's functions come with the main module
        modules.append(module)
    ctx.set_forkserver_preload(modules)  # takes effect when the fork server starts: the first launch
    return ctx


# The start-up settings (GLIBC_TUNABLES, TORCH_CPP_LOG_LEVEL) the running fork server was started with (None: not
# started by a launch of ours).
_forkserver_settings: tuple[str | None, ...] | None = None


def _restart_forkserver_unless(settings: tuple[str | None, ...]) -> None:
    """Stop the fork server if it was started with other start-up settings than ``settings``; the next start forks a
    fresh one with them.

    Why: glibc reads its tunables (:func:`.ps.allocator.allocator_env`) only when a process image starts, and torch
    reads ``TORCH_CPP_LOG_LEVEL`` (:func:`.lifecycle.quiet_cpp_logs`) when it is imported; every child is a fork of the
    fork server, so without this a launch with ``PS_TUNE_MALLOC=0`` after a default one (or the other way round) would
    silently run with the first launch's allocator. Uses the standard library's own ``ForkServer._stop`` (what its
    tests use); where that is missing the fork server is left as it is.
    """
    global _forkserver_settings
    server = getattr(mp_forkserver, "_forkserver", None)
    running = getattr(server, "_forkserver_pid", None) is not None
    if running and _forkserver_settings != settings and hasattr(server, "_stop"):
        server._stop()
        running = False
    if not running:
        _forkserver_settings = settings


def _tracker_in_own_session() -> None:
    """Start multiprocessing's resource tracker, if it is not running, in a session of its own.

    The job's queue and barrier are named POSIX semaphores (``/dev/shm/sem.mp-*``) that the tracker unlinks when
    its last user is gone. Started as usual it shares the job's process group, and a SIGKILL of the group kills it
    too: the semaphores then stay until reboot. In its own session it outlives the group, sees the launcher's pipe
    close, and unlinks them. It is the standard library's tracker; only its start differs.
    """
    from multiprocessing import resource_tracker, util

    if os.name != "posix":  # pragma: no cover - Linux is what runs jobs
        return

    def spawn_in_own_session(path: str, args: list[str], passfds: Any) -> int:
        # Its count of what it cleaned up after a kill is no news to whoever killed the job.
        quiet = [args[0], "-W", "ignore::UserWarning", *args[1:]]
        return subprocess.Popen(quiet, executable=path, pass_fds=tuple(passfds), start_new_session=True).pid

    spawn = util.spawnv_passfds
    util.spawnv_passfds = spawn_in_own_session
    try:
        resource_tracker.ensure_running()
    finally:
        util.spawnv_passfds = spawn


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
    hang_timeout_s: float = DEFAULT_PEER_TIMEOUT_S,
    end_on_lost_server: bool = True,
    log_dir: str | None = None,
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
            (:mod:`~persia_planner.modules.stopping`: ``persia train`` then saves a final checkpoint) and waits this
            long for them to report; a second signal, or the end of the wait, stops the workers as without it.
        on_start: Called once every process has started, with each one's pid by name (``ps0 ..``,
            ``trainer0 ..``): how a caller watches the job's processes (``benchmarks/soak.py`` samples their
            memory). It runs in the launching thread before the trainers are awaited, so it must return at once.
        hang_timeout_s: Once the trainers publish their steps (:func:`.progress.publish_progress`), stop the job
            when none advanced for this long and some are behind the others or stopped, naming them
            (:class:`.progress.ProgressWatch`).
        end_on_lost_server: A server that ends while the trainers run ends the job, naming it (a server lost while
            the group forms would otherwise keep the others in the rendezvous for ``rpc_timeout_s``). False: leave
            it to the trainers' requests (for trainers that kill a server on purpose).
        log_dir: Each worker writes its output and logging to ``log_dir/<name>.log``
            (:mod:`persia_planner.modules.process_logs`); what reaches the terminal stays as without it.

    Returns:
        The trainers' return values, in trainer order.

    Raises:
        TrainerError: A trainer raised (first in trainer order), hung, or the run timed out
            (:class:`persia_planner.modules.launcher.local_job.TrainerError`).
        Interrupted: SIGINT or SIGTERM reached this process; the workers were stopped first. After a drain in
            which every trainer reported, its ``results`` are the trainers' return values.
    """
    if n_servers < 0 or n_clients < 1:
        raise ValueError(f"need servers >= 0 and at least one client, got {n_servers} and {n_clients}")
    check_wire_dtype(wire_dtype)
    ctx = _context(fn)
    tuning = allocator_env() | quiet_cpp_logs()
    environ = dict(os.environ) | tuning
    # A fork server's children have its tier registry: one started before a tier module was loaded (or unloaded)
    # would unpickle a plan naming it as an unknown tier.
    tiers = tuple(t.value for t in Tier) + tuple(m.value for m in Memory)
    _restart_forkserver_unless((*tuple(environ.get(name) for name in sorted(tuning)), tiers))
    _tracker_in_own_session()  # before the job's semaphores: a SIGKILL of the job must not leave them behind
    waits = Waits(run_timeout_s, shutdown_timeout_s, failure_grace_s, drain_s, end_on_lost_server)
    stopped: list[int] = []  # how many workers were running when a signal stopped the job
    try:
        with (
            StopOnSignals(defer_first=drain_s > 0).installed() as signals,
            hosted_store(max(timeout_s, run_timeout_s)) as port,
        ):
            client = (timeout_s, rpc_timeout_s, (log_level, log_dir), delay_ms, wire_dtype)
            job = LocalJob.of(
                ctx, n_servers, n_clients, (fn, args), (port, trainers_prefix(environ)), environ, client, hang_timeout_s
            )
            try:
                job.start(tuning, signals, on_start)
                job.await_trainers(signals, waits)
                job.shut_down(waits)
            except Stop:
                stopped.append(stop_processes(job.started(), stop_grace_s))
                raise
            finally:
                stop_processes(job.started(), 0.0)  # those still running: at once
                job.results.close()
            return job.values()
    except Stop as stop:
        n = stopped[0] if stopped else 0
        raise Interrupted(
            stop.signum, f"interrupted ({signal.Signals(stop.signum).name}); stopped {n} worker{'' if n == 1 else 's'}"
        ) from None
