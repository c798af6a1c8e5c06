"""The dashboard in a real headless Chromium: it loads, its charts move, alerts show up;
served with the job queue, its jobs view shows the queue, the reservations and the failures.

Screenshots go to ``test-artifacts/dashboard/``. Without Playwright or Chromium
the test is skipped, unless ``VRAMCTL_REQUIRE_BROWSER=1`` (set in CI) makes
that a failure.
"""

from __future__ import annotations

import http.server
import json
import os
import shutil
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import psutil
import pytest
import torch

from vramctl.device import ProcessMemory, SimulatedDevice
from vramctl.guard import GuardEvent
from vramctl.jobs import ACTIVE, JobSpec, JobStore, MemoryNeed
from vramctl.monitor import Alert, Level, Monitor, UsageRule
from vramctl.server import DashboardServer, JobServer, serve_dashboard, serve_jobs

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts" / "dashboard"
TOKEN = "browser-token"
SIM = "sim:T4-16GB"
HOW_TO_INSTALL = (
    "install the browser test's tools: pip install playwright, and Chromium (apt-get install "
    "chromium, or `playwright install chromium`; or point VRAMCTL_CHROMIUM at a Chrome or "
    "Chromium executable)"
)
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    # A name of another site's that resolves to this machine, as DNS rebinding makes it.
    "--host-resolver-rules=MAP rebound.example 127.0.0.1",
]


def _unavailable(reason: str) -> NoReturn:
    if os.environ.get("VRAMCTL_REQUIRE_BROWSER") == "1":
        pytest.fail(
            f"{reason}; VRAMCTL_REQUIRE_BROWSER=1 requires the browser test: {HOW_TO_INSTALL}"
        )
    pytest.skip(f"{reason} ({HOW_TO_INSTALL})")


def _chromium_path() -> str | None:
    return (
        os.environ.get("VRAMCTL_CHROMIUM")
        or shutil.which("chromium")
        or shutil.which("chromium-browser")
    )


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    try:
        from playwright.sync_api import Error, sync_playwright
    except ImportError:
        _unavailable("Playwright is not installed")
    executable = _chromium_path()
    with sync_playwright() as p:
        failed = ""
        try:  # without a system Chromium, Playwright's own (if it was installed) is tried
            b = p.chromium.launch(executable_path=executable, args=ARGS)
        except Error as exc:
            failed = str(exc).splitlines()[0]
        if failed:
            where = executable or "Playwright's own Chromium"
            _unavailable(f"Chromium could not start ({where}: {failed})")
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def served() -> Iterator[tuple[Monitor, DashboardServer]]:
    # Rules that fire on the simulated GPU once it holds 2 GiB (14% of 14.6 GiB).
    mon = Monitor(["cpu", SIM], interval=0.2, rules=[UsageRule(0.05, 0.1, kind="gpu")])
    server = serve_dashboard(mon, port=0, token=TOKEN)
    try:
        yield mon, server
    finally:
        server.close()


def points(page: Any) -> dict[str, int]:
    found: dict[str, int] = page.eval_on_selector_all(
        ".chart", "els => Object.fromEntries(els.map(e => [e.dataset.device, +e.dataset.points]))"
    )
    return found


