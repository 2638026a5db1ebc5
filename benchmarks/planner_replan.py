"""The planner's re-planning when a cluster changes by a host: :meth:`persia_planner.Planner.plan_from` (a warm start
from the neighbour's plan) against a plan searched from scratch, on planner.py's 1,000-table process model
(``incremental_replan_s``: the slower of a host joining and a host leaving)."""

from __future__ import annotations

import statistics
import time
from typing import Any

from persia_planner import GreedyLocalSearch, Planner, SearchConfig, Topology, validate
from persia_planner.synthetic import random_model

INCREMENTAL_TARGET_S = 0.2  # Planner.plan_from of the 1,000 tables after a host joins or leaves


def bench_incremental(repeats: int, tables: int, dims: tuple[int, ...]) -> dict[str, Any]:
    """Re-planning a model of ``tables`` generated tables (planner.py's process model) when its 8 x 8 GPU cluster
    gains or loses a trainer host: :meth:`Planner.plan_from` the 8-host plan (warm start, 0.05 s of local search),
    against a plan searched from scratch on the new cluster; the median of ``repeats`` re-plans, each case."""
    model = random_model(tables, seed=tables, dims=dims)

    def cluster(hosts: int) -> Topology:
        return Topology.simple(trainers=hosts, gpus_per_trainer=8, servers=8, ps_ddr_bytes=64 * 1024**4)

    planner = Planner(GreedyLocalSearch(SearchConfig(explain_top=0)))
    before = planner.plan(model, cluster(8))
    cases = []
    for hosts, change in ((9, "a host joins"), (7, "a host leaves")):
        topology = cluster(hosts)
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            warm = planner.plan_from(model, topology, before)
            times.append(time.perf_counter() - started)
        assert validate(warm, model, topology) == [], f"invalid re-plan on {hosts} hosts"
        started = time.perf_counter()
        fresh = planner.plan(model, topology)
        cases.append(
            {
                "change": change,
                "hosts": hosts,
                "replan_s": statistics.median(times),
                "runs_s": times,
                "fresh_s": time.perf_counter() - started,
                "replan_step_ms": warm.step_ms,
                "fresh_step_ms": fresh.step_ms,
                "step_ratio": warm.step_ms / fresh.step_ms,
            }
        )
    return {
        "tables": tables,
        "cases": cases,
        "incremental_replan_s": max(c["replan_s"] for c in cases),
        "target_s": INCREMENTAL_TARGET_S,
        "worst_step_ratio": max(c["step_ratio"] for c in cases),
    }


def render_incremental(incremental: dict[str, Any], console: Any, table_type: Any) -> None:
    """The re-planning table and its headline."""
    t = table_type(
        title=f"Re-planning {incremental['tables']} tables when a host joins or leaves (warm start against fresh)"
    )
    for col in ("change", "re-plan s", "fresh s", "re-plan step ms", "fresh step ms", "ratio"):
        t.add_column(col, justify="right")
    for c in incremental["cases"]:
        t.add_row(
            c["change"],
            f"{c['replan_s']:.3f}",
            f"{c['fresh_s']:.2f}",
            f"{c['replan_step_ms']:.1f}",
            f"{c['fresh_step_ms']:.1f}",
            f"{c['step_ratio']:.3f}",
        )
    console.print(t)
    console.print(
        f"incremental_replan_s {incremental['incremental_replan_s']:.3f} s (the slower case; target < "
        f"{incremental['target_s']} s)"
    )
