"""Construction from a neighbouring plan: re-planning when the cluster changes by a host or two.

Every table whose placement still stands on the new topology keeps it (its devices are all there and it fits); a
table hashed over every server, replicated on every GPU or in row blocks over every GPU is spread again over the new
ones (unless its constraints name devices: it is then placed afresh); the rest (tables on a
host that left, or that no longer fit) are placed greedily, hottest bytes first, as a construction places them. The
improvement that follows moves load onto the new devices. A re-plan costs a few scorings per table instead of the
constructions' every option of every table.
"""

from __future__ import annotations

from collections.abc import Mapping

from persia_planner.bound import LowerBound, TierChoice
from persia_planner.cost.analytic import CostModel
from persia_planner.kinds import Sharding
from persia_planner.model.specs import TableSpec
from persia_planner.placement.shards import TablePlacement
from persia_planner.search.base import Choice, Option, OptionSource, SearchConfig
from persia_planner.search.construct import Start, placement_order
from persia_planner.search.explain import capacity_error
from persia_planner.search.result import build_placement
from persia_planner.search.shards import ShardTerms
from persia_planner.search.state import State

__all__ = ["WarmStart"]

_COLUMN_SPLITS = frozenset({Sharding.COLUMN_WISE, Sharding.TABLE_COLUMN_WISE})  # an option's splits: its shards
# Over every server or every GPU, whatever they are: spread again over the new ones.
_SPREAD = frozenset({Sharding.PS_HASH, Sharding.DATA_PARALLEL, Sharding.ROW_WISE})


class WarmStart:
    """A :class:`.base.Constructor` that starts from ``previous``, another topology's placements of the same tables.

    Args:
        config: The search's knobs.
        previous: Each table's placement in the neighbouring plan (tables missing from it are placed afresh).
    """

    def __init__(self, config: SearchConfig, previous: Mapping[str, TablePlacement]):
        self.config = config
        self.previous = previous

    def construct(self, cost: CostModel, hint: LowerBound | None, options: OptionSource) -> State:
        """The state of the kept placements, with every other table placed greedily.

        Raises:
            CapacityError: A table found no room (named by the error's ``table``).
        """
        state = State(cost, self.config, options, None, ShardTerms(cost))
        tables = list(cost.model.tables)
        homeless = []
        for i, table in enumerate(tables):
            choice = self._kept(state, table)
            if choice is not None and state.fits(choice.mem)[0]:
                state.add(table.name, choice)
            else:
                homeless.append(i)
        left = set(homeless)
        order = [int(i) for i in placement_order(state, tables, Start()) if i in left]
        for i in order:
            table = tables[i]
            # The option it had, on the best devices now; else its tier's options; else all: each fewer options to
            # score than the next.
            placed = self.previous.get(table.name)
            choice = hint = None
            if placed is not None:
                first = placed.shards[0]
                replica = placed.sharding is Sharding.DATA_PARALLEL
                hint = TierChoice(first.tier, first.cache_fraction or 0.0, replica)
                option = _option_of(placed)
                if option in state.options(table, hint=hint):
                    choice = state.best_choice_of(table, [option])[0]
            if choice is None:
                choice, _ = state.best_choice(table, hint)
            if choice is None:
                raise capacity_error(state, table)
            state.add(table.name, choice)
        return state

    def _kept(self, state: State, table: TableSpec) -> Choice | None:
        """``table``'s previous placement on this topology as a choice, where it still stands; else None."""
        placed = self.previous.get(table.name)
        if placed is None:
            return None
        cost, topology = state.cost, state.cost.topology
        tier = placed.shards[0].tier
        if tier not in self.config.tiers or placed.sharding not in self.config.shardings:
            return None
        fraction = placed.shards[0].cache_fraction or 0.0
        if placed.sharding in _SPREAD:
            hashed = placed.sharding is Sharding.PS_HASH
            every = [d.name for d in (topology.servers if hashed else topology.gpus)]
            option = Option(placed.sharding, tier, fraction)
            gpus: tuple[int, ...] = () if hashed else tuple(range(len(topology.gpus)))
            if [s.device for s in placed.shards] == every:  # the same servers (GPUs): the same shards
                placement = placed
            elif table.constraints.devices is not None or not every:  # new devices it may not allow, or none
                return None
            else:
                placement = build_placement(cost, table, option, gpus)
        else:
            if not all(topology.has_device(s.device) for s in placed.shards):
                return None
            gpus = tuple(topology.gpu_index(s.device) for s in placed.shards)
            option = _option_of(placed)
            placement = placed
        loads, mem = cost.placement_loads(table, placement)
        return Choice(option, gpus, loads, mem, placement=placement)


def _option_of(placed: TablePlacement) -> Option:
    """The option a placement was built from (its sharding, tier, cache fraction, and column splits)."""
    first = placed.shards[0]
    splits = len(placed.shards) if placed.sharding in _COLUMN_SPLITS else 1
    return Option(placed.sharding, first.tier, first.cache_fraction or 0.0, splits)
