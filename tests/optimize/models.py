"""Small models for the optimize tests (fast on a CPU)."""

from __future__ import annotations

import torch
from torch import nn

import vramctl
from vramctl.device import CpuDevice


def encoder(layers: int = 3, width: int = 32, dropout: float = 0.1) -> nn.TransformerEncoder:
    """A transformer encoder: a ModuleList of identical layers (the repeated blocks)."""
    layer = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=dropout, batch_first=True)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


def mlp() -> nn.Sequential:
    """No repeated blocks: Linear, ReLU, Linear."""
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def convnet() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 2),
    )


class DetHead(nn.Module):
    """A model with an operator that has no bf16 or fp16 CPU kernel (``linalg.det``'s LU)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.proj(x).reshape(-1, 4, 4)
        return torch.linalg.det(m)


class FakeCuda(CpuDevice):
    """A device that says it is a CUDA GPU of a given compute capability, for the choices
    that need one (TF32, cuDNN's benchmark, compile='auto'); nothing runs on it."""

    def __init__(self, capability: str = "8.0") -> None:
        super().__init__()
        self.capability = vramctl.ComputeCapability.parse(capability)
        self.id = "cuda:0"
        self.name = f"Fake GPU (sm{capability})"

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cuda", 0)

    @property
    def is_cuda(self) -> bool:
        return True

    @property
    def is_gpu(self) -> bool:
        return True
