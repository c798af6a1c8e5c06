"""The job service against slow clients, a large store and a locked one, and wrong methods:
a real uvicorn server on 127.0.0.1, real sockets, a real second SQLite connection."""

from __future__ import annotations

import json
import socket
import sqlite3
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import vramctl.jobs._store as store_module
from tests.server._service import job_service
from vramctl.jobs import JobSpec, JobStore, MemoryNeed
from vramctl.server import JobServer, serve_jobs

#: The fixture server's request timeout (seconds): short, so that the tests wait little.
TIMEOUT = 1.0
TOKEN = "t0ken-for-the-hardening-tests"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JobServer]:
    home = tmp_path_factory.mktemp("home")
    with job_service(home, token=TOKEN, request_timeout=TIMEOUT) as srv:
        yield srv


def call(
    method: str, url: str, *, token: str | None = TOKEN, body: bytes | None = None
) -> tuple[int, Any, Any]:
    """(status, headers, the JSON body or the text)."""
    req = urllib.request.Request(url, data=body, method=method)
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            status, headers, text = resp.status, resp.headers, resp.read().decode()
    except urllib.error.HTTPError as exc:
        status, headers, text = exc.code, exc.headers, exc.read().decode()
    try:
        return status, headers, json.loads(text)
    except ValueError:
        return status, headers, text


# -- slow clients ---------------------------------------------------------------------------

#: What a slow client sends, then nothing more (``{host}`` is the server's address).
PARTIAL = {
    "nothing": b"",
    "half a request line": b"GET /hea",
    "half the headers": b"GET /health HTTP/1.1\r\nHost: {host}\r\nAccept: */",
    "part of a body": (
        b"POST /jobs HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer "
        + TOKEN.encode()
        + b'\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"name": '
    ),
}


def open_slow(server: JobServer, what: bytes) -> socket.socket:
    host = f"127.0.0.1:{server.dashboard.port}".encode()
    sock = socket.create_connection(("127.0.0.1", server.dashboard.port), timeout=10)
    if what:
        sock.sendall(what.replace(b"{host}", host))
    return sock


def closed_after(sock: socket.socket, start: float, limit: float) -> float | None:
    """Seconds from ``start`` until the server closed ``sock`` (what it sent is read and
    dropped), or None if it was still open ``limit`` s after ``start``."""
    while True:
        left = start + limit - time.monotonic()
        if left <= 0:
            return None
        sock.settimeout(left)
        try:
            piece = sock.recv(65536)
        except TimeoutError:
            return None
        except ConnectionResetError:
            piece = b""
        if not piece:
            return time.monotonic() - start


def still_open(sock: socket.socket) -> bool:
    """Whether the server has not closed ``sock`` (nothing is waiting to be read)."""
    sock.setblocking(False)
    try:
        return bool(sock.recv(1, socket.MSG_PEEK)) or False
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        sock.setblocking(True)


def test_half_sent_requests_are_closed_after_the_timeout_while_others_are_answered(
    server: JobServer,
) -> None:
    start = time.monotonic()
    socks = {name: open_slow(server, what) for name, what in PARTIAL.items()}
    try:
        status, _, health = call("GET", f"{server.url}health", token=None)
        assert status == 200 and health["status"] == "ok"
        assert time.monotonic() - start < TIMEOUT  # answered while they hang
        for name, sock in socks.items():
            took = closed_after(sock, start, TIMEOUT + 5)
            assert took is not None, f"{name}: still open {TIMEOUT + 5:g} s on"
            assert took >= TIMEOUT * 0.9, f"{name}: closed after {took:.2f} s, before its time"
    finally:
        for sock in socks.values():
            sock.close()


def test_a_request_sent_slowly_but_within_the_timeout_is_answered(server: JobServer) -> None:
    sock = open_slow(server, b"GET /health HTTP/1.1\r\n")
    try:
        time.sleep(TIMEOUT / 2)
        sock.sendall(f"Host: 127.0.0.1:{server.dashboard.port}\r\n\r\n".encode())
        sock.settimeout(10)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
    finally:
        sock.close()


def test_an_idle_kept_alive_connection_is_closed_after_the_timeout(server: JobServer) -> None:
    sock = open_slow(server, b"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n")
    try:
        sock.settimeout(10)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        start = time.monotonic()
        took = closed_after(sock, start, TIMEOUT + 5)
        assert took is not None and took < TIMEOUT + 2
    finally:
        sock.close()


def test_a_stream_longer_than_the_timeout_is_not_cut(server: JobServer) -> None:
    """The deadline is on the request coming in; an answer that streams lasts."""
    sock = open_slow(server, b"GET /api/stream HTTP/1.1\r\nHost: {host}\r\n\r\n")
    try:
        sock.settimeout(10)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        assert closed_after(sock, time.monotonic(), TIMEOUT * 2.5) is None
    finally:
        sock.close()


