"""Reading topology.yaml: the ``hosts:`` form and the ``nodes:``/``links:`` form, into a networkx graph."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import networkx as nx

from persia_planner.errors import SpecError, abbreviate
from persia_planner.fields import Fields
from persia_planner.limits import (
    MAX_BANDWIDTH,
    MAX_DISK_IOPS,
    MAX_GPUS_PER_HOST,
    MAX_HOST_COUNT,
    MAX_LATENCY_S,
    MAX_MEMORY_BYTES,
    MAX_TFLOPS,
    MAX_TOPOLOGY_LINKS,
    MAX_TOPOLOGY_NODES,
    MIN_DISK_BYTES,
    MIN_DISK_IOPS,
)
from persia_planner.tiers import Holder, Memory
from persia_planner.tiers.plugins import ENVIRONMENT
from persia_planner.topology.cost_constants import LIST_CONSTANTS, CostConstants
from persia_planner.topology.hardware import (
    DEFAULT_SSD_READ_IOPS,
    DEFAULT_SSD_WRITE_IOPS,
    DeviceKind,
    Disk,
    Gpu,
    Host,
    NodeKind,
    Role,
)
from persia_planner.units import Quantity, UnitError, parse

if TYPE_CHECKING:
    from persia_planner.topology.profile import HardwareProfile

__all__ = ["SWITCH", "graph_from_hosts", "graph_from_nodes", "read_constants"]

SWITCH = "switch"


def read_constants(top: Fields, fitted: Mapping[str, Any] | None = None) -> CostConstants:
    """The ``constants:`` section over ``fitted`` (a profile's) over the defaults."""
    section = top.sub("constants", default=None)
    if section is None:
        return CostConstants().replace(dict(fitted or {}))
    overrides: dict[str, Any] = dict(fitted or {})
    for key in CostConstants.names():
        if key in LIST_CONSTANTS and section.has(key):
            overrides[key] = _read_numbers(section, key)
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


def _read_numbers(section: Fields, key: str) -> list[float]:
    """A constant that is a list of numbers in (0, 1) (``cache_fractions``, ``cache_hit_targets``)."""
    value = section.take(key)
    if not isinstance(value, list):
        raise section.error(
            key, f"expected a list of numbers in (0, 1), got {abbreviate(value)}", fixes=("write e.g. [0.05, 0.2]",)
        )
    numbers = []
    for i, item in enumerate(value):
        try:
            numbers.append(parse(item, Quantity.NUMBER))
        except UnitError as err:
            raise SpecError(section.source, f"{section.key_path(key)}[{i}]", str(err)) from None
    return numbers


@dataclass(frozen=True)
class _Devices:
    """One host entry's trainer devices, as read."""

    kind: DeviceKind
    count: int
    memory: int
    bandwidth: float
    tflops: float
    host_link: float
    peer_link: float


def graph_from_hosts(
    top: Fields,
    switch_bw: float,
    latency: float,
    constants: CostConstants | None = None,
    base_dir: Path | None = None,
) -> nx.Graph:
    """The ``hosts:`` form. A host's ``profile:`` (a path relative to ``base_dir``) gives the measured defaults of
    its CPU devices; ``constants`` convert them to the cost model's bandwidth terms."""
    graph = nx.Graph()
    graph.add_node(SWITCH, kind=NodeKind.SWITCH, bandwidth=switch_bw)
    nodes = links = 0  # of the graph so far, to refuse one too large to build before building it
    for _, item in top.take_list("hosts"):
        base = item.take_str("name")
        count = item.take_positive("count", Quantity.COUNT, default=1, maximum=MAX_HOST_COUNT)
        ddr = item.take_positive("ddr", Quantity.SIZE, maximum=MAX_MEMORY_BYTES)
        profile = _read_profile(item, base_dir)
        gpus = item.sub("gpus", default=None)
        cpus = item.sub("cpus", default=None)
        server = item.has("role") and str(item.data["role"]).lower() == Role.PARAMETER_SERVER.value
        measured = {}
        if profile is not None:
            measured = profile.host_figures(server or (gpus is None and cpus is None), constants or CostConstants())
        ddr_bw = _rate(item, "ddr_bandwidth", measured)
        nic_bw = _rate(item, "nic_bandwidth", measured)
        ssd = _read_ssd(item, profile)
        # a host without trainer devices is a parameter server unless its role says otherwise
        serves = server or (not item.has("role") and gpus is None and cpus is None)
        memories = _read_memories(item, Holder.SERVER if serves else Holder.HOST)
        if gpus is not None and cpus is not None:
            raise item.error("cpus", "a host has either 'gpus:' or 'cpus:' trainer devices, not both")
        gpu_device = gpus.take_str("device", default=None) if gpus is not None else None
        if profile is not None:
            _check_profile_is_this_host_s(item, profile, base, count, gpus is not None, gpu_device)
        has_devices = gpus is not None or cpus is not None
        role = item.take_enum("role", Role, default=Role.TRAINER if has_devices else Role.PARAMETER_SERVER)
        devices = None
        if gpus is not None:
            devices = _read_gpu_fields(gpus)
        elif cpus is not None:
            devices = _read_cpu_fields(cpus, ddr_bw, profile, constants or CostConstants())
        item.finish()
        if role is Role.PARAMETER_SERVER and devices is not None:
            key = "gpus" if gpus is not None else "cpus"
            raise item.error(key, "a parameter_server host has no trainer devices", fixes=(f"remove '{key}:'",))
        if role is Role.TRAINER and ssd is not None:
            raise item.error(
                "ssd", "the ssd tier is a parameter server's disk; a trainer host has none", fixes=("remove 'ssd:'",)
            )
        if role is Role.TRAINER and devices is None:
            raise item.error(
                "gpus", "a trainer host needs 'gpus:' or 'cpus:'", fixes=("add 'gpus:' or 'cpus:', or set role",)
            )
        per_host = devices.count if devices is not None else 0
        nodes += count * (1 + per_host)
        links += count * (1 + per_host + per_host * (per_host - 1) // 2)  # NIC, PCIe, and every pair of devices
        if nodes > MAX_TOPOLOGY_NODES or links > MAX_TOPOLOGY_LINKS:
            raise item.error(
                "count",
                f"the topology would have {nodes:,} hosts and devices and {links:,} links, over the "
                f"{MAX_TOPOLOGY_NODES:,} and {MAX_TOPOLOGY_LINKS:,} a topology may have",
                fixes=("check the counts of hosts and devices",),
            )
        for index in range(count):
            host_name = f"{base}{index}"
            if host_name in graph:
                raise item.error("name", f"host {host_name!r} is defined twice", fixes=("rename one of them",))
            names: tuple[str, ...] = ()
            if devices is not None:
                names = tuple(f"{host_name}/{devices.kind.value}{i}" for i in range(devices.count))
                for name in names:
                    if name in graph:  # a host named like a device ("trainer0/gpu0") would be replaced silently
                        raise item.error(
                            "name",
                            f"device {name!r} has the name of a host defined earlier",
                            fixes=("rename the host",),
                        )
                    spec = Gpu(
                        name,
                        host_name,
                        devices.memory,
                        devices.bandwidth,
                        devices.tflops,
                        devices.host_link,
                        devices.peer_link,
                        devices.kind,
                    )
                    graph.add_node(name, kind=NodeKind.GPU, spec=spec)
                    graph.add_edge(name, host_name, bandwidth=devices.host_link, latency=0.0, link="pcie")
                link = "nvlink" if devices.kind is DeviceKind.GPU else "shm"
                for i, a in enumerate(names):
                    for b in names[i + 1 :]:
                        graph.add_edge(a, b, bandwidth=devices.peer_link, latency=0.0, link=link)
            host = Host(host_name, role, ddr, ddr_bw, nic_bw, names, profile, ssd, memories)
            graph.add_node(host_name, kind=NodeKind.HOST, spec=host)
            # Half the one-way host-to-host latency on each side, so host -> switch -> host adds up to it.
            graph.add_edge(host_name, SWITCH, bandwidth=nic_bw, latency=latency / 2, link="nic")
    return graph


def _read_profile(item: Fields, base_dir: Path | None) -> HardwareProfile | None:
    path = item.take_str("profile", default=None)
    if path is None:
        return None
    from persia_planner.topology.profile import load_profile

    full = Path(path) if Path(path).is_absolute() or base_dir is None else base_dir / path
    if not full.exists():
        raise item.error(
            "profile",
            f"profile file {str(full)!r} not found",
            fixes=("give a path relative to the topology file", f"run persia calibrate --out {path}"),
        )
    return load_profile(full)  # a directory or a FIFO is refused there, as what it is


def _check_profile_is_this_host_s(
    item: Fields, profile: HardwareProfile, host: str, count: int, has_gpus: bool, gpu_device: str | None
) -> None:
    """Refuse a profile measured for another topology host, or on another kind of device than the host's: a
    profile of another cluster prices this one wrongly. A profile that does not say (older ones) is taken."""
    where = profile.provenance
    measured = f"profile {item.data['profile']} was measured" + (f" on {where.hostname}" if where.hostname else "")
    fixes = (f"run persia calibrate --host {host} on that host", "pass the profile measured there")
    if where.topology_host is not None and not _names_host(where.topology_host, host, count):
        raise item.error("profile", f"{measured} for host {where.topology_host!r}, not {host!r}", fixes=fixes)
    if where.device is None or not has_gpus:
        return
    if where.device == "cpu":
        raise item.error("profile", f"{measured} with device cpu, but host {host!r} has GPUs", fixes=fixes)
    if gpu_device is not None and where.device != gpu_device:
        raise item.error(
            "profile", f"{measured} with device {where.device!r}, but host {host!r} has {gpu_device!r}", fixes=fixes
        )


def _names_host(name: str, host: str, count: int) -> bool:
    """Whether ``name`` is the host entry ``host`` (its class) or one of the ``count`` hosts it stands for."""
    if name == host:
        return True
    index = name.removeprefix(host)
    digits = index != name and 0 < len(index) <= 18 and index.isascii() and index.isdigit()
    return digits and str(int(index)) == index and int(index) < count


def _read_memories(item: Fields, holder: Holder) -> tuple[tuple[str, int], ...]:
    """A host's ``memories:``: the size of each memory a tier module registered for hosts of its kind (a parameter
    server's or a trainer host's) that no other field gives (``memories: {pmem: 1TiB}``)."""
    given = item.sub("memories", default=None)
    if given is None:
        return ()
    found = []
    for name in given.names():
        key = str(name)
        memory = next((m for m in Memory if m.value == key), None)
        declared = [m.value for m in Memory if m.spec.capacity is None and m.spec.holder is holder]
        if memory is None or memory.spec.capacity is not None or memory.spec.holder is not holder:
            fix = (
                f"name one of {', '.join(declared)}"
                if declared
                else f"load the tier module that registers it ({ENVIRONMENT})"
            )
            raise given.error(key, f"no tier module registers a memory {key!r} of a {holder.value}", fixes=(fix,))
        found.append(
            (key, given.take_in_range(key, Quantity.SIZE, 1, MAX_MEMORY_BYTES, fixes=("give its size, e.g. 1TiB",)))
        )
    given.finish()
    return tuple(found)


def _read_ssd(item: Fields, profile: HardwareProfile | None) -> Disk | None:
    """A parameter server's ``ssd:``: its size (``ssd: 2TiB``), or ``{size, read_iops, write_iops}``; the rates
    default to the host profile's ``disk:`` figures, else a data-centre NVMe drive's."""
    if not item.has("ssd"):
        return None
    measured = profile.disk if profile is not None else {}
    read = measured.get("read_iops", DEFAULT_SSD_READ_IOPS)
    write = measured.get("write_iops", DEFAULT_SSD_WRITE_IOPS)
    sizes, size_fix = (MIN_DISK_BYTES, MAX_MEMORY_BYTES), ("give the disk's size, e.g. ssd: 2TiB",)
    if not isinstance(item.data["ssd"], Mapping):
        return Disk(item.take_in_range("ssd", Quantity.SIZE, *sizes, fixes=size_fix), read, write)
    ssd = item.sub("ssd")
    assert ssd is not None
    size = ssd.take_in_range("size", Quantity.SIZE, *sizes, fixes=size_fix)
    rates = (MIN_DISK_IOPS, MAX_DISK_IOPS)
    fix = "give the 4 KiB blocks the disk {} a second at random (persia calibrate measures them)"
    read = ssd.take_in_range("read_iops", Quantity.NUMBER, *rates, default=read, fixes=(fix.format("reads"),))
    write = ssd.take_in_range("write_iops", Quantity.NUMBER, *rates, default=write, fixes=(fix.format("writes"),))
    ssd.finish()
    return Disk(size, read, write)


def _rate(fields: Fields, key: str, measured: Mapping[str, float], kind: Quantity = Quantity.BANDWIDTH) -> float:
    """``key`` as given, else the host profile's figure; one of them is required."""
    maximum = MAX_BANDWIDTH if kind is Quantity.BANDWIDTH else MAX_TFLOPS
    value = fields.take_positive(key, kind, default=measured.get(key), maximum=maximum)
    if value is None:
        raise fields.error(
            key,
            "required key is missing (and no profile: on this host to take it from)",
            fixes=(f"add '{key}:'", "add 'profile: PROFILE.yaml' to the host (persia calibrate writes one)"),
        )
    return value


def _read_gpu_fields(gpus: Fields) -> _Devices:
    n_gpus = gpus.take_positive("count", Quantity.COUNT, default=1, maximum=MAX_GPUS_PER_HOST)
    hbm = gpus.take_positive("hbm", Quantity.SIZE, maximum=MAX_MEMORY_BYTES)
    hbm_bw = gpus.take_positive("hbm_bandwidth", Quantity.BANDWIDTH, maximum=MAX_BANDWIDTH)
    tflops = gpus.take_positive("tflops", Quantity.NUMBER, maximum=MAX_TFLOPS)
    pcie_bw = gpus.take_positive("pcie_bandwidth", Quantity.BANDWIDTH, maximum=MAX_BANDWIDTH)
    nvlink_bw = gpus.take_positive("nvlink_bandwidth", Quantity.BANDWIDTH, default=pcie_bw, maximum=MAX_BANDWIDTH)
    gpus.finish()
    return _Devices(DeviceKind.GPU, n_gpus, hbm, hbm_bw, tflops * 1e12, pcie_bw, nvlink_bw)


def _read_cpu_fields(
    cpus: Fields, ddr_bw: float, profile: HardwareProfile | None, constants: CostConstants
) -> _Devices:
    """CPU trainer processes: their memory budget, and rates that default to the host's profile."""
    count = cpus.take_positive("count", Quantity.COUNT, default=1, maximum=MAX_GPUS_PER_HOST)
    memory = cpus.take_positive("memory", Quantity.SIZE, maximum=MAX_MEMORY_BYTES)
    measured = profile.device_figures(constants) if profile is not None else {}
    bandwidth = _rate(cpus, "bandwidth", measured)
    tflops = _rate(cpus, "tflops", measured, Quantity.NUMBER)
    link = cpus.take_positive(
        "link_bandwidth", Quantity.BANDWIDTH, default=measured.get("link_bandwidth", ddr_bw), maximum=MAX_BANDWIDTH
    )
    cpus.finish()
    return _Devices(DeviceKind.CPU, count, memory, bandwidth, tflops * 1e12, ddr_bw, link)


def graph_from_nodes(top: Fields) -> nx.Graph:
    """The advanced form: explicit nodes and links; GPU/host specs are derived from the links."""
    graph = nx.Graph()
    raw = _read_nodes(top, graph)
    _read_links(top, graph, raw)
    for name, attrs in raw.items():
        if attrs["kind"] is NodeKind.SWITCH:
            graph.nodes[name]["bandwidth"] = attrs["bandwidth"]
            if name != SWITCH:
                nx.relabel_nodes(graph, {name: SWITCH}, copy=False)
    _derive_specs(top, graph, raw)
    orphan = next((n for n, a in raw.items() if a["kind"] is NodeKind.GPU and "spec" not in graph.nodes[n]), None)
    if orphan:
        raise top.error("links", f"GPU {orphan!r} is not linked to a host", fixes=("add a link from it to its host",))
    _check_connected(top, graph)
    return graph


def _read_nodes(top: Fields, graph: nx.Graph) -> dict[str, dict[str, Any]]:
    """The ``nodes:`` list: each node added to ``graph``; returns each one's attributes by name."""
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
                "hbm": item.take_positive("hbm", Quantity.SIZE, maximum=MAX_MEMORY_BYTES),
                "hbm_bandwidth": item.take_positive("hbm_bandwidth", Quantity.BANDWIDTH, maximum=MAX_BANDWIDTH),
                "tflops": item.take_positive("tflops", Quantity.NUMBER, maximum=MAX_TFLOPS) * 1e12,
            }
        elif kind is NodeKind.HOST:
            raw[name] = {
                "kind": kind,
                "role": item.take_enum("role", Role, default=Role.TRAINER),
                "ddr": item.take_positive("ddr", Quantity.SIZE, maximum=MAX_MEMORY_BYTES),
                "ddr_bandwidth": item.take_positive("ddr_bandwidth", Quantity.BANDWIDTH, maximum=MAX_BANDWIDTH),
            }
        else:
            raw[name] = {
                "kind": kind,
                "bandwidth": item.take_positive("bandwidth", Quantity.BANDWIDTH, math.inf, maximum=MAX_BANDWIDTH),
            }
        item.finish()
        graph.add_node(name, kind=kind)
    return raw


def _read_links(top: Fields, graph: nx.Graph, raw: dict[str, dict[str, Any]]) -> None:
    """The ``links:`` list, between the nodes of ``raw``: each one an edge of ``graph``, at most one per pair."""
    seen_links: dict[frozenset[str], str] = {}
    for _, item in top.take_list("links"):
        ends = []
        for key in ("a", "b"):
            end = item.take_str(key)
            if end not in raw:
                raise item.error(key, f"unknown node {end!r}", fixes=("declare it under 'nodes:'",))
            ends.append(end)
        bandwidth = item.take_positive("bandwidth", Quantity.BANDWIDTH, maximum=MAX_BANDWIDTH)
        latency = item.take("latency", Quantity.DURATION, default=0.0, maximum=MAX_LATENCY_S)
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


def _derive_specs(top: Fields, graph: nx.Graph, raw: dict[str, dict[str, Any]]) -> None:
    """Each host's spec (its NIC: the links to anything but its GPUs) and each of its GPUs' (its PCIe link, its
    NVLink: the fastest link to a GPU of the same host)."""
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
