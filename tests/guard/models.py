"""Small real models for the guard's tests, each with a batch maker and a loss."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Cnn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1, stride=2),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(8, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 50)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.emb(ids)))


class Lstm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(16, 32, num_layers=2, batch_first=True)
        self.head = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


def _ce(reduction: str) -> Callable[[Any, Any], torch.Tensor]:
    def loss(out: torch.Tensor, batch: Any) -> torch.Tensor:
        _, y = batch
        if out.dim() == 3:  # tokens: (N, L, V) against (N, L)
            return nn.functional.cross_entropy(out.flatten(0, 1), y.flatten(), reduction=reduction)
        return nn.functional.cross_entropy(out, y, reduction=reduction)

    return loss


def make(name: str, n: int, seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """A model (seeded) and a batch of ``n``: (inputs, targets)."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    if name == "mlp":
        return Mlp(), (torch.randn(n, 32, generator=g), torch.randint(0, 10, (n,), generator=g))
    if name == "cnn":
        return Cnn(), (
            torch.randn(n, 3, 16, 16, generator=g),
            torch.randint(0, 10, (n,), generator=g),
        )
    if name == "transformer":
        ids = torch.randint(0, 50, (n, 12), generator=g)
        return Transformer(), (ids, torch.randint(0, 50, (n, 12), generator=g))
    if name == "lstm":
        return Lstm(), (torch.randn(n, 7, 16, generator=g), torch.randint(0, 5, (n,), generator=g))
    raise KeyError(name)


def loss_fn(reduction: str = "mean") -> Callable[[Any, Any], torch.Tensor]:
    return _ce(reduction)


def forward(model: nn.Module) -> Callable[[Any], torch.Tensor]:
    return lambda batch: model(batch[0])
