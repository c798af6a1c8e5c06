"""Memory readings: one device's state at one moment, and one process's share."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields, replace
from typing import Any

from vramctl._na import NA, Bytes, NotAvailable, Reading, na_add, na_div, na_sub

__all__ = ["MemoryState", "ProcessMemory"]

# Fields that hold byte counts (summed by ``+``, differenced by ``-``).
_BYTE_FIELDS = (
    "total",
    "used",
    "free",
    "process_used",
    "allocated",
    "reserved",
    "peak_allocated",
    "peak_reserved",
    "inactive_split",
)
_COUNT_FIELDS = ("alloc_retries", "ooms")


@dataclass(frozen=True)
class MemoryState:
    """One device's memory at one moment.

    Device-wide figures come from NVML (or ``torch.cuda.mem_get_info``, or the
    host for the CPU); allocator figures are this process's, from
    ``torch.cuda.memory_stats``. Any reading the device cannot give is ``NA``.

    >>> from vramctl import MemoryState
    >>> a = MemoryState(device="cuda:0", total=16 * 2**30, used=4 * 2**30, free=12 * 2**30)
    >>> a.utilization
    0.25
    >>> a.fits(10 * 2**30, target=0.9)
    True
    """

    device: str
    #: Device-wide memory, in bytes.
    total: Bytes = NA
    used: Bytes = NA
    free: Bytes = NA
    #: Memory this process holds on the device (NVML's per-process figure; RSS for the CPU).
    process_used: Bytes = NA
    #: This process's PyTorch caching allocator (``memory_stats``).
    allocated: Bytes = NA
    reserved: Bytes = NA
    peak_allocated: Bytes = NA
    peak_reserved: Bytes = NA
    #: Bytes in split blocks that are cached but unused: the fragmentation numerator.
    inactive_split: Bytes = NA
    alloc_retries: int | NotAvailable = NA
    ooms: int | NotAvailable = NA
    #: NVML readings.
    temperature_c: Reading = NA
    power_w: Reading = NA
    compute_utilization: Reading = NA
    timestamp: float = field(default_factory=time.time)

    @property
    def utilization(self) -> Reading:
        """Fraction of device memory in use (``used / total``), 0..1."""
        return na_div(self.used, self.total)

    @property
    def fragmentation(self) -> Reading:
        """Inactive split bytes over reserved bytes, 0..1 (``NA`` when nothing is reserved)."""
        return na_div(self.inactive_split, self.reserved)

    def headroom(self, target: float = 1.0) -> Bytes:
        """Bytes that can still be used before ``used`` reaches ``target * total``."""
        if self.total is NA or self.used is NA:
            return NA
        return int(self.total * target) - self.used

    def fits(self, nbytes: int, target: float = 1.0) -> bool:
        """True when ``nbytes`` more fit under ``target`` utilization and in ``free``.

        A missing reading never fits: vramctl does not guess.
        """
        room = self.headroom(target)
        if room is NA:
            return False
        if self.free is not NA:
            room = min(room, self.free)
        return nbytes <= room

    def __add__(self, other: MemoryState) -> MemoryState:
        """Aggregate two devices: byte and count fields add, per-device readings drop to NA."""
        if not isinstance(other, MemoryState):
            return NotImplemented
        sums: dict[str, Any] = {
            name: na_add(getattr(self, name), getattr(other, name))
            for name in _BYTE_FIELDS + _COUNT_FIELDS
        }
        return MemoryState(
            device=f"{self.device}+{other.device}",
            timestamp=max(self.timestamp, other.timestamp),
            **sums,
        )

    def __radd__(self, other: object) -> MemoryState:
        if other == 0:  # lets sum() start from its default 0
            return self
        return NotImplemented

    def __sub__(self, other: MemoryState) -> MemoryState:
        """The change from ``other`` to ``self`` (same device): byte and count fields subtract."""
        if not isinstance(other, MemoryState):
            return NotImplemented
        if other.device != self.device:
            raise ValueError(f"cannot subtract readings of {other.device} from {self.device}")
        diffs: dict[str, Any] = {
            name: na_sub(getattr(self, name), getattr(other, name))
            for name in _BYTE_FIELDS + _COUNT_FIELDS
        }
        return replace(
            self,
            temperature_c=NA,
            power_w=NA,
            compute_utilization=NA,
            **diffs,
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: ``NA`` becomes ``None``; derived ratios included."""
        out: dict[str, Any] = {f.name: _json(getattr(self, f.name)) for f in fields(self)}
        out["utilization"] = _json(self.utilization)
        out["fragmentation"] = _json(self.fragmentation)
        return out


@dataclass(frozen=True)
class ProcessMemory:
    """One process's use of one device."""

    pid: int
    used: Bytes
    name: str | NotAvailable = NA
    user: str | NotAvailable = NA
    command: str | NotAvailable = NA
    #: "compute" or "graphics" for GPUs, "host" for the CPU.
    kind: str = "compute"

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _json(getattr(self, f.name)) for f in fields(self)}


def _json(value: object) -> object:
    return None if value is NA else value
