"""Planner benchmark: planning time, plan quality, nearly full clusters, the Persia 100T setting, and TorchRec's
planner beside ours.

Prints tables and writes JSON (``--json OUT``). Every comparison is a ratio measured in this same run.

    python benchmarks/planner.py --quick --json out.json   # CI: under 2 minutes
    python benchmarks/planner.py --json out.json           # full: by hand (TorchRec runs take minutes)
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.table import Table

from persia_planner import CapacityError, Topology, load_model, load_topology, plan, validate
from persia_planner.bound import MAX_WEIGHTINGS, lower_bound
from persia_planner.cost import CostModel
from persia_planner.memory import ps_servers_needed
from persia_planner.synthetic import nearly_full_topology, random_model, random_topology

EXAMPLES = Path(__file__).resolve().parents[1] / "persia_planner" / "examples"
console = Console()


def timed_plan(model, topology, repeats: int = 1):
    """Plan ``repeats`` times; returns (the last plan, median seconds)."""
    times = []
    result = None
    for _ in range(repeats):
        started = time.perf_counter()
        result = plan(model, topology)
        times.append(time.perf_counter() - started)
    return result, statistics.median(times)


def bench_speed(sizes: list[int], torchrec_runs: list[tuple[int, int, float]]) -> dict[str, Any]:
    """Planning time of generated models on 8 hosts x 8 GPUs + 8 PS; TorchRec's planner on the same tables."""
    topology = random_topology()
    rows = []
    for n in sizes:
        model = random_model(n, seed=n)
        result, seconds = timed_plan(model, topology, repeats=3 if n <= 1000 else 1)
        assert validate(result, model, topology) == [], f"invalid plan for {n} tables"
        rows.append(
            {
                "tables": n,
                "seconds": seconds,
                "step_ms": result.step_ms,
                "quality": result.quality,
                "remote_tables": len(result.remote_tables()),
            }
        )
    torchrec = []
    if torchrec_runs:
        from torchrec_baseline import time_torchrec_planner

        for n, ranks, timeout_s in torchrec_runs:
            model = random_model(n, seed=n)
            ours = next((r["seconds"] for r in rows if r["tables"] == n), None)
            if ours is None:
                ours = timed_plan(model, topology)[1]
            # TorchRec has no PS tier: its DDR per rank is made large enough for what our plan sends remote.
            status = time_torchrec_planner(
                model,
                world_size=ranks,
                local_world_size=8,
                hbm_bytes=80 * 1024**3,
                ddr_bytes=4 * 1024**4,
                timeout_s=timeout_s,
            )
            torchrec.append(
                {
                    "tables": n,
                    "ranks": ranks,
                    "timeout_s": timeout_s,
                    "status": status["status"],
                    "torchrec_seconds": status["seconds"],
                    "ours_seconds": ours,
                    "speedup": status["seconds"] / ours if ours else None,
                    "error": status.get("error"),
                }
            )
    return {"ours": rows, "torchrec": torchrec}


def quality_cases(count: int) -> list[tuple[int, int, int]]:
    """(tables, seed, trainer hosts) of the seeded generated cases."""
    sizes = [20, 50, 100, 200, 300, 500, 800, 1000]
    hosts = [2, 4, 8]
    return [(sizes[i % len(sizes)], 1000 + i, hosts[i % len(hosts)]) for i in range(count)]


def bench_quality(count: int) -> dict[str, Any]:
    """Estimated step / lower bound over seeded generated cases."""
    cases = []
    for n, seed, hosts in quality_cases(count):
        topology = random_topology(trainers=hosts, servers=hosts, ps_ddr_bytes=16 * 1024**4)
        model = random_model(n, seed=seed)
        result, seconds = timed_plan(model, topology)
        cases.append(
            {
                "tables": n,
                "seed": seed,
                "topology": topology.name,
                "step_ms": result.step_ms,
                "lower_bound_ms": result.lower_bound_ms,
                "ratio": result.quality,
                "seconds": seconds,
            }
        )
    ratios = [c["ratio"] for c in cases]
    return {
        "cases": cases,
        "median_ratio": statistics.median(ratios),
        "worst_ratio": max(ratios),
        "target_median": 1.10,
    }


