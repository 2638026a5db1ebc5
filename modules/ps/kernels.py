"""Compiled inner loops of the parameter server's request path (numba), where tensor ops cost several passes.

Two loops dominate a lookup once the transport is cheap, and both are per-id work with data-dependent branches that
tensor ops can only express as several full passes (hash, gather, compare, then rounds for the collisions):

* :func:`dedup`, on the client, of every lookup and push batch: a hash set over the batch in one pass, where an
  argsort-based ``unique`` (numpy's or ``torch.unique``) sorts the whole batch
  ([decision 0016](../../docs/decisions/0016-client-dedup-hash-set.md)).
* :func:`find`, on the server, of every request: the store's open-addressing probe (the same hash, bucket layout and
  linear probing as :class:`.index.HashIndex`, so inserts made with tensor ops stay findable). Buckets
  carry a fingerprint of their id, so the probe reads one random cache line per id, prefetched ahead; each match is
  confirmed against the slot's id a few ids later (that record prefetched meanwhile), and a training lookup's LRU/LFU
  bookkeeping is written into the record's line then.
  Probe rounds of tensor ops take several times as long.

The gathers: :func:`take_rows`, the server's, reads the rows of the found slots (``index_select``, zero rows for
absent ids), and :func:`take_rows_half` rounds them to float16 for a float16 wire, range check included;
:func:`gather_rows`, the client's expansion of the distinct rows to the batch's order, is ``index_select``'s result
written with non-temporal (streaming) stores, widening float16 rows on the way. Prefetches, streaming stores and the
vector float16 conversions come from LLVM through small numba intrinsics (``llvm.prefetch``, a store marked
``!nontemporal``, ``fptrunc``/``fpext``), so there is no C extension to build.

numba compiles each loop on its first call and caches the machine code next to this file (``cache=True``), so later
processes load it in milliseconds; ``nogil=True`` lets the RPC agent's other threads run meanwhile. Inputs are
numpy views of the tensors (no copies).
"""

from __future__ import annotations

import math

import numba
import numpy as np

# numba's argument typing reads ``np.ma.MaskedArray`` on every call, and numpy 2 imports ``numpy.ma`` on first
# access. Two RPC threads making that first access together can recurse in numpy's module ``__getattr__`` until
# RecursionError (seen once in CI, on a server's first lookup); importing it here, before any thread, closes the race.
import numpy.ma
import torch
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from persia_planner.modules.hashing import GOLDEN_GAMMA, MASK63, mix64_scalar

__all__ = [
    "EMPTY",
    "F16C",
    "FLOAT16_OVERFLOW",
    "SLOT_BITS",
    "SLOT_WIDTH",
    "STREAM_MIN_BYTES",
    "dedup",
    "find",
    "gather_rows",
    "insert",
    "rows_in",
    "take_rows",
    "take_rows_half",
]

# The smallest magnitude that float16 rounds to inf (the midpoint between 65504 and 2**16, rounded to even).
FLOAT16_OVERFLOW = 65520.0

EMPTY = -1  # a bucket never used since the last rebuild: ends a probe sequence (the index fills with it)
_INT32_MAX = 2**31 - 1
_MASK63 = np.uint64(MASK63)


@numba.njit(cache=True, nogil=True, inline="always")
def _splitmix63(key: np.int64) -> np.int64:
    # splitmix64's finaliser on the uint64 bit pattern, top bit cleared: index.hash_ids, element by element.
    return np.int64(mix64_scalar(np.uint64(key)) & _MASK63)


