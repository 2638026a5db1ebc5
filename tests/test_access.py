"""Id access distributions: cache hit rates and distinct rows per batch, against exact sums and sampling."""

import numpy as np
import pytest

from persia_planner.access import expected_unique


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
