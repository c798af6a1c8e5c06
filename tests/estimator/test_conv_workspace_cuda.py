"""What the workspace rules rest on, checked on a real GPU: a convolution's forward takes the
same workspace with and without a bias, and a depthwise convolution PyTorch does not send to
cuDNN allocates nothing beyond its outputs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vramctl.estimator._conv_workspace import conv_call, conv_key

pytestmark = pytest.mark.cuda


def _forward_workspace(conv: nn.Module, x: torch.Tensor) -> int:
    """The most bytes a forward held beyond what it kept (its output), as the calibration
    reads a workspace."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        out = conv(x)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before - out.untyped_storage().nbytes()


def test_a_forwards_workspace_does_not_depend_on_its_bias() -> None:
    if torch.backends.cudnn.benchmark:
        pytest.skip("cudnn.benchmark is on: cuDNN times its algorithms, whose workspaces differ")
    x = torch.randn(8, 3, 224, 224, device="cuda")
    with_bias = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=True).cuda()
    without = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False).cuda()
    _forward_workspace(with_bias, x)  # cuDNN's handle and plan made once
    assert _forward_workspace(with_bias, x) == _forward_workspace(without, x)


@pytest.mark.parametrize("dims", [1, 2])
def test_a_depthwise_convolution_off_cudnn_takes_no_workspace(dims: int) -> None:
    cls = nn.Conv1d if dims == 1 else nn.Conv2d
    conv = cls(96, 96, 7, padding=3, groups=96).cuda()
    x = torch.randn((8, 96, 3136) if dims == 1 else (8, 96, 56, 56), device="cuda")
    args = (x, conv.weight, conv.bias, [1] * dims, [3] * dims, [1] * dims, False, [0] * dims, 96)
    call = conv_call(conv_key(torch.ops.aten.convolution.default, args))
    assert call is not None and not call.cudnn
    _forward_workspace(conv, x)
    assert _forward_workspace(conv, x) == 0
    # and its backward: nothing beyond the gradients
    x.requires_grad_(True)
    out = conv(x)
    grad = torch.ones_like(out)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    grads = torch.autograd.grad(out, [x, conv.weight, conv.bias], grad)
    torch.cuda.synchronize()
    held = sum(g.untyped_storage().nbytes() for g in grads)
    # the bias gradient's reduction may stage its blocks' partial sums; no cuDNN workspace
    assert torch.cuda.max_memory_allocated() - before - held < 2**20
