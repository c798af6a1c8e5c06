"""The doctor's GPU checks: the GPUs found, NVML, the driver's CUDA version against torch's
build, torch's kernels for each GPU, and each GPU's other processes, MIG, persistence mode,
ECC and load (read through NVML and the device layer: CUDA is not initialised)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from vramctl._na import NA
from vramctl._units import format_bytes
from vramctl.device import Device, DriverInfo, GpuSettings
from vramctl.doctor._packages import dist_version, major_minor
from vramctl.doctor._report import Finding, Level

__all__ = [
    "BUSY_UTILIZATION",
    "OTHERS_SHARE",
    "check_driver",
    "check_ecc",
    "check_gpus",
    "check_mig",
    "check_nvml",
    "check_persistence",
    "check_processes",
    "check_torch_cuda",
    "check_utilization",
]

GiB = 2**30
#: Other processes holding this fraction of a GPU's memory make a warning.
OTHERS_SHARE = 0.05
#: GPU (SM) utilization, percent, at which other work makes a step slower.
BUSY_UTILIZATION = 50.0


def _wheel_tag(version: tuple[int, int]) -> str:
    return f"cu{version[0]}{version[1]}"


def _gpu_word(n: int) -> str:
    return f"{n} GPU{'s' * (n != 1)}"


def _smi(settings: GpuSettings) -> str:
    return f"nvidia-smi -i {settings.nvml_index}"


# -- the driver, NVML and torch's CUDA build -------------------------------------------


def check_gpus(
    driver: DriverInfo,
    devices: Sequence[Device],
    env: Mapping[str, str],
    torch_cuda: str | None,
    *,
    asked: Sequence[object] | None = None,
) -> list[Finding]:
    """``gpu.found``: the GPUs found, or that none was, and why (``asked``: the devices the
    caller named, when it did)."""
    if devices:
        rows = [
            {
                "device": d.id,
                "name": d.name,
                "uuid": d.uuid,
                "compute_capability": None if d.capability is NA else str(d.capability),
            }
            for d in devices
        ]
        names = ", ".join(f"{d.id} {d.name}" for d in devices)
        return [
            Finding("gpu.found", "ok", f"{_gpu_word(len(devices))}: {names}", "", {"gpus": rows})
        ]
    if asked:
        return [
            Finding(
                "gpu.found",
                "info",
                f"no GPU among the devices asked for ({', '.join(map(str, asked))})",
                "name a GPU: an index (0), cuda:N or a UUID",
                {"asked": [str(a) for a in asked]},
            )
        ]
    reasons: list[str] = []
    level: Level = "info"
    visible = env.get("CUDA_VISIBLE_DEVICES")
    count = driver.gpu_count
    if driver.nvml and count is not NA and count > 0:
        level = "warning"
        reasons.append(
            f"the driver sees {_gpu_word(count)} but CUDA_VISIBLE_DEVICES={visible!r} hides them"
            if visible is not None
            else f"the driver sees {_gpu_word(count)} but none could be read"
        )
        action = "unset CUDA_VISIBLE_DEVICES or set it to the GPUs to use (e.g. 0,1)"
    elif driver.nvml:
        reasons.append("the NVIDIA driver is loaded but sees no GPU")
        action = "check that the GPU is seated and powered (lspci | grep -i nvidia)"
    elif driver.error == "library_not_found":
        reasons.append("no NVIDIA driver library (libnvidia-ml) on this machine")
        action = (
            "nothing to change on a machine without a GPU (simulated GPUs, sim:NAME, stand "
            "in); on one with an NVIDIA GPU install the driver, and in a container start it "
            "with the GPUs (docker run --gpus all)"
        )
    else:
        level = "warning"
        reasons.append(f"NVML cannot run: {driver.reason}")
        action = "see the nvml.access finding"
    if torch_cuda is None and torch.version.hip is None:
        reasons.append(f"torch {torch.__version__} is a CPU-only build")
    return [
        Finding(
            "gpu.found",
            level,
            "no GPU found: " + "; ".join(reasons),
            action,
            {
                "nvml": driver.nvml,
                "nvml_error": driver.error,
                "driver_gpu_count": count,
                "cuda_visible_devices": visible,
                "torch_cuda": torch_cuda,
            },
        )
    ]


_NVML_ERRORS: dict[str, tuple[Level, str, str]] = {
    "library_not_found": (
        "info",
        "NVML's library (libnvidia-ml.so.1) is not found: no NVIDIA driver is installed, or "
        "a container was started without the GPUs",
        "none on a machine without an NVIDIA GPU; on one with a GPU, see gpu.found",
    ),
    "no_permission": (
        "error",
        "NVML refused access: this user cannot open the GPU's device files (/dev/nvidiactl, "
        "/dev/nvidia*)",
        "add the user to the group that owns /dev/nvidia* (often 'video') and log in again; "
        "in a container pass the GPUs (docker run --gpus all)",
    ),
    "driver_not_loaded": (
        "error",
        "the NVIDIA driver is installed but its kernel module is not loaded",
        "load it (sudo modprobe nvidia) or reboot after the driver's installation; "
        "nvidia-smi shows whether it runs",
    ),
    "version_mismatch": (
        "error",
        "the NVML library and the loaded kernel module are of different driver versions "
        "(the driver was updated without a reboot)",
        "reboot, or unload and reload the nvidia kernel modules",
    ),
    "function_not_found": (
        "warning",
        "the driver is older than the NVML binding expects",
        "update the NVIDIA driver",
    ),
}


def check_nvml(driver: DriverInfo) -> list[Finding]:
    """``nvml.access``: whether NVML (the driver's management library) can be used, and the
    binding's version."""
    binding = dist_version("nvidia-ml-py")
    details = {"nvidia_ml_py": binding, "error": driver.error, "reason": driver.reason}
    if driver.nvml:
        return [
            Finding(
                "nvml.access",
                "ok",
                f"NVML runs (nvidia-ml-py {binding}, driver {driver.driver_version})",
                "",
                details,
            )
        ]
    level, message, action = _NVML_ERRORS.get(
        driver.error,
        (
            "warning",
            f"NVML cannot run: {driver.reason}",
            "run nvidia-smi to see the driver's error",
        ),
    )
    return [Finding("nvml.access", level, message, action, details)]


def check_driver(driver: DriverInfo, torch_cuda: str | None) -> list[Finding]:
    """``cuda.driver``: the CUDA version torch is built for against the driver's."""
    tv = torch.__version__
    details: dict[str, Any] = {
        "torch": tv,
        "torch_cuda": torch_cuda,
        "driver_version": driver.driver_version,
        "driver_cuda": driver.cuda_version_text,
    }
    count = driver.gpu_count
    has_gpus = driver.nvml and count is not NA and count > 0
    if torch_cuda is None:
        if torch.version.hip is not None:
            return [
                Finding(
                    "cuda.driver",
                    "info",
                    f"torch {tv} is a ROCm build (HIP {torch.version.hip}): NVIDIA's driver "
                    "is not compared",
                    "",
                    details,
                )
            ]
        if has_gpus and count is not NA:
            cuda = driver.cuda_driver_version
            index = (
                f"https://download.pytorch.org/whl/{_wheel_tag(cuda)}"
                if cuda is not NA
                else "https://download.pytorch.org/whl/cu126"
            )
            return [
                Finding(
                    "cuda.driver",
                    "error",
                    f"torch {tv} is a CPU-only build, but the driver sees {_gpu_word(count)}: "
                    "nothing runs on them",
                    f"install a CUDA build of torch for CUDA {driver.cuda_version_text} or "
                    f"older: pip install torch --index-url {index}",
                    details,
                )
            ]
        return [
            Finding(
                "cuda.driver",
                "ok",
                f"torch {tv} is a CPU-only build; no driver to compare",
                "",
                details,
            )
        ]
    build = major_minor(torch_cuda)
    if not driver.nvml or driver.cuda_driver_version is NA or build is None:
        why = "NVML cannot run" if not driver.nvml else "the driver does not say"
        return [
            Finding(
                "cuda.driver",
                "info",
                f"torch {tv} is built for CUDA {torch_cuda}; the driver's CUDA version is "
                f"unknown ({why})",
                "" if not has_gpus else "run nvidia-smi to see the driver's CUDA version",
                details,
            )
        ]
    have = driver.cuda_driver_version
    shown = f"driver {driver.driver_version} supports CUDA up to {driver.cuda_version_text}"
    if have[0] < build[0]:
        return [
            Finding(
                "cuda.driver",
                "error",
                f"{shown}, but torch {tv} is built for CUDA {torch_cuda}: CUDA cannot start",
                f"update the NVIDIA driver to one for CUDA {torch_cuda} or newer, or install "
                f"torch built for CUDA {have[0]}.x: pip install torch --index-url "
                f"https://download.pytorch.org/whl/{_wheel_tag(have)}",
                details,
            )
        ]
    if have < build:
        return [
            Finding(
                "cuda.driver",
                "warning",
                f"{shown}, older than torch {tv}'s CUDA {torch_cuda}: it runs under CUDA's "
                "minor version compatibility, but kernels compiled as PTX and features of the "
                "newer CUDA fail",
                f"update the NVIDIA driver to one for CUDA {torch_cuda} or newer",
                details,
            )
        ]
    return [
        Finding(
            "cuda.driver", "ok", f"{shown}; torch {tv} is built for CUDA {torch_cuda}", "", details
        )
    ]


def _arch_supported(cc: tuple[int, int], arch_list: Sequence[str]) -> bool:
    """Whether a build with ``arch_list`` (``sm_80``, ``compute_90``) has code for ``cc``:
    a cubin of the same major version and a minor at most ``cc``'s, or PTX at most ``cc``."""
    for arch in arch_list:
        m = re.match(r"^(sm|compute)_(\d+?)(\d)[a-z]?$", arch)
        if not m:
            continue
        kind, major, minor = m.group(1), int(m.group(2)), int(m.group(3))
        if kind == "sm" and major == cc[0] and minor <= cc[1]:
            return True
        if kind == "compute" and (major, minor) <= cc:
            return True
    return False


def check_torch_cuda(torch_cuda: str | None, devices: Sequence[Device]) -> list[Finding]:
    """``torch.cuda``: whether torch's CUDA build can use the GPUs found, and has kernels for
    their compute capability."""
    if torch_cuda is None or not devices:
        return []
    tv = torch.__version__
    if not torch.cuda.is_available():
        return [
            Finding(
                "torch.cuda",
                "error",
                f"torch {tv} (CUDA {torch_cuda}) cannot use the {_gpu_word(len(devices))} "
                "NVML lists: torch.cuda.is_available() is False",
                "see the cuda.driver finding (the driver must support torch's CUDA); check "
                "CUDA_VISIBLE_DEVICES and that this process may open /dev/nvidia*",
                {"torch": tv, "torch_cuda": torch_cuda},
            )
        ]
    arch_list = list(torch.cuda.get_arch_list())
    out: list[Finding] = []
    for d in devices:
        cc = d.capability
        if cc is NA or not arch_list:
            continue
        if not _arch_supported((cc.major, cc.minor), arch_list):
            out.append(
                Finding(
                    "torch.cuda",
                    "error",
                    f"{d.id} {d.name} is sm_{cc.major}{cc.minor}, but torch {tv} has kernels "
                    f"only for {', '.join(arch_list)}",
                    f"install a torch build that supports sm_{cc.major}{cc.minor} (a newer "
                    "CUDA version's wheel)",
                    {"device": d.id, "compute_capability": str(cc), "arch_list": arch_list},
                )
            )
    if not out:
        out.append(
            Finding(
                "torch.cuda",
                "ok",
                f"torch {tv} (CUDA {torch_cuda}) sees {torch.cuda.device_count()} device(s) "
                "and has kernels for each",
                "",
                {"arch_list": arch_list},
            )
        )
    return out


# -- each GPU --------------------------------------------------------------------------


def check_processes(device: Device) -> list[Finding]:
    """``gpu.processes``: other processes on the GPU and the memory they hold."""
    procs = device.processes()
    mem = device.memory()
    others = [p for p in procs if p.pid != os.getpid()]
    details: dict[str, Any] = {
        "device": device.id,
        "total": mem.total,
        "used": mem.used,
        "processes": [p.to_dict() for p in others],
    }
    if not others:
        hidden = 0
        if mem.used is not NA and mem.total is not NA:
            hidden = mem.used - (mem.process_used if mem.process_used is not NA else 0)
        if mem.total is not NA and hidden > max(GiB, OTHERS_SHARE * mem.total):
            return [
                Finding(
                    "gpu.processes",
                    "info",
                    f"{device.id}: no process listed, but {format_bytes(hidden)} of "
                    f"{format_bytes(mem.total)} is in use (processes in another container or "
                    "PID namespace are not listed)",
                    "check nvidia-smi on the host; pick another GPU if that memory is needed",
                    details,
                )
            ]
        return [Finding("gpu.processes", "ok", f"{device.id}: no other process", "", details)]
    known = [p.used for p in others if p.used is not NA]
    held = sum(known)
    unknown = len(known) < len(others)
    share = held / mem.total if mem.total is not NA and mem.total else 0.0
    who = ", ".join(
        f"pid {p.pid}"
        + (f" {p.name}" if p.name is not NA else "")
        + (f" ({format_bytes(p.used)})" if p.used is not NA else "")
        for p in others[:5]
    )
    more = f" and {len(others) - 5} more" if len(others) > 5 else ""
    held_text = format_bytes(held) + (" or more" if unknown else "")
    of_total = f" ({share:.0%} of {format_bytes(mem.total)})" if mem.total is not NA else ""
    level: Level = "warning" if unknown or share >= OTHERS_SHARE else "info"
    return [
        Finding(
            "gpu.processes",
            level,
            f"{device.id}: {len(others)} other process(es) hold {held_text}{of_total}: {who}{more}",
            "end them or choose another GPU (vramctl devices --select SIZE, or "
            "CUDA_VISIBLE_DEVICES); vramctl's estimates and fits count only the free memory",
            details,
        )
    ]


def check_mig(settings: GpuSettings) -> list[Finding]:
    """``gpu.mig``: MIG mode, its instances, and a change waiting for a reset."""
    s = settings
    details = {
        "device": s.device,
        "gpu": s.nvml_index,
        "mig_mode": s.mig_mode,
        "mig_pending": s.mig_pending,
        "mig_instances": s.mig_instances,
    }
    out: list[Finding] = []
    if s.mig_mode is not NA and s.mig_pending is not NA and s.mig_mode != s.mig_pending:
        after = "on" if s.mig_pending else "off"
        out.append(
            Finding(
                "gpu.mig",
                "warning",
                f"GPU {s.nvml_index} ({s.name}): MIG turns {after} at the next GPU reset",
                f"reset it with no process on it (sudo {_smi(s)} -r) or reboot",
                details,
            )
        )
    if s.mig_mode is NA:
        out.append(
            Finding("gpu.mig", "ok", f"GPU {s.nvml_index}: no MIG (not supported)", "", details)
        )
    elif s.mig_mode and not s.mig_instance and not s.mig_instances:
        out.append(
            Finding(
                "gpu.mig",
                "error",
                f"GPU {s.nvml_index} ({s.name}): MIG is on but has no instances, so CUDA "
                "sees no device on it",
                f"create instances (sudo nvidia-smi mig -i {s.nvml_index} -cgi PROFILES -C) "
                f"or turn MIG off (sudo {_smi(s)} -mig 0)",
                details,
            )
        )
    elif s.mig_mode:
        out.append(
            Finding(
                "gpu.mig",
                "info",
                f"GPU {s.nvml_index} ({s.name}): MIG is on with {s.mig_instances} "
                f"instance(s); a process sees only its instance's memory ({s.device} is one)",
                f"to give one job the whole GPU turn MIG off (sudo {_smi(s)} -mig 0, with no "
                "process on it)",
                details,
            )
        )
    else:
        out.append(Finding("gpu.mig", "ok", f"GPU {s.nvml_index}: MIG is off", "", details))
    return out


def check_persistence(settings: GpuSettings) -> list[Finding]:
    """``gpu.persistence``: persistence mode (off: each CUDA start pays driver set-up)."""
    s = settings
    details = {"device": s.device, "gpu": s.nvml_index, "persistence_mode": s.persistence_mode}
    if s.persistence_mode is NA:
        return [
            Finding(
                "gpu.persistence",
                "ok",
                f"GPU {s.nvml_index}: persistence mode not reported (not supported here)",
                "",
                details,
            )
        ]
    if s.persistence_mode:
        return [
            Finding(
                "gpu.persistence", "ok", f"GPU {s.nvml_index}: persistence mode is on", "", details
            )
        ]
    return [
        Finding(
            "gpu.persistence",
            "info",
            f"GPU {s.nvml_index} ({s.name}): persistence mode is off: when no process holds "
            "the GPU the driver tears it down, and the next CUDA start sets it up again "
            "(up to seconds)",
            f"sudo {_smi(s)} -pm 1, or run nvidia-persistenced (doctor changes nothing itself)",
            details,
        )
    ]


def check_ecc(settings: GpuSettings) -> list[Finding]:
    """``gpu.ecc``: ECC mode, uncorrected ECC errors and row remapping."""
    s = settings
    details = {
        "device": s.device,
        "gpu": s.nvml_index,
        "ecc_mode": s.ecc_mode,
        "ecc_pending": s.ecc_pending,
        "uncorrected_volatile": s.ecc_uncorrected_volatile,
        "uncorrected_aggregate": s.ecc_uncorrected_aggregate,
        "corrected_volatile": s.ecc_corrected_volatile,
        "remap_pending": s.remap_pending,
        "remap_failed": s.remap_failed,
    }
    gpu = f"GPU {s.nvml_index} ({s.name})"
    reset = f"sudo {_smi(s)} -r"
    out: list[Finding] = []
    volatile, aggregate = s.ecc_uncorrected_volatile, s.ecc_uncorrected_aggregate
    if volatile is not NA and volatile > 0:
        out.append(
            Finding(
                "gpu.ecc",
                "error",
                f"{gpu}: {volatile} uncorrected ECC error(s) since the driver loaded: "
                "results computed on it may be wrong",
                f"stop work on it, read {_smi(s)} -q -d ECC,ROW_REMAPPER, then reset it "
                f"({reset}) or reboot; if errors come back, have it serviced",
                details,
            )
        )
    elif aggregate is not NA and aggregate > 0:
        out.append(
            Finding(
                "gpu.ecc",
                "warning",
                f"{gpu}: {aggregate} uncorrected ECC error(s) over its life (none since the "
                "driver loaded)",
                f"watch the count ({_smi(s)} -q -d ECC); have the GPU serviced if it grows",
                details,
            )
        )
    if s.remap_failed is True:
        out.append(
            Finding(
                "gpu.ecc",
                "error",
                f"{gpu}: a memory row remap failed",
                "have the GPU serviced (its memory has more bad rows than spares)",
                details,
            )
        )
    elif s.remap_pending is True:
        out.append(
            Finding(
                "gpu.ecc",
                "warning",
                f"{gpu}: a memory row remap waits for a GPU reset",
                f"reset it when idle ({reset}) or reboot",
                details,
            )
        )
    if s.ecc_mode is False:
        out.append(
            Finding(
                "gpu.ecc",
                "info",
                f"{gpu}: ECC is off: memory errors go undetected",
                f"turn it on (sudo {_smi(s)} -e 1) and reboot",
                details,
            )
        )
    elif s.ecc_mode is True and s.ecc_pending is False:
        out.append(
            Finding(
                "gpu.ecc",
                "info",
                f"{gpu}: ECC turns off at the next reboot",
                f"keep it on: sudo {_smi(s)} -e 1",
                details,
            )
        )
    if not out:
        text = "no ECC (not supported)" if s.ecc_mode is NA else "ECC on, no uncorrected errors"
        out.append(Finding("gpu.ecc", "ok", f"GPU {s.nvml_index}: {text}", "", details))
    return out


def check_utilization(settings: GpuSettings) -> list[Finding]:
    """``gpu.utilization``: how busy the GPU is with other work now, and its compute mode."""
    s = settings
    util, mode = s.gpu_utilization, s.compute_mode
    details = {
        "device": s.device,
        "gpu": s.nvml_index,
        "gpu_utilization": util,
        "compute_mode": mode,
    }
    gpu = f"GPU {s.nvml_index} ({s.name})"
    out: list[Finding] = []
    if mode == "prohibited":
        out.append(
            Finding(
                "gpu.utilization",
                "error",
                f"{gpu}: compute mode is Prohibited: no CUDA process can use it",
                f"sudo {_smi(s)} -c DEFAULT",
                details,
            )
        )
    elif mode in ("exclusive_process", "exclusive_thread"):
        out.append(
            Finding(
                "gpu.utilization",
                "info",
                f"{gpu}: compute mode is exclusive: one process at a time can use it",
                f"to share it: sudo {_smi(s)} -c DEFAULT",
                details,
            )
        )
    if util is not NA and util >= BUSY_UTILIZATION:
        out.append(
            Finding(
                "gpu.utilization",
                "warning",
                f"{gpu}: {util:.0f}% busy with other work: a step shares its compute and runs "
                "slower",
                "choose an idle GPU (vramctl devices --select SIZE --policy least-loaded)",
                details,
            )
        )
    if not out:
        shown = "utilization not reported" if util is NA else f"{util:.0f}% busy"
        out.append(Finding("gpu.utilization", "ok", f"GPU {s.nvml_index}: {shown}", "", details))
    return out
