"""The rows of one store table in preallocated per-slot arrays: where they live, and what changed since a dump.

Rows live in preallocated tensors and the occupied slots are always the prefix ``[0, len)``: removing rows moves the
rows above the new end into the holes below it (:meth:`RowSlots.remove`), so no free list is needed. Ids are found
through an exact open-addressing hash index (:class:`.index.HashIndex`, no collisions). Per row: a 16-byte record (id 8
+ last access 4 + count 4: confirming the id and recording the access touch one cache line) + index 16 + dirty flag
1 B on top of the weights and the optimizer state: dim 64 + row-wise Adagrad = 293 B against 260 B raw. The planner
restates this layout (``persia_planner.placement.memory.ps_store_bytes``).

Incremental dumps (for serving replicas, see :mod:`.deltas`) use a dirty mask: one bool per slot (1 B/row, allocated
zeroed), set when a row is inserted or written and cleared by :meth:`RowSlots.take_dirty`, and the log of the ids
removed since (:class:`.eviction.EvictionLog`).

Which ids get a row, which rows go and how they learn is the store's (:class:`.store.EmbeddingStore`); this module only
keeps the rows.
"""

from __future__ import annotations

from typing import Any

import torch

from persia_planner.modules.ps.eviction import EvictionLog
from persia_planner.modules.ps.index import HashIndex, as_ids, table_empty

__all__ = ["RowSlots"]

_INT32_MAX = 2**31 - 1


