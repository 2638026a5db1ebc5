"""Criteo-format reader: tab-separated ``label, I1..I13, C1..C26`` text (plain or gzip) -> :class:`Batch` streams.

Format (the Criteo Kaggle / Terabyte click logs): one sample per line, 40 tab-separated columns: the click label
(``0``/``1``), 13 integer count features and 26 categorical features given as hexadecimal hashes (8 hex digits in the
real data; up to 16 are accepted so that 63-bit synthetic ids round-trip). Any feature may be empty (missing).

Transforms (the standard DLRM preprocessing):

* integer feature ``x`` -> ``log(1 + max(x, 0))`` as float32; a missing integer is 0 (so it reads as ``log 1 = 0``).
  Negative counts (the real data has a few ``-1``/``-2`` in I2) are clamped to 0 before the log.
* categorical hex -> int64 id ``int(x, 16)`` (16-digit values with the top bit set keep their uint64 bit pattern);
  a missing categorical is an empty bag (KJT length 0) for that feature, not a sentinel id that would collide with
  a real one. ``hash_buckets`` optionally maps ids ``id mod buckets`` (unsigned) per feature.

Parsing is vectorised per chunk of lines (a few MiB): the chunk becomes one ``uint8`` numpy array, tab/newline
positions give every field's byte span, fields are gathered right-aligned into a character matrix and converted
with digit arithmetic. Validation (column count, digits, hex digits, widths) falls out of the same arrays, and only
the error path does per-line Python work (to name the line).

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
from pathlib import Path
from typing import IO

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from persia_planner.errors import SpecError

from ..config import FEATURE_NAMES

__all__ = [
    "CATEGORICAL_COLUMNS",
    "FEATURE_NAMES",
    "INTEGER_COLUMNS",
    "Batch",
    "CriteoReader",
    "write_criteo",
]

NUM_INTEGER = 13
NUM_CATEGORICAL = len(FEATURE_NAMES)  # c1..c26: the KJT keys of the categorical columns
NUM_COLUMNS = 1 + NUM_INTEGER + NUM_CATEGORICAL
INTEGER_COLUMNS = tuple(f"I{i}" for i in range(1, NUM_INTEGER + 1))
CATEGORICAL_COLUMNS = tuple(f"C{i}" for i in range(1, NUM_CATEGORICAL + 1))
_COLUMN_NAMES = ("label", *INTEGER_COLUMNS, *CATEGORICAL_COLUMNS)
_MAX_DECIMAL_DIGITS = 18  # 10**18 - 1 < 2**63: the digit sum cannot overflow int64
_MAX_HEX_DIGITS = 16  # 64 bits


@dataclass(frozen=True, eq=False)
class Batch:
    """One training batch (shared by the Criteo reader and the synthetic generator).

    Attributes:
        dense: ``[B, 13]`` float32 dense features (already transformed, see the module docstring).
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


@dataclass(frozen=True)
class _Block:
    """Parsed rows in a pickle-friendly, concatenable layout (Criteo bags hold at most one id)."""

    labels: np.ndarray  # [n] float32
    dense: np.ndarray  # [n, 13] float32
    ids: np.ndarray  # [n, 26] int64 (0 where missing)
    present: np.ndarray  # [n, 26] bool

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def slice(self, start: int, stop: int) -> _Block:
        return _Block(self.labels[start:stop], self.dense[start:stop], self.ids[start:stop], self.present[start:stop])

    @staticmethod
    def concat(blocks: Sequence[_Block]) -> _Block:
        if len(blocks) == 1:
            return blocks[0]
        return _Block(
            np.concatenate([b.labels for b in blocks]),
            np.concatenate([b.dense for b in blocks]),
            np.concatenate([b.ids for b in blocks]),
            np.concatenate([b.present for b in blocks]),
        )

    def to_batch(self) -> Batch:
        # KJT layout is key-major: all of c1's bags, then c2's, ...; transposing the row-major matrices gives it.
        present_t = np.ascontiguousarray(self.present.T)
        values = np.ascontiguousarray(self.ids.T)[present_t]
        sparse = KeyedJaggedTensor(
            keys=list(FEATURE_NAMES),
            values=torch.from_numpy(values),
            lengths=torch.from_numpy(present_t.reshape(-1).astype(np.int32)),
        )
        return Batch(dense=torch.from_numpy(self.dense), sparse=sparse, labels=torch.from_numpy(self.labels))


