"""The supervisor on a GPU: NVML's reading of a job's processes, the overrun stop, the
device's peak, CUDA_VISIBLE_DEVICES and MPS.

The NVML tests run the real supervisor in this process, with a real job process, against
the NVML stand-in (``tests/fake_nvml.py``), which reports the job's pid as using some
memory. The ``cuda`` tests do the same on a real GPU through the scheduler.
"""

from __future__ import annotations

import os
import sys
import textwrap
import threading
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pynvml
import pytest

import vramctl
import vramctl.jobs._supervise as sup
from tests.fake_nvml import FakeGpu, FakeNvml, FakeProcess
from tests.jobs.test_queue import ALLOCATE, _exists, run_all
from vramctl.jobs import JobSpec, JobStore, MemoryNeed, Scheduler
from vramctl.jobs._run import write_peak

MiB = 2**20
GiB = 2**30
PY = sys.executable

SLEEP = "import time; time.sleep({s})"
#: Prints what the job was given, then sleeps.
SHOW_ENV = """
import os, sys, time
for name in sys.argv[1:]:
    print(name, os.environ.get(name), flush=True)
time.sleep({s})
"""
#: Starts a grandchild in the job's process group, prints its pid, sleeps.
WITH_GRANDCHILD = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(child.pid, flush=True)
time.sleep(60)
"""


@pytest.fixture
def store(tmp_path: Path) -> Iterator[JobStore]:
    with JobStore(tmp_path / "jobs.db") as s:
        yield s


@pytest.fixture(autouse=True)
def _neighbours_are_here(gpus: list[FakeGpu]) -> None:
    """The fake GPUs' other processes are processes of this machine, as on a host (a pid
    that no process here has is how a supervisor in a container sees NVML's)."""
    for gpu in gpus:
        for proc in gpu.processes:
            proc.pid = 1


@pytest.fixture(autouse=True)
def _no_mps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No MPS daemon here, whatever the machine runs, unless a test says otherwise."""
    monkeypatch.setattr(sup, "MPS_PIPE_DIRECTORY", str(tmp_path / "no-mps"))
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.delenv(sup.MPS_LIMIT, raising=False)
    monkeypatch.delenv(sup.ENV_TOLERANCE, raising=False)
    # No room for a process's CUDA context, unless a test gives it: the figures are exact.
    monkeypatch.setenv(sup.ENV_ALLOWANCE, "0")


def admitted(
    store: JobStore,
    code: str,
    *args: str,
    device: str = "cuda:0",
    reserved: int = GiB,
    env: dict[str, str] | None = None,
    overrun_retries: int = 0,
) -> str:
    """A job running ``python -c code args``, admitted on ``device`` with ``reserved``
    (an overrun ends it, unless ``overrun_retries`` says otherwise)."""
    spec = JobSpec(
        name="job",
        command=(PY, "-c", textwrap.dedent(code), *args),
        memory=MemoryNeed.of_size(reserved),
        env=env or {},
        overrun_retries=overrun_retries,
    )
    job = store.submit(spec)
    assert store.move(job.id, "queued", "admitted", device=device, reserved_bytes=reserved)
    return job.id


def supervise(
    store: JobStore, job_id: str, on_start: Callable[[int], None] | None = None
) -> str | None:
    """The supervisor of ``job_id``, run here; ``on_start(pid)`` once the job has started."""
    done = threading.Event()

    def watch() -> None:
        with JobStore(store.path) as mine:
            while not done.is_set():
                pid = mine.get(job_id).pid
                if pid is not None:
                    assert on_start is not None
                    on_start(pid)
                    return
                time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    if on_start is not None:
        watcher.start()
    conn = sup._Store(str(store.path))
    try:
        return sup.supervise(conn, job_id)
    finally:
        done.set()
        conn.conn.close()
        if on_start is not None:
            watcher.join(5)


def uses(gpu: FakeGpu, used: int | None) -> Callable[[int], None]:
    """NVML will report the job's process as using ``used`` bytes of ``gpu``."""
    return lambda pid: gpu.processes.append(FakeProcess(pid, used))


def log_of(store: JobStore, job_id: str) -> str:
    return Path(store.get(job_id).log_path or "").read_text()


# -- NVML's reading of the job ----------------------------------------------------------


