"""The store, the supervisors and the scheduler, with real processes on this machine."""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
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
    DeviceConstraints,
    GuardOptions,
    Job,
    JobSpec,
    JobSpecError,
    JobStore,
    JobStoreError,
    LocalRunner,
    MemoryNeed,
    Scheduler,
    price,
)

GiB = 2**30
PY = sys.executable


def spec(name: str, code: str, need: str = "1GiB", **kw: Any) -> JobSpec:
    command = (PY, "-c", textwrap.dedent(code))
    return JobSpec(name=name, command=command, memory=MemoryNeed.of_size(need), **kw)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[JobStore]:
    with JobStore(tmp_path / "jobs.db") as s:
        yield s


def run_all(sched: Scheduler, timeout: float = 60.0) -> None:
    """Rounds until nothing is queued or active (bounded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sched.run_once()
        counts = sched.store.counts()
        if not any(counts[s] for s in ("queued", "admitted", "running")):
            return
        time.sleep(0.05)
    raise AssertionError(f"jobs still active after {timeout} s: {sched.store.counts()}")


def wait_for(store: JobStore, job_id: str, states: tuple[str, ...], timeout: float = 30) -> Job:
    """The job once it is in one of ``states`` (and, when running, its process started)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = store.get(job_id)
        if job.state in states and (job.state != "running" or job.pid is not None):
            return job
        time.sleep(0.02)
    raise AssertionError(f"job {job_id} is {store.get(job_id).state}, not one of {states}")


# -- the store ----------------------------------------------------------------------------


def test_the_store_keeps_jobs_and_moves_them_once(store: JobStore) -> None:
    a = store.submit(spec("a", "pass"))
    b = store.submit(spec("b", "pass", labels={"team": "asr"}))
    assert [j.id for j in store.list()] == [a.id, b.id]
    assert store.get(a.id).spec == a.spec and a.state == "queued"
    assert [j.id for j in store.list(label="team=asr")] == [b.id]
    assert store.list(label="team=tts") == [] and [j.id for j in store.list(label="team")] == [b.id]
    assert store.move(a.id, "queued", "admitted", device="cpu", reserved_bytes=GiB)
    assert not store.move(a.id, "queued", "admitted", device="cpu")  # not twice
    assert store.get(a.id).reserved_bytes == GiB
    assert store.counts()["admitted"] == 1 and store.counts()["queued"] == 1
    assert store.cancel(b.id).state == "cancelled"
    assert store.cancel(a.id).cancel_requested  # active: its supervisor stops it
    with pytest.raises(JobStoreError, match="no job 'nope'"):
        store.get("nope")
    with pytest.raises(JobStoreError, match="unknown job state 'done'"):
        store.list(["done"])
    with pytest.raises(JobStoreError, match="not a job field"):
        store.update(a.id, spec="{}")


def test_latest_lists_what_finished_last_first(store: JobStore) -> None:
    made = [store.submit(spec(f"j{k}", "pass")).id for k in range(5)]
    for k, job_id in enumerate(made):  # finished in the order 4, 0, 1, 3 (2 runs on)
        if k != 2:
            state = "timed-out" if k == 3 else "failed"
            store.move(job_id, "queued", state, finished_at=1000.0 + (k + 1) % 5)
    store.move(made[2], "queued", "running")
    assert [j.id for j in store.latest(["failed", "timed-out"], 10)] == [
        made[3],
        made[1],
        made[0],
        made[4],
    ]
    assert [j.id for j in store.latest(["failed"], 2)] == [made[1], made[0]]
    assert store.latest(["failed"], 0) == [] and store.latest([], 5) == []
    with pytest.raises(JobStoreError, match="unknown job state 'done'"):
        store.latest(["done"], 1)


def test_learned_peaks_keep_the_largest(store: JobStore) -> None:
    assert store.learned_peak("train") is None
    store.learn("train", 3 * GiB)
    store.learn("train", 2 * GiB)
    assert store.learned_peak("train") == 3 * GiB


def test_a_second_process_sees_every_commit(tmp_path: Path) -> None:
    with JobStore(tmp_path / "jobs.db") as one, JobStore(tmp_path / "jobs.db") as two:
        job = one.submit(spec("x", "pass"))
        assert two.get(job.id).state == "queued"
        assert two.move(job.id, "queued", "admitted")
        assert not one.move(job.id, "queued", "admitted")


def test_an_unwritable_store_is_one_clear_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(JobStoreError, match="cannot open the job store"):
        JobStore(tmp_path / "file" / "jobs.db")