def test_fifty_slow_connections_do_not_stop_a_normal_client(tmp_path: Path) -> None:
    """Each connection costs the server a socket and a parser on its event loop, not a
    thread: 50 half-sent requests (some with a body that never ends, which reach a route)
    do not keep anyone else waiting."""
    with serve_jobs(
        port=0, store=tmp_path / "jobs.db", devices=["sim:8GiB"], token=TOKEN, request_timeout=60
    ) as srv:
        kinds = list(PARTIAL.values())
        socks = [open_slow(srv, kinds[k % len(kinds)]) for k in range(50)]
        try:
            time.sleep(0.2)  # all of them in, the bodies at their routes
            spec = {"name": "after", "command": ["true"], "memory": "1GiB"}
            t0 = time.monotonic()
            assert call("GET", f"{srv.url}health", token=None)[0] == 200
            status, _, made = call("POST", f"{srv.url}jobs", body=json.dumps(spec).encode())
            assert status == 201, made
            assert call("GET", f"{srv.url}jobs/{made['id']}")[0] == 200
            assert call("GET", f"{srv.url}jobs?limit=5")[0] == 200
            assert time.monotonic() - t0 < 10
            assert all(still_open(s) for s in socks)  # they were all held meanwhile
        finally:
            for sock in socks:
                sock.close()


# -- listing a large store ------------------------------------------------------------------


def fill(path: Path, n: int) -> None:
    """``n`` finished jobs (states in turn, labels ``batch=i % 10``), in one transaction."""
    JobStore(path).close()
    base = JobSpec(name="x", command=("true",), memory=MemoryNeed.of_size("1GiB")).to_dict()
    states = ("succeeded", "failed", "cancelled")
    rows = [
        (
            f"f{i:011x}",
            f"filled{i}",
            json.dumps({**base, "name": f"filled{i}", "labels": {"batch": str(i % 10)}}),
            states[i % 3],
            float(i),
        )
        for i in range(n)
    ]
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(
            "INSERT INTO jobs (id, name, spec, state, submitted_at) VALUES (?, ?, ?, ?, ?)", rows
        )
        conn.execute("COMMIT")
    finally:
        conn.close()


