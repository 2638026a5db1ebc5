"""Hybrid training of a TorchRec DLRM from a plan: the engine behind ``persia train``.

Roles: parameter-server processes hold the plan's ``ps`` tables; trainer processes run a TorchRec ``DLRM`` whose
``EmbeddingBagCollection`` is a :class:`~persia_planner.modules.embedding.hybrid.HybridEmbeddingBagCollection` and whose
dense part is wrapped in ``DistributedDataParallel`` (gloo on CPU, nccl on CUDA). Sparse and dense optimizers are
separate: the sparse one is fused into fbgemm (local tables) or applied by the servers (PS tables); the dense one is a
``torch.optim`` optimizer over the dense parameters only.

:func:`train_local` spawns the servers and trainers on this machine (:func:`.launcher.launch.local_cluster`), and
:func:`run_trainers` does the same for a training function of one's own;
:func:`train_torchrun` is the same job under ``torchrun`` on several machines: each node is one or more topology
hosts, and runs their servers and trainers (:func:`persia_planner.topology.torchrun_nodes.process_role`). Each trainer
reads its own share of the data: batch ``b`` of the stream goes to trainer ``b mod trainers``.

The rooms of a run: :mod:`persia_planner.modules.train.config` (the options, checked without torch),
:mod:`persia_planner.modules.train.run_inputs` (the inputs against the model, before any process starts),
:mod:`persia_planner.modules.train.job` (what every trainer gets and its start-up),
:mod:`persia_planner.modules.train.trainer` (one trainer from start to summary),
:mod:`persia_planner.modules.train.loop` (the model, its optimizers and the step loop),
:mod:`persia_planner.modules.train.batch_stream` (a trainer's batches and the evaluation),
:mod:`persia_planner.modules.train.trainer_state` (``trainer.pt``); this module launches the job.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from persia_planner.errors import ErrorKind, Interrupted, PlannerError
from persia_planner.kinds import Mode
from persia_planner.model.specs import ModelSpec
from persia_planner.modules.embedding.model_parallel import check_trainers
from persia_planner.modules.process_logs import launcher_log, log_failure, process_log
from persia_planner.modules.train.config import TrainConfig, sparse_optimizer_of
from persia_planner.modules.train.job import Job, trainers_group
from persia_planner.modules.train.metrics_log import write_summary
from persia_planner.modules.train.run_directories import run_folders
from persia_planner.modules.train.run_inputs import check_before_start
from persia_planner.modules.train.run_lock import hold_run_folders
from persia_planner.modules.train.torchrun_start import TorchrunStart, torchrun_start
from persia_planner.modules.train.trainer import run_trainer
from persia_planner.modules.train.trainer_state import (
    TRAINER_STATE,
    check_layout,
    check_resume,
    data_layout,
)
from persia_planner.placement.shards import TablePlacement
from persia_planner.plan.executability import check_executable
from persia_planner.plan.validation import model_changed
from persia_planner.topology.graph import Topology
from persia_planner.topology.torchrun_nodes import ProcessKind, node_hosts, node_roles

__all__ = ["FINAL_CHECKPOINT_WAIT_S", "PS_REQUEST_TIMEOUT_S", "run_trainers", "train_local", "train_torchrun"]


log = logging.getLogger(__name__)

# How long the trainers have, after SIGINT or SIGTERM, to reach the step they agree to stop at and save the final
# checkpoint (a second signal stops them at once).
FINAL_CHECKPOINT_WAIT_S = 120.0

# A trainer's PS request timeout, on one machine and under torchrun alike: checkpoint saves and loads of large
# tables are requests too, and take far longer than the client's 10 s default for lookups.
PS_REQUEST_TIMEOUT_S = 60.0


# ---- launchers -----------------------------------------------------------------------------------------------


def _check_plan_runs(cfg: TrainConfig, spec: ModelSpec, tables: dict[str, TablePlacement], topology: Topology) -> None:
    """Before any process starts: the trainers are the plan's ranks, the tables are as they were planned (their
    rows' dtype, pooled or sequence), and TorchRec runs every table as planned."""
    check_trainers(cfg.trainers, topology)
    for table in spec.tables:
        changed = model_changed(tables[table.name], table, spec.dtype_of(table)) if table.name in tables else None
        if changed is not None:
            raise PlannerError(f"table {table.name!r} {changed}", kind=ErrorKind.INVALID_PLAN, fixes=("persia plan",))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    check_executable(
        tables, device, dtype=spec.table_dtypes, optimizer=sparse_optimizer_of(cfg, spec), qcomms=spec.qcomms
    )