def test_the_default_store_lives_under_vramctl_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VRAMCTL_HOME", str(tmp_path / "home"))
    with JobStore() as s:
        assert s.path == tmp_path / "home" / "jobs.db"
        assert Path(s.submit(spec("x", "pass")).log_path or "").parent == tmp_path / "home" / "logs"


# -- running jobs ---------------------------------------------------------------------------


def test_jobs_share_a_device_by_memory_and_all_finish(store: JobStore, tmp_path: Path) -> None:
    out = tmp_path / "out"
    code = f"""
        import os, time
        with open({str(out)!r}, "a") as f:
            env = os.environ
            f.write(env["VRAMCTL_JOB_ID"] + " " + env["VRAMCTL_RESERVED_BYTES"] + "\\n")
        time.sleep(0.3)
        print("hello from", os.environ["VRAMCTL_DEVICE"])
    """
    with vramctl.simulate("5GiB") as gpu:
        ids = [store.submit(spec(f"j{i}", code, "2GiB")).id for i in range(3)]
        sched = Scheduler(store, devices=[gpu], margin=0.0)
        first = sched.run_once()
        assert len(first) == 2  # 2 GiB each: a third does not fit in 5 GiB
        assert store.get(ids[2]).state == "queued"
        run_all(sched)
    jobs = [store.get(i) for i in ids]
    assert [j.state for j in jobs] == ["succeeded"] * 3
    assert all(j.exit_code == 0 and j.attempts == 1 and j.device == gpu.id for j in jobs)
    lines = out.read_text().split("\n")[:-1]
    assert sorted(line.split()[0] for line in lines) == sorted(ids)  # each ran exactly once
    assert all(line.split()[1] == str(2 * GiB) for line in lines)
    assert Path(jobs[0].log_path or "").read_text().strip() == f"hello from {gpu.id}"
    # Their peak is the simulated GPU's, and they never imported torch: none, nothing learned.
    assert all(j.peak_bytes is None for j in jobs)
    assert store.learned_peak("j0") is None


def test_a_failing_job_is_retried_then_fails_with_its_status(store: JobStore) -> None:
    job = store.submit(spec("bad", "import sys; sys.exit(3)", retries=1))
    with vramctl.simulate("4GiB") as gpu:
        run_all(Scheduler(store, devices=[gpu]))
    done = store.get(job.id)
    assert (done.state, done.attempts, done.exit_code) == ("failed", 2, 3)
    assert done.reason == "exited with status 3"


def test_a_command_that_does_not_exist_fails_with_the_reason(store: JobStore) -> None:
    job = store.submit(
        JobSpec(name="x", command=("no-such-program-xyz",), memory=MemoryNeed.of_size("1GiB"))
    )
    with vramctl.simulate("4GiB") as gpu:
        run_all(Scheduler(store, devices=[gpu]))
    done = store.get(job.id)
    assert done.state == "failed" and "could not start 'no-such-program-xyz'" in (done.reason or "")


def test_timeout_and_cancel_stop_the_whole_process_group(store: JobStore, tmp_path: Path) -> None:
    # The job starts a grandchild that would outlive a plain kill of the job's own process.
    code = """
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        print(child.pid, flush=True)
        time.sleep(60)
    """
    slow = store.submit(spec("slow", code, run_timeout=4.0))
    cancelled = store.submit(spec("cancelled", code))
    with vramctl.simulate("8GiB") as gpu:
        sched = Scheduler(store, devices=[gpu])
        sched.run_once()
        for job_id in (slow.id, cancelled.id):  # both have started their grandchild
            log = Path(wait_for(store, job_id, ("running",)).log_path or "")
            deadline = time.monotonic() + 30
            while not log.read_bytes().strip() and time.monotonic() < deadline:
                time.sleep(0.02)
        store.cancel(cancelled.id)
        run_all(sched)
    for job_id, state in ((slow.id, "timed-out"), (cancelled.id, "cancelled")):
        job = store.get(job_id)
        assert job.state == state, job
        assert job.finished_at is not None and job.finished
        grandchild = int(Path(job.log_path or "").read_text().split()[0])
        deadline = time.monotonic() + 10
        while _exists(grandchild) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _exists(grandchild), f"{state}: the job's child {grandchild} still runs"
    assert "run timeout of 4 s" in (store.get(slow.id).reason or "")


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) has stopped running.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_a_job_that_waits_too_long_fails_with_the_room_there_was(store: JobStore) -> None:
    job = store.submit(spec("big", "pass", "3GiB", wait_timeout=0.2))
    hog = store.submit(spec("hog", "import time; time.sleep(3)", "3GiB"))
    with vramctl.simulate("4GiB") as gpu:
        sched = Scheduler(store, devices=[gpu], margin=0.0)
        store.update(hog.id, priority=10)
        sched.run_once()
        time.sleep(0.3)
        sched.run_once()
        failed = store.get(job.id)
        assert failed.state == "failed"
        assert failed.reason is not None
        assert failed.reason.startswith("no device had 3.00 GiB free within 0.2 s (largest free: ")
        assert f"on {gpu.id})" in failed.reason
        store.cancel(hog.id)
        run_all(sched)


