"""The launcher's watch over the trainers' progress (modules/launcher/progress.py), on a fake clock: no processes."""

from __future__ import annotations

import os

from persia_planner.modules.launcher.progress import NOT_STARTED, ProgressWatch


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


TRAINERS = [("trainer0", None), ("trainer1", None), ("trainer2", None)]


def _watch(slots: list[int], timeout_s: float = 60.0) -> tuple[ProgressWatch, Clock]:
    clock = Clock()
    return ProgressWatch(slots, timeout_s, clock=clock), clock


def test_a_trainer_behind_the_others_is_named_once_none_advanced_for_the_timeout():
    slots = [159, 158, 159]
    watch, clock = _watch(slots)
    assert watch.check(TRAINERS, [], set()) is None  # first look: the steps just changed
    clock.now = 59.0
    assert watch.check(TRAINERS, [], set()) is None
    slots[0] = slots[2] = 160  # they advanced: the timeout starts again
    assert watch.check(TRAINERS, [], set()) is None
    clock.now = 118.5
    assert watch.check(TRAINERS, [], set()) is None
    clock.now = 120.0
    stall = watch.check(TRAINERS, [], set())
    assert stall is not None
    assert stall.message == "trainer1 made no progress for 61 s (at step 158; the others at step 160)"


def test_trainers_at_the_same_step_or_not_started_are_left_to_their_own_timeouts():
    for slots in ([7, 7, 7], [NOT_STARTED] * 3):
        watch, clock = _watch(slots)
        watch.check(TRAINERS, [], set())
        clock.now = 1000.0
        assert watch.check(TRAINERS, [], set()) is None


def test_a_trainer_that_reported_is_never_named():
    slots = [5, 9, 9]
    watch, clock = _watch(slots)
    watch.check(TRAINERS, [], set())
    clock.now = 100.0
    assert watch.check(TRAINERS, [], {0}) is None


def test_several_behind_are_named_with_their_steps_and_a_fix():
    slots = [NOT_STARTED, 3, 9]
    watch, clock = _watch(slots, timeout_s=5.0)
    watch.check(TRAINERS, [], set())
    clock.now = 5.0
    trainers = [("trainer0", os.getpid()), ("trainer1", None), ("trainer2", None)]
    stall = watch.check(trainers, [], set())
    assert stall is not None
    assert stall.message == (
        "trainer0, trainer1 made no progress for 5 s (trainer0 before its first step; trainer1 at step 3; "
        "the others at step 9)"
    )
    assert stall.fixes == (f"see where it waits (py-spy dump --pid {os.getpid()})",)