def train_local(
    cfg: TrainConfig,
    spec: ModelSpec,
    tables: dict[str, TablePlacement],
    *,
    servers: int,
    topology: Topology,
    run_timeout_s: float = 3600,
    on_start: Callable[[dict[str, int]], None] | None = None,
) -> dict[str, Any]:
    """Run ``servers`` PS processes and ``cfg.trainers`` trainers on this machine; returns trainer 0's summary.

    ``topology`` is the one the plan was made for: trainer ``r`` runs what the plan put on ``topology.gpus[r]``.
    ``on_start`` gets the pid of every process of the job by name once they started (``local_cluster``'s).
    """
    has_ps = any(p.mode is Mode.ASYNC for p in tables.values())
    cfg = check_before_start(cfg, spec, with_ps=has_ps)
    _check_plan_runs(cfg, spec, tables, topology)
    with hold_run_folders(run_folders(cfg)):  # the folders are this run's until it ends, however it ends
        return _train_local(cfg, spec, tables, servers, topology, run_timeout_s, on_start)


def _train_local(
    cfg: TrainConfig,
    spec: ModelSpec,
    tables: dict[str, TablePlacement],
    servers: int,
    topology: Topology,
    run_timeout_s: float,
    on_start: Callable[[dict[str, int]], None] | None,
) -> dict[str, Any]:
    from persia_planner.modules.launcher.launch import local_cluster

    has_ps = any(p.mode is Mode.ASYNC for p in tables.values())
    chosen = None
    if cfg.resume and cfg.checkpoint:  # here, before any process starts
        ckpt, state = check_resume(Path(cfg.checkpoint), has_ps, log.warning)
        check_layout(ckpt.path / TRAINER_STATE, state, data_layout(cfg, spec, cfg.trainers))
        chosen = str(ckpt.path)
    # --adapt may move tables to the servers later: they run from the start wherever the topology has some.
    with_servers = has_ps or (cfg.adapt and bool(topology.servers))
    job = Job(cfg, spec, dict(tables), topology, servers if with_servers else 0, cfg.trainers, resume_from=chosen)
    logged = launcher_log(cfg.log_dir, f"{cfg!r}, {job.servers} servers") if cfg.log_dir else None
    try:
        results = local_cluster(
            job.servers,
            cfg.trainers,
            run_trainer,
            job,
            delay_ms=cfg.ps_delay_ms,
            wire_dtype=cfg.ps_wire_dtype,
            timeout_s=PS_REQUEST_TIMEOUT_S,
            run_timeout_s=run_timeout_s,
            drain_s=FINAL_CHECKPOINT_WAIT_S if cfg.checkpoint else 0.0,
            on_start=on_start,
            log_dir=cfg.log_dir,
        )
    except Interrupted as stop:
        if not stop.results:
            raise
        done = stop.results[0]
        if cfg.log_dir:
            write_summary(cfg.log_dir, done)
        raise Interrupted(
            stop.signum,
            f"interrupted ({signal.Signals(stop.signum).name}) after step {done['last_step']}; "
            f"checkpoint in {done['checkpoint']} (--resume goes on from there)",
            stop.results,
        ) from None
    except Exception as err:
        if logged is not None:  # the terminal gets the one line from the caller
            log_failure(logged, err)
        raise
    finally:
        if logged is not None:
            logging.getLogger().removeHandler(logged)
            logged.close()
    if cfg.log_dir:
        write_summary(cfg.log_dir, results[0])
    return results[0]


