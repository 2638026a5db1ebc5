"""Improvement alone (:class:`persia_planner.search.improve.BottleneckLocalSearch`): moves that lower the state's
score, on a real cost model, from a deliberately bad start and from one with nothing to improve."""

import itertools
import time

import numpy as np
import pytest
from search_inputs import (
    all_on_one_gpu,
    cluster,
    forced_choice,
    model,
    snapshot,
    state,
    sums_match_choices,
    table,
    within_capacity,
)

from persia_planner import SearchConfig
from persia_planner.cost.analytic import CostModel
from persia_planner.kinds import Sharding
from persia_planner.search.base import Option
from persia_planner.search.improve import BottleneckLocalSearch
from persia_planner.tiers import Tier

# Eight tables of 52 MB to 416 MB, the larger the hotter, on 2 hosts x 2 GPUs.
TABLES = tuple(table(f"t{i}", 200_000 * (i + 1), 64, 2.0 + i) for i in range(8))


@pytest.fixture(scope="module")
def cost():
    return CostModel(model(*TABLES), cluster(2, 2, 0))


def test_every_table_on_one_gpu_is_spread_and_the_score_drops(cost):
    bad = all_on_one_gpu(cost)
    start = bad.current_score()
    moves = BottleneckLocalSearch().improve(bad, deadline=float("inf"))
    assert moves > 0
    assert bad.current_score() < 0.8 * start
    # Every GPU now does some of the work.
    assert {g for c in bad.choices.values() for g in c.gpus} == set(range(4))
    assert within_capacity(bad) and sums_match_choices(bad)


def test_no_move_raises_the_score(cost):
    """One move at a time (``improve_rounds=1``): each call moves at most once and never to a worse score."""
    s = all_on_one_gpu(cost, SearchConfig(improve_rounds=1))
    scores = [s.current_score()]
    local = BottleneckLocalSearch()
    while (moved := local.improve(s, deadline=float("inf"))) and len(scores) < 50:
        assert moved == 1
        scores.append(s.current_score())
        assert within_capacity(s)
    assert len(scores) > 2
    assert all(later < earlier for earlier, later in itertools.pairwise(scores))


def test_the_moves_stop_at_improve_rounds(cost):
    limited = all_on_one_gpu(cost, SearchConfig(improve_rounds=2))
    assert BottleneckLocalSearch().improve(limited, deadline=float("inf")) == 2
    unlimited = all_on_one_gpu(cost)
    assert BottleneckLocalSearch().improve(unlimited, deadline=float("inf")) > 2
    assert unlimited.current_score() < limited.current_score()


def test_running_it_again_from_where_it_stopped_moves_nothing(cost):
    s = all_on_one_gpu(cost)
    local = BottleneckLocalSearch()
    local.improve(s, deadline=float("inf"))
    before = snapshot(s)
    assert local.improve(s, deadline=float("inf")) == 0
    assert snapshot(s)[2] == before[2]
    # Moves tried and taken back leave the sums where they were, up to their rounding.
    assert np.allclose(s.loads, before[0], rtol=1e-12, atol=0)


def test_a_single_small_table_has_nothing_to_improve():
    cost = CostModel(model(table("only", 10_000, 64, 4.0)), cluster(1, 1, 0))
    s = state(cost)
    choice, _ = s.best_choice(s.specs["only"])
    s.add("only", choice)
    score = s.current_score()
    assert BottleneckLocalSearch().improve(s, deadline=float("inf")) == 0
    assert s.current_score() == score and s.choices["only"] is choice


def test_a_deadline_already_passed_makes_no_move(cost):
    s = all_on_one_gpu(cost)
    before = snapshot(s)
    assert BottleneckLocalSearch().improve(s, deadline=time.perf_counter() - 1.0) == 0
    after = snapshot(s)
    assert np.array_equal(after[0], before[0]) and np.array_equal(after[1], before[1]) and after[2] == before[2]


def test_a_hot_table_in_ddr_is_swapped_into_hbm_for_colder_tables():
    """One GPU whose HBM is full of cold tables, the hot one in DDR: re-inserting the hot table alone finds no HBM
    room, so the move evicts cold tables and places the hot one in HBM (swap-in)."""
    tables = (table("hot", 3_000_000, 64, 30.0), *(table(f"cold{i}", 3_000_000, 64, 0.5) for i in range(4)))
    cost = CostModel(model(*tables), cluster(1, 1, 0, hbm="4GiB"))  # 3.6 GiB usable: 4 of the 780 MB tables
    s = state(cost, SearchConfig(tiers=frozenset({Tier.HBM, Tier.DDR})))
    for i in range(4):
        s.add(f"cold{i}", forced_choice(cost, f"cold{i}", Option(Sharding.TABLE_WISE, Tier.HBM), (0,)))
    s.add("hot", forced_choice(cost, "hot", Option(Sharding.TABLE_WISE, Tier.DDR), (0,)))
    start = s.current_score()
    assert BottleneckLocalSearch().improve(s, deadline=float("inf")) == 1
    assert s.choices["hot"].option.tier is Tier.HBM
    # One cold table makes the room (each is as cold: the first by name goes).
    assert [n for n, c in s.choices.items() if c.option.tier is Tier.DDR] == ["cold0"]
    assert s.current_score() < start and within_capacity(s)


def test_the_candidates_tried_are_a_knob(cost):
    """With no candidate table per round, no move is tried at all."""
    s = all_on_one_gpu(cost)
    assert BottleneckLocalSearch(candidates=0).improve(s, deadline=float("inf")) == 0
    assert all(c.gpus == (0,) for c in s.choices.values())
