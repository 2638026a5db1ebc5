"""A click log as ``persia data profile`` reads it: every file checked as the training readers check it, then read a
block at a time as pyarrow tables; a file that cannot be read is one error naming it and the fix.

The checks are the readers' (:mod:`.source`: the files exist, a Parquet footer and a CSV header read, each column
named once, a schema's columns present with fitting types; :func:`.criteo_format.parse_chunk`: every Criteo line
well formed), with the bounds a profile needs before any work: at most :data:`MAX_COLUMNS` columns, lines of at
most :data:`MAX_LINE_BYTES`, text that is text (a Parquet or binary file under ``csv:`` is named as what it is),
and the files of a folder holding one log (the same columns).

Torch-free: pyarrow reads Parquet a batch of a row group at a time, CSV and Criteo TSV a block at a time (every
value as text, as the readers take a CSV's ids).
"""

from __future__ import annotations

import csv
import gzip
import io
import os
from collections.abc import Iterator
from typing import IO, Any

from persia_planner.errors import SpecError, abbreviate, clip, first_line
from persia_planner.model.data_schema import DataSchema
from persia_planner.modules.data.criteo_format import CATEGORICAL_COLUMNS, INTEGER_COLUMNS, BadField, parse_chunk
from persia_planner.modules.data.delimiters import sniff_delimiter
from persia_planner.modules.data.source import (
    DataKind,
    DataSource,
    check_file_columns,
    csv_columns,
    file_columns,
)

__all__ = ["MAX_COLUMNS", "MAX_LINE_BYTES", "log_blocks", "log_delimiter"]

MAX_COLUMNS = 10_000
"""The most columns a profiled file may have. A profile suggests a table or a dense input per column, and a model of
more than about ten thousand tables is no model TorchRec or the planner would place (production models have hundreds
to a few thousand); wider files are refused from their header, in well under a second, rather than profiled for
minutes into a model that cannot be planned."""
MAX_LINE_BYTES = 16 << 20
"""The longest line (a CSV row, or its header) read: the text read at a time. A longer one is no click log's row
(often a quote left open, which joins the lines after it into one)."""
_PARQUET_BATCH_ROWS = 1 << 16
_CRITEO_CHUNK_BYTES = 1 << 22
_SNIFF_BYTES = 1 << 16
_DETAIL_CHARS = 120
"""Of pyarrow's message, the most shown: it may quote a row of binary garbage."""


def log_blocks(source: DataSource, schema: DataSchema | None = None, *, delimiter: str = ",") -> Iterator[Any]:
    """``source``'s rows as pyarrow tables, a block each, every file checked before it is read; a CSV's fields
    separated by ``delimiter`` (a schema's own is read with :func:`log_delimiter`'s instead).

    Raises:
        SpecError: A missing path, a folder without files, or a file that is not of ``source``'s kind, cannot be
            read, has too many columns or too long a line, names a column twice, lacks a column of ``schema`` (or of
            the folder's first file), or holds a malformed Criteo line: the message names the file and the fix.
    """
    files = _files(source)
    first: tuple[str, frozenset[str]] | None = None
    for path in files:
        if source.kind is DataKind.CRITEO:
            yield from _criteo_blocks(source, path)
            continue
        names = _columns(source, path, schema, delimiter)
        if schema is None:  # the folder's files are one log: the same columns
            first = first or (path, frozenset(names))
            _same_columns(source, path, names, first)
        if source.kind is DataKind.PARQUET:
            yield from _parquet_blocks(source, path)
        else:
            yield from _csv_blocks(source, path, names, delimiter)


def log_delimiter(source: DataSource) -> str:
    """The delimiter of a CSV log, found from the first lines of its first file
    (:func:`.delimiters.sniff_delimiter`), after that file is checked as :func:`log_blocks` checks it.

    Raises:
        SpecError: A missing path or file, one of another kind, or lines no delimiter splits into columns.
    """
    path = _files(source)[0]
    _refuse_other_kinds(source, path)
    return sniff_delimiter(path)


