"""``doctor``: check the environment a PyTorch job runs in, and say what to change.

Each check is a small function that returns its findings; :func:`doctor` runs them
all. A check that raises becomes a finding of its own (it could not run) and the
others still run. Doctor only reads: it never changes a setting, and it does not
initialise CUDA (the driver is read through NVML, the GPUs through the device layer).

>>> from vramctl.optimize import doctor
>>> report = doctor()
>>> report.worst in ("ok", "info", "warning", "error")
True
>>> any(f.check == "host.shm" for f in report.findings)
True
"""

from __future__ import annotations

import datetime as _dt
import difflib
import importlib.metadata
import json
import os
import platform
import re
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import psutil
import torch

from vramctl._na import NA
from vramctl._units import format_bytes
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

__all__ = ["DoctorReport", "Finding", "doctor"]

Level = Literal["ok", "info", "warning", "error"]
#: The levels, from the best to the worst.
LEVELS: tuple[Level, ...] = ("ok", "info", "warning", "error")

GiB = 2**30
#: Below this, /dev/shm is too small for DataLoader workers to pass batches through.
SHM_NEED = 1 * GiB
#: Other processes holding this fraction of a GPU's memory make a warning.
OTHERS_SHARE = 0.05
#: GPU (SM) utilization, percent, at which other work makes a step slower.
BUSY_UTILIZATION = 50.0

_DEFAULT_ALLOC_CONF = "expandable_segments:True"
_NO_GPU = "not applicable: no CUDA device"


@dataclass(frozen=True)
class Finding:
    """One thing doctor found: which check, how bad, what it saw, and what to change.

    ``level`` is "ok", "info" (worth knowing), "warning" (likely to cost memory, speed
    or a crash) or "error" (work on the GPU fails or is wrong until it is fixed).
    ``action`` is empty for "ok".
    """

    check: str
    level: Level
    message: str
    action: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"level {self.level!r}: use one of {', '.join(LEVELS)}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "check": self.check,
            "level": self.level,
            "message": self.message,
            "action": self.action,
            "details": _plain(self.details),
        }


def _plain(value: Any) -> Any:
    """``value`` as JSON: ``NA`` is null, tuples are lists, other objects their text."""
    if value is NA or value is None:
        return None
    if isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set):
        return [_plain(v) for v in value]
    return str(value)


@dataclass(frozen=True)
class DoctorReport:
    """Every finding of one :func:`doctor` run, with the versions it ran under."""

    findings: tuple[Finding, ...]
    #: When it ran (seconds since the epoch).
    created: float = field(default_factory=time.time)
    #: vramctl, torch, Python and the platform.
    versions: dict[str, str] = field(default_factory=dict)

    @property
    def worst(self) -> Level:
        """The worst level among the findings ("ok" when there are none)."""
        return max((f.level for f in self.findings), key=LEVELS.index, default="ok")

    def counts(self) -> dict[str, int]:
        """How many findings of each level."""
        return {level: sum(f.level == level for f in self.findings) for level in LEVELS}

    def by_level(self) -> list[tuple[Level, list[Finding]]]:
        """The findings grouped by level, the worst first (levels with none left out)."""
        out: list[tuple[Level, list[Finding]]] = []
        for level in reversed(LEVELS):
            found = [f for f in self.findings if f.level == level]
            if found:
                out.append((level, found))
        return out

    def summary(self) -> str:
        """``"1 error, 2 warnings, 3 info, 10 ok"``."""
        c = self.counts()
        return (
            f"{c['error']} error{'s' * (c['error'] != 1)}, "
            f"{c['warning']} warning{'s' * (c['warning'] != 1)}, "
            f"{c['info']} info, {c['ok']} ok"
        )

    def to_dict(self) -> dict[str, Any]:
        """One JSON object: the worst level, the counts, the versions and every finding."""
        return {
            "schema": "vramctl.doctor/1",
            "created": _iso(self.created),
            "worst": self.worst,
            "counts": self.counts(),
            "versions": dict(self.versions),
            "findings": [f.to_dict() for f in self.findings],
        }

    def __str__(self) -> str:
        lines = [f"vramctl doctor: {self.summary()}"]
        for level, found in self.by_level():
            for f in found:
                lines.append(f"{level:<8} {f.check:<18} {f.message}")
                if f.action:
                    lines.append(f"{'':<27} -> {f.action}")
        return "\n".join(lines)

    def to_markdown(self) -> str:
        """The report for a person: the summary, then each level's findings and actions."""
        versions = ", ".join(f"{k} {v}" for k, v in self.versions.items())
        out = [
            "# vramctl doctor report",
            "",
            f"Created {_iso(self.created)}; {versions}.",
            "",
            f"**{self.summary()}** (worst: {self.worst})",
        ]
        titles = {"error": "Errors", "warning": "Warnings", "info": "Info", "ok": "OK"}
        for level, found in self.by_level():
            out += ["", f"## {titles[level]}", ""]
            for f in found:
                out.append(f"- **`{f.check}`**: {f.message}")
                if f.action:
                    out.append(f"  - Action: {f.action}")
                for key, value in f.details.items():
                    shown = _plain(value)
                    text = shown if isinstance(shown, str) else json.dumps(shown)
                    out.append(f"  - {key}: `{text}`")
        return "\n".join(out) + "\n"


