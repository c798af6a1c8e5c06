"""The optimize layer's error."""

from __future__ import annotations

from vramctl._errors import VramctlError

__all__ = ["OptimizeError"]


class OptimizeError(VramctlError):
    """An optimization that cannot be set up as asked (a malformed setting, a model with no
    repeated blocks to checkpoint); the message says what was wrong and what to do."""
