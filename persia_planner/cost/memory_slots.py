"""Memory vectors: the bytes a placement keeps in every memory slot of the cluster (one slot per registered memory
and device that holds it: each GPU's HBM, each trainer host's DDR, each parameter server's DDR and disk), laid out
by :class:`~persia_planner.cost.terms.Layout`; the capacity check and the search sum them as the step's load vectors
are summed."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from persia_planner.cost.all_to_all import DENSE_MAX_GPUS
from persia_planner.cost.terms import Layout
from persia_planner.placement.shards import Storage
from persia_planner.tiers import Holder, Memory

__all__ = ["MemorySlots"]


class MemorySlots:
    """Builds and reads memory vectors (the cost model's memory side: :class:`.analytic.CostModel` is one).

    Attributes:
        layout: Where each slot is in a vector.
        gpu_host: Per GPU, the index of its host.
    """

    layout: Layout
    gpu_host: np.ndarray

    def memory_vector(self, by_memory: Mapping[Memory, float | np.ndarray] | None = None) -> np.ndarray:
        """A memory vector (bytes per slot) from its parts: per memory, a value for every slot of it or one per slot
        (every other slot 0); or its price vector, given prices."""
        lay = self.layout
        mem = np.zeros(lay.mem_size)
        for memory, value in (by_memory or {}).items():
            mem[lay.slots(memory)] = value
        return mem

    def charge(self, mem: np.ndarray, storage: Storage, *, gpu: int | None = None, server: int | None = None) -> None:
        """Add a shard's ``storage`` to ``mem``: each memory's bytes in the slot of the device that holds it for the
        shard (its GPU ``gpu``, that GPU's host, or the server ``server``)."""
        lay = self.layout
        for memory, size in storage.by_memory:
            holder = memory.spec.holder
            if holder is Holder.SERVER:
                assert server is not None, f"a shard on a GPU holds no {memory} memory"
                index = server
            else:
                assert gpu is not None, f"a shard on a server holds no {memory} memory"
                index = gpu if holder is Holder.GPU else int(self.gpu_host[gpu])
            mem[lay.slots(memory).start + index] += size

    def shard_memory(self, gpus: np.ndarray, hbm: float | np.ndarray, ddr: float | np.ndarray) -> np.ndarray:
        """Memory vectors, one row per GPU in ``gpus``, of a shard on it: ``hbm`` bytes in its HBM and ``ddr`` in its
        host's DDR (each one value, or one per row)."""
        lay = self.layout
        mem = np.zeros((len(gpus), lay.mem_size))
        rows = np.arange(len(gpus))
        mem[rows, lay.hbm.start + gpus] = hbm
        mem[rows, lay.ddr.start + self.gpu_host[gpus]] += ddr
        return mem

    def shard_memory_sum(self, gpus: np.ndarray, hbm: float | np.ndarray, ddr: float | np.ndarray) -> np.ndarray:
        """:meth:`shard_memory`'s rows summed, without building them beyond
        :data:`persia_planner.cost.all_to_all.DENSE_MAX_GPUS`."""
        if len(gpus) <= DENSE_MAX_GPUS:
            return self.shard_memory(gpus, hbm, ddr).sum(axis=0)
        lay = self.layout
        mem = np.zeros(lay.mem_size)
        np.add.at(mem, lay.hbm.start + gpus, np.broadcast_to(hbm, gpus.shape))
        np.add.at(mem, lay.ddr.start + self.gpu_host[gpus], np.broadcast_to(ddr, gpus.shape))
        return mem

    def hbm_of(self, mem: np.ndarray) -> np.ndarray:
        """The HBM slots of a memory vector, per GPU (a view)."""
        return mem[self.layout.hbm]

    def ddr_of(self, mem: np.ndarray) -> np.ndarray:
        """The trainer DDR slots of a memory vector, per host (a view)."""
        return mem[self.layout.ddr]

    def slots_of(self, mem: np.ndarray, memory: Memory) -> np.ndarray:
        """The slots of ``memory`` in a memory vector, one per device that holds it (a view)."""
        return mem[self.layout.slots(memory)]
