"""Does the job queue lose or run twice a job when its scheduler is killed; how fast is it?

Real processes on this machine: a job store in a temporary folder, N tiny jobs queued at
once (each a real process, ``python -S -c``, that appends its job id to one file with
``O_APPEND`` and exits, so the file counts the runs), needs drawn from a seeded uniform
distribution of 0.5-6 GiB, on two simulated GPUs (``sim:T4-16GB`` and ``sim:16GiB``; with
``--cuda``, this machine's GPUs), so that several run at once. The scheduler is the
library's own ``Scheduler`` in a process of its own, with the default supervisors; it is
killed with SIGKILL three times mid-run (when a seeded share of the jobs has finished, plus
a seeded delay of up to half a second, so that the kill lands anywhere in a round) and
started again at once.

Figures:

- ``jobs_lost``: jobs that ended other than ``succeeded``, or whose id is not in the file;
  ``jobs_run_twice``: ids written more than once; ``jobs_unfinished``: jobs still queued or
  running when the time ran out (``--timeout``; 50 s with ``--quick``), which also fail the
  no-loss goal.
- ``admission_p50_ms`` / ``admission_p99_ms``: per admission, the time from the start of
  the scheduler round that admitted the job to the commit of its admission (the round's
  ``run_once``: adoption, reading the queue and the ledger, placement, and the supervisors
  started before it in the same round). Rounds cut short by a kill leave no record; their
  admissions are counted in ``admissions_unmeasured``.
- ``wait_p50_ms`` / ``wait_p99_ms``: what the polling interval adds: per admission in a
  round that is not the first of its scheduler's life, the time from the first job end
  after the previous round began (the room that round could not yet see) to the admission.
- ``round_p50_ms`` / ``round_p99_ms``: whole rounds; ``restart_s``: the mean time from a
  kill to the next scheduler's first round; ``supervisor_start_p50_s``: from a job's
  admission to its supervisor's start (mostly its imports); ``wall_s`` and ``jobs_per_s``.

Goals: 0 lost, 0 run twice, ``admission_p99_ms`` at most 10.

    python benchmarks/scheduler_live.py --quick   # 200 jobs, killed 3 times; under a minute
    python benchmarks/scheduler_live.py           # 1,000 jobs, killed 3 times
"""

from __future__ import annotations

import bisect
import collections
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common

GiB = 2**30
GOAL_P99_MS = 10.0
KILLS = 3
SIM_DEVICES = ("sim:T4-16GB", "sim:16GiB")

# The job: one real process that writes its id once (O_APPEND: whole lines, never torn).
JOB = (
    "import os, sys\n"
    "fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)\n"
    "os.write(fd, (os.environ['VRAMCTL_JOB_ID'] + '\\n').encode())\n"
)

# The scheduler's process: the library's Scheduler, each round timed into a file
# (one O_APPEND line per round, written after the round: a killed round leaves none).
SCHEDULER = """
import os, sys, time
from vramctl.device import simulate
from vramctl.jobs import JobStore, Scheduler

store, rounds, interval = sys.argv[1], sys.argv[2], float(sys.argv[3])
devices = [simulate(d) for d in sys.argv[4:]] or None
fd = os.open(rounds, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)


class Timed(Scheduler):
    def run_once(self):
        t0 = time.time()
        got = super().run_once()
        os.write(fd, f"{os.getpid()} {t0!r} {time.time()!r} {len(got)}\\n".encode())
        return got


Timed(JobStore(store), devices=devices, interval_s=interval).run()
"""


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def ms(value: float | None) -> float | None:
    return None if value is None else round(1000 * value, 2)


def start_scheduler(folder: Path, interval: float, devices: list[str]) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-c", SCHEDULER, str(folder / "jobs.db"), str(folder / "rounds")]
    with open(folder / "scheduler.log", "ab") as log:
        return subprocess.Popen(
            [*argv, repr(interval), *devices],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log,
        )


