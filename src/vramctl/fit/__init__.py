"""Fitting the batch size: the largest batch whose real step fits the device, in a few probes.

See :func:`fit_batch_size` and ``docs/fit.md``.
"""

from __future__ import annotations

from vramctl.fit._cache import cache_root
from vramctl.fit._fit import fit_batch_size
from vramctl.fit._result import FitError, FitResult

__all__ = ["FitError", "FitResult", "cache_root", "fit_batch_size"]
