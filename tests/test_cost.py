"""Each cost term against a hand computation (efficiencies set to 1 so the numbers are round)."""

import math

import numpy as np
import pytest

from persia_planner import ModelSpec, Topology
from persia_planner.cost.analytic import CostModel, zipf_hit_rate
from persia_planner.kinds import Sharding
from persia_planner.placement.shards import Shard, Storage, TablePlacement
from persia_planner.search import Option, build_placement
from persia_planner.tiers import Memory, Tier
from persia_planner.topology.cost_constants import REFIT_SHARDINGS, scale_name

ONE = {
    k: 1.0
    for k in (
        "hbm_efficiency",
        "uvm_efficiency",
        "ddr_efficiency",
        "nvlink_efficiency",
        "nic_efficiency",
        "ps_efficiency",
        "tflops_efficiency",
    )
}
TOPO = {
    "hosts": [
        {
            "name": "h",
            "ddr": "1TB",
            "ddr_bandwidth": "20GB/s",
            "nic_bandwidth": "10GB/s",
            "gpus": {
                "count": 2,
                "hbm": "10GB",
                "hbm_bandwidth": "1000GB/s",
                "tflops": 100,
                "pcie_bandwidth": "10GB/s",
                "nvlink_bandwidth": "100GB/s",
            },
        },
        {"name": "ps", "role": "parameter_server", "ddr": "1TB", "ddr_bandwidth": "50GB/s", "nic_bandwidth": "10GB/s"},
    ],
    "network": {"latency": "10us"},
    "constants": {**ONE, "update_passes": 3, "shard_overhead_ms": 0.001, "min_access_bytes": 32},
}


def model(staleness=4):
    return ModelSpec.from_dict(
        {
            "batch_size": 1000,
            "staleness": staleness,
            "tables": [
                {"name": "a", "rows": 1000, "dim": 10, "pooling_factor": 2, "optimizer": "sgd"},
                {"name": "b", "rows": 1000, "dim": 10, "pooling_factor": 2, "optimizer": "sgd"},
            ],
            "dense": {"parameters": 1_000_000, "flops_per_sample": 1_000_000},
        }
    )


@pytest.fixture
def cost():
    return CostModel(model(), Topology.from_dict(TOPO))


def test_moved_bytes(cost):
    # 2000 lookups x (10 cols x 4 B x (1 read + 3 update passes) + 2 x 0 state bytes)
    assert cost.moved_bytes(cost.model.tables[0], 2000, 10) == 320_000
    # a 4-column shard reads 16 B rows, but memory moves at least min_access_bytes (32) per row
    assert cost.moved_bytes(cost.model.tables[0], 2000, 4) == 2000 * 32 * 4


def test_moved_bytes_updates_distinct_rows_once(cost):
    # reads follow the 2000 ids (40 B each); the 3 update passes only the 500 distinct rows
    assert cost.moved_bytes(cost.model.tables[0], 2000, 10, 500) == 2000 * 40 + 500 * 40 * 3


# A table's step: 2000 uniform ids over 1000 rows, reading 40 B each; they touch 1000 (1 - (1 - 1/1000)^2000)
# distinct rows, each updated once (3 passes).
UNIQUE = 1000 * (1 - (1 - 1 / 1000) ** 2000)
MOVED = 2000 * 40 + UNIQUE * 40 * 3


def test_hbm_lookup_and_all_to_all(cost):
    lay = cost.layout
    loads = cost.range_shard_loads(cost.model.tables[0], 1.0, 10, Tier.HBM, np.array([0]))[0]
    assert loads[lay.emb.start] == pytest.approx(MOVED / 1e9 + 0.001)  # HBM: 1e9 B/ms, plus the shard overhead
    # pooled output 1000 x 10 x 4 = 40,000 B forward and backward, plus the 2000 ids x 8 B forward only (half a
    # round trip); the owner sends/receives 1/2 of it over NVLink (1e8 B/ms), full duplex
    exchange = 40_000 + 16_000 / 2
    assert loads[lay.nvlink.start] == pytest.approx(exchange * 0.5 / 1e8)
    assert loads[lay.nvlink.start + 1] == pytest.approx(exchange * 0.5 / 1e8)
    assert loads[lay.nic_sync].sum() == 0  # one host: nothing crosses the NIC
    assert loads[lay.host_ddr].sum() == 0


