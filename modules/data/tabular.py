"""Parquet and CSV click logs through pyarrow -> :class:`Batch` streams, mapped by a
:class:`~persia_planner.model.specs.DataSchema` (model.yaml's ``data:``).

Parquet files are read a row group at a time (``ParquetFile.iter_batches``, only the schema's columns), CSV files a
byte range at a time (the header's names, every chunk parsed by ``pyarrow.csv``; a row must not hold a newline
inside quotes); both are sharded across trainers and DataLoader workers by :mod:`.shards`. Each piece becomes a
block of arrays as :mod:`.blocks` reads the schema's columns (its bad rows named with their file and row here).
The tables map the hashed ids into their rows (``id mod rows``).
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from persia_planner.errors import SpecError, first_line
from persia_planner.model.data_schema import BadRowPolicy, DataSchema
from persia_planner.modules.data.blocks import (
    BadRowCount,
    BadValue,
    TabularBlock,
    bad_row_failure,
    line_of_row,
    to_batch,
    to_block,
)
from persia_planner.modules.data.shards import (
    DataPass,
    Failure,
    Shard,
    line_number,
    merged_batches,
    parquet_shards,
    text_chunks,
    text_shards,
)

if TYPE_CHECKING:  # pragma: no cover
    from persia_planner.modules.data.batch import Batch

__all__ = ["TabularReader"]


@dataclass(frozen=True)
class _ReadParquet:
    schema: DataSchema
    batch_rows: int
    raw: bool = False

    def __call__(self, shard: Shard) -> Iterator[TabularBlock | Failure]:
        import pyarrow.parquet as pq

        group = shard.row_group or 0
        done = 0  # rows of the row group read before the current batch
        try:
            f = pq.ParquetFile(shard.path)
            for rows in f.iter_batches(
                batch_size=self.batch_rows, row_groups=[group], columns=list(self.schema.columns)
            ):
                yield to_block(rows, self.schema, raw=self.raw)
                done += rows.num_rows
        except BadValue as err:
            before = sum(f.metadata.row_group(g).num_rows for g in range(group))  # the error's path only
            yield bad_row_failure("parquet", shard.path, before + done + err.row + 1, err)
        except (OSError, ValueError, TypeError) as err:  # pyarrow's errors subclass these
            yield Failure(f"{shard.path} (row group {group})", "", first_line(err))


_NAN_TEXT = ("NaN", "nan", "-NaN", "-nan")
"""Spellings pyarrow reads as null by default and its float parser as NaN: a dense value or a label so written is
NaN (a bad value, as in Parquet), where an empty cell is missing; an id so written stays missing, as before."""


def _nan_ids_as_null(table: Any, columns: Sequence[str]) -> Any:
    """``table`` with the ids of ``columns`` that are spelled as NaN (:data:`_NAN_TEXT`) null."""
    import pyarrow as pa
    import pyarrow.compute as pc

    spellings = pa.array(_NAN_TEXT)
    for name in columns:
        i = table.schema.get_field_index(name)
        ids = table.column(i)
        nan = pc.is_in(ids, value_set=spellings)
        if pc.any(nan).as_py():
            table = table.set_column(i, name, pc.if_else(nan, pa.scalar(None, pa.string()), ids))
    return table


@dataclass(frozen=True)
class _ReadCsv:
    schema: DataSchema
    chunk_bytes: int
    raw: bool = False

    def __call__(self, shard: Shard) -> Iterator[TabularBlock | Failure]:
        import pyarrow as pa
        import pyarrow.csv as pcsv

        parse = pcsv.ParseOptions(delimiter=self.schema.delimiter)
        with pcsv.open_csv(shard.path, parse_options=parse) as head:  # the header's names (no chunk after it has)
            names = head.schema.names
        # Ids as strings whatever they look like: a chunk of "123"s and one with "abc" read alike.
        types = {s.column: pa.string() for s in self.schema.sparse}
        label = () if self.schema.label is None else (self.schema.label,)
        types |= {c: pa.float32() for c in (*label, *self.schema.dense)}
        nulls = [v for v in pcsv.ConvertOptions().null_values if v not in _NAN_TEXT]
        convert = pcsv.ConvertOptions(
            column_types=types,
            include_columns=list(self.schema.columns),
            strings_can_be_null=True,
            null_values=nulls,
        )
        ids = list(dict.fromkeys(s.column for s in self.schema.sparse))
        for offset, lines in text_chunks(shard, self.chunk_bytes, header=True):
            try:
                table = pcsv.read_csv(
                    io.BytesIO(lines),
                    read_options=pcsv.ReadOptions(column_names=names),
                    parse_options=parse,
                    convert_options=convert,
                )
                if b"nan" in lines or b"NaN" in lines:  # a scan of the bytes, cheaper than one of every id column
                    table = _nan_ids_as_null(table, ids)
                yield to_block(table, self.schema, raw=self.raw)
            except BadValue as err:
                # The chunk's first line is the file's line L, row L - 1 (the header is line 1).
                row = line_number(shard.path, offset) - 1 + line_of_row(lines, err.row)
                yield bad_row_failure("csv", shard.path, row, err)
                return
            except (OSError, ValueError, TypeError) as err:
                yield Failure(f"{shard.path} (bytes from {offset})", "", first_line(err))
                return


class TabularReader:
    """Streams Parquet or CSV click logs as :class:`Batch` es: this trainer's row groups or byte ranges, read by a
    DataLoader worker pool.

    Args:
        paths: Parquet files (``fmt="parquet"``) or CSV files, plain or ``.gz`` (``fmt="csv"``).
        schema: Which columns are the label, the dense and the sparse features.
        fmt: ``"parquet"`` or ``"csv"``.
        batch_size: Rows per batch; only the last batch may be smaller (and is dropped with ``drop_last``).
        num_workers: DataLoader worker processes (0 reads in the calling process).
        rank: This trainer's rank: it reads only its shards (:func:`.shards.assign`).
        world: The trainers reading the files together.
        drop_last: Drop the final partial batch.
        chunk_bytes: CSV: bytes parsed at a time per worker.
        reading: The pass: an epoch's shard order and row shuffle, and a side of the validation split (default:
            every row, in file order).
        raw: Read the values as they are, for the first pass (see :func:`to_block`).
        counts: Add what ``on_bad_row`` did to the rows read here (None: not counted).

    Raises:
        SpecError: On construction for a missing file or a bad argument; during iteration for a bad value (the
            message names the file and the row, or the row group or byte offset, and the column).
        ValueError: ``on_bad_row: impute`` without the first pass's fill of every dense column.
    """

    def __init__(
        self,
        paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
        schema: DataSchema,
        *,
        fmt: str,
        batch_size: int,
        num_workers: int = 0,
        rank: int = 0,
        world: int = 1,
        drop_last: bool = False,
        chunk_bytes: int = 1 << 22,
        reading: DataPass | None = None,
        raw: bool = False,
        counts: BadRowCount | None = None,
    ):
        path_list = [str(paths)] if isinstance(paths, str | os.PathLike) else [str(p) for p in paths]
        if not path_list:
            raise SpecError("TabularReader", "paths", "no files given")
        for path in path_list:
            if not os.path.isfile(path):
                raise SpecError(path, "", "file not found", fixes=(f"pass existing {fmt} files",))
        if fmt not in ("parquet", "csv"):
            raise SpecError("TabularReader", "fmt", f"must be parquet or csv, got {fmt!r}")
        if batch_size < 1 or num_workers < 0 or chunk_bytes < 1:
            raise SpecError("TabularReader", "", "batch_size and chunk_bytes must be >= 1, num_workers >= 0")
        if not 0 <= rank < world:
            raise SpecError("TabularReader", "rank", f"must be in [0, {world}), got {rank}")
        if not raw and schema.on_bad_row is BadRowPolicy.IMPUTE and schema.to_measure:
            raise ValueError("on_bad_row: impute needs the first pass's fill of every dense column (.statistics)")
        self.paths = tuple(path_list)
        self.schema = schema
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.drop_last = drop_last
        self.counts = counts
        if fmt == "parquet":
            shards = parquet_shards(path_list)
            read: Any = _ReadParquet(schema, batch_size, raw)
        else:
            shards = text_shards(path_list, world * max(num_workers, 1))
            read = _ReadCsv(schema, chunk_bytes, raw)
        self._dataset = (reading or DataPass()).stream(shards, read, batch_size, rank, world)
        self.shards = self._dataset.shards

    @property
    def feature_names(self) -> tuple[str, ...]:
        """KJT keys of the batches: the tables the schema's features feed."""
        return self.schema.tables

    def __iter__(self) -> Iterator[Batch]:
        keys = self.schema.tables
        return self._merged(lambda block: to_batch(block, keys))

    def blocks(self) -> Iterator[TabularBlock]:
        """The batches' rows as numpy blocks (no tensor is made: the first pass reads its rows so)."""
        return self._merged(lambda block: block)

    def _merged(self, to_batch: Any) -> Iterator[Any]:
        return merged_batches(
            self._dataset,
            self.num_workers,
            to_batch,
            drop_last=self.drop_last,
            on_block=None if self.counts is None else self.counts.add,
        )
