"""The job service over real HTTP: a real uvicorn server, store and supervisors."""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.jobs.test_pricing import peak_rss_during
from tests.server._service import job_service
from vramctl.jobs import JobSpec, JobStore, MemoryNeed
from vramctl.server import JobServer, JobService, serve_jobs, service_token

PY = sys.executable


def call(
    method: str,
    url: str,
    body: Any = None,
    *,
    token: str | None = None,
    raw: bytes | None = None,
    timeout: float = 30.0,
) -> tuple[int, Any]:
    """(status, the JSON body, or the text where it is not JSON)."""
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, text = resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JobServer]:
    with job_service(tmp_path_factory.mktemp("home")) as srv:
        yield srv


def job(name: str, code: str = "print('hello')", memory: str = "1GiB", **kw: Any) -> dict[str, Any]:
    return {"name": name, "command": [PY, "-c", code], "memory": memory, **kw}


def wait_state(server: JobServer, job_id: str, timeout: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, got = call("GET", f"{server.url}jobs/{job_id}", token=server.token)
        assert status == 200
        if got["state"] in ("succeeded", "failed", "cancelled", "timed-out"):
            return dict(got)
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} did not finish in {timeout} s")


def test_the_token_is_made_once_and_private(server: JobServer) -> None:
    path = Path(os.environ["VRAMCTL_HOME"]) / "token"
    assert path.read_text().strip() == server.token
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert service_token() == server.token  # read, not made again


def test_a_job_runs_end_to_end_over_http(server: JobServer) -> None:
    status, made = call("POST", f"{server.url}jobs", job("hello"), token=server.token)
    assert status == 201 and made["state"] == "queued"
    done = wait_state(server, made["id"])
    assert done["state"] == "succeeded" and done["device"] == "sim:8GiB"
    status, text = call("GET", f"{server.url}jobs/{made['id']}/logs", token=server.token)
    assert status == 200 and text.strip() == "hello"
    status, listed = call("GET", f"{server.url}jobs?state=succeeded&limit=5", token=server.token)
    assert status == 200 and made["id"] in [j["id"] for j in listed["jobs"]]


def test_following_a_log_streams_until_the_job_ends(server: JobServer) -> None:
    code = "import time\nfor i in range(3):\n    print(i, flush=True); time.sleep(0.2)"
    _, made = call("POST", f"{server.url}jobs", job("counting", code), token=server.token)
    status, text = call(
        "GET", f"{server.url}jobs/{made['id']}/logs?follow=true", token=server.token
    )
    assert status == 200 and text.split() == ["0", "1", "2"]
    assert wait_state(server, made["id"])["state"] == "succeeded"


def test_every_mutating_route_needs_the_token_on_loopback_too(server: JobServer) -> None:
    _, made = call(
        "POST",
        f"{server.url}jobs",
        job("sleepy", "import time; time.sleep(30)"),
        token=server.token,
    )
    url = f"{server.url}jobs/{made['id']}"
    for token in (None, "wrong"):
        assert call("POST", f"{server.url}jobs", job("x"), token=token)[0] == 401
        assert call("DELETE", url, token=token)[0] == 401
        assert call("GET", f"{url}/logs", token=token)[0] == 401
        assert call("GET", f"{url}/logs?follow=true", token=token)[0] == 401
        # A job's spec holds its command and environment: reading it needs the token too.
        assert call("GET", url, token=token)[0] == 401
        assert call("GET", f"{server.url}jobs", token=token)[0] == 401
    # Read-only status stays open on loopback.
    assert call("GET", url, token=server.token)[0] == 200
    assert call("GET", f"{server.url}workers/status")[0] == 200
    status, cancelled = call("DELETE", url, token=server.token)
    assert status == 200 and (cancelled["cancel_requested"] or cancelled["state"] == "cancelled")
    assert wait_state(server, made["id"])["state"] == "cancelled"


