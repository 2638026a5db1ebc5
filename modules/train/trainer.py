"""One trainer of a run, from start to summary: its device and model, a resume, the steps with their metrics,
evaluations and checkpoints, and the summary trainer 0 returns (:func:`run_trainer`, the body of every trainer process
of ``persia train``, on this machine or under torchrun).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from persia_planner.errors import PlannerError
from persia_planner.modules.embedding.hybrid import HybridEmbeddingBagCollection, SparseOptimizer
from persia_planner.modules.embedding.model_parallel import dense_all_reduce_dtype, distribute, executed_plan
from persia_planner.modules.ps.launch import trainers_store
from persia_planner.modules.ps.progress import publish_progress
from persia_planner.modules.step_breakdown import StepProfiler
from persia_planner.modules.stopping import GracefulStop
from persia_planner.modules.train.batch_stream import (
    BadRowTally,
    Epochs,
    bad_rows_summary,
    evaluate,
    held_out_batches,
    training_batches,
    with_data_statistics,
)
from persia_planner.modules.train.config import PsCapacity, TrainConfig, sparse_optimizer_of, trainer_batch_size
from persia_planner.modules.train.job import Job, trainer_group
from persia_planner.modules.train.job_checkpoints import PS_DIR, new_lineage
from persia_planner.modules.train.loop import StepStats, TrainLoop, build_job_model, make_optimizer
from persia_planner.modules.train.metrics_log import MetricsSink, Sinks, StepRecord, open_sinks
from persia_planner.modules.train.pipeline import PipelinedTrainLoop, PipelineStep
from persia_planner.modules.train.ps_usage import planned_server_bytes, server_usage, warm_up
from persia_planner.modules.train.run_inputs import dlrm_embedding_dim, hyper_parameters, id_universe
from persia_planner.modules.train.terminal import ema, progress_bar
from persia_planner.modules.train.trainer_state import Saver, check_resume, data_layout, load_trainer_state
from persia_planner.placement.memory import PS_MAX_CAPACITY
from persia_planner.plan.executability import planned_execution

__all__ = ["WARM_UP_IDS", "run_trainer"]

log = logging.getLogger(__name__)

WARM_UP_IDS = 8192
"""Ids of the servers' warm-up before their memory baseline: about a large training request's distinct ids per
server."""


def run_trainer(j: int, client: Any, job: Job) -> dict[str, Any] | None:
    """Trainer ``j`` of ``job`` (``client``: its parameter-server client, None without PS tables); returns the
    summary on trainer 0, None on the others."""
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    job = replace(job, cfg=with_data_statistics(job.spec, job.cfg))  # before the model: every trainer alike
    with trainer_group(j, job, backend=backend), contextlib.ExitStack() as cleanup:
        run = _TrainerRun.start(j, client, job, cleanup)
        run.train()
        return run.finish()


@dataclass
class _Timeline:
    """What the steps measured: each step's loss and times, the samples, and what is not training time (the
    evaluations and checkpoints along the way, the profiled steps)."""

    profiler: StepProfiler | None
    trainers: int
    started_s: float = field(default_factory=time.perf_counter)
    losses: list[float] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)
    data_ms: list[float] = field(default_factory=list)
    ps_ms: dict[str, list[float]] = field(default_factory=lambda: {"ps_wait": [], "push": []})
    history: list[dict[str, Any]] = field(default_factory=list)
    samples: int = 0
    excluded_samples: int = 0
    excluded_steps: int = 0
    excluded_s: float = 0.0

    def record(self, step: int, index: int, stats: StepStats) -> float:
        """Record step ``step`` (the run's ``index``-th); returns the training rate so far, in samples/s."""
        self.losses.append(stats.loss)
        self.step_ms.append(stats.step_ms)
        self.data_ms.append(stats.data_ms)
        self.ps_ms["ps_wait"].append(stats.ps_wait_ms)
        self.ps_ms["push"].append(stats.push_ms)
        self.samples += stats.samples * self.trainers
        profiler = self.profiler
        if profiler is not None and profiler.start <= index < profiler.start + profiler.count:
            # The breakdown's profiled steps run slower: they are measurement, not training throughput.
            self.excluded_s += (stats.step_ms + stats.data_ms) / 1e3
            self.excluded_samples += stats.samples * self.trainers
            self.excluded_steps += 1
        t_s = time.perf_counter() - self.started_s  # at the step's end, evaluations included: throughput over time
        self.history.append(
            {"step": step, "loss": stats.loss, "samples": self.samples, "staleness": stats.staleness, "t_s": t_s}
        )
        return (self.samples - self.excluded_samples) / max(1e-9, t_s - self.excluded_s)

    def unprofiled(self, xs: list[float]) -> list[float]:
        """The steps after warm-up, without the profiled ones (the profiler's overhead inflates them)."""
        if self.profiler is None:
            return xs
        kept = xs[self.profiler.start + self.profiler.count :]
        return kept or xs

    def breakdown_ms(self, with_ps: bool) -> dict[str, float]:
        """The median step's parts: the data, and the profiled shares, or without a profile the PS terms timed
        directly and the rest together (decision 0014)."""
        timed = _median(self.unprofiled(self.step_ms))
        breakdown = {"data": _median(self.unprofiled(self.data_ms))}
        if self.profiler is not None and self.profiler.shares is not None:
            breakdown |= {term: share * timed for term, share in self.profiler.shares.items()}
        elif with_ps:
            breakdown |= {term: _median(self.unprofiled(xs)) for term, xs in self.ps_ms.items()}
            breakdown["other"] = max(0.0, timed - breakdown["ps_wait"] - breakdown["push"])
        return breakdown


@dataclass
class _TrainerRun:
    """One trainer's run: what :meth:`start` builds, :meth:`train` steps through and :meth:`finish` sums up."""

    j: int
    client: Any
    job: Job
    cfg: TrainConfig
    batch_size: int
    device: torch.device
    dmp: Any
    hybrid: HybridEmbeddingBagCollection
    executed: dict[str, Any]
    saver: Saver
    stopper: GracefulStop | None
    sink: MetricsSink
    loop: TrainLoop | PipelinedTrainLoop
    timeline: _Timeline
    memory_before: dict[str, Any] | None
    epochs: Epochs
    start_step: int = 0
    resumed_from: int | None = None
    step: int = 0
    stopped_by: str | None = None
    elapsed_s: float = 0.0
    started_monotonic_s: float = 0.0
    bad_rows: BadRowTally = field(default_factory=BadRowTally)

    @classmethod
    def start(cls, j: int, client: Any, job: Job, cleanup: contextlib.ExitStack) -> _TrainerRun:
        """Trainer ``j``'s device, model (sharded by DMP) and optimizers, resumed from a checkpoint if asked."""
        cfg, spec = job.cfg, job.spec
        layout = data_layout(cfg, spec, job.trainers)
        sparse_opt = SparseOptimizer(sparse_optimizer_of(cfg, spec), learning_rate=cfg.sparse_lr)
        device = _device(j, job)
        memory_before = None
        if job.servers:  # the servers' memory before this run's tables exist: what the run costs them is the growth
            if j == 0:
                warm_up(client, dlrm_embedding_dim(spec), WARM_UP_IDS, sparse_opt.ps())
                memory_before = client.memory()
            dist.barrier()
        capacity = None
        if cfg.ps_capacity is PsCapacity.UNBOUNDED:  # every id the data can draw, on every server: nothing is evicted
            capacity = {name: min(ids, PS_MAX_CAPACITY) for name, ids in id_universe(spec, cfg).items()}
        model, hybrid = build_job_model(job, client, sparse_opt, device=device, capacity=capacity)
        # Pipelined, DMP shards the step module around the model (TorchRec's pipeline calls it with the batch); the
        # model itself is sharded in place, and the checkpoints and evaluations read it as unpipelined runs do.
        # The collectives' precisions are the plan's (the run's spec is the model as the plan was priced).
        step_module = PipelineStep(model) if cfg.pipeline else model
        dmp = distribute(step_module, job.tables, job.topology, device=device, qcomms=job.spec.qcomms)
        executed = executed_plan(model, job.topology)
        opt = make_optimizer(model, cfg, sparse_opt)
        root = Path(cfg.checkpoint) if cfg.checkpoint else None
        lineage, start_step, resumed_from, epochs = new_lineage(), 0, None, Epochs()
        if cfg.resume and root is not None:
            chosen = Path(job.resume_from) if job.resume_from else None
            ckpt, state = check_resume(root, hybrid.ps is not None, log.warning if j == 0 else None, chosen=chosen)
            start_step = resumed_from = load_trainer_state(ckpt, state, model, hybrid, opt, layout)
            lineage = ckpt.lineage or lineage
            epochs = Epochs([int(n) for n in state.get("epoch_lengths", [])])
            cfg = replace(cfg, steps=_steps_left(cfg, job, state, start_step, epochs))
            if j == 0 and hybrid.ps is not None:
                client.load(ckpt.path / PS_DIR)
            dist.barrier()
        target = None if cfg.steps is None else start_step + cfg.steps
        saver = Saver(root, job, model, hybrid, opt, client, layout, lineage, target_step=target, epochs=epochs)
        # Only the local launcher asks for the agreed stop (a store round trip per step); torchrun signals every
        # worker.
        stoppable = root is not None and "TORCHELASTIC_RUN_ID" not in os.environ
        stopper = GracefulStop(trainers_store(), j) if stoppable else None
        # Every trainer profiles the same window (a profiled trainer is slower: the others would wait in
        # collectives). Not with PS tables: a trainer crashed (SIGSEGV) under torch.profiler with RPCs in flight
        # (decision 0014).
        profiler = None
        planned = _planned_steps(cfg, job, epochs, start_step)
        if planned is not None and planned >= 4 and hybrid.ps is None and not cfg.pipeline:
            profiler = StepProfiler(min(10, planned // 4), min(10, max(1, planned // 4)))
        # Trainer 0 logs the job's steps: its samples/s counts every trainer's, and the others run the same steps.
        # Closed however the run ends: a failed run keeps the steps it logged.
        sink: MetricsSink = cleanup.enter_context(
            contextlib.closing(open_sinks(cfg.log_dir, first_step=start_step) if j == 0 else Sinks())
        )
        loop: TrainLoop | PipelinedTrainLoop = TrainLoop(dmp, hybrid, opt, device, profiler)
        if cfg.pipeline:
            loop = PipelinedTrainLoop(dmp, hybrid, opt, device)
        timeline = _Timeline(profiler, job.trainers)
        return cls(
            j, client, job, cfg, layout["batch_size"], device, dmp, hybrid, executed, saver, stopper, sink, loop,
            timeline, memory_before, epochs, start_step, resumed_from, start_step,
        )  # fmt: skip

    def train(self) -> None:
        """The steps: each one recorded, evaluated and checkpointed as asked, until the data or the steps end or a
        stop is agreed."""
        cfg, timeline = self.cfg, self.timeline
        progress = progress_bar(cfg) if (self.j == 0 and cfg.progress) else None
        total = _planned_steps(cfg, self.job, self.epochs, self.start_step)
        task = progress.add_task("train", total=total, loss=float("nan"), rate=0.0, stale=0) if progress else None
        timeline.started_s = time.perf_counter()
        # The loop's start on the machine-wide monotonic clock: places each step's t_s beside other processes' samples.
        self.started_monotonic_s = time.monotonic()
        try:
            if progress:
                progress.start()
            batches = training_batches(
                self.job.spec, cfg, self.batch_size, epochs=self.epochs, skip=self.start_step, bad_rows=self.bad_rows
            )
            for stats in self.loop.run(batches):
                self.step += 1
                publish_progress(self.step)  # the launcher names a trainer that stops advancing
                rate = timeline.record(self.step, self.step - self.start_step - 1, stats)
                self.sink.log_step(StepRecord.of(self.step, stats, samples_per_s=rate, t_s=timeline.history[-1]["t_s"]))
                if progress:
                    progress.update(task, advance=1, loss=ema(timeline.losses), rate=rate, stale=stats.staleness)
                if self._after_step():
                    break
            self.hybrid.flush()
            # Training throughput: the evaluations along the way (they would halve it at eval_every=1) and the
            # profiled steps are not training.
            self.elapsed_s = time.perf_counter() - timeline.started_s - timeline.excluded_s
        finally:
            if progress:
                progress.stop()
        dist.barrier()  # every trainer's pushes are applied before the usage report and the checkpoint

    def _after_step(self) -> bool:
        """The evaluation and checkpoint due after this step (not training time); whether a stop was agreed."""
        cfg, step = self.cfg, self.step
        # Not after the last step: the final evaluation and checkpoint follow it (an epoch's end is not known early).
        within = cfg.steps is None or step < self.start_step + cfg.steps
        if cfg.eval_every and step % cfg.eval_every == 0 and within:
            eval_started = time.perf_counter()
            self.hybrid.flush()
            dist.barrier()  # every trainer's pushes are applied before anyone evaluates
            held_out = held_out_batches(self.job.spec, cfg, self.batch_size, bad_rows=self.bad_rows)
            self.timeline.history[-1].update(evaluate(self.loop.scoring_model(), held_out, self.device))
            self.sink.log_eval(step, self.timeline.history[-1])
            self.timeline.excluded_s += time.perf_counter() - eval_started
        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and within:
            self.timeline.excluded_s += self.saver.save(step)
        if self.stopper is not None and self.stopper.after_step(step):
            self.stopped_by = self.stopper.reason
            return True
        return False

    def finish(self) -> dict[str, Any] | None:
        """The last checkpoint and the final evaluation; on trainer 0, the run's summary."""
        cfg, job, step = self.cfg, self.job, self.step
        if step == self.start_step and self.stopped_by is None:
            # No training step at all: the data gave some trainer no full batch (every trainer stops together).
            # Said here, for what it is: the evaluation after it would only find no held-out data either.
            where = "after the resumed step" if self.start_step else "for every trainer"
            raise PlannerError(
                f"{cfg.data}: the data holds no full batch of {self.batch_size:,} samples {where} "
                f"({job.trainers} trainers read their own share of the rows)",
                fixes=("use a smaller --batch-size, fewer --trainers or more data",),
            )
        ps_servers: list[dict[str, Any]] = []
        if self.j == 0 and self.memory_before is not None and self.hybrid.ps is not None:
            planned = planned_server_bytes(job.spec, job.tables, job.topology)
            usage = server_usage(self.client.metrics(), self.memory_before, self.client.memory(), planned)
            ps_servers = [u.to_dict() for u in usage]
        # Before the evaluation: an evaluation that fails (e.g. no held-out data left) loses nothing.
        if self.saver.last_step != step:
            self.saver.save(step)
        held_out = held_out_batches(job.spec, cfg, self.batch_size, bad_rows=self.bad_rows)
        result = evaluate(self.loop.scoring_model(), held_out, self.device)
        self.sink.log_eval(step, result)
        if self.timeline.history:
            self.timeline.history[-1].update(result)
        bad_rows = bad_rows_summary(job.spec, cfg, self.bad_rows)  # every trainer: collectives
        return self._summary(result, ps_servers, bad_rows) if self.j == 0 else None

    def _summary(
        self, result: dict[str, Any], ps_servers: list[dict[str, Any]], bad_rows: dict[str, Any] | None
    ) -> dict[str, Any]:
        cfg, job, hybrid, timeline = self.cfg, self.job, self.hybrid, self.timeline
        tail = timeline.losses[-max(1, len(timeline.losses) // 10) :]
        steps_done = self.step - self.start_step
        elapsed = self.elapsed_s
        return {
            **result,
            "teacher_auc": result.get("teacher_auc"),
            "loss": sum(tail) / len(tail) if tail else float("nan"),
            "samples_per_s": (timeline.samples - timeline.excluded_samples) / elapsed if elapsed > 0 else 0.0,
            "step_ms": _median(timeline.unprofiled(timeline.step_ms)),
            "step_breakdown_ms": timeline.breakdown_ms(hybrid.ps is not None),
            "wall_step_ms": elapsed * 1e3 / max(1, steps_done - timeline.excluded_steps),
            "batch_size": self.batch_size * job.trainers,
            "steps": steps_done,
            "epochs": None if cfg.data == "synthetic" else cfg.passes,
            "epoch_steps": list(self.epochs.lengths),
            "first_step": self.start_step,
            "resumed_from_step": self.resumed_from,
            "last_step": self.step,
            "checkpoint": str(self.saver.last.path) if self.saver.last is not None else None,
            "stopped_by": self.stopped_by,
            "staleness": cfg.effective_staleness,
            "staleness_max_seen": hybrid.staleness_max_seen,
            "mode": cfg.mode.value,
            "pipelined": cfg.pipeline,
            "hyper_parameters": hyper_parameters(cfg, job.spec, job.trainers),
            "trainers": job.trainers,
            "servers": job.servers if hybrid.ps is not None else 0,
            "ps_tables": [c.name for c in hybrid.ps_tables],
            "local_tables": [c.name for c in hybrid.local_tables],
            "executed_plan": self.executed,
            "executed_matches_plan": self.executed == planned_execution(job.tables, job.spec, job.topology),
            # torch's dtype of the dense gradients' all-reduce (a DDP compression hook narrows it)
            "dense_all_reduce": dense_all_reduce_dtype(self.dmp),
            "ps_delay_ms": cfg.ps_delay_ms,
            "ps_wire": cfg.ps_wire.value,
            "ps_capacity": cfg.ps_capacity.value,
            "id_space": cfg.teacher_rows_scale,
            "ps_servers": ps_servers,
            "data": cfg.data,
            "bad_rows": bad_rows,
            "seed": cfg.seed,
            "started_monotonic_s": self.started_monotonic_s,
            "history": timeline.history,
        }


def _device(j: int, job: Job) -> torch.device:
    """Trainer ``j``'s device: GPU ``j % per_host`` of its host, as in the plan (its place on its node under
    torchrun), else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    per_host = len(job.topology.trainers[0].gpus)  # trainer_group told TorchRec the plan's nodes
    local = j % per_host if job.local_trainer is None else job.local_trainer
    device = torch.device("cuda", local % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def _planned_steps(cfg: TrainConfig, job: Job, epochs: Epochs, start_step: int) -> int | None:
    """The steps this run will train: ``--steps``, else (data files) the epochs left at the counted rows' steps per
    epoch, an estimate: an epoch ends when the first trainer runs out (None when the rows were not counted)."""
    if cfg.steps is not None:
        return cfg.steps
    if not cfg.data_rows:
        return None
    per_epoch = cfg.data_rows // (job.trainers * trainer_batch_size(cfg, job.spec, job.trainers))
    epoch, within = epochs.position(start_step)
    return max(0, (cfg.passes - epoch) * per_epoch - within)


def _steps_left(cfg: TrainConfig, job: Job, state: dict[str, Any], start_step: int, epochs: Epochs) -> int | None:
    """The steps a resumed run trains: ``--steps`` is the job's total, so that the same command, run again after a
    crash, trains what was asked; after a torchrun restart, the run goes on to the step its first attempt was to
    reach (the same total). Without ``--steps`` (data files), it trains to the end of ``--epochs``."""
    if cfg.steps is None and not (job.restarted and state.get("target_step") is not None):
        epoch, _ = epochs.position(start_step)
        if epoch >= cfg.passes:
            raise PlannerError(
                f"--resume: the newest checkpoint (step {start_step:,}) ends epoch {epoch}, which the job's "
                f"--epochs {cfg.passes} already reaches",
                fixes=(f"pass --epochs above {epoch} to train on",),
            )
        return None
    target = int(state.get("target_step") or cfg.steps or 0) if job.restarted else int(cfg.steps or 0)
    if target <= start_step:
        raise PlannerError(
            f"--resume: the newest checkpoint is at step {start_step:,}, which the job's --steps {target:,} "
            "already reaches (--steps counts the job's steps, resumed ones too)",
            fixes=(f"pass --steps above {start_step:,} to train on",),
        )
    return target - start_step


def _median(xs: list[float]) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[len(s) // 2]
