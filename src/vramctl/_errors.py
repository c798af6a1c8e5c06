"""Errors that name what was wrong and what to do about it."""

from __future__ import annotations

__all__ = ["InvalidSizeError", "UnknownDeviceError", "VramctlError"]


class VramctlError(Exception):
    """Base class of the errors vramctl raises for bad input.

    The CLI prints these as one line, without a traceback.
    """


class InvalidSizeError(VramctlError, ValueError):
    """A memory size that does not parse, or is negative."""


class UnknownDeviceError(VramctlError, LookupError):
    """A device name, index or catalog entry that does not exist."""
