"""The run's inputs against its model, without importing torch: the data it reads (its columns' schema, its rows, the
first pass over them), the model it builds from them (the dense arch, the hyper-parameters it records), and
:func:`check_before_start`, which checks all of them (and the run's folders and RPC environment) before any process
starts: ``persia train`` runs it before it imports the engine, so a mistake is answered in a fraction of a second.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from persia_planner.errors import PlannerError, SpecError
from persia_planner.model.data_schema import DataSchema
from persia_planner.model.dense import DenseArch
from persia_planner.model.specs import ModelSpec
from persia_planner.modules.data.criteo_format import FEATURE_NAMES, NUM_INTEGER, check_criteo_schema
from persia_planner.modules.data.source import (
    DataKind,
    DataSource,
    check_apart,
    check_gzip_shards,
    check_tabular,
    count_rows,
)
from persia_planner.modules.ps.ssd_files import check_ssd_dir
from persia_planner.modules.rpc_environment import rpc_channels, rpc_transports
from persia_planner.modules.train.config import (
    MAX_SYNTHETIC_IDS,
    TrainConfig,
    sparse_eps_of,
    sparse_optimizer_of,
    trainer_batch_size,
)
from persia_planner.modules.train.run_directories import check_checkpoint_dir, check_log_dir, check_resume_exists

__all__ = [
    "check_before_start",
    "check_data_matches",
    "check_dense_inputs",
    "check_id_space",
    "check_sequence_run",
    "data_schema",
    "dense_arch",
    "describe_hyper_parameters",
    "dlrm_embedding_dim",
    "first_pass_schema",
    "hyper_parameters",
    "id_universe",
    "num_dense",
]


def data_schema(spec: ModelSpec, cfg: TrainConfig) -> DataSchema | None:
    """The columns' roles of a Parquet / CSV source: ``--schema``'s, else the model's ``data:``; with
    ``--on-bad-row``'s policy when given."""
    schema = cfg.schema if cfg.schema is not None else spec.data
    if schema is not None and cfg.on_bad_row is not None and schema.on_bad_row is not cfg.on_bad_row:
        schema = replace(schema, on_bad_row=cfg.on_bad_row)
    return schema


def num_dense(spec: ModelSpec, cfg: TrainConfig) -> int:
    """The dense features of a batch: the schema's dense columns for Parquet / CSV (one constant 0 without any),
    Criteo's 13 otherwise."""
    schema = data_schema(spec, cfg)
    if DataSource.parse(cfg.data).tabular and schema is not None:
        return schema.num_inputs
    return NUM_INTEGER


def check_data_matches(spec: ModelSpec, cfg: TrainConfig) -> int | None:
    """The data must exist, feed the model and hold a step and an evaluation; returns its training rows (None for
    synthetic data).

    ``--data criteo:PATH`` provides features c1..c26, so the model's tables must be named after them (and gzip files,
    read whole, are at least one per trainer); a Parquet / CSV source is checked against its schema by
    :func:`persia_planner.modules.data.source.check_tabular`; ``--eval-data`` alike. Then the rows are counted
    (:func:`persia_planner.modules.data.source.count_rows`): the training rows must hold a batch for every trainer,
    and the validation rows (held out, or ``--eval-data``'s) at least one row.
    """
    source = DataSource.parse(cfg.data)
    if source.kind is DataKind.SYNTHETIC:
        return None
    rows = _check_files(spec, cfg, source)
    held_out = round(rows * cfg.held_out_share)
    train_rows = rows - held_out
    if cfg.eval_data is not None:
        eval_source = DataSource.parse(cfg.eval_data)
        eval_rows, eval_what = _check_files(spec, cfg, eval_source), f"--eval-data {cfg.eval_data}"
        check_apart(source, eval_source, cfg.data, cfg.eval_data)
    else:
        eval_rows = held_out
        eval_what = f"the {cfg.held_out_share:.0%} held out for validation (--eval-split)"
    batch = trainer_batch_size(cfg, spec, cfg.trainers)
    step_rows = batch * cfg.trainers
    if train_rows < step_rows:
        raise SpecError(
            cfg.data,
            "",
            f"{rows:,} rows, {train_rows:,} of them for training, hold no full batch of {batch:,} samples for each of "
            f"{cfg.trainers} trainers ({step_rows:,} rows a step)",
            fixes=("use a smaller --batch-size, fewer --trainers or more data",),
        )
    if eval_rows < 1:  # every validation row is scored, a partial batch too: one is enough
        raise SpecError(
            cfg.eval_data or cfg.data,
            "",
            f"{eval_what}: about {eval_rows:,} rows, none to evaluate on",
            fixes=("hold out more with --eval-split", "pass --eval-data PATH"),
        )
    return train_rows


