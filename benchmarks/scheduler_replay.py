"""Jobs per hour, queueing and safety of vramctl's job queue on a production GPU-sharing trace.

The Alibaba GPU-sharing trace (cluster-trace-gpu-v2023: ``openb_pod_list_default.csv`` on
``openb_node_list_gpu_node.csv``) replayed with its creation and deletion times through
vramctl's real queue, admission and placement (``JobStore`` and ``Scheduler``, in process,
with a ``launch`` hook in place of the supervisors), against two peers on the same
arrivals: one job per GPU (exclusive FIFO) and Ray-style first-fit on logical fractions.

The modelling, in full (docs/benchmarks/scheduler_replay.md says why):

- **Cluster.** ``--gpus`` GPUs of nodes taken evenly through the node list (every k-th node,
  which keeps the mix of models), each a simulated GPU of its model's memory: P100, T4 and
  V100M16 16 GiB, V100M32 32 GiB, A10 24 GiB; G1-G3 are unnamed in the trace and taken as
  16 GiB (``--unknown-gib``).
- **Tasks.** Those with one GPU, in creation order, ``--tasks`` of them from the 10th percentile
  of creation on (the trace opens with services that run for months). Tasks with no GPU are
  skipped (no GPU memory); tasks with 2-8 GPUs are skipped (75 of 8,152: vramctl places a job
  on one device). A task's share is ``gpu_milli / 1000`` of a 16 GiB GPU: that many bytes are
  its reservation R, for every scheduler.
- **Times.** A task runs ``deletion - creation`` seconds, at most ``--max-duration``. The gaps
  between arrivals are divided by one factor, chosen so that the GPU time asked for (whole
  GPUs) is ``--load`` times what the exclusive cluster has over the arrival span.
- **True peaks.** vramctl reserves need x 1.1 (``Scheduler(margin=0.1)``), so the estimate
  ("need") of a task is R / 1.1. Its true peak is need / (1 + err), err drawn (seeded) from
  the 20 measured errors of the estimator's H200 run (docs/benchmarks/estimate_accuracy.md;
  err = (predicted - measured) / measured). Peaks are reached in the first minute: a job
  that dies of its peak dies at min(duration, 60 s).
- **vramctl.** A task is submitted at its arrival; a round (``run_once``) runs after each
  batch of events, at most one per ``--round-s`` virtual seconds. The launch hook moves the
  job to running and books its end; at the end it moves to succeeded, or failed when its true
  peak passed its reservation (shares are enforced, so the overrun OOMs itself only:
  ``self_ooms``). No neighbour can be killed.
- **Exclusive FIFO.** A job takes a whole GPU, in arrival order. A true peak over the GPU's
  memory is a self OOM.
- **Ray-style fractions.** First-fit on logical fractions (``gpu_milli`` out of 1000 per GPU),
  queued jobs tried in arrival order each step (a job that fits is started even if an
  earlier one waits, as Ray's scheduler does). Memory is not enforced: when a job starts and
  the true peaks of a GPU's jobs pass its memory, jobs on it chosen at random die until the
  rest fit; a dead job that kept within its own share is a neighbour killed, one that did not
  a self OOM.
- **Figures.** ``jobs_per_hour``: jobs succeeded per virtual hour from the first arrival to the
  last end; ``p95_queue_delay_s``: start - arrival (virtual seconds); ``memory_utilization``:
  true bytes in use (at most each GPU's memory), time-averaged over that span, over the
  cluster's memory (``reserved_utilization`` the same with reservations or logical shares).

The last line is one JSON object: vramctl's figures, ``jobs_per_hour_ratio_vs_exclusive``,
``neighbours_killed``, ``self_ooms``, ``peers`` (each peer's figures), the settings,
``goal_met`` (ratio at least 2 and no neighbour killed) and ``wall_s``.

    python benchmarks/scheduler_replay.py --quick   # 32 GPUs, 400 tasks; under a minute
    python benchmarks/scheduler_replay.py           # 96 GPUs, 1,500 tasks
"""

from __future__ import annotations

