"""The ``hbm`` tier: a shard's rows, and its optimizer state, in one GPU's memory (TorchRec's ``fused`` kernel)."""

from persia_planner.kinds import Sharding
from persia_planner.tiers.memory import Memory
from persia_planner.tiers.tier import Lookups, TierSpec, register

HBM = register(
    TierSpec(
        name="hbm",
        summary="GPU memory",
        rows_in=Memory.DEVICE,
        lookups=Lookups.HBM,
        # Every range sharding, and a data-parallel replica (trained by DDP's dense kernel, in HBM).
        shardings=frozenset(Sharding) - {Sharding.PS_HASH},
        speed_rank=0,
        torchrec_kernel="fused",
    )
)
