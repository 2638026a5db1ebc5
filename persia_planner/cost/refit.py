"""Refitting the cost model from runs: the factor on each step term at which runs' measured terms are predicted.

A run of ``persia train`` measures its step split into the model's terms (``step_breakdown_ms``): with a profile,
``embedding``, ``all_to_all``, ``dense`` and ``all_reduce``; with parameter-server tables (not profiled) the servers'
wait and push (``ps``) and the rest of the step together (``sync``). The model predicts the same terms for the run's
plan (:meth:`persia_planner.cost.terms.Estimate.slowest_gpu_terms`). Each factor ``f_t`` multiplies its term in the
model (``CostConstants.<term>_scale``); the all-to-all part is split further, into its fixed cost and each sharding
type's exchange (:func:`predicted_a2a_by_sharding`), and a type's exchange has a factor ``m_s`` of its own on top of
``f_all_to_all`` (``CostConstants.<type>_scale``: what TorchRec adds to a type's ids and pooled output on CPU differs
by type, and a type's share of the step differs by plan). So every run gives linear equations

    measured_t    = f_t * predicted_t                                   embedding, all_reduce, measured alone
    measured_a2a + measured_dense = f_a2a * a2a + f_dense * dense       a profiled run's two (see below)
    measured_sync = sum over the four sync terms of f_t * predicted_t   the sync terms lumped
    measured_ps   = f_ps * predicted_ps                                 K = 0: the step waits for all of it
    step          = f_ps * predicted_ps                                 K >= 1, where the step waits for the servers

with ``f_all_to_all * predicted_all_to_all`` read as ``f_all_to_all * (fixed + sum over types s of m_s * exchange_s)``
(linear in each product ``f_all_to_all * m_s``; where the split is known the fixed cost, the collectives' latency
that calibration measures alone, is taken at its prior factor). A profiled run's all-to-all and dense parts are one
equation: the model prices TorchRec's input distribution in the step's fixed time (``dense``) where the profile
counts it in its all-to-all ranges. At K >= 1 the servers' time overlaps the trainer's work: a run whose trainers
hardly wait for the servers' rows gives no equation for ``ps`` (the servers kept up: ``f_ps * predicted_ps <= step``
bounds the factor instead), and its trainers' own pushes are trainer work, in their ``sync`` work. The equations are
solved by least squares of each residual as a share of what its equation measured (a small run weighs as much as a
large one, and a term measured alone holds its factor however small beside its step; a value under 2% of its
step is weighed as 2% of it), in the factors' logarithms. A factor that no equation holds keeps its prior;
factors the equations cannot tell apart (runs of one plan, whose terms appear in the same proportions in every
equation, or of plans so alike that only the runs' noise separates them: a direction whose singular value, the parts
taken at unit length, is under 5% of the strongest) are named, and a penalty holds the factors along those
directions at their priors' ratios: a sum the runs measure only whole scales its parts alike, and a direction seen
only through the runs' noise no longer sends factors to the range's ends. The directions the equations determine
are met exactly. Factors stay within :data:`~persia_planner.topology.cost_constants.SCALE_RANGE`.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from persia_planner.cost.run_terms import (
    LUMPED,
    SUMMARY_A2A_KEY,
    SYNC_TERMS,
    RunTerms,
    plan_id_of,
    predicted_a2a_by_sharding,
    predicted_terms,
)
from persia_planner.errors import PlannerError
from persia_planner.topology.cost_constants import REFIT_SHARDINGS, SCALE_RANGE, SCALED_TERMS, scale_name

# RunTerms and the predictions it sets beside a run's measurements are kept in run_terms.py; they are named here too,
# where a refit's callers import them from.
__all__ = [
    "LUMPED",
    "SUMMARY_A2A_KEY",
    "SYNC_TERMS",
    "Refit",
    "RunTerms",
    "TermRow",
    "exchange_part",
    "plan_id_of",
    "predicted_a2a_by_sharding",
    "predicted_terms",
    "refit",
    "refitted_profile",
]

# At K >= 1 a run whose trainers wait for the servers' rows at least this share of its step is taken to wait for them.
PS_BOUND_SHARE = 0.1
# Singular values below this share of the largest: a direction the equations do not determine. Not a rounding
# threshold: two runs of nearly one plan see a second direction only through their noise, and a fit along it put
# factors at the range's ends (embedding 15, dense 0.05) where one common factor predicts both runs as well.
_RANK_TOLERANCE = 5e-2
# A part whose weight in an undetermined direction is above this is one of the parts that direction mixes.
_PARTICIPATION = 0.2
# An equation's residual is taken as a share of its measured value, or of this share of its run's step if larger.
_WEIGHT_FLOOR_SHARE = 0.02
# The weight that holds the log-factors off the directions the runs do not determine: far above any residual's, so
# that along them the factors keep their priors' ratios; zero on the directions the runs determine, which are met.
_WEAK_PENALTY = 1e2
_SOLVE_ITERATIONS = 200


def exchange_part(sharding: str) -> str:
    """The name of a sharding type's exchange among the refit's parts: ``all_to_all.<type>``."""
    return f"all_to_all.{sharding}"


# The pieces the equations price, each with its own unknown: the five terms (the all-to-all's fixed cost under its
# name) and each sharding type's exchange; and the term each belongs to.
PARTS = (*SCALED_TERMS, *(exchange_part(s) for s in REFIT_SHARDINGS))
_TERM_OF = {p: p for p in SCALED_TERMS} | {exchange_part(s): "all_to_all" for s in REFIT_SHARDINGS}
_SHARDING_OF = {exchange_part(s): s for s in REFIT_SHARDINGS}
# The terms a profiled run measures only together (see _sums).
PAIRED = ("all_to_all", "dense")
# An all-to-all remainder below this share of the term is the split's rounding, not a fixed cost to fit.
_REMAINDER_TOLERANCE = 1e-9


@dataclass(frozen=True)
class TermRow:
    """One term of one run: the model's prediction at the factors its plan was priced with, what the run measured
    (None where it was not measured alone), and the prediction at the refitted factors (ms).

    ``term`` is one of the five, ``sync`` (the four together) or ``step``; ``source`` names the run."""

    term: str
    predicted_ms: float
    measured_ms: float | None
    refitted_ms: float
    source: str = ""


@dataclass(frozen=True)
class Refit:
    """Refitted factors and how they predict the runs they came from.

    Attributes:
        factors: The factor per term (:data:`~persia_planner.topology.cost_constants.SCALED_TERMS`).
        not_separable: Terms the runs could not determine alone: unmeasured ones (their prior kept) and ones along a
            direction the runs do not determine, kept at their priors' ratios (a sharding type's exchange as
            ``all_to_all.<type>``).
        rows: Per run, per term: predicted / measured / refitted.
        clamped: Terms (or ``all_to_all.<type>``) whose factor was held at the edge of the allowed range.
        notes: What ``not_separable`` and ``clamped`` mean for these runs, in words.
        sharding_factors: The factor on each sharding type's exchange, on top of ``factors["all_to_all"]``, for the
            types the runs' plans use (:data:`~persia_planner.topology.cost_constants.REFIT_SHARDINGS`); a type no run
            used is not named (its factor stays as it was).
    """

    factors: Mapping[str, float]
    not_separable: tuple[str, ...]
    rows: tuple[TermRow, ...]
    clamped: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=())
    sharding_factors: Mapping[str, float] = field(default_factory=dict)

    def constants(self) -> dict[str, float]:
        """The factors as cost-model constants (``<term>_scale``, ``<type>_scale``), for
        ``Topology.with_constants``."""
        terms = {scale_name(t): float(f) for t, f in self.factors.items()}
        return terms | {scale_name(s): float(f) for s, f in self.sharding_factors.items()}


def _parts(run: RunTerms) -> dict[str, float]:
    """The run's predicted ms by part (:data:`PARTS`): its terms, the all-to-all's split into its fixed cost (under
    ``all_to_all``) and each sharding type's exchange."""
    parts = {p: 0.0 for p in PARTS} | {t: float(run.predicted_ms[t]) for t in SCALED_TERMS}
    split = run.predicted_a2a_by_sharding_ms
    if split is not None:
        a2a = parts["all_to_all"]
        for sharding, ms in split.items():
            parts[exchange_part(sharding)] = float(ms)
        rest = a2a - sum(split.values())
        parts["all_to_all"] = rest if rest > _REMAINDER_TOLERANCE * a2a else 0.0
    return parts


