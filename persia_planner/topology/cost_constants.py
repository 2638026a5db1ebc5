"""Every calibration constant of the cost model, in one place.

Each may be overridden from topology.yaml under ``constants:`` (e.g. after calibrating on real hardware).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

__all__ = ["LIST_CONSTANTS", "REFIT_SHARDINGS", "SCALED_TERMS", "SCALE_RANGE", "CostConstants", "scale_name"]


# Relative to fbgemm's fused kernel, not to a peak: the one efficiency that may exceed 1.
_RELATIVE_EFFICIENCY = "dense_kernel_efficiency"
# Lists of numbers (topology.yaml gives them as YAML lists).
LIST_CONSTANTS = frozenset({"cache_hit_targets", "cache_fractions"})
# Fixed costs that a GPU cluster may not have at all.
_MAY_BE_ZERO = frozenset({"collective_latency_ms", "ps_request_ms", "ps_client_ms", "step_overhead_ms"})
# The step's parts a run measures (Estimate.slowest_gpu_terms names them), each with a factor refitted from runs.
SCALED_TERMS = ("embedding", "all_to_all", "dense", "all_reduce", "ps")
# The sharding types whose exchange (their share of the all-to-all part) has a factor of its own, refitted from runs:
# TorchRec's range shardings (a data-parallel table has no exchange; a PS table's requests are the ps part).
REFIT_SHARDINGS = ("table_wise", "row_wise", "column_wise", "table_row_wise", "table_column_wise")
# The range a refitted factor is kept in: beyond it a run measured something else than the model prices (a stall, a
# term the model lacks), not a rate to correct.
SCALE_RANGE = (0.05, 20.0)


def scale_name(term: str) -> str:
    """The constant that multiplies ``term`` (one of :data:`SCALED_TERMS`), or a sharding type's exchange (one of
    :data:`REFIT_SHARDINGS`): ``<term>_scale``."""
    return f"{term}_scale"


@dataclass(frozen=True)
class CostConstants:
    """Efficiency factors (achieved / peak) and planner reservations.

    Attributes:
        hbm_efficiency: Fraction of HBM peak bandwidth that fbgemm's TBE lookups/updates reach.
        uvm_efficiency: Fraction of the GPU<->host path bandwidth reached by UVM reads/writes of DDR rows (random
            row-sized accesses over PCIe: TorchRec's planner measured ~1/10).
        ddr_efficiency: Fraction of a trainer host's DDR bandwidth that the UVM row traffic of all its GPUs reaches.
        nvlink_efficiency: Fraction of NVLink bandwidth reached by all-to-all / all-reduce.
        nic_efficiency: Fraction of NIC / switch bandwidth reached by collectives and PS traffic.
        ps_efficiency: Fraction of a parameter server's DDR bandwidth reached by hash lookups and updates.
        tflops_efficiency: Fraction of peak TFLOPS reached by the dense MLP.
        update_passes: Bytes moved by the backward + optimizer update per looked-up row, in units of the row's
            weight bytes (read grad, read+write weights) on top of reading+writing the optimizer state.
        id_bytes: Bytes per id sent to a shard's GPU or to a parameter server (int64 ids).
        dense_kernel_efficiency: Bandwidth of the dense (non-fused) kernel of data-parallel tables relative to
            fbgemm's fused kernel (TorchRec's planner uses 0.5).
        dp_update_passes: Passes over the whole table that a data-parallel table's dense optimizer makes per step
            (TorchRec's empirical factor for the element-wise kernels: 9.22).
        min_access_bytes: Smallest memory access per row (GPU sectors / cache lines): narrower rows cost as much.
        shard_overhead_ms: Fixed GPU time per shard per step (kernel launches, index bookkeeping), so that splitting
            a table or replicating it is not free.
        collective_latency_ms: Fixed time of one collective between a host's trainers (all-to-all, all-reduce),
            on top of its bytes. A step makes four all-to-alls (TorchRec's input splits and ids, the pooled output
            forward and backward) and one all-reduce. Fitted from a ``profile:`` (gloo on CPU); 0 by default
            (NCCL's microseconds are in the noise of a GPU step).
        ps_request_ms: Fixed cost of one parameter-server request (a lookup or a push to one server) to the server
            that answers it. Fitted from a ``profile:`` (the RPC's round trip); 0 by default.
        ps_client_ms: Fixed cost of one such request to the trainer that sends it (the client's work for a table,
            inside a step). Fitted from a ``profile:``'s training steps; 0 by default.
        step_overhead_ms: Fixed time per step on every trainer beyond the modelled work (TorchRec's input
            distribution, Python, autograd, waits in collectives). Fitted from a ``profile:``'s training steps; 0 by
            default.
        hbm_reserve_fraction: Share of each GPU's HBM the planner leaves free (activations, buffers, cache slack).
        ddr_reserve_fraction: Share of each trainer host's DDR left free (OS, data loader, pinned buffers).
        ps_reserve_fraction: Share of each parameter server's DDR left free (hash-table overhead, checkpoints).
        cache_hit_targets: Hit rates at which the search sizes a skewed table's ``hbm_cache``: each target's
            smallest cache (:func:`persia_planner.model.access_pattern.cache_fraction_candidates`), besides the largest
            the free HBM holds.
        cache_fractions: HBM cache sizes (shares of a table's rows) the search tries for every table besides those
            (between the targets' sizes and the free room's: what weakly skewed tables need).
        embedding_scale: Factor on the step's embedding part (each device's lookup path and its host's DDR: every
            shard's kernels, fixed costs and PS requests' client work), refitted from runs (``refit:`` in a profile,
            :mod:`persia_planner.cost.refit`); 1 by default, as each scale.
        all_to_all_scale: Factor on the all-to-all part (NVLink and the hosts' NICs of the exchange, its fixed cost).
        dense_scale: Factor on the dense part (the dense network and the framework's fixed time per step).
        all_reduce_scale: Factor on the all-reduce (its time per gradient byte and its latency).
        ps_scale: Factor on the parameter servers' part (PCIe, the hosts' NICs for PS traffic, the servers' NICs,
            DDR and disks, the switch and the round trip).
        table_wise_scale: Factor on the exchange of a sharding type's tables (its ids and pooled output in the
            all-to-all part), on top of ``all_to_all_scale`` and of the profile's measured ``sharding_scale`` of the
            type, refitted from runs whose plans use the type; 1 by default, as for ``row_wise_scale``,
            ``column_wise_scale``, ``table_row_wise_scale`` and ``table_column_wise_scale``.
    """

    hbm_efficiency: float = 0.6
    uvm_efficiency: float = 0.1
    ddr_efficiency: float = 0.5
    nvlink_efficiency: float = 0.7
    nic_efficiency: float = 0.8
    ps_efficiency: float = 0.4
    tflops_efficiency: float = 0.5
    update_passes: float = 3.0
    id_bytes: int = 8
    dense_kernel_efficiency: float = 0.5
    dp_update_passes: float = 9.22
    min_access_bytes: int = 128
    shard_overhead_ms: float = 0.01
    collective_latency_ms: float = 0.0
    ps_request_ms: float = 0.0
    ps_client_ms: float = 0.0
    step_overhead_ms: float = 0.0
    hbm_reserve_fraction: float = 0.1
    ddr_reserve_fraction: float = 0.1
    ps_reserve_fraction: float = 0.2
    cache_hit_targets: tuple[float, ...] = (0.8, 0.9, 0.95, 0.99)
    cache_fractions: tuple[float, ...] = (0.05, 0.2)
    embedding_scale: float = 1.0
    all_to_all_scale: float = 1.0
    dense_scale: float = 1.0
    all_reduce_scale: float = 1.0
    ps_scale: float = 1.0
    table_wise_scale: float = 1.0
    row_wise_scale: float = 1.0
    column_wise_scale: float = 1.0
    table_row_wise_scale: float = 1.0
    table_column_wise_scale: float = 1.0

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def replace(self, overrides: dict[str, Any]) -> CostConstants:
        """A copy with ``overrides`` applied (unknown names raise ``KeyError``)."""
        unknown = set(overrides) - set(self.names())
        if unknown:
            raise KeyError(sorted(unknown)[0])
        values = dict(overrides)
        for name in _integer_fields() & set(values):
            if float(values[name]).is_integer():  # YAML's 8.0 is 8; validate() refuses a fraction
                values[name] = int(values[name])
        for name in LIST_CONSTANTS & set(values):
            values[name] = tuple(float(x) for x in values[name])
        return dataclasses.replace(self, **values)

    def term_scales(self) -> dict[str, float]:
        """The refitted factor of each of :data:`SCALED_TERMS`, by term name."""
        return {term: float(getattr(self, scale_name(term))) for term in SCALED_TERMS}

    def sharding_scales(self) -> dict[str, float]:
        """The refitted factor on the exchange of each of :data:`REFIT_SHARDINGS`, by sharding type."""
        return {sharding: float(getattr(self, scale_name(sharding))) for sharding in REFIT_SHARDINGS}

    def validate(self) -> str | None:
        """Return a problem description, or None when every constant is in range."""
        for name in self.names():
            value = getattr(self, name)
            if name in LIST_CONSTANTS:
                if any(not 0 < x < 1 for x in value):
                    return f"{name} must be numbers in (0, 1), got {list(value)}"
            elif name.endswith("reserve_fraction"):
                if not 0 <= value < 1:
                    return f"{name} must be in [0, 1), got {value}"
            elif name.endswith("_efficiency") and name != _RELATIVE_EFFICIENCY:  # achieved / peak
                if not 0 < value <= 1:
                    return f"{name} is a fraction of peak bandwidth or FLOPS and must be in (0, 1], got {value}"
            elif name in _integer_fields():
                if not float(value).is_integer() or value <= 0:  # also refuses inf and nan (int() would raise)
                    return f"{name} must be a whole number of bytes > 0, got {value}"
            elif name in _MAY_BE_ZERO:
                if not 0 <= value < float("inf"):
                    return f"{name} must be a finite number >= 0, got {value}"
            elif value <= 0:
                return f"{name} must be > 0, got {value}"
            elif not value < float("inf"):  # inf, nan
                return f"{name} must be a finite number, got {value}"
        return None


@functools.cache
def _integer_fields() -> frozenset[str]:
    """The constants declared ``int`` (byte counts): YAML's ``8.0`` is taken as 8, a fraction is refused."""
    return frozenset(f.name for f in dataclasses.fields(CostConstants) if f.type in (int, "int"))
