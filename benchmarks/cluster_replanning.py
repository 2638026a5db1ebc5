"""Plans for the namespace cluster as it is (:mod:`netcluster`'s replanning part): the trainers' and the servers'
NICs shaped, the planner told the loopback figures, then taught the cluster's own.

On one shaped cluster, each measured by ``persia train`` under torchrun on every host:

* ``naive``: the plan made with the loopback profile, every link as the loopback measured it (what a user has
  before calibrating anything: on trainers that hold the model, it keeps every table on them);
* ``declared``: the plan made for the NICs as declared, still priced with the loopback profile;
* ``calibrated``: the plan made with the profile calibrated on the cluster itself: short runs of ``naive`` (no PS
  tables: profiled, its all-to-all over the trainers' links measured apart from the rest of its step) and of
  ``declared`` (tables on the servers) on the cluster, refitted by ``persia calibrate --from-runs`` (least squares
  over both runs' terms);
* ``adapted``: ``naive`` started under ``--adapt``: the job refits itself from its own steps, re-plans and migrates;
* ``torchrec``: TorchRec's planner's plan for the same model on trainers that hold the whole model (it has no
  parameter servers), given the cluster's real link rates in its ``Topology``; ours is planned for the same
  trainers with the calibrated profile.

Plans are measured alternated round by round; a run's figure is its wall-clock samples/s over its last half (a job
that migrates pays for it in its first half, and is judged by where it ended up). Keys: ``replan_speedup``
(calibrated over naive), ``declared_speedup`` (declared over naive: the loopback model's re-plan for the declared
NICs), ``calibrated_over_declared``, ``adapt_speedup`` (adapted over naive), ``ours_over_torchrec``, and each plan's
tables on the servers, predicted and measured steps (``plans``, a record each).

    sudo python benchmarks/cluster_replanning.py --json out.json   # 120 steps, 2 rounds (about 15 minutes)

:mod:`netcluster` runs the same comparisons after its own (``python benchmarks/netcluster.py --json OUT``).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from cluster_jobs import DATA, HOSTS, MODEL, PROFILE, plan_for, remote_tables, run_on_cluster, topology_yaml
from netns import NetCluster, check_available, signals_as_exceptions

# Trainers that hold the whole model with little room to spare: which tables go to the servers is the plan's choice,
# and the loopback model and the cluster's disagree on it.
TRAINER_MBIT, PS_MBIT, MEMORY = 100.0, 30.0, "24MiB"
# The loopback's own links, as a profile calibrated on one host knows them.
LOOPBACK_MBIT = 10_000.0
# Trainers that hold the whole model (about 33 MiB with its optimizer state) between them: TorchRec's planner, which
# places no table on parameter servers, can plan it.
ROOMY_MEMORY = "40MiB"
STALENESS = 4
TORCHREC_TIMEOUT_S = 180.0
KEYS = ("replan_speedup", "declared_speedup", "calibrated_over_declared", "adapt_speedup", "ours_over_torchrec")
"""The comparisons' keys, as the issue names them."""


def job_args(steps: int, log_dir: Path | None = None, extra: Sequence[str] = ()) -> list[str]:
    """``persia train``'s options for every run of this benchmark."""
    args = ["--steps", str(steps), "--eval-batches", "2", "--staleness", str(STALENESS), *DATA, *extra]
    return args + (["--log-dir", str(log_dir)] if log_dir is not None else [])


def last_half_samples_per_s(log_dir: Path, batch: int) -> float:
    """Wall-clock samples/s over the second half of a run's steps, from its ``metrics.jsonl`` (every step's end
    time since the loop started: evaluations and migrations inside the half count)."""
    from persia_planner.modules.train.metrics_log import logged_steps

    steps = [r for r in logged_steps(log_dir / "metrics.jsonl") if "t_s" in r and "loss" in r]
    if len(steps) < 4:
        raise RuntimeError(f"{log_dir}: {len(steps)} steps logged, too few for a last half")
    times = [r["t_s"] for r in steps]
    if any(b < a for a, b in itertools.pairwise(times)):
        raise RuntimeError(f"{log_dir}: the steps' times go backwards: the run's clock restarted")
    mid = len(steps) // 2
    return (steps[-1]["step"] - steps[mid]["step"]) * batch / (times[-1] - times[mid])