def train_torchrun(
    cfg: TrainConfig,
    spec: ModelSpec,
    tables: dict[str, TablePlacement],
    *,
    topology: Topology,
    node_host: str | None = None,
) -> Any:
    """The same job under ``torchrun``, on one node or several: each node is one or more topology hosts, whose
    parameter servers serve the PS tables and whose trainer devices train
    (:func:`persia_planner.topology.torchrun_nodes.process_role`).

    RPC and the trainers' gloo group both rendezvous in torchrun's store at ``MASTER_ADDR:MASTER_PORT``.

    Args:
        cfg: The run's options, as for :func:`train_local` (``cfg.trainers`` becomes the topology's trainer devices).
        spec: The model.
        tables: The plan's placement of every table.
        topology: The plan's topology.
        node_host: This node's host names, comma-separated (``--node-host`` / ``PERSIA_HOST``); None: by rank.

    Returns:
        The summary on the first trainer, None elsewhere.

    Raises:
        PlannerError: The world does not match the topology (checked before anything starts).
    """
    from persia_planner.modules.ps import server as ps_server
    from persia_planner.modules.train.roles import claim_role

    start = torchrun_start(
        cfg, spec, topology, with_ps=any(p.mode is Mode.ASYNC for p in tables.values()), node_host=node_host
    )
    cfg, process, role = start.cfg, start.process, start.role
    claim_role(role, process)
    if role.kind is ProcessKind.SERVER:
        with process_log(cfg.log_dir, role.name):
            ps_server.serve(process.rank, process.world_size, name=role.name)
        return None
    _check_plan_runs(cfg, spec, tables, topology)  # the trainers' hardware is checked where they run
    # The first trainer writes the checkpoints and the metrics: it holds the run's folders for the attempt's life.
    with hold_run_folders(run_folders(cfg) if role.index == 0 else {}):
        return _torchrun_trainer(cfg, spec, tables, topology, start, node_host)


def _torchrun_trainer(
    cfg: TrainConfig,
    spec: ModelSpec,
    tables: dict[str, TablePlacement],
    topology: Topology,
    start: TorchrunStart,
    node_host: str | None,
) -> dict[str, Any] | None:
    """A torchrun trainer's part of the job (:func:`train_torchrun`)."""
    from persia_planner.modules.ps.connection import joined

    process, role, restarted = start.process, start.role, start.restarted
    servers, rank, world, index = len(topology.servers), process.rank, process.world_size, role.index
    node = node_roles(topology, node_hosts(topology, process, node_host))
    local = process.local_rank - sum(r.kind is ProcessKind.SERVER for r in node)  # servers come first on a node
    job = Job(cfg, spec, dict(tables), topology, servers, cfg.trainers, restarted=restarted, local_trainer=local)
    if not servers:  # no parameter_server host: no RPC group, as on one machine
        with process_log(cfg.log_dir, f"trainer{index}"):
            return _finished(run_trainer(index, None, job), world, cfg)
    # joined: a failed step leaves at once; a server lost at the end is named within the peer timeout, not awaited.
    with (
        process_log(cfg.log_dir, f"trainer{index}"),
        joined(
            f"trainer{index}",
            rank,
            world,
            timeout_s=PS_REQUEST_TIMEOUT_S,
            delay_ms=cfg.ps_delay_ms,
            wire_dtype=cfg.ps_wire_dtype,
        ) as client,
    ):
        try:
            return _finished(run_trainer(index, client, job), world, cfg)
        except RuntimeError as err:
            cause = next((c for c in _PEER_GONE if c in str(err)), None)
            if cause is None:
                raise
            # gloo names the peer by its socket address only: the RPC group, which names its workers, is asked which
            # trainers still answer.
            gone = _trainers_gone(index, topology) or "another process of the trainers' group"
            raise PlannerError(
                f"trainer{index} (rank {rank}): {gone} is gone (gloo: {cause})",
                fixes=("see torchrun's summary for the rank that failed first",),
                kind=ErrorKind.UNAVAILABLE,
            ) from None


