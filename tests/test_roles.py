"""Two torchrun nodes on this machine, each one host of the topology: the servers run where the topology puts them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from persia_planner.modules.ps.launch import reserved_port
from persia_planner.paths import EXAMPLES

TORCHRUN = Path(sys.executable).with_name("torchrun")


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
