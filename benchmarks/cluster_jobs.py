"""Jobs on the namespace cluster (:mod:`netns`): the topology of its hosts, ``persia plan`` for it, and ``persia
train`` run as docs/multinode.md runs it (one ``torchrun`` per host), watched to its end.

:mod:`netcluster` (the multi-node guide's claims, lost hosts) and :mod:`cluster_replanning` (plans calibrated on the
cluster, ``--adapt``, TorchRec's plan) run their jobs through these.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from netns import NetCluster

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "persia_planner" / "examples" / "dlrm_small.yaml"
PROFILE = REPO / "persia_planner" / "examples" / "profiles" / "cpu-2core.yaml"
RDZV_PORT = 29500
HOSTS = ("trainer0", "trainer1", "ps0", "ps1")
# The synthetic data draws ids from all of each table's rows, as the model.yaml that the plans price describes them
# (persia train draws from 2% of them unless told, --id-space 0.02: far fewer distinct rows a batch than priced).
DATA = ("--id-space", "1")


def topology_yaml(
    ps_mbit: float,
    trainer_mbit: float = 10_000.0,
    trainer_memory: str = "4MiB",
    nic_efficiency: float | None = None,
    profile: Path = PROFILE,
) -> str:
    """Two trainer hosts of one CPU trainer each and two parameter-server hosts, with the NICs declared as shaped
    (and, where given, the share of a NIC's rate that a transfer reaches: the cost model's ``nic_efficiency``), every
    host described by ``profile`` (default: the bundled loopback profile)."""
    constants = "" if nic_efficiency is None else f"constants:\n  nic_efficiency: {nic_efficiency:.3f}\n"
    return f"""{constants}name: netns-2x1-2ps
hosts:
  - name: trainer
    count: 2
    ddr: 8GiB
    nic_bandwidth: {trainer_mbit / 8000:g}GB/s
    profile: {profile}
    cpus: {{count: 1, memory: {trainer_memory}}}
  - name: ps
    count: 2
    role: parameter_server
    ddr: 2GiB
    nic_bandwidth: {ps_mbit / 8000:g}GB/s
    profile: {profile}
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
