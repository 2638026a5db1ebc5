"""Every calibration constant of the cost model, in one place.

Each may be overridden from topology.yaml under ``constants:`` (e.g. after calibrating on real hardware).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

__all__ = ["LIST_CONSTANTS", "CostConstants"]


# Relative to fbgemm's fused kernel, not to a peak: the one efficiency that may exceed 1.
_RELATIVE_EFFICIENCY = "dense_kernel_efficiency"
# Lists of numbers (topology.yaml gives them as YAML lists).
LIST_CONSTANTS = frozenset({"cache_hit_targets", "cache_fractions"})
# Fixed costs that a GPU cluster may not have at all.
_MAY_BE_ZERO = frozenset({"collective_latency_ms", "ps_request_ms", "ps_client_ms", "step_overhead_ms"})


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
        return None


@functools.cache
def _integer_fields() -> frozenset[str]:
    """The constants declared ``int`` (byte counts): YAML's ``8.0`` is taken as 8, a fraction is refused."""
    return frozenset(f.name for f in dataclasses.fields(CostConstants) if f.type in (int, "int"))
