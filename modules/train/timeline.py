"""What a trainer's steps measured (:class:`Timeline`): each step's loss and times, the samples, and what is not
training time; the median step and its parts, over the run (the summary's) or over its last steps (a measurement
window of ``persia train --adapt``, :class:`Window`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from persia_planner.modules.step_breakdown import StepProfiler

__all__ = ["Timeline", "Window", "median"]


@dataclass(frozen=True)
class Window:
    """One measurement window: its steps, their median step and the median step's parts (as the summary's
    ``step_breakdown_ms``)."""

    first_step: int
    last_step: int
    step_ms: float
    breakdown_ms: dict[str, float]


@dataclass
class Timeline:
    """What the steps measured: each step's loss and times, the samples, and what is not training time (the
    evaluations and checkpoints along the way, the profiled steps)."""

    profiler: StepProfiler | None
    trainers: int
    started_s: float = field(default_factory=time.perf_counter)
    running: bool = False  # the loop started (a migration's next plan goes on with the same clock)
    losses: list[float] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)
    data_ms: list[float] = field(default_factory=list)
    ps_ms: dict[str, list[float]] = field(default_factory=lambda: {"ps_wait": [], "push": []})
    history: list[dict[str, Any]] = field(default_factory=list)
    samples: int = 0
    excluded_samples: int = 0
    excluded_steps: int = 0
    excluded_s: float = 0.0
    profiled_through: int = field(init=False, default=0)  # steps up to the profiled ones' end (see __post_init__)

    def record(self, step: int, index: int, stats: Any) -> float:
        """Record step ``step`` (the run's ``index``-th, what the loop measured: a :class:`.loop.StepStats`);
        returns the training rate so far, in samples/s."""
        self.losses.append(stats.loss)
        self.step_ms.append(stats.step_ms)
        self.data_ms.append(stats.data_ms)
        self.ps_ms["ps_wait"].append(stats.ps_wait_ms)
        self.ps_ms["push"].append(stats.push_ms)
        self.samples += stats.samples * self.trainers
        profiler = self.profiler
        if profiler is not None and profiler.start <= index < profiler.start + profiler.count:
            # The breakdown's profiled steps run slower: they are measurement, not training throughput.
            self.excluded_s += (stats.step_ms + stats.data_ms) / 1e3
            self.excluded_samples += stats.samples * self.trainers
            self.excluded_steps += 1
        t_s = time.perf_counter() - self.started_s  # at the step's end, evaluations included: throughput over time
        self.history.append(
            {"step": step, "loss": stats.loss, "samples": self.samples, "staleness": stats.staleness, "t_s": t_s}
        )
        return (self.samples - self.excluded_samples) / max(1e-9, t_s - self.excluded_s)

    def window(self, steps: int, with_ps: bool, last_step: int) -> Window:
        """The last ``steps`` steps (ending with ``last_step``): their median step and its parts (the profile's
        shares where there is one, else the PS terms timed directly and the rest together)."""
        timed = median(self.step_ms[-steps:])
        breakdown = {"data": median(self.data_ms[-steps:])}
        if self.profiler is not None and self.profiler.shares is not None:
            breakdown |= {term: share * timed for term, share in self.profiler.shares.items()}
        elif with_ps:
            breakdown |= {term: median(xs[-steps:]) for term, xs in self.ps_ms.items()}
            breakdown["other"] = max(0.0, timed - breakdown["ps_wait"] - breakdown["push"])
        return Window(last_step - steps + 1, last_step, timed, breakdown)

    def __post_init__(self) -> None:
        # The steps before the profiled ones' end: warm-up and profiled. Kept when a migration drops the profiler
        # (its next plan is not profiled): the run's medians still leave them out.
        self.profiled_through = 0 if self.profiler is None else self.profiler.start + self.profiler.count

    def unprofiled(self, xs: list[float]) -> list[float]:
        """The steps after warm-up, without the profiled ones (the profiler's overhead inflates them)."""
        kept = xs[self.profiled_through :]
        return kept or xs

    def breakdown_ms(self, with_ps: bool) -> dict[str, float]:
        """The median step's parts: the data, and the profiled shares, or without a profile the PS terms timed
        directly and the rest together (decision 0014)."""
        timed = median(self.unprofiled(self.step_ms))
        breakdown = {"data": median(self.unprofiled(self.data_ms))}
        if self.profiler is not None and self.profiler.shares is not None:
            breakdown |= {term: share * timed for term, share in self.profiler.shares.items()}
        elif with_ps:
            breakdown |= {term: median(self.unprofiled(xs)) for term, xs in self.ps_ms.items()}
            breakdown["other"] = max(0.0, timed - breakdown["ps_wait"] - breakdown["push"])
        return breakdown


def median(xs: list[float]) -> float:
    """The upper median of ``xs`` (nan for none)."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[len(s) // 2]
