"""Composite kernels' intermediates: what a kernel makes and frees inside one operator."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import vramctl
from tests.estimator.real_steps import cpu_infer_peak
from vramctl.estimator import _cpu_kernels
from vramctl.estimator import _trace_step as trace_step
from vramctl.estimator._composite import composite_intermediates

_aten = torch.ops.aten


@pytest.mark.parametrize(
    ("shape", "dim", "dtype"),
    [
        ((2, 4, 64, 64), -1, torch.float32),
        ((3, 5, 7), 1, torch.float32),
        ((2, 8, 33, 48), -1, torch.bfloat16),
        ((16,), 0, torch.float32),
    ],
)
def test_safe_softmax_scratch_is_what_the_real_kernel_takes(
    shape: tuple[int, ...], dim: int, dtype: torch.dtype
) -> None:
    """SDPA's math backend's ``_safe_softmax``: one bool per element and per row, and a
    scalar, on top of its result. Checked against the real CPU kernel, byte for byte."""
    x = torch.zeros(shape, dtype=dtype)
    measured = _cpu_kernels._measure(_aten._safe_softmax.default, (x, dim), {})
    assert measured is not None
    out = torch.empty_like(x)
    made = composite_intermediates(_aten._safe_softmax.default, (x, dim), {}, [out])
    assert sum(made) == measured[0]
    assert composite_intermediates(_aten._softmax.default, (x, dim, False), {}, [out]) == ()


class MathAttention(nn.Module):
    """Causal attention forced onto SDPA's math backend (4 heads of 16 at 512 tokens)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(64, 3 * 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 4, 16).permute(2, 0, 3, 1, 4)
        with sdpa_kernel(SDPBackend.MATH):
            y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).reshape(b, t, 64)


def test_forced_math_attention_holds_its_masks_at_the_softmax(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The math backend's peak is its softmax: the scores, the result and a bool per score
    (2 MiB here, a tenth of the peak). The estimate meets the real forward within 1% (to
    the byte with PyTorch 2.13); without the rule it falls short by the masks."""
    torch.manual_seed(0)
    model, batch = MathAttention().eval(), torch.randn(2, 512, 64)
    truth = cpu_infer_peak(model, batch)
    est = vramctl.estimate(model, batch, mode="infer", device="cpu")
    assert abs(est.logical_peak - truth) / truth < 0.01
    monkeypatch.setattr(trace_step, "composite_intermediates", lambda *a: ())
    without = vramctl.estimate(model, batch, mode="infer", device="cpu")
    assert (truth - without.logical_peak) / truth > 0.05
