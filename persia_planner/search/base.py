"""The search's value objects, the Protocols of its stages, and the state they share.

A search is four stages over one shared state (:class:`SearchState`: the tables placed so far, their loads and
memory, and how a table's option gets its best devices; :class:`.state.State` is the one the planner builds):

* enumeration (:class:`OptionSource`): which options of a table are worth scoring now;
* construction (:class:`Constructor`): a first plan, every table placed once;
* improvement (:class:`Improver`): local moves while the score drops;
* explanation (:class:`Explainer`): what the largest tables would cost elsewhere.

:class:`Searcher` is the whole search, as :class:`.planner.Planner` calls it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from persia_planner.errors import PlannerError
from persia_planner.kinds import Sharding
from persia_planner.placement.shards import TablePlacement
from persia_planner.tiers import Memory, Tier

if TYPE_CHECKING:
    from persia_planner.bound import LowerBound, TierChoice
    from persia_planner.cost.analytic import CostModel
    from persia_planner.model.dtypes import DType
    from persia_planner.model.specs import TableSpec
    from persia_planner.search.shards import ShardTerms

__all__ = [
    "Alternative",
    "Choice",
    "Constructor",
    "Explainer",
    "FreeRoom",
    "Improver",
    "Option",
    "OptionSource",
    "SearchConfig",
    "SearchResult",
    "SearchState",
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
        placement: Its shards, where they were given (a placement kept from another plan): the same object, whose
            vectors the cost model has already computed.
    """

    option: Option
    gpus: tuple[int, ...]
    loads: np.ndarray
    mem: np.ndarray
    score: float | None = None
    stamp: tuple[np.ndarray, np.ndarray] | None = None
    placement: TablePlacement | None = None


@dataclass(frozen=True)
class FreeRoom:
    """What enumeration asks of the free memory.

    Attributes:
        hbm_sorted: Free HBM per GPU, largest first.
        ddr_sum: Free trainer DDR over every host.
        ddr_max: The most free DDR of one host.
    """

    hbm_sorted: list[float]
    ddr_sum: float
    ddr_max: float


