"""A trainer's data: its share of the batch stream (synthetic batch ``b`` goes to trainer ``b mod trainers``; a file
source's shards are split among the trainers, :mod:`.data.shards`), the lockstep that stops every trainer at the same
step, and the evaluation over every trainer's held-out batches."""

from __future__ import annotations

import itertools
import multiprocessing
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from persia_planner.errors import PlannerError
from persia_planner.model.specs import ModelSpec
from persia_planner.modules.data.batch import Batch, as_batches
from persia_planner.modules.data.criteo import CriteoReader
from persia_planner.modules.data.source import DataKind, DataSource
from persia_planner.modules.data.synthetic import SyntheticClicks, Teacher
from persia_planner.modules.data.tabular import TabularReader
from persia_planner.modules.train.config import TrainConfig, data_schema, id_universe

__all__ = ["evaluate", "file_reader", "lockstep", "teacher_for", "trainer_batches"]

_EVAL_SEED_OFFSET = 1_000_003


# ---- data ----------------------------------------------------------------------------------------------------


def teacher_for(spec: ModelSpec, cfg: TrainConfig) -> Teacher:
    """The synthetic data's hidden teacher for ``spec``: one feature per table, ids drawn from ``--id-space`` times
    each table's rows (:func:`.config.id_universe`)."""
    return Teacher(features=tuple(t.name for t in spec.tables), rows=id_universe(spec, cfg), seed=cfg.seed)


def trainer_batches(
    spec: ModelSpec, cfg: TrainConfig, batch_size: int, *, eval_: bool, skip: int = 0
) -> Iterator[Batch]:
    """This trainer's batches after the ``skip`` it trained on before (a resumed run): synthetic global batch ``b``
    goes to trainer ``b mod trainers``; a file source's trainer reads its own shards (:func:`file_reader`)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    count = cfg.eval_batches if eval_ else cfg.steps
    if cfg.data == "synthetic":
        seed = cfg.seed + (_EVAL_SEED_OFFSET if eval_ else 0)
        # The synthetic held-out set is fixed (its own seed): a resumed run evaluates on the same samples.
        start = 0 if eval_ else skip
        data = SyntheticClicks(
            teacher_for(spec, cfg),
            batch_size=batch_size,
            num_batches=(start + count) * world,
            seed=seed,
            pooling={t.name: t.pooling_factor for t in spec.tables},  # the ids per sample the plan was priced for
        )
        for step in range(start, start + count):
            yield data.batch(step * world + rank)
        return
    # A trainer's own stream of its shards: training takes its batches [skip, skip + steps), evaluation the
    # eval_batches right after this run's training ones.
    first = skip + cfg.steps if eval_ else skip
    yield from itertools.islice(file_reader(spec, cfg, batch_size, rank, world), first, first + count)


def file_reader(spec: ModelSpec, cfg: TrainConfig, batch_size: int, rank: int = 0, world: int = 1) -> Iterable[Batch]:
    """The batches trainer ``rank`` of ``world`` reads from ``cfg.data``'s files (its shards only), full ones."""
    source = DataSource.parse(cfg.data)
    files = source.files()
    if cfg.data_workers and multiprocessing.current_process().daemon:
        # The local launcher starts trainers as daemonic processes, which multiprocessing forbids to have children.
        # A DataLoader's workers watch their trainer and end with it, so the trainer may start them.
        multiprocessing.current_process().daemon = False
    if source.kind is DataKind.CRITEO:
        return CriteoReader(
            files, batch_size=batch_size, num_workers=cfg.data_workers, drop_last=True, rank=rank, world=world
        )
    schema = data_schema(spec, cfg)
    assert schema is not None  # config.check_data_matches
    return TabularReader(
        files,
        schema,
        fmt=source.kind.value,
        batch_size=batch_size,
        num_workers=cfg.data_workers,
        rank=rank,
        world=world,
        drop_last=True,
    )


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
    """AUC (torchmetrics), log loss and teacher AUC over every trainer's eval batches (ours, or TorchRec's
    ``Batch`` es: :func:`.data.batch.as_batch`)."""
    from torchmetrics.functional.classification import binary_auroc

    model.eval()
    preds, labels, probs = [], [], []
    with torch.no_grad():
        for b in lockstep(
            as_batches(batches)
        ):  # sharded tables answer in collectives: every trainer runs as many batches
            sparse = b.sparse if device is None or device.type == "cpu" else b.sparse.to(device)
            dense = b.dense if device is None else b.dense.to(device)
            preds.append(torch.sigmoid(model(dense, sparse).squeeze(-1)).cpu())
            labels.append(b.labels)
            if b.teacher_prob is not None:
                probs.append(b.teacher_prob)
    model.train()
    # A trainer may have no eval batch (a short Criteo file): it still joins the gathers, with nothing.
    p = torch.cat(preds) if preds else torch.empty(0)
    y = torch.cat(labels) if labels else torch.empty(0)
    t = torch.cat(probs) if probs else torch.empty(0)
    if dist.is_initialized():
        p, y, t = (_gather_1d(x) for x in (p, y, t))
    if y.numel() == 0:
        raise PlannerError(
            "no evaluation samples: the data ends before the held-out batches",
            fixes=("use more data, or fewer --steps / --eval-batches",),
        )
    out = {
        "auc": float(binary_auroc(p, y.long())),
        "eval_loss": float(nn.functional.binary_cross_entropy(p.clamp(1e-7, 1 - 1e-7), y)),
        "eval_samples": int(y.numel()),
    }
    if t.numel():
        out["teacher_auc"] = float(binary_auroc(t, y.long()))  # the same AUC as data.teacher_auc, on these samples
    return out


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
