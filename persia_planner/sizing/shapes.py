"""Cluster shapes: how many hosts of which trainer class, how many servers of which class, on which link; their price,
and every shape of a catalog within a host budget, cheapest first.

Shapes are enumerated as *streams*: one trainer class and count, one link and one server class (or none), with the
server count running up from the fewest that can hold the model. The cheapest shapes come first from a heap of the
streams' heads, so a search that stops at its first success never builds the dearer ones.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from persia_planner.model.specs import ModelSpec
from persia_planner.placement.memory import ps_servers_needed
from persia_planner.sizing.catalog import Catalog, HostClass, LinkClass

__all__ = ["Shape", "Stream", "all_shapes", "cheapest_first", "streams"]


@dataclass(frozen=True)
class Shape:
    """One cluster a catalog can make.

    Attributes:
        trainer: The trainer hosts' class.
        trainers: How many trainer hosts.
        server: The parameter servers' class (None: no servers).
        servers: How many parameter servers.
        link: The network.
    """

    trainer: HostClass
    trainers: int
    server: HostClass | None
    servers: int
    link: LinkClass

    @property
    def hosts(self) -> int:
        """Trainer hosts and servers together."""
        return self.trainers + self.servers

    @property
    def price_per_hour(self) -> float:
        """What the cluster costs an hour: its hosts, and the link for each of them."""
        servers = self.server.price_per_hour * self.servers if self.server is not None else 0.0
        return self.trainer.price_per_hour * self.trainers + servers + self.link.price_per_hour * self.hosts

    def describe(self) -> str:
        """``4 x p4d.24xlarge + 10 x r6i.32xlarge on efa``."""
        text = f"{self.trainers} x {self.trainer.name}"
        if self.server is not None and self.servers:
            text += f" + {self.servers} x {self.server.name}"
        return f"{text} on {self.link.name}"

    def topology_dict(self, catalog: Catalog, out_dir: Path | None = None) -> dict[str, Any]:
        """Its topology.yaml content (see :meth:`.catalog.Catalog.topology_dict`)."""
        return catalog.topology_dict(self.trainer, self.trainers, self.server, self.servers, self.link, out_dir)


@dataclass(frozen=True)
class Stream:
    """Shapes that differ only in their server count: ``first`` up to ``last`` servers (0 and 0: no servers).

    Attributes:
        trainer: The trainer hosts' class.
        trainers: How many trainer hosts.
        server: The servers' class (None: the stream of the one shape without servers).
        link: The network.
        first: The fewest servers whose memory, with the trainers', can hold the model (``last + 1``: none can).
        last: The most servers the host budget leaves.
    """

    trainer: HostClass
    trainers: int
    server: HostClass | None
    link: LinkClass
    first: int
    last: int

    def shape(self, servers: int) -> Shape:
        """The stream's shape with ``servers`` servers."""
        return Shape(self.trainer, self.trainers, self.server, servers, self.link)

    @property
    def held(self) -> range:
        """The server counts whose memory can hold the model."""
        return range(self.first, self.last + 1)

    @property
    def short(self) -> range:
        """The server counts whose memory cannot (the aggregate capacity or a table's rows per server)."""
        return range(0 if self.server is None else 1, min(self.first, self.last + 1))


def streams(model: ModelSpec, catalog: Catalog, max_hosts: int) -> list[Stream]:
    """Every stream of ``catalog``'s shapes with at most ``max_hosts`` hosts, with the server counts whose aggregate
    memory cannot hold ``model`` set apart (the test of :func:`persia_planner.planner.check_capacity`: all tables'
    bytes within HBM + DDR + servers, and a table larger than the trainers' HBM and DDR hashed over enough servers)."""
    need = model.total_bytes
    sizes = [(t.rows, t.bytes(model.dtype_of(t))) for t in model.tables]
    largest = max((size for _, size in sizes), default=0)
    found = []
    for trainer in catalog.trainers:
        for trainers in range(1, min(max_hosts, trainer.max_count or max_hosts) + 1):
            hbm, ddr = trainer.hbm_bytes * trainers, trainer.ddr_bytes * trainers
            local = max(hbm, ddr)
            # Tables only the servers can hold, each hashed over enough of them.
            by_rows = max((ps_servers_needed(rows) for rows, size in sizes if size > local), default=1)
            for link in catalog.links:
                alone = need <= hbm + ddr and largest <= local
                found.append(Stream(trainer, trainers, None, link, 0 if alone else 1, 0))
                left = max_hosts - trainers
                for server in catalog.servers:
                    last = min(left, server.max_count or left)
                    if last < 1:
                        continue
                    per_server = max(server.ddr_bytes, 1)
                    by_bytes = -(-max(need - hbm - ddr, 0) // per_server)
                    by_room = -(-largest // per_server) if largest > local else 1
                    first = max(1, by_bytes, by_rows, by_room)
                    found.append(Stream(trainer, trainers, server, link, min(first, last + 1), last))
    return found


def cheapest_first(found: list[Stream]) -> Iterator[tuple[int, Shape]]:
    """Every shape of ``found`` whose memory can hold the model, cheapest first (ties: in ``found``'s order), with
    the index of its stream. A consumer that drops a stream (:meth:`CheapestFirst.drop`) skips its dearer shapes."""
    return CheapestFirst(found)


class CheapestFirst:
    """The iterator of :func:`cheapest_first`: a heap of the streams' next shapes."""

    def __init__(self, found: list[Stream]):
        self._streams = found
        self._dropped: set[int] = set()
        self._heap = [(s.shape(s.first).price_per_hour, i, s.first) for i, s in enumerate(found) if s.held]
        heapq.heapify(self._heap)

    def __iter__(self) -> CheapestFirst:
        return self

    def __next__(self) -> tuple[int, Shape]:
        while self._heap:
            _, index, servers = heapq.heappop(self._heap)
            if index in self._dropped:
                continue
            stream = self._streams[index]
            if servers < stream.last:
                heapq.heappush(self._heap, (stream.shape(servers + 1).price_per_hour, index, servers + 1))
            return index, stream.shape(servers)
        raise StopIteration

    def drop(self, index: int) -> None:
        """Skip the rest of stream ``index``."""
        self._dropped.add(index)


def all_shapes(model: ModelSpec, catalog: Catalog, max_hosts: int) -> list[Shape]:
    """Every shape of ``catalog`` with at most ``max_hosts`` hosts, memory or not (what an exhaustive search tries)."""
    shapes = []
    for stream in streams(model, catalog, max_hosts):
        counts = [0] if stream.server is None else range(1, stream.last + 1)
        shapes.extend(stream.shape(n) for n in counts)
    return shapes
