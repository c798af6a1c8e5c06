"""Parsing and printing memory sizes.

>>> from vramctl import parse_size, format_bytes
>>> parse_size("1.5GiB") == 3 * 2**29
True
>>> format_bytes(20 * 2**20)
'20.00 MiB'
"""

from __future__ import annotations

import math
import re

from vramctl._errors import InvalidSizeError
from vramctl._na import NA, NotAvailable

__all__ = ["SIZE_FORMS", "format_bytes", "parse_size"]

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}

SIZE_FORMS = (
    "a byte count (17179869184) or a number with a unit: KiB, MiB, GiB, TiB or K, M, G, T "
    "(powers of 1024), KB, MB, GB, TB (powers of 1000), e.g. 512MiB, 24GB, 1.5G"
)

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | float | str) -> int:
    """Parse a memory size into bytes.

    Accepts an ``int`` byte count, or a string such as ``"16GiB"``, ``"24GB"``,
    ``"512M"`` or ``"1.5 G"``. Binary units (KiB, MiB, GiB, TiB, and the single
    letters K, M, G, T) are powers of 1024; KB, MB, GB, TB are powers of 1000.

    Raises :class:`InvalidSizeError` naming the value and the accepted forms.
    """
    if isinstance(value, bool):
        raise InvalidSizeError(f"invalid size {value!r}: use {SIZE_FORMS}")
    if isinstance(value, int):
        if value < 0:
            raise InvalidSizeError(f"invalid size {value!r}: a size cannot be negative")
        return value
    if isinstance(value, float):
        number, unit = value, ""
        if not math.isfinite(value):
            raise InvalidSizeError(f"invalid size {value!r}: use {SIZE_FORMS}")
    else:
        text = str(value).strip()
        if text.startswith("-"):
            raise InvalidSizeError(f"invalid size {value!r}: a size cannot be negative")
        match = _SIZE_RE.match(text)
        if not match or match.group(2).lower() not in _UNITS:
            raise InvalidSizeError(f"invalid size {value!r}: use {SIZE_FORMS}")
        number, unit = float(match.group(1)), match.group(2).lower()
    if number < 0:
        raise InvalidSizeError(f"invalid size {value!r}: a size cannot be negative")
    size = number * _UNITS[unit]
    if not math.isfinite(size):
        # "1e400" reads as infinity, which is no byte count.
        raise InvalidSizeError(f"invalid size {value!r}: too large; use {SIZE_FORMS}")
    return round(size)


_SIZE_LIKE_RE = re.compile(r"^\s*[-+]?\.?[0-9]")


def looks_like_size(text: str) -> bool:
    """Whether ``text`` is meant as a size (``"16GiB"``, ``"-3GiB"``, ``".5G"``), not a name.

    Callers that take a name or a size give such text to :func:`parse_size`,
    which says what is wrong with a bad one (a negative size, an unknown unit).
    """
    return _SIZE_LIKE_RE.match(text) is not None


def format_bytes(n: int | float | NotAvailable, *, signed: bool = False) -> str:
    """Format a byte count the way PyTorch's OOM messages do (``14.75 GiB``), and past
    1024 GiB in TiB and PiB (``16.36 TiB``), never a 16-digit count of GiB."""
    if n is NA:
        return "N/A"
    sign = "-" if n < 0 else ("+" if signed and n > 0 else "")
    size = abs(n)
    if size < 2**10:
        return f"{sign}{int(size)} bytes"
    units = (("KiB", 2**10), ("MiB", 2**20), ("GiB", 2**30), ("TiB", 2**40), ("PiB", 2**50))
    for unit, scale in units:
        if size < scale * 1024 or unit == "PiB":
            return f"{sign}{size / scale:.2f} {unit}"
    raise AssertionError("unreachable")
