"""int8 dynamic quantization of a model's ``nn.Linear`` layers, for inference on the CPU."""

from __future__ import annotations

import importlib
import warnings

import torch
from torch import nn

__all__ = ["LINEAR_SHARE", "linear_share", "quantize_dynamic_int8"]

#: The share of a model's weights its ``nn.Linear`` layers must hold for int8 to pay off.
LINEAR_SHARE = 0.5


def linear_share(model: nn.Module) -> tuple[int, float]:
    """Weights of ``model``'s ``nn.Linear`` layers and their share of all its parameters."""
    linear = sum(m.weight.numel() for m in model.modules() if type(m) is nn.Linear)
    total = sum(p.numel() for p in model.parameters())
    return linear, (linear / total if total else 0.0)


def quantize_dynamic_int8(model: nn.Module) -> str | None:
    """Quantize ``model``'s ``nn.Linear`` layers to int8 in place (weights int8, activations
    quantized per batch) with ``torch.ao.quantization.quantize_dynamic``; None when done,
    else why it could not be."""
    if torch.backends.quantized.engine == "none":
        return "this PyTorch build has no quantized CPU engine"
    try:
        with warnings.catch_warnings():
            # torch.ao.quantization announces its move to torchao on import and use.
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.filterwarnings("ignore", "torch.quantize_per_tensor", UserWarning)
            quantization = importlib.import_module("torch.ao.quantization")
            quantize = getattr(quantization, "quantize_dynamic", None)
            if quantize is None:
                return (
                    "this PyTorch has no torch.ao.quantization.quantize_dynamic (moved to "
                    "torchao, whose int8 kernels pay off under torch.compile: use "
                    "torchao.quantization.quantize_ yourself)"
                )
            quantize(model, {nn.Linear}, dtype=torch.qint8, inplace=True)
    except ImportError:
        return "this PyTorch has no torch.ao.quantization"
    return None
