"""Unit strings: bandwidth (bytes vs bits), durations, sizes, FLOP/s; exact round trips."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.cluster.spec import ClusterError
from plait.cluster.units import (
    UnitError,
    exact_bandwidth,
    exact_bytes,
    exact_duration,
    exact_flops,
    format_bandwidth,
    format_duration,
    parse_bandwidth,
    parse_bytes,
    parse_duration,
    parse_flops,
)


@pytest.mark.parametrize("text, expected", [
    ("600 GB/s", 600e9),
    ("200 Gb/s", 25e9),           # bits: NICs are sold in Gb/s
    ("25GB/s", 25e9),
    ("100 Gbps", 12.5e9),
    ("100 Gbit/s", 12.5e9),
    ("1.6 TB/s", 1.6e12),
    ("24 GiB/s", 24 * 2**30),
    ("10 MB/s", 10e6),
    ("400 gb/s", 50e9),           # prefix case-insensitive; lower-case b is still bits
    ("8 B/s", 8.0),
    (3e9, 3e9),                   # plain numbers are bytes/s
    (7, 7.0),
])
def test_parse_bandwidth(text, expected) -> None:
    assert parse_bandwidth(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("2 us", 2e-6), ("2us", 2e-6), ("2 µs", 2e-6), ("2 μs", 2e-6), ("1.5ms", 1.5e-3),
    ("800 ns", 8e-7), ("0.1 s", 0.1), (1, 1.0), (2.5e-6, 2.5e-6),
])
def test_parse_duration(text, expected) -> None:
    assert parse_duration(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("80 GiB", 80 * 2**30), ("80 GB", 80e9), ("512 MiB", 2**29), ("1 TiB", 2**40), (1024, 1024.0),
])
def test_parse_bytes(text, expected) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("312 TFLOPS", 312e12), ("19.5 TFLOP/s", 19.5e12), ("1.98 PFLOPS", 1.98e15), ("5e12", 5e12),
])
def test_parse_flops(text, expected) -> None:
    assert parse_flops(text) == expected


def test_parsing_is_exact_not_multiplied() -> None:
    # 5 * 1e-6 != 5e-6 in floating point; the parser must give the nearest float.
    assert parse_duration("5 us") == 5e-6 and 5 * 1e-6 != 5e-6
    assert parse_flops("15.7 TFLOPS") == 15.7e12


@pytest.mark.parametrize("parse, bad, fragment", [
    (parse_bandwidth, "fast", "expected a bandwidth"),
    (parse_bandwidth, "5 GX/s", "unknown bandwidth unit"),
    (parse_bandwidth, "5 GB", "unknown bandwidth unit"),
    (parse_bandwidth, True, "expected a bandwidth"),
    (parse_bandwidth, None, "expected a bandwidth"),
    (parse_bandwidth, [1], "expected a bandwidth"),
    (parse_bandwidth, math.nan, "finite"),
    (parse_bandwidth, "1e999 GB/s", "out of range"),
    (parse_duration, "2 parsecs", "unknown time unit"),
    (parse_duration, "", "expected a duration"),
    (parse_bytes, "80 GiB/s", "unknown size unit"),
    (parse_flops, "312 TOPS", "unknown FLOP rate unit"),
])
def test_bad_units_raise_unit_error(parse, bad, fragment) -> None:
    with pytest.raises(UnitError, match=fragment) as info:
        parse(bad)
    assert isinstance(info.value, ClusterError)


def test_format_human() -> None:
    assert format_bandwidth(25e9) == "25 GB/s"
    assert format_duration(5e-6) == "5 us"


def test_exact_forms_are_readable() -> None:
    assert exact_bandwidth(25e9) == "25 GB/s"
    assert exact_bandwidth(25e9, bits=True) == "200 Gb/s"
    assert exact_bandwidth(300e9) == "300 GB/s"
    assert exact_duration(5e-7) == "500 ns"
    assert exact_bytes(80 * 2**30) == "80 GiB"
    assert exact_bytes(80e9) == "80 GB"
    assert exact_flops(989.4e12) == "989.4 TFLOPS"


positive = st.floats(min_value=1e-12, max_value=1e18, allow_nan=False, allow_infinity=False)


@settings(max_examples=150, deadline=None)
@given(positive, st.booleans())
def test_exact_forms_round_trip(x: float, bits: bool) -> None:
    for exact, parse in ((lambda v: exact_bandwidth(v, bits=bits), parse_bandwidth),
                         (exact_duration, parse_duration), (exact_bytes, parse_bytes),
                         (exact_flops, parse_flops)):
        text = exact(x)
        assert (parse(text) if isinstance(text, str) else text) == x


def test_a_number_too_long_to_convert_is_a_unit_error() -> None:
    """Found by the fuzz test: 5000 digits exceed Python's int conversion limit."""
    from plait.cluster.units import UnitError, parse_bandwidth

    with pytest.raises(UnitError, match="5000 digits"):
        parse_bandwidth("9" * 5000 + " GB/s")
