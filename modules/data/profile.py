"""``persia data profile``: what a click log holds, read once and streamed, and the model.yaml it suggests.

Per column: its rows and missing values; for a column of ids, an estimate of its distinct ids (an HLL sketch,
Apache DataSketches, of the ids hashed as training hashes them: :func:`.ids.hash_ids`), and the table rows that
suggests; for a numeric column, its range and mean, which suggest the dense transforms. Without a schema the roles
are guessed: a 0/1 column named like a label is the label, other numeric columns dense, text and list columns (and
integer columns of many distinct values) sparse. The model.yaml skeleton says what it guessed; edit it. It is one
``persia plan`` takes: table names model.yaml accepts (:func:`table_names`) beside the real columns in ``data:``,
no column whose name model.yaml cannot hold, and no model without a table.

Torch-free: the log is read, and each file checked first, by :func:`.log_blocks.log_blocks`; the cost is linear in
rows and columns (every column looked up by name in a dict, never a scan).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from persia_planner.errors import PlannerError, SpecError, abbreviate, unprintable
from persia_planner.limits import MAX_POOLING_FACTOR
from persia_planner.model.data_schema import DataSchema
from persia_planner.model.specs import TABLE_NAME_PATTERN
from persia_planner.modules.data.criteo_format import CATEGORICAL_COLUMNS, FEATURE_NAMES, INTEGER_COLUMNS
from persia_planner.modules.data.log_blocks import log_blocks
from persia_planner.modules.data.source import DataKind, DataSource, fits_dense, fits_sparse

__all__ = ["SKETCH_LG_K", "ColumnProfile", "DataProfile", "profile", "suggested_rows", "table_names"]

SKETCH_LG_K = 14
"""log2 of the HLL sketch's registers: about 0.8% relative error on a distinct count."""
_LABEL_NAMES = ("label", "click", "clicked", "clicks", "is_click", "y", "target")
_DENSE_LOG_ABOVE = 100.0
"""A non-negative numeric column whose values reach this gets ``log1p`` in the skeleton (counts, timestamps)."""
_SEPARATORS = ("|", ";")
"""What may stand between a CSV cell's ids (a comma cannot, unquoted)."""
_ROWS_PER_ID = 2.0
"""Table rows per distinct id in the suggestion: ``id mod rows`` then collides for about a quarter of the ids."""
_NOT_IN_NAMES = re.compile(r"[^A-Za-z0-9_.-]")
_MAX_NAME_CHARS = 200  # TABLE_NAME_PATTERN's
_NO_LABEL = "LABEL_COLUMN"


@dataclass
class ColumnProfile:
    """One column of the log.

    Attributes:
        name: The column.
        kind: ``numeric``, ``text`` (strings, or a CSV's values that are not all numbers), ``list`` (multi-hot: a
            list column, or a CSV's text with a ``separator`` between ids in most rows) or ``other`` (a Parquet type
            the readers take neither as numbers nor as ids: bytes, dates, structs).
        separator: The string between a CSV cell's ids (None: one id per cell).
        rows: Rows read.
        missing: Rows without a value.
        distinct: Estimated distinct ids (text, list and integer columns; None otherwise).
        low, high, mean: A numeric column's range and mean (None otherwise; the mean also where the sum overflows).
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

    @property
    def pooling(self) -> float:
        """A multi-hot column's ids per row that has a value."""
        return self._ids / max(1, self.rows - self.missing)


