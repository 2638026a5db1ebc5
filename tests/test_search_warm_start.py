"""Construction from a neighbouring plan (:class:`persia_planner.search.warm_start.WarmStart`) and the planner's
re-plan (:meth:`persia_planner.planner.Planner.plan_from`): what still stands stays, the rest is placed, the plan is
valid and close to a plan searched from scratch."""

import pytest
from search_inputs import cluster, model, sums_match_choices, table, within_capacity

from persia_planner import GreedyLocalSearch, Planner, SearchConfig, plan, validate
from persia_planner.cost.analytic import CostModel
from persia_planner.kinds import Sharding
from persia_planner.search.options import TieredOptions
from persia_planner.search.warm_start import WarmStart

TABLES = tuple(table(f"t{i}", 20_000 * 2**i, 64, 30.0 / (i + 1), zipf_alpha=1.0) for i in range(14))


@pytest.fixture(scope="module")
def neighbour():
    spec = model(*TABLES)
    return spec, plan(spec, cluster(3, 2, 2), explain_top=0)


def test_a_grown_cluster_keeps_every_placement_that_still_stands(neighbour):
    spec, before = neighbour
    grown = cluster(4, 2, 3)  # a trainer host and a server more: every device of the old cluster is still there
    cost = CostModel(spec, grown)
    state = WarmStart(SearchConfig(), before.tables).construct(cost, None, TieredOptions())
    assert sorted(state.choices) == sorted(before.tables)
    assert sums_match_choices(state) and within_capacity(state)
    for name, old in before.tables.items():
        new = state.placement(name)
        if old.sharding is Sharding.PS_HASH:
            assert {s.device for s in new.shards} == {s.name for s in grown.servers}  # spread over all three
        elif old.sharding is Sharding.DATA_PARALLEL:
            assert len(new.shards) == len(grown.gpus)
        else:
            assert new is old


def test_tables_of_a_host_that_left_are_placed_again(neighbour):
    spec, before = neighbour
    shrunk = cluster(2, 2, 2)
    state = WarmStart(SearchConfig(), before.tables).construct(CostModel(spec, shrunk), None, TieredOptions())
    assert sorted(state.choices) == sorted(before.tables)
    devices = {g.name for g in shrunk.gpus} | {s.name for s in shrunk.servers}
    for name in before.tables:
        assert {s.device for s in state.placement(name).shards} <= devices
    assert within_capacity(state)


@pytest.mark.parametrize("hosts", [2, 4])
def test_plan_from_a_neighbour_is_valid_and_near_a_fresh_plan(neighbour, hosts):
    spec, before = neighbour
    topology = cluster(hosts, 2, 2)
    planner = Planner(GreedyLocalSearch(SearchConfig(explain_top=0)))
    warm = planner.plan_from(spec, topology, before, improve_time_s=0.5)
    fresh = plan(spec, topology, explain_top=0)
    assert validate(warm, spec, topology) == []
    assert warm.step_ms <= 1.3 * fresh.step_ms
    assert warm.lower_bound_ms <= fresh.lower_bound_ms + 1e-9  # the dense step's bound: weaker, never above
    assert warm.lower_bound_ms > 0 and set(warm.bound_parts) == {"dense step alone"}
    full = planner.plan_from(spec, topology, before, improve_time_s=0.5, full_bound=True)
    assert full.lower_bound_ms == pytest.approx(fresh.lower_bound_ms)


def test_a_cached_table_of_a_host_that_left_keeps_its_cache_fraction_where_it_lands():
    """A homeless table is first offered its old tier: a cached one at its old cache fraction (a hint without the
    fraction gave shards with none, which validate() refuses)."""
    from persia_planner.planner import priced_plan
    from persia_planner.search.base import Option
    from persia_planner.search.result import build_placement
    from persia_planner.tiers import Tier

    spec = model(*TABLES)
    old = CostModel(spec, cluster(3, 2, 2))
    cached = spec.tables[3]
    last_gpu = len(old.topology.gpus) - 1  # on the host that leaves
    previous = {
        cached.name: build_placement(old, cached, Option(Sharding.TABLE_WISE, Tier.HBM_CACHE, 0.5), (last_gpu,))
    }
    shrunk = cluster(2, 2, 2)
    cost = CostModel(spec, shrunk)
    state = WarmStart(SearchConfig(), previous).construct(cost, None, TieredOptions())
    placements = {name: state.placement(name) for name in state.choices}
    moved = placements[cached.name]
    if moved.shards[0].tier is Tier.HBM_CACHE:
        assert all(s.cache_fraction == pytest.approx(0.5) for s in moved.shards)
    planned = priced_plan(cost, placements, lower_bound_ms=0.0)
    assert validate(planned, spec, shrunk) == []


def test_a_row_wise_table_spreads_over_the_gpus_of_a_grown_cluster():
    """Row-wise means row blocks over every GPU (TorchRec splits the rows over every rank): a kept one would leave
    the new GPUs out."""
    from persia_planner.plan.torchrec_export import torchrec_shardings

    spec = model(*TABLES)
    config = SearchConfig(shardings=frozenset({Sharding.ROW_WISE, Sharding.PS_HASH}), explain_top=0)
    planner = Planner(GreedyLocalSearch(config))
    before = planner.plan(spec, cluster(2, 2, 2))
    assert any(p.sharding is Sharding.ROW_WISE for p in before.tables.values())
    grown = cluster(3, 2, 2)
    after = planner.plan_from(spec, grown, before)
    assert validate(after, spec, grown) == []
    for placement in after.tables.values():
        if placement.sharding is Sharding.ROW_WISE:
            assert len(placement.shards) == len(grown.gpus)
    torchrec_shardings(after, spec, grown)  # TorchRec takes it
