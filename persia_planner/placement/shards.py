"""Value objects of a placement: shards and a table's placement (the tiers, sharding types and modes they name live in
:mod:`.kinds`, re-exported here). Shared by the cost model, search and plan.

A shard's :meth:`Shard.storage` is what the runtime allocates for it (:func:`tier_bytes`, from the layouts in
:mod:`.memory`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from persia_planner.kinds import Mode, Sharding
from persia_planner.model.specs import DType, TableSpec
from persia_planner.placement import memory
from persia_planner.tiers import Memory, Tier

__all__ = [
    "Mode",
    "Shard",
    "Sharding",
    "Storage",
    "TablePlacement",
    "Tier",
    "bucket_rows",
    "disk_bytes",
    "even_split",
    "row_blocks",
    "row_splittable",
    "tier_bytes",
]


@dataclass(frozen=True)
class Storage:
    """Bytes held in GPU memory, in DDR (host or parameter server) and on a parameter server's disk."""

    hbm_bytes: int = 0
    ddr_bytes: int = 0
    disk_bytes: int = 0

    def __add__(self, other: Storage) -> Storage:
        return Storage(
            self.hbm_bytes + other.hbm_bytes, self.ddr_bytes + other.ddr_bytes, self.disk_bytes + other.disk_bytes
        )

    def __sub__(self, other: Storage) -> Storage:
        return Storage(
            self.hbm_bytes - other.hbm_bytes, self.ddr_bytes - other.ddr_bytes, self.disk_bytes - other.disk_bytes
        )

    def __mul__(self, factor: int) -> Storage:
        return Storage(self.hbm_bytes * factor, self.ddr_bytes * factor, self.disk_bytes * factor)

    def fits(self, capacity: Storage) -> bool:
        return (
            self.hbm_bytes <= capacity.hbm_bytes
            and self.ddr_bytes <= capacity.ddr_bytes
            and self.disk_bytes <= capacity.disk_bytes
        )


@dataclass(frozen=True)
class Shard:
    """One piece of a table on one device.

    Attributes:
        device: A GPU (``trainer0/gpu1``) for hbm/ddr/hbm_cache, a parameter server (``ps0``) for ps.
        tier: Where the rows live.
        cols: Column range ``[start, end)``.
        bytes: Weights (in the model's dtype) plus optimizer state (float32) held by this shard: the table's data,
            whatever its tier; what the runtime allocates for it is :meth:`storage`.
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
        return bucket_rows(table.rows, *self.hash)

    def row_fraction(self, table: TableSpec) -> float:
        """Share of the table's ids that this shard serves (lookups spread evenly over rows / buckets)."""
        if self.replica:
            return 1.0
        return self.n_rows(table) / table.rows

    def storage(self, table: TableSpec, dtype: DType) -> Storage:
        """HBM and DDR bytes this shard occupies as the runtime allocates them (see :func:`tier_bytes`)."""
        fraction = self.cache_fraction or 0.0
        return _storage(table, self.tier, self.n_rows(table), self.n_cols, dtype, fraction, self.replica)


@functools.lru_cache(maxsize=1 << 16)
def _storage(
    table: TableSpec, tier: Tier, rows: int, cols: int, dtype: DType, cache_fraction: float, replica: bool
) -> Storage:
    # Validation, scoring and the report each ask for every shard's storage, and the shards of a table (a replica on
    # every GPU, equal row blocks) mostly share one: numpy on scalars costs microseconds per call.
    hbm, ddr = tier_bytes(table, tier, rows, cols, dtype, cache_fraction, replica=replica)
    disk = disk_bytes(table, tier, rows, cols, dtype, cache_fraction) if not replica else 0
    return Storage(int(hbm), int(ddr), int(disk))


def bucket_rows(total: int, bucket: int, buckets: int) -> int:
    """Rows of hash bucket ``bucket`` of ``buckets`` (the first ``total % buckets`` buckets one larger)."""
    return total // buckets + (1 if bucket < total % buckets else 0)


def even_split(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` near-equal integers, the first ones one larger: the rows of a ``ps_hash``
    table's buckets (one per server), the columns of a column-wise split."""
    return [bucket_rows(total, i, parts) for i in range(parts)]


def row_blocks(rows: int, parts: int) -> list[int]:
    """Rows per shard of a row-wise split: blocks of ``ceil(rows / parts)``, the remainder, then zeros.

    The one row-block formula: TorchRec's row-wise kernels route id ``i`` to rank ``i // ceil(rows / parts)``, so no
    other split runs; the search builds row-wise shards in this layout (only where no block is empty, see
    :func:`row_splittable`) and the export checks them against it. E.g. 10 rows on 4 ranks -> ``[3, 3, 3, 1]``;
    5 rows on 4 ranks -> ``[2, 2, 1, 0]``.
    """
    block = -(-rows // parts)
    return [max(0, min(block, rows - i * block)) for i in range(parts)]


def row_splittable(rows: int, parts: int) -> bool:
    """Whether ``rows`` split in ``parts`` row blocks (:func:`row_blocks`) leaves no shard empty."""
    return parts > 1 and (parts - 1) * -(-rows // parts) < rows


def tier_bytes(
    table: TableSpec,
    tier: Tier,
    rows: Any,
    cols: int,
    dtype: DType,
    cache_fraction: float = 0.0,
    *,
    replica: bool = False,
) -> tuple[Any, Any]:
    """``(hbm, ddr)`` bytes of a shard of ``rows`` rows (an int or a numpy array of row counts) and ``cols`` columns
    on ``tier``, as the runtime that executes the tier allocates them.

    The tier's :attr:`.TierSpec.rows_in` decides: rows in device memory run as fbgemm's TBE with its table in
    ``DEVICE`` memory, rows in host memory in ``MANAGED`` (UVM) or, for a cached tier, ``MANAGED_CACHING`` memory
    (TorchRec's ``fused``, ``fused_uvm`` and ``fused_uvm_caching`` kernels), see :func:`.memory.fbgemm_bytes`; a
    data-parallel ``replica`` (``hbm``) also keeps its DDP gradient, see :func:`.memory.replica_bytes`; rows in
    server memory live in a parameter server's store, see :func:`.memory.ps_bytes` (DDR of the server); rows on a
    server's disk keep their cache and disk index in its DDR, see :func:`.memory.ssd_bytes` (and :func:`disk_bytes`
    for the disk). The search, the lower bound, validation and the report all charge these.
    """
    if replica:
        return memory.replica_bytes(table, rows, cols, dtype), 0
    spec = tier.spec
    if spec.rows_in is Memory.SERVER:
        return 0, memory.ps_bytes(rows, cols, table.optimizer, dtype)
    if spec.rows_in is Memory.DISK:
        return 0, memory.ssd_bytes(rows, cols, table.optimizer, dtype, cache_fraction)[0]
    managed = spec.rows_in is Memory.HOST
    fraction = cache_fraction if spec.cached else 0.0
    return memory.fbgemm_bytes(table, rows, cols, dtype, managed=managed, cache_fraction=fraction)


def disk_bytes(table: TableSpec, tier: Tier, rows: Any, cols: int, dtype: DType, cache_fraction: float = 0.0) -> Any:
    """Bytes a shard of ``rows`` rows x ``cols`` columns on ``tier`` takes on its parameter server's disk (the file
    of :func:`.memory.ssd_bytes`; 0 on a tier that keeps no rows on disk)."""
    if tier.spec.rows_in is not Memory.DISK:
        return 0 * rows
    return memory.ssd_bytes(rows, cols, table.optimizer, dtype, cache_fraction)[1]


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
