"""CUDA kernels' scratch that a host trace cannot see: the staging buffers of reductions, the
temporary of a softmax's backward, cuBLAS workspaces on a first step."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import vramctl
from vramctl.estimator._cuda_kernels import multiprocessors, reduction_config

H200 = multiprocessors("NVIDIA H200", (9, 0))


def _contiguous(shape: tuple[int, ...]) -> list[int]:
    return [math.prod(shape[i + 1 :]) for i in range(len(shape))]


@pytest.mark.parametrize(
    ("shape", "reduced", "buffer", "semaphores"),
    [
        # ConvNeXt-Tiny training at batch 4 on the H200 (the traced corpus): the pointwise
        # layers' bias gradients over N·H·W rows, and the layer scale's over (N, H, W)
        ((12544, 384), [0], 38535168, 12),
        ((3136, 768), [0], 19267584, 24),
        ((4, 56, 56, 96), [0, 1, 2], 2408448, 8),
        ((4, 28, 28, 192), [0, 1, 2], 4816896, 8),
    ],
)
def test_a_reduction_over_many_rows_takes_the_staging_buffer_the_h200_recorded(
    shape: tuple[int, ...], reduced: list[int], buffer: int, semaphores: int
) -> None:
    cfg = reduction_config(shape, _contiguous(shape), reduced, 4, 4, H200)
    assert (cfg.buffer, cfg.semaphores) == (buffer, semaphores)


@pytest.mark.parametrize(
    ("shape", "reduced"),
    [
        ((512, 768), [0]),  # GPT-2's bias gradients at batch 4 (the H200 recorded none)
        ((4, 1000), [0, 1]),  # a loss's mean: one block reduces it
        ((4, 128, 768), [2]),  # a row's sum: the lanes of a block
    ],
)
def test_a_small_or_row_reduction_takes_none(shape: tuple[int, ...], reduced: list[int]) -> None:
    assert reduction_config(shape, _contiguous(shape), reduced, 4, 4, H200).nbytes == 0


def test_the_layout_follows_the_strides_not_the_shape() -> None:
    # the same reduction over N·H·W of a channels-last NCHW tensor is the (N, H, W, C) one
    shape, strides = (4, 96, 56, 56), [56 * 56 * 96, 1, 56 * 96, 96]
    cl = reduction_config(shape, strides, [0, 2, 3], 4, 4, H200)
    assert cl.buffer == 2408448
    # contiguous NCHW: each channel's inputs are rows apart; a block's lanes share an output
    plain = reduction_config(shape, _contiguous(shape), [0, 2, 3], 4, 4, H200)
    assert plain.buffer != cl.buffer


def test_fewer_multiprocessors_split_an_output_over_fewer_blocks() -> None:
    t4 = multiprocessors("T4-16GB", (7, 5))
    assert t4 == (40, 1024)
    small = reduction_config((12544, 384), [384, 1], [0], 4, 4, t4)
    assert 0 < small.buffer < 38535168
    # a GPU the catalog does not know takes the largest grid: never fewer bytes
    assert multiprocessors("24GiB", None) == (142, 2048)


class _BiasGradient(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(dim=(0, 1, 2))


def test_a_cuda_targets_estimate_holds_the_buffer_during_the_reduction() -> None:
    x = torch.randn(4, 56, 56, 384)
    kw = {"mode": "infer", "calibration": False}
    est = vramctl.estimate(_BiasGradient(), x, device="H200-141GB", **kw)
    # (no matrix product: no cuBLAS workspace)
    assert est.breakdown["workspaces"] == 38535168 + 12
    # the host's reduction needs none
    assert vramctl.estimate(_BiasGradient(), x, device="cpu", **kw).breakdown["workspaces"] == 0


def _allocations(model: nn.Module, x: torch.Tensor, device: str) -> list[tuple[str, int, str]]:
    """``(operator, bytes, category)`` of each allocation in an inference trace, in order."""
    from vramctl import Step
    from vramctl.estimator._rates import RATES
    from vramctl.estimator._session import make_batch_for, open_session

    session = open_session(model, Step(device=device, calibration=False, mode="infer"), RATES)
    try:
        traced = session.trace(*make_batch_for(session, x, None, None, None))
    finally:
        session.close()
    records = traced.trace.records
    return [
        (records[e].op, records[e].nbytes, traced.categories[e])
        for e in traced.trace.events
        if e >= 0 and records[e].op in ("convolution", "sum")
    ]


def test_a_cuda_kernels_scratch_comes_after_its_outputs() -> None:
    # The recorded H200 steps: a convolution allocates its output, then its cuDNN
    # workspace (696 calls); a reduction its output, then its staging buffer (396 calls).
    conv = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(0))
    x = torch.randn(2, 3, 64, 64)
    out = 2 * 8 * 62 * 62 * 4
    gpu = _allocations(conv, x, "H200-141GB")
    assert [(op, cat == "workspaces") for op, _, cat in gpu] == [
        ("convolution", False),
        ("convolution", True),
    ]
    assert gpu[0][1] == out and gpu[1][1] > 0
    reduce = _allocations(_BiasGradient(), torch.randn(4, 56, 56, 384), "H200-141GB")
    assert [(op, cat == "workspaces") for op, _, cat in reduce] == [
        ("sum", False),
        ("sum", True),
    ]
    # A host kernel's scratch (oneDNN's) comes first, as the CPU truth measured it.
    cpu = _allocations(conv, torch.randn(2, 3, 256, 256), "cpu")
    assert [cat == "workspaces" for _, _, cat in cpu] == [True, False]


@pytest.mark.cuda
def test_a_gpus_reduction_allocates_the_modelled_buffer() -> None:
    props = torch.cuda.get_device_properties(0)
    gpu = (props.multi_processor_count, props.max_threads_per_multi_processor)
    x = torch.randn(12544, 384, device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    y = x.sum(0)
    torch.cuda.synchronize()
    scratch = torch.cuda.max_memory_allocated() - base - 384 * 4 - 512  # output, semaphores
    del y
    cfg = reduction_config((12544, 384), [384, 1], [0], 4, 4, gpu)
    assert scratch == cfg.buffer or (cfg.buffer == 0 and scratch <= 0)


# -- a softmax's backward ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("grad", "out", "itemsize"),
    [(torch.float32, torch.float32, 4), (torch.bfloat16, torch.bfloat16, 2)],
)
def test_a_softmax_backward_makes_the_product_of_its_gradient_and_output(
    grad: torch.dtype, out: torch.dtype, itemsize: int
) -> None:
    from vramctl.estimator._cuda_kernels import kernel_intermediates

    g, o = torch.empty(2, 3, 5, dtype=grad), torch.empty(2, 3, 5, dtype=out)
    op = torch.ops.aten._softmax_backward_data.default
    assert kernel_intermediates(op, (g, o, -1, grad), {}, [torch.empty_like(g)]) == (30 * itemsize,)
    assert kernel_intermediates(torch.ops.aten.mul.Tensor, (g, o), {}, [g]) == ()


class _Scores(nn.Module):
    """A softmax over a wide score matrix, and a product with it (attention's shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.proj(x)
        return torch.softmax(q @ q.transpose(1, 2), dim=-1) @ q


def test_a_cuda_targets_softmax_backward_holds_the_product() -> None:
    """The CUDA kernel multiplies the gradient by the output into a temporary first; the
    host's kernel fuses it. A training step whose peak is the softmax's backward holds one
    more score matrix on a GPU."""
    x = torch.randn(8, 512, 64)
    scores = 8 * 512 * 512 * 4
    gpu = vramctl.estimate(_Scores(), x, device="H200-141GB", calibration=False)
    assert gpu.peak_op == "_softmax_backward_data"
    import vramctl.estimator._trace_step as trace_step

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trace_step, "kernel_intermediates", lambda *a: ())
        without = vramctl.estimate(_Scores(), x, device="H200-141GB", calibration=False)
    assert gpu.logical_peak - without.logical_peak == scores


