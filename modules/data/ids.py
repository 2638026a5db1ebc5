"""Click-log ids as int64, the same on every trainer, run and machine: strings by the FNV-1a 64 hash of their UTF-8
bytes, integers by their 64-bit pattern, both finished with splitmix64. Training (:mod:`.tabular`) and the data's
profile (:mod:`.profile`) hash alike, so a profile's distinct ids are the ids the tables will see.

A table maps a hashed id into its rows as ``id mod rows``: the hashes are uniform, so ``n`` distinct ids in ``rows``
rows collide as balls in bins (the birthday problem). :func:`collision_rate` and :func:`rows_for_collision_rate` are
that formula's one home: a profile sizes its tables with it.
"""

from __future__ import annotations

import math
from typing import Any

import numba
import numpy as np

from persia_planner.modules.hashing import splitmix64

__all__ = ["DEFAULT_COLLISION_RATE", "collision_rate", "hash_ids", "rows_for_collision_rate"]

DEFAULT_COLLISION_RATE = 0.01
"""The share of a table's ids a profile lets share their row with another id (``persia data profile
--collision-rate``): about one id in a hundred learns a blend of two, at about 100 rows per id."""

_FNV_OFFSET = np.uint64(0xCBF29CE484222325)
_FNV_PRIME = np.uint64(0x100000001B3)


@numba.njit(cache=True, nogil=True)
def _fnv1a(offsets: np.ndarray, data: np.ndarray) -> np.ndarray:  # pragma: no cover - compiled
    """FNV-1a 64 of each string ``data[offsets[i]:offsets[i + 1]]``: one pass over the bytes, whatever their lengths
    (a per-position numpy loop costs a pass per byte of the longest string, however few strings are long)."""
    out = np.empty(len(offsets) - 1, dtype=np.uint64)
    for i in range(len(out)):
        h = _FNV_OFFSET
        for k in range(offsets[i], offsets[i + 1]):
            h = (h ^ np.uint64(data[k])) * _FNV_PRIME
        out[i] = h
    return out


def _hash_strings(array: Any) -> np.ndarray:
    """FNV-1a 64 of each string's UTF-8 bytes, then splitmix64."""
    import pyarrow as pa

    large = pa.types.is_large_string(array.type) or pa.types.is_large_binary(array.type)
    _, offsets_buf, data_buf = array.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=np.int64 if large else np.int32)[
        array.offset : array.offset + len(array) + 1
    ]
    data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
    return splitmix64(_fnv1a(offsets.astype(np.int64), data))


def hash_ids(array: Any) -> np.ndarray:
    """Ids as int64: strings by the FNV-1a 64 hash of their UTF-8 bytes, integers by the splitmix64 finaliser of
    their 64-bit pattern (so ``"7"`` and ``7`` differ). Stable across runs, processes and machines.

    Args:
        array: A pyarrow array of strings or integers (dictionary-encoded too), without nulls.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_dictionary(array.type):
        codes = array.indices.to_numpy(zero_copy_only=False).astype(np.int64)
        return hash_ids(array.dictionary)[codes]
    if pa.types.is_null(array.type) or len(array) == 0:
        return np.zeros(len(array), dtype=np.int64)
    if pa.types.is_integer(array.type):
        bits = pc.cast(array, pa.int64(), safe=False).to_numpy(zero_copy_only=False).view(np.uint64)
        return splitmix64(bits).view(np.int64)
    return _hash_strings(array).view(np.int64)


def collision_rate(distinct: float, rows: int) -> float:
    """The expected share of ``distinct`` ids that share their row with at least one other id when a table of
    ``rows`` rows maps them ``id mod rows`` (uniform hashes): each of the other ``n - 1`` ids misses an id's row with
    probability ``1 - 1/rows``, so the share is ``1 - (1 - 1/rows)^(n - 1)``."""
    if rows < 1:
        raise ValueError(f"a table has at least one row, got {rows}")
    others = max(0.0, distinct - 1.0)
    return -math.expm1(others * math.log1p(-1.0 / rows)) if rows > 1 else float(others > 0)


def rows_for_collision_rate(distinct: float, rate: float = DEFAULT_COLLISION_RATE) -> int:
    """The fewest table rows at which ``distinct`` ids collide at most at ``rate`` (:func:`collision_rate`):
    ``rows = 1 / (1 - (1 - rate)^(1 / (n - 1)))``, rounded up; about ``(n - 1) / rate`` for a small rate.

    Raises:
        ValueError: ``rate`` outside (0, 1).
    """
    if not 0.0 < rate < 1.0:
        raise ValueError(f"a collision rate is in (0, 1), got {rate}")
    others = max(0.0, distinct - 1.0)
    if others == 0.0:
        return 1
    # 1 - 1/rows = (1 - rate)^(1/others), each side computed without cancellation
    miss = -math.expm1(math.log1p(-rate) / others)
    return max(1, math.ceil(1.0 / miss - 1e-9))
