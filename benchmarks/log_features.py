"""The baselines' view of a split: the columns the profile's model.yaml feeds persia, read with pyarrow into one
sparse design matrix per side (one-hot ids, standardized log1p dense values) that the logistic regression and the
factorization machine of ``baseline_models.py`` both fit.

The columns are the model's ``data:`` (label, dense with their declared clip and log1p, sparse with their multi-hot
separator); a Criteo log has fixed ones (``I1..I13`` as ``log(1 + max(x, 0))``, as persia's reader reads them, and
``C1..C26``). Each sparse column's vocabulary is the training rows' ids: a validation id never seen in training sets no
column (persia's tables give it an untrained row). A dense value is clipped and log1p-scaled (signed) whether or not
the schema asks for log1p (counts are heavy-tailed; a linear model wants them compressed), then standardized with
the training rows' mean and standard deviation; a missing one reads as the mean.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from click_logs import LogKind, LogRows

from persia_planner.errors import PlannerError

__all__ = [
    "CRITEO_COLUMNS",
    "DenseColumn",
    "Design",
    "FeatureColumns",
    "IdColumn",
    "RawFeatures",
    "one_hot",
    "read_features",
    "read_times",
]


@dataclass(frozen=True)
class DenseColumn:
    """A dense column: its name and the transforms declared before standardizing.

    Attributes:
        name: The file's column.
        clip: ``(low, high)`` the values are clipped into (None: not clipped).
    """

    name: str
    clip: tuple[float, float] | None = None


@dataclass(frozen=True)
class IdColumn:
    """A sparse column: its name and, for multi-hot cells, the string between ids.

    Attributes:
        name: The file's column.
        separator: Multi-hot cells' separator (None: one id per cell).
    """

    name: str
    separator: str | None = None


@dataclass(frozen=True)
class FeatureColumns:
    """The columns a model reads.

    Attributes:
        label: The 0/1 click column.
        dense: The dense columns.
        sparse: The id columns.
    """

    label: str
    dense: tuple[DenseColumn, ...]
    sparse: tuple[IdColumn, ...]

    @classmethod
    def of_model(cls, model_yaml: Path, kind: LogKind) -> FeatureColumns:
        """The columns ``model_yaml`` (a profile's output) feeds persia for a log of ``kind``.

        Raises:
            PlannerError: A CSV / Parquet log's model without a ``data:`` section.
        """
        from persia_planner import load_model

        schema = load_model(model_yaml).data
        if kind is LogKind.CRITEO and schema is None:
            return CRITEO_COLUMNS
        if schema is None or schema.label is None:
            raise PlannerError(
                f"{model_yaml}: no data: section with a label: the baselines cannot tell which columns persia reads",
                fixes=("persia data profile must write data: for CSV and Parquet logs",),
            )
        dense = tuple(
            DenseColumn(c, schema.transforms[c].clip if c in schema.transforms else None) for c in schema.dense
        )
        sparse = tuple(IdColumn(s.column, s.separator) for s in schema.sparse)
        return cls(schema.label, dense, tuple(dict.fromkeys(sparse)))

    def names(self) -> tuple[str, ...]:
        """Every column read, each once, label first."""
        return tuple(dict.fromkeys((self.label, *(d.name for d in self.dense), *(s.name for s in self.sparse))))


_CRITEO_INTEGERS = tuple(f"I{i}" for i in range(1, 14))
_CRITEO_CATEGORIES = tuple(f"C{i}" for i in range(1, 27))
CRITEO_COLUMNS = FeatureColumns(
    "label",
    tuple(DenseColumn(c, (0.0, float("inf"))) for c in _CRITEO_INTEGERS),
    tuple(IdColumn(c) for c in _CRITEO_CATEGORIES),
)
"""A Criteo file's columns (tab-separated ``label, I1..I13, C1..C26``, no header)."""


@dataclass(frozen=True)
class RawFeatures:
    """One file's rows as the baselines read them, before encoding.

    Attributes:
        labels: The 0/1 labels, float64.
        dense: ``[rows, dense columns]``: each value clipped and signed-log1p-scaled, NaN where missing.
        ids: Per sparse column, ``(rows, ids)``: the row of each id and the id (a ``pyarrow`` string array).
    """

    labels: np.ndarray
    dense: np.ndarray
    ids: tuple[tuple[np.ndarray, Any], ...]

    def __len__(self) -> int:
        return len(self.labels)


def _read_table(kind: LogKind, path: Path, columns: FeatureColumns) -> Any:
    import pyarrow as pa
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    ids = {s.name for s in columns.sparse}
    types = {s.name: pa.string() for s in columns.sparse}
    types |= {c: pa.float64() for c in (columns.label, *(d.name for d in columns.dense))}
    if kind is LogKind.PARQUET:
        # A Parquet id column may hold lists (multi-hot): read_features casts its ids, not the lists.
        table = pq.read_table(path, columns=list(columns.names()))
        return pa.table(
            {n: table.column(n).cast(types[n]) if n not in ids else table.column(n) for n in table.column_names}
        )
    read = pcsv.ReadOptions(column_names=list(CRITEO_COLUMNS.names())) if kind is LogKind.CRITEO else None
    parse = pcsv.ParseOptions(delimiter="\t" if kind is LogKind.CRITEO else ",")
    convert = pcsv.ConvertOptions(column_types=types, include_columns=list(columns.names()), strings_can_be_null=True)
    return pcsv.read_csv(path, read_options=read, parse_options=parse, convert_options=convert)


def read_features(kind: LogKind, path: Path, columns: FeatureColumns) -> RawFeatures:
    """The rows of one file (a split's side, as written by ``click_logs.write_rows``).

    Raises:
        PlannerError: A row without a 0/1 label.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    table = _read_table(kind, path, columns)
    labels = table.column(columns.label).to_numpy(zero_copy_only=False)
    if not np.isin(labels, (0.0, 1.0)).all():
        raise PlannerError(f"{path}: column {columns.label!r} holds a value other than 0 and 1 (or none)")
    dense = np.zeros((len(labels), len(columns.dense)))
    for j, d in enumerate(columns.dense):
        values = table.column(d.name).to_numpy(zero_copy_only=False).astype(np.float64)
        if d.clip is not None:
            values = np.clip(values, *d.clip)
        dense[:, j] = np.sign(values) * np.log1p(np.abs(values))
    ids = []
    for s in columns.sparse:
        cells = table.column(s.name).combine_chunks()
        if pa.types.is_list(cells.type) or pa.types.is_large_list(cells.type) or s.separator is not None:
            lists = cells if s.separator is None else pc.split_pattern(cells, s.separator)
            rows, values = pc.list_parent_indices(lists).to_numpy(), pc.list_flatten(lists).cast(pa.string())
        else:
            rows, values = np.arange(len(cells)), cells.cast(pa.string())
        keep = pc.and_(pc.is_valid(values), pc.not_equal(values, "")).fill_null(False)
        ids.append((rows[keep.to_numpy(zero_copy_only=False)], values.filter(keep)))
    return RawFeatures(labels, dense, tuple(ids))


def read_times(rows: LogRows, column: str) -> np.ndarray:
    """The ``column`` of every row of ``rows`` (numbers where every value is one, else strings), for a split by time.

    Raises:
        PlannerError: A Criteo log (its columns have no names) or a column the log lacks.
    """
    import io

    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.csv as pcsv

    source = rows.source
    if source.kind is LogKind.CRITEO:
        raise PlannerError(f"--time-column {column}: {source.arg()} is a Criteo log, whose columns have no names")
    if rows.table is not None:
        table = rows.table
    else:
        assert rows.lines is not None and rows.header is not None
        text = rows.header + b"\n" + b"\n".join(rows.lines) + b"\n"
        names = pcsv.read_csv(io.BytesIO(rows.header + b"\n")).column_names
        if column not in names:
            raise PlannerError(f"--time-column {column}: {source.arg()} has no such column", fixes=(", ".join(names),))
        convert = pcsv.ConvertOptions(include_columns=[column], column_types={column: pa.string()})
        table = pcsv.read_csv(io.BytesIO(text), convert_options=convert)
    if column not in table.column_names:
        raise PlannerError(f"--time-column {column}: {source.arg()} has no such column")
    values = table.column(column).combine_chunks()
    if len(values) != len(rows):
        raise PlannerError(
            f"{source.arg()}: {len(values)} values of {column} for {len(rows)} lines (a quoted newline?)"
        )
    try:
        return pc.cast(values, pa.float64()).to_numpy(zero_copy_only=False)
    except pa.ArrowInvalid:
        return np.asarray(values.to_pylist(), dtype=object)


@dataclass(frozen=True)
class Design:
    """Both sides of a split as sparse design matrices over the same columns.

    Attributes:
        train: ``[training rows, features]`` (``scipy.sparse`` CSR, float64).
        valid: ``[validation rows, features]``.
        y_train: The training labels.
        y_valid: The validation labels.
        widths: Per input column, how many features it became (ids seen in training; 1 per dense column).
    """

    train: Any
    valid: Any
    y_train: np.ndarray
    y_valid: np.ndarray
    widths: dict[str, int]


def one_hot(train: RawFeatures, valid: RawFeatures, columns: FeatureColumns) -> Design:
    """The design matrices of a split: the dense values standardized by the training rows' statistics, then one
    column per (sparse column, id seen in training)."""
    import pyarrow.compute as pc
    from scipy import sparse

    with np.errstate(invalid="ignore"):
        mean = np.nanmean(train.dense, axis=0) if len(columns.dense) else np.zeros(0)
        std = np.nanstd(train.dense, axis=0) if len(columns.dense) else np.zeros(0)
    mean, std = np.nan_to_num(mean), np.where(np.nan_to_num(std) > 0, np.nan_to_num(std), 1.0)
    widths = {d.name: 1 for d in columns.dense}

    def matrix(side: RawFeatures, vocabularies: list[Any]) -> Any:
        dense = np.nan_to_num((side.dense - mean) / std)
        blocks = [sparse.csr_matrix(dense)] if len(columns.dense) else []
        for (rows, ids), vocab in zip(side.ids, vocabularies, strict=True):
            position = pc.index_in(ids, value_set=vocab)
            hit = pc.is_valid(position).to_numpy(zero_copy_only=False)
            cols = position.filter(pc.is_valid(position)).to_numpy(zero_copy_only=False)
            block = sparse.coo_matrix((np.ones(len(cols)), (rows[hit], cols)), shape=(len(side), len(vocab)))
            blocks.append(block.tocsr())
        return sparse.hstack(blocks, format="csr")

    vocabularies = [pc.unique(ids) for _, ids in train.ids]
    widths |= {s.name: len(v) for s, v in zip(columns.sparse, vocabularies, strict=True)}
    return Design(matrix(train, vocabularies), matrix(valid, vocabularies), train.labels, valid.labels, widths)
