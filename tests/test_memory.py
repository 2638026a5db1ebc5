"""The planner's bytes (persia_planner.placement.memory, Shard.storage) against what the runtimes really allocate.

* Local tables: fbgemm's TBE built on CPU for each GPU's planned shards (weights + optimizer state); which memory
  each piece goes to for UVM tables from fbgemm's own ``construct_split_state``.
* The HBM cache: fbgemm's real ``_apply_cache_state`` run on the meta device (CUDA's memory queries stubbed), so its
  buffers get the shapes a GPU would give them without CUDA.
* The parameter-server store: its arrays, and the resident memory of a filled store in a fresh process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path
from unittest import mock

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import CacheAlgorithm, EmbeddingLocation
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    DEFAULT_ASSOC,
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
    construct_split_state,
)
from fbgemm_gpu.tbe.cache.cache_config import CacheState

from persia_planner import CapacityError, ModelSpec, Topology, validate
from persia_planner.cost.analytic import CostModel
from persia_planner.kinds import Sharding
from persia_planner.model.specs import DType, Optimizer, TableSpec
from persia_planner.modules.ps import optim as ps_optim
from persia_planner.modules.ps.store import EmbeddingStore
from persia_planner.placement.memory import (
    FBGEMM_CACHE_ASSOCIATIVITY,
    PS_INDEX_LOAD_FACTOR,
    PS_LIMIT_REASON,
    PS_MAX_CAPACITY,
    PS_MAX_ROWS,
    PS_VALUE_BYTES,
    largest_cache_fraction,
    ps_bytes,
    ps_capacity,
    ps_holds,
    ps_servers_needed,
    ps_store_bytes,
)
from persia_planner.placement.shards import tier_bytes
from persia_planner.plan.plan import Plan, usage_of
from persia_planner.planner import Planner, plan
from persia_planner.search import GreedyLocalSearch, Option, SearchConfig, build_placement
from persia_planner.tiers import Tier

ROOT = Path(__file__).resolve().parents[1]
FBGEMM_OPTIMIZER = {
    Optimizer.SGD: EmbOptimType.EXACT_SGD,
    Optimizer.ROWWISE_ADAGRAD: EmbOptimType.EXACT_ROWWISE_ADAGRAD,
    Optimizer.ADAGRAD: EmbOptimType.EXACT_ADAGRAD,
    Optimizer.ADAM: EmbOptimType.ADAM,
}
PRECISION = {DType.FP32: SparseType.FP32, DType.FP16: SparseType.FP16}
PS_OPTIMIZER = {
    Optimizer.SGD: ps_optim.SGD(),
    Optimizer.ROWWISE_ADAGRAD: ps_optim.RowWiseAdagrad(),
    Optimizer.ADAGRAD: ps_optim.Adagrad(),
    Optimizer.ADAM: ps_optim.Adam(),
}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ---- local tables ---------------------------------------------------------------------------------------------


def _topology(gpus: int = 2) -> Topology:
    gpu = {"count": gpus, "hbm": "1GiB", "hbm_bandwidth": "1TB/s", "tflops": 100, "pcie_bandwidth": "32GB/s"}
    host = {"name": "trainer", "ddr": "16GiB", "ddr_bandwidth": "100GB/s", "nic_bandwidth": "25GB/s", "gpus": gpu}
    return Topology.from_dict({"name": "small", "hosts": [host]})


@pytest.mark.parametrize("dtype", [DType.FP32, DType.FP16])
def test_planned_hbm_bytes_per_gpu_are_what_fbgemm_allocates(dtype):
    """Plan three tables into HBM (one split), build fbgemm's TBE on CPU for every GPU's shards, and compare each
    GPU's planned bytes with the TBE's weights and optimizer state (float32 momentum under fp16 weights too)."""
    model = ModelSpec.from_dict(
        {
            "batch_size": 4096,
            "embedding_dtype": dtype.value,
            "tables": [
                {"name": "rw", "rows": 60_000, "dim": 64, "pooling_factor": 40, "optimizer": "rowwise_adagrad"},
                {"name": "ada", "rows": 20_000, "dim": 32, "pooling_factor": 2, "optimizer": "adagrad"},
                {"name": "sgd", "rows": 30_000, "dim": 16, "pooling_factor": 1, "optimizer": "sgd"},
            ],
        }
    )
    topology = _topology()
    local = frozenset(Sharding) - {Sharding.DATA_PARALLEL, Sharding.PS_HASH}
    config = SearchConfig(tiers=frozenset({Tier.HBM}), shardings=local, improve_time_s=0.2)
    planned = Planner(GreedyLocalSearch(config)).plan(model, topology)
    allocated = dict.fromkeys((g.name for g in topology.gpus), 0)
    shards = 0
    for name, placement in planned.tables.items():
        table = model.table(name)
        for shard in placement.shards:
            shards += 1
            tbe = SplitTableBatchedEmbeddingBagsCodegen(
                [(shard.n_rows(table), shard.n_cols, EmbeddingLocation.HOST, ComputeDevice.CPU)],
                optimizer=FBGEMM_OPTIMIZER[table.optimizer],
                weights_precision=PRECISION[dtype],
            )
            held = ("weights_host", "momentum1_host", "momentum2_host")
            allocated[shard.device] += sum(_nbytes(t) for n, t in tbe.named_buffers() if n in held) + sum(
                _nbytes(t) for n, t in tbe.named_parameters() if n in held
            )
    assert sum(allocated.values()) > 0
    for gpu, n_bytes in allocated.items():
        assert planned.devices[gpu].hbm_bytes == pytest.approx(n_bytes, rel=0.05)
    # Exact but for fbgemm's constant-size placeholders (sgd registers an empty momentum of a few bytes per TBE).
    total = sum(planned.devices[gpu].hbm_bytes for gpu in allocated)
    assert 0 <= sum(allocated.values()) - total <= 64 * shards


def _fbgemm_split(rows: int, cols: int, location: EmbeddingLocation, optimizer: Optimizer, dtype: DType):
    """(HBM, host) bytes of a TBE of one table, from fbgemm's own placement of each tensor: the calls of
    ``SplitTableBatchedEmbeddingBagsCodegen.__init__`` (weights cacheable, momentum not; momentum1 row-wise for
    row-wise Adagrad; momentum2 for Adam), their sizes times the element size (weights: dtype, momentum: float32)."""
    spec = [(rows, cols, location, ComputeDevice.CUDA)]
    parts = [(construct_split_state(spec, rowwise=False, cacheable=True), dtype.n_bytes)]
    if optimizer is not Optimizer.SGD:
        parts.append((construct_split_state(spec, rowwise=optimizer.rowwise, cacheable=False), 4))
    if optimizer is Optimizer.ADAM:
        parts.append((construct_split_state(spec, rowwise=False, cacheable=False), 4))
    hbm = sum(split.dev_size * size for split, size in parts)
    host = sum((split.uvm_size + split.host_size) * size for split, size in parts)
    return hbm, host


@pytest.mark.parametrize("optimizer", list(Optimizer))
@pytest.mark.parametrize(
    ("tier", "location"), [(Tier.HBM, EmbeddingLocation.DEVICE), (Tier.DDR, EmbeddingLocation.MANAGED)]
)
def test_fbgemm_places_uvm_tables_state_as_charged(optimizer, tier, location):
    """A UVM (ddr) table keeps row-wise Adagrad's state in HBM and the rest in host memory, as fbgemm places it."""
    table = TableSpec("t", 10_000, 64, optimizer=optimizer)
    hbm, ddr = tier_bytes(table, tier, 7_000, 32, DType.FP16)
    assert (float(hbm), float(ddr)) == _fbgemm_split(7_000, 32, location, optimizer, DType.FP16)