def bench_vs_torchrec(count: int, timeout_s: float) -> dict[str, Any]:
    """Ours vs TorchRec on HBM+DDR-only clusters: both plans under our cost model and under TorchRec's."""
    from torchrec_baseline import compare_plans

    cases = []
    for i in range(count):
        n = [10, 20, 40][i % 3]
        model = random_model(n, seed=2000 + i, rows_range=(1e3, 1e8), batch_size=8192 * 8)
        topology = random_topology(trainers=1, gpus_per_trainer=8, servers=0)
        ours = plan(model, topology)
        cases.append({"tables": n, "seed": 2000 + i, **compare_plans(model, topology, ours, timeout_s=timeout_s)})
    scored = [c for c in cases if c.get("status") == "ok"]
    return {
        "cases": cases,
        "ours_better_under_ours": sum(c["ours_ms_ours"] < c["torchrec_ms_ours"] * (1 - 1e-9) for c in scored),
        "ours_not_worse_under_torchrec": sum(
            c["ours_ms_torchrec"] <= c["torchrec_ms_torchrec"] * (1 + 1e-9) for c in scored
        ),
        "compared": len(scored),
    }


def bench_tight(cases: list[tuple[int, float, int]]) -> dict[str, Any]:
    """Nearly full clusters: the lower bound at its default budget of weightings against the same search run until
    it stops by itself (as it did before the budget), and the whole plan's time."""
    rows = []
    for n, fill, seed in cases:
        model = random_model(n, seed=seed, rows_range=(1e3, 3e9))
        topology = nearly_full_topology(model, fill)
        cost = CostModel(model, topology)
        started = time.perf_counter()
        budget = lower_bound(cost)
        budget_s = time.perf_counter() - started
        started = time.perf_counter()
        unbounded = lower_bound(cost, max_weightings=10**6)
        unbounded_s = time.perf_counter() - started
        try:
            result, seconds = timed_plan(model, topology)
            planned = "ok" if validate(result, model, topology) == [] else "invalid"
        except CapacityError:
            seconds, planned = float("nan"), "does not fit"
        rows.append(
            {
                "tables": n,
                "fill": fill,
                "seed": seed,
                "bound_seconds": budget_s,
                "bound_weightings": budget.weightings,
                "bound_ms": budget.value_ms,
                "unbudgeted_seconds": unbounded_s,
                "unbudgeted_weightings": unbounded.weightings,
                "unbudgeted_ms": unbounded.value_ms,
                "time_ratio": budget_s / unbounded_s,
                "bound_ratio": budget.value_ms / unbounded.value_ms,
                "plan_seconds": seconds,
                "plan": planned,
            }
        )
    return {"cases": rows, "max_weightings": MAX_WEIGHTINGS}


def bench_persia_100t() -> dict[str, Any]:
    """The Persia paper's model on its trainers, with as many parameter servers as its largest table needs (a server's
    store holds at most memory.PS_MAX_ROWS rows of one table; the paper's 30 are refused). ``refused``: the line a
    cluster with fewer servers than that gets, or None when the file declares enough."""
    model = load_model(EXAMPLES / "persia_100t.yaml")
    refused = None
    try:
        plan(model, load_topology(EXAMPLES / "persia_100t_cluster.yaml"))
    except CapacityError as err:
        refused = err.message
    raw = yaml.safe_load((EXAMPLES / "persia_100t_cluster.yaml").read_text())
    servers = next(h for h in raw["hosts"] if h.get("role") == "parameter_server")
    servers["count"] = max(servers["count"], max(ps_servers_needed(t.rows) for t in model.tables))
    topology = Topology.from_dict(raw)
    result, seconds = timed_plan(model, topology, repeats=3)
    assert validate(result, model, topology) == []
    remote = result.remote_tables()
    return {
        "parameters": model.embedding_parameters,
        "bytes": model.total_bytes,
        "seconds": seconds,
        "step_ms": result.step_ms,
        "lower_bound_ms": result.lower_bound_ms,
        "samples_per_s": result.samples_per_s,
        "remote_tables": remote,
        "local_tables": [n for n in result.tables if n not in remote],
        "target_seconds": 10.0,
        "servers": servers["count"],
        "paper_cluster_refused": refused,
    }


