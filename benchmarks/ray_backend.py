"""Plain Ray's GPU fractions against vramctl's Ray backend, on the same jobs and cluster.

A local Ray cluster on this machine with two simulated 8 GiB GPUs: Ray is told of two
logical GPUs (``num_gpus=2``) for the plain side, and the node offers the vramctl
resources (``vramctl ray resources``) for vramctl's. The same seeded job mix runs on each
side in turn. Each job declares a need (2, 3 or 4 GiB) and runs a real process that takes its
true peak for 2-4 s (half of it held all along, the other half taken and freed every
0.25 s, as a training step's activations are); 30% of the jobs peak at 1.75 times what
they declared (an estimate that was wrong), the others at 70-100% of it.

The GPU's memory, shared by every process on it, is a file per GPU holding the bytes in
use (locked while read and written): a step that would take the GPU past 8 GiB runs out
of memory, as on a real GPU, in whichever process asked. Each step is also a real tensor,
so under vramctl the job's own cap (``vramctl.simulate(<its reservation>)``, as on a
simulated device) refuses a step past its reservation first.

- **Plain Ray**: a task per job with ``num_gpus=need / 8 GiB`` runs the job on the GPU
  Ray assigns. Nothing holds a job to its fraction.
- **vramctl**: the jobs are submitted to a job store and run by the scheduler with the
  Ray backend (``RayRunner``, 10% margin): each job's task holds its reservation of its
  GPU's resource, and the job is capped at it.

Figures per side: ``completed``; ``neighbours_killed`` (a job that ran out of memory
while within its declared need: another job's overrun took its memory); ``self_ooms``
(a job that ran out past its declared need); ``jobs_lost`` (no outcome at all); and
``makespan_s``. Goals: vramctl's ``neighbours_killed`` 0 and ``jobs_lost`` 0.

    python benchmarks/ray_backend.py --quick   # 12 jobs a side; under a minute
    python benchmarks/ray_backend.py           # 40 jobs a side
"""

from __future__ import annotations

import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common

GiB = 2**30
CAPACITY = 8 * GiB
GPUS = 2
OVERRUN_SHARE = 0.3
OVERRUN = 1.75

# The job: holds half its peak (weights) and, step after step, takes the other half
# (activations) and frees it; each as a tensor (the cap) and a share of its GPU's memory
# file (the GPU). Exit 0 done, 3 out of memory within its need, 4 past it.
JOB = r"""
import fcntl, os, sys, time
declared, peak, hold = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
pool, capacity = sys.argv[4], int(sys.argv[5])
device = os.environ.get("VRAMCTL_DEVICE", "")
gpu = device.split("gpu")[-1] if device else os.environ["JOB_GPU"]
path = os.path.join(pool, "gpu" + gpu)
import torch

def move(n):
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        used = int(f.read() or 0)
        if n > 0 and used + n > capacity:
            return False
        f.seek(0)
        f.truncate()
        f.write(str(used + n))
    return True

def take(n):
    # A tensor (the cap, under vramctl) and its share of the GPU's memory file.
    global mine
    t = torch.empty(n, dtype=torch.uint8)
    if not move(n):
        print("out of memory: the GPU is full", mine + n, declared)
        raise SystemExit(3 if mine + n <= declared else 4)
    mine += n
    return t

mine = 0
try:
    weights = take(peak // 2)  # held all along
    end = time.time() + hold
    while time.time() < end:  # steps: activations up to the peak, then freed
        activations = take(peak - peak // 2)
        time.sleep(0.2)
        del activations
        move(-(peak - peak // 2))
        mine -= peak - peak // 2
        time.sleep(0.05)
except torch.OutOfMemoryError as exc:
    print("out of memory: past its cap", exc)
    raise SystemExit(4)
finally:
    move(-mine)
"""


