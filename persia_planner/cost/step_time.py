"""The step: what one training step takes given a load vector, its parts, and which resource sets it
(:mod:`persia_planner.cost.analytic` builds the load vectors and the :class:`StepModel`).

A load vector holds, for every resource, the milliseconds of work per step placed on it
(:class:`~persia_planner.cost.terms.Layout`). Per GPU ``g`` of host ``h(g)``, with the staleness bound ``K``:

    sync_g  = max(emb_g, ddr_host(g)) + nvlink_g + nic_sync_host(g) + dense_g + allreduce_g
    async_g = max(pcie_g, nic_async_host(g), max_p ps_nic_p, max_p ps_ddr_p, switch) + rtt / max(K, 1)
    step_g  = sync_g + async_g            if staleness K == 0
            = max(sync_g, async_g)        if K >= 1 (async work overlaps the dense step)
    step    = max(max_g step_g, max_h (nic_sync_h + nic_async_h))

docs/design/cost_model.md explains the terms.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from persia_planner.cost.terms import Cost, Estimate, Layout

__all__ = ["MS", "StepModel"]

MS = 1e3  # seconds -> milliseconds


@dataclass(frozen=True, eq=False)
class StepModel:
    """Reads load vectors as steps: their time, its parts, and what sets it
    (:class:`persia_planner.cost.analytic.CostModel` builds it from the step's fixed parts).

    Attributes:
        layout: Index ranges of the load vector.
        gpu_host: Per GPU, the index of its host.
        gpus_per_host: Per host, how many GPUs it has.
        staleness: The model's staleness bound ``K``.
        batch: The global batch (samples per step).
        dense_ms: Per GPU, the dense part's time, the framework's fixed time per step included.
        dense_grad_bytes: Bytes of the dense gradients, all-reduced every step.
        allreduce_ms_per_byte: Per GPU, the all-reduce's time per gradient byte.
        allreduce_latency_ms: The all-reduce's latency per step.
        a2a_fixed_ms: The all-to-alls' fixed time per step.
        rtt_ms: Round trip from a trainer to the farthest parameter server.
    """

    layout: Layout
    gpu_host: np.ndarray
    gpus_per_host: np.ndarray
    staleness: int
    batch: float
    dense_ms: np.ndarray
    dense_grad_bytes: float
    allreduce_ms_per_byte: np.ndarray
    allreduce_latency_ms: float
    a2a_fixed_ms: float
    rtt_ms: float

    @functools.cached_property
    def fixed_sync_ms(self) -> np.ndarray:
        """Per GPU, the sync time of an empty plan: the dense part, its all-reduce and the fixed costs."""
        return (
            self.dense_ms
            + self.dense_grad_bytes * self.allreduce_ms_per_byte
            + self.allreduce_latency_ms
            + self.a2a_fixed_ms
        )

    @functools.cached_property
    def _step_columns(self) -> np.ndarray:
        # gpu_step_ms's columns in one gather (per GPU: emb, its host's DDR, nvlink, its host's sync NIC, pcie, its
        # host's async NIC): the search calls it thousands of times on a few rows, where each numpy call's overhead
        # is most of the cost.
        lay, hosts = self.layout, self.gpu_host
        return np.concatenate(
            [
                np.arange(lay.emb.start, lay.emb.stop),
                lay.host_ddr.start + hosts,
                np.arange(lay.nvlink.start, lay.nvlink.stop),
                lay.nic_sync.start + hosts,
                np.arange(lay.pcie.start, lay.pcie.stop),
                lay.nic_async.start + hosts,
            ]
        )

    @functools.cached_property
    def _async_rtt_ms(self) -> float:
        return self.rtt_ms / max(self.staleness, 1)

    @functools.cached_property
    def _grid(self) -> tuple[int, int] | None:
        # Hosts x GPUs when every host has as many GPUs, numbered host by host: then gpu_step_ms broadcasts a host's
        # figures over its GPUs instead of gathering them.
        G, H = self.layout.n_gpus, self.layout.n_hosts
        per_host = int(self.gpus_per_host[0]) if H else 0
        if G and (self.gpus_per_host == per_host).all() and (self.gpu_host == np.arange(G) // per_host).all():
            return (H, per_host)
        return None

    @functools.cached_property
    def _fixed_sync_grid(self) -> np.ndarray:
        return self.fixed_sync_ms.reshape(self._grid)

    @functools.cached_property
    def _per_byte_grid(self) -> np.ndarray:
        return self.allreduce_ms_per_byte.reshape(self._grid)

    def step_parts(self, loads: np.ndarray) -> dict[str, np.ndarray]:
        """Per-GPU parts of the step for a batch of load vectors (shape ``(k, L)`` -> arrays ``(k, G)``)."""
        lay = self.layout
        loads = np.atleast_2d(loads)
        hosts = self.gpu_host
        emb = np.maximum(loads[:, lay.emb], loads[:, lay.host_ddr][:, hosts])
        a2a = loads[:, lay.nvlink] + loads[:, lay.nic_sync][:, hosts] + self.a2a_fixed_ms
        grad_bytes = self.dense_grad_bytes + loads[:, lay.dp_bytes]
        allreduce = grad_bytes[:, None] * self.allreduce_ms_per_byte[None, :] + self.allreduce_latency_ms
        dense = np.broadcast_to(self.dense_ms, emb.shape)
        sync = emb + a2a + dense + allreduce
        async_ = self._async(loads)
        step = sync + async_ if self.staleness == 0 else np.maximum(sync, async_)
        return {
            "emb": emb,
            "a2a": a2a,
            "dense": dense,
            "allreduce": allreduce,
            "sync": sync,
            "async": async_,
            "step": step,
        }

    def _async(self, loads: np.ndarray) -> np.ndarray:
        """Per-GPU async (parameter-server) time, ``(k, L)`` -> ``(k, G)``."""
        lay = self.layout
        if lay.n_servers == 0:
            return np.zeros((loads.shape[0], lay.n_gpus))
        shared = np.maximum(
            np.maximum(loads[:, lay.ps_nic].max(axis=1), loads[:, lay.ps_ddr].max(axis=1)), loads[:, lay.switch]
        )
        has_ps = loads[:, lay.ps_ddr].sum(axis=1) > 0
        rtt = np.where(has_ps, self.rtt_ms / max(self.staleness, 1), 0.0)
        async_ = np.maximum(loads[:, lay.pcie], loads[:, lay.nic_async][:, self.gpu_host])
        return np.maximum(async_, shared[:, None]) + rtt[:, None]

    def gpu_step_ms(self, loads: np.ndarray) -> np.ndarray:
        """Per-GPU step time only (the search's hot path): ``(k, L)`` -> ``(k, G)``. Same formula as
        :meth:`step_parts`, in the same order of operations (the same bits), with fewer numpy calls: the search
        calls it thousands of times on a few rows, where each call's overhead is most of the cost."""
        lay = self.layout
        k = loads.shape[0]
        grid = self._grid
        if grid is None:  # a host's resources gathered onto each of its GPUs
            G = lay.n_gpus
            x = loads[:, self._step_columns]
            emb, ddr, nvlink, nic_sync = x[:, :G], x[:, G : 2 * G], x[:, 2 * G : 3 * G], x[:, 3 * G : 4 * G]
            pcie, nic_async = x[:, 4 * G : 5 * G], x[:, 5 * G :]
            fixed, per_byte, dp = self.fixed_sync_ms, self.allreduce_ms_per_byte, loads[:, lay.dp_bytes, None]
        else:  # hosts of equal GPU counts in GPU order: per host x GPU of it, a host's resources broadcast
            emb = loads[:, lay.emb].reshape(k, *grid)
            ddr = loads[:, lay.host_ddr, None]
            nvlink = loads[:, lay.nvlink].reshape(k, *grid)
            nic_sync = loads[:, lay.nic_sync, None]
            pcie = loads[:, lay.pcie].reshape(k, *grid)
            nic_async = loads[:, lay.nic_async, None]
            fixed, per_byte = self._fixed_sync_grid, self._per_byte_grid
            dp = loads[:, lay.dp_bytes, None, None]
        sync = np.maximum(emb, ddr)
        sync += nvlink
        sync += nic_sync
        sync += fixed
        sync += dp * per_byte
        if lay.n_servers:
            # _async: the servers' NICs and DDR and the switch are contiguous in the load vector.
            shared = loads[:, lay.ps_nic.start : lay.switch + 1].max(axis=1)
            async_ = np.maximum(pcie, nic_async)
            np.maximum(async_, shared.reshape((k,) + (1,) * (async_.ndim - 1)), out=async_)
            has_ps = loads[:, lay.ps_ddr].sum(axis=1) > 0
            async_ += np.where(has_ps, self._async_rtt_ms, 0.0).reshape((k,) + (1,) * (async_.ndim - 1))
            if self.staleness == 0:
                sync += async_
            else:
                np.maximum(sync, async_, out=sync)
        return sync.reshape(k, lay.n_gpus)

    def step_ms(self, loads: np.ndarray) -> np.ndarray:
        """Step time (ms) for a batch of load vectors, shape ``(k, L)`` -> ``(k,)``."""
        lay = self.layout
        loads = np.atleast_2d(loads)
        gpu_step = self.gpu_step_ms(loads).max(axis=1)
        nic = (loads[:, lay.nic_sync] + loads[:, lay.nic_async]).max(axis=1, initial=0.0)
        return np.maximum(gpu_step, nic)

    def estimate(self, loads: np.ndarray) -> Estimate:
        """Score one load vector."""
        lay = self.layout
        parts = {k: v[0] for k, v in self.step_parts(loads[None, :]).items()}
        step = float(self.step_ms(loads[None, :])[0])
        server = np.maximum(loads[lay.ps_nic], loads[lay.ps_ddr])
        return Estimate(
            step,
            parts,
            loads[lay.nic_sync] + loads[lay.nic_async],
            server,
            self.batch / step * MS if step > 0 else math.inf,
        )

    def table_cost(self, loads: np.ndarray) -> Cost:
        """Summarise a table's load vector as a :class:`Cost` (sync GPU-ms averaged over GPUs, async bottleneck)."""
        lay = self.layout
        per_gpu = loads[lay.emb] + loads[lay.nvlink] + loads[lay.nic_sync][self.gpu_host]
        per_gpu = per_gpu + loads[lay.dp_bytes] * self.allreduce_ms_per_byte
        async_ms = max(loads[lay.ps_nic].max(initial=0.0), loads[lay.ps_ddr].max(initial=0.0), loads[lay.switch])
        return Cost(float(per_gpu.mean()), float(async_ms))

    def resource_ms(self, loads: np.ndarray) -> np.ndarray:
        """Time of every resource a step waits for, ``(k, L)`` -> ``(k, G + H)``: each GPU's step (the first ``G``
        columns, :meth:`gpu_step_ms`), then each trainer host's NIC (sync and async traffic share it)."""
        lay = self.layout
        out = np.empty((loads.shape[0], lay.n_gpus + lay.n_hosts))
        out[:, : lay.n_gpus] = self.gpu_step_ms(loads)
        np.add(loads[:, lay.nic_sync], loads[:, lay.nic_async], out=out[:, lay.n_gpus :])
        return out

    def bottleneck_loads(self, loads: np.ndarray, tables: np.ndarray) -> np.ndarray:
        """How much each row of ``tables`` (load vectors that sum into ``loads``) loads the resource that sets
        ``loads``' step time, in ms: a saturated NIC, or else the slowest GPU's longer path (the parameter
        servers' side or its own sync work, all-reduced bytes priced at its all-reduce rate)."""
        lay = self.layout
        parts = self.step_parts(loads)
        g = int(np.argmax(parts["step"][0]))
        host = self.gpu_host[g]
        nic_total = loads[lay.nic_sync] + loads[lay.nic_async]
        if nic_total.max(initial=0.0) >= parts["step"][0][g]:
            h = int(np.argmax(nic_total))
            columns = np.r_[lay.nic_sync.start + h, lay.nic_async.start + h]
        elif parts["async"][0][g] >= parts["sync"][0][g]:
            columns = np.r_[lay.ps_nic, lay.ps_ddr, lay.switch, lay.nic_async.start + host, lay.pcie.start + g]
        else:
            columns = np.r_[
                lay.emb.start + g,
                lay.nvlink.start + g,
                lay.nic_sync.start + host,
                lay.host_ddr.start + host,
                lay.dp_bytes,
            ]
        unit = np.where(columns == lay.dp_bytes, self.allreduce_ms_per_byte[g], 1.0)
        return tables[:, columns] @ unit
