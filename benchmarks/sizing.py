"""Sizing benchmark: does ``persia size`` find the cheapest cluster that meets a target, and how much faster than
trying every shape?

1. Generated instances small enough to search every shape: a model of 8-24 tables, a catalog of 2-3 trainer classes,
   1-2 server classes and 1-2 links, at most 6 hosts. The exhaustive search plans every shape (the same plan
   ``persia size`` judges a shape by, :func:`persia_planner.sizing.plan_shape`) and takes the cheapest that reaches
   the target; the target is a quantile of the speeds the shapes reach, so that some shapes meet it and cheaper ones
   do not. ``persia size`` (:func:`persia_planner.sizing.size`) must name a shape of the same price
   (``optimal_share``), and its time is compared with the exhaustive search's (``speedup``: total over total).
2. A 1,000-table model (tables of 1e3-1e7 rows, dims 16-256) sized on the bundled AWS catalog for 2 million
   samples/s within 32 hosts by the ``persia size`` command, a whole process (``size_1000_s``).

    python benchmarks/sizing.py --json out.json           # 12 instances, then the 1,000-table model
    python benchmarks/sizing.py --quick --json out.json   # 10 instances (CI)

JSON keys: ``instances`` (per instance: the exhaustive and our shape, price, seconds, plans), ``optimal_share``,
``speedup``, ``median_speedup``, ``size_1000_s``, ``size_1000`` (the command, the shape it chose, its price).
"""

from __future__ import annotations

import argparse
import json
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

from persia_planner import PlannerError
from persia_planner.paths import EXAMPLES
from persia_planner.sizing import Catalog, all_shapes, catalog_from_dict, plan_shape, size
from persia_planner.synthetic import model_dict, random_model
from persia_planner.topology.graph import Topology

console = Console(width=150)
MAX_HOSTS = 6
TARGET_QUANTILE = 0.6  # of the shapes' speeds: the cheapest shapes mostly miss it, the dear ones mostly meet it
SIZE_1000_TABLES = 1000
SIZE_1000_ROWS = (1e3, 1e7)  # rows of its tables, log-uniform: a few hundred GB in all
SIZE_1000_TARGET = 2_000_000.0  # samples/s: more than one host of the fastest class reaches
SIZE_1000_MAX_HOSTS = 32
SIZE_1000_TARGET_S = 60.0


def generated_catalog(seed: int) -> Catalog:
    """2-3 trainer classes (1-4 GPUs of 2-16 GiB, NICs of 10-100 Gb/s), 1-2 server classes (16-256 GiB) and 1-2
    links, priced roughly by what they hold and move (with noise, so that no class dominates another)."""
    rng = np.random.default_rng(1000 + seed)
    trainers = {}
    for i in range(int(rng.integers(2, 4))):
        gpus, hbm, nic = int(rng.choice([1, 2, 4])), int(rng.choice([2, 4, 8, 16])), int(rng.choice([10, 25, 100]))
        tflops = float(rng.choice([30, 120, 300]))
        price = (0.4 * gpus * (hbm / 8 + tflops / 150) + nic / 100) * float(rng.uniform(0.7, 1.3))
        trainers[f"t{i}"] = {
            "price_per_hour": round(price, 3),
            "source": "generated",
            "ddr": f"{int(rng.choice([32, 64, 128]))}GiB",
            "ddr_bandwidth": "100GB/s",
            "nic_bandwidth": f"{nic}Gbps",
            "gpus": {
                "count": gpus,
                "hbm": f"{hbm}GiB",
                "hbm_bandwidth": f"{int(rng.choice([300, 900, 2000]))}GB/s",
                "tflops": tflops,
                "pcie_bandwidth": "32GB/s",
                "nvlink_bandwidth": "100GB/s",
            },
        }
    servers = {}
    for i in range(int(rng.integers(1, 3))):
        ddr, nic = int(rng.choice([16, 64, 256])), int(rng.choice([10, 25, 50]))
        price = (ddr / 128 + nic / 50) * float(rng.uniform(0.7, 1.3))
        servers[f"s{i}"] = {
            "price_per_hour": round(price, 3),
            "source": "generated",
            "ddr": f"{ddr}GiB",
            "ddr_bandwidth": "80GB/s",
            "nic_bandwidth": f"{nic}Gbps",
        }
    links = {"lan": {"price_per_hour": 0, "source": "generated", "latency": "20us"}}
    if rng.random() < 0.5:
        links["fast"] = {
            "price_per_hour": round(float(rng.uniform(0.05, 0.3)), 3),
            "source": "generated",
            "latency": "3us",
        }
    data = {"name": f"generated-{seed}", "trainers": trainers, "servers": servers, "links": links}
    return catalog_from_dict(data, f"generated-{seed}.yaml")


