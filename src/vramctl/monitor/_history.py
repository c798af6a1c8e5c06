"""Samples and their bounded history: per device, with peaks, exported as JSON Lines."""

from __future__ import annotations

import itertools
import json
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from vramctl._errors import VramctlError
from vramctl._na import NA, Bytes, NotAvailable
from vramctl.device import MemoryState, ProcessMemory

__all__ = ["ExportError", "History", "Peak", "Sample", "load_jsonl"]

SAMPLE_SCHEMA = "vramctl.sample/1"


class ExportError(VramctlError, OSError):
    """A history export could not be written (or read)."""


@dataclass(frozen=True)
class Sample:
    """One device's reading at one moment, with its largest processes."""

    device: str
    memory: MemoryState
    processes: tuple[ProcessMemory, ...] = ()

    @property
    def timestamp(self) -> float:
        return self.memory.timestamp

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SAMPLE_SCHEMA,
            "device": self.device,
            "timestamp": self.timestamp,
            "memory": self.memory.to_dict(),
            "processes": [p.to_dict() for p in self.processes],
        }

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> Sample:
        mem_fields = {f.name for f in fields(MemoryState)}
        mem: dict[str, Any] = {
            k: (NA if v is None else v) for k, v in doc["memory"].items() if k in mem_fields
        }
        mem["device"] = doc["device"]
        proc_fields = {f.name for f in fields(ProcessMemory)}
        procs = tuple(ProcessMemory(**_fields(p, proc_fields)) for p in doc.get("processes", ()))
        return cls(device=doc["device"], memory=MemoryState(**mem), processes=procs)


def _fields(doc: dict[str, Any], names: set[str]) -> dict[str, Any]:
    return {k: (NA if v is None else v) for k, v in doc.items() if k in names}


@dataclass
class Peak:
    """The highest readings a device has had since the monitor started (or was reset)."""

    used: Bytes = NA
    used_at: float | NotAvailable = NA
    utilization: float | NotAvailable = NA
    allocated: Bytes = NA
    reserved: Bytes = NA
    process_used: Bytes = NA

    def update(self, mem: MemoryState) -> None:
        if mem.used is not NA and (self.used is NA or mem.used > self.used):
            self.used, self.used_at = mem.used, mem.timestamp
        util = mem.utilization
        if util is not NA and (self.utilization is NA or util > self.utilization):
            self.utilization = util
        # The allocator keeps its own peaks between samples: take them where they exist.
        for name, peak_name in (("allocated", "peak_allocated"), ("reserved", "peak_reserved")):
            seen = getattr(mem, peak_name)
            if seen is NA:
                seen = getattr(mem, name)
            if seen is not NA and (getattr(self, name) is NA or seen > getattr(self, name)):
                setattr(self, name, seen)
        if mem.process_used is not NA and (
            self.process_used is NA or mem.process_used > self.process_used
        ):
            self.process_used = mem.process_used

    def to_dict(self) -> dict[str, Any]:
        return {
            f.name: None if getattr(self, f.name) is NA else getattr(self, f.name)
            for f in fields(self)
        }


@dataclass
class _Track:
    samples: deque[Sample]
    peak: Peak = field(default_factory=Peak)


