"""The model.yaml ``persia data profile`` suggests for a profiled log: one ``persia train`` reads without edits.

* A table per sparse column, its rows chosen for a stated collision rate (:func:`suggested_rows`:
  :func:`.ids.rows_for_collision_rate`, the birthday formula of ``id mod rows``), its ``pooling_factor`` for a
  multi-hot column.
* ``batch_size`` that fits the rows (:func:`suggested_batch_size`): at least :data:`MIN_STEPS_PER_EPOCH` steps an
  epoch, at most :data:`MAX_SUGGESTED_BATCH`.
* An explicit ``dense:`` section: DCN-v2 (:data:`SUGGESTED_ARCH`) at TorchRec's default sizes, written out so that
  choosing another is an edit of what is there.
* ``data:``: the label, each dense column with its transforms, each table's column (and a multi-hot column's
  separator), and a CSV's delimiter when it is no comma. Criteo's is the format's
  (:func:`.criteo_format.criteo_schema`).

Table names are ones model.yaml accepts (:func:`table_names`) beside the real columns in ``data:``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from persia_planner.limits import MAX_POOLING_FACTOR
from persia_planner.model.data_schema import DEFAULT_DELIMITER, DataSchema, DenseTransform
from persia_planner.model.dense import ArchKind, DenseArch
from persia_planner.model.specs import TABLE_NAME_PATTERN
from persia_planner.modules.data.columns import ColumnProfile
from persia_planner.modules.data.criteo_format import criteo_schema
from persia_planner.modules.data.ids import DEFAULT_COLLISION_RATE, rows_for_collision_rate
from persia_planner.modules.data.source import DataKind
from persia_planner.modules.data.split import DEFAULT_EVAL_SPLIT

__all__ = [
    "MAX_SUGGESTED_BATCH",
    "MIN_STEPS_PER_EPOCH",
    "SUGGESTED_ARCH",
    "ProfiledLog",
    "model_skeleton",
    "suggested_batch_size",
    "suggested_rows",
    "table_names",
]

MIN_STEPS_PER_EPOCH = 50
"""The fewest steps an epoch the suggested batch gives: an epoch of fewer steps leaves Adagrad's accumulators and the
dense network barely moved (4096 rows a step gave 19 steps an epoch on 80,000 MovieLens rows, and under-trained)."""
SUGGESTED_ARCH = ArchKind.DCN
"""The suggested dense arch: on MovieLens-100K as clicks, DCN-v2's cross layers peaked 0.004-0.005 AUC above DLRM's dot
interaction at equal settings, which over-fit an epoch sooner (docs/decisions/0030-measured-defaults.md)."""
MAX_SUGGESTED_BATCH = 4096
"""The largest suggested batch: the bundled models' (dlrm_small.yaml), whose learning rates were set at it."""
NO_LABEL = "LABEL_COLUMN"
_NOT_IN_NAMES = re.compile(r"[^A-Za-z0-9_.-]")
_MAX_NAME_CHARS = 200  # TABLE_NAME_PATTERN's


class ProfiledLog(Protocol):
    """What the skeleton reads of a profiled log (:class:`.profile.DataProfile` is one): its format and rows, the
    columns of each role in the model's order, each sparse column's table, and the dense columns' transforms."""

    @property
    def kind(self) -> DataKind: ...
    @property
    def rows(self) -> int: ...
    @property
    def label(self) -> str | None: ...
    @property
    def dense(self) -> tuple[str, ...]: ...
    @property
    def sparse(self) -> tuple[str, ...]: ...
    @property
    def tables(self) -> tuple[str, ...]: ...
    @property
    def transforms(self) -> Mapping[str, DenseTransform]: ...
    @property
    def delimiter(self) -> str | None: ...
    @property
    def schema(self) -> DataSchema | None: ...
    def column(self, name: str) -> ColumnProfile: ...


def suggested_rows(distinct: float, collision_rate: float = DEFAULT_COLLISION_RATE) -> int:
    """Table rows for ``distinct`` ids at ``collision_rate`` (:func:`.ids.rows_for_collision_rate`), rounded up to
    two significant digits."""
    want = rows_for_collision_rate(max(1.0, distinct), collision_rate)
    scale = 10 ** max(0, math.floor(math.log10(want)) - 1)
    return int(math.ceil(want / scale) * scale)


def suggested_batch_size(rows: int, eval_split: float = DEFAULT_EVAL_SPLIT) -> int:
    """The global batch for ``rows`` rows, ``eval_split`` of them held out: the largest power of two that gives at
    least :data:`MIN_STEPS_PER_EPOCH` steps an epoch over the others, at most :data:`MAX_SUGGESTED_BATCH` (1 for a
    log too small for that). The held-out rows then hold an evaluation batch too (50 steps of ``B`` rows make
    ``2.6 B`` held out at 5%)."""
    train = rows * (1.0 - eval_split)
    fits = train / MIN_STEPS_PER_EPOCH
    if fits < 1:
        return 1
    return min(MAX_SUGGESTED_BATCH, 1 << math.floor(math.log2(fits)))


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


def default_dense_section() -> dict[str, Any]:
    """The suggested ``dense:`` section: TorchRec's ``DLRM_DCN`` (:data:`SUGGESTED_ARCH`) at its default sizes, its
    inputs the data's."""
    arch = DenseArch(kind=SUGGESTED_ARCH).to_dict()
    del arch["num_dense"]  # the data's dense columns
    return arch


def model_skeleton(
    found: ProfiledLog, *, name: str = "my-model", dim: int = 16, collision_rate: float = DEFAULT_COLLISION_RATE
) -> dict[str, Any]:
    """The model.yaml for ``found`` (see the module's docstring), its tables of ``dim`` and sized for
    ``collision_rate``."""
    tables = []
    for c, table in zip(found.sparse, found.tables, strict=True):
        col = found.column(c)
        tables.append({"name": table, "rows": suggested_rows(col.distinct or 1, collision_rate), "dim": dim})
        if col.kind == "list":
            tables[-1]["pooling_factor"] = min(round(col.pooling, 2), MAX_POOLING_FACTOR)
    model = {
        "name": name,
        "batch_size": suggested_batch_size(found.rows),
        "tables": tables,
        "dense": default_dense_section(),
    }
    if found.kind is DataKind.CRITEO:
        return model | {"data": criteo_schema().to_dict()}
    data: dict[str, Any] = {"label": found.label or NO_LABEL}
    if found.delimiter is not None and found.delimiter != DEFAULT_DELIMITER:
        data["delimiter"] = found.delimiter
    dense: list[Any] = []
    for c in found.dense:
        transform = found.transforms.get(c)
        dense.append({"column": c, **transform.to_dict()} if transform is not None else {"column": c})
    data["dense"] = dense
    data["sparse"] = {}
    given = [s.separator for s in found.schema.sparse] if found.schema is not None else [None] * len(found.sparse)
    for c, table, separator in zip(found.sparse, found.tables, given, strict=True):
        separator = separator if found.schema is not None else found.column(c).separator
        data["sparse"][table] = c if separator is None else {"column": c, "separator": separator}
    return model | {"data": data}