def _iso(t: float) -> str:
    return _dt.datetime.fromtimestamp(t, _dt.timezone.utc).isoformat(timespec="seconds")


# -- what the checks share ------------------------------------------------------------


def _version(dist: str) -> str | None:
    """An installed distribution's version, without importing it."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _major_minor(text: str) -> tuple[int, int] | None:
    m = re.match(r"^\s*(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _wheel_tag(version: tuple[int, int]) -> str:
    return f"cu{version[0]}{version[1]}"


def _gpu_word(n: int) -> str:
    return f"{n} GPU{'s' * (n != 1)}"


def _smi(settings: GpuSettings) -> str:
    return f"nvidia-smi -i {settings.nvml_index}"


@dataclass
class _Machine:
    """What several checks read, read once."""

    driver: DriverInfo
    devices: list[Device]
    settings: dict[str, GpuSettings | None]
    env: Mapping[str, str]


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
    binding = _version("nvidia-ml-py")
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
    build = _major_minor(torch_cuda)
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


# -- torch's settings -------------------------------------------------------------------

#: The caching allocator's keys, each with its value's rule.
_BOOL = "True or False"
_ALLOC_KEYS: dict[str, str] = {
    "backend": "native or cudaMallocAsync",
    "expandable_segments": _BOOL,
    "max_split_size_mb": "a whole number of MiB, at least 20",
    "max_non_split_rounding_mb": "a whole number of MiB, at least 20",
    "large_segment_size_mb": "a positive whole number of MiB",
    "garbage_collection_threshold": "a fraction between 0 and 1 (exclusive)",
    "roundup_power2_divisions": "a power of 2, or a list like [256:1,512:2,>:4]",
    "release_lock_on_cudamalloc": _BOOL,
    "pinned_use_cuda_host_register": _BOOL,
    "pinned_num_register_threads": "a power of 2, at most 128",
    "pinned_use_background_threads": _BOOL,
    "pinned_reserve_segment_size_mb": "a positive whole number of MiB",
    "pinned_max_round_threshold_mb": "a positive whole number of MiB",
    "pinned_max_cached_size_mb": "a positive whole number of MiB",
    "graph_capture_record_stream_reuse": _BOOL,
    "per_process_memory_fraction": "a fraction above 0, at most 1",
    "pinned_free_catch_all": _BOOL,
    "throw_on_cudamalloc_oom": _BOOL,
    "release_lock_on_hipmalloc": _BOOL,
    "pinned_use_hip_host_register": _BOOL,
}
#: Keys that the cudaMallocAsync backend ignores.
_NATIVE_ONLY = ("max_split_size_mb", "roundup_power2_divisions", "garbage_collection_threshold")


def _power_of_two(text: str, *, zero: bool = False) -> bool:
    if not text.isdigit():
        return False
    n = int(text)
    return (n == 0 and zero) or (n > 0 and n & (n - 1) == 0)


def _valid_value(key: str, value: str) -> bool:
    rule = _ALLOC_KEYS[key]
    if rule == _BOOL:
        return value in ("True", "False")
    if key == "backend":
        return value in ("native", "cudaMallocAsync", "hipMallocAsync")
    if key in ("max_split_size_mb", "max_non_split_rounding_mb"):
        return value.isdigit() and int(value) >= 20
    if key.endswith("_mb"):
        return value.isdigit() and int(value) > 0
    if key in ("garbage_collection_threshold", "per_process_memory_fraction"):
        try:
            x = float(value)
        except ValueError:
            return False
        return 0 < x < 1 if key == "garbage_collection_threshold" else 0 < x <= 1
    if key == "pinned_num_register_threads":
        return _power_of_two(value) and int(value) <= 128
    if key == "roundup_power2_divisions":
        if value.startswith("["):
            if not value.endswith("]"):
                return False
            for item in value[1:-1].split(","):
                size, sep, divisions = item.strip().partition(":")
                if not sep or not _power_of_two(divisions.strip(), zero=True):
                    return False
                if size.strip() != ">" and not _power_of_two(size.strip()):
                    return False
            return True
        return _power_of_two(value)
    return True


def _split_items(text: str) -> list[str]:
    """``text`` split at the commas outside brackets."""
    items, depth, buf = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            items.append(buf)
            buf = ""
        else:
            buf += ch
    items.append(buf)
    return [i.replace(" ", "") for i in items if i.strip()]


def parse_alloc_conf(text: str) -> tuple[dict[str, str], list[tuple[Level, str]]]:
    """The allocator's settings in ``text`` (``key:value,...``) and what is wrong with them.

    A problem is ("error", why) where PyTorch refuses the setting at its first CUDA
    allocation, or ("warning", why) for a key this list does not know (a newer PyTorch
    may), and for options the cudaMallocAsync backend ignores.

    >>> parse_alloc_conf("expandable_segments:True,max_split_size_mb:128")
    ({'expandable_segments': 'True', 'max_split_size_mb': '128'}, [])
    >>> parse_alloc_conf("expandable_segment:true")[1]
    [('error', "unknown key 'expandable_segment' (did you mean 'expandable_segments'?)")]
    """
    settings: dict[str, str] = {}
    problems: list[tuple[Level, str]] = []
    for item in _split_items(text):
        key, sep, value = item.partition(":")
        if not sep or not key or not value:
            problems.append(("error", f"{item!r} is not key:value"))
            continue
        if key not in _ALLOC_KEYS:
            close = difflib.get_close_matches(key, list(_ALLOC_KEYS), n=1, cutoff=0.8)
            if close:
                problems.append(("error", f"unknown key {key!r} (did you mean {close[0]!r}?)"))
            else:
                problems.append(
                    (
                        "warning",
                        f"unknown key {key!r}: PyTorch {torch.__version__} may refuse it "
                        "('Unrecognized key')",
                    )
                )
            continue
        if not _valid_value(key, value):
            problems.append(("error", f"{key}:{value}: {key} takes {_ALLOC_KEYS[key]}"))
            continue
        settings[key] = value
    if settings.get("backend", "native").endswith("MallocAsync"):
        ignored = [k for k in (*_NATIVE_ONLY, "expandable_segments") if k in settings]
        if ignored:
            problems.append(
                ("warning", f"backend:{settings['backend']} ignores {', '.join(ignored)}")
            )
    return settings, problems


def check_alloc_conf(env: Mapping[str, str], *, gpu: bool) -> list[Finding]:
    """``cuda.alloc_conf``: ``PYTORCH_CUDA_ALLOC_CONF`` (or ``PYTORCH_ALLOC_CONF``) parsed and
    checked."""
    cuda_conf, generic = env.get("PYTORCH_CUDA_ALLOC_CONF"), env.get("PYTORCH_ALLOC_CONF")
    name, text = (
        ("PYTORCH_ALLOC_CONF", generic)
        if cuda_conf is None and generic is not None
        else ("PYTORCH_CUDA_ALLOC_CONF", cuda_conf)
    )
    details: dict[str, Any] = {"variable": name, "value": text}
    out: list[Finding] = []
    if cuda_conf is not None and generic is not None and cuda_conf != generic:
        out.append(
            Finding(
                "cuda.alloc_conf",
                "warning",
                "PYTORCH_CUDA_ALLOC_CONF and PYTORCH_ALLOC_CONF are both set and differ; "
                "which one the CUDA allocator reads depends on the PyTorch version",
                "set one of them",
                {"PYTORCH_CUDA_ALLOC_CONF": cuda_conf, "PYTORCH_ALLOC_CONF": generic},
            )
        )
    if text is None or not text.strip():
        if gpu:
            out.append(
                Finding(
                    "cuda.alloc_conf",
                    "info",
                    "PYTORCH_CUDA_ALLOC_CONF is not set: the caching allocator keeps fixed "
                    "segments, and memory freed between steps of varying shapes fragments",
                    f"export PYTORCH_CUDA_ALLOC_CONF={_DEFAULT_ALLOC_CONF} (segments grow in "
                    "place: less reserved-but-unused memory, fewer OOMs)",
                    details,
                )
            )
        else:
            out.append(
                Finding(
                    "cuda.alloc_conf",
                    "ok",
                    "PYTORCH_CUDA_ALLOC_CONF is not set (it matters only on a GPU)",
                    "",
                    details,
                )
            )
        return out
    settings, problems = parse_alloc_conf(text)
    details["settings"] = settings
    details["problems"] = [why for _, why in problems]
    refused = [why for level, why in problems if level == "error"]
    doubtful = [why for level, why in problems if level == "warning"]
    if refused:
        out.append(
            Finding(
                "cuda.alloc_conf",
                "error" if gpu else "warning",
                f"{name}={text!r}: "
                + "; ".join(refused)
                + ("" if gpu else " (PyTorch would refuse it at the first CUDA allocation)"),
                f"fix or unset it, e.g. {name}={_DEFAULT_ALLOC_CONF}",
                details,
            )
        )
    if doubtful:
        out.append(
            Finding(
                "cuda.alloc_conf",
                "warning",
                f"{name}={text!r}: " + "; ".join(doubtful),
                "check the key against the PyTorch version's CUDA semantics notes, or remove it",
                details,
            )
        )
    if not problems:
        out.append(Finding("cuda.alloc_conf", "ok", f"{name}={text}", "", details))
    return out


def check_tf32(devices: Sequence[Device], env: Mapping[str, str]) -> list[Finding]:
    """``torch.tf32``: whether fp32 matmuls and convolutions may use TF32 on GPUs that have it
    (compute capability 8.0 and newer). Reads this process's settings."""
    capable = [d for d in devices if d.capability is not NA and d.capability.tf32]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # newer PyTorch deprecates the allow_tf32 flags
        matmul = bool(torch.backends.cuda.matmul.allow_tf32)
        cudnn = bool(torch.backends.cudnn.allow_tf32)
    precision = torch.get_float32_matmul_precision()
    override = env.get("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE") == "1"
    details: dict[str, Any] = {
        "matmul_allow_tf32": matmul,
        "cudnn_allow_tf32": cudnn,
        "float32_matmul_precision": precision,
        "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": env.get("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE"),
        "devices": [d.id for d in capable],
    }
    if not capable:
        text = _NO_GPU if not devices else "no GPU with TF32 (compute capability 8.0+)"
        return [Finding("torch.tf32", "ok", f"{text}", "", details)]
    names = ", ".join(d.id for d in capable)
    out: list[Finding] = []
    matmul_on = matmul or precision != "highest" or override
    if not matmul_on:
        out.append(
            Finding(
                "torch.tf32",
                "info",
                f"fp32 matmuls on {names} run in full fp32 (float32 matmul precision "
                "'highest'); TF32 tensor cores make them several times faster at a precision "
                "training usually tolerates",
                "torch.set_float32_matmul_precision('high') at the start of the script (this "
                "reads this process's defaults: a script's own setting is not seen here)",
                details,
            )
        )
    if not cudnn:
        out.append(
            Finding(
                "torch.tf32",
                "info",
                f"cuDNN convolutions on {names} do not use TF32",
                "torch.backends.cudnn.allow_tf32 = True (the default)",
                details,
            )
        )
    if not out:
        out.append(Finding("torch.tf32", "ok", f"TF32 is allowed on {names}", "", details))
    return out


