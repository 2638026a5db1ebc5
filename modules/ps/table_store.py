"""What a parameter server asks of a table's store, whatever keeps the rows (:class:`TableStore`), and the in-memory
store's factory (:func:`memory_store`).

A server builds each table's store with the factory its tier names (``TierSpec.store``, carried to the servers as
``TableConfig.store`` and resolved by :func:`.server_state.make_store`) and then treats every store alike: requests,
checkpoints, dumps, metrics and shutdown all go through this protocol, so a tier with a store of its own runs without
the server naming it. The built-in stores are :class:`.store.EmbeddingStore` (:func:`memory_store`: the ``ps`` tier's
rows in DDR) and :class:`.ssd_store.SsdStore` (:func:`.ssd_store.disk_store`: the ``ssd`` tier's rows on disk behind
an in-memory cache).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from persia_planner.modules.ps.optim import RowOptimizer
from persia_planner.modules.ps.protocol import TableConfig
from persia_planner.modules.ps.store import EmbeddingStore

__all__ = ["TableStore", "memory_store"]


@runtime_checkable
class TableStore(Protocol):
    """One table's rows on one server, as the server uses them (:class:`.store.EmbeddingStore` documents each call).

    Attributes:
        dim: Embedding width.
        state_width: Optimizer state values per row.
        capacity: Rows the store can hold: a checkpoint's share of more is refused.
    """

    dim: int
    state_width: int
    capacity: int

    def __len__(self) -> int:
        """Rows held."""
        ...

    def lookup(
        self, ids: torch.Tensor, *, train: bool = True, distinct: bool = False, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """Rows ``[*ids.shape, dim]`` of ``ids``; ``train=True`` admits, inserts and evicts."""
        ...

    def read(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows as held, other ids as their initial value; nothing changes."""
        ...

    def assign(self, ids: torch.Tensor, weights: torch.Tensor) -> int:
        """Set the rows of the distinct ``ids``; returns the rows written."""
        ...

    def read_state(self, ids: torch.Tensor) -> torch.Tensor:
        """Optimizer state of the distinct ``ids`` as held, others' as new; nothing changes."""
        ...

    def assign_state(self, ids: torch.Tensor, state: torch.Tensor, start: int = 0) -> int:
        """Set optimizer state columns ``[start, start + state.shape[1])`` of the distinct ``ids``."""
        ...

    def update(
        self, ids: torch.Tensor, grads: torch.Tensor, *, distinct: bool = False, optimizer: RowOptimizer | None = None
    ) -> int:
        """Apply the optimizer (``optimizer``: this push's hyper-parameters) to the rows of ``ids``."""
        ...

    def seed(self, weights: torch.Tensor | None, state: torch.Tensor | None = None) -> None:
        """Start ids never held from row ``id mod len(weights)`` of ``weights``; None removes the seed."""
        ...

    def seeded(self) -> dict[str, torch.Tensor] | None:
        """The seed, or None."""
        ...

    def metrics(self) -> dict[str, int]:
        """Counters: at least ``rows``, ``capacity``, ``lookups``, ``misses``, ``inserts``, ``not_admitted``,
        ``evictions`` and ``updates``."""
        ...

    def resident_bytes(self) -> int:
        """The server memory the store's arrays take."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Every row held, in :meth:`.store.EmbeddingStore.state_dict`'s format (what checkpoints hold)."""
        ...

    def check_state_dict(self, state: dict[str, Any]) -> None:
        """Raise ``ValueError`` if :meth:`load_state_dict` would refuse ``state``; changes nothing."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace every row by ``state``'s."""
        ...

    def dirty_rows(self) -> int:
        """Rows :meth:`take_dirty` would return now."""
        ...

    def take_dirty(self, *, with_state: bool = False) -> dict[str, torch.Tensor]:
        """Rows changed and ids removed since the previous call (an incremental dump); clears both."""
        ...

    def mark_dirty(
        self, ids: torch.Tensor, removed: torch.Tensor | None = None, *, removals_complete: bool = True
    ) -> int:
        """Mark rows taken by a dump that failed to write dirty again; returns rows marked."""
        ...

    def close(self) -> None:
        """Release what outlives the process unless removed (a store's files); the store is not used after."""
        ...


def memory_store(config: TableConfig, index: int) -> EmbeddingStore:
    """The empty in-memory store of ``config``'s table on the server of index ``index``: ``config.capacity`` rows in
    its DDR (the ``ps`` tier's store, and the cache of stores built on one). Its admission draws are seeded
    ``config.seed + index``; an id's initial row depends on the table alone, not on the server."""
    return EmbeddingStore(
        config.dim,
        config.capacity,
        config.optimizer,
        init=config.init,
        eviction=config.eviction,
        admission_probability=config.admission_probability,
        clip=config.clip,
        seed=config.seed + index,
        eviction_chunk=config.eviction_chunk,
        weight_dtype=config.weight_dtype,
        # per-id initial rows: the same on whichever server holds the id, in whatever order ids arrive
        init_seed=config.init_seed,
    )
