"""The plan: value object, plan.json (formats.md, ``persia-plan/1``) and ``validate``."""

from __future__ import annotations

import itertools
import json
import os
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from persia_planner.cost import CostModel, Estimate
from persia_planner.errors import ErrorKind, PlannerError, SpecError, abbreviate
from persia_planner.fields import Fields, load_json
from persia_planner.limits import MAX_OF_KIND, MAX_SHARDS_PER_TABLE
from persia_planner.memory import PS_MAX_ROWS, ps_servers_needed
from persia_planner.placement import Mode, Shard, Sharding, TablePlacement, Tier
from persia_planner.specs import ModelSpec
from persia_planner.topology import Topology
from persia_planner.units import Quantity, format_bytes

__all__ = [
    "FORMAT",
    "DeviceUsage",
    "Plan",
    "load_plan",
    "require_same_tables",
    "require_valid",
    "table_mismatch",
    "usage_of",
    "validate",
]

FORMAT = "persia-plan/1"
MAX_TABLE_PROBLEMS = 5
"""Problems :func:`validate` lists for one table: a plan of 200,000 bad shards is answered in a few lines."""
MAX_PROBLEMS = 50
"""Problems :func:`validate` lists in all, before it stops looking."""


@dataclass(frozen=True)
class DeviceUsage:
    """What a plan puts on one device (GPU, trainer host or parameter server)."""

    hbm_bytes: int
    ddr_bytes: int
    cost_ms: float