def test_dashboard_loads_updates_and_shows_alerts(
    browser: Any, served: tuple[Monitor, DashboardServer]
) -> None:
    mon, server = served
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    outside: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on(
        "request",
        lambda req: None if req.url.startswith((server.url, "data:")) else outside.append(req.url),
    )
    page.goto(server.page_url)

    # The page loads its state, draws a chart per device, and goes live.
    page.wait_for_selector("#status[data-state=live]", timeout=10_000)
    assert page.text_content("#status") == "live"
    assert page.locator("#jobs").is_hidden()  # no job queue here
    for dev in ("cpu", SIM):
        assert page.locator(f'.device[data-device="{dev}"] .chart canvas').count() == 1
    assert "%" in (page.text_content(f'.device[data-device="{SIM}"] .figure') or "")
    first = points(page)
    assert set(first) == {"cpu", SIM}

    # The charts update from the event stream.
    page.wait_for_function(
        "n => [...document.querySelectorAll('.chart')].every(e => +e.dataset.points >= n)",
        arg=max(first.values()) + 5,
        timeout=10_000,
    )
    later = points(page)
    assert all(later[d] > first[d] for d in first), (first, later)
    page.screenshot(path=str(ARTIFACTS / "live.png"), full_page=True)

    # Memory taken on the simulated GPU fires an alert, shown in the panel.
    assert page.locator("#alerts li.alert").count() == 0
    gpu = mon.devices[1]
    assert isinstance(gpu, SimulatedDevice)
    with gpu:
        held = torch.empty(2 * 2**30, dtype=torch.uint8)
    alert = page.locator(f'#alerts li.alert.level-critical:has-text("{SIM}")')
    alert.first.wait_for(timeout=10_000)
    assert "of memory in use" in alert.first.inner_text()
    # its level's colour on its border (a feed item's own rule used to outrank the level's)
    critical = page.evaluate(
        "() => { const d = document.createElement('div'); d.style.color = 'var(--critical)';"
        " document.body.append(d); const c = getComputedStyle(d).color; d.remove(); return c; }"
    )
    assert alert.first.evaluate("e => getComputedStyle(e).borderLeftColor") == critical
    assert "firing" in (page.text_content("#active-count") or "")
    bar = page.locator(f'.device[data-device="{SIM}"] .bar')
    assert bar.get_attribute("data-level") == "critical"

    # What vramctl did shows in the activity list: an OOM the guard recovered, a leak.
    mon._guard_event(GuardEvent("oom", step=3, batch_size=32, pieces=2, piece_limit=16))
    mon.record("leak", device=SIM, rate_bytes_per_step=2**20, causes=["a list keeps growing"])
    page.locator('#activity li[data-kind="leak"]').wait_for(timeout=10_000)
    oom = page.locator('#activity li[data-kind="guard"]').inner_text()
    assert "OOM recovered" in oom and "batch 32 in 2 pieces" in oom
    time.sleep(0.5)  # a few more points after the jump, for the screenshot
    page.screenshot(path=str(ARTIFACTS / "alert.png"), full_page=True)

    # A reload starts again from /api/state, alerts and history included.
    page.reload()
    page.wait_for_selector("#status[data-state=live]", timeout=10_000)
    assert page.locator(f'#alerts li.alert:has-text("{SIM}")').count() >= 1
    assert points(page)[SIM] >= later[SIM]
    del held

    assert errors == []
    assert outside == []


def test_dashboard_without_token_says_what_to_do(
    browser: Any, served: tuple[Monitor, DashboardServer]
) -> None:
    _, server = served
    page = browser.new_page()
    response = page.goto(server.url)
    assert response is not None and response.status == 401
    assert "token" in (page.text_content("body") or "")


def test_dashboard_without_token_is_live_on_loopback_only(browser: Any) -> None:
    # Without a token the page works at 127.0.0.1; a site whose name was made to resolve to
    # 127.0.0.1 (DNS rebinding) is refused, so its scripts cannot read the API.
    mon = Monitor(["cpu"], interval=0.2, rules=[])
    with serve_dashboard(mon, port=0) as server:
        page = browser.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(server.url)
        page.wait_for_selector("#status[data-state=live]", timeout=10_000)
        assert page.locator('.device[data-device="cpu"] .chart canvas').count() == 1
        assert errors == []
        for path in ("", "api/state"):
            response = page.goto(f"http://rebound.example:{server.port}/{path}")
            assert response is not None and response.status == 403
            assert "localhost" in (page.text_content("body") or "")


XSS = "<img src=x onerror=alert(1)>"


def _watch(page: Any) -> list[str]:
    """Console errors, uncaught exceptions and dialogs (an injected script's alert())."""
    problems: list[str] = []
    page.on("pageerror", lambda exc: problems.append(f"pageerror: {exc}"))
    page.on(
        "console",
        lambda msg: problems.append(f"console: {msg.text}") if msg.type == "error" else None,
    )

    def dialog(d: Any) -> None:
        problems.append(f"dialog: {d.message}")
        d.dismiss()

    page.on("dialog", dialog)
    return problems


