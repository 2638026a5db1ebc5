"""EmbeddingStore: the storage engine of one embedding PS table (lookup / insert / update / evict / checkpoint)."""

from __future__ import annotations

import pytest
import torch

from persia_planner.modules.ps import index as index_module
from persia_planner.modules.ps import policies
from persia_planner.modules.ps.optim import SGD, Adagrad, Adam, RowWiseAdagrad
from persia_planner.modules.ps.policies import Eviction, Normal, Uniform
from persia_planner.modules.ps.store import EmbeddingStore

DIM = 8
EXTREME_IDS = torch.tensor([0, -1, 2**63 - 1, -(2**63), 1, 2**32])  # uint64 0, 2**64-1, 2**63-1, 2**63, ...


def _ids(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _random_ids(n: int, seed: int) -> torch.Tensor:
    """``n`` distinct ids spread over the whole uint64 space (int64 bit patterns)."""
    ids = torch.unique(torch.randint(-(2**63), 2**63 - 1, (n + 16,), generator=torch.Generator().manual_seed(seed)))
    return ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(seed))][:n]


def test_lookup_insert_update_roundtrip():
    store = EmbeddingStore(DIM, 16, SGD(lr=0.5), init=Uniform(-0.1, 0.1), seed=3)
    rows = store.lookup(EXTREME_IDS)
    assert rows.shape == (EXTREME_IDS.numel(), DIM)
    assert len(store) == EXTREME_IDS.numel()
    assert store.contains(EXTREME_IDS).all()
    assert not store.contains(_ids(2, 3)).any()
    assert torch.equal(store.lookup(EXTREME_IDS), rows)  # a second lookup finds the same rows, inserts nothing
    assert len(store) == EXTREME_IDS.numel()
    grads = torch.randn(EXTREME_IDS.numel(), DIM, generator=torch.Generator().manual_seed(0))
    assert store.update(EXTREME_IDS, grads) == EXTREME_IDS.numel()
    torch.testing.assert_close(store.lookup(EXTREME_IDS, train=False), rows - 0.5 * grads, atol=0, rtol=0)
    # Shapes: a [2, 3] batch of ids gives [2, 3, dim] rows.
    assert store.lookup(EXTREME_IDS.reshape(2, 3)).shape == (2, 3, DIM)
    # A uint64 tensor is read as its bit pattern: 2**64 - 1 is the row of int64 -1.
    as_uint = torch.tensor([2**64 - 1], dtype=torch.uint64)
    assert torch.equal(store.lookup(as_uint, train=False)[0], store.lookup(_ids(-1), train=False)[0])
    m = store.metrics()
    assert m["rows"] == 6 and m["capacity"] == 16 and m["inserts"] == 6 and m["updates"] == 6
    assert m["evictions"] == 0 and m["lookups"] == 6 + 6 + 6 + 6 + 1 + 1


def test_duplicate_ids_share_one_row_and_sum_grads():
    store = EmbeddingStore(DIM, 8, SGD(lr=1.0))
    ids = _ids(5, 7, 5, 5)
    rows = store.lookup(ids)
    assert len(store) == 2
    assert torch.equal(rows[0], rows[2]) and torch.equal(rows[0], rows[3])
    assert store.metrics()["inserts"] == 2
    grads = torch.arange(4 * DIM, dtype=torch.float32).reshape(4, DIM)
    assert store.update(ids, grads) == 2
    after = store.lookup(_ids(5, 7), train=False)
    torch.testing.assert_close(after[0], rows[0] - (grads[0] + grads[2] + grads[3]))
    torch.testing.assert_close(after[1], rows[1] - grads[1])


def test_eval_lookups_never_insert_nor_touch_recency():
    store = EmbeddingStore(DIM, 2, SGD(), eviction="lru")
    rows = store.lookup(_ids(10, 11, 12), train=False)
    assert torch.equal(rows, torch.zeros(3, DIM))
    assert len(store) == 0 and not store.contains(_ids(10, 11, 12)).any()
    store.lookup(_ids(1))
    store.lookup(_ids(2))
    store.lookup(_ids(1), train=False)  # an eval read must not make 1 recent
    store.lookup(_ids(3))
    assert store.contains(_ids(1, 2, 3)).tolist() == [False, True, True]
    assert store.update(_ids(1, 99), torch.ones(2, DIM)) == 0  # evicted / never held ids are ignored


def test_lru_keeps_most_recent():
    store = EmbeddingStore(DIM, 4, SGD(), eviction=Eviction.LRU)
    for i in (1, 2, 3, 4):
        store.lookup(_ids(i))
    store.lookup(_ids(1))  # 1 is now the most recent
    store.lookup(_ids(5))  # evicts 2
    assert store.contains(_ids(1, 2, 3, 4, 5)).tolist() == [True, False, True, True, True]
    store.lookup(_ids(6, 7))  # evicts 3 and 4
    assert store.contains(_ids(1, 3, 4, 5, 6, 7)).tolist() == [True, False, False, True, True, True]
    assert store.metrics()["evictions"] == 3 and len(store) == 4


