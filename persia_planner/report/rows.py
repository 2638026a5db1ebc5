"""A plan's facts for people, as plain values: per-device and per-table rows, the summary line, the lower bound's
line, the topology's lines and a placement in words. Notebooks and tests read them; :mod:`.render` draws them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from persia_planner.cost.analytic import CostModel
from persia_planner.errors import printable
from persia_planner.kinds import Sharding
from persia_planner.model.specs import ModelSpec
from persia_planner.placement.shards import TablePlacement
from persia_planner.topology.graph import Topology
from persia_planner.units import format_bytes, format_rate

if TYPE_CHECKING:
    from persia_planner.plan.plan import Plan

__all__ = [
    "DeviceRow",
    "TableRow",
    "abbreviate",
    "bound_line",
    "describe",
    "device_rows",
    "summary",
    "table_rows",
    "topology_lines",
]

_MAX_LISTED = 6  # names listed before "+N more"


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
    cost = CostModel(plan.priced_model(model), topology)
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
    throughput, the tables sent to parameter servers and the collectives' precisions where narrowed."""
    remote = plan.remote_tables()
    remote_text = f"{len(remote)} of {len(plan.tables)} tables remote (PS, async): {_names(remote)}" if remote else ""
    parts = [
        f"step {plan.step_ms:.2f} ms",
        f"lower bound {plan.lower_bound_ms:.2f} ms",
        f"quality {plan.quality:.3f}x" + (" (provably optimal under the model)" if plan.proven_optimal else ""),
        f"{plan.samples_per_s:,.0f} samples/s",
        remote_text or "no table remote",
    ]
    if plan.qcomms is not None and plan.qcomms.quantized:
        parts.append(f"collectives in {plan.qcomms}")
    return printable(" | ".join(parts))


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


def _fraction(used: int, usable: int | None) -> float | None:
    if usable is None:
        return None
    return used / usable if usable > 0 else math.inf


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
    if placement.tier.spec.cached:
        tier = f"{tier}({placement.shards[0].cache_fraction or 0.0:g})"
    return f"{placement.sharding.value}{f' x{splits}' if splits > 1 else ''} on {tier}"
