"""Where tables can go: the cluster as a networkx graph of GPUs, hosts, parameter servers and a switch."""

from __future__ import annotations

import enum
import functools
import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import networkx as nx

from persia_planner._fields import Fields, load_yaml
from persia_planner.constants import CostConstants
from persia_planner.errors import SpecError
from persia_planner.units import Quantity, UnitError, parse

__all__ = ["Gpu", "Host", "NodeKind", "Role", "Topology", "load_topology"]

DEFAULT_LATENCY_S = 5e-6
SWITCH = "switch"


class NodeKind(enum.StrEnum):
    """Kinds of graph node."""

    GPU = "gpu"
    HOST = "host"
    SWITCH = "switch"


class Role(enum.StrEnum):
    """What a host does."""

    TRAINER = "trainer"
    PARAMETER_SERVER = "parameter_server"


@dataclass(frozen=True)
class Gpu:
    """One GPU. Bandwidths in bytes/s, capacities in bytes."""

    name: str
    host: str
    hbm_bytes: int
    hbm_bandwidth: float
    tflops: float
    pcie_bandwidth: float
    nvlink_bandwidth: float


@dataclass(frozen=True)
class Host:
    """A trainer host or a parameter server. Its DDR is one pool shared by its GPUs."""

    name: str
    role: Role
    ddr_bytes: int
    ddr_bandwidth: float
    nic_bandwidth: float
    gpus: tuple[str, ...] = ()