def test_a_queued_job_says_why_it_waits_until_it_is_admitted(
    store: JobStore, tmp_path: Path
) -> None:
    def held(gate: Path) -> str:  # runs until the gate file exists
        return f"import os, time\nwhile not os.path.exists({str(gate)!r}): time.sleep(0.02)"

    hog = store.submit(spec("hog", held(tmp_path / "hog"), "3GiB", priority=10))
    later = store.submit(spec("later", held(tmp_path / "later"), "2GiB"))
    never = store.submit(spec("never", "pass", "9GiB"))
    gone = store.submit(spec("gone", "pass", "9GiB"))
    with vramctl.simulate("4GiB") as gpu:
        sched = Scheduler(store, devices=[gpu])
        assert [j.id for j in sched.run_once()] == [hog.id]
        assert re.fullmatch(
            rf"waiting: needs 2\.20 GiB with the margin, most free is 716\.80 MiB on {gpu.id}",
            store.get(later.id).reason or "",
        )
        assert store.get(never.id).reason == (
            f"waiting: needs 9.90 GiB with the margin; the largest device has 4.00 GiB "
            f"({gpu.id}): no device here can ever take it"
        )
        store.cancel(gone.id)
        sched.run_once()  # a cancelled job keeps its own reason
        assert (store.get(gone.id).state, store.get(gone.id).reason) == ("cancelled", "cancelled")
        (tmp_path / "hog").touch()
        deadline = time.monotonic() + 30
        while store.get(later.id).state == "queued" and time.monotonic() < deadline:
            sched.run_once()
            time.sleep(0.05)
        assert store.get(later.id).state in ("admitted", "running")
        assert store.get(later.id).reason is None  # the wait is over: so is its reason
        (tmp_path / "later").touch()
        store.cancel(never.id)
        run_all(sched)
    assert store.get(later.id).state == "succeeded"


def test_a_job_is_found_by_a_unique_prefix_of_its_id(store: JobStore) -> None:
    a = store.submit(spec("a", "pass"))
    b = store.submit(spec("b", "pass"))
    with sqlite3.connect(store.path) as conn:  # two ids that share their first 7 characters
        conn.execute("UPDATE jobs SET id = 'cafe0001aaaa' WHERE id = ?", (a.id,))
        conn.execute("UPDATE jobs SET id = 'cafe0002bbbb' WHERE id = ?", (b.id,))
    conn.close()
    assert store.get("cafe0001aaaa").name == "a"
    assert store.get("cafe0001").name == "a" and store.get("CAFE0002B").name == "b"
    with pytest.raises(JobStoreError) as info:
        store.get("cafe000")
    assert str(info.value) == (
        "job id 'cafe000' is ambiguous: it matches cafe0001aaaa (a), cafe0002bbbb (b); "
        "give more of it"
    )
    assert info.value.matches == ("cafe0001aaaa", "cafe0002bbbb")
    with pytest.raises(JobStoreError, match="give at least 4 characters"):
        store.get("caf")
    with pytest.raises(JobStoreError, match="no job 'beef0000'"):
        store.get("beef0000")
    assert store.cancel("cafe0002").id == "cafe0002bbbb"
    assert [j.state for j in store.list()] == ["queued", "cancelled"]


def test_device_constraints_pick_the_device(store: JobStore) -> None:
    with vramctl.simulate("A10G-24GB") as a10, vramctl.simulate("T4-16GB") as t4:
        job = store.submit(spec("ampere", "pass", devices=DeviceConstraints(model="A10G")))
        sched = Scheduler(store, devices=[t4, a10])
        (admitted,) = sched.run_once()
        assert admitted.device == a10.id
        run_all(sched)
    assert store.get(job.id).state == "succeeded"


