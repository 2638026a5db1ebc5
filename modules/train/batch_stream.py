"""A trainer's data: its share of the batch stream (synthetic batch ``b`` goes to trainer ``b mod trainers``; a file
source's shards are dealt to the trainers anew each epoch, :mod:`.data.shards`), the lockstep that ends an epoch for
every trainer at the same step, and the evaluation over every trainer's held-out batches."""

from __future__ import annotations

import itertools
import math
import multiprocessing
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from persia_planner.errors import PlannerError
from persia_planner.model.specs import ModelSpec
from persia_planner.modules.data.batch import Batch, as_batches, blank_batch, padded
from persia_planner.modules.data.blocks import BadRowCount
from persia_planner.modules.data.criteo import CriteoReader
from persia_planner.modules.data.shards import DataPass
from persia_planner.modules.data.source import DataKind, DataSource
from persia_planner.modules.data.split import RowSplit
from persia_planner.modules.data.statistics import measured
from persia_planner.modules.data.synthetic import Interest, SyntheticClicks, Teacher
from persia_planner.modules.data.tabular import TabularReader
from persia_planner.modules.train.config import TrainConfig, trainer_batch_size
from persia_planner.modules.train.run_inputs import data_schema, id_universe

__all__ = [
    "SYNTHETIC_EVAL_BATCHES",
    "BadRowTally",
    "Epochs",
    "bad_rows_summary",
    "click_metrics",
    "evaluate",
    "file_reader",
    "held_out_batches",
    "lockstep",
    "planned_steps",
    "scoring_lockstep",
    "steps_left",
    "teacher_for",
    "training_batches",
    "with_data_statistics",
]

_EVAL_SEED_OFFSET = 1_000_003
SYNTHETIC_EVAL_BATCHES = 8
"""Batches per trainer of a synthetic evaluation without ``--eval-batches`` (generated data has no end)."""


# ---- data ----------------------------------------------------------------------------------------------------


def teacher_for(spec: ModelSpec, cfg: TrainConfig) -> Teacher:
    """The synthetic data's hidden teacher for ``spec``: one feature per table, ids drawn from ``--id-space`` times
    each table's rows (:func:`.run_inputs.id_universe`); a sequence table with a candidate is a history of its
    candidate's ids, on which the clicks depend (:class:`~persia_planner.modules.data.synthetic.Interest`)."""
    interests = tuple(
        Interest(t.name, of=t.candidate, mean_length=max(t.sequence_mean, 1.0)) for t in spec.tables if t.candidate
    )
    features = tuple(t.name for t in spec.tables)
    return Teacher(features=features, rows=id_universe(spec, cfg), seed=cfg.seed, interests=interests)


@dataclass
class Epochs:
    """Where a trainer's stream of data files is: how many batches each finished epoch gave (every trainer the same:
    an epoch ends for all at once). A checkpoint keeps them, so that a resumed run finds its epoch and the batches
    into it from the step alone.

    Attributes:
        lengths: Batches of each epoch whose last batch was read, from the first.
    """

    lengths: list[int] = field(default_factory=list)

    def ends_at(self, step: int) -> bool:
        """Whether global step ``step`` (steps done) is the last of an epoch (an epoch's length is known when the
        trainer receives its last batch, before that batch's step)."""
        return step > 0 and step in itertools.accumulate(self.lengths)

    def position(self, step: int) -> tuple[int, int]:
        """The epoch of global step ``step`` (steps done) and the batches of it already trained."""
        done = 0
        for epoch, n in enumerate(self.lengths):
            if step < done + n:
                return epoch, step - done
            done += n
        return len(self.lengths), step - done


def planned_steps(cfg: TrainConfig, spec: ModelSpec, trainers: int, epochs: Epochs, start_step: int) -> int | None:
    """The steps this run will train: ``--steps``, else (data files) the epochs left at the counted rows' steps per
    epoch, an estimate: an epoch ends when the first trainer runs out (None when the rows were not counted)."""
    if cfg.steps is not None:
        return cfg.steps
    if not cfg.data_rows:
        return None
    per_epoch = cfg.data_rows // (trainers * trainer_batch_size(cfg, spec, trainers))
    epoch, within = epochs.position(start_step)
    return max(0, (cfg.passes - epoch) * per_epoch - within)


