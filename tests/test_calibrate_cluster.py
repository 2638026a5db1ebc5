"""persia calibrate --topology under torchrun (modules/tools/cluster_calibration.py, cluster_profiles.py): on a
namespace cluster, one profile per host class, measured on its hosts over the shaped links, that a topology takes per
host and refuses on another host's entry; one host alone; the checks made before anything is measured, each one
line."""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from benchmark_modules import load
from processes import TORCHRUN_ENV
from typer.testing import CliRunner

from persia_planner.cli import app
from persia_planner.errors import PlannerError, SpecError
from persia_planner.modules.tools.cluster_profiles import (
    STEP_SKIPPED,
    calibration_host,
    host_classes,
    median_of,
    profile_outputs,
)
from persia_planner.outputs import RUN_MARKER, OutputKind
from persia_planner.topology.graph import load_topology
from persia_planner.topology.profile import load_profile
from persia_planner.topology.torchrun_nodes import TorchrunProcess

netns = load("netns")

HOSTS = ("trainer0", "trainer1", "ps0")
PS_MBIT = 100.0  # the server's NIC, shaped each way: the link rate measured to it must be this one's
TOPOLOGY = """name: calib-3
hosts:
  - name: trainer
    count: 2
    ddr: 8GiB
    {trainer_figures}
    cpus: {{count: 1, memory: 1GiB{cpu_figures}}}
  - name: ps
    role: parameter_server
    ddr: 2GiB
    {ps_figures}
network:
  latency: 50us
"""
DECLARED = dict(
    trainer_figures="ddr_bandwidth: 10GB/s\n    nic_bandwidth: 1.25GB/s",
    cpu_figures=", bandwidth: 10GB/s, tflops: 0.1",
    ps_figures=f"ddr_bandwidth: 10GB/s\n    nic_bandwidth: {PS_MBIT / 8000:g}GB/s",
)


def _topology(path: Path, **figures: str) -> Path:
    path.write_text(TOPOLOGY.format(**(DECLARED | figures)))
    return path


def _calibrate_on(cluster, work: Path, topology: Path, out_dir: Path, timeout_s: float) -> dict[str, int]:
    """``persia calibrate --topology`` as docs/multinode.md launches it: one torchrun per host, the rendezvous on
    the first host's address; each host's exit code (a host still running at the deadline is killed: -9)."""
    head = cluster.hosts[HOSTS[0]].address
    rdzv = ["--nnodes", str(len(HOSTS)), "--rdzv-backend", "persia", "--rdzv-endpoint", f"{head}:29500",
            "--rdzv-id", "calibrate", "--nproc-per-node", "1"]  # fmt: skip
    args = ["-m", "persia_planner.cli", "calibrate", "--topology", str(topology), "--out-dir", str(out_dir)]
    nodes = {}
    for i, host in enumerate(HOSTS):
        role = ["--local-addr", head, "--rdzv-conf", "is_host=true"] if i == 0 else ["--rdzv-conf", "is_host=false"]
        # As on the cluster of benchmarks/cluster_jobs.py: TensorPipe's cma channel would go around the shaped links.
        env = {k: v for k, v in os.environ.items() if not k.endswith("_SOCKET_IFNAME")}
        env |= {"PERSIA_HOST": host, "PERSIA_RPC_CHANNELS": "basic"}
        with open(work / f"{host}.out", "w") as out, open(work / f"{host}.err", "w") as err:
            argv = [sys.executable, "-m", "torch.distributed.run", *rdzv, *role, *args, "--sizes", "tiny"]
            nodes[host] = cluster.popen(host, argv, env=env, stdout=out, stderr=err, cwd=work)
    deadline = time.monotonic() + timeout_s
    codes = {}
    for host, process in nodes.items():
        try:
            codes[host] = process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            cluster.kill_host(host)
            codes[host] = process.wait(timeout=30)
    return codes


