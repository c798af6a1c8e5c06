"""The call of a model on a batch, shared by the estimator, the guard and fit."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

__all__ = ["call_model"]


def call_model(model: nn.Module, batch: Any) -> Any:
    """Call ``model`` on a batch: a mapping is keyword arguments, a tuple or list positional."""
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, tuple | list):
        return model(*batch)
    return model(batch)
