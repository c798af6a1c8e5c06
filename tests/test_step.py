"""The one rule for the loss in a model's output (``vramctl._step.model_loss``), which the
guard, the estimator and the integrations share."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from vramctl._step import model_loss


def _hf_output(loss: torch.Tensor | None, logits: torch.Tensor) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.modeling_outputs.SequenceClassifierOutput(loss=loss, logits=logits)


def test_a_hugging_face_output_gives_its_loss() -> None:
    loss, logits = torch.tensor(1.5), torch.randn(2, 3)
    assert model_loss(_hf_output(loss, logits)) is loss
    assert model_loss(_hf_output(None, logits)) is None  # no labels: no loss


def test_an_object_with_a_loss_attribute_gives_it() -> None:
    class Out:
        loss = torch.tensor(2.0)

    assert model_loss(Out()) is Out.loss


def test_a_mapping_gives_its_loss_key() -> None:
    loss = torch.tensor(0.5)
    assert model_loss({"loss": loss, "logits": torch.randn(2, 2)}) is loss
    assert model_loss({"logits": torch.randn(2, 2)}) is None


def test_a_tuple_whose_first_item_is_a_scalar_gives_it() -> None:
    loss, logits = torch.tensor(0.25), torch.randn(4, 3)
    assert model_loss((loss, logits)) is loss
    assert model_loss([loss, logits]) is loss
    assert model_loss((logits,)) is None  # return_dict=False without labels: logits first
    assert model_loss(()) is None


def test_a_bare_tensor_is_the_loss_only_when_a_scalar() -> None:
    loss = torch.tensor(3.0)
    assert model_loss(loss) is loss
    assert model_loss(torch.randn(4, 3)) is None  # the model's output, not a loss
    assert model_loss(None) is None


def test_loss_fn_is_called_on_the_output_and_the_batch() -> None:
    seen: list[Any] = []

    def loss_fn(out: Any, batch: Any) -> torch.Tensor:
        seen.append((out, batch))
        return torch.tensor(7.0)

    out, batch = {"loss": torch.tensor(1.0)}, torch.ones(2)
    assert float(model_loss(out, batch, loss_fn)) == 7.0  # loss_fn wins over the output's loss
    assert seen == [(out, batch)]


def test_the_guard_trains_on_a_tuple_output_with_the_loss_first() -> None:
    # A Hugging Face model's output with return_dict=False and labels: (loss, logits).
    from vramctl.guard import Guard

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            logits = self.lin(x)
            return logits.square().mean(), logits

    model = Model()
    result = Guard(model).step(torch.randn(6, 4), update=False)
    assert result.batch_size == 6 and model.lin.weight.grad is not None