# ---- the HBM cache --------------------------------------------------------------------------------------------


class _CacheHost(torch.nn.Module):
    """Just what ``_apply_cache_state`` reads of its TBE, on the meta device (no memory, no CUDA)."""

    _apply_cache_state = SplitTableBatchedEmbeddingBagsCodegen._apply_cache_state
    _init_uvm_cache_stats = SplitTableBatchedEmbeddingBagsCodegen._init_uvm_cache_stats
    _init_uvm_cache_counter = SplitTableBatchedEmbeddingBagsCodegen._init_uvm_cache_counter

    def __init__(self, dims: list[int], dtype: DType) -> None:
        super().__init__()
        self.weights_precision = PRECISION[dtype]
        self.current_device = torch.device("meta")
        self.use_cpu = False
        self.max_D_cache = max(dims)  # as __init__ sets it from the cached tables
        self.prefetch_pipeline = False  # TorchRec's default (CacheParams.prefetch_pipeline unset)
        self.gather_uvm_cache_stats = False

    def log(self, message: str) -> None:
        pass


def _fbgemm_cache_bytes(rows: list[int], dims: list[int], load_factor: float, dtype: DType) -> int:
    """HBM bytes of every buffer fbgemm's real ``_apply_cache_state`` registers for these cached tables (one TBE),
    with CUDA's memory queries answered by an 80 GiB GPU with nothing reserved."""
    state = CacheState.construct(rows, [EmbeddingLocation.MANAGED_CACHING] * len(rows), list(range(len(rows))))
    host = _CacheHost(dims, dtype)
    gpu = types.SimpleNamespace(total_memory=80 * 2**30)
    with (
        mock.patch("torch.cuda.get_device_properties", return_value=gpu),
        mock.patch("torch.cuda.memory_reserved", return_value=0),
    ):
        host._apply_cache_state(state, CacheAlgorithm.LRU, load_factor, 0, 0.0, PRECISION[dtype])
    assert host.lxu_cache_weights.dtype == (torch.float16 if dtype is DType.FP16 else torch.float32)
    return sum(_nbytes(b) for b in host.buffers())