@dataclass(frozen=True)
class Plan:
    """A placement of every table, with its estimate.

    Attributes:
        model: Model name.
        topology: Topology name.
        tables: Placement per table name, in model order.
        devices: Usage per device name.
        step_ms: Estimated step time under the cost model.
        lower_bound_ms: A bound no plan can beat under the same cost model (see ``bound.py``), as computed.
        samples_per_s: Global batch / step time.
        alternatives: For the largest tables, the step time under other options (explanations; not in JSON).
    """

    model: str
    topology: str
    tables: Mapping[str, TablePlacement]
    devices: Mapping[str, DeviceUsage]
    step_ms: float
    lower_bound_ms: float
    samples_per_s: float
    alternatives: Mapping[str, Any] = field(default_factory=dict, compare=False)

    @property
    def quality(self) -> float:
        """Estimated step time / lower bound: at least 1, as no plan beats the bound (see :attr:`proven_optimal`)."""
        return self.step_ms / self.lower_bound_ms if self.lower_bound_ms > 0 else float("inf")

    @property
    def proven_optimal(self) -> bool:
        """Whether the step time meets the lower bound (to 1e-9): no plan of the search's options is faster under the
        cost model (see ``bound.py``)."""
        return self.lower_bound_ms > 0 and self.step_ms <= self.lower_bound_ms * (1 + 1e-9)

    def remote_tables(self) -> list[str]:
        """Names of the tables sent to the parameter servers."""
        return [name for name, p in self.tables.items() if p.mode is Mode.ASYNC]

    # ---- JSON -----------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "model": self.model,
            "topology": self.topology,
            "tables": {name: _placement_to_dict(p) for name, p in self.tables.items()},
            "devices": {
                name: {"hbm_bytes": u.hbm_bytes, "ddr_bytes": u.ddr_bytes, "cost_ms": round(u.cost_ms, 4)}
                for name, u in self.devices.items()
            },
            "estimate": {
                "step_ms": round(self.step_ms, 4),
                "lower_bound_ms": round(self.lower_bound_ms, 4),
                "samples_per_s": round(self.samples_per_s, 1),
            },
        }

    def to_json(self, indent: int | None = 1) -> str:
        """plan.json text: with ``indent``, one shard or device per line (as formats.md shows); else compact."""
        if indent is None:
            return json.dumps(self.to_dict())
        return _dumps(self.to_dict(), indent)

    def save(self, path: str | Path) -> None:
        """Write plan.json atomically (a crash never leaves a half-written plan).

        A symbolic link is written through: the new plan replaces the file it points to (renamed into place next to
        that file), not the link itself.

        Raises:
            PlannerError: ``path`` exists and is not a regular file (a directory, a device, a FIFO, a socket):
                renaming over it would replace it, and as root that could be a device node.
            OSError: The file cannot be written.
        """
        path = Path(os.path.realpath(path))
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            mode = None
        if mode is not None and not stat.S_ISREG(mode):
            raise PlannerError(
                f"cannot write the plan to '{path}': it exists and is not a regular file",
                fixes=("give the path of a new or regular file, e.g. plan.json",),
            )
        tmp = path.with_name(f".{path.name}.tmp")
        try:
            tmp.write_text(self.to_json() + "\n")
            tmp.replace(path)
        except BaseException:
            tmp.unlink(missing_ok=True)  # e.g. the target is a directory: leave nothing behind
            raise

    @classmethod
    def from_dict(cls, data: Any, source: str = "plan.json") -> Plan:
        """Read plan.json content; structural errors name the key path."""
        if not isinstance(data, Mapping):
            raise SpecError(source, "", "expected a JSON object")
        if data.get("format") != FORMAT:
            raise SpecError(
                source,
                "format",
                f"expected {FORMAT!r}, got {data.get('format')!r}",
                fixes=("re-run 'persia plan' to write a current plan",),
            )
        top = Fields(data, source, "")
        top.take("format")
        model = top.take_str("model", default="")
        topology = top.take_str("topology", default="")
        tables_data = top.sub("tables")
        assert tables_data is not None
        tables = {}
        for name in list(tables_data.data):
            table = tables_data.sub(str(name))
            assert table is not None
            tables[str(name)] = _placement_from_fields(table)
        tables_data.finish()
        devices: dict[str, DeviceUsage] = {}
        device_data = top.sub("devices", default=None)
        if device_data is not None:
            for name in list(device_data.data):
                usage = device_data.sub(str(name))
                assert usage is not None
                devices[str(name)] = DeviceUsage(
                    usage.take("hbm_bytes", Quantity.SIZE, default=0),
                    usage.take("ddr_bytes", Quantity.SIZE, default=0),
                    usage.take("cost_ms", Quantity.NUMBER, default=0.0),
                )
                usage.finish()
            device_data.finish()
        estimate = top.sub("estimate", default=None)
        numbers = {"step_ms": 0.0, "lower_bound_ms": 0.0, "samples_per_s": 0.0}
        if estimate is not None:
            numbers = {k: estimate.take(k, Quantity.NUMBER, default=0.0) for k in numbers}
            estimate.finish()
        top.finish()
        return cls(
            model, topology, tables, devices, numbers["step_ms"], numbers["lower_bound_ms"], numbers["samples_per_s"]
        )


def _dumps(value: Any, indent: int, depth: int = 0) -> str:
    """JSON with ``indent``, but a mapping or list of scalars and lists of scalars on one line.

    A shard, a device's usage and the estimate each fit on one line; ``json.dumps(indent=...)`` would give every
    number its own line (228k lines for 1,000 tables) through its pure-Python encoder, a quarter second.
    """
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
    if children is None or all(_scalars(v) for v in children):
        return json.dumps(value)
    inner, outer = " " * (indent * (depth + 1)), " " * (indent * depth)
    if isinstance(value, dict):
        items = [f"{inner}{json.dumps(str(k))}: {_dumps(v, indent, depth + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + f"\n{outer}}}"
    items = [inner + _dumps(v, indent, depth + 1) for v in value]
    return "[\n" + ",\n".join(items) + f"\n{outer}]"


def _scalars(value: Any) -> bool:
    """Whether ``value`` is a scalar or a list of scalars."""
    if isinstance(value, dict):
        return False
    return not isinstance(value, list) or not any(isinstance(v, dict | list) for v in value)


