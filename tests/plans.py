"""Placements, topologies and plans the tests build (imported by several test modules)."""

from __future__ import annotations

from persia_planner import CostModel, GreedyLocalSearch, ModelSpec, Plan, Planner, SearchConfig, Topology, validate
from persia_planner.kinds import Sharding
from persia_planner.placement.shards import Shard, TablePlacement
from persia_planner.plan.plan import usage_of
from persia_planner.tiers import Tier


def gpu_host(name: str, count: int, gpus: int) -> dict:
    return {
        "name": name,
        "count": count,
        "ddr": "64GiB",
        "ddr_bandwidth": "200GB/s",
        "nic_bandwidth": "50GB/s",
        "gpus": {
            "count": gpus,
            "hbm": "16GiB",
            "hbm_bandwidth": "2TB/s",
            "tflops": 100,
            "pcie_bandwidth": "32GB/s",
            "nvlink_bandwidth": "300GB/s",
        },
    }


# 1 host x 1 GPU (one trainer), 1 host x 2 GPUs (two trainers), and 2 hosts x 2 GPUs + 2 parameter servers.
TOPO_1X1 = {"name": "1x1", "hosts": [gpu_host("trainer", 1, 1)]}
TOPO_1X2 = {"name": "1x2", "hosts": [gpu_host("trainer", 1, 2)]}
TOPO_2X2_PS = {
    "name": "2x2-2ps",
    "hosts": [
        gpu_host("trainer", 2, 2),
        {"name": "ps", "count": 2, "role": "parameter_server", "ddr": "64GiB", "ddr_bandwidth": "100GB/s",
         "nic_bandwidth": "25GB/s"},
    ],
}  # fmt: skip


def ps_placement(dim: int, servers: int = 1) -> TablePlacement:
    return TablePlacement(
        Sharding.PS_HASH, tuple(Shard(f"ps{i}", Tier.PS, (0, dim), 0, hash=(i, servers)) for i in range(servers))
    )


def local_placement(rows: int, dim: int, tier: Tier = Tier.HBM, device: str = "trainer0/gpu0") -> TablePlacement:
    return TablePlacement(Sharding.TABLE_WISE, (Shard(device, tier, (0, dim), 0, rows=(0, rows)),))


def replicated(rows: int, dim: int, gpus: int) -> TablePlacement:
    return TablePlacement(
        Sharding.DATA_PARALLEL,
        tuple(Shard(f"trainer0/gpu{g}", Tier.HBM, (0, dim), 0, rows=(0, rows), replica=True) for g in range(gpus)),
    )


def forced_plan(model: ModelSpec, topology: Topology, force: dict[str, tuple[Sharding, Tier]]) -> Plan:
    """A plan made by our planner, each table planned with its sharding type and tier forced by SearchConfig."""
    placements = {}
    for table in model.tables:
        sharding, tier = force[table.name]
        config = SearchConfig(shardings=frozenset({sharding}), tiers=frozenset({tier}), improve_time_s=0.2)
        sub = ModelSpec(model.name, model.batch_size, (table,), embedding_dtype=model.embedding_dtype)
        placements[table.name] = Planner(GreedyLocalSearch(config)).plan(sub, topology).tables[table.name]
        assert placements[table.name].sharding is sharding
        assert {s.tier for s in placements[table.name].shards} == {tier}
    cost = CostModel(model, topology)
    estimate, mem = cost.evaluate(placements)
    plan = Plan(
        model.name,
        topology.name,
        placements,
        usage_of(cost, estimate, mem, placements),
        estimate.step_ms,
        0.0,
        estimate.samples_per_s,
    )
    assert validate(plan, model, topology) == []
    return plan
