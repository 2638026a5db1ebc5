"""Why the largest tables went where they went: each one's chosen option against the best other option.

The search scores, for the largest tables, the best placement under each other option with every other table left
where it is (``Plan.alternatives``); this module reads them back as :class:`Explanation` values and lines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from persia_planner.model.specs import ModelSpec
from persia_planner.report.rows import describe
from persia_planner.topology.graph import Topology
from persia_planner.units import format_bytes

if TYPE_CHECKING:
    from persia_planner.plan.plan import Plan

__all__ = ["Explanation", "explain", "explanations"]


@dataclass(frozen=True)
class Explanation:
    """Why a large table went where it went: the chosen option against the best other option.

    Attributes:
        table: Table name.
        bytes: Table size (weights + optimizer state, one copy).
        chosen: The chosen option, e.g. ``"column_wise x8 on hbm"``.
        mode: ``sync`` or ``async``.
        step_ms: The plan's step time.
        next_best: The best option of another sharding / tier, or ``None`` when nothing else fits.
        next_step_ms: The step time with the table placed by ``next_best`` and every other table unchanged.
        note: Why there is no ``next_best`` (``None`` when there is one).
    """

    table: str
    bytes: int
    chosen: str
    mode: str
    step_ms: float
    next_best: str | None
    next_step_ms: float | None
    note: str | None = None

    @property
    def delta_ms(self) -> float | None:
        return None if self.next_step_ms is None else self.next_step_ms - self.step_ms

    @property
    def delta_pct(self) -> float | None:
        if self.next_step_ms is None or self.step_ms <= 0:
            return None
        return 100.0 * (self.next_step_ms - self.step_ms) / self.step_ms

    def line(self) -> str:
        head = f"{self.table} ({format_bytes(self.bytes)}) -> {self.chosen} ({self.mode})"
        if self.next_best is None or self.next_step_ms is None:
            return f"{head}: {self.note or 'no other option was scored'}"
        return (
            f"{head}: next best is {self.next_best} at {self.next_step_ms:.2f} ms per step "
            f"({self.delta_ms:+.2f} ms / {self.delta_pct:+.1f}% vs {self.step_ms:.2f} ms)"
        )


def explanations(plan: Plan, model: ModelSpec, topology: Topology) -> list[Explanation]:
    """For each table in ``plan.alternatives`` (the largest tables): its option and the best other option.

    Options are compared by (sharding, tier); ``plan.alternatives`` holds, per table, the step time of the best
    placement under each option with every other table left where it is, sorted best first.
    """
    sizes = {t.name: t.bytes(model.dtype_of(t)) for t in model.tables}
    local = sum(topology.hbm_capacity(g) for g in topology.gpus) + sum(
        topology.ddr_capacity(h) for h in topology.trainers
    )
    result = []
    for name, alternatives in plan.alternatives.items():
        placement = plan.tables.get(name)
        if placement is None:
            continue
        key = (placement.sharding, placement.tier)
        chosen = describe(placement)
        other = next((a for a in alternatives if (a.option.sharding, a.option.tier) != key), None)
        size = sizes.get(name, sum(s.bytes for s in placement.shards))
        note = None
        if other is None and not placement.tier.spec.local and not placement.tier.spec.cached and size > local:
            note = (
                f"only the parameter servers can hold it ({format_bytes(size)} is more than all usable GPU HBM and "
                f"host DDR together, {format_bytes(local)})"
            )
        elif other is None:
            note = (
                "no other option was scored (the search skips options that cannot fit next to the other tables "
                "and dominated ones, e.g. slower tiers while HBM has room or splits of a cold table)"
            )
        result.append(
            Explanation(
                table=name,
                bytes=size,
                chosen=chosen,
                mode=placement.mode.value,
                step_ms=plan.step_ms,
                next_best=other.option.describe() if other is not None else None,
                next_step_ms=other.step_ms if other is not None else None,
                note=note,
            )
        )
    return result


def explain(plan: Plan, model: ModelSpec, topology: Topology) -> list[str]:
    """Why each large table went where it went, one line per table (see :func:`explanations`)."""
    return [e.line() for e in explanations(plan, model, topology)]