def _bound_by_servers(run: RunTerms) -> bool:
    """At K >= 1, whether the run's trainers waited for the servers' rows (its ``ps`` is mostly that wait)."""
    ps = run.measured_ms.get("ps")
    if ps is None:
        return False
    wait = ps if run.ps_wait_ms is None else min(run.ps_wait_ms, ps)
    return wait >= PS_BOUND_SHARE * run.step_ms


def _targets(run: RunTerms) -> dict[str, float]:
    """What each of the run's equations sets its terms equal to, by measured key (see the module docstring): at
    K >= 1 the step where the trainers waited for the servers (``ps``), their work without the wait in their lumped
    ``sync`` work; where the servers kept up, no ``ps`` equation and the trainers' own wait and push in ``sync``."""
    targets = dict(run.measured_ms)
    ps = targets.get("ps")
    if run.staleness > 0 and ps is not None:
        del targets["ps"]
        if _bound_by_servers(run):
            targets["ps"] = run.step_ms  # the step waits for the servers: their time is the step
            if LUMPED in targets and run.ps_wait_ms is not None:
                targets[LUMPED] += ps - min(run.ps_wait_ms, ps)  # the pushes: the trainers' own work
        elif LUMPED in targets:
            targets[LUMPED] += ps
    return targets


def _sums(targets: Mapping[str, float]) -> list[tuple[tuple[str, ...], float]]:
    """The equations of a run's targets: the terms each sums, and its measured value. A profiled run's all-to-all
    and dense parts are one equation: the model prices TorchRec's input distribution in the step's fixed time (in
    ``dense``, ``step_overhead_ms``, calibrated against table-wise DMP jobs) where the profile counts it in its
    all-to-all ranges, so only their sum is the same quantity in both; runs of plans that divide it differently
    (sharding types, data-parallel tables) separate the two."""
    paired = all(t in targets for t in PAIRED)
    out = [(PAIRED, sum(targets[t] for t in PAIRED))] if paired else []
    for key, measured in targets.items():
        if key == LUMPED:
            out.append((SYNC_TERMS, measured))
        elif key in SCALED_TERMS and not (paired and key in PAIRED):
            out.append(((key,), measured))
    return out


