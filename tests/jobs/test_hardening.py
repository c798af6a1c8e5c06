"""What the token protects stays protected on disk, and one bad job does not stop the queue."""

from __future__ import annotations

import itertools
import os
import stat
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import vramctl
from vramctl.jobs import OVERRUN_GROWTH, JobSpec, JobSpecError, JobStore, MemoryNeed, Scheduler
from vramctl.jobs._store import JobStoreError

PY = sys.executable


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def spec(name: str, **kw: Any) -> JobSpec:
    return JobSpec(name=name, command=(PY, "-c", "pass"), memory=MemoryNeed.of_size("1GiB"), **kw)


# -- files ----------------------------------------------------------------------------------


def test_a_new_store_and_its_side_files_are_owner_only(tmp_path: Path) -> None:
    root = tmp_path / "home"
    with JobStore(root / "jobs.db") as store:
        store.submit(spec("secret", env={"API_KEY": "hunter2"}))
        with store.admission_lock():
            pass
        for name in ("jobs.db", "jobs.db-wal", "jobs.db-shm", "jobs.db.lock"):
            assert mode(root / name) == 0o600, name
        assert mode(root / "logs") == 0o700
        assert mode(root) == 0o700  # made by the store


def test_a_store_left_readable_by_others_is_made_owner_only_when_opened(tmp_path: Path) -> None:
    root = tmp_path / "old"
    with JobStore(root / "jobs.db") as store:
        store.submit(spec("a"))
    (root / "logs" / "abc.log").write_text("output")
    for p in (root / "jobs.db", root / "jobs.db-wal", root / "logs" / "abc.log"):
        if p.exists():
            p.chmod(0o644)
    (root / "logs").chmod(0o755)
    with JobStore(root / "jobs.db"):
        assert mode(root / "jobs.db") == 0o600
        assert mode(root / "logs") == 0o700
        assert mode(root / "logs" / "abc.log") == 0o600
        if (root / "jobs.db-wal").exists():
            assert mode(root / "jobs.db-wal") == 0o600


@pytest.mark.skipif(os.getuid() != 0, reason="only root can give a file to another user")
def test_a_store_file_of_another_user_is_refused_in_one_line(tmp_path: Path) -> None:
    root = tmp_path / "theirs"
    with JobStore(root / "jobs.db"):
        pass
    os.chown(root / "jobs.db", 65534, 65534)
    with pytest.raises(JobStoreError, match="belongs to another user"):
        JobStore(root / "jobs.db")


def test_a_jobs_log_is_owner_only(tmp_path: Path) -> None:
    with JobStore(tmp_path / "jobs.db") as store, vramctl.simulate("4GiB") as gpu:
        job = JobSpec(
            name="talks",
            command=(PY, "-c", "print('hello')"),
            memory=MemoryNeed.of_size("1GiB"),
        )
        made = store.submit(job)
        sched = Scheduler(store, devices=[gpu], margin=0.0)
        sched.run(until_idle=True)
        done = store.get(made.id)
        assert done.state == "succeeded"
        assert done.log_path is not None
        assert Path(done.log_path).read_text().strip() == "hello"
        assert mode(Path(done.log_path)) == 0o600


# -- one bad job ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("batch_size", 2**63, "batch_size: must be at most 2147483647"),
        ("batch_size", 2**31, "batch_size: must be at most 2147483647"),
        ("priority", 2**63, "priority: must be a signed 64-bit integer"),
        ("priority", -(2**63) - 1, "priority: must be a signed 64-bit integer"),
        ("wait_timeout", 1e300, "wait_timeout: must be at most"),
        ("retries", 10**9, "retries: must be at most 1000"),
    ],
)
def test_out_of_range_numbers_are_refused_at_submission(
    field: str, value: object, message: str
) -> None:
    with pytest.raises(JobSpecError, match=message):
        spec("big", **{field: value})


def test_an_estimate_in_a_spec_refuses_a_huge_batch_too() -> None:
    with pytest.raises(JobSpecError, match=r"memory\.estimate\.seq_len: must be at most"):
        JobSpec.from_dict(
            {
                "name": "long",
                "command": [PY, "-c", "pass"],
                "memory": {"estimate": {"model": "gpt2", "seq_len": 2**40}},
            }
        )


class _PoisonedPricing(Scheduler):
    """A scheduler whose pricing of one job raises what no spec check foresaw (as an
    estimate that fails only at the scheduler's batch size does)."""

    def _price(self, job: Any, device: int, batch: int | None) -> int:
        if job.name == "poison":
            raise RuntimeError("the estimate failed at this batch size")
        return super()._price(job, device, batch)


