"""The multi-node guide (docs/multinode.md) run as written on hosts made of network namespaces (:mod:`netns`).

One ``torchrun`` per host: trainers on two hosts, parameter servers on two others behind NICs shaped to
``--ps-mbit``. It runs K = 0 and K = 4 there, the K = 0 job on this machine's own launcher, and the loss of a server's
host and of a trainer's host (every process killed; the job launched again resumes from its checkpoint). Then, on a
cluster whose trainers' NICs are shaped too, the plan made for fast server NICs against the plan made for the NICs
as they are, calibrated on the cluster, adapted while it runs, and TorchRec's (:mod:`cluster_replanning`). Needs
root; elsewhere it prints why it skipped.

    python benchmarks/netcluster.py --json out.json     # 200 steps per K, faults and replanning (about 20 min)
    python benchmarks/netcluster.py --quick             # 20 steps per K only (CI, where root is available)

JSON keys: ``hosts``, ``trained``, ``sync_equals_single_host``, ``sockets_outside_cluster`` (listening sockets bound
neither to their host's cluster address nor to loopback, listed with their owner in ``sockets_outside``),
``k4_over_k0``, ``auc_gap``, ``predicted_ms`` (the K = 4 plan's step for the declared NICs), ``measured_ms`` (the
wall-clock step: elapsed over steps), ``step_error``, ``fault_stop_s`` / ``fault_messages`` / ``fault_at_step`` (per
lost host), ``resumed``, ``replan_speedup``, ``declared_speedup``, ``calibrated_over_declared``, ``adapt_speedup`` and
``ours_over_torchrec`` (and
``replan``: every plan's tables on the servers and steps; :mod:`cluster_replanning` says what each is),
``measured_mbit`` (bounded transfers through the shaped NICs), ``root_links_unchanged``, ``torn_down``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster_jobs import (
    DATA,
    HOSTS,
    job_result,
    plan_for,
    remote_tables,
    run_on_cluster,
    shardings,
    start_job,
    topology_yaml,
    train_command,
    watch_job,
)
from cluster_replanning import KEYS as REPLAN_KEYS
from cluster_replanning import replan
from netns import (
    NetCluster,
    Unavailable,
    check_available,
    namespaces,
    root_links,
    signals_as_exceptions,
    transfer_mbit,
)


@dataclass(frozen=True)
class Fault:
    """What a host's loss did to a job run with ``--checkpoint``.

    Attributes:
        host: The host whose every process was killed.
        at_step: The newest checkpoint's step when it was killed.
        stop_s: Seconds from the kill until every process of the other hosts had stopped.
        message: The other hosts' error line that names the host ("" if none did).
        resumed_from_step: Where the job, launched again on every host, went on from (None: it started over).
        steps: The step the job reached.
    """

    host: str
    at_step: int
    stop_s: float
    message: str
    resumed_from_step: int | None
    steps: int


def fault(
    cluster: NetCluster, work: Path, host: str, topology: Path, plan: Path, train_args: Sequence[str], steps: int
) -> Fault:
    """Kill every process of ``host`` once the job wrote a checkpoint; time the other hosts' stop; then launch the
    job again on every host, as a scheduler would, with the same rendezvous id: it resumes from its checkpoint.

    (torchrun's ``--max-restarts`` restarts the workers of the hosts that are left, but with torch 2.13's shared
    rendezvous store a host that replaces a lost one waits for the first round's address, which is never published
    again: a lost host means a new launch, not a restart.)
    """
    name = f"fault-{host}"
    checkpoint = work / name
    args = [*train_args, "--checkpoint", str(checkpoint), "--checkpoint-every", str(max(steps // 4, 1))]
    nodes = start_job(cluster, work, name, topology, plan, args)
    watch_job(cluster, nodes, until=lambda: _newest_step(checkpoint) is not None, timeout_s=300)
    at_step = _newest_step(checkpoint)
    if at_step is None:
        raise RuntimeError(f"{name}: no checkpoint within 300 s")
    killed = time.monotonic()
    cluster.kill_host(host)
    others = {h: p for h, p in nodes.items() if h != host}
    watch_job(cluster, others, timeout_s=300)
    stop_s = time.monotonic() - killed
    nodes[host].wait(timeout=30)
    message = _line_naming(work, name, list(others), host)
    again = start_job(cluster, work, name, topology, plan, args)
    watch_job(cluster, again)
    result = job_result(work, name, again)
    return Fault(host, at_step, stop_s, message, result.get("resumed_from_step"), result["last_step"])


def _newest_step(checkpoint: Path) -> int | None:
    """The newest complete checkpoint's step under ``checkpoint`` (None: none yet)."""
    from persia_planner.modules.train.job_checkpoints import complete_checkpoints

    found = complete_checkpoints(checkpoint)
    return int(found[0].name[5:]) if found else None


