"""``vramctl serve``: the job service: the queue's API and scheduler beside the dashboard.

:func:`serve_jobs` starts, in this process, a :class:`~vramctl.jobs.Scheduler` on a
thread of its own, the dashboard's monitor on the same devices, and one FastAPI app (the
dashboard's, with the queue's routes of :func:`~vramctl.server.jobs_router` and the
OpenAPI schema at ``/openapi.json``) served by uvicorn. The estimates that price jobs run in
a worker process (:class:`~vramctl.jobs.EstimateWorker`), never in this one.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from fastapi import FastAPI

from vramctl._auth import is_loopback
from vramctl.device import Device, gpus, resolve
from vramctl.jobs import (
    ACTIVE,
    EstimateWorker,
    JobStore,
    Scheduler,
    Settings,
    load_settings,
    vramctl_home,
)
from vramctl.monitor import Monitor
from vramctl.server._dashboard import REQUEST_TIMEOUT_S, DashboardServer, serve_dashboard
from vramctl.server._jobs import JobService, install_error_handlers, jobs_router, service_token

__all__ = ["JobServer", "serve_jobs"]

log = logging.getLogger("vramctl.server")


#: Bucket bounds (seconds) of the admission-latency histogram.
ADMISSION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
#: Bucket bounds (seconds) of the queue-delay histogram.
DELAY_BUCKETS = (1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0, 4 * 3600.0, 24 * 3600.0)


class _Histogram:
    """Counts per bucket, a sum and a count: what a Prometheus histogram reports."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * len(self.bounds)
        self.total = 0.0
        self.n = 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
        self.total += value
        self.n += 1

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative ``(le, count)`` pairs, ``+Inf`` last."""
        return [(repr(b), float(c)) for b, c in zip(self.bounds, self.counts, strict=True)] + [
            ("+Inf", float(self.n))
        ]


#: How long one scheduler round may take before /health calls the loop stuck: a round waits
#: for the estimates that price its jobs (a worker's start, and a minute each at most).
ROUND_LIMIT_S = 300.0


class _SchedulerLoop:
    """The scheduler's rounds on a daemon thread, with a heartbeat for ``/health``."""

    def __init__(
        self,
        store: Path,
        devices: Sequence[Device],
        settings: Settings,
        estimate_worker: EstimateWorker | None = None,
    ) -> None:
        self.store_path = store
        self.devices = list(devices)
        self.settings = settings
        #: Where jobs' estimates run (the submission route's too); closed with the loop.
        self.estimate_worker = estimate_worker
        self.interval = 0.2
        # Starting counts as a round: /health is not degraded before the first one ends.
        self.last_round = time.monotonic()
        #: When the round under way began (None between rounds): a round that prices jobs
        #: waits for their estimates (up to their time limit each).
        self.round_since: float | None = None
        self.error: str | None = None
        #: Per admission: from the start of the round to its commit.
        self.admission = _Histogram(ADMISSION_BUCKETS)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vramctl-scheduler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        with JobStore(self.store_path) as store:
            sched = Scheduler(
                store,
                devices=self.devices,
                policy=self.settings.policy,
                margin=self.settings.margin,
                max_concurrent_jobs=self.settings.max_concurrent_jobs,
                interval_s=self.interval,
                estimate_worker=self.estimate_worker,
            )
            while not self._stop.is_set():
                self.round_since = time.monotonic()
                try:
                    start = time.time()
                    for job in sched.run_once():
                        self.admission.observe(max(0.0, (job.admitted_at or start) - start))
                    self.error = None
                except Exception as exc:  # reported by /health; the loop goes on
                    if self._stop.is_set():
                        break  # stopping: an estimate the closed worker cut short
                    if self.error is None:
                        log.exception("a scheduler round failed")
                    self.error = f"{type(exc).__name__}: {exc}"
                self.last_round = time.monotonic()
                self.round_since = None
                self._stop.wait(self.interval)

    def alive(self) -> bool:
        """Running, its last round fine and recent, or a round under way for less than
        :data:`ROUND_LIMIT_S`."""
        now = time.monotonic()
        recent = now - self.last_round < max(10.0, 20 * self.interval)
        since = self.round_since
        busy = since is not None and now - since < ROUND_LIMIT_S
        return self._thread.is_alive() and self.error is None and (recent or busy)

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self.estimate_worker is not None:
            # An estimate running now ends at once; its job stays queued.
            self.estimate_worker.close()
        if self._thread.is_alive():
            self._thread.join(timeout)


