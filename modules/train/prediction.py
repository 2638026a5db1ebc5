"""Scores for new rows from a training checkpoint: ``persia predict``.

A checkpoint of ``persia train`` holds everything a prediction needs: ``model.yaml`` (the tables, the dense arch and the
columns as the run read them, with the statistics it measured for ``standardize``), ``plan.json`` (which tables are
on the parameter servers), ``trainer.pt`` (the dense network and the local tables' full weights) and ``ps/`` (the
servers' tables). :func:`prepare` checks it whole against its plan (:mod:`persia_planner.modules.train.trained_model`),
the data against its model and the output path, before any process starts. :func:`predict` then starts as many
servers as the run had and loads ``ps/`` into them (their hashing routes an id to the server that trained it), builds
the model in one trainer process with the local tables whole and unsharded (as ``trainer.pt`` holds them), and scores
every row of ``--data`` in file order, the last partial batch too, into a Parquet file: ``row`` (the row's place in
the files, in the order ``--data`` lists them), ``score`` (the predicted click probability) and, where the rows have
the label column, ``label``. Rows without it are scored alike; with it, the summary also gives AUC, log loss,
normalized entropy and calibration.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from persia_planner.errors import PlannerError, SpecError
from persia_planner.model.dense import DenseArch
from persia_planner.model.specs import ModelSpec
from persia_planner.modules.data.source import DataKind, DataSource, check_tabular, file_columns
from persia_planner.modules.train.config import TrainConfig
from persia_planner.modules.train.job_checkpoints import MODEL_FILE, PS_DIR
from persia_planner.modules.train.run_inputs import dense_arch
from persia_planner.modules.train.trained_model import (
    TrainedModel,
    TrainerSettings,
    check_dense,
    open_trained,
    read_trainer_state,
)
from persia_planner.outputs import SCORES_METADATA, Output, OutputKind, check_outputs, write_output

__all__ = ["DEFAULT_PREDICT_BATCH", "Prediction", "PreparedPrediction", "describe", "predict", "prepare"]

DEFAULT_PREDICT_BATCH = 8192
"""Rows scored per forward pass."""


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
    if not any(schema.label in file_columns(source.kind, f, delimiter=schema.delimiter) for f in files):
        schema = schema.unlabeled()  # rows to score
    spec = replace(spec, data=schema)
    check_tabular(source, schema, spec, trainers=1)
    return spec


@dataclass(frozen=True)
class PreparedPrediction:
    """A prediction :func:`prepare` checked whole: what its trainer builds and reads.

    Attributes:
        target: ``--out``.
        trained: The checkpoint, checked against its plan.
        settings: What ``trainer.pt`` records beside its tensors (checked against the plan and the model).
        spec: The model, its schema reading ``data`` (without the label where no file has the label column).
        data: ``--data``.
        config: How the trainer reads ``data``: one trainer, in file order, with the run's seed.
        arch: The dense arch built over ``data``.
        batch_size: Rows scored per forward pass.
    """

    target: Output
    trained: TrainedModel
    settings: TrainerSettings
    spec: ModelSpec
    data: str
    config: TrainConfig
    arch: DenseArch
    batch_size: int


def prepare(
    checkpoint: str | os.PathLike[str],
    data: str,
    out: str | os.PathLike[str],
    *,
    batch_size: int = DEFAULT_PREDICT_BATCH,
    overwrite: bool = False,
) -> PreparedPrediction:
    """Everything :func:`predict` checks before any process starts: the output path, the checkpoint whole against
    its plan (every file's sha256, ``plan.json``, ``model.yaml``, ``ps/``, ``trainer.pt`` read as tensors only with
    every local table and the dense network's shapes) and the data against the model. Writes nothing.

    Raises:
        PlannerError: A checkpoint, data or output problem, one line naming it.
    """
    if batch_size < 1:
        raise PlannerError(f"--batch-size must be >= 1, got {batch_size}")
    target = Output("--out", Path(out), OutputKind.SCORES)
    source = DataSource.parse(data)
    # A checkpoint is a run's folder: the rule refuses an output inside it, whichever checkpoint it is.
    check_outputs([target], {"--data": source.path}, overwrite=overwrite)
    trained = open_trained(checkpoint)
    settings = read_trainer_state(trained)
    spec = _check_data(trained, data)
    # A Criteo file is read by its format; its model's data: (persia data profile writes one) only describes that.
    schema = spec.data if source.tabular else None
    cfg = TrainConfig(data=data, trainers=1, schema=schema, shuffle_buffer=0, seed=settings.seed)
    arch = dense_arch(spec, cfg)
    check_dense(trained, settings, arch, data)
    return PreparedPrediction(target, trained, settings, spec, data, cfg, arch, batch_size)


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
        PlannerError: A checkpoint, data or output problem, one line naming it (:func:`prepare`'s, before any process
            starts).
    """
    started = time.perf_counter()
    prepared = prepare(checkpoint, data, out, batch_size=batch_size, overwrite=overwrite)
    trained, target = prepared.trained, prepared.target
    from persia_planner.modules.train.engine import run_trainers  # torchrec: after the checks

    results: list[tuple[int, dict[str, Any] | None]] = []

    def score_into(partial: Path) -> None:
        results.extend(
            run_trainers(
                _score,
                prepared,
                str(partial),
                trainers=1,
                servers=trained.servers,
                run_timeout_s=run_timeout_s,
            )
        )

    write_output(target, score_into, overwrite=overwrite)
    (result,) = results
    rows, metrics = result
    return Prediction(
        str(target.path),
        rows,
        str(trained.checkpoint.path),
        trained.checkpoint.step,
        time.perf_counter() - started,
        metrics,
    )


def _score(rank: int, client: Any, prepared: PreparedPrediction, out: str) -> tuple[int, dict[str, Any] | None]:
    """The trainer's body: the model loaded from the checkpoint :func:`prepare` checked, every row scored into
    ``out``; returns the rows and the metrics against their labels."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from torchmetrics.functional.classification import binary_auroc

    from persia_planner.modules.embedding.hybrid import SparseOptimizer
    from persia_planner.modules.train.batch_stream import click_metrics, file_reader
    from persia_planner.modules.train.loop import build_model, dense_state_dict, load_dense_state_dict
    from persia_planner.modules.train.trainer_state import TRAINER_STATE

    trained, settings, spec, cfg = prepared.trained, prepared.settings, prepared.spec, prepared.config
    ckpt = trained.checkpoint
    # Loaded again rather than sent: a pickle of the launcher's copy would be the local tables' bytes twice over.
    state = torch.load(ckpt.path / TRAINER_STATE, weights_only=True, map_location="cpu")
    model, hybrid = build_model(
        spec,
        trained.tables,
        ps=client,
        optimizer=SparseOptimizer(settings.sparse_optimizer, learning_rate=settings.sparse_lr),
        staleness=0,
        seed=cfg.seed,
        ps_servers=max(1, trained.servers),
        arch=prepared.arch,
        local_device=torch.device("cpu"),
    )
    missing, unexpected = load_dense_state_dict(model, state["dense"])
    missing = [k for k in missing if k in dense_state_dict(model)]
    if missing or unexpected:  # prepare() compared the shapes: the file changed since
        raise PlannerError(f"{ckpt.path / TRAINER_STATE}: the dense network differs ({(missing or unexpected)[:3]})")
    hybrid.load_local_weights(state["local"])
    if hybrid.ps is not None:
        client.load(ckpt.path / PS_DIR)
    model.eval()
    labeled = spec.data is None or spec.data.label is not None
    scores: list[np.ndarray] = []
    labels: list[np.ndarray] = []
    row = 0
    fields = [("row", pa.int64()), ("score", pa.float32()), *((("label", pa.float32()),) if labeled else ())]
    schema = pa.schema(fields, metadata=SCORES_METADATA)  # persia's mark: --overwrite replaces only such files
    with pq.ParquetWriter(out, schema) as writer, torch.no_grad():
        for batch in file_reader(spec, cfg, prepared.batch_size, drop_last=False):
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