def steps_left(cfg: TrainConfig, restarted: bool, state: dict[str, Any], start_step: int, epochs: Epochs) -> int | None:
    """The steps a resumed run trains: ``--steps`` is the job's total, so that the same command, run again after a
    crash, trains what was asked; after a torchrun restart, the run goes on to the step its first attempt was to
    reach (the same total). Without ``--steps`` (data files), it trains to the end of ``--epochs``."""
    if cfg.steps is None and not (restarted and state.get("target_step") is not None):
        epoch, _ = epochs.position(start_step)
        if epoch >= cfg.passes:
            raise PlannerError(
                f"--resume: the newest checkpoint (step {start_step:,}) ends epoch {epoch}, which the job's "
                f"--epochs {cfg.passes} already reaches",
                fixes=(f"pass --epochs above {epoch} to train on",),
            )
        return None
    target = int(state.get("target_step") or cfg.steps or 0) if restarted else int(cfg.steps or 0)
    if target <= start_step:
        raise PlannerError(
            f"--resume: the newest checkpoint is at step {start_step:,}, which the job's --steps {target:,} "
            "already reaches (--steps counts the job's steps, resumed ones too)",
            fixes=(f"pass --steps above {start_step:,} to train on",),
        )
    return target - start_step


@dataclass
class BadRowTally:
    """What ``on_bad_row`` did to the rows of Parquet / CSV files this trainer read: in each training epoch of the
    run, and in its last evaluation (:class:`.data.tabular.BadRowCount`)."""

    epochs: list[BadRowCount] = field(default_factory=list)
    evaluation: BadRowCount = field(default_factory=BadRowCount)


def bad_rows_summary(spec: ModelSpec, cfg: TrainConfig, tally: BadRowTally) -> dict[str, Any] | None:
    """What ``on_bad_row`` did to every trainer's rows, as the run's summary says it: the rows left out of a training
    epoch (the most of any epoch the run read) and of the last evaluation, and the rows imputed; None for data other
    than Parquet / CSV. Collectives: every trainer calls it."""
    schema = data_schema(spec, cfg)
    if not DataSource.parse(cfg.data).tabular or schema is None:
        return None
    epochs = torch.tensor([len(tally.epochs)])
    if dist.is_initialized():
        dist.all_reduce(epochs, op=dist.ReduceOp.MAX)
    counts = torch.zeros(int(epochs.item()) + 1, 2, dtype=torch.int64)  # the epochs' rows, then the evaluation's
    for i, c in enumerate([*tally.epochs, tally.evaluation]):
        counts[i if i < len(tally.epochs) else -1] = torch.tensor([c.skipped, c.imputed])
    if dist.is_initialized():
        dist.all_reduce(counts)
    train = counts[:-1].max(dim=0).values if len(counts) > 1 else torch.zeros(2, dtype=torch.int64)
    return {
        "on_bad_row": schema.on_bad_row.value,
        "skipped": {"train": int(train[0]), "eval": int(counts[-1, 0])},
        "imputed": {"train": int(train[1]), "eval": int(counts[-1, 1])},
    }


