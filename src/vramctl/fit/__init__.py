"""Fitting the batch size: the largest batch whose real step fits the device, in a few probes.

See :func:`fit_batch_size` and ``docs/fit.md``. The search's arithmetic (where to probe
next, from real :class:`Probe` measurements) and its host copies of state are shared, under
internal names, with ``vramctl.integrations.accelerate``.
"""

from __future__ import annotations

from vramctl.fit._fit import fit_batch_size
from vramctl.fit._result import FitError, FitResult
from vramctl.fit._search import Probe

__all__ = [
    "FitError",
    "FitResult",
    "Probe",
    "fit_batch_size",
]