import csv
import heapq
import logging
import math
import random
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _common

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "alibaba-gpu-v2023"
NODES = "openb_node_list_gpu_node.csv"
PODS = "openb_pod_list_default.csv"
GIB = 1024**3
REF_GIB = 16  # a share of gpu_milli is of a GPU of this memory
MODEL_GIB = {"P100": 16, "T4": 16, "V100M16": 16, "V100M32": 32, "A10": 24}
MARGIN = 0.1
OOM_AFTER_S = 60.0
#: The estimator's errors on the H200 quick run (allocated peak, with the profile), in percent:
#: (predicted - measured) / measured, one per row of docs/benchmarks/estimate_accuracy.md.
ESTIMATE_ERRORS_PCT = (
    -1.22, 3.63, -1.29, 4.85, -5.56, -4.46, -3.77, -3.43, -8.42, 0.23,
    -4.97, -4.98, -3.83, -3.83, -3.83, -3.83, -37.41, -34.06, -20.04, -19.55,
)  # fmt: skip


@dataclass
class Task:
    i: int
    arrival: float
    duration: float
    milli: int
    reserved: int  # R: the share's bytes (vramctl's need plus margin; Ray's logical share)
    need: int  # the estimate: R / (1 + margin)
    true_peak: int


@dataclass
class Outcome:
    """One scheduler's run: per task, when it started and ended and how."""

    started: dict[int, float]
    ended: dict[int, float]
    state: dict[int, str]  # succeeded, self-oom, killed (its last attempt's end)
    # (time, +/- true bytes, +/- reserved bytes) steps of the memory in use
    usage: list[tuple[float, int, int]]
    attempts: dict[int, int] = field(default_factory=dict)  # runs started, per task
    # ends of attempts that did not succeed, by how: self-oom, killed
    lost_attempts: dict[str, int] = field(default_factory=dict)


# -- the trace ---------------------------------------------------------------------------


def read_csv(folder: Path, name: str) -> list[dict[str, str]]:
    path = folder / name
    if not path.is_file():
        print(
            f"{path} is missing: this benchmark reads the Alibaba GPU trace (cluster-trace-gpu-"
            f"v2023) from the project's shared data folder; point --data at a folder with "
            f"{NODES} and {PODS}",
            file=sys.stderr,
        )
        raise SystemExit(2)
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def gpus_of(nodes: list[dict[str, str]], count: int, unknown_gib: int) -> list[int]:
    """``count`` GPUs' memory (GiB), from nodes taken evenly through the node list."""
    total = sum(int(n["gpu"]) for n in nodes)
    taken = max(1, round(count * len(nodes) / total))
    while True:  # the fewest evenly spaced nodes with enough GPUs
        picked = sorted({int(j * len(nodes) / taken) for j in range(taken)})
        out = [MODEL_GIB.get(nodes[k]["model"], unknown_gib) for k in picked]
        out = [g for k, g in zip(picked, out, strict=True) for _ in range(int(nodes[k]["gpu"]))]
        if len(out) >= count or taken >= len(nodes):
            break
        taken += 1
    return out[:count]


def tasks_of(
    pods: list[dict[str, str]], count: int, max_duration: float, sharing_only: bool
) -> list[dict[str, float]]:
    """The one-GPU tasks, in creation order, ``count`` from the 10th percentile on (only
    those asking for part of a GPU with ``sharing_only``)."""
    one = [p for p in pods if int(p["num_gpu"]) == 1]
    if sharing_only:
        one = [p for p in one if int(p["gpu_milli"]) < 1000]
    one.sort(key=lambda p: (float(p["creation_time"]), p["name"]))
    start = len(one) // 10
    chosen = one[start : start + count]
    return [
        {
            "creation": float(p["creation_time"]),
            "duration": max(
                1.0, min(max_duration, float(p["deletion_time"]) - float(p["creation_time"]))
            ),
            "milli": int(p["gpu_milli"]),
        }
        for p in chosen
    ]


