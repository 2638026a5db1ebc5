"""``persia train --adapt`` in the trainers: measure each plan's step in windows, let trainer 0 decide whether to move
to another plan (:func:`persia_planner.replan.decide`, torch-free), and tell every trainer.

After each start or migration the job runs a warm-up window of ``--adapt-window`` steps, then measures windows of as
many steps (the median step and its parts). At the end of each window trainer 0 decides and broadcasts the
decision, so every trainer migrates at the same step (:mod:`persia_planner.modules.train.trainer` carries the move
out: checkpoint, rebuild, resume under the new plan, :mod:`.migration`):

- a plan reached by a migration whose first window measures slower than the plan before it is left for that plan
  again (a rollback; it is always allowed, and counts as a re-plan);
- otherwise, while fewer than ``--adapt-max`` re-plans happened, ``decide`` refits the cost model on every window
  so far and says whether a plan predicted faster by more than the migration costs exists. A decision not to move
  because the measured step is within ``--adapt-threshold`` is asked again after the next window; any other (no
  faster plan, too small a gain, a plan pinned by constraints) ends the re-planning for this plan.

Where the plan chose the collectives' precisions (``TrainConfig.adapt_qcomms``), a re-plan chooses them again: a
migration may change them alone (no table moves; the model is rebuilt with the new precisions).

Every plan goes to the summary (``plans``), the metrics' JSON lines (``event: plan`` when one starts and when its
window is measured, ``event: adapt`` for each decision) and TensorBoard (``plan/index``, ``plan/predicted_ms``,
``plan/measured_ms``); each plan also to ``<log-dir>/plan.<n>.json``.

Tests force a decision: ``PERSIA_ADAPT_DECIDER=module:function`` names a function with ``decide``'s signature that
trainer 0 calls instead.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from persia_planner.errors import PlannerError
from persia_planner.model.qcomms import FP32_COMMS, QComms
from persia_planner.model.specs import ModelSpec
from persia_planner.modules.train.config import TrainConfig
from persia_planner.modules.train.metrics_log import MetricsSink
from persia_planner.modules.train.timeline import Window
from persia_planner.placement.shards import TablePlacement
from persia_planner.topology.graph import Topology

if TYPE_CHECKING:
    from persia_planner.plan.plan import Plan

__all__ = ["DECIDER_ENV", "Adapter", "PlanRun", "plan_file", "plan_of"]

log = logging.getLogger(__name__)

DECIDER_ENV = "PERSIA_ADAPT_DECIDER"
"""``module:function``: called by trainer 0 instead of :func:`persia_planner.replan.decide` (a test's forced
decision)."""

INITIAL, ROLLBACK = "initial", "rollback"


@dataclass
class PlanRun:
    """One plan of a run: when it ran, what it was predicted and measured to take.

    Attributes:
        index: 0 for the plan the run started with, then one more per migration.
        from_step: The step it started after.
        to_step: The step it ended after (None: the run's last).
        predicted_ms: Its step under the cost model the run planned with.
        measured_ms: Its first measured window's median step (None: not measured).
        refitted_ms: Its step under the refitted model, where a decision computed it.
        reason: Why the run moved to it: ``initial``, ``faster plan`` or ``rollback``.
        tables_moved: The tables whose placement it changed.
        tables: Its placements.
        qcomms: Its collectives' precisions (None: float32, not recorded).
    """

    index: int
    from_step: int
    to_step: int | None
    predicted_ms: float
    measured_ms: float | None
    refitted_ms: float | None
    reason: str
    tables_moved: list[str]
    tables: dict[str, TablePlacement] = field(repr=False)
    qcomms: QComms | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "from_step": self.from_step,
            "to_step": self.to_step,
            "predicted_ms": self.predicted_ms,
            "measured_ms": self.measured_ms,
            "refitted_ms": self.refitted_ms,
            "reason": self.reason,
            "tables_moved": list(self.tables_moved),
            "qcomms": None if self.qcomms is None else self.qcomms.to_dict(),
        }


def plan_file(log_dir: str | os.PathLike[str], index: int) -> Path:
    """Where a run's ``index``-th plan is written: ``<log-dir>/plan.<index>.json``."""
    return Path(log_dir) / f"plan.{index}.json"


class Adapter:
    """A trainer's part in ``--adapt`` (every trainer keeps one; trainer 0's decides and logs).

    Args:
        cfg: The run's options (``adapt``, ``adapt_threshold``, ``adapt_max``, ``adapt_window``).
        spec: The model as the plan was priced.
        topology: The plan's topology.
        tables: The plan the run starts with.
        j: This trainer's rank.
        first_step: The step the run starts after.
        sink: Where trainer 0 logs.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        spec: ModelSpec,
        topology: Topology,
        tables: Mapping[str, TablePlacement],
        j: int,
        first_step: int,
        sink: MetricsSink,
    ) -> None:
        self.cfg, self.spec, self.topology, self.j, self.sink = cfg, spec, topology, j, sink
        self.replans = 0
        self.history: list[Any] = []  # every window's RunTerms: each refit fits them all
        self.segment_start = first_step
        # The last profiled step (the breakdown's window: the profiler slows its steps): no window measures it.
        self.profiled_through = first_step
        self.deciding = cfg.adapt
        self.build_s = 0.0
        self.plans: list[PlanRun] = []
        if not cfg.adapt:  # nothing to measure or price
            return
        from persia_planner.replan import pinned

        self.plans.append(
            PlanRun(0, first_step, None, self._predicted_ms(tables), None, None, INITIAL, [], dict(tables), spec.qcomms)
        )
        if pinned(spec):
            self._say("every table's placement is pinned by the model's constraints: training on without re-planning")
            self.deciding = False
        if j == 0:
            self._log_plan(first_step)

    @property
    def current(self) -> PlanRun:
        return self.plans[-1]

    def started(self, step: int, build_s: float) -> None:
        """A plan's model was built (``build_s`` seconds) and starts after ``step``: its warm-up counts from there."""
        self.segment_start = step
        self.build_s = build_s

    def after_step(
        self, step: int, window: Callable[[int], Window], steps_left: int | None, save_s: float
    ) -> dict[str, TablePlacement] | None:
        """After every step (every trainer, collectively at a window's end): the plan every trainer moves to now,
        or None.

        Args:
            step: The step just done.
            window: The last ``n`` steps' measurement (``n`` -> :class:`Window`).
            steps_left: The steps the run still trains (None: not known).
            save_s: What the last checkpoint took, in seconds.
        """
        size = self.cfg.adapt_window
        since = step - self.segment_start
        if not self.deciding or since < 2 * size or since % size or step - size < self.profiled_through:
            return None
        measured = window(size)
        choice = None
        if self.j == 0:
            try:
                choice = self._choose(measured, steps_left, 2 * save_s + self.build_s)
            except PlannerError as err:  # the others wait in the broadcast: they get the reason, and train on
                log.warning("--adapt: no re-plan after step %d: %s", step, err.message)
                choice = {"measured_ms": measured.step_ms, "tables": None, "reason": err.message, "stop": True}
        shared = [choice]
        dist.broadcast_object_list(shared, src=0)
        return self._apply(step, measured, shared[0])

    # ---- trainer 0 -------------------------------------------------------------------------------------------

    def _choose(self, measured: Window, steps_left: int | None, migration_s: float) -> dict[str, Any]:
        """Trainer 0's decision on the window just measured (a picklable dict every trainer applies)."""
        from persia_planner.cost.refit import RunTerms, predicted_terms
        from persia_planner.replan import Reason, tables_moved

        current = self.current
        first_window = current.measured_ms is None
        summary = {"step_ms": measured.step_ms, "step_breakdown_ms": measured.breakdown_ms}
        summary |= {"staleness": self.cfg.effective_staleness}
        source = f"plan {current.index}, steps {measured.first_step}-{measured.last_step}"
        terms = RunTerms.from_summary(summary, predicted_terms(self.spec, self.topology, current.tables), source)
        out: dict[str, Any] = {"measured_ms": measured.step_ms, "tables": None}
        earlier = self.plans[-2] if len(self.plans) > 1 else None
        before_ms = earlier.measured_ms if earlier is not None and current.reason != ROLLBACK else None
        if first_window and before_ms is not None and measured.step_ms > before_ms:
            assert earlier is not None  # the migration did not pay: back to the better plan
            self.history.append(terms)
            moved = list(tables_moved(current.tables, earlier.tables))
            back = {"tables": earlier.tables, "qcomms": earlier.qcomms, "reason": ROLLBACK, "moved": moved}
            return out | back | {"stop": True}
        if self.replans >= self.cfg.adapt_max:
            return out | {"reason": f"--adapt-max {self.cfg.adapt_max} re-plans done", "stop": True}
        decider = _decider()
        decision = decider(
            self.spec,
            self.topology,
            current.tables,
            terms,
            threshold=self.cfg.adapt_threshold,
            steps_left=steps_left,
            migration_s=migration_s,
            seed=self.cfg.seed,
            history=tuple(self.history),
            choose_qcomms=self.cfg.adapt_qcomms,
        )
        self.history.append(terms)
        out |= {
            "reason": decision.reason,
            "refitted_ms": decision.predicted_old_ms,
            "predicted_new_ms": decision.predicted_new_ms,
            "off_by": getattr(decision, "off_by", None),
            "stop": decision.reason not in (Reason.WITHIN, Reason.FASTER),
        }
        if decision.reason == Reason.PINNED:
            self._say("every table's placement is pinned by the model's constraints: training on without re-planning")
        if decision.migrate and decision.tables is not None:
            # Refused here, before any checkpoint or table moves: a plan TorchRec would not run as written (a
            # PlannerError: every trainer hears "no re-plan" and trains on).
            qcomms = getattr(decision, "qcomms", None) or self.spec.qcomms  # a test's decider may leave it out
            if (qcomms or FP32_COMMS) == (self.spec.qcomms or FP32_COMMS):
                qcomms = self.spec.qcomms  # unchanged, as the plan records it (None: float32 not recorded)
            _check_runs(decision.tables, self.cfg, replace(self.spec, qcomms=qcomms))
            out |= {
                "tables": dict(decision.tables),
                "qcomms": qcomms,
                "moved": list(tables_moved(current.tables, decision.tables)),
            }
        return out

    # ---- every trainer ---------------------------------------------------------------------------------------

    def _apply(self, step: int, measured: Window, choice: dict[str, Any]) -> dict[str, TablePlacement] | None:
        current = self.current
        if current.measured_ms is None:
            current.measured_ms = choice["measured_ms"]
        if choice.get("refitted_ms") is not None:
            current.refitted_ms = choice["refitted_ms"]
        if choice.get("stop"):
            self.deciding = False
        if self.j == 0:
            fields = {k: choice.get(k) for k in ("reason", "measured_ms", "refitted_ms", "predicted_new_ms", "off_by")}
            self.sink.log_event(step, "adapt", {"plan": current.index, "predicted_ms": current.predicted_ms} | fields)
            self.sink.log_event(
                step,
                "plan",
                {"index": current.index, "measured_ms": current.measured_ms, "refitted_ms": current.refitted_ms},
            )
        tables = choice.get("tables")
        if tables is None:
            return None
        self.replans += 1
        current.to_step = step
        # The next plan's collectives (a decision made before they were chosen again keeps the current ones): every
        # later price, plan file and the rebuilt model use them.
        self.spec = replace(self.spec, qcomms=choice.get("qcomms", current.qcomms))
        self.plans.append(
            PlanRun(
                current.index + 1,
                step,
                None,
                self._predicted_ms(tables),
                None,
                choice.get("predicted_new_ms"),
                choice["reason"],
                list(choice.get("moved", [])),
                dict(tables),
                self.spec.qcomms,
            )
        )
        if self.j == 0:
            self._log_plan(step)
            new = self.current.qcomms
            comms = "" if new == current.qcomms else f"; collectives {current.qcomms} -> {new}"
            self._say(
                f"step {step:,}: measured {measured.step_ms:.2f} ms a step under plan {current.index} "
                f"(predicted {current.predicted_ms:.2f} ms); {choice['reason']}: moving "
                f"{', '.join(self.current.tables_moved) or 'no table'}{comms} (plan {self.current.index})"
            )
        return dict(tables)

    def summary(self) -> list[dict[str, Any]]:
        """The run's plans, as the summary's ``plans``."""
        return [p.to_dict() for p in self.plans]

    def _predicted_ms(self, tables: Mapping[str, TablePlacement]) -> float:
        from persia_planner.cost.analytic import CostModel

        return CostModel(self.spec, self.topology).evaluate(tables)[0].step_ms

    def _log_plan(self, step: int) -> None:
        """Trainer 0: the plan that starts after ``step``, to the sinks and (after the first) to its file."""
        plan = self.current
        self.sink.log_event(
            step,
            "plan",
            {
                "index": plan.index,
                "predicted_ms": plan.predicted_ms,
                "reason": plan.reason,
                "tables_moved": plan.tables_moved,
            },
        )
        if self.cfg.log_dir:
            try:
                _write_plan(plan_file(self.cfg.log_dir, plan.index), self.spec, self.topology, plan.tables)
            except PlannerError as err:  # a by-product: the run goes on, the summary and the JSONL still have it
                log.warning("--adapt: plan %d not written: %s", plan.index, err.message)

    def _say(self, text: str) -> None:
        if self.j == 0:
            print(f"persia train --adapt: {text}", file=sys.stderr, flush=True)


def _decider() -> Callable[..., Any]:
    """:func:`persia_planner.replan.decide`, or the function :data:`DECIDER_ENV` names."""
    named = os.environ.get(DECIDER_ENV)
    if not named:
        from persia_planner.replan import decide

        return decide
    module, _, function = named.partition(":")
    return getattr(importlib.import_module(module), function)


def _write_plan(path: Path, spec: ModelSpec, topology: Topology, tables: Mapping[str, TablePlacement]) -> None:
    """``tables`` as a plan.json (with its estimate), which ``persia train --plan`` runs; a file of that name that is
    not a persia plan stays (the one output rule: :func:`persia_planner.outputs.write_output`)."""
    from persia_planner.outputs import Output, OutputKind, write_output

    text = plan_of(spec, topology, tables).to_json() + "\n"
    write_output(Output("--log-dir", path, OutputKind.PLAN), lambda tmp: tmp.write_text(text), overwrite=True)


def plan_of(spec: ModelSpec, topology: Topology, tables: Mapping[str, TablePlacement]) -> Plan:
    """The :class:`~persia_planner.plan.plan.Plan` of ``tables`` (the cost model's estimate and usage; no bound),
    priced for ``spec``'s staleness, PS wire and collectives."""
    from persia_planner.cost.analytic import CostModel
    from persia_planner.plan.plan import Plan, usage_of

    cost = CostModel(spec, topology)
    estimate, memory = cost.evaluate(tables)
    return Plan(
        spec.name,
        topology.name,
        dict(tables),
        usage_of(cost, estimate, memory, tables),
        estimate.step_ms,
        0.0,
        estimate.samples_per_s,
        staleness=spec.staleness,
        ps_wire_dtype=spec.ps_wire_dtype,
        qcomms=spec.qcomms,
    )


def _check_runs(tables: Mapping[str, TablePlacement], cfg: TrainConfig, spec: ModelSpec) -> None:
    """Refuse a new plan that TorchRec and fbgemm would not run as written on these trainers (as the launcher refuses
    a plan before a run)."""
    import torch

    from persia_planner.modules.train.config import sparse_optimizer_of
    from persia_planner.plan.executability import check_executable

    device = "cuda" if torch.cuda.is_available() else "cpu"
    optimizer = sparse_optimizer_of(cfg, spec)
    check_executable(dict(tables), device, dtype=spec.table_dtypes, optimizer=optimizer, qcomms=spec.qcomms)
