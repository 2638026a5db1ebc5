"""Criteo-format reader: tab-separated ``label, I1..I13, C1..C26`` text (plain or gzip) -> :class:`Batch` streams.

The format, its transforms and the vectorised parser of a chunk of lines are :mod:`.criteo_format`'s.

Parallelism and sharding are :mod:`.shards`' (shared with the Parquet / CSV reader): every plain file is cut into a
byte range per DataLoader worker of every trainer, every ``.gz`` file is read whole; trainer ``rank`` reads only its
ranges. Every row is read exactly once; the order depends only on the files, ``shuffle_files``, ``seed``, the
trainers and ``num_workers``.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from persia_planner.errors import SpecError
from persia_planner.modules.data.batch import Batch
from persia_planner.modules.data.criteo_format import FEATURE_NAMES, BadField, Block, parse_chunk
from persia_planner.modules.data.shards import (
    DataPass,
    Failure,
    Shard,
    line_number,
    merged_batches,
    text_chunks,
    text_shards,
)

__all__ = ["FEATURE_NAMES", "Batch", "CriteoReader"]


def _to_batch(block: Block) -> Batch:
    # KJT layout is key-major: all of c1's bags, then c2's, ...; transposing the row-major matrices gives it.
    present_t = np.ascontiguousarray(block.present.T)
    values = np.ascontiguousarray(block.ids.T)[present_t]
    sparse = KeyedJaggedTensor(
        keys=list(FEATURE_NAMES),
        values=torch.from_numpy(values),
        lengths=torch.from_numpy(present_t.reshape(-1).astype(np.int32)),
    )
    return Batch(dense=torch.from_numpy(block.dense), sparse=sparse, labels=torch.from_numpy(block.labels))


@dataclass(frozen=True)
class _ReadCriteo:
    """Reads one shard of a Criteo file as blocks (ids hashed into buckets where asked), or a :class:`Failure`."""

    hash_buckets: Mapping[int, int]
    chunk_bytes: int

    def _hash(self, block: Block) -> Block:
        if not self.hash_buckets:
            return block
        ids = block.ids.copy()
        for j, buckets in self.hash_buckets.items():
            ids[:, j] = (ids[:, j].view(np.uint64) % np.uint64(buckets)).view(np.int64)
        return Block(block.labels, block.dense, ids, block.present)

    def __call__(self, shard: Shard) -> Iterator[Block | Failure]:
        for chunk_offset, buf in text_chunks(shard, self.chunk_bytes):
            try:
                block = parse_chunk(buf)
            except BadField as err:
                line = line_number(shard.path, chunk_offset + err.offset)
                yield Failure(f"{shard.path}:{line}", err.column, err.problem)
                return
            yield self._hash(block)


class CriteoReader:
    """Streams Criteo-format files as :class:`Batch` es, parsed by a DataLoader worker pool.

    Args:
        paths: One or more Criteo-format files (``.gz`` files are read through gzip, one worker per file).
        batch_size: Rows per batch; only the last batch may be smaller (and is dropped with ``drop_last``).
        num_workers: DataLoader worker processes (0 parses in the calling process).
        hash_buckets: Optional bucket count for all categorical features, or per feature name (``"c1".."c26"``);
            ids are mapped ``id mod buckets`` (uint64 arithmetic).
        drop_last: Drop the final partial batch.
        shuffle_files: Visit the files in an order shuffled by ``seed`` (rows within a file keep their order).
        seed: Seed of the file shuffle.
        chunk_bytes: Bytes read and parsed at a time per worker.
        rank: This trainer's rank: it reads only its shards (:func:`.shards.assign`), not every file.
        world: The trainers reading the files together.
        reading: The pass: an epoch's shard order and row shuffle, and a side of the validation split (default:
            every row, in file order).

    Raises:
        SpecError: On construction for a missing file or a bad argument; during iteration for a malformed line
            (the message names ``file:line``, the column and the bad value).
    """

    def __init__(
        self,
        paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
        *,
        batch_size: int,
        num_workers: int = 2,
        hash_buckets: int | Mapping[str, int] | None = None,
        drop_last: bool = False,
        shuffle_files: bool = False,
        seed: int = 0,
        chunk_bytes: int = 1 << 22,
        rank: int = 0,
        world: int = 1,
        reading: DataPass | None = None,
    ):
        path_list = [str(paths)] if isinstance(paths, str | os.PathLike) else [str(p) for p in paths]
        if not path_list:
            raise SpecError("CriteoReader", "paths", "no files given")
        for path in path_list:
            if not os.path.isfile(path):
                raise SpecError(path, "", "file not found", fixes=("pass existing Criteo-format files",))
        if batch_size < 1:
            raise SpecError("CriteoReader", "batch_size", f"must be >= 1, got {batch_size}")
        if num_workers < 0:
            raise SpecError("CriteoReader", "num_workers", f"must be >= 0, got {num_workers}")
        if chunk_bytes < 1:
            raise SpecError("CriteoReader", "chunk_bytes", f"must be >= 1, got {chunk_bytes}")
        if shuffle_files:
            random.Random(seed).shuffle(path_list)
        self.paths = tuple(path_list)
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.drop_last = drop_last
        self.hash_buckets = _bucket_columns(hash_buckets)
        if not 0 <= rank < world:
            raise SpecError("CriteoReader", "rank", f"must be in [0, {world}), got {rank}")
        # Plain files are cut into a range per worker of every trainer: each reads only its own.
        shards = text_shards(path_list, world * max(num_workers, 1))
        self._dataset = (reading or DataPass()).stream(
            shards, _ReadCriteo(self.hash_buckets, chunk_bytes), batch_size, rank, world
        )

    @property
    def feature_names(self) -> tuple[str, ...]:
        """KJT keys of the batches."""
        return FEATURE_NAMES

    def __iter__(self) -> Iterator[Batch]:
        return merged_batches(self._dataset, self.num_workers, _to_batch, drop_last=self.drop_last)


def _bucket_columns(hash_buckets: int | Mapping[str, int] | None) -> dict[int, int]:
    """Feature name -> bucket count, as categorical column index -> bucket count."""
    if hash_buckets is None:
        return {}
    if isinstance(hash_buckets, int):
        hash_buckets = dict.fromkeys(FEATURE_NAMES, hash_buckets)
    out = {}
    for name, buckets in hash_buckets.items():
        if name not in FEATURE_NAMES:
            raise SpecError("CriteoReader", f"hash_buckets.{name}", "unknown feature; expected one of c1..c26")
        if int(buckets) < 1:
            raise SpecError("CriteoReader", f"hash_buckets.{name}", f"must be >= 1, got {buckets}")
        out[FEATURE_NAMES.index(name)] = int(buckets)
    return out