def test_ddr_and_cache_tiers(cost):
    lay = cost.layout
    t = cost.model.tables[0]
    ddr = cost.range_shard_loads(t, 1.0, 10, Tier.DDR, np.array([1]))[0]
    assert ddr[lay.emb.start + 1] == pytest.approx(MOVED / 1e7 + 0.001)  # UVM: min(PCIe 10, DDR 20) GB/s
    assert ddr[lay.host_ddr.start] == pytest.approx(MOVED / 2e7)
    cache = cost.range_shard_loads(t, 1.0, 10, Tier.HBM_CACHE, np.array([1]), cache_fraction=0.2)[0]
    # uniform ids (alpha 0): hit rate = cache fraction
    assert cache[lay.emb.start + 1] == pytest.approx(0.2 * MOVED / 1e9 + 0.8 * MOVED / 1e7 + 0.001)
    assert cache[lay.host_ddr.start] == pytest.approx(0.8 * MOVED / 2e7)


def test_parameter_server_terms(cost):
    lay = cost.layout
    loads = cost.ps_table_loads(cost.model.tables[1], np.array([1.0]))
    # per GPU: the distinct rows of 500 samples x 2 ids (uniform over 1000 rows), fetched and pushed; a link's busier
    # direction carries each one's 40 B gradient and its 8 B id twice; the store reads and updates each GPU's
    # distinct rows (4 passes of 40 B)
    unique = 1000 * (1 - (1 - 1 / 1000) ** 1000)
    per_gpu = unique * (40 + 2 * 8)
    assert loads[lay.pcie] == pytest.approx([per_gpu / 1e7] * 2)
    assert loads[lay.nic_async.start] == pytest.approx(2 * per_gpu / 1e7)
    assert loads[lay.ps_nic.start] == pytest.approx(2 * per_gpu / 1e7)
    assert loads[lay.ps_ddr.start] == pytest.approx(2 * unique * 40 * 4 / 5e7)
    assert loads[lay.switch] == 0  # unlimited switch


def test_replica_terms(cost):
    lay = cost.layout
    r = cost.replica_loads(cost.model.tables[0])  # a replica on every GPU, summed
    # 2 x 500 x 2 lookups x 40 B + 1000 rows x 40 B x 9.22 optimizer passes, at half the fused kernel's bandwidth
    moved = 2 * 500 * 2 * 40 + 1000 * 40 * 9.22
    assert r[lay.emb.start] == pytest.approx(moved / (1e9 * 0.5) + 0.001)
    assert r[lay.dp_bytes] == pytest.approx(4 * 1000 * 10)
    assert cost.replica_loads(cost.model.tables[0], np.array([1]))[lay.emb.start] == 0


def test_dense_and_allreduce(cost):
    # 3 x 1e6 flops x 500 samples / 1e11 flop/ms; ring over 2 GPUs: 2 x 1/2 x 4e6 B / 1e8 B/ms
    assert cost.dense_ms == pytest.approx([0.015, 0.015])
    assert cost.dense_grad_bytes * cost.allreduce_ms_per_byte == pytest.approx([0.04, 0.04])


# Table b on the server: each GPU fetches and pushes its distinct rows over PCIe (10 GB/s), its host's NIC (both
# GPUs, 10 GB/s) and the server's NIC, the busier direction 40 B + two 8 B ids a row; the store reads and updates
# them (4 x 40 B, 50 GB/s).
UNIQUE_PER_GPU = 1000 * (1 - (1 - 1 / 1000) ** 1000)
PER_GPU = UNIQUE_PER_GPU * (40 + 2 * 8)
PS_TERMS = (PER_GPU / 1e7, 2 * PER_GPU / 1e7, 2 * PER_GPU / 1e7, 2 * UNIQUE_PER_GPU * 160 / 5e7)