@dataclass(frozen=True)
class DataProfile:
    """A log's profile: its rows and columns, and the roles of the columns (given by a schema, or guessed).

    Attributes:
        features: Per sparse column, the name its table wants: the schema's table, Criteo's feature, else the column
            (:meth:`model_skeleton` makes it a name model.yaml accepts).
        left_out: Columns no role was guessed for because model.yaml cannot name them (a control or format
            character in the name).
    """

    source: str
    kind: DataKind
    rows: int
    columns: tuple[ColumnProfile, ...]
    label: str | None
    dense: tuple[str, ...]
    sparse: tuple[str, ...]
    guessed: bool
    features: tuple[str, ...] = ()
    left_out: tuple[str, ...] = ()

    @cached_property
    def _by_name(self) -> dict[str, ColumnProfile]:
        return {c.name: c for c in self.columns}

    @cached_property
    def _roles(self) -> dict[str, str]:
        roles = dict.fromkeys(self.dense, "dense") | dict.fromkeys(self.sparse, "sparse")
        return roles | ({self.label: "label"} if self.label is not None else {})

    def column(self, name: str) -> ColumnProfile:
        """The column named ``name``."""
        return self._by_name[name]

    def role(self, name: str) -> str:
        """Column ``name``'s role: ``label``, ``dense``, ``sparse``, or ``-`` (none)."""
        return self._roles.get(name, "-")

    @cached_property
    def tables(self) -> tuple[str, ...]:
        """The table of each sparse column, named as model.yaml accepts (:func:`table_names`)."""
        wanted = self.features or self.sparse
        if self.kind is DataKind.CRITEO and not self.features:
            wanted = tuple(c.lower() for c in self.sparse)
        return table_names(wanted)

    def model_skeleton(self, name: str = "my-model", dim: int = 16) -> dict[str, Any]:
        """A model.yaml for the log: a table per sparse column sized by :func:`suggested_rows`, the data: mapping
        (naming the columns as they are), and the suggested transforms of the dense columns.

        Raises:
            PlannerError: No column is sparse: the model would have no table.
        """
        if not self.sparse:
            raise self._no_sparse_column()
        criteo = self.kind is DataKind.CRITEO  # its tables are named after the features, c1..c26; no data: section
        tables = []
        for c, table in zip(self.sparse, self.tables, strict=True):
            col = self.column(c)
            tables.append({"name": table, "rows": suggested_rows(col.distinct or 1), "dim": dim})
            if col.kind == "list":
                tables[-1]["pooling_factor"] = min(round(col.pooling, 2), MAX_POOLING_FACTOR)
        model = {"name": name, "batch_size": 4096, "tables": tables}
        if criteo:
            return model
        dense: list[Any] = []
        constant = set(self.constant_dense)
        for c in self.dense:
            col = self.column(c)
            if c in constant:  # standardize would divide by a std of 0: persia train refuses it
                dense.append({"column": c})
            elif col.low is not None and col.low >= 0 and (col.high or 0) >= _DENSE_LOG_ABOVE:
                dense.append({"column": c, "log1p": True, "standardize": True})
            else:
                dense.append({"column": c, "standardize": True})
        data: dict[str, Any] = {"label": self.label or _NO_LABEL, "dense": dense, "sparse": {}}
        for c, table in zip(self.sparse, self.tables, strict=True):
            col = self.column(c)
            if col.separator is not None:
                data["sparse"][table] = {"column": c, "separator": col.separator}
            else:
                data["sparse"][table] = c
        return model | {"data": data}

    @property
    def constant_dense(self) -> tuple[str, ...]:
        """The dense columns of one value in every row profiled: the suggested model reads them as they are."""
        return tuple(c for c in self.dense if (col := self.column(c)).low is not None and col.low == col.high)

    def _no_sparse_column(self) -> PlannerError:
        why = "every column is numbers of few distinct values, or empty"
        if self.left_out:
            why += f"; {len(self.left_out)} left out for names model.yaml cannot hold (e.g. " + (
                f"{abbreviate(self.left_out[0], 40)})"
            )
        return PlannerError(
            f"{self.source}: no column to feed an embedding table ({why}): the model would have no table",
            fixes=("name the id columns: --schema FILE with a data: mapping whose sparse: maps tables to them",),
        )


def table_names(wanted: Sequence[str]) -> tuple[str, ...]:
    """For each of ``wanted`` a table name model.yaml accepts (:data:`~persia_planner.model.specs.TABLE_NAME_PATTERN`),
    each once: other characters become ``_``, a name starting with ``.`` or ``-`` gets a ``_`` before it, an empty
    one is ``column_N``, the rest is cut to 200 characters, and a name already given gets ``_2``, ``_3``, ..."""
    used: set[str] = set()
    tries: dict[str, int] = {}
    names = []
    for i, text in enumerate(wanted):
        base = _NOT_IN_NAMES.sub("_", text) or f"column_{i + 1}"
        base = base if base[0] not in ".-" else "_" + base
        name = base = base[:_MAX_NAME_CHARS]
        while name in used:
            tries[base] = tries.get(base, 1) + 1
            suffix = f"_{tries[base]}"
            name = base[: _MAX_NAME_CHARS - len(suffix)] + suffix
        used.add(name)
        names.append(name)
    assert all(re.fullmatch(TABLE_NAME_PATTERN, n) for n in names)
    return tuple(names)


