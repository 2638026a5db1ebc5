"""Rows of a click log as arrays (:class:`TabularBlock`): a pyarrow table of the schema's columns read into labels,
dense values and hashed ids (:func:`to_block`), and then as a :class:`Batch` (:func:`to_batch`).

Values: the label and the dense columns as float32 (a missing dense value is 0), each dense column transformed as the
schema declares (:class:`~persia_planner.model.data_schema.DenseTransform`); a row with a NaN or infinite dense value
(as read or after its transforms) or without a label is bad, and goes as the schema's ``on_bad_row`` says
(:class:`~persia_planner.model.data_schema.BadRowPolicy`): found by one vectorised test over each block, its file, row
and column named only when one is there. A sparse column's ids, strings or integers, hashed to int64 by
:func:`~persia_planner.modules.data.ids.hash_ids`: the same id gives the same int64 on every trainer, run and machine.
A list column (or a string column with a ``separator``) is multi-hot: one bag of all its ids per row; a missing value
is an empty bag.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from persia_planner.model.data_schema import BadRowPolicy, DataSchema, SparseColumn
from persia_planner.modules.data.ids import hash_ids
from persia_planner.modules.data.shards import Failure
from persia_planner.modules.data.split import ROW_SALT, combine
from persia_planner.modules.hashing import mix64

if TYPE_CHECKING:  # pragma: no cover
    from persia_planner.modules.data.batch import Batch

__all__ = [
    "BAD_ROW_FIXES",
    "BadRowCount",
    "BadValue",
    "TabularBlock",
    "bad_row_failure",
    "line_of_row",
    "to_batch",
    "to_block",
]

BAD_ROW_FIXES = (
    "repair or remove the row",
    "set on_bad_row: skip (leave such rows out) or impute (the column's mean) in the columns' schema (data: or "
    "--schema; persia train --on-bad-row)",
)
"""The fixes of a bad row's error."""


@dataclass
class BadRowCount:
    """What ``on_bad_row`` did to the rows a reader read (counted as they reach the reading process).

    Attributes:
        skipped: Rows left out (``skip``; ``impute`` for a row without a label).
        imputed: Rows with a dense value read as the column's mean (``impute``).
    """

    skipped: int = 0
    imputed: int = 0

    def add(self, block: TabularBlock) -> None:
        self.skipped += block.skipped
        self.imputed += block.imputed