def _cudnn_text(version: int) -> str:
    if version >= 10000:  # cuDNN 9: 90100 is 9.1.0
        return f"{version // 10000}.{version % 10000 // 100}.{version % 100}"
    return f"{version // 1000}.{version % 1000 // 100}.{version % 100}"  # 8902 is 8.9.2


def check_cudnn(torch_cuda: str | None, *, gpu: bool) -> list[Finding]:
    """``torch.cudnn``: cuDNN's presence and version, ``benchmark`` and ``deterministic``."""
    cudnn = torch.backends.cudnn
    available = bool(cudnn.is_available())
    raw = cudnn.version() if available else None
    details: dict[str, Any] = {
        "available": available,
        "version": None if raw is None else _cudnn_text(int(raw)),
        "benchmark": bool(cudnn.benchmark),
        "deterministic": bool(cudnn.deterministic),
        "deterministic_algorithms": bool(torch.are_deterministic_algorithms_enabled()),
    }
    if not available:
        if torch_cuda is None:
            return [Finding("torch.cudnn", "ok", "no cuDNN in a CPU-only torch build", "", details)]
        return [
            Finding(
                "torch.cudnn",
                "warning" if gpu else "info",
                f"cuDNN is not available to torch {torch.__version__}: convolutions and RNNs "
                "fall back to slow kernels",
                "reinstall torch from the official wheels (they bring cuDNN), or fix "
                "LD_LIBRARY_PATH if it points at another cuDNN",
                details,
            )
        ]
    out: list[Finding] = []
    if details["deterministic"] or details["deterministic_algorithms"]:
        out.append(
            Finding(
                "torch.cudnn",
                "info",
                "deterministic algorithms are on: some kernels are slower (and some raise)",
                "turn them off unless runs must be bit-exact: "
                "torch.backends.cudnn.deterministic = False, "
                "torch.use_deterministic_algorithms(False)",
                details,
            )
        )
    bench = "on" if details["benchmark"] else "off (for fixed input shapes, on is faster)"
    out.append(
        Finding(
            "torch.cudnn",
            "ok",
            f"cuDNN {details['version']}; cudnn.benchmark {bench}",
            "",
            details,
        )
    )
    return out


