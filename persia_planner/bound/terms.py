"""The relaxation's data: each table's terms under every tier option, at the tier's cheapest device and sharding.

A tier option (:class:`TierChoice`) leaves the devices and the sharding open; its terms are what the lower bound's
functionals charge the table there (:mod:`persia_planner.bound.lower_bound`): the synchronous time, the asynchronous
resources' time, the host NICs' time, and the bytes of each memory capacity.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from persia_planner.cost.analytic import CostModel
from persia_planner.kinds import Sharding
from persia_planner.model.access_pattern import MAX_CACHE_FRACTION, MIN_CACHE_FRACTION, hit_rate_envelope, zipf_hit_rate
from persia_planner.model.specs import DType, TableSpec
from persia_planner.placement.feasibility import placeable
from persia_planner.placement.memory import (
    FBGEMM_CACHE_INDEX_BYTES_PER_ROW,
    FBGEMM_CACHE_STATE_BYTES_PER_SLOT,
    fbgemm_bytes,
    ps_holds,
)
from persia_planner.placement.shards import even_split, server_bytes, tier_bytes
from persia_planner.tiers import Lookups, Memory, Tier, replica_tier, server_tiers

__all__ = ["ASYNC_NAMES", "N_ASYNC", "TierChoice", "option_columns", "table_terms"]

N_ASYNC = 5  # ps_ddr, ps_nic, switch, host nic, pcie (busiest / slowest at K >= 1, GPU average at K = 0)
# What each asynchronous resource is called where the bound says what it is made of.
ASYNC_NAMES = ("parameter servers' DDR", "parameter servers' NICs", "switch", "host NIC (PS traffic)", "PCIe")
_NOT_RANGED = (Sharding.DATA_PARALLEL, Sharding.PS_HASH)  # the sharding types that are no range shards
# Up to this many trainer hosts that differ, the bound weighs every host's sync path alone (beyond, the busiest).
_EACH_HOST_MAX = 4


@dataclass(frozen=True)
class TierChoice:
    """A tier-level option of the relaxation (devices and sharding left open)."""

    tier: Tier
    cache_fraction: float = 0.0
    replicated: bool = False


def option_columns(cost: CostModel) -> list[TierChoice]:
    """The option columns of :func:`table_terms`, in order: each local tier without a cache, each cached tier at
    :func:`_cache_columns` sizes (per table), a data-parallel replica, the parameter servers.

    One column stands for every tier of the parameter servers (``ps``, ``ssd``): it takes the fastest one's time
    and the least DDR any of them charges (:func:`_ps_column`), a relaxation of each.
    """
    local = [t for t in Tier if t.spec.local]
    servers = server_tiers()
    return [
        *(TierChoice(t) for t in local if not t.spec.cached),
        *(TierChoice(t) for t in local if t.spec.cached for _ in range(_cache_columns())),
        TierChoice(replica_tier(), replicated=True),
        TierChoice(servers[0]),
    ]


def _cache_points(cost: CostModel, table: TableSpec) -> tuple[np.ndarray, np.ndarray]:
    """The cache sizes of ``table``'s ``hbm_cache`` columns and a hit rate at each, at least the modelled one: the
    corners of the hit rate's tangent envelope over every size the search may build (and the size where the bound's
    cache memory bends, ``G / rows``), or the one size its constraints fix, in every column."""
    G = cost.layout.n_gpus
    fixed = table.constraints.cache_fraction
    n = _cache_columns()
    if fixed is not None:
        return np.full(n, fixed), np.full(n, zipf_hit_rate(table.zipf_alpha, table.rows, fixed))
    lo = min((MIN_CACHE_FRACTION, *cost.constants.cache_fractions))
    return hit_rate_envelope(table.zipf_alpha, table.rows, lo, MAX_CACHE_FRACTION, knots=(G / table.rows,))


def _cache_columns() -> int:
    """How many ``hbm_cache`` columns every table has (see :func:`_cache_points`)."""
    return len(hit_rate_envelope(0.0, 2, MIN_CACHE_FRACTION, MAX_CACHE_FRACTION, knots=(1.0,))[0])


@dataclass(frozen=True)
class _Tables:
    """What every option column's terms are built from, per table (arrays of length T)."""

    tables: tuple[TableSpec, ...]
    dtypes: list[DType]
    rows: np.ndarray
    dims: np.ndarray
    moved: np.ndarray  # bytes a step's lookups move
    out_bytes: np.ndarray  # the pooled output
    ids_bytes: np.ndarray  # the ids the shards receive
    ranged: float  # the least all-to-all factor of any range sharding type on any device
    exchange: np.ndarray  # the least all-to-all time of a shard's output and ids
    out: np.ndarray  # exchange + a shard's fixed overhead

    @classmethod
    def of(cls, cost: CostModel) -> _Tables:
        tables = tuple(cost.model.tables)
        dtypes = [cost.dtype_of(t) for t in tables]
        dims = np.array([t.dim for t in tables], dtype=float)
        moved = np.array(
            [cost.moved_bytes(t, cost.batch * t.pooling_factor, t.dim, cost.unique_rows(t, cost.batch)) for t in tables]
        )
        # The all-to-all's bytes and the quantized collectives' conversions (CostModel.output_exchange).
        exchanged = [cost.output_exchange(t, t.dim) for t in tables]
        out_bytes = np.array([b for b, _ in exchanged], dtype=float)
        codec = np.array([n for _, n in exchanged], dtype=float) * float(cost.codec_ms_per_value.min())
        # Every local option has at least one shard: its fixed overhead, its pooled output, the ids it receives.
        ids_bytes = cost.batch * np.array([t.pooling_factor for t in tables]) * cost.constants.id_bytes
        # TorchRec's DMP scales a range shard's exchange by its sharding type (CostModel.sharding_scale): at least by
        # the least factor of any range type on any device.
        ranged = min(float(scale.min()) for s, scale in cost.sharding_scale.items() if s not in _NOT_RANGED)
        exchange = (out_bytes + ids_bytes / 2) * float(cost.a2a_gpu_sum.min()) * ranged
        rows = np.array([t.rows for t in tables], dtype=float)
        # The exchange is priced at the all-to-all's factor (through the pattern), the owner's fixed work at the
        # embedding's (CostModel.range_shard_terms).
        out = exchange + (cost.constants.shard_overhead_ms + codec) * cost.scales["embedding"]
        return cls(tables, dtypes, rows, dims, moved, out_bytes, ids_bytes, ranged, exchange, out)


