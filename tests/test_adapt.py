"""``persia train --adapt`` in the trainers: when trainer 0 decides, what every trainer moves to, the rollback of a
plan that measures slower, the bound on re-plans, what the logs say, and a plan pinned by constraints."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
import yaml
from plans import local_placement

from persia_planner import load_topology
from persia_planner.cost.analytic import CostModel
from persia_planner.model.qcomms import QComms
from persia_planner.model.specs import DType, ModelSpec, TableSpec
from persia_planner.modules.train.adapt import DECIDER_ENV, Adapter, plan_file
from persia_planner.modules.train.config import TrainConfig
from persia_planner.modules.train.metrics_log import JsonLinesSink, logged_steps
from persia_planner.modules.train.timeline import Window
from persia_planner.paths import DEFAULT_TOPOLOGY
from persia_planner.plan.plan import Plan
from persia_planner.replan import Decision, Reason

TOPOLOGY = load_topology(DEFAULT_TOPOLOGY)
SPEC = ModelSpec("adapt", 64, (TableSpec("a", 100, 16), TableSpec("b", 50, 16)))
FIRST = {"a": local_placement(100, 16, device="trainer0/cpu0"), "b": local_placement(50, 16, device="trainer0/cpu0")}
SECOND = FIRST | {"b": local_placement(50, 16, device="trainer0/cpu1")}
WINDOW = 2
# What the scripted decider answers, in turn (a module global: the Adapter calls it in this process).
SCRIPT: list[Decision] = []


def scripted(model, topology, tables, measured, **_options) -> Decision:
    return SCRIPT.pop(0)


def _decision(reason: str, tables: dict | None = None, qcomms: QComms | None = None) -> Decision:
    return Decision(
        migrate=tables is not None, reason=reason, tables=tables, predicted_old_ms=2.0, predicted_new_ms=1.0,
        refit=None, off_by=0.5, qcomms=qcomms,
    )  # fmt: skip


@pytest.fixture
def group(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A trainers' group of one (the decision's broadcast), the scripted decider, and the run's log folder."""
    monkeypatch.setenv(DECIDER_ENV, f"{__name__}:scripted")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    SCRIPT.clear()
    try:
        yield tmp_path
    finally:
        dist.destroy_process_group()


def _adapter(log_dir: Path, **options) -> tuple[Adapter, JsonLinesSink]:
    cfg = TrainConfig(adapt=True, adapt_window=WINDOW, checkpoint="ckpt", log_dir=str(log_dir), **options)
    sink = JsonLinesSink(log_dir / "metrics.jsonl")
    return Adapter(cfg, SPEC, TOPOLOGY, FIRST, 0, 0, sink), sink


def _steps(adapter: Adapter, first: int, last: int, step_ms: float) -> dict[int, dict]:
    """Steps ``first..last``, each window measuring ``step_ms``: the steps where every trainer was told to move."""
    moves = {}
    for step in range(first, last + 1):
        window = Window(step - WINDOW + 1, step, step_ms, {"data": 0.1})
        target = adapter.after_step(step, lambda n, w=window: w, steps_left=100, save_s=0.5)
        if target is not None:
            moves[step] = target
            adapter.started(step, build_s=1.0)  # as the trainer's migration does
    return moves


def test_trainer_0_decides_after_a_warm_up_window_and_again_while_within_the_threshold(group):
    adapter, sink = _adapter(group)
    SCRIPT.extend([_decision(Reason.WITHIN), _decision(Reason.SAME_PLAN)])
    assert _steps(adapter, 1, 12, 2.0) == {}
    assert SCRIPT == []  # asked at steps 4 (after the warm-up 1-2 and the window 3-4) and 6; then no more
    sink.close()
    events = [line for line in logged_steps(group / "metrics.jsonl") if line.get("event") == "adapt"]
    assert [(e["step"], e["reason"]) for e in events] == [(4, Reason.WITHIN), (6, Reason.SAME_PLAN)]
    assert adapter.summary() == [
        {"index": 0, "from_step": 0, "to_step": None, "predicted_ms": adapter.plans[0].predicted_ms,
         "measured_ms": 2.0, "refitted_ms": 2.0, "reason": "initial", "tables_moved": [], "qcomms": None},
    ]  # fmt: skip


def test_a_plan_that_measures_slower_is_rolled_back_and_that_counts_as_a_re_plan(group, capfd):
    adapter, sink = _adapter(group, adapt_max=2)
    SCRIPT.append(_decision(Reason.FASTER, SECOND))
    moves = _steps(adapter, 1, 4, 2.0)
    assert moves == {4: SECOND}
    moves = _steps(adapter, 5, 20, 3.0)  # the new plan's window (after its own warm-up) is slower
    assert moves == {8: FIRST}
    assert SCRIPT == [] and adapter.replans == 2 and not adapter.deciding
    plans = adapter.summary()
    assert [(p["index"], p["from_step"], p["to_step"], p["reason"], p["tables_moved"]) for p in plans] == [
        (0, 0, 4, "initial", []),
        (1, 4, 8, Reason.FASTER, ["b"]),
        (2, 8, None, "rollback", ["b"]),
    ]
    assert [p["measured_ms"] for p in plans] == [2.0, 3.0, None]
    sink.close()
    assert json.loads(plan_file(group, 2).read_text())["tables"]["b"]["shards"][0]["device"] == "trainer0/cpu0"
    said = [line for line in capfd.readouterr().err.splitlines() if line.startswith("persia train --adapt")]
    assert len(said) == 2 and "faster plan: moving b (plan 1)" in said[0] and "rollback" in said[1], said