@pytest.fixture
def namespaces_here() -> None:
    """Skip, saying why, where network namespaces cannot be made (checking makes one: a process)."""
    try:
        netns.check_available()
    except netns.Unavailable as err:
        pytest.skip(str(err))


@pytest.mark.processes
@pytest.mark.timeout(360)
def test_each_host_class_gets_a_profile_measured_on_its_hosts_and_links(namespaces_here, tmp_path):
    topology, out_dir = _topology(tmp_path / "topology.yaml"), tmp_path / "profiles"
    started = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    with netns.NetCluster(HOSTS, {"ps0": PS_MBIT}) as cluster:
        codes = _calibrate_on(cluster, tmp_path, topology, out_dir, timeout_s=300)
    failed = {h: (tmp_path / f"{h}.err").read_text()[-1500:] for h, code in codes.items() if code != 0}
    assert not failed, f"calibration failed on {', '.join(failed)}: {failed}"
    assert sorted(p.name for p in out_dir.iterdir()) == ["ps.yaml", "trainer.yaml"]
    profiles = {name: load_profile(out_dir / f"{name}.yaml") for name in ("trainer", "ps")}
    raw = {name: yaml.safe_load((out_dir / f"{name}.yaml").read_text()) for name in ("trainer", "ps")}
    for name, hosts in (("trainer", ["trainer0", "trainer1"]), ("ps", ["ps0"])):
        assert OutputKind.PROFILE.written_by_persia(out_dir / f"{name}.yaml")
        assert profiles[name].provenance.topology_host == name and profiles[name].provenance.device == "cpu"
        where, machine = raw[name]["where"], raw[name]["machine"]
        assert where["topology"] == "calib-3" and where["hosts"] == hosts
        assert started <= datetime.datetime.fromisoformat(machine["measured"]) <= datetime.datetime.now(datetime.UTC)
        assert machine["measured"] <= machine["measured_until"]
        assert raw[name]["step"] == {"skipped": STEP_SKIPPED} and profiles[name].step_overhead_ms is None
        # each host's own measurements are in its class's noise record, named by host
        points = [p["point"] for b in ("memory", "embedding") for p in raw[name]["noise"]["benchmarks"][b]["noisy"]]
        assert not points or {p.split(":")[0] for p in points} <= set(hosts)
    # the collectives ran between the two trainer hosts; the PS requests from trainer0 to ps0
    assert raw["trainer"]["collectives"]["processes"] == 2 and raw["trainer"]["where"]["collectives"] == list(HOSTS[:2])
    assert raw["ps"]["where"]["rpc"] == ["trainer0", "ps0"] and raw["ps"]["rpc"] == raw["trainer"]["rpc"]
    # each link's rate as reached: the server's at its shaped NIC (tc's token bucket), the trainers' far above it
    links = raw["trainer"]["where"]["links"]
    assert set(links) == {"trainer0-trainer1", "trainer0-ps0"} and set(raw["ps"]["where"]["links"]) == {"trainer0-ps0"}
    shaped = PS_MBIT * 1e6 / 8
    assert 0.3 * shaped < links["trainer0-ps0"]["bytes_per_s"] < 1.1 * shaped, links
    assert links["trainer0-trainer1"]["bytes_per_s"] > 1.5 * links["trainer0-ps0"]["bytes_per_s"], links
    assert 0 < links["trainer0-ps0"]["rpc_lookup_bytes_per_s"] < 1.1 * shaped
    assert STEP_SKIPPED in (tmp_path / "trainer0.err").read_text()
    assert "wrote" in (tmp_path / "trainer0.out").read_text()
    # a topology naming each class's profile on its hosts takes their figures; the trainers' on the server is refused
    figures = {"trainer_figures": "profile: profiles/trainer.yaml", "cpu_figures": ""}
    per_class = load_topology(_topology(tmp_path / "classes.yaml", **figures, ps_figures="profile: profiles/ps.yaml"))
    hosts = (*per_class.trainers, *per_class.servers)
    assert [h.profile.provenance.topology_host for h in hosts] == ["trainer", "trainer", "ps"]
    assert all(h.nic_bandwidth > 0 for h in hosts)
    with pytest.raises(SpecError) as refused:
        load_topology(_topology(tmp_path / "swapped.yaml", **figures, ps_figures="profile: profiles/trainer.yaml"))
    line = str(refused.value)
    assert "\n" not in line and "hosts[1].profile" in line and "for host 'trainer', not 'ps'" in line, line


