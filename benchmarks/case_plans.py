"""Each planner's plan of a case (``benchmarks/vs_torchrec.py``), saved as plan.json and checked by ``persia
validate``, as its users would get it: ours (``persia plan``), TorchRec's ``EmbeddingShardingPlanner`` for CPU trainers
(in a killable child process, ``benchmarks/torchrec_baseline.py``), and ``persia plan --tune``'s.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cpu_cases import Case
from torchrec_baseline import over_capacity, time_torchrec_planner

from persia_planner import CostModel, ModelSpec, Sharding, Topology
from persia_planner import plan as plan_ours
from persia_planner.bound import lower_bound
from persia_planner.planner import priced_plan

__all__ = [
    "BASELINE",
    "PLANNERS",
    "TRAIN_TIMEOUT_S",
    "TUNED",
    "CaseFiles",
    "PlanOutcome",
    "mix_text",
    "one_line",
    "persia_command",
    "plan_tuned",
]

BASELINE = "torchrec"  # every ratio is a plan's samples/s over this one's
TRAIN_TIMEOUT_S = 600.0
TORCHREC_TIMEOUT_S = 120.0

# Short names of the sharding types, for the mix columns.
_ABBREVIATIONS = {
    "table_wise": "tw",
    "row_wise": "rw",
    "column_wise": "cw",
    "table_row_wise": "twrw",
    "table_column_wise": "twcw",
    "data_parallel": "dp",
    "ps_hash": "ps",
}


# ---- plans ------------------------------------------------------------------------------------------------------
@dataclass
class PlanOutcome:
    """One planner's plan for a case, and what became of it.

    Attributes:
        status: ``ok`` (a valid plan.json at ``path``), ``planner_failed``, ``timeout``, ``over_capacity``,
            ``unsupported``, ``invalid``; after training, ``train_failed`` if a run failed.
        path: plan.json, when there is one.
        plan_s: Planning seconds (TorchRec's: its ``planner.plan`` call, start-up excluded).
        mix: Count of tables per sharding type (``ps_hash`` for parameter-server tables).
        split: Tables held in more than one piece (shards that are not replicas).
        predicted_ms: Our cost model's step of the plan (None without a plan).
        error: One line, when not ok.
        rates: Samples/s of each round (``persia train``'s: every step's time, from the first).
        step_ms: Each round's median step (warm-up and stalls left out).
        breakdowns: Each round's measured step, term by term (``persia train``'s ``step_breakdown_ms``).
        chosen: A tuned plan's candidate (plan.json's ``tuning.chosen``).
        retried: The errors of runs that failed and were run again.
        train_args: ``persia train`` options its runs add (``--adapt`` for an adapted plan).
    """

    status: str
    path: Path | None = None
    plan_s: float | None = None
    mix: dict[str, int] = field(default_factory=dict)
    split: int = 0
    predicted_ms: float | None = None
    error: str | None = None
    rates: list[float] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)
    breakdowns: list[dict[str, float]] = field(default_factory=list)
    chosen: str | None = None
    retried: list[str] = field(default_factory=list)
    train_args: tuple[str, ...] = ()

    @property
    def samples_per_s(self) -> float | None:
        return statistics.median(self.rates) if self.rates and self.status == "ok" else None


@dataclass(frozen=True)
class CaseFiles:
    """What a planner gets: the case, its files and their loaded forms, and a folder for its plan.json."""

    case: Case
    model_path: Path
    topology_path: Path
    model: ModelSpec
    topology: Topology
    folder: Path


def describe(outcome: PlanOutcome, tables: Mapping[str, Any]) -> PlanOutcome:
    """Fill ``mix`` and ``split`` from a plan's placements."""
    mix: dict[str, int] = {}
    for p in tables.values():
        mix[p.sharding.value] = mix.get(p.sharding.value, 0) + 1
    outcome.mix = dict(sorted(mix.items(), key=lambda kv: (-kv[1], kv[0])))
    # A parameter-server table is hashed over the servers, which is no split of the trainers' memory.
    outcome.split = sum(
        1
        for p in tables.values()
        if p.sharding is not Sharding.PS_HASH and sum(1 for s in p.shards if not s.replica) > 1
    )
    return outcome


def persia_command() -> list[str]:
    """The ``persia`` CLI of this interpreter's environment."""
    script = Path(sys.executable).with_name("persia")
    return [str(script)] if script.exists() else [sys.executable, "-m", "persia_planner.cli"]