def test_recorded_events_alerts_and_processes_show_live_as_text(
    browser: Any, served: tuple[Monitor, DashboardServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    mon, server = served
    gpu = mon.devices[1]
    own = gpu.processes
    monkeypatch.setattr(
        gpu,
        "processes",
        lambda limit=None: (
            [ProcessMemory(4242, 3 * 2**30, name=XSS, user=XSS, command=XSS), *own(limit)]
        ),
    )
    page = browser.new_page(viewport={"width": 1200, "height": 900})
    problems = _watch(page)
    page.goto(server.page_url)
    page.wait_for_selector("#status[data-state=live]", timeout=10_000)

    # An event of the user's own kind shows in the activity list as it happens (the docs'
    # mon.record("phase", name="eval")), not only after a reload.
    mon.record("phase", name=XSS)
    phase = page.locator('#activity li[data-kind="phase"]')
    phase.wait_for(timeout=10_000)
    assert XSS in phase.inner_text()

    # Text from the server is text: an alert's message, a process's name.
    mon.alerts.dispatch(Alert("custom", Level.WARNING, SIM, XSS, suggestion=XSS))
    alert = page.locator('#alerts li[data-rule="custom"]')
    alert.wait_for(timeout=10_000)
    assert alert.inner_text().count(XSS) == 2
    row = page.locator(f'.device[data-device="{SIM}"] table.procs td:has-text("4242")')
    row.wait_for(timeout=10_000)
    assert XSS in page.locator(f'.device[data-device="{SIM}"] table.procs').inner_text()

    # Time lost under a second reads in ms, not "0.00 s".
    mon._guard_event(
        GuardEvent("oom", step=1, batch_size=8, pieces=2, piece_limit=4, time_lost=0.004)
    )
    guard = page.locator('#activity li[data-kind="guard"]')
    guard.wait_for(timeout=10_000)
    assert "4.00 ms lost" in guard.inner_text()

    assert page.locator("img").count() == 0
    assert problems == []


def test_narrow_viewport_does_not_scroll_sideways(
    browser: Any, served: tuple[Monitor, DashboardServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    mon, server = served
    gpu = mon.devices[1]
    name = "python -m torch.distributed.run --nproc_per_node=8 train_a_very_long_name.py"
    monkeypatch.setattr(
        gpu,
        "processes",
        lambda limit=None: [ProcessMemory(4242, 3 * 2**30, name=name, user="a-rather-long-user")],
    )
    page = browser.new_page(viewport={"width": 400, "height": 800})
    problems = _watch(page)
    page.goto(server.page_url)
    page.wait_for_selector("#status[data-state=live]", timeout=10_000)
    page.locator(f'.device[data-device="{SIM}"] table.procs td:has-text("4242")').wait_for()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "narrow.png"), full_page=True)
    assert page.evaluate("document.documentElement.scrollWidth") <= 400
    assert problems == []


class _BadGateway(http.server.BaseHTTPRequestHandler):
    """A reverse proxy while the dashboard behind it restarts."""

    def do_GET(self) -> None:
        self.send_response(502)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def test_page_shows_the_outage_and_comes_back_live(browser: Any) -> None:
    mon = Monitor(["cpu", SIM], interval=0.2, rules=[])
    server = serve_dashboard(mon, port=0, token=TOKEN)
    port = server.port
    page = browser.new_page()
    page.goto(server.page_url)
    page.wait_for_selector("#status[data-state=live]", timeout=10_000)
    try:
        server.close()
        page.wait_for_selector("#status[data-state=reconnecting]", timeout=10_000)
        # A proxy answers 502 for a while: EventSource gives up for good on such an answer,
        # and the page must try again itself.
        proxy = http.server.ThreadingHTTPServer(("127.0.0.1", port), _BadGateway)
        thread = threading.Thread(target=proxy.serve_forever, daemon=True)
        thread.start()
        time.sleep(3)  # the browser's own retry (2 s) reaches the proxy
        proxy.shutdown()
        proxy.server_close()
        thread.join()
        assert page.get_attribute("#status", "data-state") == "reconnecting"
        mon.record("phase", name="while-away")
        server = serve_dashboard(mon, port=port, token=TOKEN)
        page.wait_for_selector("#status[data-state=live]", timeout=10_000)
        # The page reloaded its state: what happened while it was away is there.
        page.locator('#activity li[data-kind="phase"]:has-text("while-away")').wait_for(
            timeout=10_000
        )
    finally:
        server.close()
        mon.stop()


# -- the jobs view (vramctl serve) ----------------------------------------------------------

JOBS_TOKEN = "jobs-token"
JOBS_SIM = "sim:8GiB"


@pytest.fixture
def job_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[JobServer]:
    monkeypatch.setenv("VRAMCTL_HOME", str(tmp_path))  # its settings: none
    monkeypatch.delenv("VRAMCTL_TOKEN", raising=False)
    with serve_jobs(
        port=0, store=tmp_path / "jobs.db", devices=[JOBS_SIM], token=JOBS_TOKEN, interval=0.5
    ) as server:
        yield server


def _call(method: str, url: str, body: Any = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Authorization", f"Bearer {JOBS_TOKEN}")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def _submit(server: JobServer, name: str, code: str, memory: str, **kw: Any) -> str:
    spec = {"name": name, "command": [sys.executable, "-c", code], "memory": memory, **kw}
    job_id: str = _call("POST", server.url + "jobs", spec)["id"]
    return job_id


def _cancel_all(server: JobServer, ids: list[str], timeout: float = 30.0) -> None:
    """Cancel the jobs and wait until each has ended (its process with it)."""
    for job_id in ids:
        _call("DELETE", f"{server.url}jobs/{job_id}")
    deadline = time.monotonic() + timeout
    for job_id in ids:
        while _call("GET", f"{server.url}jobs/{job_id}")["state"] in ("queued", *ACTIVE):
            assert time.monotonic() < deadline, f"job {job_id} did not end"
            time.sleep(0.05)


def test_jobs_view_shows_the_queue_the_reservations_and_the_failures(
    browser: Any, job_server: JobServer
) -> None:
    server = job_server
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    problems = _watch(page)
    outside: list[str] = []
    page.on(
        "request",
        lambda req: None if req.url.startswith((server.url, "data:")) else outside.append(req.url),
    )
    page.goto(server.dashboard.page_url)
    page.wait_for_selector("#status[data-state=live]", timeout=10_000)
    page.wait_for_selector("#jobs[data-state=live]", timeout=10_000)
    assert page.locator("#jobs").is_visible()
    assert "No job waiting" in page.locator("#queue").inner_text()

    made: list[str] = []
    try:
        # A job that runs, holding 5 GiB of the 8 GiB device (with its margin) ...
        holder = _submit(server, "holder", "import time; time.sleep(30)", "5GiB")
        made.append(holder)
        segment = page.locator(f'.jobdev[data-device="{JOBS_SIM}"] .seg[data-job="{holder}"]')
        segment.wait_for(timeout=30_000)
        # ... one too big to be admitted beside it, and one that fails.
        big = _submit(server, "too-big-for-now", "pass", "6GiB", priority=5)
        made.append(big)
        bad = _submit(server, "fails-with-3", "raise SystemExit(3)", "1GiB")
        made.append(bad)

        # The queue: the big job, its need and priority.
        row = page.locator(f'#queue tr[data-job="{big}"]')
        row.wait_for(timeout=30_000)
        cells = row.locator("td").all_inner_texts()
        assert cells[0].split()[:2] == ["too-big-for-now", big]
        assert "waiting: needs 6.60 GiB with the margin" in cells[0]  # why, under its name
        assert cells[1:3] == ["6.00 GiB", "5"]
        assert cells[3].endswith(" s")

        # The failure, with its reason.
        failure = page.locator(f'#failures li[data-job="{bad}"]')
        failure.wait_for(timeout=30_000)
        assert failure.locator(".badge").text_content() == "failed"
        assert failure.locator("b").text_content() == "fails-with-3 "
        assert failure.locator(".reason").text_content() == "exited with status 3"

        # The running job's segment: its reservation's share of the device's memory.
        reserved = _call("GET", f"{server.url}jobs/{holder}")["reserved_bytes"]
        (dev,) = _call("GET", server.url + "workers/status")["devices"]
        expected = reserved / dev["capacity_bytes"]
        assert 5 / 8 <= expected < 1
        bar = page.locator(f'.jobdev[data-device="{JOBS_SIM}"] .resbar')
        shown = segment.evaluate("s => s.getBoundingClientRect().width") / bar.evaluate(
            "b => b.clientWidth"
        )
        assert abs(shown - expected) < 0.01, (shown, expected)
        assert "holder" in segment.inner_text()
        head = page.locator(f'.jobdev[data-device="{JOBS_SIM}"] .jobdev-head').inner_text()
        assert "reserved of 8.00 GiB" in head
        assert "1 running" in page.locator("#jobs-count").inner_text()
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "jobs.png"), full_page=True)
        # On a phone it does not scroll sideways (once the charts follow the new width).
        page.set_viewport_size({"width": 400, "height": 900})
        page.wait_for_function("() => document.documentElement.scrollWidth <= 400", timeout=10_000)
        page.screenshot(path=str(ARTIFACTS / "jobs-narrow.png"), full_page=True)

        # Cancelled, the holder leaves the bar and the big job runs in its place.
        _call("DELETE", f"{server.url}jobs/{holder}")
        segment.wait_for(state="detached", timeout=30_000)
        row.wait_for(state="detached", timeout=30_000)
    finally:
        _cancel_all(server, made)
    assert problems == []
    assert outside == []


def test_jobs_view_asks_for_the_rows_it_shows_and_counts_the_rest(
    browser: Any, job_server: JobServer, tmp_path: Path
) -> None:
    server = job_server
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    problems = _watch(page)
    asked: list[str] = []
    page.on("request", lambda req: asked.append(req.url) if "workers/status" in req.url else None)
    made: list[str] = []
    try:
        holder = _submit(server, "holder", "import time; time.sleep(60)", "5GiB")
        made.append(holder)
        deadline = time.monotonic() + 30
        while _call("GET", f"{server.url}jobs/{holder}")["state"] != "running":
            assert time.monotonic() < deadline, "the holder did not start"
            time.sleep(0.05)
        # 60 jobs that wait beside it (6 GiB each, with the margin, on 8 GiB).
        with JobStore(tmp_path / "jobs.db") as store:
            for k in range(60):
                spec = JobSpec(name=f"w{k}", command=("true",), memory=MemoryNeed.of_size("6GiB"))
                made.append(store.submit(spec).id)
        page.goto(server.dashboard.page_url)
        page.wait_for_selector("#queue tr.more", timeout=30_000)
        rows = page.locator("#queue tr[data-job]")
        assert rows.count() == 50
        assert rows.first.get_attribute("data-job") == made[1]
        assert rows.last.get_attribute("data-job") == made[50]
        assert page.locator("#queue tr.more").inner_text() == "and 10 more"
        assert "(60, in submission order)" in page.locator("#queue-count").inner_text()
        # Each poll asked for the 50 rows it lists, not the whole queue.
        assert asked and all("limit=50" in url for url in asked), asked
    finally:
        _cancel_all(server, made)
    assert problems == []


def test_jobs_view_reads_the_queue_with_the_pages_token(browser: Any, tmp_path: Path) -> None:
    # A job that another scheduler of the same store admitted on a device not served here,
    # admitted before the service starts (a queued one is the service's to admit: it took
    # one so in a CI run, between the submission and the move).
    with JobStore(tmp_path / "jobs.db") as store:
        spec = JobSpec(name="elsewhere", command=("true",), memory=MemoryNeed.of_size("2GiB"))
        other = store.submit(spec).id
        # Its supervisor (this process) is alive: the service's scheduler must not take it
        # over, and its admission time is set in the same commit as its state.
        assert store.move(
            other,
            "queued",
            "admitted",
            device="sim:other",
            reserved_bytes=2 * 2**30,
            admitted_at=time.time(),
            supervisor_pid=os.getpid(),
            supervisor_started=psutil.Process().create_time(),
        )
    # On an address other than loopback every route needs the token: the page passes it on.
    with serve_jobs(
        "0.0.0.0", 0, store=tmp_path / "jobs.db", devices=[JOBS_SIM], token=JOBS_TOKEN
    ) as server:
        page = browser.new_page()
        problems = _watch(page)
        page.goto(f"http://127.0.0.1:{server.dashboard.port}/?token={JOBS_TOKEN}")
        page.wait_for_selector("#jobs[data-state=live]", timeout=10_000)
        here = page.locator(f'.jobdev[data-device="{JOBS_SIM}"]')
        here.locator(".resbar").wait_for(timeout=10_000)
        assert "no job running" in here.inner_text()
        # Its reservation is listed, against no device total.
        elsewhere = page.locator('.jobdev[data-device="sim:other"]')
        assert elsewhere.locator(".figure").text_content() == "2.00 GiB reserved"
        assert elsewhere.locator(f'li[data-job="{other}"]').count() == 1
        assert problems == []
