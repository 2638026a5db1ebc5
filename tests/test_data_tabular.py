"""Parquet / CSV click logs: id hashing, the reader's values, sharding across trainers and workers (Criteo's too),
the schema checks before any process starts, and TorchRec Batches through the training loop."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from processes import cli_in_fresh_interpreter

from persia_planner.errors import PlannerError, SpecError
from persia_planner.model.data_schema import BadRowPolicy, DataSchema, DenseTransform, SparseColumn, load_data_schema
from persia_planner.model.specs import ModelSpec, TableSpec, load_model
from persia_planner.modules.data import Batch, CriteoReader, TabularReader, as_batch, hash_ids
from persia_planner.modules.data.blocks import BAD_ROW_FIXES, BadRowCount
from persia_planner.modules.data.shards import Shard, assign
from persia_planner.modules.train.batch_stream import Epochs, file_reader, held_out_batches, training_batches
from persia_planner.modules.train.config import TrainConfig
from persia_planner.modules.train.run_inputs import check_before_start

ROOT = Path(__file__).resolve().parents[1]
MASK = 2**64 - 1

MODEL_YAML = """
name: clicks
batch_size: 128
tables:
  - {name: user_id, rows: 200_000, dim: 16}
  - {name: item_ids, rows: 150_000, dim: 16, pooling_factor: 2}
  - {name: country, rows: 50, dim: 16}
data:
  label: clicked
  dense: [age, price]
  sparse:
    user_id: user
    item_ids: {column: items}
    country: country
"""


def _signed(x: int) -> int:
    return x - 2**64 if x >= 2**63 else x


def _splitmix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def ref_string(s: str) -> int:
    """FNV-1a 64 of the UTF-8 bytes, then splitmix64, written out one byte at a time."""
    h = 0xCBF29CE484222325
    for byte in s.encode():
        h = ((h ^ byte) * 0x100000001B3) & MASK
    return _signed(_splitmix(h))


def ref_int(i: int) -> int:
    return _signed(_splitmix(i & MASK))


def _model(tmp_path: Path, text: str = MODEL_YAML) -> ModelSpec:
    path = tmp_path / "model.yaml"
    path.write_text(text)
    return load_model(path)


def _clicks(n: int, start: int = 0) -> pa.Table:
    """``n`` rows: string users, a multi-hot list of item strings (some empty or missing), int countries."""
    rows = range(start, start + n)
    return pa.table(
        {
            "clicked": [i % 2 for i in rows],
            "age": [None if i % 5 == 0 else float(i) for i in rows],
            "price": [i * 0.5 for i in rows],
            "user": [None if i % 7 == 3 else f"u{i % 13}" for i in rows],
            "items": [None if i % 6 == 5 else [f"it{(i + k) % 11}" for k in range(i % 4)] for i in rows],
            "country": [i % 9 for i in rows],
        }
    )


def _write_parquet(directory: Path, files: int, groups: int, rows: int) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        pq.write_table(_clicks(groups * rows, f * groups * rows), directory / f"part-{f}.parquet", row_group_size=rows)
    (directory / "_SUCCESS").write_text("")  # Spark's marker: not a data file
    return directory


# ---- hashing -----------------------------------------------------------------------------------------------------


def test_ids_hash_to_stable_int64_whatever_their_encoding():
    words = ["a", "", "user-42", "ünïcode", "a" * 70]
    expected = [ref_string(w) for w in words]
    assert hash_ids(pa.array(words)).tolist() == expected
    assert hash_ids(pa.array(words, pa.large_string())).tolist() == expected
    assert hash_ids(pa.array(words).dictionary_encode()).tolist() == expected
    assert hash_ids(pa.array(["x", *words])[1:]).tolist() == expected  # a slice: offsets into shared buffers
    ints = [0, 1, -1, 2**63 - 1, 123456789]
    assert hash_ids(pa.array(ints, pa.int64())).tolist() == [ref_int(i) for i in ints]
    assert hash_ids(pa.array([7], pa.int32())).tolist() == [ref_int(7)]
    assert hash_ids(pa.array(["7"])).tolist() != hash_ids(pa.array([7])).tolist()
    assert hash_ids(pa.array(["a"])).dtype == np.int64


def _mix(x: int) -> int:
    """splitmix64's finaliser, written out on Python ints."""
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & MASK
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def ref_row_key(label: float, dense: list[float], bags: list[list[int]]) -> int:
    """A row's content hash written out: the salt, then each float32's bits and each bag's sum of mixed ids plus its
    length, mixed in one after another."""
    bits = [int(np.float32(x).view(np.uint32)) for x in (label, *dense)]
    h = 0x5EED0FA11C0FFEE
    for b in bits:
        h = _mix(h ^ b)
    for bag in bags:
        h = _mix(h ^ ((sum(_mix(i & MASK) for i in bag) + len(bag)) & MASK))
    return h


_PINNED_ROWS = [  # label, dense, and two features' bags: ids across the whole int64 range
    (0, [0.5, -2.0], [[-1], [3]]),
    (1, [1e30, 0.0], [[2**62, -(2**63)], [4]]),
    (1, [3.0, 3.0], [[], [5]]),
    (0, [0.0, 0.0], [[7, 8, 9], [6]]),
    (1, [-1.5, 7.25], [[2**63 - 1], []]),
    (0, [2.0, 1.0], [[5], [7]]),
    (0, [0.0, -0.0], [[42, 43], [8]]),
    (1, [9.0, 9.0], [[0], [9]]),
]


def _pinned_block():
    from persia_planner.modules.data.blocks import TabularBlock

    bags = [[row[2][f] for row in _PINNED_ROWS] for f in range(2)]
    return TabularBlock(
        np.array([row[0] for row in _PINNED_ROWS], np.float32),
        np.array([row[1] for row in _PINNED_ROWS], np.float32),
        tuple(np.array([len(b) for b in feature], np.int32) for feature in bags),
        tuple(np.array([i for b in feature for i in b], np.int64) for feature in bags),
    )


