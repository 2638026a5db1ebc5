"""Scale: the cost model's all-to-all sums from the pattern's structure equal the dense rows' sums, and the search's
peak memory grows linearly with the cluster, not with its square (timing is the benchmark's: benchmarks/planner.py)."""

import tracemalloc

import numpy as np
import pytest

from persia_planner.cost import all_to_all as cost_a2a
from persia_planner.cost.analytic import CostModel
from persia_planner.kinds import Sharding
from persia_planner.search import GreedyLocalSearch, SearchConfig
from persia_planner.search.state import CANDIDATE_HOSTS
from persia_planner.synthetic import random_model, random_topology
from persia_planner.tiers import Tier
from persia_planner.topology.graph import Topology


def _mixed_cost() -> CostModel:
    """Hosts of 4, 4 and 2 GPUs: the pattern's per-host terms differ."""
    data = Topology.simple_dict(trainers=2, gpus_per_trainer=4, servers=1)
    small = dict(data["hosts"][0], name="small", count=1)
    small["gpus"] = dict(small["gpus"], count=2, nvlink_bandwidth="300GB/s")
    small["nic_bandwidth"] = "25GB/s"
    data["hosts"].append(small)
    return CostModel(random_model(3, seed=2), Topology.from_dict(data))


def test_structured_sums_equal_dense_rows(monkeypatch):
    cost = _mixed_cost()
    a2a, lay = cost.a2a, cost.layout
    every = np.arange(lay.n_gpus)
    rows, twrw_rows = a2a.rows(every), a2a.rows(every, twrw=True)
    dense_gpu_sum, weights = a2a.gpu_sum(), np.linspace(0.5, 2.0, lay.n_hosts)
    dense_nic = a2a.nic_dot(weights)
    monkeypatch.setattr(cost_a2a, "DENSE_MAX_GPUS", 0)
    assert a2a.gpu_sum() == pytest.approx(dense_gpu_sum, rel=1e-12)
    assert a2a.nic_dot(weights) == pytest.approx(dense_nic, rel=1e-12)
    gpus = np.array([0, 3, 3, 8, 9, 5])  # a GPU twice: two shards on it
    plain, twrw = np.linspace(1, 6, len(gpus)), np.linspace(7, 2, len(gpus))
    want = (rows[gpus] * plain[:, None]).sum(axis=0) + (twrw_rows[gpus] * twrw[:, None]).sum(axis=0)
    assert a2a.weighted_sum(gpus, plain, twrw) == pytest.approx(want, rel=1e-12, abs=1e-18)


@pytest.mark.parametrize("sharding", [Sharding.ROW_WISE, Sharding.TABLE_ROW_WISE])
def test_range_and_replica_sums_equal_dense_rows(monkeypatch, sharding):
    cost = _mixed_cost()
    table, gpus = cost.model.tables[0], np.arange(cost.layout.n_gpus)
    fractions = np.full(len(gpus), 1 / len(gpus))
    terms = [cost.range_shard_terms(table, fractions, table.dim, t, gpus) for t in (Tier.HBM, Tier.DDR)]
    dense = [cost.range_loads_sum(t, gpus, sharding) for t in terms]
    replica, memory = cost.replica_loads(table), cost.shard_memory_sum(gpus, 3.0, 5.0)
    monkeypatch.setattr("persia_planner.cost.analytic.DENSE_MAX_GPUS", 0)
    for t, want in zip(terms, dense, strict=True):
        assert cost.range_loads_sum(t, gpus, sharding) == pytest.approx(want, rel=1e-12, abs=1e-18)
    assert cost.replica_loads(table) == pytest.approx(replica, rel=1e-12)
    assert cost.shard_memory_sum(gpus, 3.0, 5.0) == pytest.approx(memory)


def _search_peak(hosts: int) -> tuple[int, dict[str, str]]:
    """Peak traced bytes of building the cost model of a ``hosts``-host cluster and searching it, and the plan."""
    tracemalloc.start()
    try:
        topology = random_topology(trainers=hosts, gpus_per_trainer=8, servers=0)
        cost = CostModel(random_model(4, seed=4, rows_range=(1e5, 1e7)), topology)
        result = GreedyLocalSearch(SearchConfig(improve_time_s=1e9, improve_rounds=1)).search(cost)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return peak, {name: option.describe() for name, option in result.options.items()}


def test_search_memory_grows_linearly_with_the_cluster():
    # A row per GPU (or per host) of the cluster's resources anywhere would make the peak grow four times with
    # twice the hosts; the candidate rows, load vectors and per-GPU arrays grow twice.
    assert CANDIDATE_HOSTS < 200
    small, plan = _search_peak(200)
    large, _ = _search_peak(400)
    assert any("ps" not in option for option in plan.values())  # local placements were searched too
    assert large < 2.6 * small