class Topology:
    """The cluster graph plus fast look-ups the cost model needs.

    Nodes carry ``kind`` (:class:`NodeKind`) and ``spec`` (:class:`Gpu` / :class:`Host`); edges carry ``bandwidth``
    (bytes/s) and ``latency`` (s). Path bandwidth is the bottleneck along the lowest-latency path.

    Attributes:
        name: Topology name, copied into plan.json.
        graph: The networkx graph.
        gpus: Trainer GPUs in a stable order (host order, then GPU index).
        trainers: Trainer hosts (those with GPUs).
        servers: Parameter-server hosts.
        switch_bandwidth: Shared switch capacity in bytes/s (``inf`` when unlimited).
        constants: Cost-model constants, with any overrides from the file applied.
    """

    def __init__(self, graph: nx.Graph, name: str = "topology", constants: CostConstants | None = None):
        self.name = name
        self.graph = graph
        self.constants = constants or CostConstants()
        specs = nx.get_node_attributes(graph, "spec")
        hosts = [s for s in specs.values() if isinstance(s, Host)]
        self.trainers: tuple[Host, ...] = tuple(h for h in hosts if h.role is Role.TRAINER and h.gpus)
        self.servers: tuple[Host, ...] = tuple(h for h in hosts if h.role is Role.PARAMETER_SERVER)
        self.gpus: tuple[Gpu, ...] = tuple(specs[g] for h in self.trainers for g in h.gpus)
        self.switch_bandwidth: float = graph.nodes[SWITCH].get("bandwidth", math.inf) if SWITCH in graph else math.inf
        self._hosts = {h.name: h for h in hosts}
        self._gpu_index = {g.name: i for i, g in enumerate(self.gpus)}
        if not self.gpus:
            raise ValueError("the topology has no trainer GPU")

    # ---- look-ups -------------------------------------------------------------------------------------------
    def host(self, name: str) -> Host:
        return self._hosts[name]

    def gpu_index(self, name: str) -> int:
        return self._gpu_index[name]

    def has_device(self, name: str) -> bool:
        return name in self._gpu_index or name in self._hosts

    @property
    def latency_s(self) -> float:
        """One-way host-to-host latency across the network (first trainer to the farthest other host)."""
        others = [h.name for h in (*self.trainers, *self.servers) if h.name != self.trainers[0].name]
        return max((self.path_latency(self.trainers[0].name, o) for o in others), default=0.0)

    @functools.cache  # noqa: B019 - topologies are few and long-lived; paths are asked for many times.
    def _path(self, a: str, b: str) -> tuple[str, ...]:
        return tuple(nx.shortest_path(self.graph, a, b, weight=_path_weight))

    def path_bandwidth(self, a: str, b: str) -> float:
        """Bottleneck bandwidth (bytes/s) along the path from node ``a`` to node ``b``."""
        path = self._path(a, b)
        if len(path) < 2:
            return math.inf
        return min(self.graph.edges[u, v]["bandwidth"] for u, v in itertools.pairwise(path))

    def path_latency(self, a: str, b: str) -> float:
        """One-way latency (s) along the path from ``a`` to ``b``."""
        path = self._path(a, b)
        return sum(self.graph.edges[u, v].get("latency", 0.0) for u, v in itertools.pairwise(path))

    # ---- capacities -----------------------------------------------------------------------------------------
    def hbm_capacity(self, gpu: Gpu) -> int:
        """HBM bytes the planner may use on ``gpu`` (capacity minus the reservation)."""
        return int(gpu.hbm_bytes * (1 - self.constants.hbm_reserve_fraction))

    def ddr_capacity(self, host: Host) -> int:
        """DDR bytes the planner may use on ``host`` (capacity minus the reservation)."""
        fraction = (
            self.constants.ps_reserve_fraction
            if host.role is Role.PARAMETER_SERVER
            else (self.constants.ddr_reserve_fraction)
        )
        return int(host.ddr_bytes * (1 - fraction))

    def summary(self) -> dict[str, Any]:
        """Counts and totals for people (used by ``persia topology``)."""
        return {
            "name": self.name,
            "trainer_hosts": len(self.trainers),
            "gpus": len(self.gpus),
            "parameter_servers": len(self.servers),
            "hbm_bytes": sum(g.hbm_bytes for g in self.gpus),
            "trainer_ddr_bytes": sum(h.ddr_bytes for h in self.trainers),
            "ps_ddr_bytes": sum(h.ddr_bytes for h in self.servers),
            "nodes": self.graph.number_of_nodes(),
            "links": self.graph.number_of_edges(),
            "switch_bandwidth": self.switch_bandwidth,
            "latency_s": self.latency_s if len(self.trainers) + len(self.servers) > 1 else 0.0,
        }

    # ---- construction ---------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Any, source: str = "topology.yaml") -> Topology:
        """Build from parsed topology.yaml content (``hosts:`` form or ``nodes:``/``links:`` form)."""
        top = Fields(data, source, "")
        name = top.take_str("name", default="topology")
        constants = _read_constants(top)
        if top.has("hosts") and (top.has("nodes") or top.has("links")):
            raise top.error("nodes", "give either 'hosts:' or 'nodes:'/'links:', not both")
        if top.has("nodes") and top.has("network"):
            # The nodes form carries these on the graph itself; taking both would leave two answers to one question.
            raise top.error(
                "network",
                "is not used with 'nodes:'/'links:'",
                fixes=("give the switch bandwidth as 'bandwidth:' on the switch node and 'latency:' on each link",),
            )
        net = top.sub("network", default=None)
        switch_bw, latency = math.inf, DEFAULT_LATENCY_S
        if net is not None:
            switch_bw = net.take_positive("bandwidth", Quantity.BANDWIDTH, default=math.inf)
            latency = net.take("latency", Quantity.DURATION, default=DEFAULT_LATENCY_S)
            net.finish()
        if top.has("nodes"):
            graph = _graph_from_nodes(top)
        else:
            graph = _graph_from_hosts(top, switch_bw, latency)
        top.finish()
        try:
            return cls(graph, name, constants)
        except ValueError as err:
            raise SpecError(source, "hosts", str(err), fixes=("add a host with 'gpus:'",)) from None

    @classmethod
    def simple(
        cls,
        *,
        trainers: int,
        gpus_per_trainer: int,
        servers: int = 0,
        hbm_bytes: int = 80 * 1024**3,
        ddr_bytes: int = 2 * 1024**4,
        ps_ddr_bytes: int = 1024**4,
        name: str = "generated",
    ) -> Topology:
        """A homogeneous H100-class cluster, for tests and benchmarks."""
        data = {
            "name": name,
            "hosts": [
                {
                    "name": "trainer",
                    "count": trainers,
                    "ddr": ddr_bytes,
                    "ddr_bandwidth": "200GB/s",
                    "nic_bandwidth": "50GB/s",
                    "gpus": {
                        "count": gpus_per_trainer,
                        "hbm": hbm_bytes,
                        "hbm_bandwidth": "3.35TB/s",
                        "tflops": 400,
                        "pcie_bandwidth": "64GB/s",
                        "nvlink_bandwidth": "450GB/s",
                    },
                }
            ],
        }
        if servers:
            data["hosts"].append(
                {
                    "name": "ps",
                    "count": servers,
                    "role": "parameter_server",
                    "ddr": ps_ddr_bytes,
                    "ddr_bandwidth": "100GB/s",
                    "nic_bandwidth": "25GB/s",
                }
            )
        return cls.from_dict(data, f"{name}.yaml")


