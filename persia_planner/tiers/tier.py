"""A tier: where a shard's rows live, named by a :class:`Tier` and described by one :class:`TierSpec`.

Every part of the pipeline that treats tiers differently reads the descriptor, never the tier's name: the memory
rule (:func:`persia_planner.placement.shards.tier_bytes`), the lookup terms of the cost model and the lower bound,
the search's offer, validation, the TorchRec kernel a plan exports and what executes the tier at run time. So a new
tier is one new module under ``persia_planner/tiers/`` that registers its descriptor (CONTRIBUTING.md, "Adding a
tier").

``Tier`` is an open registry of names, not an enum: its members compare, hash, sort and print as their names
(``Tier.HBM == "hbm"``), iterate in registration order and pickle by name, as the ``StrEnum`` it replaces did.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar

from persia_planner.kinds import Sharding

__all__ = ["Lookups", "Memory", "Runtime", "Tier", "TierSpec", "register", "registered", "unregister"]


class Memory(enum.StrEnum):
    """The memory that holds a tier's rows (and that its bytes are charged to)."""

    DEVICE = "device"  # the GPU's HBM
    HOST = "host"  # the trainer host's DDR, reached by the GPU through UVM
    SERVER = "server"  # a parameter server's DDR
    DISK = "disk"  # a parameter server's local disk, its hottest rows cached in the server's DDR


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
        rows_in: The memory that holds the rows: charged by :func:`.placement.shards.tier_bytes`, and the device
            kind validation requires (a GPU for device and host memory, a parameter server for server memory).
        lookups: The path that prices a lookup's bytes (the cost model and the lower bound).
        shardings: The sharding types that run on the tier (validation refuses any other pair).
        speed_rank: The order the search offers local tiers in, fastest first.
        torchrec_kernel: TorchRec's compute kernel for the tier: what a plan exports and what DMP runs; None for a
            tier TorchRec does not execute.
        runtime: What executes the tier's shards.
        bandwidth_share: The share of the ``lookups`` path's bandwidth the tier's kernel reaches (1: all of it).
        cached: Whether the hottest rows are cached in the next faster memory: HBM for rows in host memory (hits
            priced at HBM's bandwidth), the server's DDR for rows on its disk. A shard then carries a cache fraction.
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
    bandwidth_share: float = 1.0
    cached: bool = False
    promote_to: str | None = None

    def __post_init__(self) -> None:
        if not self.name or self.name != self.name.lower():
            raise ValueError(f"a tier's name is a non-empty lower-case word, got {self.name!r}")
        if not 0 < self.bandwidth_share <= 1:
            raise ValueError(f"tier {self.name}: bandwidth_share must be in (0, 1], got {self.bandwidth_share}")
        if (self.runtime is Runtime.TORCHREC) != (self.torchrec_kernel is not None):
            raise ValueError(f"tier {self.name}: a tier TorchRec runs names its compute kernel, and only such a tier")

    @property
    def local(self) -> bool:
        """Whether the rows are in a trainer's own memory (HBM or its host's DDR)."""
        return self.rows_in in (Memory.DEVICE, Memory.HOST)

    @property
    def unified_memory(self) -> bool:
        """Whether the GPU reads the rows from host memory (CUDA unified memory: no such kernel on CPU trainers)."""
        return self.rows_in is Memory.HOST and self.runtime is Runtime.TORCHREC


_SPECS: dict[str, TierSpec] = {}


class _Registry(type):
    """Iteration, length and membership of :class:`Tier` over the registered tiers."""

    def __iter__(cls) -> Iterator[Tier]:
        return iter(list(Tier._members.values()))  # a copy: a tier registered meanwhile is not iterated

    def __len__(cls) -> int:
        return len(_SPECS)


class Tier(str, metaclass=_Registry):
    """A registered tier's name. ``Tier("ddr")`` returns the registered member (ValueError for an unknown name), so
    members are compared with ``is`` as enum members are."""

    __slots__ = ()
    _members: ClassVar[dict[str, Tier]] = {}

    HBM: ClassVar[Tier]
    DDR: ClassVar[Tier]
    HBM_CACHE: ClassVar[Tier]
    PS: ClassVar[Tier]
    SSD: ClassVar[Tier]

    def __new__(cls, value: str) -> Tier:
        member = cls._members.get(str(value)) if isinstance(value, str) else None
        if member is None:
            raise ValueError(f"{value!r} is not a valid Tier")
        return member

    @classmethod
    def _member(cls, name: str) -> Tier:
        return str.__new__(cls, name)

    @property
    def value(self) -> str:
        return str.__str__(self)

    @property
    def name(self) -> str:
        return self.value.upper()

    @property
    def spec(self) -> TierSpec:
        """The tier's descriptor."""
        return _SPECS[self.value]

    def __str__(self) -> str:
        return self.value

    def __format__(self, format_spec: str) -> str:
        return format(self.value, format_spec)

    def __repr__(self) -> str:
        return f"<Tier.{self.name}: {self.value!r}>"

    def __reduce__(self) -> tuple[type[Tier], tuple[str]]:
        return Tier, (self.value,)

    def __copy__(self) -> Tier:
        return self

    def __deepcopy__(self, memo: object) -> Tier:
        return self


def register(spec: TierSpec) -> Tier:
    """Add ``spec``'s tier (available as ``Tier.<NAME>`` and by name) and return it.

    Raises:
        ValueError: A tier of that name is registered already.
    """
    if spec.name in _SPECS:
        raise ValueError(f"tier {spec.name!r} is registered already")
    member = Tier._member(spec.name)
    _SPECS[spec.name] = spec
    Tier._members[spec.name] = member
    setattr(Tier, member.name, member)
    return member


def unregister(tier: Tier) -> None:
    """Remove a tier :func:`register` added (a test's own tier)."""
    del _SPECS[tier.value], Tier._members[tier.value]
    delattr(Tier, tier.name)


@contextmanager
def registered(spec: TierSpec) -> Iterator[Tier]:
    """``spec``'s tier, registered for the ``with`` block."""
    tier = register(spec)
    try:
        yield tier
    finally:
        unregister(tier)
