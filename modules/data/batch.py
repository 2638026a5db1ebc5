"""The batch every reader yields and the trainer takes, and :func:`as_batch`, which also takes TorchRec's."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = ["Batch", "as_batch", "as_batches"]


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
    """

    dense: torch.Tensor
    sparse: KeyedJaggedTensor
    labels: torch.Tensor
    teacher_prob: torch.Tensor | None = None

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
