"""Splitting a batch into pieces along its first dimension, and putting outputs back together.

A batch is a tensor, or a (nested) tuple, list, dict, named tuple or
dataclass of them. Its size is the first dimension of its first tensor that has
one (0-dimensional tensors are scalars); every tensor whose first dimension has
that size is cut, and so is every list of that length whose items hold no
tensor (texts, ids, lists of token ids). Everything else (a mask shared by
every sample, a flag) is given whole to every piece. Pieces are contiguous and
in order, so every sample is in exactly one piece.

>>> import torch
>>> from vramctl.guard._split import split_batch, merge_outputs
>>> batch = {"x": torch.arange(10).view(5, 2), "ids": list("abcde"), "scale": 2.0}
>>> pieces = split_batch(batch, 2)
>>> [p["ids"] for p in pieces]
[['a', 'b', 'c'], ['d', 'e']]
>>> merge_outputs([p["x"] * 10 for p in pieces], [3, 2]).shape
torch.Size([5, 2])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from vramctl._errors import VramctlError

__all__ = [
    "GuardError",
    "batch_size_of",
    "merge_outputs",
    "piece_sizes",
    "slice_batch",
    "split_batch",
]


class GuardError(VramctlError, ValueError):
    """A guard's argument, or a step's input or output, that the guard cannot use.

    A ``ValueError`` too, so ``except ValueError`` still catches it.
    """


def _first_tensor(tree: Any) -> torch.Tensor | None:
    """The first tensor with a first dimension (a 0-dimensional one, a scalar, has none)."""
    if isinstance(tree, torch.Tensor):
        return tree if tree.dim() > 0 else None
    if isinstance(tree, tuple | list):
        items: Any = tree
    elif isinstance(tree, Mapping):
        items = tree.values()
    elif dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        items = (getattr(tree, f.name) for f in dataclasses.fields(tree))
    else:
        return None
    for item in items:
        found = _first_tensor(item)
        if found is not None:
            return found
    return None


def batch_size_of(batch: Any) -> int:
    """The number of samples in a batch: the first dimension of its first tensor."""
    # Read before every guarded step: a tensor, or a tuple or list that starts with
    # one (``(inputs, targets)``), is answered without walking the batch.
    head = batch[0] if isinstance(batch, tuple | list) and batch else batch
    if isinstance(head, torch.Tensor) and head.dim() > 0:
        return int(head.shape[0])
    first = _first_tensor(batch)
    if first is None:
        raise VramctlError(
            "the batch has no tensor with a batch dimension to split; pass a tensor, or a "
            "tuple, list, dict or dataclass holding tensors whose first dimension is the batch"
        )
    return int(first.shape[0])


def piece_sizes(n: int, pieces: int) -> list[int]:
    """``n`` samples in ``pieces`` contiguous pieces, as equal as possible (none empty)."""
    k = max(1, min(pieces, n))
    base, extra = divmod(n, k)
    return [base + (1 if i < extra else 0) for i in range(k)]


def _has_tensor(tree: Any) -> bool:
    if isinstance(tree, torch.Tensor):
        return True
    if isinstance(tree, Mapping):
        return any(_has_tensor(v) for v in tree.values())
    if isinstance(tree, tuple | list):
        return any(_has_tensor(v) for v in tree)
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        return any(_has_tensor(getattr(tree, f.name)) for f in dataclasses.fields(tree))
    return False


def _is_leaf_list(x: Any) -> bool:
    """A list of per-sample records without tensors: texts, ids, lists of token ids, dicts."""
    return isinstance(x, list) and not any(_has_tensor(i) for i in x)


def _is_sample_list(outputs: Sequence[Any], sizes: Sequence[int]) -> bool:
    """Lists of one item per sample (to join), rather than lists of outputs (to merge by position).

    Every piece's list has the piece's length, and no position holds a tensor
    batch-shaped in every piece (``[logits, hidden]`` is a list of outputs).
    """
    if not all(isinstance(o, list) and len(o) == s for o, s in zip(outputs, sizes, strict=True)):
        return False
    if _is_leaf_list(outputs[0]):
        return True
    if len({len(o) for o in outputs}) > 1:
        return True  # lists of outputs have as many items in every piece
    return not any(
        all(
            isinstance(o[j], torch.Tensor) and o[j].dim() > 0 and o[j].shape[0] == s
            for o, s in zip(outputs, sizes, strict=True)
        )
        for j in range(len(outputs[0]))
    )


def _map(tree: Any, fn: Callable[[Any], Any], n: int) -> Any:
    """Apply ``fn`` to each leaf that carries the batch dimension; rebuild the containers."""
    if isinstance(tree, torch.Tensor):
        return fn(tree) if tree.dim() > 0 and tree.shape[0] == n else tree
    if isinstance(tree, Mapping):
        items = {k: _map(v, fn, n) for k, v in tree.items()}
        return type(tree)(**items) if _kw(tree) else _rebuild_mapping(tree, items)
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        changes = {f.name: _map(getattr(tree, f.name), fn, n) for f in dataclasses.fields(tree)}
        return dataclasses.replace(tree, **changes)
    if _is_leaf_list(tree) and len(tree) == n:
        return fn(tree)
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # named tuple
        return type(tree)(*(_map(v, fn, n) for v in tree))
    if isinstance(tree, tuple | list):
        return type(tree)(_map(v, fn, n) for v in tree)
    return tree


def _kw(tree: object) -> bool:
    # Model-output classes (transformers' ModelOutput) are dataclasses *and* mappings,
    # rebuilt from keyword arguments.
    keys: Any = tree
    return dataclasses.is_dataclass(tree) and all(isinstance(k, str) for k in keys)


def _rebuild_mapping(tree: object, items: dict[Any, Any]) -> Any:
    try:
        return type(tree)(items)  # type: ignore[call-arg]
    except TypeError:
        return items


def slice_batch(batch: Any, lo: int, hi: int, *, size: int | None = None) -> Any:
    """Samples ``lo`` to ``hi`` (exclusive) of ``batch``: views of its tensors, no copies."""
    n = batch_size_of(batch) if size is None else size
    return _map(batch, lambda leaf: leaf[lo:hi], n)


def split_batch(batch: Any, pieces: int, *, size: int | None = None) -> list[Any]:
    """Cut ``batch`` into at most ``pieces`` contiguous pieces along its first dimension."""
    n = batch_size_of(batch) if size is None else size
    out = []
    start = 0
    for m in piece_sizes(n, pieces):
        out.append(slice_batch(batch, start, start + m, size=n))
        start += m
    return out


def merge_outputs(outputs: Sequence[Any], sizes: Sequence[int], *, reduction: str = "mean") -> Any:
    """Put the outputs of the pieces back together, in order.

    Tensors and lists whose first dimension is the piece's size are joined
    (``torch.cat``); containers are rebuilt; a 0-dimensional tensor (a loss)
    is combined by ``reduction``: the size-weighted mean, or the sum; other
    values must be equal in every piece, or they are returned as a list.
    """
    if len(outputs) != len(sizes):
        raise GuardError(f"one size per output: {len(outputs)} outputs, {len(sizes)} sizes")
    if len(outputs) == 1:
        return outputs[0]
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        if first.dim() > 0 and all(
            isinstance(o, torch.Tensor) and o.dim() > 0 and o.shape[0] == s
            for o, s in zip(outputs, sizes, strict=True)
        ):
            return torch.cat(list(outputs))
        if first.dim() == 0:
            if reduction == "sum":
                return torch.stack(list(outputs)).sum()
            total = sum(sizes)
            return sum(o * (s / total) for o, s in zip(outputs, sizes, strict=True))
        return list(outputs)
    if isinstance(first, Mapping):
        merged = {
            k: merge_outputs([o[k] for o in outputs], sizes, reduction=reduction) for k in first
        }
        if _kw(first):
            return type(first)(**merged)
        return _rebuild_mapping(first, merged)
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        return dataclasses.replace(
            first,
            **{
                f.name: merge_outputs(
                    [getattr(o, f.name) for o in outputs], sizes, reduction=reduction
                )
                for f in dataclasses.fields(first)
            },
        )
    if _is_sample_list(outputs, sizes):
        return [item for o in outputs for item in o]
    if isinstance(first, tuple | list):
        cols = [
            merge_outputs(list(c), sizes, reduction=reduction) for c in zip(*outputs, strict=True)
        ]
        if isinstance(first, tuple) and hasattr(first, "_fields"):
            return type(first)(*cols)
        return type(first)(cols)
    if all(o is first or o == first for o in outputs):
        return first
    return list(outputs)
