"""Capacity planning (``persia size``): what cluster to buy for a model and a target speed.

A catalog (:mod:`.catalog`) lists the classes of hosts, servers and links with their prices; a shape (:mod:`.shapes`)
is a count of each; the sizer (:mod:`.sizer`) finds the cheapest shape whose best plan reaches the target, pruning
with the planner's lower bound; :mod:`.frontier` reports the cost / throughput frontier it saw.
"""

from persia_planner.sizing.catalog import Catalog, HostClass, LinkClass, catalog_from_dict, load_catalog
from persia_planner.sizing.frontier import draw_frontier, frontier, frontier_rows
from persia_planner.sizing.shapes import Shape, Stream, all_shapes, cheapest_first, streams
from persia_planner.sizing.sizer import (
    Resource,
    Sizing,
    Stage,
    Verdict,
    as_dict,
    dearest_short,
    plan_shape,
    size,
)

__all__ = [
    "Catalog",
    "HostClass",
    "LinkClass",
    "Resource",
    "Shape",
    "Sizing",
    "Stage",
    "Stream",
    "Verdict",
    "all_shapes",
    "as_dict",
    "catalog_from_dict",
    "cheapest_first",
    "dearest_short",
    "draw_frontier",
    "frontier",
    "frontier_rows",
    "load_catalog",
    "plan_shape",
    "size",
    "streams",
]
