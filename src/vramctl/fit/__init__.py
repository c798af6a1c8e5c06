"""Fitting the batch size: the largest batch whose real step fits the device, in a few probes.

See :func:`fit_batch_size` and ``docs/fit.md``. :class:`Search` (where to probe next, from
real :class:`Probe` measurements) is the arithmetic behind it, shared with other searches
(``vramctl.integrations.accelerate``), with :func:`requested_bytes` (what an OOM refused) and
:func:`to_host` (host copies of state to put back after probes).
"""

from __future__ import annotations

from vramctl.fit._cache import cache_root
from vramctl.fit._fit import fit_batch_size
from vramctl.fit._probe import requested_bytes, to_host
from vramctl.fit._result import FitError, FitResult
from vramctl.fit._search import Probe, Search

__all__ = [
    "FitError",
    "FitResult",
    "Probe",
    "Search",
    "cache_root",
    "fit_batch_size",
    "requested_bytes",
    "to_host",
]
