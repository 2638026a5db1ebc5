"""catalog.yaml: the bundled catalogs, what a class holds, and bad input named by class and key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from persia_planner.errors import SpecError
from persia_planner.paths import EXAMPLES
from persia_planner.sizing import catalog_from_dict, load_catalog
from persia_planner.topology.graph import Topology
from persia_planner.topology.hardware import Role

BUNDLED = ("catalog_aws.yaml", "catalog_gcp.yaml", "catalog_cpu.yaml")
GPU_HOST = {
    "price_per_hour": 10.0,
    "source": "test",
    "ddr": "512GiB",
    "ddr_bandwidth": "200GB/s",
    "nic_bandwidth": "100Gbps",
    "gpus": {
        "count": 4,
        "hbm": "40GiB",
        "hbm_bandwidth": "1.5TB/s",
        "tflops": 300,
        "pcie_bandwidth": "32GB/s",
        "nvlink_bandwidth": "300GB/s",
    },
}
SERVER = {"price_per_hour": 2.5, "source": "test", "ddr": "1TiB", "ddr_bandwidth": "100GB/s", "nic_bandwidth": "50Gbps"}


def catalog(**sections):
    data = {"name": "test", "trainers": {"gpu4": GPU_HOST}, "servers": {"mem1t": SERVER}} | sections
    return catalog_from_dict(data, "test.yaml")


@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_catalogs_load_with_a_price_and_a_source_for_every_class(name):
    loaded = load_catalog(EXAMPLES / name)
    assert loaded.trainers and loaded.servers and loaded.links
    for cls in (*loaded.trainers, *loaded.servers):
        assert cls.price_per_hour > 0 and cls.source
        assert cls.ddr_bytes > 0 or cls.role is Role.TRAINER
    for cls in loaded.trainers:
        assert cls.devices > 0 and cls.hbm_bytes > 0


def test_aws_p5_holds_eight_80gib_gpus_at_its_list_price():
    aws = load_catalog(EXAMPLES / "catalog_aws.yaml")
    p5 = next(c for c in aws.trainers if c.name == "p5.48xlarge")
    assert p5.price_per_hour == 55.04
    assert p5.devices == 8
    # 8 x 80 GiB less the planner's reservation per GPU
    assert 8 * 70 * 2**30 < p5.hbm_bytes <= 8 * 80 * 2**30


def test_a_class_is_read_as_a_topology_host_and_its_capacities_match():
    loaded = catalog()
    gpu4, server = loaded.trainers[0], loaded.servers[0]
    topology = Topology.from_dict(loaded.topology_dict(gpu4, 3, server, 2, loaded.links[0]))
    assert len(topology.trainers) == 3 and len(topology.servers) == 2 and len(topology.gpus) == 12
    assert sum(topology.hbm_capacity(g) for g in topology.gpus) == 3 * gpu4.hbm_bytes
    assert sum(topology.ddr_capacity(s) for s in topology.servers) == 2 * server.ddr_bytes
    assert topology.servers[0].nic_bandwidth == 50e9 / 8


def test_without_links_the_default_network_is_free():
    (link,) = catalog().links
    assert link.price_per_hour == 0 and link.network == {}


def test_a_link_sets_the_network_and_a_price():
    loaded = catalog(links={"fast": {"price_per_hour": 0.5, "source": "s", "latency": "2us", "bandwidth": "10TB/s"}})
    topology = Topology.from_dict(loaded.topology_dict(loaded.trainers[0], 2, None, 0, loaded.links[0]))
    assert topology.latency_s == pytest.approx(2e-6)
    assert loaded.links[0].price_per_hour == 0.5


@pytest.mark.parametrize(
    ("sections", "where", "problem"),
    [
        ({"trainers": {"gpu4": GPU_HOST | {"ddr": "lots"}}}, "trainers.gpu4.ddr", ""),
        (
            {"trainers": {"gpu4": GPU_HOST | {"gpus": GPU_HOST["gpus"] | {"hmb": 1}}}},
            "trainers.gpu4.gpus.hmb",
            "unknown key",
        ),
        ({"trainers": {"gpu4": GPU_HOST | {"price_per_hour": -1}}}, "trainers.gpu4.price_per_hour", "outside"),
        ({"trainers": {"gpu4": GPU_HOST | {"price_per_hour": "cheap"}}}, "trainers.gpu4.price_per_hour", "number"),
        (
            {"trainers": {"gpu4": {k: v for k, v in GPU_HOST.items() if k != "source"}}},
            "trainers.gpu4.source",
            "missing",
        ),
        ({"trainers": {"gpu4": GPU_HOST | {"count": 2}}}, "trainers.gpu4.count", "a shape sets it"),
        ({"trainers": {"gpu4": {k: v for k, v in GPU_HOST.items() if k != "gpus"}}}, "trainers.gpu4", ""),
        ({"servers": {"mem1t": SERVER | {"gpus": GPU_HOST["gpus"]}}}, "servers.mem1t", ""),
        ({"trainers": {}}, "trainers", "no trainer host class"),
        ({"links": {"x": {"price_per_hour": 0, "source": "s", "latency": "fast"}}}, "links.x.latency", ""),
        ({"links": {"x": {"price_per_hour": 0, "source": "s", "jitter": 1}}}, "links.x.jitter", "unknown key"),
        ({"cluster": 1}, "cluster", "unknown key"),
    ],
)
def test_bad_catalogs_name_the_class_and_key(sections, where, problem):
    with pytest.raises(SpecError) as err:
        catalog(**sections)
    assert err.value.source == "test.yaml"
    assert err.value.path.startswith(where), err.value
    assert problem in str(err.value)


def test_a_profile_path_is_relative_to_the_catalog_and_written_relative_to_the_output(tmp_path: Path):
    folder = tmp_path / "catalogs"
    folder.mkdir()
    data = yaml.safe_load((EXAMPLES / "catalog_cpu.yaml").read_text())
    (folder / "profiles").mkdir()
    (folder / "profiles" / "cpu-2core.yaml").write_bytes((EXAMPLES / "profiles" / "cpu-2core.yaml").read_bytes())
    (folder / "c.yaml").write_text(yaml.safe_dump(data))
    loaded = load_catalog(folder / "c.yaml")
    out = tmp_path / "sized"
    out.mkdir()
    entry = loaded.trainers[0].host_entry(2, out)
    assert entry["profile"] == "../catalogs/profiles/cpu-2core.yaml"
    assert entry["count"] == 2