def test_a_job_that_cannot_be_priced_fails_alone_and_the_queue_moves_on(tmp_path: Path) -> None:
    with JobStore(tmp_path / "jobs.db") as store, vramctl.simulate("4GiB") as gpu:
        poison = store.submit(spec("poison", priority=10))
        after = store.submit(spec("after"))
        sched = _PoisonedPricing(store, devices=[gpu], margin=0.0, launch=lambda job: None)
        admitted = sched.run_once()
        assert [j.id for j in admitted] == [after.id]
        failed = store.get(poison.id)
        assert failed.state == "failed"
        assert failed.reason == (
            "could not be priced or placed: RuntimeError: the estimate failed at this batch size"
        )


# -- the low items ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["train\n", "train\r\n", "\ntrain", "tr ain"])
def test_a_name_with_a_newline_or_space_is_refused(name: str) -> None:
    with pytest.raises(JobSpecError, match="name: must be 1 to 128 letters"):
        spec(name)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"KEY": "a\0b"}, "env: a name or value holds a NUL character"),
        ({"K\0": "v"}, "env: a name or value holds a NUL character"),
        ({"A=B": "v"}, "is not a variable name"),
        ({"": "v"}, "is not a variable name"),
    ],
)
def test_an_env_the_system_cannot_pass_is_refused_at_submission(
    env: dict[str, str], message: str
) -> None:
    with pytest.raises(JobSpecError, match=message):
        spec("envy", env=env)


def test_a_job_asking_for_two_devices_at_once_fails_with_the_reason(tmp_path: Path) -> None:
    from vramctl.jobs import DeviceConstraints

    with JobStore(tmp_path / "jobs.db") as store, vramctl.simulate("8GiB") as gpu:
        two = store.submit(spec("two", devices=DeviceConstraints(count=2)))
        one = store.submit(spec("one"))
        sched = Scheduler(store, devices=[gpu], margin=0.0, launch=lambda job: None)
        assert [j.id for j in sched.run_once()] == [one.id]
        failed = store.get(two.id)
        assert failed.state == "failed"
        assert (failed.reason or "").startswith("devices.count: this queue places a job on one")


def test_a_relative_store_path_stores_absolute_log_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with JobStore(Path("rel") / "jobs.db") as store:
        job = store.submit(spec("where"))
        assert job.log_path is not None
        assert Path(job.log_path).is_absolute()
        assert Path(job.log_path).parent == tmp_path / "rel" / "logs"


# -- shares -----------------------------------------------------------------------------------

#: Says what it was told, tries to lift its limit, then allocates (and touches) 1.5 GiB.
GREEDY = """
import os, resource
print(os.environ.get("VRAMCTL_MEMORY_LIMIT_BY"), os.environ.get("VRAMCTL_MEMORY_LIMIT"))
try:
    resource.setrlimit(resource.RLIMIT_DATA, (resource.RLIM_INFINITY,) * 2)
    print("lifted")
except (ValueError, OSError):
    print("cannot lift it")
try:
    x = bytearray(b"\\1") * (1536 * 2**20)
except MemoryError:
    print("MemoryError")
    raise SystemExit(3)
print("GOT-IT-ALL")
"""

#: Three children of 100 MiB each, each within a limit of its own.
SPREAD = """
import subprocess, sys
code = "import time; x = bytearray(b'\\\\1') * (100 * 2**20); time.sleep(30)"
kids = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(3)]
for k in kids:
    k.wait()
"""


def _run_jobs(store: JobStore, devices: list[Any]) -> None:
    from tests.jobs.test_queue import run_all

    run_all(Scheduler(store, devices=devices, margin=0.0), timeout=90)


def test_a_cpu_job_is_held_by_a_real_limit_and_told_which(tmp_path: Path) -> None:
    # Reserved 110 MiB, it once peaked at 1.5 GiB and succeeded, with nothing noted.
    cpu = vramctl.device.resolve("cpu")
    with JobStore(tmp_path / "jobs.db") as store:
        job = store.submit(
            JobSpec(name="greedy", command=(PY, "-c", GREEDY), memory=MemoryNeed.of_size("110MiB"))
        )
        _run_jobs(store, [cpu])
        done = store.get(job.id)
        log = Path(done.log_path or "").read_text()
    assert done.state == "failed", log
    assert "by RLIMIT_DATA (each process)" in log
    assert "RLIMIT_DATA" in log.splitlines()[1]  # what the job was told
    assert "cannot lift it" in log and "MemoryError" in log and "GOT-IT-ALL" not in log
    assert (done.peak_bytes or 0) < 1536 * 2**20


def test_a_cpu_job_whose_processes_pass_its_share_together_is_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VRAMCTL_PROCESS_ALLOWANCE", "24MiB")
    cpu = vramctl.device.resolve("cpu")
    with JobStore(tmp_path / "jobs.db") as store:
        job = store.submit(
            JobSpec(
                name="spread",
                command=(PY, "-c", SPREAD),
                memory=MemoryNeed.of_size("150MiB"),
                overrun_retries=0,
            )
        )
        _run_jobs(store, [cpu])
        done = store.get(job.id)
    assert done.state == "failed"
    assert (done.reason or "").startswith("used ")
    assert "of host memory, past its reservation of 150.00 MiB (+5%, and 24.00 MiB" in (
        done.reason or ""
    )
    assert done.overruns == 0 and done.need_bytes is None


