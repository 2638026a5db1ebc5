"""Which topology host a torchrun node is, what each of its processes runs, and worlds that do not match the plan."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from processes import cli_in_fresh_interpreter

from persia_planner import load_topology
from persia_planner.errors import PlannerError
from persia_planner.paths import EXAMPLES
from persia_planner.topology.torchrun_nodes import (
    ProcessKind,
    ProcessRole,
    TorchrunProcess,
    job_hosts,
    node_layout,
    process_role,
)

ROOT = Path(__file__).resolve().parents[1]
LOCAL = load_topology(EXAMPLES / "local_2x1.yaml")  # trainer0 (2 CPU trainers), ps0, ps1
CLUSTER = load_topology(EXAMPLES / "cluster_2x4_2ps.yaml")  # trainer0, trainer1 (4 GPUs each), ps0, ps1

SERVER, TRAINER = ProcessKind.SERVER, ProcessKind.TRAINER


def _roles(topology, per_node: list[int], named: list[str | None] | None = None) -> list[ProcessRole]:
    """Every process's role, nodes of ``per_node`` processes numbered in rank order."""
    world, roles, base = sum(per_node), [], 0
    for node, procs in enumerate(per_node):
        for local in range(procs):
            process = TorchrunProcess(base + local, world, local, procs, node)
            roles.append(process_role(topology, process, named[node] if named else None))
        base += procs
    return roles


def test_one_node_runs_the_servers_first_then_the_trainers():
    assert _roles(LOCAL, [4]) == [
        ProcessRole(SERVER, 0, "ps0"),
        ProcessRole(SERVER, 1, "ps1"),
        ProcessRole(TRAINER, 0, "trainer0"),
        ProcessRole(TRAINER, 1, "trainer0"),
    ]


def test_nodes_take_the_hosts_in_topology_order_by_rank():
    # two nodes of two: the trainer host (first in the file) is node 0, both servers' hosts node 1
    assert [(r.kind, r.index, r.host) for r in _roles(LOCAL, [2, 2])] == [
        (TRAINER, 0, "trainer0"),
        (TRAINER, 1, "trainer0"),
        (SERVER, 0, "ps0"),
        (SERVER, 1, "ps1"),
    ]
    # one node per host, each with its own process count: trainer j is topology.gpus[j]
    roles = _roles(CLUSTER, [4, 4, 1, 1])
    assert [r.name for r in roles] == [*(f"trainer{j}" for j in range(8)), "ps0", "ps1"]
    assert [r.host for r in roles] == ["trainer0"] * 4 + ["trainer1"] * 4 + ["ps0", "ps1"]
    assert [CLUSTER.gpus[r.index].host for r in roles[:8]] == [r.host for r in roles[:8]]


def test_named_hosts_place_the_processes_whatever_the_node_order():
    # c10d numbers the nodes by address: the server node may come first; PERSIA_HOST says which host it is
    roles = _roles(LOCAL, [2, 2], named=["ps1,ps0", "trainer0"])
    assert roles == [
        ProcessRole(SERVER, 1, "ps1"),
        ProcessRole(SERVER, 0, "ps0"),
        ProcessRole(TRAINER, 0, "trainer0"),
        ProcessRole(TRAINER, 1, "trainer0"),
    ]
    # a trainer host and a server's host on one node of five: the server first
    roles = _roles(CLUSTER, [5, 5], named=["trainer0,ps0", "trainer1,ps1"])
    assert [r.name for r in roles] == [
        "ps0",
        *(f"trainer{j}" for j in range(4)),
        "ps1",
        *(f"trainer{j}" for j in range(4, 8)),
    ]


def test_the_layout_is_one_node_per_host():
    assert [h.name for h in job_hosts(CLUSTER)] == ["trainer0", "trainer1", "ps0", "ps1"]
    assert node_layout(CLUSTER) == (("trainer0", 4), ("trainer1", 4), ("ps0", 1), ("ps1", 1))
    assert node_layout(LOCAL) == (("trainer0", 2), ("ps0", 1), ("ps1", 1))


