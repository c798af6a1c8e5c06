"""The attacks of the job service's security review, run against one real service.

Each row is one attack as an attacker or a careless user made it, and the answer the
service must give: a JSON 4xx (or 503) with a reason, never a 500 or a plain-text error,
and the service still answering afterwards. The attacks that need a job (an escape from
its share, a poisoned peak, a lost supervisor) run real jobs under real supervisors.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.server._service import job_service
from tests.server.test_jobs_api import call, job, wait_state
from vramctl.server import JobServer, serve_jobs

PY = sys.executable
TOKEN = "abuse-test-token-0123456789"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JobServer]:
    # A small allowance per process, so the escapes below pass it in megabytes, not gigabytes.
    allowance = {"VRAMCTL_PROCESS_ALLOWANCE": "96MiB"}
    with job_service(tmp_path_factory.mktemp("abuse"), env=allowance, token=TOKEN) as srv:
        yield srv


def healthy(server: JobServer) -> bool:
    status, body = call("GET", f"{server.url}health", timeout=10)
    return status == 200 and body["status"] == "ok"


#: (attack, body as bytes, expected status, a phrase of the error)
SUBMISSIONS = [
    ("batch past 63 bits", job("x", batch_size=2**63), 422, "batch_size"),
    ("priority past 64 bits", job("x", priority=2**64), 422, "priority"),
    ("run timeout of 10^12 s", job("x", run_timeout=1e12), 422, "run_timeout"),
    ("retries 10^6", job("x", retries=10**6), 422, "retries"),
    ("name with a newline", job("x\n"), 422, "name"),
    ("NUL in an env value", job("x", env={"K": "a\0b"}), 422, "NUL"),
    ("'=' in an env name", job("x", env={"A=B": "v"}), 422, "variable name"),
    ("two devices at once", job("x", devices={"count": 2}), 422, "devices.count"),
    ("a shell string", {"name": "x", "memory": "1GiB", "command": "rm -rf /"}, 422, "shell"),
    ("rerun_lost not a bool", job("x", rerun_lost="yes"), 422, "rerun_lost"),
    (
        "an estimate of a huge sequence",
        job("x", memory={"estimate": {"model": "gpt2", "seq_len": 2**40}}),
        422,
        "seq_len",
    ),
]


@pytest.mark.parametrize(
    ("attack", "body", "status", "says"), SUBMISSIONS, ids=[a[0] for a in SUBMISSIONS]
)
def test_a_bad_spec_is_a_json_4xx_with_the_reason(
    server: JobServer, attack: str, body: dict[str, Any], status: int, says: str
) -> None:
    got, answer = call("POST", f"{server.url}jobs", body, token=TOKEN)
    assert got == status, (attack, answer)
    assert isinstance(answer, dict), attack
    assert says in answer["error"] + " ".join(answer.get("problems", [])), (attack, answer)
    assert healthy(server)


def test_malformed_bodies_are_json_4xx(server: JobServer) -> None:
    for raw in (b"[" * 100_000 + b"]" * 100_000, b"{", b"\xff\xfe", b"x" * (2 * 2**20)):
        status, answer = call("POST", f"{server.url}jobs", raw=raw, token=TOKEN)
        assert 400 <= status < 500 and isinstance(answer, dict) and answer["error"]
    assert healthy(server)


def test_every_token_attack_is_a_401(server: JobServer) -> None:
    url = f"{server.url}jobs"
    for header in (
        None,
        "Bearer wrong",
        "Bearer " + TOKEN[:-1],
        "Bearer " + TOKEN + "x",
        "Basic " + TOKEN,
        TOKEN,
        "Bearer " + "a" * 10_000,
    ):
        req_headers = {} if header is None else {"Authorization": header}
        status = _raw_status(server, "GET", "/jobs", req_headers)
        assert status == 401, header
    assert _raw_status(server, "GET", f"/jobs?token={TOKEN}", {}) == 401
    assert call("GET", url, token=TOKEN)[0] == 200


def test_a_foreign_host_is_refused(server: JobServer) -> None:
    headers = {"Host": "evil.example:80", "Authorization": f"Bearer {TOKEN}"}
    assert _raw_status(server, "GET", "/jobs", headers) == 403


def test_a_405_names_the_methods_the_route_takes(server: JobServer) -> None:
    status, headers = _raw(server, "PUT", "/jobs", {"Authorization": f"Bearer {TOKEN}"})
    assert status == 405
    allowed = {m.strip() for m in headers.get("allow", "").split(",") if m.strip()}
    assert {"GET", "POST"} <= allowed


def test_a_half_sent_request_does_not_hold_the_service(server: JobServer) -> None:
    host, port = _address(server)
    held = [socket.create_connection((host, port)) for _ in range(20)]
    try:
        for s in held:
            s.sendall(b"POST /jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000\r\n\r\n{")
        assert healthy(server)  # others are answered meanwhile
        assert call("GET", f"{server.url}jobs?limit=1", token=TOKEN)[0] == 200
    finally:
        for s in held:
            s.close()


def test_a_model_that_kills_its_process_does_not_kill_the_service(server: JobServer) -> None:
    body = job("boom", memory={"estimate": {"model": "os:abort"}})
    status, answer = call("POST", f"{server.url}jobs", body, token=TOKEN, timeout=120)
    assert 400 <= status < 500 and isinstance(answer, dict), answer
    assert healthy(server)


def test_a_job_cannot_leave_its_share_by_skipping_the_bootstrap(server: JobServer) -> None:
    code = "import time; x = bytearray(b'\\1') * (600 * 2**20); time.sleep(30)"
    body = {"name": "escape", "command": [PY, "-S", "-c", code], "memory": "256MiB"}
    _, made = call("POST", f"{server.url}jobs", body, token=TOKEN)
    done = wait_state(server, made["id"], timeout=60)
    assert done["state"] == "failed"
    reserved = done["reserved_bytes"] / 2**20  # the need and the service's margin
    assert f"of host memory, past its reservation of {reserved:.2f} MiB" in done["reason"]


def test_a_job_cannot_say_it_is_held_or_teach_a_false_peak(server: JobServer) -> None:
    code = """
