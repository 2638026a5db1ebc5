"""The ``ddr`` tier: a shard's rows in its GPU's host memory, read through CUDA unified memory (TorchRec's
``fused_uvm`` kernel)."""

from persia_planner.kinds import Sharding
from persia_planner.tiers.memory import Memory
from persia_planner.tiers.tier import Lookups, TierSpec, register

DDR = register(
    TierSpec(
        name="ddr",
        summary="host memory, read by the GPU through UVM",
        rows_in=Memory.HOST,
        lookups=Lookups.UVM,
        shardings=frozenset(Sharding) - {Sharding.PS_HASH, Sharding.DATA_PARALLEL},
        speed_rank=2,
        torchrec_kernel="fused_uvm",
        promote_to="hbm",
    )
)
