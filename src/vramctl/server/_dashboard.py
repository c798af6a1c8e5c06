"""The web dashboard: a FastAPI app with live memory charts, alerts and processes.

:func:`create_app` builds the app around a running :class:`~vramctl.monitor.Monitor`;
:func:`serve_dashboard` checks the address, starts the monitor and serves the
app on a daemon thread. The page loads ``/api/state`` once, then follows the
monitor through Server-Sent Events at ``/api/stream``. Its chart library (uPlot)
is vendored: the page makes no request outside the server.

>>> from vramctl.monitor import Monitor
>>> from vramctl.server import serve_dashboard
>>> with Monitor(["cpu"], interval=0.5, rules=[]) as mon, serve_dashboard(mon, port=0) as server:
...     server.url.startswith("http://127.0.0.1:")
True
"""

from __future__ import annotations

import asyncio
import contextlib
import html
import json
import logging
import math
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from functools import cache
from importlib import resources
from types import TracebackType
from typing import Any
from urllib.parse import quote

import h11
import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from starlette.datastructures import Headers, QueryParams
from starlette.responses import StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from vramctl._auth import host_allowed, token_ok
from vramctl._na import NA
from vramctl._units import format_bytes
from vramctl._version import __version__
from vramctl.monitor import AddressError, Event, Monitor
from vramctl.monitor._shared import check_bind, static_file

__all__ = [
    "HISTORY_WINDOW",
    "KEEPALIVE_S",
    "DashboardServer",
    "create_app",
    "dashboard_router",
    "serve_dashboard",
]

log = logging.getLogger("vramctl.server")

#: Samples per device that ``/api/state`` returns and the page keeps on its charts.
HISTORY_WINDOW = 600
#: Seconds between keep-alive comments on an idle event stream.
KEEPALIVE_S = 15.0
#: Events a slow client may fall behind by before the oldest are dropped.
QUEUE_SIZE = 256
#: The memory series the page charts, as ``MemoryState`` fields.
SERIES = ("used", "total", "process_used", "allocated", "reserved")
#: Recorded events (not samples, not alerts) that ``/api/state`` returns.
EVENT_WINDOW = 100
ALERT_WINDOW = 50

_VENDORED = {"uPlot.iife.min.js", "uPlot.min.css"}
_OWN = {"dashboard.js", "dashboard.css"}
_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8"}
_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; connect-src 'self'; base-uri 'self'; form-action 'none'"
)
_STREAM_END = Event("_end", {})
#: The event kinds the page listens for by name; with ``?others=record``, the stream sends
#: the rest (events recorded with ``Monitor.record``) as ``event: record``.
_NAMED = frozenset({"sample", "alert", "guard", "leak"})


@cache
def _static(name: str) -> str:
    if name in _VENDORED:
        return static_file(name)
    return (resources.files("vramctl.server") / "static" / name).read_text("utf-8")


# -- the event hub: monitor thread -> each client's event loop ------------------------------


