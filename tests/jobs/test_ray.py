"""The Ray backend on a local Ray cluster of this machine, with simulated GPUs: real Ray
tasks, real supervisors, real jobs and real out-of-memory errors."""

from __future__ import annotations

import math
import os
import signal
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

import vramctl
from vramctl.jobs import (
    Job,
    JobSpec,
    JobStore,
    MemoryNeed,
    RayAgent,
    RayGpu,
    RayRunner,
    Scheduler,
    node_resources,
    ray_devices,
)
from vramctl.jobs._ray import resource_name

ray = pytest.importorskip("ray")

GiB = 2**30
MiB = 2**20
PY = sys.executable


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    """One local cluster for the module: two simulated 8 GiB GPUs on its one node."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a loopback-only test cluster
    resources = node_resources([vramctl.simulate("8GiB"), vramctl.simulate("8GiB")])
    ray.init(
        address="local",
        num_cpus=2,
        resources=resources,
        include_dashboard=False,
        log_to_driver=False,
    )
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[JobStore]:
    with JobStore(tmp_path / "jobs.db") as s:
        yield s


def job(name: str, code: str, need: str, **kw: Any) -> JobSpec:
    command = (PY, "-c", textwrap.dedent(code))
    return JobSpec(name=name, command=command, memory=MemoryNeed.of_size(need), **kw)


def scheduler(store: JobStore) -> tuple[Scheduler, list[RayGpu]]:
    devices = ray_devices()
    return Scheduler(store, devices=devices, runner=RayRunner(devices), interval_s=0.1), devices


def run_all(sched: Scheduler, timeout: float = 120.0, each: Any = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sched.run_once()
        if each is not None:
            each()
        counts = sched.store.counts()
        if not any(counts[s] for s in ("queued", "admitted", "running")):
            return
        time.sleep(0.1)
    raise AssertionError(f"jobs still active after {timeout} s: {sched.store.counts()}")


def wait_running(store: JobStore, job_id: str, timeout: float = 60.0) -> Job:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = store.get(job_id)
        if got.state == "running" and got.pid is not None and got.supervisor_pid is not None:
            return got
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} is {store.get(job_id).state}, not running")


def eventually(check: Any, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def holders(job_id: str) -> set[int]:
    """The pids of this machine's processes that hold ``job_id`` for a Ray task."""
    found = set()
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = proc.info["cmdline"] or []
        if "--hold" in cmd and job_id in cmd:
            found.add(proc.info["pid"])
    return found


def test_resource_names_and_devices() -> None:
    assert resource_name(0) == "vramctl_gpu0_mib"
    assert resource_name(3, simulated=True) == "vramctl_simgpu3_mib"
    sims = [vramctl.simulate("T4-16GB"), vramctl.simulate("4GiB")]
    assert node_resources(sims) == {"vramctl_simgpu0_mib": 14929.0, "vramctl_simgpu1_mib": 4096.0}
    assert node_resources([]) == {}


def test_the_cluster_gpus_are_devices(cluster: None) -> None:
    devices = ray_devices()
    node = ray.get_runtime_context().get_node_id()
    assert [(d.local, d.node_id, d.capacity()) for d in devices] == [
        ("sim:gpu0", node, 8 * GiB),
        ("sim:gpu1", node, 8 * GiB),
    ]
    assert devices[0].id == f"sim:gpu0@{node[:8]}" and devices[0].available() == 8 * GiB


def test_jobs_are_placed_by_memory_and_never_overlap_past_a_gpu(
    cluster: None, store: JobStore
) -> None:
    # Four 3 GiB jobs (3.3 GiB reserved) on two 8 GiB GPUs: two at a time on each GPU,
    # and Ray's figure of each GPU falls by exactly what runs there.
    ids = [store.submit(job(f"j{i}", "import time; time.sleep(1.5)", "3GiB")).id for i in range(5)]
    sched, devices = scheduler(store)
    lows: list[int] = []

    def watch() -> None:
        lows.append(min(d.available() for d in devices))

    run_all(sched, each=watch)
    jobs = [store.get(i) for i in ids]
    assert [j.state for j in jobs] == ["succeeded"] * 5, [j.reason for j in jobs]
    # Two at most per GPU (each reservation rounded up to a whole MiB in Ray).
    assert min(lows) >= 8 * GiB - 2 * (jobs[0].reserved_bytes + MiB)
    for dev in devices:
        here = sorted((j for j in jobs if j.device == dev.id), key=lambda j: j.started_at or 0)
        for k, a in enumerate(here):
            overlapping = [
                b
                for b in here[k:]
                if (b.started_at or 0) < (a.finished_at or 0)  # started before a ended
            ]
            assert sum(b.reserved_bytes or 0 for b in overlapping) <= dev.capacity()
    # Every reservation given back, once the tasks have returned (just after the jobs end).
    assert eventually(lambda: all(d.available() == 8 * GiB for d in devices))


