from __future__ import annotations

import pytest

from vramctl import NA, InvalidSizeError, format_bytes, parse_size
from vramctl._na import na_add, na_div, na_sub, or_na


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (1024, 1024),
        ("1024", 1024),
        ("16GiB", 16 * 2**30),
        ("16 GiB", 16 * 2**30),
        ("16gib", 16 * 2**30),
        ("24GB", 24 * 10**9),
        ("512M", 512 * 2**20),
        ("1.5G", 3 * 2**29),
        ("2TiB", 2 * 2**40),
        ("100KB", 100_000),
        ("0", 0),
        ("7B", 7),
    ],
)
def test_parse_size_accepts_the_documented_forms(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["12 gigs", "", "GiB", "1.2.3G", "ten", "5 parsecs", True])
def test_parse_size_names_the_value_and_the_forms(bad: object) -> None:
    with pytest.raises(InvalidSizeError) as err:
        parse_size(bad)  # type: ignore[arg-type]
    msg = str(err.value)
    assert repr(bad) in msg
    assert "GiB" in msg and "GB" in msg


@pytest.mark.parametrize("bad", ["-1GiB", -5, -0.5])
def test_parse_size_refuses_negative_sizes(bad: object) -> None:
    with pytest.raises(InvalidSizeError, match="negative"):
        parse_size(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["1e400", "1e308T", "9e307KiB", float("inf"), 1e308 * 10])
def test_parse_size_refuses_sizes_too_large_for_a_float(bad: object) -> None:
    # "1e400" reads as infinity: one InvalidSizeError, not an OverflowError.
    with pytest.raises(InvalidSizeError) as err:
        parse_size(bad)  # type: ignore[arg-type]
    assert repr(bad) in str(err.value) and "GiB" in str(err.value)


def test_parse_size_keeps_large_byte_counts_exact() -> None:
    assert parse_size(2**60 + 1) == 2**60 + 1
    assert parse_size(10**400) == 10**400


@pytest.mark.parametrize(
    ("text", "expected"),
    [("16GiB", True), ("-3GiB", True), (" .5G", True), ("+1G", True), ("T4-16GB", False)],
)
def test_looks_like_size_tells_sizes_from_names(text: str, expected: bool) -> None:
    from vramctl._units import looks_like_size

    assert looks_like_size(text) is expected


def test_format_bytes_matches_pytorch_style() -> None:
    assert format_bytes(512) == "512 bytes"
    assert format_bytes(20 * 2**20) == "20.00 MiB"
    assert format_bytes(int(14.75 * 2**30)) == "14.75 GiB"
    assert format_bytes(1023 * 2**30) == "1023.00 GiB"
    # Past 1024 GiB, TiB and PiB: a batch beyond any GPU reads as such, not as 16 digits.
    assert format_bytes(int(16.36 * 2**40)) == "16.36 TiB"
    assert format_bytes(10**20) == "88817.84 PiB"
    assert format_bytes(3 * 2**40) == "3.00 TiB"
    assert format_bytes(-(2**20)) == "-1.00 MiB"
    assert format_bytes(2**20, signed=True) == "+1.00 MiB"
    assert format_bytes(NA) == "N/A"


def test_na_is_explicit_falsy_and_propagates() -> None:
    assert not NA and str(NA) == "N/A" and repr(NA) == "NA"
    assert f"{NA:>5}" == "  N/A" and f"{NA:.2f}" == "N/A" and f"{NA:8.1%}" == "N/A     "
    assert na_add(1, NA) is NA and na_sub(NA, 1) is NA and na_add(2, 3) == 5
    assert na_div(1, 0) is NA and na_div(1, 4) == 0.25
    assert or_na(None) is NA and or_na(0) == 0
