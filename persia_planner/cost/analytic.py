"""The analytic cost model: what a step costs for a given placement, on a given topology.

Every formula lives here, the step's in :mod:`persia_planner.cost.step_time` (docs/design/cost_model.md explains them).
Time is in milliseconds, sizes in bytes.

The model keeps a *load vector* per plan: for every resource (each GPU's memory path, NVLink and PCIe; each trainer
host's DDR and NIC; each parameter server's NIC and DDR; the switch) the milliseconds of work per step placed on it.
Every shard adds a fixed vector to it, so plans are scored by summing vectors, and the search scores a shard on
every GPU at once with one matrix. :class:`~persia_planner.cost.step_time.StepModel` turns a load vector into the step
time.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from persia_planner.cost.all_to_all import DENSE_MAX_GPUS, A2APattern
from persia_planner.cost.memory_slots import MemorySlots
from persia_planner.cost.step_time import MS, StepModel
from persia_planner.cost.terms import Cost, Estimate, Layout
from persia_planner.kinds import Sharding
from persia_planner.model.access_pattern import cache_misses, expected_unique, expected_unique_many, zipf_hit_rate
from persia_planner.model.qcomms import FP32_COMMS, QComms
from persia_planner.model.specs import DType, ModelSpec, TableSpec
from persia_planner.placement.memory import SSD_LOG_SLACK, ssd_rows_per_block
from persia_planner.placement.shards import Shard, Storage, TablePlacement
from persia_planner.tiers import Lookups, Tier, server_tiers
from persia_planner.topology.graph import Topology
from persia_planner.topology.hardware import DeviceKind

__all__ = ["Cost", "CostModel", "Estimate", "Layout", "zipf_hit_rate"]


class CostModel(MemorySlots):
    """Scores placements of ``model`` on ``topology``.

    Args:
        model: The model (batch, dtype, tables, dense part, staleness).
        topology: The cluster; its ``constants`` hold the efficiency factors.
    """

    def __init__(self, model: ModelSpec, topology: Topology):
        self.model = model
        self.topology = topology
        self.constants = topology.constants
        # The refitted factors on the step's parts (CostConstants.term_scales): each multiplies its part's loads and
        # fixed times where they are built, so the search, the bound and an Estimate all read scaled figures.
        self.scales = topology.constants.term_scales()
        self.dtype_of = model.dtype_of
        # PS rows and gradients travel in the wire dtype, whatever the table's (the client converts both ways).
        self.wire_dtype: DType = model.ps_wire_dtype
        # The trainers' collectives: priced in the model's precisions (the planner weighs them where it chooses).
        self.qcomms: QComms = model.qcomms or FP32_COMMS
        self.layout = lay = Layout(len(topology.gpus), len(topology.trainers), len(topology.servers))
        gpus, hosts = topology.gpus, topology.trainers
        host_index = {h.name: i for i, h in enumerate(hosts)}
        self.gpu_host = np.array([host_index[g.host] for g in gpus])
        self.gpus_per_host = np.array([len(h.gpus) for h in hosts])
        n_g = self.gpus_per_host[self.gpu_host]
        G = lay.n_gpus
        self.batch = model.batch_size
        self.local_batch = model.batch_size / G

        self._set_bandwidths(topology)

        # Distinct rows per step of every table, for the global batch (a shard's) and a trainer's (its PS requests).
        tables = model.tables
        self._unique_specs = {t.name: t for t in tables}
        self._unique = self._unique_of(model, (self.batch, self.local_batch))
        self._placements = self._placements_of(model, topology)

        # CPU trainer devices of a host with a measured profile: their kernels are priced by the profile's fits
        # (fbgemm's TBE per bag, id and distinct row; the DLRM dense step), not through a bandwidth.
        self.profiles = [hosts[host_index[g.host]].profile if g.kind is DeviceKind.CPU else None for g in gpus]
        self.profiled = np.array([p is not None for p in self.profiles], dtype=bool)
        # What TorchRec's DMP adds to a placement's exchange (a replica's work) by its sharding type, per device:
        # each profiled CPU trainer's measured factor (its profile's DMP jobs, against table-wise), 1 elsewhere;
        # times the type's factor refitted from runs (CostConstants.sharding_scales, 1 unless refitted).
        refitted = topology.constants.sharding_scales()
        self.sharding_scale = {
            s: np.array([1.0 if p is None else p.sharding_scale.get(s.value, 1.0) for p in self.profiles])
            * refitted.get(s.value, 1.0)
            for s in Sharding
        }
        self.sharding_scaled = {s: bool((scale != 1.0).any()) for s, scale in self.sharding_scale.items()}

        self._set_step(n_g)

        # All-to-all pattern per owner GPU: ms on every resource per byte of pooled output (forward + backward),
        # built per row asked for (a dense GPUs x resources matrix is quadratic in the cluster).
        a2a = self.scales["all_to_all"]  # on the exchange's links only: the same links carry the all-reduce
        self.a2a = A2APattern(lay, self.gpu_host, self.gpus_per_host, self.nvlink_bw / a2a, self.nic_bw / a2a)
        # Sum over GPUs of the sync time a byte of output adds (each GPU's a2a includes its host's NIC time).
        self.a2a_gpu_sum = self.a2a.gpu_sum()

    def _set_bandwidths(self, topology: Topology) -> None:
        """The devices' and links' effective bandwidths, in bytes/ms."""
        c, gpus, hosts, servers = self.constants, topology.gpus, topology.trainers, topology.servers
        host_index = {h.name: i for i, h in enumerate(hosts)}
        self.hbm_bw = np.array([g.hbm_bandwidth for g in gpus]) * c.hbm_efficiency / MS
        self.pcie_bw = np.array([g.pcie_bandwidth for g in gpus]) * c.nic_efficiency / MS
        self.uvm_bw = (
            np.array([min(g.pcie_bandwidth, hosts[host_index[g.host]].ddr_bandwidth) for g in gpus])
            * c.uvm_efficiency
            / MS
        )
        self.nvlink_bw = np.array([g.nvlink_bandwidth for g in gpus]) * c.nvlink_efficiency / MS
        self.host_ddr_bw = np.array([h.ddr_bandwidth for h in hosts]) * c.ddr_efficiency / MS
        self.nic_bw = np.array([h.nic_bandwidth for h in hosts]) * c.nic_efficiency / MS
        self.ps_nic_bw = np.array([s.nic_bandwidth for s in servers]) * c.nic_efficiency / MS
        self.ps_ddr_bw = np.array([s.ddr_bandwidth for s in servers]) * c.ps_efficiency / MS
        self.disks = [s.ssd for s in servers]
        self.switch_bw = topology.switch_bandwidth * c.nic_efficiency / MS

    def _set_step(self, n_g: np.ndarray) -> None:
        """The step's fixed parts (``n_g``: the GPUs of each GPU's host): the dense time, the all-reduce's rate and
        latency, the collectives' fixed costs and the PS round trip, and the step model that adds them up."""
        model, topology, c, lay = self.model, self.topology, self.constants, self.layout
        gpus, servers, G = topology.gpus, topology.servers, lay.n_gpus
        # A quantized collective converts each value it carries at both ends: a GPU streams float32 in and the
        # narrow dtype out (or back) through HBM; a profiled CPU converts at its measured rate.
        self.codec_ms_per_value = (DType.FP32.n_bytes + DType.FP16.n_bytes) / self.hbm_bw
        for g in np.flatnonzero(self.profiled):
            self.codec_ms_per_value[g] = MS / self.profiles[g].codec_values_per_s
        # Dense part: forward + 2x backward FLOPs on the local batch; hierarchical ring all-reduce of the grads, in
        # the backward precision (a DDP hook converts them before and after).
        tflops = np.array([g.tflops for g in gpus]) * c.tflops_efficiency / MS
        self.dense_ms = 3.0 * model.dense.flops_per_sample * self.local_batch / tflops
        for g in np.flatnonzero(self.profiled):
            self.dense_ms[g] = self.profiles[g].dense_seconds(model.dense.flops_per_sample, self.local_batch) * MS
        backward = self.qcomms.backward
        self.dense_grad_bytes = float(backward.n_bytes * model.dense.parameters)
        if backward is not DType.FP32:
            self.dense_ms = self.dense_ms + 2 * model.dense.parameters * self.codec_ms_per_value
        H = lay.n_hosts
        nic_of_gpu = self.nic_bw[self.gpu_host]
        self.allreduce_ms_per_byte = 2 * (n_g - 1) / n_g / self.nvlink_bw + 2 * (H - 1) / H / nic_of_gpu
        latency_ms = topology.latency_s * MS if H + lay.n_servers > 1 else 0.0
        self.allreduce_latency_ms = 2 * (H - 1) * latency_ms
        # Fixed costs of a step (profiled on CPU clusters, ~0 on GPUs): four all-to-alls and one all-reduce between
        # the trainers, each with a collective's latency, and the framework's own time.
        collective = c.collective_latency_ms if G > 1 else 0.0
        self.a2a_fixed_ms = 4 * collective
        self.allreduce_latency_ms += collective
        self.dense_ms = self.dense_ms + c.step_overhead_ms
        self.rtt_ms = 2 * max(topology.path_latencies(gpus[0].name, [s.name for s in servers]), default=0.0) * MS
        scales = self.scales
        self.dense_ms = self.dense_ms * scales["dense"]
        self.allreduce_ms_per_byte = self.allreduce_ms_per_byte * scales["all_reduce"]
        self.allreduce_latency_ms *= scales["all_reduce"]
        self.a2a_fixed_ms *= scales["all_to_all"]
        self.rtt_ms *= scales["ps"]
        self.step_model = StepModel(
            layout=lay,
            gpu_host=self.gpu_host,
            gpus_per_host=self.gpus_per_host,
            staleness=model.staleness,
            batch=self.batch,
            dense_ms=self.dense_ms,
            dense_grad_bytes=self.dense_grad_bytes,
            allreduce_ms_per_byte=self.allreduce_ms_per_byte,
            allreduce_latency_ms=self.allreduce_latency_ms,
            a2a_fixed_ms=self.a2a_fixed_ms,
            rtt_ms=self.rtt_ms,
        )
        self.fixed_sync_ms = self.step_model.fixed_sync_ms

    # The last tables' distinct-row counts: `persia plan` builds cost models for the search (float32 collectives and
    # narrowed ones: the same tables), for validation and for the report, and the counts are most of building one.
    _unique_last: tuple[tuple[TableSpec, ...], tuple[float, ...], dict[tuple[str, float], float]] | None = None

    @classmethod
    def _unique_of(cls, model: ModelSpec, batches: tuple[float, ...]) -> dict[tuple[str, float], float]:
        """Expected distinct rows of every table per batch of ``batches`` samples, by (table name, samples)."""
        last = cls._unique_last
        if last is not None and last[0] is model.tables and last[1] == batches:
            return last[2]
        tables = model.tables
        unique: dict[tuple[str, float], float] = {}
        for samples in batches:
            counts = expected_unique_many(
                np.array([t.zipf_alpha for t in tables]),
                np.array([t.rows for t in tables]),
                np.array([samples * t.pooling_factor for t in tables]),
            )
            unique |= {(t.name, samples): float(u) for t, u in zip(tables, counts, strict=True)}
        cls._unique_last = (tables, batches, unique)
        return unique

    # The last (model, topology)'s placement vectors by placement: `persia plan` scores the plan, validates it and
    # reports it, each with its own cost model, on the same placement objects (0.06 s per 1,000 tables each).
    _placements_last: tuple[ModelSpec, Topology, dict[int, tuple[Any, ...]]] | None = None

    @classmethod
    def _placements_of(cls, model: ModelSpec, topology: Topology) -> dict[int, tuple[Any, ...]]:
        last = cls._placements_last
        # Equal, not only the same object: a plan is priced again with its model rebuilt (Plan.priced_model).
        if last is not None and last[1] is topology and (last[0] is model or last[0] == model):
            return last[2]
        known: dict[int, tuple[Any, ...]] = {}
        cls._placements_last = (model, topology, known)
        return known

    # ---- per-shard work ---------------------------------------------------------------------------------------
    def moved_bytes(self, table: TableSpec, lookups: float, cols: int, unique: float | None = None) -> float:
        """Bytes a lookup-and-update pass moves in the shard's memory: read the rows of the ``lookups`` ids, then
        the backward pass and optimizer on the ``unique`` distinct rows among them (all, if None): fbgemm aggregates
        a row's gradients and updates it once (``update_passes`` x the weights, read + write of the state)."""
        dtype = self.dtype_of(table)
        state = table.row_bytes(dtype, cols) - cols * dtype.n_bytes
        # Memory is read in whole sectors: a narrow row (a thin column shard) costs at least min_access_bytes.
        row = max(cols * dtype.n_bytes, self.constants.min_access_bytes)
        rows = lookups if unique is None else unique
        return lookups * row + rows * (row * self.constants.update_passes + 2 * state)

    def unique_rows(self, table: TableSpec, samples: float) -> float:
        """Expected distinct rows of ``table`` looked up by ``samples`` samples (see
        :mod:`persia_planner.model.access_pattern`)."""
        known = self._unique.get((table.name, samples))
        if known is not None and self._unique_specs[table.name] is table:
            return known
        return expected_unique(table.zipf_alpha, table.rows, samples * table.pooling_factor)

    def hbm_emb_ms(
        self, table: TableSpec, rows_fraction: float | np.ndarray, cols: int, gpus: np.ndarray
    ) -> np.ndarray:
        """Embedding time (forward, backward and update, ms) of a shard in the device memory of each GPU in
        ``gpus``, holding ``rows_fraction`` of the table's rows (and so of its lookups) and ``cols`` columns.

        A GPU: the bytes moved over its HBM bandwidth. A profiled CPU trainer: the profile's TBE fit, with the
        whole batch's bags (every range shard receives every bag; a sequence table's kernel makes each of the
        shard's ids a bag of its own), its share of the ids and distinct rows. Times the embedding factor
        (``embedding_scale``).
        """
        return self._embedding_scaled(self._hbm_emb_ms(table, rows_fraction, cols, gpus))

    def _embedding_scaled(self, ms: Any) -> Any:
        """``ms`` of the step's embedding part times its refitted factor (the same object where it is 1)."""
        scale = self.scales["embedding"]
        return ms if scale == 1.0 else ms * scale

    def _hbm_emb_ms(
        self, table: TableSpec, rows_fraction: float | np.ndarray, cols: int, gpus: np.ndarray
    ) -> np.ndarray:
        """:meth:`hbm_emb_ms` before the embedding factor."""
        lookups = self.batch * table.pooling_factor * rows_fraction
        unique = self.unique_rows(table, self.batch) * rows_fraction
        out = self.moved_bytes(table, lookups, cols, unique) / self.hbm_bw[gpus]
        if self.profiled.any():
            lookups, unique = np.broadcast_to(lookups, gpus.shape), np.broadcast_to(unique, gpus.shape)
            row_bytes = cols * self.dtype_of(table).n_bytes
            for k in np.flatnonzero(self.profiled[gpus]):
                bags = lookups[k] if table.sequence else self.batch
                seconds = self.profiles[gpus[k]].embedding_seconds(
                    table.optimizer.value, bags, lookups[k], row_bytes, unique[k]
                )
                out[k] = seconds * MS
        return out

    def range_shard_terms(
        self,
        table: TableSpec,
        rows_fraction: float | np.ndarray,
        cols: int,
        tier: Tier,
        gpus: np.ndarray,
        *,
        cache_fraction: float = 0.0,
    ) -> tuple[float | np.ndarray, float | np.ndarray, np.ndarray, np.ndarray | None]:
        """The terms :meth:`range_shard_loads` assembles: (output bytes, half the ids' bytes, the ``emb`` ms of the
        shard on each GPU in ``gpus``, the host DDR ms of each (None in HBM)); a sequence table's output, as its ids,
        is the shard's share of the rows.

        The search keeps them per table and option, and builds load vectors of any candidate GPUs from them.
        """
        lookups = self.batch * table.pooling_factor * rows_fraction
        out_bytes, conversions = self.output_exchange(table, cols)
        if table.sequence:  # a row per id: a range shard returns the rows of its own ids alone
            share = np.asarray(rows_fraction, dtype=float)
            out_bytes = out_bytes * share if share.ndim else out_bytes * float(share)
            conversions = conversions * float(share.mean()) if conversions else 0.0
        # Input distribution: the ids of the shard's lookups travel to it, forward only (half an a2a pattern).
        ids_bytes = np.asarray(lookups * self.constants.id_bytes, dtype=float)
        ids_half = ids_bytes / 2 if ids_bytes.ndim else float(ids_bytes / 2)
        overhead = self.constants.shard_overhead_ms
        if conversions:  # narrowed collectives: the owner's conversions, per candidate GPU
            overhead = overhead + conversions * self.codec_ms_per_value[gpus]
        spec = tier.spec  # its lookups' path, the share of that path's bandwidth it reaches, an HBM cache
        if spec.lookups is Lookups.HBM:
            hbm_ms = self._hbm_emb_ms(table, rows_fraction, cols, gpus) / spec.bandwidth_share
            return out_bytes, ids_half, self._embedding_scaled(overhead + hbm_ms), None
        moved = self.moved_bytes(table, lookups, cols, self.unique_rows(table, self.batch) * rows_fraction)
        hit = zipf_hit_rate(table.zipf_alpha, table.rows, cache_fraction) if spec.cached else 0.0
        uvm_bw = self.uvm_bw[gpus] * spec.bandwidth_share
        emb = overhead + (hit * moved / self.hbm_bw[gpus] + (1 - hit) * moved / uvm_bw)
        hosts = self.gpu_host[gpus]
        ddr = (1 - hit) * moved / self.host_ddr_bw[hosts]
        return out_bytes, ids_half, self._embedding_scaled(emb), self._embedding_scaled(ddr)

    def output_exchange(self, table: TableSpec, cols: int) -> tuple[float, float]:
        """The bytes of a shard's output that the all-to-all pattern carries (forward and backward averaged, as
        :class:`~persia_planner.cost.all_to_all.A2APattern` prices a byte of output both ways) and the values its
        quantized collectives convert (each narrowed direction: an encode and a decode of ``batch x cols`` values).
        A pooled table's output is a row per sample; a sequence table's a row per id
        (:attr:`~persia_planner.model.tables.TableSpec.outputs_per_sample`): its exchange grows with the sequence.

        The conversions are charged to the shard's owner, though the receivers make half of them: in a plan whose
        shards are spread, each GPU receives about as much as it owns.
        """
        own = self.dtype_of(table).n_bytes
        values = self.batch * table.outputs_per_sample * cols
        wire = [own if d is DType.FP32 else d.n_bytes for d in (self.qcomms.forward, self.qcomms.backward)]
        narrowed = sum(d is not DType.FP32 for d in (self.qcomms.forward, self.qcomms.backward))
        return values * sum(wire) / 2, 2.0 * narrowed * values

    def range_shard_loads(
        self,
        table: TableSpec,
        rows_fraction: float | np.ndarray,
        cols: int,
        tier: Tier,
        gpus: np.ndarray,
        *,
        cache_fraction: float = 0.0,
        sharding: Sharding = Sharding.TABLE_WISE,
    ) -> np.ndarray:
        """Load vectors (one row per candidate GPU in ``gpus``) of a range shard of a ``sharding`` placement placed
        on that GPU.

        ``rows_fraction`` is the share of the table's rows (and so of its lookups) in the shard: one number, or
        one per candidate.
        """
        terms = self.range_shard_terms(table, rows_fraction, cols, tier, gpus, cache_fraction=cache_fraction)
        return self.range_loads_of(terms, gpus, sharding)

    def range_loads_of(
        self,
        terms: tuple[float, float | np.ndarray, np.ndarray, np.ndarray | None],
        gpus: np.ndarray,
        sharding: Sharding,
    ) -> np.ndarray:
        """Load vectors of a range shard of a ``sharding`` placement on each GPU in ``gpus`` from its
        :meth:`range_shard_terms` (for those GPUs).

        The all-to-all pattern of its pooled output (table-row-wise: reduced in the host first) and half of it for
        its ids, times the sharding type's measured factor on its GPU (:attr:`sharding_scale`); its ``emb`` time on
        its GPU; in UVM, its time on its host's DDR.
        """
        lay = self.layout
        out_bytes, ids_half, emb, ddr = terms
        pattern = self.a2a.rows(gpus)
        if sharding is Sharding.TABLE_ROW_WISE:
            loads = self.a2a.rows(gpus, twrw=True)
            loads *= out_bytes
        else:  # a sequence table's range shards: each its own share of the output
            loads = pattern * (out_bytes[:, None] if isinstance(out_bytes, np.ndarray) else out_bytes)
        loads += pattern * (ids_half[:, None] if isinstance(ids_half, np.ndarray) else ids_half)
        if self.sharding_scaled[sharding]:
            # What a sharding type adds is in how its ids and pooled output travel (row-wise's bucketize and
            # reduce-scatter, column-wise's concat), not in its kernels: the factor is on the exchange.
            loads *= self.sharding_scale[sharding][gpus][:, None]
        idx = np.arange(len(gpus))
        loads[idx, lay.emb.start + gpus] += emb
        if ddr is not None:
            loads[idx, lay.host_ddr.start + self.gpu_host[gpus]] += ddr
        return loads

    def range_loads_sum(
        self,
        terms: tuple[float, float | np.ndarray, np.ndarray, np.ndarray | None],
        gpus: np.ndarray,
        sharding: Sharding,
    ) -> np.ndarray:
        """The sum of :meth:`range_loads_of`'s rows (a table's shards over many GPUs), in time and memory linear in
        the cluster beyond :data:`persia_planner.cost.all_to_all.DENSE_MAX_GPUS` shards (up to it, or where the sharding
        type has a measured factor, the rows' own sum, to the bit)."""
        if len(gpus) <= DENSE_MAX_GPUS or self.sharding_scaled[sharding]:
            return self.range_loads_of(terms, gpus, sharding).sum(axis=0)
        lay = self.layout
        out_bytes, ids_half, emb, ddr = terms
        if sharding is Sharding.TABLE_ROW_WISE:
            loads = self.a2a.weighted_sum(gpus, ids_half, np.full(len(gpus), out_bytes))
        else:
            loads = self.a2a.weighted_sum(gpus, out_bytes + np.asarray(ids_half))
        np.add.at(loads, lay.emb.start + gpus, np.broadcast_to(emb, gpus.shape))
        if ddr is not None:
            np.add.at(loads, lay.host_ddr.start + self.gpu_host[gpus], np.broadcast_to(ddr, gpus.shape))
        return loads

    def replica_moved_bytes(self, table: TableSpec) -> float:
        """Bytes one data-parallel replica moves per step: its local lookups and their gradients, then the dense
        optimizer's update of every row."""
        dtype = self.dtype_of(table)
        weights = table.dim * dtype.n_bytes
        state = table.row_bytes(dtype) - weights
        lookups = self.local_batch * table.pooling_factor
        return 2 * lookups * weights + table.rows * (weights * self.constants.dp_update_passes + 2 * state)

    def replica_loads(self, table: TableSpec, gpus: np.ndarray | None = None) -> np.ndarray:
        """Load vectors of one data-parallel replica on each GPU of ``gpus`` (default: every GPU), summed (times the
        sharding type's measured factor on each, :attr:`sharding_scale`)."""
        lay = self.layout
        g = np.arange(lay.n_gpus) if gpus is None else np.asarray(gpus, dtype=np.intp)
        moved = self.replica_moved_bytes(table)
        emb = moved / (self.hbm_bw[g] * self.constants.dense_kernel_efficiency) + self.constants.shard_overhead_ms
        emb = self._embedding_scaled(emb)
        per_replica = 4.0 * table.rows * table.dim / lay.n_gpus
        if self.sharding_scaled[Sharding.DATA_PARALLEL]:
            # Each replica's work times its device's measured factor (its gradient's share of the all-reduce too).
            scale = self.sharding_scale[Sharding.DATA_PARALLEL][g]
            emb, per_replica = emb * scale, per_replica * scale
        if len(g) <= DENSE_MAX_GPUS:  # the rows' own sum, to the bit
            rows = np.zeros((len(g), lay.size))
            rows[np.arange(len(g)), lay.emb.start + g] = emb
            rows[:, lay.dp_bytes] = per_replica
            return rows.sum(axis=0)
        loads = np.zeros(lay.size)
        np.add.at(loads, lay.emb.start + g, emb)
        loads[lay.dp_bytes] = per_replica * len(g)
        return loads

    def ps_bytes_per_gpu(self, table: TableSpec) -> float:
        """Bytes per step for ``table`` that a link between a trainer and the parameter servers is charged: the
        client de-duplicates its batch's ids, then looks up and pushes each distinct row once, rows and gradients in
        the wire dtype (``persia train --ps-wire``). The ids go one way twice (lookup and push) with the gradients,
        the rows come back the other way. Links are full duplex: at K >= 1 lookups and pushes of different steps
        overlap, and a link's time is its busier direction's; at K = 0 a step's push and then the next lookup are
        serial, and its time is both directions'."""
        rows = self.unique_rows(table, self.local_batch)
        wire = table.dim * self.wire_dtype.n_bytes
        both = 2 if self.model.staleness == 0 else 1
        return rows * (both * wire + 2 * self.constants.id_bytes)

    def ps_moved_bytes(self, table: TableSpec) -> float:
        """Bytes the servers' stores move per step for ``table``: every trainer's distinct rows read, then updated."""
        rows = self.layout.n_gpus * self.unique_rows(table, self.local_batch)
        return self.moved_bytes(table, rows, table.dim, rows)

    def ps_table_loads(
        self, table: TableSpec, shares: np.ndarray, tier: Tier | None = None, cache_fraction: float = 0.0
    ) -> np.ndarray:
        """Load vector of a table hashed over the parameter servers, ``shares[p]`` of its ids on server p.

        Every GPU fetches the rows of its local batch and pushes their gradients (ids travel too). On a cached
        server tier (``ssd``) a server also reads the rows its DDR cache misses from disk and logs the rows they evict
        (:meth:`.Disk.ms_per_miss`), in the request threads of its store's work.
        """
        lay, tier = self.layout, tier or server_tiers()[0]
        loads = np.zeros(lay.size)
        total = float(shares.sum())
        per_gpu = self.ps_bytes_per_gpu(table) * total
        G = lay.n_gpus
        loads[lay.pcie] = per_gpu / self.pcie_bw
        loads[lay.nic_async] = per_gpu * self.gpus_per_host / self.nic_bw
        loads[lay.ps_nic] = G * self.ps_bytes_per_gpu(table) * shares / self.ps_nic_bw
        loads[lay.ps_ddr] = self.ps_moved_bytes(table) * shares / (self.ps_ddr_bw * tier.spec.bandwidth_share)
        loads[lay.switch] = G * per_gpu / self.switch_bw
        # Every trainer sends each server that holds a share one lookup and one push per step: a fixed cost for the
        # server, and for the trainer's own thread, which prepares and sends them.
        holding = shares > 0
        loads[lay.ps_nic] += np.where(holding, 2 * lay.n_gpus * self.constants.ps_request_ms, 0.0)
        loads[lay.emb] += 2 * float(holding.sum()) * self.constants.ps_client_ms
        if tier.spec.cached:  # misses read the server's disk; a server without one holds no share (validation)
            n, alpha, rows = G * self.local_batch, table.zipf_alpha, table.rows
            misses = cache_misses(alpha, rows, n * table.pooling_factor, self.unique_rows(table, n), cache_fraction)
            per_block = ssd_rows_per_block(table.dim, table.optimizer, self.dtype_of(table))
            ms = [d.ms_per_miss(per_block, SSD_LOG_SLACK) if d is not None else 0.0 for d in self.disks]
            loads[lay.ps_ddr] += misses * shares * np.array(ms)
        ps, client = self.scales["ps"], self.scales["embedding"]
        if ps != 1.0:
            for part in (lay.pcie, lay.nic_async, lay.ps_nic, lay.ps_ddr):
                loads[part] *= ps
            loads[lay.switch] *= ps
        if client != 1.0:  # the requests' client work is the trainer's, in its embedding part
            loads[lay.emb] *= client
        return loads

    def placement_loads(self, table: TableSpec, placement: TablePlacement) -> tuple[np.ndarray, np.ndarray]:
        """(load vector, memory vector) of a whole table placement (the sum over its shards)."""
        # Kept by the placement object (held, so its id stays its own) for cost models of the same model and topology.
        known = self._placements.get(id(placement))
        if known is None or known[0] is not placement or known[1] is not table:
            loads, mem = self._placement_loads(table, placement)
            known = self._placements[id(placement)] = (placement, table, loads, mem)
        return known[2].copy(), known[3].copy()

    def _placement_loads(self, table: TableSpec, placement: TablePlacement) -> tuple[np.ndarray, np.ndarray]:
        lay = self.layout
        mem = np.zeros(lay.mem_size)
        shards = placement.shards
        known: dict[tuple[Tier, int, int, float | None, bool], Storage] = {}
        dtype = self.dtype_of(table)

        def storage(s: Shard) -> Storage:
            # A table's shards mostly share one shape (a replica on every GPU, equal row blocks).
            key = (s.tier, s.n_rows(table), s.n_cols, s.cache_fraction, s.replica)
            found = known.get(key)
            if found is None:
                found = known[key] = s.storage(table, dtype)
            return found

        gpu_index = self.topology.gpu_index
        if placement.sharding is Sharding.DATA_PARALLEL:
            gpus = np.array([gpu_index(s.device) for s in shards])
            for g, s in zip(gpus, shards, strict=True):
                self.charge(mem, storage(s), gpu=int(g))
            return self.replica_loads(table, gpus), mem
        if placement.sharding is Sharding.PS_HASH:
            shares = np.zeros(lay.n_servers)
            for s in shards:
                p = self.topology.server_index(s.device)
                shares[p] += s.row_fraction(table) * s.n_cols / table.dim
                self.charge(mem, storage(s), server=p)
            return self.ps_table_loads(table, shares, placement.tier, shards[0].cache_fraction or 0.0), mem
        loads = np.zeros(lay.size)
        groups: dict[tuple[int, Tier, float], list[Shard]] = {}
        for s in shards:
            groups.setdefault((s.n_cols, s.tier, s.cache_fraction or 0.0), []).append(s)
            g = gpu_index(s.device)
            self.charge(mem, storage(s), gpu=g)
        for (cols, tier, fraction), group in groups.items():
            gpus = np.array([gpu_index(s.device) for s in group])
            fractions = np.array([s.row_fraction(table) for s in group])
            terms = self.range_shard_terms(table, fractions, cols, tier, gpus, cache_fraction=fraction)
            loads += self.range_loads_sum(terms, gpus, placement.sharding)
        return loads, mem

    # ---- the step -----------------------------------------------------------------------------------------
    def fixed_loads(self) -> np.ndarray:
        """The load vector of an empty plan."""
        return np.zeros(self.layout.size)

    def step_parts(self, loads: np.ndarray) -> dict[str, np.ndarray]:
        """Per-GPU parts of the step for a batch of load vectors
        (:meth:`persia_planner.cost.step_time.StepModel.step_parts`)."""
        return self.step_model.step_parts(loads)

    def gpu_step_ms(self, loads: np.ndarray) -> np.ndarray:
        """Per-GPU step time only, the search's hot path
        (:meth:`persia_planner.cost.step_time.StepModel.gpu_step_ms`)."""
        return self.step_model.gpu_step_ms(loads)

    def step_ms(self, loads: np.ndarray) -> np.ndarray:
        """Step time (ms) for a batch of load vectors, shape ``(k, L)`` -> ``(k,)``."""
        return self.step_model.step_ms(loads)

    def estimate(self, loads: np.ndarray) -> Estimate:
        """Score one load vector (:meth:`persia_planner.cost.step_time.StepModel.estimate`)."""
        return self.step_model.estimate(loads)

    def evaluate(self, model_placements: Mapping[str, TablePlacement]) -> tuple[Estimate, np.ndarray]:
        """Score a full placement: (estimate, memory vector)."""
        loads = self.fixed_loads()
        mem = np.zeros(self.layout.mem_size)
        for table in self.model.tables:
            table_loads, table_mem = self.placement_loads(table, model_placements[table.name])
            loads += table_loads
            mem += table_mem
        return self.estimate(loads), mem

    def table_cost(self, loads: np.ndarray) -> Cost:
        """Summarise a table's load vector as a :class:`Cost`
        (:meth:`persia_planner.cost.step_time.StepModel.table_cost`)."""
        return self.step_model.table_cost(loads)

    def capacities(self) -> np.ndarray:
        """Usable bytes per memory slot (capacity minus the planner's reservation)."""
        return np.array([c for m in self.layout.memories for c in self.topology.capacity(m)], dtype=float)

    # ---- the vectors by resource: what the search reads and builds, without the layout's index ranges ---------
    def resource_ms(self, loads: np.ndarray) -> np.ndarray:
        """Time of every resource a step waits for (:meth:`persia_planner.cost.step_time.StepModel.resource_ms`)."""
        return self.step_model.resource_ms(loads)

    def bottleneck_loads(self, loads: np.ndarray, tables: np.ndarray) -> np.ndarray:
        """How much each row of ``tables`` loads the resource that sets ``loads``' step time
        (:meth:`persia_planner.cost.step_time.StepModel.bottleneck_loads`)."""
        return self.step_model.bottleneck_loads(loads, tables)

    def host_gpus(self) -> list[np.ndarray]:
        """The GPUs of each host (indices, ascending)."""
        return self.a2a.host_gpus
