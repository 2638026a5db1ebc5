"""A run's terms: what ``persia train`` measured of its step, beside what the cost model predicts of its plan with
every refitted factor 1 (:func:`predicted_terms`, the all-to-all's split by sharding type:
:func:`predicted_a2a_by_sharding`); what :func:`persia_planner.cost.refit.refit` fits its factors to."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from persia_planner.cost.analytic import CostModel
from persia_planner.errors import PlannerError
from persia_planner.model.specs import ModelSpec
from persia_planner.placement.shards import TablePlacement
from persia_planner.topology.cost_constants import REFIT_SHARDINGS, SCALED_TERMS, scale_name
from persia_planner.topology.graph import Topology

__all__ = [
    "LUMPED",
    "SUMMARY_A2A_KEY",
    "SYNC_TERMS",
    "RunTerms",
    "plan_id_of",
    "predicted_a2a_by_sharding",
    "predicted_terms",
]

SYNC_TERMS = ("embedding", "all_to_all", "dense", "all_reduce")
LUMPED = "sync"  # the four sync terms measured together (a run with parameter-server tables is not profiled)
# The summary key (``persia train``'s summary.json) of the plan's all-to-all split by sharding type, every factor 1.
SUMMARY_A2A_KEY = "plan_a2a_by_sharding_unscaled_ms"


@dataclass(frozen=True)
class RunTerms:
    """One run's measured terms beside the model's prediction of them.

    Attributes:
        source: Where the run's figures come from (its log folder).
        plan_id: Which plan it ran (runs of one plan cannot separate factors).
        staleness: The run's staleness bound K.
        step_ms: Its measured median step.
        measured_ms: Measured terms (ms): any of :data:`~persia_planner.topology.cost_constants.SCALED_TERMS`, or
            ``sync`` for the four sync terms together.
        predicted_ms: The model's five terms for the run's plan with every factor 1.
        measured_at: When the run ended (ISO 8601, UTC), where known.
        predicted_a2a_by_sharding_ms: The part of ``predicted_ms["all_to_all"]`` that each sharding type's exchange
            makes (:func:`predicted_a2a_by_sharding`), by type; the rest is the all-to-alls' fixed cost (all of it
            where the mapping is empty: no table is exchanged). None where not known: the all-to-all part is then
            one piece.
        ps_wait_ms: Of the measured ``ps``, the time the trainers waited for the servers' rows (the rest is their
            pushes); None where not known (all of it is taken as waiting).
    """

    source: str
    plan_id: str
    staleness: int
    step_ms: float
    measured_ms: Mapping[str, float]
    predicted_ms: Mapping[str, float]
    measured_at: str | None = None
    predicted_a2a_by_sharding_ms: Mapping[str, float] | None = None
    ps_wait_ms: float | None = None

    @classmethod
    def from_summary(
        cls,
        summary: Mapping[str, Any],
        predicted_ms: Mapping[str, float],
        source: str,
        a2a_by_sharding_ms: Mapping[str, float] | None = None,
    ) -> RunTerms:
        """A ``persia train`` summary's terms: its ``step_ms``, ``step_breakdown_ms`` (``ps`` = ``ps_wait`` +
        ``push``) and ``staleness``; the all-to-all split by sharding type from ``a2a_by_sharding_ms``, else from the
        summary's :data:`SUMMARY_A2A_KEY` where it has one.

        Raises:
            PlannerError: ``summary`` is no ``persia train`` summary (the message names ``source``).
        """
        step = summary.get("step_ms") if isinstance(summary, Mapping) else None
        breakdown = summary.get("step_breakdown_ms") if isinstance(summary, Mapping) else None
        staleness = summary.get("staleness") if isinstance(summary, Mapping) else None
        if (
            not _is_number(step)
            or not step > 0
            or not isinstance(breakdown, Mapping)
            or not all(_is_number(v) for v in breakdown.values())
            or not isinstance(staleness, int)
        ):
            raise PlannerError(
                f"{source}: not a persia train summary (needs step_ms > 0, step_breakdown_ms and staleness)",
                fixes=("give the --log-dir folder of a finished persia train run",),
            )
        b = {str(k): float(v) for k, v in breakdown.items()}
        ps = b.get("ps_wait", 0.0) + b.get("push", 0.0)
        with_ps = "ps_wait" in b or "push" in b
        if all(t in b for t in SYNC_TERMS):  # profiled: each term alone
            measured = {t: b[t] for t in SYNC_TERMS} | ({"ps": ps} if with_ps else {})
        elif "other" in b:  # parameter-server tables: their wait and push timed, the rest together
            measured = {LUMPED: b["other"], "ps": ps}
        else:  # neither a profile nor servers: the whole step is the trainer's
            measured = {LUMPED: float(step)}
        plan_id = summary.get("plan_id")
        if not isinstance(plan_id, str) or not plan_id:
            plan_id = plan_id_of(predicted_ms)  # one plan predicts the same terms
        at = summary.get("finished_at")
        split = a2a_by_sharding_ms if a2a_by_sharding_ms is not None else summary.get(SUMMARY_A2A_KEY)
        return cls(
            source=source,
            plan_id=plan_id,
            staleness=staleness,
            step_ms=float(step),
            measured_ms=measured,
            predicted_ms={t: float(predicted_ms.get(t, 0.0)) for t in SCALED_TERMS},
            measured_at=at if isinstance(at, str) else None,
            predicted_a2a_by_sharding_ms=_split_of(split),
            ps_wait_ms=b.get("ps_wait"),
        )


def _split_of(split: Any) -> dict[str, float] | None:
    """The known sharding types' positive parts of an all-to-all split (None: no split given)."""
    if not isinstance(split, Mapping):
        return None
    return {s: float(split[s]) for s in REFIT_SHARDINGS if _is_number(split.get(s)) and split[s] > 0}


