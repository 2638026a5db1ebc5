"""The cost model's value objects: a table's :class:`Cost`, the :class:`Layout` of the load and memory vectors, and
a scored plan's :class:`Estimate` (see :mod:`persia_planner.cost.analytic`)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from persia_planner.tiers import Holder, Memory

__all__ = ["Cost", "Estimate", "Layout"]


@dataclass(frozen=True)
class Cost:
    """Work a table adds per step.

    Attributes:
        sync_ms: GPU time on the synchronous critical path, averaged over GPUs.
        async_ms: Time on the busiest asynchronous (parameter-server) resource.
    """

    sync_ms: float = 0.0
    async_ms: float = 0.0

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.sync_ms + other.sync_ms, self.async_ms + other.async_ms)

    def __sub__(self, other: Cost) -> Cost:
        return Cost(self.sync_ms - other.sync_ms, self.async_ms - other.async_ms)

    def __mul__(self, factor: float) -> Cost:
        return Cost(self.sync_ms * factor, self.async_ms * factor)

    @property
    def total_ms(self) -> float:
        return self.sync_ms + self.async_ms


@dataclass(frozen=True)
class Layout:
    """Index ranges of the load vector (time, ms) and the memory vector (bytes)."""

    n_gpus: int
    n_hosts: int
    n_servers: int

    @functools.cached_property
    def emb(self) -> slice:
        return slice(0, self.n_gpus)

    @functools.cached_property
    def nvlink(self) -> slice:
        return slice(self.n_gpus, 2 * self.n_gpus)

    @functools.cached_property
    def pcie(self) -> slice:
        return slice(2 * self.n_gpus, 3 * self.n_gpus)

    def _host(self, k: int) -> slice:
        start = 3 * self.n_gpus + k * self.n_hosts
        return slice(start, start + self.n_hosts)

    @functools.cached_property
    def host_ddr(self) -> slice:
        return self._host(0)

    @functools.cached_property
    def nic_sync(self) -> slice:
        return self._host(1)

    @functools.cached_property
    def nic_async(self) -> slice:
        return self._host(2)

    def _server(self, k: int) -> slice:
        start = 3 * self.n_gpus + 3 * self.n_hosts + k * self.n_servers
        return slice(start, start + self.n_servers)

    @functools.cached_property
    def ps_nic(self) -> slice:
        return self._server(0)

    @functools.cached_property
    def ps_ddr(self) -> slice:
        return self._server(1)

    @functools.cached_property
    def switch(self) -> int:
        return 3 * self.n_gpus + 3 * self.n_hosts + 2 * self.n_servers

    @functools.cached_property
    def dp_bytes(self) -> int:
        """Not a time: gradient bytes of data-parallel tables, all-reduced with the dense gradients."""
        return self.switch + 1

    @functools.cached_property
    def size(self) -> int:
        return self.dp_bytes + 1

    # memory vector: one slot per (memory, device holding it), the memories in registration order
    @functools.cached_property
    def memories(self) -> tuple[Memory, ...]:
        """The memories a vector has slots of: those registered when the layout was first asked (a tier module
        loaded later does not change a cost model built before)."""
        return tuple(Memory)

    def holders(self, holder: Holder) -> int:
        """How many devices hold a memory of ``holder``'s kind."""
        return {Holder.GPU: self.n_gpus, Holder.HOST: self.n_hosts, Holder.SERVER: self.n_servers}[holder]

    @functools.cached_property
    def _slots(self) -> dict[Memory, slice]:
        found, start = {}, 0
        for memory in self.memories:
            size = self.holders(memory.spec.holder)
            found[memory], start = slice(start, start + size), start + size
        return found

    def slots(self, memory: Memory) -> slice:
        """The slots of ``memory``, one per device that holds it (in the topology's order).

        Raises:
            KeyError: ``memory`` was registered after this layout was made.
        """
        return self._slots[memory]

    @functools.cached_property
    def hbm(self) -> slice:
        """The GPUs' memory (device memory: where fbgemm's kernels keep rows and caches)."""
        return self.slots(Memory.DEVICE)

    @functools.cached_property
    def ddr(self) -> slice:
        """The trainer hosts' memory (host memory: fbgemm's managed rows)."""
        return self.slots(Memory.HOST)

    @functools.cached_property
    def ps_mem(self) -> slice:
        """The parameter servers' DDR (their stores' memory)."""
        return self.slots(Memory.SERVER)

    @functools.cached_property
    def mem_size(self) -> int:
        return sum(self.holders(m.spec.holder) for m in self.memories)


@dataclass(frozen=True)
class Estimate:
    """A scored plan: the step time and its parts per GPU (ms).

    Attributes:
        step_ms: Estimated time of one training step (the slowest GPU's critical path, or a saturated NIC).
        per_gpu: Arrays over GPUs: ``emb``, ``a2a``, ``dense``, ``allreduce``, ``sync``, ``async``, ``step``.
        host_nic_ms: Per trainer host, NIC time (sync + async).
        server_ms: Per parameter server, its busiest resource (NIC or DDR).
        samples_per_s: Global batch / step time.
    """

    step_ms: float
    per_gpu: Mapping[str, np.ndarray]
    host_nic_ms: np.ndarray
    server_ms: np.ndarray
    samples_per_s: float

    def slowest_gpu_terms(self) -> dict[str, float]:
        """The parts of the slowest GPU's step (ms), named as a run's measured step breakdown names them:
        ``embedding``, ``all_to_all``, ``dense``, ``all_reduce`` and ``ps`` (the parameter servers' share)."""
        g = int(np.argmax(self.per_gpu["step"]))
        names = {"emb": "embedding", "a2a": "all_to_all", "dense": "dense", "allreduce": "all_reduce", "async": "ps"}
        return {name: float(self.per_gpu[key][g]) for key, name in names.items() if key in self.per_gpu}
