"""The ``ssd`` tier measured: the default model planned on servers whose DDR is short, so that rows go to their disks,
trained by ``persia train``; its step against the plan's prediction and against the same model on servers whose DDR
holds every row.

1. Calibrate this machine (``persia calibrate``, quick in ``--quick``) into a profile, in this run: the trainers',
   the servers' and the disk's figures (``modules/tools/calibrate.disk``: ``O_DIRECT`` 4 KiB blocks at random, in
   the temporary directory the servers write to), so that the prediction is for this machine as it is now.
2. Two topologies from the bundled local cluster (two CPU trainers, two servers) on that profile: servers of 24 MiB
   DDR with disks (``ssd``), and servers of 2 GiB (``ddr``).
3. ``persia plan`` of the default model on each: the first puts tables on ``ssd``, the second none.
4. ``persia train --json --id-space 1`` of both plans, alternated (every id of the tables is drawn, as the plan's
   hit rates assume): the median step of each run after its warm-up, then the median over rounds.

    python benchmarks/ssd_tier.py --json out.json     # full calibration, 3 rounds of 200 steps (about 12 min)
    python benchmarks/ssd_tier.py --quick             # quick calibration, 2 rounds of 60 steps (CI, about 4 min)

JSON keys: ``disk_read_iops``, ``disk_write_iops``, ``ssd_tables`` (names, comma-separated), ``ssd_cache_fractions``,
``ssd_predicted_step_ms`` (the plan's), ``ssd_step_ms`` (measured), ``ssd_step_error`` (``|measured - predicted| /
predicted``), ``ssd_disk_reads_per_step`` and ``ssd_disk_writes_per_step`` (rows, over the servers),
``ddr_predicted_step_ms``, ``ddr_step_ms``, ``ddr_step_error``, ``ssd_over_ddr_step`` (measured steps' ratio),
``ssd_predicted_server_ms`` and ``ddr_predicted_server_ms`` (the busiest server's work a step, as each plan prices
it), and ``rounds`` (each run's figures).
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

import yaml

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "persia_planner" / "examples"
MODEL = EXAMPLES / "dlrm_small.yaml"
PERSIA = [sys.executable, "-m", "persia_planner.cli"]


def topology(ps_ddr: str, profile: Path, ssd: bool) -> dict[str, Any]:
    """The bundled local cluster on ``profile`` with servers of ``ps_ddr`` DDR and, with ``ssd``, disks (their rates:
    the profile's)."""
    data = yaml.safe_load((EXAMPLES / "local_2x1.yaml").read_text())
    for host in data["hosts"]:
        host["profile"] = str(profile)
        if host.get("role") == "parameter_server":
            host["ddr"] = ps_ddr
            if ssd:
                host["ssd"] = "4GiB"
    data["name"] = f"local-ps-{ps_ddr}" + ("-ssd" if ssd else "")
    return data


def plan(work: Path, name: str, topo: dict[str, Any]) -> tuple[Path, Path, dict[str, Any]]:
    """``persia plan`` of the default model on ``topo``: the topology's and the plan's paths and the plan."""
    topo_path, plan_path = work / f"{name}.topology.yaml", work / f"{name}.plan.json"
    topo_path.write_text(yaml.safe_dump(topo))
    done = subprocess.run([*PERSIA, "plan", str(MODEL), str(topo_path), "--out", str(plan_path)], capture_output=True)
    if done.returncode:
        raise SystemExit(f"persia plan on {name} failed: {done.stderr.decode()[-2000:]}")
    return topo_path, plan_path, json.loads(plan_path.read_text())


def train(topo_path: Path, plan_path: Path, steps: int, ssd_dir: Path) -> dict[str, Any]:
    """One ``persia train --json`` of the plan, every id drawn; its result."""
    command = [
        *PERSIA, "train", "--topology", str(topo_path), "--plan", str(plan_path), "--steps", str(steps),
        "--id-space", "1", "--eval-batches", "2", "--ssd-dir", str(ssd_dir), "--json",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise SystemExit(f"persia train failed: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 rounds of 60 steps (CI)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--profile", type=Path, help="use this profile (with a disk: section) instead of calibrating")
    args = parser.parse_args(argv)
    rounds, steps = (2, 60) if args.quick else (3, 200)
    sys.path.insert(0, str(REPO))
    from persia_planner.modules.tools.calibrate import calibrate

    with tempfile.TemporaryDirectory(prefix="persia-ssd-bench-") as tmp:
        work = Path(tmp)
        ssd_dir = work / "disks"
        profile = args.profile.resolve() if args.profile else work / "profile.yaml"
        if args.profile is None:
            started = time.perf_counter()
            profile.write_text(yaml.safe_dump(calibrate(quick=args.quick)))
            print(f"calibrated this machine in {time.perf_counter() - started:.0f} s")
        measured = yaml.safe_load(profile.read_text())["disk"]
        print(f"disk: {measured['read_iops']:,.0f} reads/s, {measured['write_iops']:,.0f} writes/s (4 KiB, random)")
        ssd_topo, ssd_plan, ssd = plan(work, "ssd", topology("24MiB", profile, ssd=True))
        ddr_topo, ddr_plan, ddr = plan(work, "ddr", topology("2GiB", profile, ssd=False))
        on_disk = {
            n: t["shards"][0]["cache_fraction"] for n, t in ssd["tables"].items() if t["shards"][0]["tier"] == "ssd"
        }
        if not on_disk:
            raise SystemExit("the plan on servers of 24 MiB put no table on the ssd tier")
        runs: list[dict[str, Any]] = []
        for r in range(rounds):
            for name, topo_path, plan_path in (("ssd", ssd_topo, ssd_plan), ("ddr", ddr_topo, ddr_plan)):
                result = train(topo_path, plan_path, steps, ssd_dir)
                servers = result.get("ps_servers") or []
                runs.append({
                    "round": r, "plan": name, "step_ms": result["step_ms"], "predicted_ms": result["plan_step_ms"],
                    "auc": result["auc"], "disk_reads": sum(s.get("disk_reads", 0) for s in servers),
                    "disk_writes": sum(s.get("disk_writes", 0) for s in servers),
                })  # fmt: skip
                print(f"round {r} {name}: step {result['step_ms']:.1f} ms (plan {result['plan_step_ms']:.1f} ms)")

    def median(plan_name: str, key: str) -> float:
        return statistics.median(run[key] for run in runs if run["plan"] == plan_name)

    out: dict[str, Any] = {
        "machine": {"platform": platform.platform(), "quick": args.quick, "rounds": rounds, "steps": steps},
        "disk_read_iops": measured["read_iops"],
        "disk_write_iops": measured["write_iops"],
        "ssd_tables": ", ".join(sorted(on_disk)),
        "ssd_cache_fractions": on_disk,
    }
    for name, the_plan in (("ssd", ssd), ("ddr", ddr)):
        predicted, step = the_plan["estimate"]["step_ms"], median(name, "step_ms")
        out[f"{name}_predicted_step_ms"] = predicted
        out[f"{name}_step_ms"] = step
        out[f"{name}_step_error"] = abs(step - predicted) / predicted
        servers = [usage["cost_ms"] for device, usage in the_plan["devices"].items() if device.startswith("ps")]
        out[f"{name}_predicted_server_ms"] = max(servers)  # the busiest server's work a step, as the plan prices it
    out["ssd_disk_reads_per_step"] = median("ssd", "disk_reads") / steps
    out["ssd_disk_writes_per_step"] = median("ssd", "disk_writes") / steps
    out["ssd_over_ddr_step"] = out["ssd_step_ms"] / out["ddr_step_ms"]
    out["rounds"] = runs
    print()
    print("| plan | predicted ms | measured ms | error | disk rows read / step |")
    print("|---|---|---|---|---|")
    for name in ("ssd", "ddr"):
        reads = f"{out['ssd_disk_reads_per_step']:,.0f}" if name == "ssd" else "-"
        print(
            f"| {name} | {out[f'{name}_predicted_step_ms']:.1f} | {out[f'{name}_step_ms']:.1f} | "
            f"{out[f'{name}_step_error']:.0%} | {reads} |"
        )
    print(f"ssd tables {out['ssd_tables']}; ssd / ddr measured step {out['ssd_over_ddr_step']:.2f}x")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
