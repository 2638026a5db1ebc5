"""Parquet and CSV click logs through pyarrow -> :class:`Batch` streams, mapped by a
:class:`~persia_planner.model.specs.DataSchema` (model.yaml's ``data:``).

Parquet files are read a row group at a time (``ParquetFile.iter_batches``, only the schema's columns), CSV files a
byte range at a time (the header's names, every chunk parsed by ``pyarrow.csv``; a row must not hold a newline
inside quotes); both are sharded across trainers and DataLoader workers by :mod:`.shards`.

Values: the label and the dense columns as float32 (a missing dense value is 0), each dense column transformed as the
schema declares (:class:`~persia_planner.model.data_schema.DenseTransform`); a sparse column's ids, strings or
integers, hashed to int64 by :func:`hash_ids`: the same id gives the same int64 on every trainer, run and machine.
A list column (or a string column with a ``separator``) is multi-hot: one bag of all its ids per row; a missing
value is an empty bag. The tables map the hashed ids into their rows (``id mod rows``).
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from persia_planner.errors import SpecError, first_line
from persia_planner.model.data_schema import DataSchema, SparseColumn
from persia_planner.modules.data.batch import Batch
from persia_planner.modules.data.ids import hash_ids
from persia_planner.modules.data.shards import (
    DataPass,
    Failure,
    Shard,
    merged_batches,
    parquet_shards,
    text_chunks,
    text_shards,
)
from persia_planner.modules.data.split import ROW_SALT, combine
from persia_planner.modules.hashing import mix64

__all__ = ["TabularReader"]


@dataclass(frozen=True)
class TabularBlock:
    """Rows of a click log in a pickle-friendly, concatenable layout.

    Attributes:
        labels: ``[n]`` float32.
        dense: ``[n, d]`` float32.
        lengths: Per sparse feature, ``[n]`` int32 ids per row.
        values: Per sparse feature, the rows' ids (int64) one after another.
    """

    labels: np.ndarray
    dense: np.ndarray
    lengths: tuple[np.ndarray, ...]
    values: tuple[np.ndarray, ...]

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def slice(self, start: int, stop: int) -> TabularBlock:
        """Rows ``start:stop``."""
        values = []
        for lengths, vals in zip(self.lengths, self.values, strict=True):
            first = int(lengths[:start].sum())
            values.append(vals[first : first + int(lengths[start:stop].sum())])
        return TabularBlock(
            self.labels[start:stop], self.dense[start:stop], tuple(x[start:stop] for x in self.lengths), tuple(values)
        )

    def take(self, rows: np.ndarray) -> TabularBlock:
        """The rows at the indices ``rows``, in that order."""
        values = []
        for lengths, vals in zip(self.lengths, self.values, strict=True):
            starts = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])[rows]
            picked = lengths[rows].astype(np.int64)
            # Each picked row's ids: its start, repeated over its length, plus 0..length-1.
            within = np.arange(int(picked.sum())) - np.repeat(np.cumsum(picked) - picked, picked)
            values.append(vals[np.repeat(starts, picked) + within])
        return TabularBlock(self.labels[rows], self.dense[rows], tuple(x[rows] for x in self.lengths), tuple(values))

    def row_keys(self) -> np.ndarray:
        """A 64-bit hash of each row's label, dense values and ids (a bag's ids in any order hash alike)."""
        h = np.full(len(self), ROW_SALT, dtype=np.uint64)
        h = combine(h, self.labels.view(np.uint32))
        for column in self.dense.view(np.uint32).T:
            h = combine(h, column)
        for lengths, vals in zip(self.lengths, self.values, strict=True):
            # A bag's ids summed after mixing (uint64 wraps): the ends of its run in the cumulative sum.
            ends = np.concatenate([[0], np.cumsum(mix64(vals.view(np.uint64)), dtype=np.uint64)])
            bounds = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
            h = combine(h, ends[bounds[1:]] - ends[bounds[:-1]] + lengths.astype(np.uint64))
        return h

    @classmethod
    def concat(cls, blocks: Sequence[TabularBlock]) -> TabularBlock:
        """The rows of ``blocks``, in order."""
        if len(blocks) == 1:
            return blocks[0]
        features = range(len(blocks[0].lengths))
        return cls(
            np.concatenate([b.labels for b in blocks]),
            np.concatenate([b.dense for b in blocks]),
            tuple(np.concatenate([b.lengths[f] for b in blocks]) for f in features),
            tuple(np.concatenate([b.values[f] for b in blocks]) for f in features),
        )


class _BadValue(Exception):
    def __init__(self, column: str, problem: str):
        super().__init__(problem)
        self.column = column
        self.problem = problem


def _floats(array: Any) -> np.ndarray:
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_dictionary(array.type):
        array = array.dictionary_decode()
    # A copy: torch wants writable arrays, and pyarrow's may be its read-only buffers.
    return np.array(pc.fill_null(pc.cast(array, pa.float32()), 0.0).to_numpy(zero_copy_only=False), dtype=np.float32)


def _bags(array: Any, column: SparseColumn) -> tuple[np.ndarray, np.ndarray]:
    """``(lengths [n] int32, ids int64)`` of one sparse column: one id per row, or a bag per row (multi-hot)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    n = len(array)
    if column.separator is not None:
        if pa.types.is_dictionary(array.type):
            array = array.dictionary_decode()
        array = pc.split_pattern(array, column.separator)
    if pa.types.is_list(array.type) or pa.types.is_large_list(array.type):
        flat = pc.list_flatten(array)
        parents = pc.list_parent_indices(array).to_numpy(zero_copy_only=False)
        keep = flat.is_valid()
        if column.separator is not None:  # "a||b" holds two ids, not an empty third
            keep = pc.and_(keep, pc.greater(pc.utf8_length(flat), 0))
        keep_np = keep.to_numpy(zero_copy_only=False)
        ids = hash_ids(flat.filter(keep))
        lengths = np.bincount(parents[keep_np], minlength=n).astype(np.int32)
        return lengths, ids
    valid = array.is_valid()
    lengths = valid.to_numpy(zero_copy_only=False).astype(np.int32)
    return lengths, hash_ids(array.filter(valid))


