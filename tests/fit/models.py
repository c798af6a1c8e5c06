"""Small real models for the fit tests, and a real search for the true largest batch."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from vramctl.device import Device
from vramctl.guard import PeakMeter


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


def fits(
    gpu: Device,
    model: nn.Module,
    step: Callable[[Any], None],
    make_batch: Callable[[int], Any],
    b: int,
    budget: int,
    steps: int = 2,
) -> bool:
    """Run ``steps`` real steps on one batch of ``b``: True when the peak stays within ``budget``.

    The same measurement a probe makes, written out independently of it.
    """
    failed = False
    if gpu.kind == "cuda":
        torch.cuda.empty_cache()
    meter = PeakMeter(gpu)
    try:
        with meter:
            x = make_batch(b)
            for _ in range(steps):
                step(x)
            del x
    except torch.OutOfMemoryError:
        failed = True
    gc.collect()
    model.zero_grad(set_to_none=True)
    if gpu.kind == "cuda":
        torch.cuda.empty_cache()
    return not failed and meter.peak_used <= budget


def true_max(probe: Callable[[int], bool], near: int) -> int:
    """The largest b with ``probe(b)``, by a real search: grow or shrink from ``near``, bisect."""
    lo, hi = 0, None
    b = max(1, near)
    while hi is None or lo == 0:
        if probe(b):
            lo = b
            if hi is not None:
                break
            b = b + max(1, b // 16)
        else:
            hi = b
            if lo:
                break
            b = max(1, b - max(1, b // 16))
            if b == hi:
                break
    assert hi is not None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if probe(mid):
            lo = mid
        else:
            hi = mid
    return lo