def plan_a_hbm_b_ps(cost):
    t = {x.name: x for x in cost.model.tables}
    return {
        "a": build_placement(cost, t["a"], Option(Sharding.TABLE_WISE, Tier.HBM), [0]),
        "b": build_placement(cost, t["b"], Option(Sharding.PS_HASH, Tier.PS), []),
    }


def test_step_overlaps_async_work(cost):
    est, mem = cost.evaluate(plan_a_hbm_b_ps(cost))
    sync0 = MOVED / 1e9 + 0.001 + 48_000 * 0.5 / 1e8 + 0.015 + 0.04
    async_ = max(*PS_TERMS) + 2 * 0.01 / 4  # + round trip / staleness
    assert est.per_gpu["sync"][0] == pytest.approx(sync0)
    assert est.per_gpu["async"][0] == pytest.approx(async_)
    assert est.step_ms == pytest.approx(max(sync0, async_))
    assert est.samples_per_s == pytest.approx(1000 / sync0 * 1e3)
    assert mem[cost.layout.hbm.start] == 1000 * 40
    # The server's store (memory.ps_bytes), charged full: its capacity of 1000 + ceil(4 sqrt(1000)) + 64 = 1191 rows,
    # each a 16 B record, 10 float32 weights (sgd: no state), a 1 B dirty flag and two int64 hash buckets.
    assert mem[cost.layout.ps_mem.start] == 1191 * (16 + 10 * 4 + 1 + 2 * 8)


# At K = 0 a step's push and then the next lookup are serial: a link carries both directions one after the other,
# the gradients and ids out (40 B + two 8 B ids a row), then the rows back (40 B).
PER_GPU_K0 = UNIQUE_PER_GPU * (2 * 40 + 2 * 8)


def test_staleness_zero_adds_async_work():
    cost = CostModel(model(staleness=0), Topology.from_dict(TOPO))
    est, _ = cost.evaluate(plan_a_hbm_b_ps(cost))
    ps_terms = (PER_GPU_K0 / 1e7, 2 * PER_GPU_K0 / 1e7, 2 * PER_GPU_K0 / 1e7, PS_TERMS[3])
    assert est.step_ms == pytest.approx(MOVED / 1e9 + 0.001 + 2.4e-4 + 0.015 + 0.04 + max(*ps_terms) + 2 * 0.01)


def test_staleness_zero_charges_ps_links_both_directions():
    k0, k4 = CostModel(model(staleness=0), Topology.from_dict(TOPO)), CostModel(model(), Topology.from_dict(TOPO))
    table = k0.model.tables[1]
    assert k4.ps_bytes_per_gpu(table) == pytest.approx(PER_GPU)  # K >= 1: the busier direction
    assert k0.ps_bytes_per_gpu(table) == pytest.approx(PER_GPU_K0)  # K = 0: both
    lay = k0.layout
    loads = k0.ps_table_loads(table, np.array([1.0]))
    assert loads[lay.pcie] == pytest.approx([PER_GPU_K0 / 1e7] * 2)
    assert loads[lay.nic_async.start] == pytest.approx(2 * PER_GPU_K0 / 1e7)
    assert loads[lay.ps_nic.start] == pytest.approx(2 * PER_GPU_K0 / 1e7)
    # the store's work is the same rows read and updated, whatever the links
    assert loads[lay.ps_ddr.start] == pytest.approx(k4.ps_table_loads(table, np.array([1.0]))[lay.ps_ddr.start])


SCALES = {"embedding": 1.5, "all_to_all": 2.0, "dense": 0.5, "all_reduce": 3.0, "ps": 1.25}


def scaled_topology(scales=SCALES):
    return Topology.from_dict(TOPO).with_constants({f"{term}_scale": f for term, f in scales.items()})


@pytest.mark.parametrize("staleness", [0, 4])
def test_term_scales_multiply_each_part_of_the_step(staleness):
    plain = CostModel(model(staleness), Topology.from_dict(TOPO))
    scaled = CostModel(model(staleness), scaled_topology())
    est, _ = plain.evaluate(plan_a_hbm_b_ps(plain))
    est_scaled, _ = scaled.evaluate(plan_a_hbm_b_ps(scaled))
    terms, terms_scaled = est.slowest_gpu_terms(), est_scaled.slowest_gpu_terms()
    assert terms_scaled == pytest.approx({term: SCALES[term] * ms for term, ms in terms.items()})
    sync = sum(terms_scaled[t] for t in ("embedding", "all_to_all", "dense", "all_reduce"))
    expected = sync + terms_scaled["ps"] if staleness == 0 else max(sync, terms_scaled["ps"])
    assert est_scaled.step_ms == pytest.approx(expected)


