"""The Criteo text format: its columns, whole lines parsed into numpy blocks, and rows written back.

Format (the Criteo Kaggle / Terabyte click logs): one sample per line, 40 tab-separated columns: the click label
(``0``/``1``), 13 integer count features and 26 categorical features given as hexadecimal hashes (8 hex digits in the
real data; up to 16 are accepted so that 63-bit synthetic ids round-trip). Any feature may be empty (missing).

Transforms (the standard DLRM preprocessing):

* integer feature ``x`` -> ``log(1 + max(x, 0))`` as float32; a missing integer is 0 (so it reads as ``log 1 = 0``).
  Negative counts (the real data has a few ``-1``/``-2`` in I2) are clamped to 0 before the log. In model.yaml's
  ``data:`` terms (:func:`criteo_schema`, :data:`INTEGER_TRANSFORM`) that is ``clip: [0, FLOAT32_MAX]`` then
  ``log1p``, without ``standardize`` (the counts' logs already lie within about 0..15).
* categorical hex -> int64 id ``int(x, 16)`` (16-digit values with the top bit set keep their uint64 bit pattern);
  a missing categorical is an empty bag (KJT length 0) for that feature, not a sentinel id that would collide with
  a real one. The reader's ``hash_buckets`` (:class:`.criteo.CriteoReader`) optionally maps ids ``id mod buckets``
  (unsigned) per feature.

Parsing is vectorised per chunk of lines (a few MiB): the chunk becomes one ``uint8`` numpy array, tab/newline
positions give every field's byte span, fields are gathered right-aligned into a character matrix and converted
with digit arithmetic. Validation (column count, digits, hex digits, widths) falls out of the same arrays, and only
the error path does per-line Python work (to name the line).
"""

from __future__ import annotations

import gzip
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from persia_planner.errors import SpecError
from persia_planner.model.data_schema import FLOAT32_MAX, DataSchema, DenseTransform, SparseColumn
from persia_planner.model.dense import DLRM_NUM_DENSE

if TYPE_CHECKING:
    import torch

__all__ = [
    "CATEGORICAL_COLUMNS",
    "FEATURE_NAMES",
    "INTEGER_COLUMNS",
    "INTEGER_TRANSFORM",
    "NUM_CATEGORICAL",
    "NUM_INTEGER",
    "BadField",
    "Block",
    "check_criteo_schema",
    "criteo_schema",
    "parse_chunk",
    "write_criteo",
]

FEATURE_NAMES = tuple(f"c{i}" for i in range(1, 27))
"""The 26 categorical columns C1..C26, as the KeyedJaggedTensor's keys."""
NUM_INTEGER = DLRM_NUM_DENSE
"""The integer columns I1..I13: the dense inputs of the DLRM that model.yaml describes by default."""
NUM_CATEGORICAL = len(FEATURE_NAMES)  # c1..c26: the KJT keys of the categorical columns
NUM_COLUMNS = 1 + NUM_INTEGER + NUM_CATEGORICAL
INTEGER_COLUMNS = tuple(f"I{i}" for i in range(1, NUM_INTEGER + 1))
CATEGORICAL_COLUMNS = tuple(f"C{i}" for i in range(1, NUM_CATEGORICAL + 1))
_COLUMN_NAMES = ("label", *INTEGER_COLUMNS, *CATEGORICAL_COLUMNS)
INTEGER_TRANSFORM = DenseTransform(clip=(0.0, FLOAT32_MAX), log1p=True)
"""What the reader does to each integer column, in ``data:``'s terms: ``log(1 + max(x, 0))``."""
_MAX_DECIMAL_DIGITS = 18  # 10**18 - 1 < 2**63: the digit sum cannot overflow int64
_MAX_HEX_DIGITS = 16  # 64 bits


@dataclass(frozen=True)
class Block:
    """Parsed rows in a pickle-friendly, concatenable layout (Criteo bags hold at most one id)."""

    labels: np.ndarray  # [n] float32
    dense: np.ndarray  # [n, 13] float32
    ids: np.ndarray  # [n, 26] int64 (0 where missing)
    present: np.ndarray  # [n, 26] bool

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def slice(self, start: int, stop: int) -> Block:
        """Rows ``start:stop``."""
        return Block(self.labels[start:stop], self.dense[start:stop], self.ids[start:stop], self.present[start:stop])

    def take(self, rows: np.ndarray) -> Block:
        """The rows at the indices ``rows``, in that order."""
        return Block(self.labels[rows], self.dense[rows], self.ids[rows], self.present[rows])

    def row_keys(self) -> np.ndarray:
        """A 64-bit hash of each row's label, integer columns and categorical ids (a missing id counts as -1)."""
        from persia_planner.modules.data.split import ROW_SALT, combine  # numba: not at the checks' import

        h = np.full(len(self), ROW_SALT, dtype=np.uint64)
        h = combine(h, self.labels.view(np.uint32))
        for column in (*self.dense.view(np.uint32).T, *np.where(self.present, self.ids, -1).T):
            h = combine(h, column)
        return h

    @staticmethod
    def concat(blocks: Sequence[Block]) -> Block:
        """The rows of ``blocks``, in order."""
        if len(blocks) == 1:
            return blocks[0]
        return Block(
            np.concatenate([b.labels for b in blocks]),
            np.concatenate([b.dense for b in blocks]),
            np.concatenate([b.ids for b in blocks]),
            np.concatenate([b.present for b in blocks]),
        )


