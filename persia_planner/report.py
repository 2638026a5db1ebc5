"""Reports for people: per-device and per-table tables, a summary line, explanations, and a topology picture.

Everything here reads a :class:`~persia_planner.plan.Plan` (and its model / topology) and never changes it. The data
functions (:func:`device_rows`, :func:`table_rows`, :func:`summary`, :func:`explanations`, :func:`explain`) return
plain values, so notebooks and tests can use them; the ``render_*`` functions wrap them in rich tables for the CLI.
matplotlib is imported only by :func:`draw_topology`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from persia_planner.cost import CostModel
from persia_planner.errors import printable
from persia_planner.placement import Sharding, TablePlacement, Tier
from persia_planner.report_picture import draw_topology
from persia_planner.report_text import LineTable
from persia_planner.specs import ModelSpec
from persia_planner.topology import Topology
from persia_planner.units import format_bytes, format_rate

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from persia_planner.plans import Plan
    from persia_planner.tuning import Tuning

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

_MAX_LISTED = 6  # names listed before "+N more"


# ---- data ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DeviceRow:
    """One device of a plan with its usage next to what the planner may use (capacity minus reservation).

    Attributes:
        name: Device name (``trainer0/gpu1``, ``trainer0``, ``ps3``).
        kind: ``"GPU"``, ``"host"``, ``"PS"``, or ``"?"`` for a device the topology does not have.
        hbm_bytes / hbm_usable: HBM used and usable (GPUs; ``None`` usable elsewhere).
        ddr_bytes / ddr_usable: DDR used and usable (hosts and parameter servers). For a GPU, ``ddr_bytes`` is the
            host DDR its ``ddr`` / ``hbm_cache`` shards hold and ``ddr_usable`` is ``None`` (the pool is the host's).
        cost_ms: The plan's estimate for the device: a GPU's step time, a host's NIC time, a PS's busiest resource.
    """

    name: str
    kind: str
    hbm_bytes: int
    hbm_usable: int | None
    ddr_bytes: int
    ddr_usable: int | None
    cost_ms: float

    @property
    def hbm_fraction(self) -> float | None:
        return _fraction(self.hbm_bytes, self.hbm_usable)

    @property
    def ddr_fraction(self) -> float | None:
        return _fraction(self.ddr_bytes, self.ddr_usable)


@dataclass(frozen=True)
class TableRow:
    """One table of a plan.

    Attributes:
        name: Table name.
        sharding, tier, mode: Its placement (enum values as strings).
        devices: Devices holding its shards, in shard order, without repeats.
        shards: Number of shards (replicas count one each).
        bytes: Weights + optimizer state over all shards (DDR bytes for ``ddr`` / ``hbm_cache``; replicas add up).
        sync_ms, async_ms: :meth:`CostModel.table_cost` of the placement.
        share: Its ``sync_ms + async_ms`` over the sum across tables (0..1).
    """

    name: str
    sharding: str
    tier: str
    mode: str
    devices: tuple[str, ...]
    shards: int
    bytes: int
    sync_ms: float
    async_ms: float
    share: float


@dataclass(frozen=True)
class Explanation:
    """Why a large table went where it went: the chosen option against the best other option.

    Attributes:
        table: Table name.
        bytes: Table size (weights + optimizer state, one copy).
        chosen: The chosen option, e.g. ``"column_wise x8 on hbm"``.
        mode: ``sync`` or ``async``.
        step_ms: The plan's step time.
        next_best: The best option of another sharding / tier, or ``None`` when nothing else fits.
        next_step_ms: The step time with the table placed by ``next_best`` and every other table unchanged.
        note: Why there is no ``next_best`` (``None`` when there is one).
    """

    table: str
    bytes: int
    chosen: str
    mode: str
    step_ms: float
    next_best: str | None
    next_step_ms: float | None
    note: str | None = None

    @property
    def delta_ms(self) -> float | None:
        return None if self.next_step_ms is None else self.next_step_ms - self.step_ms

    @property
    def delta_pct(self) -> float | None:
        if self.next_step_ms is None or self.step_ms <= 0:
            return None
        return 100.0 * (self.next_step_ms - self.step_ms) / self.step_ms

    def line(self) -> str:
        head = f"{self.table} ({format_bytes(self.bytes)}) -> {self.chosen} ({self.mode})"
        if self.next_best is None or self.next_step_ms is None:
            return f"{head}: {self.note or 'no other option was scored'}"
        return (
            f"{head}: next best is {self.next_best} at {self.next_step_ms:.2f} ms per step "
            f"({self.delta_ms:+.2f} ms / {self.delta_pct:+.1f}% vs {self.step_ms:.2f} ms)"
        )


def device_rows(plan: Plan, topology: Topology) -> list[DeviceRow]:
    """Per-device usage of ``plan`` against the usable capacities of ``topology`` (plan order)."""
    gpus = {g.name: g for g in topology.gpus}
    trainers = {h.name: h for h in topology.trainers}
    servers = {s.name: s for s in topology.servers}
    rows = []
    for name, usage in plan.devices.items():
        if name in gpus:
            kind, hbm_cap, ddr_cap = "GPU", topology.hbm_capacity(gpus[name]), None
        elif name in trainers:
            kind, hbm_cap, ddr_cap = "host", None, topology.ddr_capacity(trainers[name])
        elif name in servers:
            kind, hbm_cap, ddr_cap = "PS", None, topology.ddr_capacity(servers[name])
        else:
            kind, hbm_cap, ddr_cap = "?", None, None
        rows.append(DeviceRow(name, kind, usage.hbm_bytes, hbm_cap, usage.ddr_bytes, ddr_cap, usage.cost_ms))
    return rows


def table_rows(plan: Plan, model: ModelSpec, topology: Topology) -> list[TableRow]:
    """Per-table placement and cost share (model order; tables the model lacks are skipped)."""
    cost = CostModel(model, topology)
    costs = {}
    for table in model.tables:
        placement = plan.tables.get(table.name)
        if placement is not None:
            costs[table.name] = cost.table_cost(cost.placement_loads(table, placement)[0])
    total = sum(c.total_ms for c in costs.values())
    rows = []
    for name, c in costs.items():
        p = plan.tables[name]
        rows.append(
            TableRow(
                name=name,
                sharding=p.sharding.value,
                tier=p.tier.value,
                mode=p.mode.value,
                devices=p.devices,
                shards=len(p.shards),
                bytes=sum(s.bytes for s in p.shards),
                sync_ms=c.sync_ms,
                async_ms=c.async_ms,
                share=c.total_ms / total if total > 0 else 0.0,
            )
        )
    return rows


def bound_line(plan: Plan) -> str:
    """What the plan's lower bound is made of: the weighted step-time functionals and the memory that limits it."""
    parts = " + ".join(f"{w:.2f} x {name}" for name, w in plan.bound_parts.items())
    memory = ", ".join(plan.bound_binding) or "none"
    return printable(f"lower bound {plan.lower_bound_ms:.2f} ms = {parts}; memory whose room limits it: {memory}")


def summary(plan: Plan) -> str:
    """One line: step time, lower bound, quality ratio (and "provably optimal" only where the step meets the bound),
    throughput and the tables sent to parameter servers."""
    remote = plan.remote_tables()
    remote_text = f"{len(remote)} of {len(plan.tables)} tables remote (PS, async): {_names(remote)}" if remote else ""
    parts = [
        f"step {plan.step_ms:.2f} ms",
        f"lower bound {plan.lower_bound_ms:.2f} ms",
        f"quality {plan.quality:.3f}x" + (" (provably optimal under the model)" if plan.proven_optimal else ""),
        f"{plan.samples_per_s:,.0f} samples/s",
        remote_text or "no table remote",
    ]
    return printable(" | ".join(parts))


def explanations(plan: Plan, model: ModelSpec, topology: Topology) -> list[Explanation]:
    """For each table in ``plan.alternatives`` (the largest tables): its option and the best other option.

    Options are compared by (sharding, tier); ``plan.alternatives`` holds, per table, the step time of the best
    placement under each option with every other table left where it is, sorted best first.
    """
    sizes = {t.name: t.bytes(model.dtype_of(t)) for t in model.tables}
    local = sum(topology.hbm_capacity(g) for g in topology.gpus) + sum(
        topology.ddr_capacity(h) for h in topology.trainers
    )
    result = []
    for name, alternatives in plan.alternatives.items():
        placement = plan.tables.get(name)
        if placement is None:
            continue
        key = (placement.sharding, placement.tier)
        chosen = describe(placement)
        other = next((a for a in alternatives if (a.option.sharding, a.option.tier) != key), None)
        size = sizes.get(name, sum(s.bytes for s in placement.shards))
        note = None
        if other is None and placement.tier is Tier.PS and size > local:
            note = (
                f"only the parameter servers can hold it ({format_bytes(size)} is more than all usable GPU HBM and "
                f"host DDR together, {format_bytes(local)})"
            )
        elif other is None:
            note = (
                "no other option was scored (the search skips options that cannot fit next to the other tables "
                "and dominated ones, e.g. slower tiers while HBM has room or splits of a cold table)"
            )
        result.append(
            Explanation(
                table=name,
                bytes=size,
                chosen=chosen,
                mode=placement.mode.value,
                step_ms=plan.step_ms,
                next_best=other.option.describe() if other is not None else None,
                next_step_ms=other.step_ms if other is not None else None,
                note=note,
            )
        )
    return result


def explain(plan: Plan, model: ModelSpec, topology: Topology) -> list[str]:
    """Why each large table went where it went, one line per table (see :func:`explanations`)."""
    return [e.line() for e in explanations(plan, model, topology)]


def abbreviate(devices: Sequence[str], topology: Topology | None = None, limit: int = 3) -> str:
    """``'all 8 GPUs'``, ``'all 30 PS'``, ``'a, b, c'`` or ``'a, b, +6 more (8)'``."""
    devices = list(devices)
    if topology is not None and len(devices) > 1:
        if set(devices) == {g.name for g in topology.gpus}:
            return f"all {len(devices)} GPUs"
        if set(devices) == {s.name for s in topology.servers}:
            return f"all {len(devices)} PS"
    if len(devices) <= limit:
        return ", ".join(devices)
    return f"{', '.join(devices[: limit - 1])}, +{len(devices) - limit + 1} more ({len(devices)})"


def topology_lines(topology: Topology) -> list[str]:
    """What ``persia topology`` prints: hosts, GPUs, PS, memory totals (and what is usable), links, network."""
    s = topology.summary()
    trainers, servers, gpus = topology.trainers, topology.servers, topology.gpus
    hbm_usable = sum(topology.hbm_capacity(g) for g in gpus)
    ddr_usable = sum(topology.ddr_capacity(h) for h in trainers)
    ps_usable = sum(topology.ddr_capacity(p) for p in servers)
    per_host = sorted({len(h.gpus) for h in trainers})
    lines = [
        f"topology {s['name']}: {s['nodes']} nodes, {s['links']} links",
        f"trainer hosts: {len(trainers)} ({_names([h.name for h in trainers], 4)}), "
        f"{'/'.join(map(str, per_host))} GPUs each, NIC {_rates(h.nic_bandwidth for h in trainers)}",
        f"GPUs: {len(gpus)}, HBM {format_bytes(s['hbm_bytes'])} total ({format_bytes(hbm_usable)} usable), "
        f"HBM bandwidth {_rates(g.hbm_bandwidth for g in gpus)}, PCIe {_rates(g.pcie_bandwidth for g in gpus)}",
        f"trainer DDR: {format_bytes(s['trainer_ddr_bytes'])} total ({format_bytes(ddr_usable)} usable)",
    ]
    if servers:
        lines.append(
            f"parameter servers: {len(servers)} ({_names([p.name for p in servers], 4)}), DDR "
            f"{format_bytes(s['ps_ddr_bytes'])} total ({format_bytes(ps_usable)} usable), "
            f"NIC {_rates(p.nic_bandwidth for p in servers)}"
        )
    else:
        lines.append("parameter servers: none")
    switch = "unlimited" if math.isinf(s["switch_bandwidth"]) else format_rate(s["switch_bandwidth"])
    lines.append(f"switch bandwidth: {switch}")
    lines.append(f"latency: {s['latency_s'] * 1e6:.1f} us one-way, host to host")
    return lines


# ---- rich rendering -----------------------------------------------------------------------------------------------
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


# ---- helpers ------------------------------------------------------------------------------------------------------
def _fraction(used: int, usable: int | None) -> float | None:
    if usable is None:
        return None
    return used / usable if usable > 0 else math.inf


def _used(used: int, usable: int | None, *, show_zero: bool) -> str:
    if usable is None:
        return format_bytes(used) if used else "-"
    if not used and not show_zero:
        return "-"
    return f"{format_bytes(used)} / {format_bytes(usable)}"


def _percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.1f}%"


def _names(names: Sequence[str], limit: int = _MAX_LISTED) -> str:
    if len(names) <= limit:
        return ", ".join(names)
    return f"{', '.join(names[: limit - 1])}, +{len(names) - limit + 1} more"


def _rates(values: Any) -> str:
    distinct = sorted(set(values))
    return "/".join(format_rate(v) for v in distinct) if distinct else "-"


def describe(placement: TablePlacement) -> str:
    """A placement in the words of the search's options, e.g. ``'column_wise x4 on hbm_cache(0.2)'``."""
    splits = 1
    if placement.sharding in (Sharding.COLUMN_WISE, Sharding.TABLE_COLUMN_WISE):
        splits = len({s.cols for s in placement.shards})
    tier = placement.tier.value
    if placement.tier is Tier.HBM_CACHE:
        tier = f"{tier}({placement.shards[0].cache_fraction or 0.0:g})"
    return f"{placement.sharding.value}{f' x{splits}' if splits > 1 else ''} on {tier}"