MAX_HOST_COUNT = 100_000  # hosts of one `hosts:` entry
MAX_GPUS_PER_HOST = 1024


def _path_weight(u: str, v: str, edge: Mapping[str, Any]) -> float:
    # Lowest latency first; the tiny per-hop term breaks ties towards fewer hops.
    return edge.get("latency", 0.0) + 1e-12


def _read_constants(top: Fields) -> CostConstants:
    section = top.sub("constants", default=None)
    if section is None:
        return CostConstants()
    overrides: dict[str, Any] = {}
    for key in CostConstants.names():
        if key == "cache_fractions" and section.has(key):
            overrides[key] = _read_cache_fractions(section)
        elif section.has(key):
            overrides[key] = section.take(key, Quantity.NUMBER)
        else:
            section.take(key, default=None)  # marks it known, so finish() can suggest it for a typo
    section.finish()
    constants = CostConstants().replace(overrides)
    problem = constants.validate()
    if problem:
        raise top.error("constants", problem)
    return constants


def _read_cache_fractions(section: Fields) -> list[float]:
    value = section.take("cache_fractions")
    if not isinstance(value, list):
        raise section.error(
            "cache_fractions", f"expected a list of numbers in (0, 1), got {value!r}", fixes=("write e.g. [0.05, 0.2]",)
        )
    fractions = []
    for i, item in enumerate(value):
        try:
            fractions.append(parse(item, Quantity.NUMBER))
        except UnitError as err:
            raise SpecError(section.source, f"{section.key_path('cache_fractions')}[{i}]", str(err)) from None
    return fractions


def _graph_from_hosts(top: Fields, switch_bw: float, latency: float) -> nx.Graph:
    graph = nx.Graph()
    graph.add_node(SWITCH, kind=NodeKind.SWITCH, bandwidth=switch_bw)
    for _, item in top.take_list("hosts"):
        base = item.take_str("name")
        count = item.take_positive("count", Quantity.COUNT, default=1)
        if count > MAX_HOST_COUNT:  # every host is a graph node: a wrong count would hang rather than fail
            raise item.error(
                "count", f"at most {MAX_HOST_COUNT:,} hosts per entry, got {count:,}", fixes=("check the count",)
            )
        ddr = item.take_positive("ddr", Quantity.SIZE)
        ddr_bw = item.take_positive("ddr_bandwidth", Quantity.BANDWIDTH)
        nic_bw = item.take_positive("nic_bandwidth", Quantity.BANDWIDTH)
        gpus = item.sub("gpus", default=None)
        role = item.take_enum("role", Role, default=Role.TRAINER if gpus is not None else Role.PARAMETER_SERVER)
        gpu_fields = _read_gpu_fields(gpus) if gpus is not None else None
        item.finish()
        if role is Role.PARAMETER_SERVER and gpu_fields is not None:
            raise item.error("gpus", "a parameter_server host has no GPUs", fixes=("remove 'gpus:' or set role",))
        if role is Role.TRAINER and gpu_fields is None:
            raise item.error("gpus", "a trainer host needs 'gpus:'", fixes=("add 'gpus:' or set role",))
        for index in range(count):
            host_name = f"{base}{index}"
            if host_name in graph:
                raise item.error("name", f"host {host_name!r} is defined twice", fixes=("rename one of them",))
            gpu_names: tuple[str, ...] = ()
            if gpu_fields is not None:
                n_gpus, hbm, hbm_bw, tflops, pcie_bw, nvlink_bw = gpu_fields
                gpu_names = tuple(f"{host_name}/gpu{i}" for i in range(n_gpus))
                for gpu_name in gpu_names:
                    if gpu_name in graph:  # a host named like a GPU ("trainer0/gpu0") would be replaced silently
                        raise item.error(
                            "name",
                            f"GPU {gpu_name!r} has the name of a host defined earlier",
                            fixes=("rename the host",),
                        )
                    spec = Gpu(gpu_name, host_name, hbm, hbm_bw, tflops, pcie_bw, nvlink_bw)
                    graph.add_node(gpu_name, kind=NodeKind.GPU, spec=spec)
                    graph.add_edge(gpu_name, host_name, bandwidth=pcie_bw, latency=0.0, link="pcie")
                for i, a in enumerate(gpu_names):
                    for b in gpu_names[i + 1 :]:
                        graph.add_edge(a, b, bandwidth=nvlink_bw, latency=0.0, link="nvlink")
            host = Host(host_name, role, ddr, ddr_bw, nic_bw, gpu_names)
            graph.add_node(host_name, kind=NodeKind.HOST, spec=host)
            # Half the one-way host-to-host latency on each side, so host -> switch -> host adds up to it.
            graph.add_edge(host_name, SWITCH, bandwidth=nic_bw, latency=latency / 2, link="nic")
    return graph