def test_a_job_within_its_reservation_runs_and_its_peak_is_nvmls(
    store: JobStore, gpus: list[FakeGpu]
) -> None:
    job_id = admitted(store, SLEEP.format(s=1.0), reserved=2 * GiB)
    assert supervise(store, job_id, uses(gpus[0], 1536 * MiB)) == "succeeded"
    done = store.get(job_id)
    # The GPU figure for the job's process only (the GPU's other process uses 19.5 GiB).
    assert done.peak_bytes == 1536 * MiB
    assert store.learned_peak("job") == 1536 * MiB


def test_a_job_past_its_reservation_is_stopped_with_the_reason(
    store: JobStore, gpus: list[FakeGpu]
) -> None:
    job_id = admitted(store, WITH_GRANDCHILD, reserved=20 * GiB)
    log = Path(store.get(job_id).log_path or "")

    def overruns_once_its_grandchild_runs(pid: int) -> None:
        deadline = time.monotonic() + 30
        while not log.read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.02)
        gpus[0].processes.append(FakeProcess(pid, int(21.3 * GiB)))

    start = time.monotonic()
    state = supervise(store, job_id, overruns_once_its_grandchild_runs)
    assert state == "failed"
    assert time.monotonic() - start < 30  # stopped, not run out its 60 s
    done = store.get(job_id)
    assert done.reason == "used 21.30 GiB of GPU memory, past its reservation of 20.00 GiB (+5%)"
    assert done.peak_bytes == int(21.3 * GiB)
    # What an overrun was seen to use is a floor of what this very job needs; its name,
    # which other jobs may share, learns nothing of a failed run.
    assert store.learned_peak(sup.run_key(done.spec.to_dict())) == int(21.3 * GiB)
    assert store.learned_peak("job") is None
    # The job's whole process group is gone, the grandchild with it.
    grandchild = int(log_of(store, job_id).split()[0])
    deadline = time.monotonic() + 10
    while _exists(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _exists(grandchild)
    assert done.pid is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(done.pid, 0)


def test_an_overrun_with_a_retry_left_is_queued_again_needing_more(
    store: JobStore, gpus: list[FakeGpu]
) -> None:
    job_id = admitted(store, SLEEP.format(s=30.0), reserved=4 * GiB, overrun_retries=1)
    assert supervise(store, job_id, uses(gpus[0], int(4.5 * GiB))) == "queued"
    again = store.get(job_id)
    assert again.state == "queued" and again.overruns == 1 and again.attempts == 1
    # At least 1.5x its share: the watch stopped it on its way up.
    assert again.need_bytes == 6 * GiB
    assert (again.reason or "").endswith("; queued again needing 6.00 GiB (overrun 1)")
    assert again.reason.startswith("used 4.50 GiB of GPU memory, past its reservation of 4.00")
    # Its second overrun ends it: its one retry is spent.
    assert store.move(
        job_id, "queued", "admitted", device="cuda:0", reserved_bytes=7 * GiB, pid=None
    )
    gpus[0].processes.clear()
    assert supervise(store, job_id, uses(gpus[0], 12 * GiB)) == "failed"
    done = store.get(job_id)
    assert done.state == "failed" and done.overruns == 1 and done.attempts == 2
    assert (done.reason or "").startswith("used 12.00 GiB of GPU memory, past its reservation")


def test_a_supervisor_that_cannot_see_nvmls_process_ids_says_so(
    store: JobStore, gpus: list[FakeGpu]
) -> None:
    # In a container with process ids of its own NVML names the host's: a listed process
    # that no process here has. The job runs, unwatched, and its log says why.
    job_id = admitted(store, SLEEP.format(s=0.5), reserved=2 * GiB)
    host_pid = 4_000_000  # past any pid_max: no process here has it
    assert not psutil.pid_exists(host_pid)
    assert (
        supervise(store, job_id, lambda pid: gpus[0].processes.append(FakeProcess(host_pid, GiB)))
        == "succeeded"
    )
    log = log_of(store, job_id)
    assert log.count(sup.FOREIGN_PIDS) == 1
    # Where every listed process is one of ours or a neighbour that exists, nothing is said.
    again = admitted(store, SLEEP.format(s=0.5), reserved=2 * GiB)
    gpus[0].processes.clear()
    assert (
        supervise(store, again, lambda pid: gpus[0].processes.append(FakeProcess(os.getpid(), GiB)))
        == "succeeded"
    )
    assert sup.FOREIGN_PIDS not in log_of(store, again)


def test_each_process_has_room_for_its_cuda_context(
    store: JobStore, gpus: list[FakeGpu], monkeypatch: pytest.MonkeyPatch
) -> None:
    # NVML counts a process's CUDA context too, which its allocator's cap does not: each
    # process the job has on the GPU may use the allowance past the reservation.
    monkeypatch.setenv(sup.ENV_ALLOWANCE, "1GiB")
    job_id = admitted(store, SLEEP.format(s=1.0), reserved=2 * GiB)
    assert supervise(store, job_id, uses(gpus[0], int(3.05 * GiB))) == "succeeded"
    assert store.get(job_id).peak_bytes == int(3.05 * GiB)
    job_id = admitted(store, SLEEP.format(s=30), reserved=2 * GiB)
    assert supervise(store, job_id, uses(gpus[0], int(3.2 * GiB))) == "failed"
    assert store.get(job_id).reason == (
        "used 3.20 GiB of GPU memory, past its reservation of 2.00 GiB"
        " (+5%, and 1.00 GiB for its 1 process)"
    )


def test_a_job_cannot_leave_the_watch_by_saying_it_is_held(
    store: JobStore, gpus: list[FakeGpu], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A marker in its own, writable peak folder (what the bootstrap once wrote for a process
    # its allocator's cap held) no longer takes a process out of the watch: a 3 GiB job on
    # a 1 GiB share is stopped, whatever it wrote.
    monkeypatch.setenv(sup.ENV_ALLOWANCE, "1GiB")
    job_id = admitted(store, SLEEP.format(s=30), reserved=GiB)
    folder = Path(store.get(job_id).log_path or "").parent / f"{job_id}.peak"

    def held_and_over(pid: int) -> None:
        (folder / f"held.{pid}").write_text("")
        gpus[0].processes.append(FakeProcess(pid, 3 * GiB))

    assert supervise(store, job_id, held_and_over) == "failed"
    assert (store.get(job_id).reason or "").startswith("used 3.00 GiB of GPU memory")
    assert not folder.exists()  # the job's folder is cleared with its peaks


def test_a_job_cannot_teach_a_peak_past_its_share(store: JobStore, gpus: list[FakeGpu]) -> None:
    # Its peak files are its word: a reading past what one process could reach on its share
    # unstopped counts as that much.
    code = f"""
        import os
        from vramctl.jobs._run import write_peak
        write_peak(os.environ[{sup.ENV_PEAK_FILE!r}], lambda: 10**15)
    """
    job_id = admitted(store, code, reserved=GiB)
    assert supervise(store, job_id, lambda pid: None) == "succeeded"
    assert store.get(job_id).peak_bytes == int(GiB * 1.05)
    assert store.learned_peak("job") == int(GiB * 1.05)


def test_within_the_tolerance_is_not_an_overrun(store: JobStore, gpus: list[FakeGpu]) -> None:
    job_id = admitted(store, SLEEP.format(s=1.0), reserved=20 * GiB)
    assert supervise(store, job_id, uses(gpus[0], 21 * GiB)) == "succeeded"  # 5% over


def test_the_tolerance_is_a_setting(
    store: JobStore, gpus: list[FakeGpu], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(sup.ENV_TOLERANCE, "0.1")
    job_id = admitted(store, SLEEP.format(s=1.0), reserved=20 * GiB)
    assert supervise(store, job_id, uses(gpus[0], int(21.5 * GiB))) == "succeeded"
    monkeypatch.setenv(sup.ENV_TOLERANCE, "0")
    job_id = admitted(store, SLEEP.format(s=30), reserved=20 * GiB)
    assert supervise(store, job_id, uses(gpus[0], 20 * GiB + MiB)) == "failed"
    assert (store.get(job_id).reason or "").endswith("past its reservation of 20.00 GiB (+0%)")
    # A value that is not one is said in the job's log, and the default holds.
    monkeypatch.setenv(sup.ENV_TOLERANCE, "lots")
    job_id = admitted(store, SLEEP.format(s=30), reserved=20 * GiB)
    assert supervise(store, job_id, uses(gpus[0], int(21.5 * GiB))) == "failed"
    assert (store.get(job_id).reason or "").endswith("(+5%)")
    assert "VRAMCTL_OVERRUN_TOLERANCE='lots' is not a number" in log_of(store, job_id)


def test_the_tolerance_reading() -> None:
    assert sup.overrun_tolerance({}) == 0.05
    assert sup.overrun_tolerance({sup.ENV_TOLERANCE: " 0.2 "}) == 0.2
    for bad in ("-0.1", "nan", "inf", "5%"):
        with pytest.raises(ValueError):
            sup.overrun_tolerance({sup.ENV_TOLERANCE: bad})


def test_without_nvml_the_job_runs_unwatched(
    store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    FakeNvml([], init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND).install(monkeypatch)
    job_id = admitted(store, SHOW_ENV.format(s=0), "CUDA_VISIBLE_DEVICES")
    assert supervise(store, job_id) == "succeeded"
    assert store.get(job_id).peak_bytes is None  # no reading of the device
    assert log_of(store, job_id).split() == ["CUDA_VISIBLE_DEVICES", "0"]


def test_nvml_errors_skip_a_reading_and_nothing_more(store: JobStore, gpus: list[FakeGpu]) -> None:
    gpus[0].fail_call("nvmlDeviceGetComputeRunningProcesses", times=3)
    gpus[0].fail_call("nvmlDeviceGetGraphicsRunningProcesses", times=3)
    job_id = admitted(store, SLEEP.format(s=1.5), reserved=2 * GiB)
    assert supervise(store, job_id, uses(gpus[0], GiB)) == "succeeded"
    assert store.get(job_id).peak_bytes == GiB


def test_a_gpu_lost_while_the_job_runs_leaves_it_running(
    store: JobStore, gpus: list[FakeGpu]
) -> None:
    def lost(pid: int) -> None:
        gpus[0].processes.append(FakeProcess(pid, GiB))
        time.sleep(0.5)
        gpus[0].lost = True

    job_id = admitted(store, SLEEP.format(s=1.5), reserved=2 * GiB)
    assert supervise(store, job_id, lost) == "succeeded"
    assert store.get(job_id).peak_bytes == GiB


def test_a_mig_instance_without_per_process_figures_is_not_read(
    store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    parent = FakeGpu("NVIDIA A100-SXM4-80GB", "GPU-dddddddd-3333", 80 * GiB)
    mig = FakeGpu("NVIDIA A100-SXM4-80GB MIG 1g.10gb", "MIG-eeeeeeee-4444", 10 * GiB)
    mig.parent, parent.migs = parent, [mig]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    FakeNvml([parent]).install(monkeypatch)
    job_id = admitted(store, SHOW_ENV.format(s=1.0), "CUDA_VISIBLE_DEVICES", reserved=GiB)
    assert supervise(store, job_id, uses(mig, None)) == "succeeded"
    assert store.get(job_id).peak_bytes is None
    # cuda:0 is the GPU's first MIG instance, and the job is given that instance.
    assert log_of(store, job_id).split() == ["CUDA_VISIBLE_DEVICES", "MIG-eeeeeeee-4444"]


# -- which device -------------------------------------------------------------------------


def test_visible_entry_numbers_devices_as_the_scheduler_saw_them() -> None:
    assert sup.visible_entry(0, None) == "0"
    assert sup.visible_entry(3, None) == "3"
    assert sup.visible_entry(0, "2,3") == "2"
    assert sup.visible_entry(1, " 2, 3") == "3"
    assert sup.visible_entry(1, "GPU-aaaa,MIG-bbbb") == "MIG-bbbb"
    assert sup.visible_entry(2, "2,3") is None
    assert sup.visible_entry(0, "") is None  # no device visible
    assert sup.visible_entry(1, "0,bogus,1") is None  # as in CUDA: the list ends there


def test_the_job_gets_the_device_the_scheduler_measured(
    store: JobStore, gpus: list[FakeGpu], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The scheduler ran with CUDA_VISIBLE_DEVICES=2,0: its cuda:1 is physical GPU 0.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    job_id = admitted(store, SHOW_ENV.format(s=1.0), "CUDA_VISIBLE_DEVICES", device="cuda:1")
    gpus[2].processes.append(FakeProcess(999_999, 70 * GiB))  # another GPU's process
    assert supervise(store, job_id, uses(gpus[0], 512 * MiB)) == "succeeded"
    assert log_of(store, job_id).split() == ["CUDA_VISIBLE_DEVICES", gpus[0].uuid]
    assert store.get(job_id).peak_bytes == 512 * MiB


def test_without_nvml_the_job_gets_the_inherited_entry(
    store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    FakeNvml([], init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED).install(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    job_id = admitted(store, SHOW_ENV.format(s=0), "CUDA_VISIBLE_DEVICES", device="cuda:1")
    assert supervise(store, job_id) == "succeeded"
    assert log_of(store, job_id).split() == ["CUDA_VISIBLE_DEVICES", "3"]
    # A device the supervisor cannot see fails the job with the reason; nothing runs.
    job_id = admitted(store, SLEEP.format(s=0), device="cuda:2")
    assert supervise(store, job_id) == "failed"
    done = store.get(job_id)
    assert done.reason == "cuda:2 is not visible here (CUDA_VISIBLE_DEVICES=2,3)"
    assert done.pid is None


# -- MPS -------------------------------------------------------------------------------------


def test_mps_limit_and_detection(tmp_path: Path) -> None:
    assert sup.mps_limit(20 * GiB) == "0=20480M"
    assert sup.mps_limit(int(1.5 * MiB)) == "0=1M"  # whole MiB, never past the share
    assert sup.mps_limit(1000) is None
    pipes = tmp_path / "mps"
    pipes.mkdir()
    assert not sup.mps_in_use({}, str(pipes))
    assert sup.mps_in_use({"CUDA_MPS_PIPE_DIRECTORY": "/run/mps"}, str(pipes))
    os.mkfifo(pipes / "control")
    assert sup.mps_in_use({}, str(pipes))


def _environment(store: JobStore, job_id: str) -> dict[str, str]:
    """The environment the supervisor gives ``job_id`` (on a GPU: GPU-aaaaaaaa-0000)."""
    conn = sup._Store(str(store.path))
    try:
        return sup._environment(conn.get(job_id), "GPU-aaaaaaaa-0000")
    finally:
        conn.conn.close()


def test_under_mps_a_cuda_job_gets_its_pinned_memory_limit(
    store: JobStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pipes = tmp_path / "mps"
    pipes.mkdir()
    monkeypatch.setattr(sup, "MPS_PIPE_DIRECTORY", str(pipes))
    plain = admitted(store, "pass", reserved=20 * GiB)
    assert sup.MPS_LIMIT not in _environment(store, plain)  # no daemon
    os.mkfifo(pipes / "control")  # a daemon's control pipe in the default directory
    env = _environment(store, plain)
    assert env[sup.MPS_LIMIT] == "0=20480M"
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-aaaaaaaa-0000"
    # The job's own value is kept; one inherited from the scheduler's environment is not.
    own = admitted(store, "pass", reserved=20 * GiB, env={sup.MPS_LIMIT: "0=1G"})
    assert _environment(store, own)[sup.MPS_LIMIT] == "0=1G"
    monkeypatch.setenv(sup.MPS_LIMIT, "0=99G")
    assert _environment(store, plain)[sup.MPS_LIMIT] == "0=20480M"
    monkeypatch.delenv(sup.MPS_LIMIT)
    # A pipe directory named in the job's environment is a daemon in use.
    os.remove(pipes / "control")
    named = admitted(store, "pass", reserved=GiB, env={"CUDA_MPS_PIPE_DIRECTORY": str(pipes)})
    assert _environment(store, named)[sup.MPS_LIMIT] == "0=1024M"
    # Not on a simulated device or the CPU.
    os.mkfifo(pipes / "control")
    for device in ("sim:8GiB", "cpu"):
        other = admitted(store, "pass", device=device)
        assert sup.MPS_LIMIT not in _environment(store, other)


# -- the allocator's configuration ---------------------------------------------------------


def test_the_job_runs_under_the_allocator_setting_its_admission_priced(
    store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vramctl.estimator import AllocatorConfig, Step
    from vramctl.estimator._allocator import ALLOC_CONF_ENV
    from vramctl.jobs import _need

    for name in ALLOC_CONF_ENV:
        monkeypatch.delenv(name, raising=False)
    priced: list[object] = []

    def estimator(model: str, step: Step, **kwargs: object) -> int:
        priced.append(step.allocator_config)
        return GiB

    def in_process(*args: object, step: Step, **kwargs: object) -> object:
        priced.append(step.allocator_config)
        return types.SimpleNamespace(judged_peak=GiB)

    monkeypatch.setattr(_need, "estimate", in_process)

    def check(job_id: str) -> None:
        """Admission's estimate is given the configuration the job's environment sets."""
        env = _environment(store, job_id)
        need = JobSpec.from_dict(
            {
                "name": "job",
                "command": [PY, "-c", "pass"],
                "memory": {"estimate": {"model": "gpt2"}},
                "env": dict(store.get(job_id).spec.env),
            }
        )
        priced.clear()
        _need.price(need, "cuda:0", estimator=estimator)  # in a worker (the job service's)
        _need.price(need, "cuda:0")  # in this process
        want = AllocatorConfig.from_conf(env.get("PYTORCH_CUDA_ALLOC_CONF"))
        assert priced == [want, want]

    # No setting: the job gets none forced on it (it once got expandable segments,
    # which the estimate does not price), and it is priced with the defaults.
    plain = admitted(store, "pass")
    assert "PYTORCH_CUDA_ALLOC_CONF" not in _environment(store, plain)
    check(plain)
    # The spec's setting is the job's, and priced: max_split_size_mb.
    split = admitted(store, "pass", env={"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"})
    assert _environment(store, split)["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"
    check(split)
    assert priced == [AllocatorConfig(max_split_size=128 * MiB)] * 2
    # Expandable segments are the spec's to choose, kept, and priced as such.
    grow = admitted(store, "pass", env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert _environment(store, grow)["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    check(grow)
    assert priced == [AllocatorConfig(expandable_segments=True)] * 2
    # The scheduler's setting is passed on, and priced the same.
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")
    assert _environment(store, plain)["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:64"
    check(plain)
    assert priced == [AllocatorConfig(max_split_size=64 * MiB)] * 2


# -- the device's peak ----------------------------------------------------------------------


def test_read_peaks_adds_the_processes_readings_and_removes_them(tmp_path: Path) -> None:
    prefix = str(tmp_path / "abc.peak")
    assert sup.read_peaks(prefix) is None
    Path(f"{prefix}.101").write_text("300\n")
    Path(f"{prefix}.102").write_text("200\n")
    Path(f"{prefix}.103.tmp").write_text("12")  # a write cut short
    Path(tmp_path / "abc.log").write_text("the job's log")
    Path(tmp_path / "abcd.peak.104").write_text("7")  # another job's
    assert sup.read_peaks(prefix) == 500
    assert sorted(p.name for p in tmp_path.iterdir()) == ["abc.log", "abcd.peak.104"]


def test_a_forked_process_writes_no_peak_of_its_own(tmp_path: Path) -> None:
    prefix = str(tmp_path / "job.peak")
    write_peak(prefix, lambda: 10, pid=os.getpid() + 1)  # registered by another process
    write_peak(prefix, lambda: 1 // 0)  # a reading that fails
    assert list(tmp_path.iterdir()) == []
    write_peak(prefix, lambda: 10, pid=os.getpid())
    assert Path(f"{prefix}.{os.getpid()}").read_text() == "10\n"


def test_an_entry_points_peak_is_its_simulated_allocators(store: JobStore, tmp_path: Path) -> None:
    module = tmp_path / "peak_mod.py"
    module.write_text(
        textwrap.dedent(
            """
            import torch

            def allocate():
                x = torch.empty(256 * 2**20, dtype=torch.uint8)
                del x
                torch.empty(16 * 2**20, dtype=torch.uint8)
            """
        )
    )
    env = {"PYTHONPATH": str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    spec = JobSpec(
        name="peaky",
        entry_point="peak_mod:allocate",
        env=env,
        memory=MemoryNeed.of_size("1GiB"),
    )
    job = store.submit(spec)
    with vramctl.simulate("8GiB") as gpu:
        run_all(Scheduler(store, devices=[gpu]))
    done = store.get(job.id)
    assert done.state == "succeeded"
    # The simulated allocator's peak, not the resident memory of a Python with torch.
    assert done.peak_bytes == 256 * MiB
    assert store.learned_peak("peaky") == 256 * MiB
    assert not [p for p in store.logs_dir.iterdir() if ".peak" in p.name]  # cleaned up


def test_a_python_commands_peak_is_its_simulated_allocators(store: JobStore) -> None:
    job = store.submit(
        JobSpec(
            name="cmd",
            command=(PY, "-c", ALLOCATE, str(512 * MiB)),
            memory=MemoryNeed.of_size("1GiB"),
        )
    )
    with vramctl.simulate("8GiB") as gpu:
        run_all(Scheduler(store, devices=[gpu]))
    done = store.get(job.id)
    assert done.state == "succeeded" and done.peak_bytes == 512 * MiB


def test_on_the_cpu_the_peak_is_the_resident_memory(store: JobStore) -> None:
    code = "x = b'x' * (64 * 2**20); import time; time.sleep(0.5)"
    job_id = admitted(store, code, device="cpu")
    assert supervise(store, job_id) == "succeeded"
    assert (store.get(job_id).peak_bytes or 0) > 64 * MiB


# -- on a real GPU ----------------------------------------------------------------------------


# Run with ``python -I``: no bootstrap, so nothing caps it (as a program that is not Python).
OVERRUN = """
import time, torch
x = torch.empty(3 * 2**30, dtype=torch.uint8, device="cuda")
print("allocated", flush=True)
time.sleep(60)
"""


@pytest.mark.cuda
def test_a_job_past_its_reservation_on_a_gpu_is_stopped(store: JobStore) -> None:
    gpu = vramctl.gpus()[0]
    job = store.submit(
        JobSpec(
            name="overrun", command=(PY, "-I", "-c", OVERRUN), memory=MemoryNeed.of_size("1GiB")
        )
    )
    run_all(Scheduler(store, devices=[gpu]), timeout=120)
    done = store.get(job.id)
    assert done.state == "failed", (done, log_of(store, job.id))
    assert "of GPU memory, past its reservation of 1.10 GiB (+5%)" in (done.reason or "")
    assert (done.peak_bytes or 0) > 3 * GiB


# Held to its share by the bootstrap, then raises its own cap (as some libraries do).
RAISES_ITS_CAP = """
import time, torch
torch.zeros(1, device="cuda")
torch.cuda.set_per_process_memory_fraction(1.0, 0)
x = torch.empty(3 * 2**30, dtype=torch.uint8, device="cuda")
print("allocated", flush=True)
time.sleep(60)
"""


@pytest.mark.cuda
def test_a_job_that_raises_its_own_cap_is_still_watched(
    store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(sup.ENV_ALLOWANCE, "1GiB")  # the default on a GPU: room for a context
    gpu = vramctl.gpus()[0]
    job = store.submit(
        JobSpec(
            name="uncapped", command=(PY, "-c", RAISES_ITS_CAP), memory=MemoryNeed.of_size("1GiB")
        )
    )
    run_all(Scheduler(store, devices=[gpu], margin=0.0), timeout=120)
    done = store.get(job.id)
    assert done.state == "failed", (done, log_of(store, job.id))
    assert "of GPU memory, past its reservation of 1.00 GiB" in (done.reason or "")


GPU_PEAK = """
import time, torch
x = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
time.sleep(1.5)
"""


@pytest.mark.cuda
def test_a_gpu_jobs_peak_is_its_gpu_memory(store: JobStore) -> None:
    gpu = vramctl.gpus()[0]
    job = store.submit(
        JobSpec(name="gpu-peak", command=(PY, "-c", GPU_PEAK), memory=MemoryNeed.of_size("2GiB"))
    )
    run_all(Scheduler(store, devices=[gpu]), timeout=120)
    done = store.get(job.id)
    assert done.state == "succeeded", log_of(store, job.id)
    # At least the allocator's 512 MiB; NVML adds the CUDA context. Not a host RSS.
    assert 512 * MiB <= (done.peak_bytes or 0) < int(2.2 * GiB)


MPS_ENV = """
import os, torch
torch.zeros(1, device="cuda")
print(os.environ.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"), torch.cuda.device_count())
"""


@pytest.mark.cuda
def test_a_gpu_job_under_mps_gets_its_limit(store: JobStore, tmp_path: Path) -> None:
    # A pipe directory where no daemon listens: CUDA runs as without MPS, with the limit set.
    gpu = vramctl.gpus()[0]
    pipes = tmp_path / "mps"
    pipes.mkdir()
    job = store.submit(
        JobSpec(
            name="mps",
            command=(PY, "-c", MPS_ENV),
            memory=MemoryNeed.of_size("1GiB"),
            env={"CUDA_MPS_PIPE_DIRECTORY": str(pipes)},
        )
    )
    run_all(Scheduler(store, devices=[gpu], margin=0.0), timeout=120)
    done = store.get(job.id)
    assert done.state == "succeeded", log_of(store, job.id)
    assert log_of(store, job.id).split()[-2:] == ["0=1024M", "1"]