def test_lru_under_churn_is_recency_closed_and_index_stays_exact(monkeypatch):
    """Many batches with evictions (tombstones and index rebuilds): held ids are always the most recent ones."""
    rebuilds = []
    original = index_module.HashIndex.rebuild
    monkeypatch.setattr(
        index_module.HashIndex, "rebuild", lambda self, live: rebuilds.append(live) or original(self, live)
    )
    capacity, universe = 64, _random_ids(400, seed=1)
    store = EmbeddingStore(DIM, capacity, SGD(), eviction="lru")
    last_seen = torch.full((universe.numel(),), -1)
    g = torch.Generator().manual_seed(2)
    for step in range(150):
        pick = torch.randint(0, universe.numel(), (40,), generator=g)
        store.lookup(universe[pick])
        last_seen[pick] = step
        held = store.contains(universe)
        seen = last_seen >= 0
        assert int(held.sum()) == len(store) == min(capacity, int(seen.sum()))
        if (seen & ~held).any():
            assert last_seen[held].min() >= last_seen[seen & ~held].max()
        assert held[pick].all()  # a batch's own ids are never evicted by it
    assert store.metrics()["evictions"] > 5 * capacity
    assert len(rebuilds) > 3  # tombstones were cleared several times mid-stream
    sd = store.state_dict()
    assert torch.unique(sd["ids"]).numel() == capacity
    assert torch.equal(store.lookup(sd["ids"], train=False), sd["weights"])


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_chunked_eviction_frees_a_chunk_and_keeps_rows_with_their_ids(eviction):
    """A full table evicts eviction_chunk * capacity rows at once; the survivors above the new end move into the
    holes, and every held id still reads its own row (per-id init), also the batch's hits that moved."""
    capacity, chunk = 640, 1 / 32  # 20 rows a chunk
    store = EmbeddingStore(DIM, capacity, SGD(), eviction=eviction, init_seed=7, eviction_chunk=chunk)
    universe = _random_ids(capacity + 1, seed=3)
    for start in range(0, capacity, 64):  # fill in 10 batches: distinct recency (and count 1) per batch
        store.lookup(universe[start : start + 64])
    assert len(store) == capacity and store.metrics()["evictions"] == 0
    # The batch: the last-inserted ids (they sit at the end and must move into holes) plus one new id.
    batch = torch.cat([universe[capacity - 30 : capacity], universe[capacity:]])
    rows = store.lookup(batch)
    assert store.metrics()["evictions"] == 20 and len(store) == capacity - 20 + 1
    # The 20 victims are among the oldest (LRU) / least frequent then oldest (LFU): the first batch's ids.
    held_mask = store.contains(universe)
    assert int((~held_mask[:64]).sum()) == 20 and held_mask[64:].all()
    expected = Uniform().rows_for(batch, DIM, 7)
    assert torch.equal(rows, expected)
    held = universe[held_mask]
    assert torch.equal(store.lookup(held, train=False), Uniform().rows_for(held, DIM, 7))
    sd = store.state_dict()  # the occupied slots are still the prefix [0, len)
    assert torch.equal(torch.sort(sd["ids"]).values, torch.sort(held).values)


def test_chunked_eviction_under_churn_matches_per_id_rows_and_bounds():
    capacity, chunk = 200, 0.05
    store = EmbeddingStore(DIM, capacity, SGD(lr=1.0), eviction="lru", init_seed=1, eviction_chunk=chunk)
    universe = _random_ids(1000, seed=6)
    expected = Uniform().rows_for(universe, DIM, 1)  # every id's row, updated alongside the store
    g = torch.Generator().manual_seed(8)
    last_seen = torch.full((universe.numel(),), -1)
    for step in range(120):
        pick = torch.unique(torch.randint(0, universe.numel(), (37,), generator=g))
        rows = store.lookup(universe[pick])
        held = store.contains(universe)
        was_evicted = (last_seen >= 0) & ~held
        expected[was_evicted] = Uniform().rows_for(universe[was_evicted], DIM, 1)  # re-admitted ids start afresh
        last_seen[pick] = step
        assert torch.equal(rows, expected[pick])
        grads = torch.randn(pick.numel(), DIM, generator=g)
        store.update(universe[pick], grads)
        expected[pick] -= grads
        held = store.contains(universe)
        assert held[pick].all()
        assert len(store) == int(held.sum()) <= capacity
        if store.metrics()["evictions"]:  # once full, a chunk below capacity at most (plus the batch's inserts)
            assert len(store) >= capacity * (1 - chunk) - 1
        seen = last_seen >= 0
        if (seen & ~held).any():
            assert last_seen[held].min() >= last_seen[seen & ~held].max()
        last_seen[~held] = -1  # an evicted id is unseen again
    assert store.metrics()["evictions"] > 3 * capacity
    held = store.contains(universe)
    assert torch.equal(store.lookup(universe[held], train=False), expected[held])