def test_the_held_out_row_hash_is_exact_in_uint64_and_pinned():
    """No float anywhere (numpy once joined a Python 0 and the uint64 sums as float64, with a warning, losing bits):
    the keys are the written-out hash's, and the held-out rows these."""
    import warnings

    from persia_planner.modules.data.split import RowSplit

    block = _pinned_block()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        keys = block.row_keys()
    assert keys.dtype == np.uint64
    assert [int(k) for k in keys] == [ref_row_key(*row) for row in _PINNED_ROWS]
    assert [hex(int(k)) for k in keys] == [
        "0xd89ac397431d0912", "0x1d9b915f4c7a20b4", "0x3eb46bb304e5b0e3", "0x75794d8262e09ed0",
        "0xcb93667075cca775", "0xe113871e648331ab", "0x55da5d1f4736b55", "0xf65a6a162c0bdbfc",
    ]  # fmt: skip
    assert np.flatnonzero(RowSplit(0.5, held_out=True).mask(keys)).tolist() == [1, 2, 3, 6]
    assert np.flatnonzero(RowSplit(0.05, held_out=True).mask(keys)).tolist() == [6]
    # A bag's ids in another order, the same row.
    assert block.take(np.array([3])).row_keys()[0] == keys[3]
    shuffled = dataclasses.replace(block, values=(block.values[0][[0, 1, 2, 5, 4, 3, 6, 7, 8, 9, 10]], block.values[1]))
    assert (shuffled.row_keys() == keys).all()


# ---- the reader's values -----------------------------------------------------------------------------------------


def _bags(batch: Batch, key: str) -> list[list[int]]:
    jt = batch.sparse[key]
    values, offsets = jt.values().tolist(), jt.offsets().tolist()
    return [values[offsets[i] : offsets[i + 1]] for i in range(batch.size)]


def test_parquet_reader_values_multi_hot_and_missing(tmp_path):
    spec = _model(tmp_path)
    table = _clicks(10)
    pq.write_table(table, tmp_path / "c.parquet", row_group_size=4)
    batches = list(TabularReader(tmp_path / "c.parquet", spec.data, fmt="parquet", batch_size=4))
    assert [b.size for b in batches] == [4, 4, 2]
    assert batches[0].sparse.keys() == ["user_id", "item_ids", "country"]
    rows = table.to_pylist()
    labels = torch.cat([b.labels for b in batches])
    dense = torch.cat([b.dense for b in batches])
    assert labels.dtype == torch.float32 and labels.tolist() == [float(r["clicked"]) for r in rows]
    assert dense.tolist() == [[r["age"] or 0.0, r["price"]] for r in rows]  # a missing age reads as 0
    users = [bag for b in batches for bag in _bags(b, "user_id")]
    items = [bag for b in batches for bag in _bags(b, "item_ids")]
    countries = [bag for b in batches for bag in _bags(b, "country")]
    assert users == [[] if r["user"] is None else [ref_string(r["user"])] for r in rows]
    assert items == [[ref_string(x) for x in r["items"] or []] for r in rows]
    assert [len(bag) for bag in items] == [0, 1, 2, 3, 0, 0, 2, 3, 0, 1]  # multi-hot lengths; a missing list is empty
    assert countries == [[ref_int(r["country"])] for r in rows]


def test_csv_reader_header_separator_and_missing_values(tmp_path):
    path = tmp_path / "c.csv"
    path.write_text("id,clicked,age,user,tags\n1,1,3.5,alice,a|b\n2,0,,bob,\n3,1,2,,c||d|c\n")
    schema = DataSchema("clicked", ("age",), (SparseColumn("u", "user", "u"), SparseColumn("t", "tags", "t", "|")))
    (batch,) = TabularReader(path, schema, fmt="csv", batch_size=8)
    assert batch.labels.tolist() == [1.0, 0.0, 1.0] and batch.dense.tolist() == [[3.5], [0.0], [2.0]]
    assert _bags(batch, "u") == [[ref_string("alice")], [ref_string("bob")], []]
    assert _bags(batch, "t") == [[ref_string(x) for x in bag] for bag in (["a", "b"], [], ["c", "d", "c"])]


def test_gzip_csv_files_of_a_directory_are_read_whole_in_name_order(tmp_path):
    import gzip

    for k in range(2):
        with gzip.open(tmp_path / f"part-{k}.csv.gz", "wt") as f:
            f.write("y,a,u\n" + "".join(f"{i % 2},{i},x{i}\n" for i in range(5 * k, 5 * k + 5)))
    schema = DataSchema("y", ("a",), (SparseColumn("u", "u", "u"),))
    cfg = TrainConfig(data=f"csv:{tmp_path}", steps=2, trainers=1)
    spec = ModelSpec("m", 8, (), data=schema)
    got = [b.dense[:, 0].tolist() for b in file_reader(spec, cfg, 4)]
    assert got == [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0]]


def test_a_schema_for_other_data_is_refused_naming_where_it_came_from():
    given = DataSchema("y", (), (SparseColumn("u", "u", "u"),), source="s.yaml", from_file=True)
    with pytest.raises(PlannerError) as err:
        TrainConfig(schema=given)
    assert str(err.value) == (
        "--schema s.yaml maps the columns of Parquet or CSV files, not --data synthetic; "
        "fix: drop --schema or pass --data parquet:PATH or csv:PATH"
    )
    # A model's data: (persia predict hands a checkpoint's to TrainConfig): no --schema was given to drop.
    model = DataSchema("y", (), (SparseColumn("u", "u", "u"),), source="ck/step-000000010/model.yaml")
    with pytest.raises(PlannerError) as err:
        TrainConfig(schema=model, data="criteo:/d/day_0.tsv")
    assert str(err.value) == (
        "--data criteo:/d/day_0.tsv: the model's columns (data: of ck/step-000000010/model.yaml) are those of "
        "Parquet or CSV files, which this data is not; fix: pass --data parquet:PATH or csv:PATH, files with those "
        "columns"
    )


def test_a_bad_label_names_the_file_row_and_column(tmp_path):
    path = tmp_path / "c.csv"
    path.write_text("clicked,user\n1,a\n\n2,b\n")  # an empty line is no row
    schema = DataSchema("clicked", (), (SparseColumn("u", "user", "u"),))
    with pytest.raises(SpecError) as err:
        list(TabularReader(path, schema, fmt="csv", batch_size=8))
    assert str(err.value) == (
        f"csv:{path} row 3, column 'clicked': label 2: labels are 0 or 1; fix: make the label column hold 0 and 1"
    )


# ---- bad rows ------------------------------------------------------------------------------------------------------
NAN, INF = float("nan"), float("inf")
FIX = "; fix: " + " or ".join(BAD_ROW_FIXES)


