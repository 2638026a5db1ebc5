"""The validation split of a click log: which rows are held out, by a hash of each row's content.

A row is held out when its content hash (label, dense values and every feature's ids: :meth:`.shards.Block.row_keys`)
falls below the split's fraction of the 64-bit range. So the held-out rows are the same on every trainer, worker,
run and machine, whatever the shuffle seed, the trainer count or the shard boundaries, and a row copied several
times into the data (the same log twice in a folder) is held out in every copy: it can never be trained on in one
and evaluated in another.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["DEFAULT_EVAL_SPLIT", "ROW_SALT", "RowSplit", "combine"]

DEFAULT_EVAL_SPLIT = 0.05
"""The share of a file source's rows held out for validation when no ``--eval-data`` is given."""
ROW_SALT = np.uint64(0x5EED_0F_A11_C0FFEE)
"""Starts every row's hash: the split never depends on ``--seed``."""


def combine(h: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``h`` (uint64, one per row) with ``values`` (one 64-bit pattern per row) mixed in.

    Raises:
        TypeError: ``values`` are not integers. A float's cast to uint64 loses its bits and warns on every block
            (a uint64 sum joined with a Python 0 is float64: the two RuntimeWarnings every ``--eval-split`` run
            printed); a float column is mixed in by its bits (``.view(np.uint32)``).
    """
    from persia_planner.modules.hashing import mix64  # numba: imported when rows are read, not by the checks

    if values.dtype.kind not in "iu":
        raise TypeError(f"row keys mix integer bit patterns, got {values.dtype} values: view them as integers")
    return mix64(h ^ values.astype(np.uint64, copy=False))


@dataclass(frozen=True)
class RowSplit:
    """The rows of one side of a validation split.

    Attributes:
        fraction: The share of rows held out, in [0, 1).
        held_out: True: the held-out rows (validation); False: the rest (training).
    """

    fraction: float
    held_out: bool

    def __post_init__(self) -> None:
        if not 0 <= self.fraction < 1:
            raise ValueError(f"a split's fraction is in [0, 1), got {self.fraction}")

    def mask(self, keys: np.ndarray) -> np.ndarray:
        """Which rows, of content hashes ``keys`` (uint64), are on this side."""
        threshold = np.uint64(min(int(self.fraction * 2.0**64), 2**64 - 1))
        below = keys < threshold
        return below if self.held_out else ~below
