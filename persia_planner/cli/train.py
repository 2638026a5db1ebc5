"""``persia train``: plan (or read) a placement and train with it, on this machine or under torchrun.

Options, plan and inputs are checked before torch is imported; the engine is :mod:`persia_planner.modules.train.engine`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

from persia_planner.cli.app import edge, note
from persia_planner.cli.run_options import ModelOption, PsWireOption, StalenessOption, TopologyOption
from persia_planner.cli.train_options import (
    AdaptMaxOption,
    AdaptOption,
    AdaptThresholdOption,
    AdaptWindowOption,
    AsJsonOption,
    BatchSizeOption,
    CheckpointEveryOption,
    CheckpointOption,
    DataOption,
    DataWorkersOption,
    DenseLrOption,
    DenseOptimizerOption,
    EarlyStopMetricOption,
    EarlyStopOption,
    EpochsOption,
    EvalBatchesOption,
    EvalDataOption,
    EvalEveryOption,
    EvalSplitOption,
    IdSpaceOption,
    KeepOption,
    LogDirOption,
    LrScheduleOption,
    ModeOption,
    NodeHostOption,
    OnBadRowOption,
    OverwriteOption,
    PipelineOption,
    PlanPathOption,
    PsCapacityOption,
    PsDelayMsOption,
    ResumeOption,
    SchemaOption,
    SeedOption,
    ShuffleBufferOption,
    SparseEpsOption,
    SparseLrOption,
    SparseOptimizerOption,
    SparseWeightDecayOption,
    SsdDirOption,
    StepsOption,
    TrainersOption,
)
from persia_planner.errors import PlannerError

if TYPE_CHECKING:
    from persia_planner.model.specs import ModelSpec
    from persia_planner.modules.train.config import TrainConfig
    from persia_planner.plan.plan import Plan
    from persia_planner.topology.graph import Topology

__all__ = ["train_command"]


def train_command(
    model: ModelOption = None,
    topology: TopologyOption = None,
    plan_path: PlanPathOption = None,
    data: DataOption = "synthetic",
    schema: SchemaOption = None,
    on_bad_row: OnBadRowOption = None,
    data_workers: DataWorkersOption = 0,
    staleness: StalenessOption = None,
    mode: ModeOption = "hybrid",
    steps: StepsOption = None,
    epochs: EpochsOption = None,
    eval_split: EvalSplitOption = None,
    eval_data: EvalDataOption = None,
    shuffle_buffer: ShuffleBufferOption = 65_536,
    batch_size: BatchSizeOption = None,
    dense_lr: DenseLrOption = None,
    dense_optimizer: DenseOptimizerOption = None,
    pipeline: PipelineOption = False,
    sparse_lr: SparseLrOption = None,
    sparse_optimizer: SparseOptimizerOption = None,
    sparse_weight_decay: SparseWeightDecayOption = 0.0,
    sparse_eps: SparseEpsOption = None,
    lr_schedule: LrScheduleOption = "constant",
    eval_every: EvalEveryOption = 0,
    trainers: TrainersOption = 2,
    eval_batches: EvalBatchesOption = None,
    early_stop: EarlyStopOption = 0,
    early_stop_metric: EarlyStopMetricOption = "auc",
    checkpoint: CheckpointOption = None,
    checkpoint_every: CheckpointEveryOption = 0,
    keep: KeepOption = 2,
    resume: ResumeOption = False,
    overwrite: OverwriteOption = False,
    ps_delay_ms: PsDelayMsOption = 0.0,
    ps_wire: PsWireOption = None,
    id_space: IdSpaceOption = 0.02,
    ps_capacity: PsCapacityOption = "planned",
    seed: SeedOption = 0,
    node_host: NodeHostOption = None,
    log_dir: LogDirOption = None,
    ssd_dir: SsdDirOption = None,
    adapt: AdaptOption = False,
    adapt_threshold: AdaptThresholdOption = 0.10,
    adapt_max: AdaptMaxOption = 2,
    adapt_window: AdaptWindowOption = 20,
    as_json: AsJsonOption = False,
) -> None:
    """Train the model's DLRM or DCN-v2 with the plan: local tables sync (fbgemm), PS tables async (bounded
    staleness), dense DDP.

    With no options: the bundled small DLRM on synthetic click data with a known best AUC, 2 parameter servers and
    2 trainers on this machine. Under torchrun, each node is one or more topology hosts (--node-host, else by node
    rank): it runs their parameter servers and their trainer devices' trainers.
    """
    from persia_planner import load_model, load_topology
    from persia_planner import plan as make_plan
    from persia_planner.model.data_schema import load_data_schema
    from persia_planner.model.specs import DType, with_run_options
    from persia_planner.modules.train.config import TrainConfig
    from persia_planner.modules.train.run_model import run_model
    from persia_planner.paths import DEFAULT_MODEL, DEFAULT_TOPOLOGY
    from persia_planner.plan.plan import load_plan
    from persia_planner.plan.validation import require_plan_agrees

    with edge():
        model_path = model or DEFAULT_MODEL
        topology_path = topology or DEFAULT_TOPOLOGY
        model_spec = load_model(model_path)
        topo = load_topology(topology_path)
        the_plan = load_plan(plan_path) if plan_path is not None else None
        # K and the wire default to what the plan was priced for, so that a plan runs as planned unless told not to.
        planned = with_run_options(
            model_spec,
            staleness=the_plan.staleness if the_plan is not None else None,
            ps_wire=the_plan.ps_wire_dtype.value if the_plan is not None and the_plan.ps_wire_dtype else None,
        )
        wire = planned.ps_wire_dtype if ps_wire is None else DType.parse(ps_wire, "--ps-wire")
        # Options, plan and inputs are all checked before torch is imported (~7 s with torchrec): a mistake is
        # answered at once, as `persia plan` answers.
        cfg = TrainConfig(
            steps=steps,
            epochs=epochs,
            eval_split=eval_split,
            eval_data=eval_data,
            shuffle_buffer=shuffle_buffer,
            batch_size=batch_size,
            staleness=planned.staleness if staleness is None else staleness,
            mode=mode,
            trainers=trainers,
            data=data,
            schema=load_data_schema(schema) if schema is not None else None,
            on_bad_row=on_bad_row,
            data_workers=data_workers,
            eval_batches=eval_batches,
            eval_every=eval_every,
            early_stop=early_stop,
            early_stop_metric=early_stop_metric,
            pipeline=pipeline,
            sparse_weight_decay=sparse_weight_decay,
            sparse_eps=sparse_eps,
            lr_schedule=lr_schedule,
            **{
                name: value
                for name, value in (
                    ("dense_lr", dense_lr),
                    ("dense_optimizer", dense_optimizer),
                    ("sparse_lr", sparse_lr),
                    ("sparse_optimizer", sparse_optimizer),
                )
                if value is not None  # TrainConfig's defaults otherwise
            },
            ps_delay_ms=ps_delay_ms,
            ps_wire=wire,
            checkpoint=str(checkpoint) if checkpoint is not None else None,
            checkpoint_every=checkpoint_every,
            keep=keep,
            resume=resume,
            overwrite=overwrite,
            seed=seed,
            progress=not as_json,
            teacher_rows_scale=id_space,
            ps_capacity=ps_capacity,
            log_dir=str(log_dir) if log_dir is not None else None,
            ssd_dir=str(ssd_dir.absolute()) if ssd_dir is not None else None,  # resolve() raises on a loop
            adapt=adapt,
            adapt_threshold=adapt_threshold,
            adapt_max=adapt_max,
            adapt_window=adapt_window,
        )
        # The run's model: priced and planned (below, without --plan) for the K and wire it trains with.
        model_spec = run_model(model_spec, cfg)
        if the_plan is None:
            the_plan = make_plan(model_spec, topo, seed=seed)
        else:
            require_plan_agrees(the_plan, model_spec, str(plan_path))
        # The collectives run in the precisions the plan chose (or the model named): the run's model carries them.
        # Where the planner chose them (the model left them auto, no --qcomms named them), --adapt's re-plans choose
        # them again.
        cfg = dataclasses.replace(cfg, adapt_qcomms=model_spec.qcomms is None and the_plan.qcomms_chosen)
        model_spec = the_plan.priced_model(model_spec)
        cfg = _checked_start(cfg, model_spec, the_plan, topo, node_host)
        result = _run(cfg, model_spec, the_plan, topo, node_host)
        if result is not None:  # None: a torchrun process other than the first trainer
            from persia_planner.cli.run_summary import report_run

            report_run(result, model_spec, topo, the_plan, cfg, as_json=as_json)
    from persia_planner.modules.launcher.lifecycle import end_torchrun_worker

    end_torchrun_worker()


def _checked_start(
    cfg: TrainConfig, model: ModelSpec, plan: Plan, topology: Topology, node_host: str | None
) -> TrainConfig:
    """``cfg`` for this process after every check that can run before torch is imported: the plan against the
    topology, the training stack, and under torchrun this process's role, a restart's resume and the inputs."""
    from persia_planner.modules.train.run_inputs import check_before_start
    from persia_planner.modules.train.torchrun_start import torchrun_start
    from persia_planner.modules.train_extra import require_training_stack
    from persia_planner.plan.validation import require_valid

    require_valid(plan, model, topology)
    with_ps = bool(plan.remote_tables())
    require_training_stack("persia train")  # first: the data's checks read Parquet with pyarrow
    if "TORCHELASTIC_RUN_ID" in os.environ:  # the world against the plan's hosts, a restart's resume, the inputs
        return torchrun_start(cfg, model, topology, with_ps=with_ps, node_host=node_host).cfg
    if node_host is not None:
        raise PlannerError(
            "--node-host (or PERSIA_HOST) is set but this is not a torchrun process",
            fixes=("launch with torchrun", "unset PERSIA_HOST to train on this machine"),
        )
    return check_before_start(cfg, model, with_ps=with_ps)


def _run(
    cfg: TrainConfig, model: ModelSpec, plan: Plan, topology: Topology, node_host: str | None
) -> dict[str, Any] | None:
    """Train: under torchrun this process's part of the job, else the whole job on this machine (announced on the
    terminal unless the run prints JSON)."""
    import logging

    from persia_planner.modules.train.engine import train_local, train_torchrun

    logging.basicConfig(level=logging.WARNING)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return train_torchrun(cfg, model, dict(plan.tables), topology=topology, node_host=node_host)
    remote = plan.remote_tables()
    servers = max(1, len(topology.servers))
    if cfg.progress and remote:
        note(
            f"training {model.name} ({len(model.tables)} tables, {len(remote)} on the parameter servers: "
            f"{', '.join(remote)}) with {cfg.trainers} trainers and {servers} servers, "
            f"{cfg.mode} mode, staleness {cfg.effective_staleness}",
            to_stderr=False,
        )
    elif cfg.progress:  # the plan keeps every table local: nothing trains asynchronously, whatever the mode
        note(
            f"training {model.name} ({len(model.tables)} tables, all local: no table on the parameter servers, so "
            f"every table trains synchronously and the staleness does not apply) with {cfg.trainers} trainers",
            to_stderr=False,
        )
    return train_local(cfg, model, dict(plan.tables), servers=servers, topology=topology)