def build(
    raw: list[dict[str, float]], n_gpus: int, load: float, seed: int
) -> tuple[list[Task], float]:
    """Tasks with compressed arrivals (offered load ``load`` x the exclusive cluster) and
    true peaks; returns them and the compression factor."""
    rng = random.Random(seed)
    t0 = raw[0]["creation"]
    span = raw[-1]["creation"] - t0
    work = sum(r["duration"] for r in raw)  # GPU-seconds, one whole GPU a task
    # arrival span after compression = work / (load * GPUs)
    factor = max(1.0, span * load * n_gpus / work) if span > 0 else 1.0
    tasks = []
    for i, r in enumerate(raw):
        reserved = int(r["milli"] / 1000 * REF_GIB * GIB)
        need = int(reserved / (1 + MARGIN))
        err = rng.choice(ESTIMATE_ERRORS_PCT) / 100
        tasks.append(
            Task(
                i,
                (r["creation"] - t0) / factor,
                r["duration"],
                int(r["milli"]),
                reserved,
                need,
                int(need / (1 + err)),
            )
        )
    return tasks, factor


# -- the figures -------------------------------------------------------------------------


def figures(tasks: list[Task], out: Outcome, capacity: int) -> dict[str, Any]:
    t0 = min(t.arrival for t in tasks)
    end = max(out.ended.values(), default=t0)
    span = max(end - t0, 1e-9)
    done = sum(1 for s in out.state.values() if s == "succeeded")
    delays = sorted(out.started[t.i] - t.arrival for t in tasks if t.i in out.started)
    used = reserved = 0
    area_used = area_reserved = 0.0
    last = t0
    for when, du, dr in sorted(out.usage, key=lambda x: x[0]):
        area_used += used * (when - last)
        area_reserved += reserved * (when - last)
        used += du
        reserved += dr
        last = when
    states = list(out.state.values())
    runs = list(out.attempts.values())
    return {
        "jobs": len(tasks),
        "succeeded": done,
        "never_started": len(tasks) - len(out.started),
        "span_h": round(span / 3600, 3),
        "jobs_per_hour": round(done / (span / 3600), 2),
        "p50_queue_delay_s": round(_pct(delays, 0.5), 1),
        "p95_queue_delay_s": round(_pct(delays, 0.95), 1),
        "memory_utilization": round(area_used / (span * capacity), 4),
        "reserved_utilization": round(area_reserved / (span * capacity), 4),
        "self_ooms": states.count("self-oom"),
        "neighbours_killed": states.count("killed"),
        "attempts": sum(runs),
        "jobs_run_again": sum(1 for r in runs if r > 1),
        "done_after_a_retry": sum(
            1 for i, r in out.attempts.items() if r > 1 and out.state.get(i) == "succeeded"
        ),
        # every attempt that ended early, counting those run again afterwards
        "attempts_lost": dict(sorted(out.lost_attempts.items())),
    }


def _pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(math.ceil(q * len(xs)) - 1))] if xs else 0.0


# -- the peers ---------------------------------------------------------------------------