def _trainers_gone(index: int, topology: Topology) -> str:
    """The other trainers that do not answer a ping of the RPC group, with their hosts ("" if all answer)."""
    from persia_planner.modules.ps.group import unanswered

    names = {f"trainer{i}": gpu.host for i, gpu in enumerate(topology.gpus) if i != index}
    lost = unanswered(list(names), timeout_s=_PING_TIMEOUT_S)
    return ", ".join(f"{name} (host {names[name]})" for name in names if name in lost)


def run_trainers(
    fn: Callable[..., Any],
    *args: Any,
    trainers: int = 2,
    servers: int = 0,
    per_host: int | None = None,
    ps_delay_ms: float = 0.0,
    ps_wire_dtype: torch.dtype = torch.float32,
    run_timeout_s: float = 3600.0,
    log_dir: str | None = None,
) -> list[Any]:
    """Run your own training function in ``trainers`` processes on this machine, with ``servers`` parameter
    servers: ``fn(rank, client, *args)`` runs in each trainer as rank ``rank`` of the trainers' process group
    (gloo, rendezvous hosted by this process), with ``client`` its
    :class:`~persia_planner.modules.ps.client.PsClient` (None without servers); returns each trainer's return value,
    by rank. In ``fn``, build a :class:`~persia_planner.modules.embedding.hybrid.HybridEmbeddingBagCollection` on
    ``client`` and shard it with :func:`~persia_planner.modules.embedding.model_parallel.distribute`, as
    ``persia train`` does for its DLRM.

    ``fn`` and ``args`` travel to the trainers by pickle: ``fn`` is a module-level function of an importable module
    (a script's functions count when the script guards its top level with ``if __name__ == "__main__":``).

    Args:
        fn: The trainer's body; its return value must be picklable.
        *args: Passed on to ``fn`` after ``rank`` and ``client``.
        trainers: Trainer processes.
        servers: Parameter-server processes (0: none).
        per_host: Trainers per host, for TorchRec's grid shardings (``LOCAL_WORLD_SIZE``); None: the environment's.
        ps_delay_ms: Added to every PS call (a stand-in for a slow network).
        ps_wire_dtype: The dtype rows and gradients travel in to and from the servers.
        run_timeout_s: Give up, and stop every process, when the trainers have not all returned by then.
        log_dir: Also write one log file per process there.

    Raises:
        TrainerError: A trainer failed (the first failure, named), or the run timed out.
    """
    from persia_planner.modules.launcher.launch import local_cluster

    return local_cluster(
        servers,
        trainers,
        _in_trainers_group,
        fn,
        trainers,
        per_host,
        args,
        delay_ms=ps_delay_ms,
        wire_dtype=ps_wire_dtype,
        timeout_s=PS_REQUEST_TIMEOUT_S,
        run_timeout_s=run_timeout_s,
        log_dir=log_dir,
    )


def _in_trainers_group(
    j: int, client: Any, fn: Callable[..., Any], trainers: int, per_host: int | None, args: tuple[Any, ...]
) -> Any:
    with trainers_group(j, trainers, per_host=per_host):
        return fn(j, client, *args)


def _finished(result: dict[str, Any] | None, world: int, cfg: TrainConfig) -> dict[str, Any] | None:
    """The first trainer's summary with where every process ran, also in ``--log-dir``'s summary.json."""
    from persia_planner.modules.train.roles import with_processes

    result = with_processes(result, world)
    if result is not None and cfg.log_dir:
        write_summary(cfg.log_dir, result)
    return result


# What gloo says when the other end of a collective died.
_PEER_GONE = ("Connection reset by peer", "Connection closed by peer")
# How long a trainer that lost a gloo peer waits for the other trainers' answers before naming the silent ones.
_PING_TIMEOUT_S = 5.0
