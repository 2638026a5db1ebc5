"""How data files are cut into shards and read by trainers and their DataLoader workers: the machinery every file
reader (Criteo TSV, Parquet, CSV) shares.

A *shard* is a unit of reading: a Parquet row group, a byte range of a plain text file (a range owns the lines that
*start* inside it, so ranges need no coordination), or a whole ``.gz`` file (gzip cannot seek). :func:`assign` gives
trainer ``rank`` of ``world`` the shards ``rank, rank + world, ...`` and splits those among its DataLoader workers
the same way, so every shard is read by exactly one worker of one trainer and nobody parses what it does not keep.

An epoch reads every shard once, in an order drawn from the seed and the epoch (:func:`epoch_order`) before the
shards are dealt, so each epoch gives each trainer other shards. Each worker keeps the rows of its side of the
validation split (:mod:`.split`), shuffles them within a buffer of rows (seeded by the seed, the epoch, the trainer
and the worker) and batches them (:class:`ShardStream`); the trainer's process passes full batches through in the
DataLoader's (deterministic, round-robin) worker order and merges the workers' final partial batches
(:func:`merged_batches`), so every batch but the last has exactly ``batch_size`` rows and the order depends only on
the files, the seed, the epoch, the trainer count and the worker count: a resumed epoch reads what it read before.
Workers hand back plain numpy blocks, and a bad row travels as a :class:`Failure` value, because DataLoader would
re-raise a worker's ``SpecError`` as a multi-line ``RuntimeError``.
"""

from __future__ import annotations

import gzip
import os
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Any, Protocol, Self

import numpy as np
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from persia_planner.errors import SpecError
from persia_planner.modules.data.split import RowSplit

__all__ = [
    "Block",
    "DataPass",
    "Failure",
    "Shard",
    "ShardStream",
    "Shuffle",
    "assign",
    "epoch_order",
    "line_number",
    "merged_batches",
    "open_text",
    "parquet_shards",
    "text_chunks",
    "text_shards",
]


class Block(Protocol):
    """Parsed rows that can be cut and joined (Criteo's and the tabular reader's blocks)."""

    def __len__(self) -> int: ...

    def slice(self, start: int, stop: int) -> Self: ...

    def take(self, rows: np.ndarray) -> Self:
        """The rows at the indices ``rows``, in that order."""
        ...

    def row_keys(self) -> np.ndarray:
        """A 64-bit hash of each row's content (uint64): equal rows, equal keys (the split reads them)."""
        ...

    @classmethod
    def concat(cls, blocks: Sequence[Self]) -> Self: ...


@dataclass(frozen=True)
class Failure:
    """A bad row or file, reported by a worker as a value (see the module docstring)."""

    source: str
    column: str
    problem: str
    fixes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Shard:
    """A unit of reading.

    Attributes:
        path: The file.
        start: Text files: the first byte of the range.
        end: Text files: the end of the range (None: to the end of the file: gzip, or the last range).
        row_group: Parquet files: the row group.
    """

    path: str
    start: int = 0
    end: int | None = None
    row_group: int | None = None


