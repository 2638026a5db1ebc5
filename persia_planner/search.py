"""The search: which option (sharding type x tier) and which devices each table gets.

Construction is greedy by *heat density* (lookup bytes per stored byte, hottest first, so the hottest bytes take
the fastest memory), guided by the lower bound's relaxation (a tier per table when that is balanced, and a price per
byte of each memory); every option of a table is scored on the best devices at once (one matrix per option) and the
best feasible one is kept; a second pass redoes it knowing the load the not-yet-placed tables will bring.
Improvement is local search around the bottleneck: re-insert a table at its best option given everything else, or
swap a hot table into a full faster tier by evicting colder ones, while the score drops. Ties are broken by a seeded
RNG, so a seed fixes the plan, as long as the local search ends before its wall-clock budget (``improve_time_s``):
when the budget cuts it, the plan depends on how far it got on that machine (raise the budget for a reproducible plan).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from persia_planner.bound import LowerBound, TierChoice
from persia_planner.cost import CostModel
from persia_planner.errors import CapacityError, PlannerError
from persia_planner.memory import ps_holds, ps_rows_error
from persia_planner.placement import (
    Shard,
    Sharding,
    TablePlacement,
    Tier,
    even_split,
    row_blocks,
    row_splittable,
    tier_bytes,
)
from persia_planner.search_shards import RangeTerms, ShardTerms
from persia_planner.search_steps import Finish, Pick, Step, Tie, finish_in_order, finish_together, given
from persia_planner.specs import TableSpec
from persia_planner.units import format_bytes

__all__ = ["GreedyLocalSearch", "Option", "SearchConfig", "SearchResult", "Searcher"]

# Data-parallel replicas are only worth it for tiny tables; beyond this share of a GPU's HBM they are not tried.
_DP_MAX_HBM_SHARE = 0.002
# Up to this many tables, construction also runs without the lower bound's hint and keeps the better start.
_BOTH_STARTS_MAX_TABLES = 300
# Weight of the balance term in the search's score (the step time has weight 1).
_BALANCE_WEIGHT = 0.05
# Tables tried per move type in each local-search round; the heaviest few are also tried split.
_IMPROVE_CANDIDATES = 12
_SPLIT_CANDIDATES = 3
# Constructions tried with the tables that failed placed first, before the model is called infeasible.
_SQUEAKY_RETRIES = 8
# Devices scored per shard placement beyond the least-loaded GPU of every host.
_CANDIDATES = 8
# Column-wise splits are tried for tables whose single-GPU work exceeds this share of the current mean GPU load.
_HOT_SHARE = 0.25
_MIN_COLS = 16


@dataclass(frozen=True)
class Option:
    """A way to place a table, before devices are chosen."""

    sharding: Sharding
    tier: Tier
    cache_fraction: float = 0.0
    splits: int = 1

    def describe(self) -> str:
        tier = f"{self.tier.value}({self.cache_fraction:g})" if self.tier is Tier.HBM_CACHE else self.tier.value
        splits = f" x{self.splits}" if self.splits > 1 else ""
        return f"{self.sharding.value}{splits} on {tier}"


@dataclass(frozen=True)
class SearchConfig:
    """Knobs of the search.

    Attributes:
        seed: Seeds tie-breaking; the same seed gives the same plan unless ``improve_time_s`` cuts the search.
        improve_time_s: Wall-clock budget of the local-search phase.
        improve_rounds: At most this many accepted moves.
        shardings: Sharding types the search may use.
        tiers: Tiers the search may use.
        explain_top: How many of the largest tables get a next-best alternative in the explanation.
    """

    seed: int = 0
    improve_time_s: float = 5.0
    improve_rounds: int = 2000
    shardings: frozenset[Sharding] = frozenset(Sharding)
    tiers: frozenset[Tier] = frozenset(Tier)
    explain_top: int = 10

    def __post_init__(self) -> None:
        if self.seed < 0:
            raise PlannerError(f"seed must be >= 0, got {self.seed}", fixes=("pass a non-negative seed",))
        if self.improve_time_s < 0:
            raise PlannerError(f"improve_time_s must be >= 0, got {self.improve_time_s}")


@dataclass(frozen=True)
class Alternative:
    """What a table would cost elsewhere: the step time with it placed by ``option`` and the rest unchanged."""

    option: Option
    step_ms: float


@dataclass(frozen=True)
class SearchResult:
    """The outcome of a search: a placement per table, and for the largest tables, their alternatives."""

    placements: dict[str, TablePlacement]
    options: dict[str, Option]
    alternatives: dict[str, tuple[Alternative, ...]] = field(default_factory=dict)
    construct_s: float = 0.0
    improve_s: float = 0.0
    moves: int = 0


class Searcher(Protocol):
    """A search stage: assigns every table of the cost model's model an option and devices.

    ``hint`` (optional) is the lower bound, whose relaxation suggests a tier per table and prices for memory.
    """

    def search(self, cost: CostModel, hint: LowerBound | None = None) -> SearchResult: ...


@dataclass(frozen=True)
class _FreeRoom:
    hbm_sorted: list[float]  # free HBM per GPU, largest first
    ddr_sum: float
    ddr_max: float


@dataclass
class _Choice:
    option: Option
    gpus: tuple[int, ...]  # shard devices (GPU indices) in shard order; empty for ps
    loads: np.ndarray
    mem: np.ndarray
    # The score of the state it was chosen in with it added (what best() scored it by, saving a second scoring).
    score: float | None = None
    # That state's loads and its step time per GPU with this choice added: the step time after add() where the state
    # is still the same (a scoring computed it already).
    stamp: tuple[np.ndarray, np.ndarray] | None = None


class GreedyLocalSearch:
    """Greedy construction by heat density, then bottleneck-driven local search.

    Args:
        config: Search knobs; defaults are good for up to ~10k tables.
    """

    def __init__(self, config: SearchConfig | None = None):
        self.config = config or SearchConfig()

    # ---- public ---------------------------------------------------------------------------------------------
    def search(self, cost: CostModel, hint: LowerBound | None = None) -> SearchResult:
        """Construct a few greedy plans, keep the best, improve it by local search.

        Starts: guided by the bound (its tier per table, if trustworthy, and its memory prices), and on small models
        also plain. Second passes, from the best first pass: each table decides again knowing the load every
        not-yet-placed table will bring, guided and (on small models) plain.
        """
        started = time.perf_counter()
        self._shards = ShardTerms(cost)
        plain = _Start()
        guided = plain
        if hint is not None:
            # A hint whose tiers overload a resource the relaxation's weights ignored still has good prices.
            guided = _Start(hint.preferred if hint.trustworthy else None, hint.prices)
        # On large models only the guided passes run (the plain greedy scores every option of every table and
        # rarely wins there), to keep 1,000 tables under two seconds.
        both = hint is None or len(cost.model.tables) <= _BOTH_STARTS_MAX_TABLES
        starts = list(dict.fromkeys([guided, plain] if both else [guided]))
        firsts = [run for start in starts if (run := self._attempt(cost, start))]
        if not firsts:
            # Tight memory: the greedy order (hottest bytes first) can fill a tier a big table needed. Before
            # calling the model infeasible, pack: the bound's tiers even when its loads were unbalanced, and
            # largest tables first (first-fit decreasing).
            fallbacks = [_Start(largest_first=True), _Start(None, guided.prices, largest_first=True)]
            if self.config.tiers & {Tier.HBM, Tier.DDR, Tier.HBM_CACHE} and Tier.PS in self.config.tiers:
                fallbacks.append(_Start(keep_local=True))
            if hint is not None and not hint.trustworthy:
                fallbacks.insert(0, _Start(hint.preferred, hint.prices))
            firsts = [run for start in fallbacks if (run := self._attempt(cost, start))]
            starts = starts + [f for f in fallbacks if f not in starts]
        if not firsts and len(cost.model.tables) <= _BOTH_STARTS_MAX_TABLES:
            # Still nothing: the order failed, not necessarily the memory. Squeaky wheel: every table a construction
            # could not place goes first in the next one (in the order they failed), until one fits or the tables
            # that must go first repeat. Each retry costs one construction and an infeasible model pays them all,
            # hence only on models small enough for constructions to take milliseconds.
            first: tuple[str, ...] = ()
            for _ in range(_SQUEAKY_RETRIES):
                start = _Start(None, guided.prices, largest_first=True, first=first)
                run, failed = self._attempt_named(cost, start)
                if run is not None:
                    firsts, starts = [run], [*starts, start]
                    break
                if failed is None or failed in first:
                    break
                first = (*first, failed)
        if not firsts:
            firsts = [self._construct(cost, plain)]  # raises the CapacityError that names what is short
        base = min(firsts, key=_Run.current_score)
        seconds = [run for start in starts if (run := self._attempt(cost, start, previous=base))]
        run = min([base, *seconds], key=_Run.current_score)
        constructed = time.perf_counter()
        moves = run.improve(deadline=constructed + self.config.improve_time_s)
        improved = time.perf_counter()
        alternatives = run.alternatives(self.config.explain_top)
        placements = {t.name: run.placement(t) for t in cost.model.tables}
        options = {name: choice.option for name, choice in run.choices.items()}
        return SearchResult(placements, options, alternatives, constructed - started, improved - constructed, moves)

    def _construct(self, cost: CostModel, start: _Start, previous: _Run | None = None) -> _Run:
        shards = getattr(self, "_shards", None)
        if shards is None or shards.cost is not cost:
            shards = self._shards = ShardTerms(cost)
        run = _Run(cost, self.config, start.prices, shards)
        run.construct(
            start.preferred,
            previous=previous,
            largest_first=start.largest_first,
            first=start.first,
            keep_local=start.keep_local,
        )
        return run

    def _attempt(self, cost: CostModel, start: _Start, previous: _Run | None = None) -> _Run | None:
        return self._attempt_named(cost, start, previous)[0]

    def _attempt_named(
        self, cost: CostModel, start: _Start, previous: _Run | None = None
    ) -> tuple[_Run | None, str | None]:
        """The constructed run, or None and the name of the table that found no room."""
        try:
            return self._construct(cost, start, previous), None
        except CapacityError as err:
            return None, err.table


@dataclass(frozen=True, eq=False)
class _Start:
    """How a construction is guided: a tier per table and memory prices (both optional), and its order."""

    preferred: Mapping[str, TierChoice] | None = None
    prices: tuple[float, float, float] | None = None
    largest_first: bool = False  # place the largest tables first (packing) instead of the hottest bytes
    # Pack for tight servers: the tables the servers' stores would hold least compactly first, each kept local where
    # it fits.
    keep_local: bool = False
    first: tuple[str, ...] = ()  # tables placed before all others, in this order (those an earlier start failed on)


class _Run:
    """Mutable state of one search (kept private: the result is frozen)."""

    def __init__(
        self,
        cost: CostModel,
        config: SearchConfig,
        prices: Sequence[float] | None = None,
        shards: ShardTerms | None = None,
    ):
        self.cost = cost
        self.shards = shards or ShardTerms(cost)
        self.config = config
        self.lay = cost.layout
        self.rng = np.random.default_rng(config.seed)
        self.loads = cost.fixed_loads()
        self.mem = np.zeros(self.lay.mem_size)
        self.cap = cost.capacities()
        self._room = self.cap + 0.5  # validate() allows half a byte over
        self.choices: dict[str, _Choice] = {}
        self.specs = {t.name: t for t in cost.model.tables}
        topo = cost.topology
        self.host_gpus = [np.flatnonzero(cost.gpu_host == h) for h in range(self.lay.n_hosts)]
        self.min_hbm = min(topo.hbm_capacity(g) for g in topo.gpus)
        # Table-row-wise needs the same GPU count on every host (TorchRec's layout); so do we.
        self._uniform_hosts = len({len(g) for g in self.host_gpus}) == 1
        # Hosts x their GPUs, where every host has as many: the least-loaded GPU per host is then one argmin.
        self._host_grid = np.array(self.host_gpus) if self._uniform_hosts and len(self.host_gpus[0]) else None
        self._host_devices = [tuple(int(g) for g in gpus) for gpus in self.host_gpus]
        self._gpu_hosts = cost.gpu_host.tolist()
        self.dtype = cost.dtype
        self._gpu_step: np.ndarray | None = None
        self._candidates: np.ndarray | None = None
        self._free: np.ndarray | None = None
        self._room_stats: _FreeRoom | None = None
        self._mean_step: float | None = None
        G, H = self.lay.n_gpus, self.lay.n_hosts
        self._n_every = G + H
        # Construction charges memory at the relaxation's prices, so a choice that saves a little time but eats
        # scarce memory (a replica on every GPU, HBM for a cold table) pays for the room it takes from others.
        self.mem_price = np.zeros(self.lay.mem_size)
        self.pricing = prices is not None
        if prices is not None:
            self.mem_price[self.lay.hbm] = prices[0]
            self.mem_price[self.lay.ddr] = prices[1]
            self.mem_price[self.lay.ps_mem] = prices[2]

    @property
    def gpu_step(self) -> np.ndarray:
        """Current step time per GPU (cached until the state changes)."""
        if self._gpu_step is None:
            self._gpu_step = self.cost.gpu_step_ms(self.loads[None, :])[0]
        return self._gpu_step

    def candidates(self, exclude: Sequence[int] = ()) -> np.ndarray:
        """GPUs worth scoring for one more shard: the least-loaded GPU of every host plus the least-loaded overall.

        Scoring all GPUs gives the same choice almost always (a shard's own work goes to its GPU, its all-to-all
        pattern depends only on its host), at a fraction of the cost on large clusters.
        """
        if not exclude and self._candidates is not None:
            return self._candidates
        step = self.gpu_step
        if exclude:
            step = step.copy()
            step[list(exclude)] = np.inf
        # By load (ties: the lower index), the first GPU of each host is its least-loaded one (np.argmin per host
        # gives the same); a few dozen GPUs in Python cost less than the numpy calls that would do it.
        order = np.argsort(step, kind="stable").tolist()
        picked = set(order[:_CANDIDATES])
        hosts, seen = self._gpu_hosts, set()
        for g in order:
            if hosts[g] not in seen:
                seen.add(hosts[g])
                picked.add(g)
                if len(seen) == self.lay.n_hosts:
                    break
        picked.difference_update(exclude)  # those with an infinite step
        result = np.array(sorted(picked), dtype=np.intp)
        if not exclude:
            self._candidates = result
        return result

    # ---- scoring --------------------------------------------------------------------------------------------
    def score(self, loads: np.ndarray) -> np.ndarray:
        """Step time plus a balance term: an 8-norm over the GPUs' step times and the hosts' NIC times.

        The max alone is flat wherever two resources tie; the norm still rewards relieving either of them, and
        breaks ties between devices towards the less loaded one.
        """
        return self._scores(loads)[0]

    def _scores(self, loads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`score` of each row of ``loads``, and its step time per GPU."""
        if loads.ndim == 1:
            loads = loads[None, :]
        lay, G = self.lay, self.lay.n_gpus
        every = np.empty((loads.shape[0], self._n_every))
        steps = every[:, :G]
        steps[...] = self.cost.gpu_step_ms(loads)
        np.add(loads[:, lay.nic_sync], loads[:, lay.nic_async], out=every[:, G:])
        step = every.max(axis=1)  # the step time: the slowest GPU or NIC
        scale = np.maximum(step, 1e-12)
        # The 8th power by squaring thrice (numpy's ** 8 calls pow() per element, 10x slower); np.mean's own
        # arithmetic (a sum, then a division by the count) without its per-call overhead.
        power = every / scale[:, None]
        power *= power
        power *= power
        power *= power
        balance = scale * (np.add.reduce(power, axis=1) / self._n_every) ** (1 / 8)
        return step + _BALANCE_WEIGHT * balance, steps

    def _score_of(self, choice: _Choice) -> float:
        """The score of the state with ``choice`` added (as best() scored it; computed here if it did not)."""
        if choice.score is None:
            choice.score = float(self.score(self.loads + choice.loads)[0])
        return choice.score

    def _scores_added(self, loads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`_scores` of the state with each row of ``loads`` added."""
        return self._scores(self.loads + loads)

    def _stamp(self, steps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """What a choice remembers of its scoring: the state's loads it was added to and the resulting GPU steps."""
        return self.loads, steps

    def current_score(self) -> float:
        return float(self.score(self.loads)[0])

    @property
    def free(self) -> np.ndarray:
        """Room left per memory slot (cached until the state changes). Bytes are whole numbers, so ``m <= free`` is
        exactly ``mem + m <= room``."""
        if self._free is None:
            self._free = self._room - self.mem
        return self._free

    def fits(self, mem: np.ndarray) -> np.ndarray:
        if mem.ndim == 1:
            mem = mem[None, :]
        return (mem <= self.free).all(axis=1)

    # ---- options --------------------------------------------------------------------------------------------
    def options(self, table: TableSpec, explore: bool = False, hint: TierChoice | None = None) -> list[Option]:
        """Options worth scoring for ``table`` now (prunes those that are dominated or cannot fit).

        With ``explore`` (local search), split options are scored for every table, not only hot or big ones.
        With ``hint``, only the options of the hinted tier, unpruned: the relaxation chose a slower tier for this
        table to leave the faster memory to others."""
        cfg = self.config
        opts: list[Option] = []
        size = self.shards.size(table)
        free = self._free_room()
        tiers = [t for t in (Tier.HBM, Tier.HBM_CACHE, Tier.DDR) if t in cfg.tiers]
        if hint is not None:
            tiers = [t for t in tiers if t is hint.tier and not hint.replicated]
        fits_one_hbm = size <= free.hbm_sorted[0]
        for tier in tiers:
            # Slower local tiers only matter once the table no longer fits in one GPU's free HBM.
            if tier is not Tier.HBM and fits_one_hbm and Tier.HBM in tiers and hint is None:
                continue
            fractions = self.cost.constants.cache_fractions if tier is Tier.HBM_CACHE else (0.0,)
            if hint is not None and tier is Tier.HBM_CACHE:
                fractions = (hint.cache_fraction,)
            for fraction in fractions:
                opts.extend(self._local_options(table, tier, fraction, free, explore))
        if (
            Sharding.DATA_PARALLEL in cfg.shardings
            and Tier.HBM in cfg.tiers
            and size <= _DP_MAX_HBM_SHARE * (self.min_hbm)
            and (hint is None or hint.replicated)
        ):
            opts.append(Option(Sharding.DATA_PARALLEL, Tier.HBM))
        if (
            Sharding.PS_HASH in cfg.shardings
            and Tier.PS in cfg.tiers
            and self.lay.n_servers
            and self.shards.whole(("ps_holds", table.name), lambda: self._ps_holds(table))
            and (hint is None or hint.tier is Tier.PS)
        ):
            opts.append(Option(Sharding.PS_HASH, Tier.PS))
        return opts

    def _local_options(
        self,
        table: TableSpec,
        tier: Tier,
        fraction: float,
        free: _FreeRoom,
        explore: bool = False,
    ) -> list[Option]:
        shardings = self.config.shardings
        opts: list[Option] = []
        whole = self.shards.range_terms(table, tier, fraction, table.dim)
        hbm_need, ddr_need = whole.hbm, whole.ddr
        # Room for a 1/k piece on k distinct GPUs: the k-th largest free HBM (DDR is per host; checked in best()).
        hbm_sorted = free.hbm_sorted

        def room(k: int) -> bool:
            return k <= len(hbm_sorted) and hbm_need / k <= hbm_sorted[k - 1] and ddr_need <= free.ddr_sum

        one_gpu = room(1) and ddr_need <= free.ddr_max
        if one_gpu and Sharding.TABLE_WISE in shardings:
            opts.append(Option(Sharding.TABLE_WISE, tier, fraction))
        # Split options only for hot tables, tables too big for one GPU, or when table-wise is not allowed.
        if one_gpu and Sharding.TABLE_WISE in shardings and not explore and not self._is_hot(table, tier):
            return opts
        min_host = min(len(g) for g in self.host_gpus)
        # Column-wise in 2 or 4 (its shards are placed one by one); table-column-wise over a whole host (placed at
        # once per host). Finer splits pay an input distribution and a kernel per shard for little balance.
        for splits in sorted({2, 4, min_host}):
            cols = table.dim // splits
            if splits < 2 or table.dim % splits or cols < _MIN_COLS or not room(splits):
                continue
            if Sharding.COLUMN_WISE in shardings and splits <= 4:
                opts.append(Option(Sharding.COLUMN_WISE, tier, fraction, splits))
            # TorchRec lays table-column-wise out like table-row-wise: the same GPU count on every host.
            if Sharding.TABLE_COLUMN_WISE in shardings and splits == min_host and self._uniform_hosts:
                opts.append(Option(Sharding.TABLE_COLUMN_WISE, tier, fraction, splits))
        G = self.lay.n_gpus
        if Sharding.ROW_WISE in shardings and row_splittable(table.rows, G) and hbm_need / G <= hbm_sorted[-1]:
            opts.append(Option(Sharding.ROW_WISE, tier, fraction))
        if (
            Sharding.TABLE_ROW_WISE in shardings
            and self._uniform_hosts
            and row_splittable(table.rows, min_host)
            and room(min_host)
        ):
            opts.append(Option(Sharding.TABLE_ROW_WISE, tier, fraction))
        return opts

    def _is_hot(self, table: TableSpec, tier: Tier) -> bool:
        return self.shards.whole(("work", table.name, tier is Tier.HBM), lambda: self._work_ms(table, tier)) > (
            _HOT_SHARE * max(self.mean_step, 1e-9)
        )

    def _work_ms(self, table: TableSpec, tier: Tier) -> float:
        work = self.cost.moved_bytes(table, self.cost.batch * table.pooling_factor, table.dim)
        bw = self.cost.hbm_bw.min() if tier is Tier.HBM else self.cost.uvm_bw.min()
        return work / bw

    def _free_room(self) -> _FreeRoom:
        """What :meth:`options` asks of the state's free memory and load (cached until the state changes)."""
        if self._room_stats is None:
            lay = self.lay
            free_hbm = self.cap[lay.hbm] - self.mem[lay.hbm]
            free_ddr = self.cap[lay.ddr] - self.mem[lay.ddr]
            self._room_stats = _FreeRoom(
                np.sort(free_hbm)[::-1].tolist(),
                float(free_ddr.sum()),
                float(free_ddr.max()),
            )
        return self._room_stats

    @property
    def mean_step(self) -> float:
        """The mean GPU step time (cached until the state changes)."""
        if self._mean_step is None:
            step = self.gpu_step
            self._mean_step = float(step.sum() / len(step))  # np.mean's arithmetic, without its overhead
        return self._mean_step

    # ---- candidates: every placement of one option, as rows of load / memory matrices ------------------------
    def _shard_mem(
        self, table: TableSpec, option: Option, gpus: np.ndarray, rows: int | np.ndarray, cols: int
    ) -> np.ndarray:
        """Memory vectors (one row per GPU in ``gpus``) of a shard of ``rows`` rows and ``cols`` columns."""
        mem = np.zeros((len(gpus), self.lay.mem_size))
        hbm, ddr = tier_bytes(table, option.tier, rows, cols, self.dtype, option.cache_fraction)
        idx = np.arange(len(gpus))
        mem[idx, self.lay.hbm.start + gpus] = hbm
        mem[idx, self.lay.ddr.start + self.cost.gpu_host[gpus]] += ddr
        return mem

    def best(self, table: TableSpec, option: Option) -> _Choice | None:
        """The best feasible devices for ``option`` given the current state, or None if it cannot fit."""
        step = self._first_step(table, option)
        if step is None:
            return None
        return finish_in_order([step], *self._scores(self.loads + step.loads), self._scores_added, self._pick)[0]

    def _first_step(self, table: TableSpec, option: Option) -> Step | None:
        """The candidates of ``option``'s first placement decision (its load rows, which fit) and how to finish it
        from their scores; None where none fits. The scores of many options' candidates come from one matrix."""
        G = self.lay.n_gpus
        s = option.sharding
        if s in (Sharding.TABLE_WISE, Sharding.COLUMN_WISE):
            return self._first_shard(table, option)
        if s is Sharding.TABLE_COLUMN_WISE:
            # One candidate per host, all scored in one matrix: every host's shards go through the cost model at once.
            if self._host_grid is not None:
                grid = self._host_grid
                by_load = np.argsort(self.gpu_step[grid], axis=1, kind="stable")[:, : option.splits]
                picked = list(np.take_along_axis(grid, by_load, axis=1)) if grid.shape[1] >= option.splits else []
            else:
                picked = [
                    gpus[np.argsort(self.gpu_step[gpus], kind="stable")][: option.splits]
                    for gpus in self.host_gpus
                    if len(gpus) >= option.splits
                ]
            if not picked:
                return None
            found = self.shards.range_terms(table, option.tier, option.cache_fraction, table.dim // option.splits)
            gpus = np.concatenate(picked)
            shape = (len(picked), option.splits, -1)  # every host's shards: sum them per host
            loads = self.shards.range_loads(found, gpus).reshape(shape).sum(axis=1)
            mem = self.shards.range_mem(found, gpus).reshape(shape).sum(axis=1)
            return self._pick_step(option, loads, mem, [tuple(int(g) for g in p) for p in picked])
        loads, mem = self._fixed_vectors(table, option)
        if s is Sharding.TABLE_ROW_WISE:
            # One candidate per host (its vectors depend only on the table).
            return self._pick_step(option, loads, mem, self._host_devices)
        if not self.fits(mem)[0]:
            return None
        gpus = () if s is Sharding.PS_HASH else tuple(range(G))

        def finish(scores: np.ndarray, steps: np.ndarray, pick: Pick) -> Finish:
            return given(_Choice(option, gpus, loads, mem, float(scores[0]), self._stamp(steps[0])))

        return Step(loads[None, :], finish, forced=lambda: _Choice(option, gpus, loads, mem))

    def _pick_step(
        self, option: Option, loads: np.ndarray, mem: np.ndarray, devices: list[tuple[int, ...]]
    ) -> Step | None:
        """One decision among whole candidates (rows of ``loads`` / ``mem``, placed on ``devices``)."""
        ok = self.fits(mem)
        if not ok.any():
            return None

        def finish(scores: np.ndarray, steps: np.ndarray, pick: Pick) -> Finish:
            i = pick(scores, ok)
            return given(_Choice(option, devices[i], loads[i], mem[i], float(scores[i]), self._stamp(steps[i])))

        return Step(loads, finish)

    def _shard_candidates(
        self, found: RangeTerms, chosen: list[int], used_ddr: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """GPUs to score for one more shard of ``found`` (besides those ``chosen``) and which of them fit."""
        gpus = self.candidates(exclude=chosen)
        ok = self._shard_fits(found, gpus, used_ddr)
        if not ok.any():
            # The least-loaded GPUs are full: fall back to every GPU with room.
            gpus = np.setdiff1d(self.shards.all_gpus, chosen)
            ok = self._shard_fits(found, gpus, used_ddr)
            if not ok.any():
                return None
        return gpus, ok

    def _first_shard(self, table: TableSpec, option: Option) -> Step | None:
        """Table-wise and column-wise: the shards go one at a time, each on its best candidate GPU."""
        lay, shards = self.lay, self.shards
        found = shards.range_terms(table, option.tier, option.cache_fraction, table.dim // option.splits)
        first = self._shard_candidates(found, [], np.zeros(lay.n_hosts))
        if first is None:
            return None
        first_gpus, first_ok = first
        first_loads = shards.range_loads(found, first_gpus)

        def finish(scores: np.ndarray, steps: np.ndarray, pick: Pick) -> Finish:
            gpus, ok, cand_l = first_gpus, first_ok, first_loads
            used_ddr = np.zeros(lay.n_hosts)  # the DDR the shards chosen so far take on each host
            chosen: list[int] = []
            loads = mem = None
            while True:
                i = pick(scores, ok)
                g = int(gpus[i])
                chosen.append(g)
                shard_mem = np.zeros(lay.mem_size)  # shards.range_mem of this one GPU
                shard_mem[lay.hbm.start + g] = found.hbm
                shard_mem[lay.ddr.start + self.cost.gpu_host[g]] += found.ddr
                mem = shard_mem if mem is None else shard_mem + mem
                used_ddr[self.cost.gpu_host[g]] += found.ddr
                loads = cand_l[i]
                if len(chosen) == option.splits:
                    return _Choice(option, tuple(chosen), loads, mem, float(scores[i]), self._stamp(steps[i]))
                more = self._shard_candidates(found, chosen, used_ddr)
                if more is None:
                    return None
                gpus, ok = more
                cand_l = shards.range_loads(found, gpus)
                cand_l += loads
                scores, steps = yield cand_l

        return Step(first_loads, finish, option.splits)

    def _shard_fits(self, found: RangeTerms, gpus: np.ndarray, used_ddr: np.ndarray) -> np.ndarray:
        """Whether a shard of ``found`` fits on each GPU in ``gpus`` besides the state and ``used_ddr`` (bytes per
        host): its HBM on the GPU, its DDR on the GPU's host (``fits`` of its memory vector, slot by slot)."""
        lay, free = self.lay, self.free
        ok = found.hbm <= free[lay.hbm.start + gpus]
        if found.ddr or used_ddr.any():  # else its hosts' DDR holds what it holds now, which fits
            hosts = self.cost.gpu_host[gpus]
            ok &= found.ddr + used_ddr[hosts] <= free[lay.ddr.start + hosts]
        return ok

    def _fixed_vectors(self, table: TableSpec, option: Option) -> tuple[np.ndarray, np.ndarray]:
        """(loads, memory) of the placements that depend only on the table: row-wise over every GPU, table-row-wise
        on each host (one row per host), a replica on every GPU, hashed over the servers."""
        return self.shards.whole((table.name, option), lambda: self._compute_fixed(table, option))  # type: ignore[return-value]

    def _compute_fixed(self, table: TableSpec, option: Option) -> tuple[np.ndarray, np.ndarray]:
        lay, s = self.lay, option.sharding
        if s is Sharding.TABLE_ROW_WISE:
            picked = list(self.host_gpus)
            part_l, part_m = self._row_split(table, option, picked, twrw=True)
            ends = np.cumsum([len(gpus) for gpus in picked])
            loads = np.array([part_l[e - len(g) : e].sum(axis=0) for g, e in zip(picked, ends, strict=True)])
            mem = np.array([part_m[e - len(g) : e].sum(axis=0) for g, e in zip(picked, ends, strict=True)])
        elif s is Sharding.ROW_WISE:
            part_l, part_m = self._row_split(table, option, [np.arange(lay.n_gpus)])
            loads, mem = part_l.sum(axis=0), part_m.sum(axis=0)
        elif s is Sharding.DATA_PARALLEL:
            loads = self.cost.replica_loads(table).sum(axis=0)
            mem = np.zeros(lay.mem_size)
            mem[lay.hbm] = float(tier_bytes(table, Tier.HBM, table.rows, table.dim, self.dtype, replica=True)[0])
        else:
            # ps_hash: every server holds one bucket; shares follow the bucket row counts.
            shares = self._ps_rows(table) / table.rows
            loads = self.cost.ps_table_loads(table, shares)
            mem = np.zeros(lay.mem_size)
            mem[lay.ps_mem] = self._ps_mem(table)
        loads.setflags(write=False)  # shared by every choice of this placement
        mem.setflags(write=False)
        return loads, mem

    def _row_split(
        self, table: TableSpec, option: Option, groups: Sequence[np.ndarray], twrw: bool = False
    ) -> tuple[np.ndarray, np.ndarray]:
        """Loads and memory (one row per GPU) of ``table`` split in row blocks over each group of GPUs in turn."""
        rows = np.array([n for gpus in groups for n in row_blocks(table.rows, len(gpus))])
        gpus = np.concatenate(groups)
        loads = self.cost.range_shard_loads(
            table, rows / table.rows, table.dim, option.tier, gpus, cache_fraction=option.cache_fraction, twrw=twrw
        )
        return loads, self._shard_mem(table, option, gpus, rows, table.dim)

    def _ps_rows(self, table: TableSpec) -> np.ndarray:
        """Rows each server holds (one hash bucket each)."""
        return np.array(even_split(table.rows, self.lay.n_servers), dtype=float)

    def _ps_mem(self, table: TableSpec) -> np.ndarray:
        """DDR bytes each server's store takes for the table."""
        return tier_bytes(table, Tier.PS, self._ps_rows(table), table.dim, self.dtype)[1]

    def _ps_holds(self, table: TableSpec) -> bool:
        """Whether no server would hold more of the table's rows than its store can (see memory.PS_MAX_ROWS)."""
        return bool(ps_holds(table.rows, self.lay.n_servers))

    def _pick(self, scores: np.ndarray, ok: np.ndarray, draw: bool = True) -> int:
        """The best-scored candidate that fits; ties (within 1e-12) broken by the seeded RNG. In Python: a few
        dozen candidates cost less than the numpy calls (the same float comparisons)."""
        values = [score if fits else math.inf for score, fits in zip(scores.tolist(), ok.tolist(), strict=True)]
        limit = min(values) * (1 + 1e-12)
        ties = [i for i, value in enumerate(values) if value <= limit]
        if len(ties) == 1:
            return ties[0]
        if not draw:
            raise Tie
        return int(self.rng.choice(np.array(ties)))

    def _pick_untied(self, scores: np.ndarray, ok: np.ndarray) -> int:
        """:meth:`_pick` where there is no tie; :class:`.search_steps.Tie` where it would draw."""
        return self._pick(scores, ok, draw=False)

    # ---- construction and improvement -------------------------------------------------------------------------
    def best_choice(
        self, table: TableSpec, hint: TierChoice | None = None, explore: bool = False
    ) -> tuple[_Choice | None, list[tuple[_Choice, float]]]:
        """The best option for ``table`` now (only the hinted tier's options while one of them fits)."""
        if hint is not None:
            hinted = self.options(table, explore, hint)
            if hinted:
                choice, scored = self.best_choice_of(table, hinted)
                if choice is not None:
                    return choice, scored
        return self.best_choice_of(table, self.options(table, explore))

    def best_choice_of(
        self, table: TableSpec, options: list[Option]
    ) -> tuple[_Choice | None, list[tuple[_Choice, float]]]:
        # Every option's first decision is scored in one matrix (a scoring is a few dozen numpy calls whatever its
        # rows); the options then finish in order, so the seeded tie-breaks come in the same order as one by one.
        steps = [step for option in options if (step := self._first_step(table, option)) is not None]
        if not steps:
            return None, []
        if len(steps) == 1 and steps[0].forced is not None:
            # Nothing to choose: it is scored only if asked (_score_of).
            choice = steps[0].forced()
            return choice, [(choice, math.nan)]
        stacked = steps[0].loads if len(steps) == 1 else np.concatenate([step.loads for step in steps])
        scores, gpu_steps = self._scores(self.loads + stacked)
        choices = None
        if sum(step.decisions > 1 for step in steps) > 1:
            with contextlib.suppress(Tie):
                choices = finish_together(steps, scores, gpu_steps, self._scores_added, self._pick_untied)
        if choices is None:
            choices = finish_in_order(steps, scores, gpu_steps, self._scores_added, self._pick)
        scored = []
        for choice in choices:
            if choice is not None:
                value = choice.score
                assert value is not None
                if self.pricing:
                    value += float(choice.mem @ self.mem_price)
                scored.append((choice, value))
        if not scored:
            return None, []
        scored.sort(key=lambda item: item[1])
        return scored[0][0], scored

    def _changed(self) -> None:
        """Forget what was derived from the state (loads or memory)."""
        self._gpu_step = self._candidates = self._free = self._room_stats = self._mean_step = None

    def add(self, name: str, choice: _Choice) -> None:
        self._changed()
        stamp = choice.stamp
        if stamp is not None and stamp[0] is self.loads:
            self._gpu_step = stamp[1]  # this very sum was scored: the same bits
        self.choices[name] = choice
        self.loads = self.loads + choice.loads
        self.mem = self.mem + choice.mem

    def remove(self, name: str) -> _Choice:
        choice = self.choices.pop(name)
        self._changed()
        self.loads = self.loads - choice.loads
        self.mem = self.mem - choice.mem
        return choice

    def construct(
        self,
        hint: Mapping[str, TierChoice] | None = None,
        previous: _Run | None = None,
        largest_first: bool = False,
        first: Sequence[str] = (),
        keep_local: bool = False,
    ) -> None:
        """Place every table, hottest bytes first (prices, if any, apply only here).

        With ``previous`` (an earlier construction), every table not yet placed still counts with its load from
        that run: early choices then see how busy each resource will be (the parameter servers are not idle just
        because the colder tables have not been placed yet). With ``largest_first``, the largest tables go first
        (first-fit decreasing: for memory that is too tight for the hottest-first order). The tables named in
        ``first`` go before all others, in that order. With ``keep_local`` (for servers that are the tight memory), the
        tables whose rows cost the servers' stores the most per byte of the table go first, and each takes its best
        local option where one fits: a store adds a record and index per row, so narrow tables gain the most.

        Raises:
            CapacityError: A table found no room (named by the error's ``table``).
        """
        tables = list(self.cost.model.tables)
        density = np.array([t.pooling_factor / t.row_bytes(self.dtype) / t.rows for t in tables])
        order = np.argsort(-density, kind="stable")
        if largest_first:
            order = np.argsort(-np.array([t.bytes(self.dtype) for t in tables], dtype=float), kind="stable")
        elif keep_local:
            in_stores = np.array([self._ps_mem(t).sum() / t.bytes(self.dtype) for t in tables])
            order = np.argsort(-in_stores, kind="stable")
        elif hint:
            # The hint already says which tables deserve fast memory; what remains is packing: the big tables that
            # must be split go first, largest first, while every GPU still has room for its even share.
            sizes = np.array([t.bytes(self.dtype) for t in tables], dtype=float)
            big = sizes > self.min_hbm
            by_size = np.argsort(-sizes, kind="stable")
            order = np.concatenate([by_size[big[by_size]], order[~big[order]]])
        if first:
            position = {t.name: i for i, t in enumerate(tables)}
            early = [position[name] for name in first]
            order = np.concatenate([early, order[~np.isin(order, early)]]).astype(int)
        if previous is not None:
            self.loads = previous.loads.copy()
            self._changed()
        for i in order:
            table = tables[i]
            if previous is not None:
                self.loads = self.loads - previous.choices[table.name].loads
                self._changed()
            choice = None
            if keep_local:
                choice = self._packed_locally(table)
            if choice is None:
                choice, _ = self.best_choice(table, hint.get(table.name) if hint else None)
            if choice is None:
                raise self._capacity_error(table)
            self.add(table.name, choice)
        self.pricing = False

    def _packed_locally(self, table: TableSpec) -> _Choice | None:
        """The best choice of ``table`` in trainer DDR (the least HBM a local table takes: its row-wise state), else
        in HBM or the HBM cache; None where no local option fits."""
        options = [o for o in self.options(table, hint=TierChoice(Tier.DDR)) if o.tier is Tier.DDR]
        choice, _ = self.best_choice_of(table, options)
        if choice is None:
            local = [o for o in self.options(table) if o.tier is not Tier.PS]
            choice, _ = self.best_choice_of(table, local)
        return choice

    def improve(self, deadline: float) -> int:
        """Local search from the bottleneck, while the score drops. Returns the accepted moves.

        Moves, for each table loading the bottleneck: re-insert it at its best option (others fixed); or, when the
        faster tier is full, *swap* it in: evict the coldest tables of one GPU (host) that hold enough bytes, place
        it there, and re-insert the evicted tables at their best options.
        """
        tables = {t.name: t for t in self.cost.model.tables}
        moves = 0
        tried: set[tuple[str, str, float]] = set()
        while moves < self.config.improve_rounds and time.perf_counter() < deadline:
            current = float(self.score(self.loads)[0])
            improved = False
            # Re-insertion is tried on the tables with the most load on the bottleneck; swapping in on those with the
            # most load per byte (they relieve it most for the room they take).
            # The few heaviest are also tried split (column/row-wise): splitting a light table cannot relieve much.
            load = self._bottleneck_load()
            heavy = self._bottleneck_tables(load=load)
            candidates = (
                [(n, self._reinsert_split) for n in heavy[:_SPLIT_CANDIDATES]]
                + [(n, self._reinsert) for n in heavy]
                + [(n, self._swap_in) for n in self._bottleneck_tables(per_byte=True, load=load)]
            )
            for name, move in candidates:
                if time.perf_counter() >= deadline:
                    break
                key = (name, move.__name__, round(current, 9))
                if key in tried:
                    continue
                tried.add(key)
                if move(tables, name, current):
                    moves += 1
                    improved = True
                    break
            if not improved:
                break
        return moves

    def _reinsert_split(self, tables: Mapping[str, TableSpec], name: str, current: float) -> bool:
        return self._reinsert(tables, name, current, explore=True)

    def _reinsert(self, tables: Mapping[str, TableSpec], name: str, current: float, explore: bool = False) -> bool:
        old = self.remove(name)
        choice, _ = self.best_choice(tables[name], explore=explore)
        if choice is not None and self._score_of(choice) < current * (1 - 1e-9):
            self.add(name, choice)
            return True
        self.add(name, old)
        return False

    def _swap_in(self, tables: Mapping[str, TableSpec], name: str, current: float) -> bool:
        table = tables[name]
        tier = self.choices[name].option.tier
        target = {Tier.PS: Tier.DDR, Tier.DDR: Tier.HBM, Tier.HBM_CACHE: Tier.HBM}.get(tier)
        if target is None or (target is Tier.DDR and Tier.DDR not in self.config.tiers):
            return False
        evict = self._coldest_room(table, target)
        if tier is Tier.PS and Tier.HBM in self.config.tiers:
            # From the parameter servers, HBM is better still when one GPU can make room.
            in_hbm = self._coldest_room(table, Tier.HBM)
            if in_hbm is not None:
                evict, target = in_hbm, Tier.HBM
        if evict is None:
            return False
        saved = {n: self.remove(n) for n in [name, *evict]}
        options = [o for o in self.options(table) if o.tier is target and o.sharding is not Sharding.DATA_PARALLEL]
        choice, _ = self.best_choice_of(table, options)
        placed: list[str] = []
        if choice is not None:
            self.add(name, choice)
            placed.append(name)
            for other in evict:
                other_choice, _ = self.best_choice(tables[other])
                if other_choice is None:
                    break
                self.add(other, other_choice)
                placed.append(other)
            if len(placed) == len(saved) and float(self.score(self.loads)[0]) < current * (1 - 1e-9):
                return True
        for n in placed:
            self.remove(n)
        for n, old in saved.items():
            self.add(n, old)
        return False

    def _coldest_room(self, table: TableSpec, tier: Tier, max_evict: int = 32) -> list[str] | None:
        """The colder table-wise tables of ``tier`` on one GPU (HBM) or host (DDR) whose bytes, with the free
        room there, fit ``table``: the set with the least traffic per step ([] when there is room already), or None
        when no GPU / host can make room."""
        lay, dtype = self.lay, self.dtype
        size = table.bytes(dtype)
        heat = table.pooling_factor / table.rows
        by_slot: dict[int, list[tuple[float, int, str]]] = {}
        for other, choice in self.choices.items():
            o = choice.option
            if o.sharding is not Sharding.TABLE_WISE or o.tier is not tier:
                continue
            spec = self.specs[other]
            other_heat = spec.pooling_factor / spec.rows
            if other_heat >= heat:
                continue
            g = choice.gpus[0]
            slot = g if tier is Tier.HBM else int(self.cost.gpu_host[g])
            by_slot.setdefault(slot, []).append((other_heat * spec.rows, spec.bytes(dtype), other))
        if tier is Tier.HBM:
            free = self.cap[lay.hbm] - self.mem[lay.hbm]
        else:
            free = self.cap[lay.ddr] - self.mem[lay.ddr]
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
        self,
        limit: int = _IMPROVE_CANDIDATES,
        per_byte: bool = False,
        load: tuple[list[str], np.ndarray] | None = None,
    ) -> list[str]:
        """Tables with the most load (or load per stored byte) on the resource that sets the step time (``load``:
        :meth:`_bottleneck_load` of the state, when known)."""
        names, weights = load if load is not None else self._bottleneck_load()
        if per_byte:
            weights = weights / np.array([self.shards.size(self.specs[n]) for n in names])
        weights = weights + self.rng.random(len(names)) * 1e-15  # seeded tie-break
        top = np.argsort(-weights, kind="stable")[:limit]
        return [names[i] for i in top if weights[i] > 0]

    def _bottleneck_load(self) -> tuple[list[str], np.ndarray]:
        """Every placed table's name and its load on the resource that sets the step time."""
        lay = self.lay
        parts = self.cost.step_parts(self.loads)
        g = int(np.argmax(parts["step"][0]))
        host = self.cost.gpu_host[g]
        nic_total = self.loads[lay.nic_sync] + self.loads[lay.nic_async]
        if nic_total.max(initial=0.0) >= parts["step"][0][g]:
            h = int(np.argmax(nic_total))
            columns = np.r_[lay.nic_sync.start + h, lay.nic_async.start + h]
        elif parts["async"][0][g] >= parts["sync"][0][g]:
            columns = np.r_[lay.ps_nic, lay.ps_ddr, lay.switch, lay.nic_async.start + host, lay.pcie.start + g]
        else:
            columns = np.r_[
                lay.emb.start + g,
                lay.nvlink.start + g,
                lay.nic_sync.start + host,
                lay.host_ddr.start + host,
                lay.dp_bytes,
            ]
        names = list(self.choices)
        unit = np.where(columns == lay.dp_bytes, self.cost.allreduce_ms_per_byte[g], 1.0)
        return names, np.stack([choice.loads for choice in self.choices.values()])[:, columns] @ unit

    def alternatives(self, top: int) -> dict[str, tuple[Alternative, ...]]:
        """For the ``top`` largest tables: the best step time under each other option, others unchanged."""
        tables = sorted(self.cost.model.tables, key=lambda t: -t.bytes(self.dtype))[:top]
        result = {}
        for table in tables:
            old = self.remove(table.name)
            _, scored = self.best_choice(table)
            self.add(table.name, old)
            seen: dict[tuple[Sharding, Tier], Alternative] = {}
            for choice, _ in scored:
                key = (choice.option.sharding, choice.option.tier)
                step = float(self.cost.step_ms(self.loads - old.loads + choice.loads)[0])
                if key not in seen or step < seen[key].step_ms:
                    seen[key] = Alternative(choice.option, step)
            result[table.name] = tuple(sorted(seen.values(), key=lambda a: a.step_ms))
        return result

    def _capacity_error(self, table: TableSpec) -> CapacityError:
        lay, size = self.lay, table.bytes(self.dtype)
        free = {
            "GPU HBM": float((self.cap[lay.hbm] - self.mem[lay.hbm]).sum()),
            "trainer DDR": float((self.cap[lay.ddr] - self.mem[lay.ddr]).sum()),
            "PS DDR": float((self.cap[lay.ps_mem] - self.mem[lay.ps_mem]).sum()),
        }
        if self.lay.n_servers and not self._ps_holds(table):
            return ps_rows_error(table, self.lay.n_servers, max(free["GPU HBM"], free["trainer DDR"]))
        resource = "PS DDR" if self.lay.n_servers else max(free, key=free.get)
        if resource == "PS DDR":
            # The servers' stores keep float32 rows, a record and an index: more than the table's bytes.
            size = int(self._ps_mem(table).sum())
        short = int(size - free[resource])
        if self.lay.n_servers and short <= 0:
            # The servers have room in total, but every server holds an equal share of the rows (one hash bucket
            # each, as the parameter servers route ids): the server with the least room is what is short.
            gap = self._ps_mem(table) - (self.cap[lay.ps_mem] - self.mem[lay.ps_mem])
            worst = int(np.argmax(gap))
            server = self.cost.topology.servers[worst].name
            return CapacityError(
                resource,
                int(max(gap[worst], 0)),
                f"table {table.name!r} ({format_bytes(size)} in the servers' stores) fits nowhere: the "
                f"{self.lay.n_servers} parameter servers hold an equal share of its rows each, and {server} is short "
                f"by {format_bytes(max(gap[worst], 0))} for its share after placing the hotter tables",
                (
                    f"give {server} more DDR (parameter servers of equal DDR hold the most)",
                    "reduce its rows (the stores keep float32 whatever embedding_dtype is)",
                    "lower the reserve fractions under 'constants:' in topology.yaml",
                ),
                table=table.name,
            )
        fixes = (
            "add parameter servers or more DDR per server"
            if self.lay.n_servers
            else "add parameter servers (hosts with role: parameter_server)",
            "reduce its rows" if self.lay.n_servers else "use embedding_dtype: fp16 or fewer rows",
            "lower the reserve fractions under 'constants:' in topology.yaml",
        )
        held = " in the servers' stores" if resource == "PS DDR" else ""
        return CapacityError(
            resource,
            max(short, 0),
            f"table {table.name!r} ({format_bytes(size)}{held}) fits nowhere: {resource} has "
            f"{format_bytes(max(free[resource], 0))} free after placing the hotter tables "
            f"(short by {format_bytes(max(short, 0))})",
            fixes,
            table=table.name,
        )

    # ---- results --------------------------------------------------------------------------------------------
    def placement(self, table: TableSpec) -> TablePlacement:
        choice = self.choices[table.name]
        return build_placement(self.cost, table, choice.option, choice.gpus)


def _bounds(sizes: Sequence[int]) -> list[tuple[int, int]]:
    edges = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    return [(int(a), int(b)) for a, b in itertools.pairwise(edges)]


def build_placement(cost: CostModel, table: TableSpec, option: Option, gpus: Sequence[int]) -> TablePlacement:
    """Turn an option and its devices into shards with row/column ranges and byte counts."""
    topo, dtype = cost.topology, cost.dtype
    names = [topo.gpus[g].name for g in gpus]
    fraction = option.cache_fraction if option.tier is Tier.HBM_CACHE else None
    s = option.sharding

    row_bytes: dict[int, int] = {}  # per column count: a replica on every GPU, equal splits

    def shard(device: str, rows: tuple[int, int], cols: tuple[int, int], replica: bool = False) -> Shard:
        width = cols[1] - cols[0]
        if width not in row_bytes:
            row_bytes[width] = table.row_bytes(dtype, width)
        n_bytes = (rows[1] - rows[0]) * row_bytes[width]
        return Shard(device, option.tier, cols, n_bytes, rows=rows, cache_fraction=fraction, replica=replica)

    full_rows, full_cols = (0, table.rows), (0, table.dim)
    if s is Sharding.PS_HASH:
        n = len(topo.servers)
        rows = even_split(table.rows, n)
        shards = tuple(
            Shard(server.name, Tier.PS, full_cols, rows[i] * table.row_bytes(dtype), hash=(i, n))
            for i, server in enumerate(topo.servers)
        )
        return TablePlacement(s, shards)
    if s is Sharding.DATA_PARALLEL:
        return TablePlacement(s, tuple(shard(d, full_rows, full_cols, replica=True) for d in names))
    if s in (Sharding.COLUMN_WISE, Sharding.TABLE_COLUMN_WISE, Sharding.TABLE_WISE):
        cols = _bounds(even_split(table.dim, len(names)))
        return TablePlacement(s, tuple(shard(d, full_rows, c) for d, c in zip(names, cols, strict=True)))
    rows = _bounds(row_blocks(table.rows, len(names)))
    return TablePlacement(s, tuple(shard(d, r, full_cols) for d, r in zip(names, rows, strict=True)))