@dataclass(frozen=True)
class _Terms:
    """The option columns' terms (see :func:`table_terms`), filled column by column."""

    sync: np.ndarray
    sync_ddr: np.ndarray
    asyn: np.ndarray
    mem: np.ndarray
    fractions: np.ndarray


def table_terms(
    cost: CostModel,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per table x tier option, each summed over GPUs (T x O): sync time counting the GPU's own memory path, sync
    time counting its host's shared DDR instead; async terms (R x T x O); NIC terms, one per weighting of the hosts
    (W x T x O); memory (3 x T x O); the cache fraction of each option (T x O, 0 but for hbm_cache).

    Option columns (:func:`option_columns`): hbm, ddr, hbm_cache at each of :func:`_cache_points`, data_parallel,
    ps. An option a table's constraints rule out costs inf (unless they rule out every option that fits: then none
    is ruled out, and no plan exists anyway).
    """
    columns = option_columns(cost)
    n_opt = len(columns)
    dp = next(i for i, c in enumerate(columns) if c.replicated)
    ps = n_opt - 1
    T = len(cost.model.tables)
    terms = _Terms(
        np.full((T, n_opt), np.inf), np.zeros((T, n_opt)), np.zeros((N_ASYNC, T, n_opt)), np.zeros((3, T, n_opt)),
        np.zeros((T, n_opt)),
    )  # fmt: skip
    tabs = _Tables.of(cost)
    terms.sync_ddr[:, :dp] = tabs.exchange[:, None]  # the overhead is GPU time, not host-DDR time
    for i, c in enumerate(columns[:dp]):
        if not c.tier.spec.cached:
            _local_column(cost, tabs, terms, i, c.tier)
    for tier in dict.fromkeys(c.tier for c in columns[:dp] if c.tier.spec.cached):
        at = [i for i, c in enumerate(columns[:dp]) if c.tier is tier]
        _cache_columns_terms(cost, tabs, terms, slice(at[0], at[-1] + 1), tier)
    _replica_column(cost, tabs, terms, dp)
    traffic = _ps_column(cost, tabs, terms, ps) if cost.layout.n_servers else None
    nic, host = _host_terms(cost, tabs, (n_opt, dp, ps), traffic)
    sync = terms.sync
    ruled_out = _ruled_out(cost, columns)
    ruled_out &= (np.isfinite(sync) & ~ruled_out).any(axis=1, keepdims=True)
    sync[ruled_out] = np.inf
    return sync, terms.sync_ddr, terms.asyn, nic, host, terms.mem, terms.fractions


def _charge(tabs: _Tables, mem: np.ndarray, column: int, tier: Tier, fraction: float = 0.0) -> None:
    """Each table's (HBM, DDR) bytes as one shard of ``tier``: what the runtime allocates (placement.tier_bytes)."""
    for i, t in enumerate(tabs.tables):
        mem[:2, i, column] = tier_bytes(t, tier, t.rows, t.dim, tabs.dtypes[i], fraction)