def test_a_job_over_its_share_runs_out_alone(cluster: None, store: JobStore) -> None:
    grab = "import torch, time; x = torch.empty({n}, dtype=torch.uint8); time.sleep(1); print('ok')"
    over = store.submit(job("over", grab.format(n=3 * GiB), "1GiB"))
    neighbours = [store.submit(job(f"n{i}", grab.format(n=GiB), "2GiB")).id for i in range(3)]
    sched, _ = scheduler(store)
    run_all(sched)
    failed = store.get(over.id)
    assert failed.state == "failed"
    assert "OutOfMemoryError" in Path(failed.log_path or "").read_text()
    assert [store.get(i).state for i in neighbours] == ["succeeded"] * 3


def test_a_killed_worker_loses_no_job(cluster: None, store: JobStore) -> None:
    # The task's worker dies, the job does not (its supervisor runs in its own session):
    # Ray runs the task again, which holds the reservation again and waits for the job.
    long = store.submit(job("long", "import time; time.sleep(6); print('done')", "2GiB"))
    sched, devices = scheduler(store)
    sched.run_once()
    running = wait_running(store, long.id)
    first = running.supervisor_pid or 0
    worker = psutil.Process(first).ppid()
    # Ray's view of what a node has free is refreshed a moment after a task starts: wait
    # until it shows the task's reservation (whole MiB) before killing its worker.
    gpu = next(d for d in devices if d.id == running.device)
    held = math.ceil((running.reserved_bytes or 0) / MiB) * MiB
    assert held > 0 and eventually(lambda: gpu.capacity() - gpu.available() == held)
    assert holders(long.id) == {first}  # the supervisor is the task's own holder
    os.kill(worker, signal.SIGKILL)
    # Ray runs the task again: a second holder of this job starts (it waits for the
    # supervisor already running it), and the new task holds the reservation again.
    assert eventually(lambda: holders(long.id) - {first} != set()), holders(long.id)
    assert eventually(lambda: gpu.capacity() - gpu.available() == held)
    assert store.get(long.id).state == "running"
    run_all(sched)
    done = store.get(long.id)
    assert done.state == "succeeded" and done.attempts == 1
    assert "done" in Path(done.log_path or "").read_text()


def test_a_job_whose_worker_and_supervisor_died_is_retried(cluster: None, store: JobStore) -> None:
    # As if the node's processes died with the worker: the job is queued again by the
    # scheduler's adoption (retries=1, rerun_lost) and runs to the end on a second attempt.
    marker = store.path.parent / "attempts"
    code = f"""
    import time
    with open({str(marker)!r}, "a") as f:
        f.write("x")
    if open({str(marker)!r}).read() == "x":
        time.sleep(30)
    print("finished")
    """
    crash = store.submit(job("crash", code, "2GiB", retries=1, rerun_lost=True))
    sched, _ = scheduler(store)
    sched.run_once()
    running = wait_running(store, crash.id)
    assert eventually(marker.exists)  # the first attempt is under way
    worker = psutil.Process(running.supervisor_pid or 0).ppid()
    for pid in (running.supervisor_pid, worker):
        os.kill(pid or 0, signal.SIGKILL)
    os.killpg(running.pid or 0, signal.SIGKILL)
    run_all(sched)
    done = store.get(crash.id)
    assert done.state == "succeeded" and done.attempts == 2, done.reason
    assert marker.read_text() == "xx"


def test_the_agent_holds_memory_used_outside_vramctl(cluster: None, store: JobStore) -> None:
    sims = [vramctl.simulate("8GiB"), vramctl.simulate("8GiB")]
    outside = {0: 6 * GiB, 1: 0}
    agent = RayAgent(sims, outside=lambda d: outside[sims.index(d)], step_bytes=64 * MiB)
    try:
        assert agent.update() == {"vramctl_simgpu0_mib": 6144, "vramctl_simgpu1_mib": 0}
        sched, devices = scheduler(store)
        assert eventually(lambda: devices[0].available() == 2 * GiB)
        # A 3 GiB job does not fit what gpu0 has left outside vramctl's use: it goes to gpu1.
        placed = store.submit(job("placed", "pass", "3GiB"))
        run_all(sched)
        assert store.get(placed.id).device == devices[1].id
        outside[0] = 0  # the outside process is gone: the memory comes back
        agent.update()
        assert eventually(lambda: devices[0].available() == 8 * GiB)
    finally:
        agent.close()
