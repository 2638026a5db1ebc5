"""Improvement beyond single moves: ruin and recreate (large-neighbourhood search) around the local search.

The local search moves one table at a time (or swaps one in for the coldest tables of one device). Some better
plans are several moves away, each of which alone makes the plan worse: a big table that would run best split over
two GPUs' HBM needs both GPUs emptied of the small tables that fill them first. A round *ruins* a part of the plan
(every table on two GPUs, the tables sharing devices with one of the bottleneck's heaviest, a few tables at random or
a few of the largest), *recreates* it (each table at its best option, split ones included, the largest or the hottest
first, or in a random order) and keeps the result when the score drops (polished by the local search: at once on
small models, once after the last round on large ones); else it puts the ruined tables back as they were.

Rounds are counted, not timed, so that a seed fixes the plan (the deadline only cuts a search that ran too long):
:data:`ROUND_BUDGET` best-choice calls in all (fewer beyond :data:`FULL_BUDGET_TABLES` tables), and no more once
:data:`_PATIENCE` rounds in a row kept nothing.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from persia_planner.search.base import Choice, Improver
from persia_planner.search.improve import BottleneckLocalSearch

if TYPE_CHECKING:
    from persia_planner.search.base import SearchState

__all__ = ["RuinAndRecreate"]

# Best-choice calls the ruin rounds may make in all (a round recreates each table it ruined): a 40-table model gets
# all of them, a 1,000-table one 30, a few rounds (each call scores every option of a table on a large cluster).
ROUND_BUDGET = 3000
# Models of up to this many tables get the whole budget; beyond, it shrinks with the square of the table count (each
# call costs more too, on the larger clusters such models run on), so that 1,000 tables get a few rounds.
FULL_BUDGET_TABLES = 100
# Rounds at most, and tables ruined per round at most.
_ROUNDS = 400
_MAX_RUINED = 12
# The rounds end after this many in a row kept nothing: by then the neighbourhoods are mostly explored.
_PATIENCE = 30


class RuinAndRecreate:
    """The default :class:`.base.Improver`: the local search, then ruin-and-recreate rounds, each polished by it.

    Args:
        local: The single-move local search run first and after every kept round.
        rounds: Ruin rounds at most.
        budget: Best-choice calls the rounds may make in all.
        max_ruined: Tables ruined per round at most.
    """

    def __init__(
        self,
        local: Improver | None = None,
        rounds: int = _ROUNDS,
        budget: int = ROUND_BUDGET,
        max_ruined: int = _MAX_RUINED,
    ):
        self.local = local or BottleneckLocalSearch()
        self.rounds = rounds
        self.budget = budget
        self.max_ruined = max_ruined

    def improve(self, state: SearchState, deadline: float) -> int:
        """The local search's moves, then rounds while the budget lasts; returns the moves and rounds kept."""
        moves = self.local.improve(state, deadline)
        if len(state.choices) < 2:
            return moves
        best_score = state.current_score()
        small = len(state.choices) <= FULL_BUDGET_TABLES
        budget = self.budget * min(1.0, (FULL_BUDGET_TABLES / len(state.choices)) ** 2)
        spent = idle = kept = 0
        for _ in range(self.rounds):
            if spent >= budget or idle >= _PATIENCE or time.perf_counter() >= deadline:
                break
            idle += 1
            ruined = self._ruin_set(state)
            if not ruined:
                continue
            spent += len(ruined)
            saved = {name: state.remove(name) for name in ruined}
            if self._recreate(state, list(saved)) and state.current_score() < best_score * (1 - 1e-9):
                # Polished at once on small models; on large ones, where one pass of the local search costs as much
                # as many rounds, once after the last round.
                moves += 1 + (self.local.improve(state, deadline) if small else 0)
                best_score, idle, kept = state.current_score(), 0, kept + 1
                continue
            for name in ruined:
                if name in state.choices:
                    state.remove(name)
            for name, choice in saved.items():
                state.add(name, choice)
        if kept and not small:
            moves += self.local.improve(state, deadline)
        return moves

    def _ruin_set(self, state: SearchState) -> list[str]:
        """The tables one round takes out: of two GPUs (one the busiest), around one of the bottleneck's heaviest
        tables, a few at random, or a few of the largest; in the state's order (seeded choices only)."""
        rng = state.rng
        names = list(state.choices)
        kind = int(rng.integers(4))
        if kind == 0:
            busiest = int(np.argmax(state.gpu_step))
            other = int(rng.integers(state.n_gpus))
            on = {busiest, other}
            picked = [n for n in names if on.intersection(state.choices[n].gpus)]
        elif kind == 1:
            loads = np.stack([state.choices[n].loads for n in names])
            weights = state.cost.bottleneck_loads(state.loads, loads)
            top = names[int(rng.choice(np.argsort(-weights, kind="stable")[:3]))]
            devices = set(state.choices[top].gpus)
            picked = [top] + [n for n in names if n != top and devices.intersection(state.choices[n].gpus)]
        elif kind == 2:
            size = int(rng.integers(2, min(len(names), self.max_ruined) + 1))
            picked = [names[i] for i in sorted(rng.choice(len(names), size, replace=False))]
        else:
            # A few of the largest tables: a plan of another shape (split where it kept whole) is many moves away,
            # each worse alone.
            sizes = np.array([state.shards.size(state.specs[n]) for n in names])
            big = np.argsort(-sizes, kind="stable")[: 2 * self.max_ruined]
            picked = [names[i] for i in sorted(rng.choice(big, min(len(big), self.max_ruined), replace=False))]
        if len(picked) > self.max_ruined:
            keep = sorted(rng.choice(len(picked), self.max_ruined, replace=False))
            picked = [picked[i] for i in keep]
        return picked

    @staticmethod
    def _recreate(state: SearchState, names: list[str]) -> bool:
        """Place ``names`` again, each at its best option (split options too): the largest first, the hottest bytes
        first, or in a random order. False where one finds no room (the tables placed are left in)."""
        specs = state.specs
        order = int(state.rng.integers(3))
        if order == 0:
            names = sorted(names, key=lambda n: -state.shards.size(specs[n]))
        elif order == 1:
            names = sorted(names, key=lambda n: -specs[n].pooling_factor / state.shards.size(specs[n]))
        else:
            names = [names[i] for i in state.rng.permutation(len(names))]
        for name in names:
            choice: Choice | None
            choice, _ = state.best_choice(specs[name], explore=True)
            if choice is None:
                return False
            state.add(name, choice)
        return True