def validate_file(files: CaseFiles, plan_path: Path) -> tuple[int, str]:
    """``persia validate MODEL TOPOLOGY PLAN``: its exit code and its first problem line (or its last line)."""
    proc = subprocess.run(
        [*persia_command(), "validate", str(files.model_path), str(files.topology_path), str(plan_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [ln.strip() for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    problems = [ln[2:] for ln in lines if ln.startswith("- ")]
    return proc.returncode, (problems or lines or [""])[0][:300]


def plan_with_ours(files: CaseFiles) -> PlanOutcome:
    """Our planner with its defaults, as ``persia plan`` runs it."""
    started = time.perf_counter()
    try:
        ours = plan_ours(files.model, files.topology)
    except Exception as err:  # a CapacityError would be a case to fix, but it is reported, not raised
        return PlanOutcome("planner_failed", plan_s=time.perf_counter() - started, error=one_line(err))
    outcome = describe(PlanOutcome("ok", plan_s=time.perf_counter() - started, predicted_ms=ours.step_ms), ours.tables)
    outcome.path = files.folder / "ours.json"
    ours.save(outcome.path)
    code, problem = validate_file(files, outcome.path)
    if code != 0:
        outcome.status, outcome.error = "invalid", problem
    return outcome


def plan_with_torchrec(files: CaseFiles) -> PlanOutcome:
    """TorchRec's ``EmbeddingShardingPlanner`` for CPU trainers, converted to plan.json and validated."""
    from persia_planner.errors import PlannerError
    from persia_planner.plan.torchrec_export import TorchRecSharding
    from persia_planner.plan.torchrec_scoring import from_sharding_options

    model, topology, case = files.model, files.topology, files.case
    result = time_torchrec_planner(
        model,
        world_size=case.trainers,
        local_world_size=case.trainers,
        hbm_bytes=0,  # TorchRec gives CPU ranks no HBM: their tables live in DDR
        ddr_bytes=case.budget_bytes,
        timeout_s=TORCHREC_TIMEOUT_S,
        compute_device="cpu",
    )
    if result["status"] != "ok":
        status = "timeout" if result["status"] == "timeout" else "planner_failed"
        return PlanOutcome(status, plan_s=result["seconds"], error=result["error"])
    outcome = PlanOutcome("ok", plan_s=result["seconds"])
    try:
        tables = from_sharding_options([TorchRecSharding.from_dict(d) for d in result["options"]], model, topology)
    except PlannerError as err:
        outcome.status, outcome.error = "unsupported", one_line(err)
        return outcome
    describe(outcome, tables)
    cost = CostModel(model, topology)
    theirs = priced_plan(cost, tables, lower_bound_ms=lower_bound(cost).value_ms)
    outcome.predicted_ms = float(theirs.step_ms)
    outcome.path = files.folder / "torchrec.json"
    theirs.save(outcome.path)
    code, problem = validate_file(files, outcome.path)
    if code != 0:
        over = over_capacity(tables, model, topology)
        outcome.status = "over_capacity" if over["devices"] else "invalid"
        outcome.error = problem
    return outcome


def plan_tuned(files: CaseFiles, budget_s: float, steps: int) -> PlanOutcome:
    """``persia plan --tune``, as a user runs it: our search's plan, its alternatives and TorchRec's planner's plan
    each run here for ``steps`` steps in alternated rounds within ``budget_s``, the fastest median kept."""
    path = files.folder / "tuned.json"
    command = [*persia_command(), "plan", str(files.model_path), str(files.topology_path), "--tune"]
    command += ["--tune-budget", f"{budget_s:g}", "--tune-steps", str(steps), "--out", str(path)]
    started = time.perf_counter()
    proc = subprocess.run(command, capture_output=True, text=True, timeout=budget_s + TRAIN_TIMEOUT_S)
    plan_s = time.perf_counter() - started
    if proc.returncode != 0:
        tail = [ln for ln in proc.stderr.splitlines() if ln.strip()][-1:] or ["no output"]
        return PlanOutcome("planner_failed", plan_s=plan_s, error=tail[0][:300])
    from persia_planner import load_plan

    tuned = load_plan(path)
    outcome = describe(PlanOutcome("ok", path=path, plan_s=plan_s, predicted_ms=tuned.step_ms), tuned.tables)
    outcome.chosen = tuned.tuning.chosen if tuned.tuning is not None else None
    code, problem = validate_file(files, path)
    if code != 0:
        outcome.status, outcome.error = "invalid", problem
    return outcome


TUNED = "tuned"
ADAPTED = "adapted"  # our plan, its runs under persia train --adapt (re-planned and migrated as they measure)


def adapted(ours: PlanOutcome) -> PlanOutcome:
    """Our plan again, trained with ``--adapt``."""
    return PlanOutcome(
        ours.status, ours.path, ours.plan_s, dict(ours.mix), ours.split, ours.predicted_ms, ours.error,
        train_args=("--adapt",),
    )  # fmt: skip


# The plans each case trains, in this order; each is compared with BASELINE's. With --tune, TUNED joins as a third
# (plan_tuned), and the JSON's tuned_min_ratio / tuned_median_ratio fill from its rates.
PLANNERS: dict[str, Callable[[CaseFiles], PlanOutcome]] = {"ours": plan_with_ours, BASELINE: plan_with_torchrec}


def mix_text(mix: Mapping[str, int], split: int = 0) -> str:
    """``{"table_wise": 7, "ps_hash": 1}`` -> ``"tw 7, ps 1"`` (``+ N split``: tables held in several pieces)."""
    text = ", ".join(f"{_ABBREVIATIONS.get(k, k)} {n}" for k, n in mix.items())
    return f"{text} ({split} split)" if split and text else text


def one_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0][:300] if lines else ''}"