@pytest.mark.parametrize(
    ("per_node", "named", "needles"),
    [
        (
            [4, 5],
            None,
            [
                "the torchrun world has 9 processes but topology '2x4-l4-2ps' runs 10: 2 parameter servers",
                "and 8 trainers",
                "fix: launch 10 processes in all, per host: trainer0 4, trainer1 4, ps0 1, ps1 1",
            ],
        ),
        (
            [5, 5],
            None,
            [
                "torchrun node 0 has ranks 0..4, which split host 'trainer1' (ranks 4..7",
                "--nproc-per-node per host trainer0 4, trainer1 4, ps0 1, ps1 1",
                "--node-host or PERSIA_HOST",
            ],
        ),
        (
            [5, 5],
            ["trainer0", "trainer1,ps0,ps1"],
            [
                "torchrun node 0 runs 5 processes (--nproc-per-node) but its hosts (trainer0) run 4",
                "fix: --nproc-per-node 4",
            ],
        ),
        (
            [5, 5],
            ["trainer0,gpu0", "x"],
            [
                "--node-host names 'gpu0', not a trainer or parameter_server host of topology '2x4-l4-2ps'",
                "fix: name one of trainer0, trainer1, ps0, ps1",
            ],
        ),
        ([5, 5], ["ps0,ps0", "x"], ["--node-host names a host twice: 'ps0,ps0'"]),
    ],
)
def test_a_world_that_is_not_the_plans_is_refused_in_one_line(per_node, named, needles):
    with pytest.raises(PlannerError) as info:
        _roles(CLUSTER, per_node, named)
    message = str(info.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message


def test_torchrun_variables_are_read_and_checked():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"}
    assert TorchrunProcess.from_environ(env) == TorchrunProcess(3, 4, 1, 2, 1)
    # without the node's variables: one node of the whole world
    assert TorchrunProcess.from_environ({"RANK": "2", "WORLD_SIZE": "4"}) == TorchrunProcess(2, 4, 2, 4, 0)
    with pytest.raises(PlannerError, match="TORCHELASTIC_RUN_ID is set but WORLD_SIZE is not"):
        TorchrunProcess.from_environ({"RANK": "0"})
    with pytest.raises(PlannerError, match="LOCAL_WORLD_SIZE is 'two', not a whole number"):
        TorchrunProcess.from_environ(env | {"LOCAL_WORLD_SIZE": "two"})


@pytest.mark.processes
def test_the_cli_refuses_a_mismatched_world_before_importing_torch(tmp_path):
    torchrun = {"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0"}
    cases = [
        (["train"], torchrun | {"WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3"}, "the torchrun world has 3 processes"),
        (["train"], torchrun | {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "1"}, "which split host 'trainer0'"),
        (["train", "--node-host", "ps9"], torchrun | {"WORLD_SIZE": "4"}, "--node-host names 'ps9'"),
        (["train"], torchrun | {"WORLD_SIZE": "4", "PERSIA_HOST": "ps0"}, "its hosts (ps0) run 1"),
        (["train"], {"PERSIA_HOST": "trainer0"}, "--node-host (or PERSIA_HOST) is set but this is not a torchrun"),
        (["nodes", str(EXAMPLES / "local_2x1.yaml"), "--node", "3"], {}, "--node 3 is past the 3 nodes of"),
    ]
    results, torch_imported = cli_in_fresh_interpreter([(a, e) for a, e, _ in cases])
    for (args, _, needle), (exit_code, output) in zip(cases, results, strict=True):
        assert exit_code == 2 and needle in output and "Traceback" not in output, (args, output)
        assert len(output.strip().splitlines()) == 1, output
    assert torch_imported is False


@pytest.mark.processes
def test_persia_nodes_prints_each_nodes_host_and_process_count(tmp_path):
    topology = tmp_path / "two.yaml"
    rates = {"ddr_bandwidth": "100GB/s", "nic_bandwidth": "25GB/s"}
    gpus = {"count": 2, "hbm": "16GiB", "hbm_bandwidth": "1TB/s", "tflops": 100, "pcie_bandwidth": "32GB/s"}
    trainer = {"name": "gpu-box", "ddr": "64GiB", **rates, "gpus": gpus}
    server = {"name": "ps-box", "role": "parameter_server", "ddr": "128GiB", **rates}
    topology.write_text(yaml.safe_dump({"name": "two", "hosts": [server, trainer]}))
    cli = [sys.executable, "-m", "persia_planner.cli", "nodes", str(topology)]
    done = subprocess.run(cli, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["0 ps-box0 1", "1 gpu-box0 2"]
    done = subprocess.run([*cli, "--node", "1"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.stdout.splitlines() == ["1 gpu-box0 2"]