def test_lfu_keeps_most_frequent():
    def stream(store: EmbeddingStore) -> None:
        hot = _ids(0, 1, 2, 3, 4)
        for _ in range(5):
            store.lookup(hot)
        for start in range(100, 150, 5):
            store.lookup(torch.arange(start, start + 5))

    lfu = EmbeddingStore(DIM, 10, SGD(), eviction="lfu")
    stream(lfu)
    # Hot ids survive 50 one-off ids; among equally rare ids the most recent are kept.
    assert lfu.contains(_ids(0, 1, 2, 3, 4)).all()
    assert lfu.contains(torch.arange(145, 150)).all() and len(lfu) == 10
    lru = EmbeddingStore(DIM, 10, SGD(), eviction="lru")
    stream(lru)
    assert not lru.contains(_ids(0, 1, 2, 3, 4)).any()
    assert lru.contains(torch.arange(140, 150)).all()


def test_lfu_counts_every_occurrence_and_protects_the_batch():
    store = EmbeddingStore(DIM, 3, SGD(), eviction="lfu")
    store.lookup(_ids(1, 1, 1, 2, 2, 3))  # counts 3, 2, 1
    store.lookup(_ids(4))  # evicts 3
    assert store.contains(_ids(1, 2, 3, 4)).tolist() == [True, True, False, True]
    # 4 has the lowest count but is in the batch: the two new ids must evict 2 and 1 instead.
    store.lookup(_ids(4, 5, 6))
    assert store.contains(_ids(1, 2, 4, 5, 6)).tolist() == [False, False, True, True, True]


def test_batch_larger_than_capacity_admits_what_fits():
    store = EmbeddingStore(DIM, 4, SGD())
    rows = store.lookup(torch.arange(10))
    assert len(store) == 4
    held = store.contains(torch.arange(10))
    assert int(held.sum()) == 4
    assert torch.equal(rows[~held], torch.zeros(6, DIM))
    assert store.metrics()["not_admitted"] == 6


def test_admission_probability_is_binomial_and_seeded():
    n, p = 10_000, 0.3
    ids = _random_ids(n, seed=4)
    a = EmbeddingStore(DIM, n, SGD(), admission_probability=p, seed=7)
    rows = a.lookup(ids)
    admitted = a.contains(ids)
    sd = (n * p * (1 - p)) ** 0.5
    assert abs(int(admitted.sum()) - n * p) < 5 * sd
    assert a.metrics()["not_admitted"] == n - int(admitted.sum())
    assert torch.equal(rows[~admitted], torch.zeros(int((~admitted).sum()), DIM))  # not admitted: zero rows
    b = EmbeddingStore(DIM, n, SGD(), admission_probability=p, seed=7)
    b.lookup(ids)
    assert torch.equal(b.contains(ids), admitted)
    c = EmbeddingStore(DIM, n, SGD(), admission_probability=p, seed=8)
    c.lookup(ids)
    assert not torch.equal(c.contains(ids), admitted)
    # A refused id gets another chance on a later lookup (a per-occurrence draw, not a per-id verdict).
    a.lookup(ids)
    assert int(a.contains(ids).sum()) > int(admitted.sum())
    assert len(EmbeddingStore(DIM, 10, SGD(), admission_probability=0.0).lookup(ids[:10]).nonzero()) == 0


def test_clip_bounds_weights():
    store = EmbeddingStore(DIM, 32, SGD(lr=10.0), init=Uniform(-0.01, 0.01), clip=0.05)
    ids = torch.arange(32)
    store.lookup(ids)
    store.update(ids, torch.randn(32, DIM, generator=torch.Generator().manual_seed(0)))
    w = store.lookup(ids, train=False)
    assert w.abs().max() == pytest.approx(0.05)
    assert (w.abs() == 0.05).float().mean() > 0.9


def test_init_uniform_bounds_and_normal_std():
    n = 4096
    u = EmbeddingStore(16, n, SGD(), init=Uniform(-0.1, 0.3)).lookup(torch.arange(n))
    assert u.min() >= -0.1 and u.max() < 0.3
    assert u.mean().item() == pytest.approx(0.1, abs=0.005)
    z = EmbeddingStore(16, n, SGD(), init=Normal(std=0.02)).lookup(torch.arange(n))
    assert z.std().item() == pytest.approx(0.02, rel=0.02)
    assert z.mean().item() == pytest.approx(0.0, abs=0.001)
    # Same seed, same ids in the same order: same initial rows.
    again = EmbeddingStore(16, n, SGD(), init=Normal(std=0.02)).lookup(torch.arange(n))
    assert torch.equal(z, again)


