"""A run's refit of the cost model: the plan's prediction beside the run's measured terms, and the profile refitted
so that this run is predicted, written beside the run's logs (``--log-dir``).

The refit is :mod:`persia_planner.cost.refit`'s (torch-free). A run whose topology names a profile gets
``profile.fitted.yaml``: that profile with a ``refit:`` section, which a topology can name in its place. A run whose
topology has no profile has no raw measurements to carry the factors: it gets ``refit.yaml``, the factors as the
``constants:`` a topology.yaml takes (``<term>_scale``), with the same ``refit:`` section beside them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from persia_planner.cost.refit import (
    SUMMARY_A2A_KEY,
    Refit,
    RunTerms,
    plan_id_of,
    predicted_a2a_by_sharding,
    predicted_terms,
    refit,
    refitted_profile,
)
from persia_planner.errors import PlannerError
from persia_planner.fields import load_document
from persia_planner.outputs import Output, OutputKind, write_output
from persia_planner.topology.profile import HardwareProfile

if TYPE_CHECKING:
    from persia_planner.model.specs import ModelSpec
    from persia_planner.modules.train.config import TrainConfig
    from persia_planner.modules.train.job import Job
    from persia_planner.modules.train.timeline import Timeline
    from persia_planner.plan.plan import Plan
    from persia_planner.topology.graph import Topology

__all__ = [
    "FITTED_FACTORS",
    "FITTED_PROFILE",
    "PlanPrediction",
    "refit_of_run",
    "refit_rows",
    "refit_so_far",
    "write_fitted_profile",
]

log = logging.getLogger(__name__)

FITTED_PROFILE = "profile.fitted.yaml"
FITTED_FACTORS = "refit.yaml"


@dataclass(frozen=True)
class PlanPrediction:
    """What the cost model predicted of a plan's step, as a run's summary reports it.

    Attributes:
        terms_ms: The five terms on the slowest device at the factors the plan was priced with.
        unscaled_ms: The same with every factor 1 (what a refit sets beside the measured terms).
        factors: The factors the plan was priced with (the topology's ``<term>_scale`` constants, by term, and its
            ``<type>_scale`` ones, by sharding type).
        profile_source: The trainers' profile file (None: the topology names none).
        plan_id: A short id of the plan's placements.
        a2a_by_sharding_ms: Of ``unscaled_ms["all_to_all"]``, each sharding type's exchange (a refit's factor per
            type).
    """

    terms_ms: dict[str, float]
    unscaled_ms: dict[str, float]
    factors: dict[str, float]
    profile_source: str | None
    plan_id: str
    a2a_by_sharding_ms: dict[str, float]

    @classmethod
    def of(cls, model: ModelSpec, topology: Topology, plan: Plan) -> PlanPrediction:
        """The prediction of ``plan`` of ``model`` (as given to the run) on ``topology``."""
        from persia_planner.cost.analytic import CostModel

        priced = plan.priced_model(model)
        terms = CostModel(priced, topology).evaluate(plan.tables)[0].slowest_gpu_terms()
        profile = topology.measured_profile()
        return cls(
            terms_ms=terms,
            unscaled_ms=predicted_terms(priced, topology, plan.tables),
            factors=topology.constants.term_scales() | topology.constants.sharding_scales(),
            profile_source=profile.path if profile is not None else None,
            plan_id=plan_id_of(plan.to_dict()["tables"]),
            a2a_by_sharding_ms=predicted_a2a_by_sharding(priced, topology, plan.tables),
        )

    def add_to(self, summary: MutableMapping[str, Any]) -> None:
        """Put the prediction into a run's summary: ``plan_step_terms_ms``, ``plan_step_terms_unscaled_ms``,
        ``plan_factors``, ``profile_source``, ``plan_id`` and ``plan_a2a_by_sharding_unscaled_ms``."""
        summary["plan_step_terms_ms"] = self.terms_ms
        summary["plan_step_terms_unscaled_ms"] = self.unscaled_ms
        summary["plan_factors"] = self.factors
        summary["profile_source"] = self.profile_source
        summary["plan_id"] = self.plan_id
        summary[SUMMARY_A2A_KEY] = self.a2a_by_sharding_ms


def refit_of_run(summary: Mapping[str, Any], predicted_terms: Mapping[str, float], source: str) -> Refit:
    """The factors refitted from one run's summary (its plan's ``plan_factors`` as the prior).

    Raises:
        PlannerError: The summary is no ``persia train`` summary, or measured nothing the model predicts.
    """
    run = RunTerms.from_summary(summary, predicted_terms, source)
    prior = summary.get("plan_factors")
    return refit([run], prior if isinstance(prior, Mapping) else None)


def refit_rows(found: Refit) -> list[dict[str, Any]]:
    """A refit's rows as a summary holds them: term, predicted, measured and refitted ms."""
    return [
        {"term": r.term, "predicted_ms": r.predicted_ms, "measured_ms": r.measured_ms, "refitted_ms": r.refitted_ms}
        for r in found.rows
    ]


