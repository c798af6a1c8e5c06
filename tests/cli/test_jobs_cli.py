"""``vramctl run``, ``submit``, ``jobs``, ``logs`` and ``cancel`` against a real store."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from typer.testing import CliRunner

from vramctl.cli._app import app
from vramctl.device import resolve
from vramctl.jobs import JobSpec, JobStore, MemoryNeed, Scheduler

runner = CliRunner()
PY = sys.executable


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("VRAMCTL_HOME", str(tmp_path))
    return tmp_path


def test_run_shows_the_jobs_output_and_exits_with_its_status(home: Path) -> None:
    ok = runner.invoke(
        app, ["run", "-m", "1GiB", "--devices", "sim:4GiB", "--", PY, "-c", "print('hello')"]
    )
    assert ok.exit_code == 0, ok.output
    assert "hello" in ok.stdout
    assert "succeeded on sim:4GiB" in ok.stderr
    bad = runner.invoke(
        app,
        ["run", "-m", "1GiB", "--devices", "sim:4GiB", "--", PY, "-c", "raise SystemExit(7)"],
    )
    assert bad.exit_code == 7
    assert "exited with status 7" in bad.stderr
    with JobStore(home / "jobs.db") as s:
        assert [j.state for j in s.list()] == ["succeeded", "failed"]


def test_run_waits_for_room_then_says_how_much_there_was(home: Path) -> None:
    # Another job holds 3 GiB of the device (its supervisor: this process, alive).
    with JobStore(home / "jobs.db") as s:
        other = s.submit(_spec("other", "pass", "3GiB"))
        me = psutil.Process()
        s.move(other.id, "queued", "running", device="sim:4GiB", reserved_bytes=3 * 2**30)
        s.update(other.id, supervisor_pid=me.pid, supervisor_started=me.create_time())
    result = runner.invoke(
        app,
        ["run", "-m", "2GiB", "--devices", "sim:4GiB", "--wait-timeout", "0.3", "--", "true"],
    )
    assert result.exit_code == 1
    assert "no device had 2.00 GiB free within 0.3 s (largest free: 1.00 GiB on sim:4GiB)" in (
        " ".join(result.stderr.split())
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "-m", "1GiB"], "no command: put it after --"),
        (["run", "-m", "1GiB", "--", "python train.py"], "is one argument, and vramctl runs"),
        (["submit", "--", "python", "x.py"], "memory: missing"),
        (["submit", "-m", "-3GiB", "--", "true"], "memory"),
        (["submit", "-m", "1GiB", "--label", "oops", "--", "true"], "--label 'oops'"),
        (["jobs", "--state", "done"], "unknown job state 'done'"),
        (["logs", "nope"], "no job 'nope'"),
        (["scheduler", "--policy", "first-fit"], "unknown placement policy"),
        (["submit", "-m", "1GiB", "--guard", "steps", "--", "true"], "guard.function: must be"),
        (["submit", "-m", "1GiB", "--guard-optimizer", "m:o", "--", "true"], "goes with --guard"),
    ],
)
def test_bad_input_is_one_line_and_status_2(home: Path, args: list[str], message: str) -> None:
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.stderr.split())
    assert "Traceback" not in result.output


def test_submit_list_cancel_and_logs(home: Path, tmp_path: Path) -> None:
    spec = tmp_path / "job.toml"
    spec.write_text('name = "train"\ncommand = ["true"]\nmemory = "2GiB"\n[labels]\nteam = "asr"\n')
    first = runner.invoke(app, ["submit", "--spec", str(spec), "--json"])
    assert first.exit_code == 0, first.output
    job = json.loads(first.stdout)
    assert (job["name"], job["state"]) == ("train", "queued")
    second = runner.invoke(app, ["submit", "-m", "1GiB", "--name", "other", "--", "true"])
    assert second.exit_code == 0 and "queued job" in second.stdout
    listed = json.loads(runner.invoke(app, ["jobs", "--json", "--label", "team=asr"]).stdout)
    assert [j["id"] for j in listed["jobs"]] == [job["id"]]
    cancelled = runner.invoke(app, ["cancel", job["id"]])
    assert cancelled.exit_code == 0 and f"cancelled job {job['id']}" in cancelled.stdout
    table = runner.invoke(app, ["jobs", "--state", "cancelled"], env={"COLUMNS": "120"})
    assert job["id"] in table.stdout and "other" not in table.stdout
    log = Path(JobStore(home / "jobs.db").get(job["id"]).log_path or "")
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("line one\n")
    shown = runner.invoke(app, ["logs", job["id"]])
    assert shown.exit_code == 0 and shown.stdout == "line one\n"


def test_a_job_that_can_never_fit_is_refused_at_once(home: Path) -> None:
    # Without the check it would wait for room that never comes (here: 5 s, then fail).
    result = runner.invoke(
        app,
        ["run", "-m", "100GiB", "--devices", "sim:T4-16GB", "--wait-timeout", "5", "--", "true"],
    )
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == (
        "error: job 'true' cannot be placed: memory: needs 110.00 GiB with the 10% margin "
        "but the largest device, sim:T4-16GB, has 14.58 GiB"
    )
    submitted = runner.invoke(
        app, ["submit", "-m", "14GiB", "--devices", "sim:T4-16GB", "--", "true"]
    )
    assert submitted.exit_code == 2 and "needs 15.40 GiB with the 10% margin" in submitted.stderr
    with JobStore(home / "jobs.db") as s:
        assert s.list() == []  # nothing queued
    fits = runner.invoke(app, ["submit", "-m", "13GiB", "--devices", "sim:T4-16GB", "--", "true"])
    assert fits.exit_code == 0 and "queued job" in fits.stdout


def test_jobs_shows_whole_ids_that_logs_and_cancel_take_by_prefix(home: Path) -> None:
    name = "train-asr-whisper-large-v3-on-the-whole-corpus"
    for n in (name, "eval"):
        made = runner.invoke(app, ["submit", "-m", "9GiB", "--name", n, "--", "true"])
        assert made.exit_code == 0, made.output
    with JobStore(home / "jobs.db") as s:
        first, second = (j.id for j in s.list())
        Scheduler(s, devices=[resolve("sim:4GiB")]).run_once()  # says why they wait
        log = Path(s.get(first).log_path or "")
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("line one\n")
    table = runner.invoke(app, ["jobs"], env={"COLUMNS": "80"})
    assert table.exit_code == 0, table.output
    assert "…" not in table.stdout
    assert first in table.stdout and second in table.stdout
    waiting = (
        f"{first} waiting: needs 9.90 GiB with the margin; the largest device has 4.00 GiB "
        "(sim:4GiB): no device here can ever take it"
    )
    assert waiting in table.stdout
    listed = json.loads(runner.invoke(app, ["jobs", "--json"]).stdout)["jobs"]
    assert listed[0]["reason"].startswith("waiting: needs 9.90 GiB")
    shown = runner.invoke(app, ["logs", first[:8]])
    assert shown.exit_code == 0 and shown.stdout == "line one\n"
    cancelled = runner.invoke(app, ["cancel", second[:8]])
    assert cancelled.exit_code == 0 and f"cancelled job {second}" in cancelled.stdout
    with JobStore(home / "jobs.db") as s:
        assert [j.state for j in s.list()] == ["queued", "cancelled"]
        with sqlite3.connect(s.path) as conn:  # ids that share their first 7 characters
            conn.execute("UPDATE jobs SET id = 'cafe0001aaaa' WHERE id = ?", (first,))
            conn.execute("UPDATE jobs SET id = 'cafe0002bbbb' WHERE id = ?", (second,))
        conn.close()
    for command in ("logs", "cancel"):
        both = runner.invoke(app, [command, "cafe000"])
        assert both.exit_code == 2
        assert both.stderr.strip() == (
            f"error: job id 'cafe000' is ambiguous: it matches cafe0001aaaa ({name}), "
            "cafe0002bbbb (eval); give more of it"
        )
    unknown = runner.invoke(app, ["cancel", "beef0000"])
    assert unknown.exit_code == 2 and "no job 'beef0000'" in unknown.stderr


def _ctrl_c_stops() -> None:
    """In the child: SIGINT as a terminal's Ctrl-C, even where the tests run with it
    ignored (a background job of a shell), which Python would otherwise keep ignoring."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_the_scheduler_prints_each_jobs_events(home: Path, tmp_path: Path) -> None:
    argv = [PY, "-m", "vramctl", "scheduler", "--devices", "sim:4GiB"]
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
        preexec_fn=_ctrl_c_stops,
    )
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        for line in proc.stderr or []:
            lines.put(line)

    reader = threading.Thread(target=read)
    reader.start()
    seen: list[str] = []

    def expect(pattern: str, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in seen:
                if re.search(pattern, line):
                    seen.remove(line)
                    return line
            try:
                seen.append(lines.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                break
        raise AssertionError(f"no line matches {pattern!r}; got {seen}")

    stamp = r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d job "
    try:
        expect("scheduling the jobs of")
        with JobStore(home / "jobs.db") as s:
            ok = s.submit(_spec("ok", "print('hi')"))
            flaky = s.submit(_spec("flaky", "raise SystemExit(3)", retries=1))
            big = s.submit(_spec("big", "pass", "9GiB"))
            expect(stamp + rf"{ok.id} \(ok\) admitted on sim:4GiB: needs 1\.00 GiB, 1\.10 GiB")
            expect(stamp + rf"{ok.id} \(ok\) finished with exit code 0 after \d+\.\d s")
            expect(stamp + rf"{flaky.id} \(flaky\) admitted on sim:4GiB")
            expect(stamp + rf"{flaky.id} \(flaky\) queued again after attempt 1 of 2: exited with")
            expect(stamp + rf"{flaky.id} \(flaky\) failed with exit code 3 after ")
            expect(stamp + rf"{big.id} \(big\) waiting: needs 9\.90 GiB with the margin;")
            s.cancel(big.id)
            expect(stamp + rf"{big.id} \(big\) cancelled$")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        finally:
            proc.kill()
            reader.join(timeout=10)
    assert proc.returncode == 0


def test_the_scheduler_prices_estimates_outside_its_process(home: Path) -> None:
    # A job whose model aborts the process that builds it fails alone; the scheduler goes on.
    argv = [PY, "-m", "vramctl", "scheduler", "--devices", "sim:4GiB"]
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_ctrl_c_stops
    )
    try:
        with JobStore(home / "jobs.db") as s:
            boom = s.submit(
                JobSpec(
                    name="boom",
                    command=(PY, "-c", "pass"),
                    memory=MemoryNeed.from_value({"estimate": {"model": "os:abort"}}),
                )
            )
            ok = s.submit(_spec("ok", "pass"))
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                if {s.get(boom.id).state, s.get(ok.id).state} <= {"failed", "succeeded"}:
                    break
                time.sleep(0.1)
            failed = s.get(boom.id)
            assert failed.state == "failed", failed.reason
            assert "worker process died" in (failed.reason or "")
            assert s.get(ok.id).state == "succeeded"
        assert proc.poll() is None  # the scheduler lives on
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        finally:
            proc.kill()


def _spec(name: str, code: str, need: str = "1GiB", **kw: Any) -> JobSpec:
    return JobSpec(name=name, command=(PY, "-c", code), memory=MemoryNeed.of_size(need), **kw)


def test_run_guards_the_function_the_command_line_names(home: Path, tmp_path: Path) -> None:
    (tmp_path / "steps.py").write_text(
        "import torch\n\ndef embed(batch):\n"
        "    torch.empty(batch.shape[0], 2**26, dtype=torch.uint8)\n"
        "    return batch.sum(dim=1)\n"
    )
    code = "import torch, steps; print('rows', steps.embed(torch.ones(32, 4)).shape[0])"
    args = ["run", "-m", "1GiB", "--devices", "sim:4GiB", "--cwd", str(tmp_path)]
    plain = runner.invoke(app, [*args, "--overrun-retries", "0", "--", PY, "-c", code])
    assert plain.exit_code == 1 and "OutOfMemoryError" in plain.stdout
    assert "ran out of memory under its share of 1.10 GiB" in plain.output, plain.output
    guarded = runner.invoke(app, [*args, "--guard", "steps:embed", "--", PY, "-c", code])
    assert guarded.exit_code == 0, guarded.output
    assert "rows 32" in guarded.stdout and "the guard of steps:embed ran 1 of 1" in guarded.stdout
    with JobStore(home / "jobs.db") as s:
        assert s.list()[-1].spec.guard is not None
