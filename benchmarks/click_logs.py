"""Click logs named as ``persia train --data`` names them, their rows, and the splits ``vs_baselines.py`` deals them
into: every model of a split trains on the same training file and is scored on the same validation file.

A CSV or Criteo log is split line by line (the bytes of each row kept as they are: no parser rewrites a value, so
the files persia reads are the user's rows), a Parquet log row by row through pyarrow. A split is a pair of ascending
row-index arrays, disjoint and together every row.
"""

from __future__ import annotations

import enum
import gzip
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from persia_planner.errors import PlannerError

__all__ = [
    "INNER_SHARE",
    "LogKind",
    "LogRows",
    "LogSource",
    "Split",
    "inner_split",
    "random_split",
    "read_rows",
    "time_split",
    "write_rows",
]


INNER_SHARE = 0.1
"""The share of a split's training rows held out to choose the baselines' regularization and epochs and, with
``--tune-hparams``, persia's options."""


class LogKind(enum.StrEnum):
    """The file formats ``persia train --data`` reads."""

    CSV = "csv"
    PARQUET = "parquet"
    CRITEO = "criteo"


@dataclass(frozen=True)
class LogSource:
    """One click log: ``KIND:PATH`` (a file, or a folder of files of that kind).

    Attributes:
        kind: Its format.
        path: The file or folder.
    """

    kind: LogKind
    path: Path

    @classmethod
    def parse(cls, text: str) -> LogSource:
        """``csv:PATH``, ``parquet:PATH``, ``criteo:PATH``, or a bare path: a ``.parquet`` file is Parquet, a
        ``.csv`` / ``.csv.gz`` one CSV, anything else Criteo.

        Raises:
            PlannerError: An unknown kind or a path that does not exist.
        """
        head, sep, tail = text.partition(":")
        if sep and head in {k.value for k in LogKind}:
            kind, path = LogKind(head), Path(tail)
        elif sep and len(head) > 1 and "/" not in head:
            raise PlannerError(
                f"DATA {text!r}: unknown kind {head!r}", fixes=("csv:PATH, parquet:PATH or criteo:PATH",)
            )
        else:
            path = Path(text)
            name = path.name.lower()
            if name.endswith(".parquet"):
                kind = LogKind.PARQUET
            elif name.endswith((".csv", ".csv.gz")):
                kind = LogKind.CSV
            else:
                kind = LogKind.CRITEO
        if not path.exists():
            raise PlannerError(f"DATA {text!r}: {path} does not exist", fixes=("name an existing file or folder",))
        return cls(kind, path)

    @property
    def name(self) -> str:
        """The log's short name in tables and JSON (the file's name without its extensions)."""
        return self.path.name.split(".")[0] or str(self.path)

    def arg(self, path: Path | None = None) -> str:
        """``KIND:PATH`` of this log, or of ``path`` as a log of this kind (what persia's ``--data`` takes)."""
        return f"{self.kind.value}:{path if path is not None else self.path}"

    def files(self) -> list[Path]:
        """The log's files: itself, or a folder's visible files in name order.

        Raises:
            PlannerError: A folder with no file.
        """
        if self.path.is_file():
            return [self.path]
        found = sorted(p for p in self.path.iterdir() if p.is_file() and not p.name.startswith((".", "_")))
        if not found:
            raise PlannerError(f"DATA {self.arg()}: the folder holds no file", fixes=("name a file or a full folder",))
        return found

    def suffix(self) -> str:
        """The extension a split's files get (persia and pyarrow read gzip by the name)."""
        return {LogKind.CSV: ".csv", LogKind.PARQUET: ".parquet", LogKind.CRITEO: ".txt"}[self.kind]


@dataclass(frozen=True)
class LogRows:
    """Every row of a log, in file order.

    Attributes:
        source: The log.
        header: A CSV log's header line (None otherwise).
        lines: A text log's rows, one ``bytes`` line each without its newline (None for Parquet).
        table: A Parquet log's rows (a ``pyarrow.Table``; None for text).
    """

    source: LogSource
    header: bytes | None
    lines: list[bytes] | None
    table: Any = None

    def __len__(self) -> int:
        return len(self.lines) if self.lines is not None else int(self.table.num_rows)