# -- the host ----------------------------------------------------------------------------


def check_shm(path: str | os.PathLike[str] = "/dev/shm", *, need: int = SHM_NEED) -> list[Finding]:
    """``host.shm``: the size of ``/dev/shm``, through which DataLoader workers pass batches."""
    place = Path(path)
    docker = (
        "docker run --shm-size=8g (or --ipc=host); Kubernetes: an emptyDir with "
        "medium: Memory mounted at /dev/shm"
    )
    if not place.is_dir():
        return [
            Finding(
                "host.shm",
                "warning",
                f"no {place}: DataLoader workers (num_workers > 0) cannot pass batches",
                f"mount a tmpfs at {place}; in a container: {docker}",
                {"path": str(place)},
            )
        ]
    st = os.statvfs(place)
    size, free = st.f_frsize * st.f_blocks, st.f_frsize * st.f_bavail
    details = {"path": str(place), "size": size, "free": free, "need": need}
    if size < need:
        return [
            Finding(
                "host.shm",
                "warning",
                f"{place} is {format_bytes(size)}: DataLoader workers pass batches through it "
                "and fail with a bus error or 'No space left on device' when it is full",
                f"{docker}; or use num_workers=0",
                details,
            )
        ]
    if free < need:
        return [
            Finding(
                "host.shm",
                "warning",
                f"{place} has {format_bytes(free)} free of {format_bytes(size)}",
                f"remove stale files from {place} (a crashed run's), or make it larger: {docker}",
                details,
            )
        ]
    return [
        Finding(
            "host.shm",
            "ok",
            f"{place}: {format_bytes(free)} free of {format_bytes(size)}",
            "",
            details,
        )
    ]


