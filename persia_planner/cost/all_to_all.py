"""The all-to-all pattern of a shard's pooled output: ms on every resource per byte, by the GPU that owns the shard.

A dense GPUs x resources matrix of it is quadratic in the cluster (80,000 GPUs: 170 GB), yet each row is one
host's NVLink entries, one entry per host NIC that is the same for every owner but its own host's, and nothing
else. :class:`A2APattern` builds the rows of the GPUs asked for, and sums of rows without building them.

Up to :data:`DENSE_MAX_GPUS` GPUs the sums add the rows themselves, in the order the cost model always has, so the
figures of plans on today's clusters keep every bit; beyond, the same sums come from the pattern's structure in
time linear in the cluster (equal up to rounding).
"""

from __future__ import annotations

import numpy as np

from persia_planner.cost.step_time import Layout

__all__ = ["DENSE_MAX_GPUS", "A2APattern"]

# Up to this many GPUs sums over GPUs add dense rows (bit for bit what they always were); beyond, the structure.
DENSE_MAX_GPUS = 1024
# Every GPU's rows are built once and kept where they are at most this many entries (8 MB): the search asks for a
# few candidates' rows tens of thousands of times, and indexing kept rows costs a tenth of building them.
KEPT_MAX_ENTRIES = 1 << 20


