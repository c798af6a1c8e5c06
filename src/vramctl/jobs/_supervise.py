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
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import psutil

from vramctl.jobs._need import job_env
from vramctl.jobs._store import Job, JobStore

__all__ = ["ENV_DEVICE", "ENV_JOB_ID", "ENV_RESERVED", "job_argv", "main", "supervise"]

ENV_JOB_ID = "VRAMCTL_JOB_ID"
ENV_DEVICE = "VRAMCTL_DEVICE"
ENV_RESERVED = "VRAMCTL_RESERVED_BYTES"
#: How often the supervisor reads the job's memory and the store (seconds).
POLL_S = 0.1
#: Seconds between SIGTERM and SIGKILL when a job is stopped.
GRACE_S = 5.0


def job_argv(job: Job) -> list[str]:
    """The argv the job runs: its command, or the bootstrap that calls its entry point."""
    spec = job.spec
    if spec.command is not None:
        return list(spec.command)
    assert spec.entry_point is not None
    return [sys.executable, "-m", "vramctl.jobs._run", spec.entry_point, *spec.args]


def _environment(job: Job) -> dict[str, str]:
    spec = job.spec
    env = dict(os.environ)
    env.update(spec.env)
    if job.batch_size is not None and job.grad_accum is not None:
        env.update(job_env(spec, job.batch_size, job.grad_accum))
    env[ENV_JOB_ID] = job.id
    env[ENV_DEVICE] = job.device or "cpu"
    env[ENV_RESERVED] = str(job.reserved_bytes or 0)
    device = job.device or "cpu"
    if device != "cpu" and spec.command is not None:
        # Python commands are held to their share by the bootstrap in this folder.
        site = str(Path(__file__).resolve().parent / "_site")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (site, env.get("PYTHONPATH")) if p)
    if device.startswith("cuda:"):
        env["CUDA_VISIBLE_DEVICES"] = device.split(":", 1)[1]
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    return env


def _tree_rss(proc: psutil.Process) -> int:
    total = 0
    with contextlib.suppress(psutil.Error):
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


def supervise(store: JobStore, job_id: str) -> str | None:
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
    cwd = job.spec.cwd
    try:
        with open(log_path, "ab") as log:
            child = subprocess.Popen(
                job_argv(job),
                cwd=cwd,
                env=_environment(job),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
    except OSError as exc:
        failed = f"could not start {job_argv(job)[0]!r}: {exc.strerror or exc}"
        return _finish(store, job, "failed", None, 0, failed)
    store.update(job_id, pid=child.pid)
    proc = psutil.Process(child.pid)
    peak = 0
    reason: str | None = None
    state: str | None = None
    deadline = time.monotonic() + job.spec.run_timeout if job.spec.run_timeout is not None else None
    next_read = 0.0
    while child.poll() is None:
        peak = max(peak, _tree_rss(proc))
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            state, reason = "timed-out", f"ran past its run timeout of {job.spec.run_timeout:g} s"
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
    store: JobStore, job: Job, state: str, code: int | None, peak: int, reason: str | None
) -> str:
    now = time.time()
    if state == "succeeded" and peak:
        store.learn(job.name, peak)
    retry = state == "failed" and job.attempts <= job.spec.retries  # attempts made so far
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
        print("usage: python -m vramctl.jobs._supervise STORE JOB_ID", file=sys.stderr)
        return 2
    # The scheduler's own signals (Ctrl-C in its terminal) are not the job's.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with JobStore(args[0]) as store:
        supervise(store, args[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
