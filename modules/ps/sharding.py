"""Which parameter server holds an id: a stable hash of (table, id), shared by the client and checkpoint re-sharding.

The plan's ``ps_hash`` shard ``hash: [i, n]`` is exactly the ids with ``server_of(table, ids, n) == i``.
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["server_of", "table_salt"]

_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)  # splitmix64 constants as int64 bit patterns
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def table_salt(table: str) -> int:
    """A 63-bit salt from the table name, stable across processes and Python versions (not ``hash()``)."""
    return int.from_bytes(hashlib.blake2b(table.encode(), digest_size=8).digest(), "little") & (2**63 - 1)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    # >> on int64 is arithmetic; mask off the sign extension to shift the uint64 bit pattern.
    return (x >> s) & ((1 << (64 - s)) - 1)


def server_of(table: str, ids: torch.Tensor, n_servers: int) -> torch.Tensor:
    """Server index in ``[0, n_servers)`` of each id (int64 tensor holding uint64 bit patterns).

    Salting with the table spreads tables whose ids overlap (e.g. small integer ids) over different servers.
    """
    if n_servers <= 0:
        raise ValueError(f"n_servers must be positive, got {n_servers}")
    x = ids.to(torch.int64) ^ table_salt(table)
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    x = (x ^ _shr(x, 31)) & (2**63 - 1)
    return x % n_servers
