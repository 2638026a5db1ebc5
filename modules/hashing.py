"""splitmix64, the runtime's one 64-bit mixing hash: which server holds an id, the PS index's buckets, a new row's
initial values, the synthetic data's ids and the click logs' hashed ids all use it.

Its finaliser is compiled twice from one body: as a scalar function that the parameter server's numba kernels inline,
and as a numpy ufunc over uint64 arrays (one pass, where numpy or torch expressions make five). Both wrap modulo
2**64, so every caller gets the same bits: plans' ``ps_hash`` shards and checkpoints depend on them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numba
import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = [
    "GOLDEN_GAMMA",
    "MASK63",
    "MIX1",
    "MIX2",
    "as_int64",
    "mix64",
    "mix64_scalar",
    "mix64_tensor",
    "splitmix64",
]

GOLDEN_GAMMA = 0x9E3779B97F4A7C15
"""splitmix64's increment (2**64 / the golden ratio)."""
MIX1 = 0xBF58476D1CE4E5B9
"""The finaliser's first multiplier."""
MIX2 = 0x94D049BB133111EB
"""The finaliser's second multiplier."""
MASK63 = (1 << 63) - 1
"""Clears the top bit: a hash as a non-negative int64."""


def as_int64(c: int) -> int:
    """A uint64 constant as the int64 with the same bits (torch has no uint64 arithmetic)."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _finalise(x):  # type: ignore[no-untyped-def]  # numba compiles it for uint64
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(MIX1)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(MIX2)
    return x ^ (x >> np.uint64(31))


mix64_scalar = numba.njit(cache=True, nogil=True, inline="always")(_finalise)
"""splitmix64's finaliser of one uint64, for numba-compiled code."""

mix64 = numba.vectorize(["uint64(uint64)"], nopython=True, cache=True)(_finalise)
"""splitmix64's finaliser over a uint64 array (a numpy ufunc)."""


def splitmix64(x: np.ndarray) -> np.ndarray:
    """One splitmix64 step over uint64 ``x``: the finaliser of ``x + GOLDEN_GAMMA``."""
    return mix64(x + np.uint64(GOLDEN_GAMMA))


def mix64_tensor(x: torch.Tensor) -> torch.Tensor:
    """:data:`mix64` of an int64 CPU tensor's uint64 bit patterns, as int64 bit patterns of the same shape."""
    import torch

    bits = x.detach().contiguous().numpy().view(np.uint64)
    return torch.from_numpy(mix64(bits).view(np.int64))