def _bad_rows() -> pa.Table:
    """Eight rows, five bad: a NaN, no label, a -inf (which b's clip would hide), a NaN label, an inf."""
    return pa.table(
        {
            "y": pa.array([1, 0, None, 1, NAN, 0, 1, 0], pa.float64()),
            "a": [1.0, NAN, 2.0, 3.0, 4.0, INF, None, 5.0],  # None: a missing value, which reads as 0
            "b": [10.0, 20.0, 30.0, -INF, 50.0, 60.0, 70.0, 80.0],
            "u": list("pqrstvwx"),
        }
    )


def _bad_rows_schema(policy: str, **fills: float) -> DataSchema:
    transforms = {"a": DenseTransform(fill=fills.get("a")), "b": DenseTransform(clip=(0.0, 100.0), fill=fills.get("b"))}
    schema = DataSchema("y", ("a", "b"), (SparseColumn("u", "u", "u"),), transforms=transforms)
    return dataclasses.replace(schema, on_bad_row=BadRowPolicy(policy))


def test_fail_names_the_first_bad_row_of_a_parquet_file(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.concat_tables([_clicks_like(20), _bad_rows()]), path, row_group_size=12)
    with pytest.raises(SpecError) as err:
        list(TabularReader(path, _bad_rows_schema("fail"), fmt="parquet", batch_size=5))
    assert str(err.value) == f"parquet:{path} row 22, column 'a': NaN{FIX}"


def _clicks_like(n: int) -> pa.Table:
    return pa.table(
        {"y": pa.array([i % 2 for i in range(n)], pa.float64()), "a": [float(i) for i in range(n)],
         "b": [1.0] * n, "u": [f"g{i}" for i in range(n)]}
    )  # fmt: skip


def test_skip_leaves_the_bad_rows_out_and_counts_them():
    from persia_planner.modules.data.blocks import to_block

    block = to_block(_bad_rows(), _bad_rows_schema("skip"))
    assert block.labels.tolist() == [1.0, 1.0, 0.0] and block.dense.tolist() == [[1, 10], [0, 70], [5, 80]]
    assert block.values[0].tolist() == hash_ids(pa.array(list("pwx"))).tolist()
    assert (block.skipped, block.imputed) == (5, 0)


def test_impute_reads_a_bad_value_as_the_columns_mean_and_leaves_rows_without_a_label_out():
    from persia_planner.modules.data.blocks import to_block

    block = to_block(_bad_rows(), _bad_rows_schema("impute", a=2.5, b=200.0))
    assert block.labels.tolist() == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]  # rows 2 and 4 have no label
    # The fill before the transforms: b's 200 clipped to 100, as its other values are.
    assert block.dense.tolist() == [[1, 10], [2.5, 20], [3, 100], [2.5, 60], [0, 70], [5, 80]]
    assert (block.skipped, block.imputed) == (2, 3)


@pytest.mark.parametrize(
    ("table", "line"),
    [
        (_bad_rows().slice(2), "row 1, column 'y': no label"),
        (_bad_rows().slice(3), "row 1, column 'b': -inf"),  # the clip would make it 0: found as read
        (_bad_rows().slice(4), "row 1, column 'y': label NaN"),
        (_bad_rows().slice(5), "row 1, column 'a': inf"),
        (
            pa.table({"y": [1.0], "a": [1e39], "b": [1.0], "u": ["p"]}),  # a float64 that float32 cannot hold
            "row 1, column 'a': 1e+39 is beyond float32's range",
        ),
    ],
)
def test_fail_names_each_kind_of_bad_row(tmp_path, table, line):
    path = tmp_path / "d.parquet"
    pq.write_table(table, path)
    with pytest.raises(SpecError) as err:
        list(TabularReader(path, _bad_rows_schema("fail"), fmt="parquet", batch_size=4))
    assert str(err.value) == f"parquet:{path} {line}{FIX}"