def generated_model(seed: int):
    """8-24 tables of 1e3-3e8 rows: from a few GiB, which one host's HBM holds, to tens, which need servers."""
    return random_model(8 + seed % 17, seed=seed, rows_range=(1e3, 3e8), batch_size=16384)


def exhaustive(model, catalog: Catalog) -> tuple[dict[str, Any], list[tuple[Any, float | None]]]:
    """Plan every shape; each shape's speed (None: the model does not fit it) and the seconds it all took."""
    started = time.perf_counter()
    speeds = []
    for shape in all_shapes(model, catalog, MAX_HOSTS):
        topology = Topology.from_dict(shape.topology_dict(catalog), shape.describe())
        try:
            speeds.append((shape, plan_shape(model, topology).samples_per_s))
        except PlannerError:
            speeds.append((shape, None))
    return {"seconds": time.perf_counter() - started, "plans": len(speeds)}, speeds


def bench_instance(seed: int) -> dict[str, Any]:
    """One instance: the exhaustive search, the target from its speeds, then the sizer on that target."""
    model, catalog = generated_model(seed), generated_catalog(seed)
    timing, speeds = exhaustive(model, catalog)
    reached = sorted(s for _, s in speeds if s is not None)
    if not reached:
        return {"seed": seed, "status": "no shape holds the model"}
    target = float(np.quantile(reached, TARGET_QUANTILE))
    meeting = [(shape.price_per_hour, shape.describe()) for shape, s in speeds if s is not None and s >= target]
    best_price, best_shape = min(meeting)
    started = time.perf_counter()
    sized = size(model, catalog, target, max_hosts=MAX_HOSTS)
    ours_s = time.perf_counter() - started
    chosen = sized.chosen
    ours_price = chosen.shape.price_per_hour if chosen is not None else None
    return {
        "seed": seed,
        "status": "ok",
        "tables": len(model.tables),
        "shapes": len(speeds),
        "target_samples_per_s": target,
        "exhaustive_shape": best_shape,
        "exhaustive_price": best_price,
        "exhaustive_s": timing["seconds"],
        "exhaustive_plans": timing["plans"],
        "ours_shape": chosen.shape.describe() if chosen is not None else None,
        "ours_price": ours_price,
        "ours_s": ours_s,
        "ours_plans": sized.plans,
        "ours_bounds": sized.bounds,
        "optimal": ours_price is not None and abs(ours_price - best_price) <= 1e-9 * max(best_price, 1.0),
        "speedup": timing["seconds"] / ours_s,
    }


