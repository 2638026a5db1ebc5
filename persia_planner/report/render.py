"""A plan drawn for the terminal: rich tables of its devices, tables, explanation and tuning, and the whole report
that ``persia plan`` prints (:func:`print_plan`). Plain one-line tables where they fit (:mod:`.line_table`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from persia_planner.errors import printable
from persia_planner.model.specs import ModelSpec
from persia_planner.report.explanations import explanations
from persia_planner.report.line_table import LineTable
from persia_planner.report.rows import abbreviate, bound_line, device_rows, summary, table_rows
from persia_planner.topology.graph import Topology
from persia_planner.units import format_bytes

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from persia_planner.plan.plan import Plan
    from persia_planner.plan.tuning import Tuning

__all__ = ["DEVICE_ROWS", "print_plan", "render_devices", "render_explanation", "render_tables"]


_DEVICE_COLUMNS = (
    ("device", "left"),
    ("kind", "left"),
    ("HBM used / usable", "right"),
    ("HBM %", "right"),
    ("DDR used / usable", "right"),
    ("DDR %", "right"),
    ("est. ms", "right"),
)
_TABLE_COLUMNS = (
    ("table", "left"),
    ("sharding", "left"),
    ("tier", "left"),
    ("mode", "left"),
    ("devices", "left"),
    ("bytes held", "right"),
    ("sync ms", "right"),
    ("async ms", "right"),
    ("cost %", "right"),
)


def render_devices(plan: Plan, topology: Topology, *, packed: bool = False) -> Table:
    """The per-device rich table (``packed``: see :func:`render_tables`)."""
    return _rich_table(f"devices ({plan.topology})", _DEVICE_COLUMNS, _device_cells(plan, topology), packed)


def render_tables(plan: Plan, model: ModelSpec, topology: Topology, *, packed: bool = False) -> Table:
    """The per-table rich table.

    Args:
        plan: The plan.
        model: Its model.
        topology: Its topology.
        packed: Put every row's cells into one rich row, one line each, and never wrap them: the same text when the
            table fits the console's width (rich then lays out one cell per column instead of one per table and
            column, several times faster on large plans), cells cut short with an ellipsis when it does not.
    """
    return _rich_table(f"tables ({plan.model})", _TABLE_COLUMNS, _table_cells(plan, model, topology), packed)


# Device rows printed at most: beyond, the busiest ones and a line for the rest (80,000 rows help no one).
DEVICE_ROWS = 256


def _device_cells(plan: Plan, topology: Topology) -> list[tuple[str, ...]]:
    rows = device_rows(plan, topology)
    busiest = set(sorted(range(len(rows)), key=lambda i: -rows[i].cost_ms)[:DEVICE_ROWS])
    cells = [
        (
            row.name,
            row.kind,
            _used(row.hbm_bytes, row.hbm_usable, show_zero=row.kind == "GPU"),
            _percent(row.hbm_fraction),
            _used(row.ddr_bytes, row.ddr_usable, show_zero=row.kind in ("host", "PS")),
            _percent(row.ddr_fraction),
            f"{row.cost_ms:.2f}",
        )
        for i, row in enumerate(rows)
        if i in busiest
    ]
    if len(rows) > DEVICE_ROWS:
        rest = [row.cost_ms for i, row in enumerate(rows) if i not in busiest]
        cells.append((f"+{len(rest)} more", "", "", "", "", "", f"<= {max(rest):.2f}"))
    return cells


def _table_cells(plan: Plan, model: ModelSpec, topology: Topology) -> list[tuple[str, ...]]:
    return [
        (
            row.name,
            f"{row.sharding} x{row.shards}" if row.shards > 1 else row.sharding,
            row.tier,
            row.mode,
            abbreviate(row.devices, topology),
            format_bytes(row.bytes),
            f"{row.sync_ms:.3f}",
            f"{row.async_ms:.3f}",
            f"{100 * row.share:.1f}",
        )
        for row in table_rows(plan, model, topology)
    ]


def _rich_table(title: str, columns: Sequence[tuple[str, str]], rows: Sequence[tuple[str, ...]], packed: bool) -> Table:
    from rich.table import Table
    from rich.text import Text

    # Cells as Text: shown as they are on any console (a name is never markup) and with what a terminal would act
    # on escaped (names from plan.json or a profile reach here too).
    table = Table(title=Text(printable(title)), title_justify="left")
    for header, justify in columns:
        table.add_column(header, justify=justify, no_wrap=packed)  # type: ignore[arg-type]
    if packed and rows:
        table.add_row(*(Text(printable("\n".join(cells))) for cells in zip(*rows, strict=True)))
    else:
        for row in rows:
            table.add_row(*(Text(printable(cell)) for cell in row))
    return table


def render_explanation(plan: Plan, model: ModelSpec, topology: Topology) -> Table:
    """The explanation as a rich table: table, size, chosen option, next best option, its step time and delta."""
    from rich.table import Table
    from rich.text import Text

    table = Table(
        title=f"why the largest tables went where they did (step {plan.step_ms:.2f} ms)", title_justify="left"
    )
    for header, justify in (
        ("table", "left"),
        ("size", "right"),
        ("chosen", "left"),
        ("next best option", "left"),
        ("its step ms", "right"),
        ("delta", "right"),
    ):
        table.add_column(header, justify=justify)  # type: ignore[arg-type]
    for e in explanations(plan, model, topology):
        if e.next_best is None or e.next_step_ms is None:
            why = "(only the PS can hold it)" if e.note and e.note.startswith("only") else "(no other option scored)"
            table.add_row(Text(printable(e.table)), format_bytes(e.bytes), f"{e.chosen} ({e.mode})", why, "-", "-")
        else:
            table.add_row(
                Text(printable(e.table)),
                format_bytes(e.bytes),
                f"{e.chosen} ({e.mode})",
                e.next_best,
                f"{e.next_step_ms:.2f}",
                f"{e.delta_ms:+.2f} ms / {e.delta_pct:+.1f}%",
            )
    return table


def print_plan(
    plan: Plan, model: ModelSpec, topology: Topology, console: Console | None = None, *, explain: bool = False
) -> None:
    """Print the device table, the table table, the summary line and (with ``explain``) the explanation."""
    from rich.console import Console

    console = console or Console(highlight=False, markup=False)
    devices = (f"devices ({plan.topology})", _DEVICE_COLUMNS, _device_cells(plan, topology))
    tables = (f"tables ({plan.model})", _TABLE_COLUMNS, _table_cells(plan, model, topology))
    for title, columns, rows in (devices, tables):
        # Plain one-line cells that fit: the same lines as rich's table, without its per-cell layout.
        lines = LineTable.of(title, columns, rows)
        if lines is not None and lines.fits(console):
            console.print(lines)
            continue
        table = _rich_table(title, columns, rows, packed=True)
        # Packed, a table reads the same as row by row only where no cell has to wrap.
        unbounded = console.options.update_width(1 << 20)
        if console.measure(table, options=unbounded).maximum > console.width:
            table = _rich_table(title, columns, rows, packed=False)
        console.print(table)
    if explain:
        console.print(render_explanation(plan, model, topology))
        if plan.bound_parts:
            console.print(bound_line(plan), soft_wrap=True, markup=False, highlight=False)
    if plan.tuning is not None:
        console.print(_rich_table(*_tuning_table(plan.tuning), packed=False))
    console.print(summary(plan), soft_wrap=True, markup=False, highlight=False)


def _tuning_table(tuning: Tuning) -> tuple[str, tuple[tuple[str, str], ...], list[tuple[str, ...]]]:
    """``persia plan --tune``'s measurements: a row per candidate, the one kept marked (cells escaped: an error line
    may hold brackets, which rich would read as markup)."""
    from rich.markup import escape

    title = f"tuning ({tuning.steps}-step runs here, the fastest kept)"
    columns = (("candidate", "left"), ("estimate ms", "right"), ("runs", "right"), ("median samples/s", "right"))
    columns += (("", "left"),)
    rows = []
    for c in tuning.candidates:
        estimate = "-" if c.estimate_step_ms is None else f"{c.estimate_step_ms:.2f}"
        measured = f"{c.median_samples_per_s:,.0f}" if c.samples_per_s else (c.error or "not run")
        kept = "kept" if c.name == tuning.chosen else ""
        rows.append((escape(c.name), estimate, str(len(c.samples_per_s)), escape(measured), kept))
    return title, columns, rows


def _used(used: int, usable: int | None, *, show_zero: bool) -> str:
    if usable is None:
        return format_bytes(used) if used else "-"
    if not used and not show_zero:
        return "-"
    return f"{format_bytes(used)} / {format_bytes(usable)}"


def _percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.1f}%"
