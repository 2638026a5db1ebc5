"""A lower bound on the step time that no plan can beat under the same cost model.

It covers every plan that passes ``plan.validate`` and is built from the search's options: ``hbm_cache`` shards
cache between ``access.MIN_CACHE_FRACTION`` and all of the rows (or the share a table's constraints fix), and a
``table_row_wise`` table spans every GPU of its host (as TorchRec lays it out). Other valid plans may beat it: a
smaller cache, or a table-row-wise table on part of a host (the cost model charges each shard 1/n of the host's
output, as if all n GPUs of the host held one). Every cache size at once: the hit rate is concave in the size, so
the terms of the tangents' envelope (:func:`.access.hit_rate_envelope`), linear in the size between its corners,
are at most the true terms there, and least at a corner.

Derivation (Lagrangian relaxation). With the step formula of ``cost.py`` (staleness K), every plan has

- ``S``   = the fixed dense time plus the synchronous embedding time, averaged over GPUs (step >= max_g sync_g >= S),
  also with the GPUs' memory paths replaced by their hosts' DDR time (``max(emb, ddr)`` is at least either);
- ``A_r`` = the time of an asynchronous resource r with its work spread perfectly: the parameter servers' DDR and
  NICs (summed bandwidth), the switch, the busiest host NIC, the slowest PCIe link (max_g async_g >= A_r);
- ``N_w`` = the trainer hosts' NIC time (all-to-all + parameter-server traffic) under a weighting w of the hosts:
  their average and, where hosts differ, the busiest alone (step >= max_h nic_h >= N_w).

At K >= 1, step >= S, A_r and N_w each. At K = 0 a GPU's async time adds to its own sync path: step >= max_g (sync_g
+ async_g) >= S + avg_g async_g. That average is what may join S: for the shared resources (servers, switch, the
same for every GPU) A_r as above, but for the host NICs and PCIe links the GPU average of each GPU's own time, not
the busiest. (S plus the busiest NIC is no bound: where hosts differ, the GPUs behind the slow NIC may carry less
sync work than the average, and the step is then below it.) So step >= S + A_r with those A_r.

For any weights lam on the simplex a convex combination of these functionals is then a bound. Each is a sum over
tables of a term that depends only on the table's *tier* (of those its ``constraints:`` allow), taken at its
smallest over every device and sharding of that tier (lookup bytes at the tier's fastest bandwidth; pooled output
at the cheapest all-to-all owner under the functional's weights); an option whose bytes alone exceed an aggregate
capacity is in no plan. Capacity of the aggregate HBM, trainer DDR and PS DDR is priced into the objective with
multipliers mu >= 0:

    L(lam, mu) = lam_S * fixed + sum_t min_o [ c_t(o; lam) + mu . mem_t(o) ] - mu . capacity

which is a valid lower bound for every (lam, mu) (weak duality). We search lam (a few pairs, then a pattern search)
and maximise over each mu by bisection on the subgradient (L is concave in mu) only where its capacity binds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from persia_planner.access import MAX_CACHE_FRACTION, MIN_CACHE_FRACTION, hit_rate_envelope, zipf_hit_rate
from persia_planner.constraint_checks import placeable
from persia_planner.cost import CostModel
from persia_planner.kinds import Sharding
from persia_planner.memory import (
    FBGEMM_CACHE_INDEX_BYTES_PER_ROW,
    FBGEMM_CACHE_STATE_BYTES_PER_SLOT,
    fbgemm_bytes,
    ps_holds,
)
from persia_planner.placement import Tier, even_split, tier_bytes
from persia_planner.specs import TableSpec

__all__ = ["MAX_WEIGHTINGS", "BoundPart", "LowerBound", "TierChoice", "lower_bound", "lower_bound_ms"]

_ASYNC = 5  # ps_ddr, ps_nic, switch, host nic, pcie (busiest / slowest at K >= 1, GPU average at K = 0)
# What each asynchronous resource and each memory capacity is called where the bound says what it is made of.
_ASYNC_NAMES = ("parameter servers' DDR", "parameter servers' NICs", "switch", "host NIC (PS traffic)", "PCIe")
_CAPACITY_NAMES = ("HBM", "trainer DDR", "PS DDR", "HBM + trainer DDR")
_HINT_TRUST = 1.3
_NOT_RANGED = (Sharding.DATA_PARALLEL, Sharding.PS_HASH)  # the sharding types that are no range shards
# Up to this many trainer hosts that differ, the bound weighs every host's sync path alone (beyond, the busiest).
_EACH_HOST_MAX = 4
# Weightings the bound's search evaluates by default (see lower_bound). Each is a maximisation over the memory prices.
MAX_WEIGHTINGS = 100


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


def _table_terms(
    cost: CostModel,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per table x tier option, each summed over GPUs (T x O): sync time counting the GPU's own memory path, sync
    time counting its host's shared DDR instead; async terms (R x T x O); NIC terms, one per weighting of the hosts
    (W x T x O); memory (3 x T x O); the cache fraction of each option (T x O, 0 but for hbm_cache).

    Option columns: hbm, ddr, hbm_cache at each of :func:`_cache_points`, data_parallel, ps. An option a table's
    constraints rule out costs inf (unless they rule out every option that fits: then none is ruled out, and no plan
    exists anyway).
    """
    lay, c = cost.layout, cost.constants
    G, H = lay.n_gpus, lay.n_hosts
    tables = cost.model.tables
    n_cache = _cache_columns()
    n_opt = 3 + n_cache + 1
    dp, ps = 2 + n_cache, 3 + n_cache
    T = len(tables)
    sync = np.full((T, n_opt), np.inf)
    sync_ddr = np.zeros((T, n_opt))
    asyn = np.zeros((_ASYNC, T, n_opt))
    mem = np.zeros((3, T, n_opt))  # hbm, trainer ddr, ps ddr

    rows = np.array([t.rows for t in tables], dtype=float)
    dims = np.array([t.dim for t in tables], dtype=float)
    dtypes = [cost.dtype_of(t) for t in tables]
    value_bytes = np.array([d.n_bytes for d in dtypes], dtype=float)
    moved = np.array(
        [cost.moved_bytes(t, cost.batch * t.pooling_factor, t.dim, cost.unique_rows(t, cost.batch)) for t in tables]
    )
    # A range shard's kernel time is at least its share of the whole table's on the fastest device (a split adds
    # bags and fixed costs, never removes ids or distinct rows).
    all_gpus = np.arange(G)
    hbm_ms = np.array([float(cost.hbm_emb_ms(t, 1.0, t.dim, all_gpus).min()) for t in tables])
    out_bytes = cost.batch * dims * value_bytes
    # Every local option has at least one shard: its fixed overhead, its pooled output, the ids it receives.
    ids_bytes = cost.batch * np.array([t.pooling_factor for t in tables]) * c.id_bytes
    # TorchRec's DMP scales a range shard's exchange by its sharding type (CostModel.sharding_scale): at least by
    # the least factor of any range type on any device.
    ranged = min(float(scale.min()) for s, scale in cost.sharding_scale.items() if s not in _NOT_RANGED)
    exchange = (out_bytes + ids_bytes / 2) * float(cost.a2a_gpu_sum.min()) * ranged
    out = exchange + c.shard_overhead_ms
    hbm_bw, uvm_bw = float(cost.hbm_bw.max()), float(cost.uvm_bw.max())
    # GPU-ms (summed over GPUs) per byte of a host's DDR traffic: every GPU of the host waits on it.
    host_ddr = float(np.min(cost.gpus_per_host / cost.host_ddr_bw))

    def charge(column: int, tier: Tier, fraction: float = 0.0) -> None:
        """Each table's (HBM, DDR) bytes as one shard of ``tier``: what the runtime allocates (placement.tier_bytes)."""
        for i, t in enumerate(tables):
            mem[:2, i, column] = tier_bytes(t, tier, t.rows, t.dim, dtypes[i], fraction)

    sync[:, 0] = hbm_ms + out
    charge(0, Tier.HBM)
    sync[:, 1] = moved / uvm_bw + out
    sync_ddr[:, :dp] = exchange[:, None]  # the overhead is GPU time, not host-DDR time
    sync_ddr[:, 1] += moved * host_ddr
    charge(1, Tier.DDR)
    fractions = np.zeros((T, n_opt))
    points = [_cache_points(cost, t) for t in tables]
    cache = slice(2, 2 + n_cache)
    fractions[:, cache] = np.array([f for f, _ in points])
    hit = np.array([h for _, h in points])
    sync[:, cache] = hit * (moved / hbm_bw)[:, None] + (1 - hit) * (moved / uvm_bw)[:, None] + out[:, None]
    sync_ddr[:, cache] += (1 - hit) * (moved * host_ddr)[:, None]
    # fbgemm rounds each shard's cache up to whole sets of slots; any cut into at most G row pieces holds at least
    # rows * f - G slots (each piece's floor loses less than one), and every row keeps its index entry.
    for i, t in enumerate(tables):
        hbm, ddr = fbgemm_bytes(t, t.rows, t.dim, dtypes[i], managed=True)
        slots = np.maximum(0.0, t.rows * fractions[i, cache] - G)
        mem[0, i, cache] = float(hbm) + t.rows * FBGEMM_CACHE_INDEX_BYTES_PER_ROW
        mem[0, i, cache] += slots * (t.dim * dtypes[i].n_bytes + FBGEMM_CACHE_STATE_BYTES_PER_SLOT)
        mem[1, i, cache] = float(ddr)
    # data-parallel: a replica on every GPU (weights, state and DDP's gradient), whose gradients join the all-reduce.
    replicas = np.array(
        [float(tier_bytes(t, Tier.HBM, t.rows, t.dim, d, replica=True)[0]) for t, d in zip(tables, dtypes, strict=True)]
    )
    dp_ok = replicas <= cost.capacities()[lay.hbm].min() + 0.5
    dense_bw = cost.hbm_bw * c.dense_kernel_efficiency
    replica = np.array([cost.replica_moved_bytes(t) for t in tables]) * float((1 / dense_bw).sum())
    replica += G * c.shard_overhead_ms
    allreduce = 4.0 * rows * dims * float(cost.allreduce_ms_per_byte.sum())
    # A replica's work and its all-reduce, both scaled by data-parallel's factor.
    replicated = float(cost.sharding_scale[Sharding.DATA_PARALLEL].min())
    replica, allreduce = replica * replicated, allreduce * replicated
    sync[:, dp] = np.where(dp_ok, replica + allreduce, np.inf)
    sync_ddr[:, dp] = allreduce
    mem[0, :, dp] = replicas * G
    if lay.n_servers:
        traffic = G * np.array([cost.ps_bytes_per_gpu(t) for t in tables])
        # A server's store holds a bounded number of rows of a table: beyond that the ps tier is no option.
        # Every GPU sends at least one server a lookup and a push per step: their fixed cost on the trainer
        # (CostModel.ps_table_loads), summed over GPUs.
        sync[:, ps] = np.where(ps_holds(rows, lay.n_servers), 2 * G * c.ps_client_ms, np.inf)
        request_ms = 2 * G * c.ps_request_ms
        asyn[0, :, ps] = np.array([cost.ps_moved_bytes(t) for t in tables]) / float(cost.ps_ddr_bw.sum())
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
        # The store's bytes are linear in the rows plus a fixed slack per server that holds a share, and a plan may
        # hash a table over fewer servers than there are: the least any plan can hold is all rows on one server.
        for i, t in enumerate(tables):
            mem[2, i, ps] = float(tier_bytes(t, Tier.PS, even_split(t.rows, 1), t.dim, dtypes[i])[1].sum())
    # Host NICs, weighted: the average over hosts and, where hosts differ, the busiest one alone (largest ms per byte
    # a GPU sends to the servers). A local table's output leaves from its cheapest owner under the weights.
    per_gpu_nic = cost.gpus_per_host / cost.nic_bw
    weights = [np.full(H, 1 / H)]
    if per_gpu_nic.max() > per_gpu_nic.min() * (1 + 1e-9):
        busiest = np.zeros(H)  # one host's weight (not np.eye(H)'s row: H x H)
        busiest[int(np.argmax(per_gpu_nic))] = 1.0
        weights.append(busiest)
    nic = np.zeros((len(weights), T, n_opt))
    # The same hosts' sync path: a GPU's sync time holds its host's all-to-all NIC time, its fixed dense time and
    # the all-reduce of the replicas' gradients at its rate (and at K = 0 the servers' time, the same for every GPU).
    # On a few hosts that differ, every host alone: which one's path is longest depends on the plan.
    host_weights = weights
    if len(weights) > 1 and H <= _EACH_HOST_MAX:
        host_weights = [weights[0], *(np.eye(H)[h] for h in range(H))]
    host = np.zeros((len(host_weights), T, n_opt))
    host_fixed = np.zeros(len(host_weights))
    a2a_bytes = (out_bytes + ids_bytes / 2) * ranged
    gpus_of = [np.flatnonzero(cost.gpu_host == h) for h in range(H)]
    replicated = float(cost.sharding_scale[Sharding.DATA_PARALLEL].min())
    for i, w in enumerate(host_weights):
        host[i, :, :dp] = (a2a_bytes * float(cost.a2a.nic_dot(w).min()))[:, None]
        used_hosts = [h for h in range(H) if w[h] > 0]
        per_byte = sum(w[h] * float(cost.allreduce_ms_per_byte[gpus_of[h]].min()) for h in used_hosts)
        host[i, :, dp] = 4.0 * rows * dims * per_byte * replicated
        host_fixed[i] = sum(w[h] * float(cost.fixed_sync_ms[gpus_of[h]].min()) for h in used_hosts)
    for i, w in enumerate(weights):
        nic[i, :, :dp] = (a2a_bytes * float(cost.a2a.nic_dot(w).min()))[:, None]
        if lay.n_servers:
            nic[i, :, ps] = traffic / G * float(w @ per_gpu_nic)
    ruled_out = _ruled_out(cost, n_opt)
    ruled_out &= (np.isfinite(sync) & ~ruled_out).any(axis=1, keepdims=True)
    sync[ruled_out] = np.inf
    return sync, sync_ddr, asyn, nic, (host, host_fixed), mem, fractions


