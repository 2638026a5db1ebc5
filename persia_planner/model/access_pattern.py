"""How a table's ids are accessed: Zipf(alpha) over its rows (alpha 0 = uniform), as :class:`.specs.TableSpec`
declares. Two questions the cost model asks: what share of lookups a cache of the hottest rows catches, and how many
distinct rows a batch touches (fbgemm's backward, the optimizer and the parameter-server requests work on distinct
rows: the client de-duplicates ids, the fused backward aggregates gradients per row).

The hit rate also sizes the cache: :func:`cache_fraction_candidates` are the cache sizes the search tries for a table
(where the modelled hit rate reaches a few targets, and what the free HBM holds), and :func:`hit_rate_envelope` lets
the lower bound cover every size from :data:`MIN_CACHE_FRACTION` to :data:`MAX_CACHE_FRACTION` at once."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np

__all__ = [
    "MAX_CACHE_FRACTION",
    "MIN_CACHE_FRACTION",
    "cache_fraction_candidates",
    "cache_fraction_for_hit",
    "cache_misses",
    "expected_unique",
    "expected_unique_many",
    "hit_rate_envelope",
    "zipf_hit_rate",
]

_EXACT_HEAD = 512  # ranks summed one by one; the tail in log-spaced buckets (error below 1e-3)
_TAIL_BUCKETS = 96

MIN_CACHE_FRACTION = 1e-3
"""The smallest HBM cache the search sizes, as a share of the table's rows. Below it the cache is a few rows of a
small table (fbgemm allocates whole sets of 32 slots anyway) or a hit rate the ``ddr`` tier nearly matches."""
MAX_CACHE_FRACTION = 1.0
"""The largest: every row cached (more HBM than the ``hbm`` tier takes; of use where the table may not go there)."""
_ROOM_STEP = 2**0.25
"""Sizes from free room are rounded down to powers of this: a table gets a few dozen sizes over a search, not a new one
at every state (each is scored, and its terms kept, per size)."""
_SIGNIFICANT = 3  # digits of a size from a hit-rate target (rounded up: the target is still reached)
_TANGENTS = 8  # tangents of the hit-rate curve whose envelope the bound uses (the gap shrinks with their square)


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
    if alpha <= 0:
        return k / rows
    return min(1.0, _harmonic(alpha, k) / _harmonic(alpha, rows))


def cache_misses(alpha: float, rows: int, lookups: float, distinct: float, fraction: float) -> float:
    """Rows a cache of the ``fraction`` hottest rows misses in a batch of ``lookups`` lookups of ``distinct`` rows:
    the lookups outside the cache (:func:`zipf_hit_rate`), each a row of its own (cold rows seldom repeat within a
    batch), at most the distinct rows."""
    return min(distinct, lookups * (1.0 - zipf_hit_rate(alpha, rows, fraction)))


def _harmonic(alpha: float, n: float) -> float:
    """H(n, alpha) as :func:`zipf_hit_rate` approximates it."""
    if abs(alpha - 1.0) < 1e-9:
        return 1.0 + math.log(n)
    return 1.0 + (n ** (1.0 - alpha) - 1.0) / (1.0 - alpha)


def _hit_slope(alpha: float, rows: int, fraction: float) -> float:
    """d hit / d fraction of :func:`zipf_hit_rate` where ``fraction * rows >= 1`` (``rows k^-alpha / H(rows)``)."""
    if alpha <= 0:
        return 1.0
    return rows * (fraction * rows) ** -alpha / _harmonic(alpha, rows)


def cache_fraction_for_hit(alpha: float, rows: int, target: float) -> float:
    """The smallest cache fraction whose :func:`zipf_hit_rate` reaches ``target``: H(k, a) = target H(rows, a)
    solved for k (k = target x rows for uniform ids), as a share of the rows."""
    if target <= 0:
        return 0.0
    if target >= 1:
        return 1.0
    if alpha <= 0:
        return target
    y = target * _harmonic(alpha, rows)
    k = math.exp(y - 1.0) if abs(alpha - 1.0) < 1e-9 else (1.0 + (y - 1.0) * (1.0 - alpha)) ** (1.0 / (1.0 - alpha))
    return min(1.0, max(k, 1.0) / rows)  # k < 1: the hottest row alone hits that often


def cache_fraction_candidates(
    alpha: float, rows: int, targets: Sequence[float], room: Sequence[float] = (), fixed: Sequence[float] = ()
) -> tuple[float, ...]:
    """The HBM-cache sizes (shares of the table's rows) worth trying for a table, smallest first, each once.

    Where its ids are skewed, the sizes at which the modelled hit rate reaches each of ``targets`` (e.g. 0.8 .. 0.99;
    rounded up to three significant digits); for uniform ids (``alpha <= 0``) a hit rate costs its share of the rows
    in HBM, so no target is worth a size of its own. Then each of ``room``, the largest caches the free HBM holds
    (rounded down to a power of 2^(1/4)). All within [:data:`MIN_CACHE_FRACTION`, :data:`MAX_CACHE_FRACTION`]; a room
    below the smallest size is left out (that cache does not fit). And the ``fixed`` sizes every table tries, as
    they are.
    """
    found: set[float] = set(fixed)
    if alpha > 0:
        for target in targets:
            found.add(_clip(_round_up(cache_fraction_for_hit(alpha, rows, target))))
    for fraction in room:
        if fraction >= MIN_CACHE_FRACTION:
            found.add(_clip(_round_down_to_step(fraction)))
    return tuple(sorted(found))


def _clip(fraction: float) -> float:
    return min(MAX_CACHE_FRACTION, max(MIN_CACHE_FRACTION, fraction))


def _round_up(fraction: float) -> float:
    """``fraction`` rounded up to :data:`_SIGNIFICANT` digits (plans show 0.0591, not 0.05907774794113913)."""
    if fraction <= 0:
        return fraction
    exponent = math.floor(math.log10(fraction)) - _SIGNIFICANT + 1
    return round(math.ceil(fraction / 10.0**exponent - 1e-9) * 10.0**exponent, -exponent)


def _round_down_to_step(fraction: float) -> float:
    """The largest power of :data:`_ROOM_STEP` at most ``fraction``, cut to :data:`_SIGNIFICANT` digits."""
    power = math.floor(math.log(fraction, _ROOM_STEP) + 1e-9)
    while _ROOM_STEP**power > fraction:  # the logarithm's rounding
        power -= 1
    step = _ROOM_STEP**power
    exponent = math.floor(math.log10(step)) - _SIGNIFICANT + 1
    return round(math.floor(step / 10.0**exponent) * 10.0**exponent, -exponent)


def hit_rate_envelope(
    alpha: float, rows: int, lo: float, hi: float, knots: Sequence[float] = ()
) -> tuple[np.ndarray, np.ndarray]:
    """Cache fractions from ``lo`` to ``hi`` (sorted) and a hit rate at each, such that the line between neighbours
    is nowhere below :func:`zipf_hit_rate` (exact at ``lo`` and ``hi``), plus ``knots`` (fractions where the caller's
    costs bend) on that polyline; always ``_TANGENTS + 2 + len(knots)`` points.

    The hit rate is concave in the fraction (H(k, a) grows ever slower in k) once the cache holds a row, and flat
    below: the polyline is the least of tangents at fractions spaced evenly in log between the two, through their
    crossings. So a cost that is linear in the hit rate and in the fraction between these points is, over all of
    [lo, hi], at least its least value at one of them: what lets the lower bound cover every cache size at once.

    The arrays are read-only: they are kept for later calls with the same arguments (each cost model of a model
    asks them again for every table: the planner's float32 and narrowed collectives, the sizer's shapes).
    """
    return _envelope(alpha, rows, lo, hi, tuple(knots))


@functools.lru_cache(maxsize=16_384)
def _envelope(
    alpha: float, rows: int, lo: float, hi: float, knots_in: tuple[float, ...]
) -> tuple[np.ndarray, np.ndarray]:
    fractions, values = _computed_envelope(alpha, rows, lo, hi, knots_in)
    fractions.setflags(write=False)
    values.setflags(write=False)
    return fractions, values


def _computed_envelope(
    alpha: float, rows: int, lo: float, hi: float, knots_in: tuple[float, ...]
) -> tuple[np.ndarray, np.ndarray]:
    knots = [min(max(k, lo), hi) for k in knots_in]  # one outside adds nothing; kept, so every table has n points
    a = min(max(lo, 1.0 / rows), hi)  # the hit rate is flat below one row cached, concave above
    n = _TANGENTS + 2 + len(knots)
    if alpha <= 0 or a >= hi:  # linear above a (or all flat): the line through the ends is the curve
        base = [lo, a, hi]
        fractions = np.array(sorted(base + knots + [hi] * (n - len(base) - len(knots))))
        return fractions, np.array([zipf_hit_rate(alpha, rows, f) for f in fractions])
    touch = a * (hi / a) ** (np.arange(_TANGENTS) / (_TANGENTS - 1))
    hit = np.array([zipf_hit_rate(alpha, rows, t) for t in touch])
    slope = np.array([_hit_slope(alpha, rows, t) for t in touch])
    intercept = hit - slope * touch

    def envelope(f: np.ndarray) -> np.ndarray:
        value = np.min(intercept[None, :] + slope[None, :] * f[:, None], axis=1)
        flat = f <= a
        return np.minimum(np.where(flat, hit[0], value * (1 + 1e-12)), 1.0)

    with np.errstate(divide="ignore", invalid="ignore"):
        cross = (intercept[1:] - intercept[:-1]) / (slope[:-1] - slope[1:])
    cross = np.where(np.isfinite(cross), np.clip(cross, touch[:-1], touch[1:]), touch[1:])
    fractions = np.sort(np.concatenate([[lo, a], cross, [hi], knots]))
    values = envelope(fractions)
    values[0], values[-1] = zipf_hit_rate(alpha, rows, lo), zipf_hit_rate(alpha, rows, hi)
    return fractions, values


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