def _text(path: Path) -> bytes:
    if path.name.endswith(".gz"):
        with gzip.open(path, "rb") as f:
            return f.read()
    return path.read_bytes()


def read_rows(source: LogSource) -> LogRows:
    """Every row of ``source`` (a folder's files one after another; a CSV folder's files must share their header).

    Raises:
        PlannerError: An empty log, or CSV files with different headers.
    """
    if source.kind is LogKind.PARQUET:
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.concat_tables([pq.read_table(p) for p in source.files()])
        if table.num_rows == 0:
            raise PlannerError(f"DATA {source.arg()}: no rows", fixes=("name a log with rows",))
        return LogRows(source, None, None, table)
    header: bytes | None = None
    lines: list[bytes] = []
    for path in source.files():
        rows = [line for line in _text(path).split(b"\n") if line.strip()]
        if source.kind is LogKind.CSV and rows:
            first, rows = rows[0], rows[1:]
            if header is not None and first != header:
                raise PlannerError(
                    f"DATA {source.arg()}: {path.name}'s header differs from the first file's",
                    fixes=("give files of one schema",),
                )
            header = first
        lines += rows
    if not lines:
        raise PlannerError(f"DATA {source.arg()}: no rows", fixes=("name a log with rows",))
    return LogRows(source, header, lines)


def write_rows(rows: LogRows, index: np.ndarray, path: Path) -> Path:
    """The rows ``index`` of ``rows`` (in that order) as one file of the log's kind at ``path``."""
    if rows.table is not None:
        import pyarrow.parquet as pq

        pq.write_table(rows.table.take(np.asarray(index, dtype=np.int64)), path)
        return path
    assert rows.lines is not None
    lines = rows.lines
    body = b"\n".join(lines[i] for i in index)
    path.write_bytes((rows.header + b"\n" if rows.header is not None else b"") + body + b"\n")
    return path


@dataclass(frozen=True)
class Split:
    """Which rows train and which validate.

    Attributes:
        name: How it was drawn (``random 0``, ``by time``).
        train: The training rows' indices, in the order they are written.
        valid: The validation rows' indices, in the order they are written.
        by_time: The validation rows are the latest (both sides in time order), not drawn at random.
    """

    name: str
    train: np.ndarray
    valid: np.ndarray
    by_time: bool = False


def _valid_count(rows: int, valid_share: float) -> int:
    if not 0 < valid_share < 1:
        raise PlannerError(f"--valid-share {valid_share}: must be in (0, 1)", fixes=("e.g. 0.1",))
    count = math.ceil(rows * valid_share)
    if not 0 < count < rows:
        raise PlannerError(
            f"{rows} rows leave no row on one side of a {valid_share:.0%} split", fixes=("give a longer log",)
        )
    return count


def random_split(rows: int, valid_share: float, seed: int) -> Split:
    """``ceil(rows * valid_share)`` rows drawn at random (numpy's generator seeded ``seed``) validate, the others
    train; both in file order. The same arguments give the same split on every machine."""
    count = _valid_count(rows, valid_share)
    order = np.random.default_rng(seed).permutation(rows)
    return Split(f"random {seed}", np.sort(order[count:]), np.sort(order[:count]))


def time_split(times: np.ndarray, valid_share: float) -> Split:
    """The latest ``ceil(rows * valid_share)`` rows by ``times`` validate, the earlier ones train; both in time order
    (ties in file order)."""
    count = _valid_count(len(times), valid_share)
    order = np.argsort(times, kind="stable")
    return Split("by time", order[:-count], order[-count:], by_time=True)


def inner_split(split: Split, seed: int) -> Split:
    """The inner split of ``split``'s training rows, as positions into ``split.train``: by time (its latest
    :data:`INNER_SHARE`) for a split by time, else drawn at random by ``seed``."""
    if split.by_time:
        return time_split(np.arange(len(split.train)), INNER_SHARE)
    return random_split(len(split.train), INNER_SHARE, seed)