_UNLIMITED = 2**62  # cgroup v1 prints "no limit" as a huge number


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max" or not text.lstrip("-").isdigit():
        return None
    value = int(text)
    return None if value >= _UNLIMITED or value < 0 else value


def _cgroup_dirs(root: Path, self_cgroup: Path, controller: str) -> tuple[str, list[Path]]:
    """The cgroup version ("v2", "v1" or "") and this process's cgroup folders for
    ``controller``, from its own up to the root (the limit is the smallest on the way)."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, controllers, rel = [*line.split(":", 2), "", ""][:3]
        if controllers == "" and (root / "cgroup.controllers").exists():
            return "v2", _up(root, rel)
        if controller in controllers.split(","):
            base = root / controller
            if not base.is_dir():
                base = next((p for p in root.glob(f"*{controller}*") if p.is_dir()), base)
            return "v1", _up(base, rel)
    if (root / "cgroup.controllers").exists():
        return "v2", [root]
    return "", []


def _up(base: Path, rel: str) -> list[Path]:
    parts = [p for p in rel.strip().split("/") if p]
    dirs = [base.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]
    found = [d for d in dirs if d.is_dir()]
    return found or [base]


def read_cgroup_memory(
    root: str | os.PathLike[str] = "/sys/fs/cgroup",
    self_cgroup: str | os.PathLike[str] = "/proc/self/cgroup",
) -> dict[str, Any]:
    """This process's cgroup memory limit and use: ``{"version", "limit", "usage"}`` (bytes,
    None where there is none or it cannot be read)."""
    version, dirs = _cgroup_dirs(Path(root), Path(self_cgroup), "memory")
    limit_file, usage_file = (
        ("memory.max", "memory.current")
        if version == "v2"
        else ("memory.limit_in_bytes", "memory.usage_in_bytes")
    )
    limits = [v for d in dirs if (v := _read_int(d / limit_file)) is not None]
    usage = next((v for d in dirs if (v := _read_int(d / usage_file)) is not None), None)
    return {"version": version, "limit": min(limits) if limits else None, "usage": usage}


def check_cgroup(
    root: str | os.PathLike[str] = "/sys/fs/cgroup",
    self_cgroup: str | os.PathLike[str] = "/proc/self/cgroup",
    *,
    host_total: int | None = None,
) -> list[Finding]:
    """``host.cgroup``: the cgroup (container) memory limit against the host's memory."""
    total = psutil.virtual_memory().total if host_total is None else host_total
    reading = read_cgroup_memory(root, self_cgroup)
    limit, usage = reading["limit"], reading["usage"]
    details = {**reading, "host_total": total}
    if not reading["version"]:
        return [Finding("host.cgroup", "ok", "no cgroup memory controller found", "", details)]
    if limit is None or limit >= total:
        return [
            Finding(
                "host.cgroup",
                "ok",
                f"no cgroup memory limit below the host's {format_bytes(total)}",
                "",
                details,
            )
        ]
    raise_it = (
        "raise the limit if DataLoader workers, pinned memory or loading a checkpoint on the "
        "CPU get killed (exit status 137): docker run --memory, Kubernetes "
        "resources.limits.memory"
    )
    if usage is not None and usage >= 0.9 * limit:
        return [
            Finding(
                "host.cgroup",
                "warning",
                f"this cgroup uses {format_bytes(usage)} of its {format_bytes(limit)} limit "
                f"({usage / limit:.0%}); the host has {format_bytes(total)}",
                raise_it,
                details,
            )
        ]
    return [
        Finding(
            "host.cgroup",
            "info",
            f"this process's cgroup may use {format_bytes(limit)} of the host's "
            f"{format_bytes(total)}",
            raise_it,
            details,
        )
    ]