@dataclass(frozen=True)
class TabularBlock:
    """Rows of a click log in a pickle-friendly, concatenable layout.

    Attributes:
        labels: ``[n]`` float32.
        dense: ``[n, d]`` float32.
        lengths: Per sparse feature, ``[n]`` int32 ids per row.
        values: Per sparse feature, the rows' ids (int64) one after another.
        skipped: Rows ``on_bad_row`` left out of the read that made these (:class:`BadRowCount`): they ride with the
            rows to the reading process, on one block only however the rows are cut (:meth:`slice`'s first piece).
        imputed: Rows with an imputed value, alike.
    """

    labels: np.ndarray
    dense: np.ndarray
    lengths: tuple[np.ndarray, ...]
    values: tuple[np.ndarray, ...]
    skipped: int = 0
    imputed: int = 0

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def slice(self, start: int, stop: int) -> TabularBlock:
        """Rows ``start:stop`` (the counts go with the piece that starts at row 0)."""
        values = []
        for lengths, vals in zip(self.lengths, self.values, strict=True):
            first = int(lengths[:start].sum())
            values.append(vals[first : first + int(lengths[start:stop].sum())])
        counts = (self.skipped, self.imputed) if start == 0 else (0, 0)
        return TabularBlock(
            self.labels[start:stop],
            self.dense[start:stop],
            tuple(x[start:stop] for x in self.lengths),
            tuple(values),
            *counts,
        )

    def take(self, rows: np.ndarray) -> TabularBlock:
        """The rows at the indices ``rows``, in that order (with the counts)."""
        values = []
        for lengths, vals in zip(self.lengths, self.values, strict=True):
            starts = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])[rows]
            picked = lengths[rows].astype(np.int64)
            # Each picked row's ids: its start, repeated over its length, plus 0..length-1.
            within = np.arange(int(picked.sum())) - np.repeat(np.cumsum(picked) - picked, picked)
            values.append(vals[np.repeat(starts, picked) + within])
        return TabularBlock(
            self.labels[rows],
            self.dense[rows],
            tuple(x[rows] for x in self.lengths),
            tuple(values),
            self.skipped,
            self.imputed,
        )

    def row_keys(self) -> np.ndarray:
        """A 64-bit hash of each row's label, dense values and ids (a bag's ids in any order hash alike): uint64
        arithmetic only, so the same on every platform."""
        h = np.full(len(self), ROW_SALT, dtype=np.uint64)
        h = combine(h, self.labels.view(np.uint32))
        for column in self.dense.view(np.uint32).T:
            h = combine(h, column)
        for lengths, vals in zip(self.lengths, self.values, strict=True):
            # A bag's ids summed after mixing (uint64 wraps): the ends of its run in the cumulative sum. The leading
            # 0 is uint64 too: numpy would join a Python 0 (int64) and uint64 as float64, losing bits.
            mixed = np.cumsum(mix64(vals.view(np.uint64)), dtype=np.uint64)
            ends = np.concatenate([np.zeros(1, dtype=np.uint64), mixed])
            bounds = np.concatenate([np.zeros(1, dtype=np.int64), np.cumsum(lengths, dtype=np.int64)])
            h = combine(h, ends[bounds[1:]] - ends[bounds[:-1]] + lengths.astype(np.uint64))
        return h

    @classmethod
    def concat(cls, blocks: Sequence[TabularBlock]) -> TabularBlock:
        """The rows of ``blocks``, in order (their counts summed)."""
        if len(blocks) == 1:
            return blocks[0]
        features = range(len(blocks[0].lengths))
        return cls(
            np.concatenate([b.labels for b in blocks]),
            np.concatenate([b.dense for b in blocks]),
            tuple(np.concatenate([b.lengths[f] for b in blocks]) for f in features),
            tuple(np.concatenate([b.values[f] for b in blocks]) for f in features),
            sum(b.skipped for b in blocks),
            sum(b.imputed for b in blocks),
        )


class BadValue(Exception):
    """A bad value of a block: its column, what is wrong, and its row in the block."""

    def __init__(self, column: str, problem: str, row: int, *, bad_row: bool = False):
        super().__init__(problem)
        self.column = column
        self.problem = problem
        self.row = row
        self.bad_row = bad_row  # a bad row (on_bad_row could take it), not a malformed value


def _floats(array: Any) -> np.ndarray:
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_dictionary(array.type):
        array = array.dictionary_decode()
    # A copy: torch wants writable arrays, and pyarrow's may be its read-only buffers.
    return np.array(pc.fill_null(pc.cast(array, pa.float32()), 0.0).to_numpy(zero_copy_only=False), dtype=np.float32)


