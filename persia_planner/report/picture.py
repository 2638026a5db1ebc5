"""The plan's picture: the cluster drawn with networkx and matplotlib, nodes coloured by the memory a plan uses
and labelled with the tables they hold (``persia plan --png``, :func:`persia_planner.report.draw_topology`).

matplotlib is imported only inside :func:`draw_topology`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from persia_planner.kinds import Sharding
from persia_planner.report.rows import device_rows
from persia_planner.tiers import Holder
from persia_planner.topology.graph import NodeKind, Topology

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from persia_planner.plan.plan import Plan

__all__ = ["draw_topology"]

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

    usage = _memory_fraction(topology, plan) if plan is not None else None
    _draw_graph(ax, graph, (pos, groups), usage, size)
    font = 6 if dense else 8
    for node, (x, y) in pos.items():
        short = node.rsplit("/", 1)[-1]
        rotate = dense and y in (0.0, 3.0)
        ax.text(x, y + 0.18, short, ha="center", va="bottom", fontsize=font, rotation=90 if rotate else 0)
    if plan is not None:
        _label_tables(ax, pos, _tables_by_node(plan, topology), font, dense)
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


def _draw_graph(
    ax: Axes,
    graph: Any,
    layout: tuple[dict[str, tuple[float, float]], dict[str, list[str]]],
    usage: dict[str, float] | None,
    size: float,
) -> None:
    """The links (not NVLink between GPUs) and the nodes, by kind; with ``usage``, coloured by their memory use."""
    import networkx as nx

    pos, groups = layout
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
        if usage is not None and key != "switch":
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


def _label_tables(
    ax: Axes, pos: dict[str, tuple[float, float]], names_by_node: dict[str, list[str]], font: int, dense: bool
) -> None:
    """Each node's tables beside it: a host's DDR tables to its right (clear of the links), a GPU's below it
    (rotated so that neighbours do not collide), a parameter server's above its name."""
    for node, names in names_by_node.items():
        if node not in pos or not names:
            continue
        x, y = pos[node]
        style: dict[str, Any] = {"fontsize": font - 1, "color": "#333333"}
        if y == 1.0:
            ax.text(x + 0.35, y, "\n".join(names), ha="left", va="center", **style)
        elif y == 0.0:
            ax.text(x, y - 0.2, ", ".join(names), ha="center", va="top", rotation=90, **style)
        else:
            text = ", ".join(names) if dense else "\n".join(names)
            ax.text(
                x, y + (0.75 if dense else 0.45), text, ha="center", va="bottom", rotation=90 if dense else 0, **style
            )


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
            spec = shard.tier.spec
            if spec.rows_in.spec.holder is not Holder.HOST:  # on the GPU or the server itself
                targets = [(shard.device, name)]
            elif spec.cached:
                targets = [(shard.device, name + "*"), (gpu_host.get(shard.device, shard.device), name)]
            else:  # rows in the host's memory
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
