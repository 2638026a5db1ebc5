"""Click-log ids as int64, the same on every trainer, run and machine: strings by the FNV-1a 64 hash of their UTF-8
bytes, integers by their 64-bit pattern, both finished with splitmix64. Training (:mod:`.tabular`) and the data's
profile (:mod:`.profile`) hash alike, so a profile's distinct ids are the ids the tables will see.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from persia_planner.modules.hashing import splitmix64

__all__ = ["hash_ids"]

_FNV_OFFSET = np.uint64(0xCBF29CE484222325)
_FNV_PRIME = np.uint64(0x100000001B3)


def _hash_strings(array: Any) -> np.ndarray:
    """FNV-1a 64 of each string's UTF-8 bytes, then splitmix64; vectorised over the strings, a pass per byte."""
    import pyarrow as pa

    large = pa.types.is_large_string(array.type) or pa.types.is_large_binary(array.type)
    _, offsets_buf, data_buf = array.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=np.int64 if large else np.int32)[
        array.offset : array.offset + len(array) + 1
    ]
    data = np.frombuffer(data_buf, dtype=np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
    starts = offsets[:-1].astype(np.int64)
    lengths = (offsets[1:] - offsets[:-1]).astype(np.int64)
    h = np.full(len(array), _FNV_OFFSET, dtype=np.uint64)
    live = np.arange(len(array))
    for i in range(int(lengths.max(initial=0))):
        live = live[lengths[live] > i]
        h[live] = (h[live] ^ data[starts[live] + i].astype(np.uint64)) * _FNV_PRIME
    return splitmix64(h)


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
