"""Which columns of a click log feed the model (model.yaml's ``data:``, or ``persia train --schema FILE``): the label,
the dense columns with the transforms declared for them, and the sparse features, each feeding one table.

A dense column's transforms apply in a fixed order, the same in training, evaluation and prediction: ``clip: [LO,
HI]``, then ``log1p`` (signed: ``sign(x) * log(1 + |x|)``, so negative values stay finite), then ``standardize`` (minus
the mean, over the standard deviation, both from a first pass over the training rows: see
:meth:`DenseTransform.with_statistics`; or as given by ``mean:`` and ``std:``, as a checkpoint's model.yaml records
the run's).
Without dense columns, the model reads one constant 0: the bottom MLP learns a bias vector, a sparse-only DLRM or DCN.

A row is *bad* when a dense value is NaN or infinite (as read, or after its transforms) or its label is missing or
NaN; ``on_bad_row:`` (:class:`BadRowPolicy`) says what reading does with it: stop naming the file, row and column
(``fail``, the default), drop the row (``skip``), or read the value as the column's mean (``impute``). A missing
(null) dense value is no bad value: it reads as 0.

A CSV file's fields are separated by ``delimiter:`` (:data:`CSV_DELIMITERS`; a comma unless given): ``persia data
profile`` finds it from the file's first lines and writes it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from persia_planner.errors import abbreviate
from persia_planner.fields import Fields, load_yaml

__all__ = [
    "CSV_DELIMITERS",
    "DEFAULT_DELIMITER",
    "FLOAT32_MAX",
    "FLOAT32_TINY",
    "BadRowPolicy",
    "DataSchema",
    "DenseTransform",
    "SparseColumn",
    "load_data_schema",
    "read_data_schema",
]

FLOAT32_MAX = float(np.finfo(np.float32).max)
"""The largest float32 (3.4e38): dense values are float32, and so must be the statistics they are standardized with."""
FLOAT32_TINY = float(np.finfo(np.float32).tiny)
"""The smallest positive normal float32 (1.2e-38): a smaller std is 0 to float32 arithmetic."""
DEFAULT_DELIMITER = ","
"""A CSV file's delimiter unless ``delimiter:`` says otherwise."""
CSV_DELIMITERS = (",", "\t", "|", ";")
"""The delimiters a CSV file's fields may have, in the order ``persia data profile`` prefers them."""
_TAB_SPELLINGS = {"\\t": "\t", "tab": "\t"}
"""``delimiter:`` spellings of a tab besides YAML's ``"\\t"``: ``'\\t'`` (single quotes keep the backslash), ``tab``."""


class BadRowPolicy(enum.StrEnum):
    """What reading does with a bad row (a dense value NaN or infinite, as read or after its transforms; a missing
    or NaN label): ``on_bad_row:`` of the columns' schema, or ``persia train --on-bad-row``."""

    FAIL = "fail"
    """Stop, naming the file, the row and the column: before training when the first pass reads it."""
    SKIP = "skip"
    """Leave the row out (the run's summary counts them)."""
    IMPUTE = "impute"
    """Read a bad dense value as the column's :attr:`DenseTransform.fill` (the first pass's mean of its finite values,
    before the transforms, which then apply to it); a row without a label is left out, as under ``skip``."""


def _is_float32(x: float) -> bool:
    """A float32 number (an integer of any size compares exactly; nan is none)."""
    return -FLOAT32_MAX <= x <= FLOAT32_MAX


def _statistics_problem(mean: float, std: float) -> tuple[str, str] | None:
    """The key of a standardize statistic out of its range and that range in words, or None: both must be float32
    numbers, and the std one that float32 arithmetic can divide by (any number type: a 400-digit integer compares
    exactly)."""
    if not _is_float32(mean):
        return "mean", f"[{-FLOAT32_MAX:.2g}, {FLOAT32_MAX:.2g}] (a float32 number)"
    if not FLOAT32_TINY <= std <= FLOAT32_MAX:
        return "std", f"[{FLOAT32_TINY:.2g}, {FLOAT32_MAX:.2g}] (a positive float32: standardize divides by it)"
    return None


