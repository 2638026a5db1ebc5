"""How a table's ids are accessed: Zipf(alpha) over its rows (alpha 0 = uniform), as :class:`.specs.TableSpec`
declares. Two questions the cost model asks: what share of lookups a cache of the hottest rows catches, and how many
distinct rows a batch touches (fbgemm's backward, the optimizer and the parameter-server requests work on distinct
rows: the client de-duplicates ids, the fused backward aggregates gradients per row)."""

from __future__ import annotations

import functools
import math

import numpy as np

__all__ = ["expected_unique", "zipf_hit_rate"]

_EXACT_HEAD = 2048  # ranks summed one by one; the tail in log-spaced buckets (about 1% error)
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


@functools.lru_cache(maxsize=4096)
def expected_unique(alpha: float, rows: int, draws: float) -> float:
    """Expected number of distinct rows among ``draws`` independent Zipf(alpha) ids over ``rows``:
    ``sum_i 1 - (1 - p_i)^draws``.

    The hottest ranks are summed exactly; the tail in log-spaced buckets whose probability mass is the integral
    of ``i^-alpha`` over the bucket.
    """
    rows = int(rows)
    if rows <= 0 or draws <= 0:
        return 0.0
    if alpha <= 0:
        return float(-rows * math.expm1(draws * math.log1p(-1.0 / rows))) if rows > 1 else 1.0
    head = min(rows, _EXACT_HEAD)
    head_w = np.arange(1, head + 1, dtype=float) ** -alpha
    count = np.ones(head)
    weight = head_w
    if rows > head:
        edges = np.unique(np.round(np.geomspace(head + 1, rows + 1, _TAIL_BUCKETS + 1)).astype(np.int64))
        lo, hi = edges[:-1] - 0.5, edges[1:] - 0.5
        if abs(alpha - 1.0) < 1e-9:
            mass = np.log(hi) - np.log(lo)
        else:
            mass = (hi ** (1 - alpha) - lo ** (1 - alpha)) / (1 - alpha)
        tail_count = np.diff(edges).astype(float)
        count = np.concatenate([count, tail_count])
        weight = np.concatenate([head_w, mass / tail_count])  # each row of a bucket: the bucket's mean weight
    p = np.minimum(weight / float((weight * count).sum()), 1.0 - 1e-16)
    return float(np.sum(count * -np.expm1(draws * np.log1p(-p))))