def text_shards(paths: Sequence[str], pieces: int) -> list[Shard]:
    """Every plain text file as ``pieces`` byte ranges, every ``.gz`` file whole, in file order."""
    shards: list[Shard] = []
    for path in paths:
        if path.endswith(".gz"):
            shards.append(Shard(path))
            continue
        size = os.path.getsize(path)
        bounds = [size * k // pieces for k in range(pieces + 1)]
        shards.extend(Shard(path, bounds[k], bounds[k + 1]) for k in range(pieces))
    return shards


def parquet_shards(paths: Sequence[str]) -> list[Shard]:
    """One shard per row group of every Parquet file (read from the footers), in file order."""
    import pyarrow.parquet as pq

    return [Shard(path, row_group=g) for path in paths for g in range(pq.ParquetFile(path).metadata.num_row_groups)]


def epoch_order(shards: Sequence[Shard], seed: int, epoch: int) -> list[Shard]:
    """``shards`` in epoch ``epoch``'s order: a permutation drawn from ``seed`` and ``epoch``, the same on every
    trainer (each then takes its share with :func:`assign`)."""
    order = np.random.default_rng([seed, epoch, 0x5A4D]).permutation(len(shards))
    return [shards[i] for i in order]


def assign(shards: Sequence[Shard], rank: int, world: int, worker: int = 0, workers: int = 1) -> list[Shard]:
    """The shards of worker ``worker`` (of ``workers``) of trainer ``rank`` (of ``world``): round-robin over the
    trainers, then over the trainer's workers. Disjoint, and together they are ``shards``."""
    return list(shards[rank::world][worker::workers])


# ---- text files ----------------------------------------------------------------------------------------------


def open_text(path: str) -> IO[bytes]:
    """A text data file's bytes (through gzip for ``.gz``)."""
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


def text_chunks(shard: Shard, chunk_bytes: int, *, header: bool = False) -> Iterator[tuple[int, bytes]]:
    """The whole lines of ``shard`` as ``(file offset, lines)`` chunks of about ``chunk_bytes``; with ``header``, the
    file's first line is nobody's (a CSV header)."""
    with open_text(shard.path) as f:
        offset = shard.start
        if offset > 0:
            # Own the lines that start at or after ``start``: skip the tail of the line running into it.
            f.seek(offset - 1)
            f.readline()
            offset = f.tell()
        elif header:
            f.readline()
            offset = f.tell()
        if shard.end is not None and offset >= shard.end:
            return
        yield from _line_chunks(f, offset, shard.end, chunk_bytes)


def line_number(path: str, offset: int) -> int:
    """1-based line number of the line starting at byte ``offset`` (error path only: rereads the file's prefix)."""
    count = 0
    with open_text(path) as f:
        remaining = offset
        while remaining > 0:
            data = f.read(min(remaining, 1 << 22))
            if not data:
                break
            count += data.count(b"\n")
            remaining -= len(data)
    return count + 1


# ---- the trainer's stream ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shuffle:
    """How a worker shuffles its rows: within a buffer of ``rows`` rows, with a generator seeded by ``seed`` (the
    run's seed, the epoch and the trainer; the worker adds its own index)."""

    rows: int
    seed: tuple[int, ...]


class ShardStream(IterableDataset):
    """A trainer's shards, split among its DataLoader workers, read into ``batch_size`` blocks.

    Args:
        shards: This trainer's shards (:func:`assign` with its rank; the workers split them further).
        read: Reads one shard as blocks, or a :class:`Failure` (which ends the stream).
        batch_size: Rows per block handed back (a worker's last block may be smaller).
        split: Keep only the rows of this side of the validation split (None: every row).
        shuffle: Shuffle the rows within a buffer (None: in file order).
    """

    def __init__(
        self,
        shards: Sequence[Shard],
        read: Callable[[Shard], Iterator[Any]],
        batch_size: int,
        *,
        split: RowSplit | None = None,
        shuffle: Shuffle | None = None,
    ) -> None:
        super().__init__()
        self.shards = list(shards)
        self.read = read
        self.batch_size = batch_size
        self.split = split
        self.shuffle = shuffle

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        shuffle = self.shuffle
        rng = np.random.default_rng([*shuffle.seed, worker]) if shuffle is not None else None
        # Rows are cut into batches once the buffer holds this many. A shuffle mixes the whole buffer, then keeps half
        # of it to mix with the rows that come next: each shuffle sends out at least half a buffer of rows.
        window = max(self.batch_size, shuffle.rows if shuffle is not None else 0)
        keep = window // 2 if rng is not None else 0
        pending: list[Any] = []
        pending_rows = 0
        for shard in assign(self.shards, 0, 1, worker, workers):
            for item in self.read(shard):
                if isinstance(item, Failure):
                    yield item
                    return
                if self.split is not None:
                    item = item.take(np.flatnonzero(self.split.mask(item.row_keys())))
                pending.append(item)
                pending_rows += len(item)
                if pending_rows < window:
                    continue
                rest = yield from self._batches(type(item).concat(pending), rng, keep)
                pending, pending_rows = ([rest] if len(rest) else []), len(rest)
        if pending:
            rest = yield from self._batches(type(pending[0]).concat(pending), rng, 0)
            # This worker's partial batch, which the main process merges; even without rows, what a block counts
            # (the rows a reader left out) reaches it.
            yield rest

    def _batches(self, rows: Any, rng: np.random.Generator | None, keep: int) -> Generator[Any, None, Any]:
        """Yield ``rows`` (shuffled with ``rng``) as full batches, all but at least ``keep`` of them; return the
        rest."""
        if rng is not None:
            rows = rows.take(rng.permutation(len(rows)))
        full = max(0, len(rows) - keep) // self.batch_size * self.batch_size
        for start in range(0, full, self.batch_size):
            yield rows.slice(start, start + self.batch_size)
        return rows.slice(full, len(rows))


@dataclass(frozen=True)
class DataPass:
    """One pass of a trainer over the files: an epoch (its shard order and shuffle) or a plain read, and which rows.

    Attributes:
        epoch: The epoch: the shards in :func:`epoch_order` and the rows shuffled; None: the shards in file order,
            the rows unshuffled (an evaluation).
        seed: The run's seed.
        shuffle_rows: The rows of each worker's shuffle buffer (0: no shuffle).
        split: Keep only this side of the validation split (None: every row).
    """

    epoch: int | None = None
    seed: int = 0
    shuffle_rows: int = 0
    split: RowSplit | None = None

    def stream(
        self, shards: Sequence[Shard], read: Callable[[Shard], Iterator[Any]], batch_size: int, rank: int, world: int
    ) -> ShardStream:
        """Trainer ``rank`` of ``world``'s stream over ``shards`` (every shard of the files) in this pass."""
        if self.epoch is None:
            return ShardStream(assign(shards, rank, world), read, batch_size, split=self.split)
        mine = assign(epoch_order(shards, self.seed, self.epoch), rank, world)
        shuffle = Shuffle(self.shuffle_rows, (self.seed, self.epoch, rank)) if self.shuffle_rows else None
        return ShardStream(mine, read, batch_size, split=self.split, shuffle=shuffle)


def merged_batches(
    stream: ShardStream,
    num_workers: int,
    to_batch: Callable[[Any], Any],
    *,
    drop_last: bool = False,
    on_block: Callable[[Any], None] | None = None,
) -> Iterator[Any]:
    """``stream`` read by ``num_workers`` DataLoader workers (0: here), as batches of exactly ``batch_size`` rows
    (the last one may be smaller, and is dropped with ``drop_last``); ``on_block`` sees every block as it arrives.

    Raises:
        SpecError: A worker reported a :class:`Failure` (the message names the file, line or row, and column).
    """
    loader = DataLoader(stream, batch_size=None, num_workers=num_workers)
    partial: list[Any] = []
    for item in loader:
        if isinstance(item, Failure):
            raise SpecError(item.source, item.column, item.problem, fixes=item.fixes)
        if on_block is not None:
            on_block(item)
        if len(item) == stream.batch_size:
            yield to_batch(item)
        else:
            partial.append(item)
    if not partial:
        return
    rows = type(partial[0]).concat(partial)
    for start in range(0, len(rows), stream.batch_size):
        block = rows.slice(start, start + stream.batch_size)
        if len(block) == stream.batch_size or not drop_last:
            yield to_batch(block)