def test_a_csv_nan_is_a_bad_value_and_an_empty_cell_a_missing_one(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("y,a,b,u\n1,,1,nan\n0,2,3,p\n\n1,3,NaN,q\n0,1e39,2,r\n")
    schema = _bad_rows_schema("skip")
    counts = BadRowCount()
    (batch,) = TabularReader(path, schema, fmt="csv", batch_size=8, counts=counts)
    assert batch.dense.tolist() == [[0, 1], [2, 3]] and (counts.skipped, counts.imputed) == (2, 0)
    assert _bags(batch, "u") == [[], [ref_string("p")]]  # an id spelled nan stays missing
    with pytest.raises(SpecError) as err:
        list(TabularReader(path, _bad_rows_schema("fail"), fmt="csv", batch_size=8))
    assert str(err.value) == f"csv:{path} row 4, column 'b': NaN{FIX}"  # line 5: the empty line 4 counts


def test_a_value_beyond_float32_after_its_transforms_is_bad(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("y,a,u\n1,1e-30,p\n0,1e10,q\n")
    tiny = DenseTransform(standardize=True, mean=0.0, std=1.2e-38)
    schema = DataSchema("y", ("a",), (SparseColumn("u", "u", "u"),), transforms={"a": tiny})
    with pytest.raises(SpecError) as err:
        list(TabularReader(path, schema, fmt="csv", batch_size=8))
    assert str(err.value) == (
        f"csv:{path} row 2, column 'a': 1e+10 is beyond float32's range after standardize (mean 0, std 1.2e-38){FIX}"
    )


def test_the_readers_counts_reach_the_reading_process_once_however_the_rows_are_cut(tmp_path):
    """A split, a shuffle and batches of 3: every read row's count arrives, even where the last rows read were all
    bad (no row left to carry it)."""
    from persia_planner.modules.data.shards import DataPass
    from persia_planner.modules.data.split import RowSplit

    path = tmp_path / "d.parquet"
    table = pa.concat_tables([_clicks_like(30), _bad_rows(), _clicks_like(7), _bad_rows().slice(1, 1)])
    pq.write_table(table, path, row_group_size=9)
    for reading in (None, DataPass(epoch=1, shuffle_rows=4, split=RowSplit(0.3, held_out=False))):
        counts = BadRowCount()
        reader = TabularReader(
            path, _bad_rows_schema("skip"), fmt="parquet", batch_size=3, reading=reading, counts=counts
        )
        rows = sum(b.size for b in reader)
        assert counts.skipped == 6 and (rows == 40 or reading is not None)


# ---- sharding ----------------------------------------------------------------------------------------------------


def test_assign_is_disjoint_and_complete():
    shards = [Shard("f", row_group=g) for g in range(11)]
    parts = [assign(shards, r, 2, w, 2) for r in range(2) for w in range(2)]
    assert sorted(s.row_group for p in parts for s in p) == list(range(11))
    assert [s.row_group for s in parts[0]] == [0, 4, 8] and [s.row_group for s in parts[3]] == [3, 7]


def _rows_read(reader) -> list[float]:
    return [x for b in reader for x in b.dense[:, 0].tolist()]


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_two_trainers_with_two_workers_read_every_row_once(tmp_path):
    schema = DataSchema("clicked", ("price",), (SparseColumn("user_id", "user", "user_id"),))
    data = _write_parquet(tmp_path / "pq", files=2, groups=4, rows=5)
    files = sorted(str(p) for p in data.glob("*.parquet"))
    got = [
        _rows_read(TabularReader(files, schema, fmt="parquet", batch_size=3, num_workers=2, rank=r, world=2))
        for r in range(2)
    ]
    assert sorted(got[0] + got[1]) == [i * 0.5 for i in range(40)]
    # Trainer 0 reads row groups 0, 2 of each file (global units 0, 2, 4, 6), and nothing else.
    assert sorted(got[0]) == [i * 0.5 for g in (0, 2, 4, 6) for i in range(g * 5, g * 5 + 5)]
    # CSV: byte ranges of one file.
    csv_path = tmp_path / "c.csv"
    csv_path.write_text("clicked,price,user\n" + "".join(f"{i % 2},{i},u{i}\n" for i in range(57)))
    got = [
        _rows_read(TabularReader(csv_path, schema, fmt="csv", batch_size=4, num_workers=2, rank=r, world=2))
        for r in range(2)
    ]
    assert sorted(got[0] + got[1]) == list(range(57)) and got[0] and got[1]
    # Criteo TSV goes through the same shards: I1 = the row number (read back through log1p).
    tsv = tmp_path / "day.tsv"
    tsv.write_text("".join(f"{i % 2}\t{i}" + "\t" * 12 + "\t" * 26 + "\n" for i in range(45)))
    got = [_rows_read(CriteoReader(tsv, batch_size=4, num_workers=2, rank=r, world=2)) for r in range(2)]
    rows = sorted(round(float(np.expm1(x))) for x in got[0] + got[1])
    assert rows == list(range(45)) and got[0] and got[1]


def _prices(batches) -> list[list[float]]:
    return [b.dense[:, 1].tolist() for b in batches]


def test_epochs_read_every_training_row_once_each_in_its_own_order_and_resume_where_they_were(tmp_path):
    spec = _model(tmp_path)
    data = _write_parquet(tmp_path / "pq", files=2, groups=4, rows=25)  # 200 rows, 8 row groups
    cfg = TrainConfig(data=f"parquet:{data}", epochs=3, eval_split=0.2, shuffle_buffer=24, eval_batches=100, trainers=1)
    epochs = Epochs()
    full = _prices(training_batches(spec, cfg, 8, epochs=epochs))
    held = sorted(
        x for b in _prices(file_reader(spec, cfg, 8, reading=_held_out_pass(0.2), drop_last=False)) for x in b
    )
    assert set(held) >= {x for b in _prices(held_out_batches(spec, cfg, 8)) for x in b}
    every = [i * 0.5 for i in range(200)]
    trained = sorted(set(every) - set(held))
    # About a fifth held out (a hash of each row's content), none of it ever in a training batch.
    assert 25 <= len(held) <= 55 and not set(held) & {x for b in full for x in b}
    n = len(trained) // 8
    assert epochs.lengths == [n, n, n] and len(full) == 3 * n
    for e in range(3):
        rows = [x for b in full[e * n : (e + 1) * n] for x in b]
        # Each epoch: distinct training rows, all but the last partial batch's.
        assert len(set(rows)) == len(rows) == 8 * n and set(rows) <= set(trained)
    assert full[:n] != full[n : 2 * n]  # another order each epoch
    # A resumed run reads on from where it was: in the first epoch, and in a later one.
    # The checkpoint may know the current epoch's length already (its last batch was read ahead of its step).
    for skip, known in ((5, []), (n + 3, [n]), (n - 1, [n]), (2 * n - 2, [n, n])):
        lengths = Epochs(list(known))
        resumed = _prices(training_batches(spec, cfg, 8, epochs=lengths, skip=skip))
        assert resumed == full[skip:] and lengths.lengths == [n, n, n], (skip, known)
    # --steps caps the stream.
    capped = dataclasses.replace(cfg, steps=n + 2)
    assert _prices(training_batches(spec, capped, 8)) == full[: n + 2]


def test_the_held_out_rows_are_the_same_whatever_the_seed_trainers_and_copies(tmp_path):
    spec = _model(tmp_path)
    one = _write_parquet(tmp_path / "one", files=1, groups=2, rows=50)
    twice = tmp_path / "twice"
    twice.mkdir()
    for k in range(2):  # the same rows in two files: a copy of the log
        (twice / f"part-{k}.parquet").write_bytes((one / "part-0.parquet").read_bytes())

    def held(data: Path, seed: int, world: int) -> list[float]:
        cfg = TrainConfig(data=f"parquet:{data}", eval_split=0.3, eval_batches=100, seed=seed, trainers=world)
        return sorted(
            x
            for rank in range(world)
            for b in _prices(file_reader(spec, cfg, 1, rank, world, reading=_held_out_pass(0.3)))
            for x in b
        )

    first = held(one, 0, 1)
    assert 15 <= len(first) <= 45  # about 30 of the 100 rows
    assert held(one, 7, 2) == first
    assert held(twice, 0, 2) == sorted(first + first)  # every copy of a held-out row is held out


def _held_out_pass(share: float):
    from persia_planner.modules.data.shards import DataPass
    from persia_planner.modules.data.split import RowSplit

    return DataPass(split=RowSplit(share, held_out=True))


# ---- checks before any process starts ------------------------------------------------------------------------------


def test_schema_from_model_yaml_and_from_a_schema_file(tmp_path):
    spec = _model(tmp_path)
    assert spec.data is not None and spec.data.tables == ("user_id", "item_ids", "country")
    assert spec.data.columns == ("clicked", "age", "price", "user", "items", "country")
    (tmp_path / "schema.yaml").write_text(
        "data:\n  label: y\n  sparse: {uid: {column: u, table: user_id, separator: ';'}}\n"
    )
    schema = load_data_schema(tmp_path / "schema.yaml")
    assert schema.sparse == (SparseColumn("uid", "u", "user_id", ";"),) and schema.dense == ()
    (tmp_path / "flat.yaml").write_text("label: y\nsparse: {user_id: u}\n")
    assert load_data_schema(tmp_path / "flat.yaml").tables == ("user_id",)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ("  label: y\n  sparse: {a: {column: x, colum: y}}\n", "model.yaml: data.sparse.a.colum: unknown key"),
        ("  label: y\n  dense: age\n  sparse: {a: x}\n", "model.yaml: data.dense: expected a list of column names"),
        ("  label: y\n  sparse: {a: x, b: {column: z, table: a}}\n", "data.sparse.b: feeds table 'a', which a"),
        ("  label: y\n  sparse: {a: y}\n", "column 'y' is the label column too"),
        ("  sparse: {a: x}\n", "model.yaml: data.label: required key is missing"),
    ],
)
def test_a_bad_data_section_is_one_line_naming_the_key(tmp_path, data, message):
    with pytest.raises(SpecError) as info:
        _model(tmp_path, "batch_size: 8\ntables: [{name: a, rows: 10, dim: 4}]\ndata:\n" + data)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_the_data_is_checked_against_the_model_before_any_process_starts(tmp_path):
    spec = _model(tmp_path)
    data = _write_parquet(tmp_path / "pq", files=1, groups=2, rows=40)
    part = data / "part-0.parquet"

    def check(
        schema: DataSchema | None = spec.data, source: str = f"parquet:{data}", model: ModelSpec = spec, **options
    ) -> TrainConfig:
        # 80 rows, half of them held out: a batch of 4 for each of the 2 trainers, and an evaluation batch
        cfg = TrainConfig(data=source, trainers=2, **({"batch_size": 4, "eval_split": 0.5} | options))
        return check_before_start(cfg, dataclasses.replace(model, data=schema), with_ps=False)

    assert 32 <= check().data_rows <= 48  # all well, and the training rows counted
    bad = {
        "no schema": (dict(schema=None), "needs the columns' roles (label, dense, sparse)"),
        "missing column": (
            dict(schema=dataclasses.replace(spec.data, dense=("age", "weight"))),
            f"{part}: weight: no such column (the schema's dense); the file has clicked, age",
        ),
        "string dense": (
            dict(
                schema=dataclasses.replace(
                    spec.data,
                    dense=("user",),
                    sparse=(*spec.data.sparse[1:], SparseColumn("user_id", "country", "user_id")),
                )
            ),
            f"{part}: user: a dense column is string, not numeric",
        ),
        "string label": (
            dict(
                schema=dataclasses.replace(
                    spec.data,
                    label="user",
                    sparse=(*spec.data.sparse[1:], SparseColumn("user_id", "country", "user_id")),
                )
            ),
            f"{part}: user: the label column is string, not numeric 0/1",
        ),
        "float ids": (
            dict(
                schema=dataclasses.replace(
                    spec.data, sparse=(*spec.data.sparse[1:], SparseColumn("user_id", "price", "user_id"))
                )
            ),
            "price: sparse feature 'user_id''s column is double: ids must be strings or integers, or lists of them",
        ),
        "table not fed": (
            dict(schema=dataclasses.replace(spec.data, sparse=spec.data.sparse[1:])),
            "model.yaml: data.sparse: no feature feeds table 'user_id' of model clicks",
        ),
        "unknown table": (
            dict(schema=dataclasses.replace(spec.data, sparse=(*spec.data.sparse, SparseColumn("x", "user", "x")))),
            "data.sparse.x: feeds table 'x', which model clicks does not have",
        ),
        "missing path": (dict(source=f"parquet:{tmp_path / 'none'}"), "none: file or directory not found"),
        "one row group": (
            dict(source=f"parquet:{_write_parquet(tmp_path / 'one', 1, 1, 4)}"),
            "1 row group(s) in 1 file(s) for 2 trainers",
        ),
        "csv column": (dict(source=f"csv:{_csv(tmp_path)}"), "c.csv: items: no such column"),
        "too few rows": (
            dict(batch_size=32),
            f"parquet:{data}: 80 rows, {check().data_rows} of them for training, hold no full batch of 32 samples "
            "for each of 2 trainers (64 rows a step)",
        ),
        "none held out": (
            dict(eval_split=0.001),
            "the 0% held out for validation (--eval-split): about 0 rows, none to evaluate on",
        ),
    }
    for name, (options, message) in bad.items():
        with pytest.raises(SpecError) as info:
            check(**options)
        assert message in str(info.value) and "\n" not in str(info.value), (name, str(info.value))


