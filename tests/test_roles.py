"""Two torchrun nodes on this machine, each one host of the topology: the servers run where the topology puts them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from persia_planner.errors import PlannerError
from persia_planner.modules.launcher.launch import hosted_store, reserved_port
from persia_planner.modules.train.roles import claim_role, job_processes
from persia_planner.paths import EXAMPLES
from persia_planner.topology.torchrun_nodes import ProcessKind, ProcessRole, TorchrunProcess

TORCHRUN = Path(sys.executable).with_name("torchrun")


def test_a_role_claimed_twice_is_refused(monkeypatch):
    with hosted_store(timeout_s=30) as port:
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "claims")
        ps0 = ProcessRole(ProcessKind.SERVER, 0, "ps0")
        claim_role(ps0, TorchrunProcess(0, 2, 0, 1, 0))
        claim_role(ProcessRole(ProcessKind.TRAINER, 0, "trainer0"), TorchrunProcess(1, 2, 0, 1, 1))
        with pytest.raises(PlannerError) as info:  # a second node that says it is ps0 as well
            claim_role(ps0, TorchrunProcess(1, 3, 0, 1, 1))
        message = str(info.value)
        assert message.startswith("ps0 of host 'ps0' is run by two torchrun processes (node 1 is the second)")
        assert "fix: name each host on one node only (--node-host or PERSIA_HOST)" in message
        placed = [(p["rank"], p["node"], p["host"], p["role"]) for p in job_processes(2)]
        assert placed == [(0, 0, "ps0", "ps0"), (1, 1, "trainer0", "trainer0")]


def _topology(tmp_path: Path) -> Path:
    """One trainer host of two CPU trainers, then a parameter_server host entry of two servers (box-b0, box-b1)."""
    profile = str(EXAMPLES / "profiles" / "cpu-2core.yaml")
    trainer = {"name": "box-a", "ddr": "8GiB", "profile": profile, "cpus": {"count": 2, "memory": "4MiB"}}
    servers = {"name": "box-b", "count": 2, "role": "parameter_server", "ddr": "2GiB", "profile": profile}
    path = tmp_path / "two_nodes.yaml"
    path.write_text(yaml.safe_dump({"name": "two-nodes", "hosts": [trainer, servers], "network": {"latency": "50us"}}))
    return path


def _node(rank: int, port: int, hosts: str, topology: Path) -> subprocess.Popen:
    rdzv = ["--nnodes", "2", "--node-rank", str(rank), "--nproc-per-node", "2", "--rdzv-backend", "c10d"]
    # Node 0 hosts the rendezvous store on the reserved port; node 1 only connects (it retries until node 0 listens).
    rdzv += ["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "roles", "--rdzv-conf", f"is_host={rank == 0}"]
    job = ["--topology", str(topology), "--steps", "4", "--batch-size", "64", "--eval-batches", "1", "--json"]
    return subprocess.Popen(
        [str(TORCHRUN), *rdzv, "-m", "persia_planner.cli", "train", *job],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PERSIA_HOST": hosts, "PYTHONWARNINGS": "ignore"},
    )


@pytest.mark.processes
@pytest.mark.timeout(600)
def test_two_torchrun_nodes_run_the_servers_on_the_parameter_server_host(tmp_path):
    topology = _topology(tmp_path)
    with reserved_port() as port:  # node 0's agent binds it (SO_REUSEADDR, as the reservation); nobody else may
        nodes = [_node(0, port, "box-a0", topology), _node(1, port, "box-b0,box-b1", topology)]
        outs = [p.communicate(timeout=540) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], [err[-3000:] for _, err in outs]
    printed = [[x for x in out.splitlines() if x.startswith("{")] for out, _ in outs]
    assert len(printed[0]) == 1 and printed[1] == [], printed  # the first trainer prints, on the trainer host's node
    result = json.loads(printed[0][0])
    assert result["trainers"] == 2 and result["servers"] == 2 and result["steps"] == 4
    assert 0.0 <= result["auc"] <= 1.0 and result["ps_tables"], result
    processes = result["processes"]
    assert [p["rank"] for p in processes] == [0, 1, 2, 3]
    agent = {p["role"]: p["agent_pid"] for p in processes}
    host = {p["role"]: p["host"] for p in processes}
    assert host == {"trainer0": "box-a0", "trainer1": "box-a0", "ps0": "box-b0", "ps1": "box-b1"}
    # started by node 1's torchrun: the servers; by node 0's: the trainers
    assert agent == {"trainer0": nodes[0].pid, "trainer1": nodes[0].pid, "ps0": nodes[1].pid, "ps1": nodes[1].pid}
    # each node's processes share the node rank the rendezvous gave it
    node = {p["role"]: p["node"] for p in processes}
    assert node["trainer0"] == node["trainer1"] != node["ps0"] == node["ps1"]


@pytest.mark.processes
@pytest.mark.timeout(600)
def test_a_topology_without_parameter_servers_trains_under_torchrun_without_them(tmp_path):
    profile = str(EXAMPLES / "profiles" / "cpu-2core.yaml")
    trainer = {"name": "box", "ddr": "8GiB", "profile": profile, "cpus": {"count": 2, "memory": "64MiB"}}
    topology = tmp_path / "no_ps.yaml"
    topology.write_text(yaml.safe_dump({"name": "no-ps", "hosts": [trainer]}))
    job = ["train", "--topology", str(topology), "--steps", "4", "--batch-size", "64", "--eval-batches", "1", "--json"]
    with reserved_port() as port:  # ours until the run ends: torchrun may bind it (SO_REUSEADDR), nobody else
        done = subprocess.run(
            [
                str(TORCHRUN),
                "--nproc-per-node",
                "2",
                "--master-port",
                str(port),
                "-m",
                "persia_planner.cli",
                *job,
            ],
            capture_output=True,
            text=True,
            timeout=540,
        )
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("{")]
    result = json.loads(line)
    assert result["servers"] == 0 and result["ps_tables"] == [] and result["trainers"] == 2
    assert [p["role"] for p in result["processes"]] == ["trainer0", "trainer1"]
