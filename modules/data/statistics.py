"""The first pass over a click log's training rows that ``standardize`` transforms need: each such dense column's
mean and standard deviation (after its clip and log1p), measured the same way on every trainer.

Every trainer reads the same first rows of the training side of the split, in file order, so that each arrives at
the same statistics without exchanging a message, before its first step; evaluation reuses them, and the run's
summary and checkpoints record them with the hyper-parameters.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from persia_planner.model.data_schema import DataSchema
from persia_planner.modules.data.shards import DataPass
from persia_planner.modules.data.split import RowSplit
from persia_planner.modules.data.tabular import TabularReader

__all__ = ["STATISTICS_ROWS", "measured"]

STATISTICS_ROWS = 1 << 20
"""Rows of the first pass: enough for a mean and a standard deviation to three digits."""
_BATCH_ROWS = 1 << 14


def measured(
    schema: DataSchema, files: list[str], fmt: str, held_out_share: float, rows: int = STATISTICS_ROWS
) -> DataSchema:
    """``schema`` with the statistics of every column to standardize, over the first ``rows`` training rows of
    ``files`` (``held_out_share`` of the rows held out); ``schema`` itself when none needs them."""
    columns = schema.to_standardize
    if not columns:
        return schema
    raw = replace(schema, transforms={})  # the values as read: with_statistics applies clip and log1p itself
    split = RowSplit(held_out_share, held_out=False) if held_out_share else None
    reader = TabularReader(files, raw, fmt=fmt, batch_size=_BATCH_ROWS, reading=DataPass(split=split))
    index = [schema.dense.index(c) for c in columns]
    seen: list[np.ndarray] = []
    count = 0
    for batch in reader:
        seen.append(batch.dense.numpy()[:, index])
        count += len(seen[-1])
        if count >= rows:
            break
    values = np.concatenate(seen)[:rows] if seen else np.zeros((0, len(columns)), np.float32)
    return schema.with_statistics({c: values[:, k] for k, c in enumerate(columns)})
