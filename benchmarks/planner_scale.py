"""The planner's scaling with the cluster: 100 tables on 100 to 10,000 trainer hosts of 8 GPUs (and a server per 8
hosts), each size planned in a process of its own so that its peak RSS is its own.

The time is the whole of planning (topology, cost model, lower bound, search with a 0.5 s improvement budget);
``scale_exponent`` is the slope of log(seconds) on log(hosts): about 1 when the planner grows linearly.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from typing import Any

import numpy as np

TABLES = 100
GPUS_PER_HOST = 8

# Run in a fresh interpreter per size: prints one JSON line.
_CHILD = """
import json, resource, sys, time
hosts, tables, gpus = (int(a) for a in sys.argv[1:4])


def peak_mb():
    # This process's own peak: ru_maxrss survives exec on Linux, so it would report the parent's when larger.
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


from persia_planner.bound import lower_bound
from persia_planner.cost.analytic import CostModel
from persia_planner.search import GreedyLocalSearch, SearchConfig
from persia_planner.synthetic import random_model, random_topology
start = time.perf_counter()
topology = random_topology(trainers=hosts, gpus_per_trainer=gpus, servers=max(1, hosts // 8))
built = time.perf_counter()
cost = CostModel(random_model(tables, seed=1), topology)
modelled = time.perf_counter()
hint = lower_bound(cost)
bounded = time.perf_counter()
result = GreedyLocalSearch(SearchConfig(improve_time_s=0.5)).search(cost, hint)
done = time.perf_counter()
estimate, _ = cost.evaluate(result.placements)
print(json.dumps({
    "hosts": hosts, "seconds": done - start, "topology_s": built - start, "cost_s": modelled - built,
    "bound_s": bounded - modelled, "search_s": done - bounded, "construct_s": result.construct_s,
    "step_ms": float(estimate.step_ms), "bound_ms": float(hint.value_ms),
    "rss_mb": peak_mb(),
}))
"""


def exponent(xs: list[float], ys: list[float]) -> float:
    """The slope of log(ys) on log(xs) (least squares); nan with fewer than two points."""
    if len(xs) < 2:
        return math.nan
    return float(np.polyfit(np.log(xs), np.log(ys), 1)[0])


def bench_scale(hosts: list[int], timeout_s: float = 3600.0) -> dict[str, Any]:
    """Plan :data:`TABLES` tables on each cluster size of ``hosts``; a size that fails or times out ends the run."""
    rows: list[dict[str, Any]] = []
    for n in hosts:
        try:
            out = subprocess.run(
                [sys.executable, "-c", _CHILD, str(n), str(TABLES), str(GPUS_PER_HOST)],
                capture_output=True,
                text=True,
                timeout=timeout_s,
                check=True,
            )
        except (subprocess.TimeoutExpired, subprocess.CalledProcessError) as err:
            rows.append({"hosts": n, "error": type(err).__name__})
            break
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    ok = [r for r in rows if "error" not in r]
    return {
        "rows": rows,
        "scale_hosts": [r["hosts"] for r in ok],
        "scale_seconds": [r["seconds"] for r in ok],
        "scale_rss_mb": [r["rss_mb"] for r in ok],
        "scale_exponent": exponent([r["hosts"] for r in ok], [r["seconds"] for r in ok]),
        "scale_rss_exponent": exponent([r["hosts"] for r in ok], [r["rss_mb"] for r in ok]),
    }


def render_scale(scale: dict[str, Any], console: Any, table_type: Any) -> None:
    """Print the scaling table (``table_type``: rich's Table)."""
    table = table_type(title=f"Scaling: {TABLES} tables, {GPUS_PER_HOST} GPUs per host, a server per 8 hosts")
    for column in ("hosts", "GPUs", "total s", "topology s", "cost s", "bound s", "search s", "RSS MB", "step ms"):
        table.add_column(column, justify="right")
    for r in scale["rows"]:
        if "error" in r:
            table.add_row(str(r["hosts"]), str(r["hosts"] * GPUS_PER_HOST), r["error"], *[""] * 6)
            continue
        table.add_row(
            str(r["hosts"]),
            str(r["hosts"] * GPUS_PER_HOST),
            f"{r['seconds']:.1f}",
            f"{r['topology_s']:.2f}",
            f"{r['cost_s']:.2f}",
            f"{r['bound_s']:.2f}",
            f"{r['search_s']:.1f}",
            f"{r['rss_mb']:.0f}",
            f"{r['step_ms']:.3f}",
        )
    console.print(table)
    console.print(
        f"time ~ hosts^{scale['scale_exponent']:.2f}, peak RSS ~ hosts^{scale['scale_rss_exponent']:.2f} (log-log fit)"
    )
