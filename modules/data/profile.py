"""``persia data profile``: what a click log holds, read once and streamed, and the model.yaml it suggests.

Per column: its rows and missing values; for a column of ids, an estimate of its distinct ids (an HLL sketch,
Apache DataSketches, of the ids hashed as training hashes them: :func:`.ids.hash_ids`), and the table rows that
suggests; for a numeric column, its range and mean, which suggest the dense transforms. Without a schema the roles
are guessed: a 0/1 column named like a label is the label, other numeric columns dense, text and list columns (and
integer columns of many distinct values) sparse. The model.yaml skeleton says what it guessed; edit it.

Torch-free: it reads with pyarrow, Parquet a row group at a time, CSV and Criteo TSV a block at a time.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from persia_planner.model.data_schema import DataSchema
from persia_planner.modules.data.criteo_format import CATEGORICAL_COLUMNS, INTEGER_COLUMNS
from persia_planner.modules.data.source import DataKind, DataSource

__all__ = ["SKETCH_LG_K", "ColumnProfile", "DataProfile", "profile", "suggested_rows"]

SKETCH_LG_K = 14
"""log2 of the HLL sketch's registers: about 0.8% relative error on a distinct count."""
_LABEL_NAMES = ("label", "click", "clicked", "clicks", "is_click", "y", "target")
_DENSE_LOG_ABOVE = 100.0
"""A non-negative numeric column whose values reach this gets ``log1p`` in the skeleton (counts, timestamps)."""
_SEPARATORS = ("|", ";")
"""What may stand between a CSV cell's ids (a comma cannot, unquoted)."""
_ROWS_PER_ID = 2.0
"""Table rows per distinct id in the suggestion: ``id mod rows`` then collides for about a quarter of the ids."""


@dataclass
class ColumnProfile:
    """One column of the log.

    Attributes:
        name: The column.
        kind: ``numeric``, ``text`` (strings, or a CSV's values that are not all numbers) or ``list`` (multi-hot: a
            list column, or a CSV's text with a ``separator`` between ids in most rows).
        separator: The string between a CSV cell's ids (None: one id per cell).
        rows: Rows read.
        missing: Rows without a value.
        distinct: Estimated distinct ids (text, list and integer columns; None otherwise).
        low, high, mean: A numeric column's range and mean (None otherwise).
    """

    name: str
    kind: str = "numeric"
    rows: int = 0
    missing: int = 0
    distinct: float | None = None
    low: float | None = None
    high: float | None = None
    mean: float | None = None
    integral: bool = True
    separator: str | None = None
    _sum: float = 0.0  # of a numeric column's values
    _count: int = 0
    _ids: int = 0  # of a multi-hot column's ids
    _sketch: Any = field(default=None, repr=False)

    @property
    def binary(self) -> bool:
        """Every value is 0 or 1."""
        return self.kind == "numeric" and self.low is not None and self.low >= 0 and self.high <= 1 and self.integral


@dataclass(frozen=True)
class DataProfile:
    """A log's profile: its rows and columns, and the roles of the columns (given by a schema, or guessed)."""

    source: str
    kind: DataKind
    rows: int
    columns: tuple[ColumnProfile, ...]
    label: str | None
    dense: tuple[str, ...]
    sparse: tuple[str, ...]
    guessed: bool

    def column(self, name: str) -> ColumnProfile:
        return next(c for c in self.columns if c.name == name)

    def model_skeleton(self, name: str = "my-model", dim: int = 16) -> dict[str, Any]:
        """A model.yaml for the log: a table per sparse column sized by :func:`suggested_rows`, the data: mapping,
        and the suggested transforms of the dense columns."""
        criteo = self.kind is DataKind.CRITEO  # its tables are named after the features, c1..c26; no data: section
        tables = [
            {"name": c.lower() if criteo else c, "rows": suggested_rows(self.column(c).distinct or 1), "dim": dim}
            | ({"pooling_factor": round(self._pooling(c), 2)} if self.column(c).kind == "list" else {})
            for c in self.sparse
        ]
        dense: list[Any] = []
        for c in self.dense:
            col = self.column(c)
            if col.low is not None and col.low >= 0 and (col.high or 0) >= _DENSE_LOG_ABOVE:
                dense.append({"column": c, "log1p": True, "standardize": True})
            else:
                dense.append({"column": c, "standardize": True})
        data: dict[str, Any] = {"label": self.label or "LABEL_COLUMN", "dense": dense, "sparse": {}}
        for c in self.sparse:
            col = self.column(c)
            if col.separator is not None:
                data["sparse"][c] = {"column": c, "separator": col.separator}
            else:
                data["sparse"][c] = c if col.kind != "list" else {"column": c}
        model = {"name": name, "batch_size": 4096, "tables": tables}
        return model if criteo else model | {"data": data}

    def _pooling(self, column: str) -> float:
        col = self.column(column)
        return col._ids / max(1, col.rows - col.missing)


