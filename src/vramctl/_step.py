"""The call of a model on a batch and the loss in its output, shared by the estimator, the
guard, fit and the integrations."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["call_model", "model_loss"]


def call_model(model: nn.Module, batch: Any) -> Any:
    """Call ``model`` on a batch: a mapping is keyword arguments, a tuple or list positional."""
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, tuple | list):
        return model(*batch)
    return model(batch)


def model_loss(
    output: Any,
    batch: Any = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """The loss in a model's output, or None when it holds none.

    ``loss_fn(output, batch)`` when given; else the output's ``loss`` attribute (a Hugging
    Face ``ModelOutput``) or ``"loss"`` key (a mapping), the output itself when it is a
    scalar tensor, or the first item of a tuple or list when that is a scalar tensor (a
    Hugging Face model's output with ``return_dict=False`` and labels). A tensor of more
    dimensions is the model's output, not its loss: the callers decide what to do without one.
    """
    if loss_fn is not None:
        return loss_fn(output, batch)
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, tuple | list) and output:
        output = output[0]
    if isinstance(output, torch.Tensor) and output.dim() == 0:
        return output
    return None
