"""``persia size``: the cheapest cluster of a catalog whose best plan trains a model at a target speed.

A shape *meets* the target when the plan ``persia plan`` makes on it (the same search, seed and budget) estimates at
least the target's samples per second. The sizer visits the shapes cheapest first and stops at the first that meets
it, so the answer is the exhaustive search's (as long as the local search's wall-clock budget does not cut a plan:
then a plan depends on the machine's load, as ``persia plan``'s does). What makes it fast is that it rarely plans:
a shape is ruled out as soon as something the plan cannot beat says it is too slow, in order of cost:

1. memory: the aggregate capacities (shapes below the fewest servers that hold the model are never built);
2. the dense step alone (the trainers' dense part, its all-reduce and fixed costs: the same for every server count,
   so it rules out every shape of a trainer class and count at once), then the trainers' lower bound beside ideal
   servers (unbounded memory and bandwidth: no term of the bound is larger there than beside real servers, so it
   too holds for every server class and count); both per server class where that class's profile sets the cost
   constants (the trainers have none);
3. the lower bound of the stream's shape with the most servers: none of the bound's terms grows with the servers of
   a class (a hashed table's share of each server only shrinks; the trainers' client work is charged as for one
   server), so a bound there is at most any plan's step at fewer of them;
4. the shape's own lower bound, first at the weighting of the last bound (one maximisation), then in full.

Each is taken at the cheapest of the collectives' precisions the planner may choose, so no plan of any of them can
beat it. The plan itself comes last.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from persia_planner.bound import LowerBound, bound_at, lower_bound
from persia_planner.cost.analytic import CostModel
from persia_planner.errors import CapacityError, ConstraintError, PlannerError
from persia_planner.model.qcomms import qcomms_candidates
from persia_planner.model.specs import ModelSpec
from persia_planner.placement.feasibility import check_constraints
from persia_planner.placement.memory import ps_servers_needed
from persia_planner.plan.plan import Plan
from persia_planner.planner import Planner, check_capacity
from persia_planner.search import GreedyLocalSearch, SearchConfig
from persia_planner.sizing.catalog import Catalog
from persia_planner.sizing.shapes import Shape, Stream, cheapest_first, streams
from persia_planner.topology.graph import Topology
from persia_planner.topology.hardware import DeviceKind
from persia_planner.units import format_bytes

__all__ = ["Resource", "Sizing", "Stage", "Verdict", "dearest_short", "describe_short", "plan_shape", "size"]

MS = 1000.0


class Resource(enum.StrEnum):
    """What keeps a shape from the target."""

    MEMORY = "memory"
    CONSTRAINTS = "constraints"
    COMPUTE = "compute"
    NIC = "trainer NICs"
    SERVERS = "parameter servers"
    SWITCH = "switch"
    PCIE = "PCIe"
    SEARCH = "plan"  # the bound leaves room, the best plan found does not reach the target


class Stage(enum.StrEnum):
    """What decided a shape's verdict (the cheaper the earlier)."""

    MEMORY = "memory"
    DENSE = "dense step"
    TRAINERS_BOUND = "bound with ideal servers"
    STREAM_BOUND = "bound with most servers"
    BOUND = "lower bound"
    PLAN = "plan"


@dataclass(frozen=True)
class Verdict:
    """What the sizer found about one shape.

    Attributes:
        shape: The shape.
        meets: Whether its plan reaches the target.
        stage: What decided it.
        resource: What keeps it from the target (None where it meets it).
        why: One line: the figures behind the verdict.
        samples_per_s: Its plan's estimate, where it was planned.
        ceiling_samples_per_s: The most any plan on it can reach (from a bound), where one was computed.
    """

    shape: Shape
    meets: bool
    stage: Stage
    resource: Resource | None
    why: str
    samples_per_s: float | None = None
    ceiling_samples_per_s: float | None = None

    @property
    def best_known(self) -> float | None:
        """Its plan's speed, else its ceiling."""
        return self.samples_per_s if self.samples_per_s is not None else self.ceiling_samples_per_s