def _check_files(spec: ModelSpec, cfg: TrainConfig, source: DataSource) -> int:
    """One file source against the model (its schema, or Criteo's features); returns its rows."""
    if source.tabular:
        check_tabular(source, data_schema(spec, cfg), spec, cfg.trainers)
        return count_rows(source, source.files())
    files = source.check_files()
    unknown = [t.name for t in spec.tables if t.name not in FEATURE_NAMES]
    if unknown and spec.data is not None:  # a model of Parquet / CSV columns: renaming its tables is no fix
        raise PlannerError(
            f"--data {source.kind.value}:{source.path}: model {spec.name} maps Parquet or CSV columns (data: of "
            f"{spec.data.source}), not Criteo's c1..c26 (its table {unknown[0]!r} is none of them)",
            fixes=("pass --data parquet:PATH or csv:PATH, files with those columns",),
        )
    if unknown:
        raise SpecError(
            spec.name,
            f"tables.{unknown[0]}",
            "is not a Criteo feature (c1..c26); tables are fed by the feature of the same name",
            fixes=("name the tables c1..c26",),
        )
    if spec.data is not None:  # the format's columns, as its reader reads them: a data: saying otherwise is refused
        check_criteo_schema(spec.data, f"{source.kind.value}:{source.path}")
    check_gzip_shards(source, files, cfg.trainers)
    return count_rows(source, files)


def check_sequence_run(spec: ModelSpec, cfg: TrainConfig) -> None:
    """A model with sequence tables trains DIN (``dense: {arch: din}``: the arch that reads them), and without
    TorchRec's train pipeline: DIN pads each batch's sequences to their longest, a shape the pipeline's fx tracing
    of the model cannot follow.

    Raises:
        PlannerError: Sequence tables (``pooling: none``) without ``arch: din``, or with ``--pipeline``; named.
    """
    sequences = [t.name for t in spec.tables if t.sequence]
    arch = spec.dense.arch
    if sequences and (arch is None or not arch.kind.reads_sequences):
        raise PlannerError(
            f"model {spec.name!r} has sequence tables ({', '.join(sequences[:3])}), which persia train reads with "
            f"DIN, and its dense: {'gives counts, no arch' if arch is None else f'is {arch.kind.value}'}",
            fixes=("write dense: {arch: din} (its sizes as formats.md shows)",),
        )
    if sequences and cfg.pipeline:
        raise PlannerError(
            f"--pipeline: model {spec.name!r} has sequence tables ({', '.join(sequences[:3])}), whose DIN TorchRec's "
            "train pipeline cannot trace",
            fixes=("train it without --pipeline",),
        )


def dlrm_embedding_dim(spec: ModelSpec) -> int:
    """The one embedding dim of ``spec``'s tables, which DLRM's feature interaction needs.

    Raises:
        PlannerError: The tables do not share one dim.
    """
    dims = {t.dim for t in spec.tables}
    if len(dims) != 1:
        raise PlannerError(
            f"model {spec.name!r}: a DLRM needs one embedding dim for all tables, got {sorted(dims)}",
            fixes=("give every table the same dim",),
        )
    return dims.pop()


def dense_arch(spec: ModelSpec, cfg: TrainConfig) -> DenseArch:
    """The dense arch a run builds: the model's (``dense: arch:``), or TorchRec's default ``DLRM``, reading the data's
    dense features (:func:`num_dense`) unless model.yaml wrote ``num_dense``."""
    arch = spec.dense.built_arch
    if spec.dense.arch is None or arch.inputs_from_data:
        return replace(arch, num_dense=num_dense(spec, cfg))
    return arch


def check_dense_inputs(spec: ModelSpec, cfg: TrainConfig) -> None:
    """The data has as many dense features as a ``num_dense`` model.yaml wrote (a schema without dense columns
    gives one constant input)."""
    inputs, source = num_dense(spec, cfg), DataSource.parse(cfg.data)
    arch = spec.dense.arch
    if arch is not None and not arch.inputs_from_data and arch.num_dense != inputs:
        kind = f"{source.kind.value} columns" if source.tabular else "synthetic or Criteo"
        raise SpecError(
            spec.name,
            "dense.num_dense",
            f"is {arch.num_dense}, but the data ({kind}) has {inputs} dense features",
            fixes=(f"num_dense: {inputs}", "leave num_dense out (it follows the data)"),
        )


def hyper_parameters(cfg: TrainConfig, spec: ModelSpec, trainers: int) -> dict[str, Any]:
    """What a run trains with, as ``--json`` and checkpoints record it: optimizers, learning rates, their schedule,
    the embedding rows' weight decay, the global batch, the evaluation interval, the staleness bound and the dense
    arch."""
    schema = data_schema(spec, cfg) if DataSource.parse(cfg.data).tabular else None
    transforms = {c: t.to_dict() for c, t in schema.transforms.items()} if schema is not None else {}
    return {
        "dense_optimizer": cfg.dense_optimizer.value,
        "dense_lr": cfg.dense_lr,
        "sparse_optimizer": sparse_optimizer_of(cfg, spec).value,
        "sparse_lr": cfg.sparse_lr,
        "sparse_weight_decay": cfg.sparse_weight_decay,
        "sparse_eps": sparse_eps_of(cfg, spec),
        "lr_schedule": str(cfg.lr_schedule),
        "batch_size": trainer_batch_size(cfg, spec, trainers) * trainers,
        "eval_every": cfg.eval_every,
        "staleness": cfg.effective_staleness,
        "dense_arch": dense_arch(spec, cfg).to_dict(),
        **({"data_transforms": transforms} if transforms else {}),  # what scoring other rows must apply alike
    }


