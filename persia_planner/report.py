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
from persia_planner.placement import Sharding, TablePlacement, Tier
from persia_planner.report_text import LineTable
from persia_planner.specs import ModelSpec
from persia_planner.topology import NodeKind, Topology
from persia_planner.units import format_bytes, format_rate

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from rich.console import Console
    from rich.table import Table

    from persia_planner.plans import Plan

__all__ = [
    "DeviceRow",
    "Explanation",
    "TableRow",
    "abbreviate",
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
    return " | ".join(parts)


def explanations(plan: Plan, model: ModelSpec, topology: Topology) -> list[Explanation]:
    """For each table in ``plan.alternatives`` (the largest tables): its option and the best other option.

    Options are compared by (sharding, tier); ``plan.alternatives`` holds, per table, the step time of the best
    placement under each option with every other table left where it is, sorted best first.
    """
    dtype = model.embedding_dtype
    sizes = {t.name: t.bytes(dtype) for t in model.tables}
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


def _device_cells(plan: Plan, topology: Topology) -> list[tuple[str, ...]]:
    return [
        (
            row.name,
            row.kind,
            _used(row.hbm_bytes, row.hbm_usable, show_zero=row.kind == "GPU"),
            _percent(row.hbm_fraction),
            _used(row.ddr_bytes, row.ddr_usable, show_zero=row.kind in ("host", "PS")),
            _percent(row.ddr_fraction),
            f"{row.cost_ms:.2f}",
        )
        for row in device_rows(plan, topology)
    ]


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

    table = Table(title=title, title_justify="left")
    for header, justify in columns:
        table.add_column(header, justify=justify, no_wrap=packed)  # type: ignore[arg-type]
    if packed and rows:
        table.add_row(*("\n".join(cells) for cells in zip(*rows, strict=True)))
    else:
        for row in rows:
            table.add_row(*row)
    return table


def render_explanation(plan: Plan, model: ModelSpec, topology: Topology) -> Table:
    """The explanation as a rich table: table, size, chosen option, next best option, its step time and delta."""
    from rich.table import Table

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
            table.add_row(e.table, format_bytes(e.bytes), f"{e.chosen} ({e.mode})", why, "-", "-")
        else:
            table.add_row(
                e.table,
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

    console = console or Console()
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
    console.print(summary(plan), soft_wrap=True, markup=False, highlight=False)


# ---- picture ------------------------------------------------------------------------------------------------------
_KIND_STYLE = {  # label, marker, colour without a plan
    "gpu": ("GPU", "s", "#4c72b0"),
    "host": ("trainer host", "o", "#55a868"),
    "ps": ("parameter server", "D", "#c44e52"),
    "switch": ("switch", "h", "#8172b2"),
}


def draw_topology(topology: Topology, plan: Plan | None = None, ax: Axes | None = None) -> Figure:
    """Draw the cluster: parameter servers on top, the switch, trainer hosts, and each host's GPUs under it.

    Every GPU, host, parameter server and the switch is one node; the node collections are labelled ``"GPU"``,
    ``"trainer host"``, ``"parameter server"`` and ``"switch"``. With a ``plan``, nodes are coloured by the share
    of their usable memory in use (HBM for GPUs, DDR for hosts and servers) and annotated with the tables they hold
    (``name`` in HBM, ``name*`` as an HBM cache, ``name`` under a host in DDR, under a server on the PS).
    NVLink links between GPUs of a host are not drawn.

    Args:
        topology: The cluster.
        plan: Optional plan to overlay.
        ax: Axes to draw into; a new figure is made when omitted (no pyplot state is touched).

    Returns:
        The matplotlib figure.
    """
    import networkx as nx
    from matplotlib.figure import Figure

    graph = topology.graph
    pos, groups = _layout(topology)
    width = max(x for x, _ in pos.values()) - min(x for x, _ in pos.values()) + 1
    if ax is None:
        fig = Figure(figsize=(min(max(8.0, 0.32 * width + 2), 40.0), 6.5 if plan is None else 8.0))
        ax = fig.add_subplot()
    else:
        fig = ax.figure  # type: ignore[assignment]
    dense = width > 24
    size = 90 if dense else 420

    usage = _memory_fraction(topology, plan) if plan is not None else {}
    edges = [
        (u, v)
        for u, v in graph.edges
        if not (graph.nodes[u].get("kind") == NodeKind.GPU and graph.nodes[v].get("kind") == NodeKind.GPU)
    ]
    nx.draw_networkx_edges(graph, pos, edgelist=edges, ax=ax, edge_color="#999999", width=0.8)
    for key, nodes in groups.items():
        if not nodes:
            continue
        label, marker, colour = _KIND_STYLE[key]
        colours: dict[str, Any] = {"node_color": colour}
        if plan is not None and key != "switch":
            colours = {"node_color": [usage.get(n, 0.0) for n in nodes], "cmap": "YlOrRd", "vmin": 0.0, "vmax": 1.0}
        nx.draw_networkx_nodes(
            graph,
            pos,
            nodelist=nodes,
            node_shape=marker,
            **colours,
            node_size=size * (1.6 if key == "switch" else 1.0),
            edgecolors="#333333",
            label=label,
            ax=ax,
        )
    font = 6 if dense else 8
    for node, (x, y) in pos.items():
        short = node.rsplit("/", 1)[-1]
        rotate = dense and y in (0.0, 3.0)
        ax.text(x, y + 0.18, short, ha="center", va="bottom", fontsize=font, rotation=90 if rotate else 0)
    if plan is not None:
        for node, names in _tables_by_node(plan, topology).items():
            if node not in pos or not names:
                continue
            x, y = pos[node]
            style: dict[str, Any] = {"fontsize": font - 1, "color": "#333333"}
            if y == 1.0:  # a host: its DDR tables to its right, clear of the links
                ax.text(x + 0.35, y, "\n".join(names), ha="left", va="center", **style)
            elif y == 0.0:  # a GPU: below it, rotated so neighbours do not collide
                ax.text(x, y - 0.2, ", ".join(names), ha="center", va="top", rotation=90, **style)
            else:  # a parameter server: above its name
                text = ", ".join(names) if dense else "\n".join(names)
                ax.text(
                    x,
                    y + (0.75 if dense else 0.45),
                    text,
                    ha="center",
                    va="bottom",
                    rotation=90 if dense else 0,
                    **style,
                )
        from matplotlib.cm import ScalarMappable
        from matplotlib.colors import Normalize

        mappable = ScalarMappable(norm=Normalize(0.0, 1.0), cmap="YlOrRd")
        bar = fig.colorbar(mappable, ax=ax, fraction=0.025, pad=0.01)
        bar.set_label("memory used / usable\n(HBM for GPUs, DDR for hosts and PS)", fontsize=8)
        ax.set_title(
            f"{topology.name}: plan for {plan.model}, step {plan.step_ms:.2f} ms, "
            f"{len(plan.remote_tables())} of {len(plan.tables)} tables on PS\n"
            "(name* = HBM cache over host DDR, +N repl. = small tables replicated on every GPU)",
            fontsize=10,
        )
    else:
        ax.set_title(
            f"{topology.name}: {len(topology.gpus)} GPUs on {len(topology.trainers)} hosts, "
            f"{len(topology.servers)} parameter servers (NVLink between GPUs not drawn)",
            fontsize=10,
        )
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=4, fontsize=7, markerscale=0.6, frameon=False)
    ax.set_axis_off()
    ys = [y for _, y in pos.values()]
    xs = [x for x, _ in pos.values()]
    below, above = (2.0, 1.0) if plan is not None else (0.5, 0.6)
    if plan is not None and dense:
        below, above = 2.6, 2.8
    ax.set_ylim(min(ys) - below, max(ys) + above)
    ax.set_xlim(min(xs) - 0.8, max(xs) + (2.5 if plan is not None else 0.8))
    return fig


def _layout(topology: Topology) -> tuple[dict[str, tuple[float, float]], dict[str, list[str]]]:
    """Positions: GPUs at y=0 under their host (y=1), the switch at y=2, parameter servers at y=3."""
    graph = topology.graph
    pos: dict[str, tuple[float, float]] = {}
    groups: dict[str, list[str]] = {"gpu": [], "host": [], "ps": [], "switch": []}
    x = 0.0
    gpu_hosts = [*topology.trainers]
    # Hosts the Topology ignores (a trainer without GPUs in the nodes/links form) still get drawn as hosts.
    known = {h.name for h in (*topology.trainers, *topology.servers)}
    loose = [n for n, a in graph.nodes(data=True) if a.get("kind") == NodeKind.HOST and n not in known]
    for host in gpu_hosts:
        n = max(len(host.gpus), 1)
        for i, gpu in enumerate(host.gpus):
            pos[gpu] = (x + i, 0.0)
            groups["gpu"].append(gpu)
        pos[host.name] = (x + (n - 1) / 2, 1.0)
        groups["host"].append(host.name)
        x += n + 0.8
    for name in loose:
        pos[name] = (x, 1.0)
        groups["host"].append(name)
        x += 1.8
    span = max(x - 0.8, 1.0)
    n_ps = len(topology.servers)
    step = max(1.0, (span - 1) / max(n_ps - 1, 1)) if n_ps > 1 else 1.0
    start = (span - 1 - step * (n_ps - 1)) / 2
    for i, server in enumerate(topology.servers):
        pos[server.name] = (start + i * step, 3.0)
        groups["ps"].append(server.name)
    for name, attrs in graph.nodes(data=True):
        if attrs.get("kind") == NodeKind.SWITCH:
            pos[name] = ((span - 1) / 2, 2.0)
            groups["switch"].append(name)
    for name in graph.nodes:  # anything else (should not happen): park it beside the switch
        if name not in pos:
            pos[name] = (span, 2.0)
    return pos, groups


def _memory_fraction(topology: Topology, plan: Plan) -> dict[str, float]:
    rows = device_rows(plan, topology)
    out = {}
    for row in rows:
        fraction = row.hbm_fraction if row.kind == "GPU" else row.ddr_fraction
        out[row.name] = min(fraction or 0.0, 1.0)
    return out


def _tables_by_node(plan: Plan, topology: Topology, limit: int = 3) -> dict[str, list[str]]:
    """Per node, the tables it holds (largest first, ``limit`` names then ``+N``); replicas are counted apart."""
    gpu_host = {g.name: g.host for g in topology.gpus}
    held: dict[str, dict[str, int]] = {}
    replicas: dict[str, int] = {}
    for name, placement in plan.tables.items():
        if placement.sharding is Sharding.DATA_PARALLEL:
            for shard in placement.shards:
                replicas[shard.device] = replicas.get(shard.device, 0) + 1
            continue
        for shard in placement.shards:
            if shard.tier in (Tier.PS, Tier.HBM):
                targets = [(shard.device, name)]
            elif shard.tier is Tier.HBM_CACHE:
                targets = [(shard.device, name + "*"), (gpu_host.get(shard.device, shard.device), name)]
            else:  # ddr: rows in the host's memory
                targets = [(gpu_host.get(shard.device, shard.device), name)]
            for node, label in targets:
                bucket = held.setdefault(node, {})
                bucket[label] = bucket.get(label, 0) + shard.bytes
    out: dict[str, list[str]] = {}
    for node in set(held) | set(replicas):
        ranked = sorted(held.get(node, {}).items(), key=lambda kv: -kv[1])
        names = [n for n, _ in ranked[:limit]]
        if len(ranked) > limit:
            names.append(f"+{len(ranked) - limit}")
        if replicas.get(node):
            names.append(f"+{replicas[node]} repl.")
        out[node] = names
    return out


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