def write_fitted_profile(
    log_dir: str | Path, summary: Mapping[str, Any], predicted_terms: Mapping[str, float], profile_source: str | None
) -> Path | None:
    """Refit the model from the run in ``log_dir`` and write the result there: ``profile.fitted.yaml`` (the profile
    at ``profile_source`` with the refit) or, without a profile, ``refit.yaml`` (the factors as ``constants:``).

    Args:
        log_dir: The run's log folder (persia's: written in place, atomically).
        summary: The run's summary so far (``step_ms``, ``step_breakdown_ms``, ``staleness``, ``plan_factors``).
        predicted_terms: The plan's five terms with every factor 1 (``plan_step_terms_unscaled_ms``).
        profile_source: The profile the plan was priced with, or None.

    Returns:
        The file written, or None where the run measured nothing to refit from (no step yet).

    Raises:
        PlannerError: The profile cannot be read (the message names it).
    """
    folder = Path(log_dir)
    step = summary.get("step_ms")
    if not isinstance(step, int | float) or not step > 0:
        return None
    found = refit_of_run(summary, predicted_terms, str(folder))
    run = RunTerms.from_summary(summary, predicted_terms, str(folder))
    about = f"refitted from the persia train run in {folder}"
    if profile_source is None:
        content = refitted_profile({}, found, [run])
        text = OutputKind.FACTORS.header(f"{about}; the topology names no profile: give these constants: in")
        text += "# topology.yaml to plan with them\n"
        text += yaml.safe_dump({"constants": found.constants(), **content}, sort_keys=False)
        path = folder / FITTED_FACTORS
    else:
        data, source = load_document(profile_source, "give the profile the plan was priced with")
        content = refitted_profile(data, found, [run])
        HardwareProfile.from_dict(content, source)  # what a topology will read: a profile still
        text = OutputKind.PROFILE.header(about) + yaml.safe_dump(content, sort_keys=False)
        path = folder / FITTED_PROFILE
    kind = OutputKind.PROFILE if path.name == FITTED_PROFILE else OutputKind.FACTORS
    # Replaces only the file an earlier checkpoint of a run wrote there: a user's file of that name stays.
    write_output(Output("--log-dir", path, kind), lambda tmp: tmp.write_text(text), overwrite=True)
    return path


def refit_so_far(
    cfg: TrainConfig, job: Job, timeline: Timeline, with_ps: bool, step: int, start_step: int, first_step: int
) -> None:
    """With ``--log-dir``: the model refitted to a run's steps so far (:func:`write_fitted_profile`), from trainer 0
    at each checkpoint. ``start_step``: where the current plan started (after a migration), ``first_step``: where
    the run did; after a migration only the current plan's steps count."""
    if not cfg.log_dir or not timeline.step_ms:
        return
    from persia_planner.cost.refit import predicted_terms
    from persia_planner.modules.train.timeline import median

    profile = job.topology.measured_profile()
    if start_step == first_step:  # the run's steps so far, as its summary will give them
        step_ms, breakdown = median(timeline.unprofiled(timeline.step_ms)), timeline.breakdown_ms(with_ps)
    elif step > start_step:  # after a migration: the current plan's steps only
        window = timeline.window(step - start_step, with_ps, step)
        step_ms, breakdown = window.step_ms, window.breakdown_ms
    else:
        return
    summary = {
        "step_ms": step_ms,
        "step_breakdown_ms": breakdown,
        "staleness": cfg.effective_staleness,
        "plan_factors": job.topology.constants.term_scales() | job.topology.constants.sharding_scales(),
    }
    try:
        terms = predicted_terms(job.spec, job.topology, job.tables)
        write_fitted_profile(cfg.log_dir, summary, terms, profile.path if profile is not None else None)
    except PlannerError as err:  # training goes on: the refit is a by-product
        log.warning("no refitted profile at step %d: %s", step, err)