import os
folder = os.path.dirname(os.environ["VRAMCTL_PEAK_FILE"])
open(os.path.join(folder, f"held.{os.getpid()}"), "w").close()
with open(os.environ["VRAMCTL_PEAK_FILE"] + f".{os.getpid()}", "w") as f:
    f.write(str(10**15))
"""
    _, made = call("POST", f"{server.url}jobs", job("liar", code, "256MiB"), token=TOKEN)
    done = wait_state(server, made["id"])
    assert done["state"] == "succeeded"
    assert done["peak_bytes"] <= int(done["reserved_bytes"] * 1.05) + 96 * 2**20


def test_a_job_whose_supervisor_is_killed_runs_once(server: JobServer, tmp_path: Path) -> None:
    out = tmp_path / "ran"
    code = f"import time; time.sleep(1.5); open({str(out)!r}, 'a').write('x')"
    _, made = call("POST", f"{server.url}jobs", job("once", code, retries=2), token=TOKEN)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        got = call("GET", f"{server.url}jobs/{made['id']}", token=TOKEN)[1]
        if got["state"] == "running" and got.get("pid"):
            break
        time.sleep(0.05)
    supervisor = _supervisor_of(got["pid"])
    os.kill(supervisor, signal.SIGKILL)
    done = wait_state(server, made["id"], timeout=60)
    assert done["state"] == "failed" and "exit status is unknown" in done["reason"]
    time.sleep(0.5)
    assert out.read_text() == "x"  # it ran once, and finished


# -- helpers --------------------------------------------------------------------------------


def _supervisor_of(pid: int) -> int:
    import psutil

    return psutil.Process(pid).ppid()


def _address(server: JobServer) -> tuple[str, int]:
    rest = server.url.split("//", 1)[1].rstrip("/")
    host, port = rest.rsplit(":", 1)
    return host, int(port)


def _raw(
    server: JobServer, method: str, path: str, headers: dict[str, str]
) -> tuple[int, dict[str, str]]:
    """One request over a socket of its own: (status, headers in lower case)."""
    host, port = _address(server)
    head = {"Host": f"{host}:{port}", "Connection": "close", **headers}
    lines = [f"{method} {path} HTTP/1.1", *(f"{k}: {v}" for k, v in head.items()), "", ""]
    with socket.create_connection((host, port), timeout=30) as s:
        s.sendall("\r\n".join(lines).encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    top, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = top.decode("latin-1").split("\r\n")
    got = {}
    for line in header_lines:
        key, _, value = line.partition(":")
        got[key.strip().lower()] = value.strip()
    status = int(status_line.split()[1])
    if status >= 400:
        json.loads(body or b"{}")  # every error is JSON
    return status, got


def _raw_status(server: JobServer, method: str, path: str, headers: dict[str, str]) -> int:
    return _raw(server, method, path, headers)[0]


def conn_page_size(db: Path) -> int:
    import sqlite3

    conn = sqlite3.connect(db)
    try:
        return int(conn.execute("PRAGMA page_size").fetchone()[0])
    finally:
        conn.close()


def test_a_damaged_store_is_a_json_503_on_every_route(tmp_path: Path) -> None:
    import sqlite3

    from vramctl.jobs import JobSpec, JobStore, MemoryNeed

    db = tmp_path / "jobs.db"
    with JobStore(db) as store:
        for i in range(300):
            spec = JobSpec(
                name=f"j{i}",
                command=("true",),
                memory=MemoryNeed.of_size("1GiB"),
                env={"K": "v" * 200},
            )
            store.submit(spec)
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    size = db.stat().st_size
    page = conn_page_size(db)
    with open(db, "r+b") as f:  # garbage over every page past the first (the schema's)
        for offset in range(page, size, page):
            f.seek(offset)
            f.write(b"\xa5" * page)  # not a page of any kind SQLite writes
    with serve_jobs(port=0, store=db, devices=["sim:8GiB"], token=TOKEN) as srv:
        for method, path, body in (
            ("GET", "jobs", None),
            ("GET", "jobs?state=queued", None),
            ("GET", "workers/status", None),
            ("POST", "jobs", job("x")),
        ):
            status, answer = call(method, srv.url + path, body, token=TOKEN)
            assert status == 503, (path, answer)
            assert "database disk image is malformed" in answer["error"], path
        status, answer = call("GET", srv.url + "health")
        assert status == 503 and any(r.startswith("store:") for r in answer["reasons"])


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another local user")
def test_another_local_user_can_neither_read_nor_lock_the_store() -> None:
    import shutil
    import subprocess
    import tempfile

    python = "/usr/bin/python3"  # another user cannot run this environment's Python
    if not os.access(python, os.X_OK):
        pytest.skip("no system Python for another user to run")
    probe = """
