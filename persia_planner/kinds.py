"""The names a placement is made of: where a table's rows live (:class:`Tier`), how it is split (:class:`Sharding`),
how it trains (:class:`Mode`), and which tiers each sharding type runs on.

They sit below the model's specs: plan.json and model.yaml's table ``constraints:`` both name them.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

__all__ = ["LOCAL_TIERS", "TIERS_OF_SHARDING", "TIER_OF_KERNEL", "Mode", "Sharding", "Tier"]


class Tier(enum.StrEnum):
    """Where a shard's rows live."""

    HBM = "hbm"  # GPU memory
    DDR = "ddr"  # host memory, read by the GPU through UVM
    HBM_CACHE = "hbm_cache"  # rows in host DDR, the hottest cached in HBM
    PS = "ps"  # a parameter server's DDR, trained asynchronously


class Sharding(enum.StrEnum):
    """How a table is split (TorchRec's names, plus the parameter-server hash sharding)."""

    TABLE_WISE = "table_wise"
    ROW_WISE = "row_wise"
    COLUMN_WISE = "column_wise"
    TABLE_ROW_WISE = "table_row_wise"
    TABLE_COLUMN_WISE = "table_column_wise"
    DATA_PARALLEL = "data_parallel"
    PS_HASH = "ps_hash"


class Mode(enum.StrEnum):
    """How a table trains: synchronously with the dense step, or asynchronously on the parameter servers."""

    SYNC = "sync"
    ASYNC = "async"


LOCAL_TIERS: tuple[Tier, ...] = (Tier.HBM, Tier.HBM_CACHE, Tier.DDR)
"""The tiers of a trainer's own memory (fbgemm's kernels), fastest first."""

TIERS_OF_SHARDING: Mapping[Sharding, frozenset[Tier]] = {
    **{s: frozenset(LOCAL_TIERS) for s in Sharding if s not in (Sharding.DATA_PARALLEL, Sharding.PS_HASH)},
    # A replica is trained by DDP's dense kernel, in HBM; ps_hash is the parameter servers' own sharding.
    Sharding.DATA_PARALLEL: frozenset({Tier.HBM}),
    Sharding.PS_HASH: frozenset({Tier.PS}),
}
"""The tiers each sharding type runs on (``validate`` refuses any other pair)."""

TIER_OF_KERNEL: Mapping[str, Tier] = {
    "fused": Tier.HBM,
    "dense": Tier.HBM,
    "fused_uvm": Tier.DDR,
    "fused_uvm_caching": Tier.HBM_CACHE,
}
"""TorchRec's compute kernels and the tier whose memory each keeps the rows in (``dense``: a replica's, in HBM)."""
