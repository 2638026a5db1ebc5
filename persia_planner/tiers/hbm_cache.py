"""The ``hbm_cache`` tier: a shard's rows in host memory with the hottest cached in GPU memory (TorchRec's
``fused_uvm_caching`` kernel); each shard carries the cached share of its rows."""

from persia_planner.kinds import Sharding
from persia_planner.tiers.memory import Memory
from persia_planner.tiers.tier import Lookups, TierSpec, register

HBM_CACHE = register(
    TierSpec(
        name="hbm_cache",
        summary="rows in host DDR, the hottest cached in HBM",
        rows_in=Memory.HOST,
        lookups=Lookups.UVM,
        shardings=frozenset(Sharding) - {Sharding.PS_HASH, Sharding.DATA_PARALLEL},
        speed_rank=1,
        torchrec_kernel="fused_uvm_caching",
        cache_in=Memory.DEVICE,
        promote_to="hbm",
    )
)
