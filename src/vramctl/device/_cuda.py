"""CUDA GPUs and MIG instances: NVML for the device, ``torch.cuda`` for this process's allocator."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import psutil
import pynvml

from vramctl._na import NA, Bytes, NotAvailable, or_na
from vramctl.device._base import Device
from vramctl.device._capability import ComputeCapability
from vramctl.device._catalog import match_gpu_name
from vramctl.device._health import DeviceHealth, HealthPolicy, ReadingFailed
from vramctl.device._memory import MemoryState, ProcessMemory
from vramctl.device._nvml import NvmlGpu, optional

if TYPE_CHECKING:  # PyTorch is imported where this process's CUDA is used, not to list GPUs
    import torch

__all__ = ["CudaDevice", "allocator_stats"]

log = logging.getLogger("vramctl.device")


# MemoryState field -> torch.cuda.memory_stats key.
_STATS = {
    "allocated": "allocated_bytes.all.current",
    "reserved": "reserved_bytes.all.current",
    "peak_allocated": "allocated_bytes.all.peak",
    "peak_reserved": "reserved_bytes.all.peak",
    "inactive_split": "inactive_split_bytes.all.current",
    "alloc_retries": "num_alloc_retries",
    "ooms": "num_ooms",
}


def allocator_stats(index: int) -> dict[str, Any]:
    """This process's caching-allocator figures for CUDA device ``index``.

    Before this process has initialised CUDA it holds nothing on the device, so
    the figures are true zeros (fragmentation, a ratio over zero, is ``NA``).
    Without a CUDA build, or for an index ``torch.cuda`` does not number, every
    figure is ``NA``. A process that has not imported PyTorch has not initialised CUDA
    either: its figures are zeros, read without importing it.
    """
    if "torch" not in sys.modules:
        return dict.fromkeys(_STATS, 0)
    import torch

    if not torch.cuda.is_available() or not 0 <= index < torch.cuda.device_count():
        return dict.fromkeys(_STATS, NA)
    if not torch.cuda.is_initialized():
        return dict.fromkeys(_STATS, 0)
    stats = torch.cuda.memory_stats(index)
    return {field: int(stats.get(key, 0)) for field, key in _STATS.items()}


def _secondary(fn: Callable[..., Any], *args: Any) -> Any:
    """A reading beside the memory figures (temperature, power, utilization, compute mode).

    Any NVML error makes just this reading ``NA``: a sensor that fails must not discard
    the memory figures, nor count against the device's health (the memory reading does).
    """
    try:
        return optional(fn, *args)
    except pynvml.NVMLError as exc:
        log.debug("%s failed: %s: %s", getattr(fn, "__name__", fn), type(exc).__name__, exc)
        return NA


def _proc_info(pid: int) -> dict[str, Any]:
    try:
        p = psutil.Process(pid)
        with p.oneshot():
            cmd = p.cmdline()
            return {
                "name": p.name() or NA,
                "user": p.username() or NA,
                "command": " ".join(cmd) if cmd else NA,
            }
    except (psutil.Error, OSError):
        # Another PID namespace (containers) or no permission: the name is not available.
        return {}


class CudaDevice(Device):
    """One CUDA device as this process numbers it (``cuda:N``): a GPU or a MIG instance."""

    index: int

    def __init__(
        self,
        index: int,
        *,
        nvml: NvmlGpu | None,
        name: str,
        uuid: str | NotAvailable = NA,
        capability: ComputeCapability | NotAvailable = NA,
        policy: HealthPolicy | None = None,
    ) -> None:
        self.index = index
        self.id = f"cuda:{index}"
        self.kind = "mig" if nvml is not None and nvml.mig_index is not None else "cuda"
        self.name = name
        self.uuid = uuid
        self.capability = capability
        self.spec = match_gpu_name(name)
        self._nvml = nvml
        self.health = DeviceHealth(
            self.id,
            policy,
            retry_on=(pynvml.NVMLError, RuntimeError) if nvml is None else (pynvml.NVMLError,),
        )

    @classmethod
    def from_nvml(cls, gpu: NvmlGpu, policy: HealthPolicy | None = None) -> CudaDevice:
        cap: ComputeCapability | NotAvailable = NA
        handle = gpu.handle
        if gpu.mig_index is not None:
            handle = _secondary(pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle, gpu.handle)
        if handle is not NA:
            cc = _secondary(pynvml.nvmlDeviceGetCudaComputeCapability, handle)
            if cc is not NA:
                cap = ComputeCapability(int(cc[0]), int(cc[1]))
        return cls(
            gpu.cuda_index, nvml=gpu, name=gpu.name, uuid=gpu.uuid, capability=cap, policy=policy
        )

    @classmethod
    def from_torch(cls, index: int, policy: HealthPolicy | None = None) -> CudaDevice:
        """A device known only to ``torch.cuda`` (no NVML: ROCm, or a missing library)."""
        import torch

        props = torch.cuda.get_device_properties(index)
        uuid = getattr(props, "uuid", None)
        return cls(
            index,
            nvml=None,
            name=props.name,
            uuid=f"GPU-{uuid}" if uuid else NA,
            capability=ComputeCapability(props.major, props.minor),
            policy=policy,
        )

    @property
    def torch_device(self) -> torch.device:
        import torch

        return torch.device("cuda", self.index)

    @property
    def is_gpu(self) -> bool:
        return True

    @property
    def is_cuda(self) -> bool:
        return True

    @property
    def is_mig(self) -> bool:
        return self.kind == "mig"

    # -- behaviour ----------------------------------------------------------------

    def capacity(self) -> int:
        import torch

        return int(torch.cuda.mem_get_info(self.index)[1])

    def available(self) -> int:
        import torch

        free = int(torch.cuda.mem_get_info(self.index)[0])
        idx = self.index
        return free + torch.cuda.memory_reserved(idx) - torch.cuda.memory_allocated(idx)

    def _peak_begin(self) -> Any:
        import torch

        idx = self.index
        torch.cuda.synchronize(idx)
        torch.cuda.reset_peak_memory_stats(idx)
        free, total = torch.cuda.mem_get_info(idx)
        # What other processes and the CUDA context hold: used less this process's reserve.
        return int(total - free) - torch.cuda.memory_reserved(idx), torch.cuda.memory_allocated(idx)

    def _peak_end(self, token: Any) -> tuple[int, int, int]:
        import torch

        base, start = token
        idx = self.index
        torch.cuda.synchronize(idx)
        return (
            base + torch.cuda.max_memory_reserved(idx),
            torch.cuda.max_memory_allocated(idx) - start,
            torch.cuda.memory_allocated(idx) - start,
        )

    @property
    def counts_ooms(self) -> bool:
        return True

    def oom_count(self) -> int:
        import torch

        if not torch.cuda.is_initialized():
            return 0
        # Read before every guarded attempt: the nested form skips flattening the stats tree.
        return int(torch.cuda.memory_stats_as_nested_dict(self.index).get("num_ooms", 0))

    def release_cache(self) -> None:
        import torch

        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    @contextlib.contextmanager
    def capped(self, budget: int) -> Any:
        """``torch.cuda.set_per_process_memory_fraction`` for the block: this process may
        reserve ``budget`` less what is held outside its allocator now (the CUDA context,
        other processes), so that its caching allocator frees its cache and retries before
        it refuses. The fraction set before comes back afterwards, even on an error."""
        import torch

        idx = self.index
        free, total = torch.cuda.mem_get_info(idx)
        outside = int(total - free) - torch.cuda.memory_reserved(idx)
        getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        before = float(getter(idx)) if getter is not None else 1.0
        torch.cuda.set_per_process_memory_fraction(
            min(1.0, max(0.0, (budget - outside) / total)), idx
        )
        try:
            yield
        finally:
            torch.cuda.set_per_process_memory_fraction(before, idx)

    def offload_activations(self) -> contextlib.AbstractContextManager[Any]:
        # PyTorch's own: saved tensors go to pinned host memory and come back for backward.
        import torch

        return torch.autograd.graph.save_on_cpu(pin_memory=True)

    # -- readings -----------------------------------------------------------------

    def _read_nvml(self) -> dict[str, Any]:
        assert self._nvml is not None
        h = self._nvml.handle
        mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        out: dict[str, Any] = {
            "total": int(mem.total),
            "used": int(mem.used),
            "free": int(mem.free),
        }
        if self.kind == "mig":
            return out  # temperature, power and utilization belong to the whole GPU
        temp = _secondary(pynvml.nvmlDeviceGetTemperature, h, pynvml.NVML_TEMPERATURE_GPU)
        power = _secondary(pynvml.nvmlDeviceGetPowerUsage, h)
        util = _secondary(pynvml.nvmlDeviceGetUtilizationRates, h)
        out["temperature_c"] = NA if temp is NA else float(temp)
        out["power_w"] = NA if power is NA else power / 1000.0
        out["compute_utilization"] = NA if util is NA else float(util.gpu)
        return out

    def _read_torch(self) -> dict[str, Any]:
        import torch

        free, total = torch.cuda.mem_get_info(self.index)
        return {"total": int(total), "used": int(total - free), "free": int(free)}

    def memory(self) -> MemoryState:
        alloc = allocator_stats(self.index) if self.index is not None else {}
        try:
            reading = self.health.call(self._read_nvml if self._nvml else self._read_torch)
        except ReadingFailed:
            return MemoryState(device=self.id, **alloc)
        procs: list[ProcessMemory] | NotAvailable = NA
        if self._nvml is not None:
            try:
                procs = self._nvml_processes()
            except pynvml.NVMLError:
                procs = NA
        reading["process_used"] = self._own_use(procs, alloc)
        state = MemoryState(device=self.id, **reading, **alloc)
        self.health.observe(busy_reason=self._busy_reason(state, procs))
        return state

    def _own_use(self, procs: list[ProcessMemory] | NotAvailable, alloc: dict[str, Any]) -> Bytes:
        if procs is NA:
            return NA
        mine = [p for p in procs if p.pid == os.getpid()]
        if mine:
            return mine[0].used
        # Not listed: true zero if this process never touched CUDA, else hidden (PID namespace).
        return 0 if alloc.get("reserved") == 0 else NA

    def _busy_reason(
        self, state: MemoryState, procs: list[ProcessMemory] | NotAvailable
    ) -> str | None:
        util = state.utilization
        if util is not NA and util >= self.health.policy.busy_utilization:
            return f"memory {util:.0%} used"
        if self._nvml is not None and self.kind == "cuda":
            mode = _secondary(pynvml.nvmlDeviceGetComputeMode, self._nvml.handle)
            if mode == pynvml.NVML_COMPUTEMODE_PROHIBITED:
                return "compute mode is prohibited"
            if mode == pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS and procs is not NA:
                others = [p.pid for p in procs if p.pid != os.getpid()]
                if others:
                    return f"exclusive-process mode, held by pid {others[0]}"
        return None

    def _nvml_processes(self) -> list[ProcessMemory]:
        assert self._nvml is not None
        h = self._nvml.handle
        seen: dict[int, ProcessMemory] = {}
        for kind, fn in (
            ("compute", pynvml.nvmlDeviceGetComputeRunningProcesses),
            ("graphics", pynvml.nvmlDeviceGetGraphicsRunningProcesses),
        ):
            listed = optional(fn, h)
            if listed is NA:
                continue
            for p in listed:
                pid = int(p.pid)
                used = or_na(getattr(p, "usedGpuMemory", None))
                if pid in seen:
                    prev = seen[pid].used
                    if used is NA or (prev is not NA and prev >= used):
                        continue
                seen[pid] = ProcessMemory(pid=pid, used=used, kind=kind, **_proc_info(pid))
        return sorted(seen.values(), key=lambda r: -1 if r.used is NA else r.used, reverse=True)

    def processes(self, limit: int | None = None) -> list[ProcessMemory]:
        if self._nvml is None:
            return []  # per-process figures need NVML
        try:
            rows = self.health.call(self._nvml_processes)
        except ReadingFailed:
            return []
        return rows[:limit] if limit is not None else rows
