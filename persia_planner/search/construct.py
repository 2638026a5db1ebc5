"""Construction: every table placed once, greedily, from a few starts; the best plan is kept.

Greedy by *heat density* (lookup bytes per stored byte, hottest first, so the hottest bytes take the fastest
memory), guided by the lower bound's relaxation (a tier per table when that is balanced, and a price per byte of
each memory); each table takes its best option on its best devices given the tables before it. A second pass redoes
it knowing the load the not-yet-placed tables will bring. Where HBM cannot hold every table that gains from it, two
starts place the set it should hold, chosen as a knapsack (:mod:`.packing`), before the others or after them. When
memory is tight and the order fails, packing orders are tried before the model is called infeasible.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from persia_planner.bound import LowerBound, TierChoice
from persia_planner.cost.analytic import CostModel
from persia_planner.errors import CapacityError
from persia_planner.kinds import Sharding
from persia_planner.model.specs import TableSpec
from persia_planner.search.base import Choice, OptionSource, SearchConfig
from persia_planner.search.explain import capacity_error
from persia_planner.search.packing import hbm_knapsack
from persia_planner.search.shards import ShardTerms
from persia_planner.search.state import State
from persia_planner.tiers import Memory, Tier, local_tiers, server_tiers

__all__ = ["GreedyConstruction", "Start", "place_all", "placement_order"]

# Up to this many tables, construction also runs without the lower bound's hint and keeps the better start.
_BOTH_STARTS_MAX_TABLES = 300
# Constructions tried with the tables that failed placed first, before the model is called infeasible.
_SQUEAKY_RETRIES = 8


@dataclass(frozen=True, eq=False)
class Start:
    """How a construction is guided: a tier per table and memory prices (both optional), and its order.

    Attributes:
        preferred: The bound's tier per table, if trusted.
        prices: The bound's memory prices (HBM, trainer DDR, PS DDR per byte), charged while constructing.
        largest_first: Place the largest tables first (packing) instead of the hottest bytes.
        keep_local: Pack for tight servers: the tables the servers' stores would hold least compactly first, each
            kept local where it fits.
        first: Tables placed before all others, in this order (those an earlier start failed on).
        spread: Tables placed in row blocks over every GPU's HBM where that fits (a packing start's largest).
    """

    preferred: Mapping[str, TierChoice] | None = None
    prices: tuple[float, float, float] | None = None
    largest_first: bool = False
    keep_local: bool = False
    first: tuple[str, ...] = ()
    spread: frozenset[str] = frozenset()


class GreedyConstruction:
    """The default :class:`.base.Constructor`: greedy constructions from the bound's guidance and without it.

    Args:
        config: The search's knobs (seed, allowed shardings and tiers).
    """

    def __init__(self, config: SearchConfig):
        self.config = config

    def construct(self, cost: CostModel, hint: LowerBound | None, options: OptionSource) -> State:
        """The best of the first passes (guided by the bound, and on small models plain), then of the second passes
        from it (each table decides again knowing the load every not-yet-placed table will bring).

        Raises:
            CapacityError: No start placed every table (names the table and the resource that is short).
        """
        shards = ShardTerms(cost)

        def attempt(start: Start, previous: State | None = None) -> tuple[State | None, str | None]:
            state = State(cost, self.config, options, start.prices, shards)
            try:
                place_all(state, start, previous)
            except CapacityError as err:
                return None, err.table
            return state, None

        plain = Start()
        guided = plain
        untrusted = None  # the tiers of a hint that is not trusted, as a start of their own
        if hint is not None:
            # A hint whose tiers overload a resource the relaxation's weights ignored still has good prices.
            guided = Start(hint.preferred if hint.trustworthy else None, hint.prices)
            untrusted = None if hint.trustworthy else Start(hint.preferred, hint.prices)
        # On large models only the guided passes run (the plain greedy scores every option of every table and
        # rarely wins there), to keep planning 1,000 tables fast.
        small = len(cost.model.tables) <= _BOTH_STARTS_MAX_TABLES
        starts = list(dict.fromkeys([guided, plain] if hint is None or small else [guided]))
        if small and untrusted is not None:
            # The relaxation's tiers can still be the better start where they overload a resource: the greedy
            # rebalances them (decision 0020).
            starts.append(untrusted)
        if small and {Tier.HBM, Tier.DDR} <= self.config.tiers:
            # Tight HBM: the set it should hold against host memory, chosen as a knapsack (decision 0032).
            starts += _knapsack_starts(cost, State(cost, self.config, options, None, shards), guided.prices)
        firsts = [state for start in starts if (state := attempt(start)[0])]
        if not firsts:
            # Tight memory: the greedy order (hottest bytes first) can fill a tier a big table needed. Before
            # calling the model infeasible, pack: the bound's tiers even when its loads were unbalanced, and
            # largest tables first (first-fit decreasing).
            fallbacks = [Start(largest_first=True), Start(None, guided.prices, largest_first=True)]
            if any(t.spec.local for t in self.config.tiers) and server_tiers()[0] in self.config.tiers:
                fallbacks.append(Start(keep_local=True))
            if untrusted is not None and untrusted not in starts:
                fallbacks.insert(0, untrusted)
            firsts = [state for start in fallbacks if (state := attempt(start)[0])]
            starts = starts + [f for f in fallbacks if f not in starts]
        if not firsts and small:
            # Still nothing: the order failed, not necessarily the memory. Squeaky wheel: every table a construction
            # could not place goes first in the next one (in the order they failed), until one fits or the tables
            # that must go first repeat. Each retry costs one construction and an infeasible model pays them all,
            # hence only on models small enough for constructions to take milliseconds.
            first: tuple[str, ...] = ()
            for _ in range(_SQUEAKY_RETRIES):
                start = Start(None, guided.prices, largest_first=True, first=first)
                state, failed = attempt(start)
                if state is not None:
                    firsts, starts = [state], [*starts, start]
                    break
                if failed is None or failed in first:
                    break
                first = (*first, failed)
        if not firsts:
            # Raises the CapacityError that names what is short.
            place_all(State(cost, self.config, options, plain.prices, shards), plain)
        base = min(firsts, key=State.current_score)
        seconds = [state for start in starts if (state := attempt(start, base)[0])]
        return min([base, *seconds], key=State.current_score)


def _knapsack_starts(cost: CostModel, empty: State, prices: tuple[float, float, float] | None) -> list[Start]:
    """Where HBM cannot hold every table that gains from it, the set it should hold (:mod:`.packing`) placed first,
    largest first; and where the set has tables of more than half a GPU's HBM, those in row blocks over every GPU,
    after the other tables (a host-memory table keeps its optimizer state in its GPUs' HBM: placed after a packed
    set, it finds room only on the GPUs the set left some, whatever their load)."""
    chosen = hbm_knapsack(cost, cost.hbm_of(empty.free))
    if chosen is None:
        return []
    starts = [Start(chosen.preferred, prices, first=chosen.first)]
    if chosen.spread:
        tables, held = cost.model.tables, set(chosen.first)
        order = placement_order(empty, tables, Start())
        others = tuple(tables[i].name for i in order if tables[i].name not in held)
        starts.append(Start(chosen.preferred, prices, first=(*others, *chosen.first), spread=chosen.spread))
    return starts


def place_all(state: State, start: Start, previous: State | None = None) -> None:
    """Place every table in ``state``, hottest bytes first (prices, if any, apply only here).

    With ``previous`` (an earlier construction), every table not yet placed still counts with its load from
    that run: early choices then see how busy each resource will be (the parameter servers are not idle just
    because the colder tables have not been placed yet). ``start`` sets the order: with ``largest_first``, the
    largest tables go first (first-fit decreasing: for memory that is too tight for the hottest-first order); the
    tables named in ``first`` go before all others, in that order. With ``keep_local`` (for servers that are the
    tight memory), the tables whose rows cost the servers' stores the most per byte of the table go first, and each
    takes its best local option where one fits: a store adds a record and index per row, so narrow tables gain the
    most.

    Raises:
        CapacityError: A table found no room (named by the error's ``table``).
    """
    tables = list(state.cost.model.tables)
    hint = start.preferred
    order = placement_order(state, tables, start)
    if previous is not None:
        state.loads = previous.loads.copy()
        state.changed()
    for i in order:
        table = tables[i]
        if previous is not None:
            state.loads = state.loads - previous.choices[table.name].loads
            state.changed()
        choice = None
        if start.keep_local:
            choice = _packed_locally(state, table)
        elif table.name in start.spread:
            choice = _spread(state, table)
        if choice is None:
            choice, _ = state.best_choice(table, hint.get(table.name) if hint else None)
        if choice is None:
            raise capacity_error(state, table)
        state.add(table.name, choice)
    state.pricing = False


def placement_order(state: State, tables: Sequence[TableSpec], start: Start) -> np.ndarray:
    """The order in which ``start`` places the tables (indices into ``tables``)."""
    dtype = state.dtype_of
    density = np.array([t.pooling_factor / t.row_bytes(dtype(t)) / t.rows for t in tables])
    order = np.argsort(-density, kind="stable")
    if start.largest_first:
        order = np.argsort(-np.array([t.bytes(dtype(t)) for t in tables], dtype=float), kind="stable")
    elif start.keep_local:
        tier = server_tiers()[0]  # a keep-local start is tried only where the search may use it
        in_stores = np.array(
            [sum(b.sum() for b in state.server_bytes(t, tier).values()) / t.bytes(dtype(t)) for t in tables]
        )
        order = np.argsort(-in_stores, kind="stable")
    elif start.preferred:
        # The hint already says which tables deserve fast memory; what remains is packing: the big tables that
        # must be split go first, largest first, while every GPU still has room for its even share.
        sizes = np.array([t.bytes(dtype(t)) for t in tables], dtype=float)
        big = sizes > state.min_hbm
        by_size = np.argsort(-sizes, kind="stable")
        order = np.concatenate([by_size[big[by_size]], order[~big[order]]])
    if start.first:
        position = {t.name: i for i, t in enumerate(tables)}
        early = [position[name] for name in start.first]
        order = np.concatenate([early, order[~np.isin(order, early)]]).astype(int)
    return order


def _spread(state: State, table: TableSpec) -> Choice | None:
    """The best choice of ``table`` in row blocks over every GPU's HBM (row-wise; on one host, table-row-wise too)
    among the options the enumeration offers now; None where none fits or none is offered. A table that fits one
    GPU and is not hot is offered whole only (``explore`` would offer it split as well: tried, it took plans further
    from the optimum, decision 0032)."""
    every_gpu = {Sharding.ROW_WISE} | ({Sharding.TABLE_ROW_WISE} if state.n_hosts == 1 else set())
    options = [o for o in state.options(table, hint=TierChoice(Tier.HBM)) if o.sharding in every_gpu]
    return state.best_choice_of(table, options)[0] if options else None


def _packed_locally(state: State, table: TableSpec) -> Choice | None:
    """The best choice of ``table`` in trainer DDR without a cache (the least HBM a local table takes: its row-wise
    state), else on any local tier; None where no local option fits."""
    for tier in local_tiers():
        if tier.spec.rows_in is Memory.HOST and not tier.spec.cached:
            options = [o for o in state.options(table, hint=TierChoice(tier)) if o.tier is tier]
            choice, _ = state.best_choice_of(table, options)
            if choice is not None:
                return choice
    local = [o for o in state.options(table) if o.tier.spec.local]
    return state.best_choice_of(table, local)[0]
