"""The shrunk Llama the fine-tuning tests (adapters, quantization) step for real on the CPU."""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

CONFIG = transformers.LlamaConfig(
    vocab_size=1000,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
#: LoRA r=8 on the attention's query and value projections.
QV = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}


def llama() -> Any:
    """A fresh model (seed 0)."""
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(CONFIG)


def batch() -> dict[str, torch.Tensor]:
    """Four sequences of 64 tokens, their own labels."""
    ids = torch.randint(0, CONFIG.vocab_size, (4, 64), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}