def test_term_scales_reach_every_load_the_search_builds():
    plain, scaled = CostModel(model(), Topology.from_dict(TOPO)), CostModel(model(), scaled_topology())
    lay, t = plain.layout, plain.model.tables[0]
    for tier, cache in ((Tier.HBM, 0.0), (Tier.DDR, 0.0), (Tier.HBM_CACHE, 0.2)):
        a = plain.range_shard_loads(t, 1.0, 10, tier, np.array([1]), cache_fraction=cache)[0]
        b = scaled.range_shard_loads(t, 1.0, 10, tier, np.array([1]), cache_fraction=cache)[0]
        assert b[lay.emb] == pytest.approx(1.5 * a[lay.emb])
        assert b[lay.host_ddr] == pytest.approx(1.5 * a[lay.host_ddr])
        assert b[lay.nvlink] == pytest.approx(2.0 * a[lay.nvlink])
    a, b = plain.replica_loads(t), scaled.replica_loads(t)
    assert b[lay.emb] == pytest.approx(1.5 * a[lay.emb]) and b[lay.dp_bytes] == a[lay.dp_bytes]
    assert scaled.allreduce_ms_per_byte == pytest.approx(3.0 * plain.allreduce_ms_per_byte)
    a, b = plain.ps_table_loads(t, np.array([1.0])), scaled.ps_table_loads(t, np.array([1.0]))
    for part in (lay.pcie, lay.nic_async, lay.ps_nic, lay.ps_ddr):
        assert b[part] == pytest.approx(1.25 * a[part])


def test_unit_scales_change_no_bit():
    plain = CostModel(model(0), Topology.from_dict(TOPO))
    ones = CostModel(model(0), scaled_topology(dict.fromkeys(SCALES, 1.0)))
    a, _ = plain.evaluate(plan_a_hbm_b_ps(plain))
    b, _ = ones.evaluate(plan_a_hbm_b_ps(ones))
    assert a.step_ms == b.step_ms and a.slowest_gpu_terms() == b.slowest_gpu_terms()


def test_sharding_scales_multiply_their_types_exchange_only():
    topology = Topology.from_dict(TOPO)
    plain = CostModel(model(), topology)
    scaled = CostModel(model(), topology.with_constants({"row_wise_scale": 3.0, "all_to_all_scale": 2.0}))
    lay, t, gpus = plain.layout, plain.model.tables[0], np.array([0, 1])
    for sharding, factor in ((Sharding.ROW_WISE, 6.0), (Sharding.TABLE_WISE, 2.0), (Sharding.COLUMN_WISE, 2.0)):
        a = plain.range_shard_loads(t, 0.5, 10, Tier.HBM, gpus, sharding=sharding)
        b = scaled.range_shard_loads(t, 0.5, 10, Tier.HBM, gpus, sharding=sharding)
        assert b[:, lay.nvlink] == pytest.approx(factor * a[:, lay.nvlink])
        assert b[:, lay.emb] == pytest.approx(a[:, lay.emb])  # the type's kernels are the embedding part's
    # a placement's sum takes the same factor
    rw = build_placement(plain, t, Option(Sharding.ROW_WISE, Tier.HBM), [0, 1])
    a, b = plain.placement_loads(t, rw)[0], scaled.placement_loads(t, rw)[0]
    assert b[lay.nvlink] == pytest.approx(6.0 * a[lay.nvlink])
    assert scaled.a2a_fixed_ms == 2.0 * plain.a2a_fixed_ms