import fcntl, sys
for path in sys.argv[1:]:
    try:
        with open(path, "rb") as f:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        print("OPENED", path)
    except OSError as exc:
        print("refused", path, exc.errno)
"""

    def as_nobody(*paths: Path) -> str:
        argv = [python, "-S", "-c", probe, *map(str, paths)]
        return subprocess.run(argv, user="nobody", capture_output=True, text=True).stdout

    # A store in a folder open to all (one that existed before the store, so left as it
    # was): only the files' own modes keep other users out.
    folder = Path(tempfile.mkdtemp())
    try:
        folder.chmod(0o755)
        loose = folder / "loose"
        loose.write_text("x")
        loose.chmod(0o644)
        assert as_nobody(loose).startswith("OPENED")  # the probe itself works
        with serve_jobs(port=0, store=folder / "jobs.db", devices=["sim:8GiB"], token=TOKEN) as srv:
            secret = job("secret", "print('the output')", env={"API_KEY": "hunter2"})
            _, made = call("POST", f"{srv.url}jobs", secret, token=TOKEN)
            wait_state(srv, made["id"])
            names = ("jobs.db", "jobs.db-wal", "jobs.db-shm", "jobs.db.lock")
            files = [folder / n for n in names if (folder / n).exists()]
            files += sorted((folder / "logs").glob("*.log"))
            assert len(files) >= 5
            got = as_nobody(*files)
        assert "OPENED" not in got and got.count("refused") == len(files), got
    finally:
        shutil.rmtree(folder, ignore_errors=True)
