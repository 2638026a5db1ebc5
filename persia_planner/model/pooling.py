"""How a table's looked-up rows leave it: pooled into one vector per bag (TorchRec's ``EmbeddingBagCollection``, sum
or mean) or one vector per id (a sequence feature, TorchRec's ``EmbeddingCollection``).

A sequence table's output is ``ids x dim``, not ``samples x dim``: what its all-to-all carries grows with the
sequence, and TorchRec shards it with fewer types (its ``EmbeddingCollectionSharder``: no table-row-wise or
table-column-wise, whose host-level reduction has nothing to reduce). Its ``pooling_factor`` is the sequence's mean
length, its :class:`SequenceLength` also bounds it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from persia_planner.kinds import Sharding

__all__ = ["SEQUENCE_SHARDINGS", "Pooling", "SequenceLength", "sequence_shardings"]


class Pooling(enum.StrEnum):
    """How a table combines the rows of one sample's ids (model.yaml's ``pooling``; TorchRec's ``PoolingType``, with
    ``none`` for an ``EmbeddingConfig``)."""

    SUM = "sum"
    MEAN = "mean"
    NONE = "none"

    @property
    def pooled(self) -> bool:
        """Whether a sample's ids become one vector (a bag), not one vector each (a sequence)."""
        return self is not Pooling.NONE


SEQUENCE_SHARDINGS: frozenset[Sharding] = frozenset(
    {Sharding.TABLE_WISE, Sharding.ROW_WISE, Sharding.COLUMN_WISE, Sharding.DATA_PARALLEL, Sharding.PS_HASH}
)
"""The sharding types of a sequence table: TorchRec's ``EmbeddingCollectionSharder.sharding_types`` (the same on CPU
and CUDA) and the parameter servers' hash sharding, which looks rows up per id for bags and sequences alike."""


def sequence_shardings(cpu: bool) -> frozenset[Sharding]:
    """The sharding types a sequence table runs as planned on trainers of one kind: :data:`SEQUENCE_SHARDINGS`, but
    data-parallel on CPU trainers, where fbgemm's dense kernel (TorchRec's ``dense`` compute kernel of a replica)
    pools a batch's rows even when asked for one per id (fbgemm-gpu-cpu 1.8)."""
    return SEQUENCE_SHARDINGS - {Sharding.DATA_PARALLEL} if cpu else SEQUENCE_SHARDINGS


@dataclass(frozen=True)
class SequenceLength:
    """How many ids a sample's sequence holds (model.yaml's ``sequence_length: {mean, max}``).

    Attributes:
        mean: Mean ids per sample: the table's lookups per sample, as a bag's ``pooling_factor``.
        max: The most ids of a sample's sequence DIN attends over: a longer one is read by its last ``max`` ids
            (the most recent); the lookups of a sequence are of every id, as the data gives them.
    """

    mean: float
    max: int

    def __post_init__(self) -> None:
        if not 0 < self.mean <= self.max:
            raise ValueError(f"sequence length: need 0 < mean <= max, got mean {self.mean:g} and max {self.max}")
