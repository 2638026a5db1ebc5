"""Cost-model benchmark: what the planner predicts for a plan against what ``persia train`` measures, on this machine.

1. Calibrate this machine (``persia calibrate``, quick in ``--quick``) into a profile, in this run.
2. For CPU configurations that differ in tables, dims, pooling, batch, trainers' memory (so placement), PS processes
   and staleness: plan on a CPU topology that references the profile, predict the step (``CostModel``), and run
   ``persia train`` (median step after warm-up, and its measured breakdown). Errors are ``predicted / measured - 1``.
3. Ranking: three plans of one model (the planner's, all local or all on the PS, half of the planner's local tables
   moved to the PS): is the predicted order the measured one, and is the planner's plan within 5% of the best measured?
4. Memory: the planner's bytes per device against what the built modules allocate (``modules/tools/memory_audit.py``:
   tensors' bytes on the trainers, resident memory on the servers).
5. Held-out refit: the cost model's factors (``persia_planner/cost/refit.py``: one per term, and one per sharding
   type's exchange) fitted on half of step 2's cases (alternate cases by index), each case of the other half predicted
   with them; both halves in turn, so that every case has a prediction from runs it was not part of.

Prints a table per term and writes JSON (``--json OUT``) with ``cases``, ``median_abs_error``, ``worst_abs_error``,
``ranking_correct`` (and ``ranking``), ``memory_max_abs_error`` (and ``memory``), ``calibrate_s``, ``by_sharding``
(per sharding type: the cases whose plan uses it, their median and worst |error|), ``ps_cases``, and the held-out
refit's ``refit_median_abs_error``, ``refit_worst_abs_error``, ``refit_factors`` and ``refit_sharding_factors`` (per
half fitted on).

    python benchmarks/cost_model.py --quick --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

from persia_planner import CostModel, ModelSpec, SearchConfig, Tier, load_topology
from persia_planner.cost.refit import SUMMARY_A2A_KEY, RunTerms, predicted_a2a_by_sharding, refit
from persia_planner.cost.refit import predicted_terms as unscaled_terms
from persia_planner.kinds import Sharding
from persia_planner.model.specs import DenseSpec, TableSpec
from persia_planner.modules.data.criteo_format import NUM_INTEGER
from persia_planner.modules.data.synthetic import ZIPF_ALPHA
from persia_planner.planner import Planner
from persia_planner.search import GreedyLocalSearch

console = Console(width=170)
MiB = 1024**2


@dataclass(frozen=True)
class Case:
    """One configuration: a model, the trainers' memory budget, PS processes, staleness and mode."""

    name: str
    tables: int = 12
    rows: int = 20_000
    big_rows: int = 200_000  # the first table: the one a small budget sends to the PS
    dim: int = 16
    pooling: float = 1.0
    batch: int = 2048  # global
    memory: str = "64MiB"  # per trainer
    servers: int = 2
    staleness: int = 4
    mode: str = "hybrid"
    tiers: tuple[str, ...] = ()  # restrict the search (e.g. ("hbm",): all local)
    shardings: tuple[str, ...] = ()  # restrict the search's sharding types (e.g. ("row_wise",): every table split)

    def model(self) -> ModelSpec:
        # Ids as the synthetic data draws them: Zipf over every row of the table (TrainConfig teacher_rows_scale=1).
        tables = [
            TableSpec(f"c{i + 1}", rows, self.dim, self.pooling, zipf_alpha=ZIPF_ALPHA)
            for i, rows in enumerate([self.big_rows] + [self.rows] * (self.tables - 1))
        ]
        # The DLRM persia train builds over these tables.
        dense = DenseSpec.dlrm(NUM_INTEGER, self.dim, self.tables)
        return ModelSpec(self.name, self.batch, tuple(tables), dense=dense, staleness=self.staleness)


