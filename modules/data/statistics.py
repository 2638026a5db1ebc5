"""The first pass over a click log's training rows, before any process starts: it finds the bad rows among the first
rows (:class:`~persia_planner.model.data_schema.BadRowPolicy`), and measures what the schema needs of them: each
``standardize`` column's mean and standard deviation (after its clip and log1p) and, under ``on_bad_row: impute``,
each dense column's mean (:attr:`~persia_planner.model.data_schema.DenseTransform.fill`).

Every trainer reads the same first rows of the training side of the split, in file order, so the first pass measures
the same on every trainer and every node; ``persia train`` runs it once, before the processes start, and hands them
the measured schema; evaluation reuses it, and the run's summary and checkpoints record it with the hyper-parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from persia_planner.errors import SpecError
from persia_planner.model.data_schema import BadRowPolicy, DataSchema
from persia_planner.modules.data.blocks import BadRowCount
from persia_planner.modules.data.shards import DataPass
from persia_planner.modules.data.split import RowSplit
from persia_planner.modules.data.tabular import TabularReader

__all__ = ["CHECK_ROWS", "STATISTICS_ROWS", "FirstPass", "check_first_rows", "first_pass", "measured"]

STATISTICS_ROWS = 1 << 20
"""Rows of the first pass when it measures: enough for a mean and a standard deviation to three digits."""
CHECK_ROWS = 1 << 16
"""Rows of the first pass when nothing needs measuring: it only looks for bad rows."""
_BATCH_ROWS = 1 << 14


@dataclass(frozen=True)
class FirstPass:
    """What the first pass found.

    Attributes:
        schema: The schema with what it measured (itself when nothing needed measuring).
        rows: The training rows it read (after the bad ones it left out).
        counts: What ``on_bad_row`` did to them.
    """

    schema: DataSchema
    rows: int
    counts: BadRowCount = field(default_factory=BadRowCount)


def first_pass(
    schema: DataSchema, files: list[str], fmt: str, held_out_share: float, *, rows: int | None = None, data: str = ""
) -> FirstPass:
    """The first ``rows`` training rows of ``files`` (default: :data:`STATISTICS_ROWS` when the schema needs
    measuring, else :data:`CHECK_ROWS`), read raw, with ``held_out_share`` of the rows held out.

    Args:
        schema: The columns, with ``on_bad_row``.
        files: The training files.
        fmt: ``"parquet"`` or ``"csv"``.
        held_out_share: The validation split's share.
        rows: The rows to read.
        data: The data as ``--data`` names it, for the errors (default: the first file).

    Raises:
        SpecError: A bad row under ``fail`` (its file, row and column); no training row left; a column to measure
            without one finite value, or constant when it is standardized.
    """
    columns = schema.to_measure
    wanted = rows if rows is not None else STATISTICS_ROWS if columns else CHECK_ROWS
    split = RowSplit(held_out_share, held_out=False) if held_out_share else None
    counts = BadRowCount()
    reader = TabularReader(
        files, schema, fmt=fmt, batch_size=_BATCH_ROWS, reading=DataPass(split=split), raw=True, counts=counts
    )
    index = [schema.dense.index(c) for c in columns]
    seen: list[np.ndarray] = []
    count = 0
    for block in reader.blocks():
        seen.append(block.dense[:, index])
        count += len(seen[-1])
        if count + counts.skipped >= wanted:  # bounded by the rows read, bad ones included
            break
    where = data or f"{fmt}:{files[0]}"
    if not count and counts.skipped:
        raise _all_bad(where, counts.skipped, schema, "training rows", "train on")
    if not columns:
        return FirstPass(schema, count, counts)
    values = np.concatenate(seen)[:wanted] if seen else np.zeros((0, len(columns)), np.float32)
    try:
        measured_schema = schema.with_statistics({c: values[:, k] for k, c in enumerate(columns)})
    except ValueError as err:
        problem, column = err.args
        transform = schema.transforms.get(column)
        fixes = ["drop the column from data.dense"]
        if transform is not None and transform.standardize:
            fixes.insert(0, "drop its standardize")
        if schema.on_bad_row is BadRowPolicy.IMPUTE:
            fixes.append("on_bad_row: skip or fail")
        raise SpecError(where, "", f"column {column!r}: {problem}", fixes=tuple(fixes)) from None
    return FirstPass(measured_schema, count, counts)


def check_first_rows(schema: DataSchema, files: list[str], fmt: str, *, data: str, rows: int = CHECK_ROWS) -> None:
    """The first ``rows`` rows of ``files`` (``--eval-data``'s) read as a run reads them with ``schema`` (measured):
    a bad row under ``fail``, or only bad ones, found before any process starts.

    Raises:
        SpecError: A bad row under ``fail``; every row read bad.
    """
    counts = BadRowCount()
    reader = TabularReader(files, schema, fmt=fmt, batch_size=_BATCH_ROWS, counts=counts)
    count = 0
    for block in reader.blocks():
        count += len(block)
        if count + counts.skipped >= rows:
            break
    if not count and counts.skipped:
        raise _all_bad(data, counts.skipped, schema, "rows", "validate on")


def _all_bad(where: str, rows: int, schema: DataSchema, what: str, purpose: str) -> SpecError:
    return SpecError(
        where,
        "",
        f"all of the first {rows:,} {what} are bad (a NaN or infinite dense value, or no label), and on_bad_row: "
        f"{schema.on_bad_row} leaves them out: nothing to {purpose}",
        fixes=("repair the data", "drop the broken column from data.dense"),
    )


def measured(schema: DataSchema, files: list[str], fmt: str, held_out_share: float) -> DataSchema:
    """``schema`` with what the first pass measures (:func:`first_pass`); ``schema`` itself when nothing needs it."""
    if not schema.to_measure:
        return schema
    return first_pass(schema, files, fmt, held_out_share).schema
