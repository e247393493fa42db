"""Unit strings for cluster files: bandwidth, latency, sizes and FLOP/s.

In code every quantity is in SI base units (bytes, bytes/s, seconds, FLOP/s). Cluster
YAML may write them with units, the way datasheets do:

=============  ==========================================================  ===========
quantity       accepted                                                    result
=============  ==========================================================  ===========
bandwidth      ``600 GB/s``, ``25GB/s``, ``1.6 TB/s``, ``24 GiB/s``        bytes/s
               ``200 Gb/s``, ``200 Gbit/s``, ``100 Gbps`` (**bits**: /8)
duration       ``2 us``, ``2 µs``, ``1.5ms``, ``800 ns``, ``0.1 s``        seconds
size           ``80 GiB`` (2**30), ``80 GB`` (10**9), ``512 MiB``           bytes
flop rate      ``312 TFLOPS``, ``19.5 TFLOP/s``, ``1.98 PFLOPS``            FLOP/s
=============  ==========================================================  ===========

A plain number (``25e9``, ``2e-6``) is taken in the base unit. ``B`` always means
bytes and ``b``/``bit`` bits (the datasheet convention: NICs in Gb/s, NVLink and
memory in GB/s); SI prefixes are case-insensitive (``k``/``K``, ``g``/``G``).
Parsing is exact: ``"2 us"`` is the float nearest to 2e-6, not ``2 * 1e-6``.

Malformed values raise `UnitError` (a `ClusterError`) whose message says what was
expected; the YAML loader adds the file and the field path.
"""

from __future__ import annotations

import functools
import math
import re
from decimal import Decimal
from fractions import Fraction

from plait.cluster.spec import ClusterError


class UnitError(ClusterError):
    """A value that is not a number with a unit of the expected quantity."""


_NUMBER = re.compile(r"^\s*([+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*(.*?)\s*$")