@dataclass(frozen=True)
class DenseTransform:
    """The transforms of one dense column, applied in order: clip, signed log1p, standardize.

    Attributes:
        clip: ``(low, high)``: values clipped into it (None: not clipped).
        log1p: Apply ``sign(x) * log(1 + |x|)``.
        standardize: Subtract ``mean`` and divide by ``std``.
        mean: The first pass's mean of the column after clip and log1p (None until measured).
        std: Its standard deviation (None until measured).
        fill: Under ``on_bad_row: impute``, what a NaN or infinite value of the column reads as, before the
            transforms: the first pass's mean of its finite values (None until measured).
    """

    clip: tuple[float, float] | None = None
    log1p: bool = False
    standardize: bool = False
    mean: float | None = None
    std: float | None = None
    fill: float | None = None

    def before_standardize(self, values: np.ndarray) -> np.ndarray:
        """``values`` clipped and log-scaled as declared (what the first pass measures)."""
        out = values
        if self.clip is not None:
            out = np.clip(out, self.clip[0], self.clip[1])
        if self.log1p:
            out = np.sign(out) * np.log1p(np.abs(out))
        return out

    def apply(self, values: np.ndarray) -> np.ndarray:
        """``values`` (float32) transformed as declared.

        Raises:
            ValueError: ``standardize`` without the first pass's statistics.
        """
        # A value the statistics push past float32's range becomes inf, which the reader finds: no warning for it.
        with np.errstate(over="ignore", invalid="ignore"):
            out = self.before_standardize(values)
            if self.standardize:
                if self.mean is None or self.std is None:
                    raise ValueError("standardize needs the first pass's mean and std (DenseTransform.with_statistics)")
                out = (out - self.mean) / self.std
            return np.asarray(out, dtype=np.float32)

    def with_statistics(self, values: np.ndarray, *, fill: bool = False) -> DenseTransform:
        """This transform with what the first pass measures on ``values`` (raw column values of the training rows;
        only the finite ones count): the mean and standard deviation after clip and log1p where it standardizes
        without them, and with ``fill`` the mean before them (:attr:`fill`) where it has none.

        Raises:
            ValueError: No finite value to measure, or (standardize) a constant column: its std is 0.
        """
        wants_statistics = self.standardize and self.mean is None
        if not (wants_statistics or (fill and self.fill is None)):
            return self
        raw = np.asarray(values, dtype=np.float64)
        finite = raw[np.isfinite(raw)]
        if not finite.size:
            what = f" (all {raw.size:,} NaN or infinite)" if raw.size else ""
            raise ValueError(f"no finite value in the first pass's rows{what}: no mean to standardize or impute with")
        out = self if not fill or self.fill is not None else replace(self, fill=float(finite.mean()))
        if not wants_statistics:
            return out
        seen = self.before_standardize(finite)
        mean, std = float(seen.mean()), float(seen.std())
        if seen.min() == seen.max() or std < FLOAT32_TINY:  # (the summed mean's rounding leaves a tiny std)
            raise ValueError(
                f"constant ({seen[0]:g} in all {seen.size:,} first-pass rows, after clip and log1p): standardize "
                "would divide by a std of 0"
            )
        return replace(out, mean=mean, std=std)

    def to_dict(self) -> dict[str, Any]:
        """As a summary or checkpoint records it."""
        out: dict[str, Any] = {}
        if self.clip is not None:
            out["clip"] = list(self.clip)
        if self.log1p:
            out["log1p"] = True
        if self.standardize:
            out["standardize"] = True
            if self.mean is not None and self.std is not None:  # measured, or given: as model.yaml reads them back
                out |= {"mean": self.mean, "std": self.std}
        if self.fill is not None:
            out["fill"] = self.fill
        return out


_NONE = DenseTransform()  # a column read as it is


@dataclass(frozen=True)
class SparseColumn:
    """One sparse feature of a click log.

    Attributes:
        feature: The feature's name in the schema.
        column: The file's column holding its ids: strings or integers, or lists of them (multi-hot).
        table: The table it feeds (the feature's name unless given); the batches' KJT key.
        separator: CSV multi-hot: the ids of a cell are separated by this string (None: one id per cell).
    """

    feature: str
    column: str
    table: str
    separator: str | None = None


