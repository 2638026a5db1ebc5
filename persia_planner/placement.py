"""Value objects of a placement: tiers, sharding types, shards. Shared by the cost model, search and plan."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from persia_planner.specs import DType, TableSpec

__all__ = ["Mode", "Shard", "Sharding", "Storage", "TablePlacement", "Tier", "cache_bytes"]


class Tier(enum.StrEnum):
    """Where a shard's rows live."""

    HBM = "hbm"  # GPU memory
    DDR = "ddr"  # host memory, read by the GPU through UVM
    HBM_CACHE = "hbm_cache"  # rows in host DDR, the hottest cached in HBM
    PS = "ps"  # a parameter server's DDR, trained asynchronously


class Sharding(enum.StrEnum):
    """How a table is split (TorchRec's names, plus the parameter-server hash sharding)."""

    TABLE_WISE = "table_wise"
    ROW_WISE = "row_wise"
    COLUMN_WISE = "column_wise"
    TABLE_ROW_WISE = "table_row_wise"
    TABLE_COLUMN_WISE = "table_column_wise"
    DATA_PARALLEL = "data_parallel"
    PS_HASH = "ps_hash"


class Mode(enum.StrEnum):
    """How a table trains: synchronously with the dense step, or asynchronously on the parameter servers."""

    SYNC = "sync"
    ASYNC = "async"


@dataclass(frozen=True)
class Storage:
    """Bytes held in GPU memory and in DDR (host or parameter server)."""

    hbm_bytes: int = 0
    ddr_bytes: int = 0

    def __add__(self, other: Storage) -> Storage:
        return Storage(self.hbm_bytes + other.hbm_bytes, self.ddr_bytes + other.ddr_bytes)

    def __sub__(self, other: Storage) -> Storage:
        return Storage(self.hbm_bytes - other.hbm_bytes, self.ddr_bytes - other.ddr_bytes)

    def __mul__(self, factor: int) -> Storage:
        return Storage(self.hbm_bytes * factor, self.ddr_bytes * factor)

    def fits(self, capacity: Storage) -> bool:
        return self.hbm_bytes <= capacity.hbm_bytes and self.ddr_bytes <= capacity.ddr_bytes


@dataclass(frozen=True)
class Shard:
    """One piece of a table on one device.

    Attributes:
        device: A GPU (``trainer0/gpu1``) for hbm/ddr/hbm_cache, a parameter server (``ps0``) for ps.
        tier: Where the rows live.
        cols: Column range ``[start, end)``.
        bytes: Weights plus optimizer state held by this shard (DDR bytes for ddr/hbm_cache).
        rows: Row range ``[start, end)`` for range shards, None for hash shards.
        hash: ``(bucket, buckets)`` for ``ps_hash`` shards.
        cache_fraction: Share of the shard's rows cached in HBM (``hbm_cache`` only).
        replica: True for ``data_parallel`` replicas.
    """

    device: str
    tier: Tier
    cols: tuple[int, int]
    bytes: int
    rows: tuple[int, int] | None = None
    hash: tuple[int, int] | None = None
    cache_fraction: float | None = None
    replica: bool = False

    @property
    def n_cols(self) -> int:
        return self.cols[1] - self.cols[0]

    def n_rows(self, table: TableSpec) -> int:
        """Rows held: the range length, or the bucket's share of the table."""
        if self.rows is not None:
            return self.rows[1] - self.rows[0]
        assert self.hash is not None
        bucket, buckets = self.hash
        return table.rows // buckets + (1 if bucket < table.rows % buckets else 0)

    def row_fraction(self, table: TableSpec) -> float:
        """Share of the table's ids that this shard serves (lookups spread evenly over rows / buckets)."""
        if self.replica:
            return 1.0
        return self.n_rows(table) / table.rows

    def storage(self, table: TableSpec, dtype: DType) -> Storage:
        """HBM and DDR bytes this shard occupies (an HBM cache counts in HBM, its backing rows in DDR)."""
        if self.tier is Tier.HBM:
            return Storage(hbm_bytes=self.bytes)
        if self.tier is Tier.HBM_CACHE:
            return Storage(cache_bytes(self.n_rows(table), self.n_cols, self.cache_fraction or 0.0, dtype), self.bytes)
        return Storage(ddr_bytes=self.bytes)


def cache_bytes(rows: int, cols: int, fraction: float, dtype: DType) -> int:
    """HBM bytes of a cache holding ``fraction`` of ``rows`` (weights only; fbgemm keeps state with the rows)."""
    return math.ceil(rows * fraction) * cols * dtype.n_bytes


@dataclass(frozen=True)
class TablePlacement:
    """Where one table went: its sharding type and its shards."""

    sharding: Sharding
    shards: tuple[Shard, ...]

    @property
    def mode(self) -> Mode:
        return Mode.ASYNC if self.sharding is Sharding.PS_HASH else Mode.SYNC

    @property
    def tier(self) -> Tier:
        """The tier of the shards (every shard of a table shares it)."""
        return self.shards[0].tier

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s.device for s in self.shards))