def training_batches(
    spec: ModelSpec,
    cfg: TrainConfig,
    batch_size: int,
    *,
    epochs: Epochs | None = None,
    skip: int = 0,
    bad_rows: BadRowTally | None = None,
) -> Iterator[Batch]:
    """This trainer's training batches after the ``skip`` steps the job trained before (a resumed run).

    Synthetic global batch ``b`` goes to trainer ``b mod trainers``, ``cfg.steps`` of them. Data files: epoch after
    epoch (``cfg.passes``), each in its own seeded order (:class:`.data.shards.DataPass`), the held-out rows left out;
    an epoch ends for every trainer when one has read all of its share (:func:`lockstep`), and ``epochs`` records
    its length; ``bad_rows`` what ``on_bad_row`` did to each epoch's rows. At most ``cfg.steps`` batches when given.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if cfg.data == "synthetic":
        yield from _synthetic(spec, cfg, batch_size, rank, world, first=skip, count=cfg.steps or 0)
        return
    epochs = epochs if epochs is not None else Epochs()
    first_epoch, within = epochs.position(skip)
    split = RowSplit(cfg.held_out_share, held_out=False) if cfg.held_out_share else None
    tally = bad_rows if bad_rows is not None else BadRowTally()
    stream = _epochs(spec, cfg, batch_size, rank, world, epochs, first_epoch, within, split, tally)
    yield from stream if cfg.steps is None else itertools.islice(stream, cfg.steps)


def _epochs(
    spec: ModelSpec,
    cfg: TrainConfig,
    batch_size: int,
    rank: int,
    world: int,
    epochs: Epochs,
    first_epoch: int,
    within: int,
    split: RowSplit | None,
    tally: BadRowTally,
) -> Iterator[Batch]:
    for epoch in range(first_epoch, cfg.passes):
        reading = DataPass(epoch=epoch, seed=cfg.seed, shuffle_rows=cfg.shuffle_buffer, split=split)
        tally.epochs.append(counts := BadRowCount())
        batches = iter(file_reader(spec, cfg, batch_size, rank, world, reading=reading, counts=counts))
        skipped = within if epoch == first_epoch else 0
        # Every trainer trained on these together (in lockstep) before: skipped without a collective.
        n = sum(1 for _ in itertools.islice(batches, skipped))
        # A resumed run may know this epoch's length already: the checkpoint was taken after its last batch was read
        # (one ahead, or K ahead by the PS prefetch) but before its last step.
        known = len(epochs.lengths) > epoch
        ahead = lockstep(batches)
        batch = next(ahead, None)
        while batch is not None:
            n += 1
            following = next(ahead, None)  # one batch ahead: the epoch's length is known before its last step
            if following is None and not known:
                epochs.lengths.append(n)
            yield batch
            batch = following
        if n == skipped and not known:  # an epoch with no batch left to train
            epochs.lengths.append(n)


def held_out_batches(
    spec: ModelSpec, cfg: TrainConfig, batch_size: int, *, bad_rows: BadRowTally | None = None
) -> Iterator[Batch]:
    """This trainer's evaluation batches, the same at every evaluation: synthetic data drawn with another seed
    (``cfg.eval_batches``, default :data:`SYNTHETIC_EVAL_BATCHES`); data files: every row of ``--eval-data``, or of
    the training files' held-out rows, in file order, the last partial batch too (at most ``cfg.eval_batches`` when
    given; ``bad_rows``: what ``on_bad_row`` did to the rows read, this evaluation's in place of the last one's)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if cfg.data == "synthetic":
        count = cfg.eval_batches or SYNTHETIC_EVAL_BATCHES
        yield from _synthetic(spec, cfg, batch_size, rank, world, first=0, count=count, eval_=True)
        return
    counts = BadRowCount()
    if bad_rows is not None:
        bad_rows.evaluation = counts
    common: dict[str, Any] = {"drop_last": False, "counts": counts}
    if cfg.eval_data is not None:
        reader = file_reader(spec, cfg, batch_size, rank, world, data=cfg.eval_data, **common)
    else:
        split = RowSplit(cfg.held_out_share, held_out=True)
        reader = file_reader(spec, cfg, batch_size, rank, world, reading=DataPass(split=split), **common)
    yield from reader if cfg.eval_batches is None else itertools.islice(reader, cfg.eval_batches)


def _synthetic(
    spec: ModelSpec, cfg: TrainConfig, batch_size: int, rank: int, world: int, *, first: int, count: int,
    eval_: bool = False,
) -> Iterator[Batch]:  # fmt: skip
    seed = cfg.seed + (_EVAL_SEED_OFFSET if eval_ else 0)
    data = SyntheticClicks(
        teacher_for(spec, cfg),
        batch_size=batch_size,
        num_batches=(first + count) * world,
        seed=seed,
        # the ids per sample the plan was priced for (a sequence's own; its candidate's id is its candidate's)
        pooling={t.name: t.sequence_mean for t in spec.tables},
    )
    for step in range(first, first + count):
        yield data.batch(step * world + rank)


