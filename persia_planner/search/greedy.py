"""The default search: greedy construction by heat density, then bottleneck-driven local search, then explanation.

Ties are broken by a seeded RNG, so a seed fixes the plan, as long as the local search ends before its wall-clock
budget (``improve_time_s``): when the budget cuts it, the plan depends on how far it got on that machine (raise the
budget for a reproducible plan).
"""

from __future__ import annotations

import time

from persia_planner.bound import LowerBound
from persia_planner.cost.analytic import CostModel
from persia_planner.search.base import Constructor, Explainer, Improver, OptionSource, SearchConfig, SearchResult
from persia_planner.search.construct import GreedyConstruction
from persia_planner.search.explain import NextBestAlternatives
from persia_planner.search.options import TieredOptions
from persia_planner.search.ruin import RuinAndRecreate

__all__ = ["GreedyLocalSearch"]


class GreedyLocalSearch:
    """A :class:`.base.Searcher` made of the four stages; each can be replaced.

    Args:
        config: Search knobs; defaults are good for up to ~10k tables.
        options: Enumeration (default: :class:`.options.TieredOptions`).
        constructor: Construction (default: :class:`.construct.GreedyConstruction` of ``config``).
        improver: Improvement (default: :class:`.ruin.RuinAndRecreate` around :class:`.improve.BottleneckLocalSearch`).
        explainer: Explanation (default: :class:`.explain.NextBestAlternatives`).
    """

    def __init__(
        self,
        config: SearchConfig | None = None,
        *,
        options: OptionSource | None = None,
        constructor: Constructor | None = None,
        improver: Improver | None = None,
        explainer: Explainer | None = None,
    ):
        self.config = config or SearchConfig()
        self.options = options or TieredOptions()
        self.constructor = constructor or GreedyConstruction(self.config)
        self.improver = improver or RuinAndRecreate()
        self.explainer = explainer or NextBestAlternatives()

    def search(self, cost: CostModel, hint: LowerBound | None = None) -> SearchResult:
        """Construct, improve within ``config.improve_time_s``, explain the ``config.explain_top`` largest tables."""
        started = time.perf_counter()
        state = self.constructor.construct(cost, hint, self.options)
        constructed = time.perf_counter()
        moves = self.improver.improve(state, deadline=constructed + self.config.improve_time_s)
        improved = time.perf_counter()
        alternatives = dict(self.explainer.alternatives(state, self.config.explain_top))
        placements = {t.name: state.placement(t.name) for t in cost.model.tables}
        options = {name: choice.option for name, choice in state.choices.items()}
        return SearchResult(placements, options, alternatives, constructed - started, improved - constructed, moves)