def _local_column(cost: CostModel, tabs: _Tables, terms: _Terms, column: int, tier: Tier) -> None:
    """A local tier without a cache (hbm, ddr): a range shard's kernel time is at least its share of the whole
    table's on the fastest device (a split adds bags and fixed costs, never removes ids or distinct rows), at the
    tier's share of its lookup path's bandwidth."""
    spec = tier.spec
    if spec.lookups is Lookups.HBM:
        all_gpus = np.arange(cost.layout.n_gpus)
        hbm_ms = np.array([float(cost.hbm_emb_ms(t, 1.0, t.dim, all_gpus).min()) for t in tabs.tables])
        terms.sync[:, column] = hbm_ms / spec.bandwidth_share + tabs.out
    else:
        uvm_ms = tabs.moved / (float(cost.uvm_bw.max()) * spec.bandwidth_share) * cost.scales["embedding"]
        terms.sync[:, column] = uvm_ms + tabs.out
        terms.sync_ddr[:, column] += tabs.moved * _host_ddr(cost)
    _charge(tabs, terms.mem, column, tier)


def _host_ddr(cost: CostModel) -> float:
    """GPU-ms (summed over GPUs) per byte of a host's DDR traffic: every GPU of the host waits on it (an embedding
    resource: at the embedding's factor)."""
    return float(np.min(cost.gpus_per_host / cost.host_ddr_bw)) * cost.scales["embedding"]


def _cache_columns_terms(cost: CostModel, tabs: _Tables, terms: _Terms, cache: slice, tier: Tier) -> None:
    """A cached tier (hbm_cache) at each of :func:`_cache_points`: the hits at HBM's bandwidth, the misses at UVM's
    (at the tier's share of it)."""
    G = cost.layout.n_gpus
    hbm_bw, uvm_bw = float(cost.hbm_bw.max()), float(cost.uvm_bw.max()) * tier.spec.bandwidth_share
    points = [_cache_points(cost, t) for t in tabs.tables]
    terms.fractions[:, cache] = np.array([f for f, _ in points])
    hit = np.array([h for _, h in points])
    moved, mem, fractions = tabs.moved, terms.mem, terms.fractions
    kernels = hit * (moved / hbm_bw)[:, None] + (1 - hit) * (moved / uvm_bw)[:, None]
    terms.sync[:, cache] = kernels * cost.scales["embedding"] + tabs.out[:, None]
    terms.sync_ddr[:, cache] += (1 - hit) * (moved * _host_ddr(cost))[:, None]
    # fbgemm rounds each shard's cache up to whole sets of slots; any cut into at most G row pieces holds at least
    # rows * f - G slots (each piece's floor loses less than one), and every row keeps its index entry.
    for i, t in enumerate(tabs.tables):
        dtype = tabs.dtypes[i]
        hbm, ddr = fbgemm_bytes(t, t.rows, t.dim, dtype, managed=True)
        slots = np.maximum(0.0, t.rows * fractions[i, cache] - G)
        mem[0, i, cache] = float(hbm) + t.rows * FBGEMM_CACHE_INDEX_BYTES_PER_ROW
        mem[0, i, cache] += slots * (t.dim * dtype.n_bytes + FBGEMM_CACHE_STATE_BYTES_PER_SLOT)
        mem[1, i, cache] = float(ddr)