def test_per_id_uniforms_stay_inside_the_open_interval():
    """The top bin of id_uniforms' 24 bits, (2**24 - 0.5) / 2**24, rounds to 1.0 in float32: it must stay below 1,
    and Uniform's rows below ``high`` (id 29468417 with seed 0, column 0 falls in that bin; found by search)."""
    edge = torch.tensor([29468417, 3, 4])
    u = policies.id_uniforms(edge, 1, seed=0)
    assert u[0, 0] == 1.0 - 2.0**-24  # the largest float32 below 1, not 1.0
    assert bool((u > 0).all() and (u < 1).all())
    rows = Uniform(-0.01, 0.01).rows_for(edge, 1, seed=0)
    high32 = torch.tensor(0.01, dtype=torch.float32)
    assert bool((rows < high32).all()) and rows[0, 0] > 0.0099  # just below high (it was high itself)
    assert torch.equal(rows[1:], policies.id_uniforms(edge[1:], 1, seed=0) * 0.02 - 0.01)  # others unchanged
    assert torch.equal(Uniform(0.5, 0.5).rows_for(edge, 2, seed=0), torch.full((3, 2), 0.5))  # an empty interval


def test_a_refused_state_dict_leaves_the_store_unchanged():
    """load_state_dict checks everything before it writes: a malformed optional column must not leave the rows
    replaced and the index stale."""
    store = EmbeddingStore(DIM, 16, SGD())
    store.lookup(torch.tensor([1, 2, 3]))
    before = store.state_dict()
    other = EmbeddingStore(DIM, 16, SGD())
    other.lookup(torch.tensor([10, 11, 3]))
    for key, bad in (("last_access", torch.zeros(2, dtype=torch.int32)), ("count", torch.zeros(3))):
        state = other.state_dict() | {key: bad}
        with pytest.raises(ValueError, match=key):
            store.load_state_dict(state)
        for name, value in store.state_dict().items():
            assert (value == before[name]) if name == "step" else torch.equal(value, before[name]), name
        assert store.contains(torch.tensor([1, 2, 3, 10])).tolist() == [True, True, True, False]


def test_state_dict_roundtrip_is_bit_identical():
    opt = Adam(lr=0.01)
    src = EmbeddingStore(DIM, 64, opt, eviction="lfu", seed=1)
    g = torch.Generator().manual_seed(3)
    for _ in range(5):
        ids = torch.randint(0, 40, (30,), generator=g)
        src.lookup(ids)
        src.update(ids, torch.randn(30, DIM, generator=g))
    sd = src.state_dict()
    assert sd["ids"].numel() == len(src) and sd["state"].shape == (len(src), opt.state_width(DIM))
    dst = EmbeddingStore(DIM, 128, opt, eviction="lfu", seed=99)  # a different capacity is fine
    dst.load_state_dict(sd)
    assert len(dst) == len(src)
    ids = sd["ids"]
    assert torch.equal(dst.lookup(ids, train=False), src.lookup(ids, train=False))
    for key in ("ids", "weights", "state", "last_access", "count"):
        assert torch.equal(dst.state_dict()[key], sd[key])
    # Optimizer state came along: the same further updates give the same rows.
    grads = torch.randn(ids.numel(), DIM, generator=g)
    src.update(ids, grads)
    dst.update(ids, grads)
    assert torch.equal(dst.lookup(ids, train=False), src.lookup(ids, train=False))
    with pytest.raises(ValueError, match="capacity"):
        EmbeddingStore(DIM, 4, opt).load_state_dict(sd)
    with pytest.raises(ValueError, match="optimizer state"):
        EmbeddingStore(DIM, 64, SGD()).load_state_dict(sd)


def _dense_reference(opt, w: torch.Tensor):
    """A local dense table with the dense torch optimizer, or None where the reference is applied by hand."""
    p = torch.nn.Parameter(w.clone())
    if isinstance(opt, SGD):
        return p, torch.optim.SGD([p], lr=opt.lr)
    if isinstance(opt, Adagrad):
        return p, torch.optim.Adagrad([p], lr=opt.lr, eps=opt.eps, initial_accumulator_value=0.0)
    if isinstance(opt, Adam):
        return p, torch.optim.Adam([p], lr=opt.lr, betas=opt.betas, eps=opt.eps, foreach=False)
    return p, None