def plan_id_of(content: Any) -> str:
    """A short id of a plan from its content (its placements' JSON, or the terms it predicts)."""
    text = json.dumps(content, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _unrefitted(topology: Topology) -> Topology:
    """``topology`` with every refitted factor 1 (terms and sharding types): what a run's terms are set beside."""
    return topology.with_constants({scale_name(t): 1.0 for t in (*SCALED_TERMS, *REFIT_SHARDINGS)})


def predicted_terms(model: ModelSpec, topology: Topology, tables: Mapping[str, TablePlacement]) -> dict[str, float]:
    """The five terms of the plan's step on its slowest device (ms) with every factor 1: what :class:`RunTerms`
    sets beside a run's measured ones (``model`` as the plan was priced: ``Plan.priced_model``)."""
    return CostModel(model, _unrefitted(topology)).evaluate(tables)[0].slowest_gpu_terms()


def predicted_a2a_by_sharding(
    model: ModelSpec, topology: Topology, tables: Mapping[str, TablePlacement]
) -> dict[str, float]:
    """The part of :func:`predicted_terms`' ``all_to_all`` that each sharding type's tables' exchange makes on the
    same device (ms, every factor 1), by type (:data:`~persia_planner.topology.cost_constants.REFIT_SHARDINGS`, the
    types with a part); the rest of the term is the all-to-alls' fixed cost. What :class:`RunTerms` needs to refit
    a factor per type."""
    cost = CostModel(model, _unrefitted(topology))
    estimate, _ = cost.evaluate(tables)
    g = int(np.argmax(estimate.per_gpu["step"]))
    lay = cost.layout
    columns = [lay.nvlink.start + g, lay.nic_sync.start + int(cost.gpu_host[g])]
    split: dict[str, float] = {}
    for table in model.tables:
        placement = tables[table.name]
        sharding = placement.sharding.value
        if sharding in REFIT_SHARDINGS:
            loads, _ = cost.placement_loads(table, placement)
            split[sharding] = split.get(sharding, 0.0) + float(loads[columns].sum())
    return {s: ms for s, ms in split.items() if ms > 0}
