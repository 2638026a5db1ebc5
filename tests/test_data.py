"""Training data: the Criteo-format reader (parsing, workers, errors, gzip) and the synthetic teacher generator."""

from __future__ import annotations

import gzip
import math
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from torchmetrics.classification import BinaryAUROC

from persia_planner.errors import SpecError
from persia_planner.modules.data import (
    FEATURE_NAMES,
    Batch,
    CriteoReader,
    SyntheticClicks,
    Teacher,
    teacher_auc,
    to_criteo,
    write_criteo,
)

# label, I1..I13, C1..C26: a full row, an all-missing row, and one with 16-digit / upper-case hex and a negative int.
HAND_ROWS = [
    ["1", "5", "", "0", "-1", "100", "1", "2", "3", "4", "5", "6", "7", "8"]
    + ["68fd1e64", "", "0", "FFFFFFFF"]
    + [f"{i:x}" for i in range(22)],
    ["0"] + [""] * 39,
    ["0", *(["12"] * 13), "ffffffffffffffff", "7fffffffffffffff"] + ["aB"] * 24,
]


def _write_text(path: Path, rows: list[list[str]], *, newline: str = "\n", trailing: bool = True) -> Path:
    text = newline.join("\t".join(r) for r in rows) + (newline if trailing else "")
    if path.suffix == ".gz":
        with gzip.open(path, "wt") as f:
            f.write(text)
    else:
        path.write_bytes(text.encode())
    return path


def _bags(batch: Batch) -> tuple[np.ndarray, np.ndarray]:
    """``[B, 26]`` ids and presence of a Criteo batch (every bag holds at most one id)."""
    jt = batch.sparse.to_dict()
    ids = np.zeros((batch.size, len(FEATURE_NAMES)), dtype=np.int64)
    present = np.zeros_like(ids, dtype=bool)
    for f, name in enumerate(FEATURE_NAMES):
        lengths = jt[name].lengths().numpy()
        assert lengths.max(initial=0) <= 1
        present[:, f] = lengths == 1
        ids[present[:, f], f] = jt[name].values().numpy()
    return ids, present


def _row_keys(batches: list[Batch]) -> list[tuple]:
    keys = []
    for b in batches:
        ids, present = _bags(b)
        for i in range(b.size):
            keys.append((float(b.labels[i]), tuple(b.dense[i].tolist()), tuple(np.where(present[i], ids[i], -7))))
    return keys


def _random_criteo(path: Path, n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, n)
    ints = rng.integers(-2, 5000, (n, 13))
    cats = rng.integers(0, 2**32, (n, 26))
    cat_missing = rng.random((n, 26)) < 0.2
    write_criteo(path, labels, ints, cats, int_missing=rng.random((n, 13)) < 0.2, cat_missing=cat_missing)
    return labels, ints, cats, cat_missing


# --- reader: parsing --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_reader_parses_hand_written_file_exactly(tmp_path, newline):
    path = _write_text(tmp_path / "day.tsv", HAND_ROWS, newline=newline, trailing=False)
    (batch,) = list(CriteoReader(path, batch_size=8, num_workers=0))
    assert batch.size == 3 and batch.teacher_prob is None
    assert batch.labels.dtype == torch.float32 and batch.labels.tolist() == [1.0, 0.0, 0.0]
    raw = np.array([[5, 0, 0, 0, 100, 1, 2, 3, 4, 5, 6, 7, 8], [0] * 13, [12] * 13], dtype=np.float64)
    # Missing and negative counts are 0 -> log1p(0) = 0.
    assert batch.dense.dtype == torch.float32
    assert torch.equal(batch.dense, torch.from_numpy(np.log1p(raw).astype(np.float32)))
    kjt = batch.sparse
    assert kjt.keys() == list(FEATURE_NAMES) and kjt.values().dtype == torch.int64
    # Key-major lengths: c1 = rows (1, 0, 1), c2 = (0, 0, 1) (missing in row 0), c3..c26 = (1, 0, 1).
    expected_lengths = [1, 0, 1, 0, 0, 1] + [1, 0, 1] * 24
    assert kjt.lengths().tolist() == expected_lengths
    assert kjt.offsets().tolist() == np.concatenate([[0], np.cumsum(expected_lengths)]).tolist()
    jt = kjt.to_dict()
    assert jt["c1"].values().tolist() == [0x68FD1E64, -1]  # 16 x 'f' keeps the uint64 bit pattern
    assert jt["c2"].values().tolist() == [0x7FFFFFFFFFFFFFFF]
    assert jt["c3"].values().tolist() == [0, 0xAB]
    assert jt["c4"].values().tolist() == [0xFFFFFFFF, 0xAB]
    assert jt["c26"].values().tolist() == [21, 0xAB]


