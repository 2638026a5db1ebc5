"""Device choice: the best devices for each option of a table, given the state, scored as rows of one matrix.

An option's placement is one or more decisions, each among candidates that are rows of a load matrix: table-wise
and column-wise shards go one at a time, each on its best candidate GPU (the least-loaded GPU of each candidate host
plus the least-loaded few: :meth:`.state.State.candidates`); table-column-wise and table-row-wise compare whole
candidate hosts; row-wise spreads over every GPU, a replica goes on every GPU and ``ps_hash`` puts one hash bucket on
every server, which leaves nothing to decide. Every option's first decision is scored in one matrix and the further
ones together (:mod:`.steps`). A table whose constraints name devices is scored on those only (the host-level
shardings on hosts with enough of them).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from persia_planner.kinds import Sharding
from persia_planner.model.specs import TableSpec
from persia_planner.placement.shards import footprint, row_blocks, tier_bytes
from persia_planner.search.base import Choice, Option
from persia_planner.search.shards import RangeTerms
from persia_planner.search.steps import Finish, Pick, Step, Tie, finish_in_order, finish_together, given

if TYPE_CHECKING:
    from persia_planner.search.base import SearchState

__all__ = ["DeviceChoice"]

# GPUs with room scored when the candidates are full, at most (every GPU on clusters up to this size).
_FALLBACK = 128


class DeviceChoice:
    """Finds the best devices of a table's options in ``state`` (reads the state; never changes it).

    Args:
        state: The search's state.
    """

    def __init__(self, state: SearchState):
        self.state = state
        self.cost = state.cost
        self.shards = state.shards

    def best_choice_of(
        self, table: TableSpec, options: list[Option]
    ) -> tuple[Choice | None, list[tuple[Choice, float]]]:
        """The best choice among ``options`` (by score plus memory at the construction's prices), and every
        option's best choice with that value, best first."""
        state = self.state
        # Every option's first decision is scored in one matrix (a scoring is a few dozen numpy calls whatever its
        # rows); the options then finish in order, so the seeded tie-breaks come in the same order as one by one.
        steps = [step for option in options if (step := self.first_step(table, option)) is not None]
        if not steps:
            return None, []
        if len(steps) == 1 and steps[0].forced is not None:
            # Nothing to choose: it is scored only if asked (State.score_of).
            choice = steps[0].forced()
            return choice, [(choice, math.nan)]
        scores, gpu_steps = state.scores_added_each([step.loads for step in steps])
        choices = None
        if sum(step.decisions > 1 for step in steps) > 1:
            with contextlib.suppress(Tie):
                choices = finish_together(steps, scores, gpu_steps, state.scores_added, state.pick_untied)
        if choices is None:
            choices = finish_in_order(steps, scores, gpu_steps, state.scores_added, state.pick)
        scored = []
        for choice in choices:
            if choice is not None:
                value = choice.score
                assert value is not None
                if state.pricing:
                    value += float(choice.mem @ state.mem_price)
                scored.append((choice, value))
        if not scored:
            return None, []
        scored.sort(key=lambda item: item[1])
        return scored[0][0], scored

    def first_step(self, table: TableSpec, option: Option) -> Step | None:
        """The candidates of ``option``'s first placement decision (its load rows, which fit) and how to finish it
        from their scores; None where none fits."""
        state = self.state
        s = option.sharding
        if s in (Sharding.TABLE_WISE, Sharding.COLUMN_WISE):
            return self._first_shard(table, option)
        allowed = state.allowed_gpus(table)
        if s is Sharding.TABLE_COLUMN_WISE:
            # One candidate per candidate host, all scored in one matrix: every host's shards go through the cost
            # model at once.
            hosts = state.candidate_hosts() if allowed is None else self._allowed_hosts(allowed, option.splits)
            if allowed is not None:
                picked = [
                    gpus[np.argsort(state.gpu_step[gpus], kind="stable")][: option.splits]
                    for gpus in (state.host_gpus[h][allowed[state.host_gpus[h]]] for h in hosts)
                ]
            elif state.host_grid is not None:
                grid = state.host_grid if len(hosts) == state.n_hosts else state.host_grid[hosts]
                by_load = np.argsort(state.gpu_step[grid], axis=1, kind="stable")[:, : option.splits]
                picked = list(np.take_along_axis(grid, by_load, axis=1)) if grid.shape[1] >= option.splits else []
            else:
                picked = [
                    gpus[np.argsort(state.gpu_step[gpus], kind="stable")][: option.splits]
                    for gpus in (state.host_gpus[h] for h in hosts)
                    if len(gpus) >= option.splits
                ]
            if not picked:
                return None
            found = self.shards.range_terms(table, option.tier, option.cache_fraction, table.dim // option.splits)
            gpus = np.concatenate(picked)
            shape = (len(picked), option.splits, -1)  # every host's shards: sum them per host
            loads = self.shards.range_loads(found, gpus, s).reshape(shape).sum(axis=1)
            mem = self.shards.range_mem(found, gpus).reshape(shape).sum(axis=1)
            return self._pick_step(option, loads, mem, [tuple(int(g) for g in p) for p in picked])
        if s is Sharding.TABLE_ROW_WISE:
            # One candidate per candidate host. Every host's vectors depend only on the table: kept while the
            # candidates are every host; beyond, kept they would be hosts x GPUs per table, so built when asked.
            hosts = state.candidate_hosts() if allowed is None else self._allowed_hosts(allowed, None)
            if not hosts:
                return None
            if allowed is None and len(hosts) == state.n_hosts:
                loads, mem = self.fixed_vectors(table, option)
            else:
                loads, mem = self._twrw_vectors(table, option, hosts)
            return self._pick_step(option, loads, mem, [state.host_devices[h] for h in hosts])
        loads, mem = self.fixed_vectors(table, option)
        if not state.fits(mem)[0]:
            return None
        gpus = () if s is Sharding.PS_HASH else tuple(range(state.n_gpus))

        def finish(scores: np.ndarray, steps: np.ndarray, pick: Pick) -> Finish:
            return given(Choice(option, gpus, loads, mem, float(scores[0]), state.stamp(steps[0])))

        return Step(loads[None, :], finish, forced=lambda: Choice(option, gpus, loads, mem))

    def _allowed_hosts(self, allowed: np.ndarray, need: int | None) -> list[int]:
        """Candidate hosts with ``need`` GPUs in the mask ``allowed`` (None: all of theirs), in index order: those of
        :meth:`.state.State.candidate_hosts`, else up to as many others."""
        state = self.state
        enough = [
            h
            for h, gpus in enumerate(state.host_gpus)
            if (allowed[gpus].all() if need is None else int(allowed[gpus].sum()) >= need)
        ]
        eligible = set(enough)
        return [h for h in state.candidate_hosts() if h in eligible] or enough[: len(state.candidate_hosts())]

    def _pick_step(
        self, option: Option, loads: np.ndarray, mem: np.ndarray, devices: list[tuple[int, ...]]
    ) -> Step | None:
        """One decision among whole candidates (rows of ``loads`` / ``mem``, placed on ``devices``)."""
        state = self.state
        ok = state.fits(mem)
        if not ok.any():
            return None

        def finish(scores: np.ndarray, steps: np.ndarray, pick: Pick) -> Finish:
            i = pick(scores, ok)
            # Copies: a row alone would keep every candidate's row alive as long as the choice.
            row_loads, row_mem = loads[i].copy(), mem[i].copy()
            return given(Choice(option, devices[i], row_loads, row_mem, float(scores[i]), state.stamp(steps[i])))

        return Step(loads, finish)

    def _shard_candidates(
        self, found: RangeTerms, chosen: list[int], used_ddr: np.ndarray, allowed: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """GPUs to score for one more shard of ``found`` (besides those ``chosen``, within the mask ``allowed``) and
        which of them fit."""
        gpus = self.state.candidates(exclude=chosen)
        if allowed is not None:
            gpus = gpus[allowed[gpus]]
        ok = self._shard_fits(found, gpus, used_ddr)
        if not ok.any():
            # The least-loaded GPUs are full: fall back to every GPU with room (the least-loaded of them, beyond
            # _FALLBACK: a row per GPU of the cluster is GPUs x GPUs).
            pool = self.shards.all_gpus if allowed is None else np.flatnonzero(allowed)
            gpus = np.setdiff1d(pool, chosen)
            ok = self._shard_fits(found, gpus, used_ddr)
            if not ok.any():
                return None
            if len(gpus) > _FALLBACK:
                room = gpus[ok]
                gpus = np.sort(room[np.argsort(self.state.gpu_step[room], kind="stable")[:_FALLBACK]])
                ok = np.ones(len(gpus), dtype=bool)
        return gpus, ok

    def _first_shard(self, table: TableSpec, option: Option) -> Step | None:
        """Table-wise and column-wise: the shards go one at a time, each on its best candidate GPU."""
        state, shards, cost = self.state, self.shards, self.cost
        gpu_host = cost.gpu_host
        found = shards.range_terms(table, option.tier, option.cache_fraction, table.dim // option.splits)
        allowed = state.allowed_gpus(table)
        first = self._shard_candidates(found, [], np.zeros(state.n_hosts), allowed)
        if first is None:
            return None
        first_gpus, first_ok = first
        first_loads = shards.range_loads(found, first_gpus, option.sharding)

        def finish(scores: np.ndarray, steps: np.ndarray, pick: Pick) -> Finish:
            gpus, ok, cand_l = first_gpus, first_ok, first_loads
            used_ddr = np.zeros(state.n_hosts)  # the DDR the shards chosen so far take on each host
            chosen: list[int] = []
            loads = mem = None
            while True:
                i = pick(scores, ok)
                g = int(gpus[i])
                chosen.append(g)
                shard_mem = cost.memory_vector()  # shards.range_mem of this one GPU, in fewer numpy calls
                cost.hbm_of(shard_mem)[g] = found.hbm
                cost.ddr_of(shard_mem)[gpu_host[g]] += found.ddr
                mem = shard_mem if mem is None else shard_mem + mem
                used_ddr[gpu_host[g]] += found.ddr
                loads = cand_l[i].copy()  # alone: a view would keep every candidate's row alive with the choice
                if len(chosen) == option.splits:
                    return Choice(option, tuple(chosen), loads, mem, float(scores[i]), state.stamp(steps[i]))
                more = self._shard_candidates(found, chosen, used_ddr, allowed)
                if more is None:
                    return None
                gpus, ok = more
                cand_l = shards.range_loads(found, gpus, option.sharding)
                cand_l += loads
                scores, steps = yield cand_l

        return Step(first_loads, finish, option.splits)

    def _shard_fits(self, found: RangeTerms, gpus: np.ndarray, used_ddr: np.ndarray) -> np.ndarray:
        """Whether a shard of ``found`` fits on each GPU in ``gpus`` besides the state and ``used_ddr`` (bytes per
        host): its HBM on the GPU, its DDR on the GPU's host (``fits`` of its memory vector, slot by slot)."""
        cost, free = self.cost, self.state.free
        ok = found.hbm <= cost.hbm_of(free)[gpus]
        if found.ddr or used_ddr.any():  # else its hosts' DDR holds what it holds now, which fits
            hosts = cost.gpu_host[gpus]
            ok &= found.ddr + used_ddr[hosts] <= cost.ddr_of(free)[hosts]
        return ok

    def fixed_vectors(self, table: TableSpec, option: Option) -> tuple[np.ndarray, np.ndarray]:
        """(loads, memory) of the placements that depend only on the table: row-wise over every GPU, table-row-wise
        on each host (one row per host), a replica on every GPU, hashed over the servers."""
        return self.shards.whole((table.name, option), lambda: self._compute_fixed(table, option))  # type: ignore[return-value]

    def _compute_fixed(self, table: TableSpec, option: Option) -> tuple[np.ndarray, np.ndarray]:
        state, cost, s = self.state, self.cost, option.sharding
        if s is Sharding.TABLE_ROW_WISE:
            loads, mem = self._twrw_vectors(table, option, range(state.n_hosts))
        elif s is Sharding.ROW_WISE:
            # Summed without a row per GPU (each as long as the load vector: GPUs x GPUs on a large cluster).
            gpus = np.arange(state.n_gpus)
            rows = np.array(row_blocks(table.rows, len(gpus)))
            terms = cost.range_shard_terms(
                table, rows / table.rows, table.dim, option.tier, gpus, cache_fraction=option.cache_fraction
            )
            loads = cost.range_loads_sum(terms, gpus, Sharding.ROW_WISE)
            hbm, ddr = tier_bytes(table, option.tier, rows, table.dim, state.dtype_of(table), option.cache_fraction)
            mem = cost.shard_memory_sum(gpus, hbm, ddr)
        elif s is Sharding.DATA_PARALLEL:
            loads = cost.replica_loads(table)
            mem = cost.memory_vector(
                footprint(table, option.tier, table.rows, table.dim, state.dtype_of(table), replica=True)
            )
        else:
            # ps_hash: every server holds one bucket; shares follow the bucket row counts.
            tier, fraction = option.tier, option.cache_fraction
            loads = cost.ps_table_loads(table, state.ps_rows(table) / table.rows, tier, fraction)
            mem = cost.memory_vector(state.server_bytes(table, tier, fraction))
        loads.setflags(write=False)  # shared by every choice of this placement
        mem.setflags(write=False)
        return loads, mem

    def _twrw_vectors(self, table: TableSpec, option: Option, hosts: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """(loads, memory) of table-row-wise on each of ``hosts`` (one row each)."""
        picked = [self.state.host_gpus[h] for h in hosts]
        part_l, part_m = self._row_split(table, option, picked)
        ends = np.cumsum([len(gpus) for gpus in picked])
        loads = np.array([part_l[e - len(g) : e].sum(axis=0) for g, e in zip(picked, ends, strict=True)])
        mem = np.array([part_m[e - len(g) : e].sum(axis=0) for g, e in zip(picked, ends, strict=True)])
        return loads, mem

    def _row_split(
        self, table: TableSpec, option: Option, groups: Sequence[np.ndarray]
    ) -> tuple[np.ndarray, np.ndarray]:
        """Loads and memory (one row per GPU) of ``table`` split in row blocks over each group of GPUs in turn."""
        rows = np.array([n for gpus in groups for n in row_blocks(table.rows, len(gpus))])
        gpus = np.concatenate(groups)
        loads = self.cost.range_shard_loads(
            table,
            rows / table.rows,
            table.dim,
            option.tier,
            gpus,
            cache_fraction=option.cache_fraction,
            sharding=option.sharding,
        )
        hbm, ddr = tier_bytes(table, option.tier, rows, table.dim, self.state.dtype_of(table), option.cache_fraction)
        return loads, self.cost.shard_memory(gpus, hbm, ddr)