def _read_gpu_fields(gpus: Fields) -> tuple[int, int, float, float, float, float]:
    n_gpus = gpus.take_positive("count", Quantity.COUNT, default=1)
    if n_gpus > MAX_GPUS_PER_HOST:  # a host's GPUs are all linked pairwise (NVLink edges): n^2 of them
        raise gpus.error(
            "count", f"at most {MAX_GPUS_PER_HOST} GPUs per host, got {n_gpus:,}", fixes=("check the count",)
        )
    hbm = gpus.take_positive("hbm", Quantity.SIZE)
    hbm_bw = gpus.take_positive("hbm_bandwidth", Quantity.BANDWIDTH)
    tflops = gpus.take_positive("tflops", Quantity.NUMBER)
    pcie_bw = gpus.take_positive("pcie_bandwidth", Quantity.BANDWIDTH)
    nvlink_bw = gpus.take_positive("nvlink_bandwidth", Quantity.BANDWIDTH, default=pcie_bw)
    gpus.finish()
    return n_gpus, hbm, hbm_bw, tflops * 1e12, pcie_bw, nvlink_bw


def _graph_from_nodes(top: Fields) -> nx.Graph:
    """The advanced form: explicit nodes and links; GPU/host specs are derived from the links."""
    graph = nx.Graph()
    raw: dict[str, dict[str, Any]] = {}
    for _, item in top.take_list("nodes"):
        name = item.take_str("name")
        kind = item.take_enum("kind", NodeKind)
        if name in raw:
            raise item.error("name", f"node {name!r} is defined twice")
        if name == SWITCH and kind is not NodeKind.SWITCH:
            # The switch node is stored under this name; a host or GPU called so would be merged into it.
            raise item.error(
                "name",
                f"{name!r} is reserved for the switch node",
                fixes=(f"rename the {kind.value}, e.g. '{name}_{kind.value}'",),
            )
        if kind is NodeKind.SWITCH:
            other = next((n for n, a in raw.items() if a["kind"] is NodeKind.SWITCH), None)
            if other is not None:
                raise item.error(
                    "kind",
                    f"a second switch {name!r}: the nodes form supports one switch, and {other!r} is already one",
                    fixes=(
                        "use a single switch node (its 'bandwidth' is the whole network's capacity) "
                        "and link every host to it, or link hosts directly to each other",
                    ),
                )
        if kind is NodeKind.GPU:
            raw[name] = {
                "kind": kind,
                "hbm": item.take_positive("hbm", Quantity.SIZE),
                "hbm_bandwidth": item.take_positive("hbm_bandwidth", Quantity.BANDWIDTH),
                "tflops": item.take_positive("tflops", Quantity.NUMBER) * 1e12,
            }
        elif kind is NodeKind.HOST:
            raw[name] = {
                "kind": kind,
                "role": item.take_enum("role", Role, default=Role.TRAINER),
                "ddr": item.take_positive("ddr", Quantity.SIZE),
                "ddr_bandwidth": item.take_positive("ddr_bandwidth", Quantity.BANDWIDTH),
            }
        else:
            raw[name] = {"kind": kind, "bandwidth": item.take_positive("bandwidth", Quantity.BANDWIDTH, math.inf)}
        item.finish()
        graph.add_node(name, kind=kind)
    seen_links: dict[frozenset[str], str] = {}
    for _, item in top.take_list("links"):
        ends = []
        for key in ("a", "b"):
            end = item.take_str(key)
            if end not in raw:
                raise item.error(key, f"unknown node {end!r}", fixes=("declare it under 'nodes:'",))
            ends.append(end)
        bandwidth = item.take_positive("bandwidth", Quantity.BANDWIDTH)
        latency = item.take("latency", Quantity.DURATION, default=0.0)
        item.finish()
        if ends[0] == ends[1]:
            raise SpecError(
                item.source,
                item.path,
                f"links node {ends[0]!r} to itself",
                fixes=("remove it, or set 'b:' to another node",),
            )
        pair = frozenset(ends)
        if pair in seen_links:
            # networkx keeps one edge per pair: a second link would silently replace the first.
            raise SpecError(
                item.source,
                item.path,
                f"duplicates {seen_links[pair]}: both link {ends[0]!r} and {ends[1]!r}",
                fixes=("keep one link per pair of nodes and give it the combined bandwidth",),
            )
        seen_links[pair] = item.path
        graph.add_edge(ends[0], ends[1], bandwidth=bandwidth, latency=latency)
    for name, attrs in raw.items():
        if attrs["kind"] is NodeKind.SWITCH:
            graph.nodes[name]["bandwidth"] = attrs["bandwidth"]
            if name != SWITCH:
                nx.relabel_nodes(graph, {name: SWITCH}, copy=False)
    for name, attrs in raw.items():
        if attrs["kind"] is not NodeKind.HOST:
            continue
        gpus = tuple(n for n in graph.neighbors(name) if raw.get(n, {}).get("kind") is NodeKind.GPU)
        nic = sum(graph.edges[name, n]["bandwidth"] for n in graph.neighbors(name) if n not in gpus) or math.inf
        graph.nodes[name]["spec"] = Host(name, attrs["role"], attrs["ddr"], attrs["ddr_bandwidth"], nic, gpus)
        for gpu in gpus:
            if "spec" in graph.nodes[gpu]:
                # A GPU's HBM, PCIe link and share of host DDR belong to one host; two would count it twice.
                raise top.error(
                    "links",
                    f"GPU {gpu!r} is linked to two hosts, {graph.nodes[gpu]['spec'].host!r} and {name!r}",
                    fixes=("link each GPU to exactly one host",),
                )
            peers = [n for n in graph.neighbors(gpu) if n in gpus]
            nvlink = max((graph.edges[gpu, p]["bandwidth"] for p in peers), default=graph.edges[gpu, name]["bandwidth"])
            g = raw[gpu]
            graph.nodes[gpu]["spec"] = Gpu(
                gpu, name, g["hbm"], g["hbm_bandwidth"], g["tflops"], graph.edges[gpu, name]["bandwidth"], nvlink
            )
    orphan = next((n for n, a in raw.items() if a["kind"] is NodeKind.GPU and "spec" not in graph.nodes[n]), None)
    if orphan:
        raise top.error("links", f"GPU {orphan!r} is not linked to a host", fixes=("add a link from it to its host",))
    _check_connected(top, graph)
    return graph


def _check_connected(top: Fields, graph: nx.Graph) -> None:
    """Every trainer and parameter server must reach the trainers: the cost model routes traffic between them."""
    hosts = [spec for spec in nx.get_node_attributes(graph, "spec").values() if isinstance(spec, Host)]
    trainers = [h.name for h in hosts if h.role is Role.TRAINER and h.gpus]
    if not trainers:
        return  # Topology() reports the missing trainer GPU
    reachable = nx.node_connected_component(graph, trainers[0])
    for host in hosts:
        if (host.role is Role.PARAMETER_SERVER or host.gpus) and host.name not in reachable:
            raise top.error(
                "links",
                f"node {host.name!r} has no path to trainer {trainers[0]!r}",
                fixes=(f"add a link from {host.name!r} to the switch or to a trainer",),
            )


def load_topology(path: str | Path) -> Topology:
    """Load and validate a topology.yaml.

    Raises:
        SpecError: Malformed YAML, unknown key, bad unit or value; the message names the file and key path.
    """
    data, source = load_yaml(path)
    if data is None:
        raise SpecError(source, "", "file is empty", fixes=("see formats.md for the topology.yaml keys",))
    return Topology.from_dict(data, Path(source).name)