@dataclass(frozen=True)
class Sizing:
    """The answer of :func:`size`.

    Attributes:
        target_samples_per_s: The target.
        chosen: The cheapest shape that meets it (None: none within the host budget).
        plan: Its plan.
        verdicts: Every shape the sizer looked at, in the order it did (cheapest first).
        memory_short: How many shapes the aggregate memory ruled out unbuilt, by stream (those cheaper than the
            chosen shape where one was found).
        dropped: Streams a verdict ruled out whole (the dense step, the bound with most servers): the stream, the
            server count of the verdict's shape, and the verdict, which holds for its dearer shapes too.
        shapes: How many shapes the catalog makes within the budget.
        plans: How many plans were searched.
        bounds: How many lower bounds were computed (full ones; each one-weighting probe counts as a bound too).
        seconds: Wall-clock time.
        model: The model sized.
    """

    target_samples_per_s: float
    chosen: Verdict | None
    plan: Plan | None
    verdicts: tuple[Verdict, ...]
    memory_short: tuple[tuple[Stream, int], ...]
    dropped: tuple[tuple[Stream, int, Verdict], ...]
    shapes: int
    plans: int
    bounds: int
    seconds: float
    model: ModelSpec | None = None

    def failures(self) -> dict[Resource, int]:
        """How many shapes cheaper than the chosen one (all, where none was chosen) fail, by what keeps them."""
        counts: dict[Resource, int] = {}
        limit = self.chosen.shape.price_per_hour if self.chosen is not None else float("inf")
        for verdict in self.verdicts:
            if not verdict.meets and verdict.resource is not None and verdict.shape.price_per_hour < limit:
                counts[verdict.resource] = counts.get(verdict.resource, 0) + 1
        for stream, servers, verdict in self.dropped:
            rest = sum(1 for n in stream.held if n > servers and stream.shape(n).price_per_hour < limit)
            if rest and verdict.resource is not None:
                counts[verdict.resource] = counts.get(verdict.resource, 0) + rest
        short = sum(n for _, n in self.memory_short)
        if short:
            counts[Resource.MEMORY] = counts.get(Resource.MEMORY, 0) + short
        return counts


def plan_shape(model: ModelSpec, topology: Topology, *, seed: int = 0, improve_time_s: float = 5.0) -> Plan:
    """The plan ``persia plan`` makes of ``model`` on ``topology`` (without ``--explain``): what a shape is judged by.

    Raises:
        PlannerError: The model cannot be placed there (memory, constraints).
    """
    config = SearchConfig(seed=seed, improve_time_s=improve_time_s, explain_top=0)
    return Planner(GreedyLocalSearch(config)).plan(model, topology)


def size(
    model: ModelSpec,
    catalog: Catalog,
    target_samples_per_s: float,
    *,
    max_hosts: int,
    seed: int = 0,
    improve_time_s: float = 5.0,
    on_shape: Callable[[Verdict], None] | None = None,
) -> Sizing:
    """The cheapest shape of ``catalog`` (at most ``max_hosts`` hosts) whose plan reaches ``target_samples_per_s``.

    Args:
        model: The model, with the run's K (:func:`persia_planner.model.specs.with_run_options`).
        catalog: What clusters can be made of.
        target_samples_per_s: The speed to reach (the plan's estimate of global samples per second).
        max_hosts: At most this many hosts, trainers and servers together.
        seed: The plans' search seed.
        improve_time_s: Each plan's local-search budget.
        on_shape: Called with each verdict as it is reached (progress).
    """
    if not target_samples_per_s > 0:
        raise PlannerError(f"the target must be above 0 samples/s, got {target_samples_per_s}")
    if max_hosts < 1:
        raise PlannerError(f"max_hosts must be at least 1, got {max_hosts}")
    named = next((t for t in model.tables if t.constraints.devices is not None), None)
    if named is not None:
        raise PlannerError(
            f"table {named.name!r} names devices in its constraints, but a sized cluster's hosts are named after the "
            "catalog's classes",
            fixes=("remove its devices: constraint to size the model, then plan with it on the sized topology",),
        )
    started = time.perf_counter()
    sizer = _Sizer(model, catalog, target_samples_per_s, seed, improve_time_s)
    found = streams(model, catalog, max_hosts)
    order = cheapest_first(found)
    verdicts: list[Verdict] = []
    dropped: list[tuple[Stream, int, Verdict]] = []
    chosen = plan = None
    for index, shape in order:
        stream = found[index]
        dead = sizer.stream_verdict(stream, shape)
        if dead is not None:
            order.drop(index)
            verdict = dead
            dropped.append((stream, shape.servers, dead))
        else:
            verdict, plan = sizer.verdict(shape)
        verdicts.append(verdict)
        if on_shape is not None:
            on_shape(verdict)
        if verdict.meets:
            chosen = verdict
            break
    limit = chosen.shape.price_per_hour if chosen is not None else float("inf")
    short = tuple((s, n) for s in found if (n := sum(1 for k in s.short if s.shape(k).price_per_hour < limit)))
    shapes = sum(len(s.short) + len(s.held) for s in found)
    return Sizing(
        target_samples_per_s,
        chosen,
        plan if chosen is not None else None,
        tuple(verdicts),
        short,
        tuple(dropped),
        shapes,
        sizer.plans,
        sizer.bounds,
        time.perf_counter() - started,
        model,
    )