def test_an_entry_point_is_held_to_its_share_on_a_simulated_gpu(
    store: JobStore, tmp_path: Path
) -> None:
    module = tmp_path / "work_mod.py"
    module.write_text(
        textwrap.dedent(
            """
            import sys, torch

            def allocate():
                n = int(sys.argv[1])
                torch.empty(n, dtype=torch.uint8)
                print("allocated", n)
            """
        )
    )
    env = {"PYTHONPATH": str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    within = JobSpec(
        name="within",
        entry_point="work_mod:allocate",
        args=(str(GiB // 2),),
        env=env,
        memory=MemoryNeed.of_size("1GiB"),
    )
    beyond = JobSpec(
        name="beyond",
        entry_point="work_mod:allocate",
        args=(str(2 * GiB),),
        env=env,
        memory=MemoryNeed.of_size("1GiB"),
        overrun_retries=0,  # its overrun ends it
    )
    a, b = store.submit(within), store.submit(beyond)
    with vramctl.simulate("8GiB") as gpu:
        run_all(Scheduler(store, devices=[gpu]))
    assert store.get(a.id).state == "succeeded"
    over = store.get(b.id)
    assert over.state == "failed" and over.overruns == 0
    assert "OutOfMemoryError" in Path(over.log_path or "").read_text()
    assert (over.reason or "").startswith("ran out of memory under its share of 1.10 GiB")


# -- a guarded job --------------------------------------------------------------------------

STEPS = """
import torch

MiB = 2**20
model = torch.nn.Linear(16, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


def scratch(batch):
    # Memory that grows with the batch: 64 MiB a sample.
    return torch.empty(batch.shape[0], 64 * MiB, dtype=torch.uint8)


def embed(batch):
    scratch(batch)
    return batch.sum(dim=1)


def train(batch):
    scratch(batch)
    return model(batch).pow(2).mean()
"""

MAIN = """
import sys, torch
from steps import embed, train
if sys.argv[1] == "embed":
    print("embedded", embed(torch.ones(32, 16)).shape[0])
else:
    for _ in range(2):
        result = train(torch.ones(32, 16))
    print("trained", result.batch_size, "pieces", result.pieces)
"""


def test_a_guarded_job_finishes_a_batch_its_share_cannot_hold(
    store: JobStore, tmp_path: Path
) -> None:
    # 32 samples need 2 GiB of scratch in a 1 GiB share: plain, the job fails; with the
    # spec's guard the function runs in pieces and the job succeeds.
    (tmp_path / "steps.py").write_text(STEPS)
    (tmp_path / "main.py").write_text(MAIN)

    def job(name: str, what: str, **kw: Any) -> JobSpec:
        return JobSpec(
            name=name,
            command=(PY, "main.py", what),
            cwd=str(tmp_path),
            memory=MemoryNeed.of_size("1GiB"),
            **kw,
        )

    plain = store.submit(job("plain", "embed", overrun_retries=0))
    embed = store.submit(job("embed", "embed", guard=GuardOptions("steps:embed")))
    train = store.submit(
        job("train", "train", guard=GuardOptions("steps:train", optimizer="steps:optimizer"))
    )
    entry = store.submit(
        JobSpec(
            name="entry",
            entry_point="main_entry:run",
            env={"PYTHONPATH": str(tmp_path)},
            memory=MemoryNeed.of_size("1GiB"),
            guard=GuardOptions("steps:embed"),
        )
    )
    (tmp_path / "main_entry.py").write_text(
        "import torch\nfrom steps import embed\n\n"
        "def run():\n    print('embedded', embed(torch.ones(32, 16)).shape[0])\n"
    )
    with vramctl.simulate("8GiB") as gpu:
        run_all(Scheduler(store, devices=[gpu]))

    def log(job: Job) -> str:
        return Path(store.get(job.id).log_path or "").read_text()

    assert store.get(plain.id).state == "failed" and "OutOfMemoryError" in log(plain)
    for done in (embed, entry):
        assert store.get(done.id).state == "succeeded", log(done)
        assert "embedded 32" in log(done)
        assert "the guard of steps:embed ran 1 of 1 steps in pieces" in log(done), log(done)
    assert store.get(train.id).state == "succeeded", log(train)
    # Both steps ran the whole batch, in pieces (the guard remembers the size that fit).
    found = re.search(r"trained 32 pieces (\d+)", log(train))
    assert found and int(found[1]) > 1, log(train)
    assert "the guard of steps:train ran 2 of 2 steps in pieces" in log(train)


@pytest.mark.cuda
def test_a_guarded_job_finishes_on_a_gpu(store: JobStore, tmp_path: Path) -> None:
    # The same job on a real GPU, capped by the allocator at a 1 GiB share.
    (tmp_path / "steps.py").write_text(
        STEPS.replace("dtype=torch.uint8)", "dtype=torch.uint8, device='cuda')")
    )
    (tmp_path / "main.py").write_text(MAIN)
    job = store.submit(
        JobSpec(
            name="embed",
            command=(PY, "main.py", "embed"),
            cwd=str(tmp_path),
            memory=MemoryNeed.of_size("1GiB"),
            guard=GuardOptions("steps:embed"),
        )
    )
    run_all(Scheduler(store, devices=[vramctl.gpus()[0]]))
    text = Path(store.get(job.id).log_path or "").read_text()
    assert store.get(job.id).state == "succeeded", text
    assert "embedded 32" in text and "the guard of steps:embed ran 1 of 1" in text


def test_a_guard_that_never_applies_says_why(store: JobStore, tmp_path: Path) -> None:
    (tmp_path / "steps.py").write_text(STEPS)
    job = store.submit(
        JobSpec(
            name="script",
            command=(PY, "-c", "print('no import')"),
            cwd=str(tmp_path),
            memory=MemoryNeed.of_size("1GiB"),
            guard=GuardOptions("steps:embed"),
        )
    )
    with vramctl.simulate("8GiB") as gpu:
        run_all(Scheduler(store, devices=[gpu]))
    assert store.get(job.id).state == "succeeded"
    text = Path(store.get(job.id).log_path or "").read_text()
    assert "the guard of steps:embed was never applied: the job did not import steps" in text


# -- a scheduler killed mid-run -------------------------------------------------------------


SCHEDULER = """
import sys, vramctl
from vramctl.jobs import JobStore, Scheduler
with vramctl.simulate("6GiB") as gpu:
    Scheduler(JobStore(sys.argv[1]), devices=[gpu], interval_s=0.05).run()
"""


def test_a_scheduler_killed_mid_run_loses_no_job_and_runs_none_twice(
    store: JobStore, tmp_path: Path
) -> None:
    out = tmp_path / "ran"
    code = f"""
        import os, time
        time.sleep(0.4)
        with open({str(out)!r}, "a") as f:
            f.write(os.environ["VRAMCTL_JOB_ID"] + "\\n")
    """
    ids = [store.submit(spec(f"j{i}", code, "2GiB")).id for i in range(8)]
    for _ in range(2):  # killed twice while jobs run
        proc = subprocess.Popen([PY, "-c", SCHEDULER, str(store.path)])
        deadline = time.monotonic() + 30
        while store.counts()["running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert store.counts()["running"] > 0
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with vramctl.simulate("6GiB") as gpu:  # a new scheduler adopts what is left
        run_all(Scheduler(store, devices=[gpu]), timeout=90)
    assert [store.get(i).state for i in ids] == ["succeeded"] * 8
    ran = out.read_text().split()
    assert sorted(ran) == sorted(ids)  # every job ran, and none twice


def _orphaned(store: JobStore, sched: Scheduler, job_id: str) -> Job:
    """Run ``job_id`` and kill its supervisor once the job runs: an orphan."""
    sched.run_once()
    running = wait_for(store, job_id, ("running",))
    assert running.supervisor_pid is not None and running.pid is not None
    os.kill(running.supervisor_pid, signal.SIGKILL)
    assert isinstance(sched.runner, LocalRunner)
    sched.runner._started[job_id].wait()
    return running


def test_a_job_whose_supervisor_died_is_not_run_again(store: JobStore, tmp_path: Path) -> None:
    # Its run may have finished (here it succeeds): retries are for runs known to fail.
    out = tmp_path / "ran"
    code = f"import time; time.sleep(0.5); open({str(out)!r}, 'a').write('x')"
    job = store.submit(spec("orphan", code, retries=1))
    with vramctl.simulate("4GiB") as gpu:
        sched = Scheduler(store, devices=[gpu])
        running = _orphaned(store, sched, job.id)
        # The job runs on without its supervisor: its reservation stays until it ends ...
        assert sched.adopt() == [] and store.get(job.id).state == "running"
        wait_until_gone(running.pid or 0)
        # ... then it fails, its exit status unknown, and is not queued again.
        (lost,) = sched.adopt()
        run_all(sched)
    assert lost.state == "failed" and "exit status is unknown" in (lost.reason or "")
    assert "not run again" in (lost.reason or "")
    assert (store.get(job.id).state, store.get(job.id).attempts) == ("failed", 1)
    assert out.read_text() == "x"  # it ran once


def test_a_restarted_scheduler_adopts_no_stranger_with_the_jobs_pid(store: JobStore) -> None:
    # The job's process ended while no scheduler ran, and its pid went to another process
    # that leads a session of its own (here: one started for the test). Its start time is
    # not the job's process's, so it holds no reservation.
    job = store.submit(spec("orphan", "import time; time.sleep(30)"))
    with vramctl.simulate("4GiB") as gpu:
        sched = Scheduler(store, devices=[gpu])
        running = _orphaned(store, sched, job.id)
        assert running.pid_started is not None
        assert abs(running.pid_started - psutil.Process(running.pid).create_time()) < 0.01
        stranger = subprocess.Popen(
            [PY, "-c", "import time; time.sleep(30)"], start_new_session=True
        )
        try:
            # The same process: it is held. A stranger under the job's pid: it is not.
            assert sched.adopt() == [] and store.get(job.id).state == "running"
            os.killpg(running.pid or 0, signal.SIGKILL)
            wait_until_gone(running.pid or 0)
            store.update(
                job.id, pid=stranger.pid, pid_started=psutil.Process(stranger.pid).create_time() - 5
            )
            sched._orphans.clear()
            (lost,) = sched.adopt()
            assert lost.state == "failed" and "exit status is unknown" in (lost.reason or "")
            assert stranger.poll() is None  # no signal went to the stranger
        finally:
            stranger.kill()
            stranger.wait()


def test_a_lost_job_runs_again_when_its_spec_says_so(store: JobStore) -> None:
    job = store.submit(spec("orphan", "import time; time.sleep(0.5)", retries=1, rerun_lost=True))
    with vramctl.simulate("4GiB") as gpu:
        sched = Scheduler(store, devices=[gpu])
        running = _orphaned(store, sched, job.id)
        wait_until_gone(running.pid or 0)
        (lost,) = sched.adopt()
        assert lost.state == "queued" and "supervisor died" in (lost.reason or "")
        run_all(sched)
    done = store.get(job.id)
    assert (done.state, done.attempts) == ("succeeded", 2)


def test_an_orphan_is_held_to_its_cancel_request(store: JobStore) -> None:
    job = store.submit(spec("orphan", "import time; time.sleep(60)"))
    with vramctl.simulate("4GiB") as gpu:
        sched = Scheduler(store, devices=[gpu])
        running = _orphaned(store, sched, job.id)
        store.cancel(job.id)
        assert sched.adopt() == []  # SIGTERM to its process group
        wait_until_gone(running.pid or 0)
        (ended,) = sched.adopt()
    assert ended.state == "cancelled" and "supervisor had died" in (ended.reason or "")


def test_an_orphan_is_held_to_its_run_timeout(store: JobStore) -> None:
    # It ignores SIGTERM: SIGKILL follows after the grace.
    code = """
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(60)
    """
    job = store.submit(spec("orphan", code, run_timeout=1.0))
    with vramctl.simulate("4GiB") as gpu:
        sched = Scheduler(store, devices=[gpu])
        running = _orphaned(store, sched, job.id)
        time.sleep(1.2)
        sched._orphans.clear()
        assert sched.adopt() == [] and store.get(job.id).state == "running"
        assert sched._orphans[job.id].state == "timed-out"
        sched._orphans[job.id].since -= 10  # the grace is over
        assert sched.adopt() == []  # SIGKILL
        wait_until_gone(running.pid or 0)
        (ended,) = sched.adopt()
    assert ended.state == "timed-out" and "run timeout of 1 s" in (ended.reason or "")


def test_a_job_whose_supervisor_never_started_is_queued_again(store: JobStore) -> None:
    job = store.submit(spec("never", "pass", retries=0))
    with vramctl.simulate("4GiB") as gpu:
        sched = Scheduler(store, devices=[gpu], launch=lambda j: None)
        sched.run_once()  # admitted; the launch hook starts nothing
        store.update(job.id, admitted_at=time.time() - 60)
        sched.launch = None
        (lost,) = sched.adopt()
    assert lost.state == "queued" and "did not start" in (lost.reason or "")


def wait_until_gone(pid: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while _exists(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _exists(pid)


# -- placement and the batch ------------------------------------------------------------------


def test_the_policy_chooses_among_the_devices_with_room(store: JobStore) -> None:
    with vramctl.simulate("8GiB") as small, vramctl.simulate("16GiB") as large:
        # least-loaded: no jobs on either, so the most room left; fragmentation: the
        # placement module's FGD policy, which keeps the large device whole for large jobs.
        for policy, where in (
            ("best-fit", small),
            ("most-free", large),
            ("least-loaded", large),
            ("fragmentation", small),
        ):
            job = store.submit(spec(policy, "pass", "2GiB"))
            sched = Scheduler(store, devices=[large, small], policy=policy)
            (admitted,) = sched.run_once()
            assert admitted.id == job.id and admitted.device == where.id
            run_all(sched)
    with pytest.raises(JobSpecError, match="unknown placement policy 'first-fit'"):
        Scheduler(store, devices=[], policy="first-fit")


def test_a_batch_that_does_not_fit_is_lowered_with_accumulation(
    store: JobStore, tmp_path: Path
) -> None:
    need = {"estimate": {"model": "lstm", "seq_len": 1024}}
    job_spec = JobSpec.from_dict(
        {
            "name": "lstm",
            "command": [
                PY,
                "-c",
                "import os; print(os.environ['VRAMCTL_BATCH_SIZE'], "
                "os.environ['VRAMCTL_GRAD_ACCUM'])",
            ],
            "memory": need,
            "batch_size": 16,
            "effective_batch": 64,
        }
    )
    with vramctl.simulate("T4-16GB") as probe:
        at = {b: price(job_spec, probe, batch_size=b) for b in (16, 8)}
    assert at[16] > at[8]
    room = (at[16] + at[8]) // 2  # the batch of 16 does not fit; 8 does
    job = store.submit(job_spec)
    with vramctl.simulate("T4-16GB") as gpu:
        sched = Scheduler(store, devices=[gpu], margin=0.0)
        sched._ledger = _capped(sched._ledger, room)  # type: ignore[method-assign]
        (admitted,) = sched.run_once()
        assert (admitted.batch_size, admitted.grad_accum) == (8, 8)
        assert admitted.reserved_bytes == at[8]
        run_all(sched)
    done = store.get(job.id)
    assert done.state == "succeeded"
    assert Path(done.log_path or "").read_text().split() == ["8", "8"]


def _capped(ledger: Any, room: int) -> Any:
    """The scheduler's ledger with each device reporting ``room`` bytes free."""

    def capped() -> Any:
        book, free = ledger()
        return book, [room for _ in free]

    return capped


ALLOCATE = """
import sys
import torch
x = torch.empty(int(sys.argv[1]), dtype=torch.uint8)
print("allocated", x.numel())
"""


def test_a_python_command_is_held_to_its_share_on_a_simulated_gpu(store: JobStore) -> None:
    def job(name: str, n: int, retries: int = 1) -> JobSpec:
        return JobSpec(
            name=name,
            command=(PY, "-c", ALLOCATE, str(n)),
            memory=MemoryNeed.of_size("1GiB"),
            overrun_retries=retries,
        )

    within = store.submit(job("within", GiB // 2))
    beyond = store.submit(job("beyond", 2 * GiB, retries=0))
    again = store.submit(job("again", 2 * GiB))
    plain = store.submit(spec("plain", "import json; print('no torch')"))
    admitted: dict[str, list[int]] = {}
    with vramctl.simulate("8GiB") as gpu:
        sched = Scheduler(store, devices=[gpu])
        deadline = time.monotonic() + 60
        while any(not store.get(j.id).finished for j in (within, beyond, again, plain)):
            assert time.monotonic() < deadline, store.counts()
            for a in sched.run_once():
                admitted.setdefault(a.id, []).append(int(a.reserved_bytes or 0))
            time.sleep(0.05)
    assert store.get(within.id).state == "succeeded"
    assert store.get(plain.id).state == "succeeded"
    over = store.get(beyond.id)
    assert over.state == "failed"
    assert "OutOfMemoryError" in Path(over.log_path or "").read_text()
    # The same overrun, with a retry: queued again needing what it asked for, then done.
    done = store.get(again.id)
    log = Path(done.log_path or "").read_text()
    assert done.state == "succeeded", (done.reason, log)
    assert done.overruns == 1 and done.attempts == 2 and done.need_bytes == 2 * GiB
    assert log.count("OutOfMemoryError") >= 1 and "allocated 2147483648" in log
    first, second = admitted[again.id]
    assert abs(first - 1.1 * GiB) <= 1 and abs(second - 2.2 * GiB) <= 1


@pytest.mark.cuda
def test_a_python_command_is_held_to_its_share_on_a_gpu(store: JobStore) -> None:
    gpu = vramctl.gpus()[0]
    on_gpu = ALLOCATE.replace("torch.uint8)", "torch.uint8, device='cuda')")

    def job(name: str, retries: int) -> JobSpec:
        return JobSpec(
            name=name,
            command=(PY, "-c", on_gpu, str(2 * GiB)),
            memory=MemoryNeed.of_size("1GiB"),
            overrun_retries=retries,
        )

    big, again = store.submit(job("beyond", 0)), store.submit(job("again", 1))
    run_all(Scheduler(store, devices=[gpu]))
    over = store.get(big.id)
    assert over.state == "failed"
    assert "OutOfMemoryError" in Path(over.log_path or "").read_text()
    # Its twin with a retry ran again needing at least what CUDA's error said it asked for.
    done = store.get(again.id)
    assert done.state == "succeeded", done.reason
    assert done.overruns == 1 and (done.need_bytes or 0) >= 2 * GiB


def test_the_supervisor_imports_neither_vramctl_nor_torch() -> None:
    import vramctl.jobs._supervise as supervise

    # One runs beside every job for its whole life: it must stay small and start fast.
    found = subprocess.run(
        [PY, "-X", "importtime", supervise.__file__],
        capture_output=True,
        text=True,
        check=False,
    )
    assert found.returncode == 2 and "usage" in found.stderr
    modules = {line.split("|")[-1].strip() for line in found.stderr.splitlines() if "|" in line}
    assert "psutil" in modules
    banned = ("torch", "vramctl", "numpy", "pynvml")  # pynvml: only for a job on a CUDA device
    assert not {m for m in modules if m.split(".")[0] in banned}


def test_the_queue_kept_between_rounds_follows_the_store(store: JobStore) -> None:
    started: list[str] = []
    with vramctl.simulate("8GiB") as gpu:
        sched = Scheduler(store, devices=[gpu], margin=0.0, launch=lambda j: started.append(j.id))
        big = store.submit(spec("big", "pass", "6GiB"))
        second = store.submit(spec("second", "pass", "6GiB"))
        gone = store.submit(spec("gone", "pass", "6GiB"))
        assert [j.id for j in sched.run_once()] == [big.id]
        assert sched.run_once() == []  # the others fit nowhere while big holds its share
        store.cancel(gone.id)
        late = store.submit(spec("late", "pass", "1GiB"))  # new since the last round
        assert [j.id for j in sched.run_once()] == [late.id]
        store.move(big.id, "admitted", "succeeded", finished_at=time.time())
        assert [j.id for j in sched.run_once()] == [second.id]
        # Queued again (a retry): read afresh, and admitted again once there is room.
        store.move(second.id, "admitted", "queued", attempts=1)
        store.move(late.id, "admitted", "succeeded", finished_at=time.time())
        (again,) = sched.run_once()
        assert again.id == second.id and again.attempts == 1
    assert store.get(gone.id).state == "cancelled"
    assert started == [big.id, late.id, second.id, second.id]


# -- overruns and the store's added columns ---------------------------------------------------


def test_a_store_of_an_earlier_version_gets_the_columns_added_since(tmp_path: Path) -> None:
    from vramctl.jobs._store import _ADDED_COLUMNS, _SCHEMA

    old = _SCHEMA
    for name, ddl in _ADDED_COLUMNS.items():
        old = old.replace(f",\n    {name} {ddl}", "")
    assert "pid_started" not in old and "overruns" not in old
    path = tmp_path / "jobs.db"
    with sqlite3.connect(path) as conn:
        conn.executescript(old)
        conn.execute(
            "INSERT INTO jobs (id, name, spec, state, submitted_at) VALUES (?, ?, ?, ?, ?)",
            ("0123456789ab", "old", spec("old", "pass").to_json(), "queued", time.time()),
        )
    conn.close()
    path.chmod(0o600)
    with JobStore(path) as store:
        job = store.get("0123456789ab")
        assert (job.pid_started, job.need_bytes, job.overruns) == (None, None, 0)
        assert store.move(job.id, "queued", "queued", need_bytes=5, overruns=1)
    with JobStore(path) as again:  # opened again: nothing to add
        assert again.get(job.id).overruns == 1


def test_a_job_that_overran_past_every_device_fails_rather_than_waits(store: JobStore) -> None:
    job = store.submit(spec("big", "pass", "3GiB"))
    with vramctl.simulate("4GiB") as gpu:
        sched = Scheduler(store, devices=[gpu], launch=lambda j: None)
        (admitted,) = sched.run_once()
        # As its supervisor records it: it used 3.9 GiB of its 3.3 GiB share.
        assert store.move(admitted.id, "admitted", "running", attempts=1)
        assert store.move(
            job.id,
            "running",
            "queued",
            peak_bytes=int(3.9 * GiB),
            need_bytes=int(3.9 * GiB),
            overruns=1,
            reason="used 3.90 GiB of GPU memory, past its reservation",
        )
        assert sched.run_once() == []
    done = store.get(job.id)
    assert done.state == "failed"
    assert (done.reason or "").endswith("more than any device here can take")
    assert "needs at least 3.90 GiB" in (done.reason or "")