def test_unit_sharding_scales_change_no_bit():
    plain = CostModel(model(0), Topology.from_dict(TOPO))
    ones = CostModel(model(0), Topology.from_dict(TOPO).with_constants({scale_name(s): 1.0 for s in REFIT_SHARDINGS}))
    for placements in (plan_a_hbm_b_ps(plain), plan_a_hbm_b_ps(ones)):
        a, _ = plain.evaluate(placements)
        b, _ = ones.evaluate(placements)
        assert a.step_ms == b.step_ms and a.slowest_gpu_terms() == b.slowest_gpu_terms()
    t = plain.model.tables[0]
    for sharding in (Sharding.ROW_WISE, Sharding.TABLE_WISE):
        a = plain.range_shard_loads(t, 0.5, 10, Tier.HBM, np.array([0, 1]), sharding=sharding)
        b = ones.range_shard_loads(t, 0.5, 10, Tier.HBM, np.array([0, 1]), sharding=sharding)
        assert (a == b).all()


SHARDING_SCALES = [
    f"{s}_scale" for s in ("table_wise", "row_wise", "column_wise", "table_row_wise", "table_column_wise")
]


@pytest.mark.parametrize("value", [0.0, -1.0, math.inf, math.nan])
def test_a_scale_must_be_a_positive_number(value):
    with pytest.raises(Exception, match="ps_scale"):
        Topology.from_dict({**TOPO, "constants": {**TOPO["constants"], "ps_scale": value}})


def test_placement_loads_equal_shard_sum(cost):
    t = cost.model.tables[0]
    rw = build_placement(cost, t, Option(Sharding.ROW_WISE, Tier.HBM), [0, 1])
    loads, mem = cost.placement_loads(t, rw)
    expected = cost.range_shard_loads(t, np.array([0.5, 0.5]), 10, Tier.HBM, np.array([0, 1])).sum(axis=0)
    assert loads == pytest.approx(expected)
    assert mem[cost.layout.hbm].tolist() == [500 * 40, 500 * 40]
    hand = TablePlacement(Sharding.TABLE_WISE, (Shard("h0/gpu1", Tier.HBM, (0, 10), 40_000, rows=(0, 1000)),))
    assert cost.placement_loads(t, hand)[1][cost.layout.hbm.start + 1] == 40_000


@pytest.mark.parametrize(
    ("alpha", "rows", "fraction", "expected"),
    [(0.0, 1000, 0.2, 0.2), (1.0, 1000, 0.1, (1 + math.log(100)) / (1 + math.log(1000))), (2.0, 10**6, 0.5, None)],
)
def test_zipf_hit_rate(alpha, rows, fraction, expected):
    hit = zipf_hit_rate(alpha, rows, fraction)
    if expected is None:
        assert 0.99 < hit <= 1.0  # very skewed: half the rows hold nearly every access
    else:
        assert hit == pytest.approx(expected)
    assert zipf_hit_rate(alpha, rows, 0.0) == 0.0 and zipf_hit_rate(alpha, rows, 1.0) == 1.0


def test_resource_times_are_the_gpus_steps_then_the_hosts_nics(cost):
    placements = plan_a_hbm_b_ps(cost)
    vector = cost.fixed_loads()
    for table in cost.model.tables:
        vector += cost.placement_loads(table, placements[table.name])[0]
    every = cost.resource_ms(vector[None, :])
    assert every.shape == (1, 2 + 1)
    assert every[0, :2].tolist() == cost.gpu_step_ms(vector[None, :])[0].tolist()
    assert every[0, 2] == pytest.approx(cost.estimate(vector).host_nic_ms[0])
    assert every.max() == pytest.approx(cost.step_ms(vector)[0])


def test_bottleneck_loads_split_the_bottleneck_among_the_tables(cost):
    placements = plan_a_hbm_b_ps(cost)
    parts = np.stack([cost.placement_loads(t, placements[t.name])[0] for t in cost.model.tables])
    total = cost.fixed_loads() + parts.sum(axis=0)
    shares = cost.bottleneck_loads(total, parts)
    # The step waits for GPU 0's sync path (table a's lookups there); table b's PS work is hidden by staleness.
    est = cost.estimate(total)
    assert est.per_gpu["sync"][0] >= est.per_gpu["async"][0]
    assert shares[0] > 0
    assert shares[1] == pytest.approx(0.0)


