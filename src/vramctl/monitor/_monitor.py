"""The background sampler: every device's memory at a fixed interval, with alerts and events."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from vramctl._errors import VramctlError
from vramctl._na import NA
from vramctl.device import Device, ProcessMemory, devices, get_device
from vramctl.guard import GuardEvent, add_listener, remove_listener
from vramctl.monitor._alerts import Alert, AlertEngine, Callback, Level, Rule
from vramctl.monitor._history import ExportError, History, Sample

if TYPE_CHECKING:
    from vramctl.monitor._leak import LeakDetector, LeakReport

__all__ = ["Event", "Monitor", "MonitorError"]

log = logging.getLogger("vramctl.monitor")

#: Listing every host process costs milliseconds: the CPU's list is refreshed this often.
CPU_PROCESS_INTERVAL_S = 10.0


class MonitorError(VramctlError, ValueError):
    """The monitor was given a setting it cannot use."""


@dataclass(frozen=True)
class Event:
    """Something the monitor saw: ``kind`` is ``"sample"``, ``"alert"``, ``"guard"`` or ``"leak"``.

    ``data`` is JSON-ready.
    """

    kind: str
    data: dict[str, Any]
    timestamp: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "timestamp": self.timestamp, **self.data}


def _interval(value: float) -> float:
    if not isinstance(value, (int, float)) or not value > 0:
        raise MonitorError(
            f"interval={value!r}: the sampling interval is a positive number of seconds "
            "(1.0 samples once a second)"
        )
    return float(value)


class Monitor:
    """Samples each device's memory on a daemon thread; keeps history, peaks, alerts, events.

    ``devices`` defaults to every device (the GPUs, then the CPU); items may be
    :class:`~vramctl.Device` objects or anything :func:`vramctl.get_device`
    takes (``0``, ``"cuda:1"``, ``"cpu"``, ``"sim:T4-16GB"``). Each sample is a
    :class:`~vramctl.MemoryState` (NVML's device view, this process's PyTorch
    allocator, and for the CPU the host's memory and this process's RSS) plus
    the ``processes`` largest processes on the device.

    ``rules`` defaults to :func:`default_rules`; pass ``[]`` for none. Use it
    as a context manager, or call :meth:`start` and :meth:`stop`.

    >>> from vramctl.monitor import Monitor
    >>> with Monitor(["cpu"], interval=0.05) as mon:
    ...     _ = mon.sample()
    >>> mon.history.latest("cpu").memory.total > 0
    True
    """

    def __init__(
        self,
        devices: Sequence[Device | str | int] | None = None,
        interval: float = 1.0,
        *,
        history: int = 3600,
        rules: Sequence[Rule] | None = None,
        processes: int = 5,
        on_alert: Callback | None = None,
        events: int = 1000,
    ) -> None:
        self.interval = _interval(interval)
        if processes < 0:
            raise MonitorError(f"processes={processes}: list 0 or more processes per device")
        self._device_specs = None if devices is None else list(devices)
        self.devices: list[Device] = self._resolve()
        self.history = History(history)
        self.alerts = AlertEngine(rules)
        self.processes = processes
        self.events: deque[Event] = deque(maxlen=events)
        self._alerts: deque[Alert] = deque(maxlen=events)
        self.samples_taken = 0
        self.sample_time = 0.0
        self._subscribers: list[Callable[[Event], None]] = []
        self._thread: threading.Thread | None = None
        # One event per run: a thread told to stop stays stopped, even if start() comes
        # before it has seen it (a callback that calls stop() on the sampling thread).
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._cpu_procs: tuple[float, tuple[ProcessMemory, ...]] = (0.0, ())
        self._leak: LeakDetector | None = None
        #: Components that report their own figures here (a tensor cache): see add_source.
        self.sources: list[Any] = []
        self.started_at: float | None = None
        if on_alert is not None:
            self.on_alert(on_alert)
        self.alerts.on_alert(self._alert_event)

    def _resolve(self) -> list[Device]:
        if self._device_specs is None:
            return devices()
        if not self._device_specs:
            raise MonitorError("devices=[]: give at least one device, or None for all of them")
        return [get_device(d) for d in self._device_specs]

    # -- life cycle ------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> Monitor:
        """Start sampling in the background (a daemon thread). Starting twice is harmless."""
        if self.running:
            return self
        self._stop = stop = threading.Event()
        self.started_at = time.time()
        add_listener(self._guard_event)
        self._thread = threading.Thread(
            target=self._run, args=(stop,), name="vramctl-monitor", daemon=True
        )
        self._thread.start()
        return self

    def stop(self, timeout: float | None = 5.0) -> None:
        """Stop sampling and wait for the thread (at most ``timeout`` seconds)."""
        self._stop.set()
        remove_listener(self._guard_event)
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def __enter__(self) -> Monitor:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _run(self, stop: threading.Event) -> None:
        next_at = time.monotonic()
        while not stop.is_set():
            try:
                self.sample()
            except Exception:  # a reading that fails must not end monitoring
                log.exception("monitor sample failed")
            next_at += self.interval
            delay = next_at - time.monotonic()
            if delay < 0:  # fell behind (a slow reading): skip, do not burst
                next_at = time.monotonic()
                delay = 0.0
            if stop.wait(delay):
                break

    # -- sampling --------------------------------------------------------------

    def _processes(self, dev: Device) -> tuple[ProcessMemory, ...]:
        if self.processes == 0:
            return ()
        if dev.is_gpu:
            return tuple(dev.processes(limit=self.processes))
        at, rows = self._cpu_procs
        now = time.monotonic()
        if not rows or now - at >= CPU_PROCESS_INTERVAL_S:
            rows = tuple(dev.processes(limit=self.processes))
            self._cpu_procs = (now, rows)
        return rows

    def sample(self) -> list[Sample]:
        """Read every device now, record the samples, evaluate the alert rules."""
        t0 = time.perf_counter()
        with self._lock:
            taken = [Sample(d.id, d.memory(), self._processes(d)) for d in self.devices]
            fired: list[Alert] = []
            lookback = self.alerts.lookback
            for s in taken:
                self.history.append(s)
                recent = self.history.recent(s.device, lookback)
                fired += self.alerts.evaluate(s, recent, dispatch=False)
            self.samples_taken += 1
            self.sample_time += time.perf_counter() - t0
        # Outside the lock: a callback may sample, read the history or stop the monitor.
        for alert in fired:
            self.alerts.dispatch(alert)
        if self._subscribers:
            self._publish(Event("sample", {"samples": [s.to_dict() for s in taken]}))
        return taken

    # -- alerts, events, subscribers ---------------------------------------------

    def on_alert(
        self, callback: Callback, *, level: Level | str = Level.INFO, rule: str | None = None
    ) -> Callable[[], None]:
        """Call ``callback(alert)`` for alerts at ``level`` or above; returns a remover.

        Actions are callbacks: ``monitor.on_alert(vramctl.monitor.cleanup,
        level="critical")`` or ``monitor.on_alert(Shrink(guard), level="error")``.
        """
        return self.alerts.on_alert(callback, level=level, rule=rule)

    def subscribe(self, fn: Callable[[Event], None]) -> Callable[[], None]:
        """Call ``fn(event)`` for every sample, alert, guard event and leak; returns a remover.

        ``fn`` runs on the sampling thread (or the thread that caused the event):
        keep it quick, and hand work to your own thread or event loop.
        """
        self._subscribers.append(fn)

        def remove() -> None:
            if fn in self._subscribers:
                self._subscribers.remove(fn)

        return remove

    def add_source(self, source: Any) -> Callable[[], None]:
        """Report ``source``'s figures with the monitor's; returns a remover.

        ``source`` has a ``name``, ``stats()`` (a JSON-ready dict, in :meth:`summary`
        under ``"sources"``) and ``metrics()``: ``(name, "gauge" or "counter", help,
        labels, value)`` samples, served as ``vramctl_NAME`` with the monitor's own
        Prometheus metrics. :meth:`vramctl.TensorCache.attach` adds a cache here.
        """
        for attr in ("name", "stats", "metrics"):
            if not hasattr(source, attr):
                raise MonitorError(
                    f"{source!r} has no {attr}: a source has name, stats(), metrics()"
                )
        self.sources.append(source)

        def remove() -> None:
            if source in self.sources:
                self.sources.remove(source)

        return remove

    def record(self, kind: str, /, **data: Any) -> Event:
        """Record an event of your own (a batcher's resize, a phase of your job)."""
        event = Event(kind, data)
        self.events.append(event)
        self._publish(event)
        return event

    def _publish(self, event: Event) -> None:
        for fn in list(self._subscribers):
            try:
                fn(event)
            except Exception:
                log.exception("monitor subscriber %r failed", fn)

    def _alert_event(self, alert: Alert) -> None:
        self._alerts.append(alert)
        self.record("alert", **alert.to_dict())

    def _guard_event(self, event: GuardEvent) -> None:
        data = event.to_dict()
        data["event"] = data.pop("kind")  # "oom", "grow", "shrink" ...
        self.record("guard", **data)

    def recent_alerts(self, limit: int = 50) -> list[Alert]:
        """The newest alerts (resolved ones included), oldest first."""
        return list(self._alerts)[-limit:]

    # -- leaks -------------------------------------------------------------------

    def step(self) -> LeakReport | None:
        """Mark the end of a training step for the leak detector; returns a report on a leak.

        Call it at the same point of every step (after ``optimizer.step()``). The
        detector watches the first monitored CUDA device this process uses, or
        the CPU's heap. A leak is also an alert (rule ``"leak"``, level error).
        :meth:`summary`'s ``"leak"`` says what is read, and why where it is not the
        exact reading (on the CPU, glibc's malloc counters: the first step checks that
        they see a 4 MiB tensor; where that tensor cannot be allocated the step goes on,
        reading the process's RSS).
        """
        detector = self._leak
        if detector is None:
            detector = self._leak = self._make_detector()
            if detector.signal_note is not None:
                log.info("the leak detector reads %s: %s", detector.signal, detector.signal_note)
        report = detector.step()
        if report is not None:
            data = report.to_dict()
            self.record("leak", **data)
            alert = Alert(
                "leak",
                Level.ERROR,
                str(data.get("device", self._leak_device())),
                str(report).splitlines()[0],
                value=float(report.rate_bytes_per_step),
                suggestion="; ".join(report.causes),
            )
            self.alerts.dispatch(alert)
        return report

    def _leak_device(self) -> str:
        import torch

        for d in self.devices:
            if d.is_cuda and torch.cuda.is_initialized():
                return str(d.torch_device)
        return "cpu"

    def _make_detector(self) -> LeakDetector:
        from vramctl.monitor._leak import LeakDetector

        return LeakDetector(self._leak_device(), log_reports=False)

    # -- summaries and exports ---------------------------------------------------

    @property
    def overhead(self) -> float:
        """Mean seconds one sample of every device took."""
        return self.sample_time / self.samples_taken if self.samples_taken else 0.0

    def summary(self) -> dict[str, Any]:
        """Peaks, latest readings, active alerts and sampling cost, JSON-ready; once
        :meth:`step` has been called, ``"leak"``: the leak detector's device, ``signal``
        (what it reads), ``signal_note`` (why that is not the exact reading, or null) and
        ``steps``."""
        out: dict[str, Any] = {
            "pid": os.getpid(),
            "interval_s": self.interval,
            "samples": self.samples_taken,
            "sample_cost_s": round(self.overhead, 6),
            "devices": {},
            "active_alerts": [
                {"rule": r, "device": d, "level": lv.name.lower()}
                for (r, d), lv in self.alerts.active().items()
            ],
        }
        if self.sources:
            out["sources"] = {str(src.name): src.stats() for src in list(self.sources)}
        detector = self._leak
        if detector is not None:  # step() has been called
            out["leak"] = {
                "device": str(detector.device),
                "signal": detector.signal,
                "signal_note": detector.signal_note,
                "steps": detector.steps,
            }
        for dev in self.devices:
            latest = self.history.latest(dev.id)
            out["devices"][dev.id] = {
                "name": dev.name,
                "uuid": None if dev.uuid is NA else dev.uuid,
                "latest": None if latest is None else latest.memory.to_dict(),
                "peak": self.history.peak(dev.id).to_dict(),
            }
        return out

    def export(self, path: str | Path) -> Path:
        """Write the history as JSON Lines (``.jsonl``) or a plot (``.html``, ``.png``).

        Any other file name is an :class:`ExportError` (JSON Lines in a ``.csv``
        file would mislead whatever reads it).
        """
        target = Path(path)
        suffix = target.suffix.lower()
        if suffix in (".html", ".htm", ".png"):
            from vramctl.monitor._plot import plot

            return plot(self.history, target)
        if suffix not in (".jsonl", ".ndjson"):
            raise ExportError(
                f"cannot export the history to {str(target)!r}: use a .jsonl file name for "
                "JSON Lines, or .html or .png for a plot"
            )
        return self.history.to_jsonl(target)
