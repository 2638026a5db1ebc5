"""Compiled inner loops of the PS (numba): de-duplication and the hash-index probe, against plain references."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from persia_planner.modules.ps import kernels
from persia_planner.modules.ps.index import HashIndex, hash_ids
from persia_planner.modules.ps.kernels import EMPTY

INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
EXTREMES = [-1, 0, 1, 2**63 - 1, -(2**63), 2**32]


def _check_dedup(ids: torch.Tensor) -> None:
    uniq, inverse = kernels.dedup(ids)
    assert uniq.dtype == inverse.dtype == torch.int64 and inverse.shape == ids.shape
    assert torch.equal(uniq[inverse], ids)
    assert torch.equal(torch.sort(uniq).values, torch.unique(ids))  # distinct, and every id is there
    # Order of first occurrence: the first position of each distinct id increases along uniq.
    first = torch.full((uniq.numel(),), ids.numel()).scatter_reduce(0, inverse, torch.arange(ids.numel()), "amin")
    assert torch.equal(first, torch.sort(first).values)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(INT64, st.sampled_from(EXTREMES), st.integers(0, 9)), max_size=300))
def test_dedup_matches_unique_in_first_occurrence_order(values):
    _check_dedup(torch.tensor(values, dtype=torch.int64))


def test_dedup_large_batches_and_views():
    g = torch.Generator().manual_seed(50)
    for n in (1, 2, 7, 1000, 70_000):
        ids = torch.randint(-(2**63), 2**63 - 1, (n,), generator=g)
        ids = torch.cat([ids, ids[: n // 2], torch.tensor(EXTREMES)])
        ids = ids[torch.randperm(ids.numel(), generator=g)]
        for batch in (ids, ids % 37, ids[::3], torch.arange(n) * 2**20):  # wide, many repeats, a view, structured
            _check_dedup(batch)
    empty_uniq, empty_inverse = kernels.dedup(torch.empty(0, dtype=torch.int64))
    assert empty_uniq.numel() == empty_inverse.numel() == 0


@settings(max_examples=100, deadline=None)
@given(
    st.lists(INT64, min_size=1, max_size=60, unique=True),
    st.lists(st.booleans(), min_size=60, max_size=60),
    st.lists(INT64, max_size=20),
)
def test_find_agrees_with_a_dict_after_inserts_and_removals(ids, removed, strangers):
    """Inserts (tensor ops), tombstones, probe sequences that wrap around the end: the compiled probe finds exactly
    the ids held, at their slots and at a bucket that points to them."""
    capacity = len(ids)
    slot_ids = torch.tensor(ids, dtype=torch.int64)
    index = HashIndex(capacity, 0.9, slot_ids)  # a full table: long probes, wrap-around
    index.insert(slot_ids, torch.arange(capacity))
    _, buckets = kernels.find(index.buckets, slot_ids, slot_ids)
    gone = torch.tensor(removed[:capacity])
    index.remove_buckets(buckets[gone])
    held = {key: slot for slot, key in enumerate(ids) if not removed[slot]}
    queries = torch.tensor(ids + strangers, dtype=torch.int64)
    slots, where = kernels.find(index.buckets, slot_ids, queries)
    expected = torch.tensor([held.get(key, -1) for key in ids + strangers], dtype=torch.int64)
    assert torch.equal(slots, expected)
    found = slots >= 0
    assert torch.equal(index.slots_at(where[found]), slots[found]) and (where[~found] == -1).all()
    assert (index.buckets != EMPTY).sum() == capacity  # removals left tombstones, not empty buckets


def test_slots_past_2_to_the_32_are_held_and_found(tmp_path):
    """40-bit slot numbers: ids whose rows sit past slot 2**31 and 2**32 are inserted and found. The slots' ids live in
    a sparse file (32 GiB long, a few pages written), as a server's store of more than 2**32 rows would hold them."""
    slot_ids = torch.from_numpy(np.memmap(tmp_path / "slot_ids", dtype=np.int64, mode="w+", shape=(2**32 + 8,)))
    slots = torch.tensor([5, 2**31 - 1, 2**31, 2**31 + 3, 2**32 + 7])
    ids = torch.tensor([11, -3, 2**40 + 1, 77, 2**62])
    slot_ids[slots] = ids
    index = HashIndex(16, 0.5, slot_ids)
    index.insert(ids, slots)
    found, where = index.find(torch.cat([ids, torch.tensor([12345])]))
    assert found.tolist() == [*slots.tolist(), -1]
    assert torch.equal(index.slots_at(where[:5]), slots)
    # Moving a row keeps its fingerprint: the id is found at its new slot.
    index.repoint(where[4:5], torch.tensor([2**32 + 1]))
    slot_ids[2**32 + 1] = ids[4]
    assert index.find(ids[4:])[0].tolist() == [2**32 + 1]