_SI = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15, "e": 10**18}
_IEC = {"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40, "pi": 2**50}
_TIME = {
    "s": Fraction(1),
    "sec": Fraction(1),
    "ms": Fraction(1, 10**3),
    "us": Fraction(1, 10**6),
    "µs": Fraction(1, 10**6),  # micro sign U+00B5
    "μs": Fraction(1, 10**6),  # Greek mu U+03BC
    "ns": Fraction(1, 10**9),
}


def _split(value: object, quantity: str, example: str) -> tuple[Fraction, str]:
    """(exact number, unit text) of a YAML value; plain numbers have unit ''."""
    if isinstance(value, bool):  # bool is an int subclass; `true` is never a quantity
        raise UnitError(f"expected a {quantity} such as {example!r}, got {value!r}")
    if isinstance(value, int):
        return Fraction(value), ""
    if isinstance(value, float):
        if not math.isfinite(value):
            raise UnitError(f"expected a finite {quantity}, got {value!r}")
        return Fraction(value), ""
    if not isinstance(value, str):
        raise UnitError(
            f"expected a {quantity} such as {example!r}, got {type(value).__name__} {value!r}"
        )
    match = _NUMBER.match(value)
    if not match:
        raise UnitError(f"expected a {quantity} such as {example!r}, got {value!r}")
    try:
        return Fraction(match.group(1)), match.group(2)
    except ValueError:  # e.g. more digits than Python converts (sys.get_int_max_str_digits)
        shown = value if len(value) <= 40 else value[:37] + "..."
        raise UnitError(f"expected a {quantity} such as {example!r}, got {shown!r} "
                        f"({len(match.group(1))} digits)") from None


def _to_float(number: Fraction, scale: Fraction | int, original: object, quantity: str) -> float:
    try:
        result = float(number * scale)
    except OverflowError:
        result = math.inf
    if not math.isfinite(result):
        raise UnitError(f"{quantity} {original!r} is out of range")
    return result


def _byte_scale(unit: str) -> tuple[Fraction | int, bool] | None:
    """(multiplier, is_bits) of a size unit such as 'GB', 'GiB', 'Gb', 'Gbit'; None if unknown."""
    u = unit.strip()
    for suffix in ("bytes", "byte", "bits", "bit"):
        if u.lower().endswith(suffix):
            prefix, bits = u[: -len(suffix)], suffix.startswith("bit")
            break
    else:
        if not u.endswith(("B", "b")):
            return None
        prefix, bits = u[:-1], u.endswith("b")
    p = prefix.lower()
    if p in _IEC:
        return _IEC[p], bits
    if p in _SI:
        return _SI[p], bits
    return None


def parse_bandwidth(value: object) -> float:
    """Bytes/second from ``"600 GB/s"``, ``"200 Gb/s"`` (bits), ``"100 Gbps"`` or a number."""
    example = "600 GB/s"
    number, unit = _split(value, "bandwidth", example)
    if unit == "":
        return _to_float(number, 1, value, "bandwidth")
    u = unit.replace(" ", "")
    per_second = None
    if u.endswith("/s"):
        per_second = u[:-2]
    elif u.endswith("ps"):  # Gbps (bits), GBps (bytes)
        per_second = u[:-2]
    scale = _byte_scale(per_second) if per_second else None
    if scale is None:
        raise UnitError(
            f"unknown bandwidth unit {unit!r} in {value!r}: use B/s or b/s with an SI or IEC "
            f"prefix, e.g. '600 GB/s', '200 Gb/s', '24 GiB/s'"
        )
    multiplier, bits = scale
    return _to_float(number, Fraction(multiplier) / (8 if bits else 1), value, "bandwidth")


def parse_duration(value: object) -> float:
    """Seconds from ``"2 us"``, ``"1.5ms"``, ``"800 ns"``, ``"0.1 s"`` or a number of seconds."""
    number, unit = _split(value, "duration", "2 us")
    if unit == "":
        return _to_float(number, 1, value, "duration")
    scale = _TIME.get(unit.strip().lower()) or _TIME.get(unit.strip())
    if scale is None:
        raise UnitError(f"unknown time unit {unit!r} in {value!r}: use s, ms, us (µs) or ns")
    return _to_float(number, scale, value, "duration")


def parse_bytes(value: object) -> float:
    """Bytes from ``"80 GiB"`` (binary), ``"80 GB"`` (decimal), ``"512 MiB"`` or a number."""
    number, unit = _split(value, "size", "80 GiB")
    if unit == "":
        return _to_float(number, 1, value, "size")
    scale = _byte_scale(unit.replace(" ", ""))
    if scale is None:
        raise UnitError(f"unknown size unit {unit!r} in {value!r}: use B, KB, MB, GB, KiB, MiB, GiB")
    multiplier, bits = scale
    return _to_float(number, Fraction(multiplier) / (8 if bits else 1), value, "size")


def parse_flops(value: object) -> float:
    """FLOP/s from ``"312 TFLOPS"``, ``"19.5 TFLOP/s"``, ``"1.98 PFLOPS"`` or a number."""
    number, unit = _split(value, "FLOP rate", "312 TFLOPS")
    if unit == "":
        return _to_float(number, 1, value, "FLOP rate")
    u = unit.replace(" ", "").lower()
    for suffix in ("flop/s", "flops", "flop"):
        if u.endswith(suffix):
            prefix = u[: -len(suffix)]
            if prefix in _SI:
                return _to_float(number, _SI[prefix], value, "FLOP rate")
    raise UnitError(f"unknown FLOP rate unit {unit!r} in {value!r}: use e.g. TFLOPS or TFLOP/s")


# --- formatting -------------------------------------------------------------------------

def _fmt(x: float, scales: list[tuple[float, str]], digits: int) -> str:
    """Human-readable: the largest unit whose value is >= 1, `digits` significant digits."""
    if x == 0:
        return f"0 {scales[-1][1]}"
    for scale, name in scales:
        if abs(x) >= scale:
            return f"{x / scale:.{digits}g} {name}"
    scale, name = scales[-1]
    return f"{x / scale:.{digits}g} {name}"


_BW_SCALES = [(1e12, "TB/s"), (1e9, "GB/s"), (1e6, "MB/s"), (1e3, "KB/s"), (1.0, "B/s")]
_TIME_SCALES = [(1.0, "s"), (1e-3, "ms"), (1e-6, "us"), (1e-9, "ns")]
_SIZE_SCALES = [(2.0**40, "TiB"), (2.0**30, "GiB"), (2.0**20, "MiB"), (2.0**10, "KiB"), (1.0, "B")]
_FLOP_SCALES = [(1e15, "PFLOPS"), (1e12, "TFLOPS"), (1e9, "GFLOPS"), (1e6, "MFLOPS"), (1.0, "FLOPS")]


def format_bandwidth(x: float, digits: int = 4) -> str:
    return _fmt(x, _BW_SCALES, digits)


def format_duration(x: float, digits: int = 4) -> str:
    return _fmt(x, _TIME_SCALES, digits)


def format_bytes(x: float, digits: int = 4) -> str:
    return _fmt(x, _SIZE_SCALES, digits)


def format_flops(x: float, digits: int = 4) -> str:
    return _fmt(x, _FLOP_SCALES, digits)


def _exact(x: float, scales: list[tuple[float, str]], parse) -> str | float:
    """The shortest unit string that parses back to exactly `x`, else `x` (for YAML dumps).

    repr(x) is the shortest decimal that rounds to x; moving its decimal point for a
    power-of-ten unit (or dividing by a power-of-two unit, exact in binary) keeps that
    property because parsing is exact, so one candidate per unit suffices; the chosen
    one is still checked by parsing it back."""
    if x == 0 or not math.isfinite(x):
        return x
    digits = Decimal(repr(float(x))).normalize()
    candidates = []
    for scale, name in scales:
        exponent = math.log10(scale)
        if exponent == int(exponent):
            number = format(digits.scaleb(-int(exponent)), "f")
        else:
            number = repr(x / scale)
        if number.endswith(".0"):
            number = number[:-2]
        if len(number) <= 20:  # "0.000...1 ns": the plain number reads better
            # prefer "300 GB/s" to "0.3 TB/s", then the shortest
            candidates.append(((abs(x) < scale, len(number)), f"{number} {name}"))
    for _, text in sorted(candidates):
        try:
            if parse(text) == x:
                return text
        except UnitError:
            pass
    return x


@functools.lru_cache(maxsize=4096)  # dumps repeat the same link figures on every node
def exact_bandwidth(x: float, bits: bool = False) -> str | float:
    """`x` bytes/s as a unit string that parses back exactly; `bits`: in Gb/s as NICs are sold."""
    if bits and x * 8 >= 1e9 and math.isfinite(x):
        text = _exact(x * 8, [(1e9, "Gb/s")], lambda t: parse_bandwidth(t) * 8)
        if isinstance(text, str):
            return text
    return _exact(x, _BW_SCALES, parse_bandwidth)


@functools.lru_cache(maxsize=4096)
def exact_duration(x: float) -> str | float:
    return _exact(x, _TIME_SCALES, parse_duration)


@functools.lru_cache(maxsize=4096)
def exact_bytes(x: float) -> str | float:
    return _exact(x, _SIZE_SCALES + [(1e12, "TB"), (1e9, "GB"), (1e6, "MB")], parse_bytes)


@functools.lru_cache(maxsize=4096)
def exact_flops(x: float) -> str | float:
    return _exact(x, _FLOP_SCALES, parse_flops)