def test_the_cache_associativity_is_fbgemms():
    assert DEFAULT_ASSOC == FBGEMM_CACHE_ASSOCIATIVITY  # CUDA's (torch.version.hip is None here)


@pytest.mark.parametrize("optimizer", [Optimizer.ROWWISE_ADAGRAD, Optimizer.ADAM])
@pytest.mark.parametrize("room", [3e6, 4e7, 2.5e8, 1e12])
def test_the_largest_cache_that_fits_fits_and_one_more_set_does_not(optimizer, room):
    table = TableSpec("t", 1_000_000, 64, optimizer=optimizer)

    def hbm(fraction: float) -> float:
        return float(tier_bytes(table, Tier.HBM_CACHE, table.rows, 64, DType.FP16, fraction)[0])

    fraction = largest_cache_fraction(table, table.rows, 64, DType.FP16, room)
    if fraction == 0.0:  # not even the row-wise state, the index and one set fit
        assert hbm(FBGEMM_CACHE_ASSOCIATIVITY / table.rows) > room
    elif fraction == 1.0:
        assert hbm(1.0) <= room
    else:
        assert hbm(fraction) <= room < hbm(fraction + FBGEMM_CACHE_ASSOCIATIVITY / table.rows)


@pytest.mark.parametrize(
    ("rows", "cols", "fraction", "dtype", "optimizer"),
    [
        (1_300_001, 64, 0.2, DType.FP32, Optimizer.ROWWISE_ADAGRAD),
        (10_000_000, 16, 0.05, DType.FP16, Optimizer.ADAGRAD),
        (500, 128, 0.05, DType.FP32, Optimizer.SGD),  # 25 rows cached: one whole set of 32 slots
    ],
)
def test_planned_cache_bytes_are_fbgemms_buffers(rows, cols, fraction, dtype, optimizer):
    """An hbm_cache shard: the HBM the planner charges is the cache's buffers (weights, cache and LRU state, the
    row index: fbgemm's own code) plus the row-wise state fbgemm keeps on the device; DDR holds the UVM rows."""
    table = TableSpec("t", rows, cols, optimizer=optimizer)
    hbm, ddr = tier_bytes(table, Tier.HBM_CACHE, rows, cols, dtype, fraction)
    state_hbm, uvm = _fbgemm_split(rows, cols, EmbeddingLocation.MANAGED_CACHING, optimizer, dtype)
    cache = _fbgemm_cache_bytes([rows], [cols], fraction, dtype)
    assert float(hbm) == pytest.approx(cache + state_hbm, rel=0.05)
    assert abs(float(hbm) - (cache + state_hbm)) <= 64  # only fbgemm's constant-size counters are not charged
    assert float(ddr) == uvm


def test_cached_shards_sharing_one_tbe_cost_their_sum():
    """TorchRec gives one GPU's cached tables one TBE (the load factor averaged by rows): fbgemm then rounds the
    slots once, the planner per shard, so the plan may over-count by under a set per shard."""
    rows, cols, fraction = [3_000_000, 200_017, 45_000], 32, 0.2
    tables = [TableSpec(f"t{i}", r, cols, optimizer=Optimizer.SGD) for i, r in enumerate(rows)]
    planned = sum(float(tier_bytes(t, Tier.HBM_CACHE, t.rows, cols, DType.FP32, fraction)[0]) for t in tables)
    grouped = _fbgemm_cache_bytes(rows, [cols] * len(rows), fraction, DType.FP32)
    assert grouped <= planned <= grouped * 1.05