@pytest.mark.parametrize(
    ("raw", "status", "says"),
    [
        (b"{", 400, "not JSON"),
        (b"[1, 2]", 422, "JSON object"),
        (json.dumps(job("x", memroy="1GiB")).encode(), 422, "unknown field 'memroy'"),
        (json.dumps(job("x", memory="-1GiB")).encode(), 422, "memory"),
        (json.dumps(job("x", memory="9000PiB")).encode(), 422, "memory"),
        (json.dumps({"name": "x", "memory": "1GiB", "command": "ls -l"}).encode(), 422, "shell"),
        (json.dumps(job("x", memory="64GiB")).encode(), 422, "largest device"),
        (
            json.dumps(
                {"name": "x", "memory": "1GiB", "command": ["no-such-program-here"]}
            ).encode(),
            422,
            "not a program",
        ),
        (json.dumps(job("x", cwd="/no/such/folder")).encode(), 422, "not an existing folder"),
    ],
)
def test_bad_submissions_are_one_clear_json_error(
    server: JobServer, raw: bytes, status: int, says: str
) -> None:
    got, body = call("POST", f"{server.url}jobs", raw=raw, token=server.token)
    assert got == status
    assert isinstance(body, dict) and "error" in body
    assert says in body["error"] + " ".join(body.get("problems", []))


def test_unknown_ids_routes_and_filters_are_json_4xx(server: JobServer) -> None:
    for method, path in (("GET", "jobs/nope"), ("DELETE", "jobs/nope"), ("GET", "jobs/nope/logs")):
        status, body = call(method, server.url + path, token=server.token)
        assert status == 404 and "no job 'nope'" in body["error"]
    assert call("GET", server.url + "no/such/route")[0] == 404
    for query, says in (
        ("state=bogus", "state"),
        ("limit=0", "limit"),
        ("offset=-1", "offset"),
    ):
        status, body = call("GET", f"{server.url}jobs?{query}", token=server.token)
        assert status == 422 and says in body["error"] + " ".join(body.get("problems", []))
    status, body = call("GET", f"{server.url}jobs?limit=notanumber", token=server.token)
    assert status == 422 and body["problems"]


