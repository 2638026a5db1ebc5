"""Where a run's data comes from (``--data``) and the checks of a Parquet / CSV click log against the model's schema,
without importing torch.

``persia train`` runs these checks before any process starts: the files exist, the schema's columns are in them
(read from the Parquet footers and the CSV header, not the data), their types fit, every table of the model is fed
by exactly one sparse feature, and each trainer gets a share of the files. pyarrow is imported only for these two
formats.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from persia_planner.errors import PlannerError, SpecError, first_line
from persia_planner.fields import require_file_or_directory
from persia_planner.model.data_schema import DEFAULT_DELIMITER, DataSchema
from persia_planner.model.specs import ModelSpec

__all__ = [
    "DataKind",
    "DataSource",
    "check_apart",
    "check_file_columns",
    "check_gzip_shards",
    "check_tabular",
    "count_rows",
    "csv_columns",
    "file_columns",
    "fits_dense",
    "fits_sparse",
    "parquet_footer",
    "parquet_row_groups",
]


_T = TypeVar("_T")


class DataKind(enum.StrEnum):
    """The kinds of ``--data``: generated, or files of one format."""

    SYNTHETIC = "synthetic"
    CRITEO = "criteo"
    PARQUET = "parquet"
    CSV = "csv"


_EXAMPLES = "e.g. --data synthetic, criteo:/data/day_0.tsv, parquet:/data/clicks/ or csv:/data/clicks.csv"


@dataclass(frozen=True)
class DataSource:
    """``--data`` parsed: ``synthetic`` or ``KIND:PATH`` (a file, or a directory of files).

    Attributes:
        kind: The format.
        path: The file or directory (None for synthetic data).
    """

    kind: DataKind
    path: Path | None = None

    @classmethod
    def parse(cls, data: str) -> DataSource:
        """``--data``'s value as a source.

        Raises:
            PlannerError: Not ``synthetic`` nor ``KIND:PATH`` with a known kind and a path.
        """
        if data == DataKind.SYNTHETIC.value:
            return cls(DataKind.SYNTHETIC)
        kind, sep, path = data.partition(":")
        if not sep or not path or kind not in {k.value for k in DataKind} or kind == DataKind.SYNTHETIC:
            raise PlannerError(
                f"--data must be 'synthetic', 'criteo:PATH', 'parquet:PATH' or 'csv:PATH', got {data!r}",
                fixes=(_EXAMPLES,),
            )
        return cls(DataKind(kind), Path(path))

    @property
    def tabular(self) -> bool:
        """Parquet or CSV: read through pyarrow, mapped by a :class:`~persia_planner.model.specs.DataSchema`."""
        return self.kind in (DataKind.PARQUET, DataKind.CSV)

    def files(self) -> list[str]:
        """The files read, in order: the file itself, or the directory's files by name (for Parquet and CSV, not
        those starting with ``.`` or ``_``, as Spark's ``_SUCCESS`` and checksum files)."""
        assert self.path is not None
        if not self.path.is_dir():
            return [str(self.path)]
        hidden = (".", "_") if self.tabular else ()
        return sorted(str(p) for p in self.path.iterdir() if p.is_file() and not p.name.startswith(hidden))

    @property
    def identity(self) -> str:
        """As a checkpoint records it: the path resolved, so that another spelling of it is the same data."""
        if self.path is None:
            return self.kind.value
        return f"{self.kind.value}:{self.path.resolve()}"

    def check_files(self) -> list[str]:
        """:meth:`files`, which must exist.

        Raises:
            SpecError: The path does not exist or the directory holds no data file.
        """
        assert self.path is not None
        if not self.path.exists():
            raise SpecError(str(self.path), "", "file or directory not found", fixes=(f"pass --data {self.kind}:PATH",))
        require_file_or_directory(self.path, str(self.path))  # a FIFO would hang the readers
        files = self.files()
        if not files:
            raise SpecError(
                str(self.path), "", "the directory holds no files", fixes=(f"point --data {self.kind}: at its files",)
            )
        return files


