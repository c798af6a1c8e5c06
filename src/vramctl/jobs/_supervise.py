"""A job's supervisor: the small process that runs one job and writes how it ended.

The scheduler starts ``python -m vramctl.jobs._supervise STORE JOB_ID`` in a session of its
own, so the supervisor, and the job it starts in a process group of the job's own, go on
when the scheduler dies. The supervisor

1. moves the job from ``admitted`` to ``running`` (a compare-and-set: a second
   supervisor for the same job finds it moved and exits);
2. starts the job's argv (never through a shell), with its environment, working
   directory and log file, and the variables that give it its device and share;
3. reads its peak memory (the resident memory of its process tree on the host; on a CUDA
   device also NVML's figure for its processes) and watches for a cancel request and the
   run timeout, which stop the job's whole process group (SIGTERM, then SIGKILL);
4. writes the exit status, the peak and the final state in one commit: succeeded, failed
   (queued again while retries are left), cancelled or timed-out.

It is started as a script (``python .../_supervise.py STORE JOB_ID``) and imports nothing
of vramctl, nor PyTorch: one runs beside every job for the job's whole life, so it costs a
few MiB and starts in milliseconds. It reads and writes the store with plain SQL, the same
compare-and-set moves as :class:`vramctl.jobs.JobStore`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

__all__ = [
    "ENV_DEVICE",
    "ENV_JOB_ID",
    "ENV_RESERVED",
    "LEARN_SQL",
    "job_argv",
    "main",
    "supervise",
    "tree_rss",
]

ENV_JOB_ID = "VRAMCTL_JOB_ID"
ENV_DEVICE = "VRAMCTL_DEVICE"
ENV_RESERVED = "VRAMCTL_RESERVED_BYTES"
#: How often the supervisor reads the job's memory and the store (seconds).
POLL_S = 0.1
#: Records a run's peak for its job name, the largest kept (the store uses it too).
LEARN_SQL = (
    "INSERT INTO learned (name, peak_bytes, runs, updated_at) VALUES (?, ?, 1, ?)"
    " ON CONFLICT(name) DO UPDATE SET peak_bytes = MAX(peak_bytes, excluded.peak_bytes),"
    " runs = runs + 1, updated_at = excluded.updated_at"
)
#: Seconds between SIGTERM and SIGKILL when a job is stopped.
GRACE_S = 5.0


class _Row:
    """The fields of a job's row the supervisor reads (the spec as its JSON dict)."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.values = values
        self.spec: dict[str, Any] = json.loads(values["spec"])

    def __getattr__(self, name: str) -> Any:
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(name) from None


def job_argv(spec: dict[str, Any]) -> list[str]:
    """The argv the job runs: its command, or the bootstrap that calls its entry point."""
    if spec.get("command"):
        return [str(a) for a in spec["command"]]
    return [sys.executable, "-m", "vramctl.jobs._run", spec["entry_point"], *spec.get("args", [])]


def _environment(job: _Row) -> dict[str, str]:
    spec = job.spec
    env = dict(os.environ)
    env.update(spec.get("env", {}))
    if job.batch_size is not None and job.grad_accum is not None:
        env["VRAMCTL_BATCH_SIZE"] = str(job.batch_size)
        env["VRAMCTL_GRAD_ACCUM"] = str(job.grad_accum)
    env[ENV_JOB_ID] = job.id
    env[ENV_DEVICE] = job.device or "cpu"
    env[ENV_RESERVED] = str(job.reserved_bytes or 0)
    device = job.device or "cpu"
    if device != "cpu" and spec.get("command"):
        # Python commands are held to their share by the bootstrap in this folder.
        site = str(Path(__file__).resolve().parent / "_site")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (site, env.get("PYTHONPATH")) if p)
    if device.startswith("cuda:"):
        env["CUDA_VISIBLE_DEVICES"] = device.split(":", 1)[1]
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    return env


