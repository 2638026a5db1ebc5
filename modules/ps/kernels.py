"""Compiled inner loops of the parameter server's request path (numba), where tensor ops cost several passes.

Two loops dominate a lookup once the transport is cheap, and both are per-id work with data-dependent branches that
tensor ops can only express as several full passes (hash, gather, compare, then rounds for the collisions):

* :func:`dedup`, on the client, of every lookup and push batch: a hash set over the batch in one pass. 64k Zipf ids
  on this 2-core VM: 0.34 ms, against 1.2-2.0 ms for an argsort-based ``unique`` (numpy's, already the faster one)
  and 1.5 ms for ``torch.unique``.
* :func:`find`, on the server, of every request: the store's open-addressing probe (the same hash, bucket layout and
  linear probing as :class:`.store.EmbeddingStore`'s index, so inserts made with tensor ops stay findable) in one
  pass: 26k ids in a 10M-row table 0.19 ms against 0.69 ms in probe rounds of tensor ops.

numba compiles each loop on its first call and caches the machine code next to this file (``cache=True``), so later
processes load it in milliseconds; ``nogil=True`` lets the RPC agent's other threads run meanwhile. Inputs are
numpy views of the tensors (no copies).
"""

from __future__ import annotations

import numba
import numpy as np
import torch

__all__ = ["dedup", "find", "touch"]

_EMPTY = -1  # must match store._EMPTY: a bucket that ends a probe sequence
_INT32_MAX = 2**31 - 1
_MASK63 = np.uint64(0x7FFFFFFFFFFFFFFF)


@numba.njit(cache=True, nogil=True, inline="always")
def _splitmix63(key: np.int64) -> np.int64:
    # splitmix64's finaliser on the uint64 bit pattern, top bit cleared: store._hash, element by element.
    x = np.uint64(key)
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    return np.int64(x & _MASK63)


@numba.njit(cache=True, nogil=True)
def _find(buckets, slot_ids, ids, slots, where):  # pragma: no cover - compiled
    n_buckets = buckets.shape[0]
    for i in range(ids.shape[0]):
        key = ids[i]
        p = _splitmix63(key) % n_buckets
        while True:
            b = buckets[p]
            if b == _EMPTY:
                slots[i] = -1
                where[i] = -1
                break
            if b >= 0 and slot_ids[b] == key:  # a tombstone (-2) never matches and the probe goes on
                slots[i] = b
                where[i] = p
                break
            p += 1
            if p == n_buckets:
                p = 0


def find(buckets: torch.Tensor, slot_ids: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot and bucket of each id in an open-addressing index (``-1`` for both where absent); ids may repeat.

    Args:
        buckets: int32 ``[n_buckets]``: a slot number, ``-1`` (empty: ends a probe) or ``-2`` (tombstone).
        slot_ids: int64 ``[capacity]``: the id held by each slot.
        ids: int64 ``[n]`` (uint64 bit patterns), contiguous.

    Returns:
        ``(slots, buckets)``, int64 ``[n]`` each.
    """
    slots = torch.empty(ids.numel(), dtype=torch.int64)
    where = torch.empty(ids.numel(), dtype=torch.int64)
    if ids.numel():
        _find(buckets.numpy(), slot_ids.numpy(), ids.contiguous().numpy(), slots.numpy(), where.numpy())
    return slots, where


@numba.njit(cache=True, nogil=True)
def _touch(slots, last, count, step, counts, has_counts):  # pragma: no cover - compiled
    for i in range(slots.shape[0]):
        s = slots[i]
        if s >= 0:
            last[s] = step
            c = np.int64(count[s]) + (counts[i] if has_counts else 1)
            count[s] = min(c, _INT32_MAX)


def touch(
    slots: torch.Tensor, last: torch.Tensor, count: torch.Tensor, step: int, counts: torch.Tensor | None = None
) -> None:
    """Record a training lookup's accesses: ``last[s] = step`` and ``count[s] += counts[i]`` (1 without ``counts``,
    saturating at int32 max) for every held slot ``s = slots[i] >= 0``; slots must not repeat.

    One pass instead of the five tensor ops (gather, add, clamp, cast, scatter) of the LRU/LFU bookkeeping.
    """
    if slots.numel() == 0:
        return
    has_counts = counts is not None
    held = slots.contiguous().numpy()
    per_id = counts.contiguous().numpy() if has_counts else held  # an unused int64 array otherwise
    _touch(held, last.numpy(), count.numpy(), step, per_id, has_counts)


@numba.njit(cache=True, nogil=True)
def _dedup(ids, uniq, inverse, bits):  # pragma: no cover - compiled
    n = ids.shape[0]
    mask = (1 << bits) - 1
    shift = np.uint64(64 - bits)  # the multiplicative hash keeps the top `bits` bits: a slot of the table
    table = np.full(mask + 1, -1, np.int64)
    count = 0
    for i in range(n):
        key = ids[i]
        p = np.int64((np.uint64(key) * np.uint64(0x9E3779B97F4A7C15)) >> shift)
        while True:
            j = table[p]
            if j < 0:
                table[p] = count
                uniq[count] = key
                inverse[i] = count
                count += 1
                break
            if uniq[j] == key:
                inverse[i] = j
                break
            p = (p + 1) & mask
    return count


def dedup(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct ids of a flat int64 tensor, in order of first occurrence, and ``inverse`` (``uniq[inverse] ==
    ids``): what ``torch.unique(ids, sorted=False, return_inverse=True)`` means, in one hash-set pass.

    The order of first occurrence is deterministic (the same batch always gives the same order), which is all the
    servers need: they accept distinct ids in any order.
    """
    flat = ids.reshape(-1).contiguous()
    uniq = torch.empty(flat.numel(), dtype=torch.int64)
    inverse = torch.empty(flat.numel(), dtype=torch.int64)
    if flat.numel() == 0:
        return uniq, inverse
    bits = max(4, (2 * flat.numel() - 1).bit_length())  # a table of at least twice the batch: short probes
    count = _dedup(flat.numpy(), uniq.numpy(), inverse.numpy(), bits)
    return uniq[:count].clone(), inverse
