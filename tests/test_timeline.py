"""What the steps measured (persia_planner.modules.train.timeline): the run's medians leave out the warm-up and the
profiled steps, also after a migration drops the profiler."""

from __future__ import annotations

from persia_planner.modules.step_breakdown import StepProfiler
from persia_planner.modules.train.loop import StepStats
from persia_planner.modules.train.timeline import Timeline


def test_the_profiled_steps_stay_out_of_the_medians_after_a_migration_drops_the_profiler():
    timeline = Timeline(StepProfiler(start=2, count=3), trainers=1)
    slow = [50.0] * 5  # warm-up (2) and profiled (3): slower
    for index, ms in enumerate([*slow, 10.0, 11.0, 12.0]):
        timeline.record(index + 1, index, StepStats(loss=1.0, step_ms=ms, staleness=0, samples=8))
    assert timeline.unprofiled(timeline.step_ms) == [10.0, 11.0, 12.0]
    timeline.profiler = None  # a migration: the next plan's steps are not profiled
    for index, ms in enumerate([13.0, 14.0], start=8):
        timeline.record(index + 1, index, StepStats(loss=1.0, step_ms=ms, staleness=0, samples=8))
    assert timeline.unprofiled(timeline.step_ms) == [10.0, 11.0, 12.0, 13.0, 14.0]
    assert timeline.breakdown_ms(with_ps=False) == {"data": 0.0}
