"""A region's peak device memory, and what is free now, on any kind of device.

Peaks are given as device-level *used* bytes, the quantity a target
utilization is measured against (``used <= target * total``):

- CUDA: what other processes and the CUDA context hold, plus this process's
  peak reserved bytes (the caching allocator's ``max_memory_reserved``);
- a simulated GPU: its reserve plus its peak of live storages;
- the CPU: the host's used memory before the region plus the peak of the
  storages made inside it (counted the way a simulated device counts them).

>>> import torch, vramctl
>>> from vramctl.guard import PeakMeter
>>> with vramctl.simulate("1GiB") as gpu:
...     with PeakMeter(gpu) as meter:
...         x = torch.zeros(256, 1024)       # 1 MiB
...         del x
...     meter.peak_used
1048576
"""

from __future__ import annotations

from types import TracebackType

import psutil
import torch

from vramctl.device._base import Device
from vramctl.device._simulate import SimulatedDevice

__all__ = ["PeakMeter", "available_bytes", "total_bytes"]


def _cuda(device: Device) -> bool:
    return device.kind in ("cuda", "mig") and device.index is not None


def total_bytes(device: Device) -> int:
    """The device's capacity as a process sees it."""
    if isinstance(device, SimulatedDevice):
        return device.total_bytes
    if _cuda(device):
        return int(torch.cuda.mem_get_info(device.index)[1])
    return int(psutil.virtual_memory().total)


def available_bytes(device: Device) -> int:
    """Bytes this process could allocate now (free, plus the allocator's idle cache on CUDA)."""
    if isinstance(device, SimulatedDevice):
        return device.free_bytes
    if _cuda(device):
        free = int(torch.cuda.mem_get_info(device.index)[0])
        idx = device.index
        return free + torch.cuda.memory_reserved(idx) - torch.cuda.memory_allocated(idx)
    return int(psutil.virtual_memory().available)


class PeakMeter:
    """Context manager: the peak device-level used bytes inside the ``with`` block."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self.peak_used = 0
        self._base = 0
        self._counter: SimulatedDevice | None = None

    def __enter__(self) -> PeakMeter:
        dev = self.device
        if isinstance(dev, SimulatedDevice):
            dev.reset_peak()
        elif _cuda(dev):
            torch.cuda.synchronize(dev.index)
            torch.cuda.reset_peak_memory_stats(dev.index)
            free, total = torch.cuda.mem_get_info(dev.index)
            self._base = int(total - free) - torch.cuda.memory_reserved(dev.index)
        else:
            vm = psutil.virtual_memory()
            self._base = int(vm.total - vm.available)
            self._counter = SimulatedDevice(None, 1 << 62)
            self._counter.counting_only = True
            self._counter.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        dev = self.device
        if isinstance(dev, SimulatedDevice):
            self.peak_used = dev.reserve + dev.peak_bytes
        elif _cuda(dev):
            torch.cuda.synchronize(dev.index)
            self.peak_used = self._base + torch.cuda.max_memory_reserved(dev.index)
        elif self._counter is not None:
            self._counter.__exit__(exc_type, exc, tb)
            self.peak_used = self._base + self._counter.peak_bytes
            self._counter = None
