"""Planner benchmark: planning time (in-process, and ``persia plan`` as a whole process of 1,000 and 10,000 tables,
with the time's scaling exponent), re-planning when a host joins or leaves (``incremental_replan_s``), plan quality
(also on heterogeneous clusters at K = 0), nearly full clusters, the Persia 100T setting, and TorchRec's planner
beside ours.

Prints tables and writes JSON (``--json OUT``). Every comparison is a ratio measured in this same run. TorchRec's
planner and ours get the same problem: the same ranks and per-rank memory, no parameter-server tier (TorchRec has
none), and both plans are scored by both estimators, ours and TorchRec's, with any memory shortfall stated.

    python benchmarks/planner.py --quick --json out.json   # CI: a few minutes (scaling to 1,000 hosts)
    python benchmarks/planner.py --json out.json           # full: by hand (TorchRec runs take minutes)
    python benchmarks/planner.py --scale-only --json out.json  # the scaling table alone (100 -> 10,000 hosts)
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from rich.console import Console
from rich.table import Table

from persia_planner import (
    CapacityError,
    GreedyLocalSearch,
    Planner,
    SearchConfig,
    Tier,
    Topology,
    load_model,
    load_topology,
    plan,
    validate,
)
from persia_planner.bound import MAX_WEIGHTINGS, lower_bound
from persia_planner.cost.analytic import CostModel
from persia_planner.paths import EXAMPLES
from persia_planner.placement.memory import ps_servers_needed
from persia_planner.synthetic import (
    heterogeneous_topology,
    model_dict,
    nearly_full_topology,
    random_model,
    random_topology,
)

console = Console()
# TorchRec has no parameter-server tier: compared with it, our search may use only these.
LOCAL_TIERS = frozenset({Tier.HBM, Tier.HBM_CACHE, Tier.DDR})
# Rows of the generated tables compared with TorchRec: small enough for the trainers' HBM + DDR to hold them.
LOCAL_ROWS = (1e3, 1e8)
PROCESS_TABLES = 1000  # `persia plan` of this many tables on 8 hosts x 8 GPUs + 8 PS, the whole process
PROCESS_TARGET_S = 1.5
PROCESS_10K_TARGET_S = 20.0  # ... and of 10,000 tables
PROCESS_DIMS = (16, 32, 64, 128, 256)


def timed_plan(model, topology, repeats: int = 1):
    """Plan ``repeats`` times; returns (the last plan, median seconds)."""
    times = []
    result = None
    for _ in range(repeats):
        started = time.perf_counter()
        result = plan(model, topology)
        times.append(time.perf_counter() - started)
    return result, statistics.median(times)


def plan_local(model, topology):
    """Our plan without the parameter-server tier (the problem TorchRec's planner solves)."""
    return Planner(GreedyLocalSearch(SearchConfig(tiers=LOCAL_TIERS))).plan(model, topology)


def bench_process(tables: int, repeats: int) -> dict[str, Any]:
    """``persia plan MODEL TOPOLOGY --out plan.json`` of ``tables`` generated tables (dims 16-256, pooling 1-50, Zipf
    skew, rows 1e3-1e9) on 8 hosts x 8 GPUs + 8 PS, timed as a whole process (interpreter start, imports, YAML,
    search, validation, plan.json and the printed report); the median of ``repeats`` runs."""
    model = random_model(tables, seed=tables, dims=PROCESS_DIMS)
    cluster = Topology.simple_dict(trainers=8, gpus_per_trainer=8, servers=8, ps_ddr_bytes=64 * 1024**4, name="8x8+8ps")
    persia = Path(sys.executable).with_name("persia")
    command = [str(persia)] if persia.exists() else [sys.executable, "-m", "persia_planner.cli"]
    times = []
    with tempfile.TemporaryDirectory(prefix="persia-plan-") as tmp:
        files = [Path(tmp, "model.yaml"), Path(tmp, "topology.yaml"), Path(tmp, "plan.json")]
        files[0].write_text(yaml.safe_dump(model_dict(model), sort_keys=False))
        files[1].write_text(yaml.safe_dump(cluster, sort_keys=False))
        args = [*command, "plan", str(files[0]), str(files[1]), "--out", str(files[2]), "--overwrite"]
        for _ in range(repeats):
            started = time.perf_counter()
            done = subprocess.run(args, capture_output=True, text=True)
            times.append(time.perf_counter() - started)
            if done.returncode != 0:
                raise RuntimeError(f"persia plan exited {done.returncode}: {done.stderr.strip()[-300:]}")
        planned = json.loads(files[2].read_text())["estimate"]
    return {
        "tables": tables,
        "topology": cluster["name"],
        "command": " ".join(Path(a).name if i == 0 else a for i, a in enumerate(args[: len(command) + 1])),
        "runs_s": times,
        "seconds": statistics.median(times),
        "step_over_bound": planned["step_ms"] / planned["lower_bound_ms"],
    }


def bench_processes(sizes: list[int], repeats: int) -> dict[str, Any]:
    """:func:`bench_process` at each size (the first :data:`PROCESS_TABLES`); the times' slope in log-log."""
    runs = [bench_process(n, repeats if n <= PROCESS_TABLES else 1) for n in sizes]
    by_size = {r["tables"]: r for r in runs}
    slope = float(np.polyfit(np.log(sizes), np.log([r["seconds"] for r in runs]), 1)[0]) if len(runs) > 1 else None
    return {
        "runs": runs,
        "plan_process_s": by_size[PROCESS_TABLES]["seconds"],
        "target_s": PROCESS_TARGET_S,
        "plan_process_10k_s": by_size[10_000]["seconds"] if 10_000 in by_size else None,
        "target_10k_s": PROCESS_10K_TARGET_S,
        "scaling_exponent": slope,
    }


def bench_heterogeneous(count: int) -> dict[str, Any]:
    """Step / lower bound on generated heterogeneous clusters (2-4 trainer hosts of their own GPU count, HBM and
    NIC; 2 servers) at K = 0, with models of 29-38 tables."""
    cases = []
    for seed in range(count):
        topology = heterogeneous_topology(seed)
        model = random_model(29 + seed % 10, seed=seed, staleness=0)
        result, seconds = timed_plan(model, topology)
        assert validate(result, model, topology) == [], f"invalid plan on {topology.name}"
        cases.append(
            {
                "topology": topology.name,
                "gpus": len(topology.gpus),
                "tables": len(model.tables),
                "step_ms": result.step_ms,
                "lower_bound_ms": result.lower_bound_ms,
                "ratio": result.quality,
                "bound_parts": dict(result.bound_parts),
                "seconds": seconds,
            }
        )
    ratios = [c["ratio"] for c in cases]
    return {"cases": cases, "median_ratio": statistics.median(ratios), "worst_ratio": max(ratios), "aim": 1.15}


def bench_speed(sizes: list[int], torchrec_runs: list[tuple[int, int, float]]) -> dict[str, Any]:
    """Planning time of generated models on 8 hosts x 8 GPUs + 8 PS; then TorchRec's planner and ours on one problem:
    tables the trainers can hold, the same ranks (8 per host), no parameter-server tier."""
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
        from torchrec_baseline import compare_plans

        for n, ranks, timeout_s in torchrec_runs:
            model = random_model(n, seed=n, rows_range=LOCAL_ROWS)
            topology = random_topology(trainers=ranks // 8, gpus_per_trainer=8, servers=0)
            started = time.perf_counter()
            try:
                ours, ours_status = plan_local(model, topology), "ok"
            except CapacityError:
                ours, ours_status = None, "does not fit"
            ours_seconds = time.perf_counter() - started
            compared = compare_plans(model, topology, ours, timeout_s=timeout_s)
            ok = compared["status"] == "ok" and ours is not None
            torchrec.append(
                {
                    "tables": n,
                    "ranks": ranks,
                    "timeout_s": timeout_s,
                    **compared,
                    "ours_status": ours_status,
                    "ours_seconds": ours_seconds,
                    "speedup": compared["torchrec_seconds"] / ours_seconds if ours is not None else None,
                    "both_planned": ok,
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
    """Ours vs TorchRec on 1 host x 8 GPUs (8 ranks each), without the PS tier: both plans under both estimators.

    Our search minimises our estimator, so a plan that is better under it is no evidence; the summary counts what
    TorchRec's own estimator says of the two plans, and TorchRec's plans that overfill a device as we allocate it.
    """
    from torchrec_baseline import compare_plans

    cases = []
    for i in range(count):
        n = [10, 20, 40][i % 3]
        model = random_model(n, seed=2000 + i, rows_range=LOCAL_ROWS, batch_size=8192 * 8)
        topology = random_topology(trainers=1, gpus_per_trainer=8, servers=0)
        ours = plan_local(model, topology)
        cases.append({"tables": n, "seed": 2000 + i, **compare_plans(model, topology, ours, timeout_s=timeout_s)})
    scored = [c for c in cases if c.get("status") == "ok"]
    return {
        "cases": cases,
        "ours_not_worse_under_torchrec": sum(
            c["ours_ms_torchrec"] <= c["torchrec_ms_torchrec"] * (1 + 1e-9) for c in scored
        ),
        "torchrec_over_capacity": sum(c["torchrec_over_capacity"]["bytes"] > 0 for c in scored),
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
    process = results["plan_process"]
    t = Table(title="`persia plan` as a whole process (8 hosts x 8 GPUs + 8 PS; dims 16-256)")
    for col in ("tables", "seconds (median)", "runs", "step / bound"):
        t.add_column(col, justify="right")
    for r in process["runs"]:
        t.add_row(str(r["tables"]), f"{r['seconds']:.2f}", str(len(r["runs_s"])), f"{r['step_over_bound']:.3f}")
    console.print(t)
    ten_k = process["plan_process_10k_s"]
    console.print(
        f"{PROCESS_TABLES} tables: {process['plan_process_s']:.2f} s (target < {process['target_s']:g} s); "
        + (f"10,000 tables: {ten_k:.1f} s (target < {process['target_10k_s']:.0f} s); " if ten_k else "")
        + (f"time ~ tables^{process['scaling_exponent']:.2f}" if process["scaling_exponent"] else "")
    )
    hetero = results["heterogeneous"]
    t = Table(title="Heterogeneous clusters at K = 0: step / lower bound")
    for col in ("topology", "GPUs", "tables", "step ms", "bound ms", "step / bound", "bound made of"):
        t.add_column(col, justify="right")
    for c in hetero["cases"]:
        parts = ", ".join(f"{w:.2f} {n}" for n, w in c["bound_parts"].items())
        t.add_row(
            c["topology"],
            str(c["gpus"]),
            str(c["tables"]),
            f"{c['step_ms']:.1f}",
            f"{c['lower_bound_ms']:.1f}",
            f"{c['ratio']:.3f}",
            parts,
        )
    console.print(t)
    console.print(
        f"median step / bound {hetero['median_ratio']:.3f} (aim <= {hetero['aim']}), worst {hetero['worst_ratio']:.3f}"
    )
    if speed["torchrec"]:
        t = Table(title="TorchRec 1.8 EmbeddingShardingPlanner and ours on one problem (same ranks, no PS tier)")
        for col in ("tables", "ranks", "TorchRec", "ours", "TorchRec / ours", "over capacity (TorchRec / ours)"):
            t.add_column(col, justify="right")
        for r in speed["torchrec"]:
            status = f"{r['torchrec_seconds']:.1f} s" + ("" if r["status"] == "ok" else f" ({r['status']})")
            ours = f"{r['ours_seconds']:.2f} s" + ("" if r["ours_status"] == "ok" else f" ({r['ours_status']})")
            ratio = "-" if r["speedup"] is None else f"{r['speedup']:.0f}x" + ("" if r["status"] == "ok" else "+")
            t.add_row(str(r["tables"]), str(r["ranks"]), status, ours, ratio, _shortfalls(r))
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
        t = Table(title="Ours vs TorchRec's plan, 8 ranks, no PS tier (ms per step; lower is better)")
        for col in (
            "tables",
            "ours @ TorchRec's estimator",
            "TorchRec @ TorchRec's estimator",
            "ours @ our estimator",
            "TorchRec @ our estimator",
            "over capacity (TorchRec / ours)",
        ):
            t.add_column(col, justify="right")
        for c in v["cases"]:
            if c.get("status") != "ok":
                t.add_row(str(c["tables"]), "-", f"({c.get('status')})", "-", "-", "-")
                continue
            t.add_row(
                str(c["tables"]),
                f"{c['ours_ms_torchrec']:.3f}",
                f"{c['torchrec_ms_torchrec']:.3f}",
                f"{c['ours_ms_ours']:.2f}",
                f"{c['torchrec_ms_ours']:.2f}",
                _shortfalls(c),
            )
        console.print(t)
        console.print(
            f"Under TorchRec's own estimator ours is not worse in {v['ours_not_worse_under_torchrec']}/"
            f"{v['compared']}; TorchRec's plan overfills a device (as our runtime allocates) in "
            f"{v['torchrec_over_capacity']}/{v['compared']}. Our estimator's column is what our search minimises, "
            "so it is no evidence by itself."
        )
    p = results["persia_100t"]
    console.print(
        f"Persia 100T on {p['servers']} parameter servers: {p['parameters'] / 1e12:.1f}T parameters "
        f"({p['bytes'] / 1e12:.0f} TB) planned in "
        f"{p['seconds']:.2f} s (target < {p['target_seconds']:.0f} s); step {p['step_ms']:.1f} ms, "
        f"bound {p['lower_bound_ms']:.1f} ms; remote: {', '.join(p['remote_tables'][:6])}"
        f"{' ...' if len(p['remote_tables']) > 6 else ''} ({len(p['remote_tables'])} tables)"
    )


def _shortfalls(row: dict[str, Any]) -> str:
    """Each plan's bytes over capacity, e.g. ``1.2 GiB on 3 devices / 0``."""
    from persia_planner.units import format_bytes

    def one(over: dict[str, Any] | None) -> str:
        if over is None:
            return "-"
        return "0" if not over["bytes"] else f"{format_bytes(over['bytes'])} on {over['devices']} devices"

    return f"{one(row.get('torchrec_over_capacity'))} / {one(row.get('ours_over_capacity'))}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="CI mode: smaller sizes, short TorchRec timeouts")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--no-torchrec", action="store_true", help="skip the TorchRec comparisons")
    parser.add_argument("--scale-only", action="store_true", help="only the scaling table (hosts -> time, RSS)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from planner_replan import bench_incremental, render_incremental  # beside this script: on the path above
    from planner_scale import bench_scale, render_scale

    logging.getLogger("torchrec").setLevel(logging.ERROR)  # its "construct Topology via TopologyFactory" notices
    started = time.perf_counter()
    if args.quick:
        # TorchRec's planner on 100 tables takes minutes (the full run times it): 15 s bounds it in CI all the same.
        sizes, torchrec_runs, n_quality, n_vs, vs_timeout = [10, 100, 1000], [(10, 8, 30.0), (100, 8, 15.0)], 8, 3, 30.0
        tight_cases = [(100, 1.003, 4)]
        process_sizes, n_hetero = [1000, 10_000], 6
    else:
        sizes = [10, 100, 1000, 10000]
        torchrec_runs = [(100, 64, 240.0), (500, 64, 240.0), (1000, 8, 240.0), (100, 8, 240.0)]
        n_quality, n_vs, vs_timeout = 20, 9, 120.0
        tight_cases = [(100, 1.003, 4), (200, 1.001, 1), (200, 1.01, 1), (300, 1.001, 1)]
        process_sizes, n_hetero = [1000, 3000, 10_000], 12
    if args.no_torchrec:
        torchrec_runs, n_vs = [], 0
    # Hosts of 8 GPUs: 100 -> 1,000 in CI (about a minute a size at most), 100 -> 10,000 by hand.
    scale_hosts = [100, 300, 1000] if args.quick else [100, 300, 1000, 3000, 10000]
    results: dict[str, Any] = {
        "mode": "quick" if args.quick else "full",
        "machine": platform.platform(),
        "python": platform.python_version(),
    }
    if args.scale_only:
        results["scale"] = bench_scale(scale_hosts)
        results.update({k: v for k, v in results["scale"].items() if k.startswith("scale_")})
        render_scale(results["scale"], console, Table)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1, default=str))
        return 0
    results["plan_process"] = bench_processes(process_sizes, 3 if args.quick else 5)
    results.update({k: v for k, v in results["plan_process"].items() if k.startswith("plan_process_")})
    results["scaling_exponent"] = results["plan_process"]["scaling_exponent"]
    results["incremental"] = bench_incremental(5, PROCESS_TABLES, PROCESS_DIMS)
    results["incremental_replan_s"] = results["incremental"]["incremental_replan_s"]
    results["heterogeneous"] = bench_heterogeneous(n_hetero)
    results["heterogeneous_median_step_over_bound"] = results["heterogeneous"]["median_ratio"]
    results["speed"] = bench_speed(sizes, torchrec_runs)
    results["quality"] = bench_quality(n_quality)
    results["tight"] = bench_tight(tight_cases)
    if n_vs:
        results["vs_torchrec"] = bench_vs_torchrec(n_vs, vs_timeout)
    results["persia_100t"] = bench_persia_100t()
    results["scale"] = bench_scale(scale_hosts)
    results.update({k: v for k, v in results["scale"].items() if k.startswith("scale_")})
    results["total_seconds"] = time.perf_counter() - started
    render(results)
    render_incremental(results["incremental"], console, Table)
    render_scale(results["scale"], console, Table)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
        console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