def _replica_column(cost: CostModel, tabs: _Tables, terms: _Terms, dp: int) -> None:
    """data_parallel: a replica on every GPU (weights, state and DDP's gradient), whose gradients join the
    all-reduce."""
    c, G = cost.constants, cost.layout.n_gpus
    replicas = np.array(
        [
            float(tier_bytes(t, replica_tier(), t.rows, t.dim, d, replica=True)[0])
            for t, d in zip(tabs.tables, tabs.dtypes, strict=True)
        ]
    )
    dp_ok = replicas <= cost.capacities()[cost.layout.hbm].min() + 0.5
    dense_bw = cost.hbm_bw * c.dense_kernel_efficiency
    replica = np.array([cost.replica_moved_bytes(t) for t in tabs.tables]) * float((1 / dense_bw).sum())
    replica += G * c.shard_overhead_ms
    replica *= cost.scales["embedding"]  # the all-reduce's factor is in its rate already
    allreduce = 4.0 * tabs.rows * tabs.dims * float(cost.allreduce_ms_per_byte.sum())
    # A replica's work and its all-reduce, both scaled by data-parallel's factor.
    replicated = float(cost.sharding_scale[Sharding.DATA_PARALLEL].min())
    replica, allreduce = replica * replicated, allreduce * replicated
    terms.sync[:, dp] = np.where(dp_ok, replica + allreduce, np.inf)
    terms.sync_ddr[:, dp] = allreduce
    terms.mem[0, :, dp] = replicas * G


def _ps_column(cost: CostModel, tabs: _Tables, terms: _Terms, ps: int) -> np.ndarray:
    """ps: the trainers' fixed cost of the requests, the servers' DDR and NICs, the switch, the host NICs and PCIe
    links; returns each table's bytes per step between the GPUs and the servers."""
    c, lay, G = cost.constants, cost.layout, cost.layout.n_gpus
    asyn = terms.asyn
    traffic = G * np.array([cost.ps_bytes_per_gpu(t) for t in tabs.tables])
    # A server's store holds a bounded number of rows of a table: beyond that the ps tier is no option.
    # Every GPU sends at least one server a lookup and a push per step: their fixed cost on the trainer
    # (CostModel.ps_table_loads), summed over GPUs.
    client_ms = 2 * G * c.ps_client_ms * cost.scales["embedding"]  # the trainer's work: its embedding part
    terms.sync[:, ps] = np.where(ps_holds(tabs.rows, lay.n_servers), client_ms, np.inf)
    request_ms = 2 * G * c.ps_request_ms
    asyn[0, :, ps] = np.array([cost.ps_moved_bytes(t) for t in tabs.tables]) / float(cost.ps_ddr_bw.sum())
    # The servers' NICs: the bytes, and the requests' fixed cost on the servers that hold a share (at least one).
    # The busiest server is at least the bandwidth-weighted average, in which a request to the server with the
    # least bandwidth weighs least.
    share = float(cost.ps_nic_bw.min() / cost.ps_nic_bw.sum())
    asyn[1, :, ps] = traffic / float(cost.ps_nic_bw.sum()) + request_ms * share
    asyn[2, :, ps] = traffic / cost.switch_bw
    # Per byte a GPU sends: ms on its host's NIC (shared by the host's GPUs) and on its PCIe link.
    nic_ms, pcie_ms = cost.gpus_per_host[cost.gpu_host] / cost.nic_bw[cost.gpu_host], 1 / cost.pcie_bw
    # K >= 1: the busiest NIC and the slowest link. K = 0: the GPU average (see the module docstring).
    reduce = np.mean if cost.model.staleness == 0 else np.max
    asyn[3, :, ps] = traffic / G * float(reduce(nic_ms))
    asyn[4, :, ps] = traffic / G * float(reduce(pcie_ms))
    asyn[:, :, ps] *= cost.scales["ps"]

    # The store's bytes are linear in the rows plus a fixed slack per server that holds a share, and a plan may
    # hash a table over fewer servers than there are: the least any plan can hold is all rows on one server.
    # A table on a cached tier (ssd) keeps less in DDR (its cache, here none, and its index), one in another
    # memory none: the least of the tiers some server has the memories of.
    def on_some_server(memory: Memory | None) -> bool:
        return memory is None or any(c > 0 for c in cost.topology.capacity(memory))

    tiers = [t for t in server_tiers() if on_some_server(t.spec.rows_in) and on_some_server(t.spec.cache_in)]
    for i, t in enumerate(tabs.tables):
        one = np.array(even_split(t.rows, 1))
        terms.mem[2, i, ps] = min(
            float(server_bytes(t, tier, one, t.dim, tabs.dtypes[i])[Memory.SERVER].sum()) for tier in tiers
        )
    return traffic


