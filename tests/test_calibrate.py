"""persia calibrate: every microbenchmark runs and gives a profile the planner fits; bad --out is one line; each
measurement repeats until quiet (or is recorded as noisy), and a step phase whose reference disagrees runs again."""

from __future__ import annotations

import math

import pytest
from typer.testing import CliRunner

from persia_planner.cli import app
from persia_planner.modules.tools.noise import NoiseLog, Quiet, Timing, measure, measure_samples, spread_of
from persia_planner.modules.tools.step_calibration import (
    halves_spread,
    reference_agrees,
    repeat_job,
    sharding_phase,
)
from persia_planner.topology.profile import HardwareProfile


@pytest.mark.processes
@pytest.mark.timeout(600)  # eight small training jobs: minutes on a busy 2-core machine
def test_every_benchmark_gives_figures_the_planner_fits():
    from persia_planner.modules.tools.calibrate import BENCHMARKS, PHASES, Sizes, calibrate

    done = []
    sizes = Sizes.tiny()
    raw = calibrate(sizes=sizes, on_done=lambda name, s: done.append(name), topology_host="trainer")
    assert done == list(PHASES)
    assert raw["machine"]["cpus"] >= 1 and raw["machine"]["torch"]
    assert raw["machine"]["device"] == "cpu" and raw["machine"]["topology_host"] == "trainer"
    # optimizers x dims x (a table out of the caches, one in them) x poolings
    assert len(raw["embedding"]) == 2 * 2 * 2 * 2 and len(raw["collectives"]["all_to_all"]) == 2
    hot = [p for p in raw["embedding"] if p["rows"] == 1024]
    assert len(hot) == 8 and all(0 < p["unique_share"] < 1 for p in hot)  # ids repeat in the small table
    assert len(raw["dense"]["dlrm"]) == 2 * 2
    assert raw["memory"]["codec_values_per_s"] > 1e6  # float32 <-> float16, measured (a few 1e8 a second here)
    profile = HardwareProfile.from_dict(raw)
    figures = [
        profile.stream_bytes_per_s,
        profile.dense_flops_per_s,
        profile.store_update_rows_per_s,
        profile.unique_ids_per_s,
        profile.all_to_all.seconds(1e6),
        profile.ps_lookup.seconds(1000),
        profile.embedding_seconds("rowwise_adagrad", 256, 1024, 64),
        profile.embedding_seconds("rowwise_adagrad", 256, 1024, 64, 100),
        profile.dense_seconds(30_000, 512),
    ]
    assert all(math.isfinite(f) and f > 0 for f in figures), figures
    assert set(profile.embedding_forward) == {"sgd", "rowwise_adagrad"}
    # the small training jobs: their steps against the model's predictions, and what the fit takes from them
    from persia_planner.modules.tools.step_calibration import SHARDING_JOBS, STEP_JOBS

    step = raw["step"]
    assert set(step["jobs"]) == set(STEP_JOBS) == {"large", "ps", "table_wise", *SHARDING_JOBS}
    assert all(j["measured_ms"] > 0 and j["predicted_ms"] > 0 for j in step["jobs"].values())
    assert step["overhead_ms"] >= 0 and step["ps_client_ms"] >= 0 and step["check_error"] > -1
    fitted = profile.fitted_constants()
    assert fitted["step_overhead_ms"] == step["overhead_ms"] and fitted["ps_client_ms"] == step["ps_client_ms"]
    # a factor per TorchRec sharding type but the reference's, each within the range a fit may reach
    assert set(step["sharding_scale"]) == set(SHARDING_JOBS)
    assert all(0.05 <= f <= 100.0 for f in step["sharding_scale"].values())
    assert profile.sharding_scale == step["sharding_scale"]
    # where, and how quietly: every benchmark's measurements and each step job, the reference's two figures
    assert profile.provenance.device == "cpu" and profile.provenance.topology_host == "trainer"
    noise = raw["noise"]["benchmarks"]
    assert set(noise) == {*BENCHMARKS, "step"}
    assert noise["embedding"]["measurements"] == 2 * 2 * 2 * 2 * 2  # a forward and a backward each
    assert noise["collectives"]["measurements"] == 2 * 2 and noise["rpc"]["measurements"] == 2 * 2
    assert noise["step"]["measurements"] == len(STEP_JOBS) + 2  # the reference twice, and before / after
    assert len(step["reference_ms"]) == 2 and 1 <= step["tries"] <= 3 and isinstance(step["noisy"], bool)
    assert profile.noise["benchmarks"] == noise


