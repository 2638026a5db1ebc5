"""Scores for new rows from a training checkpoint: ``persia predict``.

A checkpoint of ``persia train`` holds everything a prediction needs: ``model.yaml`` (the tables, the dense arch and the
columns as the run read them, with the statistics it measured for ``standardize``), ``plan.json`` (which tables are
on the parameter servers), ``trainer.pt`` (the dense network and the local tables' full weights) and ``ps/`` (the
servers' tables). :func:`predict` starts as many servers as the run had and loads ``ps/`` into them (their hashing
routes an id to the server that trained it), builds the model in one trainer process with the local tables whole
and unsharded (as ``trainer.pt`` holds them), and scores every row of ``--data`` in file order, the last partial batch
too, into a Parquet file: ``row`` (the row's place in the files, in the order ``--data`` lists them), ``score`` (the
predicted click probability) and, where the rows have the label column, ``label``. Rows without it are scored
alike; with it, the summary also gives AUC, log loss, normalized entropy and calibration.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from persia_planner.errors import PlannerError, SpecError
from persia_planner.kinds import Mode
from persia_planner.model.specs import ModelSpec, load_model
from persia_planner.modules.data.source import DataKind, DataSource, check_tabular, file_columns
from persia_planner.modules.train.config import TrainConfig, dense_arch
from persia_planner.modules.train.job_checkpoints import MANIFEST, MODEL_FILE, Checkpoint, newest_complete, verify
from persia_planner.placement.shards import TablePlacement
from persia_planner.plan.plan import placement_from_dict

__all__ = ["DEFAULT_PREDICT_BATCH", "Prediction", "TrainedModel", "describe", "open_trained", "predict"]

DEFAULT_PREDICT_BATCH = 8192
"""Rows scored per forward pass."""


@dataclass(frozen=True)
class TrainedModel:
    """What a checkpoint says of the model it trained.

    Attributes:
        checkpoint: The checkpoint (its ``step-*`` directory, step and world).
        spec: Its ``model.yaml``: the tables, the dense arch, and the columns with their measured statistics.
        tables: Its ``plan.json``: every table's placement.
        servers: The parameter servers its PS tables are on (0: none).
    """

    checkpoint: Checkpoint
    spec: ModelSpec
    tables: dict[str, TablePlacement]
    servers: int


@dataclass(frozen=True)
class Prediction:
    """What :func:`predict` wrote.

    Attributes:
        out: The Parquet file of scores.
        rows: Rows scored.
        checkpoint: The checkpoint directory the model came from.
        step: Its training step.
        seconds: Wall time of the scoring (the servers' start and the model's load included).
        metrics: AUC, log loss, normalized entropy and calibration against the rows' labels; None without labels.
    """

    out: str
    rows: int
    checkpoint: str
    step: int
    seconds: float
    metrics: dict[str, Any] | None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def open_trained(path: str | os.PathLike[str]) -> TrainedModel:
    """The checkpoint at ``path`` (a ``step-*`` directory, or ``--checkpoint``'s directory: its newest whole one),
    its files checked whole.

    Raises:
        PlannerError: No whole checkpoint there, or one without ``model.yaml`` (one line naming the file).
    """
    root = Path(path)
    if (root / MANIFEST).is_file():
        ckpt = verify(root)
    else:
        ckpt = newest_complete(root, option="--checkpoint")
    model_file = ckpt.path / MODEL_FILE
    if not model_file.is_file():
        raise PlannerError(
            f"--checkpoint: {ckpt.path} has no {MODEL_FILE} (written by an earlier version of persia train)",
            fixes=("train again with --checkpoint DIR, or --resume it for a step",),
        )
    spec = load_model(model_file)
    source = str(ckpt.path / "plan.json")
    plan = json.loads((ckpt.path / "plan.json").read_text())
    tables = {name: placement_from_dict(entry, source, name) for name, entry in plan.items()}
    has_ps = any(p.mode is Mode.ASYNC for p in tables.values())
    return TrainedModel(ckpt, spec, tables, int(ckpt.world.get("servers", 0)) if has_ps else 0)


def _check_data(trained: TrainedModel, data: str) -> ModelSpec:
    """``data`` feeds the model: its kind reads files, and a Parquet / CSV file has the schema's columns; returns the
    spec whose schema reads it (without the label where no file has the label column)."""
    source = DataSource.parse(data)
    spec = trained.spec
    if source.kind is DataKind.SYNTHETIC:
        raise PlannerError(
            "--data synthetic: predict scores rows of files", fixes=("--data criteo:PATH, parquet:PATH or csv:PATH",)
        )
    if not source.tabular:
        source.check_files()
        return spec
    schema = spec.data
    if schema is None:
        raise SpecError(
            str(trained.checkpoint.path / MODEL_FILE),
            "data",
            f"the model was trained on Criteo files, not {source.kind.value}",
            fixes=("--data criteo:PATH",),
        )
    files = source.check_files()
    if not any(schema.label in file_columns(source.kind, f) for f in files):
        schema = schema.unlabeled()  # rows to score
    spec = replace(spec, data=schema)
    check_tabular(source, schema, spec, trainers=1)
    return spec


def predict(
    checkpoint: str | os.PathLike[str],
    data: str,
    out: str | os.PathLike[str],
    *,
    batch_size: int = DEFAULT_PREDICT_BATCH,
    overwrite: bool = False,
    run_timeout_s: float = 3600.0,
) -> Prediction:
    """Score every row of ``data`` with the model of ``checkpoint`` into the Parquet file ``out`` (written whole or
    not at all).

    Raises:
        PlannerError: A checkpoint, data or output problem, one line naming it (before any process starts).
    """
    started = time.perf_counter()
    if batch_size < 1:
        raise PlannerError(f"--batch-size must be >= 1, got {batch_size}")
    target = Path(out)
    if target.exists() and not overwrite:
        raise PlannerError(f"--out: {target} exists", fixes=("pass --overwrite to replace it", "name another file"))
    if not target.parent.is_dir():
        raise PlannerError(f"--out: {target.parent} is not a directory", fixes=("create it first",))
    trained = open_trained(checkpoint)
    spec = _check_data(trained, data)
    from persia_planner.modules.train.engine import run_trainers  # torch: after the checks

    partial = target.with_name(f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        (result,) = run_trainers(
            _score,
            trained,
            spec,
            data,
            batch_size,
            str(partial),
            trainers=1,
            servers=trained.servers,
            run_timeout_s=run_timeout_s,
        )
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    rows, metrics = result
    return Prediction(
        str(target), rows, str(trained.checkpoint.path), trained.checkpoint.step, time.perf_counter() - started, metrics
    )


def _score(
    rank: int, client: Any, trained: TrainedModel, spec: ModelSpec, data: str, batch_size: int, out: str
) -> tuple[int, dict[str, Any] | None]:
    """The trainer's body: the model loaded from the checkpoint, every row scored into ``out``; returns the rows and
    the metrics against their labels."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from torchmetrics.functional.classification import binary_auroc

    from persia_planner.model.dense import DenseArch
    from persia_planner.model.specs import Optimizer
    from persia_planner.modules.embedding.hybrid import SparseOptimizer
    from persia_planner.modules.train.batch_stream import click_metrics, file_reader
    from persia_planner.modules.train.loop import build_model, dense_state_dict
    from persia_planner.modules.train.trainer_state import TRAINER_STATE

    ckpt = trained.checkpoint
    state = torch.load(ckpt.path / TRAINER_STATE, weights_only=True, map_location="cpu")
    hyper = state.get("hyper_parameters") or {}
    cfg = TrainConfig(data=data, trainers=1, schema=spec.data, shuffle_buffer=0, seed=int(state.get("seed", 0)))
    arch = dense_arch(spec, cfg)
    trained_arch = hyper.get("dense_arch")
    if trained_arch is not None and DenseArch(**_arch_fields(trained_arch)) != replace(arch, inputs_from_data=False):
        raise PlannerError(
            f"--data {data}: the model's dense arch reads {trained_arch.get('num_dense')} dense features, this data "
            f"gives {arch.num_dense}",
            fixes=("score rows of the kind and columns the model was trained on",),
        )
    optimizer = SparseOptimizer(
        Optimizer(hyper.get("sparse_optimizer", spec.tables[0].optimizer.value)),
        learning_rate=float(hyper.get("sparse_lr", 0.1)),
    )
    model, hybrid = build_model(
        spec,
        trained.tables,
        ps=client,
        optimizer=optimizer,
        staleness=0,
        seed=cfg.seed,
        ps_servers=max(1, trained.servers),
        arch=arch,
        local_device=torch.device("cpu"),
    )
    missing, unexpected = model.load_state_dict(state["dense"], strict=False)
    missing = [k for k in missing if k in dense_state_dict(model)]
    if missing or unexpected:
        raise PlannerError(f"{ckpt.path / TRAINER_STATE}: the dense network differs ({(missing or unexpected)[:3]})")
    hybrid.load_local_weights(state["local"])
    if hybrid.ps is not None:
        client.load(ckpt.path / "ps")
    model.eval()
    labeled = spec.data is None or spec.data.label is not None
    scores: list[np.ndarray] = []
    labels: list[np.ndarray] = []
    row = 0
    schema = pa.schema([("row", pa.int64()), ("score", pa.float32()), *((("label", pa.float32()),) if labeled else ())])
    with pq.ParquetWriter(out, schema) as writer, torch.no_grad():
        for batch in file_reader(spec, cfg, batch_size, drop_last=False):
            p = torch.sigmoid(model(batch.dense, batch.sparse).squeeze(-1)).numpy().astype(np.float32)
            columns = {"row": np.arange(row, row + p.size, dtype=np.int64), "score": p}
            if labeled:
                columns["label"] = batch.labels.numpy()
                labels.append(columns["label"])
            writer.write_table(pa.table(columns, schema=schema))
            scores.append(p)
            row += p.size
    hybrid.flush()
    if not labeled or not row:
        return row, None
    p, y = torch.from_numpy(np.concatenate(scores)), torch.from_numpy(np.concatenate(labels))
    metrics = click_metrics(p, y)
    both = 0 < float(y.sum()) < y.numel()  # an AUC needs a click and a non-click
    metrics["auc"] = float(binary_auroc(p, y.long())) if both else None
    return row, metrics


def _arch_fields(recorded: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's ``hyper_parameters.dense_arch`` as :class:`DenseArch` fields."""
    fields = {k: v for k, v in recorded.items() if k != "arch"}
    return {"kind": recorded["arch"], **fields}


def describe(prediction: Prediction) -> str:
    """:func:`predict`'s result in a few lines of text."""
    lines = [
        f"scored {prediction.rows:,} rows with {prediction.checkpoint} (step {prediction.step:,}) in "
        f"{prediction.seconds:.1f} s: {prediction.out}"
    ]
    m = prediction.metrics
    if m:
        parts = [f"AUC {m['auc']:.4f}"] if m.get("auc") is not None else []
        parts.append(f"log loss {m['eval_loss']:.4f}")
        if m.get("normalized_entropy") is not None:
            parts.append(f"NE {m['normalized_entropy']:.4f}")
        if m.get("calibration") is not None:
            parts.append(f"calibration {m['calibration']:.3f}")
        lines.append("against the rows' labels: " + ", ".join(parts))
    return "\n".join(lines)
