import math
import re

import networkx as nx
import pytest

from persia_planner import SpecError, Topology, load_topology
from persia_planner.topology.graph import NodeKind, Role

TOPO = {
    "name": "t",
    "hosts": [
        {
            "name": "trainer",
            "count": 2,
            "ddr": "2TiB",
            "ddr_bandwidth": "200GB/s",
            "nic_bandwidth": "50GB/s",
            "gpus": {
                "count": 4,
                "hbm": "80GiB",
                "hbm_bandwidth": "3.35TB/s",
                "tflops": 400,
                "pcie_bandwidth": "64GB/s",
                "nvlink_bandwidth": "450GB/s",
            },
        },
        {
            "name": "ps",
            "count": 3,
            "role": "parameter_server",
            "ddr": "1TiB",
            "ddr_bandwidth": "100GB/s",
            "nic_bandwidth": "12.5GB/s",
        },
    ],
    "network": {"bandwidth": "12.8TB/s", "latency": "10us"},
}


def test_graph_nodes_and_links():
    topo = Topology.from_dict(TOPO)
    g = topo.graph
    assert isinstance(g, nx.Graph)
    assert [x.name for x in topo.gpus] == [f"trainer{h}/gpu{i}" for h in range(2) for i in range(4)]
    assert [s.name for s in topo.servers] == ["ps0", "ps1", "ps2"]
    assert all(s.role is Role.PARAMETER_SERVER for s in topo.servers)
    kinds = nx.get_node_attributes(g, "kind")
    assert sum(k is NodeKind.GPU for k in kinds.values()) == 8
    assert sum(k is NodeKind.HOST for k in kinds.values()) == 5
    # 8 pcie + 2 x 6 nvlink + 5 nic
    assert g.number_of_edges() == 8 + 12 + 5
    assert topo.switch_bandwidth == pytest.approx(12.8e12)


def test_path_bandwidth_is_the_bottleneck_and_latency_adds_up():
    topo = Topology.from_dict(TOPO)
    assert topo.path_bandwidth("trainer0/gpu0", "trainer0/gpu1") == pytest.approx(450e9)
    assert topo.path_bandwidth("trainer0/gpu0", "trainer0") == pytest.approx(64e9)
    # GPU -> pcie -> host -> nic -> switch -> nic(12.5) -> ps
    assert topo.path_bandwidth("trainer0/gpu0", "ps1") == pytest.approx(12.5e9)
    assert topo.path_bandwidth("trainer0/gpu0", "trainer1/gpu3") == pytest.approx(50e9)
    assert topo.path_latency("trainer0", "ps2") == pytest.approx(10e-6)
    assert topo.path_latency("trainer0/gpu2", "trainer0/gpu3") == 0.0


def test_capacities_subtract_the_reservation():
    topo = Topology.from_dict({**TOPO, "constants": {"hbm_reserve_fraction": 0.25, "ps_reserve_fraction": 0.5}})
    assert topo.hbm_capacity(topo.gpus[0]) == int(80 * 1024**3 * 0.75)
    assert topo.ddr_capacity(topo.servers[0]) == int(1024**4 * 0.5)
    assert topo.ddr_capacity(topo.trainers[0]) == int(2 * 1024**4 * 0.9)


def test_unlimited_switch_by_default():
    data = {k: v for k, v in TOPO.items() if k != "network"}
    assert Topology.from_dict(data).switch_bandwidth == math.inf


