"""Reports for people: a plan's rows and summary (:mod:`.rows`), why its largest tables went where they went
(:mod:`.explanations`), rich tables for the terminal (:mod:`.render`) and the cluster's picture (:mod:`.picture`).

Everything here reads a plan (and its model / topology) and never changes it; matplotlib is imported only by
:func:`draw_topology`.
"""

from persia_planner.report.explanations import Explanation, explain, explanations
from persia_planner.report.picture import draw_topology
from persia_planner.report.render import print_plan, render_devices, render_explanation, render_tables
from persia_planner.report.rows import (
    DeviceRow,
    TableRow,
    abbreviate,
    bound_line,
    describe,
    device_rows,
    summary,
    table_rows,
    topology_lines,
)

__all__ = [
    "DeviceRow",
    "Explanation",
    "TableRow",
    "abbreviate",
    "bound_line",
    "describe",
    "device_rows",
    "draw_topology",
    "explain",
    "explanations",
    "print_plan",
    "render_devices",
    "render_explanation",
    "render_tables",
    "summary",
    "table_rows",
    "topology_lines",
]