def test_status_health_and_schema(server: JobServer) -> None:
    _, made = call(
        "POST",
        f"{server.url}jobs",
        job("holder", "import time; time.sleep(30)", "3GiB"),
        token=server.token,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        status, workers = call("GET", f"{server.url}workers/status")
        if made["id"] in [j["id"] for j in workers["active"]]:
            break
        time.sleep(0.05)
    (dev,) = workers["devices"]
    assert dev["id"] == "sim:8GiB" and made["id"] in dev["jobs"]
    assert dev["allocated_bytes"] >= 3 * 2**30 and workers["allocated_bytes"] >= 3 * 2**30
    status, health = call("GET", f"{server.url}health")
    assert status == 200 and health == {**health, "status": "ok", "reasons": []}
    status, schema = call("GET", f"{server.url}openapi.json")
    assert status == 200 and {"/jobs", "/jobs/{job_id}", "/jobs/{job_id}/logs"} <= set(
        schema["paths"]
    )
    assert schema["paths"]["/jobs"]["post"]["requestBody"]["content"]["application/json"]["schema"][
        "required"
    ] == ["name", "memory"]
    call("DELETE", f"{server.url}jobs/{made['id']}", token=server.token)
    wait_state(server, made["id"])


def test_the_status_lists_the_queue_the_running_and_the_latest_failures(
    server: JobServer,
) -> None:
    url, token = server.url, server.token
    _, holder = call(
        "POST",
        f"{url}jobs",
        job("holder", "import time; time.sleep(30)", "5GiB", env={"SECRET": "hush"}),
        token=token,
    )
    made: list[str] = [holder["id"]]
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            workers = call("GET", f"{url}workers/status")[1]
            if holder["id"] in [j["id"] for j in workers["active"]]:
                break
            time.sleep(0.05)
        # Too big while the holder runs (5 GiB and 6 GiB, each with its margin, on 8 GiB).
        _, big = call("POST", f"{url}jobs", job("big", "pass", "6GiB", priority=5), token=token)
        _, bad = call("POST", f"{url}jobs", job("bad", "raise SystemExit(3)"), token=token)
        _, late = call(
            "POST",
            f"{url}jobs",
            job("late", "import time; time.sleep(30)", run_timeout=0.5),
            token=token,
        )
        made += [big["id"], bad["id"], late["id"]]
        assert wait_state(server, bad["id"])["state"] == "failed"
        assert wait_state(server, late["id"])["state"] == "timed-out"
        status, workers = call("GET", f"{url}workers/status")
        assert status == 200
        assert abs(workers["time"] - time.time()) < 60

        (queued,) = [p for p in workers["pending"] if p["id"] == big["id"]]
        # Why it waits, as the scheduler last said it.
        queued = dict(queued)
        assert queued.pop("reason").startswith("waiting: needs 6.60 GiB with the margin")
        assert queued == {
            "id": big["id"],
            "name": "big",
            "need_bytes": 6 * 2**30,
            "need_kind": "size",
            "priority": 5,
            "submitted_at": big["submitted_at"],
            "attempts": 0,
        }
        (running,) = [j for j in workers["active"] if j["id"] == holder["id"]]
        assert running["name"] == "holder" and running["device"] == "sim:8GiB"
        assert running["reserved_bytes"] >= 5 * 2**30 and running["admitted_at"] is not None
        (dev,) = workers["devices"]
        assert dev["capacity_bytes"] == 8 * 2**30 and holder["id"] in dev["jobs"]

        # The latest failures first, each with its reason; a timeout is one.
        failures = workers["recent_failures"]
        assert [f["id"] for f in failures[:2]] == [late["id"], bad["id"]]
        assert failures[1] == {
            **failures[1],
            "name": "bad",
            "state": "failed",
            "reason": "exited with status 3",
            "exit_code": 3,
            "device": "sim:8GiB",
        }
        assert failures[0]["state"] == "timed-out"
        assert failures[0]["reason"] == "ran past its run timeout of 0.5 s"
        assert failures[0]["finished_at"] >= failures[1]["finished_at"]
        assert workers["failed_jobs"] >= 2 and len(failures) <= 20

        # An open route: no command, environment, spec or log.
        def keys(doc: Any) -> set[str]:
            if isinstance(doc, dict):
                return set(doc) | {k for v in doc.values() for k in keys(v)}
            if isinstance(doc, list):
                return {k for v in doc for k in keys(v)}
            return set()

        assert not keys(workers) & {"spec", "command", "env", "cwd", "log_path", "pid"}
        assert "hush" not in json.dumps(workers)

        # The answer is what the served schema says, field for field.
        paths = call("GET", f"{url}openapi.json")[1]["paths"]
        schema = paths["/workers/status"]["get"]["responses"]["200"]["content"]
        schema = schema["application/json"]["schema"]
        assert set(workers) == set(schema["required"])
        for key in ("devices", "active", "pending", "recent_failures"):
            wanted = set(schema["properties"][key]["items"]["required"])
            assert workers[key] and all(set(e) == wanted for e in workers[key]), key

        # The dashboard's page is told where to read it.
        status, state = call("GET", f"{url}api/state")
        assert status == 200 and state["jobs"] == "workers/status"
    finally:
        for job_id in made:
            call("DELETE", f"{url}jobs/{job_id}", token=token)
        for job_id in made:
            wait_state(server, job_id)


def test_the_status_pages_the_queue_and_counts_all_of_it(server: JobServer) -> None:
    url, token = server.url, server.token
    _, holder = call(
        "POST", f"{url}jobs", job("holder", "import time; time.sleep(30)", "5GiB"), token=token
    )
    made: list[str] = [holder["id"]]
    try:
        deadline = time.monotonic() + 30
        while holder["id"] not in [
            j["id"] for j in call("GET", f"{url}workers/status")[1]["active"]
        ]:
            assert time.monotonic() < deadline, "the holder was not admitted"
            time.sleep(0.05)
        # Five jobs that wait while the holder runs (6 GiB each, with the margin, on 8 GiB).
        for k in range(5):
            made.append(
                call("POST", f"{url}jobs", job(f"w{k}", "pass", "6GiB"), token=token)[1]["id"]
            )
        queued = made[1:]

        status, first = call("GET", f"{url}workers/status?limit=2")
        assert status == 200
        assert [p["id"] for p in first["pending"]] == queued[:2]  # in submission order
        assert first["pending_jobs"] == 5 and first["pending_bytes"] == 5 * 6 * 2**30
        assert (first["pending_offset"], first["pending_next_offset"]) == (0, 2)
        _, second = call("GET", f"{url}workers/status?limit=2&offset=2")
        assert [p["id"] for p in second["pending"]] == queued[2:4]
        assert second["pending_next_offset"] == 4 and second["pending_jobs"] == 5
        _, last = call("GET", f"{url}workers/status?limit=2&offset=4")
        assert [p["id"] for p in last["pending"]] == queued[4:]
        assert last["pending_next_offset"] is None and last["pending_bytes"] == 5 * 6 * 2**30
        _, past = call("GET", f"{url}workers/status?offset=9")
        assert past["pending"] == [] and past["pending_next_offset"] is None
        _, whole = call("GET", f"{url}workers/status")  # 100 unless told: all five here
        assert [p["id"] for p in whole["pending"]] == queued
        assert whole["pending_next_offset"] is None

        # One cancelled: the count and the bytes follow.
        call("DELETE", f"{url}jobs/{queued[0]}", token=token)
        _, after = call("GET", f"{url}workers/status?limit=1")
        assert after["pending_jobs"] == 4 and after["pending_bytes"] == 4 * 6 * 2**30
        assert [p["id"] for p in after["pending"]] == [queued[1]]
        assert after["pending_next_offset"] == 1

        # Bad pages are refused as GET /jobs refuses them.
        for query, says in (
            ("limit=0", "limit"),
            ("limit=1001", "limit"),
            ("offset=-1", "offset"),
            ("limit=notanumber", "limit"),
        ):
            status, body = call("GET", f"{url}workers/status?{query}")
            assert status == 422 and body["error"] == "invalid request", query
            assert says in " ".join(body["problems"]), query
            assert call("GET", f"{url}jobs?{query}", token=token)[1] == body, query
    finally:
        for job_id in made:
            call("DELETE", f"{url}jobs/{job_id}", token=token)
        for job_id in made:
            wait_state(server, job_id)


def test_a_status_poll_reads_the_page_of_the_queue_not_the_whole_queue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = JobStore(tmp_path / "jobs.db")
    queued = [
        store.submit(
            JobSpec(name=f"w{k}", command=("true",), memory=MemoryNeed.of_size(f"{k + 1}GiB"))
        )
        for k in range(30)
    ]
    service = JobService(tmp_path / "jobs.db", [], token="t")
    rows: list[int] = []  # how many jobs each read of the store decoded
    for name in ("list", "get_many", "get", "latest"):
        real = getattr(JobStore, name)

        def spy(self: JobStore, *a: Any, _real: Any = real, **kw: Any) -> Any:
            got = _real(self, *a, **kw)
            rows.append(len(got) if isinstance(got, list) else 1)
            return got

        monkeypatch.setattr(JobStore, name, spy)
    total = sum(k + 1 for k in range(30)) * 2**30

    first = service.workers(limit=5, offset=10)
    assert [p["id"] for p in first["pending"]] == [j.id for j in queued[10:15]]
    assert first["pending_jobs"] == 30 and first["pending_bytes"] == total
    assert first["pending_next_offset"] == 15
    rows.clear()
    again = service.workers(limit=5)  # the needs are known: the page alone is read
    assert again["pending_bytes"] == total and sum(rows) == 5
    assert [p["id"] for p in again["pending"]] == [j.id for j in queued[:5]]

    # A job queued again after an overrun (a new attempt) needs what it used: read again.
    overran = queued[0].id
    assert store.move(overran, "queued", "running", attempts=1)
    assert store.move(overran, "running", "queued", need_bytes=40 * 2**30)
    rows.clear()
    after = service.workers(limit=1)
    assert after["pending_bytes"] == total - 2**30 + 40 * 2**30
    assert after["pending"][0]["need_bytes"] == 40 * 2**30
    assert sum(rows) == 1 + 1  # the page, and the one job read again
    store.cancel(queued[1].id)
    assert service.workers(limit=1)["pending_bytes"] == total - 3 * 2**30 + 40 * 2**30


def test_a_service_on_another_address_needs_the_token_for_every_route(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    with serve_jobs(
        "0.0.0.0", 0, store=tmp_path / "jobs.db", devices=["sim:8GiB"], token_file=token_file
    ) as srv:
        assert srv.token == "s3cret-token"
        url = f"http://127.0.0.1:{srv.dashboard.port}/"
        for path in ("workers/status", "health", "jobs", "metrics", "openapi.json"):
            assert call("GET", url + path)[0] == 401, path
            assert call("GET", url + path, token=srv.token)[0] == 200, path


def test_vramctl_serve_runs_jobs_from_a_client_until_sigterm(tmp_path: Path) -> None:
    import re
    import signal
    import subprocess

    env = {**os.environ, "VRAMCTL_HOME": str(tmp_path), "COLUMNS": "200"}
    env.pop("VRAMCTL_TOKEN", None)
    argv = [PY, "-m", "vramctl", "serve", "--port", "0", "--devices", "sim:8GiB"]
    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        found = re.search(r"http://127\.0\.0\.1:\d+/", line)
        assert found, line
        url = found.group(0)
        token = (tmp_path / "token").read_text().strip()
        status, made = call("POST", url + "jobs", job("from-cli"), token=token)
        assert status == 201
        deadline = time.monotonic() + 30
        while call("GET", f"{url}jobs/{made['id']}", token=token)[1]["state"] != "succeeded":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert (tmp_path / "jobs.db").exists()
    finally:
        proc.send_signal(signal.SIGTERM)
        _, errors = proc.communicate(timeout=30)
    assert proc.returncode == 0, errors


def test_metrics_count_the_jobs_and_time_their_admission(server: JobServer) -> None:
    _, made = call("POST", f"{server.url}jobs", job("metered"), token=server.token)
    wait_state(server, made["id"])
    status, text = call("GET", f"{server.url}metrics")
    assert status == 200
    lines = dict(
        line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#")
    )
    assert float(lines['vramctl_jobs{state="succeeded"}']) >= 1
    assert float(lines["vramctl_job_admission_seconds_count"]) >= 1
    assert float(lines['vramctl_job_admission_seconds_bucket{le="+Inf"}']) >= 1
    assert float(lines["vramctl_job_queue_delay_seconds_count"]) >= 1
    assert 'vramctl_jobs_reserved_bytes{device="sim:8GiB"}' in lines
    assert any(k.startswith("vramctl_memory") or k.startswith("vramctl_device") for k in lines)


def test_the_schema_in_the_docs_is_the_served_one(server: JobServer) -> None:
    status, schema = call("GET", f"{server.url}openapi.json")
    assert status == 200
    kept = Path(__file__).resolve().parents[2] / "docs" / "openapi.json"
    text = json.dumps(schema, indent=2, sort_keys=True) + "\n"
    if os.environ.get("VRAMCTL_UPDATE_DOCS"):
        kept.write_text(text)
    assert kept.read_text() == text, (
        "docs/openapi.json is not the served schema: refresh it with "
        "VRAMCTL_UPDATE_DOCS=1 python -m pytest tests/server/test_jobs_api.py -k schema_in_the_docs"
    )


def test_the_cli_talks_to_the_service_with_server(server: JobServer) -> None:
    from typer.testing import CliRunner

    from vramctl.cli._app import app

    runner = CliRunner()
    where = ["--server", server.url]
    made = runner.invoke(
        app,
        ["submit", *where, "-m", "1GiB", "--name", "remote", "--json", "--", PY, "-c", "print(42)"],
    )
    assert made.exit_code == 0, made.output
    job_id = json.loads(made.stdout)["id"]
    wait_state(server, job_id)
    logs = runner.invoke(app, ["logs", *where, job_id])
    assert logs.exit_code == 0 and logs.stdout.strip() == "42"
    listed = runner.invoke(app, ["jobs", *where, "--json", "--state", "succeeded"])
    assert job_id in [j["id"] for j in json.loads(listed.stdout)["jobs"]]
    ran = runner.invoke(
        app, ["run", *where, "-m", "1GiB", "--", PY, "-c", "print('ran'); raise SystemExit(3)"]
    )
    assert ran.exit_code == 3 and "ran" in ran.stdout
    gone = runner.invoke(app, ["cancel", *where, "nope"])
    assert gone.exit_code != 0 and "no job 'nope'" in gone.output
    wrong = runner.invoke(
        app, ["submit", *where, "--token-file", os.devnull, "-m", "1GiB", "--", "true"]
    )
    assert wrong.exit_code != 0 and "token" in wrong.output
    bad = runner.invoke(app, ["jobs", "--server", "http://127.0.0.1:9/"])
    assert bad.exit_code != 0 and "cannot reach the job service" in bad.output


def test_a_job_that_can_never_fit_is_refused_with_one_line(server: JobServer) -> None:
    from typer.testing import CliRunner

    from vramctl.cli._app import app

    # 7.5 GiB is under the device's 8 GiB, but not with the scheduler's 10% margin.
    status, body = call("POST", f"{server.url}jobs", job("x", memory="7.5GiB"), token=server.token)
    assert status == 422
    assert body == {
        "error": "job 'x' cannot be placed: memory: needs 8.25 GiB with the 10% margin but "
        "the largest device, sim:8GiB, has 8.00 GiB"
    }
    ran = CliRunner().invoke(app, ["run", "--server", server.url, "-m", "100GiB", "--", "true"])
    assert ran.exit_code == 2
    assert ran.stderr.strip() == (
        "error: job 'true' cannot be placed: memory: needs 110.00 GiB with the 10% margin "
        "but the largest device, sim:8GiB, has 8.00 GiB"
    )


def test_routes_take_a_unique_prefix_of_a_jobs_id(server: JobServer) -> None:
    from typer.testing import CliRunner

    from vramctl.cli._app import app

    made = [call("POST", f"{server.url}jobs", job(n), token=server.token)[1] for n in "ab"]
    for m in made:
        wait_state(server, m["id"])
    store = Path(os.environ["VRAMCTL_HOME"]) / "jobs.db"
    with sqlite3.connect(store) as conn:  # two ids that share their first 7 characters
        for new, m in zip(("feed0001aaaa", "feed0002bbbb"), made, strict=True):
            conn.execute("UPDATE jobs SET id = ? WHERE id = ?", (new, m["id"]))
    conn.close()
    status, got = call("GET", f"{server.url}jobs/feed0001", token=server.token)
    assert status == 200 and (got["id"], got["name"]) == ("feed0001aaaa", "a")
    status, text = call("GET", f"{server.url}jobs/feed0001/logs", token=server.token)
    assert status == 200 and text.strip() == "hello"
    status, got = call("DELETE", f"{server.url}jobs/feed0002", token=server.token)
    assert status == 200 and got["id"] == "feed0002bbbb"
    status, body = call("GET", f"{server.url}jobs/feed000", token=server.token)
    assert status == 400 and body["error"] == (
        "job id 'feed000' is ambiguous: it matches feed0001aaaa (a), feed0002bbbb (b); "
        "give more of it"
    )
    logs = CliRunner().invoke(app, ["logs", "--server", server.url, "feed0002"])
    assert logs.exit_code == 0 and logs.stdout.strip() == "hello"
    both = CliRunner().invoke(app, ["cancel", "--server", server.url, "feed000"])
    assert both.exit_code == 2 and "is ambiguous: it matches feed0001aaaa (a)" in both.stderr


def test_concurrent_submissions_are_all_kept(server: JobServer) -> None:
    from concurrent.futures import ThreadPoolExecutor

    def submit(k: int) -> tuple[int, Any]:
        return call("POST", f"{server.url}jobs", job(f"many{k}", "pass"), token=server.token)

    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(submit, range(160)))
    assert [status for status, _ in answers] == [201] * 160
    ids = {made["id"] for _, made in answers}
    _, listed = call("GET", f"{server.url}jobs?limit=1000", token=server.token)
    assert ids <= {j["id"] for j in listed["jobs"]}
    for job_id in ids:
        call("DELETE", f"{server.url}jobs/{job_id}", token=server.token)


def test_health_is_degraded_with_the_reasons(tmp_path: Path) -> None:
    from vramctl.device import resolve
    from vramctl.server import JobService

    gpu = resolve("sim:4GiB")
    beats = [True]
    service = JobService(tmp_path / "jobs.db", [gpu], token="t", scheduler_alive=lambda: beats[0])
    assert service.health() == (True, [])
    gpu.health.disable("taken out for a test")
    beats[0] = False
    ok, reasons = service.health()
    assert not ok
    assert reasons == [
        "device sim:4GiB: disabled: taken out for a test",
        "scheduler: its loop is not running",
    ]
    assert not JobService(tmp_path / "other.db", [], token="t").health()[0]


def test_a_huge_log_is_sent_in_pieces_and_the_server_stays_flat(server: JobServer) -> None:
    """A 1 GiB log (sparse, so it costs no disk) read whole: the server holds a piece at a
    time. It once read the whole file into memory (300 MiB took it from 260 to 1,444 MiB)."""

    _, made = call("POST", f"{server.url}jobs", job("quiet", "pass"), token=server.token)
    assert wait_state(server, made["id"])["state"] == "succeeded"
    log = Path(server.service.log_path(server.service.job(made["id"])) or "")
    size = 1 << 30
    os.truncate(log, size)
    me = psutil.Process()
    base = me.memory_info().rss
    peak = base
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.wait(0.005):
            peak = max(peak, me.memory_info().rss)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    received = 0
    req = urllib.request.Request(f"{server.url}jobs/{made['id']}/logs")
    req.add_header("Authorization", f"Bearer {server.token}")
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            while piece := resp.read(1 << 20):
                received += len(piece)
    finally:
        done.set()
        sampler.join()
    assert received == size
    assert peak - base < 200 * 2**20, f"the server grew by {(peak - base) / 2**20:.0f} MiB"


def test_a_body_nested_too_deeply_is_a_json_400(server: JobServer) -> None:
    body = b"[" * 100_000 + b"]" * 100_000
    status, got = call("POST", f"{server.url}jobs", raw=body, token=server.token)
    assert status in (400, 413)
    assert isinstance(got, dict) and "error" in got


def test_a_locked_store_is_a_json_503_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import vramctl.jobs._store as store_module

    # Another process holds the store's write lock past the (shortened) busy timeout.
    monkeypatch.setattr(store_module, "_BUSY_TIMEOUT", 0.3)
    db = tmp_path / "jobs.db"
    with serve_jobs(port=0, store=db, devices=["sim:8GiB"], token="t0ken-for-a-test") as srv:
        holder = sqlite3.connect(db, isolation_level=None)
        try:
            holder.execute("BEGIN EXCLUSIVE")
            status, got = call("POST", f"{srv.url}jobs", job("blocked"), token=srv.token)
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        assert status == 503
        assert got["error"].startswith("the job store is unavailable: database is locked")
        status, made = call("POST", f"{srv.url}jobs", job("after"), token=srv.token)
        assert status == 201 and made["state"] == "queued"


def test_a_job_asking_for_two_devices_is_refused_at_submission(server: JobServer) -> None:
    body = job("pair", devices={"count": 2})
    status, got = call("POST", f"{server.url}jobs", body, token=server.token)
    assert status == 422
    assert any(p.startswith("devices.count: 2 devices at once") for p in got["problems"])


# -- estimates run in the service's worker process, never in the service ---------------

#: A model priced by its estimate, small enough to run here.
LSTM = {"model": "lstm", "batch_size": 2, "seq_len": 16, "mode": "infer"}


@pytest.fixture(scope="module")
def _estimates_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("estimates-config")


@pytest.fixture
def estimates(
    _own_config_dir: None, _estimates_config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One config folder for the worker the service starts in these tests: a new worker
    measures this machine's CPU once per folder (a few seconds)."""
    monkeypatch.setenv("VRAMCTL_CONFIG_DIR", str(_estimates_config))


def probe_module(folder: Path, body: str) -> str:
    """A module of a name of its own in ``folder`` that writes its process id to
    ``folder/imported`` when imported; its name."""
    name = f"vramctl_service_probe_{uuid.uuid4().hex[:12]}"
    marker = folder / "imported"
    (folder / f"{name}.py").write_text(
        f"import os\nopen({str(marker)!r}, 'w').write(str(os.getpid()))\n{body}"
    )
    return name


@pytest.mark.usefixtures("estimates")
def test_an_estimated_job_is_priced_as_here_and_runs(server: JobServer) -> None:
    from vramctl.jobs import JobSpec, Ledger, price

    body = job("estimated", memory={"estimate": LSTM})
    status, made = call("POST", f"{server.url}jobs", body, token=server.token)
    assert status == 201, made
    done = wait_state(server, made["id"], timeout=60)
    assert done["state"] == "succeeded"
    need = price(JobSpec.from_dict(body), "sim:8GiB")
    assert done["reserved_bytes"] == need + Ledger([8 << 30], margin=0.1).margin_for(need)


@pytest.mark.usefixtures("estimates")
def test_a_model_that_aborts_is_a_422_and_the_service_lives_on(server: JobServer) -> None:
    body = job("aborts", memory={"estimate": {"model": "os:abort"}})
    status, got = call("POST", f"{server.url}jobs", body, token=server.token, timeout=60)
    assert status == 422
    assert got == {
        "error": "cannot price job 'aborts': memory.estimate: the estimate's worker process"
        " died (signal 6: SIGABRT)"
    }
    status, health = call("GET", f"{server.url}health")
    assert status == 200 and health["status"] == "ok"
    # The next estimate starts a new worker.
    status, made = call(
        "POST", f"{server.url}jobs", job("after", memory={"estimate": LSTM}), token=server.token
    )
    assert status == 201, made


@pytest.mark.usefixtures("estimates")
def test_a_factory_is_never_imported_into_the_service(
    server: JobServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = probe_module(tmp_path, "import torch\ndef make():\n    return torch.nn.Linear(4, 4)\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # the service's import path finds it
    body = job("factory", memory={"estimate": {"model": f"{name}:make"}})
    status, got = call("POST", f"{server.url}jobs", body, token=server.token, timeout=60)
    assert status == 422 and "no batch for" in got["error"]  # built, in the worker
    assert name not in sys.modules
    assert int((tmp_path / "imported").read_text()) != os.getpid()


@pytest.mark.usefixtures("estimates")
def test_an_estimate_past_its_time_limit_is_a_422_and_the_next_is_priced(
    server: JobServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = probe_module(tmp_path, "import time\ndef make():\n    time.sleep(60)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert server.service.estimator is not None
    monkeypatch.setattr(server.service.estimator, "timeout", 2.0)
    body = job("sleeps", memory={"estimate": {"model": f"{name}:make"}})
    start = time.monotonic()
    status, got = call("POST", f"{server.url}jobs", body, token=server.token, timeout=60)
    assert time.monotonic() - start < 30
    assert status == 422 and "the estimate took longer than 2 s" in got["error"], got
    monkeypatch.setattr(server.service.estimator, "timeout", 60.0)
    status, made = call(
        "POST", f"{server.url}jobs", job("next", memory={"estimate": LSTM}), token=server.token
    )
    assert status == 201, made


@pytest.mark.usefixtures("estimates")
def test_a_huge_seq_len_is_refused_and_the_service_stays_flat(server: JobServer) -> None:
    # Inputs of about 1 GiB built with real values: priced here, they grew the service.
    huge = {"model": "lstm", "batch_size": 1, "seq_len": 60_000_000}
    body = job("huge", memory={"estimate": huge})
    grown, (status, got) = peak_rss_during(
        lambda: call("POST", f"{server.url}jobs", body, token=server.token, timeout=60)
    )
    assert status == 422
    assert got["error"].startswith("job 'huge' cannot be placed: memory: needs ")
    assert grown < 200 * 2**20, f"the service grew by {grown / 2**20:.0f} MiB"
