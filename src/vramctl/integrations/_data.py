"""Batches of any size from a dataset, and an effective batch split into micro-batches.

>>> from vramctl.integrations import split_effective_batch
>>> split_effective_batch(256, 48)         # 48 fit, and 256 = 8 x 32 exactly
(32, 8)
>>> split_effective_batch(100, 400)        # the whole effective batch fits at once
(100, 1)
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.data import default_collate

from vramctl._errors import VramctlError
from vramctl._step import model_loss

__all__ = ["batch_maker", "split_effective_batch"]


def split_effective_batch(effective: int, largest: int) -> tuple[int, int]:
    """``(per_device, accumulation)`` with ``per_device * accumulation == effective`` exactly,
    ``per_device <= largest`` and the fewest accumulation steps.

    ``largest`` is the largest per-device batch that fits (a fit's answer). The
    effective batch is kept exact: the per-device batch is the largest divisor of
    ``effective`` that fits (a prime ``effective`` above ``largest`` runs one sample
    per step).
    """
    for name, value in (("effective", effective), ("largest", largest)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise VramctlError(f"{name} must be a positive integer, got {value!r}")
    if largest >= effective:
        return effective, 1
    accumulation = -(-effective // largest)
    while effective % accumulation:
        accumulation += 1
    return effective // accumulation, accumulation


def batch_maker(
    dataset: Any,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    *,
    to_device: Callable[[Any], Any] | None = None,
) -> Callable[[int], Any]:
    """``make_batch(b)``: ``b`` samples of ``dataset`` collated into one batch.

    A map-style dataset gives its first ``b`` items (repeated when it has fewer);
    an iterable one gives the first ``b`` it yields (from a fresh iterator, again
    repeated when it runs out). ``collate_fn`` defaults to PyTorch's
    ``default_collate``; ``to_device`` moves the batch where the step runs.
    This is what a batch-size search needs: real samples at any size, without
    building a new ``DataLoader`` for each.
    """
    collate = collate_fn or default_collate
    cached: list[Any] = []

    def samples(b: int) -> list[Any]:
        if hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__"):
            n = len(dataset)
            if n == 0:
                raise VramctlError("the dataset is empty: no batch can be made from it")
            return [dataset[i % n] for i in range(b)]
        while len(cached) < b:
            got = list(itertools.islice(iter(_iterable(dataset)), b))
            if not got:
                raise VramctlError("the dataset yielded nothing: no batch can be made from it")
            cached.extend(got)
            if len(got) < b:  # the whole dataset: repeat it
                cached.extend(itertools.islice(itertools.cycle(got), b - len(cached)))
        return cached[:b]

    def make_batch(b: int) -> Any:
        batch = collate(samples(b))
        return to_device(batch) if to_device is not None else batch

    return make_batch


def _iterable(dataset: Any) -> Iterable[Any]:
    if not isinstance(dataset, Iterable):
        raise VramctlError(
            f"{type(dataset).__name__} is neither a map-style dataset (__getitem__ and __len__) "
            "nor an iterable one"
        )
    return dataset


def loss_of(output: Any) -> torch.Tensor:
    """The loss in a training step's output (:func:`vramctl._step.model_loss`); a tensor of
    any shape is the loss itself: a training step returns its loss."""
    loss = model_loss(output)
    if loss is not None:
        return loss
    if isinstance(output, torch.Tensor):
        return output
    raise VramctlError(
        f"the training step returned {type(output).__name__}, with no loss in it: return the "
        "loss tensor, or a dict or output with a 'loss'"
    )
