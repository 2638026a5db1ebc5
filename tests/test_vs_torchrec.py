"""benchmarks/vs_torchrec.py's pure parts: a case's record puts the plans side by side, and the summary counts ratios
and the cases only ours runs (the planning and training are the benchmark's)."""

from __future__ import annotations

import pytest
from benchmark_modules import load

from persia_planner import load_model, load_topology

vs = load("vs_torchrec")


def _record(name, ours, theirs, status="ok", **more):
    record = {"name": name, "ours_samples_per_s": ours, "torchrec_samples_per_s": theirs, "torchrec_status": status}
    return record | more


def test_summary_takes_ratios_over_the_cases_both_ran_and_counts_the_ones_only_ours_runs():
    records = [
        _record("a", 120.0, 100.0),
        _record("b", 90.0, 100.0),
        _record("c", 200.0, 100.0),
        _record("d", 50.0, None, status="planner_failed"),
        _record("e", 60.0, None, status="over_capacity"),
        _record("f", None, 100.0),  # ours failed to run: neither a ratio nor an only-ours case
    ]
    summary = vs.summarize(records)
    assert summary["min_ratio"] == pytest.approx(0.9)
    assert summary["median_ratio"] == pytest.approx(1.2)
    assert summary["cases_only_ours_runs"] == 2
    assert summary["cases_both_run"] == 3
    assert summary["tuned_min_ratio"] is None and summary["tuned_median_ratio"] is None
    assert summary["median_paired_ratio"] is None  # the records carry none

    views = (1.0, 0.8, 1.3, None, None, None)
    with_views = [r | {"paired_ratio": v, "step_ratio": v} for r, v in zip(records, views, strict=True)]
    assert vs.summarize(with_views)["median_paired_ratio"] == pytest.approx(1.0)
    assert vs.summarize(with_views)["median_step_ratio"] == pytest.approx(1.0)

    tuned = [r | {"tuned_samples_per_s": r["ours_samples_per_s"] and r["ours_samples_per_s"] * 1.5} for r in records]
    summary = vs.summarize(tuned)
    assert summary["tuned_min_ratio"] == pytest.approx(1.35)
    assert summary["tuned_median_ratio"] == pytest.approx(1.8)

    adapted = [
        r | {"adapted_samples_per_s": r["ours_samples_per_s"] and r["ours_samples_per_s"] * 0.5} for r in records
    ]
    summary = vs.summarize(adapted)
    assert summary["adapted_min_ratio"] == pytest.approx(0.45)
    assert summary["adapted_median_ratio"] == pytest.approx(0.6)
    assert summary["tuned_min_ratio"] is None

    nothing = vs.summarize([_record("x", 50.0, None, status="planner_failed")])
    assert nothing["min_ratio"] is None and nothing["median_ratio"] is None and nothing["cases_only_ours_runs"] == 1


def test_case_record_puts_each_plans_rate_and_the_ratio_side_by_side(tmp_path):
    (case,) = vs.pick("roomy-8t-d16-2tr", quick=False)
    model_path, topology_path = case.write(tmp_path)
    model, topology = load_model(model_path), load_topology(topology_path)
    ours = vs.PlanOutcome("ok", mix={"table_wise": 7, "row_wise": 1}, split=1, predicted_ms=20.0, rates=[90, 110, 100])
    ours.step_ms = [10.0, 8.0, 9.0]
    # A neighbour slowed the third round for both plans: the paired view sees that round as the others.
    theirs = vs.PlanOutcome("ok", mix={"column_wise": 8}, predicted_ms=25.0, rates=[100, 100, 50])
    theirs.step_ms = [12.0, 11.0, 30.0]
    theirs.breakdowns = [{"embedding": 4.0, "dense": 2.0}, {"embedding": 6.0}, {"embedding": 5.0, "dense": 1.0}]
    record = vs.case_record(case, model, topology, {"ours": ours, "torchrec": theirs})
    assert record["ours_samples_per_s"] == 100 and record["torchrec_samples_per_s"] == 100
    assert record["ratio"] == pytest.approx(1.0) and record["torchrec_status"] == "ok"
    assert record["paired_ratio"] == pytest.approx(1.1)  # median of 0.9, 1.1, 2.0
    assert record["step_ratio"] == pytest.approx(12.0 / 9.0)
    assert record["ours_step_ms"] == 9.0 and record["torchrec_step_ms"] == 12.0
    assert record["ours_mix"] == "tw 7, rw 1 (1 split)" and record["torchrec_mix"] == "cw 8"
    assert record["breakdown_ms"] == {"torchrec": {"embedding": 5.0, "dense": 1.0}}

    failed = vs.PlanOutcome("planner_failed", error="PlannerError: insufficient storage")
    record = vs.case_record(case, model, topology, {"ours": ours, "torchrec": failed})
    assert record["torchrec_samples_per_s"] is None and record["ratio"] is None and record["paired_ratio"] is None
    assert record["torchrec_status"] == "planner_failed" and record["torchrec_mix"] == ""
    assert vs.summarize([record])["cases_only_ours_runs"] == 1


def test_rounds_alternate_the_plans_and_a_failed_run_is_tried_once_more(monkeypatch, tmp_path):
    calls = []
    failures = {"ours.json": 1, "torchrec.json": 99}  # ours fails once (a stray signal), TorchRec's every time

    def train_once(files, plan_path, steps, id_space, extra=()):
        calls.append(plan_path.name)
        if failures[plan_path.name] > 0:
            failures[plan_path.name] -= 1
            raise RuntimeError("persia train exited 143: interrupted (SIGTERM)")
        return {"samples_per_s": 100.0, "step_ms": 10.0, "step_breakdown_ms": {"embedding": 1.0}}

    monkeypatch.setattr(vs, "train_once", train_once)
    outcomes = {
        "ours": vs.PlanOutcome("ok", path=tmp_path / "ours.json"),
        "torchrec": vs.PlanOutcome("ok", path=tmp_path / "torchrec.json"),
        "failed": vs.PlanOutcome("planner_failed"),
    }
    vs.run_rounds(None, outcomes, steps=10, rounds=3, id_space=None)
    assert calls == ["ours.json", "ours.json", "torchrec.json", "torchrec.json", "ours.json", "ours.json"]
    assert outcomes["ours"].status == "ok" and outcomes["ours"].rates == [100.0] * 3
    assert outcomes["ours"].retried == ["RuntimeError: persia train exited 143: interrupted (SIGTERM)"]
    assert outcomes["torchrec"].status == "train_failed" and outcomes["torchrec"].rates == []
    assert outcomes["failed"].rates == []