def _csv(tmp_path: Path) -> Path:
    path = tmp_path / "c.csv"
    path.write_text("clicked,age,price,user,country\n1,2,3,a,4\n")
    return path


@pytest.mark.processes
def test_persia_train_refuses_a_bad_schema_with_exit_2_without_importing_torch(tmp_path):
    _model(tmp_path)
    data = _write_parquet(tmp_path / "pq", files=1, groups=2, rows=4)
    (tmp_path / "schema.yaml").write_text("label: clicked\nsparse: {user_id: user, item_ids: nope, country: country}\n")
    cases = [
        ["train", "--model", str(tmp_path / "model.yaml"), "--data", f"csv:{tmp_path / 'none.csv'}"],
        [
            "train",
            "--model",
            str(tmp_path / "model.yaml"),
            "--data",
            f"parquet:{data}",
            "--schema",
            str(tmp_path / "schema.yaml"),
        ],
    ]
    results, torch_imported = cli_in_fresh_interpreter([(a, {}) for a in cases])
    (missing_code, missing), (column_code, column) = results
    assert missing_code == 2 and "none.csv: file or directory not found" in missing, missing
    assert column_code == 2 and "part-0.parquet: nope: no such column (the schema's sparse.item_ids)" in column, column
    assert "Traceback" not in missing + column and torch_imported is False