def _placement_to_dict(p: TablePlacement) -> dict[str, Any]:
    shards = []
    for s in p.shards:
        item: dict[str, Any] = {}
        if s.rows is not None:
            item["rows"] = list(s.rows)
        if s.hash is not None:
            item["hash"] = list(s.hash)
        item.update({"cols": list(s.cols), "tier": s.tier.value, "device": s.device, "bytes": s.bytes})
        if s.cache_fraction is not None:
            item["cache_fraction"] = s.cache_fraction
        if s.replica:
            item["replica"] = True
        shards.append(item)
    return {"sharding": p.sharding.value, "mode": p.mode.value, "shards": shards}


def _placement_from_fields(table: Fields) -> TablePlacement:
    sharding = table.take_enum("sharding", Sharding)
    mode = table.take_enum("mode", Mode, default=None)
    shards = []
    for _, item in table.take_list("shards", max_items=MAX_SHARDS_PER_TABLE):
        shards.append(
            Shard(
                device=item.take_str("device"),
                tier=item.take_enum("tier", Tier),
                cols=_pair(item, "cols"),
                bytes=item.take("bytes", Quantity.SIZE),
                rows=_pair(item, "rows") if item.has("rows") else None,
                hash=_pair(item, "hash") if item.has("hash") else None,
                cache_fraction=item.take("cache_fraction", Quantity.NUMBER, default=None),
                replica=item.take_bool("replica", default=False),
            )
        )
        item.finish()
    table.finish()
    placement = TablePlacement(sharding, tuple(shards))
    if mode is not None and mode is not placement.mode:
        raise table.error(
            "mode",
            f"{mode.value!r} does not match sharding {sharding.value!r}",
            fixes=(f"use mode: {placement.mode.value}",),
        )
    return placement


def _pair(item: Fields, key: str) -> tuple[int, int]:
    value = item.take(key)
    top = MAX_OF_KIND[Quantity.COUNT]  # the runtime keeps row and bucket numbers in int64
    if not (
        isinstance(value, list)
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= top for v in value)
    ):
        raise item.error(key, f"expected [start, end] of two integers in [0, 2**63), got {abbreviate(value)}")
    return int(value[0]), int(value[1])


def load_plan(path: str | Path) -> Plan:
    """Read a plan.json file."""
    source = Path(path).name
    return Plan.from_dict(load_json(path, source), source)


def usage_of(
    cost: CostModel, estimate: Estimate, mem: np.ndarray, placements: Mapping[str, TablePlacement]
) -> dict[str, DeviceUsage]:
    """Per-device usage: each GPU (its HBM, the DDR its ddr/hbm_cache shards hold, its step ms), each trainer host
    (DDR summed over its GPUs, NIC ms) and each parameter server (DDR, busiest resource ms)."""
    lay, topo = cost.layout, cost.topology
    gpu_ddr: dict[str, int] = {}
    for table in cost.model.tables:
        for shard in placements[table.name].shards:
            if shard.tier in (Tier.DDR, Tier.HBM_CACHE):
                gpu_ddr[shard.device] = gpu_ddr.get(shard.device, 0) + shard.bytes
    usage: dict[str, DeviceUsage] = {}
    for g, gpu in enumerate(topo.gpus):
        usage[gpu.name] = DeviceUsage(
            int(mem[lay.hbm.start + g]), gpu_ddr.get(gpu.name, 0), float(estimate.per_gpu["step"][g])
        )
    for h, host in enumerate(topo.trainers):
        usage[host.name] = DeviceUsage(0, int(mem[lay.ddr.start + h]), float(estimate.host_nic_ms[h]))
    for p, server in enumerate(topo.servers):
        usage[server.name] = DeviceUsage(0, int(mem[lay.ps_mem.start + p]), float(estimate.server_ms[p]))
    return usage


