"""The doctor's host checks: ``/dev/shm``, the cgroup memory limit, swap and torch's CPU
threads against the CPUs and the CPU quota (the cgroup's limits are read by the device
layer: :func:`vramctl.device.cgroup_memory`, :func:`vramctl.device.cpu_quota`)."""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import torch

from vramctl._units import format_bytes
from vramctl.device._shared import affinity_cpus, cgroup_memory
from vramctl.doctor._report import Finding

__all__ = [
    "SHM_NEED",
    "check_cgroup",
    "check_shm",
    "check_swap",
    "check_threads",
    "read_meminfo",
]

GiB = 2**30
#: Below this, /dev/shm is too small for DataLoader workers to pass batches through.
SHM_NEED = 1 * GiB


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


def check_cgroup(
    root: str | os.PathLike[str] | None = None,
    self_cgroup: str | os.PathLike[str] | None = None,
    *,
    host_total: int | None = None,
) -> list[Finding]:
    """``host.cgroup``: the cgroup (container) memory limit against the host's memory
    (``root``, ``self_cgroup``: the cgroup mount and ``/proc/self/cgroup``, for a test)."""
    total = psutil.virtual_memory().total if host_total is None else host_total
    reading = cgroup_memory(root, self_cgroup)
    limit, usage = reading.limit, reading.usage
    details = {**reading.to_dict(), "host_total": total}
    if not reading.version:
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


def check_threads(
    threads: int | None = None, cpus: int | None = None, quota: float | None = None
) -> list[Finding]:
    """``host.threads``: torch's CPU threads against the CPUs this process may run on (its
    affinity) and its cgroup's CPU quota."""
    n = torch.get_num_threads() if threads is None else threads
    if cpus is None:
        cpus = affinity_cpus()
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
