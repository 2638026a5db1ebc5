"""The ``ssd`` tier: a table's rows hashed over the parameter servers as on ``ps``, but kept on each server's local
disk with the recently used ones cached in its DDR (Neo's SSD tier, HugeCTR's HPS); for tables the servers' DDR cannot
hold. Each shard carries the cached share of its rows (``cache_fraction``)."""

from persia_planner.kinds import Sharding
from persia_planner.tiers.tier import Lookups, Memory, Runtime, TierSpec, register

SSD = register(
    TierSpec(
        name="ssd",
        summary="a parameter server's disk, its hottest rows cached in the server's DDR",
        rows_in=Memory.DISK,
        lookups=Lookups.SERVER,
        shardings=frozenset({Sharding.PS_HASH}),
        speed_rank=4,
        runtime=Runtime.PARAMETER_SERVER,
        cached=True,
        promote_to="ps",
    )
)
