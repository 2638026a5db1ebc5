"""Criteo-format reader: tab-separated ``label, I1..I13, C1..C26`` text (plain or gzip) -> :class:`Batch` streams.

The format, its transforms and the vectorised parser of a chunk of lines are :mod:`.criteo_format`'s.

Parallelism: a ``torch.utils.data.IterableDataset`` under a ``DataLoader(num_workers)``. The work is cut into
shards: every plain file into ``num_workers`` byte ranges (a range owns the lines that *start* inside it, so ranges
need no coordination), every ``.gz`` file whole (gzip cannot seek). Shard ``k`` goes to worker ``k % num_workers``;
each worker batches its own rows; the main process passes full batches through in the DataLoader's (deterministic,
round-robin) worker order and merges the workers' final partial batches, so every batch but the last has exactly
``batch_size`` rows. Every row is read exactly once; the order depends only on the files, ``shuffle_files``,
``seed`` and ``num_workers``.

Workers hand back plain numpy blocks (not KeyedJaggedTensors, which need not pickle cheaply), and a parse failure
travels as a value, because DataLoader would re-raise a worker's ``SpecError`` as a multi-line ``RuntimeError``.
"""

from __future__ import annotations

import gzip
import os
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import IO

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from persia_planner.errors import SpecError

from ..config import FEATURE_NAMES
from .criteo_format import BadField, Block, parse_chunk

__all__ = ["FEATURE_NAMES", "Batch", "CriteoReader"]


@dataclass(frozen=True, eq=False)
class Batch:
    """One training batch (shared by the Criteo reader and the synthetic generator).

    Attributes:
        dense: ``[B, 13]`` float32 dense features (already transformed, see :mod:`.criteo_format`).
        sparse: KeyedJaggedTensor of int64 ids; keys are the feature names (``"c1".."c26"`` for Criteo), one bag
            per (feature, sample), key-major like all KJTs.
        labels: ``[B]`` float32 click labels (0/1).
        teacher_prob: ``[B]`` float32 true click probability for synthetic data (``None`` for real data).
    """

    dense: torch.Tensor
    sparse: KeyedJaggedTensor
    labels: torch.Tensor
    teacher_prob: torch.Tensor | None = None

    @property
    def size(self) -> int:
        """Number of samples in the batch."""
        return int(self.labels.shape[0])


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
class _Failure:
    """A malformed line, reported by a worker as a value (see the module docstring)."""

    source: str
    column: str
    problem: str


@dataclass(frozen=True)
class _Shard:
    path: str
    start: int
    end: int | None  # None: to the end of the file (gzip, or the last range)


def _open(path: str) -> IO[bytes]:
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def _line_chunks(f: IO[bytes], offset: int, end: int | None, chunk_bytes: int) -> Iterator[tuple[int, bytes]]:
    """Yield ``(stream offset, whole lines)`` from ``offset`` (a line start) for the lines starting before ``end``."""
    carry = b""
    carry_offset = offset
    pos = offset  # stream position of the next read
    while True:
        want = chunk_bytes if end is None else min(chunk_bytes, end - pos)
        if want <= 0:
            if carry:  # the last owned line crosses ``end``: finish it
                yield carry_offset, carry + f.readline()
            return
        data = f.read(want)
        if not data:
            if carry:
                yield carry_offset, carry
            return
        pos += len(data)
        buf = carry + data
        cut = buf.rfind(b"\n") + 1
        if cut:
            yield carry_offset, buf[:cut]
        carry, carry_offset = buf[cut:], carry_offset + cut


def _line_number(path: str, offset: int) -> int:
    """1-based line number of the line starting at byte ``offset`` (error path only: rereads the file's prefix)."""
    count = 0
    with _open(path) as f:
        remaining = offset
        while remaining > 0:
            data = f.read(min(remaining, 1 << 22))
            if not data:
                break
            count += data.count(b"\n")
            remaining -= len(data)
    return count + 1


def _read_shard(shard: _Shard, chunk_bytes: int) -> Iterator[Block | _Failure]:
    with _open(shard.path) as f:
        offset = shard.start
        if offset > 0:
            # Own the lines that start at or after ``start``: skip the tail of the line running into it.
            f.seek(offset - 1)
            f.readline()
            offset = f.tell()
        if shard.end is not None and offset >= shard.end:
            return
        for chunk_offset, buf in _line_chunks(f, offset, shard.end, chunk_bytes):
            try:
                block = parse_chunk(buf)
            except BadField as err:
                line = _line_number(shard.path, chunk_offset + err.offset)
                yield _Failure(f"{shard.path}:{line}", err.column, err.problem)
                return
            yield block


class _CriteoShards(IterableDataset):
    """The per-worker half of :class:`CriteoReader`: reads this worker's shards into ``batch_size`` blocks."""

    def __init__(
        self,
        paths: Sequence[str],
        batch_size: int,
        num_workers: int,
        hash_buckets: Mapping[int, int],
        chunk_bytes: int,
    ):
        super().__init__()
        self.batch_size = batch_size
        self.num_workers = max(num_workers, 1)
        self.hash_buckets = dict(hash_buckets)
        self.chunk_bytes = chunk_bytes
        shards: list[_Shard] = []
        for path in paths:
            if path.endswith(".gz"):
                shards.append(_Shard(path, 0, None))
                continue
            size = os.path.getsize(path)
            bounds = [size * k // self.num_workers for k in range(self.num_workers + 1)]
            shards.extend(_Shard(path, bounds[k], bounds[k + 1]) for k in range(self.num_workers))
        self.shards = shards

    def _hash(self, block: Block) -> Block:
        if not self.hash_buckets:
            return block
        ids = block.ids.copy()
        for j, buckets in self.hash_buckets.items():
            ids[:, j] = (ids[:, j].view(np.uint64) % np.uint64(buckets)).view(np.int64)
        return Block(block.labels, block.dense, ids, block.present)

    def __iter__(self) -> Iterator[Block | _Failure]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        pending: list[Block] = []
        pending_rows = 0
        for shard in self.shards[worker::workers]:
            for item in _read_shard(shard, self.chunk_bytes):
                if isinstance(item, _Failure):
                    yield item
                    return
                pending.append(self._hash(item))
                pending_rows += len(item)
                if pending_rows < self.batch_size:
                    continue
                rows = Block.concat(pending)
                full = len(rows) // self.batch_size * self.batch_size
                for start in range(0, full, self.batch_size):
                    yield rows.slice(start, start + self.batch_size)
                rest = rows.slice(full, len(rows))
                pending, pending_rows = ([rest] if len(rest) else []), len(rest)
        if pending_rows:
            yield Block.concat(pending)  # this worker's partial batch; the main process merges them


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
        self._dataset = _CriteoShards(path_list, batch_size, num_workers, self.hash_buckets, chunk_bytes)

    @property
    def feature_names(self) -> tuple[str, ...]:
        """KJT keys of the batches."""
        return FEATURE_NAMES

    def __iter__(self) -> Iterator[Batch]:
        loader = DataLoader(self._dataset, batch_size=None, num_workers=self.num_workers)
        partial: list[Block] = []
        for item in loader:
            if isinstance(item, _Failure):
                raise SpecError(item.source, item.column, item.problem)
            if len(item) == self.batch_size:
                yield _to_batch(item)
            else:
                partial.append(item)
        if not partial:
            return
        rows = Block.concat(partial)
        for start in range(0, len(rows), self.batch_size):
            block = rows.slice(start, start + self.batch_size)
            if len(block) == self.batch_size or not self.drop_last:
                yield _to_batch(block)


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
