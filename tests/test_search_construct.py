"""Construction alone (:class:`persia_planner.search.construct.GreedyConstruction`): a state with every table placed
once, within the memory, on a real cost model of small clusters."""

import numpy as np
import pytest
from search_inputs import ROW_BYTES_64, cluster, model, snapshot, sums_match_choices, table, within_capacity

from persia_planner import SearchConfig
from persia_planner.bound import lower_bound
from persia_planner.cost.analytic import CostModel
from persia_planner.errors import CapacityError
from persia_planner.kinds import Sharding
from persia_planner.search.construct import GreedyConstruction, Start, place_all
from persia_planner.search.options import TieredOptions
from persia_planner.search.state import State
from persia_planner.tiers import Tier

# Twelve tables from 10 k to 60 M rows (2.6 MB to 16 GB), their heat falling with their size, and one cold giant
# (26 GB) that the servers should hold.
TABLES = (
    *(table(f"t{i}", 10_000 * 2**i, 64, 40.0 / (i + 1), zipf_alpha=1.0) for i in range(12)),
    table("giant", 26_000_000_000 // ROW_BYTES_64, 64, 1.0, zipf_alpha=1.1),
)


def construct(cost, seed=0, hint=None):
    return GreedyConstruction(SearchConfig(seed=seed)).construct(cost, hint, TieredOptions())


@pytest.fixture(scope="module")
def cost():
    return CostModel(model(*TABLES), cluster(2, 2, 2))


def test_every_table_is_placed_once_and_the_sums_are_its_choices(cost):
    state = construct(cost)
    assert sorted(state.choices) == sorted(t["name"] for t in TABLES)
    assert sums_match_choices(state)
    # Each choice is a placement the plan can hold: one shard per device it names (a hashed table: one per server).
    for name, choice in state.choices.items():
        shards = state.placement(name).shards
        assert len(shards) == (
            len(cost.topology.servers) if choice.option.sharding is Sharding.PS_HASH else len(choice.gpus)
        )


def test_the_memory_used_is_within_every_capacity_and_is_the_plans(cost):
    state = construct(cost)
    assert within_capacity(state)
    # The state's memory vector is the cost model's of the plan it describes: no slot charged twice or forgotten.
    _, mem = cost.evaluate({name: state.placement(name) for name in state.choices})
    assert np.allclose(state.mem, mem, rtol=0, atol=1.0)


def test_the_hot_small_tables_stay_on_the_gpus_and_the_cold_giant_goes_to_the_servers(cost):
    state = construct(cost)
    assert state.choices["t0"].option.tier is Tier.HBM
    assert state.choices["giant"].option.tier is Tier.PS


def test_construction_ends_with_its_memory_prices_off(cost):
    """Prices steer construction only; the state it returns scores plain step time (the improver compares those)."""
    state = construct(cost, hint=lower_bound(cost))
    assert not state.pricing


def test_the_same_seed_gives_the_same_placement(cost):
    first, second = construct(cost, seed=7), construct(cost, seed=7)
    assert snapshot(first)[2] == snapshot(second)[2]
    assert first.current_score() == second.current_score()
    assert np.array_equal(first.loads, second.loads)


def test_with_the_lower_bounds_hint_every_table_is_still_placed_within_memory(cost):
    hint = lower_bound(cost)
    assert set(hint.preferred) == {t["name"] for t in TABLES}
    state = construct(cost, hint=hint)
    assert set(state.choices) == {t["name"] for t in TABLES}
    assert within_capacity(state) and sums_match_choices(state)


def test_a_model_that_cannot_fit_raises_a_capacity_error_naming_the_table():
    """390 GB on two GPUs and 64 GiB of DDR, no servers: the error names the table, the short resource and fixes."""
    cost = CostModel(model(table("small", 1000), table("huge", 1_500_000_000, 64, 1.0)), cluster(1, 2, 0))
    with pytest.raises(CapacityError) as err:
        construct(cost)
    assert err.value.table == "huge"
    assert "'huge'" in str(err.value) and err.value.short_bytes > 0 and err.value.fixes


def test_tight_memory_is_packed_largest_first_before_the_model_is_called_infeasible():
    """Hottest first, the hot table takes the servers' room the big one needs (108 GiB of stores for 104 GiB + 28
    GiB); construction falls back to packing orders and finds the plan (big on the servers, hot kept local)."""
    topo_hosts = cluster(1, 2, 2, hbm="8GiB", ps_ddr="68GiB")
    tables = (
        table("hot", 68_975_576, 100, 30.0, zipf_alpha=0.8),
        table("big", 132_919_313, 100, 5.0, optimizer="adagrad"),
        table("small", 94_602, 64, 5.0, optimizer="sgd"),
    )
    cost = CostModel(model(*tables, batch_size=65536), topo_hosts)
    hottest_first = State(cost, SearchConfig(), TieredOptions())
    with pytest.raises(CapacityError):
        place_all(hottest_first, Start())
    state = construct(cost)
    assert state.choices["big"].option.tier is Tier.PS and state.choices["hot"].option.tier is not Tier.PS
    assert within_capacity(state)


def test_a_table_that_fits_nowhere_the_search_may_go_names_a_memory_of_the_allowed_tiers():
    """With the servers' tiers left out of the search, the error names the GPUs' HBM and the search's options, not
    the servers that it may not use (it said "ps0 is short by 0 B")."""
    cost = CostModel(model(table("big", 100_000_000, 64, 2.0)), cluster(1, 2, 2, hbm="8GiB"))
    with pytest.raises(CapacityError) as err:
        GreedyConstruction(SearchConfig(tiers=frozenset({Tier.HBM}))).construct(cost, None, TieredOptions())
    assert (err.value.table, err.value.resource) == ("big", "GPU HBM") and err.value.short_bytes > 0
    assert "let the search use more tiers or sharding types (SearchConfig)" in str(err.value)
    assert "ps0" not in str(err.value)


@pytest.mark.parametrize(
    ("servers", "tiers", "resource", "says"),
    [
        (0, {Tier.PS}, "PS DDR", "the tiers the search may use (ps) need parameter servers, which the topology lacks"),
        (2, {Tier.SSD}, "PS DDR", "(ssd) need parameter servers with disks, which the topology lacks"),
    ],
)
def test_allowed_tiers_whose_memory_the_topology_lacks_are_named_as_such(servers, tiers, resource, says):
    """Not "short by 0 B" of a memory that is not there."""
    cost = CostModel(model(table("big", 100_000_000, 64, 2.0)), cluster(1, 2, servers, hbm="8GiB"))
    with pytest.raises(CapacityError) as err:
        GreedyConstruction(SearchConfig(tiers=frozenset(tiers))).construct(cost, None, TieredOptions())
    assert (err.value.table, err.value.resource) == ("big", resource) and err.value.short_bytes > 0
    assert says in str(err.value) and "0 B" not in str(err.value)


@pytest.mark.parametrize("tiers", [{Tier.PS}, {Tier.PS, Tier.HBM}])
def test_too_many_rows_for_one_server_is_explained_when_the_search_leaves_local_memories_out(tiers):
    cost = CostModel(model(table("huge", 2_000_000_000_000, 8, 1.0)), cluster(1, 2, 1))
    with pytest.raises(CapacityError) as err:
        GreedyConstruction(SearchConfig(tiers=frozenset(tiers))).construct(cost, None, TieredOptions())
    assert err.value.resource == "PS rows" and "over the 1,099,507,433,414 rows" in str(err.value)
