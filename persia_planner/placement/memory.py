"""Bytes as the runtimes allocate them: fbgemm's table-batched embeddings and the parameter-server store.

The planner never imports torch or fbgemm, so the layouts it charges are restated here, each next to the source it
comes from. ``tests/test_memory.py`` checks them against the real allocations (fbgemm's buffers, the store's tensors
and a process's resident memory), ``persia_planner.modules.tools.memory_audit`` (``tests/test_memory_audit.py``) against
the modules ``persia train`` builds, per trainer and server, and the store takes its capacity limit and defaults from
here, so the two cannot drift apart silently.

**fbgemm** (fbgemm_gpu 1.8, ``split_table_batched_embeddings_ops_training.py``,
``SplitTableBatchedEmbeddingBagsCodegen`` as TorchRec 1.8's fused kernels build it: ``hbm`` ->
``EmbeddingLocation.DEVICE``, ``ddr`` -> ``MANAGED`` (UVM), ``hbm_cache`` -> ``MANAGED_CACHING``; the export sets only
``CacheParams(load_factor=...)``, so LRU and no prefetch pipeline):

* Weights: ``weights_dev`` (DEVICE) or ``weights_uvm`` (MANAGED, MANAGED_CACHING: host DDR), rows x cols x dtype
  (``construct_split_state(rowwise=False, cacheable=True)``).
* Optimizer state: ``momentum1`` (and ``momentum2`` for Adam), float32 (``momentum1_dtype`` / ``momentum2_dtype``
  without ``optimizer_state_dtypes``), placed by ``construct_split_state(rowwise=..., cacheable=False)``: "If table
  is managed, then if optimizer state is rowwise, optimizer is on device, otherwise optimizer is managed". Row-wise
  Adagrad's one float32 per row is therefore in **HBM** for ``ddr`` and ``hbm_cache`` tables too; Adagrad's and
  Adam's per-element state stays in UVM (host DDR) with the rows.
* The cache (``_apply_cache_state``, MANAGED_CACHING only), in HBM:

  - ``cache_sets = (int(total_cache_hash_size * cache_load_factor) + DEFAULT_ASSOC - 1) // DEFAULT_ASSOC``, at
    least 1, with ``DEFAULT_ASSOC`` = 32 (64 on ROCm); slots = ``cache_sets * DEFAULT_ASSOC``.
  - Per slot: ``lxu_cache_weights`` [slots, max_D_cache] in the cache precision (the weights' by default),
    ``lxu_cache_state`` int64 [cache_sets, ASSOC] and ``lxu_state`` int64 [cache_sets, ASSOC] (LRU; LFU would keep
    one int64 per *row* instead); ``lxu_cache_locking_counter`` int32 [cache_sets, ASSOC] only with
    ``prefetch_pipeline`` (off: [0, 0]).
  - Per row of every cached table: ``cache_index_table_map`` int32 [total_cache_hash_size].
  - Constant size (``cache_hash_size_cumsum``, ``cache_miss_counter``, the statistics): not charged.

  TorchRec puts a GPU's fused tables into one TBE (``_group_tables_per_rank``: ``fused_uvm`` and
  ``fused_uvm_caching`` group as ``fused``; without prefetch every dim shares the group) and gives it the cached
  tables' load factors averaged by rows (``_get_weighted_avg_cache_load_factor``), so its slots are about the sum
  of each cached shard's rows x fraction, as charged here shard by shard. Per shard the rounding to whole sets adds
  at most 31 slots where fbgemm rounds once per TBE; where cached tables of different widths share a TBE, fbgemm
  pads every slot to the widest (``max_D_cache``), which a per-shard charge does not see.

**Data-parallel replicas** (TorchRec 1.8's ``data_parallel`` sharding): every rank holds the whole table in fbgemm's
dense TBE (``DenseTableBatchedEmbeddingBagsCodegen``: ``weights``, in the model's dtype) and trains it outside the
fused kernels, so two more things live beside the weights:

* its gradient: TorchRec wraps the replicas' lookup in DDP with ``gradient_as_bucket_view=True``
  (``ShardedEmbeddingBagCollection.init_data_parallel``), whose reducer keeps a bucket of the parameter's size and
  dtype for good and hands out the gradient as a view of it: rows x cols x dtype;
* the ``torch.optim`` state (``data_parallel_tables`` in ``modules/embedding/model_parallel.py``: TorchRec's
  ``RowWiseAdagrad`` one value per row, ``Adagrad`` one per element, ``Adam`` two), in the weights' dtype, which is
  float32 whenever there is state (``execution.check_executable`` refuses a stateful optimizer on fp16 / bf16 replicas);
  a scalar step count per table is not charged.

So a replica costs :func:`fbgemm_bytes` of the table in ``DEVICE`` memory plus its gradient (:func:`replica_bytes`).

**Parameter-server store** (``modules/ps/store.py``, ``EmbeddingStore``; its rows in ``modules/ps/row_slots.py``,
``RowSlots``), per table and server, for a capacity of C rows holding R of them:

* ``weights`` [C, dim] in the table's ``embedding_dtype`` (fp16 / bf16 halve them; the optimizer steps in
  float32 and rounds the new rows back) and ``state`` float32 [C, state_width], which the optimizer needs whole;
* ``records`` int64 [C, 2] (the id; last access int32 + access count int32): 16 B;
* ``dirty`` bool [C]: 1 B, zeroed (so written) when the store is created;
* ``HashIndex.buckets`` int64 [max(ceil(C / index_load_factor), C + 1)]: 16 B per row of capacity at the
  default load factor 0.5, all written (-1) when the store is created.

The weights, state and records are allocated untouched (``torch.empty`` or an anonymous mapping) and become resident as
rows are inserted, always as the prefix [0, R). So a server's table costs ``R x (16 + w x dim + 4 x state_width) + C x 1
+ 8 x buckets(C)`` bytes of DDR, ``w`` the dtype's bytes (:func:`ps_store_bytes`). The plan charges it filled, R = C,
with C what ``persia train`` gives each server (:func:`ps_capacity`: the shard's rows plus an allowance for the hash's
imbalance), since a server that receives more distinct ids than that fills it. (``persia train`` sizes every server's
store of a table for the largest bucket, ``ceil(rows / servers)``, so a server of a bucket one row smaller holds up to 2
rows more than its charge.) The store refuses a capacity of ``2**40 - 1`` or more (its hash index keeps 40-bit slot
numbers), which caps the rows of one table on one server (:data:`PS_MAX_ROWS`). A server's resident memory grows by a
few MiB more than its stores' arrays, which no layout charges: the last huge page (2 MiB) of each partly filled array of
32 MiB or more, and code and heap that its first large requests leave; that is a constant per table and server, inside
``ps_reserve_fraction``."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from persia_planner.errors import CapacityError
from persia_planner.model.specs import OPTIMIZER_STATE_VALUE_BYTES, DType, Optimizer, TableSpec
from persia_planner.units import format_bytes

__all__ = [
    "FBGEMM_CACHE_ASSOCIATIVITY",
    "FBGEMM_CACHE_INDEX_BYTES_PER_ROW",
    "FBGEMM_CACHE_STATE_BYTES_PER_SLOT",
    "PS_BUCKET_BYTES",
    "PS_CAPACITY_SIGMAS",
    "PS_CAPACITY_SLACK_ROWS",
    "PS_DIRTY_BYTES",
    "PS_INDEX_LOAD_FACTOR",
    "PS_LIMIT_REASON",
    "PS_MAX_CAPACITY",
    "PS_MAX_ROWS",
    "PS_RECORD_BYTES",
    "PS_VALUE_BYTES",
    "SSD_BLOCK_BYTES",
    "SSD_HEADER_BYTES",
    "SSD_INDEX_BYTES",
    "SSD_LOG_SLACK",
    "fbgemm_bytes",
    "fbgemm_cache_slots",
    "largest_cache_fraction",
    "ps_bytes",
    "ps_capacity",
    "ps_holds",
    "ps_rows_error",
    "ps_server_capacity",
    "ps_servers_needed",
    "ps_store_bytes",
    "replica_bytes",
    "ssd_bytes",
    "ssd_cache_rows",
    "ssd_file_bytes",
    "ssd_file_slots",
    "ssd_record_bytes",
    "ssd_record_size",
    "ssd_rows_per_block",
    "ssd_server_cache_capacity",
]

# ---- fbgemm ------------------------------------------------------------------------------------------------------
FBGEMM_CACHE_ASSOCIATIVITY = 32
"""Cache slots per set: fbgemm's ``DEFAULT_ASSOC`` on CUDA (64 on ROCm)."""
FBGEMM_CACHE_INDEX_BYTES_PER_ROW = 4
"""HBM per row of a cached table: ``cache_index_table_map``, int32 [total_cache_hash_size]."""
FBGEMM_CACHE_STATE_BYTES_PER_SLOT = 16
"""HBM per cache slot besides its weights: ``lxu_cache_state`` + ``lxu_state`` (LRU), int64 each."""