def _line_naming(work: Path, name: str, hosts: Sequence[str], host: str) -> str:
    """The first one-line error (``error: ...``) in ``hosts``' output that names ``host``."""
    for h in hosts:
        for line in (work / f"{name}-{h}.err").read_text(errors="replace").splitlines():
            if line.startswith("error:") and host in line:
                return line.strip()[:300]
    return ""


def run_single_host(topology: Path, plan: Path, train_args: Sequence[str]) -> dict[str, Any]:
    """The same job with ``persia train``'s own launcher on this machine's loopback."""
    done = subprocess.run(
        [sys.executable, *train_command(topology, plan, train_args)], capture_output=True, text=True, timeout=600
    )
    if done.returncode != 0:
        raise RuntimeError(f"persia train on one host: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def claim(work: Path, ps_mbit: float, steps: int, eval_batches: int, faults: bool) -> dict[str, Any]:
    """K = 0 and K = 4 of one plan (planned for the NICs as shaped) on the cluster, K = 0 on this machine's own
    launcher, and (``faults``) the loss of a server's host and of a trainer's host."""
    with NetCluster(HOSTS, {"ps0": ps_mbit, "ps1": ps_mbit}) as cluster:
        # What a transfer through a shaped NIC reaches, measured first: the topology declares the NICs' rate, and
        # the cost model's NIC efficiency is what was measured over what was declared (as for a calibrated profile).
        nbytes = int(ps_mbit * 1e6 / 8 * 0.5)
        measured = {f"{s}->trainer0": transfer_mbit(cluster, s, "trainer0", nbytes) for s in ("ps0", "ps1")}
        measured["trainer0->ps0"] = transfer_mbit(cluster, "trainer0", "ps0", nbytes)
        efficiency = min(1.0, statistics.median(measured.values()) / ps_mbit)
        topology = work / "claim.yaml"
        topology.write_text(topology_yaml(ps_mbit, nic_efficiency=efficiency))
        # A plan is priced for its staleness and runs only at it: one plan per K. Where the servers' tables are the
        # ones that fit nowhere else, both give every table the same sharding and tier (compared: same_shardings),
        # and may put a table-wise table on the other of the two like trainers.
        plan0, plan = plan_for(work, "claim-k0.json", topology, 0), plan_for(work, "claim-k4.json", topology, 4)
        job = ["--steps", str(steps), "--eval-batches", str(eval_batches), *DATA]
        k0, sockets = run_on_cluster(cluster, work, "k0", topology, plan0, [*job, "--mode", "sync"])
        k4, more = run_on_cluster(cluster, work, "k4", topology, plan, [*job, "--staleness", "4"])
        k4_job = [*job, "--staleness", "4"]
        lost = [fault(cluster, work, host, topology, plan, k4_job, steps) for host in ("ps1", "trainer1") if faults]
        outside = cluster.outside(sorted(sockets | more))
        tags = [cluster.bridge, *(h.namespace for h in cluster.hosts.values())]
    single = run_single_host(topology, plan0, [*job, "--mode", "sync"])
    return {
        "claim_remote_tables": remote_tables(plan),
        "same_shardings": shardings(plan0) == shardings(plan),
        "measured_mbit": measured,
        "nic_efficiency": efficiency,
        "outside": outside,
        "tags": tags,
        "k0": k0,
        "k4": k4,
        "single": single,
        "faults": lost,
    }


def main(argv: list[str] | None = None) -> int:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--ps-mbit", type=float, default=20.0, help="the PS hosts' NIC rate (default 20)")
    parser.add_argument("--steps", type=int, default=200, help="steps of each K = 0 / K = 4 run (default 200)")
    parser.add_argument("--quick", action="store_true", help="fewer steps, no faults, no replanning (CI)")
    parser.add_argument("--replan-steps", type=int, default=120, help="steps of each replanning run (default 120)")
    parser.add_argument("--rounds", type=int, default=2, help="alternated rounds of the replanning runs (default 2)")
    parser.add_argument("--work", type=Path, help="keep every job's logs here (default: a temporary folder)")
    args = parser.parse_args(argv)
    try:
        check_available()
    except Unavailable as err:
        print(f"skipped: {err}")
        return 0
    steps = 20 if args.quick else args.steps
    before = root_links()
    machine = {"platform": platform.platform(), "cpus": os.cpu_count()}
    results: dict[str, Any] = {"machine": machine, "hosts": len(HOSTS), "ps_mbit": args.ps_mbit, "steps": steps}
    with tempfile.TemporaryDirectory(prefix="persia-netcluster-") as tmp, signals_as_exceptions():
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        c = claim(work, args.ps_mbit, steps, 4 if args.quick else 16, faults=not args.quick)
        r = None if args.quick else replan(work, args.replan_steps, args.rounds)
    k0, k4, single = c["k0"], c["k4"], c["single"]
    results |= {
        "trained": k0["steps"] == steps and k4["steps"] == steps,
        "sync_equals_single_host": all(abs(k0[k] - single[k]) <= 1e-6 for k in ("loss", "auc", "eval_loss")),
        "sockets_outside_cluster": len(c["outside"]),
        "sockets_outside": [list(s) for s in c["outside"]],
        "remote_tables": c["claim_remote_tables"],
        "same_shardings": c["same_shardings"],
        "measured_mbit": c["measured_mbit"],
        "nic_efficiency": c["nic_efficiency"],
        "k0_samples_per_s": k0["samples_per_s"],
        "k4_samples_per_s": k4["samples_per_s"],
        "k4_over_k0": k4["samples_per_s"] / k0["samples_per_s"],
        "auc_k0": k0["auc"],
        "auc_k4": k4["auc"],
        "auc_gap": abs(k4["auc"] - k0["auc"]),
        "predicted_ms": k4["plan_step_ms"],
        # The wall-clock step (elapsed / steps): with K = 4 a step may run ahead of the link and the next one wait,
        # so the median step is shorter than what the link allows; the plan predicts the throughput's step.
        "measured_ms": k4["wall_step_ms"],
        "median_step_ms": k4["step_ms"],
        "step_error": abs(k4["plan_step_ms"] - k4["wall_step_ms"]) / k4["wall_step_ms"],
    }
    if c["faults"]:
        results |= {
            "fault_stop_s": {f.host: f.stop_s for f in c["faults"]},
            "fault_messages": {f.host: f.message for f in c["faults"]},
            "fault_at_step": {f.host: f.at_step for f in c["faults"]},
            "resumed": all(f.resumed_from_step == f.at_step and f.steps == steps for f in c["faults"]),
        }
    tags = set(c["tags"])
    if r is not None:
        results |= {"replan": {k: v for k, v in r.items() if k != "tags"}, **{k: r[k] for k in REPLAN_KEYS}}
        tags |= set(r["tags"])
    results["root_links_unchanged"] = root_links() == before
    results["torn_down"] = not tags & set(namespaces())
    print_table(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0 if results["root_links_unchanged"] and results["torn_down"] and results["trained"] else 1


def print_table(results: Mapping[str, Any]) -> None:
    """The figures the issue names, a row each."""
    rows = [(k, results[k]) for k in (
        "hosts", "trained", "sync_equals_single_host", "sockets_outside_cluster", "k4_over_k0", "auc_gap",
        "predicted_ms", "measured_ms", "step_error", "replan_speedup", "declared_speedup", "calibrated_over_declared",
        "adapt_speedup", "ours_over_torchrec", "fault_stop_s", "resumed",
        "root_links_unchanged", "torn_down",
    ) if k in results]  # fmt: skip
    width = max(len(k) for k, _ in rows)
    print(f"namespace cluster: {results['hosts']} hosts, parameter servers at {results['ps_mbit']:g} Mbit/s")
    for key, value in rows:
        if isinstance(value, float):
            value = f"{value:.3f}"
        elif isinstance(value, dict):
            value = ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in value.items())
        print(f"  {key:<{width}}  {value}")


if __name__ == "__main__":
    sys.exit(main())
