"""CUDA's autocast rules on a CPU trace."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import vramctl
from vramctl.estimator._autocast import CUDA_FP32, CUDA_FP32_SET_OPT_DTYPE, CudaAutocast


def test_cuda_fp32_operators_run_in_fp32_and_matmuls_stay_low() -> None:
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    labels = torch.zeros(4, dtype=torch.long)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = F.layer_norm(F.linear(x, w), (8,))
        with CudaAutocast():
            h = F.linear(x, w)
            got = {
                "linear": h.dtype,
                "layer_norm": F.layer_norm(h, (8,)).dtype,
                "rms_norm": F.rms_norm(h, (8,)).dtype,
                "softmax": h.softmax(-1).dtype,
                "F.softmax": F.softmax(h, -1).dtype,
                "exp": torch.exp(h).dtype,
                "pow": (h**2).dtype,
                "sum": h.sum(-1).dtype,
                "cross_entropy": F.cross_entropy(h, labels).dtype,
                "explicit dtype": h.softmax(-1, dtype=torch.bfloat16).dtype,
            }
            with torch.autocast("cpu", enabled=False):
                got["autocast off"] = F.layer_norm(h, (8,)).dtype
    assert plain.dtype == torch.bfloat16  # the CPU policy alone keeps the norm low
    low = {"linear", "explicit dtype", "autocast off"}
    if "rms_norm" not in CUDA_FP32:  # before PyTorch 2.12, CUDA autocast leaves it low too
        low.add("rms_norm")
    for op, dtype in got.items():
        assert dtype == (torch.bfloat16 if op in low else torch.float32), op


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(256, 256)
        self.norm = nn.LayerNorm(256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.fc(x))
        return (h @ h.transpose(-1, -2)).softmax(-1) @ h


def test_a_cuda_target_traces_norms_and_softmax_in_fp32() -> None:
    batch = torch.randn(8, 128, 256)
    kw = {"mode": "infer", "precision": "amp-bf16"}
    cpu = vramctl.estimate(Block(), batch, device="cpu", **kw)
    gpu = vramctl.estimate(Block(), batch, device="A10G-24GB", **kw)
    # The softmax output (8 x 128 x 128) is fp32 on CUDA: 4 bytes an element, not 2.
    # (The GPU's logical peak also holds the cuBLAS workspace, which the CPU's does not.)
    traced = gpu.logical_peak - gpu.breakdown["workspaces"]
    assert traced - cpu.logical_peak >= 8 * 128 * 128 * 2
    assert any("CUDA's fp32 rules" in n for n in gpu.notes)


def _header_names(macro: str) -> set[str] | None:
    header = Path(torch.__file__).parent / "include" / "ATen" / "autocast_mode.h"
    if not header.exists():
        return None
    text = header.read_text()
    start = text.find(f"#define {macro}(_)")
    if start < 0:
        return None
    block = text[start : text.find("\n\n", start)]
    return set(re.findall(r"_\((\w+)", block))


@pytest.mark.parametrize(
    ("macro", "ours"),
    [("AT_FORALL_FP32", CUDA_FP32), ("AT_FORALL_FP32_SET_OPT_DTYPE", CUDA_FP32_SET_OPT_DTYPE)],
)
def test_the_lists_match_the_installed_pytorch(macro: str, ours: frozenset[str]) -> None:
    names = _header_names(macro)
    if names is None:
        pytest.skip("this PyTorch install ships no ATen headers")
    assert names <= ours, f"{macro} has operators vramctl does not list: {names - ours}"
    # Operators that joined the list in a recent PyTorch follow the installed one.
    assert ("rms_norm" in names) == ("rms_norm" in ours) or macro != "AT_FORALL_FP32"


@pytest.mark.cuda
def test_the_emulation_gives_the_dtypes_cuda_autocast_gives() -> None:
    torch.manual_seed(0)
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    labels = torch.zeros(4, dtype=torch.long)
    cases = {
        "layer_norm": lambda h: F.layer_norm(h, (8,)),
        "rms_norm": lambda h: F.rms_norm(h, (8,)),
        "group_norm": lambda h: F.group_norm(h.view(4, 8, 1), 2),
        "softmax": lambda h: h.softmax(-1),
        "log_softmax": lambda h: F.log_softmax(h, -1),
        "exp": torch.exp,
        "pow": lambda h: h.pow(2),
        "rsqrt": torch.rsqrt,
        "sum": lambda h: h.sum(-1),
        "cumsum": lambda h: h.cumsum(-1),
        "cross_entropy": lambda h: F.cross_entropy(h, labels.to(h.device)),
        "mse_loss": lambda h: F.mse_loss(h, torch.zeros_like(h)),
        "gelu": F.gelu,
        "matmul": lambda h: h @ h.t(),
    }
    for name, fn in cases.items():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            real = fn(F.linear(x.cuda(), w.cuda())).dtype
        with torch.autocast("cpu", dtype=torch.bfloat16), CudaAutocast():
            emulated = fn(F.linear(x, w)).dtype
        assert emulated == real, name


class _Attention(nn.Module):
    """One attention block on ``F.scaled_dot_product_attention``."""

    def __init__(self, width: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, w = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, w // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.out(y.transpose(1, 2).reshape(b, n, w))


def _attention_peak(backend: object | None, device: str = "A10G-24GB") -> int:
    from torch.nn.attention import sdpa_kernel

    x = torch.randn(2, 512, 64)
    kw = {"mode": "infer", "precision": "amp-bf16", "device": device}
    if backend is None:
        return vramctl.estimate(_Attention(), x, **kw).peak_allocated
    with sdpa_kernel(backend):  # type: ignore[arg-type]
        return vramctl.estimate(_Attention(), x, **kw).peak_allocated


def test_a_cuda_target_takes_the_attention_backend_the_caller_forced() -> None:
    from torch.nn.attention import SDPBackend

    fused = _attention_peak(None)
    # math keeps the whole score matrix, in fp32 from bf16 inputs (as CUDA does):
    # 2 x 4 heads x 512 x 512 x 4 bytes = 8 MiB of scores, and their softmax
    math = _attention_peak(SDPBackend.MATH)
    assert math - fused >= 2 * 4 * 512 * 512 * 4
    # a GPU's fused backend alone has no host kernel: traced as the host's fused one
    assert _attention_peak(SDPBackend.EFFICIENT_ATTENTION) == fused
    assert _attention_peak(SDPBackend.CUDNN_ATTENTION) == fused
    # the CPU target runs the host's own choice, untouched
    assert _attention_peak(SDPBackend.MATH, "cpu") > _attention_peak(None, "cpu")


@pytest.mark.cuda
def test_the_forced_math_backend_costs_on_a_gpu_what_the_estimate_adds() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def real(backend: SDPBackend) -> int:
        torch.manual_seed(0)
        model = _Attention().cuda()
        x = torch.randn(2, 512, 64, device="cuda")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.no_grad(), sdpa_kernel(backend), torch.autocast("cuda", torch.bfloat16):
            model(x)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    measured = real(SDPBackend.MATH) - real(SDPBackend.EFFICIENT_ATTENTION)
    predicted = _attention_peak(SDPBackend.MATH) - _attention_peak(None)
    assert abs(predicted - measured) <= 0.05 * measured