@dataclass(frozen=True)
class DataSchema:
    """How the columns of a Parquet or CSV click log map to a training batch (model.yaml's ``data:``, or
    ``persia train --schema FILE``).

    Attributes:
        label: The 0/1 click column; None for rows without one, to score (:meth:`unlabeled`).
        dense: The float columns of the dense features, in order (a missing value reads as 0); may be empty.
        sparse: The sparse features, each feeding one table.
        source: The file the schema was read from (named by errors).
        transforms: The declared transforms of dense columns, by column (a column without any is read as it is).
        on_bad_row: What reading does with a row holding a bad value (:class:`BadRowPolicy`).
        from_file: Read from a schema file (``persia train --schema``), not from a model's ``data:``.
        delimiter: What separates a CSV file's fields (one of :data:`CSV_DELIMITERS`).
    """

    label: str | None
    dense: tuple[str, ...]
    sparse: tuple[SparseColumn, ...]
    source: str = "model.yaml"
    transforms: Mapping[str, DenseTransform] = field(default_factory=dict)
    on_bad_row: BadRowPolicy = BadRowPolicy.FAIL
    from_file: bool = False
    delimiter: str = DEFAULT_DELIMITER

    def __post_init__(self) -> None:
        object.__setattr__(self, "on_bad_row", BadRowPolicy(self.on_bad_row))  # "skip" as well as the enum

    @property
    def num_inputs(self) -> int:
        """The dense inputs of a batch: one per dense column, or one constant 0 when there is none."""
        return max(1, len(self.dense))

    @property
    def to_standardize(self) -> tuple[str, ...]:
        """The dense columns whose ``standardize`` still lacks the first pass's statistics."""
        return tuple(c for c, t in self.transforms.items() if t.standardize and t.mean is None)

    @property
    def to_measure(self) -> tuple[str, ...]:
        """The dense columns the first pass must measure: those to standardize without statistics, and under
        ``on_bad_row: impute`` every one without its :attr:`DenseTransform.fill`."""
        if self.on_bad_row is not BadRowPolicy.IMPUTE:
            return self.to_standardize
        return tuple(c for c in self.dense if c in self.to_standardize or self.transforms.get(c, _NONE).fill is None)

    def with_statistics(self, columns: Mapping[str, np.ndarray]) -> DataSchema:
        """This schema with what the first pass measures (:meth:`DenseTransform.with_statistics`) on ``columns``
        (raw values by column).

        Raises:
            ValueError: For the first column that cannot be measured, with the column's name as its second argument.
        """
        fill = self.on_bad_row is BadRowPolicy.IMPUTE
        measured = dict(self.transforms)
        for c, values in columns.items():
            try:
                measured[c] = self.transforms.get(c, _NONE).with_statistics(values, fill=fill)
            except ValueError as err:
                raise ValueError(str(err), c) from None
        return replace(self, transforms=measured)

    @property
    def columns(self) -> tuple[str, ...]:
        """Every column the schema reads, each once, label first."""
        label = () if self.label is None else (self.label,)
        return tuple(dict.fromkeys((*label, *self.dense, *(s.column for s in self.sparse))))

    def unlabeled(self) -> DataSchema:
        """This schema for rows that have no label column (rows to score): their batches' labels read NaN."""
        return replace(self, label=None)

    @property
    def tables(self) -> tuple[str, ...]:
        """The tables fed, in the schema's order (the batches' KJT keys)."""
        return tuple(s.table for s in self.sparse)

    def to_dict(self) -> dict[str, Any]:
        """As model.yaml's ``data:`` writes it (:func:`read_data_schema` reads it back), with the measured statistics
        of each standardized column: a checkpoint's model.yaml scores new rows as the run transformed its own. Not
        ``on_bad_row``: what to do with bad rows is each reader's to say (scoring names a bad row unless told)."""
        dense = [{"column": c, **self.transforms[c].to_dict()} if c in self.transforms else c for c in self.dense]
        sparse: dict[str, Any] = {}
        for s in self.sparse:
            if s.table == s.feature and s.separator is None:
                sparse[s.feature] = s.column
            else:
                sparse[s.feature] = {"column": s.column, "table": s.table}
                if s.separator is not None:
                    sparse[s.feature]["separator"] = s.separator
        out: dict[str, Any] = {"label": self.label}
        if self.delimiter != DEFAULT_DELIMITER:
            out["delimiter"] = self.delimiter
        return out | {"dense": dense, "sparse": sparse}


