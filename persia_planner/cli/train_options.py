"""The options of ``persia train``, one ``Annotated`` alias each: typer reads each option's flag, bounds and help from
its alias in :func:`persia_planner.cli.train.train_command`'s signature (those ``persia plan`` takes too are
:mod:`.run_options`')."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from persia_planner.limits import MAX_BATCH_SIZE

__all__ = [
    "AdaptMaxOption",
    "AdaptOption",
    "AdaptThresholdOption",
    "AdaptWindowOption",
    "AsJsonOption",
    "BatchSizeOption",
    "CheckpointEveryOption",
    "CheckpointOption",
    "DataOption",
    "DataWorkersOption",
    "DenseLrOption",
    "DenseOptimizerOption",
    "EarlyStopMetricOption",
    "EarlyStopOption",
    "EpochsOption",
    "EvalBatchesOption",
    "EvalDataOption",
    "EvalEveryOption",
    "EvalSplitOption",
    "IdSpaceOption",
    "KeepOption",
    "LogDirOption",
    "LrScheduleOption",
    "ModeOption",
    "NodeHostOption",
    "OnBadRowOption",
    "OverwriteOption",
    "PipelineOption",
    "PlanPathOption",
    "PsCapacityOption",
    "PsDelayMsOption",
    "ResumeOption",
    "SchemaOption",
    "SeedOption",
    "ShuffleBufferOption",
    "SparseEpsOption",
    "SparseLrOption",
    "SparseOptimizerOption",
    "SparseWeightDecayOption",
    "SsdDirOption",
    "StepsOption",
    "TrainersOption",
]


PlanPathOption = Annotated[
    Path | None, typer.Option("--plan", help="plan.json to execute (default: plan MODEL on TOPOLOGY now)")
]

DataOption = Annotated[
    str,
    typer.Option(
        "--data",
        help="'synthetic', or 'criteo:PATH', 'parquet:PATH' or 'csv:PATH' (a file or a directory of files; "
        "Parquet and CSV columns mapped by model.yaml's data: or --schema)",
    ),
]

SchemaOption = Annotated[
    Path | None,
    typer.Option("--schema", help="YAML mapping a Parquet / CSV file's columns (label, dense, sparse), as data:"),
]

OnBadRowOption = Annotated[
    str | None,
    typer.Option(
        "--on-bad-row",
        help="a Parquet / CSV row with a NaN or infinite dense value or no label: fail (stop, naming the file, row "
        "and column), skip (leave it out, counted) or impute (the column's mean; a row without a label is left out) "
        "(default: the schema's on_bad_row, else fail)",
    ),
]

DataWorkersOption = Annotated[
    int,
    typer.Option(
        "--data-workers",
        min=0,
        help="DataLoader worker processes per trainer reading --data files (0: the trainer reads them itself)",
    ),
]

ModeOption = Annotated[str, typer.Option("--mode", help="hybrid (PS tables async, staleness K) or sync (K = 0)")]

StepsOption = Annotated[
    int | None,
    typer.Option(
        "--steps",
        min=1,
        help="the job's training steps per trainer (synthetic data: default 400; data files: at most this many, "
        "default every step of --epochs); with --resume the total too: a job resumed at step 50 with --steps 400 "
        "trains 350 more",
    ),
]

EpochsOption = Annotated[
    int | None,
    typer.Option(
        "--epochs",
        min=1,
        help="data files: passes over the training rows, each in its own seeded order: the files' blocks dealt anew "
        "to the trainers, the rows shuffled within --shuffle-buffer (default: with --steps 1; without, until an "
        "epoch's validation AUC is no better than the best before it, at most 10)",
    ),
]

EvalSplitOption = Annotated[
    float | None,
    typer.Option(
        "--eval-split",
        help="data files: the share of rows held out for validation, by a hash of each row (never trained on; "
        "default 0.05 without --eval-data)",
    ),
]

EvalDataOption = Annotated[
    str | None,
    typer.Option("--eval-data", help="validation files, as --data names them (KIND:PATH, the same kind and schema)"),
]

ShuffleBufferOption = Annotated[
    int, typer.Option("--shuffle-buffer", min=0, help="data files: rows each reader shuffles together (0: none)")
]

BatchSizeOption = Annotated[
    int | None,
    typer.Option(
        "--batch-size",
        min=1,
        max=MAX_BATCH_SIZE,
        help="samples per trainer and step (default: model's / trainers)",
    ),
]

DenseLrOption = Annotated[
    float | None,
    typer.Option("--dense-lr", help="learning rate of the dense optimizer (default: adam 0.001, adagrad and sgd 0.05)"),
]

DenseOptimizerOption = Annotated[
    str | None, typer.Option("--dense-optimizer", help="adam (default), adagrad or sgd (torch.optim)")
]

PipelineOption = Annotated[
    bool,
    typer.Option(
        "--pipeline",
        help="train through TorchRec's TrainPipelineSparseDist: the next batch's input all-to-all and the PS rows of "
        "the staged batches overlap the current step (pays on CUDA)",
    ),
]

SparseLrOption = Annotated[
    float | None, typer.Option("--sparse-lr", help="learning rate of the embedding tables (default 0.1)")
]

SparseWeightDecayOption = Annotated[
    float,
    typer.Option(
        "--sparse-weight-decay",
        min=0.0,
        help="decoupled weight decay of the embedding rows each step updates, local and PS tables alike: "
        "w * (1 - lr * decay) before the update (0: none, the default; decision 0023)",
    ),
]

SparseEpsOption = Annotated[
    float | None,
    typer.Option(
        "--sparse-eps",
        min=0.0,
        max=1.0,
        help="epsilon of the embedding tables' optimizer, local and PS tables alike (default 1e-3 for Adagrad and "
        "row-wise Adagrad: a rare id's steps stay in proportion to its gradient; 1e-8 for Adam; decision 0030)",
    ),
]

LrScheduleOption = Annotated[
    str,
    typer.Option(
        "--lr-schedule",
        help="every learning rate's schedule, dense and embedding tables: constant (default), warmup=STEPS (linear "
        "rise), cosine or linear (decay to 0 at the last step), or items joined, e.g. warmup=500,decay=cosine,min=0.1",
    ),
]

SparseOptimizerOption = Annotated[
    str | None,
    typer.Option(
        "--sparse-optimizer",
        help="rowwise_adagrad, adagrad, sgd or adam (CUDA or PS tables), for every table (default: model.yaml's)",
    ),
]

EvalEveryOption = Annotated[
    int,
    typer.Option(
        "--eval-every", min=0, help="also evaluate every N steps (always: at each epoch's end and at the end)"
    ),
]

TrainersOption = Annotated[int, typer.Option("--trainers", min=1, help="trainer processes on this machine")]

EvalBatchesOption = Annotated[
    int | None,
    typer.Option(
        "--eval-batches",
        min=1,
        help="at most this many held-out batches per trainer in each evaluation (default: data files, every held-out "
        "row, the last partial batch too; synthetic data, 8)",
    ),
]

EarlyStopOption = Annotated[
    int,
    typer.Option(
        "--early-stop",
        min=0,
        help="stop after this many evaluations in a row (each epoch's end, every --eval-every steps) without a better "
        "--early-stop-metric, keeping the best one's checkpoint, which persia predict then uses (needs --checkpoint; "
        "0: never)",
    ),
]

EarlyStopMetricOption = Annotated[
    str,
    typer.Option("--early-stop-metric", help="what --early-stop watches: auc (higher is better) or ne (lower)"),
]

CheckpointOption = Annotated[
    Path | None,
    typer.Option("--checkpoint", help="save the job's checkpoints here (at the end, every N steps, on a signal)"),
]

CheckpointEveryOption = Annotated[
    int, typer.Option("--checkpoint-every", min=0, help="also checkpoint every N global steps (0: at the end)")
]

KeepOption = Annotated[int, typer.Option("--keep", min=1, help="keep the newest N checkpoints of this run")]

ResumeOption = Annotated[
    bool, typer.Option("--resume", help="continue from the newest whole checkpoint in --checkpoint")
]

OverwriteOption = Annotated[
    bool, typer.Option("--overwrite", help="train from scratch into a --checkpoint directory that is not empty")
]

PsDelayMsOption = Annotated[
    float, typer.Option("--ps-delay-ms", min=0.0, help="add this many ms to every PS call (a slow network)")
]

IdSpaceOption = Annotated[
    float,
    typer.Option(
        "--id-space",
        help="synthetic data: draw each table's ids from this many times its rows (0.02: its hot ids; above "
        "1 they can bring more distinct ids than the servers hold, so these evict while training)",
    ),
]

PsCapacityOption = Annotated[
    str,
    typer.Option(
        "--ps-capacity",
        help="rows each server's store holds: planned (what the plan charged) or unbounded (every id the "
        "synthetic data can draw, nothing evicted)",
    ),
]

SeedOption = Annotated[int, typer.Option("--seed", min=0, help="seed of the model, data and PS initialisers")]

NodeHostOption = Annotated[
    str | None,
    typer.Option(
        "--node-host",
        envvar="PERSIA_HOST",
        help="under torchrun: the topology host(s) this node is, comma-separated (default: by node rank, in "
        "topology order)",
    ),
]

SsdDirOption = Annotated[
    Path | None,
    typer.Option(
        "--ssd-dir",
        help="where each parameter server keeps the files of its ssd-tier tables, on its own host (default: its "
        "temporary directory): a directory on a local disk, not tmpfs, created if its parent exists; a run's files "
        "are removed when it ends",
    ),
]
LogDirOption = Annotated[
    Path | None,
    typer.Option(
        "--log-dir",
        help="write per-step metrics (metrics.jsonl, TensorBoard events), summary.json and one log file per "
        "process here (--resume appends)",
    ),
]

AdaptOption = Annotated[
    bool,
    typer.Option(
        "--adapt",
        help="re-plan while training: after a warm-up window, if the measured step is off the prediction by more "
        "than --adapt-threshold, refit the cost model, plan again and migrate to a plan predicted faster by more "
        "than the migration costs (through --checkpoint); a plan that measures slower is rolled back",
    ),
]

AdaptThresholdOption = Annotated[
    float, typer.Option("--adapt-threshold", help="--adapt: re-plan when the step is off by more than this share")
]

AdaptMaxOption = Annotated[int, typer.Option("--adapt-max", min=1, help="--adapt: at most this many re-plans")]

AdaptWindowOption = Annotated[
    int, typer.Option("--adapt-window", min=1, help="--adapt: steps of the warm-up and of each measurement window")
]

AsJsonOption = Annotated[bool, typer.Option("--json", help="print only one JSON object with the results")]
