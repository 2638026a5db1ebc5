"""Improvement by ruin and recreate alone (:class:`persia_planner.search.ruin.RuinAndRecreate`), around the real
local search, on a real cost model from a deliberately bad start."""

import time

import numpy as np
import pytest
from search_inputs import all_on_one_gpu, cluster, model, snapshot, state, sums_match_choices, table, within_capacity

from persia_planner import SearchConfig
from persia_planner.cost.analytic import CostModel
from persia_planner.search.improve import BottleneckLocalSearch
from persia_planner.search.ruin import RuinAndRecreate

# Eight tables of 52 MB to 416 MB, the larger the hotter, on 2 hosts x 2 GPUs.
TABLES = tuple(table(f"t{i}", 200_000 * (i + 1), 64, 2.0 + i) for i in range(8))
NEVER = float("inf")


@pytest.fixture(scope="module")
def cost():
    return CostModel(model(*TABLES), cluster(2, 2, 0))


def test_the_score_drops_and_the_memory_stays_within_capacity(cost):
    s = all_on_one_gpu(cost)
    start = s.current_score()
    moves = RuinAndRecreate().improve(s, deadline=NEVER)
    assert moves > 0
    assert s.current_score() < 0.8 * start
    assert set(s.choices) == {t["name"] for t in TABLES}
    assert within_capacity(s) and sums_match_choices(s)


def test_the_rounds_never_end_worse_than_the_local_search_alone(cost):
    """The local search runs first with the same seed, and a round is kept only when it lowers the score: the result
    is never worse than the local search's; on this model the rounds find a better plan than it does."""
    local, ruined = all_on_one_gpu(cost), all_on_one_gpu(cost)
    BottleneckLocalSearch().improve(local, deadline=NEVER)
    RuinAndRecreate().improve(ruined, deadline=NEVER)
    assert ruined.current_score() < local.current_score() * (1 - 1e-6)


def test_without_a_budget_it_is_the_local_search_alone(cost):
    local, ruined = all_on_one_gpu(cost), all_on_one_gpu(cost)
    moves = BottleneckLocalSearch().improve(local, deadline=NEVER)
    assert RuinAndRecreate(budget=0).improve(ruined, deadline=NEVER) == moves
    assert snapshot(ruined)[2] == snapshot(local)[2]
    assert ruined.current_score() == local.current_score()


def test_the_same_seed_gives_the_same_plan(cost):
    runs = []
    for _ in range(2):
        s = all_on_one_gpu(cost, SearchConfig(seed=3))
        moves = RuinAndRecreate().improve(s, deadline=NEVER)
        runs.append((moves, snapshot(s)[2], s.current_score()))
    assert runs[0] == runs[1]


def test_a_deadline_already_passed_makes_no_move(cost):
    s = all_on_one_gpu(cost)
    before = snapshot(s)
    assert RuinAndRecreate().improve(s, deadline=time.perf_counter() - 1.0) == 0
    after = snapshot(s)
    assert np.array_equal(after[0], before[0]) and np.array_equal(after[1], before[1]) and after[2] == before[2]


def test_a_single_table_gets_the_local_search_only():
    cost = CostModel(model(table("only", 10_000, 64, 4.0)), cluster(1, 2, 0))
    s = state(cost)
    choice, _ = s.best_choice(s.specs["only"])
    s.add("only", choice)
    assert RuinAndRecreate().improve(s, deadline=NEVER) == 0
    assert s.choices["only"] is choice


def test_no_round_leaves_a_table_out_or_twice(cost):
    """A round that finds no better plan puts its tables back as they were; many small rounds (two tables each)
    leave every table placed once and the sums equal to the choices'."""
    s = all_on_one_gpu(cost, SearchConfig(seed=11))
    RuinAndRecreate(rounds=60, max_ruined=2).improve(s, deadline=NEVER)
    assert sorted(s.choices) == sorted(t["name"] for t in TABLES)
    assert sums_match_choices(s) and within_capacity(s)
