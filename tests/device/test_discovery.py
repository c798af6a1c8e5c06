"""Discovery and readings through NVML (stand-in here; real in test_cuda_real.py)."""

from __future__ import annotations

import os

import pynvml
import pytest

import vramctl
from tests.fake_nvml import FakeGpu, FakeNvml, FakeProcess, GiB, MiB
from vramctl import NA, UnknownDeviceError
from vramctl.device import CpuDevice
from vramctl.device._nvml import nvml_available, nvml_reason, reset_nvml


def test_no_nvml_library_means_no_gpus_not_an_error() -> None:
    # The real binding on this machine: no libnvidia-ml, or a real driver.
    devs = vramctl.devices()
    assert devs[-1].id == "cpu"
    if not nvml_available():
        assert "NVML" in nvml_reason()


def test_nvml_init_failure_is_remembered(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeNvml([], init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    fake.install(monkeypatch)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    reset_nvml()
    assert [d.id for d in vramctl.devices()] == ["cpu"]
    vramctl.devices()
    assert fake.init_calls == 1
    assert "Driver Not Loaded" in nvml_reason()


def test_lists_gpus_then_cpu(gpus: list[FakeGpu]) -> None:
    devs = vramctl.devices()
    assert [d.id for d in devs] == ["cuda:0", "cuda:1", "cuda:2", "cpu"]
    assert isinstance(devs[-1], CpuDevice)
    a100, t4 = devs[0], devs[2]
    assert a100.spec is not None and a100.spec.name == "A100-80GB"
    assert t4.spec is not None and t4.spec.name == "T4-16GB"
    assert str(t4.capability) == "7.5" and not t4.capability.bf16  # type: ignore[union-attr]
    assert vramctl.devices()[0] is a100  # same object: health history is kept
    assert [d.id for d in vramctl.gpus()] == ["cuda:0", "cuda:1", "cuda:2"]


def test_memory_reading_from_nvml(gpus: list[FakeGpu]) -> None:
    mem = vramctl.get_device(0).memory()
    assert mem.total == 81920 * MiB and mem.used == 20 * GiB
    assert mem.free == mem.total - mem.used
    assert mem.temperature_c == 40.0 and mem.power_w == 70.0 and mem.compute_utilization == 80.0
    # This process has not initialised CUDA: its allocator figures are true zeros
    # on a CUDA build, not-available on a CPU-only build.
    import torch

    if torch.cuda.is_available():
        assert mem.allocated == 0
    else:
        assert mem.allocated is NA and mem.fragmentation is NA


def test_unsupported_readings_are_na(gpus: list[FakeGpu]) -> None:
    gpus[1].temperature = None
    gpus[1].power_mw = None
    mem = vramctl.get_device(1).memory()
    assert mem.temperature_c is NA and mem.power_w is NA and mem.total == gpus[1].total


def test_processes_with_names_and_hidden_usage(gpus: list[FakeGpu]) -> None:
    me = os.getpid()
    gpus[1].processes = [FakeProcess(me, 3 * GiB), FakeProcess(999_999_999, None)]
    procs = vramctl.get_device(1).processes()
    assert [p.pid for p in procs] == [me, 999_999_999]
    mine, ghost = procs
    assert mine.used == 3 * GiB and mine.name != NA and mine.command != NA
    assert ghost.used is NA and ghost.name is NA  # NVML hid the figure; no such local process
    assert vramctl.get_device(1).memory().process_used == 3 * GiB


@pytest.mark.parametrize(
    ("visible", "expected_uuids"),
    [
        ("2,0", ["GPU-cccccccc-2222", "GPU-aaaaaaaa-0000"]),
        ("GPU-bbbb", ["GPU-bbbbbbbb-1111"]),
        ("1,7,0", ["GPU-bbbbbbbb-1111"]),  # as in CUDA, an invalid entry ends the list
        ("", []),
        ("-1", []),
    ],
)
def test_cuda_visible_devices(
    gpus: list[FakeGpu], monkeypatch: pytest.MonkeyPatch, visible: str, expected_uuids: list[str]
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    found = vramctl.gpus()
    assert [d.uuid for d in found] == expected_uuids
    assert [d.id for d in found] == [f"cuda:{i}" for i in range(len(expected_uuids))]


def test_mig_instances_replace_their_parent(gpus: list[FakeGpu]) -> None:
    parent = gpus[0]
    parent.migs = [
        FakeGpu("NVIDIA A100-SXM4-80GB MIG 3g.40gb", "MIG-1111", 40 * GiB, used=GiB, parent=parent),
        FakeGpu("NVIDIA A100-SXM4-80GB MIG 3g.40gb", "MIG-2222", 40 * GiB, used=0, parent=parent),
    ]
    found = vramctl.gpus()
    assert [d.kind for d in found] == ["mig", "mig", "cuda", "cuda"]
    mig = found[0]
    mem = mig.memory()
    assert mem.total == 40 * GiB and mem.temperature_c is NA  # per-GPU readings don't apply
    assert str(mig.capability) == "8.0"
    assert vramctl.get_device("MIG-2222") is found[1]


def test_get_device_forms(gpus: list[FakeGpu]) -> None:
    assert vramctl.get_device(2).uuid == "GPU-cccccccc-2222"
    assert vramctl.get_device("cuda").id == "cuda:0"
    assert vramctl.get_device("cuda:1").id == "cuda:1"
    assert vramctl.get_device("GPU-cccc").id == "cuda:2"
    assert vramctl.get_device("cpu").kind == "cpu"
    assert vramctl.get_device("sim:T4-16GB").kind == "sim"


@pytest.mark.parametrize("bad", ["cuda:9", 9, "gpu0", "GPU-zzzz", "GPU-"])
def test_unknown_device_names_value_devices_and_forms(gpus: list[FakeGpu], bad: object) -> None:
    with pytest.raises(UnknownDeviceError) as err:
        vramctl.get_device(bad)  # type: ignore[arg-type]
    msg = str(err.value)
    assert str(bad) in msg and "cuda:0, cuda:1, cuda:2, cpu" in msg and "sim:NAME" in msg


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("A100-80G", "unknown device 'A100-80G': did you mean A100-80GB?"),
        ("V100-32G", "unknown device 'V100-32G': did you mean V100-32GB?"),
        ("A100", "'A100' matches several GPUs: A100-40GB, A100-80GB; name one"),
        ("V100", "'V100' matches several GPUs: V100-16GB, V100-32GB; name one"),
        ("sim:A100", "'A100' matches several GPUs: A100-40GB, A100-80GB; name one"),
    ],
)
def test_a_catalog_name_that_is_not_exact_is_never_guessed(text: str, message: str) -> None:
    with pytest.raises(UnknownDeviceError) as err:
        vramctl.device.resolve(text)
    assert str(err.value) == message


@pytest.mark.parametrize(
    ("text", "name"),
    [
        ("A100-80GB", "A100-80GB"),
        ("a100_80gb", "A100-80GB"),
        ("sim:A100-40GB", "A100-40GB"),
        ("V100-32GB", "V100-32GB"),
        ("sim:T4-16GB", "T4-16GB"),
        ("H100-80GB", "H100-80GB"),
        ("t4", "T4-16GB"),
        ("sim:8GiB", "8GiB"),
    ],
)
def test_catalog_names_aliases_and_sizes_resolve(text: str, name: str) -> None:
    assert vramctl.device.resolve(text).name == name


def test_a_gpu_lost_after_listing_does_not_hide_the_others(
    gpus: list[FakeGpu], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("time.sleep", lambda s: None)
    first = vramctl.devices()
    gpus[1].lost = True  # fell off the bus: every NVML call on it raises GPU_IS_LOST
    assert [d.id for d in vramctl.devices()] == ["cuda:0", "cuda:2", "cpu"]  # numbers kept
    assert vramctl.devices()[1] is first[2]
    assert first[1].memory().total is NA and first[1].health.state is vramctl.HealthState.ERROR
    assert vramctl.select_device("1GiB").id == "cuda:0"


@pytest.mark.parametrize(
    "function",
    [
        "nvmlDeviceGetTemperature",
        "nvmlDeviceGetPowerUsage",
        "nvmlDeviceGetUtilizationRates",
        "nvmlDeviceGetComputeMode",
    ],
)
@pytest.mark.parametrize(
    "error",
    [pynvml.NVML_ERROR_GPU_IS_LOST, pynvml.NVML_ERROR_UNKNOWN, pynvml.NVML_ERROR_NOT_SUPPORTED],
)
def test_a_failing_side_reading_is_na_and_keeps_the_memory_figures(
    gpus: list[FakeGpu], monkeypatch: pytest.MonkeyPatch, function: str, error: int
) -> None:
    monkeypatch.setattr("time.sleep", lambda s: None)
    dev = vramctl.get_device(0)
    gpus[0].fail_call(function, 10, error)
    for _ in range(3):
        mem = dev.memory()  # never raises
        assert mem.total == 81920 * MiB and mem.used == 20 * GiB
    assert dev.health.state.usable
    if function == "nvmlDeviceGetTemperature":
        assert mem.temperature_c is NA and mem.power_w == 70.0


def test_capability_read_failure_does_not_stop_discovery(gpus: list[FakeGpu]) -> None:
    gpus[2].fail_call("nvmlDeviceGetCudaComputeCapability", 1, pynvml.NVML_ERROR_UNKNOWN)
    devs = vramctl.devices()
    assert [d.id for d in devs] == ["cuda:0", "cuda:1", "cuda:2", "cpu"]
    assert devs[2].capability is NA
