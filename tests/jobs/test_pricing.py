"""Estimates priced in a worker process (``EstimateWorker``): what a spec's model does
there (abort, sleep, allocate, import) never reaches the process that prices it."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

import vramctl
from vramctl.jobs import (
    EstimateWorker,
    JobSpec,
    JobSpecError,
    JobStore,
    Scheduler,
    check_placeable,
    price,
)
from vramctl.jobs._pricing import DEFAULT_MEMORY, DEFAULT_TIMEOUT, HUB_TIMEOUT, _environment

MiB = 2**20
LSTM = {"model": "lstm", "batch_size": 2, "seq_len": 16, "mode": "infer"}
#: Inputs of about 1 GiB built with real values (the estimator's cap for real inputs).
HUGE_LSTM = {"model": "lstm", "batch_size": 1, "seq_len": 60_000_000}


def spec(name: str = "job", **estimate: Any) -> JobSpec:
    return JobSpec.from_dict(
        {"name": name, "command": [sys.executable, "-c", "pass"], "memory": {"estimate": estimate}}
    )


def module(folder: Path, source: str) -> str:
    """A module of a name of its own in ``folder``; its name."""
    name = f"vramctl_pricing_probe_{uuid.uuid4().hex[:12]}"
    (folder / f"{name}.py").write_text(source)
    return name


@pytest.fixture(scope="module")
def _config_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("config")


@pytest.fixture(autouse=True)
def _one_config_dir(
    _own_config_dir: None, _config_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One config folder for the module's workers: a worker measures this machine's CPU
    (for an estimate's step time) once per folder, a few seconds at each start else."""
    monkeypatch.setenv("VRAMCTL_CONFIG_DIR", str(_config_dir))


@pytest.fixture(scope="module")
def worker() -> Iterator[EstimateWorker]:
    """One worker for the module's tests (its start imports PyTorch)."""
    with EstimateWorker(timeout=60, memory="4GiB") as w:
        yield w


