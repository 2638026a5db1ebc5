"""Memory vectors: the bytes a placement keeps in every memory slot of the cluster (each GPU's HBM, each trainer
host's DDR, each parameter server's DDR and disk), laid out by :class:`~persia_planner.cost.terms.Layout`; the
capacity check and the search sum them as the step's load vectors are summed."""

from __future__ import annotations

import numpy as np

from persia_planner.cost.all_to_all import DENSE_MAX_GPUS
from persia_planner.cost.terms import Layout

__all__ = ["MemorySlots"]


class MemorySlots:
    """Builds and reads memory vectors (the cost model's memory side: :class:`.analytic.CostModel` is one).

    Attributes:
        layout: Where each slot is in a vector.
        gpu_host: Per GPU, the index of its host.
    """

    layout: Layout
    gpu_host: np.ndarray

    def memory_vector(
        self,
        hbm: float | np.ndarray = 0.0,
        ddr: float | np.ndarray = 0.0,
        ps: float | np.ndarray = 0.0,
        disk: float | np.ndarray = 0.0,
    ) -> np.ndarray:
        """A memory vector (bytes per slot) from its parts: ``hbm`` per GPU, ``ddr`` per trainer host, ``ps`` (DDR)
        and ``disk`` per server (each a value for every slot of its kind, or one per slot); or its price vector,
        given prices."""
        lay = self.layout
        mem = np.zeros(lay.mem_size)
        mem[lay.hbm] = hbm
        mem[lay.ddr] = ddr
        mem[lay.ps_mem] = ps
        mem[lay.ps_disk] = disk
        return mem

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

    def ps_mem_of(self, mem: np.ndarray) -> np.ndarray:
        """The parameter servers' DDR slots of a memory vector, per server (a view)."""
        return mem[self.layout.ps_mem]
