"""Re-planning a running job from what it measured (``persia train --adapt``): refit the cost model to the job's
measured step, plan again under the refitted model, and say whether moving to the new plan pays for itself.

Torch-free: the trainers measure and migrate (:mod:`persia_planner.modules.train.adapt`); this module decides. It
plans as ``persia plan`` does (:class:`persia_planner.planner.Planner`, the collectives' precisions chosen again
where the plan chose them), so it sits above the planner's pipeline.
A decision compares both plans under the *refitted* model (the one that predicts what the job measured), never the
plan's own score under the model that mispriced it, and charges the migration against what the faster step saves
over the steps left.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from persia_planner.bound import lower_bound
from persia_planner.cost.analytic import CostModel
from persia_planner.cost.refit import Refit, RunTerms, refit
from persia_planner.errors import PlannerError
from persia_planner.kinds import Sharding
from persia_planner.model.qcomms import FP32_COMMS, QComms
from persia_planner.model.specs import ModelSpec
from persia_planner.placement.shards import TablePlacement
from persia_planner.planner import Planner
from persia_planner.search import GreedyLocalSearch, SearchConfig
from persia_planner.topology.graph import Topology

__all__ = ["MIN_GAIN", "Decision", "Reason", "decide", "pinned", "refitted_topology", "tables_moved"]

MIN_GAIN = 0.03
"""The least share of the step a new plan must save, under the refitted model, to be worth a migration at all: a
smaller difference is inside what two windows of one plan measure apart on a shared machine."""


class Reason:
    """Why a decision is what it is (the summary and the JSONL carry these words)."""

    WITHIN = "within threshold"
    PINNED = "pinned"
    SAME_PLAN = "no faster plan"
    TOO_COSTLY = "gain below migration cost"
    FASTER = "faster plan"


@dataclass(frozen=True)
class Decision:
    """What a re-planning window decided.

    Attributes:
        migrate: Whether to move to :attr:`tables`.
        reason: One of :class:`Reason`'s phrases.
        tables: The new plan's placements when ``migrate``, else None.
        predicted_old_ms: The current plan's step under the refitted model.
        predicted_new_ms: The new plan's step under the refitted model (None when no plan was searched).
        refit: The refit of the measured windows.
        off_by: The measured step over the current model's prediction, minus 1.
        qcomms: The new plan's collectives' precisions when ``migrate`` (they may be all that changes), else None.
    """

    migrate: bool
    reason: str
    tables: Mapping[str, TablePlacement] | None
    predicted_old_ms: float
    predicted_new_ms: float | None
    refit: Refit
    off_by: float
    qcomms: QComms | None = None


def pinned(model: ModelSpec) -> bool:
    """Whether the model's constraints leave every table one placement (one sharding type on one tier, on named
    devices where the type places on devices): then no re-plan can change anything."""

    def one(table) -> bool:
        c = table.constraints
        if c.sharding_types is None or c.tiers is None or len(c.sharding_types) != 1 or len(c.tiers) != 1:
            return False
        sharding, tier = next(iter(c.sharding_types)), next(iter(c.tiers))
        # a replica goes to every GPU, a server tier's shares to every server (a cached one picks a cache size)
        spread = sharding is Sharding.DATA_PARALLEL or (sharding is Sharding.PS_HASH and not tier.spec.cached)
        return spread or c.devices is not None

    return bool(model.tables) and all(one(t) for t in model.tables)


def refitted_topology(topology: Topology, fit: Refit) -> Topology:
    """``topology`` with the refit's factors as its constants."""
    return topology.with_constants(fit.constants())


def tables_moved(old: Mapping[str, TablePlacement], new: Mapping[str, TablePlacement]) -> tuple[str, ...]:
    """The tables whose placement differs between two plans, in ``new``'s order."""
    return tuple(name for name, p in new.items() if (was := old.get(name)) is None or not was.same_as(p))


def decide(
    model: ModelSpec,
    topology: Topology,
    tables: Mapping[str, TablePlacement],
    measured: RunTerms,
    *,
    threshold: float,
    steps_left: int | None,
    migration_s: float,
    seed: int = 0,
    improve_time_s: float = 2.0,
    history: Sequence[RunTerms] = (),
    choose_qcomms: bool = False,
) -> Decision:
    """Decide whether a job that measured ``measured`` under ``tables`` should move to another plan.

    Args:
        model: The model as the plan was priced (its staleness, batch, qcomms).
        topology: The topology the job runs on, with the constants it was planned with.
        tables: The placements the job runs now.
        measured: The window just measured (its ``predicted_ms`` at factors 1.0).
        threshold: Re-plan only when the measured step is more than this share off the current prediction.
        steps_left: Steps the job still trains (None: not known; the gain per step alone decides).
        migration_s: What a migration costs, in seconds (checkpoint, rebuild, load).
        seed: The search's seed.
        improve_time_s: The search's improvement budget.
        history: Earlier windows (of this or other plans): the refit fits all of them with ``measured``.
        choose_qcomms: The running plan chose its collectives' precisions (the model leaves them to the planner):
            choose them again; otherwise ``model.qcomms`` stays.

    Returns:
        The decision; ``refit`` always holds the refitted factors.
    """
    # The factors the plan was priced with, per term and per sharding type's exchange: what the refit starts from.
    prior = topology.constants.term_scales() | topology.constants.sharding_scales()
    predicted_now = CostModel(model, topology).evaluate(tables)[0].step_ms
    off_by = measured.step_ms / predicted_now - 1 if predicted_now > 0 else math.inf
    fit = refit([*history, measured], prior=prior)
    refitted = refitted_topology(topology, fit)
    old_ms = CostModel(model, refitted).evaluate(tables)[0].step_ms

    def keep(reason: str, new_ms: float | None = None) -> Decision:
        return Decision(False, reason, None, old_ms, new_ms, fit, off_by)

    if abs(off_by) <= threshold:
        return keep(Reason.WITHIN)
    if pinned(model):
        return keep(Reason.PINNED)
    search = GreedyLocalSearch(SearchConfig(seed=seed, improve_time_s=improve_time_s, explain_top=0))
    try:
        if choose_qcomms:  # as `persia plan` plans a model that leaves its collectives to the planner
            planned = Planner(search).plan(dataclasses.replace(model, qcomms=None), refitted)
            new_tables, new_qcomms = dict(planned.tables), planned.qcomms
        else:  # the collectives as the model names them: the search alone re-places the tables
            cost = CostModel(model, refitted)
            new_tables, new_qcomms = dict(search.search(cost, lower_bound(cost)).placements), model.qcomms
    except PlannerError:  # nothing fits under the refitted figures: the running plan stays
        return keep(Reason.SAME_PLAN)
    new_ms = CostModel(dataclasses.replace(model, qcomms=new_qcomms), refitted).evaluate(new_tables)[0].step_ms
    changed = bool(tables_moved(tables, new_tables)) or (new_qcomms or FP32_COMMS) != (model.qcomms or FP32_COMMS)
    if not changed or new_ms > old_ms * (1 - MIN_GAIN):
        return keep(Reason.SAME_PLAN, new_ms)
    saved_s = (old_ms - new_ms) / 1e3 * (steps_left if steps_left is not None else math.inf)
    if saved_s <= migration_s:
        return keep(Reason.TOO_COSTLY, new_ms)
    return Decision(True, Reason.FASTER, new_tables, old_ms, new_ms, fit, off_by, new_qcomms)
