"""The hardware catalog (``catalog.yaml``): the host, parameter-server and link classes a cluster can be bought from,
each with a price per hour, and the topology a shape of them makes.

A class's hardware keys are a topology.yaml ``hosts:`` entry's (without ``name``, ``count`` and ``role``), so a
catalog class and a host of a topology are read by one reader, and the topology ``persia size`` writes is an ordinary
topology.yaml. Each class is read once, as a one-host topology, so that a typo fails at load with the class named.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from persia_planner.errors import SpecError
from persia_planner.fields import Fields, load_document
from persia_planner.topology.graph import Topology
from persia_planner.topology.hardware import Role
from persia_planner.units import Quantity

__all__ = ["Catalog", "HostClass", "LinkClass", "load_catalog"]

MAX_PRICE_PER_HOUR = 1e7
"""The dearest class a catalog may list (USD or any currency per hour): a backstop against a misplaced unit."""
_FIX = "see formats.md for the catalog.yaml keys"


@dataclass(frozen=True)
class HostClass:
    """A kind of host a cluster can have any number of: trainer hosts or parameter servers.

    Attributes:
        name: The class's name in the catalog (an instance type, e.g. ``p4d.24xlarge``).
        role: Trainer host or parameter server.
        price_per_hour: What one host costs an hour, in the catalog's currency.
        source: Where the price (and the figures) come from.
        hardware: Its topology.yaml host keys (``ddr``, ``nic_bandwidth``, ``gpus`` ...), without name and count;
            ``profile:`` is an absolute path.
        max_count: The most hosts of the class a shape may have (None: only ``--max-hosts`` limits it).
        devices: Its trainer devices per host (0 for a parameter server).
        hbm_bytes: Its devices' memory for tables, per host, after reservations.
        ddr_bytes: Its DDR for tables, per host, after reservations (a server's store, a trainer's host memory).
    """

    name: str
    role: Role
    price_per_hour: float
    source: str
    hardware: Mapping[str, Any]
    max_count: int | None
    devices: int
    hbm_bytes: int
    ddr_bytes: int

    def host_entry(self, count: int, out_dir: Path | None = None) -> dict[str, Any]:
        """Its topology.yaml ``hosts:`` entry of ``count`` hosts (a ``profile:`` path relative to ``out_dir``, the
        folder the topology is written to, where given)."""
        entry: dict[str, Any] = {"name": _host_name(self), "count": count}
        if self.role is Role.PARAMETER_SERVER:
            entry["role"] = Role.PARAMETER_SERVER.value
        hardware = copy.deepcopy(dict(self.hardware))
        if out_dir is not None and "profile" in hardware:
            hardware["profile"] = os.path.relpath(hardware["profile"], out_dir)
        return entry | hardware


@dataclass(frozen=True)
class LinkClass:
    """How the hosts are connected: the network keys of topology.yaml and a price per host and hour.

    Attributes:
        name: The class's name.
        price_per_hour: What attaching one host costs an hour (0: included in the hosts' price).
        source: Where the price comes from.
        network: Its topology.yaml ``network:`` keys (``bandwidth``, ``latency``).
    """

    name: str
    price_per_hour: float
    source: str
    network: Mapping[str, Any]


@dataclass(frozen=True)
class Catalog:
    """What a cluster can be made of.

    Attributes:
        name: The catalog's name.
        currency: The prices' currency (``USD``).
        trainers: Trainer host classes.
        servers: Parameter-server classes (may be none).
        links: Network classes (at least one).
        source: The file it was read from, as messages name it.
    """

    name: str
    currency: str
    trainers: tuple[HostClass, ...]
    servers: tuple[HostClass, ...]
    links: tuple[LinkClass, ...]
    source: str = "catalog.yaml"

    def topology_dict(
        self,
        trainer: HostClass,
        trainers: int,
        server: HostClass | None,
        servers: int,
        link: LinkClass,
        out_dir: Path | None = None,
    ) -> dict[str, Any]:
        """The topology.yaml content of a shape: ``trainers`` hosts of ``trainer``, ``servers`` of ``server``, on
        ``link``."""
        hosts = [trainer.host_entry(trainers, out_dir)]
        if server is not None and servers:
            hosts.append(server.host_entry(servers, out_dir))
        name = f"{trainers}x{trainer.name}" + (f"+{servers}x{server.name}" if server is not None and servers else "")
        data: dict[str, Any] = {"name": f"{name}@{link.name}", "hosts": hosts}
        if link.network:
            data["network"] = dict(link.network)
        return data


def load_catalog(path: str | Path) -> Catalog:
    """Read and check a catalog.yaml.

    Raises:
        SpecError: Malformed YAML, an unknown key, a bad unit or value, a class whose hardware a topology would
            refuse; the message names the file, the class and the key.
    """
    data, source = load_document(path, _FIX)
    return catalog_from_dict(data, Path(source).name, Path(source).resolve().parent)


def catalog_from_dict(data: Any, source: str = "catalog.yaml", base_dir: Path | None = None) -> Catalog:
    """Build a :class:`Catalog` from parsed catalog.yaml content; a class's ``profile:`` is relative to ``base_dir``."""
    top = Fields(data, source, "")
    name = top.take_str("name", default=Path(source).stem)
    currency = top.take_str("currency", default="USD")
    top.take_str("prices_as_of", default=None)  # documentation for the reader; the planner does not use it
    trainers = _classes(top, "trainers", Role.TRAINER, base_dir)
    servers = _classes(top, "servers", Role.PARAMETER_SERVER, base_dir, default={})
    links = _links(top)
    top.finish()
    if not trainers:
        raise top.error("trainers", "the catalog lists no trainer host class", fixes=("add one under 'trainers:'",))
    names = [c.name for c in (*trainers, *servers)]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise top.error("servers", f"class {twice[0]!r} is listed as a trainer and as a server", fixes=("rename one",))
    return Catalog(name, currency, trainers, servers, links, source)


def _classes(top: Fields, key: str, role: Role, base_dir: Path | None, default: Any = None) -> tuple[HostClass, ...]:
    section = top.sub(key, default=default if default is not None else None)
    if section is None:
        if default is None:
            raise top.error(key, "required key is missing", fixes=(f"add '{key}:' with at least one class",))
        return ()
    return tuple(_host_class(section, name, role, base_dir) for name in section.names())


def _host_class(section: Fields, name: str, role: Role, base_dir: Path | None) -> HostClass:
    item = section.sub(name)
    assert item is not None
    price = _price(item)
    source = item.take_str("source")
    max_count = item.take_positive("max_count", Quantity.COUNT, default=None)
    hardware = {k: v for k, v in item.data.items() if k not in ("price_per_hour", "source", "max_count")}
    for forbidden in ("name", "count", "role"):
        if forbidden in hardware:
            raise item.error(forbidden, f"a class has no '{forbidden}:' (a shape sets it)", fixes=("remove it",))
    devices = "gpus" in hardware or "cpus" in hardware
    if role is Role.TRAINER and not devices:
        raise item.error(
            "gpus", "a trainer class needs 'gpus:' or 'cpus:'", fixes=("add them, or list it under servers:",)
        )
    if role is Role.PARAMETER_SERVER and devices:
        key = "gpus" if "gpus" in hardware else "cpus"
        raise item.error(key, "a parameter-server class has no trainer devices", fixes=("list it under trainers:",))
    if "profile" in hardware and base_dir is not None:
        hardware["profile"] = str((base_dir / str(hardware["profile"])).resolve())
    entry = {"name": "h", "count": 1, **({"role": role.value} if role is Role.PARAMETER_SERVER else {}), **hardware}
    # Read as a one-host topology (a trainer class beside a placeholder server, so that either builds): the same
    # checks as topology.yaml's, with the class's key path in the message.
    hosts = [entry] if role is Role.TRAINER else [_PLACEHOLDER_TRAINER, entry]
    try:
        topology = Topology.from_dict({"hosts": hosts}, item.source)
    except SpecError as err:
        index = len(hosts) - 1
        prefix = f"hosts[{index}]"
        path = item.path + err.path[len(prefix) :] if err.path.startswith(prefix) else item.path
        raise SpecError(item.source, path, err.problem, fixes=err.fixes) from None
    host = topology.trainers[0] if role is Role.TRAINER else topology.servers[0]
    hbm = sum(topology.hbm_capacity(g) for g in topology.gpus if g.host == host.name)
    return HostClass(
        name=name,
        role=role,
        price_per_hour=price,
        source=source,
        hardware=hardware,
        max_count=int(max_count) if max_count is not None else None,
        devices=len(host.gpus),
        hbm_bytes=int(hbm),
        ddr_bytes=int(topology.ddr_capacity(host)),
    )


_PLACEHOLDER_TRAINER = {
    "name": "t",
    "ddr": "1GiB",
    "ddr_bandwidth": "1GB/s",
    "nic_bandwidth": "1GB/s",
    "gpus": {
        "count": 1,
        "hbm": "1GiB",
        "hbm_bandwidth": "1GB/s",
        "tflops": 1,
        "pcie_bandwidth": "1GB/s",
        "nvlink_bandwidth": "1GB/s",
    },
}


def _links(top: Fields) -> tuple[LinkClass, ...]:
    section = top.sub("links", default=None)
    if section is None:
        return (LinkClass("network", 0.0, "the topology's default network (no links: in the catalog)", {}),)
    links = []
    for name in section.names():
        item = section.sub(name)
        assert item is not None
        price = _price(item)
        source = item.take_str("source")
        network = {k: item.data[k] for k in ("bandwidth", "latency") if k in item.data}
        for key in network:
            item.take(key)
        item.finish()
        try:  # the keys as topology.yaml's network: reads them
            Topology.from_dict({"hosts": [_PLACEHOLDER_TRAINER], "network": network}, item.source)
        except SpecError as err:
            raise SpecError(
                item.source, err.path.replace("network", item.path, 1), err.problem, fixes=err.fixes
            ) from None
        links.append(LinkClass(name, price, source, network))
    if not links:
        raise top.error("links", "lists no link class", fixes=("add one, or remove 'links:' for the default network",))
    return tuple(links)


def _price(item: Fields) -> float:
    price = item.take("price_per_hour")
    if isinstance(price, bool) or not isinstance(price, int | float) or not math.isfinite(price):
        raise item.error("price_per_hour", f"expected a number, got {price!r}", fixes=("give the price per hour",))
    if not 0 <= price <= MAX_PRICE_PER_HOUR:
        raise item.error(
            "price_per_hour", f"{price} is outside [0, {MAX_PRICE_PER_HOUR:g}]", fixes=("give the price per hour",)
        )
    return float(price)


def _host_name(host_class: HostClass) -> str:
    """A topology host name for the class (hosts are NAME + index): its name's letters and digits."""
    cleaned = "".join(ch if ch.isalnum() else "_" for ch in host_class.name).strip("_") or "host"
    return cleaned if not cleaned[0].isdigit() else f"h{cleaned}"
