"""A parameter-server table on the ``ssd`` tier: every row on local disk (:class:`.row_file.RowFile`), the recently
used ones cached in the server's DDR (an :class:`.store.EmbeddingStore` sized by the plan's ``cache_fraction``).

A training lookup first brings the batch's rows that are on disk but not cached into the cache (one block read
each), then runs the cache's own lookup: cached rows are hits, ids never seen are admitted and initialised as on the
``ps`` tier. The cache makes room by its eviction policy, and the rows it evicts are written back as a log: appended
together at the file's head in fresh blocks (one sequential write for a whole eviction, where writing each row in
place would read and write a block per row), their old slots left as garbage. The file has room for
:data:`persia_planner.placement.memory.SSD_LOG_SLACK` times the rows; when the head reaches its end the live rows are
compacted to its start (sequential reads and writes, once per as many evictions as there are rows). Updates go to the
cached row, or, for a row evicted since its lookup (asynchronous training pushes gradients up to K steps later), to
its row on disk in place, so no gradient is lost to the cache. The disk index (id -> disk slot, a
:class:`.index.HashIndex`, and each slot's id) stays in DDR, charged by
``persia_planner.placement.memory.ssd_bytes``.

Checkpoints hold every row: :meth:`SsdStore.state_dict` writes the cache back and reads the disk rows, so the
checkpoint format, its re-sharding and ``--resume`` are the ``ps`` tier's. Incremental dumps for serving replicas
are not offered: a row that leaves the cache is not gone, and the dumps' removals would say it is.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from persia_planner.modules.ps.index import HashIndex, as_ids, table_empty
from persia_planner.modules.ps.kernels import SLOT_BITS
from persia_planner.modules.ps.protocol import TableConfig
from persia_planner.modules.ps.row_file import RowFile
from persia_planner.modules.ps.ssd_files import remove_stale, scratch_name, this_process
from persia_planner.modules.ps.store import EmbeddingStore
from persia_planner.modules.ps.table_store import memory_store
from persia_planner.placement.memory import PS_INDEX_LOAD_FACTOR, ssd_file_slots, ssd_record_size

SLOT_MASK = int(SLOT_BITS)
_COMPACT_CHUNK_BYTES = 16 << 20  # rows moved at a time by a compaction
_NO_DUMPS = "incremental dumps are not offered for tables on the ssd tier (a row leaving the DDR cache is not removed)"

__all__ = ["SsdStore", "disk_store"]

log = logging.getLogger("persia_planner.modules.ps.server")  # the server's own log, as its other lines


def disk_store(config: TableConfig, index: int) -> SsdStore:
    """The ``ssd`` tier's store of ``config``'s table on the server of index ``index`` (its ``TierSpec.store``): a DDR
    cache of ``config.capacity`` rows (:func:`.table_store.memory_store`) over a new file of
    ``config.backing_rows`` rows (at least the cache's) in ``config.store_dir``. The file is named for the table, the
    server and this process, with a header saying it is this process's; files of ours that a dead server left are
    removed first (:mod:`.ssd_files`: only those, never another file)."""
    directory = Path(config.store_dir or tempfile.gettempdir())
    directory.mkdir(parents=True, exist_ok=True)
    for stale in remove_stale(directory, config.name, index):  # files of ours whose server was killed
        log.info("removed %s: a file of rows its dead server left", stale)
    owner = this_process()
    path = directory / scratch_name(config.name, index, owner.run)
    rows = max(config.backing_rows, config.capacity)  # 0: a disk of the cache's rows
    return SsdStore(memory_store(config, index), path, rows, header=owner.header())


class SsdStore:
    """Rows of one table on disk behind a DDR cache: a :class:`.table_store.TableStore` (built by :func:`disk_store`).

    Args:
        cache: The DDR cache (its capacity: the rows the plan caches on this server); its ``on_evict`` is taken.
        path: The file of rows (created: it must not exist; removed by :meth:`close`), of ``memory.ssd_file_slots``
            slots.
        disk_capacity: Rows the disk holds (at least the cache's capacity): caps the table's rows on this server.
        direct: Bypass the page cache (see :class:`.row_file.RowFile`).
        header: The file's header: who wrote it (see :class:`.row_file.RowFile`).
    """

    def __init__(
        self,
        cache: EmbeddingStore,
        path: str | os.PathLike,
        disk_capacity: int,
        *,
        direct: bool = True,
        header: bytes = b"",
    ):
        if disk_capacity < cache.capacity:
            raise ValueError(f"disk_capacity ({disk_capacity:,}) must hold the cache's {cache.capacity:,} rows")
        self.cache = cache
        cache.on_evict = self._write_back
        self.dim, self.state_width, self.capacity = cache.dim, cache.state_width, disk_capacity
        self.weight_dtype, self.optimizer = cache.weight_dtype, cache.optimizer
        record = ssd_record_size(cache.dim, cache.weight_dtype.itemsize, cache.state_width)
        slots = int(ssd_file_slots(disk_capacity, record))
        self.file = RowFile(path, slots, cache.dim, cache.weight_dtype, cache.state_width, direct=direct, header=header)
        self._disk_ids = table_empty(slots, dtype=torch.int64)  # the id each file slot was last written for
        self._disk_index = HashIndex(disk_capacity, PS_INDEX_LOAD_FACTOR, self._disk_ids)
        self._on_disk = 0  # live rows: ids in the disk index
        self._head = 0  # the log's next free slot
        self._metrics = dict.fromkeys(("disk_reads", "disk_writes", "disk_updates", "disk_full", "compactions"), 0)

    # ----------------------------------------------------------------------------------------------- queries

    def __len__(self) -> int:
        """Rows held: on disk, or cached and not yet written there."""
        slots, _ = self._disk_index.find(self.cache.held_rows()["ids"])
        return self._on_disk + int((slots < 0).sum())

    def contains(self, ids: torch.Tensor) -> torch.Tensor:
        slots, _ = self._disk_index.find(as_ids(ids))
        return (slots >= 0).reshape(ids.shape) | self.cache.contains(ids)

    def metrics(self) -> dict[str, int]:
        """The cache's counters, with ``rows`` and ``capacity`` of the whole table, ``cached_rows``, and the disk's:
        rows read into the cache, rows written back, updates applied on disk, rows dropped with the disk full, and
        the 4 KiB blocks read and written."""
        cache = self.cache.metrics()
        return {
            **cache, "rows": len(self), "capacity": self.capacity, "cached_rows": cache["rows"],
            "cache_capacity": self.cache.capacity, **self._metrics, **self.file.io,
        }  # fmt: skip

    def resident_bytes(self) -> int:
        """DDR the table takes: the cache's and the disk index's (the slots' ids as far as the log reached)."""
        index = self._disk_index.buckets.numel() * 8 + max(self._head, self._on_disk) * 8
        return self.cache.resident_bytes() + index

    def dirty_rows(self) -> int:
        return 0

    # ------------------------------------------------------------------------------------------ the disk side

    def _disk_slots(self, ids: torch.Tensor) -> torch.Tensor:
        slots, _ = self._disk_index.find(ids)
        return slots

    def _write_back(self, ids: torch.Tensor, weights: torch.Tensor, state: torch.Tensor) -> None:
        """Append evicted rows at the log's head in fresh blocks and point the index at them (new ids beyond the
        disk's rows are dropped and counted)."""
        _, buckets = self._disk_index.find(ids)
        held = buckets >= 0
        new = (~held).nonzero().squeeze(1)
        room = self.capacity - self._on_disk
        if new.numel() > room:
            self._metrics["disk_full"] += new.numel() - room
            keep = held.clone()
            keep[new[:room]] = True
            ids, weights, state, buckets, held = ids[keep], weights[keep], state[keep], buckets[keep], held[keep]
        k = ids.numel()
        if not k:
            return
        per_block = self.file.per_unit
        start = -(-self._head // per_block) * per_block  # a fresh block: written whole, never read first
        if start + k > self.file.capacity:
            self._compact()
            start = -(-self._head // per_block) * per_block
        slots = torch.arange(start, start + k)
        self.file.write(slots, weights, state, fresh=True)
        self._disk_ids[start : start + k] = ids
        self._disk_index.repoint(buckets[held], slots[held])
        self._disk_index.insert(ids[~held], slots[~held])
        self._on_disk += int((~held).sum())
        self._head = start + k
        self._metrics["disk_writes"] += k

    def _live_slots(self) -> torch.Tensor:
        """The file slots of the rows on disk, ascending."""
        words = self._disk_index.buckets
        return torch.sort(words[words >= 0] & SLOT_MASK).values

    def _compact(self) -> None:
        """Move the live rows to the file's start, in slot order, a chunk at a time: every row is read before the
        blocks it moves into are written (its new slot is at most its old one), and a chunk's partial last block is
        read and patched, so rows not yet moved stay intact."""
        live = self._live_slots()
        chunk = max(1, _COMPACT_CHUNK_BYTES // self.file.record)
        for at in range(0, live.numel(), chunk):
            old = live[at : at + chunk]
            weights, state = self.file.read(old)
            new = torch.arange(at, at + old.numel())
            self.file.write(new, weights, state)
            ids = self._disk_ids[old].clone()
            _, buckets = self._disk_index.find(ids)
            self._disk_index.repoint(buckets, new)
            self._disk_ids[new] = ids
        self._head = live.numel()
        self._metrics["compactions"] += 1

    def _bring_in(self, uniq: torch.Tensor) -> None:
        """Cache the rows of ``uniq`` (distinct) that are on disk and not cached, keeping the batch's cached rows."""
        cached = self.cache.contains(uniq)
        missing = uniq[~cached]
        if not missing.numel():
            return
        slots = self._disk_slots(missing)
        on_disk = slots >= 0
        if not bool(on_disk.any()):
            return
        weights, state = self.file.read(slots[on_disk])
        self.cache.insert_rows(missing[on_disk], weights, state, keep=uniq[cached])
        self._metrics["disk_reads"] += int(on_disk.sum())

    def _with_disk_rows(self, flat: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` (the cache's answer for ``flat``), with the rows of ids that are on disk and not cached read in."""
        off_cache = (~self.cache.contains(flat)).nonzero().squeeze(1)
        slots = self._disk_slots(flat[off_cache])
        on_disk = slots >= 0
        if bool(on_disk.any()):
            rows[off_cache[on_disk]] = self.file.read(slots[on_disk])[0].to(rows.dtype)
        return rows

    # ------------------------------------------------------------------------------------------ the requests

    @torch.no_grad()
    def lookup(
        self, ids: torch.Tensor, *, train: bool = True, distinct: bool = False, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """:meth:`.store.EmbeddingStore.lookup`, with rows on disk found as held rows."""
        flat = as_ids(ids)
        if train:
            self._bring_in(flat if distinct else torch.unique(flat))
            return self.cache.lookup(ids, train=True, distinct=distinct, dtype=dtype)
        rows = self.cache.lookup(ids, train=False, distinct=distinct, dtype=dtype)
        return self._with_disk_rows(flat, rows.reshape(flat.numel(), self.dim)).reshape(*ids.shape, self.dim)

    @torch.no_grad()
    def read(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows as held (cached or on disk), other ids as their initial value; nothing changes."""
        flat = as_ids(ids)
        rows = self.cache.read(ids).reshape(flat.numel(), self.dim)
        return self._with_disk_rows(flat, rows).reshape(*ids.shape, self.dim)

    @torch.no_grad()
    def assign(self, ids: torch.Tensor, weights: torch.Tensor) -> int:
        """Set the rows of the distinct ``ids`` (through the cache, as a training lookup brings them in)."""
        flat = as_ids(ids)
        self._bring_in(flat)
        return self.cache.assign(flat, weights)

    @torch.no_grad()
    def read_state(self, ids: torch.Tensor) -> torch.Tensor:
        """Optimizer state of the distinct ``ids`` as held (cached or on disk), others' as new; nothing changes."""
        flat = as_ids(ids)
        state = self.cache.read_state(flat)
        off_cache = (~self.cache.contains(flat)).nonzero().squeeze(1)
        slots = self._disk_slots(flat[off_cache])
        on_disk = slots >= 0
        if bool(on_disk.any()):
            state[off_cache[on_disk]] = self.file.read(slots[on_disk])[1]
        return state

    @torch.no_grad()
    def assign_state(self, ids: torch.Tensor, state: torch.Tensor, start: int = 0) -> int:
        """Set optimizer state columns of the distinct ``ids`` (through the cache, as :meth:`assign`)."""
        flat = as_ids(ids)
        self._bring_in(flat)
        return self.cache.assign_state(flat, state, start)

    @torch.no_grad()
    def update(self, ids: torch.Tensor, grads: torch.Tensor, *, distinct: bool = False, optimizer: Any = None) -> int:
        """Apply the optimizer (``optimizer``: this push's hyper-parameters, see
        :meth:`.store.EmbeddingStore.update`) to the rows of ``ids``: cached ones in the cache, the others on disk."""
        optimizer = self.cache.step_optimizer(optimizer)
        flat = as_ids(ids)
        grads = grads.reshape(flat.numel(), self.dim).to(torch.float32)
        if not distinct:
            flat, inverse = torch.unique(flat, return_inverse=True)
            grads = torch.zeros(flat.numel(), self.dim).index_add_(0, inverse, grads)
        cached = self.cache.contains(flat)
        done = self.cache.update(flat[cached], grads[cached], distinct=True, optimizer=optimizer)
        rest = (~cached).nonzero().squeeze(1)
        slots = self._disk_slots(flat[rest])
        on_disk = slots >= 0
        if bool(on_disk.any()):
            slots, rest = slots[on_disk], rest[on_disk]
            weights, state = self.file.read(slots)
            new_w, new_state = optimizer.step(weights.float(), state, grads[rest])
            if self.cache.clip is not None:
                new_w.clamp_(-self.cache.clip, self.cache.clip)
            self.file.write(slots, new_w, new_state)
            self._metrics["disk_updates"] += slots.numel()
            done += slots.numel()
        return done

    # -------------------------------------------------------------------------------------------- checkpoint

    def _flush(self) -> None:
        """Write every cached row to disk (the cache keeps them)."""
        rows = self.cache.held_rows()
        if rows["ids"].numel():
            self._write_back(rows["ids"], rows["weights"], rows["state"])

    def state_dict(self) -> dict[str, Any]:
        """Every row (the cache written back first): the :class:`.store.EmbeddingStore` format, so checkpoints,
        their re-sharding and ``--resume`` are the ``ps`` tier's. The rows are read whole (in DDR while saved)."""
        self._flush()
        slots = self._live_slots()
        weights, state = self.file.read(slots)
        return {"ids": self._disk_ids[slots].clone(), "weights": weights, "state": state, "step": self.cache.step}

    def check_state_dict(self, state: dict[str, Any]) -> None:
        n = as_ids(state["ids"]).numel()
        if n > self.capacity:
            raise ValueError(f"checkpoint has {n} rows, the disk holds {self.capacity}")
        self.cache.check_state_dict(state, rows_held=self.capacity)  # shapes, dtypes, distinct ids

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace every row by ``state``'s: all to disk, the cache emptied."""
        self.check_state_dict(state)
        ids = as_ids(state["ids"])
        n = ids.numel()
        self.cache.load_state_dict(
            {"ids": ids[:0], "weights": state["weights"][:0], "state": state["state"][:0], "step": state.get("step", 0)}
        )
        self._disk_ids[:n] = ids
        self._on_disk = self._head = n
        self._disk_index.rebuild(n)
        self.file.write(torch.arange(n), state["weights"], state["state"], fresh=True)

    def seed(self, weights: torch.Tensor | None, state: torch.Tensor | None = None) -> None:
        """:meth:`.store.EmbeddingStore.seed`: ids never held start from the seed's rows (the cache admits them)."""
        self.cache.seed(weights, state)

    def seeded(self) -> dict[str, torch.Tensor] | None:
        return self.cache.seeded()

    def take_dirty(self, *, with_state: bool = False) -> dict[str, torch.Tensor]:
        raise NotImplementedError(_NO_DUMPS)

    def mark_dirty(
        self, ids: torch.Tensor, removed: torch.Tensor | None = None, *, removals_complete: bool = True
    ) -> int:
        raise NotImplementedError(_NO_DUMPS)  # nothing was taken (take_dirty refuses)

    def close(self) -> None:
        """Remove the file of rows."""
        self.file.close()
