"""The step helper :func:`vramctl.optimize` returns: autocast, loss scaling and the
optimizer step, in the precision it chose (as Accelerate's ``autocast()`` and
``backward()``)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from vramctl.optimize._errors import OptimizeError

__all__ = ["DTYPES", "StepHelper"]

#: The autocast dtype of each precision (fp32: no autocast).
DTYPES: dict[str, torch.dtype | None] = {
    "fp32": None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


class StepHelper:
    """One training (or inference) step in the chosen precision.

    >>> import torch, vramctl
    >>> model = torch.nn.Linear(4, 1)
    >>> step = StepHelper("bf16", "cpu", torch.optim.SGD(model.parameters(), lr=0.1))
    >>> with step.autocast():
    ...     loss = model(torch.randn(8, 4)).float().square().mean()
    >>> step.backward(loss)
    >>> step.step()
    >>> step.precision, step.scaler is None
    ('bf16', True)
    """

    def __init__(
        self,
        precision: str,
        device_type: str,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        if precision not in DTYPES:
            raise OptimizeError(f"precision must be one of {', '.join(DTYPES)}, got {precision!r}")
        #: ``"fp32"``, ``"bf16"`` or ``"fp16"``: the autocast dtype (fp32: none).
        self.precision = precision
        #: ``torch.autocast``'s device type (``"cuda"``, or ``"cpu"``, where a simulated
        #: GPU runs its kernels too).
        self.device_type = device_type
        #: The optimizer :meth:`step` steps (the rebuilt one, fused or foreach, where
        #: ``vramctl.optimize`` rebuilt it); None where none was given.
        self.optimizer = optimizer
        #: The ``GradScaler`` of an fp16 training step, else None.
        self.scaler = scaler

    @property
    def dtype(self) -> torch.dtype | None:
        """The autocast dtype, or None for fp32."""
        return DTYPES[self.precision]

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """A block whose operators run in the chosen precision (``torch.autocast``; for
        fp32, a block that changes nothing). Put the forward and the loss inside it, the
        backward outside."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, with the loss scaled first where fp16 needs a ``GradScaler``."""
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()

    def step(self, *, max_grad_norm: float | None = None) -> None:
        """The optimizer step, then ``zero_grad``: under fp16 the gradients are unscaled, a
        step with inf or NaN gradients is skipped and the scale updated (``GradScaler``).
        ``max_grad_norm`` clips the (unscaled) gradients' norm first."""
        opt = self.optimizer
        if opt is None:
            raise OptimizeError(
                "the step helper has no optimizer: pass optimizer= to vramctl.optimize, or "
                "step your optimizer yourself"
            )
        if self.scaler is not None and max_grad_norm is not None:
            self.scaler.unscale_(opt)
        if max_grad_norm is not None:
            params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        if self.scaler is not None:
            self.scaler.step(opt)
            self.scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)

    def __repr__(self) -> str:
        opt = type(self.optimizer).__name__ if self.optimizer is not None else None
        return (
            f"StepHelper(precision={self.precision!r}, device_type={self.device_type!r}, "
            f"optimizer={opt}, scaler={self.scaler is not None})"
        )