def cases() -> list[Case]:
    return [
        Case("default-like, K=4", memory="4MiB"),
        Case("default-like, K=0", memory="4MiB", staleness=0, mode="sync"),
        Case("all local", memory="256MiB", tiers=("hbm",)),
        Case("dim 64", dim=64, rows=5_000, big_rows=50_000, memory="8MiB"),
        Case("pooling 4", pooling=4.0, memory="4MiB"),
        Case("batch 1024", batch=1024, memory="4MiB"),
        Case("one PS process", memory="4MiB", servers=1),
        Case("26 tables", tables=26, rows=5_000, memory="4MiB"),
        # Each TorchRec sharding type a CPU cluster runs, every table placed by it, three cases each.
        Case("row_wise", memory="256MiB", shardings=("row_wise",)),
        Case("row_wise, pooling 4", memory="256MiB", pooling=4.0, shardings=("row_wise",)),
        Case("row_wise, dim 64", dim=64, rows=5_000, big_rows=50_000, memory="256MiB", shardings=("row_wise",)),
        Case("column_wise, dim 32", dim=32, memory="256MiB", shardings=("column_wise",)),
        Case("column_wise, dim 64", dim=64, rows=5_000, big_rows=50_000, memory="256MiB", shardings=("column_wise",)),
        Case("column_wise, pooling 4", dim=32, pooling=4.0, memory="256MiB", shardings=("column_wise",)),
        Case("data_parallel", rows=500, big_rows=2_000, memory="256MiB", shardings=("data_parallel",)),
        Case("data_parallel, dim 64", dim=64, rows=500, big_rows=1_000, memory="256MiB", shardings=("data_parallel",)),
        Case(
            "data_parallel, 26 tables", tables=26, rows=300, big_rows=300, memory="256MiB", shardings=("data_parallel",)
        ),
    ]


def topology_for(case: Case, profile: Path, folder: Path) -> Path:
    hosts: list[dict[str, Any]] = [
        {"name": "trainer", "ddr": "8GiB", "profile": str(profile), "cpus": {"count": 2, "memory": case.memory}}
    ]
    if case.servers:
        hosts.append(
            {"name": "ps", "count": case.servers, "role": "parameter_server", "ddr": "2GiB", "profile": str(profile)}
        )
    path = folder / f"topology-{abs(hash(case.name))}.yaml"
    path.write_text(yaml.safe_dump({"name": case.name, "hosts": hosts, "network": {"latency": "100us"}}))
    return path


def plan_for(case: Case, model: ModelSpec, topology: Any) -> Any:
    config = SearchConfig(seed=0, improve_time_s=1.0)
    if case.tiers:
        config = dataclasses.replace(config, tiers=frozenset(Tier(t) for t in case.tiers))
    if case.shardings:
        config = dataclasses.replace(config, shardings=frozenset(Sharding(s) for s in case.shardings))
    return Planner(GreedyLocalSearch(config)).plan(model, topology)