def to_block(table: Any, schema: DataSchema) -> TabularBlock:
    """A pyarrow RecordBatch or Table holding the schema's columns as a :class:`TabularBlock`.

    Raises:
        _BadValue: A missing label, or one other than 0 and 1 (a schema without a label reads NaN labels).
    """
    import pyarrow as pa

    def column(name: str) -> Any:
        col = table.column(name)
        return col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col

    if schema.label is None:  # rows to score
        labels = np.full(table.num_rows, np.nan, dtype=np.float32)
    else:
        label = column(schema.label)
        if label.null_count:
            raise _BadValue(schema.label, "a missing label")
        labels = _floats(label)
        bad = labels[(labels != 0) & (labels != 1)]
        if bad.size:
            raise _BadValue(schema.label, f"label {bad[0]:g}: labels are 0 or 1")
    # No dense column: one constant 0, which the dense arch reads as a sparse-only model's input.
    dense = np.zeros((len(labels), schema.num_inputs), dtype=np.float32)
    for j, name in enumerate(schema.dense):
        values = _floats(column(name))
        transform = schema.transforms.get(name)
        dense[:, j] = values if transform is None else transform.apply(values)
    bags = [_bags(column(s.column), s) for s in schema.sparse]
    return TabularBlock(labels, dense, tuple(b[0] for b in bags), tuple(b[1] for b in bags))


def to_batch(block: TabularBlock, keys: Sequence[str]) -> Batch:
    """A block as a :class:`Batch` whose KJT has one key per table (key-major, as every KJT)."""
    sparse = KeyedJaggedTensor(
        keys=list(keys),
        values=torch.from_numpy(np.concatenate(block.values) if block.values else np.zeros(0, np.int64)),
        lengths=torch.from_numpy(np.concatenate(block.lengths) if block.lengths else np.zeros(0, np.int32)),
    )
    return Batch(dense=torch.from_numpy(block.dense), sparse=sparse, labels=torch.from_numpy(block.labels))


@dataclass(frozen=True)
class _ReadParquet:
    schema: DataSchema
    batch_rows: int

    def __call__(self, shard: Shard) -> Iterator[TabularBlock | Failure]:
        import pyarrow.parquet as pq

        try:
            f = pq.ParquetFile(shard.path)
            for rows in f.iter_batches(
                batch_size=self.batch_rows, row_groups=[shard.row_group or 0], columns=list(self.schema.columns)
            ):
                yield to_block(rows, self.schema)
        except _BadValue as err:
            yield Failure(f"{shard.path} (row group {shard.row_group})", err.column, err.problem)
        except (OSError, ValueError, TypeError) as err:  # pyarrow's errors subclass these
            yield Failure(f"{shard.path} (row group {shard.row_group})", "", first_line(err))


@dataclass(frozen=True)
class _ReadCsv:
    schema: DataSchema
    chunk_bytes: int

    def __call__(self, shard: Shard) -> Iterator[TabularBlock | Failure]:
        import pyarrow as pa
        import pyarrow.csv as pcsv

        with pcsv.open_csv(shard.path) as head:  # the header's names (every chunk after it has none)
            names = head.schema.names
        # Ids as strings whatever they look like: a chunk of "123"s and one with "abc" read alike.
        types = {s.column: pa.string() for s in self.schema.sparse}
        label = () if self.schema.label is None else (self.schema.label,)
        types |= {c: pa.float32() for c in (*label, *self.schema.dense)}
        convert = pcsv.ConvertOptions(
            column_types=types, include_columns=list(self.schema.columns), strings_can_be_null=True
        )
        for offset, lines in text_chunks(shard, self.chunk_bytes, header=True):
            try:
                table = pcsv.read_csv(
                    io.BytesIO(lines), read_options=pcsv.ReadOptions(column_names=names), convert_options=convert
                )
                yield to_block(table, self.schema)
            except _BadValue as err:
                yield Failure(f"{shard.path} (bytes from {offset})", err.column, err.problem)
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

    Raises:
        SpecError: On construction for a missing file or a bad argument; during iteration for a bad value (the
            message names the file, the row group or byte offset, and the column).
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
        self.paths = tuple(path_list)
        self.schema = schema
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.drop_last = drop_last
        if fmt == "parquet":
            shards = parquet_shards(path_list)
            read: Any = _ReadParquet(schema, batch_size)
        else:
            shards = text_shards(path_list, world * max(num_workers, 1))
            read = _ReadCsv(schema, chunk_bytes)
        self._dataset = (reading or DataPass()).stream(shards, read, batch_size, rank, world)
        self.shards = self._dataset.shards

    @property
    def feature_names(self) -> tuple[str, ...]:
        """KJT keys of the batches: the tables the schema's features feed."""
        return self.schema.tables

    def __iter__(self) -> Iterator[Batch]:
        keys = self.schema.tables
        return merged_batches(
            self._dataset, self.num_workers, lambda block: to_batch(block, keys), drop_last=self.drop_last
        )
