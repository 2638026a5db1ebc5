"""Which columns of a click log feed the model (model.yaml's ``data:``, or ``persia train --schema FILE``): the label,
the dense columns with the transforms declared for them, and the sparse features, each feeding one table.

A dense column's transforms apply in a fixed order, the same in training, evaluation and prediction: ``clip: [LO,
HI]``, then ``log1p`` (signed: ``sign(x) * log(1 + |x|)``, so negative values stay finite), then ``standardize`` (minus
the mean, over the standard deviation, both from a first pass over the training rows: see
:meth:`DenseTransform.with_statistics`; or as given by ``mean:`` and ``std:``, as a checkpoint's model.yaml records
the run's).
Without dense columns, the model reads one constant 0: the bottom MLP learns a bias vector, a sparse-only DLRM or DCN.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from persia_planner.errors import abbreviate
from persia_planner.fields import Fields, load_yaml

__all__ = ["DataSchema", "DenseTransform", "SparseColumn", "load_data_schema", "read_data_schema"]


@dataclass(frozen=True)
class DenseTransform:
    """The transforms of one dense column, applied in order: clip, signed log1p, standardize.

    Attributes:
        clip: ``(low, high)``: values clipped into it (None: not clipped).
        log1p: Apply ``sign(x) * log(1 + |x|)``.
        standardize: Subtract ``mean`` and divide by ``std``.
        mean: The first pass's mean of the column after clip and log1p (None until measured).
        std: Its standard deviation (None until measured).
    """

    clip: tuple[float, float] | None = None
    log1p: bool = False
    standardize: bool = False
    mean: float | None = None
    std: float | None = None

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
        out = self.before_standardize(values)
        if self.standardize:
            if self.mean is None or self.std is None:
                raise ValueError("standardize needs the first pass's mean and std (DenseTransform.with_statistics)")
            out = (out - self.mean) / self.std
        return np.asarray(out, dtype=np.float32)

    def with_statistics(self, values: np.ndarray) -> DenseTransform:
        """This transform with the mean and standard deviation of ``values`` (raw column values of the training rows)
        after clip and log1p; a constant column keeps a std of 1."""
        seen = self.before_standardize(np.asarray(values, dtype=np.float64))
        mean = float(seen.mean()) if seen.size else 0.0
        std = float(seen.std()) if seen.size else 1.0
        return replace(self, mean=mean, std=std if std > 0 and math.isfinite(std) else 1.0)

    def to_dict(self) -> dict[str, Any]:
        """As a summary or checkpoint records it."""
        out: dict[str, Any] = {}
        if self.clip is not None:
            out["clip"] = list(self.clip)
        if self.log1p:
            out["log1p"] = True
        if self.standardize:
            out |= {"standardize": True, "mean": self.mean, "std": self.std}
        return out


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
    """

    label: str | None
    dense: tuple[str, ...]
    sparse: tuple[SparseColumn, ...]
    source: str = "model.yaml"
    transforms: Mapping[str, DenseTransform] = field(default_factory=dict)

    @property
    def num_inputs(self) -> int:
        """The dense inputs of a batch: one per dense column, or one constant 0 when there is none."""
        return max(1, len(self.dense))

    @property
    def to_standardize(self) -> tuple[str, ...]:
        """The dense columns whose ``standardize`` still lacks the first pass's statistics."""
        return tuple(c for c, t in self.transforms.items() if t.standardize and t.mean is None)

    def with_statistics(self, columns: Mapping[str, np.ndarray]) -> DataSchema:
        """This schema with the statistics of each standardized column measured on ``columns`` (raw values)."""
        measured = {c: t.with_statistics(columns[c]) if c in columns else t for c, t in self.transforms.items()}
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
        of each standardized column: a checkpoint's model.yaml scores new rows as the run transformed its own."""
        dense = [{"column": c, **self.transforms[c].to_dict()} if c in self.transforms else c for c in self.dense]
        sparse: dict[str, Any] = {}
        for s in self.sparse:
            if s.table == s.feature and s.separator is None:
                sparse[s.feature] = s.column
            else:
                sparse[s.feature] = {"column": s.column, "table": s.table}
                if s.separator is not None:
                    sparse[s.feature]["separator"] = s.separator
        return {"label": self.label, "dense": dense, "sparse": sparse}


def read_data_schema(fields: Fields | None) -> DataSchema | None:
    """The ``data:`` mapping as a :class:`DataSchema` (None when absent); errors name the file and key path."""
    if fields is None:
        return None
    label = fields.take_str("label")
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
    return DataSchema(label, tuple(dense_value), tuple(sparse), fields.source, transforms)


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
            and all(isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) for x in clip)
            and clip[0] < clip[1]
        ):
            raise entry.error("clip", f"expected [LOW, HIGH] with LOW < HIGH, got {abbreviate(clip)}")
        log1p = entry.take_bool("log1p", default=False)
        standardize = entry.take_bool("standardize", default=False)
        mean, std = _read_statistics(entry, standardize)
        entry.finish()
        names.append(column)
        transform = DenseTransform(tuple(float(x) for x in clip) if clip else None, log1p, standardize, mean, std)
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
    values = [entry.take(k) for k in ("mean", "std")]
    if not all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in values):
        raise entry.error("mean", f"mean and std must be finite numbers, got {abbreviate(values)}")
    if values[1] <= 0:
        raise entry.error("std", f"must be > 0, got {values[1]!r}", fixes=("leave mean and std out for a first pass",))
    return float(values[0]), float(values[1])


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
    return schema
