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


def _dropout_bytes(p: float, device: str) -> float:
    """Bytes a dropout layer adds to a training step's peak, per element it drops."""

    def peak(rate: float) -> int:
        model = nn.Sequential(nn.Linear(256, 256), nn.Dropout(rate), nn.Linear(256, 256))
        return vramctl.estimate(
            model,
            torch.randn(4096, 256),
            device=device,
            mode="train",
            loss_fn=lambda out, _batch: out.square().mean(),
        ).logical_peak

    return (peak(p) - peak(0.0)) / (4096 * 256)


def test_a_cuda_target_keeps_dropout_a_one_byte_mask() -> None:
    # CUDA's fused kernel keeps a bool mask for backward; the host keeps fp32 noise
    assert _dropout_bytes(0.1, "A10G-24GB") == 1.0
    assert _dropout_bytes(0.1, "cpu") == 4.0


class _DroppedAttention(nn.Module):
    """Attention with dropout, and optionally a learned bias as its mask."""

    def __init__(self, p: float, learned_mask: bool = False) -> None:
        super().__init__()
        self.p = p
        self.qkv = nn.Linear(64, 192)
        self.bias = nn.Parameter(torch.zeros(1, 4, 256, 256)) if learned_mask else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (t.transpose(1, 2) for t in self.qkv(x).view(b, n, 3, 4, 16).unbind(2))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias, dropout_p=self.p)


def _attention_train_peak(p: float, device: str, learned_mask: bool = False) -> int:
    return vramctl.estimate(
        _DroppedAttention(p, learned_mask),
        torch.randn(8, 256, 64),
        device=device,
        mode="train",
        loss_fn=lambda out, _batch: out.square().mean(),
    ).logical_peak


def test_a_cuda_target_runs_attention_dropout_in_the_fused_kernel() -> None:
    # CUDA's fused kernels drop with a random seed, no mask: the same peak as without
    assert _attention_train_peak(0.1, "A10G-24GB") == _attention_train_peak(0.0, "A10G-24GB")
    # the host's fused kernel takes no dropout: the host target keeps the math path's scores
    scores = 8 * 4 * 256 * 256 * 4
    assert _attention_train_peak(0.1, "cpu") - _attention_train_peak(0.0, "cpu") >= scores
    # a mask that needs a gradient sends CUDA to the math path too (T5's position bias)
    learned = _attention_train_peak(0.1, "A10G-24GB", learned_mask=True)
    assert learned - _attention_train_peak(0.1, "A10G-24GB") >= scores


def test_cross_entropy_takes_its_log_softmax_in_the_logits_dtype_as_cuda_does() -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: dict[str, list[torch.dtype]] = {}

    class Dtypes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            name = func.overloadpacket.__name__
            if name in ("_log_softmax", "nll_loss_forward", "_log_softmax_backward_data"):
                seen[name] = [a.dtype for a in args if isinstance(a, torch.Tensor)]
            return func(*args, **(kwargs or {}))

    logits = torch.randn(8, 100, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 100, (8,))
    with torch.autocast("cpu", dtype=torch.bfloat16), CudaAutocast(), Dtypes():
        loss = F.cross_entropy(logits, labels)
        loss.backward()
    assert loss.dtype == torch.float32
    assert seen["_log_softmax"] == [torch.bfloat16]  # ATen passes the logits' dtype
    assert seen["nll_loss_forward"][0] == torch.float32  # NLL is an fp32 operator
    assert seen["_log_softmax_backward_data"][0] == torch.bfloat16


@pytest.mark.cuda
def test_dropout_on_a_gpu_keeps_what_the_estimate_keeps() -> None:
    def kept(rate: float) -> int:
        torch.manual_seed(0)
        layer = nn.Linear(256, 256).cuda()
        x = torch.randn(4096, 256, device="cuda")
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        out = F.dropout(layer(x), rate, training=True)
        held = torch.cuda.memory_allocated() - base
        del out
        return held

    assert (kept(0.1) - kept(0.0)) / (4096 * 256) == _dropout_bytes(0.1, "A10G-24GB")


class _CheckpointedDropout(nn.Module):
    """A checkpointed block with dropout and attention dropout: backward recomputes both."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 64)
        self.attention = _DroppedAttention(0.1)

    def block(self, x: torch.Tensor) -> torch.Tensor:
        return self.attention(F.dropout(self.fc(x), 0.1, training=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        out: torch.Tensor = checkpoint(self.block, x, use_reentrant=False)
        return out


@pytest.mark.parametrize("precision", ["fp32", "amp-bf16"])
def test_a_checkpointed_block_recomputes_with_the_cuda_rules(precision: str) -> None:
    # the recomputation must keep what the forward kept (a bool mask, no attention mask):
    # the checkpoint refuses recomputed tensors whose metadata differ
    est = vramctl.estimate(
        _CheckpointedDropout(),
        torch.randn(8, 256, 64),
        device="A10G-24GB",
        mode="train",
        precision=precision,
        loss_fn=lambda out, _batch: out.square().mean(),
    )
    assert est.peak_allocated > 0


def test_concurrent_estimates_leave_the_checkpoints_recomputation_as_it_was() -> None:
    import threading

    import torch.utils.checkpoint as checkpoint

    original = checkpoint._run_fn_with_dynamo_disabled
    to, cuda, resize = nn.Module.to, nn.Module.cuda, torch.UntypedStorage.resize_
    errors: list[BaseException] = []

    def run(device: str) -> None:
        try:
            for _ in range(3):
                vramctl.estimate(
                    _CheckpointedDropout(),
                    torch.randn(2, 256, 64),
                    device=device,
                    mode="train",
                    loss_fn=lambda out, _batch: out.square().mean(),
                )
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(d,)) for d in ("A10G-24GB", "cpu", "T4-16GB")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert checkpoint._run_fn_with_dynamo_disabled is original
    # (each trace's replacements of these were restored out of order before: a later
    # `module.to("cpu")` in the process skipped `_apply`, and bitsandbytes never quantized)
    assert (nn.Module.to, nn.Module.cuda, torch.UntypedStorage.resize_) == (to, cuda, resize)
    # a host step afterwards recomputes as the host (no CUDA rule left behind)
    run("cpu")
    assert not errors, errors
