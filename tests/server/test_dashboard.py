"""The dashboard's HTTP API against a real uvicorn server on 127.0.0.1."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi import APIRouter
from typer.testing import CliRunner

import vramctl
import vramctl.cli._dashboard  # registers ``vramctl dashboard``
from vramctl.cli._app import app as cli_app
from vramctl.monitor import AddressError, Monitor
from vramctl.server import DashboardServer, create_app, serve_dashboard

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "s3cret-token"


def get(url: str, headers: dict[str, str] | None = None, timeout: float = 10.0) -> tuple[int, str]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def read_events(resp: Any, want: str, deadline: float) -> dict[str, Any]:
    """Read Server-Sent Events from ``resp`` until one of kind ``want``; returns its data."""
    kind = None
    while time.monotonic() < deadline:
        line = resp.readline().decode()
        if not line:
            break
        line = line.rstrip("\n")
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: ") and kind == want:
            doc: dict[str, Any] = json.loads(line[6:])
            return doc
        elif not line:
            kind = None
    raise AssertionError(f"no {want!r} event arrived")


def open_stream(url: str) -> Any:
    """Open an event stream, and read on until the server has subscribed it to the monitor."""
    resp = urllib.request.urlopen(url, timeout=10)
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert resp.readline() == b"retry: 2000\n"
    assert resp.readline() == b": connected\n"
    return resp


@pytest.fixture(autouse=True)
def _no_env_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VRAMCTL_TOKEN", raising=False)


@pytest.fixture
def served() -> Iterator[tuple[Monitor, DashboardServer]]:
    mon = Monitor(["cpu"], interval=0.2, rules=[])
    server = serve_dashboard(mon, port=0)
    try:
        yield mon, server
    finally:
        server.close()


def test_state_has_devices_history_alerts_and_events(
    served: tuple[Monitor, DashboardServer],
) -> None:
    mon, server = served
    mon.sample()
    mon.record("leak", device="cpu", rate_bytes_per_step=1024, causes=["a list keeps growing"])
    status, body = get(server.url + "api/state")
    assert status == 200
    doc = json.loads(body)
    assert doc["interval_s"] == 0.2
    assert doc["sample_cost_s"] >= 0
    assert doc["running"] is True
    assert doc["jobs"] is None  # no job queue here: the page shows no jobs view
    (cpu,) = doc["devices"]
    assert {"id", "name", "uuid", "kind", "total", "latest", "peak", "processes"} <= set(cpu)
    assert (cpu["id"], cpu["kind"]) == ("cpu", "cpu")
    history = cpu["history"]
    assert set(history) == {"t", "used", "total", "process_used", "allocated", "reserved"}
    assert len(history["t"]) >= 1
    assert all(len(v) == len(history["t"]) for v in history.values())
    assert cpu["total"] > 0 and cpu["peak"]["used"] > 0
    assert cpu["processes"] and {"pid", "name", "user", "used"} <= set(cpu["processes"][0])
    assert doc["alerts"] == [] and doc["active_alerts"] == []
    assert doc["events"][-1]["kind"] == "leak"
    assert doc["events"][-1]["data"]["rate_bytes_per_step"] == 1024


def test_a_simulated_gpu_is_shown_as_one_with_its_capacity_and_count() -> None:
    sim = vramctl.simulate("T4-16GB")
    busy = vramctl.simulate("64MiB")
    mon = Monitor([sim, busy, "cpu"], interval=60, rules=[])
    server = serve_dashboard(mon, port=0)
    try:
        with busy:
            held = torch.zeros(1024, 1024)  # 4 MiB, counted by the simulated GPU
            mon.sample()
        status, body = get(server.url + "api/state")
        del held
        js = get(server.url + "static/dashboard.js")[1]
    finally:
        server.close()
    assert status == 200
    t4, small, cpu = json.loads(body)["devices"]
    assert (t4["id"], t4["simulated"], cpu["simulated"], cpu["note"]) == (
        "sim:T4-16GB",
        True,
        False,
        None,
    )
    spec = vramctl.gpu_spec("T4-16GB")
    assert t4["total"] == t4["latest"]["total"] == spec.cuda_total_bytes  # not 0 B, not N/A
    assert t4["latest"]["used"] == 0  # nothing runs on it: the simulation counts nothing
    note = t4["note"]
    assert "simulated GPU, no hardware" in note and "0 B while nothing runs" in note
    assert "14.58 GiB is what a CUDA process sees of a T4-16GB" in note and "15.00 GiB" in note
    assert small["latest"]["used"] == 4 * 2**20 and small["total"] == 64 * 2**20
    assert "64.00 MiB is the size it was given" in small["note"]
    assert "info.simulated" in js and "info.note" in js  # the page marks it and says so


def test_page_static_health_and_metrics(served: tuple[Monitor, DashboardServer]) -> None:
    mon, server = served
    mon.sample()  # a reading now: the sampler's first one may not have come yet on a busy machine
    status, page = get(server.url)
    assert status == 200
    assert 'id="status"' in page and "static/uPlot.iife.min.js" in page
    assert "http" not in page.replace(server.url, "")  # no CDN, no external address
    status, js = get(server.url + "static/uPlot.iife.min.js")
    assert status == 200 and "uPlot" in js
    assert get(server.url + "static/dashboard.js")[0] == 200
    assert get(server.url + "static/dashboard.css")[0] == 200
    assert get(server.url + "static/..%2f_dashboard.py")[0] == 404
    assert get(server.url + "static/nothing.js")[0] == 404
    status, body = get(server.url + "healthz")
    assert status == 200 and json.loads(body)["ok"] is True
    req = urllib.request.Request(server.url + "metrics")
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.headers["content-type"].startswith("text/plain; version=0.0.4")
        text = resp.read().decode()
    assert 'vramctl_memory_total_bytes{device="cpu"' in text


def test_stream_sends_samples_and_events(served: tuple[Monitor, DashboardServer]) -> None:
    mon, server = served
    with open_stream(server.url + "api/stream") as resp:
        doc = read_events(resp, "sample", time.monotonic() + 5)
        assert doc["samples"][0]["device"] == "cpu"
        assert doc["samples"][0]["memory"]["total"] > 0
        mon.record("leak", device="cpu", rate_bytes_per_step=4096, causes=[])
        leak = read_events(resp, "leak", time.monotonic() + 5)
        assert leak["rate_bytes_per_step"] == 4096 and leak["timestamp"] > 0


def test_stream_sends_recorded_events_as_record_when_asked(
    served: tuple[Monitor, DashboardServer],
) -> None:
    # A browser's EventSource hears only the event names it listens for: the page asks for
    # events of kinds of the user's own (Monitor.record) under one name, "record".
    mon, server = served
    with open_stream(server.url + "api/stream?others=record") as resp:
        mon.record("phase", name="eval", step=7)
        doc = read_events(resp, "record", time.monotonic() + 5)
        assert doc["kind"] == "phase" and doc["timestamp"] > 0
        assert doc["data"] == {"name": "eval", "step": 7}
        mon.record("leak", device="cpu", rate_bytes_per_step=4096, causes=[])
        assert read_events(resp, "leak", time.monotonic() + 5)["rate_bytes_per_step"] == 4096
    with open_stream(server.url + "api/stream") as resp:  # by default, by their own name
        mon.record("phase", name="train")
        assert read_events(resp, "phase", time.monotonic() + 5)["name"] == "train"


def test_stream_unsubscribes_when_the_client_goes(
    served: tuple[Monitor, DashboardServer],
) -> None:
    mon, server = served
    before = len(mon._subscribers)
    resp = open_stream(server.url + "api/stream")
    assert len(mon._subscribers) == before + 1
    resp.close()
    deadline = time.monotonic() + 5
    while len(mon._subscribers) > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(mon._subscribers) == before


def test_stream_keeps_an_idle_connection_alive() -> None:
    mon = Monitor(["cpu"], interval=60, rules=[])
    with serve_dashboard(mon, port=0) as server:
        server.app.state.vramctl_hub.keepalive = 0.2
        with open_stream(server.url + "api/stream") as resp:
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline:
                if resp.readline() == b": keep-alive\n":
                    break
            else:
                raise AssertionError("no keep-alive comment within 3 s")


def test_nan_readings_are_null_in_json(served: tuple[Monitor, DashboardServer]) -> None:
    mon, server = served
    with open_stream(server.url + "api/stream") as resp:
        mon.record("phase", name="eval", loss=float("nan"))
        assert read_events(resp, "phase", time.monotonic() + 5)["loss"] is None
    status, body = get(server.url + "api/state")
    assert status == 200 and json.loads(body)["events"][-1]["data"]["loss"] is None


def test_token_is_required_on_every_route() -> None:
    mon = Monitor(["cpu"], interval=0.5, rules=[])
    with serve_dashboard(mon, port=0, token=TOKEN) as server:
        for path in ("", "api/state", "metrics", "healthz", "static/dashboard.js"):
            status, body = get(server.url + path)
            assert status == 401, path
            assert "token" in json.loads(body)["detail"]
            assert get(server.url + path, {"Authorization": "Bearer wrong"})[0] == 401
            assert get(server.url + path, {"Authorization": f"Bearer {TOKEN}"})[0] == 200
            assert get(server.url + path + f"?token={TOKEN}")[0] == 200
        # The page hands its token on to its scripts (and from there to the API and stream).
        page = get(server.page_url)[1]
        assert server.page_url.endswith(f"?token={TOKEN}")
        assert f"static/dashboard.js?token={TOKEN}" in page
        with urllib.request.urlopen(server.url + f"api/stream?token={TOKEN}", timeout=10) as r:
            read_events(r, "sample", time.monotonic() + 5)
    assert not mon.running


def test_added_routes_are_served_and_guarded() -> None:
    mon = Monitor(["cpu"], interval=0.5, rules=[])
    jobs = APIRouter()

    @jobs.get("/api/jobs")
    def list_jobs() -> list[str]:
        return ["job-1"]

    app = create_app(mon, token=TOKEN, routers=[jobs])
    assert app.state.vramctl_token == TOKEN
    with serve_dashboard(mon, port=0, token=TOKEN, routers=[jobs]) as server:
        assert get(server.url + "api/jobs")[0] == 401
        assert get(server.url + f"api/jobs?token={TOKEN}") == (200, '["job-1"]')
        assert get(server.url + f"api/state?token={TOKEN}")[0] == 200


def test_non_loopback_without_token_is_refused() -> None:
    mon = Monitor(["cpu"], interval=0.5, rules=[])
    with pytest.raises(AddressError, match="token"):
        serve_dashboard(mon, "0.0.0.0", 0)
    assert not mon.running


def test_port_in_use_is_a_clear_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        mon = Monitor(["cpu"], interval=0.5, rules=[])
        with pytest.raises(AddressError, match=f"port {port} .*already in use"):
            serve_dashboard(mon, port=port)
        assert not mon.running


def test_close_is_quick_with_streams_open() -> None:
    mon = Monitor(["cpu"], interval=0.2, rules=[])
    server = serve_dashboard(mon, port=0)
    assert mon.running and server.port > 0
    ended: list[float] = []

    def follow() -> None:
        with urllib.request.urlopen(server.url + "api/stream", timeout=10) as resp:
            while resp.readline():
                pass
        ended.append(time.monotonic())

    readers = [threading.Thread(target=follow, daemon=True) for _ in range(2)]
    for r in readers:
        r.start()
    hub = server.app.state.vramctl_hub
    deadline = time.monotonic() + 5
    while hub.clients < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert hub.clients == 2
    t0 = time.monotonic()
    server.close()
    assert time.monotonic() - t0 < 2.0
    for r in readers:
        r.join(2)
    assert len(ended) == 2
    assert not server.running and not mon.running


def test_a_running_monitor_is_left_running() -> None:
    with Monitor(["cpu"], interval=0.5, rules=[]) as mon:
        serve_dashboard(mon, port=0).close()
        assert mon.running


# -- the command ----------------------------------------------------------------------------

runner = CliRunner()


def test_cli_help() -> None:
    result = runner.invoke(cli_app, ["dashboard", "--help"])
    assert result.exit_code == 0
    for option in ("--host", "--port", "--interval", "--device", "--token", "--open"):
        assert option in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--interval", "0"], "--interval 0: give a positive number"),
        (["--host", "0.0.0.0"], "give a token"),
    ],
)
def test_cli_refuses_bad_settings(args: list[str], message: str) -> None:
    result = runner.invoke(cli_app, ["dashboard", "-d", "cpu", "--port", "0", *args])
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())
    assert "Traceback" not in result.output


def test_cli_port_in_use() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        result = runner.invoke(cli_app, ["dashboard", "-d", "cpu", "--port", str(port)])
    assert result.exit_code == 2
    assert "already in use" in result.output and "Traceback" not in result.output


def test_cli_serves_until_interrupted() -> None:
    # Ctrl-C as in a terminal: a shell's background job (`bash .ci/run &`) starts with SIGINT
    # ignored, which its children inherit, and Python then installs no KeyboardInterrupt.
    code = (
        "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "import vramctl.cli._dashboard; from vramctl.cli import main; main()"
    )
    env = {**os.environ, "COLUMNS": "200", "VRAMCTL_TOKEN": TOKEN}
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "dashboard", "-d", "cpu", "--port", "0", "-i", "0.5"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "vramctl dashboard: http://127.0.0.1:" in line, line
        url = line.split()[-1]
        assert url.endswith(f"/?token={TOKEN}")
        status, body = get(url.replace("/?", "/healthz?"))
        assert status == 200 and json.loads(body)["monitor_running"] is True
        proc.send_signal(signal.SIGINT)
        # communicate() drains both pipes while waiting: a child blocked on a full pipe
        # would otherwise look like one that does not stop.
        _, errtext = proc.communicate(timeout=30)
        assert proc.returncode == 0, errtext[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_says_a_simulated_gpu_runs_nothing() -> None:
    # `vramctl dashboard -d sim:T4-16GB`, as its --help suggests.
    code = (
        "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "import vramctl.cli._dashboard; from vramctl.cli import main; main()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "dashboard", "-d", "sim:T4-16GB", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
        cwd=ROOT,
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().split()[-1]
        status, body = get(url + "api/state")
        proc.send_signal(signal.SIGINT)
        _, errtext = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert status == 200, body
    (t4,) = json.loads(body)["devices"]
    assert t4["simulated"] is True and t4["total"] == vramctl.gpu_spec("T4-16GB").cuda_total_bytes
    assert "simulated GPU" in t4["note"]
    said = " ".join(errtext.split())
    assert "sim:T4-16GB is a simulated GPU: nothing runs on it in this process" in said, errtext
    assert "0 B in use of its 14.58 GiB" in said


# -- the address: DNS rebinding, restarts -----------------------------------------------------


def get_as(url: str, host: str | None, headers: dict[str, str] | None = None) -> tuple[int, str]:
    """GET ``url`` with the header ``Host: host``, as a browser sends it for another name."""
    parts = urllib.parse.urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        conn.putrequest("GET", path, skip_host=True)
        if host is not None:
            conn.putheader("Host", host)
        for name, value in (headers or {}).items():
            conn.putheader(name, value)
        conn.endheaders()
        resp = conn.getresponse()
        # An event stream does not end: its first bytes are enough.
        body = resp.read(200) if resp.status == 200 else resp.read()
        return resp.status, body.decode()
    finally:
        conn.close()


def test_without_a_token_only_this_machines_names_are_answered(
    served: tuple[Monitor, DashboardServer],
) -> None:
    # A web page whose own name resolves to 127.0.0.1 (DNS rebinding) must not read the API.
    _, server = served
    port = server.port
    for path in ("", "api/state", "api/stream", "metrics", "healthz", "static/dashboard.js"):
        url = server.url + path
        for host in ("evil.example", f"evil.example:{port}", f"127.0.0.1.nip.io:{port}"):
            status, body = get_as(url, host)
            assert status == 403, (path, host)
            assert "localhost" in json.loads(body)["detail"]
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost:9000", f"[::1]:{port}"):
            assert get_as(url, host)[0] == 200, (path, host)


def test_with_a_token_any_name_is_answered() -> None:
    # Behind a token (a reverse proxy, another machine's name), the Host is not checked.
    mon = Monitor(["cpu"], interval=0.5, rules=[])
    with serve_dashboard(mon, port=0, token=TOKEN) as server:
        url = server.url + "api/state"
        assert get_as(url, "dashboard.example")[0] == 401
        auth = {"Authorization": f"Bearer {TOKEN}"}
        assert get_as(url, "dashboard.example", auth)[0] == 200


def test_a_port_just_freed_can_be_served_again() -> None:
    # Stopped while a page follows it, a server closes the connection first and leaves it in
    # TIME_WAIT on its port: the command run again at once may bind it (as uvicorn does), and
    # the port is not "already in use".
    mon = Monitor(["cpu"], interval=0.5, rules=[])
    server = serve_dashboard(mon, port=0)
    port = server.port
    with open_stream(server.url + "api/stream") as resp:
        server.close()
        resp.read()  # the stream ends: the server hung up first
    with serve_dashboard(mon, port=port) as again:
        assert get(again.url + "healthz")[0] == 200
