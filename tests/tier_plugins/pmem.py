"""A test tier with a memory and a store of its own: rows hashed over the parameter servers' persistent memory
(``pmem``: byte-addressable, larger and slower than DDR; topology.yaml sizes it with ``memories: {pmem: SIZE}``),
trained asynchronously as on ``ps``, in a store that counts what it reads and writes there."""

from __future__ import annotations

from typing import Any

from persia_planner.kinds import Sharding
from persia_planner.tiers import Holder, Lookups, MemorySpec, Runtime, TierSpec, register, register_memory

PMEM = register_memory(MemorySpec("pmem", Holder.SERVER, "PS pmem", "pmem_bytes"))

TIER = register(
    TierSpec(
        name="pmem",
        summary="a parameter server's persistent memory, trained asynchronously",
        rows_in=PMEM,
        lookups=Lookups.SERVER,
        shardings=frozenset({Sharding.PS_HASH}),
        speed_rank=5,
        runtime=Runtime.PARAMETER_SERVER,
        store=f"{__name__}:pmem_store",
        bandwidth_share=0.5,
        promote_to="ps",
    )
)


class PmemStore:
    """A server's rows of one table in its persistent memory: the in-memory store's layout, with the rows read and
    written counted (what a pmem device's wear and bandwidth are reckoned from)."""

    def __init__(self, rows: Any) -> None:
        self._rows = rows
        self.reads = 0
        self.writes = 0

    def lookup(self, ids: Any, **kwargs: Any) -> Any:
        found = self._rows.lookup(ids, **kwargs)
        self.reads += int(ids.numel())
        return found

    def update(self, ids: Any, grads: Any, *args: Any, **kwargs: Any) -> Any:
        self.writes += int(ids.numel())
        return self._rows.update(ids, grads, *args, **kwargs)

    def __len__(self) -> int:
        return len(self._rows)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._rows, name)


def pmem_store(config: Any, index: int) -> PmemStore:
    """The tier's store of ``config``'s table on server ``index`` (the runtime imports this when it creates it)."""
    from persia_planner.modules.ps.table_store import memory_store

    return PmemStore(memory_store(config, index))