class SearchState(Protocol):
    """The state every stage works on: what construction, improvement, explanation, enumeration and the device
    choice read and change. The stages depend on this, never on :class:`.state.State` (the implementation), so that
    a stage is written, and tested, against the interface alone.

    Attributes:
        cost: The cost model every vector and score comes from.
        config: The search's knobs; ``rng`` is seeded by its seed and breaks every tie.
        specs: The model's tables by name; ``choices`` those placed so far, with their choice.
        loads: The summed load vector; ``mem`` the summed memory vector, ``cap`` each slot's capacity, and
            ``mem_price`` memory at the construction's prices (``pricing``: construction charges them).
        shards: The per-search cache of the tables' state-independent vectors.
        dtype_of: A table's weight dtype.
        n_gpus: GPUs; ``n_hosts`` hosts; ``n_servers`` parameter servers.
        host_gpus: Each host's GPUs (indices, ascending); ``host_devices`` the same as tuples; ``host_grid`` as one
            hosts x GPUs array where every host has as many (``uniform_hosts``), else None.
        min_hbm: The smallest GPU's HBM.
    """

    cost: CostModel
    config: SearchConfig
    rng: np.random.Generator
    specs: dict[str, TableSpec]
    choices: dict[str, Choice]
    loads: np.ndarray
    mem: np.ndarray
    cap: np.ndarray
    mem_price: np.ndarray
    pricing: bool
    shards: ShardTerms
    dtype_of: Callable[[TableSpec], DType]
    n_gpus: int
    n_hosts: int
    n_servers: int
    host_gpus: list[np.ndarray]
    host_devices: list[tuple[int, ...]]
    host_grid: np.ndarray | None
    uniform_hosts: bool
    min_hbm: float

    @property
    def gpu_step(self) -> np.ndarray:
        """The step time per GPU now."""
        ...

    @property
    def mean_step(self) -> float:
        """The mean GPU step time."""
        ...

    @property
    def free(self) -> np.ndarray:
        """Room left per memory slot."""
        ...

    def free_room(self, gpus: np.ndarray | None = None) -> FreeRoom:
        """Free HBM and trainer DDR, of every GPU and host or of ``gpus`` and their hosts."""
        ...

    def candidates(self, exclude: Sequence[int] = ()) -> np.ndarray:
        """GPUs worth scoring for one more shard."""
        ...

    def candidate_hosts(self) -> list[int]:
        """Hosts worth scoring for a whole-host placement."""
        ...

    def scores_added(self, loads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The score, and the step per GPU, of the state with each row of ``loads`` added."""
        ...

    def scores_added_each(self, matrices: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`scores_added` of the matrices' rows, stacked."""
        ...

    def score_of(self, choice: Choice) -> float:
        """The score of the state with ``choice`` added."""
        ...

    def current_score(self) -> float:
        """The state's score now."""
        ...

    def stamp(self, steps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """What a choice remembers of its scoring (the loads it was added to, and ``steps``)."""
        ...

    def fits(self, mem: np.ndarray) -> np.ndarray:
        """Whether each row of ``mem`` fits in the room left."""
        ...

    def pick(self, scores: np.ndarray, ok: np.ndarray, draw: bool = True) -> int:
        """The best-scored candidate that fits, ties broken by ``rng`` (or refused: ``draw=False``)."""
        ...

    def pick_untied(self, scores: np.ndarray, ok: np.ndarray) -> int:
        """:meth:`pick` where there is no tie."""
        ...

    def changed(self) -> None:
        """Forget what was derived from the sums (after they were set directly)."""
        ...

    def add(self, name: str, choice: Choice) -> None:
        """Place table ``name`` by ``choice``."""
        ...

    def remove(self, name: str) -> Choice:
        """Take table ``name`` out; its choice."""
        ...

    def options(self, table: TableSpec, explore: bool = False, hint: TierChoice | None = None) -> list[Option]:
        """Enumeration's options of ``table`` in this state."""
        ...

    def best_choice(
        self, table: TableSpec, hint: TierChoice | None = None, explore: bool = False
    ) -> tuple[Choice | None, list[tuple[Choice, float]]]:
        """The best option for ``table`` now, and every option's best choice with its value, best first."""
        ...

    def best_choice_of(
        self, table: TableSpec, options: list[Option]
    ) -> tuple[Choice | None, list[tuple[Choice, float]]]:
        """:meth:`best_choice` among ``options``."""
        ...

    def allowed_gpus(self, table: TableSpec) -> np.ndarray | None:
        """The GPUs ``table``'s constraints allow, as a mask; None where every one."""
        ...

    def every_server(self, table: TableSpec) -> bool:
        """Whether ``table``'s constraints let it go to every parameter server."""
        ...

    def ps_rows(self, table: TableSpec) -> np.ndarray:
        """Rows each server holds of ``table``."""
        ...

    def server_bytes(self, table: TableSpec, tier: Tier, cache_fraction: float = 0.0) -> dict[Memory, np.ndarray]:
        """Bytes each server takes for ``table`` on ``tier``, per server memory."""
        ...

    def servers_hold(self, memory: Memory) -> bool:
        """Whether every parameter server has some of ``memory``."""
        ...

    def ps_holds(self, table: TableSpec) -> bool:
        """Whether no server would hold more of ``table``'s rows than its store can."""
        ...

    def placement(self, name: str) -> TablePlacement:
        """The placed table's shards."""
        ...


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
        self, state: SearchState, table: TableSpec, explore: bool = False, hint: TierChoice | None = None
    ) -> list[Option]: ...


class Constructor(Protocol):
    """Construction: a state with every table of ``cost``'s model placed.

    Raises:
        CapacityError: No construction found room for some table (named by the error).
    """

    def construct(self, cost: CostModel, hint: LowerBound | None, options: OptionSource) -> SearchState: ...


class Improver(Protocol):
    """Improvement: moves in ``state`` while its score drops, until ``deadline`` (``time.perf_counter``); returns
    the accepted moves."""

    def improve(self, state: SearchState, deadline: float) -> int: ...


class Explainer(Protocol):
    """Explanation: for the ``top`` largest tables, what they would cost under their other options."""

    def alternatives(self, state: SearchState, top: int) -> Mapping[str, tuple[Alternative, ...]]: ...
