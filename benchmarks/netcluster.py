"""The multi-node guide (docs/multinode.md) run as written on hosts made of network namespaces (:mod:`netns`).

One ``torchrun`` per host: trainers on two hosts, parameter servers on two others behind NICs shaped to
``--ps-mbit``. It runs K = 0 and K = 4 there, the K = 0 job on this machine's own launcher, and the loss of a server's
host and of a trainer's host (every process killed; the job launched again resumes from its checkpoint). Then, on a
cluster whose trainers' NICs are shaped too, the plan made for fast server NICs against the plan made for the NICs
as they are. Needs root; elsewhere it prints why it skipped.

    python benchmarks/netcluster.py --json out.json     # 200 steps per K, faults and replanning (about 8 min)
    python benchmarks/netcluster.py --quick             # 20 steps per K only (CI, where root is available)

JSON keys: ``hosts``, ``trained``, ``sync_equals_single_host``, ``sockets_outside_cluster`` (listening sockets bound
neither to their host's cluster address nor to loopback, listed with their owner in ``sockets_outside``),
``k4_over_k0``, ``auc_gap``, ``predicted_ms`` (the K = 4 plan's step for the declared NICs), ``measured_ms`` (the
wall-clock step: elapsed over steps), ``step_error``, ``fault_stop_s`` / ``fault_messages`` / ``fault_at_step`` (per
lost host), ``resumed``, ``replan_speedup`` (and ``replan``: the two plans' tables on the servers and steps),
``measured_mbit`` (bounded transfers through the shaped NICs), ``root_links_unchanged``, ``torn_down``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from netns import NetCluster, Unavailable, check_available, namespaces, root_links, transfer_mbit

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "persia_planner" / "examples" / "dlrm_small.yaml"
PROFILE = REPO / "persia_planner" / "examples" / "profiles" / "cpu-2core.yaml"
RDZV_PORT = 29500


def topology_yaml(
    ps_mbit: float, trainer_mbit: float = 10_000.0, trainer_memory: str = "4MiB", nic_efficiency: float | None = None
) -> str:
    """Two trainer hosts of one CPU trainer each and two parameter-server hosts, with the NICs declared as shaped
    (and, where given, the share of a NIC's rate that a transfer reaches: the cost model's ``nic_efficiency``)."""
    constants = "" if nic_efficiency is None else f"constants:\n  nic_efficiency: {nic_efficiency:.3f}\n"
    return f"""{constants}name: netns-2x1-2ps
hosts:
  - name: trainer
    count: 2
    ddr: 8GiB
    nic_bandwidth: {trainer_mbit / 8000:g}GB/s
    profile: {PROFILE}
    cpus: {{count: 1, memory: {trainer_memory}}}
  - name: ps
    count: 2
    role: parameter_server
    ddr: 2GiB
    nic_bandwidth: {ps_mbit / 8000:g}GB/s
    profile: {PROFILE}
network:
  latency: 50us
"""


def train_command(topology: Path, plan: Path, train_args: Sequence[str]) -> list[str]:
    """``python``'s arguments for ``persia train`` of the bundled model with ``plan``, its result as JSON."""
    return ["-m", "persia_planner.cli", "train", "--model", str(MODEL), "--topology", str(topology),
            "--plan", str(plan), *train_args, "--json"]  # fmt: skip