def simulate_peer(
    tasks: list[Task],
    gpus: list[int],
    fits: Callable[[list[list[Task]], int, Task], bool],
    shared: bool,
    seed: int,
    retries: int = 0,
) -> Outcome:
    """A discrete-event run of a peer: ``fits(held, gpu, task)`` says whether ``task`` may
    start on ``gpu``; first fit over the GPUs, queued tasks tried in arrival order.
    ``shared``: several jobs on a GPU, memory not enforced (Ray's fractions). ``retries``:
    a task that died is queued again (with the same share) that many times."""
    rng = random.Random(seed)
    cap = [g * GIB for g in gpus]
    held: list[list[Task]] = [[] for _ in gpus]
    out = Outcome({}, {}, {}, [])
    events: list[tuple[float, int, int, int]] = [(t.arrival, 1, t.i, 0) for t in tasks]
    heapq.heapify(events)
    queue: list[Task] = []
    gone: set[int] = set()
    where: dict[int, int] = {}
    again: list[Task] = []
    stale: dict[int, int] = {}  # end events still queued of attempts already ended

    def finish(t: Task, now: float, state: str, by_event: bool = False) -> None:
        g = where[t.i]
        held[g].remove(t)
        gone.add(t.i)
        out.ended[t.i] = now
        out.state[t.i] = state
        out.usage.append((now, -min(t.true_peak, cap[g]), -_share(t, cap[g], shared)))
        if state != "succeeded":
            out.lost_attempts[state] = out.lost_attempts.get(state, 0) + 1
            if out.attempts[t.i] <= retries:
                # Run again: its end events of this attempt no longer count.
                again.append(t)
                if not by_event:
                    stale[t.i] = stale.get(t.i, 0) + 1

    while events:
        now = events[0][0]
        while events and events[0][0] == now:
            _, kind, i, _ = heapq.heappop(events)
            t = tasks[i]
            if kind == 1:
                queue.append(t)
            elif stale.get(i):
                stale[i] -= 1
            elif i not in gone:
                finish(t, now, "succeeded" if kind == 0 else "self-oom", by_event=True)
        for t in again:
            gone.discard(t.i)
            queue.append(t)
        again.clear()
        waiting = []
        for t in queue:
            g = next((g for g in range(len(gpus)) if fits(held, g, t)), None)
            if g is None:
                waiting.append(t)
                continue
            held[g].append(t)
            where[t.i] = g
            out.started.setdefault(t.i, now)
            out.attempts[t.i] = out.attempts.get(t.i, 0) + 1
            out.usage.append((now, min(t.true_peak, cap[g]), _share(t, cap[g], shared)))
            if t.true_peak > cap[g]:
                heapq.heappush(events, (now + min(t.duration, OOM_AFTER_S), 2, t.i, 0))
            else:
                heapq.heappush(events, (now + t.duration, 0, t.i, 0))
            if shared:
                # Unenforced: the GPU's true peaks past its memory kill jobs on it at random.
                while sum(x.true_peak for x in held[g]) > cap[g]:
                    victim = rng.choice(held[g])
                    own = victim.true_peak > _share(victim, cap[g], True)
                    finish(victim, now, "self-oom" if own else "killed")
        queue = waiting
    return out


def _share(t: Task, cap: int, shared: bool) -> int:
    """The memory a peer sets aside for ``t``: its logical fraction of the GPU, or the GPU."""
    return int(t.milli / 1000 * cap) if shared else cap


def exclusive_fits(held: list[list[Task]], g: int, t: Task) -> bool:
    return not held[g]


def fraction_fits(held: list[list[Task]], g: int, t: Task) -> bool:
    return sum(x.milli for x in held[g]) + t.milli <= 1000


# -- vramctl -----------------------------------------------------------------------------


