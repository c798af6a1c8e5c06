"""Offloading the activations saved for backward to host memory, the guard's last resort."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from vramctl.device._base import Device
from vramctl.device._simulate import SimulatedDevice

__all__ = ["can_offload", "offload_activations"]


def can_offload(device: Device) -> bool:
    """Offloading frees device memory only where the device is not the host."""
    return isinstance(device, SimulatedDevice) or device.kind in ("cuda", "mig")


@contextlib.contextmanager
def offload_activations(device: Device) -> Iterator[None]:
    """Keep the tensors saved for backward in host memory while the block runs.

    On CUDA this is PyTorch's ``torch.autograd.graph.save_on_cpu`` (pinned
    memory); on a simulated GPU the saved tensors are copied out of its budget
    and back in when backward needs them, which is what ``save_on_cpu`` does to
    a real GPU's memory.
    """
    if isinstance(device, SimulatedDevice):

        def pack(t: torch.Tensor) -> Any:
            with device.host():
                return t.detach().clone()

        def unpack(t: torch.Tensor) -> torch.Tensor:
            return t.clone()

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
    elif device.kind in ("cuda", "mig"):
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            yield
    else:
        yield