def table_mismatch(placed: Iterable[str], tables: Iterable[str]) -> tuple[list[str], list[str]]:
    """The plan-matches-model check: ``(missing, unknown)``, the ``tables`` that ``placed`` lacks (in their order)
    and the names it places that are none of them (sorted). Both empty: the plan places exactly these tables."""
    placed, tables = set(placed), list(tables)
    return [name for name in tables if name not in placed], sorted(placed - set(tables))


def require_same_tables(placed: Iterable[str], tables: Iterable[str], *, holder: str = "the model") -> None:
    """Raise :class:`PlannerError` (kind ``invalid_plan``) unless the plan places exactly ``tables``
    (:func:`table_mismatch`); ``holder`` names what holds the tables in the message.

    Args:
        placed: The names the plan places (a plan's ``tables`` mapping).
        tables: The model's (or collection's) table names.
        holder: What the tables are of, e.g. ``"the collection"``.
    """
    missing, unknown = table_mismatch(placed, tables)
    if missing:
        raise PlannerError(
            f"the plan has no placement for tables {missing[:3]}",
            kind=ErrorKind.INVALID_PLAN,
            fixes=("plan this model (persia plan MODEL TOPOLOGY) and pass that plan",),
        )
    if unknown:
        raise PlannerError(
            f"the plan places tables {unknown[:3]} that are not in {holder}",
            kind=ErrorKind.INVALID_PLAN,
            fixes=("pass the plan made for this model",),
        )


def validate(plan: Plan, model: ModelSpec, topology: Topology) -> list[str]:
    """Re-check a plan against its model and topology.

    Checks: every table is placed exactly once (range shards tile rows x cols; hash buckets each once per column
    range; replicas on every GPU), tiers match devices and sharding types, shard bytes are right, no parameter
    server holds more rows of a table than its store can, and no GPU, host or parameter server exceeds its capacity
    minus the reservation, with every shard charged what its runtime allocates (``Shard.storage``).

    Returns:
        Problems found, one line each (at most :data:`MAX_TABLE_PROBLEMS` per table and :data:`MAX_PROBLEMS` in
        all, then a line saying it stopped); empty when the plan is valid.
    """
    problems: list[str] = []
    cost = CostModel(model, topology)
    _, unknown = table_mismatch(plan.tables, (t.name for t in model.tables))
    for extra in unknown:
        problems.append(f"plan places table {extra!r} that the model does not have")
    mem = np.zeros(cost.layout.mem_size)
    for table in model.tables:
        placement = plan.tables.get(table.name)
        if placement is None:
            problems.append(f"table {table.name!r} is not placed")
            continue
        table_problems = _check_table(table, placement, topology, cost)
        problems.extend(f"table {table.name!r}: {p}" for p in table_problems[:MAX_TABLE_PROBLEMS])
        if len(problems) >= MAX_PROBLEMS:
            return [*problems[:MAX_PROBLEMS], f"stopped after {MAX_PROBLEMS} problems"]
        if not table_problems:
            mem += cost.placement_loads(table, placement)[1]
    caps = cost.capacities()
    slots = (
        [(g.name, "HBM") for g in topology.gpus]
        + [(h.name, "DDR") for h in topology.trainers]
        + [(s.name, "DDR") for s in topology.servers]
    )
    for (name, kind), used, cap in zip(slots, mem, caps, strict=True):
        if used > cap + 0.5:
            problems.append(
                f"{name} {kind} holds {format_bytes(used)}, over its usable {format_bytes(cap)} "
                f"(short by {format_bytes(used - cap)})"
            )
    return problems