def test_nodes_and_links_form_builds_the_same_kind_of_graph():
    data = {
        "name": "custom",
        "nodes": [
            {"name": "h0", "kind": "host", "ddr": "512GiB", "ddr_bandwidth": "100GB/s"},
            {"name": "g0", "kind": "gpu", "hbm": "40GiB", "hbm_bandwidth": "1.5TB/s", "tflops": 150},
            {"name": "g1", "kind": "gpu", "hbm": "40GiB", "hbm_bandwidth": "1.5TB/s", "tflops": 150},
            {"name": "p0", "kind": "host", "role": "parameter_server", "ddr": "1TiB", "ddr_bandwidth": "100GB/s"},
            {"name": "sw", "kind": "switch", "bandwidth": "1TB/s"},
        ],
        "links": [
            {"a": "g0", "b": "h0", "bandwidth": "32GB/s"},
            {"a": "g1", "b": "h0", "bandwidth": "32GB/s"},
            {"a": "g0", "b": "g1", "bandwidth": "300GB/s"},
            {"a": "h0", "b": "sw", "bandwidth": "25GB/s", "latency": "3us"},
            {"a": "p0", "b": "sw", "bandwidth": "10GB/s", "latency": "3us"},
        ],
    }
    topo = Topology.from_dict(data)
    assert [g.name for g in topo.gpus] == ["g0", "g1"]
    assert topo.gpus[0].nvlink_bandwidth == pytest.approx(300e9)
    assert topo.gpus[0].pcie_bandwidth == pytest.approx(32e9)
    assert topo.trainers[0].nic_bandwidth == pytest.approx(25e9)
    assert topo.switch_bandwidth == pytest.approx(1e12)
    assert topo.path_bandwidth("g0", "p0") == pytest.approx(10e9)
    assert topo.path_latency("h0", "p0") == pytest.approx(6e-6)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {**TOPO, "hosts": [{**TOPO["hosts"][0], "ddr": "2TX"}]},
            "topology.yaml: hosts[0].ddr: unknown unit 'TX' in '2TX'",
        ),
        (
            {**TOPO, "hosts": [{**TOPO["hosts"][0], "gpus": {**TOPO["hosts"][0]["gpus"], "hbm": 0}}]},
            "topology.yaml: hosts[0].gpus.hbm: must be > 0, got 0",
        ),
        (
            {**TOPO, "hosts": [{**TOPO["hosts"][0], "count": 10**7}]},
            "topology.yaml: hosts[0].count: must be <= 100,000, got 10000000; fix: use at most 100,000",
        ),
        (
            {**TOPO, "hosts": [{**TOPO["hosts"][0], "gpus": {**TOPO["hosts"][0]["gpus"], "count": 5000}}]},
            "topology.yaml: hosts[0].gpus.count: must be <= 1,024, got 5000; fix: use at most 1,024",
        ),
        (
            {**TOPO, "hosts": [{**TOPO["hosts"][0], "role": "worker"}]},
            "topology.yaml: hosts[0].role: unknown value 'worker'; fix: use one of trainer | parameter_server",
        ),
        ({**TOPO, "hosts": [TOPO["hosts"][1]]}, "topology.yaml: hosts: the topology has no trainer GPU"),
        ({**TOPO, "network": {"latncy": "5us"}}, "topology.yaml: network.latncy: unknown key; fix: did you mean"),
        (
            {**TOPO, "constants": {"hbm_efficency": 0.5}},
            "topology.yaml: constants.hbm_efficency: unknown key; fix: did you mean 'hbm_efficiency'?",
        ),
        (
            {**TOPO, "constants": {"hbm_reserve_fraction": 1.5}},
            "topology.yaml: constants: hbm_reserve_fraction must be in [0, 1), got 1.5",
        ),
        (
            {**TOPO, "constants": {"hbm_efficiency": 1.5}},
            "topology.yaml: constants: hbm_efficiency is a fraction of peak bandwidth or FLOPS and must be in (0, 1], "
            "got 1.5",
        ),
        (
            {**TOPO, "constants": {"id_bytes": 1.5}},
            "topology.yaml: constants: id_bytes must be a whole number of bytes > 0, got 1.5",
        ),
        (
            {**TOPO, "hosts": [TOPO["hosts"][0], TOPO["hosts"][0]]},
            "topology.yaml: hosts[1].name: host 'trainer0' is defined twice",
        ),
        (  # a parameter server named like a GPU defined after it: the GPU would replace it in the graph
            {**TOPO, "hosts": [{**TOPO["hosts"][1], "name": "trainer0/gpu", "count": 1}, TOPO["hosts"][0]]},
            "topology.yaml: hosts[1].name: device 'trainer0/gpu0' has the name of a host defined earlier",
        ),
        (
            {**TOPO, "hosts": [{**TOPO["hosts"][0], "ddr": "2Tb"}]},
            "topology.yaml: hosts[0].ddr: '2Tb' is in bits (lower-case 'b'); a size is bytes: write 'TB'",
        ),
        (
            {**TOPO, "constants": {"cache_fractions": 0.2}},
            "topology.yaml: constants.cache_fractions: expected a list of numbers in (0, 1), got 0.2",
        ),
        (
            {**TOPO, "constants": {"cache_fractions": [0.1, "a"]}},
            "topology.yaml: constants.cache_fractions[1]: 'a' is not a number like 1.05",
        ),
        (
            {**TOPO, "constants": {"cache_fractions": [0.1, 1.0]}},
            "topology.yaml: constants: cache_fractions must be numbers in (0, 1), got [0.1, 1.0]",
        ),
    ],
)
def test_errors(data, message):
    with pytest.raises(SpecError) as err:
        Topology.from_dict(data)
    assert str(err.value).startswith(message)


