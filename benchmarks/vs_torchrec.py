"""Our planner's plans against TorchRec 1.8's planner's plans, both executed by ``persia train`` on this machine.

A sharding planner is worth switching to only if its plans run faster than the one users already have. Each case
is a model and a CPU cluster (one host of 2 or 4 trainer processes, each with an embedding-memory budget, plus
parameter servers), given to both planners as their users would give it:

* ours: ``persia_planner.plan`` on model.yaml + topology.yaml (what ``persia plan`` does);
* TorchRec's: ``EmbeddingShardingPlanner`` with ``compute_device="cpu"``, one rank per trainer whose DDR capacity is
  the trainer's memory budget, the tables' pooling factors as ``ParameterConstraints`` and otherwise TorchRec's
  defaults (``benchmarks/torchrec_baseline.py`` runs it in a killable child process). Its plan is converted to
  plan.json (``torchrec_scoring.from_sharding_options``) and checked with ``persia validate``.

Both plans are then trained by ``persia train --plan P --mode sync`` (K = 0; the same data, seeds and dense
network), alternating the plans round by round; each plan's figure is the median samples/s of its rounds and a
case's ``ratio`` is ours / TorchRec's. A run's rate on a shared 2-core machine moves with the neighbours by tens of
percent, so each case also has ``paired_ratio`` (the median of the rounds' ours / TorchRec's, runs adjacent in time)
and ``step_ratio`` (by each run's median step, warm-up and stalls left out); five rounds by default.

TorchRec's plan may not exist: ``torchrec_status`` says why (``planner_failed``: its planner found no plan that
fits, e.g. when the tables exceed the trainers' memory and only parameter servers could hold them;
``over_capacity``: its plan overfills a trainer by ``persia validate``; ``unsupported``: the plan has what ``persia
train`` cannot run; ``train_failed``: the run failed). Such a case stays in the results with ours alone and counts
in ``cases_only_ours_runs``.

Budgets are of three kinds (``kind``), checked by ``tests/test_vs_torchrec.py``: ``roomy`` (every table fits on one
trainer), ``tight`` (not on one trainer, but on all of them: tables must be spread, and where the largest exceeds a
trainer, split) and ``ps_only`` (the tables exceed all the trainers' memory together: no all-local plan exists).

Prints a table and writes JSON (``--json OUT``): ``cases`` (a record per case), ``min_ratio`` and ``median_ratio``
(over the cases both plans ran), ``cases_only_ours_runs``, and ``tuned_min_ratio`` / ``tuned_median_ratio`` (a third,
tuned plan per case: ``persia plan --tune``'s, with ``--tune``; null without it).

    python benchmarks/vs_torchrec.py --quick --json out.json    # CI: 3 cases, 40 steps, 2 rounds (~3 min; --tune ~6)
    python benchmarks/vs_torchrec.py --json out.json            # 10 cases, 150 steps, 5 rounds (~40 minutes)
    python benchmarks/vs_torchrec.py --cases roomy-8t-d16-2tr,ps-26t-d16-2tr --rounds 5
    python benchmarks/vs_torchrec.py --tune --json out.json     # also persia plan --tune's plan (tuned_* keys)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from rich.console import Console
from rich.table import Table

if str(Path(__file__).resolve().parent) not in sys.path:  # torchrec_baseline sits beside this file
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from torchrec_baseline import over_capacity, time_torchrec_planner

from persia_planner import CostModel, ModelSpec, Sharding, Topology, load_model, load_topology
from persia_planner import plan as plan_ours
from persia_planner.bound import lower_bound
from persia_planner.paths import EXAMPLES
from persia_planner.planner import priced_plan

# Nothing here imports torch: the trainers are `persia train` processes, TorchRec's planner runs in its own child.

console = Console(width=max(Console().width, 200))

KiB, MiB = 1024, 1024**2
PROFILE = EXAMPLES / "profiles" / "cpu-2core.yaml"
BASELINE = "torchrec"  # every ratio is a plan's samples/s over this one's
TRAIN_TIMEOUT_S = 600.0
TORCHREC_TIMEOUT_S = 120.0

ROOMY, TIGHT, PS_ONLY = "roomy", "tight", "ps_only"
KINDS = (ROOMY, TIGHT, PS_ONLY)

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


# ---- the cases --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """One model on one CPU cluster.

    Table ``i`` of ``tables`` gets rows log-spaced from ``rows[0]`` to ``rows[1]`` and a pooling factor spaced from
    ``pooling[0]`` to ``pooling[1]``, both shuffled by ``seed`` independently, so large tables are not always the
    most pooled. All tables share ``dim`` (the DLRM ``persia train`` builds needs one) and ``zipf_alpha``.

    Attributes:
        name: Case name (``--cases`` picks by it).
        kind: The budget's intent: ``roomy``, ``tight`` or ``ps_only`` (see the module docstring).
        tables: Number of tables.
        dim: Embedding dimension of every table.
        rows: Smallest and largest table rows.
        pooling: Smallest and largest pooling factor.
        zipf_alpha: The tables' access skew, as the planner is told it.
        trainers: Trainer processes (CPU devices of the one trainer host).
        budget_kib: Each trainer's embedding memory (``cpus: memory``), KiB.
        batch: Global batch size.
        servers: Parameter-server processes.
        seed: Seed of the shuffles.
    """

    name: str
    kind: str
    tables: int
    dim: int
    rows: tuple[int, int]
    pooling: tuple[float, float]
    zipf_alpha: float
    trainers: int
    budget_kib: int
    batch: int = 2048
    servers: int = 2
    seed: int = 0

    @property
    def budget_bytes(self) -> int:
        return self.budget_kib * KiB

    def table_rows(self) -> list[int]:
        """Rows of each table, in table order."""
        rows = np.geomspace(self.rows[0], self.rows[1], self.tables).round().astype(int)
        return [int(r) for r in np.random.default_rng([self.seed, 1]).permutation(rows)]

    def table_pooling(self) -> list[float]:
        """Pooling factor of each table, in table order."""
        pooling = np.linspace(self.pooling[0], self.pooling[1], self.tables).round(1)
        return [float(p) for p in np.random.default_rng([self.seed, 2]).permutation(pooling)]

    def model_dict(self) -> dict[str, Any]:
        """model.yaml content: the tables and the DLRM ``persia train`` builds over them, K = 0."""
        tables = [
            {
                "name": f"t{i + 1}",
                "rows": rows,
                "dim": self.dim,
                "pooling_factor": pooling,
                "zipf_alpha": self.zipf_alpha,
            }
            for i, (rows, pooling) in enumerate(zip(self.table_rows(), self.table_pooling(), strict=True))
        ]
        return {
            "name": self.name,
            "batch_size": self.batch,
            "embedding_dtype": "fp32",
            "staleness": 0,  # the runs are --mode sync
            "tables": tables,
            "dense": {"arch": "dlrm", "num_dense": 13, "bottom": [64], "over": [64, 32, 1]},
        }

    def topology_dict(self, profile: Path = PROFILE) -> dict[str, Any]:
        """topology.yaml content: one host of ``trainers`` CPU trainers with ``budget`` each, and the servers."""
        hosts: list[dict[str, Any]] = [
            {
                "name": "trainer",
                "ddr": "8GiB",
                "profile": str(profile),
                "cpus": {"count": self.trainers, "memory": f"{self.budget_kib}KiB"},
            }
        ]
        if self.servers:
            hosts.append(
                {
                    "name": "ps",
                    "count": self.servers,
                    "role": "parameter_server",
                    "ddr": "2GiB",
                    "profile": str(profile),
                }
            )
        return {"name": f"{self.name}-cluster", "hosts": hosts, "network": {"latency": "50us"}}

    def write(self, folder: Path) -> tuple[Path, Path]:
        """Write model.yaml and topology.yaml into ``folder``; returns their paths."""
        folder.mkdir(parents=True, exist_ok=True)
        model, topology = folder / "model.yaml", folder / "topology.yaml"
        model.write_text(yaml.safe_dump(self.model_dict(), sort_keys=False))
        topology.write_text(yaml.safe_dump(self.topology_dict(), sort_keys=False))
        return model, topology


def cases() -> list[Case]:
    """The full benchmark's cases: 8 to 100 tables, dims 8 to 256, pooling 1 to 20, skew 0.8 to 1.3, 2 and 4
    trainers, each kind of budget (three ``ps_only``)."""
    return [
        Case("roomy-8t-d16-2tr", ROOMY, 8, 16, (500, 100_000), (1, 4), 1.05, 2, 64 * 1024),
        Case("roomy-100t-d8-2tr", ROOMY, 100, 8, (100, 20_000), (1, 1), 1.2, 2, 32 * 1024, batch=1024),
        Case("roomy-26t-d16-4tr-pool20", ROOMY, 26, 16, (100, 50_000), (1, 20), 0.9, 4, 32 * 1024),
        # Tables must be spread over the trainers (none holds them all). On CPU, TorchRec's default reservation takes
        # 15% of a rank's DDR plus 20 copies of its batch's ids, and it counts each table's pooled input and output
        # with the table: these budgets are about the least with which its planner finds a plan (28 MiB, not 24, for
        # 50 tables).
        Case("tight-12t-d32-2tr", TIGHT, 12, 32, (1_000, 120_000), (1, 10), 1.1, 2, 34 * 1024),
        Case("tight-50t-d16-4tr", TIGHT, 50, 16, (200, 80_000), (1, 6), 1.3, 4, 28 * 1024),
        # The largest table exceeds a trainer: it must be split (TorchRec splits columns of 128 or more on CPU).
        Case("tight-split-8t-d16-2tr", TIGHT, 8, 16, (1_000, 300_000), (1, 3), 1.05, 2, 21 * 1024),
        Case("tight-split-8t-d256-4tr", TIGHT, 8, 256, (500, 30_000), (1, 2), 1.05, 4, 24 * 1024, batch=1024),
        # More table bytes than all the trainers' memory: only parameter servers can hold some.
        Case("ps-26t-d16-2tr", PS_ONLY, 26, 16, (10, 200_000), (1, 3), 1.05, 2, 4 * 1024),
        Case("ps-50t-d8-4tr-zipf08", PS_ONLY, 50, 8, (100, 300_000), (1, 2), 0.8, 4, 2 * 1024),
        Case("ps-10t-d32-2tr-pool20", PS_ONLY, 10, 32, (1_000, 200_000), (5, 20), 1.2, 2, 8 * 1024),
    ]


QUICK_CASES = ("roomy-8t-d16-2tr", "tight-12t-d32-2tr", "ps-26t-d16-2tr")


def table_bytes(model: ModelSpec) -> list[int]:
    """Bytes of each table (weights and optimizer state), as the planner counts them."""
    return [t.bytes(model.embedding_dtype) for t in model.tables]


def budget_kind(model: ModelSpec, topology: Topology) -> str:
    """Which kind of budget ``topology`` gives ``model`` (``roomy``, ``tight`` or ``ps_only``), by our memory rule.

    ``roomy``: all tables fit in one trainer's usable memory; ``tight``: not in one, but in all of them together;
    ``ps_only``: more bytes than all the trainers' raw budgets (no all-local plan, whatever the reservation).
    """
    total = sum(table_bytes(model))
    usable = [topology.hbm_capacity(g) for g in topology.gpus]
    if total > sum(g.hbm_bytes for g in topology.gpus):
        return PS_ONLY
    if total <= min(usable):
        return ROOMY
    return TIGHT if total <= sum(usable) else "between"  # "between": neither, a case to fix


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
        return PlanOutcome("planner_failed", plan_s=time.perf_counter() - started, error=_one_line(err))
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
    from persia_planner.export import TorchRecSharding
    from persia_planner.torchrec_scoring import from_sharding_options

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
        outcome.status, outcome.error = "unsupported", _one_line(err)
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
# The plans each case trains, in this order; each is compared with BASELINE's. With --tune, TUNED joins as a third
# (plan_tuned), and the JSON's tuned_min_ratio / tuned_median_ratio fill from its rates.
PLANNERS: dict[str, Callable[[CaseFiles], PlanOutcome]] = {"ours": plan_with_ours, BASELINE: plan_with_torchrec}


# ---- training ---------------------------------------------------------------------------------------------------
def train_once(files: CaseFiles, plan_path: Path, steps: int, id_space: float | None) -> dict[str, Any]:
    """One ``persia train --plan PLAN --mode sync --json`` run; its final JSON line.

    Raises:
        RuntimeError: The run failed or printed no JSON (the message has its last stderr line).
    """
    command = [
        *persia_command(),
        "train",
        "--model",
        str(files.model_path),
        "--topology",
        str(files.topology_path),
        "--plan",
        str(plan_path),
        "--mode",
        "sync",
        "--steps",
        str(steps),
        "--trainers",
        str(files.case.trainers),
        "--eval-batches",
        "1",  # the AUC is not compared; evaluation is outside the timed steps anyway
        "--json",
    ]
    if id_space is not None:
        command += ["--id-space", str(id_space)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=TRAIN_TIMEOUT_S)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            if proc.returncode == 0:
                return json.loads(line)
            break
    tail = [ln for ln in proc.stderr.splitlines() if ln.strip()][-1:] or ["no output"]
    raise RuntimeError(f"persia train exited {proc.returncode}: {tail[0][:300]}")


def run_rounds(
    files: CaseFiles, outcomes: Mapping[str, PlanOutcome], *, steps: int, rounds: int, id_space: float | None
) -> None:
    """Train every valid plan ``rounds`` times, alternating the order round by round, into ``outcome.rates``.

    A failed run is tried once more (in the full run a neighbour's SIGTERM once ended two runs in a row); a plan
    whose retry fails too is marked ``train_failed`` and not run again, and the others go on. The first failure's
    message is kept in ``outcome.retried``.
    """
    labels = [label for label, o in outcomes.items() if o.status == "ok"]
    for r in range(rounds):
        # A B, B A, ...: neither plan always runs first (after the other's processes, caches, neighbours).
        for label in labels if r % 2 == 0 else labels[::-1]:
            outcome = outcomes[label]
            if outcome.status != "ok":
                continue
            try:
                result = train_once(files, outcome.path, steps, id_space)
            except (RuntimeError, subprocess.TimeoutExpired) as first:
                outcome.retried.append(_one_line(first))
                console.print(f"   round {r + 1} {label}: failed, once more ({outcome.retried[-1]})")
                try:
                    result = train_once(files, outcome.path, steps, id_space)
                except (RuntimeError, subprocess.TimeoutExpired) as err:
                    outcome.status, outcome.error = "train_failed", _one_line(err)
                    continue
            outcome.rates.append(float(result["samples_per_s"]))
            outcome.step_ms.append(float(result["step_ms"]))
            outcome.breakdowns.append(dict(result.get("step_breakdown_ms", {})))
            console.print(f"   round {r + 1} {label}: {outcome.rates[-1]:,.0f} samples/s")


# ---- one case ---------------------------------------------------------------------------------------------------
def run_case(
    case: Case,
    folder: Path,
    *,
    steps: int,
    rounds: int,
    id_space: float | None = None,
    tune: tuple[float, int] | None = None,
) -> dict[str, Any]:
    """Plan ``case`` with every planner of :data:`PLANNERS` (and, with ``tune`` = (budget s, steps), ``persia plan
    --tune``), train the plans, and return the case's record."""
    model_path, topology_path = case.write(folder)
    model, topology = load_model(model_path), load_topology(topology_path)
    files = CaseFiles(case, model_path, topology_path, model, topology, folder)
    outcomes = {label: planner(files) for label, planner in PLANNERS.items()}
    if tune is not None:
        outcomes[TUNED] = plan_tuned(files, *tune)
    for label, o in outcomes.items():
        said = f"{o.status}" + (f" ({o.error})" if o.error else "")
        console.print(f"   {label}: {mix_text(o.mix, o.split) or '-'}; {said}")
    run_rounds(files, outcomes, steps=steps, rounds=rounds, id_space=id_space)
    return case_record(case, model, topology, outcomes)


def case_record(
    case: Case, model: ModelSpec, topology: Topology, outcomes: Mapping[str, PlanOutcome]
) -> dict[str, Any]:
    """A case's JSON record: the case, and per plan its mix, prediction, samples/s and ratio to the baseline."""
    record: dict[str, Any] = {
        "name": case.name,
        "kind": case.kind,
        "tables": case.tables,
        "dim": case.dim,
        "pooling": f"{case.pooling[0]:g}-{case.pooling[1]:g}",
        "zipf_alpha": case.zipf_alpha,
        "rows": f"{case.rows[0]:,}-{case.rows[1]:,}",
        "table_mib": round(sum(table_bytes(model)) / MiB, 2),
        "trainers": case.trainers,
        "budget_mib": round(case.budget_bytes / MiB, 3),
        "batch": case.batch,
    }
    base = outcomes.get(BASELINE)
    for label, o in outcomes.items():
        ran = o.status == "ok" and bool(o.rates)
        record[f"{label}_samples_per_s"] = o.samples_per_s
        record[f"{label}_step_ms"] = round(statistics.median(o.step_ms), 3) if ran else None
        record[f"{label}_mix"] = mix_text(o.mix, o.split)
        record[f"{label}_predicted_ms"] = None if o.predicted_ms is None else round(o.predicted_ms, 3)
        record[f"{label}_plan_s"] = None if o.plan_s is None else round(o.plan_s, 3)
        if label != BASELINE:
            prefix = "" if label == "ours" else f"{label}_"
            record.update({f"{prefix}{k}": v for k, v in compare(o, base).items()})
        record[f"{label}_status"] = o.status
        record[f"{label}_error"] = o.error
        if o.chosen is not None:
            record[f"{label}_chosen"] = o.chosen
        record[f"{label}_retried"] = len(o.retried)
    record["rounds"] = {label: o.rates for label, o in outcomes.items()}
    record["rounds_step_ms"] = {label: o.step_ms for label, o in outcomes.items()}
    # Two levels deep, so RESULTS.md leaves it out: the terms say where a plan's step went (a run with PS tables is
    # not profiled, and has only data / ps_wait / push / other).
    record["breakdown_ms"] = {label: median_terms(o.breakdowns) for label, o in outcomes.items() if o.breakdowns}
    return record


def compare(mine: PlanOutcome, base: PlanOutcome | None) -> dict[str, float | None]:
    """``mine`` against the baseline plan, three ways (None unless both ran).

    ``ratio``: median samples/s over median samples/s (the headline). On a shared 2-core machine a run's rate moves
    with its neighbours by more than the plans differ, so two more robust views go beside it: ``paired_ratio``, the
    median over rounds of the ratio of the two runs of one round (adjacent in time: slow drifts cancel), and
    ``step_ratio``, the baseline's median step over mine (each run's median step: warm-up and stalls left out).
    """
    empty: dict[str, float | None] = {"ratio": None, "paired_ratio": None, "step_ratio": None}
    if base is None or mine.status != "ok" or base.status != "ok" or not mine.rates or not base.rates:
        return empty
    pairs = [a / b for a, b in zip(mine.rates, base.rates, strict=False)]
    return {
        "ratio": statistics.median(mine.rates) / statistics.median(base.rates),
        "paired_ratio": statistics.median(pairs),
        "step_ratio": statistics.median(base.step_ms) / statistics.median(mine.step_ms),
    }


def median_terms(breakdowns: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Each term's median over the rounds (a term missing from a round counts as 0 there)."""
    terms = list(dict.fromkeys(t for b in breakdowns for t in b))
    return {t: round(statistics.median(b.get(t, 0.0) for b in breakdowns), 3) for t in terms}


def mix_text(mix: Mapping[str, int], split: int = 0) -> str:
    """``{"table_wise": 7, "ps_hash": 1}`` -> ``"tw 7, ps 1"`` (``+ N split``: tables held in several pieces)."""
    text = ", ".join(f"{_ABBREVIATIONS.get(k, k)} {n}" for k, n in mix.items())
    return f"{text} ({split} split)" if split and text else text


def _one_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0][:300] if lines else ''}"