@dataclass
class _Sizer:
    """The stages of one sizing, with what they learn kept for the next shapes."""

    model: ModelSpec
    catalog: Catalog
    target: float
    seed: int
    improve_time_s: float
    plans: int = 0
    bounds: int = 0
    _dense: dict[tuple[str, int, str, str | None], Verdict | None] = field(default_factory=dict)
    _streams: dict[tuple[str, int, str, str | None], Verdict | None] = field(default_factory=dict)
    _last: dict[Any, LowerBound] = field(default_factory=dict)  # per precision of the collectives, its last bound
    _variants: dict[bool, list[ModelSpec]] = field(default_factory=dict)  # by whether the trainers have GPUs

    @property
    def target_ms(self) -> float:
        """The step the target allows."""
        return self.model.batch_size / self.target * MS

    def topology(self, shape: Shape) -> Topology:
        return Topology.from_dict(shape.topology_dict(self.catalog), f"{shape.describe()} ({self.catalog.source})")

    def variants(self, topology: Topology) -> list[ModelSpec]:
        """The model under each precision of the collectives a plan of it may run in, the narrowest first (its bound
        is most often the lower: where it reaches the target, the others need no bound)."""
        if self.model.qcomms is not None:
            return [self.model]
        cuda = any(g.kind is not DeviceKind.CPU for g in topology.gpus)
        if cuda not in self._variants:
            models = [dataclasses.replace(self.model, qcomms=c) for c in qcomms_candidates(cuda)]
            self._variants[cuda] = models[::-1]
        return self._variants[cuda]

    def stream_verdict(self, stream: Stream, shape: Shape) -> Verdict | None:
        """A verdict for every shape of ``stream`` (here for ``shape``), where one holds for all; else None."""
        # The trainers' verdicts hold for every server class that leaves the cost constants the trainers' (a
        # topology takes them from the trainers' profile, else from any host's): per server class where its
        # profile would set them.
        sets_constants = "profile" not in stream.trainer.hardware and stream.server is not None
        sets_constants = sets_constants and "profile" in stream.server.hardware  # type: ignore[union-attr]
        constants = stream.server.name if sets_constants else None  # type: ignore[union-attr]
        key = (stream.trainer.name, stream.trainers, stream.link.name)
        if (*key, constants) not in self._dense:
            found = self._dense_verdict(stream)
            if found is None and constants is None and self._ideal_applies:
                found = self._ideal_verdict(stream)
            self._dense[(*key, constants)] = found
        dense = self._dense[(*key, constants)]
        if dense is not None:
            return dataclasses.replace(dense, shape=shape)
        if stream.server is None or stream.first == stream.last:
            return None
        skey = (*key, stream.server.name)
        if skey not in self._streams:
            most = stream.shape(stream.last)
            topology = self.topology(most)
            ceiling, bound = self._ceiling(topology)
            verdict = None
            if ceiling < self.target:
                verdict = _too_slow(most, Stage.STREAM_BOUND, ceiling, bound, f"even with {stream.last} servers ")
            self._streams[skey] = verdict
        found = self._streams[skey]
        return dataclasses.replace(found, shape=shape) if found is not None else None

    @functools.cached_property
    def _ideal_applies(self) -> bool:
        """Whether the ideal servers stand for every real ones: no table's constraints name tiers (the ideal servers
        have no disk for ``ssd``)."""
        return all(t.constraints.tiers is None for t in self.model.tables)

    def _ideal_verdict(self, stream: Stream) -> Verdict | None:
        """The trainers' own ceiling: their bound beside servers that hold anything and move it in no time. Every
        term of the bound is at most what it is beside real servers (any class, any count, or none: the trainers'
        NICs carry the same bytes, the round trip is the same, the client work is charged as for one server), so
        it holds for every stream of these trainers at once."""
        shape = stream.shape(0)
        data = shape.topology_dict(self.catalog)
        data["hosts"].append(dict(_IDEAL_SERVER, count=self._ideal_servers))
        topology = Topology.from_dict(data, f"{shape.describe()} with ideal servers")
        ceiling, bound = self._ceiling(topology)
        if ceiling >= self.target:
            return None
        return _too_slow(shape, Stage.TRAINERS_BOUND, ceiling, bound, "even beside ideal servers ")

    @functools.cached_property
    def _ideal_servers(self) -> int:
        """As many ideal servers as the longest table needs (a server's store holds PS_MAX_ROWS of one table)."""
        return max([1, *(ps_servers_needed(t.rows) for t in self.model.tables)])

    def _dense_verdict(self, stream: Stream) -> Verdict | None:
        # One server of the stream's class where it has one: the constants are then the shapes' own.
        shape = stream.shape(1 if stream.server is not None else 0)
        topology = self.topology(shape)
        fixed = min(float(np.mean(CostModel(m, topology).fixed_sync_ms)) for m in self.variants(topology))
        if fixed <= self.target_ms:
            return None
        ceiling = self.model.batch_size / fixed * MS
        why = (
            f"the dense step alone takes {fixed:.2f} ms on {stream.trainers} x {stream.trainer.name}: at most "
            f"{ceiling:,.0f} samples/s"
        )
        return Verdict(shape, False, Stage.DENSE, Resource.COMPUTE, why, ceiling_samples_per_s=ceiling)

    def _ceiling(self, topology: Topology) -> tuple[float, LowerBound | None]:
        """The most samples/s any plan on ``topology`` may reach by the bound (at least the target's where one
        precision's bound leaves room for it: the rest are not computed), with the bound that gave it. Each
        precision is probed at its last bound's weighting first (one maximisation instead of a search)."""
        best, best_bound = 0.0, None
        for model in self.variants(topology):
            cost = CostModel(model, topology)
            k = model.qcomms
            last = self._last.get(k)
            if last is not None:
                self.bounds += 1
                probe = bound_at(cost, last)
                if probe is not None and probe > self.target_ms:
                    ceiling = model.batch_size / probe * MS
                    if ceiling > best:
                        best, best_bound = ceiling, last
                    continue
            self.bounds += 1
            bound = lower_bound(cost)
            self._last[k] = bound
            ceiling = model.batch_size / max(bound.value_ms, 1e-12) * MS
            if ceiling > best:
                best, best_bound = ceiling, bound
            if best >= self.target:
                break
        return best, best_bound

    def verdict(self, shape: Shape) -> tuple[Verdict, Plan | None]:
        """The verdict of ``shape`` by its bound, else by its plan (returned where it was planned)."""
        try:
            topology = self.topology(shape)
            check_constraints(self.model, topology)
            check_capacity(self.model, topology)
        except CapacityError as err:
            return Verdict(shape, False, Stage.MEMORY, Resource.MEMORY, str(err)), None
        except ConstraintError as err:
            return Verdict(shape, False, Stage.MEMORY, Resource.CONSTRAINTS, str(err)), None
        ceiling, bound = self._ceiling(topology)
        if ceiling < self.target:
            return _too_slow(shape, Stage.BOUND, ceiling, bound), None
        self.plans += 1
        try:
            planned = plan_shape(self.model, topology, seed=self.seed, improve_time_s=self.improve_time_s)
        except PlannerError as err:
            resource = Resource.CONSTRAINTS if isinstance(err, ConstraintError) else Resource.MEMORY
            return Verdict(shape, False, Stage.MEMORY, resource, str(err), ceiling_samples_per_s=ceiling), None
        rate = planned.samples_per_s
        if rate >= self.target:
            why = f"its plan steps {planned.step_ms:.2f} ms: {rate:,.0f} samples/s"
            return Verdict(shape, True, Stage.PLAN, None, why, rate, ceiling), planned
        why = (
            f"its best plan steps {planned.step_ms:.2f} ms ({rate:,.0f} samples/s), over the {self.target_ms:.2f} ms "
            f"the target allows (the bound allows {ceiling:,.0f})"
        )
        return Verdict(shape, False, Stage.PLAN, Resource.SEARCH, why, rate, ceiling), planned


