"""``vramctl serve``: the job service: the queue's API and scheduler beside the dashboard.

:func:`serve_jobs` starts, in this process, a :class:`~vramctl.jobs.Scheduler` on a
thread of its own, the dashboard's monitor on the same devices, and one FastAPI app (the
dashboard's, with the queue's routes of :func:`~vramctl.server.jobs_router` and the
OpenAPI schema at ``/openapi.json``) served by uvicorn.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from fastapi import FastAPI

from vramctl.device import Device, gpus, resolve
from vramctl.jobs import JobStore, Scheduler, Settings, load_settings, vramctl_home
from vramctl.monitor import Monitor, is_loopback
from vramctl.server._dashboard import DashboardServer, serve_dashboard
from vramctl.server._jobs import JobService, install_error_handlers, jobs_router, service_token

__all__ = ["JobServer", "serve_jobs"]

log = logging.getLogger("vramctl.server")


class _SchedulerLoop:
    """The scheduler's rounds on a daemon thread, with a heartbeat for ``/health``."""

    def __init__(self, store: Path, devices: Sequence[Device], settings: Settings) -> None:
        self.store_path = store
        self.devices = list(devices)
        self.settings = settings
        self.interval = 0.2
        self.last_round = 0.0
        self.error: str | None = None
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
            )
            while not self._stop.is_set():
                try:
                    sched.run_once()
                    self.error = None
                except Exception as exc:  # reported by /health; the loop goes on
                    if self.error is None:
                        log.exception("a scheduler round failed")
                    self.error = f"{type(exc).__name__}: {exc}"
                self.last_round = time.monotonic()
                self._stop.wait(self.interval)

    def alive(self) -> bool:
        """Running, its last round fine and recent."""
        recent = time.monotonic() - self.last_round < max(10.0, 20 * self.interval)
        return self._thread.is_alive() and self.error is None and recent

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
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
) -> JobServer:
    """Serve the job queue and the dashboard at ``http://HOST:PORT/``; returns the server.

    ``store``: the job store (default: the settings'); ``devices``: where jobs run
    (default: every GPU, else the CPU; ``sim:NAME`` for a simulated GPU); ``interval``:
    the monitor's sampling. The token (``token``, else ``$VRAMCTL_TOKEN``, else
    ``token_file``, else ``$VRAMCTL_HOME/token``, created on first start) is needed to
    submit, cancel and read logs on every address, and for every route on an address
    other than loopback.
    """
    settings = settings if settings is not None else load_settings()
    chosen_store = store if store is not None else settings.store
    path = Path(chosen_store) if chosen_store is not None else vramctl_home() / "jobs.db"
    secret = token or service_token(token_file=token_file)
    chosen = _resolve(devices)
    service = JobService(path, chosen, token=secret, settings=settings)
    loop = _SchedulerLoop(path, chosen, settings)
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
        configure=install_error_handlers,
        openapi=True,
    )
    loop.start()
    return JobServer(dashboard, service, loop, monitor, secret)


def _resolve(devices: Sequence[Device | str] | None) -> list[Device]:
    if devices is None:
        return list(gpus()) or [resolve("cpu")]
    out: list[Device] = []
    for d in devices:
        if isinstance(d, Device):
            out.append(d)
        elif d.startswith("sim:"):
            from vramctl.device import simulate

            out.append(simulate(d))
        else:
            out.append(resolve(d))
    return out