def _files(source: DataSource) -> list[str]:
    try:
        return source.check_files()
    except SpecError as err:  # its fix names --data: here the path is the command's argument
        fix = f"name a {source.kind} file, or a folder of them: persia data profile {source.kind}:PATH"
        raise SpecError(err.source, err.path, err.problem, fixes=(fix,)) from None


def _columns(source: DataSource, path: str, schema: DataSchema | None, delimiter: str) -> list[str]:
    """The file's columns, read and checked by the readers' checks, after the profile's own bounds."""
    _refuse_other_kinds(source, path)
    if source.kind is DataKind.CSV:
        counted = _header_columns(_first_line(source, path), delimiter)
        if counted > MAX_COLUMNS:
            raise _too_wide(path, counted)
    try:
        if schema is not None:
            columns = check_file_columns(source.kind, path, schema, block_size=MAX_LINE_BYTES)
        elif source.kind is DataKind.CSV:
            columns = csv_columns(path, block_size=MAX_LINE_BYTES, delimiter=delimiter)
        else:
            columns = file_columns(source.kind, path)
    except SpecError as err:
        if err.fixes:
            raise
        raise _unreadable(source, path, err, err.problem) from None
    except _pyarrow_errors() as err:  # what the checks let through: an encoding pyarrow does not implement
        raise _unreadable(source, path, err) from None
    if len(columns) > MAX_COLUMNS:
        raise _too_wide(path, len(columns))
    if not columns:
        raise SpecError(path, "", "the file has no columns", fixes=_fixes(source, path))
    return list(columns)


def _same_columns(source: DataSource, path: str, names: list[str], first: tuple[str, frozenset[str]]) -> None:
    first_path, first_names = first
    lacks = sorted(first_names.difference(names))
    extra = [n for n in names if n not in first_names]
    if not lacks and not extra:
        return
    problem = f"lacks column {abbreviate(lacks[0], 60)}" if lacks else f"has column {abbreviate(extra[0], 60)}"
    raise SpecError(
        path,
        "",
        f"{problem}, unlike {os.path.basename(first_path)}: the files of {source.path} are not one log",
        fixes=(f"move the files of other logs out of {source.path}", "profile each log on its own"),
    )


def _parquet_blocks(source: DataSource, path: str) -> Iterator[Any]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    group = 0
    try:
        f = pq.ParquetFile(path)
        for group in range(f.metadata.num_row_groups):
            for batch in f.iter_batches(batch_size=_PARQUET_BATCH_ROWS, row_groups=[group]):
                yield pa.Table.from_batches([batch])
    except _pyarrow_errors() as err:  # corrupt pages, an encoding or a nesting pyarrow cannot read
        raise SpecError(
            path, f"row group {group}", f"cannot be read ({_detail(err)})", fixes=_fixes(source, path)
        ) from None


def _csv_blocks(source: DataSource, path: str, names: list[str], delimiter: str) -> Iterator[Any]:
    import pyarrow as pa
    import pyarrow.csv as pcsv

    read = pcsv.ReadOptions(column_names=names, skip_rows=1, block_size=MAX_LINE_BYTES)
    parse = pcsv.ParseOptions(delimiter=delimiter)
    convert = pcsv.ConvertOptions(column_types=dict.fromkeys(names, pa.string()), strings_can_be_null=True)
    try:
        with pcsv.open_csv(path, read_options=read, parse_options=parse, convert_options=convert) as reader:
            for batch in reader:
                yield pa.Table.from_batches([batch])
    except _pyarrow_errors() as err:  # a row of other columns, bytes not UTF-8, a line too long
        raise _unreadable(source, path, err) from None


