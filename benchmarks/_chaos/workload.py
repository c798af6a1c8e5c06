"""The workload: a fixed seeded dataset, an MLP with AdamW, and the plain training step.

``Tallied`` wraps the model with a zero ``tally``, one entry per sample of a batch,
added to the loss as ``tally[i].mean()`` (``i``: each sample's place in the batch,
carried in the batch as its third tensor). That term changes neither the loss nor
the model's gradients; after the backward pass, ``tally.grad * n`` holds, for each
sample of a batch of ``n``, how many times its loss reached the gradients, however
the step was split (pieces are weighted by their share of the batch): 1 when the
update holds that sample exactly once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class Config:
    """The workload: data, model, batch sizes and how long each loop runs."""

    n_samples: int = 8192
    d_in: int = 32
    width: int = 128
    depth: int = 3
    classes: int = 10
    batch: int = 512
    infer_batch: int = 1024
    epochs: int = 16
    infer_passes: int = 32
    lr: float = 1e-3
    weight_decay: float = 0.01
    seed: int = 0
    checkpoint_every: int = 8
    restart_ticks: int = 10

    @property
    def train_steps(self) -> int:
        return self.epochs * math.ceil(self.n_samples / self.batch)

    @property
    def infer_steps(self) -> int:
        return self.infer_passes * math.ceil(self.n_samples / self.infer_batch)


FULL = Config()
QUICK = replace(FULL, epochs=4, infer_passes=8)
#: On a GPU the tensors are made larger, so that the caching allocator's 2 MiB and
#: 20 MiB segments are small beside the step's need.
CUDA_FULL = replace(FULL, n_samples=65536, width=1024, batch=8192, infer_batch=16384)
CUDA_QUICK = replace(CUDA_FULL, epochs=4, infer_passes=8)


@dataclass
class Data:
    x: torch.Tensor
    y: torch.Tensor
    orders: list[torch.Tensor]


def make_data(cfg: Config) -> Data:
    """A fixed dataset (labels from a noisy linear teacher) and one shuffle per epoch."""
    g = torch.Generator().manual_seed(cfg.seed)
    x = torch.randn(cfg.n_samples, cfg.d_in, generator=g)
    teacher = torch.randn(cfg.d_in, cfg.classes, generator=g)
    y = (x @ teacher + 0.5 * torch.randn(cfg.n_samples, cfg.classes, generator=g)).argmax(1)
    orders = [torch.randperm(cfg.n_samples, generator=g) for _ in range(cfg.epochs)]
    return Data(x, y, orders)


def build_model(cfg: Config) -> nn.Module:
    """An MLP with GELU: no dropout, no BatchNorm, so a batch in pieces is the same step."""
    torch.manual_seed(cfg.seed + 1)
    layers: list[nn.Module] = [nn.Linear(cfg.d_in, cfg.width), nn.GELU()]
    for _ in range(cfg.depth - 1):
        layers += [nn.Linear(cfg.width, cfg.width), nn.GELU()]
    layers.append(nn.Linear(cfg.width, cfg.classes))
    return nn.Sequential(*layers)


def make_optimizer(cfg: Config, model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)


def ce_loss(out: torch.Tensor, batch: Any) -> torch.Tensor:
    return nn.functional.cross_entropy(out, batch[1])


def forward_pair(model: nn.Module, batch: Any) -> torch.Tensor:
    out: torch.Tensor = model(batch[0])  # (inputs, targets) batches
    return out


def plan(n: int, epochs: int, size: int) -> list[tuple[int, int, int]]:
    """(epoch, start, end) of every batch of ``size`` over ``epochs`` passes of ``n`` samples."""
    return [(e, lo, min(lo + size, n)) for e in range(epochs) for lo in range(0, n, size)]


def train_step(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> None:
    """The plain training step, as an unguarded loop writes it."""
    loss = ce_loss(model(x), (x, y))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


class Tallied(nn.Module):
    """The model (``net``, the one the optimizer updates) and a zero ``tally`` beside it."""

    def __init__(self, net: nn.Module, batch: int) -> None:
        super().__init__()
        self.net = net
        self.tally = nn.Parameter(torch.zeros(batch))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out

    def loss(self, out: torch.Tensor, batch: Any) -> torch.Tensor:
        """The cross-entropy, plus 0 whose gradient counts the batch's samples (``batch[2]``)."""
        return ce_loss(out, batch) + self.tally[batch[2]].mean()

    def step(self, opt: torch.optim.Optimizer, batch: Any) -> None:
        """The plain training step, tallied."""
        self.loss(self(batch[0]), batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def counts(self, n: int) -> torch.Tensor:
        """How many times each sample of the last batch (of ``n``) reached the gradients; the
        tally's gradient is cleared for the next step."""
        grad, self.tally.grad = self.tally.grad, None
        if grad is None:
            return torch.zeros(n, dtype=torch.long)
        return (grad[:n].detach().double().cpu() * n).round().long()

    def clear(self) -> None:
        """Forget a failed step's share (a crash, a restart)."""
        self.tally.grad = None


def tallied(cfg: Config) -> Tallied:
    return Tallied(build_model(cfg), cfg.batch)
