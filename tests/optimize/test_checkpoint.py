"""Activation checkpointing: the blocks found, memory by the estimator, exact gradients."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
from torch import nn

import vramctl
from tests.optimize.models import encoder, mlp
from vramctl.optimize import OptimizeError, apply_checkpointing, find_blocks


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.norm(self.fc(x)))


def staged() -> nn.Module:
    """Stages (a ResNet's layer1..layer3) of blocks, the last stage the widest."""
    return nn.Sequential(
        nn.Sequential(Block(8), Block(8)),
        nn.Sequential(Block(8), Block(8), Block(8)),
        nn.Linear(8, 8),
    )


def test_find_blocks_are_the_encoder_layers() -> None:
    model = encoder(layers=3)
    assert find_blocks(model) == list(model.layers)


def test_find_blocks_takes_every_stage_of_the_block_type() -> None:
    model = staged()
    blocks = find_blocks(model)
    assert [type(b) for b in blocks] == [Block] * 5
    assert blocks == [*model[0], *model[1]]


def test_find_blocks_skips_bare_layers() -> None:
    assert find_blocks(mlp()) == []
    assert find_blocks(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))) == []


def test_no_repeated_blocks_is_a_clear_error() -> None:
    with pytest.raises(OptimizeError, match="no repeated blocks"):
        apply_checkpointing(mlp(), "selective")
    with pytest.raises(OptimizeError, match="checkpointing must be one of"):
        apply_checkpointing(encoder(), "half")


def test_undo_restores_the_model_exactly() -> None:
    model = encoder()
    mine = model.layers[1].forward  # an instance forward of the user's own
    model.layers[1].forward = mine
    for kind in ("selective", "full"):
        undo = apply_checkpointing(model, kind)
        assert all("forward" in layer.__dict__ for layer in model.layers)
        assert model.layers[1].forward is not mine
        undo()
        assert "forward" not in model.layers[0].__dict__
        assert "forward" not in model.layers[2].__dict__
        assert model.layers[1].__dict__["forward"] is mine


def test_a_copy_checkpoints_its_own_blocks() -> None:
    model = encoder()
    apply_checkpointing(model, "full")
    clone = copy.deepcopy(model)
    assert clone.layers[0].forward.module is clone.layers[0]
    assert clone.layers[0].forward.module is not model.layers[0]


def _activations(model: nn.Module, batch: object, kind: str, device: str) -> int:
    undo = apply_checkpointing(model, kind)
    try:
        est = vramctl.estimate(model, batch, device=device)
    finally:
        undo()
    return est.breakdown["activations"]


@pytest.mark.parametrize("device", ["cpu", "A10G-24GB"])
def test_estimator_orders_activations_none_selective_full(device: str) -> None:
    model = encoder(layers=4, width=64)
    x = torch.randn(8, 128, 64)
    none, selective, full = (
        _activations(model, x, k, device) for k in ("none", "selective", "full")
    )
    assert none > selective > full
    # Full checkpointing keeps each block's input (8 x 128 x 64 fp32 = 256 KiB) and little else.
    assert full < none / 10


def _grads(model: nn.Module, x: torch.Tensor, kind: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    m = copy.deepcopy(model)
    apply_checkpointing(m, kind)
    m.train()
    torch.manual_seed(7)  # the dropout masks: the recomputation must draw the same ones
    loss = m(x).square().mean()
    loss.backward()
    return loss.detach(), [p.grad for p in m.parameters() if p.grad is not None]


@pytest.mark.parametrize("kind", ["selective", "full"])
def test_a_checkpointed_step_has_the_same_gradients(kind: str) -> None:
    torch.manual_seed(0)
    model = encoder(layers=3, width=32, dropout=0.1)
    x = torch.randn(4, 16, 32)
    loss0, g0 = _grads(model, x, "none")
    loss, g = _grads(model, x, kind)
    torch.testing.assert_close(loss, loss0)
    assert len(g) == len(g0) == len(list(model.parameters()))
    for a, b in zip(g, g0, strict=True):
        torch.testing.assert_close(a, b)


def test_no_grad_runs_the_blocks_unwrapped() -> None:
    model = encoder()
    calls = []
    real = torch.utils.checkpoint.checkpoint

    def spy(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return real(*args, **kwargs)

    apply_checkpointing(model, "full")
    with pytest.MonkeyPatch.context() as mp:
        # By the module: ``vramctl.optimize`` as an attribute is the function.
        mp.setattr(importlib.import_module("vramctl.optimize._checkpoint"), "checkpoint", spy)
        with torch.no_grad():
            model(torch.randn(2, 5, 32))
        assert calls == []
        model(torch.randn(2, 5, 32))
        assert len(calls) == 3


def test_transformers_model_uses_its_own_checkpointing() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        n_layer=3,
        n_embd=32,
        n_head=4,
        vocab_size=128,
        n_positions=64,
        eos_token_id=0,
        bos_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    assert [type(b).__name__ for b in find_blocks(model)] == ["GPT2Block"] * 3
    ids = torch.randint(0, 128, (2, 32))
    batch = {"input_ids": ids, "labels": ids}

    undo = apply_checkpointing(model, "full")
    assert model.is_activation_checkpointing
    assert not any("forward" in m.__dict__ for m in model.modules())
    undo()
    assert not model.is_activation_checkpointing
    assert "_require_grads_hook" not in model.__dict__
    assert model.config.use_cache

    none, selective, full = (
        _activations(model, batch, k, "cpu") for k in ("none", "selective", "full")
    )
    assert none > selective > full

    def grads(kind: str) -> list[torch.Tensor]:
        m = copy.deepcopy(model)
        apply_checkpointing(m, kind)
        m.train()
        torch.manual_seed(3)
        m(**batch).loss.backward()
        return [p.grad for p in m.parameters()]

    g0 = grads("none")
    for kind in ("selective", "full"):
        for a, b in zip(grads(kind), g0, strict=True):
            torch.testing.assert_close(a, b)