class _Hub:
    """The open event streams, so that a server can end them when it closes."""

    def __init__(self, monitor: Monitor) -> None:
        self.monitor = monitor
        self.closing = threading.Event()
        self.keepalive = KEEPALIVE_S
        self._lock = threading.Lock()
        self._clients: set[tuple[asyncio.AbstractEventLoop, asyncio.Queue[Event]]] = set()

    @property
    def clients(self) -> int:
        with self._lock:
            return len(self._clients)

    @staticmethod
    def _offer(queue: asyncio.Queue[Event], event: Event) -> None:
        """Runs on the client's loop: queue ``event``, dropping the oldest when full."""
        if queue.full():
            with contextlib.suppress(asyncio.QueueEmpty):
                queue.get_nowait()
        queue.put_nowait(event)

    @classmethod
    def _deliver(
        cls, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[Event], event: Event
    ) -> None:
        with contextlib.suppress(RuntimeError):  # the loop has closed: the client is gone
            loop.call_soon_threadsafe(cls._offer, queue, event)

    async def stream(self, others: str | None = None) -> AsyncIterator[str]:
        """One client's Server-Sent Events, until it disconnects or the server closes.

        ``others="record"`` sends events of kinds other than ``sample``, ``alert``,
        ``guard`` and ``leak`` as ``event: record``, ``data: {"kind", "timestamp",
        "data"}`` (as ``/api/state`` lists them): a browser's ``EventSource`` hears
        only the event names it listens for, and cannot know every kind in advance.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Event] = asyncio.Queue(QUEUE_SIZE)
        client = (loop, queue)
        remove = self.monitor.subscribe(lambda event: self._deliver(loop, queue, event))
        with self._lock:
            self._clients.add(client)
        try:
            yield "retry: 2000\n: connected\n\n"
            last = time.monotonic()
            poll = min(1.0, self.keepalive)
            while not self.closing.is_set():
                try:
                    event = await asyncio.wait_for(queue.get(), timeout=poll)
                except asyncio.TimeoutError:
                    if time.monotonic() - last >= self.keepalive:
                        last = time.monotonic()
                        yield ": keep-alive\n\n"
                    continue
                if event is _STREAM_END:
                    break
                last = time.monotonic()
                yield _sse(event, wrap=others == "record")
        finally:
            remove()
            with self._lock:
                self._clients.discard(client)

    def close(self) -> None:
        """End every open stream (the server is closing)."""
        self.closing.set()
        with self._lock:
            clients = list(self._clients)
        for loop, queue in clients:
            self._deliver(loop, queue, _STREAM_END)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _json(doc: Any) -> str:
    """JSON that a browser can parse: NaN and infinities (not JSON) become null."""
    try:
        return json.dumps(doc, default=str, allow_nan=False)
    except ValueError:
        return json.dumps(_finite(doc), default=str, allow_nan=False)


def _sse(event: Event, *, wrap: bool = False) -> str:
    if wrap and event.kind not in _NAMED:
        doc = {"kind": event.kind, "timestamp": event.timestamp, "data": event.data}
        return f"event: record\ndata: {_json(doc)}\n\n"
    data = _json({"timestamp": event.timestamp, **event.data})
    kind = "".join(c for c in event.kind if c.isprintable() and c not in "\r\n") or "message"
    return f"event: {kind}\ndata: {data}\n\n"


# -- state -------------------------------------------------------------------------------


def _value(v: object) -> object:
    return None if v is NA else v


def _simulated_note(dev: Any) -> str | None:
    """What a simulated GPU's figures are, for a reader who could take it for hardware."""
    if not dev.is_simulated:
        return None
    size = format_bytes(dev.capacity())
    spec = dev.spec
    where = (
        f"{size} is what a CUDA process sees of a {spec.name} (NVML reports "
        f"{format_bytes(spec.total_bytes)})"
        if spec is not None
        else f"{size} is the size it was given"
    )
    return (
        "A simulated GPU, no hardware: its memory in use is this process's count of the "
        f"tensors made inside its `with` block, 0 B while nothing runs there; {where}."
    )


def _device_state(monitor: Monitor, dev: Any) -> dict[str, Any]:
    latest = monitor.history.latest(dev.id)
    history = monitor.history.columns(dev.id, SERIES, last=HISTORY_WINDOW)
    return {
        "id": dev.id,
        "name": dev.name,
        "uuid": _value(dev.uuid),
        "kind": dev.kind,
        "simulated": dev.is_simulated,
        "note": _simulated_note(dev),
        "total": None if latest is None else _value(latest.memory.total),
        "latest": None if latest is None else latest.memory.to_dict(),
        "peak": monitor.history.peak(dev.id).to_dict(),
        "processes": [] if latest is None else [p.to_dict() for p in latest.processes],
        "history": history,
    }


def _state(monitor: Monitor, title: str = "vramctl", jobs: str | None = None) -> dict[str, Any]:
    """Everything the page shows, JSON-ready: devices with history, alerts, events, and
    where the job queue's summary is read (``jobs``), when the app serves one."""
    if not monitor.running and monitor.samples_taken == 0:
        monitor.sample()
    events = list(monitor.events)
    alerts = [{"timestamp": e.timestamp, **e.data} for e in events if e.kind == "alert"]
    alerts = alerts[-ALERT_WINDOW:]
    active = []
    for (rule, device), level in monitor.alerts.active().items():
        last: dict[str, Any] = next(
            (
                a
                for a in reversed(alerts)
                if a.get("rule") == rule and a.get("device") == device and not a.get("resolved")
            ),
            {},
        )
        active.append({**last, "rule": rule, "device": device, "level": level.name.lower()})
    return {
        "schema": "vramctl.dashboard/1",
        "title": title,
        "pid": os.getpid(),
        "time": time.time(),
        "running": monitor.running,
        "interval_s": monitor.interval,
        "samples": monitor.samples_taken,
        "sample_cost_s": round(monitor.overhead, 6),
        "window": HISTORY_WINDOW,
        "jobs": jobs,
        "devices": [_device_state(monitor, d) for d in monitor.devices],
        "alerts": alerts,
        "active_alerts": active,
        "events": [
            {"kind": e.kind, "timestamp": e.timestamp, "data": e.data}
            for e in events
            if e.kind not in ("alert", "sample")
        ][-EVENT_WINDOW:],
    }


