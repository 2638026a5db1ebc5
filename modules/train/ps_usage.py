"""What each parameter server did in a training run: hits, admissions, evictions, the rows it holds, its stores'
bytes and its resident memory, set beside the bytes the plan charged it (issue 30, part 6).

Trainer 0 reads each server's :func:`.ps.server.server_memory` before the tables are registered and, after the
last push, its :func:`.ps.server.server_metrics` and memory again
(:meth:`persia_planner.modules.ps.client.PsClient.metrics` / ``memory``, the servers' own RPCs); :func:`server_usage`
reduces the three to one :class:`ServerUsage` per server. The resident memory's growth between the two reads is what the
run's stores (and the requests' buffers) cost the server, which the plan charged as ``planned`` (the ``CostModel``'s
memory vector, :func:`planned_server_bytes`). Torch-free: dictionaries in, dictionaries out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from persia_planner.cost.analytic import CostModel
from persia_planner.model.specs import ModelSpec
from persia_planner.placement.shards import TablePlacement
from persia_planner.topology.graph import Topology
from persia_planner.units import format_bytes

__all__ = ["WARM_UP_TABLE", "ServerUsage", "planned_server_bytes", "server_usage", "usage_table", "warm_up"]

WARM_UP_TABLE = "__memory_warm_up__"
"""The table :func:`warm_up` registers on every server (left out of :func:`server_usage`)."""


@dataclass(frozen=True)
class ServerUsage:
    """One parameter server over a run, all its tables together.

    Attributes:
        name: The server (``ps0``).
        lookups: Ids looked up (each distinct id of a request once: the client de-duplicates), evaluation included.
        hits: Lookups that found their row.
        misses: Lookups that did not (each distinct id of a request once).
        admissions: Rows inserted (missing ids of training lookups that were admitted).
        not_admitted: Missing ids left out (admission draws, or a batch with more new ids than room).
        evictions: Rows evicted to make room.
        rows: Rows held at the end.
        capacity: Rows its stores can hold.
        store_bytes: Its stores' own account of their arrays (``EmbeddingStore.resident_bytes``).
        rss_growth_bytes: Growth of its resident memory from before the tables were registered to the end.
        planned_bytes: The bytes the plan charged it (0 where the topology names no such server).
        disk_reads: Rows its ``ssd`` tables read from disk into their DDR caches.
        disk_writes: Rows they wrote back to disk (evicted from the caches).
        stores: Per table, the store that ran it on this server (``"module:QualName"`` of its class).
    """

    name: str
    lookups: int
    hits: int
    misses: int
    admissions: int
    not_admitted: int
    evictions: int
    rows: int
    capacity: int
    store_bytes: int
    rss_growth_bytes: int
    planned_bytes: int
    disk_reads: int = 0
    disk_writes: int = 0
    stores: dict[str, str] = field(default_factory=dict)

    @property
    def rss_over_planned(self) -> float:
        """``rss_growth_bytes / planned_bytes`` (inf where nothing was planned)."""
        return self.rss_growth_bytes / self.planned_bytes if self.planned_bytes else float("inf")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"rss_over_planned": self.rss_over_planned}


def warm_up(client: Any, dim: int, ids: int, optimizer: Any = None, *, drop: bool = True) -> None:
    """Have every server serve a table of its own through each path a run takes (inserts, hits, gradient pushes with
    ``optimizer``, a full store's evictions), then drop it, before a memory baseline is read: the baseline then
    holds what the first requests allocate for good (the compiled kernels, the RPC connections and threads, the
    request buffers) and the growth after it is the stores'.

    Args:
        client: A connected ``PsClient``.
        dim: Width of the warm-up rows.
        ids: Ids per request (about a large request's).
        optimizer: The servers' row optimizer of the run (``SparseOptimizer.ps()``); None: the table default's.
        drop: Drop the table at the end; False where several clients warm up at once (a measurement's own cluster,
            which no checkpoint follows): :func:`server_usage` leaves it out.
    """
    import torch  # here: the rest of this module is torch-free

    from persia_planner.modules.ps.protocol import TableConfig

    extra = {} if optimizer is None else {"optimizer": optimizer}
    client.register(TableConfig(name=WARM_UP_TABLE, dim=dim, capacity=2 * ids, **extra))
    first = torch.arange(ids)
    client.lookup(WARM_UP_TABLE, first, train=True)  # inserts
    client.push_gradients(WARM_UP_TABLE, first, torch.zeros(ids, dim))
    client.lookup(WARM_UP_TABLE, first, train=True)  # hits
    client.lookup(WARM_UP_TABLE, first + ids, train=True)  # a full store: evictions
    if drop:
        client.drop(WARM_UP_TABLE)  # no checkpoint, dump or metrics of the run carries it


def planned_server_bytes(spec: ModelSpec, tables: Mapping[str, TablePlacement], topology: Topology) -> dict[str, int]:
    """The DDR bytes the plan charges each parameter server (``CostModel.evaluate``'s memory vector)."""
    cost = CostModel(spec, topology)
    _, mem = cost.evaluate(tables)
    start = cost.layout.ps_mem.start
    return {server.name: int(mem[start + p]) for p, server in enumerate(topology.servers)}


def server_usage(
    metrics: Sequence[Mapping[str, Any]],
    before: Sequence[Mapping[str, Any]],
    after: Sequence[Mapping[str, Any]],
    planned: Mapping[str, int],
) -> list[ServerUsage]:
    """One :class:`ServerUsage` per server, in server order.

    Args:
        metrics: Each server's ``server_metrics()`` at the end.
        before: Each server's ``server_memory()`` before the run's tables were registered.
        after: Each server's ``server_memory()`` at the end.
        planned: The plan's bytes per server name (:func:`planned_server_bytes`).
    """
    out = []
    for m, start, end in zip(metrics, before, after, strict=True):
        tables = [t for name, t in m["tables"].items() if name != WARM_UP_TABLE]

        def total(key: str, tables: Any = tables) -> int:
            return int(sum(t.get(key, 0) for t in tables))  # only ssd tables count disk rows

        out.append(
            ServerUsage(
                name=m["name"],
                lookups=total("lookups"),
                hits=total("lookups") - total("misses"),
                misses=total("misses"),
                admissions=total("inserts"),
                not_admitted=total("not_admitted"),
                evictions=total("evictions"),
                rows=total("rows"),
                capacity=total("capacity"),
                store_bytes=int(end["store_bytes"]) - int(start["store_bytes"]),
                rss_growth_bytes=int(end["resident_bytes"]) - int(start["resident_bytes"]),
                planned_bytes=int(planned.get(m["name"], 0)),
                disk_reads=total("disk_reads"),
                disk_writes=total("disk_writes"),
                stores={name: store for name, store in m.get("stores", {}).items() if name != WARM_UP_TABLE},
            )
        )
    return out


def usage_table(servers: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """The CLI's per-server table: its header and one row per server (``ServerUsage.to_dict()`` of each)."""
    header = ["server", "hit rate", "admissions", "evictions", "rows / capacity", "store", "RSS growth", "planned"]
    rows = []
    for s in servers:
        rate = s["hits"] / s["lookups"] if s["lookups"] else 0.0
        rows.append(
            [
                s["name"],
                f"{rate:.1%}",
                f"{s['admissions']:,}",
                f"{s['evictions']:,}",
                f"{s['rows']:,} / {s['capacity']:,}",
                format_bytes(s["store_bytes"]),
                format_bytes(max(s["rss_growth_bytes"], 0)),
                format_bytes(s["planned_bytes"]),
            ]
        )
    return header, rows
