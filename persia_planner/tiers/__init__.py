"""The tiers a shard's rows can live on: one module per tier, each registering its :class:`TierSpec`.

Importing this package registers the built-in tiers in their plan.json order (``hbm``, ``ddr``, ``hbm_cache``,
``ps``, ``ssd``). The helpers below answer the questions several layers ask of the registry as it is when asked, so a
tier a test registers takes part like a built-in one.
"""

from __future__ import annotations

from collections.abc import Mapping

from persia_planner.kinds import Sharding
from persia_planner.tiers.memory import Holder, Memory, MemorySpec, register_memory, unregister_memory
from persia_planner.tiers.names import Registered
from persia_planner.tiers.plugins import BUILT_IN, Loaded, load, load_configured_at_import, load_missing, plugged
from persia_planner.tiers.tier import Lookups, Runtime, Tier, TierSpec, register, registered, unregister

__all__ = [
    "Holder",
    "Loaded",
    "Lookups",
    "Memory",
    "MemorySpec",
    "Runtime",
    "Tier",
    "TierSpec",
    "local_tiers",
    "plugged",
    "register",
    "register_memory",
    "registered",
    "replica_tier",
    "server_tiers",
    "tier_of_kernel",
    "tiers_of",
    "unregister",
    "unregister_memory",
]


def local_tiers() -> tuple[Tier, ...]:
    """The tiers of a trainer's own memory (fbgemm's kernels), fastest first."""
    return tuple(sorted((t for t in Tier if t.spec.local), key=lambda t: t.spec.speed_rank))


def server_tiers() -> tuple[Tier, ...]:
    """The tiers of the parameter servers (trained asynchronously), fastest first."""
    return tuple(sorted((t for t in Tier if not t.spec.local), key=lambda t: t.spec.speed_rank))


def replica_tier() -> Tier:
    """The tier of data-parallel replicas: the fastest local tier that runs them (``hbm``)."""
    return next(t for t in local_tiers() if Sharding.DATA_PARALLEL in t.spec.shardings)


def tiers_of(sharding: Sharding) -> frozenset[Tier]:
    """The tiers ``sharding`` runs on (validation refuses any other pair)."""
    return frozenset(t for t in Tier if sharding in t.spec.shardings)


def tier_of_kernel() -> Mapping[str, Tier]:
    """TorchRec's compute kernels and the tier whose memory each keeps the rows in (``dense``: a data-parallel
    replica's, in HBM)."""
    kernels: dict[str, Tier] = {}
    for t in Tier:  # a kernel two tiers share reads back as the first registered (a built-in tier)
        if t.spec.torchrec_kernel is not None:
            kernels.setdefault(t.spec.torchrec_kernel, t)
    return {**kernels, "dense": Tier.HBM}


# Last: a tier module may import this package's helpers above.
for _module in BUILT_IN:  # in plan.json's order: Tier iterates in it
    load(_module)
load_configured_at_import()
Registered.on_missing = load_missing
