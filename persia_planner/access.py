"""How a table's ids are accessed: Zipf(alpha) over its rows (alpha 0 = uniform), as :class:`.specs.TableSpec`
declares. Two questions the cost model asks: what share of lookups a cache of the hottest rows catches, and how many
distinct rows a batch touches (fbgemm's backward, the optimizer and the parameter-server requests work on distinct
rows: the client de-duplicates ids, the fused backward aggregates gradients per row)."""

from __future__ import annotations

import functools
import math

import numpy as np

__all__ = ["expected_unique", "expected_unique_many", "zipf_hit_rate"]

_EXACT_HEAD = 512  # ranks summed one by one; the tail in log-spaced buckets (error below 1e-3)
_TAIL_BUCKETS = 96


def zipf_hit_rate(alpha: float, rows: int, fraction: float) -> float:
    """Share of lookups that hit a cache of the ``fraction`` hottest rows, for Zipf(alpha) ids over ``rows``.

    Uses the generalised harmonic number H(n, a) ~ 1 + (n^(1-a) - 1) / (1 - a) (1 + ln n at a = 1):
    hit = H(k, a) / H(n, a) with k = fraction * rows. Uniform ids (a = 0) give hit = fraction.
    """
    if fraction <= 0:
        return 0.0
    if fraction >= 1:
        return 1.0
    k = max(1.0, fraction * rows)

    def harmonic(n: float) -> float:
        if abs(alpha - 1.0) < 1e-9:
            return 1.0 + math.log(n)
        return 1.0 + (n ** (1.0 - alpha) - 1.0) / (1.0 - alpha)

    if alpha <= 0:
        return k / rows
    return min(1.0, harmonic(k) / harmonic(rows))


def expected_unique_many(alpha: np.ndarray, rows: np.ndarray, draws: np.ndarray) -> np.ndarray:
    """Expected number of distinct rows among ``draws`` independent Zipf(alpha) ids over ``rows``,
    ``sum_i 1 - (1 - p_i)^draws``, for many tables at once (arrays that broadcast together).

    The hottest ranks are summed exactly; the tail in log-spaced buckets whose probability mass is the integral
    of ``i^-alpha`` over the bucket (uniform ids, ``alpha <= 0``, in closed form).
    """
    alpha, rows, draws = (np.asarray(x, dtype=float) for x in np.broadcast_arrays(alpha, rows, draws))
    alpha, rows, draws = alpha.ravel(), np.floor(rows.ravel()), draws.ravel()
    ranks = np.arange(1, _EXACT_HEAD + 1, dtype=float)
    a = np.maximum(alpha, 0.0)[:, None]
    head_w = np.where(ranks[None, :] <= rows[:, None], ranks[None, :] ** -a, 0.0)
    # Tail buckets [lo, hi) between the head and the last row, spaced evenly in log(rank); empty where rows <= head.
    start, stop = _EXACT_HEAD + 0.5, np.maximum(rows + 0.5, _EXACT_HEAD + 0.5)
    edges = start * (stop / start)[:, None] ** (np.arange(_TAIL_BUCKETS + 1) / _TAIL_BUCKETS)[None, :]
    lo, hi = edges[:, :-1], edges[:, 1:]
    one = np.abs(a - 1.0) < 1e-9
    safe = np.where(one, 0.5, 1.0 - a)  # the exponent's 1 - a, away from 0 where a = 1
    mass = np.where(one, np.log(hi) - np.log(lo), (hi**safe - lo**safe) / safe)
    count = hi - lo
    total = head_w.sum(axis=1) + mass.sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        p_head = np.minimum(head_w / total[:, None], 1.0 - 1e-16)
        p_tail = np.minimum(np.where(count > 0, mass / count, 0.0) / total[:, None], 1.0 - 1e-16)
    d = draws[:, None]
    out = np.sum(-np.expm1(d * np.log1p(-p_head)), axis=1) + np.sum(count * -np.expm1(d * np.log1p(-p_tail)), axis=1)
    uniform = alpha <= 0
    if uniform.any():
        r = np.maximum(rows[uniform], 1.0)
        with np.errstate(divide="ignore"):
            out[uniform] = np.where(r > 1, -r * np.expm1(draws[uniform] * np.log1p(-1.0 / r)), 1.0)
    return np.where((rows <= 0) | (draws <= 0), 0.0, out)


@functools.lru_cache(maxsize=4096)
def expected_unique(alpha: float, rows: int, draws: float) -> float:
    """:func:`expected_unique_many` of one table."""
    return float(expected_unique_many(np.array([alpha]), np.array([rows]), np.array([draws]))[0])