def _host_terms(
    cost: CostModel, tabs: _Tables, columns: tuple[int, int, int], traffic: np.ndarray | None
) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """The host NICs' terms, weighted: the average over hosts and, where hosts differ, the busiest one alone
    (largest ms per byte a GPU sends to the servers); a local table's output leaves from its cheapest owner under
    the weights. And the same hosts' sync path with its fixed part: a GPU's sync time holds its host's all-to-all
    NIC time, its fixed dense time and the all-reduce of the replicas' gradients at its rate (and at K = 0 the
    servers' time, the same for every GPU); on a few hosts that differ, every host alone (which one's path is
    longest depends on the plan)."""
    n_opt, dp, ps = columns
    H, G, T = cost.layout.n_hosts, cost.layout.n_gpus, len(tabs.tables)
    per_gpu_nic = cost.gpus_per_host / cost.nic_bw
    weights = [np.full(H, 1 / H)]
    if per_gpu_nic.max() > per_gpu_nic.min() * (1 + 1e-9):
        busiest = np.zeros(H)  # one host's weight (not np.eye(H)'s row: H x H)
        busiest[int(np.argmax(per_gpu_nic))] = 1.0
        weights.append(busiest)
    nic = np.zeros((len(weights), T, n_opt))
    host_weights = weights
    if len(weights) > 1 and H <= _EACH_HOST_MAX:
        host_weights = [weights[0], *(np.eye(H)[h] for h in range(H))]
    host = np.zeros((len(host_weights), T, n_opt))
    host_fixed = np.zeros(len(host_weights))
    a2a_bytes = (tabs.out_bytes + tabs.ids_bytes / 2) * tabs.ranged
    gpus_of = [np.flatnonzero(cost.gpu_host == h) for h in range(H)]
    replicated = float(cost.sharding_scale[Sharding.DATA_PARALLEL].min())
    for i, w in enumerate(host_weights):
        host[i, :, :dp] = (a2a_bytes * float(cost.a2a.nic_dot(w).min()))[:, None]
        used_hosts = [h for h in range(H) if w[h] > 0]
        per_byte = sum(w[h] * float(cost.allreduce_ms_per_byte[gpus_of[h]].min()) for h in used_hosts)
        host[i, :, dp] = 4.0 * tabs.rows * tabs.dims * per_byte * replicated
        host_fixed[i] = sum(w[h] * float(cost.fixed_sync_ms[gpus_of[h]].min()) for h in used_hosts)
    for i, w in enumerate(weights):
        nic[i, :, :dp] = (a2a_bytes * float(cost.a2a.nic_dot(w).min()))[:, None]
        if traffic is not None:
            nic[i, :, ps] = traffic / G * float(w @ per_gpu_nic) * cost.scales["ps"]
    return nic, (host, host_fixed)


def _ruled_out(cost: CostModel, columns: list[TierChoice]) -> np.ndarray:
    """T x O: the options each table's constraints rule out (the pairs
    :func:`persia_planner.placement.feasibility.placeable` leaves
    out: their sharding types, tiers, devices)."""
    out = np.zeros((len(cost.model.tables), len(columns)), dtype=bool)
    for i, table in enumerate(cost.model.tables):
        if not table.constraints.constrained:
            continue
        pairs = placeable(table, cost.topology)
        replica = any(s is Sharding.DATA_PARALLEL for s, _ in pairs)
        tiers = {t for s, t in pairs if s is not Sharding.DATA_PARALLEL}
        on_servers = any(not t.spec.local for t in tiers)  # the one column of the server tiers
        out[i] = [
            not (replica if c.replicated else on_servers if not c.tier.spec.local else c.tier in tiers) for c in columns
        ]
    return out
