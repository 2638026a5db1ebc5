"""The bodies of the local cluster's workers (:func:`.launch.local_cluster`): a server, a trainer, and what a trainer
may call (:func:`barrier`).

A worker reports how it ended through the launcher's results queue, ``(who, ok, payload)``: ``who`` is the trainer's
index, or a server's name when a server failed; ``payload`` is the trainer's pickled return value, or
``(message, traceback, internal)`` for a failure. Nothing is printed: the launcher turns the first failure into one
line, and the traceback travels with it (``PERSIA_DEBUG`` shows it).
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.rpc as rpc

from persia_planner.errors import PlannerError, first_line
from persia_planner.modules.launcher.lifecycle import adopt_environment, die_with_the_launcher, exit_now, name_process
from persia_planner.modules.launcher.progress import use_progress_slot
from persia_planner.modules.process_logs import log_to_file
from persia_planner.modules.ps.client import PsClient
from persia_planner.modules.ps.connection import connect
from persia_planner.modules.ps.protocol import server_name
from persia_planner.modules.ps.server import serve
from persia_planner.modules.rpc_environment import listen_where_the_rendezvous_is

log = logging.getLogger(__name__)

__all__ = ["barrier", "describe_exit", "failure_of", "server_main", "trainer_main", "use_hosted_store"]

_BARRIER: Any = None  # the trainers' multiprocessing barrier, set in each trainer process


def barrier(timeout_s: float | None = 60.0) -> None:
    """Block until every trainer of the :func:`~.launch.local_cluster` reached this call (call it from ``fn`` only)."""
    if _BARRIER is None:
        raise RuntimeError("barrier() is only available inside a trainer started by local_cluster")
    _BARRIER.wait(timeout_s)


def use_hosted_store(port: int) -> None:
    """In a child of :func:`~.launch.hosted_store`: rendezvous (``env://``, rpc, process groups) in the parent's
    store."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    listen_where_the_rendezvous_is()


def failure_of(err: BaseException) -> tuple[str, str, bool]:
    """What a worker reports for ``err``: its first line, the traceback, and whether it is a bug (not bad input)."""
    return first_line(err, with_type=True), traceback.format_exc(), not isinstance(err, PlannerError)


def describe_exit(name: str, code: int) -> str:
    """How process ``name`` ended: ``exited with 1``, or ``was killed (SIGKILL)`` for a negative exit code."""
    if code < 0:
        try:
            return f"{name} was killed ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"{name} exited with {code}"


def _finish(results: Any, failed: bool) -> None:
    """Flush the reports, then end without finalizing the interpreter (:func:`.lifecycle.exit_now`: a gloo
    collective's thread may still hold Python objects). A failure is reported, not raised: multiprocessing would print
    its traceback on the user's terminal before the launcher's one-line error."""
    results.close()
    results.join_thread()
    exit_now(1 if failed else 0)


def server_main(
    rank: int,
    world_size: int,
    port: int,
    rpc_timeout_s: float,
    logs: tuple[int, str | None],
    environ: dict[str, str],
    results: Any,
) -> None:
    """Server ``ps{rank}`` of the local cluster; a failure (even at start-up) is reported as ``(name, False, ...)``.
    ``logs`` is the log level and the log directory (:func:`persia_planner.modules.process_logs.log_to_file`)."""
    die_with_the_launcher()
    name_process(server_name(rank))
    adopt_environment(environ)
    log_level, log_dir = logs
    log_to_file(log_dir, server_name(rank), log_level)
    use_hosted_store(port)
    failed = False
    try:
        # No peer watch: this launcher supervises its children itself (run_timeout_s, failure_grace_s) and names the
        # trainer that failed; a server giving up first would make the others report the server instead.
        serve(rank, world_size, rpc_timeout_s=rpc_timeout_s, peer_timeout_s=None)
    except Exception as err:
        failed = True
        results.put((server_name(rank), False, failure_of(err)))
        log.info("%s failed", server_name(rank), exc_info=True)  # its log file only (the launcher names it)
    _finish(results, failed)


def trainer_main(
    j: int,
    n_servers: int,
    world_size: int,
    port: int,
    opts: tuple[float, float, tuple[int, str | None], float, torch.dtype],
    results: Any,
    shared: tuple[Any, Any],
    fn: Callable[..., Any],
    args: tuple,
    environ: dict[str, str],
) -> None:
    """Trainer ``j`` of the local cluster: joins the RPC group (if there are servers), runs ``fn(j, client, *args)``
    and reports its value or its failure (one that happens while joining too). ``opts`` holds the client's timeouts,
    the log level and directory, and the client's delay and wire dtype."""
    global _BARRIER
    die_with_the_launcher()
    name_process(f"trainer{j}")
    adopt_environment(environ)
    timeout_s, rpc_timeout_s, (log_level, log_dir), delay_ms, wire_dtype = opts
    log_to_file(log_dir, f"trainer{j}", log_level)
    use_hosted_store(port)
    _BARRIER, progress = shared
    use_progress_slot(progress, j)
    client: PsClient | None = None
    failed = False
    try:
        try:
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
            value = fn(j, client, *args)
            # Before reporting success: a push still in flight that fails is this trainer's failure (its gradients
            # are lost), not something to find only in the child's exit code after the parent has moved on.
            if client is not None:
                client.flush()
            # Plain pickle, not the queue's: torch's reducers would pass tensors as shared-memory handles that
            # the parent can only open while this process lives, and it may be gone (or killed) by then.
            results.put((j, True, pickle.dumps(value)))
        except BaseException as err:
            failed = True
            results.put((j, False, failure_of(err)))
            log.info("trainer%d failed", j, exc_info=True)  # its log file only (the launcher names it)
            if not isinstance(err, Exception):
                raise  # an interrupt or exit goes on as it came
    finally:
        if client is not None:
            client.close()
            # Graceful: waits for the servers and the other trainers. After a failure (often a lost server) it
            # cannot complete, and would log a traceback about it before the launcher names the failure: leave.
            rpc.shutdown(graceful=not failed)
    _finish(results, failed)
