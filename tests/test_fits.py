"""The least-squares fits a hardware profile is made of: a fixed time plus a rate, in relative error, an outlier set
aside where the other points agree."""

from __future__ import annotations

import math

import numpy as np
import pytest

from persia_planner.topology.fits import fit_linear, fit_terms


def test_fit_recovers_latency_and_bandwidth():
    sizes = [1e3, 1e4, 1e5, 1e6, 1e7]
    fit = fit_linear(sizes, [50e-6 + s / 2e9 for s in sizes])
    assert fit.fixed_s == pytest.approx(50e-6, rel=1e-6)
    assert fit.units_per_s == pytest.approx(2e9, rel=1e-6)
    assert fit.worst_error < 1e-9
    assert fit.seconds(1e6) == pytest.approx(50e-6 + 5e-4)


def test_fit_without_fixed_cost_goes_through_the_origin_and_flat_points_give_a_constant():
    through_origin = fit_linear([1, 2, 4], [0.9, 2.0, 4.1])
    assert through_origin.fixed_s == 0.0 and through_origin.units_per_s == pytest.approx(1.0, rel=0.05)
    flat = fit_linear([10, 100, 1000], [2e-3, 2e-3, 1.9e-3])
    assert math.isinf(flat.units_per_s) and flat.fixed_s == pytest.approx(1.97e-3, rel=0.02)
    with pytest.raises(ValueError):
        fit_linear([1, 2], [0.0, 1.0])


def test_a_fit_sets_aside_a_point_the_machine_s_noise_hit():
    units = np.arange(1, 21, dtype=float) * 1000
    seconds = 1e-4 + units / 1e7
    seconds[7] /= 8  # one measurement far off: a difference of medians on a busy machine
    coef, worst = fit_terms({"fixed": [1.0] * 20, "slope": units}, seconds)
    assert coef["fixed"] == pytest.approx(1e-4, rel=1e-6) and coef["slope"] == pytest.approx(1e-7, rel=1e-6)
    assert worst < 1e-6  # over the points kept
    coef, worst = fit_terms({"fixed": [1.0] * 20, "slope": units}, seconds, robust=False)
    assert worst > 0.5