def test_constants_validate_refuses_non_finite_byte_counts():
    from persia_planner.topology.cost_constants import CostConstants

    for bad in (float("inf"), float("nan")):
        assert CostConstants(id_bytes=bad).validate() == f"id_bytes must be a whole number of bytes > 0, got {bad}"


def test_constants_take_whole_byte_counts_and_any_efficiency_up_to_one():
    constants = {"id_bytes": 4.0, "hbm_efficiency": 1, "dense_kernel_efficiency": 2}
    topo = Topology.from_dict({**TOPO, "constants": constants})
    assert topo.constants.id_bytes == 4 and isinstance(topo.constants.id_bytes, int)
    assert topo.constants.hbm_efficiency == 1 and topo.constants.dense_kernel_efficiency == 2


def test_bundled_examples_load():
    from persia_planner.paths import EXAMPLES as examples

    topo = load_topology(examples / "persia_100t_cluster.yaml")
    assert len(topo.gpus) == 64 and len(topo.servers) == 30
    assert topo.servers[0].ddr_bytes == 12 * 10**12


NODES = {
    "nodes": [
        {"name": "h", "kind": "host", "ddr": "1TiB", "ddr_bandwidth": "10GB/s"},
        {"name": "g", "kind": "gpu", "hbm": "16GiB", "hbm_bandwidth": "1TB/s", "tflops": 1},
        {"name": "p", "kind": "host", "role": "parameter_server", "ddr": "1TiB", "ddr_bandwidth": "10GB/s"},
        {"name": "sw", "kind": "switch"},
    ],
    "links": [
        {"a": "g", "b": "h", "bandwidth": "10GB/s"},
        {"a": "h", "b": "sw", "bandwidth": "10GB/s"},
        {"a": "p", "b": "sw", "bandwidth": "10GB/s"},
    ],
}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {**NODES, "links": NODES["links"][:2]},
            "topology.yaml: links: node 'p' has no path to trainer 'h'; "
            "fix: add a link from 'p' to the switch or to a trainer",
        ),
        (
            {
                "nodes": [*NODES["nodes"], {"name": "h2", "kind": "host", "ddr": "1TiB", "ddr_bandwidth": "10GB/s"}],
                "links": [*NODES["links"], {"a": "g", "b": "h2", "bandwidth": "10GB/s"}],
            },
            "topology.yaml: links: GPU 'g' is linked to two hosts, 'h' and 'h2'; "
            "fix: link each GPU to exactly one host",
        ),
        (
            {**NODES, "network": {"bandwidth": "1GB/s", "latency": "1ms"}},
            "topology.yaml: network: is not used with 'nodes:'/'links:'; fix: give the switch bandwidth as "
            "'bandwidth:' on the switch node and 'latency:' on each link",
        ),
        (
            {**NODES, "nodes": [*NODES["nodes"], {"name": "sw2", "kind": "switch"}]},
            "topology.yaml: nodes[4].kind: a second switch 'sw2': the nodes form supports one switch, and 'sw' is "
            "already one; fix: use a single switch node (its 'bandwidth' is the whole network's capacity) and link "
            "every host to it, or link hosts directly to each other",
        ),
        (
            {
                "nodes": [*NODES["nodes"], {"name": "switch", "kind": "host", "ddr": "1TiB", "ddr_bandwidth": "1GB/s"}],
                "links": [*NODES["links"], {"a": "switch", "b": "sw", "bandwidth": "10GB/s"}],
            },
            "topology.yaml: nodes[4].name: 'switch' is reserved for the switch node; fix: rename the host, "
            "e.g. 'switch_host'",
        ),
        (
            {**NODES, "links": [*NODES["links"], {"a": "h", "b": "h", "bandwidth": "10GB/s"}]},
            "topology.yaml: links[3]: links node 'h' to itself; fix: remove it, or set 'b:' to another node",
        ),
        (
            {**NODES, "links": [*NODES["links"], {"a": "sw", "b": "h", "bandwidth": "10GB/s"}]},
            "topology.yaml: links[3]: duplicates links[1]: both link 'sw' and 'h'; "
            "fix: keep one link per pair of nodes and give it the combined bandwidth",
        ),
    ],
)
def test_nodes_form_errors(data, message):
    assert Topology.from_dict(NODES).servers[0].name == "p"
    with pytest.raises(SpecError) as err:
        Topology.from_dict(data)
    assert str(err.value) == message


def _with_ssd(ssd, host: int = 1) -> dict:
    data = {**TOPO, "hosts": [dict(h) for h in TOPO["hosts"]]}
    data["hosts"][host]["ssd"] = ssd
    return data


