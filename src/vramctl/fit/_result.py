"""What :func:`vramctl.fit.fit_batch_size` returns, and the error it raises.

>>> from vramctl.fit import FitResult
>>> r = FitResult(batch_size=48, peak_used=900, budget=1000, predicted=40,
...               probes=[(40, 760, True), (48, 900, True)])
>>> r.to_dict()["probes"][1]
{'batch_size': 48, 'peak_used_bytes': 900, 'fits': True}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vramctl._errors import VramctlError

__all__ = ["SCHEMA", "FitError", "FitResult"]

SCHEMA = "vramctl.fit/1"


class FitError(VramctlError):
    """Bad input to :func:`~vramctl.fit.fit_batch_size`, or a step that does not fit at batch 1."""


@dataclass(frozen=True)
class FitResult:
    """The largest batch size that fits, and the probes that show it."""

    #: Largest batch size whose step peaked within the budget.
    batch_size: int
    #: Peak device-level used bytes measured at ``batch_size`` (None if a cache entry lacks it).
    peak_used: int | None
    #: ``target * total`` of the device, in bytes.
    budget: int
    #: The estimator's answer (None when no model was known or the estimate failed).
    predicted: int | None
    #: Every real probe: (batch size, peak used bytes or None for an OOM, fits).
    probes: list[tuple[int, int | None, bool]] = field(default_factory=list)
    #: ``"probe"`` (measured now) or ``"cache"`` (read from the cache; nothing ran).
    source: str = "probe"
    #: Seconds this call took.
    elapsed: float = 0.0
    #: The device's id (``"cuda:0"``, ``"sim:2GiB"``, ``"cpu"``).
    device: str = ""
    target: float = 0.9
    #: What the search noticed (an estimate that failed, a limit that was reached).
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (schema ``vramctl.fit/1``)."""
        return {
            "schema": SCHEMA,
            "batch_size": self.batch_size,
            "peak_used_bytes": self.peak_used,
            "budget_bytes": self.budget,
            "predicted": self.predicted,
            "probes": [
                {"batch_size": b, "peak_used_bytes": p, "fits": f} for b, p, f in self.probes
            ],
            "source": self.source,
            "elapsed_s": round(self.elapsed, 4),
            "device": self.device,
            "target": self.target,
            "notes": list(self.notes),
        }