@pytest.mark.parametrize("home", [0, 3, 7])  # 7: the last bucket, so the probe wraps around to bucket 0
def test_find_confirms_fingerprint_matches_against_the_ids(home):
    """Two ids whose hashes agree in the fingerprint's 23 bits: the probe's match on the first is refuted by its id,
    the probe goes on to the held id (or finds none), and only the held id's record is touched."""
    n_buckets = 8
    hashed = lambda k: int(hash_ids(torch.tensor([k])))  # noqa: E731
    key = next(k for k in range(10**6) if hashed(k) % n_buckets == home)
    absent = next(k for k in range(key + 1, 10**6) if hashed(k) % n_buckets == (home + 2) % n_buckets)
    records = torch.zeros(3, 2, dtype=torch.int64)
    records[:, 0] = torch.tensor([key, -5, -6])  # slot 0 holds key; slots 1 and 2 hold ids the decoys stand for
    index = HashIndex(3, 3 / n_buckets, records[:, 0])
    assert index.n_buckets == n_buckets
    width = kernels.SLOT_WIDTH
    fingerprint = lambda k: hashed(k) >> width  # noqa: E731
    # The decoys: buckets whose fingerprints say key / absent but whose slots hold other ids.
    index.buckets[home] = fingerprint(key) << width | 1
    index.buckets[(home + 1) % n_buckets] = fingerprint(key) << width | 0
    index.buckets[(home + 2) % n_buckets] = fingerprint(absent) << width | 2
    last, count = records.view(torch.int32)[:, 2], records.view(torch.int32)[:, 3]
    slots, where = kernels.find(index.buckets, records[:, 0], torch.tensor([key, absent]), touch=(last, count, 9, None))
    assert slots.tolist() == [0, -1] and where.tolist() == [(home + 1) % n_buckets, -1]
    assert last.tolist() == [9, 0, 0] and count.tolist() == [1, 0, 0]


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from([8, 16, 24, 64, 12, 3]),
    st.integers(1, 40),
    st.lists(st.integers(0, 10**6), min_size=0, max_size=200),
)
def test_gather_rows_matches_index_select(dim, rows, picks):
    table = torch.randn(rows, dim)
    index = torch.tensor([p % rows for p in picks], dtype=torch.int64)
    old = kernels.STREAM_MIN_BYTES
    try:
        kernels.STREAM_MIN_BYTES = 0  # every eligible gather streams, however small
        out = kernels.gather_rows(table, index)
    finally:
        kernels.STREAM_MIN_BYTES = old
    assert out.shape == (index.numel(), dim) and torch.equal(out, table.index_select(0, index))


