"""``doctor``: each check's findings, levels and actions, against the NVML stand-in and
temporary files standing for /dev/shm, the cgroup tree and /proc/meminfo."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest
import torch
from typer.testing import CliRunner

import vramctl
from tests.fake_nvml import FakeGpu, FakeNvml, GiB, MiB
from vramctl.cli._app import app
from vramctl.device import driver_info
from vramctl.device._host import cgroup_memory, cpu_quota
from vramctl.doctor import DoctorReport, Finding, _doctor, _gpu, _host, _packages, _torch, doctor

runner = CliRunner()


@pytest.fixture(autouse=True)
def _no_allocator_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """The user's allocator settings do not leak into the checks."""
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def no_nvml(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    """A machine without the NVIDIA driver (and torch.cuda unavailable)."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    fake = FakeNvml([], init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    fake.install(monkeypatch)
    return fake


def only(report: DoctorReport, check: str, device: str | None = None) -> list[Finding]:
    return [
        f
        for f in report.findings
        if f.check == check and (device is None or f.details.get("device") == device)
    ]


def one(report: DoctorReport, check: str, device: str | None = None) -> Finding:
    found = only(report, check, device)
    assert len(found) == 1, found
    return found[0]


# -- the findings on a machine with GPUs (the stand-in) ---------------------------------


@pytest.fixture
def troubled(gpus: list[FakeGpu]) -> list[FakeGpu]:
    """cuda:0 persistence off and another process; GPU 1 with MIG (two instances); the T4
    with uncorrected ECC errors."""
    gpus[0].persistence = False
    parent = gpus[1]
    parent.migs = [
        FakeGpu("NVIDIA A100-SXM4-80GB MIG 3g.40gb", "MIG-1111", 40 * GiB, parent=parent),
        FakeGpu("NVIDIA A100-SXM4-80GB MIG 3g.40gb", "MIG-2222", 40 * GiB, parent=parent),
    ]
    gpus[2].ecc_uncorrected_volatile = 3
    gpus[2].ecc_uncorrected_aggregate = 3
    return gpus


def test_each_gpu_finding_with_its_level_and_action(troubled: list[FakeGpu]) -> None:
    report = doctor(env={})
    # Four CUDA devices (cuda:1 and cuda:2 are GPU 1's MIG instances), three GPUs.
    assert [g["device"] for g in one(report, "gpu.found").details["gpus"]] == [
        "cuda:0",
        "cuda:1",
        "cuda:2",
        "cuda:3",
    ]
    persistence = {f.details["gpu"]: f for f in only(report, "gpu.persistence")}
    assert sorted(persistence) == [0, 1, 2]  # once per GPU, not per MIG instance
    assert persistence[0].level == "info" and "nvidia-smi -i 0 -pm 1" in persistence[0].action
    assert persistence[1].level == "ok" and persistence[1].action == ""

    mig = {f.details["gpu"]: f for f in only(report, "gpu.mig")}
    assert mig[1].level == "info" and "2 instance(s)" in mig[1].message
    assert "nvidia-smi -i 1 -mig 0" in mig[1].action
    assert mig[0].level == "ok" and mig[2].level == "ok"

    ecc = {f.details["gpu"]: f for f in only(report, "gpu.ecc")}
    assert ecc[2].level == "error" and "3 uncorrected ECC error(s)" in ecc[2].message
    assert "nvidia-smi -i 2 -r" in ecc[2].action
    assert ecc[0].level == "ok"

    procs = one(report, "gpu.processes", "cuda:0")
    assert procs.level == "warning" and "pid 4242" in procs.message
    assert "24% of 80.00 GiB" in procs.message and "vramctl devices --select" in procs.action
    assert one(report, "gpu.processes", "cuda:3").level == "ok"

    busy = {f.details["gpu"]: f for f in only(report, "gpu.utilization")}
    assert busy[0].level == "warning" and "80% busy" in busy[0].message
    assert "least-loaded" in busy[0].action
    assert busy[2].level == "ok"
    assert report.worst == "error"


def test_mig_on_without_instances_is_an_error(gpus: list[FakeGpu]) -> None:
    gpus[1].mig_mode = (True, True)
    f = one(doctor(env={}), "gpu.mig", "cuda:1")
    assert f.level == "error" and "no instances" in f.message
    assert "nvidia-smi mig -i 1 -cgi" in f.action


def test_a_pending_mig_change_needs_a_reset(gpus: list[FakeGpu]) -> None:
    gpus[0].mig_mode = (False, True)
    found = only(doctor(env={}), "gpu.mig", "cuda:0")
    assert [f.level for f in found] == ["warning", "ok"]
    assert "turns on at the next GPU reset" in found[0].message
    assert "nvidia-smi -i 0 -r" in found[0].action


@pytest.mark.parametrize(
    ("settings", "level", "needle", "action"),
    [
        ({"ecc_uncorrected_aggregate": 4}, "warning", "over its life", "-q -d ECC"),
        ({"ecc_mode": (False, False)}, "info", "ECC is off", "nvidia-smi -i 2 -e 1"),
        ({"remapped_rows": (0, 1, True, False)}, "warning", "remap waits", "nvidia-smi -i 2 -r"),
        ({"remapped_rows": (0, 9, False, True)}, "error", "remap failed", "serviced"),
        ({"ecc_mode": None}, "ok", "no ECC", ""),
    ],
)
def test_ecc_findings(
    gpus: list[FakeGpu], settings: dict[str, Any], level: str, needle: str, action: str
) -> None:
    for key, value in settings.items():
        setattr(gpus[2], key, value)
    f = one(doctor(env={}), "gpu.ecc", "cuda:2")
    assert f.level == level and needle in f.message
    assert action in f.action and (action or f.action == "")


def test_compute_mode_prohibited_is_an_error(gpus: list[FakeGpu]) -> None:
    gpus[1].compute_mode = pynvml.NVML_COMPUTEMODE_PROHIBITED
    found = only(doctor(env={}), "gpu.utilization", "cuda:1")
    assert found[0].level == "error" and "Prohibited" in found[0].message
    assert "nvidia-smi -i 1 -c DEFAULT" in found[0].action


def test_memory_held_by_unlisted_processes(gpus: list[FakeGpu]) -> None:
    gpus[1].used = 30 * GiB  # and no process listed: another container's
    f = one(doctor(env={}), "gpu.processes", "cuda:1")
    assert f.level == "info" and "no process listed, but 30.00 GiB" in f.message


def test_only_the_devices_asked_for(troubled: list[FakeGpu]) -> None:
    report = doctor(devices=["cuda:3"], env={})
    assert [g["device"] for g in one(report, "gpu.found").details["gpus"]] == ["cuda:3"]
    assert [f.details["device"] for f in only(report, "gpu.ecc")] == ["cuda:3"]
    f = one(doctor(devices=["cpu"], env={}), "gpu.found")
    assert f.level == "info" and "no GPU among the devices asked for (cpu)" in f.message


# -- the driver against torch's build -------------------------------------------------------


@pytest.mark.parametrize(
    ("build", "level", "needle"),
    [
        ("12.4", "ok", "supports CUDA up to 12.4"),
        ("12.1", "ok", "built for CUDA 12.1"),
        ("12.8", "warning", "minor version compatibility"),
        ("13.0", "error", "CUDA cannot start"),
    ],
)
def test_driver_against_the_torch_build(
    gpus: list[FakeGpu], monkeypatch: pytest.MonkeyPatch, build: str, level: str, needle: str
) -> None:
    monkeypatch.setattr(torch.version, "cuda", build)
    f = one(doctor(env={}), "cuda.driver")
    assert f.level == level and needle in f.message
    assert f.details["driver_version"] == "550.54.15" and f.details["driver_cuda"] == "12.4"
    if level == "error":
        assert "update the NVIDIA driver" in f.action and "whl/cu124" in f.action
    elif level == "warning":
        assert "update the NVIDIA driver" in f.action
    else:
        assert f.action == ""


def test_a_cpu_only_torch_on_a_gpu_machine(
    gpus: list[FakeGpu], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    f = one(doctor(env={}), "cuda.driver")
    assert f.level == "error" and "CPU-only build" in f.message and "3 GPUs" in f.message
    assert "--index-url https://download.pytorch.org/whl/cu124" in f.action


def test_a_cuda_torch_that_cannot_see_the_gpus(
    gpus: list[FakeGpu], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.version, "cuda", "12.4")  # torch.cuda.is_available() is False
    f = one(doctor(env={}), "torch.cuda")
    assert f.level == "error" and "torch.cuda.is_available() is False" in f.message
    assert "CUDA_VISIBLE_DEVICES" in f.action


@pytest.mark.parametrize(
    ("cc", "arch", "ok"),
    [
        ((8, 6), ["sm_80", "sm_90"], True),  # sm_80 cubins run on 8.6
        ((9, 0), ["sm_80", "compute_80"], True),  # PTX is compiled for newer GPUs
        ((12, 0), ["sm_80", "sm_90"], False),
        ((9, 0), ["sm_90a"], True),
        ((7, 5), ["sm_80", "sm_90"], False),
    ],
)
def test_arch_support(cc: tuple[int, int], arch: list[str], ok: bool) -> None:
    assert _gpu._arch_supported(cc, arch) is ok


# -- no GPU --------------------------------------------------------------------------------


def test_without_a_gpu_one_finding_says_so_and_the_rest_is_checked(no_nvml: FakeNvml) -> None:
    report = doctor(env={})
    found = one(report, "gpu.found")
    assert found.level == "info" and found.message.startswith("no GPU found")
    assert "no NVIDIA driver library" in found.message and found.action
    if torch.version.cuda is None:
        assert "CPU-only build" in found.message
    assert report.worst != "error"
    assert [f.check for f in report.findings if "no GPU" in f.message] == ["gpu.found"]
    checks = {f.check for f in report.findings}
    assert {
        "nvml.access",
        "cuda.driver",
        "cuda.alloc_conf",
        "torch.tf32",
        "torch.cudnn",
        "host.shm",
        "host.cgroup",
        "host.swap",
        "host.threads",
        "python.packages",
    } <= checks
    assert not any(c.startswith("gpu.") and c != "gpu.found" for c in checks)
    assert "could not run" not in str(report)


def test_gpus_hidden_by_cuda_visible_devices(
    gpus: list[FakeGpu], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    f = one(doctor(), "gpu.found")
    assert f.level == "warning" and "CUDA_VISIBLE_DEVICES=''" in f.message
    assert "the driver sees 3 GPUs" in f.message and "unset CUDA_VISIBLE_DEVICES" in f.action


@pytest.mark.parametrize(
    ("code", "level", "action"),
    [
        (pynvml.NVML_ERROR_NO_PERMISSION, "error", "group that owns /dev/nvidia*"),
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "error", "modprobe nvidia"),
        (pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, "error", "reboot"),
        (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "info", "gpu.found"),
    ],
)
def test_nvml_access_explains_why_it_cannot_run(
    monkeypatch: pytest.MonkeyPatch, code: int, level: str, action: str
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    FakeNvml([], init_error=code).install(monkeypatch)
    f = one(doctor(env={}), "nvml.access")
    assert f.level == level and action in f.action


# -- PYTORCH_CUDA_ALLOC_CONF ------------------------------------------------------------------


def test_unset_alloc_conf_on_a_gpu_suggests_expandable_segments(gpus: list[FakeGpu]) -> None:
    f = one(doctor(env={}), "cuda.alloc_conf")
    assert f.level == "info" and "not set" in f.message
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in f.action


def test_unset_alloc_conf_without_a_gpu_is_fine() -> None:
    [f] = _torch.check_alloc_conf({}, gpu=False)
    assert f.level == "ok" and f.details["variable"] == "PYTORCH_CUDA_ALLOC_CONF"


@pytest.mark.parametrize(
    "value",
    [
        "expandable_segments:True",
        "max_split_size_mb:128,garbage_collection_threshold:0.6",
        "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]",
        "roundup_power2_divisions:4, expandable_segments:False",
        "backend:cudaMallocAsync",
        "pinned_num_register_threads:8",
    ],
)
def test_good_alloc_conf(value: str) -> None:
    [f] = _torch.check_alloc_conf({"PYTORCH_CUDA_ALLOC_CONF": value}, gpu=True)
    assert f.level == "ok" and f.action == "" and f.details["problems"] == []


@pytest.mark.parametrize(
    ("value", "level", "needle"),
    [
        ("expandable_segment:True", "error", "did you mean 'expandable_segments'"),
        ("expandable_segments:true", "error", "takes True or False"),
        ("max_split_size_mb:10", "error", "at least 20"),
        ("garbage_collection_threshold:1.5", "error", "between 0 and 1"),
        ("roundup_power2_divisions:3", "error", "a power of 2"),
        ("roundup_power2_divisions:[256:3]", "error", "a power of 2"),
        ("pinned_num_register_threads:256", "error", "at most 128"),
        ("backend:magic", "error", "native or cudaMallocAsync"),
        ("expandable_segments", "error", "is not key:value"),
        ("totally_new_option:1", "warning", "may refuse it"),
        ("backend:cudaMallocAsync,max_split_size_mb:64", "warning", "ignores max_split_size_mb"),
    ],
)
def test_bad_alloc_conf(value: str, level: str, needle: str) -> None:
    found = _torch.check_alloc_conf({"PYTORCH_CUDA_ALLOC_CONF": value}, gpu=True)
    assert [f.level for f in found] == [level]
    assert needle in found[0].message and found[0].action


def test_a_bad_alloc_conf_without_a_gpu_is_a_warning() -> None:
    [f] = _torch.check_alloc_conf({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:1"}, gpu=False)
    assert f.level == "warning" and "would refuse it" in f.message


def test_the_generic_variable_and_two_that_differ() -> None:
    [f] = _torch.check_alloc_conf({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}, gpu=True)
    assert f.level == "ok" and f.details["variable"] == "PYTORCH_ALLOC_CONF"
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "PYTORCH_ALLOC_CONF": "x:1"}
    found = _torch.check_alloc_conf(env, gpu=True)
    assert found[0].level == "warning" and "both set" in found[0].message


def test_doctor_reads_the_environment(gpus: list[FakeGpu], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segmentz:True")
    f = one(doctor(), "cuda.alloc_conf")
    assert f.level == "error" and "expandable_segmentz" in f.message


# -- TF32 and cuDNN ---------------------------------------------------------------------------


def test_tf32_off_on_an_ampere_gpu(gpus: list[FakeGpu], monkeypatch: pytest.MonkeyPatch) -> None:
    # Set directly, not with monkeypatch: torch's cuBLAS settings object answers through
    # __getattr__, and pytest 9.2's undo deletes such an attribute instead of setting it
    # back (and stops undoing there). The doctor's conftest puts the flag back.
    torch.backends.cuda.matmul.allow_tf32 = False
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "highest")
    f = one(doctor(env={}), "torch.tf32")
    assert f.level == "info" and "cuda:0, cuda:1" in f.message and "cuda:2" not in f.message
    assert "torch.set_float32_matmul_precision('high')" in f.action


def test_tf32_on(gpus: list[FakeGpu], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    f = one(doctor(env={}), "torch.tf32")
    assert f.level == "ok" and "TF32 is allowed" in f.message


def test_tf32_on_a_gpu_without_it(gpus: list[FakeGpu]) -> None:
    f = one(doctor(devices=[2], env={}), "torch.tf32")  # a T4: 7.5
    assert f.level == "ok" and "no GPU with TF32" in f.message


def test_cudnn(monkeypatch: pytest.MonkeyPatch) -> None:
    cudnn = torch.backends.cudnn
    monkeypatch.setattr(cudnn, "is_available", lambda: True)
    monkeypatch.setattr(cudnn, "version", lambda: 90100)
    monkeypatch.setattr(cudnn, "deterministic", True)
    found = _torch.check_cudnn("12.4", gpu=True)
    assert [f.level for f in found] == ["info", "ok"]
    assert "deterministic" in found[0].message and found[0].action
    assert "cuDNN 9.1.0" in found[1].message
    monkeypatch.setattr(cudnn, "is_available", lambda: False)
    [missing] = _torch.check_cudnn("12.4", gpu=True)
    assert missing.level == "warning" and "reinstall torch" in missing.action
    assert _torch._cudnn_text(8902) == "8.9.2"


# -- the host, through temporary files --------------------------------------------------------


def test_shm_too_small(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    small = SimpleNamespace(f_frsize=4096, f_blocks=64 * MiB // 4096, f_bavail=60 * MiB // 4096)
    monkeypatch.setattr(_host.os, "statvfs", lambda path: small)
    [f] = _host.check_shm(tmp_path)
    assert f.level == "warning" and "is 64.00 MiB" in f.message
    assert "--shm-size" in f.action and "--ipc=host" in f.action


def test_shm_large_enough_or_missing(tmp_path: Path) -> None:
    [f] = _host.check_shm(tmp_path, need=1)
    assert f.level == "ok" and f.details["size"] > 0
    [f] = _host.check_shm(tmp_path, need=2**62)
    assert f.level == "warning"
    [f] = _host.check_shm(tmp_path / "missing")
    assert f.level == "warning" and "no " in f.message and "--shm-size" in f.action


def _cgroup_v2(tmp_path: Path, rel: str, files: dict[str, str]) -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpu memory\n")
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    own = tmp_path / "self_cgroup"
    own.write_text(f"0::{rel}\n")
    return root, own


def test_cgroup_v2_limit_below_the_host(tmp_path: Path) -> None:
    root, own = _cgroup_v2(
        tmp_path,
        "/job/step",
        {
            "job/memory.max": str(8 * GiB),
            "job/step/memory.max": "max",
            "job/step/memory.current": str(2 * GiB),
        },
    )
    assert cgroup_memory(root, own).to_dict() == {
        "version": "v2",
        "limit": 8 * GiB,
        "usage": 2 * GiB,
    }
    [f] = _host.check_cgroup(root, own, host_total=64 * GiB)
    assert f.level == "info" and "8.00 GiB of the host's 64.00 GiB" in f.message
    assert "docker run --memory" in f.action


def test_cgroup_v2_near_its_limit(tmp_path: Path) -> None:
    root, own = _cgroup_v2(
        tmp_path, "/", {"memory.max": str(4 * GiB), "memory.current": str(int(3.8 * GiB))}
    )
    [f] = _host.check_cgroup(root, own, host_total=64 * GiB)
    assert f.level == "warning" and "95%" in f.message and "137" in f.action


def test_cgroup_without_a_limit(tmp_path: Path) -> None:
    root, own = _cgroup_v2(tmp_path, "/", {"memory.max": "max", "memory.current": "100"})
    [f] = _host.check_cgroup(root, own, host_total=64 * GiB)
    assert f.level == "ok" and f.action == ""
    [f] = _host.check_cgroup(tmp_path / "none", tmp_path / "none", host_total=64 * GiB)
    assert f.level == "ok" and "no cgroup" in f.message


def test_cgroup_v1(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    (root / "memory" / "docker" / "abc").mkdir(parents=True)
    (root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (root / "memory" / "docker" / "abc" / "memory.limit_in_bytes").write_text(str(16 * GiB))
    (root / "memory" / "docker" / "abc" / "memory.usage_in_bytes").write_text(str(GiB))
    own = tmp_path / "self_cgroup"
    own.write_text("5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n")
    assert cgroup_memory(root, own).to_dict() == {"version": "v1", "limit": 16 * GiB, "usage": GiB}
    [f] = _host.check_cgroup(root, own, host_total=128 * GiB)
    assert f.level == "info" and "16.00 GiB" in f.message


def test_cpu_quota(tmp_path: Path) -> None:
    root, own = _cgroup_v2(tmp_path, "/", {"cpu.max": "150000 100000\n"})
    assert cpu_quota(root, own) == 1.5
    (root / "cpu.max").write_text("max 100000\n")
    assert cpu_quota(root, own) is None


def test_threads() -> None:
    [f] = _host.check_threads(threads=8, cpus=2)
    assert f.level == "warning" and "torch.set_num_threads(2)" in f.action
    [f] = _host.check_threads(threads=4, cpus=8, quota=1.5)
    assert f.level == "warning" and "quota of 1.5" in f.message and "(1)" in f.action
    [f] = _host.check_threads(threads=4, cpus=8)
    assert f.level == "ok" and f.action == ""


def _meminfo(tmp_path: Path, swap_total_kb: int, swap_free_kb: int) -> Path:
    path = tmp_path / "meminfo"
    path.write_text(
        "MemTotal:       65536000 kB\nMemAvailable:   1000000 kB\n"
        f"SwapCached:            0 kB\nSwapTotal:      {swap_total_kb} kB\n"
        f"SwapFree:       {swap_free_kb} kB\nHugePages_Total:       0\n"
    )
    return path


def test_swap(tmp_path: Path) -> None:
    [f] = _host.check_swap(_meminfo(tmp_path, 8 * 2**20, 2 * 2**20))
    assert f.level == "warning" and "6.00 GiB of 8.00 GiB" in f.message
    assert "DataLoader workers" in f.action
    [f] = _host.check_swap(_meminfo(tmp_path, 8 * 2**20, 8 * 2**20))
    assert f.level == "ok" and f.details["swap_total"] == 8 * GiB
    [f] = _host.check_swap(_meminfo(tmp_path, 0, 0))
    assert f.level == "ok" and "no swap" in f.message
    assert _host.read_meminfo(_meminfo(tmp_path, 0, 0))["MemTotal"] == 65536000 * 1024


def test_packages() -> None:
    found = _packages.check_packages(
        {"torch": "2.5.0", "pynvml": "11.5.0", "nvidia-ml-py": "12.560.30"}
    )
    assert [f.level for f in found] == ["warning", "ok"]
    assert "pip uninstall pynvml" in found[0].action
    assert "torch 2.5.0" in found[1].message and "not installed: transformers" in found[1].message
    [real] = _packages.check_packages()
    assert real.level == "ok" and f"torch {torch.__version__}" in real.message


# -- a check that fails, the report ------------------------------------------------------------


def test_a_check_that_raises_becomes_a_finding(
    gpus: list[FakeGpu], monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(*args: Any, **kwargs: Any) -> list[Finding]:
        raise RuntimeError("the swap file exploded")

    monkeypatch.setattr(_doctor, "check_swap", boom)
    monkeypatch.setattr(_doctor, "check_ecc", boom)
    report = doctor(env={})
    f = one(report, "host.swap")
    assert (
        f.level == "warning" and "could not run: RuntimeError: the swap file exploded" in f.message
    )
    assert f.action and f.details["error"] == "RuntimeError"
    assert [x.level for x in only(report, "gpu.ecc")] == ["warning"] * 3
    assert len(only(report, "gpu.persistence")) == 3 and only(report, "host.shm")


def test_finding_levels_are_checked() -> None:
    with pytest.raises(ValueError, match="level 'fatal'"):
        Finding("x", "fatal", "m")  # type: ignore[arg-type]


def test_report_views() -> None:
    report = DoctorReport(
        (
            Finding("a.ok", "ok", "fine"),
            Finding("b.err", "error", "broken", "fix it", {"n": 1, "v": (1, 2)}),
            Finding("c.warn", "warning", "hm", "look"),
        ),
        created=0.0,
        versions={"vramctl": "1"},
    )
    assert report.worst == "error"
    assert report.counts() == {"ok": 1, "info": 0, "warning": 1, "error": 1}
    assert report.summary() == "1 error, 1 warning, 0 info, 1 ok"
    doc = json.loads(json.dumps(report.to_dict()))
    assert doc["schema"] == "vramctl.doctor/1" and doc["worst"] == "error"
    assert doc["findings"][1]["details"] == {"n": 1, "v": [1, 2]}
    text = str(report)
    assert text.index("b.err") < text.index("c.warn") < text.index("a.ok") and "-> fix it" in text
    md = report.to_markdown()
    assert md.startswith("# vramctl doctor report")
    assert md.index("## Errors") < md.index("## Warnings") < md.index("## OK")
    assert "- **`b.err`**: broken\n  - Action: fix it" in md
    assert DoctorReport(()).worst == "ok"


def test_the_public_names() -> None:
    # The names kept where they were before the doctor had a package of its own.
    from vramctl.optimize import DoctorReport as OldReport
    from vramctl.optimize import Finding as OldFinding
    from vramctl.optimize import doctor as old_doctor

    # vramctl.doctor is the package, called as its function.
    assert vramctl.doctor.doctor is doctor and old_doctor is doctor and callable(vramctl.doctor)
    assert OldReport is DoctorReport and OldFinding is Finding
    assert doctor.__module__ == "vramctl.doctor._doctor"
    assert driver_info().to_dict()["nvml"] in (True, False)


# -- the command -------------------------------------------------------------------------------


def test_cli_json_is_one_object(no_nvml: FakeNvml) -> None:
    result = runner.invoke(app, ["doctor", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["schema"] == "vramctl.doctor/1" and doc["worst"] in ("ok", "info", "warning")
    assert {f["check"] for f in doc["findings"]} >= {"gpu.found", "host.shm", "python.packages"}


def test_cli_table_and_reports(no_nvml: FakeNvml, tmp_path: Path) -> None:
    result = runner.invoke(
        app, ["doctor", "--report", str(tmp_path / "r.md")], env={"COLUMNS": "120"}
    )
    assert result.exit_code == 0, result.output
    assert "vramctl doctor:" in result.stdout and "gpu.found" in result.stdout
    assert "no GPU found" in result.stdout and "report written to" in result.stdout
    md = (tmp_path / "r.md").read_text()
    assert md.startswith("# vramctl doctor report") and "`gpu.found`" in md

    result = runner.invoke(app, ["doctor", "--json", "--report", str(tmp_path / "r.json")])
    assert result.exit_code == 0, result.output
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["findings"] == json.loads(result.stdout)["findings"]


def test_cli_exits_1_on_an_error(gpus: list[FakeGpu], tmp_path: Path) -> None:
    gpus[2].ecc_uncorrected_volatile = 1
    result = runner.invoke(app, ["doctor", "--json", "--report", str(tmp_path / "x.txt")])
    assert result.exit_code == 1, result.output
    doc = json.loads(result.stdout)
    assert doc["worst"] == "error"
    assert any(f["check"] == "gpu.ecc" and f["level"] == "error" for f in doc["findings"])
    assert (tmp_path / "x.txt").read_text().startswith("# vramctl doctor report")


def test_cli_refuses_a_report_it_cannot_write(no_nvml: FakeNvml, tmp_path: Path) -> None:
    result = runner.invoke(app, ["doctor", "--report", str(tmp_path / "no" / "r.md")])
    assert result.exit_code == 2 and "--report" in result.stderr


# -- a real GPU ----------------------------------------------------------------------------------


@pytest.mark.cuda
def test_on_a_real_gpu_the_driver_matches_nvml_and_torch() -> None:
    report = doctor()
    found = one(report, "gpu.found")
    assert found.level == "ok" and len(found.details["gpus"]) == torch.cuda.device_count()
    driver = one(report, "cuda.driver")
    pynvml.nvmlInit()
    version = pynvml.nvmlSystemGetDriverVersion()
    version = version.decode() if isinstance(version, bytes) else version
    assert driver.details["driver_version"] == version
    # The CUDA driver API's version (cuDriverGetVersion), as torch reads it.
    cuda = torch._C._cuda_getDriverVersion()
    assert driver.details["driver_cuda"] == f"{cuda // 1000}.{cuda % 1000 // 10}"
    assert driver.details["torch_cuda"] == torch.version.cuda
    assert driver.level in ("ok", "warning")  # CUDA runs, so the driver is new enough
    assert one(report, "nvml.access").level == "ok"
    assert all(f.level == "ok" for f in only(report, "torch.cuda"))
    assert not [f for f in report.findings if "could not run" in f.message]
