"""Rebuilding an optimizer with PyTorch's fused or multi-tensor (foreach) kernels."""

from __future__ import annotations

import inspect
from typing import Any

import torch

__all__ = ["fast_kernel", "rebuild_optimizer"]

_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _devices(name: str, fallback: tuple[str, ...]) -> tuple[str, ...]:
    """The device types PyTorch's fused or foreach optimizer kernels support."""
    try:
        from torch.utils import _foreach_utils

        return tuple(getattr(_foreach_utils, name)())
    except (ImportError, AttributeError):
        return fallback


def _where(tensors: list[torch.Tensor]) -> str:
    kinds = sorted({f"{t.device.type} {str(t.dtype).removeprefix('torch.')}" for t in tensors})
    return ", ".join(kinds) or "no parameters"


def fast_kernel(optimizer: torch.optim.Optimizer) -> tuple[str | None, str]:
    """Which of PyTorch's faster kernels ``optimizer`` can be rebuilt with: ``"fused"`` where
    PyTorch has a fused kernel for its class and its parameters' device and dtype, else
    ``"foreach"`` where the device has multi-tensor kernels, else None; and why."""
    cls = type(optimizer)
    name = cls.__name__
    try:
        options = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return None, f"{name}'s options cannot be read"
    groups = optimizer.param_groups
    tensors = [p for g in groups for p in g["params"]]
    where = _where(tensors)
    if any(g.get("fused") for g in groups):
        return None, f"{name} is already fused"
    fused_devices = _devices("_get_fused_kernels_supported_devices", ("cuda",))
    if (
        "fused" in options
        and tensors
        and not any(g.get("differentiable") for g in groups)
        and all(
            t.dtype in _FUSED_DTYPES and not t.is_sparse and t.device.type in fused_devices
            for t in tensors
        )
    ):
        return "fused", f"{name} with fused=True ({where}): one kernel for all parameters"
    if "foreach" not in options:
        return None, f"{name} has no fused or foreach option"
    lacks = f"no fused {name} for {where}" if "fused" in options else f"no fused {name}"
    if any(g.get("foreach") for g in groups):
        return None, f"{name} already uses foreach kernels; {lacks}"
    supported = _devices("_get_foreach_kernels_supported_devices", ("cuda",))
    if not tensors or any(t.device.type not in supported for t in tensors):
        return None, f"{lacks}, and PyTorch's foreach kernels run on {', '.join(supported)} only"
    return "foreach", f"{name} with foreach=True ({where}): multi-tensor kernels; {lacks}"


def rebuild_optimizer(optimizer: torch.optim.Optimizer, kernel: str) -> torch.optim.Optimizer:
    """``optimizer`` rebuilt with ``kernel=True`` (``"fused"`` or ``"foreach"``; see
    :func:`fast_kernel`): the same class, parameter groups, hyper-parameters and state.

    >>> import torch
    >>> p = [torch.nn.Parameter(torch.randn(3))]
    >>> new = rebuild_optimizer(torch.optim.AdamW(p, lr=0.01), "fused")
    >>> new.param_groups[0]["fused"], new.param_groups[0]["lr"]
    (True, 0.01)
    """
    cls = type(optimizer)
    options = inspect.signature(cls.__init__).parameters

    def switched(group: dict[str, Any]) -> dict[str, Any]:
        out = {**group, kernel: True}
        if kernel == "fused" and "foreach" in out:
            out["foreach"] = None
        return out

    state = optimizer.state_dict()
    # load_state_dict takes the groups' settings from the state: switch them there too.
    state["param_groups"] = [switched(g) for g in state["param_groups"]]
    kwargs = switched({k: v for k, v in optimizer.defaults.items() if k in options})
    new = cls([switched(g) for g in optimizer.param_groups], **kwargs)
    new.load_state_dict(state)
    return new
