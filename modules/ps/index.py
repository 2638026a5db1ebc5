"""The id -> slot index of an :class:`~.store.EmbeddingStore`, and the allocation of the store's large arrays.

:class:`HashIndex` is a vectorised open-addressing hash table of int64 words, each a 40-bit slot number and a 23-bit
fingerprint of its id (linear probing, splitmix64 hash, about ``2 * capacity`` buckets = 16 B/row). A batch is
resolved in one compiled pass that probes the buckets alone and, a few ids behind, confirms each match against the
slot's id and records a training lookup's accesses (:func:`.kernels.find`): the fingerprint in the bucket spares the
probe a second random read that would depend on the first. Inserts claim buckets in one compiled pass too, in batch
order (:func:`.kernels.insert`); evictions leave tombstones that a vectorised rebuild clears. Ids are exact 64-bit
values: no collisions. The bucket word and the empty marker are the compiled probe's
(:data:`.kernels.EMPTY`, :data:`.kernels.SLOT_BITS`).
"""

from __future__ import annotations

import contextlib
import math
import mmap

import torch

from persia_planner.modules.hashing import MASK63, mix64_tensor
from persia_planner.modules.ps import kernels
from persia_planner.modules.ps.kernels import EMPTY, SLOT_BITS

__all__ = ["HUGE_PAGES_MIN_BYTES", "TOMBSTONE", "HashIndex", "as_ids", "hash_ids", "table_empty"]

TOMBSTONE = -2  # a bucket whose row was evicted: probes continue past it, inserts may reuse it
_SLOT_BITS = int(SLOT_BITS)


def hash_ids(ids: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser of the uint64 bit patterns, top bit cleared (:mod:`~persia_planner.modules.hashing`)."""
    return mix64_tensor(ids) & MASK63


def as_ids(ids: torch.Tensor) -> torch.Tensor:
    """Flatten to int64 holding the uint64 bit pattern (a torch.uint64 tensor is reinterpreted, not converted)."""
    if ids.dtype == torch.uint64:
        ids = ids.view(torch.int64)
    elif ids.dtype != torch.int64:
        raise TypeError(f"ids must be int64 (uint64 bit pattern) or uint64, got {ids.dtype}")
    return ids.reshape(-1)


# Arrays from this size on are mapped on huge pages (see table_empty); read at each call, so tests can move it.
HUGE_PAGES_MIN_BYTES = 32 << 20


def table_empty(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(*shape, dtype=dtype)`` for the store's per-row arrays and index, on transparent huge pages.

    Why: a lookup touches these arrays at random (a bucket, the slot's record and its row per id); with
    4 KiB pages nearly every such access also misses the TLB. The memory is an anonymous private mapping advised
    ``MADV_HUGEPAGE`` (honoured where ``/sys/kernel/mm/transparent_hugepage/enabled`` says ``madvise`` or ``always``;
    elsewhere the advice is ignored and these are ordinary pages): like ``torch.empty``, untouched capacity stays
    unbacked, now in steps of 2 MiB. Arrays under 32 MiB keep torch's allocator.
    """
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if nbytes < HUGE_PAGES_MIN_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(*shape, dtype=dtype)
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # a kernel without transparent huge pages: ordinary pages
        memory.madvise(mmap.MADV_HUGEPAGE)
    # frombuffer keeps the mapping alive as long as the tensor (or a view of it) lives.
    return torch.frombuffer(memory, dtype=dtype, count=numel).view(*shape)


class HashIndex:
    """Open-addressing (linear probing) table from id to slot, every operation vectorised over a batch.

    A bucket is one int64 word: ``fingerprint << 40 | slot`` for a held id (the fingerprint is the top 23 bits of the
    id's 63-bit hash, so the word is >= 0; :data:`~.kernels.SLOT_WIDTH`), :data:`~.kernels.EMPTY` (-1) or
    :data:`TOMBSTONE` (-2). The id itself is read from the store's slot ids only to confirm a fingerprint match, a
    few ids after the probe (see :func:`.kernels.find`), so the probe reads one random cache line per id and never
    waits for a second that depends on it; a bucket costs 8 B. Invariant: ``live + tombstones < buckets`` (there is
    always an empty bucket), so every probe sequence terminates; :meth:`needs_rebuild` keeps the filled fraction <=
    ``max_fill``.
    """

    def __init__(self, capacity: int, load_factor: float, slot_ids: torch.Tensor) -> None:
        self.n_buckets = max(math.ceil(capacity / load_factor), capacity + 1)
        self.buckets = table_empty(self.n_buckets, dtype=torch.int64).fill_(EMPTY)
        self.slot_ids = slot_ids
        self.tombstones = 0
        self.max_fill = (1.0 + load_factor) / 2  # rebuild once tombstones take half the slack

    def find(
        self, ids: torch.Tensor, *, touch: tuple[torch.Tensor, torch.Tensor, int, torch.Tensor | None] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot and bucket of each id, ``-1`` for both where absent. ``ids`` may repeat (not with ``touch``).

        One compiled pass (:func:`.kernels.find`, which also takes ``touch``): the probe is per-id branching that
        tensor ops need several passes and rounds for.
        """
        return kernels.find(self.buckets, self.slot_ids, ids, touch=touch)

    def insert(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """Insert distinct ids known to be absent, pointing at ``slots`` (one compiled pass, :func:`.kernels.insert`:
        each id takes the first bucket from its home on that holds no id, reusing tombstones)."""
        self.tombstones -= kernels.insert(self.buckets, ids, slots)

    def slots_at(self, buckets: torch.Tensor) -> torch.Tensor:
        """The slots that occupied ``buckets`` point to (int64)."""
        return self.buckets.index_select(0, buckets) & _SLOT_BITS

    def repoint(self, buckets: torch.Tensor, slots: torch.Tensor) -> None:
        """Point the occupied ``buckets`` at new ``slots`` (their ids' rows moved), keeping the fingerprints."""
        self.buckets[buckets] = (self.buckets.index_select(0, buckets) & ~_SLOT_BITS) | slots.to(torch.int64)

    def remove_buckets(self, buckets: torch.Tensor) -> None:
        """Tombstone the given occupied buckets."""
        self.buckets[buckets] = TOMBSTONE
        self.tombstones += buckets.numel()

    def needs_rebuild(self, live: int) -> bool:
        """Whether ``live`` rows and the tombstones fill more than ``max_fill`` of the buckets."""
        return live + self.tombstones > self.max_fill * self.n_buckets

    def rebuild(self, live: int) -> None:
        """Drop all tombstones by re-inserting the ``live`` occupied slots ``[0, live)``."""
        self.buckets.fill_(EMPTY)
        self.tombstones = 0
        self.insert(self.slot_ids[:live], torch.arange(live))
