"""A tier: where a shard's rows live, named by a :class:`Tier` and described by one :class:`TierSpec`.

Every part of the pipeline that treats tiers differently reads the descriptor, never the tier's name: the memories
it charges (:func:`persia_planner.placement.shards.tier_bytes`, by the registered :class:`.memory.Memory` its rows and
its cache are in), the lookup terms of the cost model and the lower bound, the search's offer, validation, the
TorchRec kernel a plan exports and the store or kernel that executes the tier at run time. So a new tier is one new
module that declares its descriptor (and any memory of its own) and one line that registers it
(:mod:`persia_planner.tiers.plugins`; CONTRIBUTING.md, "Adding a tier").

``Tier`` is an open registry of names (:class:`.names.Registered`), not an enum: its members compare, hash, sort and
print as their names (``Tier.HBM == "hbm"``), iterate in registration order and pickle by name.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar

from persia_planner.kinds import Sharding
from persia_planner.tiers.memory import Holder, Memory
from persia_planner.tiers.names import Registered

__all__ = ["Lookups", "Memory", "Runtime", "Tier", "TierSpec", "register", "registered", "unregister"]


class Lookups(enum.StrEnum):
    """The path a tier's lookups read their bytes through (which bandwidth prices them)."""

    HBM = "hbm"  # the GPU's own memory
    UVM = "uvm"  # host DDR over PCIe
    SERVER = "server"  # requests to the parameter servers, off the synchronous step


class Runtime(enum.StrEnum):
    """What executes a tier's shards."""

    TORCHREC = "torchrec"  # TorchRec's DMP, with the tier's compute kernel (fbgemm's TBE)
    PARAMETER_SERVER = "parameter_server"  # the embedding parameter servers, trained asynchronously


@dataclass(frozen=True)
class TierSpec:
    """Everything the planner and the runtime know of one tier.

    Attributes:
        name: The tier's name in plan.json and model.yaml (lower case).
        summary: One line for a reader: what the tier is.
        rows_in: The memory that holds the rows (charged by :func:`.placement.shards.tier_bytes`); its holder is
            the device kind validation requires (a GPU for device and host memory, a parameter server for a
            server's memories).
        lookups: The path that prices a lookup's bytes (the cost model and the lower bound).
        shardings: The sharding types that run on the tier (validation refuses any other pair).
        speed_rank: The order the search offers tiers in, fastest first.
        torchrec_kernel: TorchRec's compute kernel for the tier: what a plan exports and what DMP runs; None for a
            tier TorchRec does not execute.
        runtime: What executes the tier's shards.
        store: For a tier the parameter servers run, the store that keeps its rows: ``"module:name"`` of a
            callable ``(TableConfig, server_index) -> store`` the servers import when they create the table
            (:func:`persia_planner.modules.ps.server_state.make_store`); None for a tier TorchRec runs.
        bandwidth_share: The share of the ``lookups`` path's bandwidth the tier's kernel reaches (1: all of it).
        cache_in: The faster memory the hottest rows are cached in (None: no cache): HBM for rows in host memory
            (hits priced at HBM's bandwidth), the server's DDR for rows on its disk. A shard then carries a cache
            fraction.
        promote_to: The faster tier the local search tries to move a table on this tier to, by evicting colder
            tables there (None: none).
    """

    name: str
    summary: str
    rows_in: Memory
    lookups: Lookups
    shardings: frozenset[Sharding]
    speed_rank: int
    torchrec_kernel: str | None = None
    runtime: Runtime = Runtime.TORCHREC
    store: str | None = None
    bandwidth_share: float = 1.0
    cache_in: Memory | None = None
    promote_to: str | None = None

    def __post_init__(self) -> None:
        if not self.name or self.name != self.name.lower():
            raise ValueError(f"a tier's name is a non-empty lower-case word, got {self.name!r}")
        if not 0 < self.bandwidth_share <= 1:
            raise ValueError(f"tier {self.name}: bandwidth_share must be in (0, 1], got {self.bandwidth_share}")
        if (self.runtime is Runtime.TORCHREC) != (self.torchrec_kernel is not None):
            raise ValueError(f"tier {self.name}: a tier TorchRec runs names its compute kernel, and only such a tier")
        if (self.runtime is Runtime.PARAMETER_SERVER) != (self.store is not None and ":" in self.store):
            raise ValueError(
                f"tier {self.name}: a tier the servers run names its store as 'module:name', and only such a tier"
            )
        holders = {self.rows_in.spec.holder} | ({self.cache_in.spec.holder} if self.cache_in is not None else set())
        if self.runtime is Runtime.TORCHREC and not {self.rows_in, self.cache_in} <= {Memory.DEVICE, Memory.HOST, None}:
            # fbgemm's kernels allocate in device or (managed) host memory, no other
            raise ValueError(f"tier {self.name}: a tier TorchRec runs keeps its rows in device or host memory")
        if self.runtime is Runtime.PARAMETER_SERVER and holders != {Holder.SERVER}:
            raise ValueError(
                f"tier {self.name}: a tier the servers run keeps its rows (and its cache) in a server's memory"
            )

    @property
    def local(self) -> bool:
        """Whether the rows are in a trainer's own memory (its GPU's or its host's)."""
        return self.rows_in.spec.holder is not Holder.SERVER

    @property
    def cached(self) -> bool:
        """Whether the hottest rows are cached in a faster memory (a shard carries a cache fraction)."""
        return self.cache_in is not None

    @property
    def unified_memory(self) -> bool:
        """Whether the GPU reads the rows from host memory (CUDA unified memory: no such kernel on CPU trainers)."""
        return self.rows_in.spec.holder is Holder.HOST and self.runtime is Runtime.TORCHREC


class Tier(Registered):
    """A registered tier's name. ``Tier("ddr")`` returns the registered member (ValueError for an unknown name), so
    members are compared with ``is`` as enum members are; ``.spec`` is its :class:`TierSpec`."""

    __slots__ = ()

    HBM: ClassVar[Tier]
    DDR: ClassVar[Tier]
    HBM_CACHE: ClassVar[Tier]
    PS: ClassVar[Tier]
    SSD: ClassVar[Tier]

    @property
    def spec(self) -> TierSpec:
        """The tier's descriptor."""
        return type(self)._specs[self.value]


def register(spec: TierSpec) -> Tier:
    """Add ``spec``'s tier (available as ``Tier.<NAME>`` and by name) and return it.

    Raises:
        ValueError: A tier of that name is registered already.
    """
    return Tier._add(spec.name, spec)


def unregister(tier: Tier) -> None:
    """Remove a tier :func:`register` added (a test's own tier)."""
    Tier._remove(tier)


@contextmanager
def registered(spec: TierSpec) -> Iterator[Tier]:
    """``spec``'s tier, registered for the ``with`` block."""
    tier = register(spec)
    try:
        yield tier
    finally:
        unregister(tier)