def suggested_rows(distinct: float) -> int:
    """Table rows for ``distinct`` ids: twice as many (``id mod rows`` then maps most ids to rows of their own),
    rounded up to two significant digits."""
    want = max(1.0, _ROWS_PER_ID * distinct)
    scale = 10 ** max(0, math.floor(math.log10(want)) - 1)
    return int(math.ceil(want / scale) * scale)


def profile(source: DataSource, schema: DataSchema | None = None, *, max_rows: int | None = None) -> DataProfile:
    """Read ``source`` (every file; at most ``max_rows`` rows) and profile its columns.

    Raises:
        SpecError: A file cannot be read, or a schema column is not in it.
    """
    columns: dict[str, ColumnProfile] = {}
    rows = 0
    for table in _blocks(source):
        if max_rows is not None and rows >= max_rows:
            break
        if max_rows is not None and rows + table.num_rows > max_rows:
            table = table.slice(0, max_rows - rows)
        rows += table.num_rows
        for name in table.column_names:
            col = columns.setdefault(name, ColumnProfile(name))
            _update(col, table.column(name), text_ids=source.kind is not DataKind.PARQUET)
    for col in columns.values():
        if col._sketch is not None:
            col.distinct = float(col._sketch.get_estimate())
        if col._count:
            col.mean = col._sum / col._count if col.kind == "numeric" else None
    if schema is not None:
        label, dense, sparse = schema.label, schema.dense, tuple(s.column for s in schema.sparse)
    elif source.kind is DataKind.CRITEO:  # the format says: the label, 13 counts, 26 categorical columns
        label, dense, sparse = "label", INTEGER_COLUMNS, CATEGORICAL_COLUMNS
    else:
        label, dense, sparse = _guess_roles(list(columns.values()), rows)
    guessed = schema is None and source.kind is not DataKind.CRITEO
    return DataProfile(str(source.path), source.kind, rows, tuple(columns.values()), label, dense, sparse, guessed)


def _blocks(source: DataSource) -> Iterator[Any]:
    """The log as pyarrow tables of a block each: Parquet row groups; CSV and Criteo blocks, every value as text
    (the reader takes a CSV's ids as text whatever they look like)."""
    import pyarrow as pa
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    for path in source.check_files():
        if source.kind is DataKind.PARQUET:
            f = pq.ParquetFile(path)
            for group in range(f.metadata.num_row_groups):
                yield f.read_row_group(group)
            continue
        criteo = source.kind is DataKind.CRITEO
        names = ["label", *INTEGER_COLUMNS, *CATEGORICAL_COLUMNS] if criteo else None
        if names is None:
            with pcsv.open_csv(path) as head:
                names = head.schema.names
        read = pcsv.ReadOptions(column_names=names, skip_rows=0 if criteo else 1, block_size=1 << 24)
        parse = pcsv.ParseOptions(delimiter="\t" if criteo else ",")
        convert = pcsv.ConvertOptions(column_types=dict.fromkeys(names, pa.string()), strings_can_be_null=True)
        with pcsv.open_csv(path, read_options=read, parse_options=parse, convert_options=convert) as reader:
            for batch in reader:
                yield pa.Table.from_batches([batch])


