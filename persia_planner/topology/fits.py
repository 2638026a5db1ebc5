"""Least-squares fits of measured points: a fixed time plus rates (:func:`fit_terms`, :func:`fit_linear`), and the
engines' fits a hardware profile is made of (:class:`EmbeddingFit` for memory gathers and fbgemm's kernels,
:class:`DenseFit` for the dense MLP). Fitted in relative error, with non-negative coefficients, dropping an outlier
only where the rest agree."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "BYTES_PER_FLOAT",
    "DenseFit",
    "EmbeddingFit",
    "LinearFit",
    "fit_dense",
    "fit_embedding",
    "fit_linear",
    "fit_terms",
]

BYTES_PER_FLOAT = 4  # the benchmarks' tables are fp32


@dataclass(frozen=True)
class LinearFit:
    """``seconds = fixed_s + units / units_per_s``: a per-call (or per-row) cost plus a rate.

    Attributes:
        fixed_s: The cost at zero units (latency, per-row overhead).
        units_per_s: Units (bytes, rows) per second beyond it; ``inf`` when the size does not matter.
        worst_error: Largest relative error of the fit over the points it was fitted to.
    """

    fixed_s: float
    units_per_s: float
    worst_error: float = 0.0

    def seconds(self, units: float) -> float:
        return self.fixed_s + units / self.units_per_s


def fit_terms(
    columns: Mapping[str, Sequence[float]], seconds: Sequence[float], *, robust: bool = True
) -> tuple[dict[str, float], float]:
    """Non-negative least-squares fit of ``seconds`` to ``sum_k coef_k * columns[k]``, in relative error (a small
    call matters as much as a large one: a step makes many small ones).

    ``robust``: a point that the fit without it misses by more than 3x the median relative error (and by more than
    25%) is a measurement hit by the machine's noise, not a shape the model must follow; up to a tenth of the points
    are set aside that way, the worst first. The worst error reported is over the points kept.

    Returns:
        The coefficients by column name (a term the data does not support is 0), and the worst relative error.
    """
    y = np.asarray(seconds, dtype=float)
    if len(y) == 0 or np.any(y <= 0):
        raise ValueError("a fit needs points with positive times")
    names = list(columns)
    x = np.stack([np.asarray(columns[n], dtype=float) for n in names], axis=1) / y[:, None]
    kept = np.ones(len(y), dtype=bool)
    coef, errors = _nnls_relative(x, kept)
    for _ in range(len(y) // 10 if robust else 0):
        # The worst point, judged by the fit without it (an outlier bends the fit that includes it towards itself).
        worst = int(np.argmax(np.where(kept, errors, -1.0)))
        trial = kept.copy()
        trial[worst] = False
        trial_coef, trial_errors = _nnls_relative(x, trial)
        if trial_errors[worst] <= max(0.25, 3 * float(np.median(trial_errors[trial]))):
            break
        kept, coef, errors = trial, trial_coef, trial_errors
    worst_error = float(errors[kept].max()) if coef.any() else 1.0
    return dict(zip(names, (float(c) for c in coef), strict=True)), worst_error


def _nnls_relative(x: np.ndarray, kept: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Coefficients >= 0 minimising the relative errors of the kept rows (each row of ``x`` is already divided by
    its point's seconds, so the target is 1), and every row's absolute relative error."""
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    rows = x[kept]
    while active:  # active set: drop the most negative term and refit, until every term is >= 0
        solution, *_ = np.linalg.lstsq(rows[:, active], np.ones(len(rows)), rcond=None)
        if np.all(solution >= 0):
            coef[active] = solution
            break
        active.pop(int(np.argmin(solution)))
    return coef, np.abs(x @ coef - 1)


def fit_linear(units: Sequence[float], seconds: Sequence[float]) -> LinearFit:
    """Fit ``seconds`` to ``fixed + units / rate`` (see :func:`fit_terms`); a constant where size does not
    matter, a pure rate where there is no measurable fixed cost."""
    coef, worst = fit_terms({"fixed": [1.0] * len(units), "slope": units}, seconds)
    if coef["fixed"] == 0 and coef["slope"] == 0:
        raise ValueError("no positive fit")
    slope = coef["slope"]
    return LinearFit(coef["fixed"], math.inf if slope == 0 else 1.0 / slope, worst)


