"""The search's value objects and the Protocols of its stages.

A search is four stages over one shared :class:`.state.State` (the tables placed so far, their loads and memory,
and how a table's option gets its best devices):

* enumeration (:class:`OptionSource`): which options of a table are worth scoring now;
* construction (:class:`Constructor`): a first plan, every table placed once;
* improvement (:class:`Improver`): local moves while the score drops;
* explanation (:class:`Explainer`): what the largest tables would cost elsewhere.

:class:`Searcher` is the whole search, as :class:`.planner.Planner` calls it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from persia_planner.errors import PlannerError
from persia_planner.kinds import Sharding
from persia_planner.placement.shards import TablePlacement
from persia_planner.tiers import Tier

if TYPE_CHECKING:
    from persia_planner.bound import LowerBound, TierChoice
    from persia_planner.cost.analytic import CostModel
    from persia_planner.model.specs import TableSpec
    from persia_planner.search.state import State

__all__ = [
    "Alternative",
    "Choice",
    "Constructor",
    "Explainer",
    "Improver",
    "Option",
    "OptionSource",
    "SearchConfig",
    "SearchResult",
    "Searcher",
]


@dataclass(frozen=True)
class Option:
    """A way to place a table, before devices are chosen."""

    sharding: Sharding
    tier: Tier
    cache_fraction: float = 0.0
    splits: int = 1

    def describe(self) -> str:
        tier = f"{self.tier.value}({self.cache_fraction:g})" if self.tier.spec.cached else self.tier.value
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
    tiers: frozenset[Tier] = field(default_factory=lambda: frozenset(Tier))  # the tiers registered now
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


@dataclass
class Choice:
    """An option on its devices, with the load and memory vectors it adds to the state.

    Attributes:
        option: The option.
        gpus: Shard devices (GPU indices) in shard order; empty for ``ps_hash``.
        loads: Its load vector (the cost model's layout).
        mem: Its memory vector.
        score: The score of the state it was chosen in with it added (saves scoring it again), if known.
        stamp: That state's loads and its step time per GPU with this choice added: the step time after
            :meth:`.state.State.add` while the state is still the same (a scoring computed it already).
    """

    option: Option
    gpus: tuple[int, ...]
    loads: np.ndarray
    mem: np.ndarray
    score: float | None = None
    stamp: tuple[np.ndarray, np.ndarray] | None = None


class Searcher(Protocol):
    """A whole search: assigns every table of the cost model's model an option and devices.

    ``hint`` (optional) is the lower bound, whose relaxation suggests a tier per table and prices for memory.
    """

    def search(self, cost: CostModel, hint: LowerBound | None = None) -> SearchResult: ...


class OptionSource(Protocol):
    """Enumeration: the options of ``table`` worth scoring in ``state`` (pruning those dominated or that cannot fit).

    ``explore`` (local search) asks for split options of every table; ``hint`` for the hinted tier's options only.
    """

    def options(
        self, state: State, table: TableSpec, explore: bool = False, hint: TierChoice | None = None
    ) -> list[Option]: ...


class Constructor(Protocol):
    """Construction: a state with every table of ``cost``'s model placed.

    Raises:
        CapacityError: No construction found room for some table (named by the error).
    """

    def construct(self, cost: CostModel, hint: LowerBound | None, options: OptionSource) -> State: ...


class Improver(Protocol):
    """Improvement: moves in ``state`` while its score drops, until ``deadline`` (``time.perf_counter``); returns
    the accepted moves."""

    def improve(self, state: State, deadline: float) -> int: ...


class Explainer(Protocol):
    """Explanation: for the ``top`` largest tables, what they would cost under their other options."""

    def alternatives(self, state: State, top: int) -> Mapping[str, tuple[Alternative, ...]]: ...