# -- the app -----------------------------------------------------------------------------


class _Gate:
    """ASGI middleware that answers a request it does not allow with an error of its own."""

    status = 403
    detail = ""
    headers: dict[str, str] | None = None

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    def allowed(self, scope: Scope) -> bool:
        raise NotImplementedError

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or self.allowed(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        response = JSONResponse({"detail": self.detail}, self.status, headers=self.headers)
        await response(scope, receive, send)


class _TokenGate(_Gate):
    """Every request needs ``Authorization: Bearer TOKEN`` or ``?token=``."""

    status = 401
    detail = (
        "this vramctl server needs its token: open the URL it printed when it "
        "started (it ends in ?token=...), or send the header 'Authorization: Bearer TOKEN'"
    )
    headers = {"WWW-Authenticate": "Bearer"}  # noqa: RUF012 - read only

    def __init__(self, app: ASGIApp, token: str) -> None:
        super().__init__(app)
        self.token = token

    def allowed(self, scope: Scope) -> bool:
        headers = Headers(scope=scope)
        query = QueryParams(scope.get("query_string", b""))
        return token_ok(self.token, headers.get("authorization"), query.get("token"))


class _HostGate(_Gate):
    """For a server on loopback without a token: only this machine's names.

    A page on another site that points a name of its own at 127.0.0.1 (DNS rebinding)
    would otherwise read the API from the user's browser; its requests carry that name
    as their ``Host``, and are answered 403.
    """

    detail = (
        "this vramctl server answers only requests addressed to 127.0.0.1 or "
        "localhost; to serve it under another name, give it a token (--token)"
    )

    def __init__(self, app: ASGIApp, bound: str) -> None:
        super().__init__(app)
        self.bound = bound

    def allowed(self, scope: Scope) -> bool:
        return host_allowed(Headers(scope=scope).get("host"), self.bound)


def _page(title: str, token: str | None) -> str:
    query = f"?token={quote(token, safe='')}" if token else ""
    return (
        _static("dashboard.html")
        .replace("{{title}}", html.escape(title))
        .replace("{{token}}", html.escape(token or ""))
        .replace("{{query}}", html.escape(query))
    )


class _DashboardRouter(APIRouter):
    def __init__(self, hub: _Hub) -> None:
        super().__init__()
        self.hub = hub


def dashboard_router(monitor: Monitor, *, title: str = "vramctl") -> APIRouter:
    """The dashboard's routes, to include in an app of your own.

    ``/`` (the page), ``/static/{name}``, ``/api/state``, ``/api/stream`` (events),
    ``/metrics`` (Prometheus) and ``/healthz``. The token check is the app's: see
    :func:`create_app`. The page reads its token from ``?token=`` (or from the
    app's ``vramctl_token`` state) and passes it on to the API. Where the app's
    ``vramctl_jobs_status`` state names the job queue's summary (``"workers/status"``,
    as ``vramctl serve`` sets it), the page shows its jobs view too.
    """
    return _router(monitor, title)


def _router(monitor: Monitor, title: str) -> _DashboardRouter:
    hub = _Hub(monitor)
    router = _DashboardRouter(hub)

    @router.get("/", response_class=HTMLResponse, include_in_schema=False)
    def page(request: Request) -> HTMLResponse:
        token = getattr(request.app.state, "vramctl_token", None)
        return HTMLResponse(
            _page(title, token),
            headers={"Content-Security-Policy": _CSP, "Cache-Control": "no-store"},
        )

    @router.get("/static/{name}", include_in_schema=False)
    def static(name: str) -> Response:
        if name not in _VENDORED | _OWN:
            return PlainTextResponse(f"no static file {name!r}", status_code=404)
        kind = _TYPES[os.path.splitext(name)[1]]
        return Response(_static(name), media_type=kind, headers={"Cache-Control": "no-cache"})

    @router.get("/api/state")
    def api_state(request: Request) -> Response:
        """Devices with their recent history, peaks and processes; alerts; events; and
        ``jobs``, the address of the job queue's summary when the app serves the queue
        (the page then shows its jobs view), else null."""
        jobs = getattr(request.app.state, "vramctl_jobs_status", None)
        return Response(
            _json(_state(monitor, title, jobs)),
            media_type="application/json",
            headers={"Cache-Control": "no-store"},
        )

    @router.get(
        "/api/stream",
        response_class=StreamingResponse,
        responses={200: {"content": {"text/event-stream": {}}}},
    )
    def api_stream(others: str | None = None) -> StreamingResponse:
        """Server-Sent Events: ``sample``, ``alert``, ``guard``, ``leak`` and recorded events.

        ``?others=record`` sends the recorded events as ``event: record`` (see
        :meth:`_Hub.stream`): the page asks for it.
        """
        return StreamingResponse(
            hub.stream(others),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )

    @router.get(
        "/metrics",
        response_class=PlainTextResponse,
        responses={200: {"content": {"text/plain": {}}}},
    )
    def metrics(request: Request) -> PlainTextResponse:
        """The monitor's metrics in Prometheus's text format (and those of the collectors
        in the app's ``vramctl_collectors`` state: the job service's)."""
        from vramctl.monitor._shared import metrics_text

        extra = getattr(request.app.state, "vramctl_collectors", ())
        return PlainTextResponse(
            metrics_text(monitor, extra), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    @router.get("/healthz")
    def healthz() -> dict[str, Any]:
        """Liveness: whether the monitor is sampling, and how many samples it took."""
        return {"ok": True, "monitor_running": monitor.running, "samples": monitor.samples_taken}

    return router


def create_app(
    monitor: Monitor,
    *,
    token: str | None = None,
    title: str = "vramctl",
    routers: Iterable[APIRouter] = (),
    configure: Callable[[FastAPI], None] | None = None,
    openapi: bool = False,
) -> FastAPI:
    """The dashboard as a FastAPI app; ``routers`` adds routes of your own, and
    ``configure(app)`` anything else (error handlers); ``openapi`` serves the schema at
    ``/openapi.json``.

    With a ``token``, every route (yours included) needs ``Authorization: Bearer
    TOKEN`` or ``?token=TOKEN`` and answers 401 otherwise. The app does not start
    the monitor: start it, or use :func:`serve_dashboard`.
    """
    app = FastAPI(
        title=title,
        version=__version__,
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json" if openapi else None,
    )
    router = _router(monitor, title)
    app.include_router(router)
    for extra in routers:
        app.include_router(extra)
    app.state.vramctl_monitor = monitor
    app.state.vramctl_token = token or None
    app.state.vramctl_hub = router.hub
    if configure is not None:
        configure(app)
    if token:
        app.add_middleware(_TokenGate, token=token)
    return app


# -- serving -----------------------------------------------------------------------------

#: Seconds a client has to send a whole request (line, headers and body) from the
#: connection's start, or from the end of the previous response on a kept-alive one.
REQUEST_TIMEOUT_S = 30.0


class _TimedH11(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline on each request: a connection whose
    client has not sent its whole request within :attr:`request_timeout` s (of the
    connection's start, or of the previous response's end) is closed. uvicorn times only a
    connection idle after a response: one that sent nothing, half a request line, half its
    headers or part of its body was held for good. Once a request is in, its answer is not
    timed (a followed log or an event stream lasts as long as it lasts)."""

    request_timeout = REQUEST_TIMEOUT_S
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        if not self.transport.is_closing():
            self._deadline = self.loop.call_later(self.request_timeout, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.transport.is_closing() or self.transport.get_protocol() is not self:
            return  # closed already, or upgraded (a websocket)
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY):  # still waiting for the client
            self.transport.close()


def _timed_protocol(timeout: float) -> type[asyncio.Protocol]:
    """:class:`_TimedH11` with ``timeout``."""
    return type("_TimedH11", (_TimedH11,), {"request_timeout": float(timeout)})


class DashboardServer:
    """A dashboard served on a daemon thread; :meth:`close` (or ``with``) stops it."""

    def __init__(
        self,
        app: FastAPI,
        server: uvicorn.Server,
        thread: threading.Thread,
        host: str,
        port: int,
        token: str | None,
        owns_monitor: bool,
    ) -> None:
        self.app = app
        self.host = host
        self.port = port
        self.token = token
        self._server = server
        self._thread = thread
        self._owns_monitor = owns_monitor

    @property
    def url(self) -> str:
        """The page's address, without the token."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    @property
    def page_url(self) -> str:
        """The address to open: :attr:`url`, with ``?token=`` when a token is required."""
        return self.url + (f"?token={quote(self.token, safe='')}" if self.token else "")

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout: float = 5.0) -> None:
        """End the event streams, stop the server, and stop the monitor if it started it."""
        hub: _Hub = self.app.state.vramctl_hub
        hub.close()
        self._server.should_exit = True
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._server.force_exit = True
            self._thread.join(timeout)
        if self._owns_monitor:
            self.app.state.vramctl_monitor.stop()

    def __enter__(self) -> DashboardServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"DashboardServer({self.url!r}, token={'yes' if self.token else 'no'})"


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise AddressError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}; choose another port"
        ) from None
    return sock