def fbgemm_cache_slots(rows: Any, fraction: float) -> Any:
    """Cache slots fbgemm allocates for ``rows`` cached rows at load factor ``fraction`` (``_apply_cache_state``:
    ``int(rows * fraction)`` rounded up to whole sets of ``DEFAULT_ASSOC``, at least one set; none without rows).

    ``rows`` may be a numpy array (one shard per element).
    """
    rows = np.asarray(rows, dtype=float)
    sets = np.maximum(np.ceil(np.floor(rows * fraction) / FBGEMM_CACHE_ASSOCIATIVITY), 1.0)
    return np.where(rows > 0, sets * FBGEMM_CACHE_ASSOCIATIVITY, 0.0)


def fbgemm_bytes(
    table: TableSpec, rows: Any, cols: int, dtype: DType, *, managed: bool, cache_fraction: float = 0.0
) -> tuple[Any, Any]:
    """``(hbm, ddr)`` bytes of an fbgemm TBE shard of ``rows`` rows x ``cols`` columns of ``table``.

    Args:
        table: The table (its optimizer decides the state and where it lives).
        rows: Rows of the shard (an int, or a numpy array of row counts).
        cols: Columns of the shard.
        dtype: Weight dtype (also the cache's).
        managed: The rows are in UVM (``MANAGED`` / ``MANAGED_CACHING``: host DDR), not in HBM (``DEVICE``).
        cache_fraction: The cache load factor of a ``MANAGED_CACHING`` shard; 0 for no cache.
    """
    rows = np.asarray(rows, dtype=float)
    weights = rows * (cols * dtype.n_bytes)
    state = rows * table.optimizer.state_bytes_per_row(cols)
    if not managed:
        return weights + state, np.zeros_like(rows)
    # Row-wise state is on the device even for managed tables (construct_split_state); the rest follows the rows.
    hbm = state if table.optimizer.rowwise else np.zeros_like(rows)
    ddr = weights if table.optimizer.rowwise else weights + state
    if cache_fraction > 0:
        slots = fbgemm_cache_slots(rows, cache_fraction)
        hbm = (
            hbm
            + rows * FBGEMM_CACHE_INDEX_BYTES_PER_ROW
            + slots * (cols * dtype.n_bytes + FBGEMM_CACHE_STATE_BYTES_PER_SLOT)
        )
    return hbm, ddr


