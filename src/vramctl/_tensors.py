"""Tensor helpers shared by the simulated devices and the estimator's tracer."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_flatten


def tensors(tree: Any) -> Iterator[torch.Tensor]:
    """The tensors among the leaves of a (nested) container."""
    for leaf in tree_flatten(tree)[0]:
        if isinstance(leaf, torch.Tensor):
            yield leaf


def storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    """The storage a strided tensor's bytes live in (None for sparse, meta or storage-less)."""
    if t.layout != torch.strided or t.is_meta:
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