# ---- the parameter-server store -------------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer", list(Optimizer))
@pytest.mark.parametrize("dim", [8, 64])
def test_a_full_store_allocates_what_is_charged(optimizer, dim):
    """Filled to its capacity, every array of the store is resident: their bytes are the planner's, exactly."""
    capacity = 3_000
    store = EmbeddingStore(dim, capacity, PS_OPTIMIZER[optimizer])
    store.lookup(torch.arange(capacity, dtype=torch.int64) * 31 + 7)
    assert len(store) == capacity
    assert store.state_width == optimizer.ps_state_values(dim)
    arrays = store.arrays()
    assert arrays["weights"].element_size() == arrays["state"].element_size() == PS_VALUE_BYTES
    allocated = sum(_nbytes(a) for a in arrays.values())
    assert allocated == ps_store_bytes(capacity, capacity, dim, optimizer)


@pytest.mark.parametrize("dtype", [DType.FP16, DType.BF16])
def test_a_narrow_store_keeps_its_weights_in_the_dtype_and_is_charged_for_it(dtype):
    """A fp16 / bf16 table's store: 2-byte weights, float32 optimizer state, and the planner charges exactly that."""
    capacity, dim, optimizer = 2_000, 64, Optimizer.ROWWISE_ADAGRAD
    store = EmbeddingStore(dim, capacity, PS_OPTIMIZER[optimizer], weight_dtype=getattr(torch, dtype.torch_name))
    store.lookup(torch.arange(capacity, dtype=torch.int64) * 31 + 7)
    arrays = store.arrays()
    assert (arrays["weights"].element_size(), arrays["state"].element_size()) == (2, PS_VALUE_BYTES)
    assert sum(_nbytes(a) for a in arrays.values()) == ps_store_bytes(capacity, capacity, dim, optimizer, dtype)
    # 2 bytes a weight fewer than a float32 store's: 128 B of a dim-64 row
    wide = ps_store_bytes(capacity, capacity, dim, optimizer)
    assert wide - ps_store_bytes(capacity, capacity, dim, optimizer, dtype) == capacity * dim * 2


@pytest.mark.parametrize("optimizer", [Optimizer.ROWWISE_ADAGRAD, Optimizer.ADAM])
def test_a_partly_filled_store_accounts_for_what_is_charged(optimizer):
    """The store's own account (what a server reports): the rows it holds of the per-slot arrays, the dirty mask
    and the hash index whole: the planner's bytes for those rows at that capacity."""
    capacity, rows, dim = 3_000, 1_234, 8
    store = EmbeddingStore(dim, capacity, PS_OPTIMIZER[optimizer])
    store.lookup(torch.arange(rows, dtype=torch.int64) * 31 + 7)
    assert store.resident_bytes() == ps_store_bytes(rows, capacity, dim, optimizer)


def test_the_store_takes_its_limits_from_the_planner():
    assert EmbeddingStore(4, 10, ps_optim.SGD()).arrays()["index"].shape[0] == 10 / PS_INDEX_LOAD_FACTOR
    with pytest.raises(ValueError, match=r"capacity must be at most 1,099,511,627,774 \(40-bit slot numbers\)"):
        EmbeddingStore(4, PS_MAX_CAPACITY + 1, ps_optim.SGD())
    assert ps_capacity(PS_MAX_ROWS) <= PS_MAX_CAPACITY < ps_capacity(PS_MAX_ROWS + 1)


_RSS_SCRIPT = """
import ctypes, json, os, sys
import torch
from persia_planner.placement.memory import ps_capacity
from persia_planner.modules.ps.optim import RowWiseAdagrad
from persia_planner.modules.ps.store import EmbeddingStore

libc = ctypes.CDLL("libc.so.6")


def resident():
    libc.malloc_trim(0)  # freed batch temporaries back to the system: only what the store holds stays
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


rows, dim = int(sys.argv[1]), int(sys.argv[2])
warm = EmbeddingStore(dim, 4096, RowWiseAdagrad())  # compiles the kernels, sizes torch's pools
warm.lookup(torch.arange(3000))
warm.update(torch.arange(3000), torch.ones(3000, dim))
del warm
before = resident()
capacity = int(ps_capacity(rows))
store = EmbeddingStore(dim, capacity, RowWiseAdagrad())
for start in range(0, capacity, 65536):
    store.lookup(torch.arange(start, min(start + 65536, capacity)) * 7919 + 13, distinct=True)
print(json.dumps({"rows": len(store), "bytes": resident() - before}))
"""


@pytest.mark.processes
@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads the resident set from /proc")
def test_a_filled_store_is_as_resident_as_planned():
    """A server's store for a shard of N rows, with the capacity C persia train gives it (N + 4 sqrt(N) + 64),
    filled to C rows in a fresh process, as a server under pressure fills it: its resident memory grows by the
    planner's ps bytes, within 5% (dim 16, row-wise Adagrad: 105 B/row where 68 were planned before)."""
    rows, dim = 1_000_000, 16
    out = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, str(rows), str(dim)],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    assert measured["rows"] == int(ps_capacity(rows))
    planned = float(ps_bytes(rows, dim, Optimizer.ROWWISE_ADAGRAD))
    assert measured["bytes"] == pytest.approx(planned, rel=0.05)