def _bags(array: Any, column: SparseColumn) -> tuple[np.ndarray, np.ndarray]:
    """``(lengths [n] int32, ids int64)`` of one sparse column: one id per row, or a bag per row (multi-hot)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    n = len(array)
    if column.separator is not None:
        if pa.types.is_dictionary(array.type):
            array = array.dictionary_decode()
        array = pc.split_pattern(array, column.separator)
    if pa.types.is_list(array.type) or pa.types.is_large_list(array.type):
        flat = pc.list_flatten(array)
        parents = pc.list_parent_indices(array).to_numpy(zero_copy_only=False)
        keep = flat.is_valid()
        if column.separator is not None:  # "a||b" holds two ids, not an empty third
            keep = pc.and_(keep, pc.greater(pc.utf8_length(flat), 0))
        keep_np = keep.to_numpy(zero_copy_only=False)
        ids = hash_ids(flat.filter(keep))
        lengths = np.bincount(parents[keep_np], minlength=n).astype(np.int32)
        return lengths, ids
    valid = array.is_valid()
    lengths = valid.to_numpy(zero_copy_only=False).astype(np.int32)
    return lengths, hash_ids(array.filter(valid))


def _null_mask(array: Any) -> np.ndarray | None:
    """Which values of a pyarrow array are null (None when none is)."""
    return array.is_null().to_numpy(zero_copy_only=False) if array.null_count else None


def _shown(value: float) -> str:
    """A float32 value as an error names it (``NaN``, ``inf``, ``-inf``, ``2.5``)."""
    return "NaN" if np.isnan(value) else f"{value:g}"


def to_block(table: Any, schema: DataSchema, *, raw: bool = False) -> TabularBlock:
    """A pyarrow RecordBatch or Table holding the schema's columns as a :class:`TabularBlock`, its bad rows gone as
    the schema's ``on_bad_row`` says.

    Args:
        table: The rows.
        schema: Their columns.
        raw: The values as read, for the first pass (:mod:`.statistics`): no transform, and under ``impute`` the bad
            dense values kept as they are (the first pass measures the finite ones).

    Raises:
        BadValue: A label other than 0 and 1 (a schema without a label reads NaN labels); under ``fail``, the
            block's first bad row.
    """
    import pyarrow as pa

    def column(name: str) -> Any:
        col = table.column(name)
        return col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col

    n = table.num_rows
    no_label = None  # rows without a label, when some are
    if schema.label is None:  # rows to score
        labels = np.full(n, np.nan, dtype=np.float32)
    else:
        label = column(schema.label)
        labels = _floats(label)
        nulls = _null_mask(label)
        if nulls is not None:
            labels[nulls] = np.nan
        off = (labels != 0) & (labels != 1)
        if off.any():
            no_label = np.isnan(labels)
            wrong = np.flatnonzero(off & ~no_label)
            if wrong.size:
                r = int(wrong[0])
                raise BadValue(schema.label, f"label {_shown(labels[r])}: labels are 0 or 1", r)
    # No dense column: one constant 0, which the dense arch reads as a sparse-only model's input.
    dense = np.zeros((n, schema.num_inputs), dtype=np.float32)
    hidden: dict[int, np.ndarray] = {}  # of clipped columns: the non-finite values read, which a clip made finite
    for j, name in enumerate(schema.dense):
        values = _floats(column(name))
        transform = None if raw else schema.transforms.get(name)
        if transform is None:
            dense[:, j] = values
            continue
        dense[:, j] = transform.apply(values)
        if transform.clip is not None and not np.isfinite(values).all():
            hidden[j] = ~np.isfinite(values)
    bags = [_bags(column(s.column), s) for s in schema.sparse]
    block = TabularBlock(labels, dense, tuple(b[0] for b in bags), tuple(b[1] for b in bags))
    if no_label is None and not hidden and np.isfinite(dense).all():  # every row good: one test of the block
        return block
    return _bad_rows_gone(block, schema, raw, no_label, hidden, column)


def _bad_rows_gone(
    block: TabularBlock,
    schema: DataSchema,
    raw: bool,
    no_label: np.ndarray | None,
    hidden: dict[int, np.ndarray],
    column: Any,
) -> TabularBlock:
    """``block``, which holds a bad row, as ``on_bad_row`` says (see :func:`to_block`)."""
    policy = schema.on_bad_row
    dense = block.dense
    bad = ~np.isfinite(dense)
    for j, mask in hidden.items():
        bad[:, j] |= mask
    if raw and policy is BadRowPolicy.IMPUTE:
        bad[:] = False  # the first pass measures the finite values
    no_label = np.zeros(len(block), dtype=bool) if no_label is None else no_label
    bad_rows = bad.any(axis=1)
    if policy is BadRowPolicy.FAIL:
        r = int(np.flatnonzero(bad_rows | no_label)[0])
        if no_label[r]:
            null = _null_mask(column(schema.label))
            raise BadValue(
                str(schema.label), "no label" if null is not None and null[r] else "label NaN", r, bad_row=True
            )
        raise _bad_value(schema, column, r, int(np.flatnonzero(bad[r])[0]))
    keep = ~no_label
    imputed = 0
    if policy is BadRowPolicy.SKIP:
        keep &= ~bad_rows
    elif bad_rows.any():  # impute: each bad value read as its column's fill, then transformed
        dense = dense.copy()
        for j in np.flatnonzero(bad.any(axis=0)):
            transform = schema.transforms[schema.dense[j]]
            values = _floats(column(schema.dense[j]))
            values[bad[:, j]] = transform.fill
            dense[:, j] = transform.apply(values)
        still = ~np.isfinite(dense) & keep[:, None]
        if still.any():  # the fill itself beyond float32 after the transforms
            r = int(np.flatnonzero(still.any(axis=1))[0])
            raise _bad_value(schema, column, r, int(np.flatnonzero(still[r])[0]))
        imputed = int((bad_rows & keep).sum())
    rows = np.flatnonzero(keep)
    kept = replace(block, dense=dense).take(rows)
    return replace(kept, skipped=len(block) - len(rows), imputed=imputed)


def _bad_value(schema: DataSchema, column: Any, row: int, j: int) -> BadValue:
    """The error of dense column ``j``'s bad value at ``row``: NaN or infinite as read, or beyond float32 after its
    transforms."""
    import pyarrow as pa
    import pyarrow.compute as pc

    name = schema.dense[j]
    value = _floats(column(name))[row]
    if not np.isfinite(value):
        read = column(name)
        read = read.dictionary_decode() if pa.types.is_dictionary(read.type) else read
        wide = pc.cast(read, pa.float64())[row].as_py()  # a Parquet float64 past float32's range: named as written
        if wide is not None and np.isfinite(wide):
            return BadValue(name, f"{wide:g} is beyond float32's range", row, bad_row=True)
        return BadValue(name, _shown(value), row, bad_row=True)
    t = schema.transforms[name]
    steps = [f"clip [{t.clip[0]:g}, {t.clip[1]:g}]"] if t.clip is not None else []
    steps += ["log1p"] if t.log1p else []
    steps += [f"standardize (mean {t.mean:g}, std {t.std:g})"] if t.standardize and t.std is not None else []
    return BadValue(name, f"{_shown(value)} is beyond float32's range after {', '.join(steps)}", row, bad_row=True)


def to_batch(block: TabularBlock, keys: Sequence[str]) -> Batch:
    """A block as a :class:`Batch` whose KJT has one key per table (key-major, as every KJT)."""
    # torchrec takes seconds to import: not for the first pass, which reads blocks before any process starts.
    import torch
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from persia_planner.modules.data.batch import Batch

    sparse = KeyedJaggedTensor(
        keys=list(keys),
        values=torch.from_numpy(np.concatenate(block.values) if block.values else np.zeros(0, np.int64)),
        lengths=torch.from_numpy(np.concatenate(block.lengths) if block.lengths else np.zeros(0, np.int32)),
    )
    return Batch(dense=torch.from_numpy(block.dense), sparse=sparse, labels=torch.from_numpy(block.labels))


def bad_row_failure(kind: str, path: str, row: int, err: BadValue) -> Failure:
    """``err`` at the file's ``row`` (1-based; a CSV's header is no row) as one line with its fix."""
    fixes = BAD_ROW_FIXES if err.bad_row else ("make the label column hold 0 and 1",)
    return Failure(f"{kind}:{path} row {row}, column {err.column!r}", "", err.problem, fixes)


def line_of_row(lines: bytes, row: int) -> int:
    """The line (0-based) of ``lines`` holding its ``row``-th row: pyarrow reads no row from an empty line."""
    seen = -1
    for i, line in enumerate(lines.split(b"\n")):
        if line.rstrip(b"\r"):
            seen += 1
            if seen == row:
                return i
    return row
