"""``doctor``: run every check and gather the findings in a :class:`DoctorReport`.

Each check is a small function that returns its findings (``_gpu``, ``_torch``, ``_host``,
``_packages``); :func:`doctor` runs them all. A check that raises becomes a finding of its
own (it could not run) and the others still run.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vramctl._version import __version__
from vramctl.device import (
    Device,
    DriverInfo,
    GpuSettings,
    driver_info,
    get_device,
    gpu_settings,
    gpus,
)
from vramctl.device._shared import cpu_quota
from vramctl.doctor._gpu import (
    check_driver,
    check_ecc,
    check_gpus,
    check_mig,
    check_nvml,
    check_persistence,
    check_processes,
    check_torch_cuda,
    check_utilization,
)
from vramctl.doctor._host import check_cgroup, check_shm, check_swap, check_threads
from vramctl.doctor._packages import check_packages
from vramctl.doctor._report import DoctorReport, Finding
from vramctl.doctor._torch import check_alloc_conf, check_cudnn, check_tf32

__all__ = ["doctor"]


@dataclass
class _Machine:
    """What several checks read, read once."""

    driver: DriverInfo
    devices: list[Device]
    settings: dict[str, GpuSettings | None]
    env: Mapping[str, str]


def _failed(check: str, exc: BaseException) -> Finding:
    return Finding(
        check,
        "warning",
        f"the check could not run: {type(exc).__name__}: {exc}",
        "run it again; if it fails the same way, report this message",
        {"error": type(exc).__name__},
    )


def _run(check: str, fn: Callable[..., list[Finding]], *args: Any, **kwargs: Any) -> list[Finding]:
    """``fn``'s findings, or one saying that ``check`` could not run."""
    try:
        return list(fn(*args, **kwargs))
    except Exception as exc:
        return [_failed(check, exc)]


def _gather(
    devices: Sequence[Device | int | str] | None, env: Mapping[str, str]
) -> tuple[_Machine, list[Finding]]:
    failed: list[Finding] = []
    try:
        driver = driver_info()
    except Exception as exc:
        failed.append(_failed("nvml.access", exc))
        driver = DriverInfo(nvml=False, reason=str(exc), error="other")
    try:
        found = [get_device(d) for d in devices] if devices is not None else gpus()
        found = [d for d in found if d.is_cuda]
    except Exception as exc:
        failed.append(_failed("gpu.found", exc))
        found = []
    settings: dict[str, GpuSettings | None] = {}
    for d in found:
        try:
            settings[d.id] = gpu_settings(d)
        except Exception as exc:
            failed.append(_failed("gpu.settings", exc))
            settings[d.id] = None
    return _Machine(driver, found, settings, env), failed


def _versions() -> dict[str, str]:
    return {
        "vramctl": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
    }


def doctor(
    *,
    devices: Sequence[Device | int | str] | None = None,
    env: Mapping[str, str] | None = None,
) -> DoctorReport:
    """Check the environment for PyTorch work on GPUs, and say what to change.

    Checks the GPUs found (or ``devices``: indices, ``cuda:N``, UUIDs), NVML, the
    driver's CUDA version against torch's build, each GPU's other processes, MIG,
    persistence and ECC, ``PYTORCH_CUDA_ALLOC_CONF``, TF32 and cuDNN, ``/dev/shm``,
    the cgroup memory limit, swap, torch's CPU threads and the versions of
    transformers, accelerate, lightning and nvidia-ml-py. ``env`` stands for
    ``os.environ``. TF32, cuDNN and thread settings are this process's.

    Without a GPU one finding says so (and why) and the rest is still checked. A check
    that fails becomes a "warning" finding saying it could not run.
    """
    env = os.environ if env is None else env
    machine, findings = _gather(devices, env)
    torch_cuda = torch.version.cuda
    gpu = bool(machine.devices)
    findings += _run(
        "gpu.found", check_gpus, machine.driver, machine.devices, env, torch_cuda, asked=devices
    )
    findings += _run("nvml.access", check_nvml, machine.driver)
    findings += _run("cuda.driver", check_driver, machine.driver, torch_cuda)
    findings += _run("torch.cuda", check_torch_cuda, torch_cuda, machine.devices)
    seen: set[str] = set()
    for d in machine.devices:
        settings = machine.settings.get(d.id)
        if settings is None:
            # Known to torch.cuda alone: its readings would initialise CUDA here, and the
            # other processes need NVML (the nvml.access finding says why it is missing).
            continue
        findings += _run("gpu.processes", check_processes, d)
        if settings.uuid in seen:
            continue  # its GPU's settings were checked (another MIG instance of it)
        seen.add(settings.uuid)
        findings += _run("gpu.mig", check_mig, settings)
        findings += _run("gpu.persistence", check_persistence, settings)
        findings += _run("gpu.ecc", check_ecc, settings)
        findings += _run("gpu.utilization", check_utilization, settings)
    findings += _run("cuda.alloc_conf", check_alloc_conf, env, gpu=gpu)
    findings += _run("torch.tf32", check_tf32, machine.devices, env)
    findings += _run("torch.cudnn", check_cudnn, torch_cuda, gpu=gpu)
    findings += _run("host.shm", check_shm)
    findings += _run("host.cgroup", check_cgroup)
    findings += _run("host.swap", check_swap)
    findings += _run("host.threads", lambda: check_threads(quota=cpu_quota()))
    findings += _run("python.packages", check_packages)
    return DoctorReport(tuple(findings), versions=_versions())
