"""Id access distributions: cache hit rates and distinct rows per batch, against exact sums and sampling."""

import numpy as np
import pytest

from persia_planner.model.access_pattern import (
    MAX_CACHE_FRACTION,
    MIN_CACHE_FRACTION,
    cache_fraction_candidates,
    cache_fraction_for_hit,
    expected_unique,
    hit_rate_envelope,
    zipf_hit_rate,
)


def exact_unique(alpha: float, rows: int, draws: float) -> float:
    p = np.arange(1, rows + 1, dtype=float) ** -alpha
    p /= p.sum()
    return float(np.sum(-np.expm1(draws * np.log1p(-p))))


@pytest.mark.parametrize(
    ("alpha", "rows", "draws"),
    [(1.05, 20_000, 2048), (1.05, 20_000, 8192), (0.8, 1_000_000, 100_000), (1.2, 3_000_000, 50_000), (1.0, 500, 1e4)],
)
def test_expected_unique_matches_the_exact_sum(alpha, rows, draws):
    assert expected_unique(alpha, rows, draws) == pytest.approx(exact_unique(alpha, rows, draws), rel=1e-3)


def test_expected_unique_of_uniform_ids_is_the_occupancy_formula():
    assert expected_unique(0.0, 1000, 2000) == pytest.approx(1000 * (1 - (1 - 1 / 1000) ** 2000))


def test_expected_unique_matches_sampled_batches():
    rng = np.random.default_rng(0)
    rows, alpha, draws = 5000, 1.05, 4096
    p = np.arange(1, rows + 1, dtype=float) ** -alpha
    counts = [np.unique(rng.choice(rows, draws, p=p / p.sum())).size for _ in range(50)]
    assert expected_unique(alpha, rows, draws) == pytest.approx(np.mean(counts), rel=0.02)


def test_expected_unique_bounds():
    assert expected_unique(1.05, 10**12, 0) == 0.0
    assert expected_unique(1.05, 100, 10**9) == pytest.approx(100)
    assert expected_unique(0.9, 10**12, 1000) <= 1000


# ---- cache sizes from the hit rate --------------------------------------------------------------------------------
@pytest.mark.parametrize("target", [0.5, 0.8, 0.9, 0.95, 0.99])
def test_a_skewed_table_reaches_a_hit_rate_with_a_smaller_cache_than_a_uniform_one(target):
    rows = 40_000_000
    uniform = cache_fraction_for_hit(0.0, rows, target)
    assert uniform == target
    previous = uniform
    for alpha in (0.5, 1.0, 1.05, 1.2):
        skewed = cache_fraction_for_hit(alpha, rows, target)
        assert skewed < previous  # the more skewed, the smaller the cache
        assert zipf_hit_rate(alpha, rows, skewed) == pytest.approx(target, rel=1e-9)
        previous = skewed


def test_cache_candidates_come_from_the_targets_and_the_free_room():
    targets = (0.8, 0.9, 0.95, 0.99)
    skewed = cache_fraction_candidates(1.05, 40_000_000, targets, room=(0.37,))
    assert skewed == (0.00496, 0.0591, 0.232, 0.353, 0.74)  # 0.37 is rounded down to 2^(-6/4), to 3 digits
    for size, target in zip(skewed[:2] + skewed[3:], targets, strict=True):  # rounded up: each target is reached
        assert zipf_hit_rate(1.05, 40_000_000, size) >= target
    assert cache_fraction_candidates(0.0, 40_000_000, targets, room=(0.37,)) == (0.353,)  # uniform: the room only
    assert cache_fraction_candidates(0.0, 40_000_000, targets, room=(MIN_CACHE_FRACTION / 2,)) == ()  # no room
    assert cache_fraction_candidates(3.0, 40_000_000, targets) == (MIN_CACHE_FRACTION,)  # clipped to the smallest
    assert cache_fraction_candidates(0.0, 100, targets, fixed=(0.2, 0.05)) == (0.05, 0.2)  # tried by every table


@pytest.mark.parametrize("alpha", [0.0, 0.3, 1.0, 1.05, 1.4, 3.0])
@pytest.mark.parametrize("rows", [10, 5000, 40_000_000])
def test_the_hit_rate_envelope_is_never_below_the_hit_rate(alpha, rows):
    """Between its points the envelope's polyline is at or above the modelled hit rate (the lower bound relies on
    it), exact at the ends, and has as many points for every table."""
    fractions, hits = hit_rate_envelope(alpha, rows, MIN_CACHE_FRACTION, MAX_CACHE_FRACTION, knots=(4 / rows,))
    assert len(fractions) == len(hit_rate_envelope(0.0, 2, 0.5, 1.0, knots=(0.7,))[0])
    assert list(fractions) == sorted(fractions)
    assert (fractions[0], fractions[-1]) == (MIN_CACHE_FRACTION, MAX_CACHE_FRACTION)
    grid = np.exp(np.linspace(np.log(MIN_CACHE_FRACTION), 0.0, 4001))
    true = np.array([zipf_hit_rate(alpha, rows, f) for f in grid])
    assert np.all(np.interp(grid, fractions, hits) >= true - 1e-12)
    assert hits[0] == zipf_hit_rate(alpha, rows, MIN_CACHE_FRACTION) and hits[-1] == 1.0


def test_the_envelope_of_the_same_table_is_kept_and_read_only():
    """A second cost model of the same tables asks every table's envelope again: the same arrays come back, and
    nobody can change them for the next caller."""
    first = hit_rate_envelope(1.05, 123_457, 0.01, 0.5, knots=(0.02,))
    again = hit_rate_envelope(1.05, 123_457, 0.01, 0.5, knots=[0.02])
    assert first[0] is again[0] and first[1] is again[1]
    with pytest.raises(ValueError):
        first[1][0] = 1.0
    other = hit_rate_envelope(1.05, 123_458, 0.01, 0.5, knots=(0.02,))
    assert other[1] is not first[1]
