"""One parser for every human-written quantity: sizes, bandwidths, durations and counts.

Sizes: integers (bytes) or ``B KB MB GB TB`` (powers of 1000) and ``KiB MiB GiB TiB`` (powers of 1024); a lower-case
final ``b`` (bits) is an error. Bandwidths: ``B/s`` forms (``3.35TB/s``, ``900GiB/s``) and bit forms (``400Gbps``,
``25Gb/s``, ``1Gib/s``): the case of the final ``b``/``B`` alone decides bits or bytes; returned in bytes/s.
Durations: ``ns us ms s`` (``5us``), lower case only (``5Ms`` is an error, not 5 ms); returned in seconds.
Counts: ``40_000_000``, ``1e9``, ``4M`` is *not* a count.
"""

from __future__ import annotations

import decimal
import enum
import math
import re
from decimal import Decimal

from persia_planner.errors import abbreviate

__all__ = ["Quantity", "UnitError", "format_bytes", "format_rate", "parse"]


class Quantity(enum.StrEnum):
    """The kinds of quantity a field can hold."""

    SIZE = "size"
    BANDWIDTH = "bandwidth"
    DURATION = "duration"
    COUNT = "count"
    NUMBER = "number"


class UnitError(ValueError):
    """A value could not be read as the quantity its field needs. The message says what would be accepted."""


_SIZE_UNITS = {
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "pb": 1000**5,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "pib": 1024**5,
}
_DURATION_UNITS = {
    "ns": Decimal("1e-9"),
    "us": Decimal("1e-6"),
    "µs": Decimal("1e-6"),
    "ms": Decimal("1e-3"),
    "s": Decimal(1),
}
# Decimal, not float, so that "4.1GB" is exactly 4_100_000_000 bytes; the precision keeps any sane input x unit exact.
_EXACT = decimal.Context(prec=60, Emax=decimal.MAX_EMAX, Emin=decimal.MIN_EMIN)
# A sign is accepted so that "-2us" reaches the non-negative check and gets that message, not "not a duration".
_NUMBER = r"[+-]?[0-9][0-9_]*(?:\.[0-9_]*)?(?:[eE][+-]?[0-9]+)?"
_QUANTITY_RE = re.compile(rf"^\s*({_NUMBER})\s*([A-Za-zµ/]*)\s*$")

_EXAMPLES = {
    Quantity.SIZE: "an integer byte count or a size like '80GiB' or '1.5TB'",
    Quantity.BANDWIDTH: "a bandwidth like '64GB/s', '900GiB/s' or '400Gbps'",
    Quantity.DURATION: "a duration like '5us' or '2ms'",
    Quantity.COUNT: "a whole number like 40_000_000 or 1e9",
    Quantity.NUMBER: "a number like 1.05",
}


def _byte_unit(key: str) -> str:
    """The canonical spelling of a size unit given in lower case: ``mib`` -> ``MiB``, ``gb`` -> ``GB``."""
    return key[0].upper() + ("iB" if key.endswith("ib") else "B") if len(key) > 1 else "B"


def _split(value: str, kind: Quantity) -> tuple[Decimal, str]:
    match = _QUANTITY_RE.match(value)
    if not match:
        raise UnitError(f"{abbreviate(value)} is not {_EXAMPLES[kind]}")
    return Decimal(match.group(1).replace("_", "")), match.group(2)


def _scale(value: str, kind: Quantity) -> Decimal:
    number, unit = _split(value, kind)
    key = unit.lower()
    if kind is Quantity.SIZE:
        if unit == "":
            return number
        if key in _SIZE_UNITS:
            if unit.endswith("b"):
                raise UnitError(
                    f"{abbreviate(value)} is in bits (lower-case 'b'); a size is bytes: write {_byte_unit(key)!r}"
                )
            return number * _SIZE_UNITS[key]
    elif kind is Quantity.BANDWIDTH:
        # "Gb/s", "Gbps", "Gib/s": network people write bits with a lower-case b, whatever the prefix.
        prefix = unit[:-2] if key.endswith(("/s", "ps")) else ""
        if prefix.lower() in _SIZE_UNITS:
            per_second = number * _SIZE_UNITS[prefix.lower()]
            return per_second / 8 if prefix.endswith("b") else per_second
    elif kind is Quantity.DURATION:
        if unit in _DURATION_UNITS:
            return number * _DURATION_UNITS[unit]
        if key in _DURATION_UNITS:  # "5Ms" read as 5 ms would hide a typo (or a mega-second)
            raise UnitError(
                f"unit {unit!r} in {abbreviate(value)} is not a duration unit: they are lower case (ns, us, ms, s); "
                f"did you mean {key!r}?"
            )
    elif unit == "":
        return number
    raise UnitError(f"unknown unit {unit!r} in {abbreviate(value)}; expected {_EXAMPLES[kind]}")


def parse(value: object, kind: Quantity) -> float:
    """Parse a human-written quantity into base units.

    Args:
        value: What the user wrote: an int/float (already in base units) or a string with a unit.
        kind: Which quantity the field holds; decides the accepted units.

    Returns:
        Bytes for sizes, bytes/s for bandwidths, seconds for durations, the number for counts. Sizes and counts
        come back as ``int``.

    Raises:
        UnitError: The value is malformed, has an unknown unit, is negative, or is not whole where it must be.
    """
    if isinstance(value, bool) or value is None:
        raise UnitError(f"{abbreviate(value)} is not {_EXAMPLES[kind]}")
    if type(value) is int and value >= 0 and kind in (Quantity.SIZE, Quantity.COUNT):
        return value  # the common case, without Decimal: a plan.json of 200,000 shards reads a million of them
    with decimal.localcontext(_EXACT):
        if isinstance(value, int | float):
            number = Decimal(value)
        elif isinstance(value, str):
            number = _scale(value, kind)
        else:
            raise UnitError(f"{abbreviate(value)} is not {_EXAMPLES[kind]}")
        # float() first: it is cheap even for "1e999999999", which int() would spend minutes expanding.
        if not number.is_finite() or number < 0 or not math.isfinite(float(number)):
            raise UnitError(f"{abbreviate(value)} must be a finite, non-negative {kind.value}")
        if kind in (Quantity.SIZE, Quantity.COUNT):
            if number != number.to_integral_value():
                raise UnitError(
                    f"{abbreviate(value)} is not a whole number of {'bytes' if kind is Quantity.SIZE else 'items'}"
                )
            return int(number)
    return float(number)


def format_bytes(n_bytes: float) -> str:
    """Format a byte count with a binary unit, e.g. ``'74.5 GiB'``."""
    value = float(n_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(value) < 1024 or unit == "PiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_rate(bytes_per_s: float) -> str:
    """Format a bandwidth in decimal units, e.g. ``'64.0 GB/s'``."""
    value = float(bytes_per_s)
    for unit in ("B/s", "KB/s", "MB/s", "GB/s", "TB/s"):
        if abs(value) < 1000 or unit == "TB/s":
            return f"{value:.1f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")