def _train_json(args: list[str]) -> dict:
    """``persia train ARGS`` on this machine (not under torchrun): its ``--json`` result; exit 0 asserted."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")}
    done = subprocess.run(
        [sys.executable, "-m", "persia_planner.cli", "train", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=540,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---- training --------------------------------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_torchrec_batches_train_through_the_loop_and_evaluate(tmp_path):
    """The Python API in one process, all tables local: TorchRec's Batch goes wherever ours goes."""
    from torchrec.datasets.utils import Batch as TorchRecBatch

    from persia_planner.modules.embedding.hybrid import SparseOptimizer
    from persia_planner.modules.train.batch_stream import evaluate
    from persia_planner.modules.train.loop import TrainLoop, build_model, make_optimizer

    spec = _model(tmp_path)
    pq.write_table(_clicks(256), tmp_path / "c.parquet", row_group_size=64)
    ours = list(TabularReader(tmp_path / "c.parquet", spec.data, fmt="parquet", batch_size=32))
    theirs = [TorchRecBatch(b.dense, b.sparse, b.labels.long()) for b in ours]
    assert as_batch(theirs[0]).labels.dtype == torch.float32 and as_batch(ours[0]) is ours[0]
    with pytest.raises(TypeError, match=r"expected a persia Batch or a torchrec\.datasets\.utils\.Batch, got int"):
        as_batch(3)
    arch = dataclasses.replace(spec.dense.built_arch, num_dense=len(spec.data.dense))
    model, hybrid = build_model(spec, None, arch=arch)
    cfg = TrainConfig(dense_lr=0.05, sparse_lr=0.1)
    opt = make_optimizer(model, cfg, SparseOptimizer(spec.tables[0].optimizer, learning_rate=0.1))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    stats = list(TrainLoop(model, hybrid, opt).run(theirs[:6]))
    assert len(stats) == 6 and all(np.isfinite(s.loss) and s.samples == 32 for s in stats)
    after = model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    result = evaluate(model, theirs[6:])
    assert result["eval_samples"] == 64 and 0.0 <= result["auc"] <= 1.0


@pytest.mark.processes
@pytest.mark.timeout(600)
def test_persia_train_on_parquet_with_a_data_section(tmp_path):
    """`persia train --data parquet:DIR` on the default local topology: 2 PS + 2 trainers, the two large tables on
    the servers, string ids and a multi-hot column, each trainer reading its row groups with 2 DataLoader workers."""
    _model(tmp_path)
    data = _write_parquet(tmp_path / "pq", files=2, groups=4, rows=100)
    args = ["--model", str(tmp_path / "model.yaml"), "--data", f"parquet:{data}", "--steps", "6"]
    args += ["--batch-size", "32", "--eval-batches", "2", "--eval-split", "0.2", "--data-workers", "2", "--json"]
    result = _train_json(args)
    assert sorted(result["ps_tables"]) == ["item_ids", "user_id"] and result["local_tables"] == ["country"]
    assert result["servers"] == 2 and result["trainers"] == 2 and result["steps"] == 6
    assert result["eval_samples"] == 2 * 2 * 32 and 0.0 <= result["auc"] <= 1.0
    assert result["data"] == f"parquet:{data}" and np.isfinite(result["loss"])
    # The click metrics, and the plan's prediction beside the measured step.
    assert result["normalized_entropy"] > 0 and result["calibration"] > 0 and 0 < result["eval_ctr"] < 1
    assert result["epochs"] == 1 and result["epoch_steps"] == []  # --steps 6 ends inside the first epoch
    assert set(result["plan_step_terms_ms"]) == {"embedding", "all_to_all", "dense", "all_reduce", "ps"}
    assert result["plan_step_ms"] > 0 and result["step_ms"] > 0


@pytest.mark.processes
@pytest.mark.timeout(900)
def test_a_resumed_run_on_parquet_goes_on_with_each_trainers_next_batches(tmp_path):
    """Sync mode (K = 0) is reproducible: a run resumed at step 3 has the uninterrupted run's losses, bit for bit,
    only if each trainer skipped exactly the batches of its own shards it trained on."""
    import shutil

    from persia_planner import load_topology, plan
    from persia_planner.modules.train import train_local
    from persia_planner.paths import DEFAULT_TOPOLOGY

    spec = _model(tmp_path)
    topology = load_topology(DEFAULT_TOPOLOGY)
    tables = dict(plan(spec, topology).tables)
    data = _write_parquet(tmp_path / "pq", files=2, groups=2, rows=150)

    def run(**options) -> dict:
        cfg = TrainConfig(
            data=f"parquet:{data}", batch_size=32, mode="sync", eval_batches=1, eval_split=0.25, progress=False,
            **options,
        )  # fmt: skip
        return train_local(cfg, spec, tables, servers=len(topology.servers), topology=topology)

    whole = run(steps=6, checkpoint=str(tmp_path / "whole"), checkpoint_every=3)
    shutil.copytree(tmp_path / "whole" / "step-000000003", tmp_path / "ckpt" / "step-000000003")
    rest = run(steps=6, checkpoint=str(tmp_path / "ckpt"), resume=True)  # --steps: the job's total
    assert rest["first_step"] == 3 and rest["last_step"] == 6
    assert [h["loss"] for h in rest["history"]] == [h["loss"] for h in whole["history"][3:]]
    assert rest["auc"] == whole["auc"] and rest["eval_samples"] == 2 * 32


def test_fewer_criteo_gzip_files_than_trainers_are_refused(tmp_path):
    import gzip

    with gzip.open(tmp_path / "day_0.gz", "wt") as f:
        f.write("".join(f"{i % 2}\t{i}" + "\t" * 38 + "\n" for i in range(100)))
    spec = ModelSpec("m", 8, (TableSpec("c1", 10, 4),))
    check_before_start(TrainConfig(data=f"criteo:{tmp_path}", trainers=1, eval_split=0.3), spec, with_ps=False)
    with pytest.raises(SpecError, match=r"1 gzip file\(s\) for 2 trainers: a gzip file cannot be split"):
        check_before_start(TrainConfig(data=f"criteo:{tmp_path}", trainers=2), spec, with_ps=False)


@pytest.mark.processes
@pytest.mark.timeout(600)
def test_persia_train_on_csv_with_a_schema_file(tmp_path):
    """`persia train --data csv:FILE --schema FILE`: a model.yaml without data:, a multi-hot column split at '|'."""
    (tmp_path / "model.yaml").write_text(MODEL_YAML.split("data:")[0])
    (tmp_path / "schema.yaml").write_text(
        "label: clicked\ndense: [age]\nsparse:\n  user_id: user\n  item_ids: {column: items, separator: '|'}\n"
        "  country: country\n"
    )
    rows = "".join(f"{i % 2},{i % 50},u{i % 97},a{i % 7}|b{i % 5},{i % 9}\n" for i in range(600))
    (tmp_path / "clicks.csv").write_text("clicked,age,user,items,country\n" + rows)
    args = ["--model", str(tmp_path / "model.yaml"), "--data", f"csv:{tmp_path / 'clicks.csv'}"]
    args += ["--schema", str(tmp_path / "schema.yaml"), "--steps", "3", "--batch-size", "32", "--eval-batches", "1"]
    args += ["--eval-split", "0.2"]
    result = _train_json([*args, "--json"])
    assert result["steps"] == 3 and result["eval_samples"] == 2 * 32 and np.isfinite(result["loss"])


