"""What a table does with its rows besides training them: how a new row starts and which row a full table gives up.

These are values of a table's configuration (:class:`.protocol.TableConfig`), sent to every server and compared
there, so they are frozen dataclasses and an enum, below both the protocol and the store (:mod:`.store` applies them;
:mod:`.optim` holds the third policy, how a row learns).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

import torch

from persia_planner.modules.hashing import GOLDEN_GAMMA, MIX1, MIX2, as_int64, mix64_tensor

__all__ = ["Eviction", "Normal", "Uniform", "id_uniforms"]


class Eviction(StrEnum):
    """Which row a full table gives up for a new id."""

    LRU = "lru"  # least recently looked up (granularity: one training lookup batch)
    LFU = "lfu"  # least frequently looked up; ties broken by least recent


_MIX1, _MIX2, _GOLD = as_int64(MIX1), as_int64(MIX2), as_int64(GOLDEN_GAMMA)
_BELOW_ONE = 1.0 - 2.0**-24  # the largest float32 below 1


def id_uniforms(ids: torch.Tensor, dim: int, seed: int, stream: int = 0) -> torch.Tensor:
    """``[n, dim]`` float32 uniforms in (0, 1) that depend only on ``(seed, id, column, stream)``.

    splitmix64 over int64 with wrapping arithmetic, vectorised. A new row's initial value is therefore a function of
    its id, not of the order in which ids reached the server or of which server holds it, so runs with several
    trainers, re-sharded servers and resumed jobs initialise every row alike.
    """
    cols = torch.arange(dim, dtype=torch.int64) * 2 + stream
    salt = (seed * _MIX1) & 0xFFFFFFFFFFFFFFFF
    salt -= (salt >> 63) << 64  # as a signed int64
    x = ids.to(torch.int64).unsqueeze(1) * _MIX2 + cols.unsqueeze(0) * _GOLD + salt
    x = mix64_tensor(x)
    # The top 24 bits, centred in their bins: (k + 0.5) / 2**24. For the top bin that is 1 - 2**-25, which float32
    # rounds to 1.0, outside (0, 1): it is held at the largest float32 below 1 (one value in 2**24 moves by 2**-25).
    return ((((x >> 40) & 0xFFFFFF).to(torch.float32) + 0.5) * (1.0 / (1 << 24))).clamp_(max=_BELOW_ONE)


@dataclass(frozen=True)
class Uniform:
    """Initialise new rows uniformly in ``[low, high)``."""

    low: float = -0.01
    high: float = 0.01

    def __post_init__(self) -> None:
        if not self.low <= self.high:
            raise ValueError(f"Uniform needs low <= high, got [{self.low}, {self.high}]")

    def sample(self, n: int, dim: int, generator: torch.Generator) -> torch.Tensor:
        """``[n, dim]`` float32 rows drawn from ``generator``."""
        return torch.empty(n, dim, dtype=torch.float32).uniform_(self.low, self.high, generator=generator)

    def rows_for(self, ids: torch.Tensor, dim: int, seed: int) -> torch.Tensor:
        """``[len(ids), dim]`` rows in ``[low, high)`` that depend only on ``(seed, id)`` (see :func:`id_uniforms`)."""
        rows = id_uniforms(ids, dim, seed) * (self.high - self.low) + self.low
        if self.low < self.high:
            # u < 1, but u * (high - low) + low can still round up to high in float32.
            below_high = torch.nextafter(torch.tensor(self.high, dtype=torch.float32), torch.tensor(-math.inf))
            rows.clamp_(max=float(below_high))
        return rows


@dataclass(frozen=True)
class Normal:
    """Initialise new rows from ``N(mean, std^2)``."""

    std: float = 0.01
    mean: float = 0.0

    def __post_init__(self) -> None:
        if not self.std >= 0.0:
            raise ValueError(f"Normal needs std >= 0, got {self.std}")

    def sample(self, n: int, dim: int, generator: torch.Generator) -> torch.Tensor:
        """``[n, dim]`` float32 rows drawn from ``generator``."""
        return torch.empty(n, dim, dtype=torch.float32).normal_(self.mean, self.std, generator=generator)

    def rows_for(self, ids: torch.Tensor, dim: int, seed: int) -> torch.Tensor:
        """``[len(ids), dim]`` rows that depend only on ``(seed, id)`` (Box-Muller over :func:`id_uniforms`)."""
        u1, u2 = id_uniforms(ids, dim, seed, 0), id_uniforms(ids, dim, seed, 1)
        z = torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2.0 * torch.pi) * u2)
        return z * self.std + self.mean