def calibrate_from_runs(work: Path, dirs: Sequence[Path]) -> Path:
    """``persia calibrate --from-runs``: the loopback profile refitted to the cluster's runs."""
    out = work / "cluster-profile.yaml"
    done = subprocess.run(
        [sys.executable, "-m", "persia_planner.cli", "calibrate", "--from-runs", *map(str, dirs), "--profile",
         str(PROFILE), "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"persia calibrate --from-runs: {done.stderr.strip()[-500:]}")
    return out


def torchrec_plan(work: Path, topology_path: Path) -> tuple[Path | None, str]:
    """TorchRec's planner's plan of the model for ``topology_path``'s trainers, given its link rates, as plan.json
    (None and why when it has none)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from torchrec_baseline import time_torchrec_planner

    from persia_planner import load_model, load_topology
    from persia_planner.bound import lower_bound
    from persia_planner.cost.analytic import CostModel
    from persia_planner.plan.torchrec_export import TorchRecSharding
    from persia_planner.plan.torchrec_scoring import from_sharding_options
    from persia_planner.planner import priced_plan

    model = dataclasses.replace(load_model(MODEL), staleness=STALENESS)
    topology = load_topology(topology_path)
    result = time_torchrec_planner(
        model,
        world_size=len(topology.gpus),
        local_world_size=1,
        hbm_bytes=0,  # CPU ranks: TorchRec keeps their tables in DDR
        ddr_bytes=topology.gpus[0].hbm_bytes,  # a CPU trainer's memory budget
        timeout_s=TORCHREC_TIMEOUT_S,
        topology=topology,
        compute_device="cpu",
    )
    if result["status"] != "ok":
        return None, f"{result['status']}: {result.get('error')}"
    tables = from_sharding_options([TorchRecSharding.from_dict(d) for d in result["options"]], model, topology)
    cost = CostModel(model, topology)
    path = work / "torchrec.json"
    priced_plan(cost, tables, lower_bound_ms=lower_bound(cost).value_ms).save(path)
    return path, "ok"


def alternate(runs: Mapping[str, Callable[[int], dict[str, Any]]], rounds: int) -> dict[str, list[dict[str, Any]]]:
    """Each run ``rounds`` times, in turn, round by round (neighbours on the machine weigh on every plan alike)."""
    out: dict[str, list[dict[str, Any]]] = {name: [] for name in runs}
    for r in range(rounds):
        for name, run in runs.items():
            out[name].append(run(r))
    return out


def replan(work: Path, steps: int, rounds: int = 2) -> dict[str, Any]:
    """The replanning comparisons on one shaped cluster (see the module docstring)."""
    naive_t, declared_t, roomy_t = work / "naive.yaml", work / "declared.yaml", work / "roomy.yaml"
    naive_t.write_text(topology_yaml(LOOPBACK_MBIT, LOOPBACK_MBIT, MEMORY))
    declared_t.write_text(topology_yaml(PS_MBIT, TRAINER_MBIT, MEMORY))
    roomy_t.write_text(topology_yaml(PS_MBIT, TRAINER_MBIT, ROOMY_MEMORY))
    plans = {"naive": plan_for(work, "naive.json", naive_t, STALENESS)}
    plans["declared"] = plan_for(work, "declared.json", declared_t, STALENESS)
    rates = {"trainer0": TRAINER_MBIT, "trainer1": TRAINER_MBIT, "ps0": PS_MBIT, "ps1": PS_MBIT}
    started = time.monotonic()
    with NetCluster(HOSTS, rates) as cluster:

        def run(name: str, plan: Path, topology: Path, extra: Sequence[str] = ()) -> Callable[[int], dict[str, Any]]:
            def once(r: int) -> dict[str, Any]:
                log = work / f"{name}-{r}"
                # --adapt migrates through a checkpoint: a folder of its own per run
                more = [*extra, "--checkpoint", str(work / f"ck-{name}-{r}")] if "--adapt" in extra else extra
                result, _ = run_on_cluster(cluster, work, f"{name}-{r}", topology, plan, job_args(steps, log, more))
                result["last_half_samples_per_s"] = last_half_samples_per_s(log, result["batch_size"])
                result["log_dir"] = str(log)
                return result

            return once

        # Calibration where the job runs: short runs of two plans that load the cluster differently. The naive plan
        # keeps every table on the trainers: without PS tables a run is profiled, and its all-to-all over the
        # trainers' links is measured apart from the rest of its step; the declared one puts tables on the servers.
        theirs, torchrec_status = torchrec_plan(work, roomy_t)
        calibration = {work / "calibrate-naive": plans["naive"], work / "calibrate-declared": plans["declared"]}
        for log, plan in calibration.items():
            run_on_cluster(cluster, work, log.name, declared_t, plan, job_args(max(20, steps // 2), log))
        profile = calibrate_from_runs(work, list(calibration))
        calibrated_t, calibrated_roomy_t = work / "calibrated.yaml", work / "calibrated-roomy.yaml"
        calibrated_t.write_text(topology_yaml(PS_MBIT, TRAINER_MBIT, MEMORY, profile=profile))
        calibrated_roomy_t.write_text(topology_yaml(PS_MBIT, TRAINER_MBIT, ROOMY_MEMORY, profile=profile))
        plans["calibrated"] = plan_for(work, "calibrated.json", calibrated_t, STALENESS)
        plans["ours_roomy"] = plan_for(work, "ours-roomy.json", calibrated_roomy_t, STALENESS)
        runs = {
            "naive": run("naive", plans["naive"], declared_t),
            "declared": run("declared", plans["declared"], declared_t),
            "calibrated": run("calibrated", plans["calibrated"], calibrated_t),
            "adapted": run("adapted", plans["naive"], declared_t, ("--adapt",)),
            "ours_roomy": run("ours_roomy", plans["ours_roomy"], calibrated_roomy_t),
        }
        if theirs is not None:
            runs["torchrec"] = run("torchrec", theirs, roomy_t)
        measured = alternate(runs, rounds)
        tags = [cluster.bridge, *(h.namespace for h in cluster.hosts.values())]

    def rate(name: str) -> float:
        return statistics.median(r["last_half_samples_per_s"] for r in measured[name])

    record: dict[str, Any] = {
        "trainer_mbit": TRAINER_MBIT, "ps_mbit": PS_MBIT, "trainer_memory": MEMORY, "roomy_memory": ROOMY_MEMORY,
        "rounds": rounds, "steps": steps, "seconds": time.monotonic() - started, "tags": tags,
        "torchrec_status": torchrec_status,
        "plans": [
            {
                "name": name,
                "remote_tables": remote_tables(plans.get(name, theirs)) if plans.get(name, theirs) else None,
                "predicted_ms": statistics.median(r["plan_step_ms"] for r in results),
                "measured_ms": statistics.median(r["wall_step_ms"] for r in results),
                "last_half_samples_per_s": rate(name),
                "adapt": [r.get("plans") for r in results] if name == "adapted" else None,
            }
            for name, results in measured.items()
        ],
    }  # fmt: skip
    record["replan_speedup"] = rate("calibrated") / rate("naive")
    record["declared_speedup"] = rate("declared") / rate("naive")
    record["calibrated_over_declared"] = rate("calibrated") / rate("declared")
    record["adapt_speedup"] = rate("adapted") / rate("naive")
    record["ours_over_torchrec"] = rate("ours_roomy") / rate("torchrec") if "torchrec" in measured else None
    return record


def print_table(record: Mapping[str, Any]) -> None:
    """Each plan's tables on the servers, predicted and measured step, rate; then the keys."""
    print(
        f"namespace cluster: trainers' NICs {record['trainer_mbit']:g} Mbit/s, servers' {record['ps_mbit']:g}, "
        f"{record['trainer_memory']} a trainer ({record['roomy_memory']} for TorchRec's), {record['steps']} steps, "
        f"{record['rounds']} rounds"
    )
    print(f"  {'plan':<12} {'on servers':>10} {'predicted ms':>13} {'measured ms':>12} {'samples/s':>10}")
    for p in record["plans"]:
        print(
            f"  {p['name']:<12} {p['remote_tables']!s:>10} {p['predicted_ms']:>13.1f} {p['measured_ms']:>12.1f} "
            f"{p['last_half_samples_per_s']:>10,.0f}"
        )
    for key in KEYS:
        value = record.get(key)
        print(f"  {key:<26} {'-' if value is None else f'{value:.3f}'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--steps", type=int, default=120, help="steps of each run (default 120)")
    parser.add_argument("--rounds", type=int, default=2, help="alternated rounds (default 2)")
    parser.add_argument("--work", type=Path, help="keep the runs' logs here (default: a temporary folder)")
    args = parser.parse_args(argv)
    check_available()
    with tempfile.TemporaryDirectory(prefix="persia-replanning-") as tmp, signals_as_exceptions():
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        record = replan(work, args.steps, args.rounds)
    record.pop("tags", None)
    record["machine"] = {"platform": platform.platform(), "cpus": os.cpu_count()}
    print_table(record)
    if args.json:
        args.json.write_text(json.dumps(record, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
