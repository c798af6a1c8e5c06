"""The device interface every kind of device implements."""

from __future__ import annotations

import abc
import contextlib
from typing import TYPE_CHECKING, Any

from vramctl._na import NA, NotAvailable
from vramctl.device._capability import ComputeCapability
from vramctl.device._catalog import GpuSpec
from vramctl.device._health import DeviceHealth
from vramctl.device._memory import MemoryState, ProcessMemory

if TYPE_CHECKING:  # PyTorch is imported where a tensor is touched, not to list devices
    import torch

    from vramctl.device._meter import PeakMeter

__all__ = ["Device"]


class Device(abc.ABC):
    """A device that holds tensors: a CUDA GPU, a MIG instance, the CPU, or a simulated GPU.

    >>> import vramctl
    >>> cpu = vramctl.get_device("cpu")
    >>> cpu.memory().total > 0
    True
    """

    #: "cuda", "mig", "cpu" or "sim".
    kind: str
    #: Stable identifier: "cuda:0", "cpu", "sim:T4-16GB".
    id: str
    name: str
    index: int | None
    uuid: str | NotAvailable = NA
    capability: ComputeCapability | NotAvailable = NA
    #: The catalog entry this device matches, if any.
    spec: GpuSpec | None = None
    health: DeviceHealth

    @property
    @abc.abstractmethod
    def torch_device(self) -> torch.device:
        """The ``torch.device`` to put tensors on."""

    @abc.abstractmethod
    def memory(self) -> MemoryState:
        """Read the device's memory now. Never raises: missing readings are ``NA``."""

    @abc.abstractmethod
    def processes(self, limit: int | None = None) -> list[ProcessMemory]:
        """Processes using the device, largest first (at most ``limit``)."""

    @property
    def is_gpu(self) -> bool:
        """Whether it holds a GPU's memory (a CUDA GPU, a MIG instance or a simulated GPU)."""
        return False

    @property
    def is_cuda(self) -> bool:
        """Whether its tensors are CUDA memory: ``torch.cuda``'s allocator, context and
        workspaces apply (a CUDA GPU or a MIG instance; not a simulated GPU)."""
        return False

    @property
    def is_mig(self) -> bool:
        """Whether it is a MIG instance (a slice of a GPU) rather than a whole device."""
        return False

    @property
    def is_simulated(self) -> bool:
        """Whether it is a simulated GPU: no hardware, its memory in use is this process's
        count of the tensors made inside its ``with`` block (0 while nothing runs there)."""
        return False

    # -- behaviour: what differs by kind is answered here, never by asking the kind ------

    @abc.abstractmethod
    def capacity(self) -> int:
        """The device's capacity as a process sees it, in bytes."""

    @abc.abstractmethod
    def available(self) -> int:
        """Bytes this process could allocate now (on CUDA: free plus the allocator's idle cache)."""

    def peak_meter(self) -> PeakMeter:
        """A context manager that measures the peak memory of its ``with`` block here.

        >>> import torch, vramctl
        >>> with vramctl.get_device("cpu").peak_meter() as m:
        ...     x = torch.zeros(1024)
        >>> m.peak_allocated >= 4096
        True
        """
        from vramctl.device._meter import PeakMeter

        return PeakMeter(self)

    @abc.abstractmethod
    def _peak_begin(self) -> Any:
        """Start a peak measurement; returns what :meth:`_peak_end` needs."""

    @abc.abstractmethod
    def _peak_end(self, token: Any) -> tuple[int, int, int]:
        """End it: ``(peak_used, peak_allocated, net_allocated)``."""

    def oom_count(self) -> int:
        """How many allocations this device's allocator has refused in this process."""
        return 0

    @property
    def counts_ooms(self) -> bool:
        """Whether :meth:`oom_count` can rise (a GPU's allocator counts what it refuses; on
        the host it stays 0, so a caller reading it before every attempt may skip it)."""
        return False

    def release_cache(self) -> None:
        """Give memory cached by this process's allocator back (CUDA's ``empty_cache``)."""
        return None

    def capped(self, budget: int) -> contextlib.AbstractContextManager[Any]:
        """A block in which this process's allocator may not take the device's used memory
        past ``budget`` bytes: on CUDA it gives back its cache and retries before it
        refuses, as it does when the device is full. Elsewhere the block runs as it is
        (a simulated GPU refuses at its own capacity)."""
        return contextlib.nullcontext()

    @property
    def active(self) -> bool:
        """Whether a step run in this thread is counted by the device (False only for a
        simulated GPU whose ``with`` block this thread is not in)."""
        return True

    def counting(self) -> contextlib.AbstractContextManager[Any]:
        """A block whose allocations this device counts, in whichever thread runs it
        (a simulated GPU enters its counting there; a real device always counts)."""
        return contextlib.nullcontext()

    def uncounted(self) -> contextlib.AbstractContextManager[Any]:
        """A block whose allocations are host memory, not this device's (a simulated GPU's
        ``.to("cpu")``); for a real device the block runs as it is."""
        return contextlib.nullcontext()

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of ``t`` in host memory, outside this device's count: pinned where this
        is a CUDA device (so copies to and from it can be asynchronous)."""
        import torch

        with self.uncounted():
            out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.is_cuda)
            out.copy_(t.detach())
        return out

    def adopt(self, obj: Any) -> Any:
        """Place ``obj`` on this device, as ``.to(device)`` does: a module or tensor is moved
        (and returned); a simulated GPU counts what it holds instead."""
        import torch

        if isinstance(obj, torch.nn.Module | torch.Tensor):
            return obj.to(self.torch_device)
        return obj

    def put(self, t: torch.Tensor) -> torch.Tensor:
        """A batch's tensor on this device: copied there (asynchronously from pinned memory)
        where it is not the host; a simulated GPU counts a copy."""
        return t.to(self.torch_device, non_blocking=True)

    def owns(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s memory is this device's."""
        return t.device == self.torch_device

    @property
    def can_offload(self) -> bool:
        """Whether moving tensors to host memory frees this device's memory."""
        return self.is_gpu

    def offload_activations(self) -> contextlib.AbstractContextManager[Any]:
        """A block whose tensors saved for backward are kept in host memory."""
        return contextlib.nullcontext()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready description (no readings; see :meth:`memory`)."""
        cc = self.capability
        return {
            "id": self.id,
            "kind": self.kind,
            "index": self.index,
            "name": self.name,
            "uuid": None if self.uuid is NA else self.uuid,
            "compute_capability": None if cc is NA else str(cc),
            "features": None if cc is NA else cc.features(),
            "catalog": None if self.spec is None else self.spec.name,
            "health": self.health.to_dict(),
        }

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id} {self.name!r} {self.health.state}>"
