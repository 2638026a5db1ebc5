"""Which parameter server holds an id: a stable hash of (table, id), shared by the client and checkpoint re-sharding.

The plan's ``ps_hash`` shard ``hash: [i, n]`` is exactly the ids with ``server_of(table, ids, n) == i``.
"""

from __future__ import annotations

import hashlib

import torch

from persia_planner.modules.hashing import MASK63, mix64_tensor

__all__ = ["server_of", "table_salt"]


def table_salt(table: str) -> int:
    """A 63-bit salt from the table name, stable across processes and Python versions (not ``hash()``)."""
    return int.from_bytes(hashlib.blake2b(table.encode(), digest_size=8).digest(), "little") & MASK63


def server_of(table: str, ids: torch.Tensor, n_servers: int) -> torch.Tensor:
    """Server index in ``[0, n_servers)`` of each id (int64 tensor holding uint64 bit patterns).

    Salting with the table spreads tables whose ids overlap (e.g. small integer ids) over different servers.
    """
    if n_servers <= 0:
        raise ValueError(f"n_servers must be positive, got {n_servers}")
    return (mix64_tensor(ids.to(torch.int64) ^ table_salt(table)) & MASK63) % n_servers