class BadField(Exception):
    """Raised by :func:`parse_chunk`: the bad line's byte offset in the chunk, the column, and what is wrong."""

    def __init__(self, offset: int, column: str, problem: str):
        super().__init__(problem)
        self.offset = offset
        self.column = column
        self.problem = problem


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


def parse_chunk(buf: bytes) -> Block:
    """Parse whole lines into a block (blank lines are skipped).

    Raises:
        BadField: for the first malformed line of the chunk.
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
        raise BadField(
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
        raise BadField(int(line_starts[i]), _COLUMN_NAMES[j], problem)

    dense = np.log1p(np.maximum(ints[:, 1:], 0)).astype(np.float32)  # missing parsed as 0 -> log1p(0) = 0
    present = starts[:, 1 + NUM_INTEGER :] < ends[:, 1 + NUM_INTEGER :]
    ids = np.where(present, ids, 0)
    return Block(labels.astype(np.float32), dense, ids, present)


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
        if hasattr(values, "numpy"):  # a torch.Tensor, read without importing torch
            values = values.numpy()
        rows = [list(r) for r in (values.tolist() if isinstance(values, np.ndarray) else values)]
        if missing is not None:
            mask = missing.numpy() if hasattr(missing, "numpy") else np.asarray(missing)
            rows = [[None if m else v for v, m in zip(r, mr, strict=True)] for r, mr in zip(rows, mask, strict=True)]
        for i, r in enumerate(rows):
            if len(r) != width:
                raise SpecError(str(path), f"row {i}", f"expected {width} values, got {len(r)}")
        return rows

    label_list = labels.tolist() if hasattr(labels, "tolist") else list(labels)
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


def criteo_schema(source: str = "criteo:") -> DataSchema:
    """The Criteo columns as the reader reads them, in model.yaml's ``data:`` terms: the label, I1..I13 each with
    :data:`INTEGER_TRANSFORM`, and C1..C26 feeding tables c1..c26 (what ``persia data profile criteo:PATH``
    writes)."""
    sparse = tuple(SparseColumn(f, c, f) for f, c in zip(FEATURE_NAMES, CATEGORICAL_COLUMNS, strict=True))
    transforms = dict.fromkeys(INTEGER_COLUMNS, INTEGER_TRANSFORM)
    return DataSchema("label", INTEGER_COLUMNS, sparse, source, transforms)


def check_criteo_schema(schema: DataSchema, data: str) -> None:
    """A model's ``data:`` read with Criteo files (``data``) says what the reader does (:func:`criteo_schema`):
    the reader's columns and transforms are the format's, and a ``data:`` saying otherwise would be silently
    ignored.

    Raises:
        SpecError: The first difference, naming the key.
    """
    expected = criteo_schema()
    problem = ""
    if schema.label != expected.label:
        key, problem = "data.label", f"is {schema.label!r}; a Criteo file's is 'label'"
    elif schema.dense != expected.dense:
        key, problem = "data.dense", "must list I1..I13, in order: the Criteo reader reads all 13"
    elif schema.sparse != expected.sparse:
        key, problem = "data.sparse", "must map c1..c26 to C1..C26 (c1: C1, ...): the Criteo reader's features"
    else:
        key = "data.dense"
        for column in expected.dense:
            given = schema.transforms.get(column, DenseTransform())
            if given != INTEGER_TRANSFORM:
                key = f"data.dense.{column}"
                problem = (
                    f"declares {given.to_dict() or 'no transform'}; the Criteo reader applies log(1 + max(x, 0)) to "
                    "every integer column ({clip: [0, 3.4e38], log1p: true})"
                )
                break
    if problem:
        raise SpecError(
            schema.source,
            key,
            f"{problem} (--data {data})",
            fixes=(
                "write data: as persia data profile criteo:PATH does, or leave it out",
                "for other transforms, write the rows as CSV with a header and train on csv:PATH",
            ),
        )