@dataclass(frozen=True)
class EmbeddingFit:
    """fbgemm TBE time of one call:
    ``bags * per_bag_s + ids * per_id_s + unique * (per_row_s + row_bytes / bytes_per_s)``.

    A bag is one sample's ids of one feature (pooled into one output row); an id is one looked-up row; ``unique``
    counts the distinct rows among the ids. A repeated id finds its row in the CPU's caches, and the fused backward
    aggregates the gradients of a row before it updates the row once: memory traffic follows the distinct rows.

    Attributes:
        per_bag_s: Cost per bag (offsets, the pooled output row).
        per_id_s: Cost per looked-up id (index arithmetic, the gradient's aggregation).
        per_row_s: Cost per distinct row beyond its bytes (a cache miss's latency, the update's bookkeeping).
        bytes_per_s: Rate of a distinct row's bytes (read forward; weights and state read and written backward).
        worst_error: Largest relative error over the fitted points.
    """

    per_bag_s: float
    per_id_s: float
    per_row_s: float
    bytes_per_s: float
    worst_error: float = 0.0

    def seconds(self, bags: float, ids: float, row_bytes: float, unique: float | None = None) -> float:
        """Seconds for ``bags`` bags of ``ids`` ids of ``row_bytes`` each, ``unique`` of them distinct (all if
        None)."""
        rows = ids if unique is None else unique
        return bags * self.per_bag_s + ids * self.per_id_s + rows * (self.per_row_s + row_bytes / self.bytes_per_s)


def fit_embedding(points: Sequence[Mapping[str, float]], rate_key: str) -> EmbeddingFit:
    """Fit :class:`EmbeddingFit` to points of ``{dim, pooling, <rate_key>}`` (ids per second at that pooling) and
    optionally ``unique_share`` (distinct rows / ids; 1 where absent)."""
    # Per id: seconds / ids = per_bag / pooling + per_id + share * (per_row + row_bytes / bytes_per_s)
    share = [float(p.get("unique_share", 1.0)) for p in points]
    coef, worst = fit_terms(
        {
            "bag": [1 / p["pooling"] for p in points],
            "id": [1.0] * len(points),
            "row": share,
            "byte": [u * p["dim"] * BYTES_PER_FLOAT for u, p in zip(share, points, strict=True)],
        },
        [1 / p[rate_key] for p in points],
    )
    byte = coef["byte"]
    return EmbeddingFit(coef["bag"], coef["id"], coef["row"], math.inf if byte == 0 else 1 / byte, worst)


@dataclass(frozen=True)
class DenseFit:
    """Time of a dense step: ``per_call_s + samples * (per_sample_s + flops_per_sample / flops_per_s)``.

    Attributes:
        per_call_s: Per step (launching the layers, the optimizer over every parameter).
        per_sample_s: Per sample beyond its FLOPs (activations, the interaction's gathers, the loss).
        flops_per_s: Forward FLOPs per second, the backward's included (a forward FLOP costs 3 in all).
        worst_error: Largest relative error over the fitted points.
    """

    per_call_s: float
    per_sample_s: float
    flops_per_s: float
    worst_error: float = 0.0

    def seconds(self, flops_per_sample: float, samples: float) -> float:
        return self.per_call_s + samples * (self.per_sample_s + flops_per_sample / self.flops_per_s)


def fit_dense(points: Sequence[Mapping[str, float]]) -> DenseFit:
    """Fit :class:`DenseFit` to points of ``{batch, flops_per_sample, seconds}``."""
    coef, worst = fit_terms(
        {
            "call": [1.0] * len(points),
            "sample": [p["batch"] for p in points],
            "flop": [p["batch"] * p["flops_per_sample"] for p in points],
        },
        [p["seconds"] for p in points],
    )
    flop = coef["flop"]
    return DenseFit(coef["call"], coef["sample"], math.inf if flop == 0 else 1 / flop, worst)