# ---- the planner knows the store's row limit ------------------------------------------------------------------


def _ps_topology(servers: int) -> Topology:
    gpu = {"count": 1, "hbm": "1GiB", "hbm_bandwidth": "1TB/s", "tflops": 100, "pcie_bandwidth": "32GB/s"}
    hosts = [
        {"name": "trainer", "ddr": "16GiB", "ddr_bandwidth": "100GB/s", "nic_bandwidth": "25GB/s", "gpus": gpu},
        {"name": "ps", "count": servers, "role": "parameter_server", "ddr": "2PB"}
        | {"ddr_bandwidth": "100GB/s", "nic_bandwidth": "25GB/s"},
    ]
    return Topology.from_dict({"name": "ps", "hosts": hosts})


def _too_long_for_two() -> ModelSpec:
    """One table of two rows more than two servers' stores hold (one too many on each)."""
    return ModelSpec.from_dict({"batch_size": 1024, "tables": [{"name": "ids", "rows": 2 * PS_MAX_ROWS + 2, "dim": 8}]})


def test_validation_refuses_more_rows_per_server_than_the_store_holds():
    model = _too_long_for_two()
    topology = _ps_topology(2)
    cost = CostModel(model, topology)
    placement = build_placement(cost, model.tables[0], Option(Sharding.PS_HASH, Tier.PS), [])
    estimate, mem = cost.evaluate({"ids": placement})
    written = Plan("m", "ps", {"ids": placement}, usage_of(cost, estimate, mem, {"ids": placement}), 1.0, 1.0, 1.0)
    problems = validate(written, model, topology)
    assert problems == [
        f"table 'ids': ps0 would hold {PS_MAX_ROWS + 1:,} of its rows, over the {PS_MAX_ROWS:,} rows of one table "
        f"that a parameter server's store holds ({PS_LIMIT_REASON}); fix: plan it with at least 3 parameter servers"
    ]


def test_the_planner_refuses_a_table_only_too_few_servers_could_hold():
    model = _too_long_for_two()
    with pytest.raises(
        CapacityError, match=rf"each of the 2 parameter servers would hold {PS_MAX_ROWS + 1:,} of its rows"
    ) as err:
        plan(model, _ps_topology(2))
    assert err.value.table == "ids" and "use at least 3 parameter servers" in str(err.value)
    result = plan(model, _ps_topology(3), improve_time_s=0.1)
    assert result.tables["ids"].tier is Tier.PS and validate(result, model, _ps_topology(3)) == []


def test_a_table_of_2_to_the_41_rows_per_server_is_refused_in_one_line_with_the_reason():
    """The store's slots are 40-bit: 2**41 rows of one table on one server cannot be held, and the planner says why
    (with the servers that would hold it); ids themselves are 64-bit, far above 2**41."""
    rows = 2 * 2**41
    assert 2**31 < PS_MAX_ROWS < 2**40 and not ps_holds(rows, 2) and ps_servers_needed(rows) == 5
    # The capacity arithmetic itself is exact (float64) at this size: 4 sqrt(2**41) = 5,931,641.6.
    assert ps_capacity(2**41) == 2**41 + 5_931_642 + 64
    model = ModelSpec.from_dict({"batch_size": 1024, "tables": [{"name": "ids", "rows": rows, "dim": 8}]})
    with pytest.raises(CapacityError) as err:
        plan(model, _ps_topology(2))
    message = str(err.value)
    assert "each of the 2 parameter servers would hold 2,199,023,255,552 of its rows" in message
    assert "(its slot numbers are 40-bit, and its capacity is the rows plus 4 square roots of them plus 64)" in message
    assert "use at least 5 parameter servers" in message and "\n" not in message
    result = plan(model, _ps_topology(5), improve_time_s=0.1)
    assert result.tables["ids"].tier is Tier.PS and validate(result, model, _ps_topology(5)) == []
    # Hashed ids span 64 bits: a store takes ids far above 2**33 (and negative int64s: uint64 bit patterns).
    store = EmbeddingStore(4, 64, ps_optim.SGD())
    ids = torch.tensor([2**33, 2**33 + 1, 2**40 + 7, 2**62, -(2**63), -1], dtype=torch.int64)
    store.lookup(ids)
    assert store.contains(ids).all() and len(store) == 6 and store.metrics()["inserts"] == 6