def _ruled_out(cost: CostModel, n_opt: int) -> np.ndarray:
    """T x O: the options each table's constraints rule out (the pairs :func:`.constraint_checks.placeable` leaves
    out: their sharding types, tiers, devices)."""
    columns = _columns(cost)
    out = np.zeros((len(cost.model.tables), n_opt), dtype=bool)
    for i, table in enumerate(cost.model.tables):
        if not table.constraints.constrained:
            continue
        pairs = placeable(table, cost.topology)
        replica = any(s is Sharding.DATA_PARALLEL for s, _ in pairs)
        tiers = {t for s, t in pairs if s is not Sharding.DATA_PARALLEL}
        out[i] = [not (replica if c.replicated else c.tier in tiers) for c in columns]
    return out


def lower_bound(cost: CostModel, *, max_weightings: int = MAX_WEIGHTINGS) -> LowerBound:
    """A lower bound (ms) on the step time of any plan of ``cost.model`` on ``cost.topology``, with the tier
    assignment of the relaxation's best solution (a Lagrangian hint the search starts from).

    Args:
        cost: The cost model of the model and topology.
        max_weightings: Weightings of the functionals the search over weights evaluates at most (each one a
            maximisation over the memory prices). The bound holds for any value; more can only tighten it.
    """
    if max_weightings < 1:
        raise ValueError(f"max_weightings must be at least 1, got {max_weightings}")
    lay = cost.layout
    sync, sync_ddr, asyn, nic, (host, host_fixed), mem, fractions = _table_terms(cost)
    feasible = np.isfinite(sync)
    sync_avg = np.where(feasible, sync / lay.n_gpus, 0.0)
    ddr_avg = np.where(feasible, sync_ddr / lay.n_gpus, 0.0)
    fixed = float(np.mean(cost.fixed_sync_ms))
    caps = cost.capacities() + 0.5  # validate() allows half a byte over each device's capacity
    # A fourth, implied constraint: HBM + trainer DDR together. Its price moves both local tiers at once, which
    # the per-tier prices alone cannot do without oscillating (a table priced out of HBM lands in DDR and back).
    mem = np.concatenate([mem, (mem[0] + mem[1])[None]], axis=0)
    capacity = np.array(
        [caps[lay.hbm].sum(), caps[lay.ddr].sum(), caps[lay.ps_mem].sum(), caps[lay.hbm].sum() + caps[lay.ddr].sum()]
    )
    # An option whose bytes alone exceed an aggregate capacity is in no valid plan. A table's cached shards may mix
    # the cache fractions, so those options go together, where even the smallest cache does not fit. (Where a table
    # fits nowhere no plan exists: its options stay, so that the bound stays finite.)
    fits = np.all(mem <= capacity[:, None, None], axis=0)
    columns = _columns(cost)
    cached = np.array([c.tier is Tier.HBM_CACHE for c in columns])
    fits[:, cached] = fits[:, cached].any(axis=1, keepdims=True)
    feasible &= fits | ~np.any(feasible & fits, axis=1, keepdims=True)
    # A capacity that even the most memory-hungry option of every table cannot exceed never binds: price 0.
    binding = [k for k in (3, 0, 1, 2) if capacity[k] < float(mem[k].max(axis=1).sum())]
    rows = np.arange(len(sync))
    positive = mem[mem > 0]
    mem_scale = float(positive.min()) if positive.size else 1.0

    # The maximisation evaluates the Lagrangian thousands of times on 1,000 tables: flat views and the infeasible
    # options' inf added once per functional keep each evaluation to a few whole-array operations.
    n_options = mem.shape[2]
    mem_flat = mem.reshape(len(mem), -1)
    row_starts = rows * n_options
    # The picks' bytes are gathered from a copy with the options' memory rows side by side: np.take of its rows is
    # what mem_flat[:, flat] gives (the same layout, so sum() adds in the same order: the same bits), without the
    # fancy index's strided copy, twice as slow.
    mem_rows = np.ascontiguousarray(mem_flat.T)

    def evaluate(masked: np.ndarray, constant: float, mu: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
        """``masked``: the terms with inf where an option is infeasible."""
        c = masked + np.dot(mu[None, :], mem_flat).reshape(masked.shape)  # what np.tensordot(mu, mem, 1) does
        pick = c.argmin(axis=1)
        flat = row_starts + pick
        value = constant + float(c.ravel()[flat].sum()) - float(mu @ capacity)
        used = mem_rows.take(flat, axis=0).sum(axis=0)
        return value, used - capacity, pick

    warm = np.zeros(4)  # prices of the previous weights: neighbouring weights have nearby optimal prices

    def maximise(terms: np.ndarray, constant: float) -> tuple[float, np.ndarray]:
        """max over mu >= 0 by bisection on the subgradient (L is concave, piecewise linear in each price), two
        rounds over the binding capacities, warm-started from the previous call's prices.

        Returns the best bound seen and the tables' cheapest options at the final prices, each price on the side
        where its capacity holds (so the picks make a near-feasible start for the search)."""
        mu = warm.copy()
        terms = np.where(feasible, terms, np.inf)
        value, slope, pick = evaluate(terms, constant, mu)
        # No price above (largest term / smallest memory) changes a pick: the search range ends there.
        log_top = np.log10(max(float(np.abs(terms[feasible]).max(initial=0.0)), 1e-12) / mem_scale) + 1
        full_range = (log_top - 17, log_top)
        for _ in range(2 if len(binding) > 1 else 1):
            for k in binding:
                if slope[k] <= 0 and mu[k] == 0:
                    continue
                if mu[k] > 0:
                    lo, hi = np.log10(mu[k]) - 2, np.log10(mu[k]) + 2
                    mu[k] = 10**lo
                    v_lo, sl_lo, _ = evaluate(terms, constant, mu)
                    mu[k] = 10**hi
                    v_hi, sl_hi, _ = evaluate(terms, constant, mu)
                    value = max(value, v_lo, v_hi)
                    if not (sl_lo[k] > 0 >= sl_hi[k]):
                        lo, hi = full_range
                else:
                    lo, hi = full_range
                for _ in range(13):
                    mid = (lo + hi) / 2
                    mu[k] = 10**mid
                    v, sl, _ = evaluate(terms, constant, mu)
                    value = max(value, v)
                    lo, hi = (mid, hi) if sl[k] > 0 else (lo, mid)
                mu[k] = 10**hi
                v, slope, pick = evaluate(terms, constant, mu)
                value = max(value, v)
        warm[:] = mu
        return value, pick

    synchronous = cost.model.staleness == 0
    used = [r for r in range(_ASYNC) if asyn[r].max(initial=0.0) > 0]
    # Linear functionals F_j (per-table terms, a constant in ms) with step >= F_j for every plan.
    functionals: list[tuple[np.ndarray, float]] = []
    names: list[str] = []
    shared = [r for r in used if r < 3]  # the servers' DDR and NICs and the switch: the same for every GPU
    if synchronous and used:
        strongest = max(used, key=lambda r: float(asyn[r].max(axis=1).sum()))
        functionals.append((sync_avg + asyn[strongest], fixed))
        functionals.append((ddr_avg + asyn[strongest], fixed))
        names += [f"GPU work + {_ASYNC_NAMES[strongest]} (K = 0)", f"GPU work via host DDR + {_ASYNC_NAMES[strongest]}"]
    else:
        functionals.append((sync_avg, fixed))
        functionals.append((ddr_avg, fixed))
        names += ["GPU work (average)", "GPU work via host DDR (average)"]
        # The two strongest asynchronous resources carry the bound; more only slow the weight search down.
        strongest_two = sorted(used, key=lambda r: -float(asyn[r].max(axis=1).sum()))[:2]
        functionals.extend((asyn[r], 0.0) for r in strongest_two)
        names += [_ASYNC_NAMES[r] for r in strongest_two]
    functionals.extend((f, 0.0) for f in nic)
    names += ["host NICs (average)", "busiest host NIC"][: len(nic)]
    # A host's sync path. At K = 0 the servers' time joins it: only a resource every GPU waits on alike.
    joined = max(shared, key=lambda r: float(asyn[r].max(axis=1).sum())) if synchronous and shared else None
    host_names = ["hosts' sync path (average)"]
    if len(host) == 2:
        host_names.append("busiest host's sync path")
    elif len(host) > 2:
        host_names += [f"host {h.name}'s sync path" for h in cost.topology.trainers]
    for which, f, constant in zip(host_names, host, host_fixed, strict=True):
        if joined is None:
            functionals.append((f, float(constant)))
            names.append(which)
        else:
            functionals.append((f + asyn[joined], float(constant)))
            names.append(f"{which} + {_ASYNC_NAMES[joined]} (K = 0)")

    def combination(weights: np.ndarray) -> tuple[np.ndarray, float]:
        terms = sum(w * f[0] for w, f in zip(weights, functionals, strict=True) if w > 0)
        constant = sum(w * f[1] for w, f in zip(weights, functionals, strict=True))
        return np.asarray(terms) + np.zeros_like(sync_avg), constant

    calls = 0

    def combined(weights: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
        nonlocal calls
        calls += 1
        value, pick = maximise(*combination(weights))
        return value, pick, warm.copy()

    def repair(pick: np.ndarray, terms: np.ndarray) -> np.ndarray:
        """Make the relaxation's picks fit: while a capacity is over, move the tables that free its bytes at the
        least extra cost per byte to their cheapest option that uses less of it."""
        pick = pick.copy()
        cost_now = np.where(feasible, terms, np.inf)
        for _ in range(4):
            over = mem[:, rows, pick].sum(axis=1) - capacity
            if np.all(over <= 0):
                break
            full = over >= 0
            for k in np.flatnonzero(over > 0):
                held = mem[k, rows, pick]
                # Never push bytes into another capacity that is already full.
                grows_full = np.any(full[:, None, None] & (mem > mem[:, rows, pick][:, :, None]), axis=0)
                alternative = np.where((mem[k] < held[:, None]) & ~grows_full, cost_now, np.inf)
                alt = np.argmin(alternative, axis=1)
                extra = alternative[rows, alt] - cost_now[rows, pick]
                freed = held - mem[k, rows, alt]
                ratio = np.where((freed > 0) & np.isfinite(extra), extra / np.maximum(freed, 1e-300), np.inf)
                order = np.argsort(ratio, kind="stable")
                enough = int(np.searchsorted(np.cumsum(freed[order]), over[k])) + 1
                moved = order[:enough][np.isfinite(ratio[order[:enough]])]
                pick[moved] = alt[moved]
        return pick

    # A functional that stays below the trivial bound even at its largest cannot lift a combination much: drop it.
    all_functionals = list(functionals)
    kept = [
        k
        for k, f in enumerate(functionals)
        if f[1] > 0 or float(np.where(feasible, f[0], -np.inf).max(axis=1).sum()) > fixed
    ]
    functionals, names = [functionals[k] for k in kept], [names[k] for k in kept]
    # Search the simplex of weights: the best pair (sync, one other), then a local pattern search over all.
    n = len(functionals)
    best_w = np.eye(n)[0]
    best, best_pick, best_mu = combined(best_w)
    for j in range(1, n):
        for w in (0.3, 0.6, 0.85):
            if calls >= max_weightings:
                break
            weights = np.zeros(n)
            weights[0], weights[j] = w, 1 - w
            value, pick, mu = combined(weights)
            if value > best:
                best, best_w, best_pick, best_mu = value, weights, pick, mu
    step = 0.1
    # Bounded by a count of weightings, not rounds: any weights give a valid bound, so stopping early only loosens
    # it. Where the relaxation is infeasible (more bytes than the cluster holds) the Lagrangian grows without limit
    # and every move "improves" it. Where every tier is nearly full, the prices warm-started from the previous
    # weighting gain a little in every call (they climb a ridge of coupled capacities one price at a time), so the
    # same weights kept "improving" for seconds, for a bound under 1% tighter (decision 0004).
    while step > 0.03 and calls < max_weightings:
        improved = False
        for i in range(n):
            for j in range(n):
                if i == j or best_w[j] < step / 2 or calls >= max_weightings:
                    continue
                weights = best_w.copy()
                moved = min(step, weights[j])
                weights[i] += moved
                weights[j] -= moved
                value, pick, mu = combined(weights)
                if value > best * (1 + 1e-9):
                    best, best_w, best_pick, best_mu, improved = value, weights, pick, mu, True
        if not improved:
            step /= 2
    best_pick = repair(best_pick, combination(best_w)[0])
    preferred = {
        t.name: TierChoice(columns[p].tier, float(fractions[i, p]), columns[p].replicated)
        for i, (t, p) in enumerate(zip(cost.model.tables, best_pick.tolist(), strict=True))
    }
    prices = (float(best_mu[0] + best_mu[3]), float(best_mu[1] + best_mu[3]), float(best_mu[2]))
    # The relaxed step of the hinted tiers: the largest functional there. A Lagrangian pick is only optimal for its
    # weights; when it overloads a resource the weights ignored, the search should not follow it.
    hinted_ms = max(
        float(np.where(feasible, f, 0.0)[rows, best_pick].sum()) + constant for f, constant in all_functionals
    )
    parts = tuple(BoundPart(name, float(w)) for name, w in zip(names, best_w.tolist(), strict=True) if w > 0)
    binding_names = tuple(_CAPACITY_NAMES[k] for k in range(len(best_mu)) if best_mu[k] > 0)
    if fixed >= best:
        parts, binding_names = (BoundPart("dense step alone", 1.0),), ()
    return LowerBound(max(best, fixed), preferred, prices, hinted_ms, calls, parts, binding_names)


@dataclass(frozen=True)
class BoundPart:
    """One of the step-time functionals the bound combines, and its weight in the combination that gave the bound.

    Attributes:
        name: What it measures, e.g. "GPU work (average)" or "busiest host NIC".
        weight: Its weight (the weights sum to 1).
    """

    name: str
    weight: float


@dataclass(frozen=True)
class TierChoice:
    """A tier-level option of the relaxation (devices and sharding left open)."""

    tier: Tier
    cache_fraction: float = 0.0
    replicated: bool = False


@dataclass(frozen=True)
class LowerBound:
    """The bound, and hints for the search from the relaxation's best solution.

    Attributes:
        value_ms: The bound.
        preferred: Per table, the tier the relaxation gives it (repaired to fit the aggregate capacities).
        prices: Marginal step-time value (ms per byte) of aggregate HBM, trainer DDR and PS DDR.
        hinted_ms: The relaxed step time (largest functional) of the ``preferred`` tiers: how far the hint is from
            balanced. Close to ``value_ms`` means a trustworthy hint.
        weightings: How many weightings of the functionals the search evaluated (at most ``max_weightings``).
        parts: The functionals of the combination that gave the bound, with their weights: what it is made of.
        binding: The memory capacities priced above zero in it (whose room limits the bound).
    """

    value_ms: float
    preferred: Mapping[str, TierChoice]
    prices: tuple[float, float, float] = (0.0, 0.0, 0.0)
    hinted_ms: float = 0.0
    weightings: int = 0
    parts: tuple[BoundPart, ...] = ()
    binding: tuple[str, ...] = ()

    def describe(self) -> str:
        """What the bound is made of, in one line: e.g. "0.85 GPU work (average) + 0.15 busiest host NIC; memory
        priced: HBM"."""
        text = " + ".join(f"{p.weight:.2f} {p.name}" for p in self.parts) or "no functional"
        return text + (f"; memory priced: {', '.join(self.binding)}" if self.binding else "; no memory priced")

    @property
    def trustworthy(self) -> bool:
        """Whether the hinted tiers are nearly balanced (within 30% of the bound) and worth following."""
        return self.hinted_ms <= _HINT_TRUST * self.value_ms


def _columns(cost: CostModel) -> list[TierChoice]:
    """The option columns of ``_table_terms``, in order (each ``hbm_cache`` column's size is per table)."""
    return [
        TierChoice(Tier.HBM),
        TierChoice(Tier.DDR),
        *(TierChoice(Tier.HBM_CACHE) for _ in range(_cache_columns())),
        TierChoice(Tier.HBM, replicated=True),
        TierChoice(Tier.PS),
    ]


def lower_bound_ms(cost: CostModel) -> float:
    """The bound alone (see :func:`lower_bound`)."""
    return lower_bound(cost).value_ms
