"""The parameter servers under real pressure (issue 30, part 6): a training run whose PS tables receive more distinct
ids than the servers hold, so rows are admitted and evicted while it trains, against the same run with unbounded
stores.

Both runs train the same small hybrid DLRM (two PS tables, a few local ones; two CPU trainers, two servers) on the
same synthetic data, whose ids are drawn from ``--id-space`` times each table's rows (``persia train --id-space``):

* ``bounded``: each server's store holds what the plan charged it for (``--ps-capacity planned``), so it evicts;
* ``unbounded``: each store holds every id the data can draw (``--ps-capacity unbounded``), so nothing is evicted:
  the baseline, measured in the same invocation.

Per server it reports hits, admissions, evictions, rows held, the stores' bytes and the resident-memory growth
beside the planned bytes (``persia train --json``'s ``ps_servers``). Headline keys: ``evictions`` (bounded run, sum
over servers, must be > 0), ``distinct_ids_over_capacity`` (distinct ids the tables received, read as the unbounded
run's rows, over the bounded servers' capacity: > 1), ``rss_over_planned`` (max over bounded servers of resident
growth / planned bytes; target <= 1), ``rss_over_full_store`` (the same over the bytes of the stores filled to
their capacity, ``memory.ps_bytes`` of the largest bucket: the plan's charge, but for a bucket one row smaller),
``auc_bounded``, ``auc_unbounded`` and ``auc_gap`` (target <= 0.01).

    python benchmarks/ps_pressure.py --json benchmarks/results/ps_pressure.json   # full: a few minutes on 2 cores
    python benchmarks/ps_pressure.py --quick                                      # CI: under 90 s on 2 cores
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from persia_planner.kinds import Sharding
from persia_planner.model.specs import ModelSpec, TableSpec
from persia_planner.placement.memory import ps_bytes
from persia_planner.units import format_bytes

# The training modules (torch, torchrec: ~7 s of imports) are imported inside the functions: every process a run
# starts runs this file's top level again, and the parameter servers need none of them.

console = Console(width=132)
# The trainers' processes inherit it: TorchRec's deprecation warnings would bury the tables.
os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning,ignore::UserWarning")


def case(ps_rows: int, dim: int) -> tuple[ModelSpec, dict[str, Any], Any]:
    """The model, its placements and topology: two PS tables of ``ps_rows`` rows, three small local ones."""
    from persia_planner.modules.tools.memory_audit import cpu_topology, placed

    spec = ModelSpec(
        "ps-pressure",
        4096,
        (
            TableSpec("ps_a", ps_rows, dim),
            TableSpec("ps_b", ps_rows // 2, dim),
            TableSpec("tw0", 2_000, dim),
            TableSpec("tw1", 500, dim),
            TableSpec("rw", 4_000, dim),
        ),
    )
    shardings = {
        "ps_a": (Sharding.PS_HASH, ()),
        "ps_b": (Sharding.PS_HASH, ()),
        "tw0": (Sharding.TABLE_WISE, (0,)),
        "tw1": (Sharding.TABLE_WISE, (1,)),
        "rw": (Sharding.ROW_WISE, (0, 1)),
    }
    c = placed("ps-pressure", spec, cpu_topology(2, 2), shardings)
    return c.spec, c.tables, c.topology


def run(spec: ModelSpec, tables: dict[str, Any], topology: Any, **options: Any) -> dict[str, Any]:
    """One ``persia train`` run (its ``--json`` summary) with its wall time."""
    from persia_planner.modules.train import TrainConfig, train_local

    cfg = TrainConfig(progress=False, trainers=2, **options)
    started = time.perf_counter()
    result = train_local(cfg, spec, dict(tables), servers=len(topology.servers), topology=topology)
    result.pop("history", None)
    result.pop("executed_plan", None)
    result["wall_s"] = time.perf_counter() - started
    return result


def full_store_bytes(spec: ModelSpec, servers: int) -> int:
    """Bytes one server's stores take once each is full (holds its capacity), all PS tables together."""
    total = 0
    for t in spec.tables:
        if t.name.startswith("ps_"):
            total += int(ps_bytes(-(-t.rows // servers), t.dim, t.optimizer))  # the largest bucket's store, full
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smaller run (CI: under 90 s on 2 cores)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--id-space", type=float, default=16.0, help="ids per table row the data draws from")
    args = parser.parse_args(argv)

    ps_rows, dim, steps, batch, eval_batches = (32_768, 16, 40, 4096, 8) if args.quick else (262_144, 32, 300, 8192, 16)
    spec, tables, topology = case(ps_rows, dim)
    options = {
        "steps": steps,
        "batch_size": batch // 2,
        "eval_batches": eval_batches,
        "teacher_rows_scale": args.id_space,
    }
    console.print(
        f"[bold]ps pressure[/]: {spec.name}, PS tables of {ps_rows:,} and {ps_rows // 2:,} rows (dim {dim}), ids "
        f"from {args.id_space:g}x their rows, {steps} steps x {batch} samples, 2 trainers, 2 servers"
    )
    bounded = run(spec, tables, topology, ps_capacity="planned", **options)
    unbounded = run(spec, tables, topology, ps_capacity="unbounded", **options)

    servers = bounded["ps_servers"]
    full = full_store_bytes(spec, len(topology.servers))
    distinct = sum(s["rows"] for s in unbounded["ps_servers"])  # nothing evicted: every id admitted is still held
    capacity = sum(s["capacity"] for s in servers)
    results: dict[str, Any] = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "date": datetime.date.today().isoformat(),
        "quick": args.quick,
        "config": {"ps_rows": ps_rows, "dim": dim, "steps": steps, "global_batch": batch, "id_space": args.id_space},
        "evictions": sum(s["evictions"] for s in servers),
        "distinct_ids_over_capacity": distinct / capacity,
        "rss_over_planned": max(s["rss_over_planned"] for s in servers),
        "rss_over_full_store": max(s["rss_growth_bytes"] for s in servers) / full,
        "auc_bounded": bounded["auc"],
        "auc_unbounded": unbounded["auc"],
        "auc_gap": abs(bounded["auc"] - unbounded["auc"]),
        "teacher_auc": bounded["teacher_auc"],
        "consistent": all(s["admissions"] - s["evictions"] == s["rows"] for s in servers),
        "bounded_wall_s": bounded["wall_s"],
        "unbounded_wall_s": unbounded["wall_s"],
        "bounded_samples_per_s": bounded["samples_per_s"],
        "unbounded_samples_per_s": unbounded["samples_per_s"],
        "samples_per_s_bounded_over_unbounded": bounded["samples_per_s"] / unbounded["samples_per_s"],
        "full_store_bytes": full,
        "bounded_servers": servers,
        "unbounded_servers": unbounded["ps_servers"],
    }

    per_server = Table(title="parameter servers (bounded run; unbounded in brackets)")
    columns = ("server", "hit rate", "admissions", "evictions", "rows / capacity", "store", "RSS growth", "planned")
    for column in columns:
        per_server.add_column(column, justify="left" if column == "server" else "right")
    for s, u in zip(servers, unbounded["ps_servers"], strict=True):
        per_server.add_row(
            s["name"],
            f"{s['hits'] / max(1, s['lookups']):.1%} ({u['hits'] / max(1, u['lookups']):.1%})",
            f"{s['admissions']:,} ({u['admissions']:,})",
            f"{s['evictions']:,} ({u['evictions']:,})",
            f"{s['rows']:,} / {s['capacity']:,}",
            format_bytes(s["store_bytes"]),
            f"{format_bytes(s['rss_growth_bytes'])} ({format_bytes(u['rss_growth_bytes'])})",
            format_bytes(s["planned_bytes"]),
        )
    console.print(per_server)
    summary = Table(title="ps pressure: bounded vs unbounded (same run)")
    summary.add_column("metric")
    summary.add_column("value", justify="right")
    summary.add_column("target", justify="right")
    for name, value, target in (
        ("evictions (bounded, all servers)", f"{results['evictions']:,}", "> 0"),
        ("distinct ids / capacity", f"{results['distinct_ids_over_capacity']:.2f}", "> 1"),
        ("RSS growth / planned bytes (max)", f"{results['rss_over_planned']:.3f}", "<= 1"),
        ("RSS growth / full store bytes (max)", f"{results['rss_over_full_store']:.3f}", "<= 1"),
        ("AUC bounded / unbounded", f"{results['auc_bounded']:.4f} / {results['auc_unbounded']:.4f}", ""),
        ("AUC gap", f"{results['auc_gap']:.4f}", "<= 0.01"),
        ("teacher AUC (best possible)", f"{results['teacher_auc']:.4f}", ""),
        ("admissions - evictions = rows", str(results["consistent"]), "True"),
        ("samples/s bounded / unbounded", f"{results['samples_per_s_bounded_over_unbounded']:.2f}", ""),
        ("wall s bounded, unbounded", f"{bounded['wall_s']:.0f}, {unbounded['wall_s']:.0f}", ""),
    ):
        summary.add_row(name, value, target)
    console.print(summary)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
        console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
