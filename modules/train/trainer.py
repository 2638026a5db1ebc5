"""One trainer of a run, from start to summary: its device and model, a resume, the steps with their metrics,
evaluations and checkpoints, and the summary trainer 0 returns (:func:`run_trainer`, the body of every trainer process
of ``persia train``, on this machine or under torchrun).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from persia_planner.errors import PlannerError
from persia_planner.modules.embedding.hybrid_set import TrainedTables
from persia_planner.modules.embedding.model_parallel import dense_all_reduce_dtype, distribute, executed_plan
from persia_planner.modules.launcher.launch import trainers_store
from persia_planner.modules.launcher.progress import publish_progress
from persia_planner.modules.step_breakdown import StepProfiler
from persia_planner.modules.stopping import GracefulStop
from persia_planner.modules.train.adapt import Adapter
from persia_planner.modules.train.batch_stream import (
    BadRowTally,
    Epochs,
    bad_rows_summary,
    evaluate,
    held_out_batches,
    planned_steps,
    steps_left,
    training_batches,
    with_data_statistics,
)
from persia_planner.modules.train.best_checkpoint import EarlyStopMetric, EarlyStopping, forget_best
from persia_planner.modules.train.config import PsCapacity, TrainConfig
from persia_planner.modules.train.job import Job, trainer_group
from persia_planner.modules.train.job_checkpoints import PS_DIR, new_lineage
from persia_planner.modules.train.loop import (
    TrainLoop,
    build_job_model,
    make_optimizer,
    scheduled_optimizer,
    sparse_optimizer,
)
from persia_planner.modules.train.lr_schedule import ScheduledRates
from persia_planner.modules.train.metrics_log import MetricsSink, Sinks, StepRecord, open_sinks
from persia_planner.modules.train.migration import migrated_state, saved_plan, seed_moved_tables
from persia_planner.modules.train.pipeline import PipelinedTrainLoop, PipelineStep
from persia_planner.modules.train.ps_usage import planned_server_bytes, server_usage, warm_up
from persia_planner.modules.train.run_inputs import dlrm_embedding_dim, hyper_parameters, id_universe
from persia_planner.modules.train.run_refit import refit_so_far
from persia_planner.modules.train.terminal import ema, progress_bar
from persia_planner.modules.train.timeline import Timeline, median
from persia_planner.modules.train.trainer_state import (
    Saver,
    check_resume,
    data_layout,
    load_trainer_state,
    require_dense_optimizer,
)
from persia_planner.placement.memory import PS_MAX_CAPACITY
from persia_planner.placement.shards import TablePlacement
from persia_planner.plan.executability import planned_execution
from persia_planner.plan.plan import placement_to_dict

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
        while run.migration is not None:  # --adapt: every trainer agreed to move to another plan
            run = run.migrate(run.migration, cleanup)
            run.train()
        return run.finish()


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
    hybrid: TrainedTables
    executed: dict[str, Any]
    saver: Saver
    stopper: GracefulStop | None
    sink: MetricsSink
    loop: TrainLoop | PipelinedTrainLoop
    timeline: Timeline
    memory_before: dict[str, Any] | None
    epochs: Epochs
    adapter: Adapter
    start_step: int = 0
    resumed_from: int | None = None
    step: int = 0
    first_step: int = 0  # the step the run started after (start_step: the current plan's, after a migration)
    stopped_by: str | None = None
    elapsed_s: float = 0.0
    started_monotonic_s: float = 0.0
    bad_rows: BadRowTally = field(default_factory=BadRowTally)
    migration: dict[str, TablePlacement] | None = None  # the plan every trainer agreed to move to (--adapt)
    rates: ScheduledRates | None = None  # --lr-schedule over the optimizer the steps call
    stopping: EarlyStopping = field(default_factory=lambda: EarlyStopping(EarlyStopMetric.AUC, 0))
    evaluated: tuple[int, dict[str, Any]] | None = None  # the last evaluation: its step and results

    @classmethod
    def start(
        cls, j: int, client: Any, job: Job, cleanup: contextlib.ExitStack, *, previous: _TrainerRun | None = None
    ) -> _TrainerRun:
        """Trainer ``j``'s device, model (sharded by DMP) and optimizers, resumed from a checkpoint if asked (under
        another plan than the checkpoint's: its tables migrated, :mod:`.migration`). ``previous``: the run of the
        plan this one replaces (a migration): its metrics, timeline and stop go on."""
        cfg, spec = job.cfg, job.spec
        layout = data_layout(cfg, spec, job.trainers)
        sparse_opt = sparse_optimizer(cfg, spec)
        device = _device(j, job)
        memory_before = previous.memory_before if previous is not None else None
        if job.servers and previous is None:  # the servers' memory before this run's tables: the growth is the run's
            if j == 0:
                warm_up(client, dlrm_embedding_dim(spec), WARM_UP_IDS, sparse_opt.ps())
                memory_before = client.memory()
            dist.barrier()
        capacity = None
        if cfg.ps_capacity is PsCapacity.UNBOUNDED:  # every id the data can draw, on every server: nothing is evicted
            capacity = {name: min(ids, PS_MAX_CAPACITY) for name, ids in id_universe(spec, cfg).items()}
        build_started = time.perf_counter()
        model, hybrid = build_job_model(job, client, sparse_opt, device=device, capacity=capacity)
        # Pipelined, DMP shards the step module around the model (TorchRec's pipeline calls it with the batch); the
        # model itself is sharded in place, and the checkpoints and evaluations read it as unpipelined runs do.
        # The collectives' precisions are the plan's (the run's spec is the model as the plan was priced).
        step_module = PipelineStep(model) if cfg.pipeline else model
        dmp = distribute(step_module, job.tables, job.topology, device=device, qcomms=job.spec.qcomms)
        executed = executed_plan(model, job.topology)
        opt = make_optimizer(model, cfg, sparse_opt)
        build_s = time.perf_counter() - build_started
        root = Path(cfg.checkpoint) if cfg.checkpoint else None
        lineage, start_step, resumed_from, epochs = new_lineage(), 0, None, Epochs()
        if cfg.resume and root is not None:
            chosen = Path(job.resume_from) if job.resume_from else None
            ckpt, state = check_resume(root, hybrid.ps is not None, log.warning if j == 0 else None, chosen=chosen)
            require_dense_optimizer(state, cfg.dense_optimizer.value, ckpt.path)
            saved = state
            old_tables = saved_plan(ckpt.path)
            moves = None
            if old_tables is not None and old_tables != job.tables:  # another plan: its tables move (.migration)
                state, moves, whole = migrated_state(
                    ckpt.path, state, old_tables, job.tables, hybrid, opt, sparse_opt.kind
                )
            start_step = resumed_from = load_trainer_state(ckpt, state, model, hybrid, opt, layout)
            lineage = ckpt.lineage or lineage
            epochs = Epochs([int(n) for n in state.get("epoch_lengths", [])])
            cfg = replace(cfg, steps=steps_left(cfg, job.restarted, state, start_step, epochs))
            if j == 0 and hybrid.ps is not None and moves is None:
                client.load(ckpt.path / PS_DIR)
            elif j == 0 and hybrid.ps is not None and moves is not None:
                if moves.ps_to_ps:
                    client.load(ckpt.path / PS_DIR, tables=moves.ps_to_ps)
                seed_moved_tables(client, moves.local_to_ps, saved["local"], whole, sparse_opt.kind)
            dist.barrier()
        if j == 0 and root is not None and cfg.resume and not cfg.early_stop:
            forget_best(root, lineage)  # this run ends on its last checkpoint: predict must not take an older best
        target = None if cfg.steps is None else start_step + cfg.steps
        saver = Saver(root, job, model, hybrid, opt, client, layout, lineage, target_step=target, epochs=epochs)
        # The steps call the dense and the tables' optimizers together, their rates on the schedule from here.
        stepped, rates = scheduled_optimizer(cfg, spec, job.trainers, opt, dmp, start_step, target)
        if previous is not None:
            run = previous._next(job, cfg, dmp, hybrid, executed, saver, stepped, epochs, start_step, build_s)
            return replace(run, rates=rates)
        # Only the local launcher asks for the agreed stop (a store round trip per step); torchrun signals every
        # worker.
        stoppable = root is not None and "TORCHELASTIC_RUN_ID" not in os.environ
        stopper = GracefulStop(trainers_store(), j) if stoppable else None
        # Every trainer profiles the same window (a profiled trainer is slower: the others would wait in
        # collectives). Not with PS tables: a trainer crashed (SIGSEGV) under torch.profiler with RPCs in flight
        # (decision 0014).
        profiler = None
        planned = planned_steps(cfg, spec, job.trainers, epochs, start_step)
        if planned is not None and planned >= 4 and hybrid.ps is None and not cfg.pipeline:
            profiler = StepProfiler(min(10, planned // 4), min(10, max(1, planned // 4)))
        # Trainer 0 logs the job's steps: its samples/s counts every trainer's, and the others run the same steps.
        # Closed however the run ends: a failed run keeps the steps it logged.
        sink: MetricsSink = cleanup.enter_context(
            contextlib.closing(open_sinks(cfg.log_dir, first_step=start_step) if j == 0 else Sinks())
        )
        loop = _loop(cfg, dmp, hybrid, stepped, device, profiler)
        timeline = Timeline(profiler, job.trainers)
        adapter = Adapter(cfg, spec, job.topology, job.tables, j, start_step, sink)
        adapter.started(start_step, build_s)
        if profiler is not None:  # its steps run slower: measurement windows start after them
            adapter.profiled_through = start_step + profiler.start + profiler.count
        return cls(
            j, client, job, cfg, layout["batch_size"], device, dmp, hybrid, executed, saver, stopper, sink, loop,
            timeline, memory_before, epochs, adapter, start_step, resumed_from, start_step, start_step, rates=rates,
            stopping=EarlyStopping.of_run(cfg.early_stop_metric, cfg.early_stop, root, lineage),
        )  # fmt: skip

    def _next(
        self,
        job: Job,
        cfg: TrainConfig,
        dmp: Any,
        hybrid: TrainedTables,
        executed: dict[str, Any],
        saver: Saver,
        opt: Any,
        epochs: Epochs,
        start_step: int,
        build_s: float,
    ) -> _TrainerRun:
        """The run of the next plan (a migration): its model, and this run's metrics, timeline, stop and tallies.
        Its steps are not profiled: the first plan's shares of the step are not the next one's, so from here on the
        windows and the summary break the step down as an unprofiled run does."""
        self.adapter.started(start_step, build_s)
        self.timeline.profiler = None
        return replace(
            self,
            job=job,
            cfg=cfg,
            dmp=dmp,
            hybrid=hybrid,
            executed=executed,
            saver=saver,
            loop=_loop(cfg, dmp, hybrid, opt, self.device, None),
            epochs=epochs,
            start_step=start_step,
            step=start_step,
            migration=None,
        )

    def train(self) -> None:
        """The steps: each one recorded, evaluated and checkpointed as asked, until the data or the steps end or a
        stop is agreed."""
        cfg, timeline = self.cfg, self.timeline
        progress = progress_bar(cfg) if (self.j == 0 and cfg.progress) else None
        total = planned_steps(cfg, self.job.spec, self.job.trainers, self.epochs, self.start_step)
        task = progress.add_task("train", total=total, loss=float("nan"), rate=0.0, stale=0) if progress else None
        if not timeline.running:  # a migration's next plan goes on with the run's clock
            timeline.started_s, timeline.running = time.perf_counter(), True
            # The loop's start on the machine-wide monotonic clock: places each step's t_s beside other processes'
            # samples.
            self.started_monotonic_s = time.monotonic()
        try:
            if progress:
                progress.start()
            batches = training_batches(
                self.job.spec, cfg, self.batch_size, epochs=self.epochs, skip=self.start_step, bad_rows=self.bad_rows
            )
            for stats in self.loop.run(batches):
                self.step += 1
                if self.rates is not None:
                    self.rates.step()
                publish_progress(self.step)  # the launcher names a trainer that stops advancing
                rate = timeline.record(self.step, self.step - self.first_step - 1, stats)
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
        # Not after the last step: the final evaluation and checkpoint follow it.
        within = cfg.steps is None or step < self.start_step + cfg.steps
        last_of_data = step == sum(self.epochs.lengths) and len(self.epochs.lengths) >= cfg.passes
        if (
            within
            and not last_of_data
            and ((cfg.eval_every and step % cfg.eval_every == 0) or self.epochs.ends_at(step))
        ):
            eval_started = time.perf_counter()
            result = self._evaluate()
            self.timeline.history[-1].update(result)
            self.stopping.keep_best(step, result, self.saver, publish=self.j == 0)
            self.timeline.excluded_s += time.perf_counter() - eval_started
        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and within and self.saver.last_step != step:
            self.timeline.excluded_s += self.saver.save(step)
            self._refit_profile()
        if self.stopping.should_stop:  # every trainer saw the same evaluations
            self.stopped_by = "early stop"
            return True
        if self.stopper is not None and self.stopper.after_step(step):
            self.stopped_by = self.stopper.reason
            return True
        if within and not last_of_data:  # --adapt: a window's end may move every trainer to another plan, here
            steps_left = None if cfg.steps is None else self.start_step + cfg.steps - step
            with_ps = self.hybrid.ps is not None
            measure = functools.partial(self.timeline.window, with_ps=with_ps, last_step=step)
            self.migration = self.adapter.after_step(step, measure, steps_left, self.saver.last_save_s)
            return self.migration is not None
        return False

    def migrate(self, tables: dict[str, TablePlacement], cleanup: contextlib.ExitStack) -> _TrainerRun:
        """Move the job to ``tables`` (every trainer, at the same step): a checkpoint of this step, this plan's
        model torn down (its PS tables dropped from the servers, which stay up), and the next plan's built and
        resumed from that checkpoint, exactly as ``--resume`` under the new plan would (:mod:`.migration`). The
        step counter, epochs, metrics and timeline go on; the migration's seconds are not training time."""
        started = time.perf_counter()
        self.hybrid.flush()
        if self.saver.last_step != self.step:
            self.saver.save(self.step)
            self._refit_profile()
        shared = [str(self.saver.last.path) if self.saver.last is not None else None]  # trainer 0 published it
        dist.broadcast_object_list(shared, src=0)
        if shared[0] is None:  # no --checkpoint: TrainConfig refuses --adapt without one
            raise PlannerError("--adapt: a migration needs --checkpoint DIR to go through")
        if self.hybrid.ps is not None:
            # Every trainer: the next model registers these tables again on this client, whenever this one is freed.
            self.hybrid.release()
        if self.j == 0 and self.hybrid.ps is not None:
            # A resume starts on servers without the tables; so does a migration: the next plan registers its own
            # and loads the ones it keeps there from the checkpoint.
            for config in self.hybrid.ps_tables:
                self.client.drop(config.name)
        dist.barrier()
        # The next plan's collectives are the adapter's (a re-plan may change them alone).
        spec = replace(self.job.spec, qcomms=self.adapter.current.qcomms)
        cfg = replace(self.job.cfg, resume=True)
        job = replace(self.job, spec=spec, tables=dict(tables), resume_from=shared[0], cfg=cfg)
        save_s = self.saver.last_save_s  # what the next decision prices a migration's checkpoint at
        # This plan's model goes before the next one is built: the saver holds it too (model, tables, optimizer).
        self.dmp = self.loop = self.hybrid = self.saver = None  # type: ignore[assignment]
        gc.collect()
        run = _TrainerRun.start(self.j, self.client, job, cleanup, previous=self)
        run.saver.last_save_s = save_s
        run.timeline.excluded_s += time.perf_counter() - started
        return run

    def _refit_profile(self) -> None:
        """Trainer 0, with ``--log-dir``: the model refitted to the steps so far, beside the logs."""
        if self.j == 0:
            refit_so_far(self.cfg, self.job, self.timeline, self.hybrid.ps is not None, self.step, self.start_step,
                         self.first_step)  # fmt: skip

    def finish(self) -> dict[str, Any] | None:
        """The last checkpoint and the final evaluation; on trainer 0, the run's summary."""
        cfg, job, step = self.cfg, self.job, self.step
        if step == self.first_step and self.stopped_by is None:
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
            self._refit_profile()
        if self.evaluated is not None and self.evaluated[0] == step:  # stopped early right after an evaluation
            result = self.evaluated[1]
        else:
            result = self._evaluate()
            self.stopping.keep_best(step, result, self.saver, publish=self.j == 0)
        if self.timeline.history:
            self.timeline.history[-1].update(result)
        bad_rows = bad_rows_summary(job.spec, cfg, self.bad_rows)  # every trainer: collectives
        if self.j != 0:
            return None
        best = self.stopping.best_results
        if (
            self.stopping.patience
            and self.saver.root is not None
            and best is not None
            and self.stopping.best_step != step
        ):
            # The run's model is the best evaluation's checkpoint (persia predict scores with it): its metrics head
            # the summary, the last evaluation's beside them.
            result = {**best, "final_evaluation": result}
        return self._summary(result, ps_servers, bad_rows)

    def _evaluate(self) -> dict[str, Any]:
        """An evaluation of the model as it is after this step, over every held-out row (every trainer)."""
        self.hybrid.flush()
        dist.barrier()  # every trainer's pushes are applied before anyone evaluates
        held_out = held_out_batches(self.job.spec, self.cfg, self.batch_size, bad_rows=self.bad_rows)
        result = evaluate(self.loop.scoring_model(), held_out, self.device)
        self.sink.log_eval(self.step, result)
        self.evaluated = (self.step, result)
        return result

    def _summary(
        self, result: dict[str, Any], ps_servers: list[dict[str, Any]], bad_rows: dict[str, Any] | None
    ) -> dict[str, Any]:
        cfg, job, hybrid, timeline = self.cfg, self.job, self.hybrid, self.timeline
        tail = timeline.losses[-max(1, len(timeline.losses) // 10) :]
        steps_done = self.step - self.first_step
        elapsed = self.elapsed_s
        return {
            **result,
            "teacher_auc": result.get("teacher_auc"),
            "loss": sum(tail) / len(tail) if tail else float("nan"),
            "samples_per_s": (timeline.samples - timeline.excluded_samples) / elapsed if elapsed > 0 else 0.0,
            "step_ms": median(timeline.unprofiled(timeline.step_ms)),
            "step_breakdown_ms": timeline.breakdown_ms(hybrid.ps is not None),
            "wall_step_ms": elapsed * 1e3 / max(1, steps_done - timeline.excluded_steps),
            "batch_size": self.batch_size * job.trainers,
            "steps": steps_done,
            "epochs": None if cfg.data == "synthetic" else cfg.passes,
            "epoch_steps": list(self.epochs.lengths),
            "first_step": self.first_step,
            "resumed_from_step": self.resumed_from,
            "last_step": self.step,
            "checkpoint": str(self.saver.last.path) if self.saver.last is not None else None,
            "stopped_by": self.stopped_by,
            "early_stopping": self.stopping.summary(),
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
            "ps_wire": cfg.ps_wire.torch_name,  # the summary's vocabulary: torch's
            "ps_capacity": cfg.ps_capacity.value,
            "id_space": cfg.teacher_rows_scale,
            "ps_servers": ps_servers,
            "data": cfg.data,
            "bad_rows": bad_rows,
            "seed": cfg.seed,
            "started_monotonic_s": self.started_monotonic_s,
            "plans": self.adapter.summary() if cfg.adapt else None,
            "final_plan": self._final_plan(),
            "history": timeline.history,
        }

    def _final_plan(self) -> dict[str, Any] | None:
        """After a migration, the plan the run ended on and its own steps (None: the run kept its first plan): what
        the launcher prices and refits, since the summary's ``step_ms`` spans every plan."""
        if self.start_step == self.first_step:
            return None
        final: dict[str, Any] = {
            "tables": {name: placement_to_dict(p) for name, p in self.job.tables.items()},
            "qcomms": None if self.job.spec.qcomms is None else self.job.spec.qcomms.to_dict(),
            "from_step": self.start_step,
            "step_ms": None,  # a migration at the last step: the plan ran no step of its own
            "step_breakdown_ms": None,
        }
        if self.step > self.start_step:
            window = self.timeline.window(self.step - self.start_step, self.hybrid.ps is not None, self.step)
            final |= {"step_ms": window.step_ms, "step_breakdown_ms": window.breakdown_ms}
        return final


def _loop(
    cfg: TrainConfig, dmp: Any, hybrid: TrainedTables, opt: Any, device: torch.device, profiler: Any
) -> TrainLoop | PipelinedTrainLoop:
    """The step loop of a run (TorchRec's pipeline with ``--pipeline``)."""
    if cfg.pipeline:
        return PipelinedTrainLoop(dmp, hybrid, opt, device)
    return TrainLoop(dmp, hybrid, opt, device, profiler)


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