def _update(col: ColumnProfile, values: Any, *, text_ids: bool) -> None:
    """Fold one block of a column into its profile."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from persia_planner.modules.data.ids import hash_ids

    values = values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values
    if pa.types.is_dictionary(values.type):
        values = values.dictionary_decode()
    col.rows += len(values)
    col.missing += values.null_count
    if text_ids and pa.types.is_string(values.type):
        present = values.filter(values.is_valid())
        present = present.filter(pc.greater(pc.utf8_length(present), 0))
        col.missing += len(values) - values.null_count - len(present)
        try:
            numbers = pc.cast(present, pa.float64())
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            numbers = None
        if numbers is not None and col.kind == "numeric":
            _numeric(col, numbers.to_numpy(zero_copy_only=False))
            _sketch(col, hash_ids(present))
            return
        if col.kind == "numeric":  # the first text seen: is it a list of ids in a cell?
            col.kind = "text"
            col.separator = _separator(present)
            col.kind = "list" if col.separator is not None else "text"
        if col.separator is not None:
            flat = pc.list_flatten(pc.split_pattern(present, col.separator))
            flat = flat.filter(pc.greater(pc.utf8_length(flat), 0))
            col._ids += len(flat)
            _sketch(col, hash_ids(flat))
            return
        _sketch(col, hash_ids(present))
        return
    if pa.types.is_list(values.type) or pa.types.is_large_list(values.type):
        col.kind = "list"
        flat = pc.list_flatten(values)
        col._ids += len(flat)
        _sketch(col, hash_ids(flat.filter(flat.is_valid())))
        return
    present = values.filter(values.is_valid())
    if pa.types.is_string(values.type) or pa.types.is_large_string(values.type):
        col.kind = "text"
        _sketch(col, hash_ids(present))
        return
    if pa.types.is_integer(values.type) or pa.types.is_boolean(values.type):
        if pa.types.is_integer(values.type):
            _sketch(col, hash_ids(present))
        present = pc.cast(present, pa.float64())
    _numeric(col, present.to_numpy(zero_copy_only=False).astype(np.float64))


def _separator(values: Any) -> str | None:
    """The separator most cells of ``values`` (text) hold, if any: they are multi-hot cells."""
    import pyarrow.compute as pc

    if not len(values):
        return None
    for candidate in _SEPARATORS:
        if pc.sum(pc.match_substring(values, candidate)).as_py() > len(values) / 2:
            return candidate
    return None


def _numeric(col: ColumnProfile, x: np.ndarray) -> None:
    if not x.size:
        return
    finite = x[np.isfinite(x)]
    if not finite.size:
        return
    col.low = float(finite.min()) if col.low is None else min(col.low, float(finite.min()))
    col.high = float(finite.max()) if col.high is None else max(col.high, float(finite.max()))
    col.integral = col.integral and bool(np.all(finite == np.round(finite)))
    col._sum += float(finite.sum())
    col._count += int(finite.size)


def _sketch(col: ColumnProfile, hashed: np.ndarray) -> None:
    from datasketches import hll_sketch

    if col._sketch is None:
        col._sketch = hll_sketch(SKETCH_LG_K)
    update = col._sketch.update
    for value in hashed.tolist():
        update(value)


def _guess_roles(columns: list[ColumnProfile], rows: int) -> tuple[str | None, tuple[str, ...], tuple[str, ...]]:
    """The label (a 0/1 column, by name first), the sparse columns (text, lists, and non-negative integers of many
    distinct values: ids written as numbers) and the dense ones (the other numeric columns)."""
    binary = [c for c in columns if c.binary]
    named = [c for c in binary if c.name.lower() in _LABEL_NAMES]
    label = (named or binary or [None])[0]
    dense, sparse = [], []
    for c in columns:
        if c is label or c.rows == c.missing:
            continue
        if c.kind in ("text", "list"):
            sparse.append(c.name)
        elif c.integral and c.distinct is not None and c.distinct > max(16.0, 0.001 * rows) and (c.low or 0) >= 0:
            # Integral values, many of them: ids written as numbers (a count would rather be dense; edit it).
            sparse.append(c.name)
        else:
            dense.append(c.name)
    return (label.name if label is not None else None), tuple(dense), tuple(sparse)
