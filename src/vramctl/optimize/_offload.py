"""Offloading an optimizer's state to host memory (ZeRO-Offload's trade, one process).

The optimizer is rebuilt over host copies of the parameters, so its state (AdamW's two
moments: twice the parameters' bytes) lives in host memory and its step runs on the CPU.
Each step copies the gradients to the host, steps there, and copies the updated
parameters back into the device's, in place. The device keeps the parameters and the
gradients only; the step costs two copies over the host link and a CPU optimizer step.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from typing import Any

import torch

from vramctl.device import Device, current_device, resolve
from vramctl.optimize._errors import OptimizeError

__all__ = ["OffloadedOptimizer"]


class OffloadedOptimizer(torch.optim.Optimizer):
    """``optimizer`` with its state and step in host memory.

    Its ``param_groups`` are the device's parameters (so ``GradScaler``, gradient clipping
    and learning-rate schedulers work on it as on the original); the optimizer that
    steps, ``inner``, is the same class with the same groups, hyper-parameters and state,
    over pinned host copies of the parameters.

    >>> import torch
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = OffloadedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1), device="cpu")
    >>> model(torch.randn(3, 4)).sum().backward()
    >>> opt.step()
    >>> opt.zero_grad()
    >>> len(opt.inner.state), opt.param_groups[0]["lr"]
    (2, 0.1)
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, device: Device | str | int | None = None
    ) -> None:
        if isinstance(optimizer, OffloadedOptimizer):
            raise OptimizeError("the optimizer is already offloaded")
        dev = resolve(device) if device is not None else current_device()
        #: The device whose parameters this optimizer updates.
        self.device = dev
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        host_groups = []
        for group in optimizer.param_groups:
            hosted = []
            for p in group["params"]:
                hp = dev.to_host(p).requires_grad_(p.requires_grad)
                self._pairs.append((p, hp))
                hosted.append(hp)
            host_groups.append({**group, "params": hosted})
        cls = type(optimizer)
        try:
            options = inspect.signature(cls.__init__).parameters
        except (TypeError, ValueError) as exc:
            raise OptimizeError(f"{cls.__name__}'s options cannot be read") from exc
        kwargs = {k: v for k, v in optimizer.defaults.items() if k in options}
        with dev.uncounted():
            # the state (where the optimizer has stepped) is copied to the host, not shared
            state = copy.deepcopy(optimizer.state_dict())
            #: The optimizer that steps: over the host copies of the parameters.
            self.inner: torch.optim.Optimizer = cls(host_groups, **kwargs)
            self.inner.load_state_dict(state)
        super().__init__(
            [{k: v for k, v in g.items()} for g in optimizer.param_groups], optimizer.defaults
        )

    def _sync_groups(self) -> None:
        """Hyper-parameters changed on this optimizer's groups (a scheduler's lr) reach the
        inner one's."""
        for mine, theirs in zip(self.param_groups, self.inner.param_groups, strict=True):
            for k, v in mine.items():
                if k != "params":
                    theirs[k] = v

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        """Copy the gradients to the host, step there, copy the parameters back."""
        if closure is not None:
            raise OptimizeError("an offloaded optimizer's step takes no closure")
        self._sync_groups()
        dev = self.device
        with dev.uncounted():
            for p, hp in self._pairs:
                g = p.grad
                if g is None:
                    hp.grad = None
                elif hp.grad is None or hp.grad.shape != g.shape or hp.grad.dtype != g.dtype:
                    hp.grad = dev.to_host(g)
                else:
                    hp.grad.copy_(g, non_blocking=True)
            if dev.is_cuda:
                torch.cuda.synchronize(dev.torch_device)
            self.inner.step()
            for p, hp in self._pairs:
                if hp.grad is not None:
                    p.copy_(hp, non_blocking=True)

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's (the state, in host memory)."""
        self._sync_groups()
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        with self.device.uncounted():
            self.inner.load_state_dict(state_dict)
        for mine, theirs in zip(self.param_groups, self.inner.param_groups, strict=True):
            mine.update({k: v for k, v in theirs.items() if k != "params"})

    def __repr__(self) -> str:
        return f"OffloadedOptimizer({self.inner!r}, device={self.device.id!r})"