def test_gather_rows_large_streams_and_refuses_bad_indices(monkeypatch):
    g = torch.Generator().manual_seed(51)
    table = torch.randn(5000, 64, generator=g)
    index = torch.randint(0, 5000, (70_000,), generator=g)
    assert kernels.STREAM_MIN_BYTES <= 70_000 * 64 * 4
    assert torch.equal(kernels.gather_rows(table, index), table.index_select(0, index))
    assert torch.equal(kernels.gather_rows(table, index.to(torch.int32)), table.index_select(0, index))
    assert torch.equal(kernels.gather_rows(table[:, :32], index), table[:, :32].index_select(0, index))  # a view
    monkeypatch.setattr(kernels, "STREAM_MIN_BYTES", 0)
    assert kernels.gather_rows(table, torch.empty(0, dtype=torch.int64)).shape == (0, 64)
    for bad in (5000, -1, 2**40):
        index[-3] = bad
        with pytest.raises(IndexError, match=f"index {bad} is out of range for 5000 rows"):
            kernels.gather_rows(table, index)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(INT64, min_size=1, max_size=50, unique=True),
    st.lists(st.integers(0, 60), min_size=1, max_size=80),
    st.booleans(),
    st.integers(1, 2**31 - 1),
)
def test_find_records_accesses_in_the_same_pass(ids, picks, with_counts, step):
    """``touch``: the slots found get ``last = step`` and ``count += counts[i]`` (or 1), saturating at int32 max;
    absent ids and other slots are untouched; the columns may be strided views of one record array."""
    capacity = len(ids)
    records = torch.zeros(capacity, 2, dtype=torch.int64)
    records[:, 0] = torch.tensor(ids)
    last, count = records.view(torch.int32)[:, 2], records.view(torch.int32)[:, 3]
    g = torch.Generator().manual_seed(step % 1000)
    count.copy_(torch.randint(0, 2**31 - 1, (capacity,), generator=g, dtype=torch.int32))
    count[0] = 2**31 - 2  # one step from saturation
    before_last, before_count = last.clone(), count.clone()
    index = HashIndex(capacity, 0.9, records[:, 0])
    index.insert(records[:, 0], torch.arange(capacity))
    wanted = sorted({p % (capacity + 3) for p in picks})  # distinct; ones past the ids are strangers
    queries = torch.tensor([ids[p] if p < capacity else -(p + 1) * 7919 for p in wanted], dtype=torch.int64)
    queries = queries[~torch.isin(queries, records[:, 0]) | (torch.tensor(wanted) < capacity)]
    per_id = torch.randint(1, 2**31, (queries.numel(),), generator=g) if with_counts else None
    slots, _ = kernels.find(index.buckets, records[:, 0], queries, touch=(last, count, step, per_id))
    expected_last, expected_count = before_last.clone(), before_count.clone().long()
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            expected_last[s] = step
            expected_count[s] = min(expected_count[s] + (int(per_id[i]) if with_counts else 1), 2**31 - 1)
    assert torch.equal(last, expected_last) and torch.equal(count.long(), expected_count)
    assert torch.equal(records[:, 0], torch.tensor(ids))  # the ids beside them are never written


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([1, 3, 16, 64]), st.integers(1, 40), st.lists(st.integers(-1, 10**6), max_size=200))
def test_take_rows_is_index_select_with_zero_rows_for_absent_slots(dim, rows, picks):
    table = torch.randn(rows, dim)
    slots = torch.tensor([p if p < 0 else p % rows for p in picks], dtype=torch.int64)
    expected = table.index_select(0, slots.clamp(min=0))
    expected[slots < 0] = 0.0
    out = kernels.take_rows(table, slots)
    assert out.shape == (slots.numel(), dim) and torch.equal(out, expected)


def test_take_rows_refuses_slots_out_of_range():
    table = torch.randn(5000, 64)
    slots = torch.randint(0, 5000, (70_000,))
    assert torch.equal(kernels.take_rows(table, slots), table.index_select(0, slots))
    assert torch.equal(kernels.take_rows(table, slots.to(torch.int32)), table.index_select(0, slots))
    for bad in (5000, -2, 2**40):
        slots[-3] = bad
        with pytest.raises(IndexError, match=f"slot {bad} is out of range for 5000 rows"):
            kernels.take_rows(table, slots)


# Values whose float16 rounding is a corner: ties, the largest half, the overflow edge, subnormals, signed zero.
HALF_CORNERS = [0.0, -0.0, 65504.0, -65504.0, 65519.0, 65520.0, 1e5, 2049.0, 2051.0, 1 + 2**-11, 6e-8, 3e-8, -1e-7]
FLOATS = st.one_of(
    st.floats(width=32, allow_nan=False, allow_infinity=False),
    st.floats(-70000, 70000, width=32),
    st.sampled_from([*HALF_CORNERS, float("inf"), float("-inf"), float("nan")]),
)


