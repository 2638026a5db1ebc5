import math

import pytest

from persia_planner.units import Quantity, UnitError, format_bytes, parse


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (0, 0),
        (1024, 1024),
        ("80GiB", 80 * 1024**3),
        ("1.5TB", 1_500_000_000_000),
        ("2TiB", 2 * 1024**4),
        ("512 MiB", 512 * 1024**2),
        ("100B", 100),
        ("12TB", 12 * 10**12),
        ("4KB", 4000),
        # Exact decimals: a float would make these 4099999999.9999995 etc. and reject them as fractional bytes.
        ("4.1GB", 4_100_000_000),
        ("0.7GB", 700_000_000),
        ("2.3TB", 2_300_000_000_000),
        ("1.9MB", 1_900_000),
    ],
)
def test_sizes(text, expected):
    assert parse(text, Quantity.SIZE) == expected
    assert isinstance(parse(text, Quantity.SIZE), int)


@pytest.mark.parametrize(
    ("text", "bytes_per_s"),
    [
        ("3.35TB/s", 3.35e12),
        ("64GB/s", 64e9),
        ("900GiB/s", 900 * 1024**3),
        ("400Gbps", 50e9),
        ("25Gb/s", 25e9 / 8),
        ("100Gbps", 12.5e9),
        ("12.5GBps", 12.5e9),
        (1e9, 1e9),
        # The case of the final b/B decides bits or bytes, with or without the binary 'i'.
        ("1Gib/s", 2**30 / 8),
        ("100Mib/s", 100 * 2**20 / 8),
        ("8b/s", 1.0),
        ("8B/s", 8.0),
        ("1GiB/s", 2**30),
    ],
)
def test_bandwidths(text, bytes_per_s):
    assert parse(text, Quantity.BANDWIDTH) == pytest.approx(bytes_per_s)


@pytest.mark.parametrize(("text", "seconds"), [("5us", 5e-6), ("2ms", 2e-3), ("1s", 1.0), ("250ns", 2.5e-7)])
def test_durations(text, seconds):
    assert parse(text, Quantity.DURATION) == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("text", "count"), [("40_000_000", 40_000_000), ("1e9", 10**9), (7, 7), ("600e9", 600 * 10**9)]
)
def test_counts(text, count):
    assert parse(text, Quantity.COUNT) == count


@pytest.mark.parametrize(
    ("value", "kind", "message"),
    [
        ("80XB", Quantity.SIZE, "unknown unit 'XB' in '80XB'"),
        ("fast", Quantity.BANDWIDTH, "'fast' is not a bandwidth like"),
        ("64GB", Quantity.BANDWIDTH, "unknown unit 'GB' in '64GB'"),
        ("1.5", Quantity.COUNT, "'1.5' is not a whole number"),
        (-3, Quantity.SIZE, "must be a finite, non-negative size"),
        (True, Quantity.COUNT, "True is not a whole number"),
        ("5 parsecs", Quantity.DURATION, "unknown unit 'parsecs'"),
        ("4M", Quantity.COUNT, "unknown unit 'M' in '4M'"),
        (math.inf, Quantity.NUMBER, "must be a finite"),
        ("-2us", Quantity.DURATION, "'-2us' must be a finite, non-negative duration"),
        (
            "5Ms",
            Quantity.DURATION,
            "unit 'Ms' in '5Ms' is not a duration unit: they are lower case (ns, us, ms, s); did you mean 'ms'?",
        ),
        ("2US", Quantity.DURATION, "unit 'US' in '2US' is not a duration unit"),
        ("1S", Quantity.DURATION, "did you mean 's'?"),
        ("-128GiB", Quantity.SIZE, "'-128GiB' must be a finite, non-negative size"),
        ("80Gb", Quantity.SIZE, "'80Gb' is in bits (lower-case 'b'); a size is bytes: write 'GB'"),
        ("16Gib", Quantity.SIZE, "'16Gib' is in bits (lower-case 'b'); a size is bytes: write 'GiB'"),
        ("5mib", Quantity.SIZE, "'5mib' is in bits (lower-case 'b'); a size is bytes: write 'MiB'"),
        ("1e999999999", Quantity.SIZE, "'1e999999999' must be a finite, non-negative size"),
    ],
)
def test_errors_say_what_is_accepted(value, kind, message):
    with pytest.raises(UnitError) as err:
        parse(value, kind)
    assert message in str(err.value)


def test_format_bytes():
    assert format_bytes(80 * 1024**3) == "80.0 GiB"
    assert format_bytes(512) == "512 B"