@pytest.mark.processes
@pytest.mark.timeout(600)
def test_persia_train_with_on_bad_row_skip_trains_and_counts_the_rows_it_left_out(tmp_path):
    """NaN in 2% of a dense column: --on-bad-row skip trains on the rest (a finite loss, an AUC), and the summary
    counts the bad rows each pass read (both trainers' shards hold all 12; the evaluation reads the same file)."""
    (tmp_path / "model.yaml").write_text(MODEL_YAML.split("data:")[0])
    (tmp_path / "schema.yaml").write_text(
        "label: clicked\ndense: [age, {column: price, standardize: true}]\n"
        "sparse: {user_id: user, item_ids: user, country: country}\n"
    )
    rows = "".join(f"{i % 2},{i % 50},{'NaN' if i % 50 == 7 else i % 13},u{i % 97},{i % 9}\n" for i in range(600))
    (tmp_path / "clicks.csv").write_text("clicked,age,price,user,country\n" + rows)
    args = ["--model", str(tmp_path / "model.yaml"), "--data", f"csv:{tmp_path / 'clicks.csv'}", "--json"]
    args += ["--schema", str(tmp_path / "schema.yaml"), "--steps", "3", "--batch-size", "32", "--eval-batches", "1"]
    result = _train_json([*args, "--eval-split", "0.2", "--on-bad-row", "skip"])
    assert result["steps"] == 3 and np.isfinite(result["loss"]) and np.isfinite(result["auc"])
    assert result["bad_rows"] == {
        "on_bad_row": "skip", "skipped": {"train": 12, "eval": 12}, "imputed": {"train": 0, "eval": 0}
    }  # fmt: skip


def test_the_dense_inputs_follow_the_data_unless_model_yaml_writes_them(tmp_path):
    """An arch without num_dense reads the run's dense columns (--schema may bring others than model.yaml's data:);
    a written num_dense must match them; a schema without dense columns gives one constant input (sparse-only)."""
    from persia_planner.modules.train.run_inputs import dense_arch, hyper_parameters

    data = _write_parquet(tmp_path / "pq", files=1, groups=2, rows=40)
    arch = "dense: {arch: dcn, bottom: [8], over: [8, 1]}\n"
    spec = _model(tmp_path, MODEL_YAML + arch)
    assert spec.dense.arch.num_dense == 2 and spec.dense.arch.inputs_from_data  # priced with data:'s two columns
    wider = dataclasses.replace(spec.data, dense=("age", "price", "country"))
    cfg = TrainConfig(data=f"parquet:{data}", trainers=2, batch_size=4, schema=wider, eval_split=0.5)
    check_before_start(cfg, spec, with_ps=False)
    assert dense_arch(spec, cfg).num_dense == 3 and hyper_parameters(cfg, spec, 2)["dense_arch"]["num_dense"] == 3
    written = _model(tmp_path, MODEL_YAML + "dense: {arch: dcn, num_dense: 2, bottom: [8], over: [8, 1]}\n")
    with pytest.raises(SpecError, match=r"dense.num_dense: is 2, but the data \(parquet columns\) has 3 dense"):
        check_before_start(cfg, written, with_ps=False)
    no_dense = TrainConfig(
        data=f"parquet:{data}",
        trainers=2,
        batch_size=4,
        schema=dataclasses.replace(spec.data, dense=()),
        eval_split=0.5,
    )
    check_before_start(no_dense, spec, with_ps=False)
    assert dense_arch(spec, no_dense).num_dense == 1


def test_csv_ids_are_checked_as_text_and_gzip_files_against_the_trainers(tmp_path):
    """The reader reads CSV ids as strings whatever pyarrow infers ("12|7" tags, "0012"); a gzip CSV is one shard."""
    import gzip

    # pyarrow infers int64 for "items" (no row has two ids yet) and for "user" ("0007")
    text = "clicked,age,price,user,items,country\n" + "".join(f"1,3,4.5,{i:04d},{i},{i}\n" for i in range(40))
    (tmp_path / "clicks.csv").write_text(text)
    tags = SparseColumn("item_ids", "items", "item_ids", "|")
    sparse = (SparseColumn("user_id", "user", "user_id"), tags, SparseColumn("country", "country", "country"))
    schema = dataclasses.replace(_model(tmp_path).data, sparse=sparse)
    spec = dataclasses.replace(_model(tmp_path), data=schema)
    cfg = TrainConfig(data=f"csv:{tmp_path / 'clicks.csv'}", trainers=2, batch_size=4, eval_split=0.5)
    check_before_start(cfg, spec, with_ps=False)
    (tmp_path / "gz").mkdir()
    with gzip.open(tmp_path / "gz" / "clicks.csv.gz", "wt") as f:
        f.write(text)
    with pytest.raises(SpecError, match=r"1 gzip file\(s\) for 2 trainers: a gzip file cannot be split"):
        check_before_start(TrainConfig(data=f"csv:{tmp_path / 'gz'}", trainers=2), spec, with_ps=False)