def by_sharding(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per sharding type: the cases whose plan uses it, their median and worst |error|."""
    out: dict[str, dict[str, Any]] = {}
    for r in results:
        for sharding in r["shardings"]:
            out.setdefault(sharding, {"cases": []})["cases"].append(r["name"])
    for sharding, entry in out.items():
        errors = [abs(r["error"]) for r in results if sharding in r["shardings"]]
        entry.update(median_abs_error=statistics.median(errors), worst_abs_error=max(errors))
    return dict(sorted(out.items()))


def measure(case: Case, model: ModelSpec, tables: dict[str, Any], topology: Any, steps: int) -> dict[str, Any]:
    from persia_planner.modules.train import TrainConfig, train_local

    cfg = TrainConfig(
        steps=steps, mode=case.mode, staleness=case.staleness, eval_batches=1, progress=False, teacher_rows_scale=1.0
    )
    servers = len(topology.servers)
    return train_local(cfg, model, tables, servers=max(1, servers), topology=topology)


MODEL_TERMS = {"embedding": "emb", "all_to_all": "a2a", "dense": "dense", "all_reduce": "allreduce"}
TERMS = (*MODEL_TERMS, "ps")


def predicted_terms(estimate: Any) -> dict[str, float]:
    """The model's step on trainer 0 in the measured breakdown's terms; ``ps``: the parameter-server time the step
    waits for (all of it at K = 0; what the dense step does not hide at K >= 1)."""
    parts = {k: float(v[0]) for k, v in estimate.per_gpu.items()}
    out = {term: parts[name] for term, name in MODEL_TERMS.items()}
    out["ps"] = parts["step"] - parts["sync"]
    return out


def measured_terms(result: dict[str, Any]) -> dict[str, float | None]:
    """``persia train``'s breakdown in the same terms; a run with PS tables is not profiled (decision 0014): its PS
    wait and pushes are timed directly and the other terms are unknown (None)."""
    measured = result["step_breakdown_ms"]
    profiled = "embedding" in measured
    out: dict[str, float | None] = {term: measured.get(term) if profiled else None for term in MODEL_TERMS}
    out["ps"] = measured.get("ps_wait", 0.0) + measured.get("push", 0.0)
    return out


def run_plan(
    case: Case, model: ModelSpec, tables: dict[str, Any], topology: Any, steps: int, name: str | None = None
) -> dict[str, Any]:
    """Predict and measure one placement of ``model``."""
    estimate, _ = CostModel(model, topology).evaluate(tables)
    started = time.perf_counter()
    result = measure(case, model, tables, topology, steps)
    predicted, measured = predicted_terms(estimate), measured_terms(result)
    # What a refit reads (RunTerms.from_summary): the summary's step, breakdown and K, and the model's five terms
    # with the all-to-all's split by sharding type, every factor 1.
    summary = {k: result[k] for k in ("step_ms", "step_breakdown_ms", "staleness")} | {"plan_id": name or case.name}
    summary[SUMMARY_A2A_KEY] = predicted_a2a_by_sharding(model, topology, tables)
    return {
        "name": name or case.name,
        "ps_tables": sorted(t for t, p in tables.items() if p.sharding.value == "ps_hash"),
        "shardings": sorted({p.sharding.value for p in tables.values()}),
        "predicted_ms": estimate.step_ms,
        "measured_ms": result["step_ms"],
        "error": estimate.step_ms / result["step_ms"] - 1,
        "terms": {t: {"predicted_ms": predicted[t], "measured_ms": measured[t]} for t in TERMS},
        "data_ms": result["step_breakdown_ms"].get("data", 0.0),
        "wall_s": time.perf_counter() - started,
        "summary": summary,
        "model_terms_ms": unscaled_terms(model, topology, tables),
    }


def run_case(case: Case, profile: Path, folder: Path, steps: int) -> tuple[dict[str, Any], tuple[Any, ...]]:
    """One case's result, and what predicts it again under other factors: (model, topology, tables)."""
    model = case.model()
    topology = load_topology(topology_for(case, profile, folder))
    tables = dict(plan_for(case, model, topology).tables)
    return run_plan(case, model, tables, topology, steps), (model, topology, tables)


def held_out_refit(results: list[dict[str, Any]], priced: list[tuple[Any, ...]]) -> dict[str, Any]:
    """Fit the factors on every other case and predict the rest with them, both halves in turn: each case's step
    predicted by factors fitted on runs it was not part of."""
    runs = [RunTerms.from_summary(r["summary"], r["model_terms_ms"], r["name"]) for r in results]
    factors: dict[str, dict[str, float]] = {}
    shardings: dict[str, dict[str, float]] = {}
    notes: dict[str, list[str]] = {}
    for half, name in ((0, "even"), (1, "odd")):
        fitted = refit([run for i, run in enumerate(runs) if i % 2 == half])
        factors[f"fit on {name} cases"] = dict(fitted.factors)
        shardings[f"fit on {name} cases"] = dict(fitted.sharding_factors)
        notes[f"fit on {name} cases"] = list(fitted.notes)
        for i in range(1 - half, len(results), 2):
            model, topology, tables = priced[i]
            estimate = CostModel(model, topology.with_constants(fitted.constants())).evaluate(tables)[0]
            r = results[i]
            r["refit_predicted_ms"] = estimate.step_ms
            r["refit_error"] = estimate.step_ms / r["measured_ms"] - 1
            r["refit_terms_ms"] = estimate.slowest_gpu_terms()
    errors = [abs(r["refit_error"]) for r in results]
    return {
        "refit_median_abs_error": statistics.median(errors),
        "refit_worst_abs_error": max(errors),
        "refit_factors": factors,
        "refit_sharding_factors": shardings,
        "refit_notes": notes,
    }


def ranking(profile: Path, folder: Path, steps: int) -> dict[str, Any]:
    """Three plans of one model: the planner's, all tables local, and the large tables on the PS tier. Is the
    predicted order of their step times the measured one, and is the planner's within 5% of the best measured?"""
    case = Case("ranking", memory="256MiB")
    model = case.model()
    topology = load_topology(topology_for(case, profile, folder))
    chosen = dict(plan_for(case, model, topology).tables)
    local = dict(plan_for(Case("all local", memory="256MiB", tiers=("hbm",)), model, topology).tables)
    remote = dict(plan_for(Case("all PS", memory="256MiB", tiers=("ps",)), model, topology).tables)
    # A third plan that differs from the other two: the planner's with the half of the tables it keeps local
    # that are largest moved to the servers.
    kept = sorted((t for t in model.tables if chosen[t.name].sharding.value != "ps_hash"), key=lambda t: -t.rows)
    mixed = dict(chosen) | {t.name: remote[t.name] for t in kept[: max(1, len(kept) // 2)]}
    plans = {"planner's": chosen, "half moved to PS": mixed}
    plans |= {"all local": local} if local != chosen else {"all PS": remote}
    runs = {name: run_plan(case, model, tables, topology, steps, name) for name, tables in plans.items()}
    names = list(runs)
    predicted_order = sorted(names, key=lambda n: runs[n]["predicted_ms"])
    measured_order = sorted(names, key=lambda n: runs[n]["measured_ms"])
    best = min(r["measured_ms"] for r in runs.values())
    return {
        "plans": list(runs.values()),
        "predicted_order": predicted_order,
        "measured_order": measured_order,
        "ranking_correct": predicted_order == measured_order,
        "planner_vs_best": runs["planner's"]["measured_ms"] / best,
    }


def step_table(title: str, results: list[dict[str, Any]]) -> Table:
    table = Table(title=title)
    refitted = any("refit_error" in r for r in results)
    extra = ("refitted", "refit error") if refitted else ()
    for column in ("case", "PS tables", "predicted", "measured", "error", *extra, *TERMS):
        table.add_column(column, justify="left" if column in ("case", "PS tables") else "right")
    for r in results:
        terms = [
            f"{t['predicted_ms']:.1f} / " + ("-" if t["measured_ms"] is None else f"{t['measured_ms']:.1f}")
            for t in r["terms"].values()
        ]
        table.add_row(
            r["name"],
            ",".join(r["ps_tables"]) or "-",
            f"{r['predicted_ms']:.1f}",
            f"{r['measured_ms']:.1f}",
            f"{r['error']:+.0%}",
            *((f"{r['refit_predicted_ms']:.1f}", f"{r['refit_error']:+.0%}") if refitted else ()),
            *terms,
        )
    return table


def memory_table(cases: dict[str, dict[str, dict[str, Any]]]) -> Table:
    table = Table(title="memory: predicted vs allocated bytes per device")
    for column in ("case", "device", "predicted", "allocated", "store's own account", "error"):
        table.add_column(column, justify="left" if column in ("case", "device") else "right")
    for case, devices in cases.items():
        for device, d in devices.items():
            accounted = d.get("accounted")
            table.add_row(
                case,
                device,
                f"{d['predicted']:,}",
                f"{d['allocated']:,}",
                "-" if accounted is None else f"{accounted:,}",
                f"{d['error']:+.2%}",
            )
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="quick calibration, fewer steps (CI)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--profile", type=Path, help="use this profile instead of calibrating now")
    parser.add_argument("--save-profile", type=Path, help="also keep the profile calibrated in this run here")
    args = parser.parse_args(argv)
    steps = 40 if args.quick else 80
    calibrate_s = None
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        profile = args.profile.resolve() if args.profile else folder / "profile.yaml"
        if args.profile is None:
            from persia_planner.modules.tools.calibrate import calibrate

            console.print("[bold]1. calibrate[/] this machine")
            started = time.perf_counter()
            profile.write_text(yaml.safe_dump(calibrate(quick=args.quick)))
            calibrate_s = time.perf_counter() - started
            console.print(f"   {calibrate_s:.0f} s")
            if args.save_profile:
                args.save_profile.write_text(profile.read_text())
        console.print(f"[bold]2. predicted vs measured[/]: {len(cases())} configurations, {steps} steps")
        results, priced = [], []
        for case in cases():
            result, context = run_case(case, profile, folder, steps)
            results.append(result)
            priced.append(context)
            r = results[-1]
            console.print(f"   {r['name']}: predicted {r['predicted_ms']:.1f} ms, measured {r['measured_ms']:.1f} ms")
        console.print("[bold]3. ranking[/]: three plans of one model")
        ranked = ranking(profile, folder, steps)
    from persia_planner.modules.tools.memory_audit import memory_error

    console.print("[bold]4. memory[/]: the planner's bytes per device against what the built modules allocate")
    memory = memory_error()
    errors = [abs(r["error"]) for r in results]
    console.print("[bold]5. held-out refit[/]: factors fitted on every other case, the rest predicted with them")
    refitted = held_out_refit(results, priced)
    out = {
        "quick": args.quick,
        "calibrate_s": calibrate_s,
        "cases": results,
        "median_abs_error": statistics.median(errors),
        "worst_abs_error": max(errors),
        "ranking": ranked,
        "ranking_correct": ranked["ranking_correct"],
        "memory_max_abs_error": memory["memory_max_abs_error"],
        "memory": memory["cases"],
        "by_sharding": by_sharding(results),
        "ps_cases": sum("ps_hash" in r["shardings"] for r in results),
        **refitted,
    }
    console.print(step_table("cost model: predicted vs measured step (ms)", results))
    console.print(
        f"median |error| {out['median_abs_error']:.0%} (target <= 15%), worst {out['worst_abs_error']:.0%} "
        "(target <= 30%); terms are predicted / measured ('-': not measured in runs with PS tables)"
    )
    console.print(
        f"held-out refit: median |error| {out['refit_median_abs_error']:.0%} (target <= 10%), worst "
        f"{out['refit_worst_abs_error']:.0%} (target <= 20%); unrefitted {out['median_abs_error']:.0%} / "
        f"{out['worst_abs_error']:.0%}"
    )
    for half, factors in out["refit_factors"].items():
        shown = ", ".join(f"{t} {f:.2f}" for t, f in (factors | out["refit_sharding_factors"][half]).items())
        console.print(f"   factors {half}: {shown}" + "".join(f"; {n}" for n in out["refit_notes"][half]))
    per_type = Table(title="by sharding type (the cases whose plan uses it)")
    for column in ("sharding", "cases", "median |error|", "worst |error|"):
        per_type.add_column(column, justify="left" if column == "sharding" else "right")
    for sharding, entry in out["by_sharding"].items():
        per_type.add_row(
            sharding, str(len(entry["cases"])), f"{entry['median_abs_error']:.0%}", f"{entry['worst_abs_error']:.0%}"
        )
    console.print(per_type)
    console.print(step_table("ranking: three plans of one model (ms)", ranked["plans"]))
    console.print(memory_table(memory["cases"]))
    console.print(
        f"predicted order {ranked['predicted_order']}, measured {ranked['measured_order']}: "
        f"ranking_correct {ranked['ranking_correct']}; the planner's plan / best measured "
        f"{ranked['planner_vs_best']:.3f} (target <= 1.05)"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
