"""Value objects of a placement: shards and a table's placement (the tiers, sharding types and modes they name live in
:mod:`.kinds`, re-exported here). Shared by the cost model, search and plan.

A shard's :meth:`Shard.storage` is what the runtime allocates for it (:func:`footprint`, from the layouts in
:mod:`.memory`).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

from persia_planner.kinds import Mode, Sharding
from persia_planner.model.specs import DType, TableSpec
from persia_planner.placement import memory
from persia_planner.tiers import Holder, Memory, Tier

__all__ = [
    "Mode",
    "Shard",
    "Sharding",
    "Storage",
    "TablePlacement",
    "Tier",
    "bucket_rows",
    "even_split",
    "footprint",
    "row_blocks",
    "row_splittable",
    "server_bytes",
    "server_store_rows",
    "tier_bytes",
]


@dataclass(frozen=True)
class Storage:
    """Bytes a shard holds in each memory (:func:`footprint`'s, as whole bytes; a memory it holds nothing of is
    absent), charged to the device of the shard that holds that memory."""

    by_memory: tuple[tuple[Memory, int], ...] = ()

    def of_usage(self, usage_key: str) -> int:
        """Bytes in the memories plan.json reports under ``usage_key`` (``ddr_bytes``: a host's or a server's)."""
        return sum(b for m, b in self.by_memory if m.spec.usage_key == usage_key)

    @property
    def hbm_bytes(self) -> int:
        return self.of_usage(Memory.DEVICE.spec.usage_key)

    @property
    def ddr_bytes(self) -> int:
        return self.of_usage(Memory.HOST.spec.usage_key)


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
        cache_fraction: Share of the shard's rows cached in HBM (``hbm_cache``) or in its server's DDR (``ssd``).
        replica: True for ``data_parallel`` replicas.
        store_rows: On a server tier, the rows its server's store is made to hold (its capacity: what the plan
            charged, :func:`server_store_rows`); None elsewhere, or in a plan.json written before it was recorded.
        backing_rows: On a cached server tier, the rows its store keeps in the tier's backing memory (the ``ssd``
            tier's disk) under its cache of ``store_rows``; 0 elsewhere.
    """

    device: str
    tier: Tier
    cols: tuple[int, int]
    bytes: int
    rows: tuple[int, int] | None = None
    hash: tuple[int, int] | None = None
    cache_fraction: float | None = None
    replica: bool = False
    store_rows: int | None = None
    backing_rows: int = 0

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
        """Bytes this shard occupies in each memory as the runtime allocates them (see :func:`footprint`)."""
        fraction = self.cache_fraction or 0.0
        return _storage(table, self.tier, self.n_rows(table), self.n_cols, dtype, fraction, self.replica)


@functools.lru_cache(maxsize=1 << 16)
def _storage(
    table: TableSpec, tier: Tier, rows: int, cols: int, dtype: DType, cache_fraction: float, replica: bool
) -> Storage:
    # Validation, scoring and the report each ask for every shard's storage, and the shards of a table (a replica on
    # every GPU, equal row blocks) mostly share one: numpy on scalars costs microseconds per call.
    found = footprint(table, tier, rows, cols, dtype, cache_fraction, replica=replica)
    return Storage(tuple((m, int(b)) for m, b in found.items() if int(b)))


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