class A2APattern:
    """The owner GPUs' all-to-all rows (forward + backward, full-duplex links: a link's time is (sent + received)
    / 2 / bandwidth; the owner sends each other GPU 1/G of the output forward and receives as much backward).

    Args:
        layout: The load vector's layout.
        gpu_host: The host of each GPU.
        gpus_per_host: GPUs of each host.
        nvlink_bw: Effective NVLink bandwidth of each GPU (bytes/ms).
        nic_bw: Effective NIC bandwidth of each host (bytes/ms).
    """

    def __init__(
        self, layout: Layout, gpu_host: np.ndarray, gpus_per_host: np.ndarray, nvlink_bw: np.ndarray, nic_bw: np.ndarray
    ):
        self.layout = layout
        self.gpu_host, self.gpus_per_host = gpu_host, gpus_per_host
        self.nvlink_bw, self.nic_bw = nvlink_bw, nic_bw
        self.n_g = gpus_per_host[gpu_host]
        order = np.argsort(gpu_host, kind="stable")
        self.host_gpus = np.split(order, np.cumsum(gpus_per_host)[:-1]) if len(gpus_per_host) else []
        # Every owner's NIC entries but its own host's.
        self.nic_common = gpus_per_host / layout.n_gpus / nic_bw
        self._kept: tuple[np.ndarray, np.ndarray] | None = None
        if 0 < layout.n_gpus * layout.size <= KEPT_MAX_ENTRIES:
            every = np.arange(layout.n_gpus)
            plain = self._build(every)
            self._kept = (plain, self.twrw_of(plain, every))

    def rows(self, gpus: np.ndarray, twrw: bool = False) -> np.ndarray:
        """The pattern of each GPU in ``gpus`` (one row each). ``twrw``: table-row-wise, whose partial sums are
        reduce-scattered inside the host over NVLink first; the host's reduced output then leaves like a table-wise
        shard's, split over the host's GPUs."""
        gpus = np.asarray(gpus, dtype=np.intp)
        if self._kept is not None:
            return self._kept[1 if twrw else 0][gpus]  # a copy: the caller may scale it in place
        out = self._build(gpus)
        return self.twrw_of(out, gpus) if twrw else out

    def _build(self, gpus: np.ndarray) -> np.ndarray:
        """The plain rows of ``gpus``, built from the links' bandwidths."""
        lay, G, n_g = self.layout, self.layout.n_gpus, self.n_g
        hosts = self.gpu_host[gpus]
        out = np.zeros((len(gpus), lay.size))
        idx = np.arange(len(gpus))
        nvl, nic = lay.nvlink, lay.nic_sync
        if len(gpus):
            mates = [self.host_gpus[h] for h in hosts.tolist()]
            cols = np.concatenate(mates)
            out[np.repeat(idx, [len(m) for m in mates]), nvl.start + cols] = 1.0 / G / self.nvlink_bw[cols]
        out[idx, nvl.start + gpus] = (n_g[gpus] - 1) / G / self.nvlink_bw[gpus]
        out[:, nic] = self.nic_common
        out[idx, nic.start + hosts] = (G - n_g[gpus]) / G / self.nic_bw[hosts]
        return out

    def twrw_of(self, rows: np.ndarray, gpus: np.ndarray) -> np.ndarray:
        """The table-row-wise rows of ``gpus`` from their plain :meth:`rows` (without building those again)."""
        n_g, idx = self.n_g[gpus], np.arange(len(gpus))
        out = rows / n_g[:, None]
        out[idx, self.layout.nvlink.start + gpus] += (n_g - 1) / n_g / self.nvlink_bw[gpus]
        return out

    def gpu_sum(self) -> np.ndarray:
        """Per owner GPU, the sum over GPUs of the sync time a byte of its output adds (each GPU's sync time
        includes its host's NIC time)."""
        lay, G = self.layout, self.layout.n_gpus
        if G <= DENSE_MAX_GPUS:
            visible = np.zeros(lay.size)
            visible[lay.nvlink] = 1.0
            visible[lay.nic_sync] = self.gpus_per_host
            return self.rows(np.arange(G)) @ visible
        h, n_g, bw = self.gpu_host, self.n_g, self.nvlink_bw
        mates = np.bincount(h, weights=1.0 / G / bw, minlength=len(self.gpus_per_host))[h]
        nvl = mates - 1.0 / G / bw + (n_g - 1) / G / bw
        own = self.gpus_per_host[h] * self.nic_common[h]
        nic = float(self.gpus_per_host @ self.nic_common) - own + n_g * (G - n_g) / G / self.nic_bw[h]
        return nvl + nic

    def nic_dot(self, weights: np.ndarray) -> np.ndarray:
        """Per owner GPU, its pattern's NIC entries weighted by ``weights`` (one per host) and summed."""
        G, h = self.layout.n_gpus, self.gpu_host
        if G <= DENSE_MAX_GPUS:
            return self.rows(np.arange(G))[:, self.layout.nic_sync] @ weights
        own = (G - self.n_g) / G / self.nic_bw[h]
        return float(self.nic_common @ weights) + (own - self.nic_common[h]) * weights[h]

    def weighted_sum(self, gpus: np.ndarray, plain: np.ndarray, twrw: np.ndarray | None = None) -> np.ndarray:
        """The sum over ``i`` of ``plain[i]`` times the row of ``gpus[i]``, plus ``twrw[i]`` times its table-row-wise
        row, from the structure (no rows built): time linear in the cluster."""
        lay, G = self.layout, self.layout.n_gpus
        H = len(self.gpus_per_host)
        n_g, bw = self.n_g, self.nvlink_bw
        gpus = np.asarray(gpus, dtype=np.intp)
        plain = np.broadcast_to(np.asarray(plain, dtype=float), gpus.shape)
        weight = plain.copy()
        out = np.zeros(lay.size)
        if twrw is not None:
            twrw = np.broadcast_to(np.asarray(twrw, dtype=float), gpus.shape)
            weight += twrw / n_g[gpus]
            np.add.at(out, lay.nvlink.start + gpus, twrw * (n_g[gpus] - 1) / n_g[gpus] / bw[gpus])
        per_gpu = np.bincount(gpus, weights=weight, minlength=G)
        per_host = np.bincount(self.gpu_host[gpus], weights=weight, minlength=H)
        # NVLink: 1/G of the output to (and from) every mate; the owner's own link carries the n - 1 others'.
        out[lay.nvlink] += per_host[self.gpu_host] / G / bw + per_gpu * (n_g - 2) / G / bw
        gph = self.gpus_per_host
        out[lay.nic_sync] += (per_gpu.sum() - per_host) * self.nic_common + per_host * (G - gph) / G / self.nic_bw
        return out