@pytest.mark.processes
@pytest.mark.timeout(180)
def test_an_out_dir_the_first_trainer_refuses_stops_every_host_in_one_line(namespaces_here, tmp_path):
    out_dir = tmp_path / "profiles"
    out_dir.mkdir()
    (out_dir / "notes.txt").write_text("not a profile")
    with netns.NetCluster(HOSTS) as cluster:
        codes = _calibrate_on(cluster, tmp_path, _topology(tmp_path / "topology.yaml"), out_dir, timeout_s=120)
    assert codes == dict.fromkeys(HOSTS, 1), codes  # torchrun's failure, none killed at the deadline
    said = "holds 1 file that persia did not write as a profile (notes.txt)"
    for host in HOSTS:
        lines = (tmp_path / f"{host}.err").read_text().splitlines()
        errors = [x for x in lines if x.startswith("error:")]
        origin = "" if host == "trainer0" else "on host trainer0: "
        assert len(errors) == 1 and errors[0].startswith(f"error: {origin}--out-dir") and said in errors[0], errors
        assert any("exitcode  : 2" in x for x in lines)  # the worker's: bad input, as torchrun's summary says
    assert sorted(p.name for p in out_dir.iterdir()) == ["notes.txt"]  # nothing measured, nothing written


ONE_HOST = """name: one-host
hosts:
  - name: box
    ddr: 8GiB
    ddr_bandwidth: 10GB/s
    nic_bandwidth: 1GB/s
    cpus: {count: 2, memory: 1GiB, bandwidth: 10GB/s, tflops: 0.1}
"""


@pytest.mark.processes
@pytest.mark.timeout(240)
def test_one_trainer_host_without_servers_measures_its_collectives_and_a_server_on_itself(tmp_path):
    (tmp_path / "one.yaml").write_text(ONE_HOST)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m",
            "persia_planner.cli", "calibrate", "--topology", "one.yaml", "--out-dir", "out",
            "--sizes", "tiny"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    process = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)  # fmt: skip
    try:
        out, err = process.communicate(timeout=200)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # torchrun's worker too, were it still there
    assert process.returncode == 0, f"torchrun (the calibration's one process) failed: {err[-1500:]}"
    assert "wrote out/box.yaml: box0" in out
    raw = yaml.safe_load((tmp_path / "out" / "box.yaml").read_text())
    assert load_profile(tmp_path / "out" / "box.yaml").provenance.topology_host == "box"
    # two local processes for the collectives, a local server for the requests: no link between hosts to measure
    assert raw["collectives"]["processes"] == 2 and raw["where"]["collectives"] == ["box0"]
    assert raw["where"]["rpc"] == ["box0"] and [p["rows"] for p in raw["rpc"]["requests"]] == [1, 256]
    assert raw["where"]["links"] == {} and raw["where"]["hosts"] == ["box0"]


# ---- what is checked before anything is measured -------------------------------------------------------------------


def test_host_classes_are_the_topology_s_host_entries(tmp_path):
    classes = host_classes(_topology(tmp_path / "t.yaml"))
    assert classes == {"trainer0": "trainer", "trainer1": "trainer", "ps0": "ps"}


def _process(rank: int, world: int, local_rank: int = 0, local_world: int = 1) -> TorchrunProcess:
    return TorchrunProcess(rank, world, local_rank, local_world, rank)


