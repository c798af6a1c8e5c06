"""The job service's HTTP API: the queue of :mod:`vramctl.jobs` over HTTP.

:func:`jobs_router` serves ``POST /jobs``, ``GET /jobs``, ``GET /jobs/{id}``,
``DELETE /jobs/{id}``, ``GET /jobs/{id}/logs``, ``GET /workers/status`` and
``GET /health`` for one job store; ``vramctl serve`` mounts it on the dashboard's app.
A route's ``{id}`` is a job's id or a prefix of it that names one job (4 characters or
more, as git takes a short hash): one that names several is a 400 that lists them.

A job is a command run as the service's user, so the routes that submit, cancel or read a
job's log need the service's token on every address, loopback included (any local user
can reach 127.0.0.1): :func:`service_token` creates it once in a ``0600`` file under
``$VRAMCTL_HOME``, where the CLI finds it. Every error is JSON, ``{"error": message}``
(with ``"problems"`` for a spec), and a 4xx status.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from vramctl._auth import TOKEN_FILE, find_token, token_ok
from vramctl._errors import VramctlError
from vramctl.device import Device
from vramctl.jobs import (
    ACTIVE,
    STATES,
    EstimateWorker,
    Job,
    JobSpec,
    JobSpecError,
    JobStore,
    JobStoreError,
    Settings,
    check_placeable,
    vramctl_home,
)
from vramctl.jobs._shared import device_capacity as capacity_of

log = logging.getLogger("vramctl.server")

__all__ = [
    "TOKEN_FILE",
    "ApiError",
    "JobService",
    "install_error_handlers",
    "jobs_router",
    "service_token",
]

#: The most jobs ``GET /jobs`` returns at once, and ``GET /workers/status`` lists queued.
MAX_PAGE = 1000
#: How many queued jobs ``GET /workers/status`` lists when not told (``limit``).
PENDING_PAGE = 100
#: How often a followed log is read for more (seconds).
FOLLOW_POLL_S = 0.2
#: ``state`` of ``GET /jobs``: states, comma-separated.
_STATES_PATTERN = "^({s})(,({s}))*$".format(s="|".join(STATES))
#: The largest job spec body accepted (bytes).
MAX_BODY = 1 << 20
#: The states ``GET /workers/status`` lists as failures.
FAILED = ("failed", "timed-out")
#: How many of the latest failures ``GET /workers/status`` lists.
RECENT_FAILURES = 20
#: How long ``GET /health`` waits for the store's write lock (seconds).
HEALTH_STORE_TIMEOUT = 1.0
#: ``Retry-After`` (seconds) of a 503 for a store that cannot be used now.
RETRY_AFTER_S = 5


class ApiError(VramctlError):
    """A request the service refuses: its HTTP status and a message (and problems)."""

    def __init__(self, status: int, message: str, problems: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.problems = list(problems)

    def response(self) -> JSONResponse:
        body: dict[str, Any] = {"error": self.message}
        if self.problems:
            body["problems"] = self.problems
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(body, self.status, headers=headers)


def service_token(
    home: str | os.PathLike[str] | None = None, *, token_file: str | os.PathLike[str] | None = None
) -> str:
    """The service's token: ``$VRAMCTL_TOKEN``, else the file ``token_file``, else
    ``$VRAMCTL_HOME/token``, created (random, mode 0600) when it does not exist yet."""
    found = find_token(token_file=token_file, home=home or vramctl_home(), create=True)
    assert found is not None  # create: a token, or an error
    return found


def _job_json(job: Job) -> dict[str, Any]:
    return job.to_dict()


class JobService:
    """What the routes share: the store (one connection per thread: SQLite connections
    are not shared between threads), the devices jobs may run on, the settings, the
    token and the scheduler's heartbeat."""

    def __init__(
        self,
        store: str | os.PathLike[str],
        devices: Sequence[Device],
        *,
        token: str,
        settings: Settings | None = None,
        scheduler_alive: Callable[[], bool] | None = None,
        estimator: EstimateWorker | None = None,
    ) -> None:
        self.path = Path(store)
        self.devices = list(devices)
        self.token = token
        self.settings = settings
        self.scheduler_alive = scheduler_alive
        #: Prices a spec's estimate at submission in a process of its own (None: here).
        self.estimator = estimator
        self._local = threading.local()
        #: Each queued job's need by ``(id, attempts)``, as :meth:`_pending_bytes` last read.
        self._needs: dict[tuple[str, int], int | None] = {}
        _ = self.store  # opened now: a bad path is an error at start, not at a request

    @property
    def store(self) -> JobStore:
        got: JobStore | None = getattr(self._local, "store", None)
        if got is None:
            got = self._local.store = JobStore(self.path)
        return got

    def check_token(self, request: Request) -> None:
        if not token_ok(self.token, request.headers.get("authorization")):
            raise ApiError(
                401,
                "this route needs the service's token, on loopback too: send "
                "'Authorization: Bearer TOKEN' (the token is in $VRAMCTL_HOME/token)",
            )

    # -- submitting --------------------------------------------------------------------

    def spec_of(self, body: bytes) -> JobSpec:
        if len(body) > MAX_BODY:
            raise ApiError(413, f"a job spec is at most {MAX_BODY} bytes")
        try:
            doc = json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"the body is not JSON: {exc}") from None
        except RecursionError:
            raise ApiError(400, "the body is nested too deeply to be a job spec") from None
        if not isinstance(doc, dict):
            raise ApiError(422, "a job spec is a JSON object", ["(body): not an object"])
        try:
            spec = JobSpec.from_dict(doc)
        except JobSpecError as exc:
            raise ApiError(422, exc.what, exc.problems) from None
        if self.settings is not None:
            spec = self.settings.apply(spec)
        problems = self._run_problems(spec)
        if problems:
            raise ApiError(422, "the job cannot run here", problems)
        learned = self.store.learned_peak(spec.name) if spec.memory.kind == "learned" else None
        margin = self.settings.margin if self.settings is not None else 0.0
        try:
            check_placeable(
                spec,
                self.devices,
                learned_peak=learned,
                margin=margin,
                estimator=self.estimator,
            )
        except JobSpecError as exc:
            raise ApiError(422, str(exc)) from None  # one line: what, need and largest device
        return spec

    def _run_problems(self, spec: JobSpec) -> list[str]:
        """What would stop the job's process from starting: its program and its folder."""
        problems = []
        if spec.devices.count > 1:
            # The scheduler would fail it too: one job, one device, one reservation.
            problems.append(
                f"devices.count: {spec.devices.count} devices at once cannot be placed here;"
                " a job runs on one device (run one job per device)"
            )
        cwd = Path(spec.cwd) if spec.cwd else None
        if cwd is not None and not cwd.is_dir():
            problems.append(f"cwd: {spec.cwd!r} is not an existing folder on the server")
        if spec.command:
            program = spec.command[0]
            where = os.path.join(spec.cwd or os.getcwd(), program)
            found = (
                os.path.isfile(where) and os.access(where, os.X_OK)
                if os.sep in program
                else shutil.which(program, path=spec.env.get("PATH")) is not None
            )
            if not found:
                problems.append(
                    f"command: {program!r} is not a program found on the server"
                    + ("" if os.sep in program else " (not on its PATH)")
                )
        return problems

    def submit(self, spec: JobSpec) -> Job:
        """Queue ``spec`` (call it on the thread that uses the store: each has its own)."""
        return self.store.submit(spec)

    def job(self, job_id: str) -> Job:
        """The job ``job_id`` or the one whose id starts with it (4 characters or more)."""
        try:
            return self.store.get(job_id)
        except JobStoreError as exc:
            if exc.matches:  # a prefix of several ids: the message lists them
                raise ApiError(400, str(exc)) from None
            raise ApiError(404, f"no job {job_id!r}") from None

    def log_path(self, job: Job) -> Path | None:
        """The job's log, only where it lies under the store's log folder."""
        if not job.log_path:
            return None
        path = Path(job.log_path).resolve()
        logs = self.store.logs_dir.resolve()
        if not path.is_relative_to(logs):
            raise ApiError(403, f"job {job.id}'s log is outside the store's log folder")
        return path

    # -- status ------------------------------------------------------------------------

    def workers(self, limit: int = PENDING_PAGE, offset: int = 0) -> dict[str, Any]:
        """Seed 001's summary: active and pending jobs, allocated and pending bytes; and
        for the dashboard's jobs view, a page of the queued jobs (``limit`` from
        ``offset``, in submission order) with each one's priority and submission, and the
        jobs that failed or timed out last, with their reasons. No command, environment
        or log: the route is open on loopback.

        The page alone is read from the store (a poll once read and sent the whole queue);
        the queue's count and bytes come from its keys and :meth:`_pending_bytes`."""
        active = self.store.list(ACTIVE)
        queue = self.store.keys(["queued"])
        page = self.store.list(["queued"], limit=limit, offset=offset)
        counts = self.store.counts()
        devices = []
        for dev in self.devices:
            held = [j for j in active if j.device == dev.id]
            devices.append(
                {
                    "id": dev.id,
                    "name": dev.name,
                    "capacity_bytes": capacity_of(dev),
                    "allocated_bytes": sum(j.reserved_bytes or 0 for j in held),
                    "jobs": [j.id for j in held],
                }
            )
        pending = [
            {
                "id": job.id,
                "name": job.name,
                "need_bytes": _pending_need(job),
                "need_kind": job.spec.memory.kind,
                "priority": job.priority,
                "submitted_at": job.submitted_at,
                "attempts": job.attempts,
                "reason": job.reason,
            }
            for job in page
        ]
        end = offset + len(page)
        return {
            "time": time.time(),
            "active_jobs": len(active),
            "pending_jobs": len(queue),
            "failed_jobs": sum(counts[s] for s in FAILED),
            "allocated_bytes": sum(j.reserved_bytes or 0 for j in active),
            "pending_bytes": self._pending_bytes(queue),
            "devices": devices,
            "active": [_summary(j) for j in active],
            "pending": pending,
            "pending_offset": offset,
            "pending_next_offset": end if page and end < len(queue) else None,
            "recent_failures": [_failure(j) for j in self.store.latest(FAILED, RECENT_FAILURES)],
        }

    def _pending_bytes(self, queue: Sequence[tuple[str, int, int, float, int]]) -> int:
        """What the queued jobs (``queue``: the store's keys) need in all. A job's need
        changes only when an overrun queues it again, a new attempt: each ``(id,
        attempts)`` is read from the store once and its need kept for the next polls (a
        poll reads the rows of the jobs queued since the last, not the whole queue's)."""
        known = self._needs
        keys = [(job_id, attempts) for job_id, attempts, *_ in queue]
        fresh = {
            (job.id, job.attempts): _pending_need(job)
            for job in self.store.get_many([k[0] for k in keys if k not in known])
            if job.state == "queued"
        }
        # Replaced, not changed in place: routes run on several threads. A job gone, or
        # queued again, since the keys were read is left for the next poll.
        self._needs = {
            k: known[k] if k in known else fresh[k] for k in keys if k in known or k in fresh
        }
        return sum(need or 0 for need in self._needs.values())

    def store_writable(self, timeout: float | None = None) -> None:
        """Take the store's write lock and let it go, on a connection of its own, within
        ``timeout`` s (:data:`HEALTH_STORE_TIMEOUT`); :class:`sqlite3.OperationalError`
        when another process holds it longer: submissions would wait for it, then fail.
        A read alone misses that (readers go on beside a writer in WAL mode)."""
        wait = HEALTH_STORE_TIMEOUT if timeout is None else timeout
        uri = f"{self.path.absolute().as_uri()}?mode=rw"  # never makes a missing store
        conn = sqlite3.connect(uri, uri=True, timeout=wait, isolation_level=None)
        try:
            try:
                conn.execute("BEGIN IMMEDIATE")
            except sqlite3.OperationalError as exc:
                raise sqlite3.OperationalError(
                    f"cannot take its write lock within {wait:g} s ({exc}): another process"
                    " holds it; submissions wait for it, then fail"
                ) from None
            conn.execute("ROLLBACK")
        finally:
            conn.close()

    def health(self) -> tuple[bool, list[str]]:
        reasons = []
        try:
            self.store.counts()
            self.store_writable()
        except sqlite3.Error as exc:
            reasons.append(f"store: {exc}")
        if not self.devices:
            reasons.append("devices: none to run jobs on")
        for dev in self.devices:
            if not dev.health.state.usable:
                why = f": {dev.health.reason}" if dev.health.reason else ""
                reasons.append(f"device {dev.id}: {dev.health.state}{why}")
        if self.scheduler_alive is not None and not self.scheduler_alive():
            reasons.append("scheduler: its loop is not running")
        return not reasons, reasons