def suggested_rows(distinct: float) -> int:
    """Table rows for ``distinct`` ids: twice as many (``id mod rows`` then maps most ids to rows of their own),
    rounded up to two significant digits."""
    want = max(1.0, _ROWS_PER_ID * distinct)
    scale = 10 ** max(0, math.floor(math.log10(want)) - 1)
    return int(math.ceil(want / scale) * scale)


def profile(source: DataSource, schema: DataSchema | None = None, *, max_rows: int | None = None) -> DataProfile:
    """Read ``source`` (every file; at most ``max_rows`` rows) and profile its columns.

    Raises:
        SpecError: A file cannot be read (:func:`.log_blocks.log_blocks` names it and the fix), a schema column is not
            in it, or the log holds no row.
        PlannerError: A schema for a Criteo log (its columns are the format's).
    """
    if schema is not None and source.kind is DataKind.CRITEO:
        raise PlannerError(
            f"--schema maps the columns of a CSV or Parquet log; criteo:{source.path} has the format's own",
            fixes=("drop --schema", "profile a CSV or Parquet log as csv:PATH or parquet:PATH"),
        )
    columns: dict[str, ColumnProfile] = {}
    rows = 0
    text_ids = source.kind is not DataKind.PARQUET
    for table in log_blocks(source, schema):
        if max_rows is not None and rows >= max_rows:
            break
        if max_rows is not None and rows + table.num_rows > max_rows:
            table = table.slice(0, max_rows - rows)
        rows += table.num_rows
        for name, values in zip(table.column_names, table.columns, strict=True):
            col = columns.get(name)
            if col is None:
                col = columns[name] = ColumnProfile(name)
            _update(col, values, text_ids=text_ids)
    if rows == 0:
        raise SpecError(str(source.path), "", "the log holds no rows", fixes=("profile the files that hold the rows",))
    for col in columns.values():
        if col._sketch is not None:
            col.distinct = float(col._sketch.get_estimate())
        if col._count and col.kind == "numeric" and math.isfinite(col._sum):
            col.mean = col._sum / col._count
    left_out: tuple[str, ...] = ()
    if schema is not None:
        label, dense, sparse = schema.label, schema.dense, tuple(s.column for s in schema.sparse)
        features = schema.tables
    elif source.kind is DataKind.CRITEO:  # the format says: the label, 13 counts, 26 categorical columns
        label, dense, sparse, features = "label", INTEGER_COLUMNS, CATEGORICAL_COLUMNS, FEATURE_NAMES
    else:
        # A name holding a control or format character cannot be written in model.yaml (its loader refuses it).
        left_out = tuple(c.name for c in columns.values() if unprintable(c.name) is not None)
        named = [c for c in columns.values() if unprintable(c.name) is None]
        label, dense, sparse = _guess_roles(named, rows)
        features = sparse
    guessed = schema is None and source.kind is not DataKind.CRITEO
    return DataProfile(
        str(source.path), source.kind, rows, tuple(columns.values()), label, dense, sparse, guessed, features, left_out
    )


def _update(col: ColumnProfile, values: Any, *, text_ids: bool) -> None:
    """Fold one block of a column into its profile."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from persia_planner.modules.data.ids import hash_ids

    values = values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values
    col.rows += len(values)
    col.missing += values.null_count
    if col.kind == "other" or not (fits_dense(values.type) or fits_sparse(values.type)):
        col.kind = "other"  # what no reader takes: counted, not profiled
        return
    if pa.types.is_dictionary(values.type):
        values = values.dictionary_decode()
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
    if col.kind != "numeric":  # numbers in one file, ids in another: counted as the ids
        return
    if pa.types.is_integer(values.type):
        _sketch(col, hash_ids(present))
    try:
        numbers = pc.cast(present, pa.float64())
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):  # a half float, which pyarrow may not cast
        col.kind = "other"
        return
    _numeric(col, numbers.to_numpy(zero_copy_only=False).astype(np.float64))


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
    with np.errstate(over="ignore"):  # values near 1e308: the sum overflows, and the mean is left out
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
        if c is label or c.rows == c.missing or c.kind == "other":
            continue
        if c.kind in ("text", "list"):
            sparse.append(c.name)
        elif c.integral and c.distinct is not None and c.distinct > max(16.0, 0.001 * rows) and (c.low or 0) >= 0:
            # Integral values, many of them: ids written as numbers (a count would rather be dense; edit it).
            sparse.append(c.name)
        else:
            dense.append(c.name)
    return (label.name if label is not None else None), tuple(dense), tuple(sparse)
