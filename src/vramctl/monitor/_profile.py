"""``profile(name)``: the time and peak-memory delta of an operation, aggregated per name.

On a CUDA device the peak comes from the caching allocator (its peak counter is
reset at the start of each profiled block, as ``torch.cuda.reset_peak_memory_stats``
does); on a simulated GPU from its own count; on the CPU from a count of the
tensor storages the block creates (a dispatch mode that is active only inside
the block).

>>> import torch
>>> from vramctl.monitor import Profiler
>>> prof = Profiler()
>>> with prof.profile("ones"):
...     x = torch.ones(1024, 1024)
>>> prof.stats["ones"].calls, prof.stats["ones"].peak_delta >= 4 * 2**20
(1, True)
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from vramctl._units import format_bytes
from vramctl.device import Device, resolve

__all__ = ["OpStats", "Profiler", "profile", "profiler"]


@dataclass
class OpStats:
    """Calls, time and peak-memory delta of one profiled name."""

    name: str
    calls: int = 0
    total_s: float = 0.0
    max_s: float = 0.0
    #: Largest rise of memory above the level at entry, over all calls (bytes).
    peak_delta: int = 0
    #: Sum of (memory at exit - memory at entry) over all calls: what the calls kept.
    net_delta: int = 0
    min_s: float = field(default=math.inf)

    @property
    def mean_s(self) -> float:
        return self.total_s / self.calls if self.calls else 0.0

    def add(self, seconds: float, peak: int, net: int) -> None:
        self.calls += 1
        self.total_s += seconds
        self.max_s = max(self.max_s, seconds)
        self.min_s = min(self.min_s, seconds)
        self.peak_delta = max(self.peak_delta, peak)
        self.net_delta += net

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "calls": self.calls,
            "total_s": round(self.total_s, 6),
            "mean_s": round(self.mean_s, 6),
            "min_s": round(self.min_s, 6) if self.calls else None,
            "max_s": round(self.max_s, 6),
            "peak_delta_bytes": self.peak_delta,
            "net_delta_bytes": self.net_delta,
        }


def _target(device: Device | str | int | None) -> Device:
    return resolve(device)


@contextlib.contextmanager
def _measure(device: Device) -> Iterator[list[int]]:
    """Yields a list that holds ``[peak_delta, net_delta]`` after the block."""
    result = [0, 0]
    meter = device.peak_meter()
    try:
        with meter:
            yield result
    finally:
        result[:] = [meter.peak_allocated, meter.net_allocated]


class Profiler:
    """Aggregates :meth:`profile` blocks per name; :meth:`table` prints the summary."""

    def __init__(self) -> None:
        self.stats: dict[str, OpStats] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def profile(self, name: str, device: Device | str | int | None = None) -> Iterator[None]:
        """Time the block and measure how far memory rose above its level at entry."""
        if not name:
            raise ValueError("profile() needs a name for the operation, e.g. profile('forward')")
        dev = _target(device)
        t0 = time.perf_counter()
        try:
            with _measure(dev) as mem:
                yield
        finally:
            seconds = time.perf_counter() - t0
            with self._lock:
                self.stats.setdefault(name, OpStats(name)).add(seconds, mem[0], mem[1])

    def reset(self) -> None:
        with self._lock:
            self.stats.clear()

    def summary(self) -> list[dict[str, Any]]:
        """One JSON-ready row per name, slowest total first."""
        rows = sorted(self.stats.values(), key=lambda s: s.total_s, reverse=True)
        return [r.to_dict() for r in rows]

    def table(self) -> str:
        """A plain-text table: name, calls, mean and total time, peak and net memory deltas."""
        head = (
            f"{'operation':<24} {'calls':>6} {'mean ms':>9} {'total s':>9} "
            f"{'peak +':>10} {'kept':>10}"
        )
        lines = [head, "-" * len(head)]
        for s in sorted(self.stats.values(), key=lambda s: s.total_s, reverse=True):
            lines.append(
                f"{s.name[:24]:<24} {s.calls:>6} {s.mean_s * 1e3:>9.2f} {s.total_s:>9.3f} "
                f"{format_bytes(s.peak_delta):>10} {format_bytes(s.net_delta):>10}"
            )
        return "\n".join(lines)


#: The process-wide profiler that :func:`profile` adds to.
profiler = Profiler()


def profile(name: str, device: Device | str | int | None = None) -> Any:
    """Profile a block under ``name`` in the process-wide :data:`profiler`.

    >>> import torch
    >>> from vramctl.monitor import profile, profiler
    >>> with profile("matmul"):
    ...     _ = torch.randn(256, 256) @ torch.randn(256, 256)
    >>> profiler.stats["matmul"].calls >= 1
    True
    """
    return profiler.profile(name, device)