def read_data_schema(fields: Fields | None) -> DataSchema | None:
    """The ``data:`` mapping as a :class:`DataSchema` (None when absent); errors name the file and key path."""
    if fields is None:
        return None
    label = fields.take_str("label")
    on_bad_row = fields.take_enum("on_bad_row", BadRowPolicy, default=BadRowPolicy.FAIL)
    delimiter = fields.take("delimiter", default=DEFAULT_DELIMITER)
    delimiter = _TAB_SPELLINGS.get(delimiter, delimiter) if isinstance(delimiter, str) else delimiter
    if delimiter not in CSV_DELIMITERS:  # a tab is no printable name: only the listed characters are taken
        raise fields.error(
            "delimiter",
            f"is {abbreviate(delimiter, 20)}, not a CSV delimiter",
            fixes=("one of ',', '\\t' (tab), '|', ';'",),
        )
    dense_value, transforms = _read_dense(fields)
    sparse_fields = fields.sub("sparse")
    assert sparse_fields is not None
    sparse: list[SparseColumn] = []
    for feature in list(sparse_fields.data):
        if not isinstance(feature, str) or not feature:
            raise sparse_fields.error(str(feature), "a feature name must be a non-empty string")
        sparse_fields.refuse_unprintable(feature, feature)
        value = sparse_fields.take(feature)
        if isinstance(value, str):
            sparse.append(SparseColumn(feature, value, feature))
            continue
        item = sparse_fields.sub(feature)
        assert item is not None
        column = item.take_str("column")
        table = item.take_str("table", default=feature)
        separator = item.take_str("separator", default=None)
        item.finish()
        if separator == "":
            raise item.error("separator", "is empty", fixes=("give the string between ids, e.g. '|'",))
        if separator is not None and delimiter in separator:
            raise item.error(
                "separator",
                f"holds the file's delimiter {delimiter!r}: it would split the fields, not the ids",
                fixes=("give another separator", "give another delimiter"),
            )
        sparse.append(SparseColumn(feature, column, table, separator))
    sparse_fields.finish()
    fields.finish()
    if not sparse:
        raise fields.error("sparse", "no sparse feature", fixes=("map each table to the column of its ids",))
    seen: dict[str, str] = {}
    for s in sparse:
        if s.table in seen:
            raise sparse_fields.error(
                s.feature, f"feeds table {s.table!r}, which {seen[s.table]} feeds already", ("one feature per table",)
            )
        seen[s.table] = s.feature
    for name, column in (("label", label), *((f"dense {c!r}", c) for c in dense_value)):
        if column in {s.column for s in sparse}:
            raise fields.error("sparse", f"column {column!r} is the {name} column too", ("map it once",))
    if label in dense_value:
        raise fields.error("dense", f"column {label!r} is the label", fixes=("remove it from dense",))
    return DataSchema(
        label, tuple(dense_value), tuple(sparse), fields.source, transforms, on_bad_row, delimiter=delimiter
    )