def _pending_need(job: Job) -> int | None:
    """A queued job's need in bytes: its spec's size (None for an estimated or learned
    need), or at least what it used where it overran its share."""
    need = job.spec.memory.size
    if job.need_bytes is not None:
        need = max(need or 0, job.need_bytes)
    return need


def _summary(job: Job) -> dict[str, Any]:
    return {
        "id": job.id,
        "name": job.name,
        "state": job.state,
        "device": job.device,
        "reserved_bytes": job.reserved_bytes,
        "admitted_at": job.admitted_at,
        "started_at": job.started_at,
    }


def _failure(job: Job) -> dict[str, Any]:
    return {
        "id": job.id,
        "name": job.name,
        "state": job.state,
        "device": job.device,
        "reason": job.reason,
        "exit_code": job.exit_code,
        "attempts": job.attempts,
        "finished_at": job.finished_at,
    }


#: A log is sent in pieces of this size: the server holds one piece at a time, whatever the
#: log's size (a whole 300 MiB log read at once took the server from 260 to 1,444 MiB).
LOG_CHUNK = 1 << 20


def _pieces(path: Path | None, offset: int = 0) -> Iterator[bytes]:
    """What the log holds from ``offset`` on now, a piece at a time."""
    if path is None:
        return
    try:
        f = path.open("rb")
    except FileNotFoundError:
        return
    with f:
        f.seek(offset)
        while piece := f.read(LOG_CHUNK):
            yield piece


