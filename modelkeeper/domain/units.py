"""Byte quantities as operators write them ("16GiB", "1.5G") and as messages show them.

Pure: stdlib only, so placement, the catalog and the CLI can all share one reading of
"16G" instead of each guessing.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal

KIB = 1024
MIB = 1024**2
GIB = 1024**3
TIB = 1024**4

#: Suffix (lower-cased) -> bytes per unit. Binary suffixes carry an "i" (KiB, MiB, GiB,
#: TiB, or the Kubernetes short forms Ki/Mi/Gi/Ti); everything else is decimal, so
#: "1.5G" means 1.5e9 bytes exactly as "1.5GB" does. Suffixes are case-insensitive:
#: nobody writing a memory size means megabits by "mb".
_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kib": KIB,
    "ki": KIB,
    "mib": MIB,
    "mi": MIB,
    "gib": GIB,
    "gi": GIB,
    "tib": TIB,
    "ti": TIB,
    "kb": 10**3,
    "k": 10**3,
    "mb": 10**6,
    "m": 10**6,
    "gb": 10**9,
    "g": 10**9,
    "tb": 10**12,
    "t": 10**12,
}

_ACCEPTED = (
    "a whole number of bytes (e.g. 1000000), or a number with a unit: "
    "KiB/MiB/GiB/TiB (binary, also Ki/Mi/Gi/Ti) or KB/MB/GB/TB (decimal, also K/M/G/T), "
    "e.g. 16GiB, 512MiB, 1.5G"
)

_QUANTITY = re.compile(r"^\s*(?P<number>\d+(?:\.\d+)?|\.\d+)\s*(?P<unit>[A-Za-z]*)\s*$")


def parse_bytes(value: str | int) -> int:
    """Parse a byte quantity such as ``"16GiB"``, ``"512MiB"``, ``"1.5G"`` or ``"1000000"``.

    Binary units (KiB, MiB, GiB, TiB; Ki, Mi, Gi, Ti) are powers of 1024; decimal units
    (KB, MB, GB, TB; K, M, G, T) are powers of 1000; a bare number is bytes and must be
    whole. A fraction of a unit that lands between two bytes is rounded up: these are
    memory requirements and capacities, and one byte never matters, but understating a
    requirement can. An ``int`` is taken as bytes.

    Raises ``ValueError`` naming the value and the accepted forms when it is not one of
    them (negative, empty, unknown unit, fractional bytes).
    """
    # bool is an int subclass; True is not "1 byte" to anyone who wrote it.
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"invalid byte quantity {value!r}: expected {_ACCEPTED}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"invalid byte quantity {value!r}: must not be negative")
        return value
    if value.strip().startswith("-"):
        raise ValueError(f"invalid byte quantity {value!r}: must not be negative")
    match = _QUANTITY.match(value)
    if match is None:
        raise ValueError(f"invalid byte quantity {value!r}: expected {_ACCEPTED}")
    unit = match["unit"].lower()
    if unit not in _UNITS:
        raise ValueError(
            f"invalid byte quantity {value!r}: unknown unit {match['unit']!r}; expected {_ACCEPTED}"
        )
    number = Decimal(match["number"])
    if unit in ("", "b") and number != number.to_integral_value():
        raise ValueError(
            f"invalid byte quantity {value!r}: a number of bytes must be whole; "
            f"expected {_ACCEPTED}"
        )
    # Decimal, not float: "1.1GiB" must not pick up binary-fraction noise before rounding.
    return math.ceil(number * _UNITS[unit])


def format_gib(n: int) -> str:
    """Bytes as GiB with one decimal, e.g. ``format_gib(8 * 2**30) == "8.0 GiB"``."""
    return f"{n / GIB:.1f} GiB"


# -- durations ---------------------------------------------------------------------------

#: Suffix -> seconds per unit, as operators write timeouts ("10m", "90s", "1h"). A bare
#: number is seconds. Lower case only: "M" would read as months to some.
_DURATION_UNITS: dict[str, float] = {"ms": 0.001, "": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0,
                                     "d": 86_400.0}
_DURATION = re.compile(r"^\s*(?P<number>\d+(?:\.\d+)?|\.\d+)\s*(?P<unit>[A-Za-z]*)\s*$")
_DURATION_ACCEPTED = "a number of seconds, or a number with a unit: ms, s, m, h or d " \
                     "(e.g. 90s, 10m, 1.5h)"


def parse_duration(value: str) -> float:
    """Seconds from ``"10m"``, ``"90s"``, ``"1h"``, ``"1.5h"``, ``"2d"`` or ``"30"``.

    Raises ``ValueError`` naming the value and the accepted forms when it is not one of
    them (negative, empty, unknown unit).
    """
    match = _DURATION.match(value)
    if match is None or match["unit"] not in _DURATION_UNITS:
        raise ValueError(f"invalid duration {value!r}: expected {_DURATION_ACCEPTED}")
    return float(Decimal(match["number"]) * Decimal(str(_DURATION_UNITS[match["unit"]])))


def format_duration(seconds: float) -> str:
    """Seconds in the largest unit that holds them whole: ``600`` is ``"10m"``, ``90`` is
    ``"90s"``, ``5400`` is ``"90m"``, ``0.5`` is ``"0.5s"``; what parse_duration reads."""
    for unit, size in (("d", 86_400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"
