"""The roles ``persia data profile`` guesses for a log's columns, as a practitioner would from their statistics
(:class:`.columns.ColumnProfile`), each with the reason it gives.

* The label: a 0/1 column, one named like a label first (``click``, ``label``, ...).
* Left out, with a note: a column with no value, or one value in every row (nothing to learn from; standardize would
  divide by a std of 0), ids unique per row (a row's own id, as Avazu's ``id``: no id recurs, so no embedding
  learns: text, and integers named as ids or spread like hashes, past :data:`HASH_LIKE`), a type no reader takes,
  and a name model.yaml cannot hold.
* Dense with ``log1p`` and ``standardize``: a heavy-tailed count, non-negative integers whose largest value is at
  least :data:`HEAVY_TAIL_RATIO` times the median, starting at 0 or 1 (Criteo's I1..I13, clicks, durations). Its
  log is what a network can use: a linear layer over the raw values is ruled by the few largest.
* Sparse (a table): text and lists of ids; integers named as ids (``user_id``, ``movieId``: ids numbered by
  popularity look like counts); integer codes, whose values recur (at least :data:`MIN_ID_REPEATS` rows per distinct
  value: Avazu's C1, banner_pos, device_type, C14..C21). A table learns a value per code where a dense input could
  only scale it.
* Dense, standardized (and ``log1p`` where heavy-tailed): every other numeric column, fractions and integers that
  hardly recur (a timestamp, a weight).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from persia_planner.errors import unprintable
from persia_planner.model.data_schema import DenseTransform
from persia_planner.modules.data.columns import ColumnProfile

__all__ = [
    "HEAVY_TAIL_RATIO",
    "LABEL_NAMES",
    "MIN_ID_REPEATS",
    "UNIQUE_SHARE",
    "Guess",
    "Role",
    "dense_transform",
    "guess_roles",
    "heavy_tailed",
]

LABEL_NAMES = ("label", "click", "clicked", "clicks", "is_click", "y", "target")
"""Names of a label column, tried first among the 0/1 columns."""
HEAVY_TAIL_RATIO = 10.0
"""A column is heavy-tailed when its largest value is at least this many times its median (or 1, if larger): its
values span an order of magnitude above the typical one."""
MAX_NEGATIVE_SHARE = 0.05
"""At most this share of a heavy-tailed count may be negative (Criteo's I2 holds a few -1s; Avazu's C20 is -1 in
about half its rows, a code for missing, and no count)."""
MIN_ID_REPEATS = 3.0
"""Rows per distinct value of an integer column, at least, to be a code fed to a table: a value seen fewer times
(a timestamp, a weight in dollars) teaches its embedding row next to nothing."""
UNIQUE_SHARE = 0.95
"""An id column with at least this share of its rows' values distinct (the estimate is within about 1%) is unique
per row."""
MIN_ROWS_FOR_UNIQUE = 20
"""Fewer rows than this say nothing about an id's recurring."""
HASH_LIKE = float(1 << 32)
"""Integers spanning more than this are hashes or random ids (Avazu's ``id``), not times or amounts."""
_ID_NAME = re.compile(r"(?:^|[_\-. ])id$|[a-z]I[dD]$", re.IGNORECASE)
"""A column named as ids: ``id``, ``user_id``, ``item-id``, ``movieId``."""


class Role(enum.StrEnum):
    """What a column is to the model."""

    LABEL = "label"
    DENSE = "dense"
    SPARSE = "sparse"
    LEFT_OUT = "left out"


@dataclass(frozen=True)
class Guess:
    """A column's guessed role, why, and (dense) its transforms.

    Attributes:
        column: The column.
        role: Its role.
        why: The reason, in a few words (printed beside the role, and in the notes of those left out).
        transform: A dense column's transforms.
    """

    column: str
    role: Role
    why: str
    transform: DenseTransform = field(default_factory=DenseTransform)


