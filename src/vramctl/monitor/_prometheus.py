"""Prometheus metrics from a :class:`Monitor`: ``vramctl_`` names, base units, labels.

Gauges are in bytes or 0-1 ratios, counters end in ``_total``; device metrics
carry ``device`` and ``uuid``, per-process ones add ``pid``. A scrape reads
the monitor's newest samples (it does not sample again), so scraping costs no
device calls. Needs ``prometheus-client`` (``pip install 'vramctl[monitor]'``).
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from vramctl._auth import host_allowed, token_ok
from vramctl._na import NA
from vramctl._optional import require
from vramctl.monitor._http import AddressError, check_bind

if TYPE_CHECKING:
    from vramctl.monitor._monitor import Monitor

__all__ = ["MetricsServer", "metrics_text", "registry", "serve_prometheus"]

#: (metric suffix, MemoryState field, help). Device-wide readings: labels device, uuid.
_DEVICE_GAUGES = (
    ("memory_total_bytes", "total", "Device memory capacity."),
    ("memory_used_bytes", "used", "Device memory in use, by every process."),
    ("memory_free_bytes", "free", "Device memory free."),
    ("memory_utilization_ratio", "utilization", "Device memory in use over capacity, 0-1."),
    ("temperature_celsius", "temperature_c", "GPU temperature."),
    ("power_watts", "power_w", "GPU power draw."),
)
#: This process's own figures: labels device, uuid, pid.
_PROCESS_GAUGES = (
    ("allocator_allocated_bytes", "allocated", "Bytes in tensors (PyTorch caching allocator)."),
    ("allocator_reserved_bytes", "reserved", "Bytes the PyTorch caching allocator holds."),
    (
        "allocator_inactive_split_bytes",
        "inactive_split",
        "Reserved bytes in inactive split blocks (fragmentation).",
    ),
    (
        "allocator_fragmentation_ratio",
        "fragmentation",
        "Inactive split bytes over reserved bytes, 0-1.",
    ),
)
_PROCESS_COUNTERS = (
    ("allocator_retries", "alloc_retries", "Allocations retried after freeing the cache."),
    ("allocator_ooms", "ooms", "Out-of-memory errors the allocator raised."),
)


def _label(value: object) -> str:
    """A label value from an event's data: a string, whatever ``Monitor.record`` was given."""
    return "" if value is None else str(value)


def _need_client() -> None:
    require("prometheus_client", extra="monitor", what="Prometheus metrics")


class _Collector:
    def __init__(self, monitor: Monitor) -> None:
        self.monitor = monitor

    def describe(self) -> Iterable[Any]:
        """The families :meth:`collect` may give, without their samples.

        The registry learns the names from them, so that a scrape of
        ``/metrics?name[]=NAME`` returns those metrics (and not an empty page).
        """
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        gauges = [name for name, _, _ in (*_DEVICE_GAUGES, *_PROCESS_GAUGES)]
        gauges += [
            "compute_utilization_ratio",
            "memory_peak_used_bytes",
            "process_memory_bytes",
            "alerts_active",
            "monitor_sample_seconds",
        ]
        counters = [name for name, _, _ in _PROCESS_COUNTERS]
        counters += ["alerts", "guard_events", "monitor_samples"]
        for name in gauges:
            yield GaugeMetricFamily(f"vramctl_{name}", "")
        for name in counters:
            yield CounterMetricFamily(f"vramctl_{name}", "")
        seen: set[str] = set()
        for source in list(self.monitor.sources):
            for name, kind, *_ in source.metrics():
                if name not in seen:
                    seen.add(name)
                    cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                    yield cls(f"vramctl_{name}", "")

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        mon = self.monitor
        if not mon.running and mon.samples_taken == 0:
            mon.sample()
        dev_labels = ["device", "uuid"]
        proc_labels = ["device", "uuid", "pid"]
        families: dict[str, Any] = {}

        def family(kind: type, name: str, doc: str, labels: list[str]) -> Any:
            if name not in families:
                families[name] = kind(f"vramctl_{name}", doc, labels=labels)
            return families[name]

        pid = str(os.getpid())
        for dev in mon.devices:
            latest = mon.history.latest(dev.id)
            if latest is None:
                continue
            mem = latest.memory
            uuid = "" if dev.uuid is NA else str(dev.uuid)
            for name, attr, doc in _DEVICE_GAUGES:
                value = getattr(mem, attr)
                if value is not NA:
                    family(GaugeMetricFamily, name, doc, dev_labels).add_metric(
                        [dev.id, uuid], float(value)
                    )
            if mem.compute_utilization is not NA:
                family(
                    GaugeMetricFamily,
                    "compute_utilization_ratio",
                    "GPU busy fraction, 0-1.",
                    dev_labels,
                ).add_metric([dev.id, uuid], float(mem.compute_utilization) / 100.0)
            peak = mon.history.peak(dev.id)
            if peak.used is not NA:
                family(
                    GaugeMetricFamily,
                    "memory_peak_used_bytes",
                    "Highest device memory in use since monitoring started.",
                    dev_labels,
                ).add_metric([dev.id, uuid], float(peak.used))
            for name, attr, doc in _PROCESS_GAUGES:
                value = getattr(mem, attr)
                if value is not NA:
                    family(GaugeMetricFamily, name, doc, proc_labels).add_metric(
                        [dev.id, uuid, pid], float(value)
                    )
            for name, attr, doc in _PROCESS_COUNTERS:
                value = getattr(mem, attr)
                if value is not NA:
                    family(CounterMetricFamily, name, doc, proc_labels).add_metric(
                        [dev.id, uuid, pid], float(value)
                    )
            procs = family(
                GaugeMetricFamily,
                "process_memory_bytes",
                "Device memory each process uses (host RSS for the CPU).",
                proc_labels,
            )
            for p in latest.processes:
                if p.used is not NA:
                    procs.add_metric([dev.id, uuid, str(p.pid)], float(p.used))
        active = family(
            GaugeMetricFamily,
            "alerts_active",
            "Alerts firing now (1 per rule and device).",
            ["device", "rule", "level"],
        )
        for (rule, device), level in mon.alerts.active().items():
            active.add_metric([device, rule, level.name.lower()], 1.0)
        counts = Counter(
            (_label(e.data.get("level")), _label(e.data.get("rule")))
            for e in mon.events
            if e.kind == "alert" and not e.data.get("resolved")
        )
        fired = family(CounterMetricFamily, "alerts", "Alerts fired.", ["level", "rule"])
        for (level_name, rule_name), n in sorted(counts.items()):
            fired.add_metric([level_name, rule_name], float(n))
        guard = Counter(_label(e.data.get("event")) for e in mon.events if e.kind == "guard")
        gfam = family(
            CounterMetricFamily,
            "guard_events",
            "OOM guard events (oom, grow, offload ...).",
            ["kind"],
        )
        for kind, n in sorted(guard.items()):
            gfam.add_metric([kind], float(n))
        family(CounterMetricFamily, "monitor_samples", "Samples the monitor took.", []).add_metric(
            [], float(mon.samples_taken)
        )
        family(
            GaugeMetricFamily, "monitor_sample_seconds", "Mean time one sample took.", []
        ).add_metric([], mon.overhead)
        for source in list(mon.sources):
            for name, kind, doc, labels, value in source.metrics():
                cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                keys = sorted(labels)
                family(cls, name, doc, keys).add_metric([labels[k] for k in keys], float(value))
        yield from families.values()