def largest_cache_fraction(table: TableSpec, rows: int, cols: int, dtype: DType, hbm_room: float) -> float:
    """The largest cache load factor whose ``MANAGED_CACHING`` shard of ``rows`` x ``cols`` takes at most
    ``hbm_room`` bytes of HBM (:func:`fbgemm_bytes`: whole sets of slots); 0 where not even one set fits, at most 1.
    """
    fixed, _ = fbgemm_bytes(table, rows, cols, dtype, managed=True)
    fixed = float(fixed) + rows * FBGEMM_CACHE_INDEX_BYTES_PER_ROW
    per_set = FBGEMM_CACHE_ASSOCIATIVITY * (cols * dtype.n_bytes + FBGEMM_CACHE_STATE_BYTES_PER_SLOT)
    sets = math.floor((hbm_room - fixed) / per_set)
    if sets < 1 or rows <= 0:
        return 0.0
    return min(1.0, sets * FBGEMM_CACHE_ASSOCIATIVITY / rows)


def replica_bytes(table: TableSpec, rows: Any, cols: int, dtype: DType) -> Any:
    """HBM bytes of a data-parallel replica of ``rows`` x ``cols``: its weights and optimizer state as fbgemm's
    ``DEVICE`` TBE holds them (:func:`fbgemm_bytes`) plus the gradient DDP's bucket keeps, rows x cols in the
    weights' dtype (see the module docstring). ``rows`` may be a numpy array."""
    rows = np.asarray(rows, dtype=float)
    hbm, _ = fbgemm_bytes(table, rows, cols, dtype, managed=False)
    return hbm + rows * (cols * dtype.n_bytes)