class RowSlots:
    """``capacity`` slots of ``weights [dim]`` (in ``weight_dtype``) + float32 optimizer ``state [state_width]`` +
    a record (id, last access, access count) + a dirty flag, the occupied ones the prefix ``[0, len)``.

    The arrays are public for the store, which reads and writes rows of them by slot: ``ids``, ``last`` (the training
    lookup batch of the slot's last access, int32), ``count`` (its access count, int32, saturating), ``weights``,
    ``state``, ``dirty``, and the hash ``index`` of the occupied slots' ids.

    Args:
        capacity: Slots.
        dim: Embedding width.
        state_width: Optimizer state values per row.
        weight_dtype: The dtype the weights are kept in.
        index_load_factor: Live rows per hash bucket at full capacity.
    """

    def __init__(
        self, capacity: int, dim: int, state_width: int, weight_dtype: torch.dtype, index_load_factor: float
    ) -> None:
        self.capacity, self.dim, self.state_width = capacity, dim, state_width
        # One 16-byte record per slot: its id, the training lookup batch of its last access, its access count
        # (saturating at int32 max). A lookup's probe reads the id and records the access in the same cache line,
        # instead of three lines of three arrays, one random read per id instead of three. Views give the three columns.
        self.records = table_empty(capacity, 2, dtype=torch.int64)
        self.ids = self.records[:, 0]
        self.last = self.records.view(torch.int32)[:, 2]
        self.count = self.records.view(torch.int32)[:, 3]
        self.weights = table_empty(capacity, dim, dtype=weight_dtype)
        self.state = table_empty(capacity, state_width, dtype=torch.float32)
        # Rows inserted or written since the last take_dirty(). Keyed by slot, not id: a slot that is evicted and
        # handed to a new id is dirty for the new id, so an evicted id never shows up in a dump.
        self.dirty = torch.zeros(capacity, dtype=torch.bool)
        self.index = HashIndex(capacity, index_load_factor, self.ids)
        self._n = 0
        # Ids removed since the last take_dirty(), for the deltas' removals; it runs from the first take_dirty(),
        # snapshot() or restore() on: slots never dumped, checkpointed nor loaded keep no log.
        self.evicted = EvictionLog(capacity, self.index)

    def __len__(self) -> int:
        return self._n

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """The slots of the flat int64 ``ids``, -1 where not held (read-only)."""
        return self.index.find(ids)[0]

    def held(self) -> dict[str, torch.Tensor]:
        """``ids``, ``weights`` and ``state`` of the occupied slots: views, valid until the rows next change."""
        n = self._n
        return {"ids": self.ids[:n], "weights": self.weights[:n], "state": self.state[:n]}

    def arrays(self) -> dict[str, torch.Tensor]:
        """Every array allocated, by role: the per-slot ``records``, ``weights``, ``state`` and ``dirty`` (``capacity``
        rows each, resident as rows are inserted) and the hash ``index`` (written whole at creation)."""
        return {
            "records": self.records,
            "weights": self.weights,
            "state": self.state,
            "dirty": self.dirty,
            "index": self.index.buckets,
        }

    def resident_bytes(self) -> int:
        """Bytes of :meth:`arrays` that hold data: the per-slot arrays up to the rows held (occupied slots are
        always the prefix ``[0, len)``), the dirty mask and the hash index whole (both written at creation).

        Untouched capacity costs no resident memory (see :func:`.index.table_empty`), so this is the store's own
        account of what a server's resident memory grows by (``persia_planner.modules.tools.memory_audit`` sets the
        two side by side).
        """
        held = 0
        for role, array in self.arrays().items():
            nbytes = array.numel() * array.element_size()
            held += nbytes if role in ("dirty", "index") else nbytes * self._n // self.capacity
        return held

    def append(
        self, ids: torch.Tensor, weights: torch.Tensor, state: torch.Tensor, step: int, counts: torch.Tensor
    ) -> torch.Tensor:
        """Put the new distinct ``ids`` (none held, and room for them) in the next free slots with their ``weights``,
        ``state``, last access ``step`` and access ``counts``, marked dirty; returns their slots."""
        k = ids.numel()
        slots = torch.arange(self._n, self._n + k)
        self._n += k
        self.ids.index_copy_(0, slots, ids)
        self.weights.index_copy_(0, slots, weights.to(self.weights.dtype))
        self.state.index_copy_(0, slots, state.to(torch.float32))
        self.last[slots] = step
        self.count[slots] = counts.clamp(max=_INT32_MAX).int()
        self.dirty[slots] = True
        if self.index.needs_rebuild(self._n):
            self.index.rebuild(self._n)  # clears the tombstones and indexes the new ids with the rest
        else:
            self.index.insert(ids, slots)
        return slots

    def remove(self, victims: torch.Tensor, batch_slots: torch.Tensor) -> None:
        """Remove the rows of the distinct occupied slots ``victims`` (logging their ids as evicted), then move the
        rows above the new end into the holes below it, so the occupied slots stay the prefix; the index and
        ``batch_slots`` (a batch's slots, -1 where not held; updated in place) follow the moved rows."""
        live, n_victims = self._n, victims.numel()
        _, buckets = self.index.find(self.ids[victims])
        self.index.remove_buckets(buckets)
        if self.evicted.running:
            self.evicted.add(self.ids.index_select(0, victims))
        end = live - n_victims
        # Holes below the new end are filled by the survivors above it (the two sets have the same size).
        holes = victims[victims < end]
        above = torch.ones(n_victims, dtype=torch.bool)
        above[victims[victims >= end] - end] = False
        movers = torch.arange(end, live)[above]
        if movers.numel():
            _, mover_buckets = self.index.find(self.ids[movers])
            for rows in (self.records, self.weights, self.state, self.dirty):
                rows.index_copy_(0, holes, rows.index_select(0, movers))
            self.index.repoint(mover_buckets, holes)
            # The batch's slots that moved: map old slot -> new slot through the movers (ascending by construction).
            at = torch.searchsorted(movers, batch_slots).clamp_(max=movers.numel() - 1)
            moved = movers[at] == batch_slots
            batch_slots[moved] = holes[at[moved]]
        self.dirty[end:live] = False
        self._n = end

    # -------------------------------------------------------------------------------------------- checkpoint

    def snapshot(self) -> dict[str, torch.Tensor]:
        """Copies of the occupied slots: ``ids``, ``weights``, ``state``, ``last_access``, ``count``.

        Starts the eviction log if it is not running yet: a replica may start from these rows, so the next
        :meth:`take_dirty` must list what is removed from here on.
        """
        self.evicted.start()
        n = self._n
        return {
            "ids": self.ids[:n].clone(),
            "weights": self.weights[:n].clone(),
            "state": self.state[:n].clone(),
            "last_access": self.last[:n].clone(),
            "count": self.count[:n].clone(),
        }

    def check(self, rows: dict[str, Any], *, rows_held: int | None = None) -> None:
        """Raise ``ValueError`` if :meth:`restore` would refuse ``rows`` (more rows than the capacity, another dim or
        optimizer state width, repeated ids); changes nothing. ``rows_held``: the rows a store built on these slots
        holds in their place (a disk tier's), instead of the capacity."""
        ids = as_ids(rows["ids"])
        n = ids.numel()
        if n > (self.capacity if rows_held is None else rows_held):
            raise ValueError(f"checkpoint has {n} rows, capacity is {self.capacity}")
        if tuple(rows["weights"].shape) != (n, self.dim):
            raise ValueError(f"weights shape {tuple(rows['weights'].shape)} != ({n}, {self.dim})")
        if tuple(rows["state"].shape) != (n, self.state_width):
            raise ValueError(f"optimizer state shape {tuple(rows['state'].shape)} != ({n}, {self.state_width})")
        for key in ("last_access", "count"):  # optional (older checkpoints); checked so a load cannot fail halfway
            if key in rows:
                value = rows[key]
                if tuple(value.shape) != (n,) or value.dtype.is_floating_point or value.dtype == torch.bool:
                    got = f"{value.dtype} {tuple(value.shape)}"
                    raise ValueError(f"{key} must be an integer tensor of shape ({n},), got {got}")
        if torch.unique(ids).numel() != n:
            raise ValueError("checkpoint ids are not distinct")

    def restore(self, rows: dict[str, Any]) -> None:
        """Replace the contents by ``rows`` (a :meth:`snapshot`, checked by :meth:`check` first), weights converted
        to the slots' dtype; nothing is dirty then, and the eviction log restarts."""
        self.check(rows)
        ids = as_ids(rows["ids"])
        n = ids.numel()
        self.ids[:n] = ids
        self.weights[:n] = rows["weights"]
        self.state[:n] = rows["state"]
        self.last[:n] = rows.get("last_access", torch.zeros(n, dtype=torch.int32))
        self.count[:n] = rows.get("count", torch.zeros(n, dtype=torch.int32))
        self._n = n
        self.index.rebuild(n)
        # The loaded rows are the new base a replica starts from, so nothing is dirty or removed relative to it.
        self.dirty.zero_()
        # ... and a replica may start from them, so evictions from here on are logged for the next dump.
        self.evicted.restart()

    # -------------------------------------------------------------------------------------- incremental dumps

    def dirty_rows(self) -> int:
        """How many rows :meth:`take_dirty` would return now."""
        return int(self.dirty[: self._n].sum())

    def take_dirty(self, *, with_state: bool = False) -> dict[str, torch.Tensor]:
        """Rows inserted or updated since the previous call (or construction / :meth:`restore`), as copies,
        and the ids evicted since then that the store no longer holds.

        Clears the dirty mask and the eviction log. Lookup hits that only refresh LRU/LFU metadata do not make a row
        dirty; an evicted id is never among the rows (its slot now belongs to another id).

        Evictions are logged from the first call, :meth:`snapshot` or :meth:`restore` on, within a bound
        (:class:`.eviction.EvictionLog`); past it the next call says so (``removals_complete`` false).

        Args:
            with_state: Also return the optimizer state of the rows (needed to resume training, not to serve).

        Returns:
            ``{"ids": int64 [k], "weights": [k, dim] (the weight dtype), "removed": int64 [r], "removals_complete":
            bool []}`` plus ``"state": [k, state_width]`` if asked. ``removed`` is sorted and disjoint from ``ids``.
        """
        slots = self.dirty[: self._n].nonzero().squeeze(1)
        out = {"ids": self.ids.index_select(0, slots), "weights": self.weights.index_select(0, slots)}
        if with_state:
            out["state"] = self.state.index_select(0, slots)
        out["removed"], complete = self.evicted.take()
        out["removals_complete"] = torch.tensor(complete)
        self.dirty[slots] = False
        return out

    def mark_dirty(
        self, ids: torch.Tensor, removed: torch.Tensor | None = None, *, removals_complete: bool = True
    ) -> int:
        """Mark the held rows of ``ids`` dirty again and log ``removed`` as evicted again (e.g. after a dump that
        failed to write, so the next dump still carries both); returns rows marked.

        ``removals_complete=False`` (what the failed :meth:`take_dirty` said) marks the log incomplete again, so
        the next dump does not claim a full list of removals it never had.
        """
        slots = self.find(as_ids(ids))
        slots = slots[slots >= 0]
        self.dirty[slots] = True
        self.evicted.put_back(removed, complete=removals_complete)
        return slots.numel()
