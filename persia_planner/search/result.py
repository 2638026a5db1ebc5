"""From a searched option and its devices to the plan's shards: row and column ranges and byte counts."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from persia_planner.cost.analytic import CostModel
from persia_planner.kinds import Sharding
from persia_planner.model.specs import TableSpec
from persia_planner.placement.shards import Shard, TablePlacement, even_split, row_blocks, server_store_rows
from persia_planner.search.base import Option

__all__ = ["build_placement"]


def _bounds(sizes: Sequence[int]) -> list[tuple[int, int]]:
    edges = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    return [(int(a), int(b)) for a, b in itertools.pairwise(edges)]


def build_placement(cost: CostModel, table: TableSpec, option: Option, gpus: Sequence[int]) -> TablePlacement:
    """Turn an option and its devices into shards with row/column ranges and byte counts."""
    topo, dtype = cost.topology, cost.dtype_of(table)
    names = [topo.gpus[g].name for g in gpus]
    fraction = option.cache_fraction if option.tier.spec.cached else None
    s = option.sharding

    row_bytes: dict[int, int] = {}  # per column count: a replica on every GPU, equal splits

    def shard(device: str, rows: tuple[int, int], cols: tuple[int, int], replica: bool = False) -> Shard:
        width = cols[1] - cols[0]
        if width not in row_bytes:
            row_bytes[width] = table.row_bytes(dtype, width)
        n_bytes = (rows[1] - rows[0]) * row_bytes[width]
        return Shard(device, option.tier, cols, n_bytes, rows=rows, cache_fraction=fraction, replica=replica)

    full_rows, full_cols = (0, table.rows), (0, table.dim)
    if s is Sharding.PS_HASH:
        n = len(topo.servers)
        rows = even_split(table.rows, n)
        store, backing = server_store_rows(table.rows, n, option.tier, fraction or 0.0)
        shards = tuple(
            Shard(
                server.name,
                option.tier,
                full_cols,
                rows[i] * table.row_bytes(dtype),
                hash=(i, n),
                cache_fraction=fraction,
                store_rows=store,
                backing_rows=backing,
            )
            for i, server in enumerate(topo.servers)
        )
        return TablePlacement(s, shards, dtype, table.sequence)
    if s is Sharding.DATA_PARALLEL:
        return TablePlacement(
            s, tuple(shard(d, full_rows, full_cols, replica=True) for d in names), dtype, table.sequence
        )
    if s in (Sharding.COLUMN_WISE, Sharding.TABLE_COLUMN_WISE, Sharding.TABLE_WISE):
        cols = _bounds(even_split(table.dim, len(names)))
        return TablePlacement(
            s, tuple(shard(d, full_rows, c) for d, c in zip(names, cols, strict=True)), dtype, table.sequence
        )
    rows = _bounds(row_blocks(table.rows, len(names)))
    return TablePlacement(
        s, tuple(shard(d, r, full_cols) for d, r in zip(names, rows, strict=True)), dtype, table.sequence
    )
