"""Write benchmarks/RESULTS.md from the benchmarks' JSON files (the figures are never typed by hand).

    python benchmarks/results.py benchmarks/results/hybrid.json [more.json ...] > benchmarks/RESULTS.md

Each file becomes one section: its headline keys (the ones an issue names) first, then every other scalar, one level
of nesting flattened (``speed.k4_over_k0_no_delay``), then one table per list of named records (the cost model's
cases: a row per record, a column per scalar field). Other lists (per-step losses, per-round rates) are left out.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

HEADLINES = {
    "sizing": ("optimal_share", "speedup", "median_speedup", "size_1000_s"),
    "sequence": (
        "auc_hybrid",
        "auc_sync",
        "auc_teacher",
        "auc_gap",
        "auc_no_history",
        "history_gain",
        "cost_error",
        "predicted_step_ms",
        "step_ms",
    ),
    "ssd_tier": (
        "ssd_tables",
        "ssd_predicted_step_ms",
        "ssd_step_ms",
        "ssd_step_error",
        "ddr_step_ms",
        "ddr_step_error",
        "ssd_over_ddr_step",
        "ssd_disk_reads_per_step",
    ),
    "netcluster": (
        "hosts",
        "trained",
        "sync_equals_single_host",
        "sockets_outside_cluster",
        "k4_over_k0",
        "auc_gap",
        "predicted_ms",
        "measured_ms",
        "step_error",
        "fault_stop_s.ps1",
        "fault_stop_s.trainer1",
        "resumed",
        "replan_speedup",
        "declared_speedup",
        "calibrated_over_declared",
        "adapt_speedup",
        "ours_over_torchrec",
    ),
    "cluster_replanning": (
        "replan_speedup",
        "declared_speedup",
        "calibrated_over_declared",
        "adapt_speedup",
        "ours_over_torchrec",
    ),
    "hybrid": (
        "dmp_samples_per_s",
        "local_samples_per_s",
        "hybrid_samples_per_s",
        "hybrid_vs_dmp",
        "sync_vs_torchrec_max_abs_diff",
        "executed_matches_plan",
        "pipelined_samples_per_s.k0",
        "pipelined_samples_per_s.k4",
        "pipelined_over_plain.k0",
        "pipelined_over_plain.k4",
        "qcomms_auc_gap",
        "qcomms_samples_per_s",
        "fp32_comms_samples_per_s",
        "qcomms_speedup",
    ),
    "cost_model": (
        "median_abs_error",
        "worst_abs_error",
        "refit_median_abs_error",
        "refit_worst_abs_error",
        "ranking_correct",
        "memory_max_abs_error",
        "calibrate_s",
    ),
    "planner": (
        "plan_process_s",
        "incremental_replan_s",
        "plan_process_10k_s",
        "scaling_exponent",
        "heterogeneous_median_step_over_bound",
    ),
    "ps_pressure": (
        "evictions",
        "distinct_ids_over_capacity",
        "rss_over_planned",
        "rss_over_full_store",
        "auc_bounded",
        "auc_unbounded",
        "auc_gap",
    ),
    "soak": (
        "duration_s",
        "throughput_ratio_last_vs_first",
        "cpu_ratio_last_vs_first",
        "rss_growth_max",
        "rss_growth_worst",
    ),
    "optimality": ("within_2pct_share", "worst_gap", "median_bound_over_optimum"),
    "fuzz": ("examples", "failed"),
    "vs_baselines": (
        "persia_minus_lr_min",
        "persia_minus_fm_min",
        "persia_at_least_lr",
        "persia_at_least_lr_every_split",
    ),
    "vs_torchrec": (
        "min_ratio",
        "median_ratio",
        "cases_only_ours_runs",
        "tuned_min_ratio",
        "tuned_median_ratio",
        "adapted_min_ratio",
        "adapted_median_ratio",
    ),
}


def _records(data: dict[str, Any], prefix: str = "") -> dict[str, list[dict[str, Any]]]:
    """Lists of named records (dicts with a ``name``), one level of nesting deep, by their flattened key."""
    out: dict[str, list[dict[str, Any]]] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, list) and value and all(isinstance(v, dict) and "name" in v for v in value):
            out[name] = value
        elif isinstance(value, dict) and not prefix:
            out.update(_records(value, f"{name}."))
    return out


def _table(key: str, records: list[dict[str, Any]]) -> list[str]:
    columns = list(dict.fromkeys(k for r in records for k, v in _scalars(r).items()))
    lines = ["", f"`{key}`:", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in records:
        flat = _scalars(r)
        lines.append("| " + " | ".join(_fmt(flat.get(c, "")) for c in columns) + " |")
    return lines


def _scalars(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and not prefix:
            out.update(_scalars(value, f"{name}."))
        elif isinstance(value, bool | int | float | str) or value is None:
            out[name] = value
    return out


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) >= 100 else f"{value:.4g}"
    return str(value)


def section(path: Path) -> str:
    data = json.loads(path.read_text())
    name = path.stem.split("-")[0]
    flat = _scalars(data)
    first = [k for k in HEADLINES.get(name, ()) if k in flat]
    machine = data.get("machine", {})
    platform = machine.get("platform", "?") if isinstance(machine, dict) else str(machine)
    lines = [f"## {path.stem}", "", f"`{path.name}`, machine: {platform}", ""]
    lines += ["| key | value |", "|---|---|"]
    lines += [f"| **{k}** | {_fmt(flat[k])} |" for k in first]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in flat.items() if k not in first and not k.startswith("machine.")]
    for key, records in _records(data).items():
        lines += _table(key, records)
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    print("# Benchmark results\n\nWritten by `benchmarks/results.py` from the JSON of the runs each section names.\n")
    for arg in argv:
        print(section(Path(arg)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
