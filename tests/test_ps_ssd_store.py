"""The ``ssd`` tier's store: rows on a real file behind a DDR cache train exactly as an all-DDR store does."""

from __future__ import annotations

import pytest
import torch

from persia_planner.model.specs import DType, Optimizer
from persia_planner.modules.ps.optim import RowWiseAdagrad
from persia_planner.modules.ps.row_file import BLOCK_BYTES, HEADER_BYTES, RowFile
from persia_planner.modules.ps.ssd_store import SsdStore
from persia_planner.modules.ps.store import EmbeddingStore
from persia_planner.placement.memory import ps_server_capacity, ssd_bytes, ssd_record_size, ssd_server_cache_capacity

DIM = 8


def _store(capacity: int, dtype: torch.dtype = torch.float32) -> EmbeddingStore:
    return EmbeddingStore(DIM, capacity, RowWiseAdagrad(lr=0.1), init_seed=7, eviction_chunk=0, weight_dtype=dtype)


def _ssd(tmp_path, cache_rows: int, disk_rows: int, dtype: torch.dtype = torch.float32) -> SsdStore:
    return SsdStore(_store(cache_rows, dtype), tmp_path / "t.rows", disk_rows)


def _batches(n: int, ids: int, size: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, ids, (size,), generator=g) for _ in range(n)]


def test_record_layout_packs_rows_in_blocks_and_spans_blocks_past_one(tmp_path):
    small = RowFile(tmp_path / "a", 1000, 8, torch.float16, 1)
    assert small.record == ssd_record_size(8, 2, 1) == 20
    assert small.per_unit == BLOCK_BYTES // 20 and small.unit_bytes == BLOCK_BYTES
    wide = RowFile(tmp_path / "b", 10, 1200, torch.float32, 1)
    assert wide.per_unit == 1 and wide.unit_bytes == 2 * BLOCK_BYTES
    assert (tmp_path / "b").stat().st_size == HEADER_BYTES + 10 * 2 * BLOCK_BYTES
    wide.close()
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("dim", [8, 1200])
def test_rows_written_read_back_exactly_and_unwritten_rows_read_as_zeros(tmp_path, dim):
    f = RowFile(tmp_path / "rows", 5000, dim, torch.float16, 2)
    slots = torch.tensor([4999, 3, 700, 4, 2500])
    w = torch.randn(5, dim).half()
    s = torch.randn(5, 2)
    f.write(slots, w, s)
    got_w, got_s = f.read(torch.tensor([3, 4999, 1, 4]))
    assert torch.equal(got_w[[0, 1, 3]], w[[1, 0, 3]]) and torch.equal(got_s[[0, 1, 3]], s[[1, 0, 3]])
    assert not got_w[2].any() and not got_s[2].any()
    f.write(torch.tensor([3]), torch.ones(1, dim), torch.zeros(1, 2))  # a read-modify-write keeps its block's others
    got_w, _ = f.read(torch.tensor([3, 4]))
    assert torch.equal(got_w[0], torch.ones(dim).half()) and torch.equal(got_w[1], w[3])
    f.close()


@pytest.mark.parametrize("disk_rows", [4000, 2100])  # 2,100: the log fills its file and compacts often
def test_a_small_cache_over_disk_trains_exactly_as_an_all_ddr_store(tmp_path, disk_rows):
    ddr = _store(4000)
    ssd = _ssd(tmp_path, cache_rows=300, disk_rows=disk_rows)
    for i, ids in enumerate(_batches(40, 2000, 256)):
        assert torch.equal(ssd.lookup(ids), ddr.lookup(ids))
        grads = torch.randn(ids.numel(), DIM, generator=torch.Generator().manual_seed(i))
        # the gradient of an older batch arrives late, as with staleness K: some of its rows left the cache since
        late = _batches(1, 2000, 256, seed=i)[0] if i else ids
        assert ssd.update(late, grads) == ddr.update(late, grads)
    m = ssd.metrics()
    assert m["disk_reads"] > 0 and m["disk_writes"] > 0 and m["disk_updates"] > 0 and m["disk_full"] == 0
    assert m["compactions"] >= (4 if disk_rows < 4000 else 1)  # the log filled its file and was compacted
    assert m["cached_rows"] <= 300 and len(ssd) == len(ddr)
    every = torch.arange(2000)
    assert torch.equal(ssd.read(every), ddr.read(every))
    assert torch.equal(ssd.lookup(every, train=False), ddr.lookup(every, train=False))


def test_checkpoint_holds_every_row_on_disk_and_loads_into_a_new_file(tmp_path):
    ssd = _ssd(tmp_path, cache_rows=100, disk_rows=3000, dtype=torch.float16)
    for ids in _batches(20, 1500, 200):
        ssd.lookup(ids)
        ssd.update(ids, torch.randn(ids.numel(), DIM))
    saved = ssd.state_dict()
    assert saved["ids"].numel() == len(ssd) > 100 and saved["weights"].dtype == torch.float16
    (tmp_path / "again").mkdir()
    restored = _ssd(tmp_path / "again", cache_rows=50, disk_rows=3000, dtype=torch.float16)
    restored.load_state_dict(saved)
    every = torch.arange(1500)
    assert torch.equal(restored.read(every), ssd.read(every))
    into_ddr = _store(3000, torch.float16)  # the same checkpoint loads on the ps tier, and back
    into_ddr.load_state_dict(saved)
    assert torch.equal(into_ddr.read(every), ssd.read(every))
    (tmp_path / "small").mkdir()
    with pytest.raises(ValueError, match="disk holds 10"):
        _ssd(tmp_path / "small", cache_rows=5, disk_rows=10).check_state_dict(saved)


def test_a_full_disk_drops_rows_and_counts_them(tmp_path):
    ssd = _ssd(tmp_path, cache_rows=50, disk_rows=60)
    for ids in _batches(10, 1000, 100):
        ssd.lookup(ids)
    assert ssd.metrics()["disk_full"] > 0 and len(ssd) <= 60 + 50


@pytest.mark.parametrize("dtype", [DType.FP32, DType.FP16])
def test_the_planner_charges_the_file_and_the_ddr_a_server_of_a_planned_table_takes(tmp_path, dtype):
    rows, fraction = 20_000, 0.05
    torch_dtype = torch.float16 if dtype is DType.FP16 else torch.float32
    cache = EmbeddingStore(
        DIM, ssd_server_cache_capacity(rows, 1, fraction), RowWiseAdagrad(), init_seed=7, weight_dtype=torch_dtype
    )
    ssd = SsdStore(cache, tmp_path / "t.rows", ps_server_capacity(rows, 1))
    for ids in _batches(30, rows, 2000):
        ssd.lookup(ids)
    ddr, disk = ssd_bytes(rows, DIM, Optimizer.ROWWISE_ADAGRAD, dtype, fraction)
    assert (tmp_path / "t.rows").stat().st_size == disk
    assert len(ssd) > cache.capacity and 0.9 * ddr <= ssd.resident_bytes() <= ddr