def _criteo_blocks(source: DataSource, path: str) -> Iterator[Any]:
    """A Criteo file, each chunk of lines checked by the reader's parser (naming the line) and read as text."""
    import pyarrow as pa
    import pyarrow.csv as pcsv

    _refuse_other_kinds(source, path)
    names = ["label", *INTEGER_COLUMNS, *CATEGORICAL_COLUMNS]
    parse = pcsv.ParseOptions(delimiter="\t", quote_char=False)
    convert = pcsv.ConvertOptions(column_types=dict.fromkeys(names, pa.string()), strings_can_be_null=True)
    line = 1
    with _open(source, path) as f:
        for lines in _line_chunks(source, path, f):
            try:
                parse_chunk(lines)
            except BadField as err:
                at = line + lines.count(b"\n", 0, err.offset)
                fixes = (*_fixes(source, path), "profile a CSV file as csv:PATH")
                raise SpecError(f"{path}:{at}", err.column, err.problem, fixes=fixes) from None
            line += lines.count(b"\n")
            read = pcsv.ReadOptions(column_names=names, block_size=len(lines) + 1)
            try:
                yield pcsv.read_csv(io.BytesIO(lines), read_options=read, parse_options=parse, convert_options=convert)
            except _pyarrow_errors() as err:  # the parser has checked the lines: not expected, but named
                raise _unreadable(source, path, err) from None


def _line_chunks(source: DataSource, path: str, f: IO[bytes]) -> Iterator[bytes]:
    """The file's whole lines, about :data:`_CRITEO_CHUNK_BYTES` at a time."""
    carry = b""
    while data := _read(source, path, f, _CRITEO_CHUNK_BYTES):
        buf = carry + data
        cut = buf.rfind(b"\n") + 1
        if cut:
            yield buf[:cut]
        carry = buf[cut:]
        if len(carry) > MAX_LINE_BYTES:
            raise _too_long(path)
    if carry:
        yield carry


# ---- what a file is, and the errors that say it --------------------------------------------------------------------


def _open(source: DataSource, path: str, *, raw: bool = False) -> IO[bytes]:
    """The file's bytes: through gzip for ``.gz`` (what the readers read), or as stored with ``raw``."""
    try:
        return gzip.open(path, "rb") if path.endswith(".gz") and not raw else open(path, "rb")
    except OSError as err:
        raise SpecError(path, "", f"cannot read it ({err.strerror or err})", fixes=_fixes(source, path)) from None


def _read(source: DataSource, path: str, f: IO[bytes], size: int) -> bytes:
    try:
        return f.read(size)
    except (OSError, EOFError) as err:  # gzip's BadGzipFile is an OSError
        raise SpecError(path, "", f"cannot read it ({first_line(err)})", fixes=_fixes(source, path)) from None


def _refuse_other_kinds(source: DataSource, path: str) -> None:
    """Refuse a file that is plainly not of ``source``'s kind, named as what it is: a Parquet file (its magic bytes)
    or a binary one (a NUL in its first bytes, which text never holds) under ``csv:`` or ``criteo:``, and text under
    ``parquet:``."""
    with _open(source, path, raw=True) as f:
        start = _read(source, path, f, _SNIFF_BYTES)
    if source.kind is DataKind.PARQUET:
        if start.startswith(b"PAR1") or not start or b"\0" in start:
            return  # a Parquet file, or what its reader names (an empty file, a binary one)
        raise SpecError(path, "", "not a Parquet file: it is text", fixes=_fixes(source, path, "text"))
    kind = "CSV" if source.kind is DataKind.CSV else "Criteo TSV"
    if start.startswith(b"PAR1"):
        raise SpecError(path, "", f"not {kind} text: it is a Parquet file", fixes=_fixes(source, path, "Parquet"))
    if path.endswith(".gz"):
        with _open(source, path) as f:
            start = _read(source, path, f, _SNIFF_BYTES)
    if b"\0" in start:
        raise SpecError(path, "", f"not {kind} text: it holds binary data (NUL bytes)", fixes=_fixes(source, path))


