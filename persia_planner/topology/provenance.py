"""Where, when and how quietly a profile was measured: its ``machine:`` and ``noise:`` sections.

``persia calibrate`` records the host's name, the device kind it measured (``cpu`` or the CUDA device's name) and,
when given, the topology host (class) the profile is for; a topology refuses a profile whose host or device kind is
not the host's that names it (:mod:`persia_planner.topology.reader`). Each measurement's spread goes to ``noise:``: a
benchmark whose measurements stayed spread after their repeats was disturbed, and its figures are suspect.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from persia_planner.fields import Fields
from persia_planner.units import Quantity

__all__ = [
    "PROVENANCE_KEYS",
    "NoisyPoint",
    "Provenance",
    "disturbed_warnings",
    "noisy_points",
    "provenance_rows",
    "read_machine",
    "read_noise",
]

# The ``machine:`` keys a topology checks: the host's name, the device kind measured, the topology host it is for.
PROVENANCE_KEYS = ("hostname", "device", "topology_host")
_AGAIN = ("run persia calibrate again",)


@dataclass(frozen=True)
class Provenance:
    """Where and when a profile was measured (its ``machine:`` section; None where an older profile lacks it).

    Attributes:
        hostname: The host's name (``socket.gethostname()``).
        device: The device kind measured: ``cpu``, or the CUDA device's name.
        topology_host: The topology host (class) it is for (``persia calibrate --host``; None: any host).
        measured: When (ISO 8601, UTC).
    """

    hostname: str | None = None
    device: str | None = None
    topology_host: str | None = None
    measured: str | None = None

    @classmethod
    def of(cls, machine: Mapping[str, Any]) -> Provenance:
        """The provenance a ``machine:`` section (as :func:`read_machine` gives it) records."""
        measured = machine.get("measured")
        return cls(*(machine.get(k) for k in PROVENANCE_KEYS), None if measured is None else str(measured))


@dataclass(frozen=True)
class NoisyPoint:
    """A measurement whose spread stayed above the target (``noise.benchmarks.<benchmark>.noisy``)."""

    benchmark: str
    point: str
    spread: float
    repeats: int

    def line(self) -> str:
        """``<benchmark> spread 34% over 12 repeats (<point>)``."""
        repeats = f"{self.repeats} repeat{'' if self.repeats == 1 else 's'}"
        return f"{self.benchmark} spread {self.spread:.0%} over {repeats} ({self.point})"


def read_machine(top: Fields) -> dict[str, Any]:
    """The ``machine:`` section as written (anything but a mapping: none), its provenance keys strings."""
    data = top.take("machine", default={})
    if not isinstance(data, Mapping):
        return {}
    section = Fields(data, top.source, top.key_path("machine"))
    for key in PROVENANCE_KEYS:
        if section.has(key):
            section.take_str(key)
    return dict(data)


def read_noise(top: Fields) -> dict[str, Any]:
    """The ``noise:`` section (empty where the profile has none): ``target_spread`` and per benchmark its
    ``worst_spread``, ``measurements`` and ``noisy`` points (``point``, ``spread``, ``repeats``)."""
    section = top.sub("noise", default=None)
    if section is None:
        return {}
    target = section.take_positive("target_spread", Quantity.NUMBER)
    benchmarks = section.sub("benchmarks")
    assert benchmarks is not None
    read: dict[str, Any] = {}
    for name in benchmarks.names():
        bench = benchmarks.sub(name)
        assert bench is not None
        worst = _spread(bench, "worst_spread")
        count = bench.take_positive("measurements", Quantity.COUNT)
        noisy = []
        for _, item in bench.take_list("noisy", default=[]):
            point = {"point": item.take_str("point"), "spread": _spread(item, "spread")}
            point["repeats"] = item.take_positive("repeats", Quantity.COUNT)
            item.finish()
            noisy.append(point)
        bench.finish()
        read[name] = {"worst_spread": worst, "measurements": count, "noisy": noisy}
    benchmarks.finish()
    section.finish()
    return {"target_spread": target, "benchmarks": read}


def _spread(fields: Fields, key: str) -> float:
    value = fields.take(key, Quantity.NUMBER)
    if value < 0:
        raise fields.error(key, f"must be >= 0, got {value}", fixes=_AGAIN)
    return float(value)


def noisy_points(noise: Mapping[str, Any]) -> list[NoisyPoint]:
    """Every noisy measurement of a ``noise:`` section (as :func:`read_noise` gives it), by benchmark, worst first."""
    return [
        NoisyPoint(name, p["point"], p["spread"], p["repeats"])
        for name, bench in noise.get("benchmarks", {}).items()
        for p in sorted(bench["noisy"], key=lambda p: -p["spread"])
    ]


def disturbed_warnings(noise: Mapping[str, Any], repeated_longer: bool = False) -> list[str]:
    """One ``warning: calibration was disturbed: ...`` line per benchmark with a noisy measurement (its worst; the
    step phase's include its reference disagreeing before and after the other jobs), with the fix."""
    worst: dict[str, str] = {}
    for point in noisy_points(noise):  # worst first within each benchmark
        worst.setdefault(point.benchmark, point.line())
    fix = "re-run persia calibrate on a quiet machine" + ("" if repeated_longer else " or pass --repeat-until-quiet")
    return [f"warning: calibration was disturbed: {line}; {fix}" for line in worst.values()]


def provenance_rows(machine: Mapping[str, Any], noise: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """(figure, value, note) rows of a profile's summary: where and when it was measured, and each benchmark's
    worst spread (with how many of its measurements stayed noisy)."""
    rows = []
    where = [str(machine[k]) for k in ("hostname", "device", "measured") if machine.get(k) is not None]
    if where:
        rows.append(("measured on", ", ".join(where), ""))
    if machine.get("topology_host") is not None:
        rows.append(("for topology host", str(machine["topology_host"]), ""))
    target = noise.get("target_spread")
    for name, bench in noise.get("benchmarks", {}).items():
        count = len(bench["noisy"])
        noisy = f"; {count} of {bench['measurements']} noisy: disturbed" if count else ""
        rows.append((f"spread of {name} (target {target:.0%})", f"{bench['worst_spread']:.0%} worst{noisy}", ""))
    return rows
