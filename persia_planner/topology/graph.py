"""Where tables can go: the cluster as a networkx graph of GPUs, hosts, parameter servers and a switch."""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import networkx as nx

from persia_planner.errors import PlannerError, SpecError
from persia_planner.fields import Fields, load_document
from persia_planner.limits import MAX_BANDWIDTH, MAX_LATENCY_S
from persia_planner.tiers import Holder, Memory
from persia_planner.topology.cost_constants import CostConstants
from persia_planner.topology.hardware import DeviceKind, Gpu, Host, NodeKind, Role
from persia_planner.topology.reader import SWITCH, graph_from_hosts, graph_from_nodes, read_constants
from persia_planner.units import Quantity

if TYPE_CHECKING:
    from persia_planner.topology.profile import HardwareProfile

__all__ = ["DeviceKind", "Gpu", "Host", "NodeKind", "Role", "Topology", "load_topology"]

DEFAULT_LATENCY_S = 5e-6


class Topology:
    """The cluster graph plus fast look-ups the cost model needs.

    Nodes carry ``kind`` (:class:`NodeKind`) and ``spec`` (:class:`Gpu` / :class:`Host`); edges carry ``bandwidth``
    (bytes/s) and ``latency`` (s). Path bandwidth is the bottleneck along the lowest-latency path.

    Attributes:
        name: Topology name, copied into plan.json.
        graph: The networkx graph.
        gpus: Trainer devices (GPUs, or CPU trainer processes) in a stable order (host order, then index).
        trainers: Trainer hosts (those with trainer devices).
        device_kind: What the trainer devices are (one kind per topology).
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
        self._server_index = {s.name: i for i, s in enumerate(self.servers)}
        if not self.gpus:
            raise ValueError("the topology has no trainer GPU")
        kinds = {g.kind for g in self.gpus}
        if len(kinds) > 1:
            # One job's trainers run one kind of kernel and collective backend (fbgemm CUDA + NCCL, or CPU + gloo).
            raise ValueError("trainer hosts mix 'gpus:' and 'cpus:' devices; one job trains on one kind")
        self.device_kind: DeviceKind = kinds.pop()

    # ---- look-ups -------------------------------------------------------------------------------------------
    def host(self, name: str) -> Host:
        return self._hosts[name]

    def gpu_index(self, name: str) -> int:
        return self._gpu_index[name]

    def server_index(self, name: str) -> int:
        """The index of parameter server ``name`` in :attr:`servers` (KeyError for another name)."""
        return self._server_index[name]

    def has_device(self, name: str) -> bool:
        return name in self._gpu_index or name in self._hosts

    @property
    def latency_s(self) -> float:
        """One-way host-to-host latency across the network (first trainer to the farthest other host)."""
        others = [h.name for h in (*self.trainers, *self.servers) if h.name != self.trainers[0].name]
        return max(self.path_latencies(self.trainers[0].name, others), default=0.0)

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

    def path_latencies(self, a: str, targets: Sequence[str]) -> list[float]:
        """:meth:`path_latency` from ``a`` to each of ``targets``, from one search of the graph (a search per
        target is hosts x hosts on a large cluster)."""
        paths = self._paths_from(a)
        edges = self.graph.edges
        return [sum(edges[u, v].get("latency", 0.0) for u, v in itertools.pairwise(paths[b])) for b in targets]

    @functools.cache  # noqa: B019 - as _path: few sources, asked for every target.
    def _paths_from(self, a: str) -> dict[str, list[str]]:
        return nx.single_source_dijkstra_path(self.graph, a, weight=_path_weight)

    def with_constants(self, overrides: Mapping[str, float]) -> Topology:
        """The same cluster with ``overrides`` applied to its cost-model constants (e.g. the ``<term>_scale``
        factors a run refitted: :meth:`persia_planner.cost.refit.Refit.constants`); a new object, so that no cost
        model's kept placement vectors of this one are read under other constants.

        Raises:
            PlannerError: An unknown constant or a value out of its range.
        """
        try:
            constants = self.constants.replace(dict(overrides))
        except KeyError as err:
            raise PlannerError(
                f"{err.args[0]!r} is no cost-model constant", fixes=(f"use one of {', '.join(CostConstants.names())}",)
            ) from None
        problem = constants.validate()
        if problem:
            raise PlannerError(f"constants: {problem}")
        return Topology(self.graph, self.name, constants)

    def measured_profile(self) -> HardwareProfile | None:
        """The profile whose fitted constants (its refitted factors among them) this topology plans with: the
        trainers' (else any host's), or None."""
        hosts = [h for h in (*self.trainers, *self.servers) if h.profile is not None]
        return hosts[0].profile if hosts else None

    # ---- capacities -----------------------------------------------------------------------------------------
    def holders(self, holder: Holder) -> Sequence[Gpu | Host]:
        """The devices that hold a memory of ``holder``'s kind, one slot each: GPUs, trainer hosts or servers."""
        return {Holder.GPU: self.gpus, Holder.HOST: self.trainers, Holder.SERVER: self.servers}[holder]

    def capacity(self, memory: Memory) -> list[int]:
        """Bytes the planner may fill of ``memory`` on each device that holds it (:meth:`holders`' order)."""
        return [memory.spec.capacity_of(self, d) for d in self.holders(memory.spec.holder)]

    def without(self, memory: Memory) -> list[str]:
        """The devices of ``memory``'s holder kind that have none of it (a server without an ``ssd:``)."""
        holders = self.holders(memory.spec.holder)
        return [d.name for d, c in zip(holders, self.capacity(memory), strict=True) if c <= 0]

    def hbm_capacity(self, gpu: Gpu) -> int:
        """HBM bytes the planner may use on ``gpu`` (capacity minus the reservation)."""
        return int(gpu.hbm_bytes * (1 - self.constants.hbm_reserve_fraction))

    def ddr_capacity(self, host: Host) -> int:
        """DDR bytes the planner may use on ``host`` (capacity minus the reservation). A CPU trainer host's DDR
        holds its devices' memory (their budgets): none is left for a host-memory tier (``ddr``, ``hbm_cache``)."""
        if host.role is Role.TRAINER and host.gpus and self.device_kind is DeviceKind.CPU:
            return 0
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
    def from_dict(cls, data: Any, source: str = "topology.yaml", base_dir: str | Path | None = None) -> Topology:
        """Build from parsed topology.yaml content (``hosts:`` form or ``nodes:``/``links:`` form); a host's
        ``profile:`` path is relative to ``base_dir`` (the topology file's folder)."""
        top = Fields(data, source, "")
        name = top.take_str("name", default="topology")
        constants = read_constants(top)
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
            switch_bw = net.take_positive("bandwidth", Quantity.BANDWIDTH, default=math.inf, maximum=MAX_BANDWIDTH)
            latency = net.take("latency", Quantity.DURATION, default=DEFAULT_LATENCY_S, maximum=MAX_LATENCY_S)
            net.finish()
        if top.has("nodes"):
            graph = graph_from_nodes(top)
        else:
            graph = graph_from_hosts(top, switch_bw, latency, constants, Path(base_dir) if base_dir else None)
            profile = _measured_profile(graph)
            if profile is not None:  # it measures the fixed costs; the file's own constants: still win
                constants = read_constants(Fields(data, source, ""), profile.fitted_constants())
        top.finish()
        try:
            return cls(graph, name, constants)
        except ValueError as err:
            mixed = "mix" in str(err)
            fix = "give every trainer host 'gpus:' or every one 'cpus:'" if mixed else "add a host with 'gpus:'"
            raise SpecError(source, "hosts", str(err), fixes=(fix,)) from None

    @classmethod
    def simple(cls, **options: Any) -> Topology:
        """A homogeneous H100-class cluster, for tests and benchmarks (the options of :meth:`simple_dict`)."""
        data = cls.simple_dict(**options)
        return cls.from_dict(data, f"{data['name']}.yaml")

    @staticmethod
    def simple_dict(
        *,
        trainers: int,
        gpus_per_trainer: int,
        servers: int = 0,
        hbm_bytes: int = 80 * 1024**3,
        ddr_bytes: int = 2 * 1024**4,
        ps_ddr_bytes: int = 1024**4,
        name: str = "generated",
    ) -> dict[str, Any]:
        """:meth:`simple`'s cluster as topology.yaml content (to write it for ``persia plan``)."""
        data: dict[str, Any] = {
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
        return data


def _path_weight(u: str, v: str, edge: Mapping[str, Any]) -> float:
    # Lowest latency first; the tiny per-hop term breaks ties towards fewer hops.
    return edge.get("latency", 0.0) + 1e-12


def _measured_profile(graph: nx.Graph) -> HardwareProfile | None:
    """The trainers' profile (else any host's): the one whose fixed costs the cost model takes."""
    hosts = [s for s in nx.get_node_attributes(graph, "spec").values() if isinstance(s, Host) and s.profile]
    trainers = [h for h in hosts if h.gpus]
    return (trainers or hosts)[0].profile if hosts else None


def load_topology(path: str | Path) -> Topology:
    """Load and validate a topology.yaml.

    Raises:
        SpecError: Malformed YAML, unknown key, bad unit or value; the message names the file and key path.
    """
    data, source = load_document(path, "see formats.md for the topology.yaml keys")
    return Topology.from_dict(data, Path(source).name, Path(source).parent)