def _first_line(source: DataSource, path: str) -> bytes:
    """The file's first line (a CSV's header), read to at most :data:`MAX_LINE_BYTES`."""
    with _open(source, path) as f:
        try:
            line = f.readline(MAX_LINE_BYTES + 1)
        except (OSError, EOFError) as err:
            raise SpecError(path, "", f"cannot read it ({first_line(err)})", fixes=_fixes(source, path)) from None
    if len(line) > MAX_LINE_BYTES:
        raise _too_long(path, "the header line")
    return line


def _header_columns(header: bytes, delimiter: str) -> int:
    """A CSV header's columns, counted before pyarrow reads them (its cost grows faster than their number): its
    delimiters, and where those are too many, the names the csv module splits (a quoted name may hold one)."""
    bound = header.count(delimiter.encode()) + 1
    if bound <= MAX_COLUMNS:
        return bound
    try:
        text = header.decode("utf-8", errors="replace").rstrip("\r\n")
        return len(next(csv.reader([text], delimiter=delimiter), []))
    except csv.Error:  # a stray carriage return, which pyarrow would refuse anyway
        return bound


def _fixes(source: DataSource, path: str, what: str | None = None) -> tuple[str, ...]:
    """How to get past an unreadable file: move it out of the folder, or name its kind."""
    if source.path is not None and source.path.is_dir():
        but = " but those starting with '.' or '_'" if source.tabular else ""
        return (f"move {os.path.basename(path)} out of {source.path}: {source.kind}: reads every file there{but}",)
    if what == "Parquet":
        return (f"profile it as parquet:{path}",)
    if what == "text" and source.kind is DataKind.PARQUET:
        return (f"profile a CSV file as csv:{path}",)
    return {
        DataKind.CSV: ("give a CSV file: a header line of column names, then a row per line",),
        DataKind.PARQUET: ("give a Parquet file (e.g. written by pyarrow or Spark)",),
    }.get(source.kind, ("give Criteo TSV lines: label, 13 integers, 26 hex ids",))


def _pyarrow_errors() -> tuple[type[BaseException], ...]:
    """What pyarrow raises for a file it cannot read (its ArrowInvalid is a ValueError, its IO errors OSErrors)."""
    import pyarrow as pa

    return (OSError, ValueError, pa.ArrowException)


def _detail(err: BaseException) -> str:
    """pyarrow's message, its first line, shortened."""
    return abbreviate(first_line(err), _DETAIL_CHARS).strip("'\"")


def _unreadable(source: DataSource, path: str, err: BaseException, problem: str | None = None) -> SpecError:
    """The error for a file pyarrow could not read (``problem``: as the readers' checks said it), with the fix."""
    message = first_line(err)
    if "straddl" in message:  # pyarrow: a row longer than the block it reads
        return _too_long(path)
    if "UTF8" in message or ("utf-8" in message.lower() and "decode" in message):
        return SpecError(path, "", "holds bytes that are not UTF-8 text", fixes=_fixes(source, path))
    if problem is None:
        kind = {DataKind.CSV: "CSV", DataKind.PARQUET: "Parquet"}.get(source.kind, "Criteo")
        problem = f"not a readable {kind} file ({_detail(err)})"
    return SpecError(path, "", clip(problem, _DETAIL_CHARS + 60), fixes=_fixes(source, path))


def _too_long(path: str, what: str = "a line") -> SpecError:
    return SpecError(
        path,
        "",
        f"{what} is longer than {MAX_LINE_BYTES >> 20} MiB, more than any click log's row",
        fixes=("check the file: a quote left open joins the lines after it into one",),
    )


def _too_wide(path: str, columns: int) -> SpecError:
    return SpecError(
        path,
        "",
        f"{columns:,} columns, more than the {MAX_COLUMNS:,} a profile reads (a table or a dense input each: no "
        "model to plan)",
        fixes=("profile the columns the model will read: write them to a file of their own",),
    )