@pytest.mark.processes
@pytest.mark.timeout(600)
def test_a_bad_csv_row_90_percent_into_the_file_stops_the_job_naming_it(tmp_path):
    """The trainer whose share holds the bad row fails on it; the other then loses its peer in a collective. The
    launcher reports the first failure that is not only a lost peer: the file, the byte offset and the reason."""
    _model(tmp_path)
    rows = _clicks(100_000).to_pylist()  # 2.6 MB: the bad row past the first block, which the checks at start read
    lines = ["clicked,age,price,user,country"]
    for r in rows:
        lines.append(f"{r['clicked']},{r['age'] or ''},{r['price']},{r['user'] or ''},{r['country']}")
    bad = int(len(lines) * 0.9)
    lines[bad] += ",surplus"  # a sixth field
    data = tmp_path / "clicks.csv"
    data.write_text("\n".join(lines) + "\n")
    schema = tmp_path / "schema.yaml"
    schema.write_text("label: clicked\ndense: [age, price]\nsparse: {user_id: user, item_ids: user, country: country}")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")}
    args = ["--model", tmp_path / "model.yaml", "--data", f"csv:{data}", "--schema", schema, "--steps", 20]
    args += ["--batch-size", 32, "--eval-batches", 1]
    done = subprocess.run(
        [sys.executable, "-m", "persia_planner.cli", "train", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=540,
    )
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2, done.stderr[-3000:]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert str(data) in errors[0] and "bytes from" in errors[0], errors[0]
    assert "Expected 5 columns, got 6" in errors[0] and "Connection closed" not in errors[0], errors[0]


SPARSE_ONLY_YAML = """
name: clicks-sparse
batch_size: 64
tables:
  - {name: user_id, rows: 200_000, dim: 16}
  - {name: item_ids, rows: 150_000, dim: 16}
  - {name: country, rows: 50, dim: 16}
data:
  label: clicked
  sparse:
    user_id: user
    item_ids: {column: items, separator: "|"}
    country: country
"""


def _sparse_only_csv(path: Path, rows: int) -> None:
    """String ids, no numeric column: a click when the user's and the item's parity agree (learnable)."""
    lines = ["clicked,user,items,country"]
    for i in range(rows):
        user, item = f"u{i}", f"i{i % 37}|j{i % 11}"
        lines.append(f"{int((i % 2) == (i % 37) % 2)},{user},{item},c{i % 9}")
    path.write_text("\n".join(lines) + "\n")


def test_a_sparse_only_csv_log_keeps_its_validation_rows_out_of_every_epoch(tmp_path):
    spec = _model(tmp_path, SPARSE_ONLY_YAML)
    _sparse_only_csv(tmp_path / "clicks.csv", 600)
    cfg = TrainConfig(data=f"csv:{tmp_path / 'clicks.csv'}", epochs=3, eval_split=0.2, eval_batches=100, trainers=1)
    from persia_planner.modules.train.run_inputs import dense_arch

    assert dense_arch(spec, cfg).num_dense == 1  # the one constant input

    def users(batches) -> list[int]:
        out = []
        for b in batches:
            assert b.dense.shape[1] == 1 and not b.dense.any()
            out += b.sparse.to_dict()["user_id"].values().tolist()
        return out

    epochs = Epochs()
    trained = users(training_batches(spec, cfg, 16, epochs=epochs))
    held = users(held_out_batches(spec, cfg, 16))
    assert 80 <= len(held) <= 160 and not set(held) & set(trained)  # every user id is one row
    n = epochs.lengths[0] * 16
    assert epochs.lengths == [n // 16] * 3 and 600 - len(held) - 16 < n <= 600 - len(held)
    for e in range(3):  # each training row at most once per epoch; only the last partial batch is left out
        assert len(set(trained[e * n : (e + 1) * n])) == n


@pytest.mark.processes
@pytest.mark.timeout(900)
def test_a_resumed_epoch_of_a_sparse_only_csv_log_equals_the_uninterrupted_one(tmp_path):
    """Three epochs of a CSV log with string ids and no dense column, K = 0: a run resumed in the second epoch has
    the uninterrupted run's losses bit for bit, and the same epochs."""
    import shutil

    from persia_planner import load_topology, plan
    from persia_planner.modules.train import train_local
    from persia_planner.paths import DEFAULT_TOPOLOGY

    spec = _model(tmp_path, SPARSE_ONLY_YAML)
    topology = load_topology(DEFAULT_TOPOLOGY)
    tables = dict(plan(spec, topology).tables)
    _sparse_only_csv(tmp_path / "clicks.csv", 1_200)

    def run(**options) -> dict:
        cfg = TrainConfig(
            data=f"csv:{tmp_path / 'clicks.csv'}", epochs=3, eval_split=0.2, batch_size=32, mode="sync",
            eval_batches=1, shuffle_buffer=128, keep=10, progress=False, **options,
        )  # fmt: skip
        return train_local(cfg, spec, tables, servers=len(topology.servers), topology=topology)

    whole = run(checkpoint=str(tmp_path / "whole"), checkpoint_every=20)
    per_epoch = whole["epoch_steps"]
    assert len(per_epoch) == 3 and per_epoch[0] < 20 < sum(per_epoch[:2]), per_epoch
    shutil.copytree(tmp_path / "whole" / "step-000000020", tmp_path / "ckpt" / "step-000000020")
    rest = run(checkpoint=str(tmp_path / "ckpt"), resume=True)
    assert rest["first_step"] == 20 and rest["last_step"] == whole["last_step"] == sum(per_epoch)
    assert rest["epoch_steps"] == per_epoch
    assert [h["loss"] for h in rest["history"]] == [h["loss"] for h in whole["history"][20:]]
    assert rest["auc"] == whole["auc"] and rest["normalized_entropy"] == whole["normalized_entropy"]


def test_declared_transforms_apply_alike_in_training_and_evaluation(tmp_path):
    from persia_planner.modules.train.batch_stream import with_data_statistics
    from persia_planner.modules.train.run_inputs import hyper_parameters

    text = MODEL_YAML.replace(
        "dense: [age, price]", "dense: [age, {column: price, clip: [0, 30], log1p: true, standardize: true}]"
    )
    spec = _model(tmp_path, text)
    data = _write_parquet(tmp_path / "pq", files=1, groups=4, rows=50)
    cfg = with_data_statistics(spec, TrainConfig(data=f"parquet:{data}", eval_split=0.2, trainers=1))
    price = cfg.schema.transforms["price"]
    raw = np.array([i * 0.5 for i in range(200)])
    assert price.mean == pytest.approx(np.log1p(np.clip(raw, 0, 30)).mean(), rel=0.05)  # the training rows' mean
    trained = np.concatenate([b.dense[:, 1].numpy() for b in training_batches(spec, cfg, 8)])
    held = np.concatenate([b.dense[:, 1].numpy() for b in held_out_batches(spec, cfg, 8)])
    assert abs(trained.mean()) < 0.15 and abs(trained.std() - 1) < 0.15  # the first pass saw the training side
    # as read; the batches are those rows transformed, hashed to a side anew (a few cross), the last partial dropped
    # Both sides are the same function of the raw prices (the data has each price once).
    expected = price.apply(raw.astype(np.float32))
    assert np.isin(np.round(np.concatenate([trained, held]), 4), np.round(expected, 4)).all()
    assert hyper_parameters(cfg, spec, 1)["data_transforms"]["price"]["mean"] == price.mean
