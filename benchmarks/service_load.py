"""Does the job service hold up under many clients at once, and lose nothing?

A real ``vramctl serve`` in a process of its own (an empty store in a temporary folder, two
simulated GPUs, its scheduler and supervisors), and C concurrent clients (threads, each
its own HTTP connections, the standard library's ``urllib``) for S seconds. Each client
loops: submit a job (``POST /jobs``, with the token; the job is ``/bin/true`` with a need
drawn, seeded, from 0.5-4 GiB), then poll it (``GET /jobs/{id}``) three times, and list a
page of the queue (``GET /jobs?limit=20``) once. Jobs are admitted by memory as they come,
so the queue grows while the clients run. After the clients stop, what is still queued is
cancelled through the API and what runs is let finish (up to 60 s); then the store is
read: every job a client was told was queued must be there, in an end state.

Figures: ``requests``, ``requests_per_s``, latency p50/p99 per route and overall (ms),
``errors`` (answers other than the one expected, or no answer), ``jobs_submitted``,
``jobs_lost`` (a submitted id missing from the store, or not in an end state at the end:
goal 0), ``jobs_finished``.

Then a listing at scale: a fresh store filled with 50,000 finished jobs (one transaction), a
service on it, and ``GET /jobs?limit=1`` (and ``?state=succeeded&limit=1``) timed, the median
of a few: ``list_limit1_ms_at_50k`` and ``list_state_limit1_ms_at_50k`` (goal: under
:data:`LIST_GOAL_MS`; the list once read and decoded every job, 3.3-3.9 s).

    python benchmarks/service_load.py --quick   # 50 clients, 10 s; under a minute
    python benchmarks/service_load.py           # 200 clients, 30 s
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

import _common

GiB = 2**30
DEVICES = "sim:T4-16GB,sim:16GiB"
END = ("succeeded", "failed", "cancelled", "timed-out")


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return round(1000 * s[min(len(s) - 1, round(q * (len(s) - 1)))], 2)


def request(url: str, token: str | None, body: Any = None, method: str = "GET") -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, None


def start(folder: Path) -> tuple[subprocess.Popen[str], str]:
    env = {**os.environ, "VRAMCTL_HOME": str(folder), "COLUMNS": "200"}
    env.pop("VRAMCTL_TOKEN", None)
    argv = [sys.executable, "-m", "vramctl", "serve", "--port", "0", "--devices", DEVICES]
    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    found = re.search(r"http://127\.0\.0\.1:\d+/", line)
    if not found:
        proc.kill()
        raise SystemExit(f"vramctl serve did not start: {line!r}")
    return proc, found.group(0)


def client(
    k: int, url: str, token: str, stop: float, out: dict[str, list[float]], ids: list[str]
) -> list[str]:
    rng = random.Random(k)
    errors: list[str] = []

    def timed(route: str, path: str, body: Any = None, method: str = "GET") -> Any:
        t0 = time.perf_counter()
        try:
            status, doc = request(url + path, token, body, method)
        except OSError as exc:
            errors.append(f"{route}: {exc}")
            return None
        out[route].append(time.perf_counter() - t0)
        want = 201 if method == "POST" else 200
        if status != want:
            errors.append(f"{route}: {status}")
            return None
        return doc

    while time.monotonic() < stop:
        need = int(rng.uniform(0.5, 4.0) * GiB)
        spec = {"name": f"load{k}", "command": ["true"], "memory": need}
        made = timed("POST /jobs", "jobs", spec, "POST")
        if made is None:
            continue
        ids.append(made["id"])
        for _ in range(3):
            timed("GET /jobs/{id}", f"jobs/{made['id']}")
        timed("GET /jobs", "jobs?limit=20")
    return errors


def run(clients: int, seconds: float, keep: bool) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix="vramctl-service-load-"))
    proc, url = start(folder)
    token = (folder / "token").read_text().strip()
    out: dict[str, list[float]] = defaultdict(list)
    ids: list[str] = []
    errors: list[str] = []
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def one(k: int) -> None:
        mine = client(k, url, token, stop, out, ids)
        with lock:
            errors.extend(mine)

    t0 = time.monotonic()
    threads = [threading.Thread(target=one, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    # What is still queued is cancelled (through the API); what runs is let finish.
    while True:
        status, page = request(url + "jobs?state=queued&limit=1000", token)
        if status != 200 or not page["jobs"]:
            break
        for job in page["jobs"]:
            request(f"{url}jobs/{job['id']}", token, method="DELETE")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status, page = request(url + "jobs?state=admitted,running&limit=1", token)
        if status == 200 and page["total"] == 0:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)

    from vramctl.jobs import JobStore

    with JobStore(folder / "jobs.db") as store:
        stored = {j.id: j.state for j in store.list()}
    lost = [i for i in ids if stored.get(i) not in END]
    everything = [v for values in out.values() for v in values]
    n = len(everything)
    summary = {
        "clients": clients,
        "seconds": seconds,
        "requests": n,
        "requests_per_s": round(n / wall, 1) if wall else None,
        "latency_p50_ms": pct(everything, 0.5),
        "latency_p99_ms": pct(everything, 0.99),
        "routes": {
            route: {"requests": len(v), "p50_ms": pct(v, 0.5), "p99_ms": pct(v, 0.99)}
            for route, v in sorted(out.items())
        },
        "errors": len(errors),
        "error_kinds": sorted(set(errors))[:10],
        "jobs_submitted": len(ids),
        "jobs_lost": len(lost),
        "jobs_finished": sum(1 for i in ids if stored.get(i) == "succeeded"),
        "jobs_cancelled_after": sum(1 for i in ids if stored.get(i) == "cancelled"),
    }
    if keep:
        print(f"the store and logs: {folder}", file=sys.stderr)
    else:
        shutil.rmtree(folder, ignore_errors=True)
    return summary


def fill(path: Path, n: int) -> None:
    """A store at ``path`` with ``n`` finished jobs (of distinct names and labels), written
    in one transaction."""
    import sqlite3

    from vramctl.jobs import JobSpec, JobStore, MemoryNeed

    JobStore(path).close()  # the schema, as the service makes it
    base = JobSpec(name="x", command=("true",), memory=MemoryNeed.of_size("1GiB")).to_dict()
    now = time.time()
    states = ("succeeded", "failed", "cancelled")
    rows = []
    for i in range(n):
        spec = json.dumps({**base, "name": f"listed{i}", "labels": {"batch": str(i % 100)}})
        job_id = f"{i:012x}"
        state = states[i % len(states)]
        log = str(path.parent / "logs" / f"{job_id}.log")
        rows.append((job_id, f"listed{i}", spec, state, now - n + i, now, log))
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(
            "INSERT INTO jobs (id, name, spec, state, submitted_at, finished_at, log_path)"
            " VALUES (?, ?, ?, ?, ?, ?, ?)",
            rows,
        )
        conn.execute("COMMIT")
    finally:
        conn.close()


def list_at_scale(n: int, repeats: int = 7, budget_s: float = 30.0) -> dict[str, Any]:
    """Median milliseconds of ``GET /jobs?limit=1`` (and ``?state=succeeded&limit=1``) from a
    service whose store holds ``n`` jobs; at most ``repeats`` tries or ``budget_s`` each."""
    folder = Path(tempfile.mkdtemp(prefix="vramctl-service-list-"))
    try:
        fill(folder / "jobs.db", n)
        proc, url = start(folder)
        token = (folder / "token").read_text().strip()
        got: dict[str, Any] = {}
        try:
            for key, path in (
                ("list_limit1", "jobs?limit=1"),
                ("list_state_limit1", "jobs?state=succeeded&limit=1"),
            ):
                status, page = request(url + path, token)  # the first, untimed
                if status != 200 or page["total"] < 1 or len(page["jobs"]) != 1:
                    raise SystemExit(f"GET /{path} answered {status}: {page!r:.200}")
                times: list[float] = []
                stop = time.monotonic() + budget_s
                while len(times) < repeats and time.monotonic() < stop:
                    t0 = time.perf_counter()
                    request(url + path, token)
                    times.append(time.perf_counter() - t0)
                got[f"{key}_ms_at_{n // 1000}k"] = pct(times, 0.5)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
        return got
    finally:
        shutil.rmtree(folder, ignore_errors=True)


#: ``GET /jobs?limit=1`` at 50,000 jobs: the goal (milliseconds, median).
LIST_GOAL_MS = 250.0


def main(argv: list[str] | None = None) -> int:
    ap = _common.parser(__doc__, quick="50 clients for 10 s")
    ap.add_argument("--clients", type=int, help="concurrent clients (default 200; --quick 50)")
    ap.add_argument("--seconds", type=float, help="how long they run (default 30; --quick 10)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary store and logs")
    ap.add_argument(
        "--list-jobs",
        type=int,
        default=50_000,
        help="jobs in the store the listing is timed against (default 50,000; 0 skips it)",
    )
    args = _common.parse(ap, argv)
    clients = args.clients or (50 if args.quick else 200)
    seconds = args.seconds or (10.0 if args.quick else 30.0)
    summary = run(clients, seconds, args.keep)
    listed = list_at_scale(args.list_jobs) if args.list_jobs > 0 else {}
    summary.update(listed)
    for key in ("requests_per_s", "latency_p99_ms", "errors", "jobs_lost", *listed):
        print(f"{key}: {summary[key]}", file=sys.stderr)
    list_ok = all(v is not None and v < LIST_GOAL_MS for v in listed.values())
    summary["goal_met"] = summary["jobs_lost"] == 0 and summary["errors"] == 0 and list_ok
    return _common.finish(summary, summary["goal_met"])


if __name__ == "__main__":
    sys.exit(main())
