"""What an estimate returns: :class:`Estimate`, its breakdown by category."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vramctl._units import format_bytes

__all__ = ["CATEGORIES", "Estimate"]

CATEGORIES = (
    "parameters",
    "gradients",
    "optimizer",
    "inputs",
    "activations",
    "temporaries",
    "workspaces",
    "allocator",
    "context",
)


@dataclass(frozen=True)
class Estimate:
    """A step's predicted peak memory on a device, and where it goes.

    ``peak_allocated`` and ``peak_reserved`` are what ``torch.cuda``'s
    ``max_memory_allocated`` and ``max_memory_reserved`` would report;
    ``peak_device`` adds the CUDA context (what ``nvidia-smi`` shows for the
    process). On a CPU target the three equal ``logical_peak``, the bytes of
    live tensor storages.
    """

    model: str
    device: str
    capacity: int
    mode: str
    precision: str
    batch_size: int | None
    seq_len: int | None
    seconds: float | None
    logical_peak: int
    peak_allocated: int
    peak_reserved: int
    peak_device: int
    #: Bytes by category at the peak; they sum to ``peak_device``.
    breakdown: dict[str, int]
    peak_op: str
    peak_module: str
    peak_phase: str
    target_utilization: float
    fits: bool
    #: Assumptions where the trace could not know values (data-dependent operators).
    assumptions: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    alloc_retries: int = 0
    ops: int = 0
    elapsed: float = 0.0
    parameters: int = 0

    @property
    def budget(self) -> int:
        """The bytes the step may use: capacity times target utilization."""
        return int(self.capacity * self.target_utilization)

    @property
    def headroom(self) -> int:
        """Budget left at the peak (negative when it does not fit)."""
        return self.budget - self.peak_device

    @property
    def exact(self) -> bool:
        """True when no value had to be assumed."""
        return not self.assumptions

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "device": self.device,
            "capacity_bytes": self.capacity,
            "mode": self.mode,
            "precision": self.precision,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "seconds": self.seconds,
            "parameters": self.parameters,
            "logical_peak_bytes": self.logical_peak,
            "peak_allocated_bytes": self.peak_allocated,
            "peak_reserved_bytes": self.peak_reserved,
            "peak_device_bytes": self.peak_device,
            "breakdown_bytes": dict(self.breakdown),
            "peak_at": {"op": self.peak_op, "module": self.peak_module, "phase": self.peak_phase},
            "target_utilization": self.target_utilization,
            "budget_bytes": self.budget,
            "headroom_bytes": self.headroom,
            "fits": self.fits,
            "exact": self.exact,
            "assumptions": list(self.assumptions),
            "notes": list(self.notes),
            "alloc_retries": self.alloc_retries,
            "ops": self.ops,
            "elapsed_s": round(self.elapsed, 4),
        }

    def __str__(self) -> str:
        verdict = "fits" if self.fits else "does NOT fit"
        lines = [
            f"{self.model} {self.mode} {self.precision} batch {self.batch_size} on {self.device}: "
            f"peak {format_bytes(self.peak_device)} of {format_bytes(self.budget)} "
            f"({self.target_utilization:.0%} of {format_bytes(self.capacity)}), {verdict}",
            f"  allocated {format_bytes(self.peak_allocated)}, "
            f"reserved {format_bytes(self.peak_reserved)}; peak at {self.peak_op} in "
            f"{self.peak_module or '(top level)'} ({self.peak_phase})",
        ]
        lines += [f"  {k:<12} {format_bytes(v):>12}" for k, v in self.breakdown.items() if v]
        lines += [f"  assumed: {a}" for a in self.assumptions]
        return "\n".join(lines)