def run_vramctl(
    tasks: list[Task], gpus: list[int], policy: str, round_s: float, retry_overruns: bool = True
) -> tuple[Outcome, dict[str, Any]]:
    """The replay through the real store and scheduler; returns the outcome and timings."""
    import vramctl
    from vramctl.jobs import JobSpec, JobStore, Scheduler, overrun_need

    devices = []
    for k, gib in enumerate(gpus):
        dev = vramctl.simulate(f"{gib}GiB")
        # Simulated GPUs of one size share one id ("sim:16GiB"); the scheduler keys its
        # ledger by id, so each gets its own.
        dev.id = f"sim:{k}-{gib}GiB"
        devices.append(dev)
    cap = {d.id: gib * GIB for d, gib in zip(devices, gpus, strict=True)}
    out = Outcome({}, {}, {}, [])
    by_job: dict[str, Task] = {}
    events: list[tuple[float, int, int, str]] = [(t.arrival, 1, t.i, "") for t in tasks]
    heapq.heapify(events)
    now = 0.0
    rounds = 0
    round_wall = 0.0

    with tempfile.TemporaryDirectory() as tmp, JobStore(Path(tmp) / "jobs.db") as store:

        def launch(job: Any) -> None:
            t = by_job[job.id]
            store.move(
                job.id, "admitted", "running", started_at=time.time(), attempts=job.attempts + 1
            )
            out.started.setdefault(t.i, now)
            out.attempts[t.i] = out.attempts.get(t.i, 0) + 1
            reserved = int(job.reserved_bytes or 0)
            out.usage.append((now, min(t.true_peak, cap[job.device]), reserved))
            if t.true_peak > reserved:  # enforced share: the overrun OOMs the job itself
                heapq.heappush(events, (now + min(t.duration, OOM_AFTER_S), 2, t.i, job.id))
            else:
                heapq.heappush(events, (now + t.duration, 0, t.i, job.id))

        sched = Scheduler(store, devices=devices, policy=policy, margin=MARGIN, launch=launch)
        next_round = 0.0
        waiting = 0  # jobs queued again after an overrun: rounds go on while they wait
        while events or waiting:
            now = max(events[0][0], next_round) if events else next_round
            while events and events[0][0] <= now:
                _, kind, i, job_id = heapq.heappop(events)
                t = tasks[i]
                if kind == 1:
                    spec = JobSpec.from_dict(
                        {"name": f"task-{i}", "command": ["true"], "memory": t.need}
                    )
                    by_job[store.submit(spec).id] = t
                    continue
                job = store.get(job_id)
                ok = kind == 0
                reserved = int(job.reserved_bytes or 0)
                out.ended[i] = now
                out.state[i] = "succeeded" if ok else "self-oom"
                out.usage.append((now, -min(t.true_peak, cap[job.device or ""]), -reserved))
                if not ok:
                    out.lost_attempts["self-oom"] = out.lost_attempts.get("self-oom", 0) + 1
                if not ok and retry_overruns and job.overruns < job.spec.overrun_retries:
                    # As a supervisor does: out of memory under its cap, it was seen to use
                    # its share; it runs again needing more (vramctl.jobs.overrun_need).
                    store.move(
                        job_id,
                        "running",
                        "queued",
                        peak_bytes=min(t.true_peak, reserved),
                        need_bytes=overrun_need(min(t.true_peak, reserved), reserved),
                        overruns=job.overruns + 1,
                        reason="out of memory under its share; queued again",
                    )
                    continue
                store.move(
                    job_id,
                    "running",
                    "succeeded" if ok else "failed",
                    finished_at=time.time(),
                    exit_code=0 if ok else 1,
                    reason=None if ok else "out of memory (its share)",
                )
            start = time.perf_counter()
            sched.run_once()
            round_wall += time.perf_counter() - start
            rounds += 1
            next_round = now + round_s
            counts = store.counts()
            waiting = counts["queued"] + counts["admitted"] + counts["running"]
        counts = store.counts()
    return out, {
        "rounds": rounds,
        "round_ms_mean": round(1000 * round_wall / max(1, rounds), 2),
        "store_counts": {k: v for k, v in counts.items() if v},
    }