def test_out_must_be_a_file(tmp_path):
    result = CliRunner().invoke(app, ["calibrate", "--quick", "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert (
        result.output
        == f"error: --out {tmp_path} is a folder; fix: name a file in it, e.g. {tmp_path / 'profile.yaml'}\n"
    )


class FakeMachine:
    """A clock and a call that advances it by scripted seconds: a timed function without timing anything."""

    def __init__(self, durations):
        self.now = 0.0
        self.durations = list(durations)
        self.calls = 0

    def clock(self) -> float:
        return self.now

    def call(self) -> None:
        self.now += self.durations[self.calls % len(self.durations)]
        self.calls += 1


def test_spread_is_the_interquartile_range_over_the_median():
    assert spread_of([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx(2 / 3)
    assert spread_of([2.0, 2.0, 2.0, 2.0, 100.0]) == 0.0  # one slow call does not move it
    assert spread_of([3.0]) == 0.0 and spread_of([0.0, 0.0]) == 0.0


def test_a_quiet_measurement_stops_after_its_first_round():
    machine = FakeMachine([0.002])
    timing = measure(machine.call, 5, Quiet(0.10, 40, 10.0), warmup=1, clock=machine.clock)
    assert timing == Timing(0.002, 0.0, 5, noisy=False)
    assert machine.calls == 6  # the warm-up and one round


def test_a_noisy_measurement_repeats_to_its_count_bound_and_is_marked():
    machine = FakeMachine([0.001, 0.003])
    timing = measure(machine.call, 5, Quiet(0.10, 20, 10.0), warmup=0, clock=machine.clock)
    assert timing.repeats == 20 and timing.noisy
    assert timing.median_s == pytest.approx(0.002) and timing.spread == pytest.approx(1.0)


def test_a_noisy_measurement_stops_at_its_time_bound():
    machine = FakeMachine([1.0, 3.0])
    # rounds of 5 calls: 9 s after the first (under 10 s), 20 s after the second
    timing = measure(machine.call, 5, Quiet(0.10, 1000, 10.0), warmup=0, clock=machine.clock)
    assert timing.repeats == 10 and timing.noisy


def test_a_measurement_that_settles_stops_when_its_spread_is_small():
    # a disturbed first round, then quiet calls: the second round's median holds and the spread falls under 10%
    samples = iter([5.0, 1.0, 9.0, 1.0, 1.0] + [1.0] * 100)
    timing = measure_samples(lambda: next(samples), 5, Quiet(0.10, 40, 1e9), clock=lambda: 0.0)
    assert timing == Timing(1.0, 0.0, 10, noisy=False)


def test_processes_measuring_together_follow_one_verdict():
    verdicts = iter([False, False, True])
    timing = measure_samples(lambda: 1.0, 2, Quiet(0.10, 40, 1e9), clock=lambda: 0.0, agree=lambda _: next(verdicts))
    assert timing.repeats == 6 and not timing.noisy


def test_the_noise_section_names_each_benchmark_s_worst_spread_and_its_noisy_points():
    log = NoiseLog(Quiet(0.10, 20, 1.0))
    timer = log.timer("memory")
    timer.record("stream copy", Timing(0.01, 0.02, 5, noisy=False))
    timer.record("gather 64 B rows", Timing(0.01, 0.34, 20, noisy=True))
    log.extend("rpc", [{"point": "lookup 1 rows", "median_s": 1e-4, "spread": 0.05, "repeats": 10, "noisy": False}])
    assert log.section() == {
        "target_spread": 0.10,
        "benchmarks": {
            "memory": {
                "worst_spread": 0.34,
                "measurements": 2,
                "noisy": [{"point": "gather 64 B rows", "spread": 0.34, "repeats": 20}],
            },
            "rpc": {"worst_spread": 0.05, "measurements": 1, "noisy": []},
        },
    }


def test_longer_bounds_keep_the_target():
    from persia_planner.modules.tools.calibrate import Sizes

    sizes = Sizes.of(True).longer(5)
    assert sizes.quiet == Quiet(0.10, 100, 5.0) and sizes.step_runs == 10 and sizes.step_budget_s == 1000.0


def test_a_job_s_halves_show_a_disturbance_in_part_of_it():
    assert halves_spread([10.0] * 10 + [12.0] * 10) == pytest.approx(0.2)
    assert halves_spread([10.0, 12.0] * 10) == 0.0  # alternating steps: both halves alike
    assert halves_spread([10.0]) == 0.0


def test_a_job_runs_again_while_its_halves_disagree_and_its_quietest_run_is_kept():
    results = iter([{"measured_ms": 30.0, "spread": 0.3}, {"measured_ms": 20.0, "spread": 0.05}])
    job = repeat_job(lambda: next(results), runs=3)
    assert job["measured_ms"] == 20.0 and job["timing"] == Timing(0.02, 0.05, 2, noisy=False)
    results = iter([{"measured_ms": 30.0, "spread": 0.3}, {"measured_ms": 25.0, "spread": 0.2}])
    job = repeat_job(lambda: next(results), runs=2)
    assert job["measured_ms"] == 25.0 and job["timing"] == Timing(0.025, 0.2, 2, noisy=True)


def test_a_job_is_not_run_again_once_the_phase_is_out_of_time():
    results = iter([{"measured_ms": 30.0, "spread": 0.3}, {"measured_ms": 20.0, "spread": 0.05}])
    job = repeat_job(lambda: next(results), runs=3, out_of_time=lambda: True)
    assert job["measured_ms"] == 30.0 and job["timing"] == Timing(0.03, 0.3, 1, noisy=True)


def test_the_reference_before_and_after_must_agree_within_the_tolerance():
    assert reference_agrees(100.0, 109.0) and reference_agrees(109.0, 100.0)
    assert not reference_agrees(100.0, 111.0) and not reference_agrees(111.0, 100.0)


def scripted(reference_ms):
    """A job runner: the reference's steps in turn from ``reference_ms``, every other job 50 ms; logs its calls."""
    steps = iter(reference_ms)
    calls = []

    def run(name):
        calls.append(name)
        return {"measured_ms": next(steps) if name == "table_wise" else 50.0}

    return run, calls


def test_a_phase_whose_reference_agrees_runs_once():
    run, calls = scripted([20.0, 21.0])
    phase = sharding_phase(run, ("row_wise", "column_wise"))
    assert calls == ["table_wise", "row_wise", "column_wise", "table_wise"]
    assert (
        phase.agreed
        and phase.tries == 1
        and phase.jobs == {"row_wise": {"measured_ms": 50.0}} | {"column_wise": {"measured_ms": 50.0}}
    )


def test_a_phase_whose_reference_disagrees_runs_again_and_keeps_the_agreeing_run():
    run, calls = scripted([20.0, 30.0, 20.0, 20.5])
    phase = sharding_phase(run, ("row_wise",))
    assert calls == ["table_wise", "row_wise", "table_wise"] * 2
    assert phase.agreed and phase.tries == 2
    assert (phase.before["measured_ms"], phase.after["measured_ms"]) == (20.0, 20.5)


def test_a_phase_that_still_disagrees_after_its_retries_keeps_the_closest_run_marked():
    run, calls = scripted([20.0, 30.0, 20.0, 25.0, 20.0, 40.0, 99.0])
    phase = sharding_phase(run, ("row_wise",), retries=2)
    assert len(calls) == 9 and not phase.agreed and phase.tries == 3
    assert (phase.before["measured_ms"], phase.after["measured_ms"]) == (20.0, 25.0)
    assert phase.disagreement == pytest.approx(0.25)


@pytest.mark.parametrize("host", ["", " ", "a\x1bb"])
def test_a_host_that_is_no_name_is_refused_before_measuring(tmp_path, host):
    result = CliRunner().invoke(app, ["calibrate", "--quick", "--host", host, "--out", str(tmp_path / "p.yaml")])
    assert result.exit_code == 2
    assert result.output.startswith(f"error: --host {host!r} is no host name; fix: name the topology's host")
    assert not (tmp_path / "p.yaml").exists()


def test_a_phase_is_not_retried_once_out_of_time():
    run, calls = scripted([20.0, 30.0, 20.0, 20.5])
    phase = sharding_phase(run, ("row_wise",), out_of_time=lambda: True)
    assert len(calls) == 3 and not phase.agreed and phase.tries == 1