def test_a_re_plan_may_change_the_collectives_alone_and_a_rollback_restores_them(group):
    """The planner chose the collectives (``adapt_qcomms``): a decision that narrows them moves no table, yet the job
    migrates; the new plan is priced, logged and written with them, and a rollback returns to float32."""
    fp16 = QComms(DType.FP16, DType.FP16)
    adapter, sink = _adapter(group, adapt_qcomms=True)
    SCRIPT.append(_decision(Reason.FASTER, FIRST, fp16))
    assert _steps(adapter, 1, 4, 2.0) == {4: FIRST}
    assert adapter.current.qcomms == fp16 and adapter.current.tables_moved == []
    assert adapter.current.predicted_ms == pytest.approx(
        CostModel(dataclasses.replace(SPEC, qcomms=fp16), TOPOLOGY).evaluate(FIRST)[0].step_ms
    )
    assert Plan.from_dict(json.loads(plan_file(group, 1).read_text())).qcomms == fp16
    assert _steps(adapter, 5, 8, 3.0) == {8: FIRST}  # measured slower than plan 0: back to it
    assert adapter.current.reason == "rollback" and adapter.current.qcomms is None
    sink.close()
    assert [p["qcomms"] for p in adapter.summary()] == [None, {"forward": "fp16", "backward": "fp16"}, None]


def test_no_more_re_plans_than_adapt_max(group):
    adapter, _ = _adapter(group, adapt_max=1)
    SCRIPT.append(_decision(Reason.FASTER, SECOND))
    assert _steps(adapter, 1, 4, 2.0) == {4: SECOND}
    assert _steps(adapter, 5, 30, 1.0) == {}  # faster: kept; and the one re-plan is done
    assert SCRIPT == [] and adapter.replans == 1 and not adapter.deciding


def test_the_planners_decision_on_a_window_as_measured(group, monkeypatch):
    """The real ``decide``: a window measured as predicted is within the threshold; the summary's refitted step is
    the refit's."""
    monkeypatch.delenv(DECIDER_ENV)
    adapter, _ = _adapter(group)
    predicted = adapter.plans[0].predicted_ms
    assert _steps(adapter, 1, 4, predicted) == {}
    assert adapter.deciding and adapter.plans[0].measured_ms == predicted
    assert adapter.plans[0].refitted_ms == pytest.approx(predicted, rel=0.05)


@pytest.mark.processes
@pytest.mark.timeout(600)
def test_adapt_with_a_plan_pinned_by_constraints_says_so_once_and_trains_on(tmp_path):
    tables = [
        {"name": name, "rows": rows, "dim": 16, "constraints": {"sharding_types": ["table_wise"], "tiers": ["hbm"],
         "devices": ["trainer0/cpu0"]}}
        for name, rows in (("a", 100), ("b", 50))
    ]  # fmt: skip
    model = tmp_path / "model.yaml"
    model.write_text(yaml.safe_dump({"name": "pinned", "batch_size": 64, "tables": tables}))
    done = subprocess.run(
        [sys.executable, "-m", "persia_planner.cli", "train", "--model", str(model), "--adapt", "--adapt-window", "2",
         "--steps", "8", "--mode", "sync", "--eval-batches", "1", "--checkpoint", str(tmp_path / "ckpt"), "--json"],
        capture_output=True, text=True, timeout=500,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if "pinned" in line]
    assert said == [
        "persia train --adapt: every table's placement is pinned by the model's constraints: training on without "
        "re-planning"
    ], done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["steps"] == 8 and [p["reason"] for p in result["plans"]] == ["initial"]


def test_adapt_needs_a_checkpoint_folder_and_options_in_range():
    from persia_planner.errors import PlannerError

    with pytest.raises(PlannerError, match=r"^--adapt needs --checkpoint DIR: a migration to a new plan saves"):
        TrainConfig(adapt=True)
    with pytest.raises(PlannerError, match=r"^--adapt-threshold must be a share in \[0, 10\]"):
        TrainConfig(adapt_threshold=float("nan"))
    with pytest.raises(PlannerError, match=r"^--adapt-max must be in \[1, 100\] re-plans, got 0"):
        TrainConfig(adapt_max=0)
    with pytest.raises(PlannerError, match=r"^--adapt-window must be in \[1, 1,000,000,000\] steps, got 0"):
        TrainConfig(adapt_window=0)


def test_a_new_plan_that_would_not_run_as_written_is_not_migrated_to(group):
    """A decider's plan with a table in host memory (``ddr``: TorchRec runs it on CPU as plain memory, not as
    planned) is refused before any checkpoint: every trainer hears why and trains on under its plan."""
    from persia_planner.tiers import Tier

    unrunnable = FIRST | {"b": local_placement(50, 16, tier=Tier.DDR, device="trainer0/cpu0")}
    adapter, sink = _adapter(group)
    SCRIPT.append(_decision(Reason.FASTER, unrunnable))
    assert _steps(adapter, 1, 2 * WINDOW + 2, 3.0) == {}
    sink.close()
    events = [r for r in logged_steps(group / "metrics.jsonl") if r.get("event") == "adapt"]
    assert len(events) == 1 and "ddr" in events[0]["reason"]


def test_no_window_measures_the_profiled_steps(group):
    """The breakdown's profiled steps run slower: a window that holds one is not measured, the next clean one is."""
    adapter, sink = _adapter(group)
    adapter.profiled_through = 7  # steps 1-7 profiled: the windows ending at 4, 6 and 8 hold some of them
    SCRIPT.append(_decision(Reason.SAME_PLAN))
    assert _steps(adapter, 1, 5 * WINDOW, 3.0) == {}
    sink.close()
    decided = [r["step"] for r in logged_steps(group / "metrics.jsonl") if r.get("event") == "adapt"]
    assert decided == [10]  # steps 9-10: the first window after the profiled steps
