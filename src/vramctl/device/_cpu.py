"""The CPU as a device: host memory, read through psutil (and the cgroup limit)."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from vramctl._na import NA
from vramctl.device._base import Device
from vramctl.device._health import DeviceHealth, ReadingFailed
from vramctl.device._host import cgroup_memory
from vramctl.device._memory import MemoryState, ProcessMemory

if TYPE_CHECKING:
    import torch

__all__ = ["CpuDevice"]


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


class CpuDevice(Device):
    """Host memory as a device; a cgroup limit lower than the RAM is the total (the smallest
    limit from this process's cgroup up, v1 or v2: :func:`cgroup_memory`)."""

    kind = "cpu"
    id = "cpu"
    index = None

    def __init__(self) -> None:
        self.name = f"{_cpu_name()} ({os.cpu_count()} cores)"
        self.health = DeviceHealth(self.id)

    @property
    def torch_device(self) -> torch.device:
        import torch

        return torch.device("cpu")

    def capacity(self) -> int:
        return int(psutil.virtual_memory().total)

    def available(self) -> int:
        return int(psutil.virtual_memory().available)

    def _peak_begin(self) -> Any:
        from vramctl.device._meter import HostCount

        vm = psutil.virtual_memory()
        counter = HostCount()
        counter.__enter__()  # type: ignore[no-untyped-call]
        return int(vm.total - vm.available), counter

    def _peak_end(self, token: Any) -> tuple[int, int, int]:
        base, counter = token
        counter.__exit__(None, None, None)
        return base + counter.peak, counter.peak, counter.live

    def put(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.torch_device)

    def _read(self) -> MemoryState:
        vm = psutil.virtual_memory()
        total, free = int(vm.total), int(vm.available)
        cgroup = cgroup_memory()
        if cgroup.limit is not None and cgroup.limit < total:
            total = cgroup.limit
            if cgroup.headroom is not None:
                free = min(free, cgroup.headroom)
            free = min(free, total)
        return MemoryState(
            device=self.id,
            total=total,
            used=total - free,
            free=free,
            process_used=int(psutil.Process().memory_info().rss),
        )

    def memory(self) -> MemoryState:
        try:
            return self.health.call(self._read)
        except ReadingFailed:
            return MemoryState(device=self.id)

    def processes(self, limit: int | None = None) -> list[ProcessMemory]:
        rows = []
        for p in psutil.process_iter(["pid", "name", "username", "memory_info", "cmdline"]):
            info = p.info
            mem = info.get("memory_info")
            if mem is None:
                continue
            cmd = info.get("cmdline")
            rows.append(
                ProcessMemory(
                    pid=int(info["pid"]),
                    used=int(mem.rss),
                    name=info.get("name") or NA,
                    user=info.get("username") or NA,
                    command=" ".join(cmd) if cmd else NA,
                    kind="host",
                )
            )
        rows.sort(key=lambda r: r.used if r.used is not NA else -1, reverse=True)
        return rows[:limit] if limit is not None else rows
