"""Enumeration: the options (sharding type x tier) of a table worth scoring in the current state.

Pruning keeps the scoring cheap without losing the plans that matter: slower local tiers only once a table no
longer fits one GPU's free HBM, split options only for hot or big tables (or while the local search explores),
replicas only for tiny tables, and nothing that cannot fit. A table's ``constraints:`` narrow its options to the
sharding types, tiers and devices they allow; the ``hbm_cache`` tier is tried at the cache sizes that reach the
constants' hit-rate targets and at the largest the free HBM holds (or at the one the constraints fix).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from persia_planner.bound import TierChoice
from persia_planner.kinds import Sharding
from persia_planner.model.access_pattern import cache_fraction_candidates
from persia_planner.model.pooling import sequence_shardings
from persia_planner.model.specs import TableSpec
from persia_planner.placement.memory import largest_cache_fraction
from persia_planner.placement.shards import row_splittable
from persia_planner.search.base import Option
from persia_planner.tiers import Lookups, Memory, Tier, local_tiers, server_tiers
from persia_planner.topology.hardware import DeviceKind

if TYPE_CHECKING:
    from persia_planner.search.base import FreeRoom, SearchState

__all__ = ["TieredOptions"]

# Data-parallel replicas are only worth it for tiny tables; beyond this share of a GPU's HBM they are not tried.
_DP_MAX_HBM_SHARE = 0.002
# Column-wise splits are tried for tables whose single-GPU work exceeds this share of the current mean GPU load.
_HOT_SHARE = 0.25
_MIN_COLS = 16


def _cpu(state: SearchState) -> bool:
    """Whether the trainers are CPU devices (what fbgemm's kernels run there narrows a sequence table's types)."""
    return state.cost.topology.device_kind is DeviceKind.CPU


class TieredOptions:
    """The default :class:`.base.OptionSource`: every allowed sharding on every allowed tier, pruned by room and heat.

    Column-wise in 2 or 4 and table-column-wise over a host (finer splits pay an input distribution and a kernel per
    shard for little balance); row-wise over every GPU and table-row-wise per host; table-row-wise and
    table-column-wise only where every host has as many GPUs, as TorchRec lays them out.
    """

    def options(
        self, state: SearchState, table: TableSpec, explore: bool = False, hint: TierChoice | None = None
    ) -> list[Option]:
        """Options worth scoring for ``table`` now (prunes those that are dominated or cannot fit).

        With ``explore`` (local search), split options are scored for every table, not only hot or big ones.
        With ``hint``, only the options of the hinted tier, unpruned: the relaxation chose a slower tier for this
        table to leave the faster memory to others."""
        cfg, allowed = state.config, table.constraints
        shardings = frozenset(
            s
            for s in cfg.shardings
            if (allowed.sharding_types is None or s in allowed.sharding_types) and table.allows(s)
        )
        tiers_allowed = frozenset(t for t in cfg.tiers if allowed.tiers is None or t in allowed.tiers)
        gpus = state.allowed_gpus(table)
        opts: list[Option] = []
        size = state.shards.size(table)
        free = state.free_room(gpus)
        tiers = [t for t in local_tiers() if t in tiers_allowed] if free.hbm_sorted else []
        if hint is not None:
            tiers = [t for t in tiers if t is hint.tier and not hint.replicated]
        fits_one_hbm = bool(free.hbm_sorted) and size <= free.hbm_sorted[0]
        in_hbm = any(t.spec.rows_in is Memory.DEVICE for t in tiers)
        for tier in tiers:
            # Slower local tiers only matter once the table no longer fits in one GPU's free HBM.
            if tier.spec.rows_in is not Memory.DEVICE and fits_one_hbm and in_hbm and hint is None:
                continue
            fractions: tuple[float, ...] = (0.0,)
            if tier.spec.cached:
                fractions = self.cache_fractions(state, table, free)
                if hint is not None and allowed.cache_fraction is None:
                    # The relaxation's size, to three digits: the bound covers every size, and plans read better.
                    fractions = (float(f"{hint.cache_fraction:.3g}"),)
            for fraction in fractions:
                opts.extend(self._local_options(state, table, tier, fraction, free, explore, shardings, gpus))
        replica_tiers = [t for t in local_tiers() if t in tiers_allowed and Sharding.DATA_PARALLEL in t.spec.shardings]
        if (
            Sharding.DATA_PARALLEL in shardings
            and (not table.sequence or Sharding.DATA_PARALLEL in sequence_shardings(_cpu(state)))
            and replica_tiers
            and gpus is None
            and size <= _DP_MAX_HBM_SHARE * state.min_hbm
            and (hint is None or hint.replicated)
        ):
            opts.append(Option(Sharding.DATA_PARALLEL, replica_tiers[0]))
        if (
            Sharding.PS_HASH in shardings
            and state.n_servers
            and state.every_server(table)
            and state.shards.whole(("ps_holds", table.name), lambda: state.ps_holds(table))
            and (hint is None or not hint.tier.spec.local)  # the relaxation's one column of the server tiers
        ):
            for tier in server_tiers():
                spec = tier.spec
                if tier not in tiers_allowed or not all(
                    state.servers_hold(m) for m in (spec.rows_in, spec.cache_in) if m
                ):
                    continue
                fractions = self.server_cache_fractions(state, table) if spec.cached else (0.0,)
                opts.extend(Option(Sharding.PS_HASH, tier, cache_fraction=f) for f in fractions)
        return opts

    @staticmethod
    def server_cache_fractions(state: SearchState, table: TableSpec) -> tuple[float, ...]:
        """The cache sizes to try for ``table`` on a cached server tier (``ssd``): the one its constraints fix, else
        the hit-rate targets' and the constants' fixed sizes that leave rows uncached (a cache of every row is an
        uncached tier with a backing store besides)."""
        fixed = table.constraints.cache_fraction
        if fixed is not None:
            return (fixed,)
        constants = state.cost.constants

        def targets() -> tuple[float, ...]:
            hit = constants.cache_hit_targets
            found = cache_fraction_candidates(table.zipf_alpha, table.rows, hit, fixed=constants.cache_fractions)
            return tuple(f for f in found if f < 1.0)

        return state.shards.whole(("server_cache_fractions", table.name), targets)  # type: ignore[return-value]

    @staticmethod
    def cache_fractions(state: SearchState, table: TableSpec, free: FreeRoom) -> tuple[float, ...]:
        """The cache sizes to try for ``table`` on ``hbm_cache`` in ``state``: the one its constraints fix, else
        :func:`persia_planner.model.access_pattern.cache_fraction_candidates` (the hit-rate targets, the largest cache
        the freest GPU holds whole and the largest every GPU holds a row block of, given ``free``) and the constants'
        fixed sizes, but those larger than a row block on every GPU holds (no split holds more: each is scored on every
        GPU first)."""
        fixed = table.constraints.cache_fraction
        if fixed is not None:
            return (fixed,)
        if not free.hbm_sorted:
            return ()
        constants = state.cost.constants

        def targets() -> tuple[float, ...]:
            hit = constants.cache_hit_targets
            return cache_fraction_candidates(table.zipf_alpha, table.rows, hit, fixed=constants.cache_fractions)

        block = -(-table.rows // len(free.hbm_sorted))
        whole = largest_cache_fraction(table, table.rows, table.dim, state.dtype_of(table), free.hbm_sorted[0])
        spread = largest_cache_fraction(table, block, table.dim, state.dtype_of(table), free.hbm_sorted[-1])
        found = set(state.shards.whole(("cache_targets", table.name), targets))  # type: ignore[call-overload]
        found.update(cache_fraction_candidates(0.0, table.rows, (), (whole, spread)))
        return tuple(sorted(f for f in found if f <= max(whole, spread)))

    def _local_options(
        self,
        state: SearchState,
        table: TableSpec,
        tier: Tier,
        fraction: float,
        free: FreeRoom,
        explore: bool,
        shardings: frozenset[Sharding],
        gpus: np.ndarray | None,
    ) -> list[Option]:
        opts: list[Option] = []
        whole = state.shards.range_terms(table, tier, fraction, table.dim)
        hbm_need, ddr_need = whole.hbm, whole.ddr
        # Room for a 1/k piece on k distinct GPUs: the k-th largest free HBM (DDR is per host; checked when the
        # devices are chosen).
        hbm_sorted = free.hbm_sorted

        def room(k: int) -> bool:
            return k <= len(hbm_sorted) and hbm_need / k <= hbm_sorted[k - 1] and ddr_need <= free.ddr_sum

        one_gpu = room(1) and ddr_need <= free.ddr_max
        if one_gpu and Sharding.TABLE_WISE in shardings:
            opts.append(Option(Sharding.TABLE_WISE, tier, fraction))
        # Split options only for hot tables, tables too big for one GPU, or when table-wise is not allowed.
        if one_gpu and Sharding.TABLE_WISE in shardings and not explore and not self._is_hot(state, table, tier):
            return opts
        min_host = min(len(g) for g in state.host_gpus)
        # Allowed GPUs per host: a host-level sharding needs as many of one host's GPUs as it has shards.
        per_host = None if gpus is None else [int(gpus[g].sum()) for g in state.host_gpus]
        for splits in sorted({2, 4, min_host}):
            cols = table.dim // splits
            if splits < 2 or table.dim % splits or cols < _MIN_COLS or not room(splits):
                continue
            if Sharding.COLUMN_WISE in shardings and splits <= 4:
                opts.append(Option(Sharding.COLUMN_WISE, tier, fraction, splits))
            # TorchRec lays table-column-wise out like table-row-wise: the same GPU count on every host.
            if (
                Sharding.TABLE_COLUMN_WISE in shardings
                and splits == min_host
                and state.uniform_hosts
                and (per_host is None or max(per_host) >= splits)
            ):
                opts.append(Option(Sharding.TABLE_COLUMN_WISE, tier, fraction, splits))
        G = state.n_gpus
        if (
            Sharding.ROW_WISE in shardings
            and gpus is None
            and row_splittable(table.rows, G)
            and hbm_need / G <= hbm_sorted[-1]
        ):
            opts.append(Option(Sharding.ROW_WISE, tier, fraction))
        if (
            Sharding.TABLE_ROW_WISE in shardings
            and state.uniform_hosts
            and (per_host is None or max(per_host) == min_host)
            and row_splittable(table.rows, min_host)
            and room(min_host)
        ):
            opts.append(Option(Sharding.TABLE_ROW_WISE, tier, fraction))
        return opts

    def _is_hot(self, state: SearchState, table: TableSpec, tier: Tier) -> bool:
        """Whether one GPU's work for the table is above a share of the mean GPU step."""
        path = (tier.spec.lookups, tier.spec.bandwidth_share)
        work = state.shards.whole(("work", table.name, path), lambda: self._work_ms(state, table, tier))
        return work > _HOT_SHARE * max(state.mean_step, 1e-9)

    @staticmethod
    def _work_ms(state: SearchState, table: TableSpec, tier: Tier) -> float:
        cost = state.cost
        work = cost.moved_bytes(table, cost.batch * table.pooling_factor, table.dim)
        bw = cost.hbm_bw.min() if tier.spec.lookups is Lookups.HBM else cost.uvm_bw.min()
        # As the cost model prices the lookups: times the refitted embedding factor (exact where it is 1).
        return work / (bw * tier.spec.bandwidth_share) * cost.scales["embedding"]