class History:
    """A ring buffer of samples per device: the newest ``capacity`` of each are kept.

    >>> from vramctl import MemoryState
    >>> h = History(capacity=2)
    >>> for used in (1, 5, 3):
    ...     h.append(Sample("cpu", MemoryState("cpu", total=10, used=used, free=10 - used)))
    >>> [s.memory.used for s in h.samples("cpu")], h.peak("cpu").used
    ([5, 3], 5)
    """

    def __init__(self, capacity: int = 3600) -> None:
        if capacity < 1:
            raise ValueError(f"history capacity must be at least 1 sample, got {capacity}")
        self.capacity = capacity
        self._tracks: dict[str, _Track] = {}
        self._lock = threading.Lock()

    def append(self, sample: Sample) -> None:
        with self._lock:
            track = self._tracks.get(sample.device)
            if track is None:
                track = self._tracks[sample.device] = _Track(deque(maxlen=self.capacity))
            track.samples.append(sample)
            track.peak.update(sample.memory)

    def extend(self, samples: Iterable[Sample]) -> None:
        for s in samples:
            self.append(s)

    @property
    def devices(self) -> list[str]:
        with self._lock:
            return list(self._tracks)

    def samples(self, device: str, since: float | None = None) -> list[Sample]:
        """The kept samples of ``device``, oldest first (those after ``since``, if given)."""
        with self._lock:
            track = self._tracks.get(device)
            rows = list(track.samples) if track else []
        if since is not None:
            rows = [s for s in rows if s.timestamp > since]
        return rows

    def recent(self, device: str, seconds: float, limit: int = 200) -> list[Sample]:
        """The samples of the last ``seconds`` before the newest one (at most ``limit``).

        Oldest first. Walks back from the newest sample only as far as needed, so
        its cost does not grow with the history's capacity.
        """
        with self._lock:
            track = self._tracks.get(device)
            if not track or not track.samples:
                return []
            since = track.samples[-1].timestamp - seconds
            newest = itertools.islice(reversed(track.samples), limit)
            rows = list(itertools.takewhile(lambda s: s.memory.timestamp >= since, newest))
        rows.reverse()
        return rows

    def latest(self, device: str) -> Sample | None:
        with self._lock:
            track = self._tracks.get(device)
            return track.samples[-1] if track and track.samples else None

    def peak(self, device: str) -> Peak:
        with self._lock:
            track = self._tracks.get(device)
            return Peak(**vars(track.peak)) if track else Peak()

    def columns(
        self, device: str, names: Iterable[str], last: int | None = None
    ) -> dict[str, list[Any]]:
        """Columns for a chart: ``"t"`` (timestamps) and each named ``MemoryState`` field.

        ``NA`` readings become ``None``; ``last`` keeps only the newest samples.

        >>> from vramctl import MemoryState
        >>> h = History()
        >>> h.append(Sample("cpu", MemoryState("cpu", used=3, timestamp=1.0)))
        >>> h.columns("cpu", ["used", "allocated"])
        {'t': [1.0], 'used': [3], 'allocated': [None]}
        """
        rows = self.samples(device)
        if last is not None:
            rows = rows[-last:]
        out: dict[str, list[Any]] = {"t": [s.timestamp for s in rows]}
        for name in names:
            out[name] = [None if (v := getattr(s.memory, name)) is NA else v for s in rows]
        return out

    def __iter__(self) -> Iterator[Sample]:
        """Every kept sample, by time."""
        with self._lock:
            rows = [s for t in self._tracks.values() for s in t.samples]
        return iter(sorted(rows, key=lambda s: s.timestamp))

    def __len__(self) -> int:
        with self._lock:
            return sum(len(t.samples) for t in self._tracks.values())

    def clear(self) -> None:
        with self._lock:
            self._tracks.clear()

    # -- export -------------------------------------------------------------------

    def to_jsonl(self, path: str | Path) -> Path:
        """Write every kept sample as one JSON object per line; returns the path."""
        target = Path(path)
        lines = [json.dumps(s.to_dict()) for s in self]
        try:
            target.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        except OSError as exc:
            raise ExportError(
                f"cannot write the history to {str(target)!r}: {exc.strerror or exc}; "
                "choose a path in a writable directory"
            ) from exc
        return target


def load_jsonl(path: str | Path, capacity: int | None = None) -> History:
    """Read a history written by :meth:`History.to_jsonl` (or ``vramctl monitor --jsonl``)."""
    source = Path(path)
    try:
        text = source.read_text(encoding="utf-8")
    except OSError as exc:
        raise ExportError(f"cannot read {str(source)!r}: {exc.strerror or exc}") from exc
    samples = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            samples.append(Sample.from_dict(json.loads(line)))
        except (ValueError, KeyError, TypeError) as exc:
            raise ExportError(f"{source}:{n}: not a vramctl sample ({exc})") from exc
    history = History(capacity or max(1, len(samples)))
    history.extend(samples)
    return history