class JobServer:
    """A running job service; :meth:`close` (or ``with``) stops it. Running jobs go on
    (their supervisors are their own processes); a later service adopts them."""

    def __init__(
        self,
        dashboard: DashboardServer,
        service: JobService,
        loop: _SchedulerLoop,
        monitor: Monitor,
        token: str,
    ) -> None:
        self.dashboard = dashboard
        self.service = service
        self.token = token
        self._loop = loop
        self._monitor = monitor

    @property
    def url(self) -> str:
        """The service's base address (ends in ``/``)."""
        return self.dashboard.url

    @property
    def app(self) -> FastAPI:
        return self.dashboard.app

    def close(self) -> None:
        self.dashboard.close()
        self._loop.stop()
        self._monitor.stop()

    def __enter__(self) -> JobServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class _JobsCollector:
    """The queue's metrics for Prometheus: jobs per state, reserved bytes per device,
    queue delay and admission latency."""

    def __init__(self, service: JobService, loop: _SchedulerLoop) -> None:
        self.service = service
        self.loop = loop

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

        store = self.service.store
        jobs = GaugeMetricFamily("vramctl_jobs", "Jobs in the store, by state.", labels=["state"])
        for state, n in store.counts().items():
            jobs.add_metric([state], float(n))
        yield jobs
        reserved = GaugeMetricFamily(
            "vramctl_jobs_reserved_bytes",
            "Bytes reserved by the jobs admitted or running on each device.",
            labels=["device"],
        )
        held = {d.id: 0 for d in self.service.devices}
        for job in store.list(ACTIVE):
            if job.device in held:
                held[job.device] += job.reserved_bytes or 0
        for device, n in held.items():
            reserved.add_metric([device], float(n))
        yield reserved
        delay = _Histogram(DELAY_BUCKETS)
        for value in store.queue_delays():
            delay.observe(value)
        yield HistogramMetricFamily(
            "vramctl_job_queue_delay_seconds",
            "From submission to admission, per admitted job.",
            buckets=delay.buckets(),
            sum_value=delay.total,
        )
        adm = self.loop.admission
        yield HistogramMetricFamily(
            "vramctl_job_admission_seconds",
            "From the start of the scheduler's round to the admission's commit.",
            buckets=adm.buckets(),
            sum_value=adm.total,
        )


def serve_jobs(
    host: str = "127.0.0.1",
    port: int = 8765,
    *,
    store: str | os.PathLike[str] | None = None,
    devices: Sequence[Device | str] | None = None,
    token: str | None = None,
    token_file: str | os.PathLike[str] | None = None,
    settings: Settings | None = None,
    interval: float = 1.0,
    request_timeout: float = REQUEST_TIMEOUT_S,
) -> JobServer:
    """Serve the job queue and the dashboard at ``http://HOST:PORT/``; returns the server.

    ``store``: the job store (default: the settings'); ``devices``: where jobs run
    (default: every GPU, else the CPU; ``sim:NAME`` for a simulated GPU); ``interval``:
    the monitor's sampling. The token (``token``, else ``$VRAMCTL_TOKEN``, else
    ``token_file``, else ``$VRAMCTL_HOME/token``, created on first start) is needed to
    submit, cancel and read logs on every address, and for every route on an address
    other than loopback. ``request_timeout``: the seconds a client has to send a whole
    request before its connection is closed (see :func:`serve_dashboard`).
    """
    settings = settings if settings is not None else load_settings()
    chosen_store = store if store is not None else settings.store
    path = Path(chosen_store) if chosen_store is not None else vramctl_home() / "jobs.db"
    secret = token or service_token(token_file=token_file)
    chosen = _resolve(devices)
    # One worker process runs every estimate (the submission's check, the scheduler's
    # pricing): a user's model is never imported or run in the service's process.
    estimates = EstimateWorker()
    service = JobService(path, chosen, token=secret, settings=settings, estimator=estimates)
    loop = _SchedulerLoop(path, chosen, settings, estimates)
    service.scheduler_alive = loop.alive
    monitor = Monitor(chosen, interval)
    # On loopback the read-only routes stay open (the job routes check the token
    # themselves); anywhere else every route needs it.
    dashboard = serve_dashboard(
        monitor,
        host,
        port,
        token=None if is_loopback(host) else secret,
        title="vramctl jobs",
        routers=[jobs_router(service)],
        configure=lambda app: _configure(app, _JobsCollector(service, loop)),
        openapi=True,
        request_timeout=request_timeout,
    )
    loop.start()
    return JobServer(dashboard, service, loop, monitor, secret)


def _configure(app: FastAPI, collector: _JobsCollector) -> None:
    install_error_handlers(app)
    app.state.vramctl_collectors = [collector]
    # The page's jobs view reads the queue's summary (relative to the page: behind a
    # proxy's prefix too).
    app.state.vramctl_jobs_status = "workers/status"


def _resolve(devices: Sequence[Device | str] | None) -> list[Device]:
    if devices is None:
        return list(gpus()) or [resolve("cpu")]
    return [d if isinstance(d, Device) else resolve(d) for d in devices]
