"""The batch every reader yields and the trainer takes, and :func:`as_batch`, which also takes TorchRec's."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = ["Batch", "as_batch", "as_batches", "blank_batch", "padded"]


@dataclass(frozen=True, eq=False)
class Batch:
    """One training batch (shared by the file readers and the synthetic generator).

    Attributes:
        dense: ``[B, D]`` float32 dense features (Criteo's 13, transformed as :mod:`.criteo_format` says; a click
            log's dense columns).
        sparse: KeyedJaggedTensor of int64 ids; keys are the feature names (``"c1".."c26"`` for Criteo, the tables
            a click log's features feed), one bag per (feature, sample), key-major like all KJTs.
        labels: ``[B]`` float32 click labels (0/1).
        teacher_prob: ``[B]`` float32 true click probability for synthetic data (``None`` for real data).
        mask: ``[B]`` bool, the samples that are data; ``None``: all of them. An evaluation pads a trainer's last
            partial batch, and gives a trainer whose rows ran out blank batches, so that sharded tables see batches
            of one size on every trainer (:func:`padded`); the padding is scored and left out.
    """

    dense: torch.Tensor
    sparse: KeyedJaggedTensor
    labels: torch.Tensor
    teacher_prob: torch.Tensor | None = None
    mask: torch.Tensor | None = None

    @property
    def size(self) -> int:
        """Number of samples in the batch."""
        return int(self.labels.shape[0])


def as_batch(batch: Any) -> Batch:
    """``batch`` as our :class:`Batch`: ours as it is, or TorchRec's ``torchrec.datasets.utils.Batch``
    (``dense_features``, ``sparse_features``, ``labels``; labels become float32 for the loss).

    Raises:
        TypeError: ``batch`` is neither.
    """
    if isinstance(batch, Batch):
        return batch
    if all(hasattr(batch, name) for name in ("dense_features", "sparse_features", "labels")):
        labels = batch.labels
        return Batch(
            dense=batch.dense_features,
            sparse=batch.sparse_features,
            labels=labels if labels.dtype == torch.float32 else labels.float(),
        )
    raise TypeError(f"expected a persia Batch or a torchrec.datasets.utils.Batch, got {type(batch).__name__}")


def as_batches(batches: Iterable[Any]) -> Iterator[Batch]:
    """Every batch of ``batches`` through :func:`as_batch`."""
    return (as_batch(b) for b in batches)


def blank_batch(keys: list[str], dense_features: int, size: int, *, weighted: bool = False) -> Batch:
    """``size`` samples that are all padding: no id in any bag of ``keys`` (with no weight, ``weighted``: the
    features of a weighted collection), zero dense features, masked out."""
    return Batch(
        dense=torch.zeros(size, dense_features),
        sparse=KeyedJaggedTensor(
            keys=list(keys),
            values=torch.empty(0, dtype=torch.int64),
            lengths=torch.zeros(len(keys) * size, dtype=torch.int32),
            weights=torch.empty(0) if weighted else None,
        ),
        labels=torch.zeros(size),
        mask=torch.zeros(size, dtype=torch.bool),
    )


def padded(batch: Batch, size: int) -> Batch:
    """``batch`` with blank samples (:func:`blank_batch`) appended up to ``size``, and its mask saying which are
    its own; ``batch`` itself when it has ``size`` samples.

    Raises:
        ValueError: ``batch`` has more than ``size`` samples.
    """
    n = batch.size
    if n > size:
        raise ValueError(f"a batch of {n} samples does not fit {size}")
    if n == size:
        return batch
    keys = batch.sparse.keys()
    lengths = batch.sparse.lengths().view(len(keys), n)
    pad = torch.zeros(len(keys), size - n, dtype=lengths.dtype)
    weights = batch.sparse.weights_or_none()
    sparse = KeyedJaggedTensor(
        keys=list(keys),
        values=batch.sparse.values(),
        lengths=torch.cat([lengths, pad], dim=1).reshape(-1),
        weights=weights,
    )
    own = batch.mask if batch.mask is not None else torch.ones(n, dtype=torch.bool)
    teacher = batch.teacher_prob
    return Batch(
        dense=torch.cat([batch.dense, batch.dense.new_zeros(size - n, batch.dense.shape[1])]),
        sparse=sparse,
        labels=torch.cat([batch.labels, batch.labels.new_zeros(size - n)]),
        teacher_prob=None if teacher is None else torch.cat([teacher, teacher.new_zeros(size - n)]),
        mask=torch.cat([own, torch.zeros(size - n, dtype=torch.bool)]),
    )
