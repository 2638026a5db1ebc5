"""Measured refinement: alternated timed runs within a budget, failures recorded, and ``persia plan --tune``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from persia_planner import ModelSpec, load_topology
from persia_planner.errors import PlannerError
from persia_planner.modules.tools import tune as tune_module
from persia_planner.modules.tools.tune import TuneRun, measure_candidates, tune_config
from persia_planner.paths import DEFAULT_MODEL, DEFAULT_TOPOLOGY
from persia_planner.plan.plan import Plan

TOPOLOGY = load_topology(DEFAULT_TOPOLOGY)
MODEL = ModelSpec.from_dict({"batch_size": 64, "staleness": 0, "tables": [{"name": "a", "rows": 10, "dim": 4}]})


def run(name: str, estimate_ms: float) -> TuneRun:
    """A candidate whose tables name it (the fake launchers below read the name from them)."""
    return TuneRun(name, Plan("m", "t", {"name": name}, {}, estimate_ms, 0.0, 0.0))


RUNS = [run("search", 10.0), run("whole tables", 11.0), run("torchrec", 12.0)]


class FakeClock:
    """Stands in for time.monotonic: each fake run takes ``run_s`` seconds of it."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


def fake_train(clock: FakeClock, rates: dict[str, list[float]], calls: list[tuple[str, int]], run_s: float = 10.0):
    def train(cfg, model, tables, **_):
        name = tables["name"]
        calls.append((name, cfg.seed))
        clock.now += run_s
        if name == "torchrec":
            raise PlannerError("table 'x' is planned on tier ddr, which needs CUDA unified memory")
        return {"samples_per_s": rates[name].pop(0)}

    return train


def test_candidates_alternate_in_rounds_until_the_budget_and_a_failure_is_kept(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(tune_module.time, "monotonic", clock.monotonic)
    rates = {"search": [100.0, 90.0, 95.0], "whole tables": [120.0, 80.0, 130.0]}
    calls: list[tuple[str, int]] = []
    runs = RUNS
    seen: list[tuple[str, float | None]] = []
    cfg = tune_config(MODEL, TOPOLOGY, steps=20, seed=7)
    measured = measure_candidates(
        runs, MODEL, TOPOLOGY, cfg, budget_s=75.0, on_run=lambda n, r: seen.append((n, r)),
        train=fake_train(clock, rates, calls),
    )  # fmt: skip
    # Round 1 takes 30 s (3 runs), rounds 2 and 3 20 s each (the failed one is not run again); a 4th would end at 90.
    assert calls == [("search", 7), ("whole tables", 7), ("torchrec", 7)] + [
        (name, seed) for seed in (8, 9) for name in ("search", "whole tables")
    ]
    assert [(c.name, c.samples_per_s, c.error) for c in measured] == [
        ("search", (100.0, 90.0, 95.0), None),
        ("whole tables", (120.0, 80.0, 130.0), None),
        ("torchrec", (), "table 'x' is planned on tier ddr, which needs CUDA unified memory"),
    ]
    assert seen[:3] == [("search", 100.0), ("whole tables", 120.0), ("torchrec", None)]


def test_at_least_one_round_runs_whatever_the_budget(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(tune_module.time, "monotonic", clock.monotonic)
    calls: list[tuple[str, int]] = []
    runs = RUNS[:2]
    rates = {"search": [1.0], "whole tables": [2.0]}
    cfg = tune_config(MODEL, TOPOLOGY, steps=20)
    measured = measure_candidates(runs, MODEL, TOPOLOGY, cfg, budget_s=1.0, train=fake_train(clock, rates, calls))
    assert [c.samples_per_s for c in measured] == [(1.0,), (2.0,)] and len(calls) == 2


def test_a_run_is_configured_as_persia_train_would_run_the_plan():
    cfg = tune_config(MODEL, TOPOLOGY, steps=30, seed=3)
    assert (cfg.steps, cfg.trainers, cfg.effective_staleness, cfg.mode.value, cfg.progress) == (30, 2, 0, "sync", False)
    hybrid = tune_config(ModelSpec.from_dict({"batch_size": 64, "tables": [{"name": "a", "rows": 10, "dim": 4}]}),
                         TOPOLOGY, steps=30)  # fmt: skip
    assert (hybrid.mode.value, hybrid.effective_staleness) == ("hybrid", 4)


PERSIA = [sys.executable, "-m", "persia_planner.cli"]


@pytest.mark.processes
def test_tune_needs_the_topology_of_this_machine():
    done = subprocess.run([*PERSIA, "plan", "--tune"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert lines == [
        "error: --tune runs the candidates on this machine, and topology '2x4-l4-2ps' has 2 trainer hosts; fix: "
        "tune on a topology of this machine (one trainer host), then plan the cluster with what it chose"
    ], done.stderr


@pytest.mark.processes
@pytest.mark.timeout(600)
def test_persia_plan_tune_runs_the_candidates_here_and_records_them(tmp_path):
    topology = tmp_path / "roomy.yaml"
    text = DEFAULT_TOPOLOGY.read_text().replace("memory: 4MiB", "memory: 64MiB")
    topology.write_text(text.replace("profile: profiles/", f"profile: {DEFAULT_TOPOLOGY.parent}/profiles/"))
    out = tmp_path / "plan.json"
    done = subprocess.run(
        [*PERSIA, "plan", str(DEFAULT_MODEL), str(topology), "--staleness", "0", "--tune", "--tune-budget", "1",
         "--tune-steps", "6", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    tuning = json.loads(out.read_text())["tuning"]
    names = [c["name"] for c in tuning["candidates"]]
    assert names[0] == "search" and "torchrec" in names, tuning
    assert tuning["chosen"] in names and tuning["steps"] == 6
    # One round (the budget is shorter than any run): every candidate that could run did, once.
    for c in tuning["candidates"]:
        assert (len(c["samples_per_s"]) == 1 and c["samples_per_s"][0] > 0) or "error" in c, c
    chosen = next(c for c in tuning["candidates"] if c["name"] == tuning["chosen"])
    assert chosen["median_samples_per_s"] == max(c["median_samples_per_s"] for c in tuning["candidates"])
    assert "tuning (6-step runs here, the fastest kept)" in done.stdout


def test_a_signal_stops_the_tuning_not_just_a_candidate(monkeypatch):
    from persia_planner.errors import Interrupted

    def interrupted(cfg, model, tables, **_):
        raise Interrupted(2, "interrupted (SIGINT) after step 3")

    cfg = tune_config(MODEL, TOPOLOGY, steps=20)
    with pytest.raises(Interrupted):
        measure_candidates(RUNS[:2], MODEL, TOPOLOGY, cfg, budget_s=100.0, train=interrupted)