def _half_bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal float16 tensors, bit for bit except that any NaN matches any NaN (payloads may differ)."""
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a.view(torch.int16)[~nan], b.view(torch.int16)[~nan])


@settings(max_examples=80, deadline=None)
@given(
    st.sampled_from([8, 16, 64, 12, 3]),
    st.integers(1, 30),
    st.lists(st.integers(-1, 10**6), max_size=120),
    st.lists(FLOATS, min_size=1, max_size=64),
)
def test_take_rows_half_rounds_as_half_and_reports_the_peak(dim, rows, picks, values):
    """The gather + compiled float16 rounding equals ``take_rows(...).half()`` bit for bit (zero rows for slot -1), and
    the peak is the largest ``|value|`` of the rows taken, NaN ignored."""
    g = torch.Generator().manual_seed(len(values) * 31 + dim)
    table = torch.randn(rows, dim, generator=g) * 100
    spots = torch.randint(0, rows * dim, (len(values),), generator=g)
    table.view(-1)[spots] = torch.tensor(values, dtype=torch.float32)
    slots = torch.tensor([p if p < 0 else p % rows for p in picks], dtype=torch.int64)
    full = kernels.take_rows(table, slots)
    out, peak = kernels.take_rows_half(table, slots)
    assert out.dtype == torch.float16 and out.shape == (slots.numel(), dim)
    assert _half_bits_equal(out, full.half())
    magnitudes = full.abs()[~torch.isnan(full)]
    assert peak == (float(magnitudes.max()) if magnitudes.numel() else 0.0)


def test_take_rows_half_falls_back_and_refuses_slots_out_of_range(monkeypatch):
    table = torch.randn(5000, 64) * 1e3
    table[7, 5], table[9, 1] = float("nan"), -7e4
    slots = torch.randint(0, 5000, (70_000,))
    slots[:2] = torch.tensor([7, 9])
    compiled = kernels.take_rows_half(table, slots)
    monkeypatch.setattr(kernels, "F16C", False)  # the torch path: take_rows, then .half() and one reduction
    plain = kernels.take_rows_half(table, slots)
    assert _half_bits_equal(compiled[0], plain[0]) and compiled[1] == plain[1] == 7e4
    assert _half_bits_equal(compiled[0], table.index_select(0, slots).half())
    monkeypatch.undo()
    for bad in (5000, -2, 2**40):
        slots[-3] = bad
        with pytest.raises(IndexError, match=f"slot {bad} is out of range for 5000 rows"):
            kernels.take_rows_half(table, slots)


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from([8, 16, 64, 12]),
    st.integers(1, 40),
    st.lists(st.integers(0, 10**6), max_size=200),
    st.lists(FLOATS, max_size=20),
)
def test_gather_rows_widens_float16_rows(dim, rows, picks, values):
    """A float16 table's rows come out as float32, exactly ``index_select(...).float()``, streamed or not, with or
    without F16C."""
    table = (torch.randn(rows, dim) * 1e3).half()
    if values:
        spots = torch.randint(0, rows * dim, (len(values),))
        table.view(-1)[spots] = torch.tensor(values, dtype=torch.float32).half()
    index = torch.tensor([p % rows for p in picks], dtype=torch.int64)
    expected = table.index_select(0, index).float()
    for threshold, f16c in ((0, kernels.F16C), (kernels.STREAM_MIN_BYTES, kernels.F16C), (0, False)):
        old = kernels.STREAM_MIN_BYTES, kernels.F16C
        try:
            kernels.STREAM_MIN_BYTES, kernels.F16C = threshold, f16c
            out = kernels.gather_rows(table, index)
        finally:
            kernels.STREAM_MIN_BYTES, kernels.F16C = old
        assert out.dtype == torch.float32 and torch.equal(out.isnan(), expected.isnan())
        assert torch.equal(out.nan_to_num(), expected.nan_to_num())
