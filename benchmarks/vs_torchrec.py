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

The cases, and their kinds of budget (roomy, tight, PS only), are in ``benchmarks/cpu_cases.py``.

Prints a table and writes JSON (``--json OUT``): ``cases`` (a record per case), ``min_ratio`` and ``median_ratio``
(over the cases both plans ran), ``cases_only_ours_runs``, ``tuned_min_ratio`` / ``tuned_median_ratio`` (a third,
tuned plan per case: ``persia plan --tune``'s, with ``--tune``; null without it) and ``adapted_min_ratio`` /
``adapted_median_ratio`` (with ``--adapt``: our plan trained under ``persia train --adapt``, which refits the model to
its own steps, re-plans and migrates; null without it).

    python benchmarks/vs_torchrec.py --quick --json out.json    # CI: 3 cases, 40 steps, 2 rounds (~3 min; --tune ~6)
    python benchmarks/vs_torchrec.py --json out.json            # 10 cases, 150 steps, 5 rounds (~40 minutes)
    python benchmarks/vs_torchrec.py --cases roomy-8t-d16-2tr,ps-26t-d16-2tr --rounds 5
    python benchmarks/vs_torchrec.py --tune --json out.json     # also persia plan --tune's plan (tuned_* keys)
    python benchmarks/vs_torchrec.py --adapt --json out.json    # also our plan under --adapt (adapted_* keys)
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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

if str(Path(__file__).resolve().parent) not in sys.path:  # torchrec_baseline sits beside this file
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from case_plans import (
    ADAPTED,
    BASELINE,
    PLANNERS,
    TRAIN_TIMEOUT_S,
    TUNED,
    CaseFiles,
    PlanOutcome,
    adapted,
    mix_text,
    one_line,
    persia_command,
    plan_tuned,
)
from cpu_cases import Case, MiB, pick, table_bytes

from persia_planner import ModelSpec, Topology, load_model, load_topology

# Nothing here imports torch: the trainers are `persia train` processes, TorchRec's planner runs in its own child.

console = Console(width=max(Console().width, 200))


# ---- training ---------------------------------------------------------------------------------------------------
def train_once(
    files: CaseFiles, plan_path: Path, steps: int, id_space: float | None, extra: Sequence[str] = ()
) -> dict[str, Any]:
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
        *extra,
    ]
    if id_space is not None:
        command += ["--id-space", str(id_space)]
    with tempfile.TemporaryDirectory(prefix="vs-torchrec-ck-") as checkpoint:
        if "--adapt" in extra:  # it migrates through a checkpoint
            command += ["--checkpoint", checkpoint]
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
                result = train_once(files, outcome.path, steps, id_space, outcome.train_args)
            except (RuntimeError, subprocess.TimeoutExpired) as first:
                outcome.retried.append(one_line(first))
                console.print(f"   round {r + 1} {label}: failed, once more ({outcome.retried[-1]})")
                try:
                    result = train_once(files, outcome.path, steps, id_space, outcome.train_args)
                except (RuntimeError, subprocess.TimeoutExpired) as err:
                    outcome.status, outcome.error = "train_failed", one_line(err)
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
    adapt: bool = False,
) -> dict[str, Any]:
    """Plan ``case`` with every planner of :data:`PLANNERS` (and, with ``tune`` = (budget s, steps), ``persia plan
    --tune``; with ``adapt``, our plan once more under ``persia train --adapt``), train the plans, and return the
    case's record."""
    model_path, topology_path = case.write(folder)
    model, topology = load_model(model_path), load_topology(topology_path)
    files = CaseFiles(case, model_path, topology_path, model, topology, folder)
    outcomes = {label: planner(files) for label, planner in PLANNERS.items()}
    if tune is not None:
        outcomes[TUNED] = plan_tuned(files, *tune)
    if adapt:
        outcomes[ADAPTED] = adapted(outcomes["ours"])
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
    for label, prefix in (("ours", ""), (TUNED, "tuned_"), (ADAPTED, "adapted_")):
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
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="CI: 3 cases (one only ours can run), 40 steps, 2 rounds")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--cases", help="comma-separated case names (default: all, or --quick's)")
    parser.add_argument("--rounds", type=int, help="runs of each plan, alternated (default 5; --quick 2)")
    parser.add_argument("--steps", type=int, help="steps per run (default 150; --quick 60)")
    parser.add_argument("--id-space", type=float, help="persia train --id-space (default: persia train's)")
    parser.add_argument("--tune", action="store_true", help="also run persia plan --tune's plan (tuned_* keys)")
    parser.add_argument("--adapt", action="store_true", help="also run our plan under --adapt (adapted_* keys)")
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
            folder = Path(tmp, case.name)
            kept = {"steps": steps, "rounds": rounds, "id_space": args.id_space, "tune": tune, "adapt": args.adapt}
            records.append(run_case(case, folder, **kept))
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
    if args.adapt:
        console.print(
            f"adapted (persia train --adapt from our plan) / TorchRec: min {fmt(out['adapted_min_ratio'])}, median "
            f"{fmt(out['adapted_median_ratio'])}"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))
        console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