def run(
    n: int, seed: int, interval: float, devices: list[str], timeout: float, keep: bool
) -> dict[str, Any]:
    from vramctl.jobs import JobSpec, JobStore, MemoryNeed

    rng = random.Random(seed)
    folder = Path(tempfile.mkdtemp(prefix="vramctl-scheduler-live-"))
    ran = folder / "ran"
    store = JobStore(folder / "jobs.db")
    for i in range(n):
        need = int(rng.uniform(0.5, 6.0) * GiB)
        command = (sys.executable, "-S", "-c", JOB, str(ran))
        store.submit(JobSpec(name=f"job{i}", command=command, memory=MemoryNeed.of_size(need)))
    # When to kill: after a seeded share of the jobs has finished, plus a seeded delay.
    kill_at = sorted(rng.uniform(0.1, 0.85) for _ in range(KILLS))
    delays = [rng.uniform(0.0, 0.5) for _ in range(KILLS)]

    t_start = time.time()
    proc = start_scheduler(folder, interval, devices)
    kills: list[float] = []
    deadline = time.monotonic() + timeout
    done = False
    try:
        while time.monotonic() < deadline:
            counts = store.counts()
            finished = sum(counts[s] for s in ("succeeded", "failed", "cancelled", "timed-out"))
            if not any(counts[s] for s in ("queued", "admitted", "running")):
                done = True
                break
            if len(kills) < KILLS and finished >= kill_at[len(kills)] * n:
                time.sleep(delays[len(kills)])
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                kills.append(time.time())
                proc = start_scheduler(folder, interval, devices)
                continue
            time.sleep(0.05)
    finally:  # never leave a scheduler behind
        t_end = time.time()
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    jobs = store.list()
    store.close()
    runs = collections.Counter(ran.read_text().split() if ran.exists() else [])
    unfinished = [j for j in jobs if not j.finished]  # still there when time ran out
    lost = [j for j in jobs if j.finished and (j.state != "succeeded" or runs[j.id] == 0)]
    twice = [i for i, c in runs.items() if c > 1]

    # The rounds, in the order they started; each scheduler's life is its pid.
    rounds = []
    for line in (folder / "rounds").read_text().splitlines():
        pid, t0, t1, got = line.split()
        rounds.append((float(t0), float(t1), int(got), int(pid)))
    rounds.sort()
    starts = [r[0] for r in rounds]
    ends = sorted(j.finished_at for j in jobs if j.finished_at is not None)
    admission: list[float] = []
    wait: list[float] = []
    unmeasured = 0
    for j in jobs:
        if j.admitted_at is None:
            continue
        k = bisect.bisect_right(starts, j.admitted_at) - 1
        if k < 0 or not rounds[k][0] <= j.admitted_at <= rounds[k][1]:
            unmeasured += 1  # its round was cut short by a kill
            continue
        admission.append(j.admitted_at - rounds[k][0])
        if k > 0 and rounds[k - 1][3] == rounds[k][3]:
            prev = rounds[k - 1][0]
            first_end = bisect.bisect_right(ends, prev)
            if first_end < len(ends) and ends[first_end] <= rounds[k][0]:
                wait.append(j.admitted_at - max(j.submitted_at, ends[first_end]))
    # A restart: from the kill to the first round of the next scheduler.
    restarts = []
    for t in kills:
        k = bisect.bisect_right(starts, t)
        if k < len(starts):
            restarts.append(starts[k] - t)
    round_s = [r[1] - r[0] for r in rounds]
    # From admission to the supervisor's move to running (its start-up: imports).
    start_s = [j.started_at - j.admitted_at for j in jobs if j.started_at and j.admitted_at]
    wall = t_end - t_start
    p99 = ms(pct(admission, 0.99))
    if keep:
        print(f"the store, the logs and the rounds: {folder}", file=sys.stderr)
    else:
        shutil.rmtree(folder, ignore_errors=True)
    return {
        "jobs": n,
        "jobs_lost": len(lost),
        "jobs_run_twice": len(twice),
        "jobs_unfinished": len(unfinished),
        "scheduler_kills": len(kills),
        "admission_p50_ms": ms(pct(admission, 0.5)),
        "admission_p99_ms": p99,
        "admissions_measured": len(admission),
        "admissions_unmeasured": unmeasured,
        "wait_p50_ms": ms(pct(wait, 0.5)),
        "wait_p99_ms": ms(pct(wait, 0.99)),
        "round_p50_ms": ms(pct(round_s, 0.5)),
        "round_p99_ms": ms(pct(round_s, 0.99)),
        "rounds": len(rounds),
        "supervisor_start_p50_s": None if not start_s else round(statistics.median(start_s), 2),
        "restart_s": round(statistics.mean(restarts), 2) if restarts else None,
        "requeued": sum(1 for j in jobs if j.attempts > 1),
        "interval_s": interval,
        "devices": devices or "gpus",
        "finished_in_time": done,
        "wall_s": round(wall, 2),
        "jobs_per_s": round(n / wall, 3) if wall > 0 else None,
        "goal_no_loss": not lost and not unfinished,
        "goal_none_twice": not twice,
        "goal_p99": p99 is not None and p99 <= GOAL_P99_MS,
        "lost_states": dict(collections.Counter(j.state for j in lost)),
    }


def main(argv: list[str] | None = None) -> int:
    ap = _common.parser(
        __doc__,
        quick="200 jobs, killed 3 times; under a minute",
        cuda="this machine's GPUs instead of the simulated ones",
        seed="the jobs' needs and the kills' moments",
    )
    ap.add_argument("--jobs", type=int, help="how many jobs (default: 1,000; --quick: 200)")
    ap.add_argument(
        "--interval", type=float, default=0.2, help="the scheduler's polling interval, seconds"
    )
    ap.add_argument("--timeout", type=float, help="give up after this many seconds")
    ap.add_argument("--keep", action="store_true", help="keep the temporary store and logs")
    args = _common.parse(ap, argv)
    n = args.jobs or (200 if args.quick else 1000)
    timeout = args.timeout or (50.0 if args.quick else 4 * 3600.0)
    devices = [] if args.cuda else list(SIM_DEVICES)
    summary = run(n, args.seed, args.interval, devices, timeout, args.keep)
    for key in ("jobs_lost", "jobs_run_twice", "admission_p99_ms", "wait_p99_ms", "wall_s"):
        print(f"{key}: {summary[key]}", file=sys.stderr)
    summary["goal_met"] = summary["goal_no_loss"] and summary["goal_none_twice"]
    summary["goal_met"] = summary["goal_met"] and summary["goal_p99"]
    return _common.finish(summary, summary["goal_met"])


if __name__ == "__main__":
    sys.exit(main())