def test_a_servers_disk_takes_its_size_and_rates_or_the_profiles_or_nvmes(tmp_path):
    import yaml
    from test_profile import raw_profile

    from persia_planner.topology.hardware import DEFAULT_SSD_READ_IOPS, DEFAULT_SSD_WRITE_IOPS, Disk

    assert Topology.from_dict(_with_ssd("2TiB")).servers[0].ssd == Disk(2 * 2**40)
    assert Disk(1).read_iops == DEFAULT_SSD_READ_IOPS and Disk(1).write_iops == DEFAULT_SSD_WRITE_IOPS
    given = Topology.from_dict(_with_ssd({"size": "1TB", "read_iops": 1000, "write_iops": 500}))
    assert given.servers[2].ssd == Disk(10**12, 1000, 500)
    assert Topology.from_dict(TOPO).servers[0].ssd is None
    disk = {"read_iops": 30_000, "write_iops": 20_000, "read_bytes_per_s": 1e9, "write_bytes_per_s": 5e8, "path": "/x"}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump({**raw_profile(), "disk": disk}))
    profiled = _with_ssd("1TiB")
    profiled["hosts"][1]["profile"] = "p.yaml"
    assert Topology.from_dict(profiled, base_dir=tmp_path).servers[0].ssd == Disk(2**40, 30_000, 20_000)
    # a miss: its block read, and 1/64 of a block appended (64 rows a block), compacted once per as many appends
    assert Disk(1, 1000, 500).ms_per_miss(64, 2) == pytest.approx(1e3 * (1 / 1000 + 1 / 64 / 500 + 1 / 64 * 0.003))


@pytest.mark.parametrize(
    ("ssd", "host", "message"),
    [
        ("1TiB", 0, "hosts[0].ssd: the ssd tier is a parameter server's disk; a trainer host has none"),
        ({"size": "1TiB", "iops": 5}, 1, "hosts[1].ssd.iops: unknown key; fix: did you mean 'read_iops'?"),
        ({"read_iops": 5}, 1, "hosts[1].ssd.size: required key is missing"),
        ("-1GiB", 1, "hosts[1].ssd"),
        (
            {"size": "1TiB", "read_iops": 1e-300},
            1,
            "hosts[1].ssd.read_iops: must be in [1, 1e+09], got 1e-300; fix: give the 4 KiB blocks the disk reads a "
            "second at random (persia calibrate measures them)",
        ),
        (
            {"size": "1TiB", "write_iops": 1e300},
            1,
            "hosts[1].ssd.write_iops: must be in [1, 1e+09], got 1e+300; fix: give the 4 KiB blocks the disk writes "
            "a second at random (persia calibrate measures them)",
        ),
        ("2", 1, "hosts[1].ssd: must be in [1.0 MiB, 1024.0 PiB], got '2'; fix: give the disk's size, e.g. ssd: 2TiB"),
        (
            {"size": "2048PiB"},
            1,
            "hosts[1].ssd.size: must be in [1.0 MiB, 1024.0 PiB], got '2048PiB'; fix: give the disk's size, e.g. "
            "ssd: 2TiB",
        ),
    ],
)
def test_a_bad_disk_is_one_line_naming_the_key(ssd, host, message):
    with pytest.raises(SpecError, match=re.escape(message)):
        Topology.from_dict(_with_ssd(ssd, host))


@pytest.mark.parametrize(
    ("figure", "value", "message"),
    [
        ("read_iops", 1e-300, "disk.read_iops: must be in [1, 1e+09], got 1e-300"),
        ("write_iops", 0.5, "disk.write_iops: must be in [1, 1e+09], got 0.5"),
        ("read_bytes_per_s", 1e-300, "disk.read_bytes_per_s: must be in [4096, 1e+15], got 1e-300"),
        ("write_bytes_per_s", 1e300, "disk.write_bytes_per_s: must be in [4096, 1e+15], got 1e+300"),
    ],
)
def test_a_profiles_disk_figures_are_bounded_both_ways(tmp_path, figure, value, message):
    import yaml
    from test_profile import raw_profile

    disk = {"read_iops": 30_000, "write_iops": 20_000, "read_bytes_per_s": 1e9, "write_bytes_per_s": 5e8, figure: value}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump({**raw_profile(), "disk": disk}))
    profiled = _with_ssd("1TiB")
    profiled["hosts"][1]["profile"] = "p.yaml"
    with pytest.raises(SpecError) as err:
        Topology.from_dict(profiled, base_dir=tmp_path)
    assert str(err.value) == f"p.yaml: {message}; fix: run persia calibrate again"