def serve_dashboard(
    monitor: Monitor,
    host: str = "127.0.0.1",
    port: int = 8765,
    *,
    token: str | None = None,
    title: str = "vramctl",
    routers: Sequence[APIRouter] = (),
    configure: Callable[[FastAPI], None] | None = None,
    openapi: bool = False,
    timeout: float = 10.0,
    request_timeout: float = REQUEST_TIMEOUT_S,
) -> DashboardServer:
    """Serve the dashboard at ``http://HOST:PORT/`` on a daemon thread; returns the server.

    Binds to 127.0.0.1 by default; any other address needs ``token`` (or
    ``$VRAMCTL_TOKEN``). Without a token it answers only requests addressed to
    ``localhost`` or a loopback address (``Host``), so that no web site can read it
    through DNS rebinding. A port in use is an :class:`~vramctl.monitor.AddressError`
    at once. ``port=0`` picks a free port (see :attr:`DashboardServer.port`).
    Starts ``monitor`` if it is not running (and stops it again on close).
    ``routers``, ``configure`` and ``openapi`` are :func:`create_app`'s.
    ``request_timeout``: the seconds a client has to send a whole request (from the
    connection's start, or the previous response's end) before its connection is closed;
    a kept-alive connection idle that long (or 5 s, whichever is less) is closed too.
    """
    if not request_timeout > 0:
        raise ValueError(f"request_timeout must be positive, got {request_timeout!r}")
    required = check_bind(host, port, token)
    app = create_app(
        monitor,
        token=required,
        title=title,
        routers=routers,
        configure=configure,
        openapi=openapi,
    )
    if required is None:  # on loopback: answer this machine's names only (DNS rebinding)
        app.add_middleware(_HostGate, bound=host)
    sock = _listen(host, port)
    real_port = int(sock.getsockname()[1])
    config = uvicorn.Config(
        app,
        # The h11 protocol always (not httptools where it is installed), with a deadline
        # on each request (uvicorn has none for a request half sent).
        http=_timed_protocol(request_timeout),
        log_level="warning",
        lifespan="off",
        timeout_graceful_shutdown=3,
        access_log=False,
    )
    server = uvicorn.Server(config)
    failure: list[BaseException] = []

    def run() -> None:
        try:
            server.run(sockets=[sock])
        except BaseException as exc:  # reported by serve_dashboard, or logged once it runs
            failure.append(exc)
            if server.started:
                log.exception("the dashboard server stopped")
        finally:
            sock.close()

    owns_monitor = not monitor.running
    monitor.start()
    thread = threading.Thread(target=run, name="vramctl-dashboard", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    if not server.started:
        server.should_exit = True
        thread.join(2)
        if owns_monitor:
            monitor.stop()
        reason = f": {failure[0]}" if failure else f" within {timeout:g} s"
        raise AddressError(f"the dashboard server on {host}:{real_port} did not start{reason}")
    return DashboardServer(app, server, thread, host, real_port, required, owns_monitor)