def heavy_tailed(col: ColumnProfile) -> bool:
    """The column's largest value is at least :data:`HEAVY_TAIL_RATIO` times its median (or 1), and few of its
    values are negative: a count or an amount, whose log a network uses."""
    if col.high is None or col.median is None or not col.numbers:
        return False
    mostly_positive = col.negatives <= MAX_NEGATIVE_SHARE * col.numbers
    return mostly_positive and col.high >= HEAVY_TAIL_RATIO * max(abs(col.median), 1.0)


def dense_transform(col: ColumnProfile) -> DenseTransform:
    """A dense column's suggested transforms: ``log1p`` where heavy-tailed, then ``standardize`` (the first pass
    measures its mean and std)."""
    return DenseTransform(log1p=heavy_tailed(col), standardize=True)


def guess_roles(columns: Sequence[ColumnProfile]) -> tuple[Guess, ...]:
    """Each column's role (see the module's docstring), in the columns' order; at most one label."""
    named = [c for c in columns if unprintable(c.name) is None]
    binary = [c for c in named if c.binary and _varies(c)]
    by_name = [c for c in binary if c.name.lower() in LABEL_NAMES]
    label = (by_name or binary or [None])[0]
    guesses = []
    for c in columns:
        if c is label:
            guesses.append(Guess(c.name, Role.LABEL, "a 0/1 column" + (", named as a label" if by_name else "")))
        else:
            guesses.append(_guess(c))
    return tuple(guesses)


def _varies(col: ColumnProfile) -> bool:
    """More than one value in the rows read."""
    if col.kind == "numeric":
        return col.low is not None and col.low != col.high
    return col.distinct is not None and round(col.distinct) > 1


def _guess(c: ColumnProfile) -> Guess:
    if unprintable(c.name) is not None:
        why = "a control or format character in its name, which model.yaml cannot hold: rename it to use it"
        return Guess(c.name, Role.LEFT_OUT, why)
    if c.kind == "other":
        return Guess(c.name, Role.LEFT_OUT, "of a type no reader takes (bytes, dates, structs)")
    if c.present == 0 or (c.kind == "numeric" and c.low is None):
        return Guess(c.name, Role.LEFT_OUT, "no value in any row read")
    if not _varies(c):
        return Guess(c.name, Role.LEFT_OUT, "one value in every row read: nothing to learn from")
    named_id = c.integral and c.distinct is not None and _ID_NAME.search(c.name) is not None
    spread = c.high is not None and c.low is not None and c.high - c.low > HASH_LIKE
    ids = c.kind == "text" or named_id or (c.integral and c.distinct is not None and spread)
    unique = c.present >= MIN_ROWS_FOR_UNIQUE and c.distinct is not None and c.distinct >= UNIQUE_SHARE * c.present
    if ids and unique:
        return Guess(c.name, Role.LEFT_OUT, "unique per row, a row's own id: none recurs for a table to learn")
    if named_id:
        return Guess(c.name, Role.SPARSE, f"integer ids, {round(c.distinct or 0):,} of them, named as ids")
    if c.kind in ("text", "list"):
        return Guess(c.name, Role.SPARSE, "multi-hot ids" if c.kind == "list" else "text ids")
    heavy = heavy_tailed(c)
    transform = DenseTransform(log1p=heavy, standardize=True)
    if not c.integral or c.distinct is None:  # (a Parquet float column of whole numbers: not hashed as ids)
        what = "fractional values" if not c.integral else "floats, not ids"
        return Guess(c.name, Role.DENSE, what + (", heavy-tailed" if heavy else ""), transform)
    starts_low = c.low is not None and c.low <= 1
    if heavy and starts_low:
        return Guess(c.name, Role.DENSE, "a heavy-tailed count", transform)
    if c.present >= MIN_ID_REPEATS * c.distinct:
        return Guess(c.name, Role.SPARSE, f"integer codes, {round(c.distinct):,} values that recur")
    return Guess(c.name, Role.DENSE, "integers that hardly recur" + (", heavy-tailed" if heavy else ""), transform)
