"""Cost-model benchmark: what the planner predicts for a plan against what ``persia train`` measures, on this machine.

1. Calibrate this machine (``persia calibrate``, quick in ``--quick``) into a profile, in this run.
2. For CPU configurations that differ in tables, dims, pooling, batch, trainers' memory (so placement), PS processes
   and staleness: plan on a CPU topology that references the profile, predict the step (``CostModel``), and run
   ``persia train`` (median step after warm-up, and its measured breakdown). Errors are ``predicted / measured - 1``.
3. Ranking: three plans of one model (the planner's, all local, more tables on the PS): is the predicted order the
   measured one, and is the planner's plan within 5% of the best measured?

Prints a table per term and writes JSON (``--json OUT``) with ``cases``, ``median_abs_error``, ``worst_abs_error``,
``ranking_correct`` and ``memory_max_abs_error`` (``None`` until the memory comparison lands here).

    python benchmarks/cost_model.py --quick --json out.json
"""

from __future__ import annotations

import argparse
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
from persia_planner.planner import Planner
from persia_planner.search import GreedyLocalSearch
from persia_planner.specs import DenseSpec, TableSpec

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

    def model(self) -> ModelSpec:
        tables = [
            TableSpec(f"c{i + 1}", self.big_rows if i == 0 else self.rows, self.dim, self.pooling)
            for i in range(self.tables)
        ]
        # DLRM-small's dense part: bottom 13-64-dim, top (dim + F(F-1)/2)-64-32-1, interaction F x F x dim.
        f = self.tables + 1
        top_in = self.dim + f * (f - 1) // 2
        macs = 13 * 64 + 64 * self.dim + top_in * 64 + 64 * 32 + 32 + f * f * self.dim
        params = 13 * 64 + 64 * self.dim + top_in * 64 + 64 * 32 + 32
        return ModelSpec(
            self.name, self.batch, tuple(tables), dense=DenseSpec(params, 2 * macs), staleness=self.staleness
        )


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
        config = SearchConfig(seed=0, improve_time_s=1.0, tiers=frozenset({*(Tier(t) for t in case.tiers)}))
    return Planner(GreedyLocalSearch(config)).plan(model, topology)


def measure(case: Case, model: ModelSpec, the_plan: Any, topology: Any, steps: int) -> dict[str, Any]:
    from persia_planner.modules.train import TrainConfig, train_local

    cfg = TrainConfig(steps=steps, mode=case.mode, staleness=case.staleness, eval_batches=1, progress=False)
    servers = len(topology.servers)
    return train_local(cfg, model, dict(the_plan.tables), servers=max(1, servers), topology=topology)


MODEL_TERMS = {"embedding": "emb", "all_to_all": "a2a", "dense": "dense", "all_reduce": "allreduce"}


def run_case(case: Case, profile: Path, folder: Path, steps: int) -> dict[str, Any]:
    model = case.model()
    topology = load_topology(topology_for(case, profile, folder))
    the_plan = plan_for(case, model, topology)
    estimate, _ = CostModel(model, topology).evaluate(the_plan.tables)
    started = time.perf_counter()
    result = measure(case, model, the_plan, topology, steps)
    parts = {k: float(v[0]) for k, v in estimate.per_gpu.items()}
    measured_terms = result["step_breakdown_ms"]
    predicted_terms = {term: parts[name] for term, name in MODEL_TERMS.items()}
    predicted_terms["ps"] = parts["async"]
    measured_ps = measured_terms.get("ps_wait", 0.0) + measured_terms.get("push", 0.0)
    return {
        "name": case.name,
        "ps_tables": sorted(the_plan.remote_tables()),
        "predicted_ms": estimate.step_ms,
        "measured_ms": result["step_ms"],
        "error": estimate.step_ms / result["step_ms"] - 1,
        "terms": {
            term: {
                "predicted_ms": predicted_terms[term],
                "measured_ms": measured_ps if term == "ps" else measured_terms.get(term, 0.0),
            }
            for term in (*MODEL_TERMS, "ps")
        },
        "data_ms": measured_terms.get("data", 0.0),
        "wall_s": time.perf_counter() - started,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="quick calibration, fewer steps (CI)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--profile", type=Path, help="use this profile instead of calibrating now")
    args = parser.parse_args(argv)
    steps = 40 if args.quick else 80
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        profile = args.profile.resolve() if args.profile else folder / "profile.yaml"
        if args.profile is None:
            from persia_planner.modules.calibrate import calibrate

            console.print("[bold]1. calibrate[/] this machine")
            started = time.perf_counter()
            profile.write_text(yaml.safe_dump(calibrate(quick=args.quick)))
            console.print(f"   {time.perf_counter() - started:.0f} s")
        console.print(f"[bold]2. predicted vs measured[/]: {len(cases())} configurations, {steps} steps")
        results = []
        for case in cases():
            results.append(run_case(case, profile, folder, steps))
            r = results[-1]
            console.print(f"   {r['name']}: predicted {r['predicted_ms']:.1f} ms, measured {r['measured_ms']:.1f} ms")
    errors = [abs(r["error"]) for r in results]
    out = {
        "quick": args.quick,
        "cases": results,
        "median_abs_error": statistics.median(errors),
        "worst_abs_error": max(errors),
        "ranking_correct": None,
        "memory_max_abs_error": None,
    }
    table = Table(title="cost model: predicted vs measured step (ms)")
    for column in ("case", "PS tables", "predicted", "measured", "error", *MODEL_TERMS, "ps"):
        table.add_column(column, justify="left" if column in ("case", "PS tables") else "right")
    for r in results:
        terms = [f"{t['predicted_ms']:.1f} / {t['measured_ms']:.1f}" for t in r["terms"].values()]
        table.add_row(
            r["name"],
            ",".join(r["ps_tables"]) or "-",
            f"{r['predicted_ms']:.1f}",
            f"{r['measured_ms']:.1f}",
            f"{r['error']:+.0%}",
            *terms,
        )
    console.print(table)
    console.print(
        f"median |error| {out['median_abs_error']:.0%} (target <= 15%), worst {out['worst_abs_error']:.0%} "
        "(target <= 30%); terms are predicted / measured"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