def check_apart(data: DataSource, eval_data: DataSource, data_option: str, eval_option: str) -> None:
    """No file of ``eval_data`` (``--eval-data``) is a file of ``data`` (``--data``): the same file under another
    name too (a link, a folder holding the other's file), by device and inode as :func:`os.path.samefile` compares
    them.

    Raises:
        PlannerError: A file in both, named.
    """
    training: dict[tuple[int, int], str] = {}
    for path in data.files():
        with contextlib.suppress(OSError):  # the checks before would have named a file that cannot be read
            st = os.stat(path)
            training[(st.st_dev, st.st_ino)] = path
    for path in eval_data.files():
        try:
            st = os.stat(path)
        except OSError:
            continue
        same = training.get((st.st_dev, st.st_ino))
        if same is not None:
            shown = path if path == same else f"{path} is {same}"
            raise PlannerError(
                f"--eval-data {eval_option} is also in --data {data_option} ({shown}): validating on training rows",
                fixes=(
                    "pass --eval-data files that are not training files",
                    "drop --eval-data: --eval-split holds rows of --data out",
                ),
            )


def count_rows(source: DataSource, files: list[str]) -> int:
    """The data rows of ``files``: from the Parquet footers, else by counting lines (a pass over the bytes, through
    gzip for ``.gz``; a CSV's header is no row).

    Raises:
        SpecError: A file cannot be read.
    """
    if source.kind is DataKind.PARQUET:
        return sum(parquet_footer(path)[1] for path in files)
    header = 1 if source.kind is DataKind.CSV else 0
    return sum(max(0, _lines_of(path) - header) for path in files)


def _once_per_file_version(read: Callable[[str], _T]) -> Callable[[str], _T]:
    """``read(path)``, computed once per version of the file (its size and modification time) in this process: the
    CLI and the launcher both check the data, and the schema checks and the row count both read Parquet footers."""

    @functools.cache
    def cached(path: str, size: int, mtime_ns: int) -> _T:
        return read(path)

    @functools.wraps(read)
    def versioned(path: str) -> _T:
        try:
            st = os.stat(path)
        except OSError as err:
            raise SpecError(path, "", f"cannot read it ({err.strerror or err})") from None
        return cached(path, st.st_size, st.st_mtime_ns)

    return versioned


@_once_per_file_version
def _lines_of(path: str) -> int:
    """Lines of a text file (a last line without its newline counts), plain or gzip."""
    import gzip

    lines, last = 0, b"\n"
    try:
        with gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                lines += chunk.count(b"\n")
                last = chunk[-1:]
    except (OSError, EOFError) as err:
        raise SpecError(path, "", f"cannot read it ({first_line(err)})") from None
    return lines + (last != b"\n")


# ---- Parquet / CSV metadata --------------------------------------------------------------------------------------


def parquet_row_groups(path: str) -> int:
    """The row groups of a Parquet file, from its footer."""
    return parquet_footer(path)[0]


@_once_per_file_version
def parquet_footer(path: str) -> tuple[int, int]:
    """A Parquet file's row groups and rows, from its footer."""
    import pyarrow.parquet as pq

    try:
        metadata = pq.ParquetFile(path).metadata
    except (OSError, ValueError) as err:  # pyarrow's ArrowInvalid is a ValueError
        raise SpecError(path, "", f"not a readable Parquet file ({first_line(err)})") from None
    return int(metadata.num_row_groups), int(metadata.num_rows)


def csv_columns(path: str, *, block_size: int = 1 << 20, delimiter: str = DEFAULT_DELIMITER) -> dict[str, Any]:
    """A CSV file's columns and the pyarrow types inferred from its first block (its header and first rows) of
    ``block_size`` bytes, which must hold the header line; its fields separated by ``delimiter``."""
    import pyarrow.csv as pcsv

    read, parse = pcsv.ReadOptions(block_size=block_size), pcsv.ParseOptions(delimiter=delimiter)
    try:
        with pcsv.open_csv(path, read_options=read, parse_options=parse) as reader:
            fields = list(reader.schema)
    except (OSError, ValueError) as err:
        raise SpecError(path, "", f"not a readable CSV file ({first_line(err)})") from None
    return _named_once(path, fields)


def _named_once(path: str, fields: list[Any]) -> dict[str, Any]:
    """The columns by name, where each name is one column: a name given twice would feed whichever the reader
    takes (pyarrow the first), the other silently unused."""
    columns: dict[str, Any] = {}
    for i, f in enumerate(fields):
        if f.name in columns:
            raise SpecError(
                path,
                "",
                f"the header names column {f.name!r} twice (columns {list(columns).index(f.name) + 1} and {i + 1})",
                fixes=("give each column its own name",),
            )
        columns[f.name] = f.type
    return columns


