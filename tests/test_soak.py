"""benchmarks/soak.py's reading of a run: samples/s per window from the steps' times, each process's RSS growth
after warm-up, samples per CPU-second, the probe's step count, and /proc as it reads it (the run itself is the
benchmark's)."""

from __future__ import annotations

import os

import pytest
from benchmark_modules import load

soak = load("soak")


def _steps(rates: list[float], seconds_each: float = 10.0, per_step: int = 100) -> list[dict]:
    """Steps of ``per_step`` samples, ``rates[i]`` samples/s during the i-th ``seconds_each`` seconds."""
    history, t, samples = [], 0.0, 0
    for i, rate in enumerate(rates):
        while t + per_step / rate <= (i + 1) * seconds_each + 1e-9:
            t += per_step / rate
            samples += per_step
            history.append({"t_s": t, "samples": samples})
    return history


def test_windows_give_each_windows_rate_cpu_efficiency_and_rss():
    history = _steps([1000.0, 1000.0, 500.0, 500.0])  # 40 s: the second half at half the rate
    started = 100.0
    # One sample a second: RSS grows 1 KiB/s in trainer0; the trainer uses one CPU-second per second of the
    # machine's 2, the neighbours half a second.
    samples = [
        soak.Sample(started + t, {"trainer0": 1000 + t}, {"trainer0": 10}, {"trainer0": t}, 1.5 * t, 2.0 * t)
        for t in range(0, 41)
    ]
    wins = soak.windows(history, samples, started, 4)
    assert [w.samples_per_s for w in wins] == pytest.approx([1000, 1000, 500, 500])
    # CPU time is read at the sampler's instants, so a step ending on one may fall on either side: one step of 100.
    assert [w.samples_per_cpu_s for w in wins] == pytest.approx([1000, 1000, 500, 500], abs=10)
    assert [w.rss_mb["trainer0"] for w in wins] == pytest.approx([(1000 + t) / 1024 for t in (10, 20, 30, 40)])
    assert wins[1].lo_s == pytest.approx(10) and wins[1].hi_s == pytest.approx(20)
    assert [w.others_cpu for w in wins] == pytest.approx([0.25] * 4)


def test_rss_growth_is_measured_from_the_end_of_warm_up():
    samples = [
        soak.Sample(float(t), {"a": 1000 + 100 * t, "b": 2000}, {"a": 500 + 100 * t, "b": 1000}, {}) for t in range(11)
    ]
    growth = soak.rss_growth(samples, after_warmup=2.0, end=10.0)
    assert growth["a"]["after_warmup"] == pytest.approx(1200 / 1024)
    assert growth["a"]["end"] == pytest.approx(2000 / 1024)
    assert growth["a"]["growth"] == pytest.approx(800 / 1200) and growth["a"]["anon_growth"] == pytest.approx(800 / 700)
    assert growth["a"]["start"] == pytest.approx(1000 / 1024) and growth["a"]["peak"] == growth["a"]["end"]
    assert growth["b"]["growth"] == 0.0


def test_trend_ratio_of_a_line_and_the_probes_step_count():
    assert soak.trend_ratio([(0.0, 100.0), (1.0, 90.0), (2.0, 80.0)]) == pytest.approx(0.8)
    assert soak.trend_ratio([(0.0, 1.0)]) != soak.trend_ratio([(0.0, 1.0)])  # nan: no line through one point
    # 30 steps: the first ends at 5 s (lazy set-up), the loop at 5 + 29 * 0.2 s; 4 s outside it.
    history = [{"t_s": 5.0 + 0.2 * i} for i in range(30)]
    probe = {"history": history, "steps": 30, "wall_step_ms": (5 + 29 * 0.2) * 1e3 / 30, "wall_s": 14.8}
    assert soak.soak_steps(probe, 104.0) == 500  # (104 - 4) s at 0.2 s a step


def test_proc_readings_of_this_process():
    rss, anon = soak.read_memory_kb(os.getpid())
    assert rss > anon > 0
    assert soak.cpu_seconds(os.getpid()) > 0
    assert soak.read_memory_kb(2**22 + 1) is None and soak.cpu_seconds(2**22 + 1) is None  # above pid_max: none