async def _follow(service: JobService, job_id: str, path: Path | None) -> AsyncIterator[bytes]:
    """The log from its start, then what is written to it until the job ends."""
    offset = 0
    while True:
        job = await asyncio.to_thread(service.job, job_id)
        pieces = _pieces(path, offset)
        while piece := await asyncio.to_thread(next, pieces, b""):
            offset += len(piece)
            yield piece
        if job.finished:
            return
        await asyncio.sleep(FOLLOW_POLL_S)


def jobs_router(service: JobService) -> APIRouter:
    """The queue's routes (see the module) for ``service``."""
    router = APIRouter()

    @router.post(
        "/jobs",
        status_code=201,
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": JOB_SPEC_SCHEMA}},
            }
        },
        responses=_ERRORS,
    )
    async def submit(request: Request) -> JSONResponse:
        """Queue a job: its spec as JSON (see docs/jobs.md). Needs the token."""
        service.check_token(request)
        try:
            body = await request.body()
        except ClientDisconnect:  # gone, or closed for sending too slowly: no one to answer
            raise ApiError(408, "the request's body did not arrive whole") from None
        spec = await asyncio.to_thread(service.spec_of, body)
        job = await asyncio.to_thread(service.submit, spec)
        return JSONResponse(_job_json(job), 201, headers={"Location": f"/jobs/{job.id}"})

    @router.get("/jobs", responses=_ERRORS)
    def list_jobs(
        request: Request,
        state: Annotated[str | None, Query(pattern=_STATES_PATTERN)] = None,
        label: str | None = None,
        limit: Annotated[int | None, Query(ge=1, le=MAX_PAGE)] = None,
        offset: Annotated[int, Query(ge=0)] = 0,
    ) -> dict[str, Any]:
        """Jobs in submission order: ``state`` (comma-separated), ``label`` (KEY or
        KEY=VALUE), ``limit`` (at most 1000) and ``offset``. Needs the token (a job's
        spec holds its command and environment)."""
        service.check_token(request)
        states = None if state is None else [s.strip() for s in state.split(",") if s.strip()]
        bad = [s for s in states or [] if s not in STATES]
        if bad:
            raise ApiError(422, f"state: unknown {bad[0]!r}; states: {', '.join(STATES)}")
        n, start = (MAX_PAGE if limit is None else limit), offset
        # The page alone is read and decoded (in SQL, by seq): 50,000 jobs read whole for
        # one of them took 3.3-3.9 s.
        jobs = service.store.list(states, label=label, limit=n, offset=start)
        return {
            "total": service.store.count(states, label=label),
            "offset": start,
            "jobs": [_job_json(j) for j in jobs],
        }

    @router.get("/jobs/{job_id}", responses=_ERRORS)
    def get_job(job_id: str, request: Request) -> dict[str, Any]:
        """One job: its spec, state, device, reservation, batch, exit status, peak.
        ``job_id``: the id, or a prefix of it that names one job (4 characters or more).
        Needs the token (the spec holds its command and environment)."""
        service.check_token(request)
        return _job_json(service.job(job_id))

    @router.delete("/jobs/{job_id}", responses=_ERRORS)
    def cancel_job(job_id: str, request: Request) -> dict[str, Any]:
        """Cancel a job: a queued one at once, a running one through its supervisor.
        Needs the token."""
        service.check_token(request)
        return _job_json(service.store.cancel(service.job(job_id).id))

    @router.get(
        "/jobs/{job_id}/logs",
        responses={**_ERRORS, 200: {"content": {"text/plain": {}}}},
        response_class=StreamingResponse,
    )
    def job_logs(job_id: str, request: Request, follow: bool = False) -> StreamingResponse:
        """The job's output; ``follow=true`` streams it until the job ends. Needs the
        token."""
        service.check_token(request)
        job = service.job(job_id)
        path = service.log_path(job)
        if follow:
            stream: Any = _follow(service, job.id, path)
        else:
            stream = _pieces(path)
        return StreamingResponse(
            stream, media_type="text/plain; charset=utf-8", headers={"Cache-Control": "no-store"}
        )

    @router.get(
        "/workers/status",
        response_model=None,
        responses={
            200: {
                "description": "the queue's summary",
                "content": {"application/json": {"schema": WORKERS_SCHEMA}},
            },
            422: _ERRORS[422],  # a bad page, as GET /jobs answers it
        },
    )
    def workers_status(
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = PENDING_PAGE,
        offset: Annotated[int, Query(ge=0)] = 0,
    ) -> dict[str, Any]:
        """Active and pending jobs, and the bytes allocated and pending, per device; the
        latest jobs that failed or timed out, with their reasons. ``pending`` is a page of
        the queue: ``limit`` jobs (100 unless told, at most 1000) from ``offset``;
        ``pending_jobs`` counts them all and ``pending_next_offset`` is the next page's
        offset (null after the last). No command, environment or log (open on loopback)."""
        return service.workers(limit, offset)

    @router.get("/health", responses={503: {"description": "degraded"}})
    def health() -> JSONResponse:
        """``ok``, or ``degraded`` (503) with the reasons: the store (read, and its write
        lock taken within a second), the devices, the scheduler's loop; ``Retry-After``
        when the store is the reason."""
        ok, reasons = service.health()
        body = {"status": "ok" if ok else "degraded", "reasons": reasons, "time": time.time()}
        store_down = any(r.startswith("store:") for r in reasons)
        headers = {"Retry-After": str(RETRY_AFTER_S)} if store_down else None
        return JSONResponse(body, 200 if ok else 503, headers=headers)

    return router


