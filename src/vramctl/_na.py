"""The "not available" sentinel for readings a device cannot give.

MIG instances have no temperature, containers hide other processes' names, a
CPU has no allocator statistics. Such a reading is ``NA``: never an exception,
never a silent zero. ``NA`` is falsy, prints as ``N/A`` and serialises to
``null``; arithmetic helpers propagate it.

>>> from vramctl import NA
>>> bool(NA), str(NA)
(False, 'N/A')
"""

from __future__ import annotations

import enum
import re
from typing import Final, Literal, TypeVar

__all__ = ["NA", "Bytes", "NotAvailable", "Reading", "na_add", "na_div", "na_sub", "or_na"]


_SPEC = re.compile(r"^(?P<align>(?:.?[<>=^])?)[+\- ]?z?#?0?(?P<width>\d*)")


class _NotAvailableType(enum.Enum):
    NA = "N/A"

    def __bool__(self) -> bool:
        return False

    def __str__(self) -> str:
        return "N/A"

    def __repr__(self) -> str:
        return "NA"

    def __format__(self, spec: str) -> str:
        # Keep a numeric spec's fill, alignment and width; drop sign, precision and type.
        m = _SPEC.match(spec)
        return format("N/A", (m.group("align") + m.group("width")) if m else "")


NotAvailable = Literal[_NotAvailableType.NA]
NA: Final = _NotAvailableType.NA

#: A byte count that may be missing.
Bytes = int | NotAvailable
#: A measurement (degrees, watts, percent, a ratio) that may be missing.
Reading = float | NotAvailable

T = TypeVar("T", int, float)


def or_na(value: T | None) -> T | NotAvailable:
    """Map ``None`` (a binding's way of saying "unknown") to ``NA``."""
    return NA if value is None else value


def na_add(a: int | NotAvailable, b: int | NotAvailable) -> int | NotAvailable:
    return NA if a is NA or b is NA else a + b


def na_sub(a: int | NotAvailable, b: int | NotAvailable) -> int | NotAvailable:
    return NA if a is NA or b is NA else a - b


def na_div(a: float | NotAvailable, b: float | NotAvailable) -> float | NotAvailable:
    """``a / b``, or ``NA`` when either is missing or ``b`` is zero."""
    if a is NA or b is NA or b == 0:
        return NA
    return a / b