def job_mix(n: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        declared = int(rng.choice((2.0, 3.0, 4.0)) * GiB)
        over = rng.random() < OVERRUN_SHARE
        peak = int(declared * (OVERRUN if over else rng.uniform(0.7, 1.0)))
        jobs.append({"i": i, "declared": declared, "peak": peak, "hold": rng.uniform(2.0, 4.0)})
    return jobs


def argv(job: dict[str, Any], pool: Path) -> list[str]:
    return [
        sys.executable,
        "-c",
        JOB,
        str(job["declared"]),
        str(job["peak"]),
        f"{job['hold']:.3f}",
        str(pool),
        str(CAPACITY),
    ]


def tally(codes: list[int | None], t0: float, t1: float) -> dict[str, Any]:
    return {
        "jobs": len(codes),
        "completed": codes.count(0),
        "neighbours_killed": codes.count(3),
        "self_ooms": codes.count(4),
        "jobs_lost": sum(1 for c in codes if c not in (0, 3, 4)),
        "makespan_s": round(t1 - t0, 2),
    }


def fresh_pool(root: Path, name: str) -> Path:
    pool = root / name
    pool.mkdir()
    for g in range(GPUS):
        (pool / f"gpu{g}").write_text("0")
    return pool


def plain_ray(ray: Any, jobs: list[dict[str, Any]], pool: Path) -> dict[str, Any]:
    import subprocess

    @ray.remote(num_cpus=0)
    def run(args: list[str]) -> int:
        env = dict(os.environ)
        env.pop("VRAMCTL_DEVICE", None)
        env["JOB_GPU"] = str(int(ray.get_gpu_ids()[0]))
        return subprocess.run(args, env=env, capture_output=True, check=False).returncode

    t0 = time.perf_counter()
    refs = [
        run.options(num_gpus=round(j["declared"] / CAPACITY + 5e-5, 4)).remote(argv(j, pool))
        for j in jobs
    ]
    codes: list[int | None] = []
    for ref in refs:
        try:
            codes.append(int(ray.get(ref, timeout=300)))
        except Exception:
            codes.append(None)
    return tally(codes, t0, time.perf_counter())


def vramctl_ray(jobs: list[dict[str, Any]], pool: Path, root: Path) -> dict[str, Any]:
    from vramctl.jobs import JobSpec, JobStore, MemoryNeed, RayRunner, Scheduler, ray_devices

    devices = ray_devices()
    codes: list[int | None] = []
    with JobStore(root / "jobs.db") as store:
        t0 = time.perf_counter()
        ids = [
            store.submit(
                JobSpec(
                    name=f"job{j['i']}",
                    command=tuple(argv(j, pool)),
                    memory=MemoryNeed.of_size(j["declared"]),
                )
            ).id
            for j in jobs
        ]
        sched = Scheduler(store, devices=devices, runner=RayRunner(devices), interval_s=0.05)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            sched.run_once()
            counts = store.counts()
            if not any(counts[s] for s in ("queued", "admitted", "running")):
                break
            time.sleep(0.05)
        t1 = time.perf_counter()
        for job in store.get_many(ids):
            codes.append(job.exit_code if job.state in ("succeeded", "failed") else None)
    return tally(codes, t0, t1)


def main(argv_: list[str] | None = None) -> int:
    ap = _common.parser(__doc__, quick="12 jobs a side (under a minute)", seed="the job mix")
    ap.add_argument("--jobs", type=int, default=None, help="jobs a side (default: 40)")
    args = _common.parse(ap, argv_)
    n = args.jobs or (12 if args.quick else 40)
    import ray

    import vramctl
    from vramctl.jobs import node_resources

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a loopback-only cluster
    sims = [vramctl.simulate(CAPACITY) for _ in range(GPUS)]
    t_start = time.perf_counter()
    ray.init(
        address="local",
        num_cpus=2,
        num_gpus=GPUS,
        resources=node_resources(sims),
        include_dashboard=False,
        log_to_driver=False,
    )
    root = Path(tempfile.mkdtemp(prefix="ray-backend-"))
    try:
        jobs = job_mix(n, args.seed)
        ray_side = plain_ray(ray, jobs, fresh_pool(root, "ray"))
        vramctl_side = vramctl_ray(jobs, fresh_pool(root, "vramctl"), root)
    finally:
        ray.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    summary = {
        "benchmark": "ray_backend",
        "quick": bool(args.quick),
        "ray_neighbours_killed": ray_side["neighbours_killed"],
        "vramctl_neighbours_killed": vramctl_side["neighbours_killed"],
        "jobs_lost": vramctl_side["jobs_lost"],
        "ray_jobs_lost": ray_side["jobs_lost"],
        "makespan_s": {"ray": ray_side["makespan_s"], "vramctl": vramctl_side["makespan_s"]},
        "ray": ray_side,
        "vramctl": vramctl_side,
        "goal_met": vramctl_side["neighbours_killed"] == 0 and vramctl_side["jobs_lost"] == 0,
        "settings": {
            "jobs": n,
            "gpus": GPUS,
            "gpu_gib": CAPACITY / GiB,
            "overrun_share": OVERRUN_SHARE,
            "overrun": OVERRUN,
            "seed": args.seed,
            "ray": _common.version("ray"),
        },
        "wall_s": round(time.perf_counter() - t_start, 1),
        **_common.machine(False),
    }
    return _common.finish(summary, summary["goal_met"])


if __name__ == "__main__":
    sys.exit(main())