_IDEAL_SERVER = {
    "name": "ideal_ps",
    "role": "parameter_server",
    "ddr": 2**58,
    "ddr_bandwidth": "1000TB/s",
    "nic_bandwidth": "1000TB/s",
}
"""A parameter server no real one beats: memory for any table, and bandwidths far above any NIC or DDR."""


def _too_slow(shape: Shape, stage: Stage, ceiling: float, bound: LowerBound | None, context: str = "") -> Verdict:
    if ceiling <= 0:  # an infinite bound: some table has no option that fits
        why = f"{context}some table fits no tier its constraints allow (no plan exists)"
        return Verdict(shape, False, stage, Resource.MEMORY, why, ceiling_samples_per_s=None)
    made_of = bound.describe() if bound is not None else "the bound"
    why = f"{context}no plan reaches more than {ceiling:,.0f} samples/s ({made_of})"
    return Verdict(shape, False, stage, _bound_resource(bound), why, ceiling_samples_per_s=ceiling)


def _bound_resource(bound: LowerBound | None) -> Resource:
    """What the heaviest functional of a bound measures."""
    if bound is None or not bound.parts:
        return Resource.COMPUTE
    return _resource_named(max(bound.parts, key=lambda p: p.weight).name)


def _resource_named(name: str) -> Resource:
    if name.startswith(("GPU work", "dense")) or "sync path" in name:
        return Resource.COMPUTE
    if "parameter servers" in name:
        return Resource.SERVERS
    if "NIC" in name:
        return Resource.NIC
    if "switch" in name:
        return Resource.SWITCH
    if "PCIe" in name:
        return Resource.PCIE
    return Resource.COMPUTE