def _read_dense(fields: Fields) -> tuple[list[str], dict[str, DenseTransform]]:
    """``dense:``: column names, or mappings ``{column: NAME, clip: [LO, HI], log1p: true, standardize: true}``."""
    value = fields.take("dense", default=[])
    if not isinstance(value, list):
        raise fields.error("dense", f"expected a list of column names, got {abbreviate(value)}")
    names: list[str] = []
    transforms: dict[str, DenseTransform] = {}
    for i, item in enumerate(value):
        key = f"dense[{i}]"
        if isinstance(item, str) and item:
            fields.refuse_unprintable(key, item)
            names.append(item)
            continue
        if not isinstance(item, Mapping):
            raise fields.error(key, f"expected a column name or a mapping with 'column:', got {abbreviate(item)}")
        entry = Fields(item, fields.source, fields.key_path(key))
        column = entry.take_str("column")
        entry.refuse_unprintable("column", column)
        clip = entry.take("clip", default=None)
        if clip is not None and not (
            isinstance(clip, list)
            and len(clip) == 2
            and all(isinstance(x, int | float) and not isinstance(x, bool) and _is_float32(x) for x in clip)
            and clip[0] < clip[1]
        ):
            raise entry.error("clip", f"expected [LOW, HIGH] with LOW < HIGH, float32 numbers, got {abbreviate(clip)}")
        log1p = entry.take_bool("log1p", default=False)
        standardize = entry.take_bool("standardize", default=False)
        mean, std = _read_statistics(entry, standardize)
        fill = _read_fill(entry)
        entry.finish()
        names.append(column)
        clipped = tuple(float(x) for x in clip) if clip else None
        transform = DenseTransform(clipped, log1p, standardize, mean, std, fill)
        if transform != DenseTransform():
            transforms[column] = transform
    duplicate = next((c for c in names if names.count(c) > 1), None)
    if duplicate is not None:
        raise fields.error("dense", f"column {duplicate!r} is listed twice", fixes=("list each column once",))
    return names, transforms


def _read_statistics(entry: Fields, standardize: bool) -> tuple[float | None, float | None]:
    """``mean:`` and ``std:`` of a standardized column, given together (no first pass then: a checkpoint's
    model.yaml carries the run's), or neither."""
    given = [k for k in ("mean", "std") if entry.has(k)]
    if not given:
        return None, None
    if not standardize:
        raise entry.error(given[0], "is a statistic of 'standardize: true'", fixes=(f"remove '{given[0]}'",))
    if len(given) == 1:
        other = "std" if given[0] == "mean" else "mean"
        raise entry.error(other, f"is missing beside '{given[0]}'", fixes=("give both, or neither for a first pass",))
    given = {k: entry.take(k) for k in ("mean", "std")}
    mean, std = _number(given["mean"]), _number(given["std"])
    for key, value in (("mean", mean), ("std", std)):
        if value is None:
            raise entry.error(key, f"expected a number, got {abbreviate(given[key])}", _STATISTICS_FIXES)
    assert mean is not None and std is not None
    problem = _statistics_problem(mean, std)
    if problem is not None:
        key, allowed = problem
        raise entry.error(key, f"must be in {allowed}, got {abbreviate(given[key], 40)}", _STATISTICS_FIXES)
    return float(mean), float(std)


def _number(value: Any) -> float | None:
    """``value`` as a number: an int or a float, or a string of one (YAML reads ``1e-300`` as a string); None if
    it is none."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return value
    if isinstance(value, str) and len(value) <= 40:
        try:
            return float(value)
        except ValueError:
            return None
    return None


_STATISTICS_FIXES = ("leave mean and std out for a first pass to measure them",)


def _read_fill(entry: Fields) -> float | None:
    """``fill:``, what a bad value of the column reads as under ``on_bad_row: impute`` (a checkpoint's model.yaml
    records the run's): a float32 number."""
    if not entry.has("fill"):
        return None
    given = entry.take("fill")
    value = _number(given)
    if value is None or not _is_float32(value):
        raise entry.error(
            "fill",
            f"must be a number in [{-FLOAT32_MAX:.2g}, {FLOAT32_MAX:.2g}] (a float32), got {abbreviate(given, 40)}",
            fixes=("leave fill out for a first pass to measure the column's mean",),
        )
    return float(value)


def load_data_schema(path: str | Path) -> DataSchema:
    """A schema file (``persia train --schema FILE``): the ``data:`` mapping of model.yaml, at the top level or
    under ``data:``.

    Raises:
        SpecError: Malformed YAML, a missing or unknown key; the message names the file and key path.
    """
    data, source = load_yaml(path)
    name = Path(source).name
    if isinstance(data, Mapping) and set(data) == {"data"}:
        schema = read_data_schema(Fields(data, name, "").sub("data"))
    else:
        schema = read_data_schema(Fields(data if data is not None else {}, name, ""))
    assert schema is not None
    return replace(schema, from_file=True)