def plan_for(work: Path, name: str, topology: Path, staleness: int) -> Path:
    """``persia plan`` of the bundled model on ``topology`` for staleness ``staleness``, into ``work/name``."""
    out = work / name
    done = subprocess.run(
        [sys.executable, "-m", "persia_planner.cli", "plan", str(MODEL), str(topology), "--staleness", str(staleness),
         "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"persia plan: {done.stderr.strip()[-500:]}")
    return out


def shardings(plan: Path) -> dict[str, tuple[str, tuple[str, ...]]]:
    """Per table of ``plan``, its sharding and its shards' tiers (where they are aside)."""
    tables = json.loads(plan.read_text())["tables"]
    return {n: (t["sharding"], tuple(sorted(s["tier"] for s in t.get("shards", [])))) for n, t in tables.items()}


def remote_tables(plan: Path) -> int:
    """How many of ``plan``'s tables live on the parameter servers."""
    tables = json.loads(plan.read_text())["tables"]
    return sum(any(s.get("tier") == "ps" for s in t.get("shards", [])) for t in tables.values())


def start_job(
    cluster: NetCluster,
    work: Path,
    name: str,
    topology: Path,
    plan: Path,
    train_args: Sequence[str],
    hosts: Sequence[str] | None = None,
) -> dict[str, subprocess.Popen]:
    """The job as docs/multinode.md runs it: one torchrun per host (``hosts``: all), c10d on the first host's cluster
    address (its torchrun with ``--local-addr``), no interface variables. Each host's output goes to
    ``work/<name>-<host>.out`` and ``.err`` (appended: a replacement host writes after the host it replaces)."""
    head = cluster.hosts[next(iter(cluster.hosts))].address
    args = train_command(topology, plan, train_args)
    rdzv = ["--nnodes", str(len(cluster.hosts)), "--rdzv-backend", "persia", "--rdzv-endpoint", f"{head}:{RDZV_PORT}",
            "--rdzv-id", name]  # fmt: skip
    nodes = {}
    for i, host in enumerate(cluster.hosts):
        if hosts is not None and host not in hosts:
            continue
        role = ["--local-addr", head, "--rdzv-conf", "is_host=true"] if i == 0 else ["--rdzv-conf", "is_host=false"]
        # The one variable a real cluster would not need: the namespaces share a kernel, and TensorPipe's cma channel
        # would copy rows from process to process around the shaped links.
        env = {k: v for k, v in os.environ.items() if not k.endswith("_SOCKET_IFNAME")} | {
            "PERSIA_HOST": host,
            "PERSIA_RPC_CHANNELS": "basic",
        }
        with open(work / f"{name}-{host}.out", "a") as out, open(work / f"{name}-{host}.err", "a") as err:
            argv = [sys.executable, "-m", "torch.distributed.run", *rdzv, *role, "--nproc-per-node", "1", *args]
            nodes[host] = cluster.popen(host, argv, env=env, stdout=out, stderr=err, cwd=work)
    return nodes


def watch_job(
    cluster: NetCluster, nodes: Mapping[str, subprocess.Popen], until: Any = None, timeout_s: float = 600.0
) -> set[tuple[str, str, int, str]]:
    """Wait for ``nodes`` to end (or ``until()`` to be true), at most ``timeout_s``; returns every listening socket
    seen meanwhile, ``(host, address, port, owner)``, the owner ``torchrun`` (a host's agent) or ``job`` (the
    processes it started). Nodes still running at the deadline are killed."""
    sockets: set[tuple[str, str, int, str]] = set()
    agents = {p.pid for p in nodes.values()}
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in nodes.values()) and time.monotonic() < deadline:  # bounded in time
        for host in cluster.hosts:
            sockets |= {
                (host, a, port, "torchrun" if pid in agents else "job") for a, port, pid in cluster.listening(host)
            }
        if until is not None and until():
            return sockets
        time.sleep(0.5)
    for p in nodes.values():
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    return sockets


def job_result(work: Path, name: str, nodes: Mapping[str, subprocess.Popen]) -> dict[str, Any]:
    """The first trainer's ``--json`` result of a job whose nodes all ended well.

    Raises:
        RuntimeError: A node failed (naming it, with the end of its output).
    """
    codes = {host: p.wait() for host, p in nodes.items()}
    if any(codes.values()):
        host = next(h for h, c in codes.items() if c)
        lines = (work / f"{name}-{host}.err").read_text(errors="replace").splitlines()
        said = [x for x in lines if x.startswith("error:")] or lines[-10:]
        raise RuntimeError(f"the job failed on {host} (exit {codes[host]}): {' / '.join(said)[-800:]}")
    for h in nodes:  # the first host with a result; its last one (a job launched again appends to its output)
        results = [x for x in (work / f"{name}-{h}.out").read_text().splitlines() if x.startswith("{")]
        if results:
            return json.loads(results[-1])
    raise RuntimeError(f"the job {name} ended well but printed no result")


def run_on_cluster(
    cluster: NetCluster, work: Path, name: str, topology: Path, plan: Path, train_args: Sequence[str]
) -> tuple[dict[str, Any], set[tuple[str, str, int, str]]]:
    """Run the job on every host to its end: the first trainer's result, and the listening sockets seen."""
    nodes = start_job(cluster, work, name, topology, plan, train_args)
    sockets = watch_job(cluster, nodes)
    return job_result(work, name, nodes), sockets


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


@contextlib.contextmanager
def _signals_as_exceptions() -> Iterator[None]:
    """SIGINT and SIGTERM raise here, so that the ``with`` blocks above tear the cluster down."""

    def stop(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    before = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


HOSTS = ("trainer0", "trainer1", "ps0", "ps1")
# The synthetic data draws ids from all of each table's rows, as the model.yaml that the plans price describes them
# (persia train draws from 2% of them unless told, --id-space 0.02: far fewer distinct rows a batch than priced).
DATA = ("--id-space", "1")
# The replanning cluster: trainers' NICs shaped too, so that the servers are worth a table to the planner when their
# NICs are declared fast, and the trainers hold more of the model.
REPLAN_TRAINER_MBIT, REPLAN_PS_MBIT, REPLAN_MEMORY = 100.0, 30.0, "12MiB"


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


def replan(work: Path, steps: int) -> dict[str, Any]:
    """The same shaped cluster run with the plan made for fast server NICs, and with the plan made for its own."""
    naive_topology, declared_topology = work / "naive.yaml", work / "declared.yaml"
    naive_topology.write_text(topology_yaml(10_000.0, REPLAN_TRAINER_MBIT, REPLAN_MEMORY))
    declared_topology.write_text(topology_yaml(REPLAN_PS_MBIT, REPLAN_TRAINER_MBIT, REPLAN_MEMORY))
    naive = plan_for(work, "naive.json", naive_topology, 4)
    declared = plan_for(work, "declared.json", declared_topology, 4)
    job = ["--steps", str(steps), "--eval-batches", "2", "--staleness", "4", *DATA]
    rates = {"trainer0": REPLAN_TRAINER_MBIT, "trainer1": REPLAN_TRAINER_MBIT} | {
        s: REPLAN_PS_MBIT for s in ("ps0", "ps1")
    }
    with NetCluster(HOSTS, rates) as cluster:
        on_naive, _ = run_on_cluster(cluster, work, "naive", declared_topology, naive, job)
        on_declared, _ = run_on_cluster(cluster, work, "declared", declared_topology, declared, job)
        tags = [cluster.bridge, *(h.namespace for h in cluster.hosts.values())]
    return {
        "naive": on_naive, "declared": on_declared, "tags": tags,
        "naive_remote": remote_tables(naive), "declared_remote": remote_tables(declared),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--ps-mbit", type=float, default=20.0, help="the PS hosts' NIC rate (default 20)")
    parser.add_argument("--steps", type=int, default=200, help="steps of each K = 0 / K = 4 run (default 200)")
    parser.add_argument("--quick", action="store_true", help="fewer steps, no faults, no replanning (CI)")
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
    with tempfile.TemporaryDirectory(prefix="persia-netcluster-") as tmp, _signals_as_exceptions():
        work = Path(tmp)
        c = claim(work, args.ps_mbit, steps, 4 if args.quick else 16, faults=not args.quick)
        r = None if args.quick else replan(work, 60)
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
        results |= {
            "replan": {
                "trainer_mbit": REPLAN_TRAINER_MBIT, "ps_mbit": REPLAN_PS_MBIT, "trainer_memory": REPLAN_MEMORY,
                "remote_tables_fast_nic": r["naive_remote"], "remote_tables_declared_nic": r["declared_remote"],
                "measured_ms_fast_nic_plan": r["naive"]["wall_step_ms"],
                "measured_ms_declared_nic_plan": r["declared"]["wall_step_ms"],
                "breakdown_ms_fast_nic_plan": r["naive"]["step_breakdown_ms"],
                "breakdown_ms_declared_nic_plan": r["declared"]["step_breakdown_ms"],
                "predicted_ms_declared_nic_plan": r["declared"]["plan_step_ms"],
            },
            "replan_speedup": r["naive"]["wall_step_ms"] / r["declared"]["wall_step_ms"],
        }  # fmt: skip
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
        "predicted_ms", "measured_ms", "step_error", "replan_speedup", "fault_stop_s", "resumed",
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