def with_data_statistics(spec: ModelSpec, cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with what its schema needs measured (:func:`.data.statistics.measured`: ``standardize``'s statistics,
    ``impute``'s means), for a Parquet / CSV source whose schema asks for them; ``cfg`` itself otherwise (as after
    :func:`.run_inputs.check_before_start`, which measured them before the processes started)."""
    source = DataSource.parse(cfg.data)
    schema = data_schema(spec, cfg)
    if not source.tabular or schema is None or not schema.to_measure:
        return cfg
    return replace(cfg, schema=measured(schema, source.files(), source.kind.value, cfg.held_out_share))


def file_reader(
    spec: ModelSpec,
    cfg: TrainConfig,
    batch_size: int,
    rank: int = 0,
    world: int = 1,
    *,
    data: str | None = None,
    reading: DataPass | None = None,
    drop_last: bool = True,
    counts: BadRowCount | None = None,
) -> Iterable[Batch]:
    """The full batches trainer ``rank`` of ``world`` reads from ``data``'s files (default ``cfg.data``; its shards
    only) in the pass ``reading`` (default: every row, in file order); the last partial one too without
    ``drop_last``; Parquet / CSV: ``counts`` adds what ``on_bad_row`` did to the rows read."""
    source = DataSource.parse(data or cfg.data)
    files = source.files()
    if cfg.data_workers and multiprocessing.current_process().daemon:
        # The local launcher starts trainers as daemonic processes, which multiprocessing forbids to have children.
        # A DataLoader's workers watch their trainer and end with it, so the trainer may start them.
        multiprocessing.current_process().daemon = False
    # Full batches to train on: a trainer's last partial batch would be a step of another size than the others'.
    common: dict[str, Any] = {
        "batch_size": batch_size,
        "num_workers": cfg.data_workers,
        "drop_last": drop_last,
        "rank": rank,
        "world": world,
        "reading": reading,
    }
    if source.kind is DataKind.CRITEO:
        return CriteoReader(files, **common)
    schema = data_schema(spec, cfg)
    assert schema is not None  # config.check_data_matches
    return TabularReader(files, schema, fmt=source.kind.value, counts=counts, **common)


def lockstep(batches: Iterable[Batch]) -> Iterator[Batch]:
    """Stop every trainer at the same step when one runs out of data (collectives must match)."""
    for batch in batches:
        if dist.is_initialized():
            flag = torch.ones(1)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            if flag.item() == 0:
                return
        yield batch
    if dist.is_initialized():
        flag = torch.zeros(1)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)


# ---- evaluation ----------------------------------------------------------------------------------------------


def evaluate(model: nn.Module, batches: Iterable[Any], device: torch.device | None = None) -> dict[str, float]:
    """AUC (torchmetrics), log loss, normalized entropy, calibration and teacher AUC over every sample of every
    trainer's eval batches (ours, or TorchRec's ``Batch`` es: :func:`.data.batch.as_batch`); see
    :func:`click_metrics`. Every trainer scores batches of one size, as many as the trainer with the most
    (:func:`scoring_lockstep`): sharded tables answer in collectives."""
    from torchmetrics.functional.classification import binary_auroc

    model.eval()
    preds, labels, probs = [], [], []
    with torch.no_grad():
        for b in scoring_lockstep(as_batches(batches)):
            sparse = b.sparse if device is None or device.type == "cpu" else b.sparse.to(device)
            dense = b.dense if device is None else b.dense.to(device)
            p = torch.sigmoid(model(dense, sparse).squeeze(-1)).cpu()
            own = b.mask if b.mask is not None else slice(None)
            preds.append(p[own])
            labels.append(b.labels[own])
            if b.teacher_prob is not None:
                probs.append(b.teacher_prob[own])
    model.train()
    # A trainer may have no eval batch (a short file): it still joins the gathers, with nothing.
    p = torch.cat(preds) if preds else torch.empty(0)
    y = torch.cat(labels) if labels else torch.empty(0)
    t = torch.cat(probs) if probs else torch.empty(0)
    if dist.is_initialized():
        p, y, t = (_gather_1d(x) for x in (p, y, t))
    if y.numel() == 0:
        raise PlannerError(
            "no evaluation samples: no trainer read a held-out row",
            fixes=("hold out more rows with --eval-split", "pass --eval-data PATH"),
        )
    out = {"auc": float(binary_auroc(p, y.long())), **click_metrics(p, y)}
    if t.numel():
        out["teacher_auc"] = float(binary_auroc(t, y.long()))  # the same AUC as data.teacher_auc, on these samples
    if dist.is_initialized():
        # Trainer 0's figures for everyone: parallel reductions may differ in the last bit between processes, and
        # early stopping's decisions (a checkpoint, a stop: collectives) must be the same on every trainer.
        shared = [out]
        dist.broadcast_object_list(shared, src=0)
        out = shared[0]
    return out


def scoring_lockstep(batches: Iterable[Batch]) -> Iterator[Batch]:
    """Every trainer's ``batches`` at one size (the largest first batch of any trainer's), as many on each as the
    trainer with the most: a partial batch padded, a trainer whose batches ran out given blank ones
    (:func:`.data.batch.padded`, :func:`.data.batch.blank_batch`); the padding is masked. Unlike :func:`lockstep`,
    which ends every trainer's pass when the first runs out, no sample is left out. Collectives: every trainer
    calls it."""
    it = iter(batches)
    pending = next(it, None)
    shape = None
    if pending is not None:
        weighted = pending.sparse.weights_or_none() is not None
        shape = (list(pending.sparse.keys()), int(pending.dense.shape[1]), pending.size, weighted)
    shapes = [shape]
    if dist.is_initialized():
        shapes = [None] * dist.get_world_size()
        dist.all_gather_object(shapes, shape)
    known = [s for s in shapes if s is not None]
    if not known:
        return
    keys, dense_features, _, weighted = known[0]
    size = max(s[2] for s in known)
    blank = blank_batch(keys, dense_features, size, weighted=weighted)
    while True:
        more = torch.tensor([pending is not None], dtype=torch.int32)
        if dist.is_initialized():
            dist.all_reduce(more, op=dist.ReduceOp.MAX)
        if not more.item():
            return
        if pending is None:
            yield blank
        else:
            yield padded(pending, size)
            pending = next(it, None)


def click_metrics(p: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    """Log loss, normalized entropy and calibration of predicted click probabilities ``p`` against labels ``y``.

    Normalized entropy (He et al., "Practical lessons from predicting clicks on ads at Facebook") is the log loss
    divided by the entropy of the observed click rate: below 1 the model beats predicting that rate for every
    sample. Calibration is the predicted click rate over the observed one (1: calibrated). Both are None when every
    label is the same (no entropy, or no click).
    """
    loss = float(nn.functional.binary_cross_entropy(p.clamp(1e-7, 1 - 1e-7), y))
    ctr = float(y.double().mean())
    base = -(ctr * math.log(ctr) + (1 - ctr) * math.log(1 - ctr)) if 0 < ctr < 1 else 0.0
    return {
        "eval_loss": loss,
        "normalized_entropy": loss / base if base > 0 else None,
        "calibration": float(p.double().mean()) / ctr if ctr > 0 else None,
        "eval_ctr": ctr,
        "eval_samples": int(y.numel()),
    }


def _gather_1d(x: torch.Tensor) -> torch.Tensor:
    n = torch.tensor([x.numel()])
    sizes = [torch.empty_like(n) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, n)
    widest = int(max(s.item() for s in sizes))
    padded = torch.zeros(widest, dtype=x.dtype)
    padded[: x.numel()] = x
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded)
    return torch.cat([p[: int(s.item())] for p, s in zip(parts, sizes, strict=True)])
