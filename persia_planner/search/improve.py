"""Improvement: local search from the bottleneck, while the score drops.

Moves, for each table loading the bottleneck: re-insert it at its best option (others fixed); or, when the faster
tier is full, *swap* it in: evict the coldest tables of one GPU (host) that hold enough bytes, place it there, and
re-insert the evicted tables at their best options.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from persia_planner.kinds import Sharding
from persia_planner.model.specs import TableSpec
from persia_planner.tiers import Holder, Tier, local_tiers

if TYPE_CHECKING:
    from persia_planner.search.base import SearchState

__all__ = ["BottleneckLocalSearch"]

# Tables tried per move type in each local-search round; the heaviest few are also tried split.
_IMPROVE_CANDIDATES = 12
_SPLIT_CANDIDATES = 3


class BottleneckLocalSearch:
    """The default :class:`.base.Improver`: re-insertion and swap-in moves on the tables that load the bottleneck.

    Args:
        candidates: Tables tried per move type in each round.
        split_candidates: Of those, how many of the heaviest are also tried split (column- or row-wise).
    """

    def __init__(self, candidates: int = _IMPROVE_CANDIDATES, split_candidates: int = _SPLIT_CANDIDATES):
        self.candidates = candidates
        self.split_candidates = split_candidates

    def improve(self, state: SearchState, deadline: float) -> int:
        """Accept the first move that lowers the score, round after round, until none does, ``deadline``
        (``time.perf_counter``) passes or ``state.config.improve_rounds`` moves were made. Returns the moves."""
        tables = {t.name: t for t in state.cost.model.tables}
        moves = 0
        # Moves that failed since the last full round, skipped until a round finds nothing else: one accepted move
        # changes a table or two, and what failed just before mostly fails again. A round that skipped some and
        # found nothing is run again in full, so the search still ends where no candidate move improves.
        failed: set[tuple[str, str]] = set()
        table_loads = _TableLoads(state)
        while moves < state.config.improve_rounds and time.perf_counter() < deadline:
            current = state.current_score()
            improved = skipped = False
            # Re-insertion is tried on the tables with the most load on the bottleneck; swapping in on those with the
            # most load per byte (they relieve it most for the room they take).
            # The few heaviest are also tried split (column/row-wise): splitting a light table cannot relieve much.
            # Split tries score every split option of a table, several times a plain one's: they come after the
            # plain ones, which find most moves.
            load = table_loads.bottleneck(state)
            heavy = self._bottleneck_tables(state, load)
            candidates = (
                [(n, self._reinsert) for n in heavy]
                + [(n, self._reinsert_split) for n in heavy[: self.split_candidates]]
                + [(n, self._swap_in) for n in self._bottleneck_tables(state, load, per_byte=True)]
            )
            for name, move in candidates:
                if time.perf_counter() >= deadline:
                    break
                key = (name, move.__name__)
                if key in failed:
                    skipped = True
                    continue
                if move(state, tables, name, current):
                    moves += 1
                    improved = True
                    break
                failed.add(key)
            if not improved:
                if not skipped:
                    break
                failed.clear()
        return moves

    def _reinsert_split(self, state: SearchState, tables: Mapping[str, TableSpec], name: str, current: float) -> bool:
        return self._reinsert(state, tables, name, current, explore=True)

    @staticmethod
    def _reinsert(
        state: SearchState, tables: Mapping[str, TableSpec], name: str, current: float, explore: bool = False
    ) -> bool:
        old = state.remove(name)
        choice, _ = state.best_choice(tables[name], explore=explore)
        if choice is not None and state.score_of(choice) < current * (1 - 1e-9):
            state.add(name, choice)
            return True
        state.add(name, old)
        return False

    def _swap_in(self, state: SearchState, tables: Mapping[str, TableSpec], name: str, current: float) -> bool:
        table = tables[name]
        tier = state.choices[name].option.tier
        promote_to = tier.spec.promote_to
        target = Tier(promote_to) if promote_to is not None else None
        if target is None or target not in state.config.tiers:
            return False
        evict = self._coldest_room(state, table, target)
        fastest = local_tiers()[0]
        if not tier.spec.local and fastest in state.config.tiers:
            # From the parameter servers, the fastest local tier (HBM) is better still when one GPU can make room.
            in_fastest = self._coldest_room(state, table, fastest)
            if in_fastest is not None:
                evict, target = in_fastest, fastest
        if evict is None:
            return False
        saved = {n: state.remove(n) for n in [name, *evict]}
        options = [o for o in state.options(table) if o.tier is target and o.sharding is not Sharding.DATA_PARALLEL]
        choice, _ = state.best_choice_of(table, options)
        placed: list[str] = []
        if choice is not None:
            state.add(name, choice)
            placed.append(name)
            for other in evict:
                other_choice, _ = state.best_choice(tables[other])
                if other_choice is None:
                    break
                state.add(other, other_choice)
                placed.append(other)
            if len(placed) == len(saved) and state.current_score() < current * (1 - 1e-9):
                return True
        for n in placed:
            state.remove(n)
        for n, old in saved.items():
            state.add(n, old)
        return False

    @staticmethod
    def _coldest_room(state: SearchState, table: TableSpec, tier: Tier, max_evict: int = 32) -> list[str] | None:
        """The colder table-wise tables of ``tier`` on one GPU (HBM) or host (DDR) whose bytes, with the free
        room there, fit ``table``: the set with the least traffic per step ([] when there is room already), or None
        when no GPU / host can make room."""
        cost = state.cost
        memory = tier.spec.rows_in
        per_gpu = memory.spec.holder is Holder.GPU  # else one slot per host
        size = table.bytes(state.dtype_of(table))
        heat = table.pooling_factor / table.rows
        by_slot: dict[int, list[tuple[float, int, str]]] = {}
        for other, choice in state.choices.items():
            o = choice.option
            if o.sharding is not Sharding.TABLE_WISE or o.tier is not tier:
                continue
            spec = state.specs[other]
            other_heat = spec.pooling_factor / spec.rows
            if other_heat >= heat:
                continue
            g = choice.gpus[0]
            slot = g if per_gpu else int(cost.gpu_host[g])
            by_slot.setdefault(slot, []).append((other_heat * spec.rows, spec.bytes(state.dtype_of(spec)), other))
        free = cost.slots_of(state.cap, memory) - cost.slots_of(state.mem, memory)
        if free.max() >= size:
            return []
        best: tuple[float, list[str]] | None = None
        for slot, items in by_slot.items():
            items.sort()
            room, traffic, chosen = float(free[slot]), 0.0, []
            for lookups, n_bytes, other in items[:max_evict]:
                if room >= size:
                    break
                room += n_bytes
                traffic += lookups
                chosen.append(other)
            if room >= size and (best is None or traffic < best[0]):
                best = (traffic, chosen)
        return best[1] if best else None

    def _bottleneck_tables(
        self, state: SearchState, load: tuple[list[str], np.ndarray, np.ndarray], per_byte: bool = False
    ) -> list[str]:
        """Tables with the most load (or load per stored byte) on the resource that sets the step time (``load``:
        :meth:`_TableLoads.bottleneck` of the state)."""
        names, weights, sizes = load
        if per_byte:
            weights = weights / sizes
        weights = weights + state.rng.random(len(names)) * 1e-15  # seeded tie-break
        top = np.argsort(-weights, kind="stable")[: self.candidates]
        return [names[i] for i in top if weights[i] > 0]


class _TableLoads:
    """Every table's load vector as a row of one matrix, kept across the rounds of one local search: a round copies
    in only the rows of the tables whose choice changed (stacking every vector each round was most of a round on
    10,000 tables)."""

    def __init__(self, state: SearchState):
        self.row = {name: i for i, name in enumerate(state.specs)}
        self.matrix = np.zeros((len(self.row), len(state.loads)))
        self.held: list[object] = [None] * len(self.row)
        self.sizes = np.array([state.shards.size(spec) for spec in state.specs.values()], dtype=float)

    def bottleneck(self, state: SearchState) -> tuple[list[str], np.ndarray, np.ndarray]:
        """Every placed table's name (in the state's order), its load on the resource that sets the step time and
        its stored bytes."""
        names = list(state.choices)
        rows = [self.row[name] for name in names]
        for name, i in zip(names, rows, strict=True):
            choice = state.choices[name]
            if self.held[i] is not choice:
                self.matrix[i] = choice.loads
                self.held[i] = choice
        return names, state.cost.bottleneck_loads(state.loads, self.matrix)[rows], self.sizes[rows]