@pytest.mark.parametrize("opt", [SGD(lr=0.1), Adagrad(lr=0.1), RowWiseAdagrad(lr=0.1), Adam(lr=0.01)])
def test_ps_trained_table_equals_dense_local_table(opt):
    """Same ids, same grads, same optimizer: the PS table equals a dense local table to 1e-6 (no eviction)."""
    rows, steps = 200, 8
    universe = _random_ids(rows, seed=5)  # arbitrary uint64 ids; row r of the dense table is universe[r]
    store = EmbeddingStore(DIM, rows, opt, seed=2)
    p, dense_opt = _dense_reference(opt, store.lookup(universe))  # start from the store's initial rows
    state = opt.init_state(rows, DIM)
    g = torch.Generator().manual_seed(6)
    for _ in range(steps):
        r = torch.randint(0, rows // 2, (300,), generator=g)
        if isinstance(opt, Adam):  # torch Adam moves every row each step: the definitions agree when all are in
            r = torch.cat([torch.arange(rows), r])
        grads = torch.randn(r.numel(), DIM, generator=g)
        torch.testing.assert_close(store.lookup(universe[r]), p.detach()[r], atol=1e-6, rtol=0)
        store.update(universe[r], grads)
        dense_grad = torch.zeros(rows, DIM).index_add_(0, r, grads)
        if dense_opt is not None:
            p.grad = dense_grad
            dense_opt.step()
        else:  # row-wise Adagrad: no dense torch optimizer; apply its definition to the rows with a gradient
            touched = torch.unique(r)
            with torch.no_grad():
                p[touched], state[touched] = opt.step(p[touched], state[touched], dense_grad[touched])
    torch.testing.assert_close(store.lookup(universe, train=False), p.detach(), atol=1e-6, rtol=0)
    assert store.metrics()["evictions"] == 0 and len(store) == rows


def test_invalid_arguments():
    with pytest.raises(ValueError):
        EmbeddingStore(0, 10, SGD())
    with pytest.raises(ValueError):
        EmbeddingStore(DIM, 10, SGD(), admission_probability=1.5)
    with pytest.raises(ValueError):
        EmbeddingStore(DIM, 10, SGD(), eviction="fifo")
    with pytest.raises(ValueError, match="eviction_chunk"):
        EmbeddingStore(DIM, 10, SGD(), eviction_chunk=1.0)
    with pytest.raises(TypeError):
        EmbeddingStore(DIM, 10, SGD()).lookup(torch.tensor([1.0]))


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
def test_distinct_lookup_equals_the_deduplicating_path(eviction):
    """``distinct=True`` (the server's path for client-deduplicated batches) changes nothing but the work done:
    same rows, inserts, evictions, not-admitted zero rows and metadata as the default path on the same batches."""
    kwargs = dict(init=Uniform(-0.1, 0.1), eviction=eviction, admission_probability=0.7, seed=5)
    plain, fast = EmbeddingStore(DIM, 40, SGD(lr=0.1), **kwargs), EmbeddingStore(DIM, 40, SGD(lr=0.1), **kwargs)
    universe = _random_ids(120, seed=9)
    for step in range(12):
        g = torch.Generator().manual_seed(step)
        batch = torch.unique(universe[torch.randint(0, 120, (30,), generator=g)])  # distinct, sorted: as sent
        train = step % 4 != 3
        a, b = plain.lookup(batch, train=train), fast.lookup(batch, train=train, distinct=True)
        assert torch.equal(a, b), step
        assert not train or ((a == 0).all(dim=1) == ~plain.contains(batch)).all()  # not admitted: zero rows
    assert plain.metrics() == fast.metrics()
    sp, sf = plain.state_dict(), fast.state_dict()
    assert (
        all(torch.equal(sp[k], sf[k]) for k in ("ids", "weights", "last_access", "count")) and sp["step"] == sf["step"]
    )
    assert plain.metrics()["evictions"] > 0 and plain.metrics()["not_admitted"] > 0  # both paths were exercised
    # Any order of distinct ids reads the same rows (here all held: admission draws follow the ids' order).
    held = sp["ids"][torch.randperm(len(plain), generator=torch.Generator().manual_seed(1))]
    assert torch.equal(fast.lookup(held, distinct=True), plain.lookup(held))


def test_float16_lookup_is_the_float32_lookup_rounded_and_refuses_what_float16_cannot_hold():
    """``dtype=torch.float16`` (a float16 wire's lookup): the float32 path's rows rounded once, with the same side
    effects; a weight beyond float16's range raises ``OverflowError`` (it would read as inf)."""
    kwargs = dict(init=Uniform(-0.1, 0.1), seed=5)
    plain, half = EmbeddingStore(DIM, 40, SGD(lr=0.1), **kwargs), EmbeddingStore(DIM, 40, SGD(lr=0.1), **kwargs)
    universe = _random_ids(60, seed=3)
    for step in range(6):
        g = torch.Generator().manual_seed(step)
        batch = universe[torch.randint(0, 60, (30,), generator=g)]  # repeats: the de-duplicating path too
        distinct = step % 2 == 0
        if distinct:
            batch = torch.unique(batch)
        a = plain.lookup(batch, distinct=distinct)
        b = half.lookup(batch, distinct=distinct, dtype=torch.float16)
        assert b.dtype == torch.float16 and torch.equal(b, a.half()), step
    assert plain.metrics() == half.metrics()
    assert torch.equal(plain.state_dict()["last_access"], half.state_dict()["last_access"])
    held = plain.state_dict()["ids"][:3]
    half.update(held[:1], torch.full((1, DIM), -1e6), distinct=True)  # SGD: w += 1e5 in that row
    with pytest.raises(OverflowError, match=r"holds weights up to 100000, beyond float16's 65504"):
        half.lookup(held, dtype=torch.float16)
    assert torch.isfinite(half.lookup(held)).all()  # float32 reads it as it is
    with pytest.raises(ValueError, match=r"lookup dtype must be torch\.float32 or torch\.float16"):
        half.lookup(held, dtype=torch.bfloat16)
    # The edge is where float16 rounds to inf: 65519 rounds to 65504 and passes, 65520 and inf are refused.
    state = half.state_dict()
    for weight, refused in ((65519.0, False), (-65520.0, True), (float("inf"), True), (float("nan"), False)):
        state["weights"][0] = 0.0
        state["weights"][0, 3] = weight
        half.load_state_dict(state)
        if refused:
            with pytest.raises(OverflowError, match=f"holds weights up to {abs(weight):.6g}, beyond float16's 65504"):
                half.lookup(state["ids"][:1], dtype=torch.float16)
        else:
            got, expected = half.lookup(state["ids"][:1], dtype=torch.float16)[0, 3], torch.tensor(weight).half()
            assert (bool(got.isnan()) and bool(expected.isnan())) or (got == expected and float(got) == 65504.0)


@pytest.mark.parametrize("weight_dtype", [torch.float16, torch.bfloat16])
def test_a_narrow_store_is_a_float32_store_whose_rows_are_rounded_after_every_write(weight_dtype):
    """Rows kept in float16 / bfloat16: every lookup gives what a float32 store gives once its rows are rounded to the
    dtype after each insert and update (the optimizer steps in float32 from the rounded rows, its state stays
    float32); a float16 lookup of a float16 store is the rows as kept; checkpoints keep the dtype and load across."""
    opt = RowWiseAdagrad(lr=0.05)
    narrow = EmbeddingStore(16, 40, opt, init=Uniform(-0.1, 0.1), seed=2, weight_dtype=weight_dtype)
    wide = EmbeddingStore(16, 40, opt, init=Uniform(-0.1, 0.1), seed=2)
    universe = _random_ids(60, seed=8)

    def round_wide():  # the reference: the float32 store's rows rounded as the narrow store rounds each write
        state = wide.state_dict()
        state["weights"] = state["weights"].to(weight_dtype).float()
        wide.load_state_dict(state)

    for step in range(8):
        g = torch.Generator().manual_seed(step)
        batch = universe[torch.randint(0, 60, (30,), generator=g)]  # repeats, misses, evictions (capacity 40)
        a = narrow.lookup(batch)
        wide.lookup(batch)
        round_wide()  # the rows this batch inserted
        b = wide.lookup(batch, train=False)
        assert a.dtype == torch.float32 and torch.equal(a, b), step
        grads = torch.randn(30, 16, generator=g)
        assert narrow.update(batch, grads) == wide.update(batch, grads)
        round_wide()
    state = narrow.state_dict()
    assert state["weights"].dtype == weight_dtype and state["state"].dtype == torch.float32
    assert torch.equal(state["weights"].float(), wide.state_dict()["weights"])
    assert torch.equal(state["state"], wide.state_dict()["state"])
    held = state["ids"][:5]
    if weight_dtype == torch.float16:
        assert torch.equal(narrow.lookup(held, train=False, dtype=torch.float16), state["weights"][:5])
    # A float32 checkpoint loads into the narrow store rounded, the narrow one into a float32 store exactly.
    narrow.load_state_dict(wide.state_dict())
    assert torch.equal(narrow.state_dict()["weights"], wide.state_dict()["weights"].to(weight_dtype))
    restored = EmbeddingStore(16, 40, opt)
    restored.load_state_dict(state)
    assert torch.equal(restored.lookup(held, train=False), state["weights"][:5].float())
    with pytest.raises(ValueError, match=r"weight_dtype must be torch\.float32, torch\.float16 or torch\.bfloat16"):
        EmbeddingStore(16, 40, opt, weight_dtype=torch.int8)


def test_per_id_initialisation_ignores_arrival_order_and_server():
    from persia_planner.modules.ps.protocol import TableConfig
    from persia_planner.modules.ps.server_state import make_store

    config = TableConfig("user", dim=8, capacity=100, optimizer=RowWiseAdagrad(lr=0.1), seed=3)
    a, b = make_store(config, 0), make_store(config, 1)
    ids = torch.tensor([5, -7, 2**62 + 1, 40, 41])
    rows_a = a.lookup(ids)
    b.lookup(torch.tensor([41, 999]))  # another order, other ids first, another server index
    rows_b = b.lookup(ids.flip(0)).flip(0)
    torch.testing.assert_close(rows_a, rows_b, rtol=0, atol=0)
    assert rows_a.abs().max() <= 0.01 and rows_a.std() > 0.003  # the config's Uniform(-0.01, 0.01), not constant
    other_table = make_store(TableConfig("item", dim=8, capacity=100, optimizer=RowWiseAdagrad(lr=0.1), seed=3), 0)
    assert not torch.equal(other_table.lookup(ids), rows_a)  # tables are salted by name


@pytest.mark.parametrize("opt", [SGD(lr=0.1), Adagrad(lr=0.1), RowWiseAdagrad(lr=0.1), Adam(lr=0.01)])
def test_distinct_update_equals_the_summing_path(opt):
    """``update(distinct=True)`` (the server's path for client-summed pushes) gives bit-identical rows and state to
    the default path fed the same distinct ids, in any order, including ids the store does not hold."""
    universe = _random_ids(60, seed=11)
    plain, fast = EmbeddingStore(DIM, 64, opt, seed=4), EmbeddingStore(DIM, 64, opt, seed=4)
    plain.lookup(universe[:50])
    fast.lookup(universe[:50])
    for step in range(5):
        g = torch.Generator().manual_seed(20 + step)
        ids = universe[torch.randperm(60, generator=g)[:35]]  # distinct, unsorted, some never inserted
        grads = torch.randn(35, DIM, generator=g)
        assert plain.update(ids, grads) == fast.update(ids, grads, distinct=True) == int(plain.contains(ids).sum())
    sp, sf = plain.state_dict(), fast.state_dict()
    assert all(torch.equal(sp[k], sf[k]) for k in ("ids", "weights", "state"))
    assert plain.metrics() == fast.metrics()


def test_update_upcasts_narrow_gradients_before_summing():
    """float16 / bfloat16 gradients are summed and stepped in float32: the same rows as their float32 upcast, and
    not the rows of a float16 sum (which would round 2048 + 1 back to 2048)."""
    ids = _ids(1, 2, 1, 1)
    for dtype in (torch.float16, torch.bfloat16):
        narrow, wide = EmbeddingStore(DIM, 8, SGD(lr=1.0)), EmbeddingStore(DIM, 8, SGD(lr=1.0))
        narrow.lookup(ids)
        wide.lookup(ids)
        grads = torch.tensor([2048.0, 3.0, 1.0, 1.0]).unsqueeze(1).expand(4, DIM).to(dtype)
        narrow.update(ids, grads)
        wide.update(ids, grads.float())
        assert torch.equal(narrow.lookup(ids, train=False), wide.lookup(ids, train=False))
        initial = EmbeddingStore(DIM, 8, SGD(lr=1.0)).lookup(_ids(1))[0]  # same seed: the initial row of id 1
        torch.testing.assert_close(narrow.lookup(_ids(1), train=False)[0], initial - 2050.0, atol=1e-3, rtol=0)


def test_huge_page_arrays_and_streaming_gathers_change_nothing(monkeypatch):
    """The same churn (inserts, LRU evictions, updates) through a store on mmap'd huge-page arrays whose gathers all
    stream, and through one on torch.empty arrays with index_select gathers: every lookup and the state equal."""
    from persia_planner.modules.ps import kernels

    def run(huge: bool) -> tuple[list[torch.Tensor], dict]:
        mapped = []
        real_mmap = index_module.mmap.mmap
        monkeypatch.setattr(index_module.mmap, "mmap", lambda *a, **k: mapped.append(a) or real_mmap(*a, **k))
        monkeypatch.setattr(index_module, "HUGE_PAGES_MIN_BYTES", 0 if huge else 1 << 62)
        monkeypatch.setattr(kernels, "STREAM_MIN_BYTES", 0)
        monkeypatch.setattr(kernels, "stream_gathers", huge)
        store = EmbeddingStore(16, 200, RowWiseAdagrad(lr=0.1), eviction="lru", seed=4, eviction_chunk=0.05)
        assert len(mapped) == (4 if huge else 0)  # slot records (id, last, count), weights, state, index buckets
        universe, g, seen = _random_ids(700, seed=5), torch.Generator().manual_seed(6), []
        for _ in range(40):
            ids = universe[torch.randint(0, universe.numel(), (90,), generator=g)]
            seen.append(store.lookup(ids))
            store.update(ids, torch.randn(90, 16, generator=g))
            seen.append(store.lookup(ids.unique(), distinct=True, train=False))
        return seen, store.state_dict()

    streamed, streamed_state = run(huge=True)
    plain, plain_state = run(huge=False)
    assert all(torch.equal(a, b) for a, b in zip(streamed, plain, strict=True))
    assert streamed_state.keys() == plain_state.keys()
    assert all(torch.equal(torch.as_tensor(streamed_state[k]), torch.as_tensor(v)) for k, v in plain_state.items())
    assert plain_state["ids"].numel() == 200  # the table filled and evicted


def test_a_seeded_store_answers_unheld_ids_with_the_local_rows_id_mod_rows():
    """A table moved from the trainers' local tables: every id it does not hold starts from row ``id mod rows`` of
    the local table (weights and the optimizer's row state), so the moved table answers as the local one did."""
    rows, weights = 7, torch.randn(7, DIM, generator=torch.Generator().manual_seed(1))
    row_state = torch.arange(7, dtype=torch.float32).unsqueeze(1)
    store = EmbeddingStore(DIM, 64, RowWiseAdagrad(lr=0.1), init=Uniform(-0.1, 0.1), init_seed=5)
    store.seed(weights, row_state)
    held = EXTREME_IDS[:3]
    store.lookup(held)
    store.update(held, torch.ones(3, DIM))
    ids = torch.cat([EXTREME_IDS, _ids(3, 10, -8)])
    local = weights[torch.remainder(ids, rows)]
    read = store.read(ids)
    assert torch.equal(read[3:], local[3:])  # unheld ids: the local rows, bit for bit
    assert not torch.equal(read[:3], local[:3])  # the trained ones moved on
    scored = store.lookup(torch.cat([ids, ids[-2:]]), train=False)  # an evaluation: repeats, nothing inserted
    assert torch.equal(scored[: len(ids)], read) and torch.equal(scored[len(ids) :], read[-2:])
    assert store.metrics()["rows"] == 3
    fresh = EXTREME_IDS[3:]
    assert torch.equal(store.lookup(fresh), weights[torch.remainder(fresh, rows)])  # inserted as read
    assert torch.equal(store.state_dict()["state"][3:6], row_state[torch.remainder(fresh, rows)])
    with pytest.raises(ValueError, match=r"seed weights must be \[rows, 8\], got \(7, 4\)"):
        store.seed(torch.zeros(7, 4))
    with pytest.raises(ValueError, match=r"seed state must be \[7, 1\], got \(7, 2\)"):
        store.seed(weights, torch.zeros(7, 2))
    store.seed(None)  # unseeded: the initialiser again
    assert store.seeded() is None
    assert torch.equal(store.read(_ids(99)), Uniform(-0.1, 0.1).rows_for(_ids(99), DIM, 5))


def test_pushed_hyper_parameters_state_rows_and_cold_ids():
    """A push's own optimizer steps its rows (another kind is refused); optimizer state reads and writes by column;
    loading weights keeps a row's state; an id never trained reads as its initial row in eval lookups and reads."""
    store = EmbeddingStore(DIM, 100, RowWiseAdagrad(lr=0.5), init=Uniform(-0.1, 0.1), init_seed=3)
    ids = _ids(1, 2)
    before = store.lookup(ids)
    grads = torch.ones(2, DIM)
    store.update(ids, grads, optimizer=RowWiseAdagrad(lr=0.0))
    assert torch.equal(store.read(ids), before)  # lr 0 travelled with the push: rows frozen, accumulators grew
    assert torch.equal(store.read_state(ids), torch.ones(2, 1))
    store.update(ids, grads, optimizer=RowWiseAdagrad(lr=0.25))
    torch.testing.assert_close(store.read(ids), before - 0.25 / (2**0.5 + 1e-8), atol=1e-7, rtol=0)
    with pytest.raises(ValueError, match="a push's optimizer is SGD, the table's is RowWiseAdagrad"):
        store.update(ids, grads, optimizer=SGD(lr=0.1))
    store.assign(ids, torch.zeros(2, DIM))  # weights only: the accumulators stay
    assert torch.equal(store.read_state(ids), torch.full((2, 1), 2.0))
    assert store.assign_state(_ids(2, 9), torch.tensor([[5.0], [7.0]])) == 2  # 9 inserted, as a lookup would
    assert torch.equal(store.read_state(_ids(1, 2, 9, 50)), torch.tensor([[2.0], [5.0], [7.0], [0.0]]))
    cold = _ids(60, 61)
    initial = Uniform(-0.1, 0.1).rows_for(cold, DIM, 3)
    assert torch.equal(store.lookup(cold, train=False), initial) and torch.equal(store.read(cold), initial)
    assert not bool(store.contains(cold).any())
    assert torch.equal(store.lookup(cold), initial)  # the training lookup inserts that very row