@dataclass(frozen=True)
class _Failure:
    """A malformed line, reported by a worker as a value (see the module docstring)."""

    source: str
    column: str
    problem: str


class _BadField(Exception):
    """Raised by the chunk parser: the bad line's byte offset in the chunk, the column, and what is wrong."""

    def __init__(self, offset: int, column: str, problem: str):
        super().__init__(problem)
        self.offset = offset
        self.column = column
        self.problem = problem


@dataclass(frozen=True)
class _Shard:
    path: str
    start: int
    end: int | None  # None: to the end of the file (gzip, or the last range)


def _open(path: str) -> IO[bytes]:
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def _field_text(buf: bytes, start: int, end: int, limit: int = 40) -> str:
    """The bad field for an error message, shortened so that a garbage line still gives a one-line message."""
    text = buf[start : min(end, start + limit + 1)].decode("utf-8", errors="replace")
    return text if len(text) <= limit else text[:limit] + "..."


def _right_aligned(arr: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Characters of every field, right-aligned in a ``[..., width]`` matrix (``'0'`` padding) and the valid mask."""
    width = int((ends - starts).max(initial=0))
    idx = ends[..., None] - width + np.arange(width)
    valid = idx >= starts[..., None]
    chars = np.where(valid, arr[np.maximum(idx, 0)], np.uint8(ord("0")))
    return chars, valid


def _parse_decimal(arr: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Signed decimal integers of the fields; returns (values, bad) with bad marking non-integers (empty is fine)."""
    lens = ends - starts
    nonempty = lens > 0
    neg = nonempty & (arr[np.where(nonempty, starts, 0)] == ord("-"))
    # Cap the gathered width: an overlong field is an error anyway and must not blow up the character matrix.
    chars, valid = _right_aligned(arr, starts, np.minimum(ends, starts + _MAX_DECIMAL_DIGITS + 2))
    lens = np.minimum(lens, _MAX_DECIMAL_DIGITS + 2)
    width = chars.shape[-1]
    if width:
        # The sign is the first valid character; make it a '0' digit and remember the sign.
        sign_col = width - lens
        rows = np.nonzero(neg)
        chars[(*rows, sign_col[neg])] = ord("0")
    digits = chars.astype(np.int64) - ord("0")
    bad_digit = ((digits < 0) | (digits > 9)) & valid
    bad = bad_digit.any(-1) | (lens - neg > _MAX_DECIMAL_DIGITS) | (neg & (lens == 1))
    digits = np.where(bad_digit, 0, digits)
    powers = 10 ** np.arange(width - 1, -1, -1, dtype=np.int64)
    if width > _MAX_DECIMAL_DIGITS:
        powers[: width - _MAX_DECIMAL_DIGITS] = 0  # flagged bad above; avoid the overflowing powers
    values = (digits * powers).sum(-1)
    return np.where(neg, -values, values), bad


_HEX = np.full(256, -1, dtype=np.int64)
_HEX[np.frombuffer(b"0123456789", np.uint8)] = np.arange(10)
_HEX[np.frombuffer(b"abcdef", np.uint8)] = np.arange(10, 16)
_HEX[np.frombuffer(b"ABCDEF", np.uint8)] = np.arange(10, 16)


def _parse_hex(arr: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Hex fields as int64 (uint64 bit pattern); returns (values, bad)."""
    lens = ends - starts
    chars, valid = _right_aligned(arr, starts, np.minimum(ends, starts + _MAX_HEX_DIGITS + 1))  # capped width
    width = chars.shape[-1]
    nibbles = _HEX[chars]
    bad_digit = (nibbles < 0) & valid
    bad = bad_digit.any(-1) | (lens > _MAX_HEX_DIGITS)
    nibbles = np.where(bad_digit | ~valid, 0, nibbles).astype(np.uint64)
    shifts = (4 * np.arange(width - 1, -1, -1)).astype(np.uint64)
    if width > _MAX_HEX_DIGITS:
        shifts[: width - _MAX_HEX_DIGITS] = 0  # flagged bad above
    # Non-overlapping nibbles: the uint64 sum is exact.
    values = (nibbles << shifts).sum(-1, dtype=np.uint64)
    return values.view(np.int64), bad


def _parse_chunk(buf: bytes) -> _Block:
    """Parse whole lines into a block (blank lines are skipped).

    Raises:
        _BadField: for the first malformed line of the chunk.
    """
    if buf and not buf.endswith(b"\n"):
        buf += b"\n"  # the file's last line may lack its newline
    arr = np.frombuffer(buf, dtype=np.uint8)
    newlines = np.flatnonzero(arr == ord("\n"))
    line_starts = np.concatenate([[0], newlines[:-1] + 1]).astype(np.int64)
    line_ends = newlines.astype(np.int64)
    # Tolerate CRLF files: the '\r' is not part of the last field.
    crlf = (line_ends > line_starts) & (arr[np.maximum(line_ends - 1, 0)] == ord("\r"))
    line_ends = line_ends - crlf
    keep = line_ends > line_starts
    line_starts, line_ends = line_starts[keep], line_ends[keep]
    n = line_starts.shape[0]
    tabs = np.flatnonzero(arr == ord("\t"))
    tab_counts = np.searchsorted(tabs, line_ends) - np.searchsorted(tabs, line_starts)
    wrong = np.flatnonzero(tab_counts != NUM_COLUMNS - 1)
    if wrong.size:
        i = int(wrong[0])
        raise _BadField(
            int(line_starts[i]),
            "",
            f"expected {NUM_COLUMNS} tab-separated columns (label, {NUM_INTEGER} integer, {NUM_CATEGORICAL} "
            f"categorical), found {int(tab_counts[i]) + 1}",
        )
    # Every tab of the chunk belongs to a kept line (blank lines have none), 39 per line in order.
    tabs = tabs.reshape(n, NUM_COLUMNS - 1).astype(np.int64)
    starts = np.concatenate([line_starts[:, None], tabs + 1], axis=1)
    ends = np.concatenate([tabs, line_ends[:, None]], axis=1)

    ints, bad_int = _parse_decimal(arr, starts[:, : 1 + NUM_INTEGER], ends[:, : 1 + NUM_INTEGER])
    ids, bad_hex = _parse_hex(arr, starts[:, 1 + NUM_INTEGER :], ends[:, 1 + NUM_INTEGER :])
    labels = ints[:, 0]
    label_empty = starts[:, 0] == ends[:, 0]
    bad_int[:, 0] |= label_empty | ((labels != 0) & (labels != 1))
    bad = np.concatenate([bad_int, bad_hex], axis=1)
    if bad.any():
        i, j = (int(v) for v in np.argwhere(bad)[0])  # row-major: the first bad line, then its first bad column
        text = _field_text(buf, int(starts[i, j]), int(ends[i, j]))
        if j == 0:
            problem = f"label {text!r} is not 0 or 1"
        elif j <= NUM_INTEGER:
            problem = f"{text!r} is not an integer (at most {_MAX_DECIMAL_DIGITS} digits)"
        else:
            problem = f"{text!r} is not hexadecimal (at most {_MAX_HEX_DIGITS} hex digits)"
        raise _BadField(int(line_starts[i]), _COLUMN_NAMES[j], problem)

    dense = np.log1p(np.maximum(ints[:, 1:], 0)).astype(np.float32)  # missing parsed as 0 -> log1p(0) = 0
    present = starts[:, 1 + NUM_INTEGER :] < ends[:, 1 + NUM_INTEGER :]
    ids = np.where(present, ids, 0)
    return _Block(labels.astype(np.float32), dense, ids, present)


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


def _read_shard(shard: _Shard, chunk_bytes: int) -> Iterator[_Block | _Failure]:
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
                block = _parse_chunk(buf)
            except _BadField as err:
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

    def _hash(self, block: _Block) -> _Block:
        if not self.hash_buckets:
            return block
        ids = block.ids.copy()
        for j, buckets in self.hash_buckets.items():
            ids[:, j] = (ids[:, j].view(np.uint64) % np.uint64(buckets)).view(np.int64)
        return _Block(block.labels, block.dense, ids, block.present)

    def __iter__(self) -> Iterator[_Block | _Failure]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        pending: list[_Block] = []
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
                rows = _Block.concat(pending)
                full = len(rows) // self.batch_size * self.batch_size
                for start in range(0, full, self.batch_size):
                    yield rows.slice(start, start + self.batch_size)
                rest = rows.slice(full, len(rows))
                pending, pending_rows = ([rest] if len(rest) else []), len(rest)
        if pending_rows:
            yield _Block.concat(pending)  # this worker's partial batch; the main process merges them


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
        partial: list[_Block] = []
        for item in loader:
            if isinstance(item, _Failure):
                raise SpecError(item.source, item.column, item.problem)
            if len(item) == self.batch_size:
                yield item.to_batch()
            else:
                partial.append(item)
        if not partial:
            return
        rows = _Block.concat(partial)
        for start in range(0, len(rows), self.batch_size):
            block = rows.slice(start, start + self.batch_size)
            if len(block) == self.batch_size or not self.drop_last:
                yield block.to_batch()


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


def write_criteo(
    path: str | os.PathLike[str],
    labels: Sequence[int] | np.ndarray | torch.Tensor,
    ints: Sequence[Sequence[int | None]] | np.ndarray | torch.Tensor,
    cats: Sequence[Sequence[int | None]] | np.ndarray | torch.Tensor,
    *,
    int_missing: np.ndarray | torch.Tensor | None = None,
    cat_missing: np.ndarray | torch.Tensor | None = None,
) -> Path:
    """Write rows as a Criteo-format file (gzip-compressed when ``path`` ends in ``.gz``).

    Args:
        path: Output file.
        labels: ``[n]`` 0/1 labels.
        ints: ``[n, 13]`` integer features; ``None`` entries (in nested lists) are written as missing.
        cats: ``[n, 26]`` categorical ids (int64; written as unsigned hex, at least 8 digits like the real data);
            ``None`` entries are written as missing.
        int_missing: Optional ``[n, 13]`` bool mask of missing integer features.
        cat_missing: Optional ``[n, 26]`` bool mask of missing categorical features.

    Returns:
        The path written.
    """

    def rows_of(values, width: int, missing) -> list[list[int | None]]:
        if isinstance(values, torch.Tensor):
            values = values.numpy()
        rows = [list(r) for r in (values.tolist() if isinstance(values, np.ndarray) else values)]
        if missing is not None:
            mask = missing.numpy() if isinstance(missing, torch.Tensor) else np.asarray(missing)
            rows = [[None if m else v for v, m in zip(r, mr, strict=True)] for r, mr in zip(rows, mask, strict=True)]
        for i, r in enumerate(rows):
            if len(r) != width:
                raise SpecError(str(path), f"row {i}", f"expected {width} values, got {len(r)}")
        return rows

    label_list = labels.tolist() if isinstance(labels, np.ndarray | torch.Tensor) else list(labels)
    int_rows = rows_of(ints, NUM_INTEGER, int_missing)
    cat_rows = rows_of(cats, NUM_CATEGORICAL, cat_missing)
    if not len(label_list) == len(int_rows) == len(cat_rows):
        raise SpecError(str(path), "", "labels, ints and cats differ in length")
    mask64 = (1 << 64) - 1
    lines = []
    for label, ir, cr in zip(label_list, int_rows, cat_rows, strict=True):
        fields = [str(int(label))]
        fields += ["" if v is None else str(int(v)) for v in ir]
        fields += ["" if v is None else f"{int(v) & mask64:08x}" for v in cr]
        lines.append("\t".join(fields))
    data = ("\n".join(lines) + "\n").encode() if lines else b""
    out = Path(path)
    with gzip.open(out, "wb") if out.suffix == ".gz" else open(out, "wb") as f:
        f.write(data)
    return out
