"""What :func:`vramctl.optimize` did: one :class:`Optimization` per setting, in a report."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from vramctl._units import format_bytes

__all__ = ["Optimization", "OptimizationReport"]


@dataclass(frozen=True)
class Optimization:
    """One optimization: applied or not, why, and its predicted effect on the step.

    ``memory_delta_bytes`` is the change of the step's predicted peak device memory and
    ``time_delta_seconds`` the change of its predicted time (negative: it saves), both
    from the estimator; None where nothing was predicted (the reason says why).
    """

    name: str
    applied: bool
    reason: str
    memory_delta_bytes: int | None = None
    time_delta_seconds: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _signed_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    return ("+" if n > 0 else "") + format_bytes(n)


def _signed_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1000:+.1f} ms"


@dataclass
class OptimizationReport:
    """The optimizations :func:`vramctl.optimize` considered, each applied or skipped with
    its reason, in the order they were applied.

    >>> r = OptimizationReport([Optimization("tf32", False, "not a CUDA device")], "cpu")
    >>> r["tf32"].reason
    'not a CUDA device'
    >>> [o.name for o in r.skipped]
    ['tf32']
    """

    entries: list[Optimization] = field(default_factory=list)
    #: The device the choices were made for (its id).
    device: str = ""
    level: str = "basic"
    mode: str = "train"
    #: What the predictions were made with, or why there are none.
    notes: list[str] = field(default_factory=list)

    def __iter__(self) -> Iterator[Optimization]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, name: object) -> bool:
        return any(o.name == name for o in self.entries)

    def __getitem__(self, name: str) -> Optimization:
        for o in self.entries:
            if o.name == name:
                return o
        raise KeyError(f"no optimization {name!r}; the report has {', '.join(self.names)}")

    @property
    def names(self) -> list[str]:
        return [o.name for o in self.entries]

    @property
    def applied(self) -> list[Optimization]:
        return [o for o in self.entries if o.applied]

    @property
    def skipped(self) -> list[Optimization]:
        return [o for o in self.entries if not o.applied]

    def add(self, entry: Optimization) -> None:
        """Add ``entry``, or replace the entry of the same name."""
        for i, o in enumerate(self.entries):
            if o.name == entry.name:
                self.entries[i] = entry
                return
        self.entries.append(entry)

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "level": self.level,
            "mode": self.mode,
            "optimizations": [o.to_dict() for o in self.entries],
            "notes": list(self.notes),
        }

    def __str__(self) -> str:
        rows = [("optimization", "applied", "memory", "time", "reason")]
        rows += [
            (
                o.name,
                "yes" if o.applied else "no",
                _signed_bytes(o.memory_delta_bytes),
                _signed_seconds(o.time_delta_seconds),
                o.reason,
            )
            for o in self.entries
        ]
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = [
            f"optimizations for {self.device or 'the device'} (level {self.level}, {self.mode}):"
        ]
        for r in rows:
            lines.append(
                "  ".join(c.ljust(w) for c, w in zip(r[:4], widths, strict=True)) + "  " + r[4]
            )
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)
