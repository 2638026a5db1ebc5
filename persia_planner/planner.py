"""The pipeline: model + topology -> cost model -> search -> plan (with its lower bound)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from persia_planner.bound import LowerBound, bound_at, dense_bound, lower_bound
from persia_planner.bound.terms import ASYNC_NAMES
from persia_planner.cost.analytic import CostModel
from persia_planner.errors import CapacityError, PlannerError
from persia_planner.kinds import Sharding
from persia_planner.model.qcomms import FP32_COMMS, qcomms_candidates
from persia_planner.model.specs import DType, ModelSpec
from persia_planner.placement.feasibility import check_constraints
from persia_planner.placement.memory import ps_holds, ps_rows_error
from persia_planner.placement.shards import TablePlacement
from persia_planner.plan.plan import Plan, usage_of
from persia_planner.search import GreedyLocalSearch, SearchConfig, Searcher, WarmStart
from persia_planner.topology.graph import Topology
from persia_planner.topology.hardware import DeviceKind
from persia_planner.units import format_bytes

__all__ = ["CANDIDATE_FAMILIES", "Planner", "candidate_plans", "plan", "priced_plan"]


class Planner:
    """Plans models on topologies.

    Args:
        searcher: The search stage (default: greedy construction + local search).
    """

    def __init__(self, searcher: Searcher | None = None):
        self.searcher = searcher or GreedyLocalSearch()

    def plan(self, model: ModelSpec, topology: Topology) -> Plan:
        """Place every table of ``model`` on ``topology``.

        Raises:
            ConstraintError: A table's constraints name a device the topology lacks, or allow no placement its
                devices can hold.
            CapacityError: The model does not fit (or a table fits nowhere its constraints allow); names the short
                capacity, by how much, and what to change.
        """
        check_constraints(model, topology)
        check_capacity(model, topology)
        if model.qcomms is not None:
            return self._search(model, topology)
        # qcomms left to the planner. A narrowed candidate whose lower bound is QCOMMS_MIN_GAIN (5%) below float32's
        # is searched alone, and kept where its plan steps that much faster than its own placement in float32 (else
        # that placement runs in float32): one search. Where no candidate's bound shows such a gain, float32's plan
        # is searched, and then each candidate whose bound is 5% below that plan's step: a loose bound (the servers'
        # traffic, or GPU work that leaves out the trainers' exchange) hid narrowings that halved the exchange making
        # the step (decision 0025). A narrowed plan is kept there only where it steps 5% faster than float32's too.
        wide = dataclasses.replace(model, qcomms=FP32_COMMS)
        wide_cost = CostModel(wide, topology)
        wide_bound = lower_bound(wide_cost)
        cuda = any(g.kind is not DeviceKind.CPU for g in topology.gpus)
        candidates = [
            _Narrowed(CostModel(dataclasses.replace(model, qcomms=c), topology), wide_bound)
            for c in qcomms_candidates(cuda)[1:]
        ]
        # Where the parameter servers' traffic alone makes the bound, narrowing the trainers' collectives leaves it.
        by_servers = bool(wide_bound.parts) and all(p.name in ASYNC_NAMES for p in wide_bound.parts)
        for candidate in candidates if not by_servers else ():
            bound = candidate.bound_below(wide_bound.value_ms * (1 - QCOMMS_MIN_GAIN))
            if bound is not None:
                quantized = self._search(candidate.cost.model, topology, candidate.cost, bound)
                in_fp32 = self._priced(wide_cost, wide_bound, quantized.tables, quantized.alternatives)
                chosen = quantized if quantized.step_ms <= in_fp32.step_ms * (1 - QCOMMS_MIN_GAIN) else in_fp32
                return dataclasses.replace(chosen, qcomms_chosen=True)
        best = self._search(wide, topology, wide_cost, wide_bound)
        for candidate in candidates:
            bound = candidate.bound_below(best.step_ms * (1 - QCOMMS_MIN_GAIN))
            if bound is None:
                continue
            quantized = self._search(candidate.cost.model, topology, candidate.cost, bound)
            in_fp32 = self._priced(wide_cost, wide_bound, quantized.tables, quantized.alternatives)
            if quantized.step_ms <= min(best.step_ms, in_fp32.step_ms) * (1 - QCOMMS_MIN_GAIN):
                best = quantized
            elif in_fp32.step_ms < best.step_ms:
                best = in_fp32
        return dataclasses.replace(best, qcomms_chosen=True)

    def plan_from(
        self,
        model: ModelSpec,
        topology: Topology,
        neighbour: Plan,
        *,
        improve_time_s: float = 0.05,
        full_bound: bool = False,
    ) -> Plan:
        """Re-plan ``model`` on ``topology`` from ``neighbour``, its plan on a cluster that differs by a host or a few
        (:class:`persia_planner.search.WarmStart`): the tables that can stay where they were stay, the others are
        placed greedily, and the local search moves load onto new devices within ``improve_time_s``. The
        collectives' precisions are the neighbour's (or the model's, where it names them).

        Args:
            model: The model the neighbour planned.
            topology: The new cluster.
            neighbour: The plan to start from.
            improve_time_s: The local search's budget.
            full_bound: Report the full lower bound (:func:`persia_planner.bound.lower_bound`, which costs more
                than the re-plan on large models) instead of the dense step's
                (:func:`persia_planner.bound.dense_bound`).

        Raises:
            ConstraintError: As :meth:`plan`.
            CapacityError: As :meth:`plan`.
        """
        check_constraints(model, topology)
        check_capacity(model, topology)
        qcomms = model.qcomms if model.qcomms is not None else neighbour.qcomms
        priced = dataclasses.replace(model, qcomms=qcomms)
        cost = CostModel(priced, topology)
        base = getattr(self.searcher, "config", SearchConfig())
        config = dataclasses.replace(base, improve_time_s=improve_time_s, explain_top=0)
        searcher = GreedyLocalSearch(config, constructor=WarmStart(config, neighbour.tables))
        bound = lower_bound(cost) if full_bound else dense_bound(cost)
        result = searcher.search(cost, bound)
        planned = self._priced(cost, bound, result.placements, result.alternatives)
        return dataclasses.replace(planned, qcomms_chosen=model.qcomms is None and neighbour.qcomms_chosen)

    def _search(
        self, model: ModelSpec, topology: Topology, cost: CostModel | None = None, bound: LowerBound | None = None
    ) -> Plan:
        cost = cost or CostModel(model, topology)
        bound = bound or lower_bound(cost)
        result = self.searcher.search(cost, bound)
        return self._priced(cost, bound, result.placements, result.alternatives)

    @staticmethod
    def _priced(
        cost: CostModel, bound: LowerBound, placements: Mapping[str, TablePlacement], alternatives: Mapping[str, Any]
    ) -> Plan:
        planned = priced_plan(cost, placements, lower_bound_ms=bound.value_ms, alternatives=alternatives)
        parts = {part.name: part.weight for part in bound.parts}
        return dataclasses.replace(planned, bound_parts=parts, bound_binding=bound.binding)


class _Narrowed:
    """A narrowed qcomms candidate's cost model and its lower bound, computed once and only where asked for."""

    def __init__(self, cost: CostModel, wide_bound: LowerBound):
        self.cost, self._wide_bound = cost, wide_bound
        self._probe: float | None = None
        self._bound: LowerBound | None = None

    def bound_below(self, below_ms: float) -> LowerBound | None:
        """The candidate's lower bound where it is under ``below_ms`` (None: the candidate cannot step that fast).
        Probed first at float32's weighting of the bound's functionals (``bound_at``: one weighting, itself a
        bound), so that the full bound is computed only where the probe leaves room."""
        if self._bound is None or (not self._bound.complete and self._bound.value_ms <= below_ms):
            if self._probe is None:
                self._probe = bound_at(self.cost, self._wide_bound) or 0.0
            if self._probe > below_ms:
                return None
            # Stopped as soon as it passes below_ms: all that is asked then. A later, higher below_ms that the
            # stopped bound does not pass computes it whole (its hint guides the search).
            self._bound = lower_bound(self.cost, stop_above=below_ms)
        return self._bound if self._bound.value_ms <= below_ms else None


QCOMMS_MIN_GAIN = 0.05
"""The share of the step a quantized collective must save before the planner narrows it where the model leaves
``qcomms`` to it: narrowing costs accuracy (measured in ``benchmarks/hybrid.py``), so a gain within the cost
model's error is not taken."""


def plan(
    model: ModelSpec,
    topology: Topology,
    *,
    seed: int = 0,
    improve_time_s: float = 5.0,
    explain_top: int = SearchConfig.explain_top,
) -> Plan:
    """Plan ``model`` on ``topology`` with the default search (see :class:`Planner`).

    ``explain_top``: how many of the largest tables get ``Plan.alternatives`` (0: none, which saves re-scoring them;
    the plan is the same).
    """
    config = SearchConfig(seed=seed, improve_time_s=improve_time_s, explain_top=explain_top)
    return Planner(GreedyLocalSearch(config)).plan(model, topology)


def priced_plan(
    cost: CostModel,
    placements: Mapping[str, TablePlacement],
    *,
    lower_bound_ms: float,
    alternatives: Mapping[str, Any] | None = None,
) -> Plan:
    """``placements`` as a :class:`Plan` of ``cost``'s model and topology: its estimate, its devices' usage, and the
    K and PS wire dtype it was priced for.

    Args:
        cost: The cost model of the model and topology.
        placements: Every table's placement (the search's, or another planner's).
        lower_bound_ms: The bound to report beside it.
        alternatives: The search's explanations, if any.
    """
    model = cost.model
    estimate, mem = cost.evaluate(placements)
    return Plan(
        model=model.name,
        topology=cost.topology.name,
        tables=dict(placements),
        devices=usage_of(cost, estimate, mem, placements),
        step_ms=estimate.step_ms,
        lower_bound_ms=lower_bound_ms,
        samples_per_s=estimate.samples_per_s,
        alternatives=dict(alternatives or {}),
        staleness=model.staleness,
        ps_wire_dtype=model.ps_wire_dtype,
        qcomms=cost.qcomms,
    )


_SPLITS = frozenset({Sharding.ROW_WISE, Sharding.COLUMN_WISE, Sharding.TABLE_ROW_WISE, Sharding.TABLE_COLUMN_WISE})
CANDIDATE_FAMILIES: tuple[tuple[str, frozenset[Sharding]], ...] = (
    ("search", frozenset(Sharding)),
    ("whole tables", frozenset(Sharding) - _SPLITS),
    ("no replicas", frozenset(Sharding) - {Sharding.DATA_PARALLEL}),
    ("no row splits", frozenset(Sharding) - {Sharding.ROW_WISE, Sharding.TABLE_ROW_WISE}),
    ("table-wise only", frozenset({Sharding.TABLE_WISE, Sharding.PS_HASH})),
)
"""The searches whose plans :func:`candidate_plans` offers, by name: the full search, then the same search kept from
kinds of sharding whose run-time cost the model prices least surely (a split table's input distribution and extra
output collectives, a replica's all-reduce)."""


def candidate_plans(
    model: ModelSpec,
    topology: Topology,
    *,
    limit: int = 4,
    seed: int = 0,
    improve_time_s: float = 5.0,
    first: Plan | None = None,
) -> list[tuple[str, Plan]]:
    """The plans worth measuring (``persia plan --tune``): the search's, then its best distinct alternatives.

    Each of :data:`CANDIDATE_FAMILIES` is searched; a family that cannot place the model (a table too big for any
    option it keeps) is skipped, and one whose plan equals an earlier one's is dropped. The search's own plan comes
    first, the others by their estimate.

    Args:
        model: The model (with the run's K and wire, :func:`persia_planner.model.specs.with_run_options`).
        topology: The cluster.
        limit: At most this many plans.
        seed: Seed of each search.
        improve_time_s: Local-search budget of each search.
        first: The search's plan, if already made (saves searching it again).
    """
    found: list[tuple[str, Plan]] = []
    for name, shardings in CANDIDATE_FAMILIES:
        if len(found) >= limit:
            break
        if name == "search" and first is not None:
            found.append((name, first))
            continue
        config = SearchConfig(seed=seed, improve_time_s=improve_time_s, shardings=shardings, explain_top=0)
        try:
            candidate = Planner(GreedyLocalSearch(config)).plan(model, topology)
        except PlannerError:
            continue
        if all(dict(candidate.tables) != dict(other.tables) for _, other in found):
            found.append((name, candidate))
    return found[:1] + sorted(found[1:], key=lambda item: item[1].step_ms)


def check_capacity(model: ModelSpec, topology: Topology) -> None:
    """Fail fast, before searching, when the tables cannot fit even if perfectly packed."""
    hbm = sum(topology.hbm_capacity(g) for g in topology.gpus)
    ddr = sum(topology.ddr_capacity(h) for h in topology.trainers)
    ps = sum(topology.ddr_capacity(s) for s in topology.servers)
    total = model.total_bytes
    size = {t.name: t.bytes(model.dtype_of(t)) for t in model.tables}
    if total > hbm + ddr + ps:
        short = total - (hbm + ddr + ps)
        resource = "PS DDR" if topology.servers else "trainer DDR"
        per_server = topology.servers[0].ddr_bytes if topology.servers else None
        fixes = []
        if per_server:
            need = -(-short // topology.ddr_capacity(topology.servers[0]))
            fixes.append(f"add {need} parameter servers of {format_bytes(per_server)}")
        else:
            fixes.append("add parameter servers (hosts with role: parameter_server)")
        if DType.FP32 in model.dtypes:
            fixes.append("set embedding_dtype: fp16")
        fixes.append("reduce table rows")
        raise CapacityError(
            resource,
            short,
            f"the tables need {format_bytes(total)} but HBM + DDR + PS hold {format_bytes(hbm + ddr + ps)} after "
            f"reservations: {resource} is short by {format_bytes(short)}",
            tuple(fixes),
        )
    # A table larger than all of HBM and all of DDR can only go to the parameter servers: each must hold its share.
    local = max(hbm, ddr)
    for table in model.tables:
        if size[table.name] > local and topology.servers and not ps_holds(table.rows, len(topology.servers)):
            raise ps_rows_error(table, len(topology.servers), local)
    largest = max(model.tables, key=lambda t: size[t.name])
    room = max(hbm, ddr, ps)
    if size[largest.name] > room:
        short = size[largest.name] - room
        raise CapacityError(
            "largest tier",
            short,
            f"table {largest.name!r} ({format_bytes(size[largest.name])}) is larger than any tier "
            f"(largest holds {format_bytes(room)}; short by {format_bytes(short)})",
            ("add parameter servers or DDR", "reduce its rows or dim"),
            table=largest.name,
        )