def test_each_process_is_one_host_named_or_by_rank(tmp_path):
    path = _topology(tmp_path / "t.yaml")
    topology, classes = load_topology(path), host_classes(path)
    assert calibration_host(topology, classes, _process(2, 3)).host == "ps0"
    named = calibration_host(topology, classes, _process(0, 3), "trainer1")
    assert (named.host, named.host_class, named.rank) == ("trainer1", "trainer", 0)
    with pytest.raises(PlannerError, match=r"world has 4 processes but persia calibrate runs one per host .*: 3 "):
        calibration_host(topology, classes, _process(0, 4))
    with pytest.raises(PlannerError, match=r"runs 1 processes \(--nproc-per-node\) but names 2 hosts"):
        calibration_host(topology, classes, _process(0, 3), "trainer0,ps0")


def test_a_folder_of_other_files_is_refused_unless_overwrite_and_a_missing_one_is_made(tmp_path):
    made = tmp_path / "new"
    outputs = profile_outputs(made, ["trainer", "ps"], overwrite=False)
    assert made.is_dir() and [o.path.name for o in outputs] == ["trainer.yaml", "ps.yaml"]
    (made / "notes.txt").write_text("mine")
    with pytest.raises(PlannerError, match=r"holds 1 file that persia did not write as a profile \(notes.txt\)"):
        profile_outputs(made, ["trainer"], overwrite=False)
    assert len(profile_outputs(made, ["trainer"], overwrite=True)) == 1  # written beside them, never removed
    (made / "trainer.yaml").write_text("foreign: yes\n")
    with pytest.raises(PlannerError, match=r"trainer.yaml"):
        profile_outputs(made, ["trainer"], overwrite=True)  # a file of another kind is never replaced
    with pytest.raises(PlannerError, match=r"cannot be made"):
        profile_outputs(tmp_path / "no" / "such", ["trainer"], overwrite=False)
    with pytest.raises(PlannerError, match=r"host class 'a/b' cannot name a file"):
        profile_outputs(tmp_path / "x", ["a/b"], overwrite=False)
    run = tmp_path / "run"
    run.mkdir()
    (run / RUN_MARKER).write_text("")
    with pytest.raises(PlannerError, match=r"--out-dir .* is inside .*writing there would change a training run"):
        profile_outputs(run / "profiles", ["trainer"], overwrite=True)
    assert not (run / "profiles").exists()


def test_the_hosts_of_a_class_are_merged_by_their_median_leaf_by_leaf():
    hosts = [
        {"stream": 1.0, "points": [{"rows": 64, "rate": 10.0}], "path": "/a", "n": 3},
        {"stream": 3.0, "points": [{"rows": 64, "rate": 30.0}], "path": "/b", "n": 3},
        {"stream": 2.0, "points": [{"rows": 64, "rate": 40.0}], "path": "/c", "n": 3},
    ]
    assert median_of(hosts) == {"stream": 2.0, "points": [{"rows": 64, "rate": 30.0}], "path": "/a", "n": 3}
    assert median_of([{"x": 1}, {"x": 2}]) == {"x": 1.5}


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--topology", "T"], {}, "a cluster calibration needs --out-dir too"),
        (["--topology", "T", "--out-dir", "D"], {}, "runs under torchrun, one process per host"),
        (["--topology", "T", "--out-dir", "D", "--sizes", "huge"], {}, "--sizes 'huge' is not one of full, quick"),
        (["--topology", "T", "--out-dir", "D"], {"RANK": "0", "WORLD_SIZE": "2"}, "world has 2 processes"),
    ],
)
def test_a_cluster_calibration_that_cannot_run_says_why_in_one_line(tmp_path, args, env, message, monkeypatch):
    topology = _topology(tmp_path / "t.yaml")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "PERSIA_HOST"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    argv = ["calibrate", *[str(topology) if a == "T" else str(tmp_path / "d") if a == "D" else a for a in args]]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 2, result.output
    lines = [x for x in result.output.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.output
    assert not (tmp_path / "d").exists()  # nothing made before the checks passed