def _check_table(table, placement: TablePlacement, topology: Topology, cost: CostModel) -> list[str]:
    problems: list[str] = []
    s = placement.sharding
    if not placement.shards:
        return ["has no shards"]
    gpu_names = {g.name for g in topology.gpus}
    server_names = {p.name for p in topology.servers}
    for i, shard in enumerate(placement.shards):
        if shard.tier is Tier.PS:
            if shard.device not in server_names:
                problems.append(f"shard {i} is on tier ps but {shard.device!r} is not a parameter server")
            if s is not Sharding.PS_HASH:
                problems.append(f"shard {i} is on tier ps but the sharding is {s.value}")
        else:
            if shard.device not in gpu_names:
                problems.append(f"shard {i} is on tier {shard.tier.value} but {shard.device!r} is not a GPU")
            if s is Sharding.PS_HASH:
                problems.append(f"shard {i} is on tier {shard.tier.value} but ps_hash shards must be on tier ps")
        if shard.tier is Tier.HBM_CACHE and not (shard.cache_fraction and 0 < shard.cache_fraction < 1):
            problems.append(f"shard {i} is hbm_cache without a cache_fraction in (0, 1)")
        if not (0 <= shard.cols[0] < shard.cols[1] <= table.dim):
            problems.append(f"shard {i} cols {list(shard.cols)} are outside [0, {table.dim})")
        if shard.rows is not None and not (0 <= shard.rows[0] < shard.rows[1] <= table.rows):
            problems.append(f"shard {i} rows {list(shard.rows)} are outside [0, {table.rows})")
        if shard.hash is not None and not (0 <= shard.hash[0] < shard.hash[1]):
            problems.append(f"shard {i} hash {list(shard.hash)} needs 0 <= bucket < buckets")
        if shard.rows is None and shard.hash is None:
            problems.append(f"shard {i} has neither 'rows' nor 'hash'")
        if shard.rows is not None and shard.hash is not None:
            # Its size would be read from `rows` (a range shard's), while the servers hold a hash bucket's share.
            problems.append(f"shard {i} has both 'rows' and 'hash' (a range shard gives rows, a ps_hash shard hash)")
        if len(problems) >= MAX_TABLE_PROBLEMS:
            return problems  # a plan of thousands of bad shards: the first few say what is wrong
    if problems:
        return problems
    if s is Sharding.PS_HASH:
        problems += _check_hash(table, placement)
        problems += _check_store_rows(table, placement, len(topology.servers))
    elif s is Sharding.DATA_PARALLEL:
        devices = [sh.device for sh in placement.shards]
        if sorted(devices) != sorted(gpu_names) or not all(sh.replica for sh in placement.shards):
            problems.append("data_parallel needs one replica on every GPU")
        if any(sh.tier is not Tier.HBM for sh in placement.shards):
            problems.append("data_parallel replicas must be in hbm")
        if any(sh.rows != (0, table.rows) or sh.cols != (0, table.dim) for sh in placement.shards):
            problems.append("data_parallel replicas must hold the whole table")
    else:
        problems += _check_tiling(table, placement)
        problems += _check_shape(table, placement, topology)
    for i, shard in enumerate(placement.shards):
        expected = shard.n_rows(table) * table.row_bytes(cost.dtype, shard.n_cols)
        if shard.bytes != expected:
            problems.append(f"shard {i} bytes {shard.bytes} != {expected} (rows x (cols x dtype + state))")
    return problems


def _check_hash(table, placement: TablePlacement) -> list[str]:
    by_cols: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for shard in placement.shards:
        if shard.hash is None:
            return ["ps_hash shards need 'hash': [bucket, buckets]"]
        by_cols.setdefault(shard.cols, []).append(shard.hash)
    problems = _cols_tile(table, list(by_cols))
    for cols, buckets in by_cols.items():
        n = {b[1] for b in buckets}
        # The count first: `buckets` may claim 10**18 of them, which range() must not be listed for.
        if len(n) != 1 or next(iter(n)) != len(buckets) or sorted(b[0] for b in buckets) != list(range(len(buckets))):
            problems.append(
                f"cols {list(cols)}: hash buckets {abbreviate(sorted(buckets))} are not each of 0..n-1 once"
            )
    return problems