_ERROR_SCHEMA = {
    "type": "object",
    "properties": {
        "error": {"type": "string"},
        "problems": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["error"],
}
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"description": text, "content": {"application/json": {"schema": _ERROR_SCHEMA}}}
    for code, text in (
        (400, "malformed request"),
        (401, "no token, or a wrong one"),
        (403, "refused"),
        (404, "no such job"),
        (413, "body too large"),
        (422, "invalid request"),
    )
}

_NUM = {"type": "number"}
_INT = {"type": "integer"}
_OPT_INT = {"type": ["integer", "null"]}
_OPT_NUM = {"type": ["number", "null"]}
_OPT_STR = {"type": ["string", "null"]}
_STR = {"type": "string"}


def _object(properties: dict[str, Any]) -> dict[str, Any]:
    """An object schema whose every property is always there."""
    return {"type": "object", "properties": properties, "required": list(properties)}


def _list_of(properties: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return {"type": "array", "items": _object(properties), **kw}


#: ``GET /workers/status``'s answer.
WORKERS_SCHEMA: dict[str, Any] = _object(
    {
        "time": _NUM,
        "active_jobs": _INT,
        "pending_jobs": _INT,
        "failed_jobs": _INT,
        "allocated_bytes": _INT,
        "pending_bytes": _INT,
        "devices": _list_of(
            {
                "id": _STR,
                "name": _STR,
                "capacity_bytes": _INT,
                "allocated_bytes": _INT,
                "jobs": {"type": "array", "items": _STR},
            }
        ),
        "active": _list_of(
            {
                "id": _STR,
                "name": _STR,
                "state": {"enum": list(ACTIVE)},
                "device": _OPT_STR,
                "reserved_bytes": _OPT_INT,
                "admitted_at": _OPT_NUM,
                "started_at": _OPT_NUM,
            }
        ),
        "pending": _list_of(
            {
                "id": _STR,
                "name": _STR,
                "need_bytes": _OPT_INT,
                "need_kind": {"enum": ["size", "estimate", "learned"]},
                "priority": _INT,
                "submitted_at": _NUM,
                "attempts": _INT,
                "reason": _OPT_STR,
            },
            maxItems=MAX_PAGE,
        ),
        "pending_offset": _INT,
        "pending_next_offset": _OPT_INT,
        "recent_failures": _list_of(
            {
                "id": _STR,
                "name": _STR,
                "state": {"enum": list(FAILED)},
                "device": _OPT_STR,
                "reason": _OPT_STR,
                "exit_code": _OPT_INT,
                "attempts": _INT,
                "finished_at": _OPT_NUM,
            },
            maxItems=RECENT_FAILURES,
        ),
    }
)

#: The job spec as JSON Schema, for the OpenAPI document (the spec's own checks decide).
JOB_SPEC_SCHEMA: dict[str, Any] = JobSpec.json_schema()


def install_error_handlers(app: FastAPI) -> None:
    """Every error as JSON ``{"error": ...}`` with its 4xx status: the service's own,
    FastAPI's validation errors (422) and unknown routes (404)."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = [
            f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg', 'invalid')}"
            for e in exc.errors()
        ]
        return ApiError(422, "invalid request", problems).response()

    @app.exception_handler(sqlite3.Error)
    async def store_unavailable(request: Request, exc: sqlite3.Error) -> JSONResponse:
        # A store locked by another process past the busy timeout, or damaged pages: the
        # service cannot answer now, and says why (it once sent a plain-text 500).
        log.warning("the job store failed a request: %s", exc)
        response = ApiError(503, f"the job store is unavailable: {exc}").response()
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
        return response

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        response = ApiError(exc.status_code, str(exc.detail)).response()
        response.headers.update(exc.headers or {})
        if exc.status_code == 405:
            # Every method the path has (Starlette names only its first route's).
            response.headers["Allow"] = ", ".join(sorted(_methods(app, request.url.path)))
        return response


#: The methods a 405's ``Allow`` may name.
_HTTP_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def _methods(app: FastAPI, path: str) -> set[str]:
    """The methods some route of the app takes at ``path``: each asked of the app's routes
    as a request would be (FastAPI's included routers are not flat ``Route`` objects; read
    as such, every 405's ``Allow`` was empty)."""
    from starlette.routing import Match

    def taken(method: str) -> bool:
        scope = {"type": "http", "path": path, "method": method, "root_path": "", "headers": []}
        return any(route.matches(dict(scope))[0] == Match.FULL for route in app.routes)

    return {m for m in _HTTP_METHODS if taken(m)}
