"""The memories a tier's rows (and its caches) can be charged to: each a registered :class:`Memory` with one slot per
device that holds it, its capacity read from the topology by the memory's own rule.

The planner's memory vectors have one slot per (memory, holder) in registration order, the capacity check and the
search compare them slot by slot, and plan.json reports each device's bytes under the memory's ``usage_key``. The
three memories every cluster has are registered here; a tier that brings its own memory (the ``ssd`` tier's disk)
declares it beside the tier, in the tier's module.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from persia_planner.tiers.names import Registered

__all__ = ["DEVICE", "HOST", "SERVER", "Holder", "Memory", "MemorySpec", "register_memory", "unregister_memory"]


class Holder(enum.StrEnum):
    """The devices that hold a memory: one slot of it per such device."""

    GPU = "gpu"  # each trainer device (its HBM)
    HOST = "host"  # each trainer host (its DDR, shared by its GPUs)
    SERVER = "server"  # each parameter server


@dataclass(frozen=True)
class MemorySpec:
    """One memory kind.

    Attributes:
        name: Its name (lower case): the key of its slots, and of a topology's ``memories:`` entries.
        holder: Which devices hold one slot of it each.
        label: How a report names it ("PS DDR").
        usage_key: The key of its bytes in plan.json's per-device ``usage`` (two memories of different holders may
            share one: a trainer host's and a server's DDR are both ``ddr_bytes``).
        capacity: ``(topology, device) -> bytes`` the planner may fill on ``device`` (a GPU, a trainer host or a
            server as the topology describes it). None: the device's ``memories[name]`` from topology.yaml (0 where
            absent), for a memory no built-in field describes.
        noun: How a message names it on one device ("ps0's disk"); None: its name.
        declared_as: The topology entry that gives a device some of it ("an ssd: disk"); None: a ``memories:``
            entry.
        fix: What to add to the topology where the devices lack it; None: a ``memories:`` entry.
    """

    name: str
    holder: Holder
    label: str
    usage_key: str
    capacity: Callable[[Any, Any], int] | None = None
    noun: str | None = None
    declared_as: str | None = None
    fix: str | None = None

    @property
    def short_name(self) -> str:
        """:attr:`noun`, or the memory's name."""
        return self.noun or self.name

    @property
    def entry(self) -> str:
        """:attr:`declared_as`, or the ``memories:`` entry that declares it."""
        return self.declared_as or f"a 'memories: {{{self.name}: SIZE}}' entry"

    @property
    def how_to_add(self) -> str:
        """:attr:`fix`, or adding the ``memories:`` entry to the holders."""
        return self.fix or f"add 'memories: {{{self.name}: SIZE}}' to the topology's {self.holder.value} entries"

    def capacity_of(self, topology: Any, device: Any) -> int:
        """Bytes the planner may fill of this memory on ``device``."""
        if self.capacity is not None:
            return int(self.capacity(topology, device))
        return int(dict(getattr(device, "memories", ())).get(self.name, 0))


class Memory(Registered):
    """A registered memory's name (``Memory("server")``); ``.spec`` is its :class:`MemorySpec`."""

    __slots__ = ()

    DEVICE: ClassVar[Memory]
    HOST: ClassVar[Memory]
    SERVER: ClassVar[Memory]

    @property
    def spec(self) -> MemorySpec:
        return type(self)._specs[self.value]


def register_memory(spec: MemorySpec) -> Memory:
    """Add ``spec``'s memory (``Memory.<NAME>`` while registered).

    Raises:
        ValueError: A memory of that name is registered already, or one of a GPU has no capacity rule (topology.yaml
            sizes extra memories on hosts only).
    """
    if spec.holder is Holder.GPU and spec.capacity is None:
        raise ValueError(f"memory {spec.name}: a GPU's memory needs a capacity rule (memories: sizes hosts only)")
    return Memory._add(spec.name, spec)


def unregister_memory(memory: Memory) -> None:
    """Remove a memory :func:`register_memory` added (a plugin's, when a test unloads it)."""
    Memory._remove(memory)


DEVICE = register_memory(
    MemorySpec(
        "device", Holder.GPU, "GPU HBM", "hbm_bytes", capacity=lambda topo, gpu: topo.hbm_capacity(gpu), noun="HBM"
    )
)
HOST = register_memory(
    MemorySpec(
        "host", Holder.HOST, "trainer DDR", "ddr_bytes", capacity=lambda topo, host: topo.ddr_capacity(host), noun="DDR"
    )
)
SERVER = register_memory(
    MemorySpec(
        "server", Holder.SERVER, "PS DDR", "ddr_bytes", capacity=lambda topo, ps: topo.ddr_capacity(ps), noun="DDR"
    )
)