# ---- the parameter-server store ----------------------------------------------------------------------------------
PS_VALUE_BYTES = OPTIMIZER_STATE_VALUE_BYTES
"""The store's optimizer state is float32 (``RowSlots.state``) whatever the plan's dtype (the weights' dtype)."""
PS_RECORD_BYTES = 16
"""Per row held besides the values: ``RowSlots.records`` int64 [C, 2] (the id, last access + access count)."""
PS_DIRTY_BYTES = 1
"""Per row of capacity: the dirty mask ``RowSlots.dirty``, bool [C], written whole (zeroed) at creation."""
PS_BUCKET_BYTES = 8
"""One bucket of the store's hash index (``HashIndex.buckets``, int64)."""
PS_INDEX_LOAD_FACTOR = 0.5
"""Rows per bucket at full capacity: the store's default ``index_load_factor`` (buckets = capacity / 0.5)."""
PS_MAX_CAPACITY = 2**40 - 2
"""The largest capacity the store accepts (it refuses ``2**40 - 1`` and above: its index keeps 40-bit slot numbers)."""
PS_CAPACITY_SIGMAS = 4
"""Standard deviations of the hash's imbalance that a server's capacity allows for (see :func:`ps_capacity`)."""
PS_CAPACITY_SLACK_ROWS = 64
"""Rows of capacity added to the allowance, for small shards, whose counts are not yet normal (Poisson tails)."""


def ps_capacity(rows: Any) -> Any:
    """The store capacity (rows) a server gets for a table of which it is planned to hold ``rows`` rows.

    ``rows + ceil(4 sqrt(rows)) + 64``: the planned rows plus an allowance for the hash's imbalance. A table's ids
    go to servers by a 64-bit mixing hash (``modules/ps/sharding.server_of``: splitmix64's finaliser of the id xor a
    salt of the table's name, modulo the servers), so of N distinct ids each of n servers receives a
    Binomial(N, 1/n) count: mean ``R = N / n``, standard deviation ``sqrt(R (1 - 1/n)) <= sqrt(R)``. Four of them
    are exceeded with probability about 3e-5 per server and table, so a table whose ids all fit is (almost) never
    evicted; the 64 rows cover small shards, where the count's tail is wider than the normal's. A server under
    pressure (more distinct ids than that) fills its whole capacity, which is what the plan charges
    (:func:`ps_bytes`). ``rows`` may be a numpy array; ``int()`` the result of a scalar.
    """
    rows = np.asarray(rows, dtype=float)
    return rows + np.ceil(PS_CAPACITY_SIGMAS * np.sqrt(rows)) + PS_CAPACITY_SLACK_ROWS