def peak_rss_during(work: Any) -> tuple[int, Any]:
    """(how far this process's resident memory rose above its start while ``work`` ran,
    what ``work`` returned or raised)."""
    me = psutil.Process()
    start = me.memory_info().rss
    peak = start
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, me.memory_info().rss)
            time.sleep(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        result: Any = work()
    except Exception as exc:
        result = exc
    finally:
        done.set()
        sampler.join()
    return peak - start, result


def test_a_price_from_the_worker_is_the_in_process_price(worker: EstimateWorker) -> None:
    job = spec(**LSTM)
    for device in ("cpu", "sim:T4-16GB", vramctl.simulate("A10G-24GB")):
        assert price(job, device, estimator=worker) == price(job, device) > 0
    # A lowered batch too, and the placement check.
    assert price(job, "cpu", batch_size=1, estimator=worker) == price(job, "cpu", batch_size=1)
    need = price(job, "sim:8GiB")
    check_placeable(job, [vramctl.simulate(need + MiB)], estimator=worker)
    with pytest.raises(JobSpecError, match=r"memory: needs .* but the largest device"):
        check_placeable(job, [vramctl.simulate(need // 2)], estimator=worker)
    assert worker.pid is not None and worker.pid != os.getpid()


def test_an_estimates_error_reads_as_in_process(worker: EstimateWorker) -> None:
    job = spec(model="no_such_pkg_xyz:make")
    with pytest.raises(JobSpecError) as here:
        price(job, "cpu")
    with pytest.raises(JobSpecError) as there:
        price(job, "cpu", estimator=worker)
    assert str(there.value) == str(here.value)
    assert str(there.value).startswith("cannot price job 'job': memory.estimate: cannot load")


def test_a_factory_is_imported_in_the_worker_only(
    worker: EstimateWorker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On import the module says where it runs, and the Hub's timeouts there.
    name = module(
        tmp_path,
        "import json, os\n"
        "from huggingface_hub import constants\n"
        f"with open({str(tmp_path / 'seen.json')!r}, 'w') as f:\n"
        "    json.dump({'pid': os.getpid(), 'etag': constants.HF_HUB_ETAG_TIMEOUT,\n"
        "               'download': constants.HF_HUB_DOWNLOAD_TIMEOUT}, f)\n"
        "def make():\n"
        "    import torch\n"
        "    return torch.nn.Linear(4, 4)\n",
    )
    monkeypatch.syspath_prepend(str(tmp_path))  # found here too: as the service finds it
    with pytest.raises(JobSpecError, match="no batch for"):  # it was built, and needs one
        price(spec(model=f"{name}:make"), "cpu", estimator=worker)
    assert name not in sys.modules
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen["pid"] == worker.pid != os.getpid()
    assert seen["etag"] == int(os.environ.get("HF_HUB_ETAG_TIMEOUT") or HUB_TIMEOUT)
    assert seen["download"] == int(os.environ.get("HF_HUB_DOWNLOAD_TIMEOUT") or HUB_TIMEOUT)


def test_a_factory_is_found_from_the_working_folder_as_here(
    worker: EstimateWorker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = module(tmp_path, "import torch\ndef make():\n    return torch.nn.Linear(4, 4)\n")
    monkeypatch.chdir(tmp_path)  # not on the import path: found as `python -m` finds it
    with pytest.raises(JobSpecError, match="no batch for"):
        price(spec(model=f"{name}:make"), "cpu", estimator=worker)
    assert name not in sys.modules


def test_the_hub_timeouts_keep_a_value_already_set() -> None:
    env = _environment({"HF_HUB_DOWNLOAD_TIMEOUT": "17", "PATH": "/bin"})
    assert env == {
        "HF_HUB_DOWNLOAD_TIMEOUT": "17",
        "HF_HUB_ETAG_TIMEOUT": HUB_TIMEOUT,
        "PATH": "/bin",
    }


def test_a_worker_that_aborts_fails_the_estimate_and_the_next_starts_anew(
    worker: EstimateWorker,
) -> None:
    job = spec(**LSTM)
    assert price(job, "cpu", estimator=worker) > 0
    before = worker.pid
    with pytest.raises(JobSpecError) as info:
        price(spec(model="os:abort"), "cpu", estimator=worker)
    assert str(info.value) == (
        "cannot price job 'job': memory.estimate: the estimate's worker process died"
        " (signal 6: SIGABRT)"
    )
    assert worker.pid is None
    assert before is not None and not psutil.pid_exists(before)
    assert price(job, "cpu", estimator=worker) == price(job, "cpu")
    assert worker.pid not in (None, before)


def test_an_estimate_past_its_time_limit_is_stopped(
    worker: EstimateWorker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = module(tmp_path, "import time\ndef make():\n    time.sleep(60)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    job = spec(**LSTM)
    assert price(job, "cpu", estimator=worker) > 0  # started before the clock runs
    before = worker.pid
    monkeypatch.setattr(worker, "timeout", 2.0)
    start = time.monotonic()
    with pytest.raises(JobSpecError) as info:
        price(spec(model=f"{name}:make"), "cpu", estimator=worker)
    assert time.monotonic() - start < 10
    assert "the estimate took longer than 2 s" in str(info.value)
    assert before is not None and not psutil.pid_exists(before)
    monkeypatch.undo()
    assert price(job, "cpu", estimator=worker) == price(job, "cpu")


def test_an_estimates_memory_stays_in_the_worker(worker: EstimateWorker) -> None:
    job = spec(**HUGE_LSTM)
    grown, got = peak_rss_during(lambda: price(job, "sim:8GiB", estimator=worker))
    assert isinstance(got, int) and got > 8 * 2**30  # priced (about 10 TB: no GPU holds it)
    assert grown < 200 * MiB, f"this process grew by {grown / MiB:.0f} MiB"


def test_an_estimate_over_the_memory_limit_is_a_clean_error(worker: EstimateWorker) -> None:
    # The worker's own memory after an estimate (its threads and arenas differ by machine),
    # plus less than the huge batch needs.
    assert price(spec(**LSTM), "cpu", estimator=worker) > 0
    assert worker.pid is not None
    own = psutil.Process(worker.pid).memory_info().data
    with EstimateWorker(memory=max(own + 256 * MiB, 512 * MiB)) as small:
        grown, got = peak_rss_during(lambda: price(spec(**HUGE_LSTM), "cpu", estimator=small))
        assert isinstance(got, JobSpecError), got
        assert "the estimate needed more memory than its worker process may use" in str(got)
        assert "\n" not in str(got)
        assert grown < 200 * MiB
        assert price(spec(**LSTM), "cpu", estimator=small) > 0  # it goes on


def test_a_factory_that_allocates_past_the_limit_is_a_clean_error(
    worker: EstimateWorker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 16 GiB of zeros: lazily mapped, it would pass unnoticed without the limit (4 GiB).
    name = module(tmp_path, "def make():\n    return bytearray(16 << 30)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(JobSpecError) as info:
        price(spec(model=f"{name}:make"), "cpu", estimator=worker)
    assert str(info.value) == (
        "cannot price job 'job': memory.estimate: the estimate needed more memory than its"
        f" worker process may use (4.00 GiB, $VRAMCTL_ESTIMATE_MEMORY): model {name}:make"
        " failed to build: MemoryError"
    )
    assert price(spec(**LSTM), "cpu", estimator=worker) == price(spec(**LSTM), "cpu")


def test_close_stops_an_estimate_in_flight(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "called"
    name = module(
        tmp_path,
        f"import time\ndef make():\n    open({str(marker)!r}, 'w').close()\n    time.sleep(60)\n",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    w = EstimateWorker()
    errors: list[Exception] = []

    def sleepy() -> None:
        try:
            price(spec(model=f"{name}:make"), "cpu", estimator=w)
        except Exception as exc:
            errors.append(exc)

    thread = threading.Thread(target=sleepy)
    thread.start()
    deadline = time.monotonic() + 60
    while not marker.exists():  # the worker runs the factory
        assert time.monotonic() < deadline
        time.sleep(0.05)
    pid = w.pid
    w.close()
    thread.join(10)
    assert not thread.is_alive()
    assert w.closed and w.pid is None
    assert pid is not None and not psutil.pid_exists(pid)
    assert len(errors) == 1 and isinstance(errors[0], JobSpecError)
    assert "worker process was closed" in str(errors[0])
    with pytest.raises(JobSpecError, match="worker process is closed"):
        price(spec(**LSTM), "cpu", estimator=w)


def test_the_scheduler_fails_a_job_whose_worker_died_and_goes_on(
    worker: EstimateWorker, tmp_path: Path
) -> None:
    with JobStore(tmp_path / "jobs.db") as store:
        aborts = store.submit(spec("aborts", model="os:abort"))
        fine = store.submit(spec("fine", **LSTM))
        sched = Scheduler(
            store,
            devices=[vramctl.simulate("8GiB")],
            launch=lambda job: None,
            estimate_worker=worker,
        )
        admitted = sched.run_once()
        assert [j.id for j in admitted] == [fine.id]
        failed = store.get(aborts.id)
        assert failed.state == "failed"
        assert failed.reason == (
            "cannot price job 'aborts': memory.estimate: the estimate's worker process died"
            " (signal 6: SIGABRT)"
        )


def test_a_closed_worker_leaves_the_job_queued(tmp_path: Path) -> None:
    closed = EstimateWorker()
    closed.close()
    with JobStore(tmp_path / "jobs.db") as store:
        job = store.submit(spec(**LSTM))
        sched = Scheduler(
            store, devices=[vramctl.simulate("8GiB")], launch=lambda j: None, estimate_worker=closed
        )
        with pytest.raises(JobSpecError, match="worker process is closed"):
            sched.run_once()
        assert store.get(job.id).state == "queued"  # the next scheduler prices it


def test_the_limits_come_from_the_arguments_or_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("VRAMCTL_ESTIMATE_TIMEOUT", raising=False)
    monkeypatch.delenv("VRAMCTL_ESTIMATE_MEMORY", raising=False)
    w = EstimateWorker()
    assert (w.timeout, w.memory) == (DEFAULT_TIMEOUT, DEFAULT_MEMORY) == (60.0, 4 * 2**30)
    monkeypatch.setenv("VRAMCTL_ESTIMATE_TIMEOUT", "2m")
    monkeypatch.setenv("VRAMCTL_ESTIMATE_MEMORY", "2GiB")
    w = EstimateWorker()
    assert (w.timeout, w.memory) == (120.0, 2 * 2**30)
    w = EstimateWorker(timeout=5, memory=3 * 2**30)
    assert (w.timeout, w.memory) == (5.0, 3 * 2**30)
    for var, value, says in [
        ("VRAMCTL_ESTIMATE_TIMEOUT", "soon", "$VRAMCTL_ESTIMATE_TIMEOUT: must be seconds"),
        ("VRAMCTL_ESTIMATE_TIMEOUT", "0", "$VRAMCTL_ESTIMATE_TIMEOUT: must be more than 0"),
        ("VRAMCTL_ESTIMATE_MEMORY", "lots", "$VRAMCTL_ESTIMATE_MEMORY: invalid size 'lots'"),
        ("VRAMCTL_ESTIMATE_MEMORY", "10MiB", "$VRAMCTL_ESTIMATE_MEMORY: at least 256 MiB"),
    ]:
        with monkeypatch.context() as m:
            m.setenv(var, value)
            with pytest.raises(JobSpecError) as info:
                EstimateWorker()
            assert str(info.value).startswith("invalid estimate worker settings: " + says)


def test_a_generate_job_is_priced_by_its_whole_generation(worker: EstimateWorker) -> None:
    """An inference job that generates is admitted by the peak of its generation (the
    prompt's prefill and the last token's step, the cache at its longest), in the worker as
    here."""
    gen = {"model": "gpt2", "batch_size": 2, "seq_len": 64, "mode": "generate"}
    job = spec(**gen, max_new_tokens=256)
    need = price(job, "sim:T4-16GB")
    assert price(job, "sim:T4-16GB", estimator=worker) == need
    est = vramctl.estimate(
        "gpt2", batch_size=2, seq_len=64, mode="generate", max_new_tokens=256,
        device="sim:T4-16GB",
    )  # fmt: skip
    assert need == est.judged_peak
    # a longer generation holds a longer cache
    assert need > price(spec(**gen, max_new_tokens=8), "sim:T4-16GB")
    assert JobSpec.from_dict(job.to_dict()) == job
    # an offloaded cache keeps the layers it is not using in host memory: it needs less
    offloaded = spec(**gen, max_new_tokens=256, cache="offloaded")
    assert price(offloaded, "sim:T4-16GB") < need
    assert JobSpec.from_dict(offloaded.to_dict()) == offloaded


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"mode": "generate"}, "memory.estimate.max_new_tokens: missing"),
        ({"mode": "infer", "max_new_tokens": 8}, "max_new_tokens: only with mode"),
        ({"mode": "generate", "max_new_tokens": 8, "cache": "paged"}, "cache: must be one of"),
        ({"mode": "generate", "max_new_tokens": 0}, "max_new_tokens"),
        ({"mode": "generate", "max_new_tokens": 8, "kv_dtype": "int2"}, "kv_dtype: only with"),
        (
            {"mode": "generate", "max_new_tokens": 8, "cache": "quantized", "kv_dtype": "int8"},
            "kv_dtype: must be one of int4, int2",
        ),
        ({"mode": "infer", "kv_dtype": "int2"}, 'kv_dtype: only with mode = "generate"'),
    ],
)
def test_a_generate_jobs_spec_is_checked(fields: dict[str, Any], problem: str) -> None:
    with pytest.raises(JobSpecError, match=problem):
        spec(model="gpt2", **fields)
