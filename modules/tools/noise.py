"""Timing that knows when it was disturbed: ``persia calibrate``'s measurements repeat until their spread is small.

A measurement runs in rounds of calls; after each round the spread of every call so far (the interquartile range over
the median, which one slow call does not move) is set against a target. A quiet measurement stops at its first round
that meets it; a disturbed one repeats until a bound in calls or in seconds and is kept (its median), but recorded as
noisy. :class:`NoiseLog` gathers each benchmark's measurements into the profile's ``noise:`` section, which
:class:`persia_planner.topology.profile.HardwareProfile` reads back and ``persia calibrate`` warns about.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["NoiseLog", "Quiet", "Timer", "Timing", "measure", "measure_samples", "spread_of"]


@dataclass(frozen=True)
class Quiet:
    """When a measurement may stop repeating.

    Attributes:
        target_spread: The spread (interquartile range / median of the calls so far) at which it stops.
        max_repeats: The most calls it makes (it stops at the end of the round that reaches it).
        max_s: The most seconds it spends (the same way): a slow call is not repeated for minutes.
    """

    target_spread: float = 0.10
    max_repeats: int = 20
    max_s: float = 1.0

    def longer(self, factor: float) -> Quiet:
        """The same target with both bounds ``factor`` times as large (``--repeat-until-quiet``)."""
        return Quiet(self.target_spread, max(1, round(self.max_repeats * factor)), self.max_s * factor)


@dataclass(frozen=True)
class Timing:
    """One measurement: the median call's seconds, the spread of its calls and how many it took."""

    median_s: float
    spread: float
    repeats: int
    noisy: bool


def spread_of(samples: Iterable[float]) -> float:
    """(75th percentile - 25th percentile) / median; 0 for fewer than two samples or a median of 0 (calls below
    the clock's resolution)."""
    values = sorted(samples)
    if len(values) < 2:
        return 0.0
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return (q3 - q1) / median if median > 0 else 0.0


def measure_samples(
    sample: Callable[[], float],
    repeats: int,
    quiet: Quiet,
    clock: Callable[[], float] = time.perf_counter,
    agree: Callable[[bool], bool] | None = None,
) -> Timing:
    """Take ``sample()`` (seconds it measured itself) in rounds of ``repeats`` until their spread is at most
    ``quiet.target_spread``, or a bound of ``quiet`` is reached (then the result is noisy).

    Args:
        agree: Turns this process's verdict after a round (stop or not) into the one every process taking part
            acts on (a collective's processes must make the same calls: they take rank 0's).
    """
    samples: list[float] = []
    started = clock()
    while True:
        samples.extend(sample() for _ in range(max(1, repeats)))
        spread = spread_of(samples)
        quiet_now = spread <= quiet.target_spread
        stop = quiet_now or len(samples) >= quiet.max_repeats or clock() - started >= quiet.max_s
        if agree is not None:
            stop = agree(stop)
        if stop:
            return Timing(statistics.median(samples), spread, len(samples), noisy=not quiet_now)


def measure(
    fn: Callable[[], Any],
    repeats: int,
    quiet: Quiet,
    warmup: int = 1,
    clock: Callable[[], float] = time.perf_counter,
    agree: Callable[[bool], bool] | None = None,
) -> Timing:
    """Time ``fn()`` after ``warmup`` untimed calls, in rounds of ``repeats`` (:func:`measure_samples`)."""
    for _ in range(warmup):
        fn()

    def timed() -> float:
        start = clock()
        fn()
        return clock() - start

    return measure_samples(timed, repeats, quiet, clock, agree)


class Timer:
    """One benchmark's measurements: each one timed until quiet and recorded under its point's name."""

    def __init__(self, quiet: Quiet, records: list[dict[str, Any]]):
        self.quiet = quiet
        self.records = records

    def median_s(
        self,
        point: str,
        fn: Callable[[], Any],
        repeats: int,
        warmup: int = 1,
        agree: Callable[[bool], bool] | None = None,
    ) -> float:
        """The median seconds of ``fn()`` (:func:`measure`), recorded as ``point``."""
        return self.record(point, measure(fn, repeats, self.quiet, warmup, agree=agree))

    def median_sample_s(self, point: str, sample: Callable[[], float], repeats: int) -> float:
        """The median of ``sample()``'s own seconds (:func:`measure_samples`), recorded as ``point``."""
        return self.record(point, measure_samples(sample, repeats, self.quiet))

    def record(self, point: str, timing: Timing) -> float:
        """Keep ``timing`` as ``point``'s; returns its median seconds."""
        self.records.append({"point": point, **asdict(timing)})
        return timing.median_s


class NoiseLog:
    """Every benchmark's measurements, for the profile's ``noise:`` section."""

    def __init__(self, quiet: Quiet):
        self.quiet = quiet
        self.benchmarks: dict[str, list[dict[str, Any]]] = {}

    def timer(self, benchmark: str) -> Timer:
        """The timer that records ``benchmark``'s measurements."""
        return Timer(self.quiet, self.benchmarks.setdefault(benchmark, []))

    def extend(self, benchmark: str, records: Iterable[Mapping[str, Any]]) -> None:
        """Add measurements recorded elsewhere (another process's :attr:`Timer.records`)."""
        self.benchmarks.setdefault(benchmark, []).extend(dict(r) for r in records)

    def section(self) -> dict[str, Any]:
        """The ``noise:`` section: the target, and per benchmark its measurements' worst spread, how many there were
        and the noisy ones (point, spread, repeats), worst first."""
        benchmarks = {}
        for name, records in self.benchmarks.items():
            if not records:
                continue
            noisy = sorted((r for r in records if r["noisy"]), key=lambda r: -r["spread"])
            benchmarks[name] = {
                "worst_spread": max(float(r["spread"]) for r in records),
                "measurements": len(records),
                "noisy": [{"point": r["point"], "spread": float(r["spread"]), "repeats": r["repeats"]} for r in noisy],
            }
        return {"target_spread": self.quiet.target_spread, "benchmarks": benchmarks}