def describe_short(stream: Stream, servers: int, model: ModelSpec) -> str:
    """Why a shape the memory test set apart (``servers`` of ``stream.short``) cannot hold the model."""
    hold = (stream.trainer.hbm_bytes + stream.trainer.ddr_bytes) * stream.trainers
    if stream.server is not None:
        hold += stream.server.ddr_bytes * servers
    if model.total_bytes > hold:
        return f"it holds {format_bytes(hold)} of tables; the model needs {format_bytes(model.total_bytes)}"
    return "a table too large for the trainers needs more servers (its bytes, or its rows per server's store)"


def dearest_short(sizing: Sizing) -> tuple[Shape, str] | None:
    """The dearest shape the memory test set apart below the chosen one (any, where none was chosen), and why."""
    limit = sizing.chosen.shape.price_per_hour if sizing.chosen is not None else float("inf")
    found = [
        (stream.shape(k).price_per_hour, i, k)
        for i, (stream, _) in enumerate(sizing.memory_short)
        for k in stream.short
        if stream.shape(k).price_per_hour < limit
    ]
    if not found:
        return None
    _, i, k = max(found)
    stream = sizing.memory_short[i][0]
    return stream.shape(k), describe_short(stream, k, sizing.model)


def as_dict(verdict: Verdict) -> dict[str, Any]:
    """A verdict as sizing.json writes it."""
    shape = verdict.shape
    return {
        "shape": shape.describe(),
        "trainer_class": shape.trainer.name,
        "trainers": shape.trainers,
        "server_class": shape.server.name if shape.server is not None else None,
        "servers": shape.servers,
        "link": shape.link.name,
        "price_per_hour": round(shape.price_per_hour, 6),
        "meets": verdict.meets,
        "stage": verdict.stage.value,
        "resource": verdict.resource.value if verdict.resource is not None else None,
        "samples_per_s": verdict.samples_per_s,
        "ceiling_samples_per_s": verdict.ceiling_samples_per_s,
        "why": verdict.why,
    }
