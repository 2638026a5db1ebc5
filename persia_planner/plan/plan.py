"""The plan: value object and plan.json (formats.md, ``persia-plan/1``); its checks are in
:mod:`persia_planner.plan.validation`."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from persia_planner.cost.analytic import CostModel, Estimate
from persia_planner.errors import PlannerError, SpecError, abbreviate
from persia_planner.fields import Fields, load_json
from persia_planner.kinds import Mode, Sharding
from persia_planner.limits import MAX_OF_KIND, MAX_SHARDS_PER_TABLE, MAX_STALENESS
from persia_planner.model.pooling import Pooling
from persia_planner.model.qcomms import QComms
from persia_planner.model.specs import DType, ModelSpec
from persia_planner.placement.shards import Shard, TablePlacement
from persia_planner.plan.tuning import Tuning
from persia_planner.tiers import Holder, Memory, Tier
from persia_planner.units import Quantity

__all__ = [
    "FORMAT",
    "DeviceUsage",
    "Plan",
    "load_plan",
    "placement_from_dict",
    "placement_to_dict",
    "usage_of",
]

FORMAT = "persia-plan/1"


_USAGE_KEYS = ("hbm_bytes", "ddr_bytes")  # every device reports these; another memory's key only where it holds some


@dataclass(frozen=True)
class DeviceUsage:
    """What a plan puts on one device (GPU, trainer host or parameter server).

    Attributes:
        hbm_bytes: In its GPU memory.
        ddr_bytes: In its DDR (a GPU's: the rows its shards keep in its host's).
        cost_ms: Its busiest resource's time per step.
        other_bytes: In each other memory, by the memory's ``usage_key`` (a server's ``disk_bytes``), nonzero only.
    """

    hbm_bytes: int
    ddr_bytes: int
    cost_ms: float
    other_bytes: tuple[tuple[str, int], ...] = ()

    def bytes_of(self, usage_key: str) -> int:
        """Bytes reported under ``usage_key`` (``hbm_bytes``, ``ddr_bytes`` or another memory's)."""
        if usage_key in _USAGE_KEYS:
            return self.hbm_bytes if usage_key == "hbm_bytes" else self.ddr_bytes
        return dict(self.other_bytes).get(usage_key, 0)


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
        staleness: The staleness bound K the plan was priced for (None: not recorded, a plan of an older writer or
            of another planner). Only a plan with parameter-server tables depends on it.
        ps_wire_dtype: The dtype its parameter-server traffic was priced in (None: not recorded).
        qcomms: The precisions of the trainers' collectives it was priced for and runs with (None: not recorded,
            float32).
        qcomms_chosen: The planner chose ``qcomms`` (the model left them ``auto``, no ``--qcomms`` named them):
            ``persia train --adapt`` may choose them again; otherwise they stay as named.
        tuning: What ``persia plan --tune`` measured of the candidates, and which it kept (None: not tuned).
        bound_parts: What the bound is made of: the step-time functionals of the combination that gave it, each
            with its weight (``bound.BoundPart``; empty where not recorded).
        bound_binding: The memory capacities whose room limits the bound (priced above zero in it).
    """

    model: str
    topology: str
    tables: Mapping[str, TablePlacement]
    devices: Mapping[str, DeviceUsage]
    step_ms: float
    lower_bound_ms: float
    samples_per_s: float
    alternatives: Mapping[str, Any] = field(default_factory=dict, compare=False)
    staleness: int | None = None
    ps_wire_dtype: DType | None = None
    qcomms: QComms | None = None
    qcomms_chosen: bool = field(default=False, compare=False)
    tuning: Tuning | None = None
    bound_parts: Mapping[str, float] = field(default_factory=dict, compare=False)
    bound_binding: tuple[str, ...] = field(default=(), compare=False)

    @property
    def quality(self) -> float:
        """Estimated step time / lower bound: at least 1, as no plan beats the bound (see :attr:`proven_optimal`)."""
        return self.step_ms / self.lower_bound_ms if self.lower_bound_ms > 0 else float("inf")

    @property
    def proven_optimal(self) -> bool:
        """Whether the step time meets the lower bound (to 1e-9): no plan of the search's options is faster under the
        cost model (see ``bound.py``)."""
        return self.lower_bound_ms > 0 and self.step_ms <= self.lower_bound_ms * (1 + 1e-9)

    def priced_model(self, model: ModelSpec) -> ModelSpec:
        """``model`` as this plan was priced: with the collectives' precisions it records, which the planner may
        have chosen (the staleness K and the PS wire are a run's options: ``with_run_options``)."""
        return model if self.qcomms is None else replace(model, qcomms=self.qcomms)

    def remote_tables(self) -> list[str]:
        """Names of the tables sent to the parameter servers."""
        return [name for name, p in self.tables.items() if p.mode is Mode.ASYNC]

    # ---- JSON -----------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "model": self.model,
            "topology": self.topology,
            **({"staleness": self.staleness} if self.staleness is not None else {}),
            **({"ps_wire_dtype": self.ps_wire_dtype.value} if self.ps_wire_dtype is not None else {}),
            **({"qcomms": self.qcomms.to_dict()} if self.qcomms is not None else {}),
            **({"qcomms_chosen": True} if self.qcomms_chosen else {}),
            "tables": {name: placement_to_dict(p) for name, p in self.tables.items()},
            "devices": {
                name: {
                    "hbm_bytes": u.hbm_bytes,
                    "ddr_bytes": u.ddr_bytes,
                    **dict(u.other_bytes),
                    "cost_ms": round(u.cost_ms, 4),
                }
                for name, u in self.devices.items()
            },
            "estimate": {
                "step_ms": round(self.step_ms, 4),
                "lower_bound_ms": round(self.lower_bound_ms, 4),
                "samples_per_s": round(self.samples_per_s, 1),
                **(
                    {
                        "lower_bound": {
                            "parts": {name: round(w, 4) for name, w in self.bound_parts.items()},
                            **({"memory_priced": list(self.bound_binding)} if self.bound_binding else {}),
                        }
                    }
                    if self.bound_parts
                    else {}
                ),
            },
            **({"tuning": self.tuning.to_dict()} if self.tuning is not None else {}),
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
        staleness = top.take("staleness", Quantity.COUNT, default=None, maximum=MAX_STALENESS)
        wire = top.take_enum("ps_wire_dtype", DType, default=None)
        qcomms = _read_qcomms(top)
        chosen = top.take_bool("qcomms_chosen", default=False)
        tables_data = top.sub("tables")
        assert tables_data is not None
        tables = {}
        for name in tables_data.names():
            table = tables_data.sub(str(name))
            assert table is not None
            tables[str(name)] = _placement_from_fields(table)
        tables_data.finish()
        devices: dict[str, DeviceUsage] = {}
        device_data = top.sub("devices", default=None)
        if device_data is not None:
            for name in device_data.names():
                usage = device_data.sub(str(name))
                assert usage is not None
                hbm = usage.take("hbm_bytes", Quantity.SIZE, default=0)
                ddr = usage.take("ddr_bytes", Quantity.SIZE, default=0)
                cost_ms = usage.take("cost_ms", Quantity.NUMBER, default=0.0)
                others = dict.fromkeys(m.spec.usage_key for m in Memory if m.spec.usage_key not in _USAGE_KEYS)
                found = ((key, usage.take(key, Quantity.SIZE, default=0)) for key in others)
                devices[str(name)] = DeviceUsage(hbm, ddr, cost_ms, tuple((k, b) for k, b in found if b))
                usage.finish()
            device_data.finish()
        estimate = top.sub("estimate", default=None)
        numbers = {"step_ms": 0.0, "lower_bound_ms": 0.0, "samples_per_s": 0.0}
        parts: dict[str, float] = {}
        binding: tuple[str, ...] = ()
        if estimate is not None:
            numbers = {k: estimate.take(k, Quantity.NUMBER, default=0.0) for k in numbers}
            bound = estimate.sub("lower_bound", default=None)
            if bound is not None:
                part_fields = bound.sub("parts", default=None)
                if part_fields is not None:
                    parts = {str(n): part_fields.take(str(n), Quantity.NUMBER) for n in part_fields.names()}
                    part_fields.finish()
                binding = tuple(bound.take_str_list("memory_priced", default=[]))
                bound.finish()
            estimate.finish()
        tuning_fields = top.sub("tuning", default=None)
        tuning = Tuning.from_fields(tuning_fields) if tuning_fields is not None else None
        top.finish()
        return cls(
            model,
            topology,
            tables,
            devices,
            numbers["step_ms"],
            numbers["lower_bound_ms"],
            numbers["samples_per_s"],
            staleness=staleness,
            ps_wire_dtype=wire,
            qcomms=qcomms,
            qcomms_chosen=chosen,
            tuning=tuning,
            bound_parts=parts,
            bound_binding=binding,
        )


def _read_qcomms(top: Fields) -> QComms | None:
    """plan.json's ``qcomms`` (absent: not recorded): what the planner decided, never ``auto``."""
    value = top.take("qcomms", default=None)
    if value is None:
        return None
    try:
        qcomms = QComms.from_value(value, "qcomms")
    except PlannerError as err:
        raise top.error("qcomms", str(err).removeprefix("qcomms "), fixes=("re-run 'persia plan'",)) from None
    if qcomms is None:
        raise top.error("qcomms", "a plan records what its planner chose, not auto", fixes=("re-run 'persia plan'",))
    return qcomms


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


def placement_to_dict(p: TablePlacement) -> dict[str, Any]:
    """A table's placement as plan.json writes it (also recorded in a training checkpoint)."""
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
        if s.store_rows is not None:
            item["store_rows"] = s.store_rows
        if s.backing_rows:
            item["backing_rows"] = s.backing_rows
        shards.append(item)
    dtype = {"dtype": p.dtype.value} if p.dtype is not None else {}
    # Written for sequence tables alone: a pooled table's entry stays as plans wrote it before sequences were planned.
    pooling = {"pooling": Pooling.NONE.value} if p.sequence else {}
    return {"sharding": p.sharding.value, "mode": p.mode.value, **dtype, **pooling, "shards": shards}


def placement_from_dict(data: Any, source: str, path: str = "") -> TablePlacement:
    """A table's placement as :func:`placement_to_dict` writes it; errors name ``source`` and the key ``path``."""
    return _placement_from_fields(Fields(data, source, path))


def _placement_from_fields(table: Fields) -> TablePlacement:
    sharding = table.take_enum("sharding", Sharding)
    mode = table.take_enum("mode", Mode, default=None)
    dtype = table.take_enum("dtype", DType, default=None)
    pooling = table.take_enum("pooling", Pooling, default=Pooling.SUM)
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
                store_rows=item.take_positive("store_rows", Quantity.COUNT, default=None),
                backing_rows=item.take_positive("backing_rows", Quantity.COUNT, default=0),
            )
        )
        item.finish()
    table.finish()
    placement = TablePlacement(sharding, tuple(shards), dtype, sequence=not pooling.pooled)
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
            if shard.tier.spec.rows_in.spec.holder is Holder.HOST:
                gpu_ddr[shard.device] = gpu_ddr.get(shard.device, 0) + shard.bytes

    def held(holder: Holder, index: int) -> dict[str, int]:
        found = dict.fromkeys(_USAGE_KEYS, 0)
        for memory in lay.memories:
            if memory.spec.holder is holder:
                key = memory.spec.usage_key
                found[key] = found.get(key, 0) + int(mem[lay.slots(memory).start + index])
        return found

    def device_usage(found: dict[str, int], cost_ms: float, ddr: int | None = None) -> DeviceUsage:
        others = tuple((k, b) for k, b in found.items() if k not in _USAGE_KEYS and b)
        return DeviceUsage(found["hbm_bytes"], found["ddr_bytes"] if ddr is None else ddr, cost_ms, others)

    usage: dict[str, DeviceUsage] = {}
    for g, gpu in enumerate(topo.gpus):
        usage[gpu.name] = device_usage(
            held(Holder.GPU, g), float(estimate.per_gpu["step"][g]), gpu_ddr.get(gpu.name, 0)
        )
    for h, host in enumerate(topo.trainers):
        usage[host.name] = device_usage(held(Holder.HOST, h), float(estimate.host_nic_ms[h]))
    for p, server in enumerate(topo.servers):
        usage[server.name] = device_usage(held(Holder.SERVER, p), float(estimate.server_ms[p]))
    return usage