def ps_server_capacity(rows: int, n_servers: int) -> int:
    """The capacity ``persia train`` gives every server's store of a table of ``rows`` rows hashed over
    ``n_servers``: :func:`ps_capacity` of the largest bucket, ``ceil(rows / n_servers)`` rows."""
    return int(ps_capacity(-(-rows // n_servers)))


def _max_rows() -> int:
    # The inverse of ps_capacity at PS_MAX_CAPACITY: the float estimate, then the exact integer boundary.
    root = (-PS_CAPACITY_SIGMAS + math.sqrt(PS_CAPACITY_SIGMAS**2 + 4 * (PS_MAX_CAPACITY - PS_CAPACITY_SLACK_ROWS))) / 2
    rows = int(root * root) + 2
    while ps_capacity(rows) > PS_MAX_CAPACITY:
        rows -= 1
    return rows


PS_MAX_ROWS = _max_rows()
"""The most rows of one table one server may be planned to hold: the largest with a capacity the store accepts
(1,099,507,433,414: 2**40 less the allowance of :func:`ps_capacity`), far more than a server's memory holds
(a trillion dim-64 rows are 128 TB in fp16); a plan that gives one server more is refused with
:data:`PS_LIMIT_REASON`."""
PS_LIMIT_REASON = "its slot numbers are 40-bit, and its capacity is the rows plus 4 square roots of them plus 64"
"""Why :data:`PS_MAX_ROWS` is what it is, as the refusals say it."""


def ps_store_bytes(rows: Any, capacity: Any, dim: int, optimizer: Optimizer, dtype: DType = DType.FP32) -> Any:
    """Resident DDR bytes of a store of ``capacity`` rows of width ``dim`` that holds ``rows`` of them.

    ``rows`` x (record + weights in ``dtype`` + float32 optimizer state) + the dirty mask and the hash index, which
    are written whole when the store is created (see the module docstring for the layout). Arrays or ints.
    """
    rows, capacity = np.asarray(rows, dtype=float), np.asarray(capacity, dtype=float)
    per_row = PS_RECORD_BYTES + dtype.n_bytes * dim + PS_VALUE_BYTES * optimizer.ps_state_values(dim)
    buckets = np.maximum(np.ceil(capacity / PS_INDEX_LOAD_FACTOR), capacity + 1)
    return rows * per_row + capacity * PS_DIRTY_BYTES + buckets * PS_BUCKET_BYTES


def ps_bytes(rows: Any, dim: int, optimizer: Optimizer, dtype: DType = DType.FP32) -> Any:
    """DDR bytes one server's store of a table takes when it is planned to hold ``rows`` rows of width ``dim``:
    :func:`ps_store_bytes` of the capacity :func:`ps_capacity` gives those rows, filled.

    Every place that charges a PS table's bytes comes here (``placement.tier_bytes``). The store is charged full
    because a server under pressure (hashed ids: more distinct ids than its capacity) fills it before it evicts, and
    the allowance is only a few standard deviations of the hash's imbalance (decision 0019). ``rows`` may be a
    numpy array.
    """
    capacity = ps_capacity(rows)
    return ps_store_bytes(capacity, capacity, dim, optimizer, dtype)


def ps_holds(rows: Any, n_servers: int) -> Any:
    """Whether ``n_servers`` stores hold a table of ``rows`` rows, hashed evenly across them (the largest bucket,
    ``ceil(rows / n_servers)``, within :data:`PS_MAX_ROWS`). ``rows`` may be a numpy array."""
    return -(-rows // n_servers) <= PS_MAX_ROWS


def ps_servers_needed(rows: int) -> int:
    """The fewest parameter servers that can hold a table of ``rows`` rows (see :data:`PS_MAX_ROWS`)."""
    return -(-rows // PS_MAX_ROWS)


def ps_rows_error(table: TableSpec, n_servers: int, local_free: float) -> CapacityError:
    """The refusal of a table that only the parameter servers could hold but whose rows per server exceed what one
    server's store holds of a table (``memory.PS_MAX_ROWS``)."""
    per_server = -(-table.rows // n_servers)
    need = ps_servers_needed(table.rows)
    return CapacityError(
        "PS rows",
        0,
        f"table {table.name!r} ({table.rows:,} rows) fits nowhere: the trainers have at most "
        f"{format_bytes(max(local_free, 0))} of HBM or DDR free for it, and each of the {n_servers} parameter "
        f"servers would hold {per_server:,} of its rows, over the {PS_MAX_ROWS:,} rows of one table that a server's "
        f"store holds ({PS_LIMIT_REASON})",
        (f"use at least {need} parameter servers", "reduce its rows"),
        table=table.name,
    )


# ---- the ssd tier: a parameter server's disk behind its DDR ---------------------------------------------------------
SSD_BLOCK_BYTES = 4096
"""The disk's unit of reading and writing (``modules/ps/row_file.BLOCK_BYTES``): a row is read as its block."""
SSD_HEADER_BYTES = SSD_BLOCK_BYTES
"""The file's first block, before its rows: who wrote it (``modules/ps/ssd_files``), so that a cleanup removes only
files of its own."""
SSD_LOG_SLACK = 2
"""File slots per row of disk capacity: evicted rows are appended as a log, and the live rows compacted to the file's
start when the log reaches its end (``modules/ps/ssd_store.SsdStore``): once per ``SSD_LOG_SLACK - 1`` times the rows
appended."""
SSD_INDEX_BYTES = PS_BUCKET_BYTES / PS_INDEX_LOAD_FACTOR + 8 * SSD_LOG_SLACK
"""DDR per row of disk capacity: the disk index's hash buckets and the id of each file slot (int64)."""


def ssd_record_bytes(dim: int, optimizer: Optimizer, dtype: DType = DType.FP32) -> int:
    """Bytes of one row of ``table`` on disk (:func:`ssd_record_size`)."""
    return ssd_record_size(dim, dtype.n_bytes, optimizer.ps_state_values(dim))


def ssd_record_size(dim: int, weight_bytes: int, state_values: int) -> int:
    """Bytes of one row on disk: ``dim`` weights of ``weight_bytes``, then its float32 optimizer state values,
    padded to 4 bytes (the file's layout, ``modules/ps/row_file.RowFile``)."""
    raw = dim * weight_bytes + PS_VALUE_BYTES * state_values
    return -(-raw // 4) * 4


def ssd_file_bytes(capacity: Any, record: int) -> Any:
    """Bytes of a file of ``capacity`` rows of ``record`` bytes: records packed in whole blocks, none straddling two;
    a record past one block takes whole blocks of its own. ``capacity`` may be a numpy array."""
    capacity = np.asarray(capacity, dtype=float)
    if record <= SSD_BLOCK_BYTES:
        return np.ceil(capacity / (SSD_BLOCK_BYTES // record)) * SSD_BLOCK_BYTES
    return capacity * (-(-record // SSD_BLOCK_BYTES) * SSD_BLOCK_BYTES)


def ssd_cache_rows(rows: Any, cache_fraction: float) -> Any:
    """The DDR cache's capacity (rows) of a server's share of ``rows`` rows on the ``ssd`` tier: ``cache_fraction``
    of the rows, rounded up, at least one where there are rows."""
    rows = np.asarray(rows, dtype=float)
    return np.where(rows > 0, np.maximum(np.ceil(rows * cache_fraction), 1.0), 0.0)


def ssd_server_cache_capacity(rows: int, n_servers: int, cache_fraction: float) -> int:
    """The DDR cache's capacity ``persia train`` gives every server's store of a table of ``rows`` rows on the
    ``ssd`` tier hashed over ``n_servers``: :func:`ps_capacity` of :func:`ssd_cache_rows` of the largest bucket, as
    :func:`ssd_bytes` charges it."""
    return int(ps_capacity(ssd_cache_rows(-(-rows // n_servers), cache_fraction)))


def ssd_bytes(
    rows: Any, dim: int, optimizer: Optimizer, dtype: DType = DType.FP32, cache_fraction: float = 0.0
) -> tuple[Any, Any]:
    """``(ddr, disk)`` bytes one server takes for ``rows`` rows of a table on the ``ssd`` tier
    (``modules/ps/ssd_store.SsdStore``): a store of :func:`ssd_cache_rows` rows as the cache, charged as
    :func:`ps_bytes`, and the disk index of the disk's capacity (:func:`ps_capacity` of the rows) in DDR; the file of
    :data:`SSD_LOG_SLACK` times that capacity on disk, after its header block. ``rows`` may be a numpy array."""
    capacity = ps_capacity(rows)
    cache = ps_bytes(ssd_cache_rows(rows, cache_fraction), dim, optimizer, dtype)
    ddr = np.where(np.asarray(rows) > 0, cache + capacity * SSD_INDEX_BYTES, 0.0)
    record = ssd_record_bytes(dim, optimizer, dtype)
    return ddr, ssd_file_bytes(ssd_file_slots(capacity, record), record) + SSD_HEADER_BYTES


def ssd_file_slots(capacity: Any, record: int) -> Any:
    """Slots of the file of a server's ``ssd`` table of ``capacity`` rows of ``record`` bytes: :data:`SSD_LOG_SLACK`
    times the rows, in whole blocks, and one block more (each append starts a fresh block). May be an array."""
    per_block = max(SSD_BLOCK_BYTES // record, 1)
    return np.ceil(np.asarray(capacity, dtype=float) * SSD_LOG_SLACK / per_block) * per_block + per_block


def ssd_rows_per_block(dim: int, optimizer: Optimizer, dtype: DType = DType.FP32) -> float:
    """Rows of a table one disk block holds (below 1 where a row takes several blocks): what one appended block of
    evicted rows writes back."""
    record = ssd_record_bytes(dim, optimizer, dtype)
    return float(SSD_BLOCK_BYTES // record) if record <= SSD_BLOCK_BYTES else 1 / -(-record // SSD_BLOCK_BYTES)
