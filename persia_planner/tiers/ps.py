"""The ``ps`` tier: a table's rows hashed over the embedding parameter servers' DDR and trained asynchronously with
bounded staleness (the Persia hybrid algorithm); TorchRec's plan leaves such tables out."""

from persia_planner.kinds import Sharding
from persia_planner.tiers.memory import Memory
from persia_planner.tiers.tier import Lookups, Runtime, TierSpec, register

PS = register(
    TierSpec(
        name="ps",
        summary="a parameter server's DDR, trained asynchronously",
        rows_in=Memory.SERVER,
        lookups=Lookups.SERVER,
        shardings=frozenset({Sharding.PS_HASH}),
        speed_rank=3,
        runtime=Runtime.PARAMETER_SERVER,
        store="persia_planner.modules.ps.table_store:memory_store",
        promote_to="ddr",
    )
)