def read_meminfo(path: str | os.PathLike[str] = "/proc/meminfo") -> dict[str, int]:
    """``/proc/meminfo`` in bytes (``{"MemTotal": ..., "SwapTotal": ...}``)."""
    out: dict[str, int] = {}
    for line in Path(path).read_text().splitlines():
        key, _, rest = line.partition(":")
        fields_ = rest.split()
        if fields_ and fields_[0].isdigit():
            unit = 1024 if len(fields_) > 1 and fields_[1].lower() == "kb" else 1
            out[key.strip()] = int(fields_[0]) * unit
    return out


def check_swap(path: str | os.PathLike[str] = "/proc/meminfo") -> list[Finding]:
    """``host.swap``: swap size and use (a swapping host slows DataLoader workers, pinned
    memory and CPU offload)."""
    if not Path(path).exists():
        return [
            Finding(
                "host.swap", "ok", f"swap not read ({path} does not exist)", "", {"path": str(path)}
            )
        ]
    info = read_meminfo(path)
    total, free = info.get("SwapTotal", 0), info.get("SwapFree", 0)
    used = max(0, total - free - info.get("SwapCached", 0))
    details = {
        "swap_total": total,
        "swap_used": used,
        "mem_total": info.get("MemTotal"),
        "mem_available": info.get("MemAvailable"),
    }
    if total == 0:
        return [
            Finding(
                "host.swap",
                "ok",
                "no swap: when host memory runs out, the kernel's OOM killer ends a process",
                "",
                details,
            )
        ]
    if used >= GiB and used >= 0.5 * total:
        return [
            Finding(
                "host.swap",
                "warning",
                f"the host is swapping: {format_bytes(used)} of {format_bytes(total)} swap "
                "in use; DataLoader workers, pinned memory and CPU offload slow down",
                "free host memory: fewer DataLoader workers or a smaller prefetch_factor, less "
                "CPU offload; or add RAM",
                details,
            )
        ]
    return [
        Finding(
            "host.swap",
            "ok",
            f"swap: {format_bytes(used)} of {format_bytes(total)} in use",
            "",
            details,
        )
    ]


