"""Byte quantities: every accepted form, and errors that name the value and the forms."""

from __future__ import annotations

import pytest

from modelkeeper.domain.units import GIB, KIB, MIB, format_gib, parse_bytes

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("16GiB", 16 * GIB),
        ("512MiB", 512 * MIB),
        ("4KiB", 4 * KIB),
        ("2TiB", 2 * 1024**4),
        ("16Gi", 16 * GIB),
        ("512Mi", 512 * MIB),
        ("1.5GiB", 3 * GIB // 2),
        ("0.5MiB", MIB // 2),
        (".5Ki", 512),
        ("1.5G", 1_500_000_000),
        ("1.5GB", 1_500_000_000),
        ("24GB", 24_000_000_000),
        ("512MB", 512_000_000),
        ("512M", 512_000_000),
        ("10KB", 10_000),
        ("10k", 10_000),
        ("1TB", 10**12),
        ("1000000", 1_000_000),
        ("1000000B", 1_000_000),
        ("0", 0),
        ("0GiB", 0),
        # Case and spacing are forgiven: nobody means megabits by "mb".
        ("16 GiB", 16 * GIB),
        ("  16gib ", 16 * GIB),
        ("512mb", 512_000_000),
        # A fraction landing between bytes rounds up: a requirement is never understated.
        ("1.1GiB", 1_181_116_007),
        ("0.0001KB", 1),
    ],
)
def test_parse_bytes_accepts(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


def test_parse_bytes_takes_an_int_as_bytes() -> None:
    assert parse_bytes(1234) == 1234
    assert parse_bytes(0) == 0


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("", "expected"),
        ("   ", "expected"),
        ("GiB", "expected"),
        ("ten", "expected"),
        ("1e9", "expected"),
        ("1,5GiB", "expected"),
        ("16 GiB extra", "expected"),
        ("5XB", "unknown unit 'XB'"),
        ("16Gb/s", "expected"),
        ("1.5", "must be whole"),
        ("1.5B", "must be whole"),
        ("-1", "must not be negative"),
        ("-16GiB", "must not be negative"),
        (-5, "must not be negative"),
        (True, "expected"),
        (1.5, "expected"),
    ],
)
def test_parse_bytes_rejects_with_the_value_and_accepted_forms(
    value: object, fragment: str
) -> None:
    with pytest.raises(ValueError) as info:
        parse_bytes(value)  # type: ignore[arg-type]
    message = str(info.value)
    assert repr(value) in message
    assert fragment in message
    if fragment != "must not be negative":
        # The accepted forms are spelled out so the operator can fix it in one go.
        assert "GiB" in message and "GB" in message and "bytes" in message


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        (0, "0.0 GiB"),
        (8 * GIB, "8.0 GiB"),
        (24 * GIB, "24.0 GiB"),
        (3 * GIB // 2, "1.5 GiB"),
        (512 * MIB, "0.5 GiB"),
        (24_000_000_000, "22.4 GiB"),
        (1, "0.0 GiB"),
        (-2 * GIB, "-2.0 GiB"),
    ],
)
def test_format_gib(n: int, expected: str) -> None:
    assert format_gib(n) == expected


@pytest.mark.parametrize("text", ["8GiB", "24GiB", "1.5GiB", "3584MiB"])
def test_format_gib_round_trips_whole_tenths(text: str) -> None:
    assert parse_bytes(format_gib(parse_bytes(text)).replace(" ", "")) == parse_bytes(text)
