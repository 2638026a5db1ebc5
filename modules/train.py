"""Hybrid training of a TorchRec DLRM from a plan: the engine behind ``persia train``.

Roles: parameter-server processes hold the plan's ``ps`` tables; trainer processes run a TorchRec ``DLRM`` whose
``EmbeddingBagCollection`` is a :class:`~.hybrid.HybridEmbeddingBagCollection` and whose dense part is wrapped in
``DistributedDataParallel`` (gloo on CPU, nccl on CUDA). Sparse and dense optimizers are separate: the sparse one is
fused into fbgemm (local tables) or applied by the servers (PS tables); the dense one is a ``torch.optim`` optimizer
over the dense parameters only.

:func:`train_local` spawns the servers and trainers on this machine (:func:`.ps.launch.local_cluster`);
:func:`train_torchrun` is the same job under ``torchrun`` on several machines: each node is one or more topology
hosts, and runs their servers and trainers (:func:`persia_planner.nodes.process_role`). Each trainer reads its own
share of the data: batch ``b`` of the stream goes to trainer ``b mod trainers``.

The rooms of a run: :mod:`.config` (the options, checked without torch), :mod:`.job` (what every trainer gets and
its start-up), :mod:`.loop` (the model, its optimizers and the step loop, :class:`TrainLoop`), :mod:`.stream` (a
trainer's batches and the evaluation), :mod:`.resume` (``trainer.pt``); this module runs a trainer and launches the
job, and re-exports the Python API below.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from persia_planner.errors import ErrorKind, Interrupted, PlannerError
from persia_planner.execution import check_executable, planned_execution
from persia_planner.memory import PS_MAX_CAPACITY
from persia_planner.nodes import ProcessKind, TorchrunProcess, node_hosts, node_roles, process_role
from persia_planner.placement import Mode, TablePlacement
from persia_planner.specs import ModelSpec
from persia_planner.topology import Topology

from .breakdown import StepProfiler
from .checkpoints import new_lineage, written_by_run
from .config import (
    PsCapacity,
    TrainConfig,
    check_before_start,
    dense_arch,
    dlrm_embedding_dim,
    hyper_parameters,
    id_universe,
    sparse_optimizer_of,
)
from .distributed import check_trainers, distribute, executed_plan
from .hybrid import SparseOptimizer
from .job import Job, trainer_group
from .loop import TrainLoop, build_model, dense_state_dict, make_optimizer
from .metrics_log import MetricsSink, Sinks, StepRecord, open_sinks, write_summary
from .proclogs import launcher_log, log_failure, process_log
from .ps.launch import trainers_store
from .ps.progress import publish_progress
from .ps_usage import planned_server_bytes, server_usage, usage_table, warm_up
from .resume import TRAINER_STATE, Saver, check_layout, check_resume, data_layout, load_trainer_state
from .run_dirs import elastic_resume
from .stopping import GracefulStop
from .stream import evaluate, lockstep, teacher_for, trainer_batches
from .terminal import ema, progress_bar, summary_rows

__all__ = [
    "FINAL_CHECKPOINT_WAIT_S",
    "PS_REQUEST_TIMEOUT_S",
    "TrainConfig",
    "TrainLoop",
    "build_model",
    "check_resume",
    "dense_state_dict",
    "make_optimizer",
    "summary_rows",
    "teacher_for",
    "train_local",
    "train_torchrun",
    "usage_table",
]


log = logging.getLogger(__name__)

# ---- one trainer ---------------------------------------------------------------------------------------------


def _trainer(j: int, client: Any, job: Job) -> dict[str, Any] | None:
    """Body of trainer ``j`` (also under torchrun); returns the summary on trainer 0."""
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    with trainer_group(j, job, backend=backend), contextlib.ExitStack() as cleanup:
        return _train(j, client, job, cleanup)


def _train(j: int, client: Any, job: Job, cleanup: contextlib.ExitStack) -> dict[str, Any] | None:
    cfg, spec = job.cfg, job.spec
    layout = data_layout(cfg, spec, job.trainers)
    batch_size = layout["batch_size"]
    sparse_opt = SparseOptimizer(sparse_optimizer_of(cfg, spec), learning_rate=cfg.sparse_lr)
    per_host = len(job.topology.trainers[0].gpus)  # trainer_group told TorchRec the plan's nodes
    device = torch.device("cpu")
    if torch.cuda.is_available():  # trainer j is GPU j % per_host of its host, as in the plan
        local = j % per_host if job.local_trainer is None else job.local_trainer
        device = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(device)
    memory_before = None
    if job.servers:  # the servers' memory before this run's tables exist: what the run costs them is the growth
        if j == 0:
            warm_up(client, dlrm_embedding_dim(spec), WARM_UP_IDS, sparse_opt.ps())
            memory_before = client.memory()
        dist.barrier()
    capacity = None
    if cfg.ps_capacity is PsCapacity.UNBOUNDED:  # every id the data can draw, on every server: nothing is evicted
        capacity = {name: min(ids, PS_MAX_CAPACITY) for name, ids in id_universe(spec, cfg).items()}
    model, hybrid = build_model(
        spec,
        job.tables,
        ps=client,
        optimizer=sparse_opt,
        staleness=cfg.effective_staleness,
        seed=cfg.seed,
        ps_servers=job.servers,
        device=device,
        local_device=torch.device("meta"),  # only the shards this trainer holds are allocated, by DMP
        capacity=capacity,
        arch=dense_arch(spec, cfg),
    )
    dmp = distribute(model, job.tables, job.topology, device=device)
    executed = executed_plan(model, job.topology)
    opt = make_optimizer(model, cfg, sparse_opt)
    start_step = 0
    root = Path(cfg.checkpoint) if cfg.checkpoint else None
    lineage = new_lineage()
    resumed_from: int | None = None
    if cfg.resume and root is not None:
        chosen = Path(job.resume_from) if job.resume_from else None
        ckpt, state = check_resume(root, hybrid.ps is not None, log.warning if j == 0 else None, chosen=chosen)
        start_step = resumed_from = load_trainer_state(ckpt, state, model, hybrid, opt, layout)
        lineage = ckpt.lineage or lineage
        # --steps is the job's total, so that the same command, run again after a crash, trains what was asked;
        # torchrun restarted the job: it goes on to the step its first attempt was to reach (the same total).
        target = int(state.get("target_step", cfg.steps)) if job.restarted else cfg.steps
        if target <= start_step:
            raise PlannerError(
                f"--resume: the newest checkpoint is at step {start_step:,}, which the job's --steps {target:,} "
                "already reaches (--steps counts the job's steps, resumed ones too)",
                fixes=(f"pass --steps above {start_step:,} to train on",),
            )
        cfg = replace(cfg, steps=target - start_step)
        if j == 0 and hybrid.ps is not None:
            client.load(ckpt.path / "ps")
        dist.barrier()
    saver = Saver(root, job, model, hybrid, opt, client, layout, lineage, target_step=start_step + cfg.steps)
    # Only the local launcher asks for the agreed stop (a store round trip per step); torchrun signals every worker.
    stoppable = root is not None and "TORCHELASTIC_RUN_ID" not in os.environ
    stopper = GracefulStop(trainers_store(), j) if stoppable else None

    history: list[dict[str, Any]] = []
    losses: list[float] = []
    step_ms: list[float] = []
    # Every trainer profiles the same window (a profiled trainer is slower: the others would wait in collectives).
    # Not with PS tables: a trainer crashed (SIGSEGV) under torch.profiler with RPCs in flight (decision 0014).
    warmup = min(10, cfg.steps // 4)
    profiler = None
    if cfg.steps >= 4 and hybrid.ps is None:
        profiler = StepProfiler(warmup, min(10, max(1, cfg.steps // 4)))
    # Trainer 0 logs the job's steps: its samples/s counts every trainer's, and the others run the same steps.
    # Closed however _train ends: a failed run keeps the steps it logged.
    sink: MetricsSink = cleanup.enter_context(
        contextlib.closing(open_sinks(cfg.log_dir, first_step=start_step) if j == 0 else Sinks())
    )
    data_ms: list[float] = []
    ps_ms: dict[str, list[float]] = {"ps_wait": [], "push": []}
    loop = TrainLoop(dmp, hybrid, opt, device, profiler)
    progress = progress_bar(cfg) if (j == 0 and cfg.progress) else None
    task = progress.add_task("train", total=cfg.steps, loss=float("nan"), rate=0.0, stale=0) if progress else None
    t0 = time.perf_counter()
    # The loop's start on the machine-wide monotonic clock: places each step's t_s beside other processes' samples.
    started_monotonic_s = time.monotonic()
    eval_s = 0.0
    samples = excluded_samples = excluded_steps = 0
    step = start_step
    stopped_by: str | None = None
    try:
        if progress:
            progress.start()
        batches = trainer_batches(spec, cfg, batch_size, eval_=False, skip=start_step)
        if cfg.data != "synthetic":  # every trainer gets exactly cfg.steps synthetic batches: no count to agree on
            batches = lockstep(batches)
        for stats in loop.run(batches):
            step += 1
            publish_progress(step)  # the launcher names a trainer that stops advancing
            losses.append(stats.loss)
            step_ms.append(stats.step_ms)
            data_ms.append(stats.data_ms)
            ps_ms["ps_wait"].append(stats.ps_wait_ms)
            ps_ms["push"].append(stats.push_ms)
            samples += stats.samples * job.trainers
            index = step - start_step - 1
            if profiler is not None and profiler.start <= index < profiler.start + profiler.count:
                # The breakdown's profiled steps run slower: they are measurement, not training throughput.
                eval_s += (stats.step_ms + stats.data_ms) / 1e3
                excluded_samples += stats.samples * job.trainers
                excluded_steps += 1
            rate = (samples - excluded_samples) / max(1e-9, time.perf_counter() - t0 - eval_s)
            t_s = time.perf_counter() - t0  # at the step's end, evaluations included: throughput over time
            history.append(
                {"step": step, "loss": stats.loss, "samples": samples, "staleness": stats.staleness, "t_s": t_s}
            )
            sink.log_step(StepRecord.of(step, stats, samples_per_s=rate, t_s=t_s))
            if progress:
                progress.update(task, advance=1, loss=ema(losses), rate=rate, stale=stats.staleness)
            if cfg.eval_every and step % cfg.eval_every == 0 and step < start_step + cfg.steps:
                eval_started = time.perf_counter()
                hybrid.flush()
                dist.barrier()  # every trainer's pushes are applied before anyone evaluates
                held_out = trainer_batches(spec, cfg, batch_size, eval_=True, skip=start_step)
                history[-1].update(evaluate(dmp, held_out, device))
                sink.log_eval(step, history[-1])
                eval_s += time.perf_counter() - eval_started
            if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < start_step + cfg.steps:
                eval_s += saver.save(step)  # not training time either
            if stopper is not None and stopper.after_step(step):
                stopped_by = stopper.reason
                break
        hybrid.flush()
        # Training throughput: the evaluations along the way (they would halve it at eval_every=1) and the profiled
        # steps are not training.
        elapsed = time.perf_counter() - t0 - eval_s
    finally:
        if progress:
            progress.stop()
    dist.barrier()  # every trainer's pushes are applied before the usage report and the checkpoint
    if step == start_step and stopped_by is None:
        # No training step at all: the data gave some trainer no full batch (every trainer stops together). Said
        # here, for what it is: the evaluation after it would only find no held-out data either.
        where = "after the resumed step" if start_step else "for every trainer"
        raise PlannerError(
            f"{cfg.data}: the data holds no full batch of {batch_size:,} samples {where} "
            f"({job.trainers} trainers read their own share of the rows)",
            fixes=("use a smaller --batch-size, fewer --trainers or more data",),
        )
    ps_servers: list[dict[str, Any]] = []
    if j == 0 and memory_before is not None and hybrid.ps is not None:
        planned = planned_server_bytes(spec, job.tables, job.topology)
        usage = server_usage(client.metrics(), memory_before, client.memory(), planned)
        ps_servers = [u.to_dict() for u in usage]
    # Before the evaluation: an evaluation that fails (e.g. no held-out data left) loses nothing.
    if saver.last_step != step:
        saver.save(step)
    result = evaluate(dmp, trainer_batches(spec, cfg, batch_size, eval_=True, skip=start_step), device)
    sink.log_eval(step, result)
    if history:
        history[-1].update(result)
    if j != 0:
        return None
    tail = losses[-max(1, len(losses) // 10) :]
    steps_done = step - start_step
    timed = _unprofiled(step_ms, profiler)
    breakdown = {"data": _median(_unprofiled(data_ms, profiler))}
    if profiler is not None and profiler.shares is not None:
        breakdown |= {term: share * _median(timed) for term, share in profiler.shares.items()}
    elif hybrid.ps is not None:  # not profiled (decision 0014): the PS terms are timed directly, the rest together
        breakdown |= {term: _median(_unprofiled(xs, profiler)) for term, xs in ps_ms.items()}
        breakdown["other"] = max(0.0, _median(timed) - breakdown["ps_wait"] - breakdown["push"])
    return {
        **result,
        "teacher_auc": result.get("teacher_auc"),
        "loss": sum(tail) / len(tail) if tail else float("nan"),
        "samples_per_s": (samples - excluded_samples) / elapsed if elapsed > 0 else 0.0,
        "step_ms": _median(timed),
        "step_breakdown_ms": breakdown,
        "wall_step_ms": elapsed * 1e3 / max(1, steps_done - excluded_steps),
        "batch_size": batch_size * job.trainers,
        "steps": steps_done,
        "first_step": start_step,
        "resumed_from_step": resumed_from,
        "last_step": step,
        "checkpoint": str(saver.last.path) if saver.last is not None else None,
        "stopped_by": stopped_by,
        "staleness": cfg.effective_staleness,
        "staleness_max_seen": hybrid.staleness_max_seen,
        "mode": cfg.mode.value,
        "hyper_parameters": hyper_parameters(cfg, spec, job.trainers),
        "trainers": job.trainers,
        "servers": job.servers if hybrid.ps is not None else 0,
        "ps_tables": [c.name for c in hybrid.ps_tables],
        "local_tables": [c.name for c in hybrid.local_tables],
        "executed_plan": executed,
        "executed_matches_plan": executed == planned_execution(job.tables, spec, job.topology),
        "ps_delay_ms": cfg.ps_delay_ms,
        "ps_wire": cfg.ps_wire.value,
        "ps_capacity": cfg.ps_capacity.value,
        "id_space": cfg.teacher_rows_scale,
        "ps_servers": ps_servers,
        "data": cfg.data,
        "seed": cfg.seed,
        "started_monotonic_s": started_monotonic_s,
        "history": history,
    }


def _unprofiled(xs: list[float], profiler: StepProfiler | None) -> list[float]:
    """The steps after warm-up, without the profiled ones (the profiler's overhead inflates them)."""
    if profiler is None:
        return xs
    kept = xs[profiler.start + profiler.count :]
    return kept or xs


def _median(xs: list[float]) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[len(s) // 2]


# How long the trainers have, after SIGINT or SIGTERM, to reach the step they agree to stop at and save the final
# checkpoint (a second signal stops them at once).
FINAL_CHECKPOINT_WAIT_S = 120.0

# Ids of the servers' warm-up before their memory baseline: about a large training request's distinct ids per server.
WARM_UP_IDS = 8192

# A trainer's PS request timeout, on one machine and under torchrun alike: checkpoint saves and loads of large
# tables are requests too, and take far longer than the client's 10 s default for lookups.
PS_REQUEST_TIMEOUT_S = 60.0


# ---- launchers -----------------------------------------------------------------------------------------------


def _check_plan_runs(cfg: TrainConfig, spec: ModelSpec, tables: dict[str, TablePlacement], topology: Topology) -> None:
    """Before any process starts: the trainers are the plan's ranks, and TorchRec runs every table as planned."""
    check_trainers(cfg.trainers, topology)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    check_executable(tables, device, dtype=spec.table_dtypes, optimizer=sparse_optimizer_of(cfg, spec))


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
    from .ps.launch import local_cluster

    has_ps = any(p.mode is Mode.ASYNC for p in tables.values())
    check_before_start(cfg, spec, with_ps=has_ps)
    _check_plan_runs(cfg, spec, tables, topology)
    chosen = None
    if cfg.resume and cfg.checkpoint:  # here, before any process starts
        ckpt, state = check_resume(Path(cfg.checkpoint), has_ps, log.warning)
        check_layout(ckpt.path / TRAINER_STATE, state, data_layout(cfg, spec, cfg.trainers))
        chosen = str(ckpt.path)
    job = Job(cfg, spec, dict(tables), topology, servers if has_ps else 0, cfg.trainers, resume_from=chosen)
    logged = launcher_log(cfg.log_dir, f"{cfg!r}, {job.servers} servers") if cfg.log_dir else None
    try:
        results = local_cluster(
            job.servers,
            cfg.trainers,
            _trainer,
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
    parameter servers serve the PS tables and whose trainer devices train (:func:`persia_planner.nodes.process_role`).

    RPC and the trainers' gloo group both rendezvous in torchrun's store at ``MASTER_ADDR:MASTER_PORT``.

    Args:
        cfg, spec, tables: As for :func:`train_local` (``cfg.trainers`` becomes the topology's trainer devices).
        topology: The plan's topology.
        node_host: This node's host names, comma-separated (``--node-host`` / ``PERSIA_HOST``); None: by rank.

    Returns:
        The summary on the first trainer, None elsewhere.

    Raises:
        PlannerError: The world does not match the topology (checked before anything starts).
    """
    from .ps import server as ps_server
    from .ps.trainer import joined
    from .roles import claim_role

    process = TorchrunProcess.from_environ()
    role = process_role(topology, process, node_host)
    servers, rank, world = len(topology.servers), process.rank, process.world_size
    cfg = elastic_resume(cfg)
    # A restarted attempt that resumes this run's own checkpoint trains on to the step the first attempt was to reach.
    restarted = cfg.resume and written_by_run(cfg.checkpoint or "", os.environ.get("TORCHELASTIC_RUN_ID", ""))
    cfg = replace(cfg, trainers=len(topology.gpus))  # before the checks: the data's shards are for them
    check_before_start(cfg, spec, with_ps=any(p.mode is Mode.ASYNC for p in tables.values()))
    claim_role(role, process)
    if role.kind is ProcessKind.SERVER:
        with process_log(cfg.log_dir, role.name):
            ps_server.serve(rank, world, name=role.name)
        return None
    index = role.index
    _check_plan_runs(cfg, spec, tables, topology)  # the trainers' hardware is checked where they run
    node = node_roles(topology, node_hosts(topology, process, node_host))
    local = process.local_rank - sum(r.kind is ProcessKind.SERVER for r in node)  # servers come first on a node
    job = Job(cfg, spec, dict(tables), topology, servers, cfg.trainers, restarted=restarted, local_trainer=local)
    if not servers:  # no parameter_server host: no RPC group, as on one machine
        with process_log(cfg.log_dir, f"trainer{index}"):
            return _finished(_trainer(index, None, job), world, cfg)
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
            return _finished(_trainer(index, client, job), world, cfg)
        except RuntimeError as err:
            cause = next((c for c in _PEER_GONE if c in str(err)), None)
            if cause is None:
                raise
            # gloo names the peer by its socket address only; torchrun's own summary names the rank that failed.
            raise PlannerError(
                f"trainer{index} (rank {rank}): another process of the trainers' group is gone (gloo: {cause})",
                fixes=("see torchrun's summary for the rank that failed first",),
                kind=ErrorKind.UNAVAILABLE,
            ) from None


def _finished(result: dict[str, Any] | None, world: int, cfg: TrainConfig) -> dict[str, Any] | None:
    """The first trainer's summary with where every process ran, also in ``--log-dir``'s summary.json."""
    from .roles import with_processes

    result = with_processes(result, world)
    if result is not None and cfg.log_dir:
        write_summary(cfg.log_dir, result)
    return result


# What gloo says when the other end of a collective died.
_PEER_GONE = ("Connection reset by peer", "Connection closed by peer")
