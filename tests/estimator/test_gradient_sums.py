"""Autograd's gradient sums: in place in a plain step, out of place under a dispatch mode.

A weight used twice (a tied embedding) gets two gradients that autograd's engine sums. A
plain step adds the second into the first when the first is a plain tensor referenced
nowhere else; while any ``TorchDispatchMode`` is active (an operator recorder, a debugging
mode) ATen takes every tensor for a subclass and the sum takes new memory. The estimator
models the plain step, and the recorded one under ``sums_out_of_place``; both are checked
against real CPU steps measured by PyTorch's profiler.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from tests.estimator.real_steps import cpu_step_peak
from vramctl.estimator import estimate
from vramctl.estimator._spec import StepSpec
from vramctl.estimator._trace import sums_out_of_place

VOCAB, WIDTH = 32768, 256


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.mid = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mid(self.emb(ids))))


class _Passthrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


def _batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))


def _estimate() -> int:
    return estimate(
        Tied(), _batch(), device="cpu", precision="amp-bf16", mode="train", optimizer="sgd"
    ).peak_allocated


def test_a_recorded_step_holds_the_tied_gradient_twice_and_the_estimate_follows() -> None:
    torch.manual_seed(0)
    spec = StepSpec(precision="amp-bf16", optimizer="sgd")
    plain_real = cpu_step_peak(Tied(), _batch(), spec)
    with _Passthrough():
        recorded_real = cpu_step_peak(Tied(), _batch(), spec)
    grad = VOCAB * WIDTH * 4
    # the premise: the same step under a dispatch mode holds one gradient more
    assert abs(recorded_real - plain_real - grad) < 0.05 * grad
    plain = _estimate()
    with sums_out_of_place():
        recorded = _estimate()
    assert recorded - plain > 0.9 * grad
    # and each estimate is its own step's
    assert abs(plain / plain_real - 1) < 0.02
    assert abs(recorded / recorded_real - 1) < 0.02


def test_the_switch_is_undone_after_an_error() -> None:
    from vramctl.estimator._trace import _INPLACE_SUMS

    try:
        with sums_out_of_place():
            assert _INPLACE_SUMS.get() is False
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert _INPLACE_SUMS.get() is True
