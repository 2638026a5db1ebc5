"""The exact oracle of benchmarks/optimality.py: it prices plans as the cost model does, the lower bound never exceeds
its optimum, and the search's plan (on the oracle's options) is never below it (hypothesis)."""

from __future__ import annotations

import pytest
from benchmark_modules import load
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from persia_planner import CapacityError, Planner, SearchConfig
from persia_planner.bound import lower_bound
from persia_planner.cost.analytic import CostModel
from persia_planner.search import GreedyLocalSearch

pytest.importorskip("scipy")
optimality = load("optimality")

CLUSTERS = [((3, 50.0),), ((2, 50.0), (2, 50.0)), ((1, 12.5), (2, 100.0))]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.integers(3, 10),
    st.sampled_from(CLUSTERS),
    st.sampled_from([0, 2]),
    st.sampled_from([0, 4]),
    st.sampled_from([0.25, 1.0, 16.0]),
    st.integers(0, 2**16),
)
# An uneven row split's twin with its devices swapped is no candidate: a symmetry cut left no plan at all (the first)
# or an "optimum" above the search's plan (the second, with memory in bytes beside times in ms).
@example(10, ((2, 50.0), (2, 50.0)), 2, 4, 0.25, 6325)
@example(9, ((1, 12.5), (2, 100.0)), 2, 0, 1.0, 411)
def test_the_bound_is_at_most_the_optimum_and_the_search_at_least(tables, hosts, servers, k, hbm_gib, seed):
    inst = optimality.Instance("t", tables, hosts, servers, k, hbm_gib, seed)
    model, topology = inst.model(), inst.topology()
    cost = CostModel(model, topology)
    solved = optimality.solve(cost, time_limit_s=30.0)  # raises where its step is not the cost model's
    config = SearchConfig(seed=0, improve_time_s=0.2, shardings=optimality.SHARDINGS, tiers=optimality.TIERS)
    try:
        ours = Planner(GreedyLocalSearch(config)).plan(model, topology)
    except CapacityError:
        ours = None
    if solved is None:
        assert ours is None  # no choice among the oracle's options fits: neither does the search's
        return
    optimum, plan = solved
    assert set(plan) == {t.name for t in model.tables}
    assert lower_bound(cost).value_ms <= optimum * (1 + 1e-9)
    if ours is not None:
        assert ours.step_ms >= optimum * (1 - optimality.REL_GAP)


def test_a_summary_counts_what_was_solved():
    records = [
        {"name": "a", "status": "ok", "ours_ms": 10.1, "optimum_ms": 10.0, "bound_ms": 9.0, "gap": 0.01},
        {"name": "b", "status": "ok", "ours_ms": 12.0, "optimum_ms": 10.0, "bound_ms": 5.0, "gap": 0.2},
        {"name": "c", "status": "no_plan", "ours_ms": None, "optimum_ms": None, "bound_ms": None, "gap": None},
    ]
    out = optimality.summarize(records)
    assert out["solved"] == 2 and out["within_2pct_share"] == 0.5 and out["worst_gap"] == 0.2
    assert out["median_bound_over_optimum"] == pytest.approx(0.7)


def test_ruin_and_recreate_finds_what_single_moves_miss():
    # A big table runs best split over two GPUs' HBM, which small tables fill first: emptying both is several
    # moves, each worse alone. The local search alone stops 62% above the optimum; ruin and recreate reaches it.
    from persia_planner.search.improve import BottleneckLocalSearch

    inst = optimality.Instance("i09", 23, ((2, 50.0), (2, 50.0)), 0, 4, 1.0, seed=9)
    model, topology = inst.model(), inst.topology()
    config = SearchConfig(seed=0, improve_time_s=30.0, shardings=optimality.SHARDINGS, tiers=optimality.TIERS)
    local = Planner(GreedyLocalSearch(config, improver=BottleneckLocalSearch())).plan(model, topology)
    ruined = Planner(GreedyLocalSearch(config)).plan(model, topology)
    optimum = 5.42314497737686  # optimality.solve of this instance (about a minute with HiGHS)
    assert local.step_ms > optimum * 1.5
    assert optimum * (1 - optimality.REL_GAP) <= ruined.step_ms <= optimum * 1.02