def describe_hyper_parameters(hyper: Mapping[str, Any] | None) -> str:
    """:func:`hyper_parameters` in one line of the summary table."""
    if not hyper:
        return "-"
    extras = []
    if hyper.get("sparse_weight_decay"):
        extras.append(f", row decay {hyper['sparse_weight_decay']:g}")
    if hyper.get("lr_schedule", "constant") != "constant":
        extras.append(f"; rates {hyper['lr_schedule']}")
    return (
        f"{hyper['dense_arch']['arch']}; dense {hyper['dense_optimizer']} ({hyper['dense_lr']:g}), "
        f"sparse {hyper['sparse_optimizer']} ({hyper['sparse_lr']:g}){''.join(extras)}"
    )


def id_universe(spec: ModelSpec, cfg: TrainConfig) -> dict[str, int]:
    """Distinct ids the synthetic data draws per table: ``--id-space`` times the table's rows (at least 1)."""
    return {t.name: max(1, int(t.rows * cfg.teacher_rows_scale)) for t in spec.tables}


def check_id_space(spec: ModelSpec, cfg: TrainConfig) -> None:
    """Synthetic data: every table's id universe (:func:`id_universe`) within :data:`MAX_SYNTHETIC_IDS`."""
    if cfg.data != "synthetic":
        return
    table = max(spec.tables, key=lambda t: t.rows)
    ids = id_universe(spec, cfg)[table.name]
    if ids > MAX_SYNTHETIC_IDS:
        raise PlannerError(
            f"--id-space {cfg.teacher_rows_scale:g}: table {table.name!r} would draw from {ids:,} ids, over the "
            f"{MAX_SYNTHETIC_IDS:,} of one synthetic feature",
            fixes=(f"--id-space {math.floor(MAX_SYNTHETIC_IDS / table.rows * 100) / 100:g} or less",),
        )


def check_before_start(cfg: TrainConfig, spec: ModelSpec, *, with_ps: bool, reads_data: bool = True) -> TrainConfig:
    """The run's inputs that every process would trip over: one line here, before any process starts; returns
    ``cfg`` with the training rows it counted (:attr:`TrainConfig.data_rows`).

    Checks the data (:func:`check_data_matches`), the checkpoint and log directories and, with ``--resume``, that the
    checkpoint holds a trainer state; that the model's tables agree on one sparse optimizer and one dim, and its
    dense arch on the data's dense features; when the plan has PS tables (``with_ps``), ``PERSIA_RPC_TRANSPORTS``
    and ``PERSIA_RPC_CHANNELS``; last, the first rows of a Parquet / CSV source (:func:`first_pass_schema`), and
    returns ``cfg`` with the schema that pass measured too. The data is read once: a ``cfg`` this function returned
    (its rows counted) is not read again, nor is it by a process that reads none (``reads_data`` False: a
    parameter server).

    Raises:
        PlannerError: The first problem found (``SpecError`` for the data).
    """
    check_sequence_run(spec, cfg)
    checked = cfg.data_rows is not None or not reads_data
    rows = cfg.data_rows if checked else check_data_matches(spec, cfg)
    check_id_space(spec, cfg)
    if cfg.resume and cfg.checkpoint:  # first: a refused resume creates nothing
        check_resume_exists(cfg.checkpoint)
    check_checkpoint_dir(cfg)
    check_log_dir(cfg)
    check_ssd_dir(cfg.ssd_dir)
    sparse_optimizer_of(cfg, spec)
    dlrm_embedding_dim(spec)
    check_dense_inputs(spec, cfg)
    if with_ps:
        rpc_transports()
        rpc_channels()
    return replace(cfg, data_rows=rows, schema=cfg.schema if checked else first_pass_schema(spec, cfg))


def first_pass_schema(spec: ModelSpec, cfg: TrainConfig) -> DataSchema | None:
    """The schema a run reads a Parquet / CSV source with, after the first pass over its first training rows
    (:func:`persia_planner.modules.data.statistics.first_pass`), which finds their bad rows before any process
    starts and measures what the schema needs (``standardize``'s statistics, ``impute``'s means), and a look at the
    first rows of ``--eval-data``; ``cfg.schema`` for other data.

    Raises:
        SpecError: A bad row under ``on_bad_row: fail``, or a column the schema cannot standardize or impute.
    """
    source = DataSource.parse(cfg.data)
    schema = data_schema(spec, cfg)
    if not source.tabular or schema is None:
        return cfg.schema
    # The reader imports torch: here, after every check that does not need it.
    from persia_planner.modules.data.statistics import check_first_rows, first_pass

    measured = first_pass(schema, source.files(), source.kind.value, cfg.held_out_share, data=cfg.data).schema
    if cfg.eval_data is not None:  # its first rows too, as the evaluations will read them
        evaluation = DataSource.parse(cfg.eval_data)
        check_first_rows(measured, evaluation.files(), evaluation.kind.value, data=cfg.eval_data)
    return measured