def registry(monitor: Monitor, extra: Sequence[Any] = ()) -> Any:
    """A ``prometheus_client.CollectorRegistry`` holding ``monitor``'s metrics, and those
    of the ``extra`` collectors (objects with ``collect()``, as prometheus_client's)."""
    _need_client()
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Collector(monitor))
    for collector in extra:
        reg.register(collector)
    return reg


def metrics_text(monitor: Monitor, extra: Sequence[Any] = ()) -> str:
    """The metrics in Prometheus's text format, as a scrape of ``/metrics`` returns them
    (with those of the ``extra`` collectors)."""
    from prometheus_client import generate_latest

    return bytes(generate_latest(registry(monitor, extra))).decode()


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that stalls (the handler's timeout) or hangs up is no error of the server's.
        if isinstance(sys.exc_info()[1], OSError):
            return
        super().handle_error(request, client_address)


class _ThreadingServer6(_ThreadingServer):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    #: Seconds a connection may wait on the client (its request, reading the answer):
    #: a client that connects and sends nothing does not keep a thread for ever.
    timeout = 10.0

    def log_message(self, format: str, *args: Any) -> None:
        pass


class MetricsServer:
    """A running ``/metrics`` endpoint; :meth:`close` stops it."""

    def __init__(self, server: WSGIServer, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread
        self.host = str(server.server_address[0])
        self.port = int(server.server_address[1])

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in str(self.host) else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


def serve_prometheus(
    monitor: Monitor,
    host: str = "127.0.0.1",
    port: int = 9400,
    *,
    token: str | None = None,
    extra: Sequence[Any] = (),
) -> MetricsServer:
    """Serve ``monitor``'s metrics at ``http://HOST:PORT/metrics`` on a daemon thread.

    Binds to 127.0.0.1 by default; any other address needs ``token`` (or
    ``$VRAMCTL_TOKEN``), which scrapers send as ``Authorization: Bearer TOKEN``.
    Without a token it answers only requests addressed to ``localhost`` or a
    loopback address (``Host``), so that no web site can read it through DNS
    rebinding. ``extra`` are more collectors (objects with ``collect()``, as
    prometheus_client's) served with the monitor's metrics; the monitor's sources
    (:meth:`Monitor.add_source`) are served anyway.
    """
    _need_client()
    from prometheus_client import make_wsgi_app

    required = check_bind(host, port, token)
    metrics_app = make_wsgi_app(registry(monitor, extra))

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if required is None and not host_allowed(environ.get("HTTP_HOST"), host):
            start_response("403 Forbidden", [("Content-Type", "text/plain")])
            return [b"this endpoint answers only requests addressed to 127.0.0.1 or localhost\n"]
        if not token_ok(required, environ.get("HTTP_AUTHORIZATION")):
            start_response("401 Unauthorized", [("WWW-Authenticate", "Bearer")])
            return [b"a bearer token is required\n"]
        if environ.get("PATH_INFO", "/") not in ("/", "/metrics"):
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"metrics are at /metrics\n"]
        return metrics_app(environ, start_response)  # type: ignore[no-any-return]

    server_class = _ThreadingServer6 if ":" in host else _ThreadingServer
    try:
        server = make_server(host, port, app, server_class, handler_class=_QuietHandler)
    except OSError as exc:
        raise AddressError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    thread = threading.Thread(target=server.serve_forever, name="vramctl-metrics", daemon=True)
    thread.start()
    return MetricsServer(server, thread)
