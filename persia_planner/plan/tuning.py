"""What measured refinement (``persia plan --tune``) found: each candidate plan's measured rate, and the one kept.

The cost model ranks plans; on the user's own hardware a short run decides between the best few. A plan that was
tuned records, in plan.json's ``tuning``, every candidate with its estimate and the samples/s of each timed run, and
the name of the one kept (the plan's tables are that candidate's). The candidates themselves come from
:func:`persia_planner.planner.candidate_plans`; the runs from :mod:`persia_planner.modules.tools.tune`.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from persia_planner.fields import Fields
from persia_planner.limits import MAX_TUNING_CANDIDATES, MAX_TUNING_ROUNDS
from persia_planner.units import Quantity

__all__ = ["MeasuredCandidate", "Tuning", "fastest"]


@dataclass(frozen=True)
class MeasuredCandidate:
    """One candidate plan and what running it measured.

    Attributes:
        name: What the candidate is (``search``, a restricted search such as ``whole tables``, ``torchrec``).
        estimate_step_ms: Its step time under the cost model (None: there is no plan, e.g. TorchRec's planner found
            none).
        samples_per_s: Global samples per second of each timed run, in run order (empty when it could not run).
        error: Why it could not run (one line), or None.
    """

    name: str
    estimate_step_ms: float | None
    samples_per_s: tuple[float, ...] = ()
    error: str | None = None

    @property
    def median_samples_per_s(self) -> float:
        """The median of its runs (0 when it has none)."""
        return statistics.median(self.samples_per_s) if self.samples_per_s else 0.0

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "estimate_step_ms": None if self.estimate_step_ms is None else round(self.estimate_step_ms, 4),
            "samples_per_s": [round(r, 1) for r in self.samples_per_s],
            "median_samples_per_s": round(self.median_samples_per_s, 1),
        }
        if self.error is not None:
            out["error"] = self.error
        return out

    @classmethod
    def from_fields(cls, item: Fields) -> MeasuredCandidate:
        name = item.take_str("name")
        estimate = item.take("estimate_step_ms", Quantity.NUMBER, default=None)
        rates = item.take("samples_per_s", default=[])
        if not isinstance(rates, list) or len(rates) > MAX_TUNING_ROUNDS or not all(_rate(r) for r in rates):
            raise item.error("samples_per_s", f"expected a list of at most {MAX_TUNING_ROUNDS} numbers >= 0")
        item.take("median_samples_per_s", Quantity.NUMBER, default=None)  # derived: written for readers only
        error = item.take_str("error", default=None)
        item.finish()
        return cls(name, None if estimate is None else float(estimate), tuple(float(r) for r in rates), error)


def _rate(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < float("inf")


@dataclass(frozen=True)
class Tuning:
    """The record of a tuning: the candidates as measured, and which was kept.

    Attributes:
        chosen: The name of the candidate kept (the plan's tables are its).
        steps: Training steps of each timed run.
        budget_s: The time the tuning was allowed.
        candidates: Every candidate, the search's first.
    """

    chosen: str
    steps: int
    budget_s: float
    candidates: tuple[MeasuredCandidate, ...]

    def candidate(self, name: str) -> MeasuredCandidate:
        for c in self.candidates:
            if c.name == name:
                return c
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        return {
            "chosen": self.chosen,
            "steps": self.steps,
            "budget_s": self.budget_s,
            "candidates": [c.to_dict() for c in self.candidates],
        }

    @classmethod
    def from_fields(cls, fields: Fields) -> Tuning:
        """Read plan.json's ``tuning``; errors name the key path."""
        chosen = fields.take_str("chosen")
        steps = fields.take_positive("steps", Quantity.COUNT)
        budget = fields.take("budget_s", Quantity.NUMBER)
        candidates = tuple(
            MeasuredCandidate.from_fields(item)
            for _, item in fields.take_list("candidates", max_items=MAX_TUNING_CANDIDATES)
        )
        fields.finish()
        if chosen not in {c.name for c in candidates}:
            raise fields.error(
                "chosen", f"{chosen!r} is none of the candidates", fixes=("re-run 'persia plan --tune'",)
            )
        return cls(chosen, int(steps), float(budget), candidates)


def fastest(candidates: Sequence[MeasuredCandidate]) -> MeasuredCandidate:
    """The candidate with the highest median rate; on a tie (or when none ran) the first, the search's own plan.

    Raises:
        ValueError: No candidates.
    """
    if not candidates:
        raise ValueError("no candidates")
    best = candidates[0]
    for c in candidates[1:]:
        if c.median_samples_per_s > best.median_samples_per_s:
            best = c
    return best