# ---- summary ----------------------------------------------------------------------------------------------------
def ratios(records: Sequence[Mapping[str, Any]], label: str = "ours") -> list[float]:
    """``label``'s samples/s over the baseline's, for the cases where both ran."""
    out = []
    for r in records:
        mine, theirs = r.get(f"{label}_samples_per_s"), r.get(f"{BASELINE}_samples_per_s")
        if mine and theirs:
            out.append(mine / theirs)
    return out


def summarize(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The headline figures over the case records.

    Returns:
        ``min_ratio`` / ``median_ratio``: ours / TorchRec's samples/s over the cases both ran (None if none);
        ``cases_only_ours_runs``: the cases ours ran and TorchRec's did not; ``tuned_min_ratio`` /
        ``tuned_median_ratio``: the same as the first two for a ``tuned`` plan (None while there is none);
        ``median_paired_ratio`` / ``median_step_ratio``: the medians of the cases' robust views (:func:`compare`).
    """
    out: dict[str, Any] = {}
    for label, prefix in (("ours", ""), ("tuned", "tuned_")):
        values = ratios(records, label)
        out[f"{prefix}min_ratio"] = min(values) if values else None
        out[f"{prefix}median_ratio"] = statistics.median(values) if values else None
    out["cases_only_ours_runs"] = sum(
        1 for r in records if r.get("ours_samples_per_s") and not r.get(f"{BASELINE}_samples_per_s")
    )
    out["cases_both_run"] = len(ratios(records))
    for key in ("paired_ratio", "step_ratio"):
        values = [r[key] for r in records if r.get(key) is not None]
        out[f"median_{key}"] = statistics.median(values) if values else None
    return out


def results_table(records: Sequence[Mapping[str, Any]], title: str) -> Table:
    table = Table(title=title)
    columns = (
        "case",
        "kind",
        "tables",
        "trainers",
        "budget",
        "ours: mix",
        "TorchRec: mix",
        "ours samples/s",
        "TorchRec samples/s",
        "ratio",
        "paired",
        "by step",
        "tuned: kept, ratio",
        "predicted ms (ours / TR)",
        "TorchRec status",
    )
    for column in columns:
        table.add_column(
            column,
            justify="left" if column in ("case", "kind", "ours: mix", "TorchRec: mix", "TorchRec status") else "right",
        )

    def rate(value: float | None) -> str:
        return "-" if value is None else f"{value:,.0f}"

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    def times(value: float | None) -> str:
        if value is None:
            return "-"
        return f"[green]{value:.2f}x[/]" if value >= 1 else f"[red]{value:.2f}x[/]"

    for r in records:
        status = r[f"{BASELINE}_status"]
        table.add_row(
            r["name"],
            r["kind"],
            str(r["tables"]),
            str(r["trainers"]),
            f"{r['budget_mib']:g} MiB",
            r["ours_mix"] or "-",
            r[f"{BASELINE}_mix"] or "-",
            rate(r["ours_samples_per_s"]),
            rate(r[f"{BASELINE}_samples_per_s"]),
            times(r.get("ratio")),
            times(r.get("paired_ratio")),
            times(r.get("step_ratio")),
            "-"
            if f"{TUNED}_status" not in r
            else f"{r.get(f'{TUNED}_chosen', r[f'{TUNED}_status'])}, "
            + ("-" if r.get(f"{TUNED}_ratio") is None else f"{r[f'{TUNED}_ratio']:.2f}x"),
            f"{ms(r['ours_predicted_ms'])} / {ms(r[f'{BASELINE}_predicted_ms'])}",
            status if status == "ok" else f"[yellow]{status}[/]",
        )
    return table


# ---- the run ----------------------------------------------------------------------------------------------------
def pick(names: str | None, quick: bool) -> list[Case]:
    """The cases ``--cases`` names (comma-separated), else the quick or full set.

    Raises:
        SystemExit: A name that is no case.
    """
    every = {c.name: c for c in cases()}
    wanted = names.split(",") if names else (QUICK_CASES if quick else list(every))
    unknown = [n for n in wanted if n not in every]
    if unknown:
        raise SystemExit(f"unknown case(s) {', '.join(unknown)}; the cases: {', '.join(every)}")
    return [every[n] for n in wanted]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="CI: 3 cases (one only ours can run), 40 steps, 2 rounds")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--cases", help="comma-separated case names (default: all, or --quick's)")
    parser.add_argument("--rounds", type=int, help="runs of each plan, alternated (default 5; --quick 2)")
    parser.add_argument("--steps", type=int, help="steps per run (default 150; --quick 60)")
    parser.add_argument("--id-space", type=float, help="persia train --id-space (default: persia train's)")
    parser.add_argument("--tune", action="store_true", help="also run persia plan --tune's plan (tuned_* keys)")
    parser.add_argument("--tune-budget", type=float, help="persia plan --tune-budget per case (default 90; --quick 30)")
    args = parser.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 5)
    steps = args.steps or (40 if args.quick else 150)
    chosen = pick(args.cases, args.quick)
    if shutil.which(persia_command()[0]) is None:
        raise SystemExit(f"no persia CLI at {persia_command()[0]}")
    started = time.perf_counter()
    records = []
    with tempfile.TemporaryDirectory(prefix="vs-torchrec-") as tmp:
        for i, case in enumerate(chosen):
            console.print(
                f"[bold]{i + 1}/{len(chosen)} {case.name}[/] ({case.kind}): {case.tables} tables, dim {case.dim}, "
                f"{case.trainers} trainers x {case.budget_bytes / MiB:g} MiB; {rounds} rounds of {steps} steps"
            )
            case_started = time.perf_counter()
            tune = (args.tune_budget or (30.0 if args.quick else 90.0), max(20, steps // 3)) if args.tune else None
            records.append(
                run_case(case, Path(tmp, case.name), steps=steps, rounds=rounds, id_space=args.id_space, tune=tune)
            )
            records[-1]["wall_s"] = round(time.perf_counter() - case_started, 1)
    out: dict[str, Any] = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "quick": args.quick,
        "steps": steps,
        "rounds": rounds,
        **summarize(records),
        "wall_s": round(time.perf_counter() - started, 1),
        "cases": records,
    }
    console.print(
        results_table(
            records,
            f"our plans vs TorchRec 1.8's, persia train --mode sync, {steps} steps, "
            f"median of {rounds} alternated rounds",
        )
    )

    def fmt(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}x"

    console.print(
        f"ours / TorchRec over the {out['cases_both_run']} cases both ran: min {fmt(out['min_ratio'])}, median "
        f"{fmt(out['median_ratio'])} (paired rounds: median {fmt(out['median_paired_ratio'])}; by median step: "
        f"median {fmt(out['median_step_ratio'])}); cases only ours runs: {out['cases_only_ours_runs']}; "
        f"{out['wall_s']:.0f} s"
    )
    if args.tune:
        console.print(
            f"tuned (persia plan --tune) / TorchRec: min {fmt(out['tuned_min_ratio'])}, median "
            f"{fmt(out['tuned_median_ratio'])}; kept: "
            + ", ".join(f"{r['name']} {r.get(f'{TUNED}_chosen', r[f'{TUNED}_status'])}" for r in records)
        )
    for r in records:
        if r[f"{BASELINE}_status"] != "ok" or r["ours_status"] != "ok":
            console.print(
                f"   {r['name']}: TorchRec {r[f'{BASELINE}_status']}: {r[f'{BASELINE}_error']}; "
                f"ours {r['ours_status']}" + (f": {r['ours_error']}" if r["ours_error"] else "")
            )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))
        console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
