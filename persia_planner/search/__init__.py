"""The search: which option (sharding type x tier) and which devices each table gets.

A search is four stages over one shared state (:mod:`.state`: the tables placed so far, as summed load and memory
vectors of the cost model, and their score):

* :mod:`.options`, enumeration: the options of a table worth scoring now;
* :mod:`persia_planner.search.device_choice`, the best devices of each option, scored as rows of one matrix
(:mod:`.steps`, :mod:`.shards`);
* :mod:`.construct`, construction: every table placed once, greedily, from a few starts (or :mod:`.warm_start`:
  from a neighbouring cluster's plan);
* :mod:`.improve`, improvement: local moves around the bottleneck while the score drops;
* :mod:`.explain`, explanation: what the largest tables would cost elsewhere, and why a table fits nowhere.

:class:`GreedyLocalSearch` runs them; each stage is a narrow Protocol in :mod:`.base` and can be replaced through its
constructor, or the whole search through :class:`.planner.Planner`'s ``searcher``. :func:`build_placement` turns an
option and its devices into the plan's shards.
"""

from persia_planner.search.base import (
    Alternative,
    Constructor,
    Explainer,
    Improver,
    Option,
    OptionSource,
    SearchConfig,
    Searcher,
    SearchResult,
)
from persia_planner.search.greedy import GreedyLocalSearch
from persia_planner.search.result import build_placement
from persia_planner.search.warm_start import WarmStart

__all__ = [
    "Alternative",
    "Constructor",
    "Explainer",
    "GreedyLocalSearch",
    "Improver",
    "Option",
    "OptionSource",
    "SearchConfig",
    "SearchResult",
    "Searcher",
    "WarmStart",
    "build_placement",
]