@pytest.mark.cuda
def test_a_gpus_softmax_backward_takes_the_modelled_temporary() -> None:
    from vramctl.estimator._cuda_kernels import kernel_intermediates

    out = torch.softmax(torch.randn(8, 512, 512, device="cuda"), dim=-1)
    grad = torch.randn_like(out)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    gi = torch.ops.aten._softmax_backward_data(grad, out, -1, torch.float32)
    torch.cuda.synchronize()
    made = torch.cuda.max_memory_allocated() - base - gi.untyped_storage().nbytes()
    op = torch.ops.aten._softmax_backward_data.default
    assert (made,) == kernel_intermediates(op, (grad, out, -1, torch.float32), {}, [gi])


# -- cuBLAS workspaces on a first step ---------------------------------------------------


class _HeadAtTheEnd(nn.Module):
    """Elementwise work with a large temporary, then the one matrix product: a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head((x.exp() * 2).mean(dim=1))


def test_a_first_step_makes_each_cublas_workspace_at_its_first_product() -> None:
    from vramctl.estimator._cuda_kernels import CUBLAS_WORKSPACE, first_step
    from vramctl.estimator._trace import StorageRecord, Trace

    def rec(op: str, phase: str, n: int = 100) -> StorageRecord:
        return StorageRecord(n, op, "", phase)

    records = [
        rec(CUBLAS_WORKSPACE, "setup", 1000),  # the forward thread's handle
        rec(CUBLAS_WORKSPACE, "setup", 1000),  # autograd's device thread's
        rec("exp", "forward"),
        rec("addmm", "forward"),
        rec("mul", "backward"),
        rec("mm", "backward"),
        rec("mm", "backward"),
    ]
    trace = Trace(events=[0, 1, 2, 3, ~2, 4, 5, 6], records=records)
    assert first_step(trace).events == [2, 3, 0, ~2, 4, 5, 1, 6]
    assert trace.events == [0, 1, 2, 3, ~2, 4, 5, 6]  # the loop's trace is left as it was
    # a handle no product ran on keeps its place (as the loop's)
    no_products = Trace(events=[0, 2, ~2], records=records)
    assert first_step(no_products).events == [0, 2, ~2]


def test_a_cuda_estimates_first_step_peaks_before_its_cublas_workspace() -> None:
    x = torch.randn(64, 512, 256)
    kw = {"mode": "infer", "calibration": False}
    est = vramctl.estimate(_HeadAtTheEnd(), x, device="H200-141GB", **kw)
    cublas = 4096 * 1024 * 8  # one handle's, from Hopper (``:4096:8``)
    lt = 1024 * 1024  # cuBLASLt's, made by the head's bias product (``addmm``)
    # the loop holds the workspaces throughout; the first step makes them after its peak
    assert est.first_step_peak_allocated is not None
    assert est.peak_allocated - est.first_step_peak_allocated == cublas + lt
    assert any("first step allocates" in n for n in est.notes)
    # and reserves: no segment of its own for them while the activations are live; the
    # model's state (its weights and the batch, 32 MiB) is made in 34 MiB of segments
    assert est.first_step_peak_reserved is not None and est.state_reserved is not None
    assert est.peak_reserved - est.first_step_peak_reserved == 32 * 2**20
    assert est.state_reserved == 34 * 2**20
    # where the product comes first, its workspace is live at the first step's peak too
    first = nn.Sequential(nn.Linear(256, 256), _HeadAtTheEnd())
    est = vramctl.estimate(first, x, device="H200-141GB", **kw)
    assert est.first_step_peak_allocated == est.peak_allocated
    assert est.first_step_peak_reserved == est.peak_reserved
    host = vramctl.estimate(_HeadAtTheEnd(), x, device="cpu", **kw)
    assert host.first_step_peak_allocated is None
    assert host.first_step_peak_reserved is None and host.state_reserved is None


class _WideHead(nn.Module):
    """A 48 MiB temporary freed before the one matrix product: the product's 32 MiB cuBLAS
    workspace is cut from the temporary's free block on a process's first step."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x.exp().mean(dim=1))


