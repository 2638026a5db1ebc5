"""What the search keeps of each table's shards between scorings: the parts of their load and memory vectors that do
not depend on the rest of the plan.

A shard's vectors are fixed (:mod:`persia_planner.cost.analytic`): a table is scored again and again (two constructions,
then every re-insertion of the local search), and most of each scoring was recomputing them. :class:`ShardTerms`
computes the terms of a range shard once per table, tier, cache fraction and column count (for every GPU), and the whole
vectors of the placements that do not depend on the state at all (row-wise over every GPU, table-row-wise per host, a
replica on every GPU, hashed over the servers); the search builds the rows of its candidate GPUs from them. The vectors
are the cost model's, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import numpy as np

from persia_planner.cost.analytic import CostModel
from persia_planner.kinds import Sharding
from persia_planner.model.specs import TableSpec
from persia_planner.placement.shards import tier_bytes
from persia_planner.tiers import Tier

__all__ = ["RangeTerms", "ShardTerms"]


@dataclass(frozen=True)
class RangeTerms:
    """A range shard of a table (its rows, ``cols`` columns, on a tier), on every GPU.

    Attributes:
        terms: :meth:`.CostModel.range_shard_terms` for every GPU.
        hbm: HBM bytes of the shard (on its GPU).
        ddr: DDR bytes of the shard (on its GPU's host).
    """

    terms: tuple[float, float, np.ndarray, np.ndarray | None]
    hbm: float
    ddr: float


class ShardTerms:
    """Per-search cache of the state-independent parts of the tables' load and memory vectors.

    Args:
        cost: The cost model every vector comes from.
    """

    def __init__(self, cost: CostModel):
        self.cost = cost
        self.all_gpus = np.arange(cost.layout.n_gpus)
        self._range: dict[tuple[str, Tier, float, int], RangeTerms] = {}
        self._whole: dict[Hashable, object] = {}

    def range_terms(self, table: TableSpec, tier: Tier, cache_fraction: float, cols: int) -> RangeTerms:
        """The terms of a shard of every row of ``table`` and ``cols`` columns on ``tier``."""
        key = (table.name, tier, cache_fraction, cols)
        found = self._range.get(key)
        if found is None:
            cost = self.cost
            terms = cost.range_shard_terms(table, 1.0, cols, tier, self.all_gpus, cache_fraction=cache_fraction)
            hbm, ddr = tier_bytes(table, tier, table.rows, cols, cost.dtype_of(table), cache_fraction)
            found = self._range[key] = RangeTerms(terms, float(hbm), float(ddr))
        return found

    def range_loads(self, found: RangeTerms, gpus: np.ndarray, sharding: Sharding) -> np.ndarray:
        """Load vectors (one row per GPU in ``gpus``) of the shard of ``found`` of a ``sharding`` placement on each
        of them."""
        out_bytes, ids_half, emb, ddr = found.terms
        return self.cost.range_loads_of(
            (out_bytes, ids_half, emb[gpus], None if ddr is None else ddr[gpus]), gpus, sharding
        )

    def range_mem(self, found: RangeTerms, gpus: np.ndarray) -> np.ndarray:
        """Memory vectors (one row per GPU in ``gpus``) of the shard of ``found`` on each of them."""
        return self.cost.shard_memory(gpus, found.hbm, found.ddr)

    def size(self, table: TableSpec) -> int:
        """The table's bytes (weights and optimizer state)."""
        return self.whole(("size", table.name), lambda: table.bytes(self.cost.dtype_of(table)))  # type: ignore[return-value]

    def whole(self, key: Hashable, compute: Callable[[], object]) -> object:
        """The value of ``compute()`` (a placement's vectors that depend on nothing but the table), kept by ``key``."""
        found = self._whole.get(key, self)
        if found is self:
            found = self._whole[key] = compute()
        return found