#: Three processes of 100 MiB each for a moment: together past a share of 150 MiB.
SPREAD_BRIEFLY = SPREAD.replace("time.sleep(30)", "time.sleep(1.5)")


def test_a_job_that_overran_its_share_runs_again_with_what_it_was_seen_to_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VRAMCTL_PROCESS_ALLOWANCE", "24MiB")
    cpu = vramctl.device.resolve("cpu")
    reserved: list[int] = []
    with JobStore(tmp_path / "jobs.db") as store:
        spec = JobSpec(
            name="spread",
            command=(PY, "-c", SPREAD_BRIEFLY),
            memory=MemoryNeed.of_size("150MiB"),
            overrun_retries=4,
        )
        job = store.submit(spec)
        sched = Scheduler(store, devices=[cpu], margin=0.0)
        deadline = time.monotonic() + 90
        while not store.get(job.id).finished and time.monotonic() < deadline:
            for admitted in sched.run_once():
                reserved.append(int(admitted.reserved_bytes or 0))
            time.sleep(0.05)
        done = store.get(job.id)
    assert done.state == "succeeded", done.reason
    # Stopped at least once, each attempt asking for at least 1.5x the last.
    assert 1 <= done.overruns <= 4
    assert len(reserved) == done.overruns + 1 == done.attempts
    assert reserved[0] == 150 * 2**20
    for before, after in itertools.pairwise(reserved):
        assert after >= int(before * OVERRUN_GROWTH)
    assert done.need_bytes is not None and done.need_bytes >= 225 * 2**20
    assert done.reason is None  # its last attempt succeeded


#: Ways out of the simulated share, each then allocating 600 MiB of the host's memory.
ALLOCATE = "import time; x = bytearray(b'\\1') * (600 * 2**20); time.sleep(30)"
LEAVES_THE_SIMULATION = """
import time, torch
from vramctl.jobs import _run
_run._HELD[0].__exit__(None, None, None)   # out of vramctl.simulate
x = torch.ones(600 * 2**20, dtype=torch.uint8)
time.sleep(30)
"""
REMOVES_THE_HOOK = """
import sys, time
sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "_After"]
import torch                                # never held
x = torch.ones(600 * 2**20, dtype=torch.uint8)
time.sleep(30)
"""
ESCAPES = {
    "python -S": ("-S", "-c", ALLOCATE),
    "python -I": ("-I", "-c", ALLOCATE),
    "leaves the simulation": ("-c", LEAVES_THE_SIMULATION),
    "removes the import hook": ("-c", REMOVES_THE_HOOK),
}


@pytest.mark.parametrize("escape", list(ESCAPES))
def test_a_job_that_escapes_its_simulated_share_is_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, escape: str
) -> None:
    # Out of the simulation nothing counts its share; its memory is the host's, and the
    # supervisor watches that.
    monkeypatch.setenv("VRAMCTL_PROCESS_ALLOWANCE", "128MiB")
    with JobStore(tmp_path / "jobs.db") as store, vramctl.simulate("4GiB") as gpu:
        job = store.submit(
            JobSpec(
                name="escape",
                command=(PY, *ESCAPES[escape]),
                memory=MemoryNeed.of_size("256MiB"),
                overrun_retries=0,
            )
        )
        _run_jobs(store, [gpu])
        done = store.get(job.id)
    assert done.state == "failed", Path(done.log_path or "").read_text()
    assert "of host memory, past its reservation of 256.00 MiB" in (done.reason or "")


def test_a_delegated_cgroup_gets_the_jobs_memory_max(tmp_path: Path) -> None:
    # A folder stands in for cgroupfs (this machine has cgroup v1): what vramctl writes, and
    # that it gives up on a cgroup without the memory controller.
    from vramctl.jobs._supervise import _cgroup_limit

    base = tmp_path / "delegated"
    base.mkdir()
    (base / "cgroup.controllers").write_text("cpu io memory pids\n")
    folder = _cgroup_limit("abc123", 5 * 2**20, str(base))
    assert folder == str(base / "vramctl-abc123")
    assert (base / "vramctl-abc123" / "memory.max").read_text() == str(5 * 2**20)
    assert (base / "vramctl-abc123" / "memory.swap.max").read_text() == "0"
    assert (base / "cgroup.subtree_control").read_text() == "+memory"
    (base / "cgroup.controllers").write_text("cpu io pids\n")
    assert _cgroup_limit("def456", 2**20, str(base)) is None
    assert _cgroup_limit("def456", 2**20, str(tmp_path / "none")) is None
    assert _cgroup_limit("def456", 2**20, None) is None