# -- main --------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = _common.parser(
        __doc__,
        quick="32 GPUs, 400 tasks; under a minute",
        seed="true peaks' and kills' draws",
        threads=True,
    )
    ap.add_argument("--data", type=Path, default=DATA, help="the trace's folder")
    ap.add_argument("--gpus", type=int, help="GPUs of the cluster (default 96, --quick 32)")
    ap.add_argument("--tasks", type=int, help="tasks replayed (default 1500, --quick 400)")
    ap.add_argument("--load", type=float, default=3.0, help="offered load, x exclusive capacity")
    ap.add_argument("--max-duration", type=float, default=4 * 3600.0, help="seconds at most")
    ap.add_argument("--round-s", type=float, default=30.0, help="virtual seconds between rounds")
    ap.add_argument("--policy", default="best-fit", help="vramctl's placement policy")
    ap.add_argument("--unknown-gib", type=int, default=16, help="GiB of G1-G3's GPUs")
    ap.add_argument(
        "--sharing-only", action="store_true", help="only tasks asking for part of a GPU"
    )
    ap.add_argument(
        "--no-overrun-retries",
        action="store_true",
        help="vramctl's jobs fail at their first overrun (overrun_retries = 0), as before",
    )
    args = _common.parse(ap, argv)
    wall = time.perf_counter()
    logging.getLogger("vramctl.jobs").setLevel(logging.WARNING)
    n_gpus = args.gpus or (32 if args.quick else 96)
    n_tasks = args.tasks or (400 if args.quick else 1500)
    gpus = gpus_of(read_csv(args.data, NODES), n_gpus, args.unknown_gib)
    raw = tasks_of(read_csv(args.data, PODS), n_tasks, args.max_duration, args.sharing_only)
    tasks, factor = build(raw, len(gpus), args.load, args.seed)
    capacity = sum(gpus) * GIB
    print(
        f"{len(gpus)} GPUs ({sum(gpus)} GiB), {len(tasks)} tasks, arrivals compressed "
        f"{factor:.1f}x, {sum(t.true_peak > t.reserved for t in tasks)} with a true peak over "
        "their share",
        flush=True,
    )

    peers = {}
    for name, fits, shared, retries in (
        ("exclusive_fifo", exclusive_fits, False, 0),
        ("ray_fractions", fraction_fits, True, 0),
        ("ray_fractions_retried", fraction_fits, True, 1),
    ):
        start = time.perf_counter()
        run = simulate_peer(tasks, gpus, fits, shared, args.seed, retries)
        peers[name] = figures(tasks, run, capacity)
        peers[name]["wall_s"] = round(time.perf_counter() - start, 2)
        print(f"{name:15s} {peers[name]}", flush=True)
    start = time.perf_counter()
    outcome, timing = run_vramctl(
        tasks, gpus, args.policy, args.round_s, not args.no_overrun_retries
    )
    ours = figures(tasks, outcome, capacity)
    ours.update(timing, wall_s=round(time.perf_counter() - start, 2))
    print(f"{'vramctl':15s} {ours}", flush=True)

    ratio = ours["jobs_per_hour"] / peers["exclusive_fifo"]["jobs_per_hour"]
    vs_ray = ours["jobs_per_hour"] / peers["ray_fractions"]["jobs_per_hour"]
    vs_retried = ours["jobs_per_hour"] / peers["ray_fractions_retried"]["jobs_per_hour"]
    summary: dict[str, Any] = {
        "benchmark": "scheduler_replay",
        "quick": args.quick,
        "jobs_per_hour": ours["jobs_per_hour"],
        "jobs_per_hour_ratio_vs_exclusive": round(ratio, 3),
        "jobs_per_hour_ratio_ray_vs_exclusive": round(
            peers["ray_fractions"]["jobs_per_hour"] / peers["exclusive_fifo"]["jobs_per_hour"], 3
        ),
        "jobs_per_hour_ratio_vs_ray": round(vs_ray, 3),
        "jobs_per_hour_ratio_vs_ray_retried": round(vs_retried, 3),
        "attempts": ours["attempts"],
        "done_after_a_retry": ours["done_after_a_retry"],
        "p95_queue_delay_s": ours["p95_queue_delay_s"],
        "memory_utilization": ours["memory_utilization"],
        "reserved_utilization": ours["reserved_utilization"],
        "neighbours_killed": ours["neighbours_killed"],
        "self_ooms": ours["self_ooms"],
        "peers_neighbours_killed": {k: v["neighbours_killed"] for k, v in peers.items()},
        "vramctl": ours,
        "peers": peers,
        "goal_met": bool(vs_ray > 1.0 and ours["attempts_lost"].get("killed", 0) == 0),
        "settings": {
            "gpus": len(gpus),
            "gpu_gib": {str(g): gpus.count(g) for g in sorted(set(gpus))},
            "tasks": len(tasks),
            "load": args.load,
            "arrival_compression": round(factor, 2),
            "max_duration_s": args.max_duration,
            "round_s": args.round_s,
            "policy": args.policy,
            "margin": MARGIN,
            "unknown_gib": args.unknown_gib,
            "sharing_only": args.sharing_only,
            "overrun_retries": not args.no_overrun_retries,
            "threads": args.threads,
            "seed": args.seed,
        },
        "wall_s": round(time.perf_counter() - wall, 2),
    }
    summary.update(_common.machine(False))
    return _common.finish(summary, True)


if __name__ == "__main__":
    raise SystemExit(main())
