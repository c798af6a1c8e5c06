"""Offloading the activations saved for backward to host memory, the guard's last resort."""

from __future__ import annotations

import contextlib
from typing import Any

from vramctl.device import Device

__all__ = ["can_offload", "offload_activations"]


def can_offload(device: Device) -> bool:
    """Offloading frees device memory only where the device is not the host."""
    return device.can_offload


def offload_activations(device: Device) -> contextlib.AbstractContextManager[Any]:
    """Keep the tensors saved for backward in host memory while the block runs.

    On CUDA this is PyTorch's ``torch.autograd.graph.save_on_cpu`` (pinned
    memory); on a simulated GPU the saved tensors are copied out of its budget
    and back in when backward needs them, which is what ``save_on_cpu`` does to
    a real GPU's memory; on the CPU the block runs as it is.
    """
    return device.offload_activations()