def read_cpu_quota(
    root: str | os.PathLike[str] = "/sys/fs/cgroup",
    self_cgroup: str | os.PathLike[str] = "/proc/self/cgroup",
) -> float | None:
    """The cgroup's CPU quota in CPUs (``cpu.max`` "200000 100000" is 2.0); None without one."""
    version, dirs = _cgroup_dirs(Path(root), Path(self_cgroup), "cpu")
    quotas: list[float] = []
    for d in dirs:
        try:
            if version == "v2":
                quota, period = [*(d / "cpu.max").read_text().split(), ""][:2]
            else:
                quota = (d / "cpu.cfs_quota_us").read_text().strip()
                period = (d / "cpu.cfs_period_us").read_text().strip()
        except (OSError, ValueError):
            continue
        if quota.isdigit() and period.isdigit() and int(period) > 0:
            quotas.append(int(quota) / int(period))
    return min(quotas) if quotas else None


def check_threads(
    threads: int | None = None, cpus: int | None = None, quota: float | None = None
) -> list[Finding]:
    """``host.threads``: torch's CPU threads against the CPUs this process may run on (its
    affinity) and its cgroup's CPU quota."""
    n = torch.get_num_threads() if threads is None else threads
    if cpus is None:
        try:
            cpus = len(os.sched_getaffinity(0))
        except AttributeError:  # not on Linux
            cpus = os.cpu_count() or 1
    details = {"torch_threads": n, "cpus": cpus, "cpu_quota": quota}
    room = cpus if quota is None else min(cpus, max(1, int(quota)))
    if n > room:
        why = f"a CPU quota of {quota:g}" if quota is not None and quota < cpus else f"{cpus} CPUs"
        return [
            Finding(
                "host.threads",
                "warning",
                f"torch uses {n} CPU threads, but this process has {why}: the threads contend "
                "and CPU work slows down",
                f"torch.set_num_threads({room}) or OMP_NUM_THREADS={room}",
                details,
            )
        ]
    limit = f" (quota {quota:g})" if quota is not None else ""
    return [
        Finding("host.threads", "ok", f"torch uses {n} threads on {cpus} CPUs{limit}", "", details)
    ]


# -- Python packages ------------------------------------------------------------------------

_PACKAGES = (
    "torch",
    "transformers",
    "accelerate",
    "lightning",
    "pytorch-lightning",
    "nvidia-ml-py",
)


def check_packages(versions: Mapping[str, str | None] | None = None) -> list[Finding]:
    """``python.packages``: the versions of torch, transformers, accelerate, lightning and
    nvidia-ml-py (read from their metadata: nothing is imported), and the old ``pynvml``
    package, whose module would shadow nvidia-ml-py's."""
    found = {d: _version(d) for d in (*_PACKAGES, "pynvml")} if versions is None else dict(versions)
    out: list[Finding] = []
    old = found.get("pynvml")
    major = _major_minor(old or "")
    if old is not None and major is not None and major[0] < 12:
        out.append(
            Finding(
                "python.packages",
                "warning",
                f"the pynvml package {old} is installed: its own pynvml module may shadow "
                "nvidia-ml-py's, with older NVML calls",
                "pip uninstall pynvml (nvidia-ml-py provides the module)",
                {"pynvml": old, "nvidia-ml-py": found.get("nvidia-ml-py")},
            )
        )
    shown = ", ".join(f"{d} {v}" for d in _PACKAGES if (v := found.get(d)) is not None)
    absent = [d for d in _PACKAGES if found.get(d) is None]
    text = shown + (f"; not installed: {', '.join(absent)}" if absent else "")
    out.append(Finding("python.packages", "ok", text, "", {d: found.get(d) for d in found}))
    return out


# -- the run --------------------------------------------------------------------------------


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
    findings += _run("host.threads", lambda: check_threads(quota=read_cpu_quota()))
    findings += _run("python.packages", check_packages)
    return DoctorReport(tuple(findings), versions=_versions())