@pytest.fixture(scope="module")
def large(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("large") / "jobs.db"
    fill(path, 3000)
    return path


def test_a_page_of_the_list_reads_and_decodes_only_its_rows(
    large: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``GET /jobs?limit=1`` over 50,000 jobs took 3.3-3.9 s: every row was read and its
    spec parsed, then all but one dropped."""
    decoded = []
    real = store_module._job

    def counting(row: Any) -> Any:
        decoded.append(row[0])
        return real(row)

    monkeypatch.setattr(store_module, "_job", counting)
    with JobStore(large) as store:
        for states, label, limit, offset in (
            (None, None, 1, 0),
            (["succeeded"], None, 2, 10),
            (None, "batch=3", 3, 5),
            (["failed", "cancelled"], "batch", 4, 100),
        ):
            decoded.clear()
            page = store.list(states, label=label, limit=limit, offset=offset)
            assert len(page) == limit and len(decoded) == limit


def plans(store: JobStore, call: Any) -> list[str]:
    """The query plan of each statement ``call()`` runs on the store's connection."""
    seen: list[str] = []
    conn: sqlite3.Connection = store._conn
    conn.set_trace_callback(seen.append)
    try:
        call()
    finally:
        conn.set_trace_callback(None)
    return [
        " / ".join(str(r[3]) for r in conn.execute(f"EXPLAIN QUERY PLAN {sql}"))
        for sql in seen
        if sql.lstrip().upper().startswith("SELECT")
    ]


def test_a_page_is_read_in_order_with_no_sort_of_the_whole_store(large: Path) -> None:
    with JobStore(large) as store:
        (plan,) = plans(store, lambda: store.list(limit=1))
        assert "TEMP B-TREE" not in plan, plan
        (plan,) = plans(store, lambda: store.list(["succeeded"], limit=1, offset=20))
        assert "USING INDEX jobs_state_seq" in plan and "TEMP B-TREE" not in plan, plan
        (plan,) = plans(store, lambda: store.count(["succeeded"]))
        assert "COVERING INDEX" in plan, plan


def test_paging_in_sql_gives_what_filtering_the_whole_list_gave(large: Path) -> None:
    with JobStore(large) as store:
        everything = store.list()
        assert [j.seq for j in everything] == sorted(j.seq for j in everything)
        for states in (None, ["succeeded"], ["failed", "cancelled"], []):
            for label in (None, "batch", "batch=3", "batch=", "nope", "batch=nope", "\ud800"):
                key, _, value = (label or "").partition("=")
                want = [
                    j
                    for j in everything
                    if (states is None or j.state in states)
                    and (
                        label is None
                        or (key in j.spec.labels and (not value or j.spec.labels[key] == value))
                    )
                ]
                assert store.count(states, label=label) == len(want)
                assert store.list(states, label=label) == want
                for offset, limit in ((0, 1), (7, 5), (len(want) - 1, 10), (len(want) + 5, 3)):
                    got = store.list(states, label=label, limit=limit, offset=max(0, offset))
                    assert got == want[max(0, offset) : max(0, offset) + limit]
                assert store.list(states, label=label, limit=10**30, offset=10**20) == []


def test_an_older_store_gets_the_listing_index_when_opened(tmp_path: Path) -> None:
    path = tmp_path / "jobs.db"
    JobStore(path).close()
    conn = sqlite3.connect(path)
    conn.execute("DROP INDEX jobs_state_seq")
    conn.close()
    with JobStore(path) as store:
        names = {r[0] for r in store._conn.execute("SELECT name FROM sqlite_master")}
        assert "jobs_state_seq" in names


def test_listing_over_http_pages_and_counts_in_the_store(server: JobServer) -> None:
    fill_more = [
        JobSpec(
            name=f"paged{i}",
            command=("true",),
            memory=MemoryNeed.of_size("1GiB"),
            labels={"paged": str(i % 2)},
        )
        for i in range(6)
    ]
    with JobStore(server.service.path) as store:
        made = [store.submit(spec) for spec in fill_more]
        for job in made:  # finished: the scheduler leaves them be
            store.move(job.id, "queued", "cancelled", finished_at=time.time())
        total = store.count()
    status, _, page = call("GET", f"{server.url}jobs?limit=1")
    assert status == 200 and page["total"] >= total and len(page["jobs"]) == 1
    status, _, page = call("GET", f"{server.url}jobs?label=paged=1&limit=2&offset=1")
    assert status == 200 and page["total"] == 3 and page["offset"] == 1
    assert [j["name"] for j in page["jobs"]] == ["paged3", "paged5"]
    # Past SQLite's integers: an empty page, as a slice of the whole list was.
    status, _, page = call("GET", f"{server.url}jobs?offset={10**20}")
    assert status == 200 and page["jobs"] == [] and page["total"] >= total


# -- 405s -----------------------------------------------------------------------------------

#: Every route of the service, as a path to ask, and the methods it takes.
ROUTES = {
    "/": ("/", {"GET"}),
    "/static/{name}": ("/static/dashboard.js", {"GET"}),
    "/api/state": ("/api/state", {"GET"}),
    "/api/stream": ("/api/stream", {"GET"}),
    "/metrics": ("/metrics", {"GET"}),
    "/healthz": ("/healthz", {"GET"}),
    "/openapi.json": ("/openapi.json", {"GET", "HEAD"}),
    "/jobs": ("/jobs", {"GET", "POST"}),
    "/jobs/{job_id}": ("/jobs/abcdef", {"GET", "DELETE"}),
    "/jobs/{job_id}/logs": ("/jobs/abcdef/logs", {"GET"}),
    "/workers/status": ("/workers/status", {"GET"}),
    "/health": ("/health", {"GET"}),
}
METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def test_every_405_lists_exactly_the_methods_of_its_route(server: JobServer) -> None:
    schema = call("GET", f"{server.url}openapi.json")[2]
    hidden = {"/", "/static/{name}", "/openapi.json"}  # not in the schema
    assert set(schema["paths"]) | hidden == set(ROUTES)
    for route, item in schema["paths"].items():
        assert {m.upper() for m in item} == ROUTES[route][1] - {"HEAD"}, route
    for route, (path, taken) in ROUTES.items():
        for method in METHODS:
            if method in taken:
                continue
            body = b"{}" if method in ("POST", "PUT", "PATCH") else None
            status, headers, _ = call(method, server.url + path.lstrip("/"), body=body)
            assert status == 405, (method, route, status)
            assert headers.get_all("Allow") == [", ".join(sorted(taken))], (method, route)


# -- a locked store -------------------------------------------------------------------------


def test_health_is_a_503_with_the_reason_while_another_connection_holds_the_store(
    server: JobServer,
) -> None:
    """A read goes on beside a writer (WAL), so /health said ok while every submission
    waited for the lock and failed with a 503."""
    holder = sqlite3.connect(server.service.path, isolation_level=None)
    try:
        holder.execute("BEGIN EXCLUSIVE")
        t0 = time.monotonic()
        status, headers, got = call("GET", f"{server.url}health", token=None)
        took = time.monotonic() - t0
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert status == 503 and got["status"] == "degraded", got
    assert any(r.startswith("store: cannot take its write lock") for r in got["reasons"]), got
    assert headers["Retry-After"] == "5"
    assert took < 10
    status, headers, got = call("GET", f"{server.url}health", token=None)
    assert status == 200 and got["reasons"] == [] and "Retry-After" not in headers