def test_memory_vectors_by_kind(cost):
    """One slot per registered memory and device holding it, in registration order: GPUs' HBM, hosts' DDR, then
    each server memory (DDR, the ssd tier's disk)."""
    assert cost.layout.memories == (Memory.DEVICE, Memory.HOST, Memory.SERVER, Memory.DISK)
    mem = cost.memory_vector(
        {Memory.DEVICE: np.array([1.0, 2.0]), Memory.HOST: 3.0, Memory.SERVER: 4.0, Memory.DISK: 6.0}
    )
    got = [cost.slots_of(mem, m).tolist() for m in cost.layout.memories]
    assert got == [[1.0, 2.0], [3.0], [4.0], [6.0]] and mem.tolist() == [1.0, 2.0, 3.0, 4.0, 6.0]
    assert cost.hbm_of(mem).tolist() == [1.0, 2.0] and cost.ddr_of(mem).tolist() == [3.0]
    server_disk = Storage(((Memory.SERVER, 7), (Memory.DISK, 9)))
    cost.charge(mem, server_disk, server=0)
    cost.charge(mem, Storage(((Memory.DEVICE, 1), (Memory.HOST, 2))), gpu=1)
    assert mem.tolist() == [1.0, 3.0, 5.0, 11.0, 15.0]
    shard = cost.shard_memory(np.array([1, 0]), np.array([10.0, 20.0]), 5.0)
    assert shard.tolist() == [[0.0, 10.0, 5.0, 0.0, 0.0], [20.0, 0.0, 5.0, 0.0, 0.0]]


def _cpu_cost(scales: dict[str, float], tmp_path) -> CostModel:
    """Two CPU trainers of one host whose profile measured these sharding-type factors; one 2,000-row table."""
    import yaml
    from test_profile import raw_profile

    (tmp_path / "cpu.yaml").write_text(
        yaml.safe_dump({**raw_profile(), "step": {"overhead_ms": 1.0, "sharding_scale": scales}})
    )
    topo = Topology.from_dict(
        {
            "name": "cpus",
            "hosts": [{"name": "t", "ddr": "8GiB", "profile": "cpu.yaml", "cpus": {"count": 2, "memory": "1GiB"}}],
        },
        base_dir=tmp_path,
    )
    model = ModelSpec.from_dict({"name": "m", "batch_size": 2048, "tables": [{"name": "t", "rows": 2000, "dim": 32}]})
    return CostModel(model, topo)


def test_a_profiled_sharding_factor_scales_that_type_s_exchange_and_a_replica_s_work(tmp_path):
    plain = _cpu_cost({}, tmp_path)
    scaled = _cpu_cost({"row_wise": 4.0, "data_parallel": 0.5}, tmp_path)
    table, gpus, lay = plain.model.tables[0], np.array([0, 1]), plain.layout
    terms = plain.range_shard_terms(table, np.array([0.5, 0.5]), table.dim, Tier.HBM, gpus)
    for sharding, factor in ((Sharding.ROW_WISE, 4.0), (Sharding.TABLE_WISE, 1.0), (Sharding.COLUMN_WISE, 1.0)):
        before, after = plain.range_loads_of(terms, gpus, sharding), scaled.range_loads_of(terms, gpus, sharding)
        # the exchange (the devices' collectives) by the type's factor; the kernels' time as it was
        assert after[:, lay.nvlink] == pytest.approx(before[:, lay.nvlink] * factor)
        assert before[:, lay.nvlink].sum() > 0
        assert after[:, lay.emb] == pytest.approx(before[:, lay.emb])
    assert scaled.replica_loads(table) == pytest.approx(plain.replica_loads(table) * 0.5)
    # a whole placement is priced the same way
    rw = TablePlacement(
        Sharding.ROW_WISE,
        tuple(Shard(f"t0/cpu{g}", Tier.HBM, (0, 32), 1, rows=(1000 * g, 1000 * (g + 1))) for g in (0, 1)),
    )
    a, b = plain.placement_loads(table, rw)[0], scaled.placement_loads(table, rw)[0]
    assert b[lay.nvlink] == pytest.approx(a[lay.nvlink] * 4.0) and b[lay.emb] == pytest.approx(a[lay.emb])