def file_columns(kind: DataKind, path: str, *, delimiter: str = DEFAULT_DELIMITER) -> dict[str, Any]:
    """A Parquet or CSV file's columns and their pyarrow types (a CSV's inferred from its first block, its fields
    separated by ``delimiter``)."""
    return _parquet_columns(path) if kind is DataKind.PARQUET else csv_columns(path, delimiter=delimiter)


def _parquet_columns(path: str) -> dict[str, Any]:
    import pyarrow.parquet as pq

    try:
        fields = list(pq.read_schema(path))
    except (OSError, ValueError) as err:
        raise SpecError(path, "", f"not a readable Parquet file ({first_line(err)})") from None
    return _named_once(path, fields)


def check_file_columns(kind: DataKind, path: str, schema: DataSchema, *, block_size: int = 1 << 20) -> dict[str, Any]:
    """A Parquet or CSV file's columns (:func:`file_columns`), which must hold the schema's with fitting types, as
    :func:`check_tabular` checks each file.

    Raises:
        SpecError: The file cannot be read, names a column twice, or lacks a column of the schema or its type.
    """
    if kind is DataKind.PARQUET:
        columns = _parquet_columns(path)
    else:
        columns = csv_columns(path, block_size=block_size, delimiter=schema.delimiter)
    _check_columns(path, columns, schema, ids_as_text=kind is not DataKind.PARQUET)
    return columns


def fits_dense(t: Any) -> bool:
    """Whether a column of pyarrow type ``t`` can be the label or a dense column (numbers, as the readers take)."""
    return _is_numeric(t)


def fits_sparse(t: Any) -> bool:
    """Whether a column of pyarrow type ``t`` can feed a table: ids (strings or integers) or lists of them."""
    return _is_id(t) or _is_id_list(t)


def _value_type(t: Any) -> Any:
    import pyarrow as pa

    return t.value_type if pa.types.is_dictionary(t) else t


def _is_numeric(t: Any) -> bool:
    import pyarrow as pa

    t = _value_type(t)
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t) or pa.types.is_null(t)


def _is_id(t: Any) -> bool:
    import pyarrow as pa

    t = _value_type(t)
    return pa.types.is_integer(t) or pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_null(t)


def _is_id_list(t: Any) -> bool:
    import pyarrow as pa

    return (pa.types.is_list(t) or pa.types.is_large_list(t)) and _is_id(t.value_type)


def check_tabular(source: DataSource, schema: DataSchema | None, spec: ModelSpec, trainers: int) -> None:
    """A Parquet / CSV source against the model: one line naming the file, column or field, and the fix.

    Checks that a schema is given, that it feeds every table of ``spec`` exactly once and no other, that every file
    has the schema's columns with fitting types (label and dense numeric; sparse ids strings or integers, or lists of
    them; a ``separator`` on a string column), and that the Parquet row groups are at least ``trainers`` (each trainer
    reads whole row groups). The amount of data is the caller's to check (:func:`count_rows`).

    Raises:
        SpecError: The first problem found.
    """
    if schema is None:
        raise SpecError(
            spec.name,
            "data",
            f"--data {source.kind}: needs the columns' roles (label, dense, sparse)",
            fixes=("add a data: section to model.yaml", "pass --schema FILE (see docs/formats.md)"),
        )
    fed = set(schema.tables)
    missing = [t.name for t in spec.tables if t.name not in fed]
    if missing:
        raise SpecError(
            schema.source,
            "data.sparse",
            f"no feature feeds table {missing[0]!r} of model {spec.name}",
            fixes=(f"add '{missing[0]}: COLUMN' under data.sparse",),
        )
    tables = {t.name for t in spec.tables}
    for s in schema.sparse:
        if s.table not in tables:
            raise SpecError(
                schema.source,
                f"data.sparse.{s.feature}",
                f"feeds table {s.table!r}, which model {spec.name} does not have",
                fixes=("name a table of the model (table: NAME)", "remove the feature"),
            )
    files = source.check_files()
    row_groups = rows = 0
    for path in files:
        if source.kind is DataKind.PARQUET:
            _check_columns(path, _parquet_columns(path), schema)
            groups, held = parquet_footer(path)
            row_groups, rows = row_groups + groups, rows + held
        else:
            _check_columns(path, csv_columns(path, delimiter=schema.delimiter), schema, ids_as_text=True)
    if source.kind is DataKind.CSV:
        check_gzip_shards(source, files, trainers)
    if source.kind is DataKind.PARQUET and rows == 0:
        # Empty part files are common (a Spark partition with no rows); all of them empty is no data at all.
        where = "the Parquet file holds" if len(files) == 1 else f"the {len(files)} Parquet files hold"
        raise SpecError(str(source.path), "", f"{where} no rows", fixes=("point --data at the files with the data",))
    if source.kind is DataKind.PARQUET and row_groups < trainers:
        raise SpecError(
            str(source.path),
            "",
            f"{row_groups} row group(s) in {len(files)} file(s) for {trainers} trainers: "
            "each trainer reads whole row groups",
            fixes=("write smaller row groups (row_group_size) or more files", "train with fewer trainers"),
        )


