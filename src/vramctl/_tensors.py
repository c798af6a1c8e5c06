"""Tensor helpers shared by the simulated devices, the estimator's tracer and the monitor."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

__all__ = ["storage", "tensor_parts", "tensors"]


def tensors(tree: Any) -> Iterator[torch.Tensor]:
    """The tensors among the leaves of a (nested) container, in pytree's order.

    Tuples, lists and dicts (an operator's arguments and outputs, nearly always) are walked
    here and scalars skipped; anything else is flattened by pytree, as before."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif type(tree) in (tuple, list):
        for item in tree:
            yield from tensors(item)
    elif type(tree) is dict:
        for item in tree.values():
            yield from tensors(item)
    elif type(tree) not in _LEAVES:
        for leaf in tree_flatten(tree)[0]:
            if isinstance(leaf, torch.Tensor):
                yield leaf


#: Types pytree keeps as leaves that are never tensors: an operator's scalar arguments.
_LEAVES = frozenset(
    {int, float, bool, str, complex, type(None), torch.dtype, torch.device, torch.layout,
     torch.memory_format}
)  # fmt: skip


def storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    """The storage a strided tensor's bytes live in (None for sparse, meta or storage-less)."""
    if t.layout != torch.strided or t.is_meta:
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


def tensor_parts(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The strided tensors whose storages hold ``t``'s bytes: ``t`` itself, or a sparse
    tensor's values and indices (values first); none for a meta tensor or another layout."""
    if t.layout == torch.strided:
        return (t,)
    if t.is_meta:
        return ()
    try:
        if t.layout == torch.sparse_coo:
            return (t._values(), t._indices())
        if t.layout in (torch.sparse_csr, torch.sparse_bsr):
            return (t.values(), t.crow_indices(), t.col_indices())
        if t.layout in (torch.sparse_csc, torch.sparse_bsc):
            return (t.values(), t.ccol_indices(), t.row_indices())
    except (RuntimeError, NotImplementedError):
        pass
    return ()