def _ps_cap(runs: Sequence[RunTerms]) -> float:
    """The largest ``ps`` factor the runs allow: at K >= 1 a run whose trainers did not wait for the servers had
    servers that kept up, ``f_ps * predicted_ps <= step`` (inf: no such run)."""
    caps = [
        r.step_ms / r.predicted_ms["ps"]
        for r in runs
        if r.staleness > 0 and "ps" in r.measured_ms and not _bound_by_servers(r) and r.predicted_ms["ps"] > 0
    ]
    return min(caps, default=math.inf)


def _equations(runs: Sequence[RunTerms], base: Mapping[str, float]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(coefficients per equation and part, measured values, weights): one row per measured value of each run.

    Where a run's all-to-all is split by sharding type, its fixed cost (the collectives' latency, which
    calibration measures alone) is taken at its prior factor, on the measured side: only the exchanges are fitted
    (a fixed cost per step beside the dense part's fixed time would be told from it by noise alone)."""
    rows: list[list[float]] = []
    values: list[float] = []
    weights: list[float] = []
    for run in runs:
        parts = _parts(run)
        fixed = 0.0
        if run.predicted_a2a_by_sharding_ms is not None:
            fixed, parts["all_to_all"] = base["all_to_all"] * parts["all_to_all"], 0.0
        for terms, measured in _sums(_targets(run)):
            row = [parts[p] if _TERM_OF[p] in terms else 0.0 for p in PARTS]
            if not any(row):
                continue  # the model has nothing there to scale
            rows.append(row)
            values.append(measured - (fixed if "all_to_all" in terms else 0.0))
            # Each equation's residual as a share of what it measured: a term measured alone holds its factor however
            # small beside its step (a sliver weighed by the step let the lumped equations of other runs pull it to
            # the range's ends). Floored at a small share of the step: a term of a fraction of a millisecond is
            # mostly timer noise.
            weights.append(1.0 / max(measured, _WEIGHT_FLOOR_SHARE * run.step_ms))
    shape = (len(rows), len(PARTS))
    return np.array(rows, dtype=float).reshape(shape), np.array(values, dtype=float), np.array(weights, dtype=float)


def _weak_directions(a: np.ndarray) -> np.ndarray:
    """The directions (rows, one per direction, in the parts' log-factors) that the equations ``a`` do not
    determine: the right singular vectors of ``a`` with each column at unit length, whose singular value is under
    :data:`_RANK_TOLERANCE` of the strongest, and those no equation reaches at all.

    Each column at unit length: what decides is whether the runs hold the parts in different proportions, not how
    large a part is (a 2 ms embedding term measured alone is determined, however small beside a 300 ms step). Along
    such a direction the factors keep their priors' ratios: a sum the runs measure only whole scales its parts
    alike."""
    unit = a / np.maximum(np.linalg.norm(a, axis=0), 1e-300)
    _, s, vt = np.linalg.svd(unit, full_matrices=True)
    rank = int((s > _RANK_TOLERANCE * s.max()).sum()) if s.size else 0
    return vt[rank:]


def _undetermined(weak: np.ndarray, measured: list[int]) -> list[int]:
    """The measured parts that a weak direction mixes (its weight on them above :data:`_PARTICIPATION`)."""
    mixed = np.abs(weak).max(axis=0) > _PARTICIPATION if weak.size else np.zeros(len(measured), dtype=bool)
    return [measured[j] for j in range(len(measured)) if mixed[j]]


def _solve(
    a: np.ndarray, y: np.ndarray, bounds: Sequence[tuple[float, float]], weak: np.ndarray
) -> tuple[np.ndarray, list[int]]:
    """Multipliers ``m`` (on the priors) of least ``|a m - y|^2``, with each ``m_j`` within ``bounds[j]`` and
    ``log m`` held off the ``weak`` directions (rows) by a penalty: Gauss-Newton in ``log m`` with Levenberg's
    damping, a multiplier at a bound it presses against held there. Returns ``m`` and the indices at a bound."""
    n = a.shape[1]
    lo = np.log([max(b[0], 1e-300) for b in bounds])
    hi = np.log([b[1] for b in bounds])
    z = np.clip(np.zeros(n), lo, hi)
    pull = math.sqrt(_WEAK_PENALTY) * weak.reshape(-1, n)

    def residuals(z: np.ndarray) -> np.ndarray:
        return np.concatenate([a @ np.exp(z) - y, pull @ z])

    cost, damping = float(residuals(z) @ residuals(z)), 1e-3
    for _ in range(_SOLVE_ITERATIONS):
        r = residuals(z)
        jac = np.vstack([a * np.exp(z), pull])
        grad = jac.T @ r
        # A multiplier at a bound that the gradient presses further out is held for this step.
        free = ~(((z <= lo + 1e-12) & (grad > 0)) | ((z >= hi - 1e-12) & (grad < 0)))
        if not free.any():
            break
        jf = jac[:, free]
        normal, rhs = jf.T @ jf, -(jf.T @ r)
        while True:
            step = np.linalg.solve(normal + damping * np.diag(np.maximum(np.diag(normal), 1e-12)), rhs)
            trial = z.copy()
            trial[free] = np.clip(z[free] + step, lo[free], hi[free])
            trial_cost = float(residuals(trial) @ residuals(trial))
            if trial_cost <= cost or damping > 1e12:
                break
            damping *= 10.0
        if trial_cost > cost:
            break
        moved = float(np.abs(trial - z).max())
        z, cost, damping = trial, trial_cost, max(damping / 10.0, 1e-12)
        if moved < 1e-12:
            break
    m = np.exp(z)
    held = []
    for j in range(n):
        for edge in bounds[j]:
            if abs(z[j] - math.log(max(edge, 1e-300))) <= 1e-9:
                m[j] = edge  # the bound itself, not its logarithm's round trip
                held.append(j)
                break
    return m, held


def _priors(prior: Mapping[str, float] | None) -> tuple[dict[str, float], dict[str, float]]:
    """Each part's factor as the runs' plans were priced (their terms' factors; an exchange's: the all-to-all's
    times its type's), and each sharding type's factor."""
    given = prior or {}
    base = {t: float(given.get(t, 1.0)) for t in SCALED_TERMS}
    shardings = {s: float(given.get(s, 1.0)) for s in REFIT_SHARDINGS}
    return base | {exchange_part(s): base["all_to_all"] * shardings[s] for s in REFIT_SHARDINGS}, shardings


def _bounds(j: int, base: Mapping[str, float], ps_cap: float, a2a_fitted: bool) -> tuple[float, float]:
    """The range of part ``j``'s multiplier (on its prior) that keeps its factor in range: a term's in
    :data:`SCALE_RANGE`, ``ps`` at most ``ps_cap``; an exchange's (the all-to-all's times its type's) with its type's
    in range, given the all-to-all's prior, or where the all-to-all's is fitted too, in the range's square (its type's
    factor is held to the range once the all-to-all's is known)."""
    lo, hi = SCALE_RANGE
    part = PARTS[j]
    if part not in _SHARDING_OF:
        span = (lo, min(hi, max(ps_cap, lo))) if part == "ps" else (lo, hi)
    elif a2a_fitted:
        span = (lo * lo, hi * hi)
    else:
        span = (lo * base["all_to_all"], hi * base["all_to_all"])
    return span[0] / base[part], span[1] / base[part]


def refit(runs: Sequence[RunTerms], prior: Mapping[str, float] | None = None) -> Refit:
    """Least-squares factors from the runs' equations (see the module docstring).

    Args:
        runs: The runs, each with its measured and predicted terms.
        prior: The factors the runs' plans were priced with, by term and by sharding type (default 1 each): kept
            where no run measures a term, and the ratios kept between terms along a direction the runs do not
            determine.

    Raises:
        PlannerError: No run, or no run measured anything the model predicts.
    """
    if not runs:
        raise PlannerError("no run to refit from", fixes=("give the log folder of one or more persia train runs",))
    base, sharding_prior = _priors(prior)
    a, y, w = _equations(runs, base)
    if not len(y):
        raise PlannerError(
            "the runs measured no term the model predicts", fixes=("give runs with a measured step breakdown",)
        )
    priced = a * np.array([base[p] for p in PARTS])  # in multiples of the prior
    measured = [j for j in range(len(PARTS)) if priced[:, j].any()]
    weighted = priced[:, measured] * w[:, None]
    weak = _weak_directions(weighted)
    cap, a2a_fitted = _ps_cap(runs), PARTS.index("all_to_all") in measured
    bounds = [_bounds(j, base, cap, a2a_fitted) for j in measured]
    multipliers, held_at = _solve(weighted, y * w, bounds, weak)
    fitted = dict(base)
    for j, m in zip(measured, multipliers, strict=True):
        fitted[PARTS[j]] = base[PARTS[j]] * float(m)
    held = [measured[k] for k in held_at]
    factors = {t: fitted[t] for t in SCALED_TERMS}
    a2a = factors["all_to_all"]
    lo, hi = SCALE_RANGE
    shardings: dict[str, float] = {}
    clamped_types: list[str] = []
    for j in measured:
        sharding = _SHARDING_OF.get(PARTS[j])
        if sharding is not None:
            ratio = fitted[PARTS[j]] / a2a
            shardings[sharding] = min(max(ratio, lo), hi)
            if not lo * (1 + 1e-9) < ratio < hi * (1 - 1e-9):
                clamped_types.append(PARTS[j])
    unmeasured = [t for t in SCALED_TERMS if SCALED_TERMS.index(t) not in measured]
    exchanged = bool(shardings) and "all_to_all" in unmeasured  # the fixed cost kept: the exchanges carry the term
    together = [PARTS[j] for j in _undetermined(weak, measured)]
    at_edge = [PARTS[j] for j in held if PARTS[j] in SCALED_TERMS]
    capped = [t for t in at_edge if t == "ps" and lo < factors[t] < hi]  # held by the runs whose servers kept up
    clamped = tuple(t for t in at_edge if t not in capped) + tuple(clamped_types)
    notes = _notes(runs, [t for t in unmeasured if not (exchanged and t == "all_to_all")], together, clamped)
    if exchanged:
        notes += ("all_to_all: its fixed cost kept at the prior factor, each sharding type's exchange refitted",)
    if capped:
        notes += (
            f"ps held at {factors['ps']:.3g}: at K >= 1 runs whose trainers did not wait for the servers had servers "
            "that kept up with their steps",
        )
    rows = tuple(
        row for run in runs for row in _rows(run, (base, sharding_prior), (factors, sharding_prior | shardings))
    )
    not_separable = tuple(t for t in SCALED_TERMS if t in unmeasured or t in together) + tuple(
        p for p in together if p in _SHARDING_OF
    )
    return Refit(factors, not_separable, rows, clamped, notes, shardings)


def _notes(
    runs: Sequence[RunTerms], unmeasured: list[str], together: list[str], clamped: tuple[str, ...]
) -> tuple[str, ...]:
    notes = []
    hidden = [t for t in unmeasured if t == "ps" and any("ps" in r.measured_ms for r in runs)]
    if hidden:
        notes.append("the servers' time hid behind the trainers' work (K >= 1) in every run: ps kept at the prior")
    if [t for t in unmeasured if t not in hidden]:
        notes.append(f"no run measured {', '.join(t for t in unmeasured if t not in hidden)}: kept at the prior factor")
    if together:
        plans = len({r.plan_id for r in runs})
        who = "runs of one plan" if plans == 1 else f"these runs ({plans} plans)"
        notes.append(
            f"{who} cannot separate {', '.join(together)}: the prior divides their share, each moved as little "
            "as the runs allow (runs of other plans, or a profiled run without parameter-server tables, separate "
            "them)"
        )
    if clamped:
        lo, hi = SCALE_RANGE
        notes.append(f"{', '.join(clamped)} held at the edge of [{lo:g}, {hi:g}]: the runs ask for more than a rate")
    return tuple(notes)


def _step(terms: Mapping[str, float], staleness: int) -> float:
    """The step from its terms on one trainer (the model's: the servers' time adds at K = 0, overlaps at K >= 1)."""
    sync = sum(terms[t] for t in SYNC_TERMS)
    return sync + terms["ps"] if staleness == 0 else max(sync, terms["ps"])


def _terms_at(run: RunTerms, factors: Mapping[str, float], shardings: Mapping[str, float]) -> dict[str, float]:
    """The run's five terms under ``factors`` (by term) and ``shardings`` (by type: absent, 1)."""
    parts = _parts(run)
    terms = {t: factors[t] * parts[t] for t in SCALED_TERMS}
    for sharding in REFIT_SHARDINGS:
        terms["all_to_all"] += factors["all_to_all"] * shardings.get(sharding, 1.0) * parts[exchange_part(sharding)]
    return terms


def _rows(
    run: RunTerms,
    prior: tuple[Mapping[str, float], Mapping[str, float]],
    fitted: tuple[Mapping[str, float], Mapping[str, float]],
) -> list[TermRow]:
    before, after = _terms_at(run, *prior), _terms_at(run, *fitted)
    rows = [TermRow(t, before[t], run.measured_ms.get(t), after[t], run.source) for t in SCALED_TERMS]
    targets = _targets(run)
    if LUMPED in targets:  # the value its equation holds (at K >= 1 with the servers hidden: the visible PS time too)
        pair = [sum(terms[t] for t in SYNC_TERMS) for terms in (before, after)]
        rows.append(TermRow(LUMPED, pair[0], targets[LUMPED], pair[1], run.source))
    rows.append(TermRow("step", _step(before, run.staleness), run.step_ms, _step(after, run.staleness), run.source))
    return rows


def refitted_profile(profile_data: Mapping[str, Any], refit: Refit, runs: Sequence[RunTerms]) -> dict[str, Any]:
    """A profile's YAML content with the ``refit:`` section of ``refit`` (replacing any earlier one, whose factors
    on sharding types these runs did not use are kept): a topology naming it plans with the refitted factors
    (``HardwareProfile.fitted_constants``)."""
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    earlier = profile_data.get("refit")
    kept = earlier.get("sharding_factors") if isinstance(earlier, Mapping) else None
    shardings = dict(kept) if isinstance(kept, Mapping) else {}
    shardings |= {s: round(float(f), 6) for s, f in refit.sharding_factors.items()}
    section: dict[str, Any] = {"factors": {t: round(float(f), 6) for t, f in refit.factors.items()}}
    if shardings:
        section["sharding_factors"] = shardings
    section |= {
        "runs": [
            {"log_dir": r.source, "plan": r.plan_id, "measured_at": r.measured_at or now, "step_ms": float(r.step_ms)}
            for r in runs
        ],
        "not_separable": list(refit.not_separable),
        "terms": [
            {
                "run": row.source,
                "term": row.term,
                "predicted_ms": float(row.predicted_ms),
                "measured_ms": None if row.measured_ms is None else float(row.measured_ms),
                "refitted_ms": float(row.refitted_ms),
            }
            for row in refit.rows
        ],
    }
    return {**{k: v for k, v in profile_data.items() if k != "refit"}, "refit": section}
