"""``persia data profile``: what a click log holds, read once and streamed, and the model.yaml it suggests.

Per column its statistics (:class:`.columns.ColumnProfile`: rows, missing values, distinct ids estimated from the ids
hashed as training hashes them, a numeric column's range and quantiles); without a schema its role guessed from them
(:mod:`.roles`: the label, dense counts and measures with their transforms, tables for ids and codes, and the columns
left out with the reason why). A CSV's delimiter is found from its first lines (:mod:`.delimiters`) unless given.
The model.yaml skeleton (:mod:`.skeleton`) is one ``persia train`` reads without edits.

Torch-free: the log is read, and each file checked first, by :func:`.log_blocks.log_blocks`; the cost is linear in
rows and columns (every column looked up by name in a dict, never a scan).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from persia_planner.errors import PlannerError, SpecError, abbreviate, printable
from persia_planner.model.data_schema import DEFAULT_DELIMITER, DataSchema, DenseTransform
from persia_planner.modules.data.columns import SKETCH_LG_K, ColumnProfile
from persia_planner.modules.data.criteo_format import (
    CATEGORICAL_COLUMNS,
    FEATURE_NAMES,
    INTEGER_COLUMNS,
    INTEGER_TRANSFORM,
)
from persia_planner.modules.data.ids import DEFAULT_COLLISION_RATE
from persia_planner.modules.data.log_blocks import log_blocks, log_delimiter
from persia_planner.modules.data.roles import Guess, Role, guess_roles
from persia_planner.modules.data.skeleton import model_skeleton, suggested_rows, table_names
from persia_planner.modules.data.source import DataKind, DataSource

__all__ = [
    "SKETCH_LG_K",
    "ColumnProfile",
    "DataProfile",
    "Guess",
    "Role",
    "profile",
    "suggested_rows",
    "table_names",
]

_NOTE_NAMES = 4
"""Column names a note shows before it counts the rest."""


@dataclass(frozen=True)
class DataProfile:
    """A log's profile: its rows and columns, and the roles of the columns (given by a schema, Criteo's, or guessed).

    Attributes:
        source: The log's path.
        kind: Its format.
        rows: The rows read.
        columns: Each column's statistics, in the file's order.
        guesses: Each column's role and why, in the same order (a schema's or Criteo's roles are no guesses, but
            are given the same way).
        guessed: The roles were guessed (no schema, not Criteo).
        features: Per sparse column, the name its table wants: the schema's table, Criteo's feature, else the column
            (:func:`.skeleton.table_names` makes it a name model.yaml accepts).
        transforms: Each dense column's transforms: the schema's where it declares any (never dropped), the
            format's for Criteo, else the suggested ones (:func:`.roles.dense_transform`).
        delimiter: A CSV's delimiter, as given or found (None for other formats).
        schema: The schema that gave the roles (None: guessed, or Criteo's).
    """

    source: str
    kind: DataKind
    rows: int
    columns: tuple[ColumnProfile, ...]
    guesses: tuple[Guess, ...]
    guessed: bool
    features: tuple[str, ...] = ()
    transforms: Mapping[str, DenseTransform] = field(default_factory=dict)
    delimiter: str | None = None
    schema: DataSchema | None = None

    @cached_property
    def _by_name(self) -> dict[str, ColumnProfile]:
        return {c.name: c for c in self.columns}

    @cached_property
    def _roles(self) -> dict[str, Guess]:
        return {g.column: g for g in self.guesses}

    def _of(self, role: Role) -> tuple[str, ...]:
        return tuple(g.column for g in self.guesses if g.role is role)

    @property
    def label(self) -> str | None:
        """The label column (None: no 0/1 column found)."""
        return next(iter(self._of(Role.LABEL)), None)

    @property
    def dense(self) -> tuple[str, ...]:
        """The dense columns, in the model's order."""
        return self._of(Role.DENSE)

    @property
    def sparse(self) -> tuple[str, ...]:
        """The columns feeding tables, in the model's order."""
        return self._of(Role.SPARSE)

    @property
    def left_out(self) -> tuple[Guess, ...]:
        """The columns the guess left out of the model, with why (a schema's other columns are not counted)."""
        return tuple(g for g in self.guesses if g.role is Role.LEFT_OUT) if self.guessed else ()

    def column(self, name: str) -> ColumnProfile:
        """The column named ``name``."""
        return self._by_name[name]

    def role(self, name: str) -> str:
        """Column ``name``'s role: ``label``, ``dense``, ``sparse``, ``left out``, or ``-`` (none)."""
        guess = self._roles.get(name)
        return "-" if guess is None else guess.role.value

    def why(self, name: str) -> str:
        """Why column ``name`` has its role."""
        guess = self._roles.get(name)
        return "" if guess is None else guess.why

    @cached_property
    def tables(self) -> tuple[str, ...]:
        """The table of each sparse column, named as model.yaml accepts (:func:`.skeleton.table_names`)."""
        return table_names(self.features or self.sparse)

    def model_skeleton(
        self, name: str = "my-model", dim: int = 16, collision_rate: float = DEFAULT_COLLISION_RATE
    ) -> dict[str, Any]:
        """The suggested model.yaml (:func:`.skeleton.model_skeleton`).

        Raises:
            PlannerError: No column is sparse: the model would have no table.
        """
        if not self.sparse:
            raise self._no_sparse_column()
        return model_skeleton(self, name=name, dim=dim, collision_rate=collision_rate)

    @property
    def constant_dense(self) -> tuple[str, ...]:
        """The dense columns of one value in every row profiled (a schema's: a guess leaves them out)."""
        return tuple(c for c in self.dense if (col := self.column(c)).low is not None and col.low == col.high)

    def notes(self) -> list[str]:
        """What the suggested model leaves out or to the user, a line each (printable)."""
        lines = []
        by_reason: dict[str, list[str]] = {}
        for g in self.left_out:
            by_reason.setdefault(g.why, []).append(g.column)
        for why, names in by_reason.items():
            shown = ", ".join(abbreviate(n, 40) for n in names[:_NOTE_NAMES])
            more = f" and {len(names) - _NOTE_NAMES} more" if len(names) > _NOTE_NAMES else ""
            lines.append(f"left out of the model: {shown}{more} ({why})")
        standardized = [c for c in self.constant_dense if self.transforms.get(c, DenseTransform()).standardize]
        if standardized:
            lines.append(
                f"{len(standardized)} dense column(s) of the schema hold one value in every row read, e.g. "
                f"{abbreviate(standardized[0], 40)}: standardize would divide by a std of 0 (persia train refuses it);"
                " drop the column or its standardize"
            )
        if self.label is None and self.sparse:
            lines.append("no 0/1 column to be the label: the model names LABEL_COLUMN; write the label's column there")
        return [printable(line) for line in lines]

    def _no_sparse_column(self) -> PlannerError:
        why = "every column is the label, dense or left out"
        if self.left_out:
            why += f"; {len(self.left_out)} left out (e.g. {abbreviate(self.left_out[0].column, 40)}: "
            why += f"{self.left_out[0].why})"
        return PlannerError(
            f"{self.source}: no column to feed an embedding table ({why}): the model would have no table",
            fixes=("name the id columns: --schema FILE with a data: mapping whose sparse: maps tables to them",),
        )


def profile(
    source: DataSource,
    schema: DataSchema | None = None,
    *,
    max_rows: int | None = None,
    delimiter: str | None = None,
) -> DataProfile:
    """Read ``source`` (every file; at most ``max_rows`` rows) and profile its columns.

    Args:
        source: The log.
        schema: The columns' roles (default: guessed); its transforms are kept.
        max_rows: Read at most this many rows.
        delimiter: A CSV's delimiter (default: the schema's when it names one other than a comma, else found from
            the first lines of the first file).

    Raises:
        SpecError: A file cannot be read (:func:`.log_blocks.log_blocks` names it and the fix), its lines split into
            no columns, a schema column is not in it, or the log holds no row.
        PlannerError: A schema or a delimiter for a Criteo log (its columns are the format's).
    """
    if source.kind is DataKind.CRITEO and (schema is not None or delimiter is not None):
        option = "--schema" if schema is not None else "--delimiter"
        given = "maps the columns" if schema is not None else "separates the fields"
        raise PlannerError(
            f"{option} {given} of a CSV or Parquet log; criteo:{source.path} has the format's own",
            fixes=(f"drop {option}", "profile a CSV or Parquet log as csv:PATH or parquet:PATH"),
        )
    if source.kind is DataKind.CSV:
        if delimiter is None:
            stated = schema is not None and schema.delimiter != DEFAULT_DELIMITER
            delimiter = schema.delimiter if schema is not None and stated else log_delimiter(source)
        if schema is not None:
            schema = replace(schema, delimiter=delimiter)
    columns: dict[str, ColumnProfile] = {}
    rows = 0
    text_ids = source.kind is not DataKind.PARQUET
    for table in log_blocks(source, schema, delimiter=delimiter or DEFAULT_DELIMITER):
        if max_rows is not None and rows >= max_rows:
            break
        if max_rows is not None and rows + table.num_rows > max_rows:
            table = table.slice(0, max_rows - rows)
        rows += table.num_rows
        for name, values in zip(table.column_names, table.columns, strict=True):
            col = columns.get(name)
            if col is None:
                col = columns[name] = ColumnProfile(name)
            col.fold(values, text_ids=text_ids)
    if rows == 0:
        raise SpecError(str(source.path), "", "the log holds no rows", fixes=("profile the files that hold the rows",))
    for col in columns.values():
        col.finish()
    found = tuple(columns.values())
    csv = delimiter if source.kind is DataKind.CSV else None
    if schema is not None:
        guesses, transforms = _schema_roles(schema, found)
        return DataProfile(
            str(source.path), source.kind, rows, found, guesses, False, schema.tables, transforms, csv, schema
        )
    if source.kind is DataKind.CRITEO:  # the format says: the label, 13 counts, 26 categorical columns
        roles = {"label": Role.LABEL} | dict.fromkeys(INTEGER_COLUMNS, Role.DENSE)
        roles |= dict.fromkeys(CATEGORICAL_COLUMNS, Role.SPARSE)
        guesses = tuple(Guess(c.name, roles[c.name], "the Criteo format's") for c in found)
        transforms = dict.fromkeys(INTEGER_COLUMNS, INTEGER_TRANSFORM)
        return DataProfile(str(source.path), source.kind, rows, found, guesses, False, FEATURE_NAMES, transforms)
    guesses = guess_roles(found)
    transforms = {g.column: g.transform for g in guesses if g.role is Role.DENSE}
    return DataProfile(str(source.path), source.kind, rows, found, guesses, True, (), transforms, csv)


def _schema_roles(
    schema: DataSchema, columns: tuple[ColumnProfile, ...]
) -> tuple[tuple[Guess, ...], dict[str, DenseTransform]]:
    """The schema's roles, in its order, and its dense columns' transforms: those it declares, kept, else the
    suggested ones (the guess's, for a column it lists without any)."""
    guessed = {g.column: g for g in guess_roles(columns)}
    by_name = {c.name: c for c in columns}
    guesses = []
    if schema.label is not None:
        guesses.append(Guess(schema.label, Role.LABEL, "the schema's"))
    transforms = {}
    for c in schema.dense:
        guesses.append(Guess(c, Role.DENSE, "the schema's"))
        declared = schema.transforms.get(c)
        if declared is not None:
            transforms[c] = declared
        elif c in guessed and guessed[c].role is Role.DENSE:
            transforms[c] = guessed[c].transform
        elif c in by_name and by_name[c].low is not None and by_name[c].low != by_name[c].high:
            transforms[c] = DenseTransform(standardize=True)
    guesses += [Guess(s.column, Role.SPARSE, "the schema's") for s in schema.sparse]
    listed = set(schema.columns)
    guesses += [Guess(c.name, Role.LEFT_OUT, "not in the schema") for c in columns if c.name not in listed]
    return tuple(guesses), transforms
