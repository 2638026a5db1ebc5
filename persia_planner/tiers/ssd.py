"""The ``ssd`` tier: a table's rows hashed over the parameter servers as on ``ps``, but kept on each server's local
disk with the recently used ones cached in its DDR (Neo's SSD tier, HugeCTR's HPS); for tables the servers' DDR cannot
hold. Each shard carries the cached share of its rows (``cache_fraction``). The disk is this tier's own memory: its
capacity is a server's ``ssd:`` in topology.yaml."""

from persia_planner.kinds import Sharding
from persia_planner.tiers.memory import Holder, Memory, MemorySpec, register_memory
from persia_planner.tiers.tier import Lookups, Runtime, TierSpec, register

DISK = register_memory(
    MemorySpec(
        "disk",
        Holder.SERVER,
        "PS disk",
        "disk_bytes",
        capacity=lambda topo, server: server.ssd.capacity_bytes if server.ssd is not None else 0,
        noun="disk",
        declared_as="an ssd: disk",
        fix="add 'ssd: SIZE' (e.g. ssd: 2TiB) to the topology's parameter-server hosts",
    )
)

SSD = register(
    TierSpec(
        name="ssd",
        summary="a parameter server's disk, its hottest rows cached in the server's DDR",
        rows_in=DISK,
        lookups=Lookups.SERVER,
        shardings=frozenset({Sharding.PS_HASH}),
        speed_rank=4,
        runtime=Runtime.PARAMETER_SERVER,
        store="persia_planner.modules.ps.ssd_store:disk_store",
        cache_in=Memory.SERVER,
        promote_to="ps",
    )
)