@intrinsic
def _prefetch(typingctx, array, at):  # pragma: no cover - compiled
    """Ask the CPU to load ``array[at]``'s cache line (``llvm.prefetch``: read, keep in all levels); never faults.
    ``array`` is 1-D, contiguous or strided (a column of a table of records)."""
    sig = types.void(array, at)

    def codegen(context, builder, signature, args):
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        byte_ptr = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [byte_ptr, i32, i32, i32]), "llvm.prefetch.p0"
        )
        at = context.cast(builder, args[1], signature.args[1], types.intp)
        address = builder.bitcast(cgutils.get_item_pointer(context, builder, aryty, ary, [at]), byte_ptr)
        builder.call(fn, [address, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return sig, codegen


_AHEAD = 8  # rows between a prefetch and its use in the gathers
_PROBE_AHEAD = 32  # ids between a home bucket's prefetch and its probe (one stage: no dependent read to wait for)
# A held bucket's word: the top 23 bits of its id's 63-bit hash (the fingerprint) above its slot's 40 bits. 2**40 slots
# let one store hold a trillion rows (a 12 TB server holds ~10**11 fp16 dim-64 rows); 23 bits of fingerprint still
# send all but one in 8 million non-matching probes past without reading the slot's id.
SLOT_WIDTH = 40
SLOT_BITS = np.int64((1 << SLOT_WIDTH) - 1)


@numba.njit(cache=True, nogil=True)
def _probe_exact(buckets, slot_ids, key, fingerprint, p):  # pragma: no cover - compiled
    # The linear probe from bucket p on, every fingerprint match confirmed against the slot's id: (slot, bucket),
    # (-1, -1) if absent. Only after a match that the confirmation refuted (two ids alike in 23 bits of hash).
    n_buckets = buckets.shape[0]
    while True:
        b = buckets[p]
        if b == EMPTY:
            return -1, -1
        if b >= 0 and (b >> SLOT_WIDTH) == fingerprint and slot_ids[b & SLOT_BITS] == key:
            return b & SLOT_BITS, p
        p += 1
        if p == n_buckets:
            p = 0


_CONFIRM_PREFETCH = 16  # ids between a probe and the prefetch of its slot's record
_CONFIRM_AT = 32  # ids between a probe and the confirmation of its match (the record has arrived by then)


@numba.njit(cache=True, nogil=True)
def _find(buckets, slot_ids, ids, slots, where, last, count, step, counts, touch):  # pragma: no cover - compiled
    # Three streams of independent random reads in one loop, each far enough ahead of its use: the home bucket of id
    # i + _PROBE_AHEAD is prefetched; id i is probed, reading buckets only (fingerprint and slot in one word); the
    # record of id i - _CONFIRM_PREFETCH's slot is prefetched; and the match of id i - _CONFIRM_AT is confirmed
    # against its slot's id, writing a training lookup's bookkeeping into the same line. Comparing the slot's id in
    # the probe itself is a second random read that waits for the first, one id at a time (decision 0005).
    # touch: 0 none, 1 one access per id, 2 counts[i] accesses.
    n_buckets = buckets.shape[0]
    n = ids.shape[0]
    for i in range(n):
        where[i] = _splitmix63(ids[i]) % n_buckets  # home buckets first: `where` doubles as the pipeline's queue
    for i in range(-_PROBE_AHEAD, n + _CONFIRM_AT):
        ahead = i + _PROBE_AHEAD
        if ahead < n:
            _prefetch(buckets, where[ahead])
        if 0 <= i < n:
            fingerprint = _splitmix63(ids[i]) >> SLOT_WIDTH
            p = where[i]
            while True:
                b = buckets[p]
                if b == EMPTY:
                    slots[i] = -1
                    where[i] = -1
                    break
                if b >= 0 and (b >> SLOT_WIDTH) == fingerprint:  # a tombstone (-2) never matches and the probe goes on
                    slots[i] = b & SLOT_BITS
                    where[i] = p
                    break
                p += 1
                if p == n_buckets:
                    p = 0
        j = i - _CONFIRM_PREFETCH
        if 0 <= j < n and slots[j] >= 0:
            _prefetch(slot_ids, slots[j])
        k = i - _CONFIRM_AT
        if k < 0 or slots[k] < 0:
            continue
        s = slots[k]
        key = ids[k]
        if slot_ids[s] != key:  # another id with the same fingerprint: probe on past it, confirming every match
            p = where[k] + 1
            s, p = _probe_exact(buckets, slot_ids, key, _splitmix63(key) >> SLOT_WIDTH, 0 if p == n_buckets else p)
            slots[k] = s
            where[k] = p
            if s < 0:
                continue
        if touch:
            last[s] = step
            c = np.int64(count[s]) + (counts[k] if touch == 2 else 1)
            count[s] = min(c, _INT32_MAX)


_NO_INT32 = np.empty(0, np.int32)
_NO_INT64 = np.empty(0, np.int64)


def find(
    buckets: torch.Tensor,
    slot_ids: torch.Tensor,
    ids: torch.Tensor,
    *,
    touch: tuple[torch.Tensor, torch.Tensor, int, torch.Tensor | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot and bucket of each id in an open-addressing index (``-1`` for both where absent); ids may repeat.

    Args:
        buckets: int64 ``[n_buckets]``: ``fingerprint << SLOT_WIDTH | slot`` where held (the fingerprint is the top
            23 bits of the id's 63-bit hash), ``-1`` (empty: ends a probe) or ``-2`` (tombstone).
        slot_ids: int64 ``[capacity]``: the id held by each slot (may be a strided column of per-slot records).
        ids: int64 ``[n]`` (uint64 bit patterns), contiguous.
        touch: ``(last, count, step, counts)`` to record a training lookup's accesses in the same pass:
            ``last[s] = step`` and ``count[s] += counts[i]`` (1 where ``counts`` is None; saturating at int32 max)
            for every slot ``s`` found. int32 ``[capacity]`` each, possibly strided; ids must then not repeat.
            Stored beside the slot's id (:class:`.store.EmbeddingStore` keeps all three in one 16-byte record),
            the write hits the cache line that confirming the id just read.

    Returns:
        ``(slots, buckets)``, int64 ``[n]`` each.
    """
    slots = torch.empty(ids.numel(), dtype=torch.int64)
    where = torch.empty(ids.numel(), dtype=torch.int64)
    if not ids.numel():
        return slots, where
    if touch is None:
        last, count, step, counts, mode = _NO_INT32, _NO_INT32, 0, _NO_INT64, 0
    else:
        last_t, count_t, step, per_id = touch
        last, count = last_t.numpy(), count_t.numpy()
        counts, mode = (_NO_INT64, 1) if per_id is None else (per_id.contiguous().numpy(), 2)
    _find(
        buckets.numpy(), slot_ids.numpy(), ids.contiguous().numpy(), slots.numpy(), where.numpy(),
        last, count, step, counts, mode,
    )  # fmt: skip
    return slots, where


@numba.njit(cache=True, nogil=True)
def _insert(buckets, ids, slots):  # pragma: no cover - compiled
    # Each id claims the first bucket from its home on that holds no id (empty, or a tombstone); returns the
    # tombstones reused.
    n_buckets = buckets.shape[0]
    reused = 0
    for i in range(ids.shape[0]):
        h = _splitmix63(ids[i])
        p = h % n_buckets
        while buckets[p] >= 0:
            p += 1
            if p == n_buckets:
                p = 0
        if buckets[p] != EMPTY:
            reused += 1
        buckets[p] = ((h >> SLOT_WIDTH) << SLOT_WIDTH) | slots[i]
    return reused


def insert(buckets: torch.Tensor, ids: torch.Tensor, slots: torch.Tensor) -> int:
    """Point the distinct ``ids``, none held, at ``slots`` in an open-addressing index (:func:`find`'s layout), in one
    compiled pass; returns the tombstones their buckets reused. Where rounds of tensor ops claim buckets, a store's
    cache under churn (the ``ssd`` tier's: hundreds of inserts a request into a few thousand buckets) spent more time
    in their per-round overheads than in everything else it does."""
    if ids.numel():
        return int(_insert(buckets.numpy(), ids.contiguous().numpy(), slots.to(torch.int64).contiguous().numpy()))
    return 0


@numba.njit(cache=True, nogil=True)
def _dedup(ids, uniq, inverse, bits):  # pragma: no cover - compiled
    n = ids.shape[0]
    mask = (1 << bits) - 1
    shift = np.uint64(64 - bits)  # the multiplicative hash keeps the top `bits` bits: a slot of the table
    table = np.full(mask + 1, -1, np.int64)
    count = 0
    for i in range(n):
        key = ids[i]
        p = np.int64((np.uint64(key) * np.uint64(GOLDEN_GAMMA)) >> shift)
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


@intrinsic
def _stream8(typingctx, dst, dst_at, src, src_at):  # pragma: no cover - compiled
    """``dst[dst_at:dst_at + 8] = src[src_at:src_at + 8]`` into a float32 array with one non-temporal vector store: the
    destination's cache lines are written to memory without first being read into the cache. ``src`` is float32, or
    int16 holding float16 bits (widened exactly, as ``Tensor.float()`` does). ``dst_at`` must be a multiple of 8 in a
    32-byte aligned array (an aligned non-temporal store faults otherwise)."""
    sig = types.void(dst, dst_at, src, src_at)
    half = src.dtype == types.int16

    def codegen(context, builder, signature, args):
        dst_array = context.make_array(signature.args[0])(context, builder, args[0])
        src_array = context.make_array(signature.args[2])(context, builder, args[2])
        vector = ir.VectorType(ir.FloatType(), 8)
        source_type = ir.VectorType(ir.HalfType(), 8) if half else vector
        source = builder.bitcast(builder.gep(src_array.data, [args[3]]), source_type.as_pointer())
        value = builder.load(source, align=2 if half else 4)
        if half:
            value = builder.fpext(value, vector)
        target = builder.bitcast(builder.gep(dst_array.data, [args[1]]), vector.as_pointer())
        store = builder.store(value, target, align=32)
        store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _half_row(typingctx, dst, dst_at, src, src_at, dim):  # pragma: no cover - compiled
    """``dst[dst_at:dst_at + dim] = src[src_at:src_at + dim]`` rounded to float16 (to nearest even, as
    ``Tensor.half()``) into an int16 array holding float16 bits, 8 values per vector conversion (``vcvtps2ph`` with
    F16C); returns the row's largest ``|value|`` (NaN ignored), kept in a register meanwhile. ``dim % 8 == 0``."""
    sig = types.float32(dst, dst_at, src, src_at, dim)

    def codegen(context, builder, signature, args):
        dst_array = context.make_array(signature.args[0])(context, builder, args[0])
        src_array = context.make_array(signature.args[2])(context, builder, args[2])
        f32 = ir.FloatType()
        vector = ir.VectorType(f32, 8)
        halves = ir.VectorType(ir.HalfType(), 8)
        module = builder.module
        fabs = cgutils.get_or_insert_function(module, ir.FunctionType(vector, [vector]), "llvm.fabs.v8f32")
        fmax = cgutils.get_or_insert_function(module, ir.FunctionType(f32, [vector]), "llvm.vector.reduce.fmax.v8f32")
        # An alloca in the entry block: LLVM promotes it to a register, so the running peak never touches memory.
        peak = cgutils.alloca_once_value(builder, ir.Constant(vector, [ir.Constant(f32, 0.0)] * 8))
        dst_at, src_at, dim = (context.cast(builder, args[i], signature.args[i], types.intp) for i in (1, 3, 4))
        with cgutils.for_range(builder, builder.sdiv(dim, ir.Constant(dim.type, 8))) as loop:
            offset = builder.mul(loop.index, ir.Constant(loop.index.type, 8))
            source = builder.gep(src_array.data, [builder.add(src_at, offset)])
            value = builder.load(builder.bitcast(source, vector.as_pointer()), align=4)
            target = builder.gep(dst_array.data, [builder.add(dst_at, offset)])
            builder.store(builder.fptrunc(value, halves), builder.bitcast(target, halves.as_pointer()), align=2)
            magnitude = builder.call(fabs, [value])
            before = builder.load(peak)
            # An ordered compare is false for NaN: a NaN lane keeps the running value.
            builder.store(builder.select(builder.fcmp_ordered(">", magnitude, before), magnitude, before), peak)
        return builder.call(fmax, [builder.load(peak)])  # no NaN left to propagate

    return sig, codegen


@intrinsic
def _fence(typingctx):  # pragma: no cover - compiled
    """A full memory fence: non-temporal stores are weakly ordered, and another thread reads the rows next."""
    sig = types.void()

    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return sig, codegen


@numba.njit(cache=True, nogil=True, inline="always")
def _prefetch_row(src, r, rows, dim):  # pragma: no cover - compiled
    # Row r of a flat [rows * dim] table, one prefetch per 64-byte line; rows out of range are skipped (never fault).
    if 0 <= r < rows:
        for k in range(0, dim, 64 // src.itemsize):
            _prefetch(src, r * dim + k)


@numba.njit(cache=True, nogil=True)
def _gather_stream(src, rows, dim, index, dst, ahead):  # pragma: no cover - compiled
    n = index.shape[0]
    for i in range(n):
        if i + ahead < n:
            _prefetch_row(src, index[i + ahead], rows, dim)
        r = index[i]
        if r < 0 or r >= rows:
            return i  # checked here, not in a pass of its own; the caller raises
        s = r * dim
        d = i * dim
        for k in range(0, dim, 8):
            _stream8(dst, d + k, src, s + k)
    _fence()
    return -1


# Below this many bytes a gather's output may still be in cache when it is read: plain stores keep it there.
STREAM_MIN_BYTES = 1 << 20
stream_gathers = True  # False: gather_rows is index_select (benchmarks/ps.py --breakdown compares the two)


def gather_rows(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``src.index_select(0, index)`` for a ``[rows, dim]`` table, written with non-temporal stores when large; a
    float16 table's rows come out widened to float32 (``src.index_select(0, index).float()``) in the same pass.

    Why: the client expands a lookup's distinct rows into the batch's order, a fresh output larger than the caches
    that nobody reads before it leaves them. Plain stores first read every destination line into the cache and evict
    what the transfer and the other process needed; streaming stores skip both (decision 0007 has the measurements).
    The server's gather of rows picked at random from its table gains nothing from it (it waits on the reads, and the
    transport reads its answer right after): that is :func:`take_rows`. Used for float32 outputs of at least
    :data:`STREAM_MIN_BYTES` whose rows are whole 32-byte vectors (``dim % 8 == 0``); otherwise, or with
    :data:`stream_gathers` off, this is ``index_select`` (then ``.float()`` for float16, also where the CPU lacks
    F16C). Other dtypes keep theirs.

    Raises:
        IndexError: An index lies outside ``[0, rows)`` (as ``index_select`` raises).
    """
    n_rows, dim = src.shape
    n = index.numel()
    half = src.dtype == torch.float16
    streamable = src.dtype == torch.float32 or (half and F16C)
    if not stream_gathers or not streamable or dim % 8 or n * dim * 4 < STREAM_MIN_BYTES:
        out = src.index_select(0, index)
        return out.float() if half else out
    src = src.contiguous()
    index = index.to(torch.int64).contiguous()
    out = torch.empty(n, dim)
    if out.data_ptr() % 32:  # torch aligns CPU allocations to 64 bytes; never rely on it for a faulting store
        return src.index_select(0, index).float() if half else src.index_select(0, index, out=out)
    # numba has no float16 arrays: the halves travel as their int16 bit patterns, widened by the store intrinsic.
    table = src.view(-1).view(torch.int16) if half else src.view(-1)
    bad = _gather_stream(table.numpy(), n_rows, dim, index.numpy(), out.view(-1).numpy(), _AHEAD)
    if bad >= 0:
        raise IndexError(f"gather_rows: index {int(index[bad])} is out of range for {n_rows} rows")
    return out


def take_rows(src: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The store's gather: ``src[slots]`` for a ``[rows, dim]`` table, a zero row where a slot is ``-1``.

    ``index_select`` (after a clamp and followed by a masked fill, only when some slot is ``-1``): the out-of-order
    core keeps enough row copies in flight by itself, and a compiled loop that prefetched rows ahead was slower in
    every comparison (decision 0006).

    Raises:
        IndexError: A slot lies outside ``[-1, rows)``.
    """
    index = slots.to(torch.int64).reshape(-1)
    if not index.numel():
        return src.new_empty(0, src.shape[1])
    rows = src.shape[0]
    low, high = torch.aminmax(index)
    if int(low) < -1 or int(high) >= rows:
        bad = int(index[(index < -1) | (index >= rows)][0])
        raise IndexError(f"take_rows: slot {bad} is out of range for {rows} rows")
    if int(low) >= 0:  # every id held: the training case
        return src.index_select(0, index)
    out = src.index_select(0, index.clamp(min=0))
    return out.masked_fill_((index < 0).unsqueeze(1), 0.0)


@numba.njit(cache=True, nogil=True)
def _to_half(src, dst, dim):  # pragma: no cover - compiled
    # Row by row over a contiguous [n * dim] block: the peak is folded while each row is in registers.
    peak = np.float32(0.0)
    for d in range(0, src.shape[0], dim):
        p = _half_row(dst, d, src, d, dim)
        if p > peak:
            peak = p
    return peak


def _has_f16c() -> bool:
    # The features numba compiles for, not the host's: NUMBA_CPU_FEATURES may name others and NUMBA_ENABLE_AVX=0
    # turns AVX off (F16C needs it). "" where the host's cannot be read: then torch converts.
    from numba.core import config
    from numba.core.codegen import get_host_cpu_features

    features = config.CPU_FEATURES if config.CPU_FEATURES is not None else get_host_cpu_features()
    flags = set(features.split(","))
    return {"+f16c", "+avx"} <= flags


# Without F16C, LLVM would lower the vector conversion to a library call that numba's JIT need not resolve. A
# switch read at each call, like STREAM_MIN_BYTES: tests turn it off to run the path of a CPU without F16C.
F16C = _has_f16c()


def take_rows_half(src: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, float]:
    """:func:`take_rows` rounded to float16, and the largest ``|value|`` among the rows taken.

    Why: a value beyond float16's 65504 would arrive as ``inf``, so a float16 answer needs a range check besides the
    conversion. The rows are gathered by :func:`take_rows` (``index_select`` on the intra-op threads: rows picked at
    random from a full table wait on memory, and two threads keep more of them in flight), then one compiled pass
    over the gathered block, still in cache, converts each row (``vcvtps2ph``, rounding to nearest even as
    ``Tensor.half()``) and folds its magnitude into the peak while it is in registers. One compiled loop that
    gathered and converted together, on one thread, was slower (decision 0010). Falls back to
    ``take_rows(...).half()`` and a reduction where the row width is not a multiple of 8 or the CPU lacks F16C.

    Returns:
        ``(rows, peak)``: float16 ``[len(slots), dim]`` (zero rows where a slot is ``-1``) and the largest magnitude
        (NaN ignored; ``inf`` if a row holds one; 0.0 for no rows).

    Raises:
        IndexError: A slot lies outside ``[-1, rows)``.
    """
    dim = src.shape[1]
    full = take_rows(src, slots)
    if dim % 8 or not F16C or src.dtype != torch.float32:
        peak = full.abs().nan_to_num(nan=0.0, posinf=math.inf).amax() if full.numel() else torch.tensor(0.0)
        return full.half(), float(peak)
    out = torch.empty(full.shape[0], dim, dtype=torch.float16)
    if not full.numel():
        return out, 0.0
    # numba has no float16 arrays: the halves are written as their int16 bit patterns.
    peak = _to_half(full.view(-1).numpy(), out.view(-1).view(torch.int16).numpy(), dim)
    return out, float(peak)


def rows_in(
    weights: torch.Tensor, slots: torch.Tensor, inverse: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """A store's answer to a lookup: the rows of ``slots`` (a zero row where a slot is ``-1``) in ``dtype``, put in
    the caller's order by ``inverse`` (None: already in it).

    Raises:
        OverflowError: ``dtype`` is float16 and a row holds a value beyond its range (it would arrive as ``inf``).
    """
    if dtype == weights.dtype:  # the rows as kept
        rows = take_rows(weights, slots)
        if inverse is not None:
            rows = gather_rows(rows, inverse) if dtype == torch.float32 else rows.index_select(0, inverse)
        return rows
    if dtype == torch.float16:  # narrowed from wider rows: a value beyond float16's range must not pass as inf
        rows, peak = take_rows_half(weights, slots)
        if peak >= FLOAT16_OVERFLOW:  # an inf weight too: float16 cannot tell it from an overflow
            raise OverflowError(f"holds weights up to {peak:.6g}, beyond float16's 65504")
        return rows if inverse is None else rows.index_select(0, inverse)
    # float32 from narrower rows: the gather to the caller's order widens float16 in the same pass
    rows = take_rows(weights, slots)
    return (gather_rows(rows, inverse) if inverse is not None else rows).float()