def render(results: dict[str, Any]) -> None:
    speed = results["speed"]
    t = Table(title="Planning time (8 hosts x 8 GPUs + 8 PS)")
    for col in ("tables", "seconds (median)", "step ms", "step / bound", "remote tables"):
        t.add_column(col, justify="right")
    for r in speed["ours"]:
        t.add_row(
            str(r["tables"]),
            f"{r['seconds']:.2f}",
            f"{r['step_ms']:.1f}",
            f"{r['quality']:.3f}",
            str(r["remote_tables"]),
        )
    console.print(t)
    if speed["torchrec"]:
        t = Table(title="TorchRec 1.8 EmbeddingShardingPlanner on the same tables (no PS tier)")
        for col in ("tables", "ranks", "TorchRec", "ours", "TorchRec / ours"):
            t.add_column(col, justify="right")
        for r in speed["torchrec"]:
            status = f"{r['torchrec_seconds']:.1f} s" + ("" if r["status"] == "ok" else f" ({r['status']})")
            t.add_row(
                str(r["tables"]),
                str(r["ranks"]),
                status,
                f"{r['ours_seconds']:.2f} s",
                f"{r['speedup']:.0f}x" + ("" if r["status"] == "ok" else "+"),
            )
        console.print(t)
    t = Table(title="Nearly full clusters (1 host x 1 GPU + 4 PS): bound at its budget / run to its end")
    for col in ("tables", "fill", "budget s (n)", "to end s (n)", "time", "bound", "plan s"):
        t.add_column(col, justify="right")
    for r in results["tight"]["cases"]:
        t.add_row(
            str(r["tables"]),
            f"{r['fill']:.3f}",
            f"{r['bound_seconds']:.2f} ({r['bound_weightings']})",
            f"{r['unbudgeted_seconds']:.2f} ({r['unbudgeted_weightings']})",
            f"{r['time_ratio']:.2f}",
            f"{r['bound_ratio']:.4f}",
            f"{r['plan_seconds']:.2f}" if r["plan"] == "ok" else r["plan"],
        )
    console.print(t)
    q = results["quality"]
    console.print(
        f"Plan quality over {len(q['cases'])} seeded cases: step / lower bound median "
        f"{q['median_ratio']:.3f} (target <= {q['target_median']}), worst {q['worst_ratio']:.3f}"
    )
    if "vs_torchrec" in results:
        v = results["vs_torchrec"]
        t = Table(title="Ours vs TorchRec's plan, HBM+DDR only (ms per step; lower is better)")
        for col in (
            "tables",
            "ours @ our model",
            "TorchRec @ our model",
            "ours @ TorchRec model",
            "TorchRec @ TorchRec model",
        ):
            t.add_column(col, justify="right")
        for c in v["cases"]:
            if c.get("status") != "ok":
                t.add_row(str(c["tables"]), "-", f"({c.get('status')})", "-", "-")
                continue
            t.add_row(
                str(c["tables"]),
                f"{c['ours_ms_ours']:.2f}",
                f"{c['torchrec_ms_ours']:.2f}",
                f"{c['ours_ms_torchrec']:.3f}",
                f"{c['torchrec_ms_torchrec']:.3f}",
            )
        console.print(t)
        console.print(
            f"ours better under our model in {v['ours_better_under_ours']}/{v['compared']}; "
            f"not worse under TorchRec's model in {v['ours_not_worse_under_torchrec']}/{v['compared']}"
        )
    p = results["persia_100t"]
    console.print(
        f"Persia 100T on {p['servers']} parameter servers: {p['parameters'] / 1e12:.1f}T parameters "
        f"({p['bytes'] / 1e12:.0f} TB) planned in "
        f"{p['seconds']:.2f} s (target < {p['target_seconds']:.0f} s); step {p['step_ms']:.1f} ms, "
        f"bound {p['lower_bound_ms']:.1f} ms; remote: {', '.join(p['remote_tables'][:6])}"
        f"{' ...' if len(p['remote_tables']) > 6 else ''} ({len(p['remote_tables'])} tables)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="CI mode: smaller sizes, short TorchRec timeouts")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--no-torchrec", action="store_true", help="skip the TorchRec comparisons")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    logging.getLogger("torchrec").setLevel(logging.ERROR)  # its "construct Topology via TopologyFactory" notices
    started = time.perf_counter()
    if args.quick:
        # TorchRec's planner on 100 tables takes minutes (the full run times it): 15 s bounds it in CI all the same.
        sizes, torchrec_runs, n_quality, n_vs, vs_timeout = [10, 100, 1000], [(10, 8, 30.0), (100, 8, 15.0)], 8, 3, 30.0
        tight_cases = [(100, 1.003, 4)]
    else:
        sizes = [10, 100, 1000, 10000]
        torchrec_runs = [(100, 64, 240.0), (500, 64, 240.0), (1000, 8, 240.0), (100, 8, 240.0)]
        n_quality, n_vs, vs_timeout = 20, 9, 120.0
        tight_cases = [(100, 1.003, 4), (200, 1.001, 1), (200, 1.01, 1), (300, 1.001, 1)]
    if args.no_torchrec:
        torchrec_runs, n_vs = [], 0
    results: dict[str, Any] = {
        "mode": "quick" if args.quick else "full",
        "machine": platform.platform(),
        "python": platform.python_version(),
    }
    results["speed"] = bench_speed(sizes, torchrec_runs)
    results["quality"] = bench_quality(n_quality)
    results["tight"] = bench_tight(tight_cases)
    if n_vs:
        results["vs_torchrec"] = bench_vs_torchrec(n_vs, vs_timeout)
    results["persia_100t"] = bench_persia_100t()
    results["total_seconds"] = time.perf_counter() - started
    render(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
        console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