def _check_store_rows(table, placement: TablePlacement, n_servers: int) -> list[str]:
    """One line if a server would hold more rows of the table than its store can (``memory.PS_MAX_ROWS``)."""
    fullest = max(placement.shards, key=lambda shard: shard.n_rows(table))
    rows = fullest.n_rows(table)
    if rows <= PS_MAX_ROWS:
        return []
    need = ps_servers_needed(table.rows)
    fix = f"plan it with at least {need} parameter servers" if need > n_servers else "spread it over more hash buckets"
    return [
        f"{fullest.device} would hold {rows:,} of its rows, over the {PS_MAX_ROWS:,} rows of one table that a "
        f"parameter server's store holds; fix: {fix}"
    ]


def _cols_tile(table, ranges: list[tuple[int, int]]) -> list[str]:
    ranges = sorted(ranges)
    edge = 0
    for a, b in ranges:
        if a != edge:
            return [f"column ranges {abbreviate(ranges)} do not tile [0, {table.dim}) exactly once"]
        edge = b
    return (
        [] if edge == table.dim else [f"column ranges {abbreviate(ranges)} do not tile [0, {table.dim}) exactly once"]
    )


def _check_tiling(table, placement: TablePlacement) -> list[str]:
    """Rectangles tile rows x cols exactly once: per column cut, the row ranges chain from 0 to rows."""
    shards = placement.shards
    if any(s.rows is None for s in shards):
        return ["range shardings need 'rows' on every shard"]
    cuts = sorted({c for s in shards for c in s.cols})
    if cuts[0] != 0 or cuts[-1] != table.dim:
        return [f"columns do not cover [0, {table.dim})"]
    for lo, hi in itertools.pairwise(cuts):
        covering = sorted(s.rows for s in shards if s.cols[0] <= lo and hi <= s.cols[1])  # type: ignore[type-var]
        edge = 0
        for a, b in covering:
            if a != edge:
                return [f"rows x cols [{lo}, {hi}) are covered {'twice' if a < edge else 'with a gap'} near row {a}"]
            edge = b
        if edge != table.rows:
            return [f"rows of cols [{lo}, {hi}) end at {edge}, not {table.rows}"]
    return []


def _check_shape(table, placement: TablePlacement, topology: Topology) -> list[str]:
    s, shards = placement.sharding, placement.shards
    full_rows = all(sh.rows == (0, table.rows) for sh in shards)
    full_cols = all(sh.cols == (0, table.dim) for sh in shards)
    hosts = {topology.host(topology.gpus[topology.gpu_index(sh.device)].host).name for sh in shards}
    tiers = {sh.tier for sh in shards}
    problems = []
    if len(tiers) > 1:
        problems.append(f"shards mix tiers {sorted(t.value for t in tiers)}")
    if s is Sharding.TABLE_WISE and len(shards) != 1:
        problems.append("table_wise has exactly one shard")
    if s in (Sharding.COLUMN_WISE, Sharding.TABLE_COLUMN_WISE) and not full_rows:
        problems.append(f"{s.value} shards must hold every row")
    if s in (Sharding.ROW_WISE, Sharding.TABLE_ROW_WISE) and not full_cols:
        problems.append(f"{s.value} shards must hold every column")
    if s in (Sharding.TABLE_ROW_WISE, Sharding.TABLE_COLUMN_WISE) and len(hosts) != 1:
        problems.append(f"{s.value} shards must stay on one host, found {abbreviate(sorted(hosts))}")
    return problems


def require_valid(plan: Plan, model: ModelSpec, topology: Topology) -> None:
    """Raise :class:`PlannerError` (kind ``invalid_plan``) naming the first problem and how many there are."""
    problems = validate(plan, model, topology)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise PlannerError(
            f"invalid plan: {problems[0]}{more}",
            kind=ErrorKind.INVALID_PLAN,
            fixes=("re-run 'persia plan' for this model and topology",),
        )
