"""The device interface every kind of device implements."""

from __future__ import annotations

import abc
from typing import Any

import torch

from vramctl._na import NA, NotAvailable
from vramctl.device._capability import ComputeCapability
from vramctl.device._health import DeviceHealth
from vramctl.device._memory import MemoryState, ProcessMemory
from vramctl.device.catalog import GpuSpec

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
        return self.kind in ("cuda", "mig", "sim")

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