def test_reader_hash_buckets_bound_ids(tmp_path):
    path = _write_text(tmp_path / "day.tsv", HAND_ROWS)
    (batch,) = list(CriteoReader(path, batch_size=8, num_workers=0, hash_buckets=1000))
    jt = batch.sparse.to_dict()
    assert jt["c1"].values().tolist() == [0x68FD1E64 % 1000, (2**64 - 1) % 1000]  # unsigned modulo
    assert all(0 <= v < 1000 for v in batch.sparse.values().tolist())
    (batch,) = list(CriteoReader(path, batch_size=8, num_workers=0, hash_buckets={"c4": 7}))
    jt = batch.sparse.to_dict()
    assert jt["c4"].values().tolist() == [0xFFFFFFFF % 7, 0xAB % 7]
    assert jt["c1"].values().tolist() == [0x68FD1E64, -1]  # unlisted features keep their ids
    with pytest.raises(SpecError, match=r"hash_buckets\.c99"):
        CriteoReader(path, batch_size=8, hash_buckets={"c99": 7})


# --- reader: workers, batching, gzip ----------------------------------------------------------------------------------
@pytest.mark.processes
def test_reader_two_workers_read_every_row_once(tmp_path):
    n, bs = 1000, 64
    labels, _, cats, cat_missing = _random_criteo(tmp_path / "day.tsv", n, seed=1)
    # Small chunks force lines to straddle chunk and shard boundaries.
    reference = list(CriteoReader(tmp_path / "day.tsv", batch_size=bs, num_workers=0))
    reader = CriteoReader(tmp_path / "day.tsv", batch_size=bs, num_workers=2, chunk_bytes=1000)
    batches = list(reader)
    assert [b.size for b in batches] == [bs] * (n // bs) + [n % bs]  # only the last batch is partial
    assert Counter(_row_keys(batches)) == Counter(_row_keys(reference))
    # num_workers=0 keeps file order: check it against what was written.
    assert torch.cat([b.labels for b in reference]).tolist() == labels.tolist()
    ids = np.concatenate([_bags(b)[0] for b in reference])
    present = np.concatenate([_bags(b)[1] for b in reference])
    assert np.array_equal(present, ~cat_missing) and np.array_equal(ids[present], cats[~cat_missing])
    # Deterministic for a given num_workers.
    again = list(CriteoReader(tmp_path / "day.tsv", batch_size=bs, num_workers=2, chunk_bytes=1000))
    for a, b in zip(batches, again, strict=True):
        assert torch.equal(a.labels, b.labels) and torch.equal(a.sparse.values(), b.sparse.values())
    dropped = list(CriteoReader(tmp_path / "day.tsv", batch_size=bs, num_workers=2, drop_last=True))
    assert [b.size for b in dropped] == [bs] * (n // bs)


@pytest.mark.processes
def test_reader_gzip_multiple_files_and_tiny_files(tmp_path):
    _random_criteo(tmp_path / "a.tsv", 300, seed=2)
    _random_criteo(tmp_path / "b.tsv.gz", 200, seed=3)
    _write_text(tmp_path / "c.tsv", HAND_ROWS[:1])  # fewer lines than workers
    paths = [tmp_path / "a.tsv", tmp_path / "b.tsv.gz", tmp_path / "c.tsv"]
    plain = [tmp_path / "a.tsv", tmp_path / "b.tsv", tmp_path / "c.tsv"]
    (tmp_path / "b.tsv").write_bytes(gzip.decompress((tmp_path / "b.tsv.gz").read_bytes()))
    reference = _row_keys(list(CriteoReader(plain, batch_size=50, num_workers=0)))
    assert len(reference) == 501
    for workers in (0, 2, 3):
        batches = list(CriteoReader(paths, batch_size=50, num_workers=workers, shuffle_files=True, seed=5))
        assert [b.size for b in batches] == [50] * 10 + [1]
        assert Counter(_row_keys(batches)) == Counter(reference)


# --- reader: errors ---------------------------------------------------------------------------------------------------
@pytest.mark.processes
@pytest.mark.parametrize(
    ("bad_row", "column", "problem"),
    [
        (["1", "2", "3"], "", "expected 40 tab-separated columns .* found 3"),
        (["1", "x7", *[""] * 12, *["ab"] * 26], "I1", "'x7' is not an integer"),
        (["1", *["3"] * 13, "zz", *["ab"] * 25], "C1", "'zz' is not hexadecimal"),
        (["1", *["3"] * 13, *["ab"] * 25, "1" * 17], "C26", "is not hexadecimal"),
        (["1", "7" * 19, *[""] * 12, *["ab"] * 26], "I1", "is not an integer"),
        (["0", "", "", "--1", *[""] * 10, *["ab"] * 26], "I3", "'--1' is not an integer"),
        (["1", *["3"] * 13, "a" * 100_000, *["ab"] * 25], "C1", "is not hexadecimal"),
        (["2", *["3"] * 13, *["ab"] * 26], "label", "label '2' is not 0 or 1"),
        (["", *["3"] * 13, *["ab"] * 26], "label", "label '' is not 0 or 1"),
    ],
)
@pytest.mark.parametrize("workers", [0, 2])
def test_reader_malformed_line_names_file_and_line(tmp_path, bad_row, column, problem, workers):
    good = HAND_ROWS * 40  # the bad line is line 101, in the second worker's byte range
    path = _write_text(tmp_path / "day.tsv", [*good[:100], bad_row, *good[100:]])
    reader = CriteoReader(path, batch_size=16, num_workers=workers, chunk_bytes=700)
    with pytest.raises(SpecError) as err:
        list(reader)
    message = str(err.value)
    assert "\n" not in message and len(message) < len(str(path)) + 200
    where = f"{path}:101: {column}: " if column else f"{path}:101: "
    assert message.startswith(where), message
    assert re.search(problem, message), message


def test_reader_rejects_missing_file_and_bad_arguments(tmp_path):
    with pytest.raises(SpecError, match="file not found"):
        CriteoReader(tmp_path / "nope.tsv", batch_size=4)
    path = _write_text(tmp_path / "day.tsv", HAND_ROWS)
    with pytest.raises(SpecError, match="batch_size"):
        CriteoReader(path, batch_size=0)


# --- synthetic ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def teacher() -> Teacher:
    return Teacher(rows=10_000, alpha=1.05, seed=7)


def _same(a: Batch, b: Batch) -> bool:
    return (
        torch.equal(a.dense, b.dense)
        and torch.equal(a.labels, b.labels)
        and torch.equal(a.teacher_prob, b.teacher_prob)
        and torch.equal(a.sparse.values(), b.sparse.values())
        and torch.equal(a.sparse.lengths(), b.sparse.lengths())
    )


def test_synthetic_is_deterministic(teacher):
    a = list(SyntheticClicks(teacher, batch_size=256, num_batches=3, seed=1))
    b = list(SyntheticClicks(Teacher(rows=10_000, alpha=1.05, seed=7), batch_size=256, num_batches=3, seed=1))
    c = list(SyntheticClicks(teacher, batch_size=256, num_batches=3, seed=2))
    assert all(_same(x, y) for x, y in zip(a, b, strict=True))
    assert not _same(a[0], c[0])
    assert _same(SyntheticClicks(teacher, batch_size=256, num_batches=3, seed=1).batch(2), a[2])
    assert a[0].sparse.keys() == list(FEATURE_NAMES) and a[0].dense.shape == (256, 13)


def test_synthetic_ctr_zipf_skew_and_teacher_auc(teacher):
    batches = list(SyntheticClicks(teacher, batch_size=8192, num_batches=4, seed=3))
    labels = torch.cat([b.labels for b in batches])
    prob = torch.cat([b.teacher_prob for b in batches])
    n = labels.numel()
    assert abs(float(prob.mean()) - 0.25) < 0.01
    assert abs(float(labels.mean()) - 0.25) < 4 * math.sqrt(0.25 * 0.75 / n) + 0.01
    # Zipf: the top 1% of ids (ranks 0..99 of 10k) should take sum_{r<=100} r^-a / sum_{r<=10k} r^-a of lookups.
    expected = sum(r**-1.05 for r in range(1, 101)) / sum(r**-1.05 for r in range(1, 10_001))
    assert expected == pytest.approx(teacher.expected_share("c5", 100)) and expected > 0.5
    top = set(teacher.ids_of_rank("c5", range(100)).tolist())
    ids = torch.cat([b.sparse["c5"].values() for b in batches]).tolist()
    share = sum(i in top for i in ids) / len(ids)
    assert abs(share - expected) < 0.02, (share, expected)
    assert all(0 <= i < 2**63 for i in ids)
    # The teacher's AUC: well above chance, equal to torchmetrics and to a rank-sum (Mann-Whitney) computation.
    auc = teacher_auc(batches)
    assert 0.75 < auc < 0.95
    metric = BinaryAUROC()
    metric.update(prob, labels.long())
    assert auc == pytest.approx(float(metric.compute()), abs=1e-6)
    assert auc == pytest.approx(_mann_whitney_auc(prob.numpy(), labels.numpy()), abs=1e-6)
    # The teacher recomputes its own probabilities from the batch features.
    assert torch.allclose(teacher.prob(batches[0]), batches[0].teacher_prob, atol=1e-6)


def _mann_whitney_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """AUC as the normalised rank sum of the positives (ties get their average rank)."""
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    average_rank = np.cumsum(counts) - (counts - 1) / 2.0  # 1-based average rank of each distinct score
    ranks = average_rank[inverse]
    pos = labels == 1
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def test_synthetic_variable_pooling(teacher):
    ds = SyntheticClicks(teacher, batch_size=4096, num_batches=1, pooling={"c1": 3.0, "c2": 0.5}, seed=4)
    batch = ds.batch(0)
    jt = batch.sparse.to_dict()
    assert float(jt["c1"].lengths().float().mean()) == pytest.approx(3.0, abs=0.1)
    assert int(jt["c1"].lengths().min()) >= 1
    assert float(jt["c2"].lengths().float().mean()) == pytest.approx(0.5, abs=0.05)
    assert set(jt["c3"].lengths().tolist()) == {1}
    with pytest.raises(SpecError, match="at most one id"):
        to_criteo(ds, Path("/nonexistent/never-written.tsv"))
    with pytest.raises(SpecError, match=r"pooling\.c99"):
        SyntheticClicks(teacher, batch_size=4, num_batches=1, pooling={"c99": 1.0})


@pytest.mark.processes
@pytest.mark.parametrize("suffix", [".tsv", ".tsv.gz"])
def test_synthetic_to_criteo_reads_back(tmp_path, teacher, suffix):
    ds = SyntheticClicks(teacher, batch_size=500, num_batches=3, pooling={"c7": 0.6}, seed=9)
    path = to_criteo(ds, tmp_path / f"synthetic{suffix}")
    written = list(ds)
    read = list(CriteoReader(path, batch_size=500, num_workers=0))
    assert len(read) == len(written)
    for w, r in zip(written, read, strict=True):
        assert torch.equal(w.labels, r.labels)
        assert torch.equal(w.dense, r.dense)  # integer counts -> log1p on both sides
        assert torch.equal(w.sparse.lengths(), r.sparse.lengths())
        assert torch.equal(w.sparse.values(), r.sparse.values())
        assert torch.allclose(teacher.prob(r), w.teacher_prob, atol=1e-6)
    two_workers = list(CriteoReader(path, batch_size=128, num_workers=2))
    assert Counter(_row_keys(two_workers)) == Counter(_row_keys(read))