def bench_size_1000() -> dict[str, Any]:
    """``persia size`` of a 1,000-table model on the bundled AWS catalog, a whole process."""
    model = random_model(
        SIZE_1000_TABLES, seed=SIZE_1000_TABLES, dims=(16, 32, 64, 128, 256), rows_range=SIZE_1000_ROWS
    )
    persia = Path(sys.executable).with_name("persia")
    command = [str(persia)] if persia.exists() else [sys.executable, "-m", "persia_planner.cli"]
    catalog = EXAMPLES / "catalog_aws.yaml"
    with tempfile.TemporaryDirectory(prefix="persia-size-") as tmp:
        model_file = Path(tmp, "model.yaml")
        model_file.write_text(yaml.safe_dump(model_dict(model), sort_keys=False))
        args = [
            *command,
            "size",
            str(model_file),
            str(catalog),
            "--target-samples-per-s",
            f"{SIZE_1000_TARGET:g}",
            "--max-hosts",
            str(SIZE_1000_MAX_HOSTS),
            "--out",
            str(Path(tmp, "sized")),
        ]
        started = time.perf_counter()
        done = subprocess.run(args, capture_output=True, text=True)
        seconds = time.perf_counter() - started
        if done.returncode != 0:
            raise RuntimeError(f"persia size exited {done.returncode}: {done.stderr.strip()[-400:]}")
        record = json.loads(Path(tmp, "sized", "sizing.json").read_text())
    return {
        "command": " ".join(["persia", *args[len(command) :]])
        .replace(tmp, "TMP")
        .replace(str(EXAMPLES.parent.parent) + "/", ""),
        "seconds": seconds,
        "target_s": SIZE_1000_TARGET_S,
        "chosen": record["chosen"]["shape"],
        "price_per_hour": record["chosen"]["price_per_hour"],
        "samples_per_s": record["chosen"]["samples_per_s"],
        "shapes": record["shapes"],
        "looked_at": len(record["verdicts"]),
        "bounds": record["bounds"],
        "plans": record["plans"],
        "failures": record["failures"],
    }


def render(results: dict[str, Any]) -> None:
    table = Table(title="persia size against every shape planned (at most 6 hosts)")
    for column in ("seed", "tables", "shapes", "target/s", "exhaustive", "ours", "same price", "exh. s", "ours s",
                   "plans", "speedup"):  # fmt: skip
        table.add_column(column, justify="left" if column in ("exhaustive", "ours") else "right")
    for r in results["instances"]:
        if r["status"] != "ok":
            table.add_row(str(r["seed"]), "-", "-", "-", r["status"], "-", "-", "-", "-", "-", "-")
            continue
        table.add_row(
            str(r["seed"]),
            str(r["tables"]),
            str(r["shapes"]),
            f"{r['target_samples_per_s']:,.0f}",
            f"{r['exhaustive_shape']} ({r['exhaustive_price']:.2f})",
            f"{r['ours_shape']} ({r['ours_price']:.2f})" if r["ours_shape"] else "none",
            "yes" if r["optimal"] else "NO",
            f"{r['exhaustive_s']:.1f}",
            f"{r['ours_s']:.2f}",
            f"{r['ours_plans']}/{r['exhaustive_plans']}",
            f"{r['speedup']:.0f}x",
        )
    console.print(table)
    console.print(
        f"optimal_share {results['optimal_share']:.2f} (target 1.0), speedup {results['speedup']:.1f}x total "
        f"(median {results['median_speedup']:.1f}x; target >= 20x)"
    )
    big = results.get("size_1000")
    if big:
        console.print(
            f"size_1000_s {big['seconds']:.1f} s (target < {big['target_s']:.0f} s): {big['chosen']} at "
            f"{big['price_per_hour']:.2f}/h, {big['samples_per_s']:,.0f} samples/s; looked at {big['looked_at']} of "
            f"{big['shapes']} shapes ({big['bounds']} bounds, {big['plans']} plans)"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="CI mode: 10 instances")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--instances", type=int, help="how many generated instances (default 12, quick 10)")
    args = parser.parse_args(argv)
    count = args.instances or (10 if args.quick else 12)
    results: dict[str, Any] = {
        "mode": "quick" if args.quick else "full",
        "machine": platform.platform(),
        "python": platform.python_version(),
        "max_hosts": MAX_HOSTS,
    }
    instances = [bench_instance(seed) for seed in range(count)]
    ok = [r for r in instances if r["status"] == "ok"]
    results["instances"] = instances
    results["optimal_share"] = sum(r["optimal"] for r in ok) / len(ok) if ok else 0.0
    results["speedup"] = sum(r["exhaustive_s"] for r in ok) / max(sum(r["ours_s"] for r in ok), 1e-9)
    results["median_speedup"] = statistics.median(r["speedup"] for r in ok) if ok else 0.0
    results["size_1000"] = bench_size_1000()
    results["size_1000_s"] = results["size_1000"]["seconds"]
    render(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
        console.print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
