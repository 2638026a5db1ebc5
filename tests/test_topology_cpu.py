"""CPU trainer devices and measured host profiles in topology.yaml."""

from __future__ import annotations

import pytest
import yaml
from test_profile import raw_profile

from persia_planner import SpecError, load_model, load_topology, plan
from persia_planner.paths import DEFAULT_MODEL
from persia_planner.tiers import Tier
from persia_planner.topology.cost_constants import CostConstants
from persia_planner.topology.graph import DeviceKind
from persia_planner.topology.profile import HardwareProfile


def write(tmp_path, hosts: list[dict], profile: bool = True) -> str:
    if profile:
        (tmp_path / "profiles").mkdir(exist_ok=True)
        (tmp_path / "profiles" / "cpu.yaml").write_text(yaml.safe_dump(raw_profile()))
    path = tmp_path / "topology.yaml"
    path.write_text(yaml.safe_dump({"name": "cpu", "hosts": hosts, "network": {"latency": "200us"}}))
    return str(path)


TRAINER = {"name": "trainer", "ddr": "8GiB", "profile": "profiles/cpu.yaml", "cpus": {"count": 2, "memory": "4MiB"}}
SERVER = {"name": "ps", "count": 2, "role": "parameter_server", "ddr": "2GiB", "profile": "profiles/cpu.yaml"}


def test_cpu_devices_take_their_rates_from_the_host_profile(tmp_path):
    topo = load_topology(write(tmp_path, [TRAINER, SERVER]))
    profile = HardwareProfile.from_dict(raw_profile())
    constants = CostConstants()
    device, host = topo.gpus[0], topo.trainers[0]
    assert [g.name for g in topo.gpus] == ["trainer0/cpu0", "trainer0/cpu1"]
    assert topo.device_kind is DeviceKind.CPU and device.kind is DeviceKind.CPU
    assert device.hbm_bytes == 4 * 1024**2
    figures = profile.device_figures(constants)
    assert device.hbm_bandwidth == pytest.approx(figures["bandwidth"])
    assert device.tflops == pytest.approx(figures["tflops"] * 1e12)
    assert device.nvlink_bandwidth == pytest.approx(figures["link_bandwidth"])
    # declared x efficiency = measured
    assert host.ddr_bandwidth * constants.ddr_efficiency == pytest.approx(profile.stream_bytes_per_s)
    server = topo.servers[0]
    # a server's RPC rate of a row's lookup and push, over the bytes of the busier direction (the row, its id twice)
    assert server.nic_bandwidth * constants.nic_efficiency == pytest.approx(
        profile.ps_lookup.units_per_s * (profile.ps_row_bytes + constants.id_bytes) / 2
    )
    # a CPU trainer's DDR is its devices' memory: no host-memory tier on top of it
    assert topo.ddr_capacity(host) == 0 and topo.ddr_capacity(server) > 0


def test_explicit_figures_win_over_the_profile(tmp_path):
    trainer = {**TRAINER, "nic_bandwidth": "1GB/s", "cpus": {**TRAINER["cpus"], "bandwidth": "3GB/s", "tflops": 0.2}}
    topo = load_topology(write(tmp_path, [trainer, SERVER]))
    assert topo.gpus[0].hbm_bandwidth == 3e9 and topo.gpus[0].tflops == pytest.approx(0.2e12)
    assert topo.trainers[0].nic_bandwidth == 1e9


def test_a_cpu_plan_keeps_local_tables_in_the_trainers_memory_and_the_big_ones_on_the_servers(tmp_path):
    topo = load_topology(write(tmp_path, [TRAINER, SERVER]))
    model = load_model(DEFAULT_MODEL)
    the_plan = plan(model, topo)
    tiers = {p.shards[0].tier for p in the_plan.tables.values()}
    assert tiers <= {Tier.HBM, Tier.PS}  # HBM is a CPU device's own memory here
    assert {"c1", "c10", "c20"} <= set(the_plan.remote_tables())  # 6.8-13.6 MB each: over a trainer's 4 MiB


@pytest.mark.parametrize(
    ("hosts", "words"),
    [
        ([{**TRAINER, "profile": "missing.yaml"}, SERVER], ["hosts[0].profile", "missing.yaml", "persia calibrate"]),
        ([{**TRAINER, "gpus": {"count": 1}}, SERVER], ["hosts[0].cpus", "not both"]),
        (
            [{**{k: v for k, v in TRAINER.items() if k != "profile"}, "ddr_bandwidth": 1e9, "nic_bandwidth": 1e9}],
            ["hosts[0].cpus.bandwidth", "profile"],
        ),
        (
            [
                TRAINER,
                {
                    "name": "gpu",
                    "ddr": "1TiB",
                    "ddr_bandwidth": "100GB/s",
                    "nic_bandwidth": "10GB/s",
                    "gpus": {"hbm": "80GiB", "hbm_bandwidth": "3TB/s", "tflops": 100, "pcie_bandwidth": "64GB/s"},
                },
            ],
            ["hosts", "mix", "every one 'cpus:'"],
        ),
        ([{**TRAINER, "role": "parameter_server"}], ["hosts[0].cpus", "no trainer devices"]),
    ],
)
def test_bad_cpu_topologies_are_one_line(tmp_path, hosts, words):
    with pytest.raises(SpecError) as err:
        load_topology(write(tmp_path, hosts))
    message = str(err.value)
    assert "\n" not in message and all(w in message for w in words), message


def test_a_slower_measured_network_moves_tables_off_the_parameter_servers(tmp_path):
    """The same machine measured twice, once with PS requests ten times slower: the planner keeps more local."""
    model = load_model(DEFAULT_MODEL)
    remote = {}
    for name, slowdown in (("fast", 1.0), ("slow", 10.0)):
        folder = tmp_path / name
        folder.mkdir()
        raw = raw_profile()
        for request in raw["rpc"]["requests"]:
            request["lookup_seconds"] *= slowdown
            request["push_seconds"] *= slowdown
        (folder / "profiles").mkdir()
        (folder / "profiles" / "cpu.yaml").write_text(yaml.safe_dump(raw))
        path = folder / "topology.yaml"
        hosts = [{**TRAINER, "cpus": {"count": 2, "memory": "64MiB"}}, SERVER]
        path.write_text(yaml.safe_dump({"name": name, "hosts": hosts, "network": {"latency": "200us"}}))
        remote[name] = set(plan(model, load_topology(path)).remote_tables())
    assert remote["slow"] < remote["fast"], remote