class _Store:
    """The few reads and compare-and-set writes a supervisor makes, in plain SQL."""

    def __init__(self, path: str) -> None:
        self.conn = sqlite3.connect(path, timeout=30.0, isolation_level=None)
        self.conn.execute("PRAGMA journal_mode = WAL")
        self.conn.execute("PRAGMA synchronous = NORMAL")

    def get(self, job_id: str) -> _Row:
        cur = self.conn.execute("SELECT * FROM jobs WHERE id = ?", (job_id,))
        row = cur.fetchone()
        if row is None:
            raise LookupError(f"no job {job_id!r}")
        return _Row(dict(zip([d[0] for d in cur.description], row, strict=True)))

    def move(self, job_id: str, frm: str, to: str, **values: Any) -> bool:
        sets = ", ".join(["state = ?", *(f"{k} = ?" for k in values)])
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            cur = self.conn.execute(
                f"UPDATE jobs SET {sets} WHERE id = ? AND state = ?",
                (to, *values.values(), job_id, frm),
            )
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")
        return cur.rowcount == 1

    def update(self, job_id: str, **values: Any) -> None:
        sets = ", ".join(f"{k} = ?" for k in values)
        self.conn.execute(f"UPDATE jobs SET {sets} WHERE id = ?", (*values.values(), job_id))

    def learn(self, name: str, peak: int) -> None:
        self.conn.execute(LEARN_SQL, (name, int(peak), time.time()))


def tree_rss(pid: int) -> int:
    """The resident memory of process ``pid`` and its descendants (0 if it is gone)."""
    total = 0
    with contextlib.suppress(psutil.Error):
        proc = psutil.Process(pid)
        for p in [proc, *proc.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                total += p.memory_info().rss
    return total


def _stop(pgid: int) -> None:
    """SIGTERM the job's process group, then SIGKILL what is left after the grace."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def supervise(store: _Store, job_id: str) -> str | None:
    """Run ``job_id`` to its end; returns the state it ended in (None: not this one's)."""
    me = psutil.Process()
    job = store.get(job_id)
    if not store.move(
        job_id,
        "admitted",
        "running",
        supervisor_pid=me.pid,
        supervisor_started=me.create_time(),
        started_at=time.time(),
        attempts=job.attempts + 1,
    ):
        return None
    job = store.get(job_id)
    log_path = job.log_path or os.devnull
    os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
    cwd = job.spec.get("cwd")
    argv = job_argv(job.spec)
    try:
        with open(log_path, "ab") as log:
            child = subprocess.Popen(
                argv,
                cwd=cwd,
                env=_environment(job),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
    except OSError as exc:
        failed = f"could not start {argv[0]!r}: {exc.strerror or exc}"
        return _finish(store, job, "failed", None, 0, failed)
    store.update(job_id, pid=child.pid)
    peak = 0
    reason: str | None = None
    state: str | None = None
    run_timeout = job.spec.get("run_timeout")
    deadline = time.monotonic() + run_timeout if run_timeout is not None else None
    next_read = 0.0
    while child.poll() is None:
        peak = max(peak, tree_rss(child.pid))
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            state, reason = "timed-out", f"ran past its run timeout of {run_timeout:g} s"
            _stop(child.pid)
            break
        if now >= next_read:
            next_read = now + 0.5
            if store.get(job_id).cancel_requested:
                state, reason = "cancelled", "cancelled"
                _stop(child.pid)
                break
        time.sleep(POLL_S)
    code = child.wait()
    if state is None:
        state = "succeeded" if code == 0 else "failed"
        if code != 0:
            reason = f"exited with status {code}" if code > 0 else f"killed by signal {-code}"
    return _finish(store, job, state, code, peak, reason)


def _finish(
    store: _Store, job: _Row, state: str, code: int | None, peak: int, reason: str | None
) -> str:
    now = time.time()
    if state == "succeeded" and peak:
        store.learn(job.name, peak)
    retry = state == "failed" and job.attempts <= job.spec.get("retries", 0)  # attempts made
    if retry and store.move(
        job.id, "running", "queued", exit_code=code, peak_bytes=peak or None, reason=reason
    ):
        return "queued"
    store.move(
        job.id,
        "running",
        state,
        exit_code=code,
        peak_bytes=peak or None,
        reason=reason,
        finished_at=now,
    )
    return state


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: python _supervise.py STORE JOB_ID", file=sys.stderr)
        return 2
    # The scheduler's own signals (Ctrl-C in its terminal) are not the job's.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    store = _Store(args[0])
    try:
        supervise(store, args[1])
    finally:
        store.conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