def footprint(
    table: TableSpec,
    tier: Tier,
    rows: Any,
    cols: int,
    dtype: DType,
    cache_fraction: float = 0.0,
    *,
    replica: bool = False,
) -> dict[Memory, Any]:
    """Bytes per memory of a shard of ``rows`` rows (an int or a numpy array of row counts) and ``cols`` columns on
    ``tier``, as the runtime that executes the tier allocates them; each memory's bytes are charged to the device
    of the shard that holds it (its GPU, its GPU's host, or each server of a hashed share).

    The tier's descriptor decides. A tier TorchRec runs is fbgemm's TBE (TorchRec's ``fused``, ``fused_uvm`` and
    ``fused_uvm_caching`` kernels): rows in device memory, or in host memory as ``MANAGED`` (UVM) or, cached,
    ``MANAGED_CACHING`` (:func:`.memory.fbgemm_bytes`); a data-parallel ``replica`` also keeps its DDP gradient
    (:func:`.memory.replica_bytes`). A tier the servers run is a server's store: every row in the memory it names
    (:func:`.memory.ps_bytes`), or, cached, a cache and the index of its backing rows in ``cache_in`` over the rows
    in ``rows_in`` (:func:`.memory.ssd_bytes`). The search, the lower bound, validation and the report all charge
    these.
    """
    if replica:
        return {Memory.DEVICE: memory.replica_bytes(table, rows, cols, dtype)}
    spec = tier.spec
    if not spec.local:
        if spec.cache_in is None:
            return {spec.rows_in: memory.ps_bytes(rows, cols, table.optimizer, dtype)}
        cache, backing = memory.ssd_bytes(rows, cols, table.optimizer, dtype, cache_fraction)
        return {spec.cache_in: cache, spec.rows_in: backing}
    managed = spec.rows_in is not Memory.DEVICE
    fraction = cache_fraction if spec.cached else 0.0
    device, host = memory.fbgemm_bytes(table, rows, cols, dtype, managed=managed, cache_fraction=fraction)
    return {Memory.DEVICE: device, Memory.HOST: host}


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
    """``(device, host)`` bytes of a shard on a local ``tier`` (:func:`footprint`'s, in its GPU's memory and its
    host's): what the device choice and the enumeration weigh against a GPU and its host."""
    found = footprint(table, tier, rows, cols, dtype, cache_fraction, replica=replica)
    return found.get(Memory.DEVICE, 0 * rows), found.get(Memory.HOST, 0 * rows)


def server_bytes(
    table: TableSpec, tier: Tier, rows: Any, cols: int, dtype: DType, cache_fraction: float = 0.0
) -> dict[Memory, Any]:
    """:func:`footprint` of a server tier's shares, every server memory present (0 where the tier keeps nothing)."""
    found = footprint(table, tier, rows, cols, dtype, cache_fraction)
    return {m: found.get(m, 0 * rows) for m in Memory if m.spec.holder is Holder.SERVER}


def server_store_rows(table_rows: int, n_servers: int, tier: Tier, cache_fraction: float = 0.0) -> tuple[int, int]:
    """``(store_rows, backing_rows)`` of every server's store of a table of ``table_rows`` rows hashed over
    ``n_servers`` on server tier ``tier``, as the plan charges them: a store of the largest bucket's capacity
    (:func:`.memory.ps_server_capacity`, the hash's allowance included), or on a cached tier a cache of
    :func:`.memory.ssd_server_cache_capacity` over that many backing rows (at least the cache's)."""
    whole = memory.ps_server_capacity(table_rows, n_servers)
    if not tier.spec.cached:
        return whole, 0
    cache = memory.ssd_server_cache_capacity(table_rows, n_servers, cache_fraction)
    return cache, max(cache, whole)


@dataclass(frozen=True)
class TablePlacement:
    """Where one table went: its sharding type, its shards, the dtype its rows were planned in (None: a plan
    written before plan.json recorded it; the model's is then assumed) and whether it was planned as a sequence
    table (``pooling: none``: one output row per id, TorchRec's ``EmbeddingCollection``)."""

    sharding: Sharding
    shards: tuple[Shard, ...]
    dtype: DType | None = None
    sequence: bool = False

    @property
    def mode(self) -> Mode:
        return Mode.ASYNC if self.sharding is Sharding.PS_HASH else Mode.SYNC

    def same_as(self, other: TablePlacement) -> bool:
        """Whether the two place the table alike; what one of them does not record (a plan.json, or a checkpoint's
        plan, written before ``dtype`` and the stores' rows were) is no difference."""
        if self.sharding is not other.sharding or len(self.shards) != len(other.shards):
            return False
        if self.sequence is not other.sequence:
            return False
        if self.dtype is not None and other.dtype is not None and self.dtype is not other.dtype:
            return False

        def unrecorded(shard: Shard) -> Shard:
            return dataclasses.replace(shard, store_rows=None, backing_rows=0)

        return all(
            a == b or (None in (a.store_rows, b.store_rows) and unrecorded(a) == unrecorded(b))
            for a, b in zip(self.shards, other.shards, strict=True)
        )

    @property
    def tier(self) -> Tier:
        """The tier of the shards (every shard of a table shares it)."""
        return self.shards[0].tier

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s.device for s in self.shards))