def test_a_loop_begins_with_the_first_step_that_makes_its_cublas_workspace() -> None:
    """The steps after a first step are served from the blocks it left: its cuBLAS workspace
    took 32 MiB of the 48 MiB block the temporary had freed, so the second step's temporary
    takes a segment of its own. A loop whose workspace was held from its start would reserve
    16 MiB less (32 MiB beside one 48 MiB segment)."""
    x = torch.randn(64, 768, 256)  # 48 MiB
    est = vramctl.estimate(_WideHead(), x, device="H200-141GB", mode="infer", calibration=False)
    assert est.first_step_peak_reserved is not None and est.state_reserved is not None
    assert est.first_step_peak_reserved - est.state_reserved == 48 * 2**20
    assert est.peak_reserved - est.first_step_peak_reserved == 48 * 2**20


def _fresh_on_gpu(
    model: nn.Module, shape: tuple[int, ...]
) -> tuple[nn.Module, torch.Tensor, vramctl.Estimate, int]:
    """``model`` and a batch of ``shape`` on the GPU, the estimate of its inference, and
    what earlier tests left reserved; the cuBLAS workspaces and the cache then emptied, as
    a fresh process has them before its first step."""
    torch.cuda.empty_cache()
    held = torch.cuda.memory_reserved()
    model = model.cuda()
    x = torch.randn(*shape, device="cuda")
    est = vramctl.estimate(model, x, device="cuda:0", mode="infer", calibration=False)
    torch.cuda.synchronize()
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None:
        pytest.skip("this PyTorch cannot free its cuBLAS workspaces")
    clear()
    torch.cuda.empty_cache()
    return model, x, est, held


@pytest.mark.cuda
def test_a_gpus_first_step_peaks_as_estimated_before_its_cublas_workspace() -> None:
    model, x, est, held = _fresh_on_gpu(_HeadAtTheEnd(), (64, 512, 256))
    state = torch.cuda.memory_reserved() - held
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        model(x)
    torch.cuda.synchronize()
    first = torch.cuda.max_memory_allocated()
    first_reserved = torch.cuda.max_memory_reserved() - held
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        model(x)
    torch.cuda.synchronize()
    later = torch.cuda.max_memory_allocated()
    assert est.first_step_peak_allocated is not None
    assert abs(first - est.first_step_peak_allocated) <= 0.01 * first
    # the segments the weights and the batch were made in, and the first step's reserved
    # peak from them (this process made nothing else before)
    assert est.state_reserved is not None and est.first_step_peak_reserved is not None
    assert abs(state - est.state_reserved) <= 2 * 2**20
    assert abs(first_reserved - est.first_step_peak_reserved) <= 2 * 2**20
    assert later > first  # the workspace, held from the second step's start


@pytest.mark.cuda
def test_a_gpus_loop_reserves_as_estimated_after_its_first_step() -> None:
    model, x, est, held = _fresh_on_gpu(_WideHead(), (64, 768, 256))
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        for _ in range(3):
            model(x)
    torch.cuda.synchronize()
    assert abs(torch.cuda.max_memory_reserved() - held - est.peak_reserved) <= 2 * 2**20