def check_gzip_shards(source: DataSource, files: list[str], trainers: int) -> None:
    """Text files read whole (all ``.gz``: a gzip stream cannot be split) must be at least one per trainer.

    Raises:
        SpecError: Fewer gzip files than trainers.
    """
    if files and all(f.endswith(".gz") for f in files) and len(files) < trainers:
        raise SpecError(
            str(source.path),
            "",
            f"{len(files)} gzip file(s) for {trainers} trainers: a gzip file cannot be split, each trainer reads "
            "whole ones",
            fixes=("decompress the files", "split them into one per trainer or more"),
        )


def _check_columns(path: str, columns: dict[str, Any], schema: DataSchema, *, ids_as_text: bool = False) -> None:
    """The schema's columns are in the file with fitting types. ``ids_as_text``: a CSV, whose ids the reader reads
    as strings whatever type pyarrow infers from the first block (``0012``, ``1e5``): only their presence counts."""

    def need(column: str, field: str) -> Any:
        if column not in columns:
            if ids_as_text and len(columns) == 1:  # a CSV of another delimiter reads as one column
                raise _other_delimiter(path, schema)
            known = ", ".join(list(columns)[:12])
            raise SpecError(
                path,
                column,
                f"no such column (the schema's {field}); the file has {known}",
                fixes=(f"fix {schema.source}'s data.{field}",),
            )
        return columns[column]

    label = need(schema.label, "label") if schema.label is not None else None
    if label is not None and not _is_numeric(label):
        raise SpecError(
            path, str(schema.label), f"the label column is {label}, not numeric 0/1", fixes=("write 0/1 labels",)
        )
    for column in schema.dense:
        t = need(column, "dense")
        if not _is_numeric(t):
            raise SpecError(
                path, column, f"a dense column is {t}, not numeric", fixes=("move it to data.sparse or cast it",)
            )
    for s in schema.sparse:
        t = need(s.column, f"sparse.{s.feature}")
        if ids_as_text:
            continue
        if s.separator is not None:
            if not _is_id(t) or "string" not in str(_value_type(t)):
                raise SpecError(
                    path, s.column, f"has a separator but the column is {t}, not strings", fixes=("drop separator:",)
                )
        elif not (_is_id(t) or _is_id_list(t)):
            raise SpecError(
                path,
                s.column,
                f"sparse feature {s.feature!r}'s column is {t}: ids must be strings or integers, or lists of them",
                fixes=("map a column of ids",),
            )


def _other_delimiter(path: str, schema: DataSchema) -> SpecError:
    """The error of a CSV file whose header the schema's delimiter reads as one column: its own delimiter named
    where its first lines show one (:func:`.delimiters.sniff_delimiter`)."""
    from persia_planner.modules.data.delimiters import described_delimiter, sniff_delimiter

    shown = described_delimiter(schema.delimiter)
    try:
        found = sniff_delimiter(path)
    except SpecError:
        found = None
    if found is None or found == schema.delimiter:
        return SpecError(
            path,
            "",
            f"its header is one column when split by {shown}",
            fixes=("give a CSV file of the schema's columns",),
        )
    quoted = "\\t" if found == "\t" else found
    return SpecError(
        path,
        "",
        f"its fields are separated by {described_delimiter(found)}, not {shown} (the delimiter of {schema.source})",
        fixes=(f'add delimiter: "{quoted}" to {schema.source}\'s data:',),
    )
