"""Small real models for the fit tests, and the true largest batch, found by real OOMs."""

from __future__ import annotations

import contextlib
import copy
import gc
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

import vramctl


class TokenMlp(nn.Module):
    """An MLP over 16 tokens per sample: about 0.2 MB of activations per sample."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 1024), nn.GELU(), nn.Linear(1024, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class SmallCnn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(2),
            nn.Flatten(),
            nn.Linear(128, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def mlp_batch(b: int) -> torch.Tensor:
    return torch.randn(b, 16, 64)


def cnn_batch(b: int) -> torch.Tensor:
    return torch.randn(b, 3, 32, 32)


def train_step(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[Any], None]:
    def step(x: torch.Tensor) -> None:
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


#: A room of a given budget: ``room(budget, held)`` makes a device on which this process can
#: hold at most ``budget`` bytes, ``held`` (the model and optimizer) counted in it, and yields a
#: function that reads how many allocations its allocator has refused so far.
Room = Callable[[int, list[Any]], AbstractContextManager[Callable[[], int]]]


@contextlib.contextmanager
def simulated(budget: int, held: list[Any]) -> Iterator[Callable[[], int]]:
    """A fresh ``vramctl.simulate(budget)`` holding ``held``: its OOMs are real refusals."""
    with vramctl.simulate(budget) as gpu:
        for obj in held:
            gpu.adopt(obj)
        yield lambda: gpu.ooms


def true_max(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    make_step: Callable[[nn.Module, torch.optim.Optimizer], Callable[[Any], Any]],
    make_batch: Callable[[int], Any],
    budget: int,
    *,
    near: int,
    steps: int = 2,
    room: Room = simulated,
) -> int:
    """The true largest batch: the largest ``b`` whose real steps do not run out of memory.

    Each try starts from the weights and optimizer state the model has now, in a fresh
    ``room(budget, [model, optimizer])`` (by default a simulated GPU of ``budget`` bytes, the
    budget ``fit_batch_size`` targets), and runs ``steps`` real steps of
    ``make_step(model, optimizer)`` on one batch of ``b`` (made inside the room, as a probe
    makes it). It fails when a ``torch.OutOfMemoryError`` comes out, or the room's allocator
    refused an allocation that the step caught (a Guard splits instead of raising). No
    vramctl meter is read: only real OOMs decide. The search gallops from ``near`` (up on a
    success, down on a failure) until a size that runs and a larger one that does not are
    found, then bisects between them. The model and optimizer are left as they were.
    """
    assert vramctl.current_device().kind != "sim", "call it outside any simulated device"
    weights = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    opt_state = copy.deepcopy(_to_cpu(optimizer.state_dict()))

    def restore() -> None:
        model.load_state_dict(weights)
        optimizer.load_state_dict(copy.deepcopy(opt_state))
        model.zero_grad(set_to_none=True)
        optimizer.zero_grad(set_to_none=True)
        gc.collect()

    def runs(b: int) -> bool:
        restore()
        with room(budget, [model, optimizer]) as refused:
            before = refused()
            try:
                step = make_step(model, optimizer)
                x = make_batch(b)
                for _ in range(steps):
                    step(x)
                del x, step
            except torch.OutOfMemoryError:
                return False
            return refused() == before

    try:
        b = max(1, near)
        gap = max(1, b // 8)
        if runs(b):
            lo, hi = b, b + gap
            while runs(hi):
                lo, gap = hi, 2 * gap
                hi = lo + gap
        else:
            lo, hi = max(0, b - gap), b
            while lo > 0 and not runs(lo):
                hi, gap = lo, 2 * gap
                lo = max(0, hi - gap)
        while hi - lo > 1:  # lo runs (or is 0), hi does not
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if runs(mid) else (lo, mid)
        return lo
    finally:
        restore()


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj
