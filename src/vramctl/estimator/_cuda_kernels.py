"""Scratch memory of PyTorch's CUDA kernels that a host trace cannot see.

A trace runs on the host; where a CUDA kernel asks the caching allocator for scratch that
the host's kernel does not, the estimate for a CUDA target adds it as a workspace around
the operator (:class:`~vramctl.estimator._trace.Tracer`'s ``workspace`` hook), made after
the operator's outputs: the recorded H200 steps' convolutions allocate their output, then
cuDNN's workspace (696 calls), and their reductions their output, then the staging buffer
and semaphores (396 calls).

**Reductions.** ``sum`` and ``mean`` run ATen's ``gpu_reduce_kernel`` on CUDA
(``aten/src/ATen/native/cuda/Reduce.cuh``). Where one output's inputs are many and the
outputs few, it splits each output's inputs over several thread blocks
(``ctas_per_output``) and reduces their partial results through a staging buffer in
global memory, allocated from the caching allocator for the call and freed when it
returns, with a semaphore per block column. Its size follows the launch configuration
(``setReduceConfig``), which follows the iterator's layout of the input (its dimensions
reordered by stride and coalesced, as ``TensorIterator`` does) and the GPU's
multiprocessors. A reduction over the rows of a channels-last activation (a layer
scale's or a bias's gradient over N·H·W) takes tens of MiB: on an H200, ConvNeXt-Tiny's
first-stage bias gradients at batch 4 took 38.5 MB for a 1.5 KB output. This module
replays that configuration; the sizes it gives are the recorded ones.

**cuBLAS workspaces on a first step.** PyTorch gives each (thread, stream) cuBLAS handle a
workspace from the caching allocator, made by the first matrix product that thread runs
and kept for the process's life: one for the thread that runs the forward, one for
autograd's device thread in a training step. A loop's later steps hold both from their
start, as the estimate does; a first step makes each at its first product, which can come
after the step's peak (ResNet-50's one product is its classifier, at its end).
:func:`first_step` moves them there.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vramctl._errors import VramctlError
from vramctl.device import gpu_spec
from vramctl.estimator._trace import Trace

__all__ = [
    "CUBLASLT_WORKSPACE",
    "CUBLAS_WORKSPACE",
    "ReductionScratch",
    "first_step",
    "kernel_intermediates",
    "multiprocessors",
    "reduction_config",
    "reduction_scratch",
    "without_idle_cublas",
]

_aten = torch.ops.aten

#: The reductions whose scratch is modelled: the operator and where its ``dim`` is.
_REDUCTIONS = {
    _aten.sum.dim_IntList: 1,
    _aten.sum.default: None,
    _aten.mean.dim: 1,
    _aten.mean.default: None,
}
#: Resident threads per multiprocessor by compute capability (CUDA programming guide).
_THREADS_PER_SM = {(7, 0): 2048, (7, 5): 1024, (8, 6): 1536, (8, 9): 1536, (12, 0): 1536}
#: For a GPU not in the catalog: the largest grid any catalog GPU launches (more blocks
#: per output, a larger buffer), so that the scratch is not under-counted.
_UNKNOWN = (142, 2048)
MAX_NUM_THREADS = 512
WARP = 32


def multiprocessors(name: str, capability: tuple[int, int] | None) -> tuple[int, int]:
    """``(multiprocessors, resident threads per multiprocessor)`` of a target GPU."""
    try:
        sms = gpu_spec(name).multiprocessors
    except (VramctlError, ValueError):
        sms = 0
    if not sms:
        return _UNKNOWN
    return sms, _THREADS_PER_SM.get(capability or (9, 0), 2048)


def _iterator_layout(
    shape: Sequence[int], strides: Sequence[int], reduced: set[int]
) -> tuple[list[int], list[int], list[int]]:
    """The dimensions ``TensorIterator`` runs a reduction over, innermost first: sizes, the
    input's strides and the output's (0 on reduced dimensions), all in elements. The
    output is contiguous over the kept dimensions; dimensions are ordered as
    ``reorder_dimensions`` orders them (reduced ones first, then by the output's and the
    input's strides) and merged as ``coalesce_dimensions`` merges them."""
    ndim = len(shape)
    out = [0] * ndim
    step = 1
    for d in reversed(range(ndim)):
        if d not in reduced:
            out[d] = step
            step *= shape[d]
    operands = (out, list(strides))

    def should_swap(d0: int, d1: int) -> int:
        for i, st in enumerate(operands):
            s0, s1 = st[d0], st[d1]
            if i == 0 and (s0 == 0) != (s1 == 0):  # the output: reduced dimensions first
                return 1 if s1 == 0 else -1
            if s0 == 0 or s1 == 0:
                continue
            if s0 < s1:
                return -1
            if s0 > s1:
                return 1
            if shape[d0] > shape[d1]:
                return 1
        return 0

    perm = list(reversed(range(ndim)))
    for i in range(1, ndim):
        d1 = i
        for d0 in range(i - 1, -1, -1):
            c = should_swap(perm[d0], perm[d1])
            if c > 0:
                perm[d0], perm[d1] = perm[d1], perm[d0]
                d1 = d0
            elif c < 0:
                break
    sizes = [shape[p] for p in perm]
    st = [[op[p] for p in perm] for op in operands]
    if not sizes:
        return [], [], []
    prev = 0
    for d in range(1, len(sizes)):
        if sizes[prev] == 1 or sizes[d] == 1 or all(sizes[prev] * s[prev] == s[d] for s in st):
            if sizes[prev] == 1:
                for s in st:
                    s[prev] = s[d]
            sizes[prev] *= sizes[d]
        else:
            prev += 1
            if prev != d:
                for s in st:
                    s[prev] = s[d]
                sizes[prev] = sizes[d]
    n = prev + 1
    return sizes[:n], st[1][:n], st[0][:n]


@dataclass(frozen=True)
class ReductionScratch:
    """One reduction's launch, as ``setReduceConfig`` plans it, and the scratch it takes."""

    num_outputs: int
    inputs_per_output: int
    block: tuple[int, int]
    output_vec_size: int
    ctas_per_output: int
    #: The staging buffer for the partial results of an output's blocks, in bytes.
    buffer: int
    #: The blocks' semaphores, in bytes.
    semaphores: int

    @property
    def nbytes(self) -> int:
        return self.buffer + self.semaphores


def reduction_config(
    shape: Sequence[int],
    strides: Sequence[int],
    reduced: Sequence[int],
    element_size: int,
    acc_size: int,
    multiprocessors: tuple[int, int],
    storage_offset: int = 0,
    vt0: int = 4,
) -> ReductionScratch:
    """The launch of a reduction of a tensor (``shape``, ``strides`` in elements) over the
    dimensions ``reduced``, whose elements are ``element_size`` bytes and accumulate in
    ``acc_size`` bytes, on a GPU of ``multiprocessors`` (count, threads each)."""
    sizes, in_st, out_st = _iterator_layout(shape, strides, set(reduced))
    numel = math.prod(shape)
    reduce_dims = 0
    while reduce_dims < len(sizes) and out_st[reduce_dims] == 0:
        reduce_dims += 1
    num_outputs = max(math.prod(sizes[reduce_dims:]), 1)
    inputs_per_output = numel // num_outputs if num_outputs else 0
    ndim = len(sizes)
    if ndim:
        fastest = reduce_dims == ndim or in_st[0] < in_st[reduce_dims]
        if fastest:
            dim0, dim1, moving = inputs_per_output, num_outputs, in_st[0]
        else:
            dim0, dim1, moving = num_outputs, inputs_per_output, in_st[reduce_dims]
    else:
        fastest, dim0, dim1, moving = True, 1, 1, 1
    output_vec = 1
    if moving == 1:
        if fastest and dim0 > 128 and reduce_dims == 1:
            dim0 //= vt0  # vectorized along the input
        elif not fastest:
            output_vec = 4
            others = [s for j, s in enumerate(in_st) if j != reduce_dims]
            for n in (storage_offset, sizes[reduce_dims], *others):
                while n % output_vec:
                    output_vec //= 2
            dim0 //= output_vec
    most = MAX_NUM_THREADS // output_vec

    def pow2(n: int) -> int:
        return most if n >= most else max(1, 1 << (max(n, 1).bit_length() - 1))

    width = min(pow2(dim0), WARP)
    height = min(pow2(dim1), most // width)
    width = min(pow2(dim0), most // height)
    threads = width * height
    step_in = step_out = 1
    block_x_reduce = ndim == 0 or fastest
    if block_x_reduce:
        step_in *= width
    else:
        step_out *= width

    def per_thread() -> int:
        return -(-inputs_per_output // step_in)

    split_warps = per_thread() >= height * 16 or per_thread() >= 256
    if split_warps:
        step_in *= height
    else:
        step_out *= height
    sms, per_sm = multiprocessors
    target = sms * max(per_sm // threads, 1)
    grid = -(-(num_outputs // output_vec) // step_out)
    ctas = 1
    if split_warps and per_thread() >= 256 and grid <= target:
        ctas = max(min(-(-target // grid), -(-per_thread() // 16)), -(-per_thread() // 256))
    if ctas <= 1:
        return ReductionScratch(
            num_outputs, inputs_per_output, (width, height), output_vec, 1, 0, 0
        )
    buffer = acc_size * num_outputs * ctas
    if not block_x_reduce:
        buffer *= width * output_vec
    return ReductionScratch(
        num_outputs, inputs_per_output, (width, height), output_vec, ctas, buffer, 4 * grid
    )


def kernel_intermediates(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], outs: list[torch.Tensor]
) -> tuple[int, ...]:
    """Tensors a CUDA kernel makes after its outputs and frees before it returns, in order:
    ``_softmax_backward_data`` multiplies the gradient by the softmax's output into a
    temporary of their size first (``Tensor tmp = grad * output;`` in ``SoftMax.cu``; the
    CPU kernel fuses it), so a softmax's backward holds its gradient, its output, its result
    and that product at once. The recorded H200 step of an attention block on the math
    backend peaked there, one fp32 score matrix above the trace without it."""
    if func is _aten._softmax_backward_data.default and outs:
        grad = args[0] if args else kwargs.get("grad_output")
        out = args[1] if len(args) > 1 else kwargs.get("output")
        if isinstance(grad, torch.Tensor) and isinstance(out, torch.Tensor) and grad.numel():
            dtype = torch.promote_types(grad.dtype, out.dtype)
            return (grad.numel() * dtype.itemsize,)
    return ()


def reduction_scratch(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], multiprocessors: tuple[int, int]
) -> int:
    """The bytes of scratch a CUDA reduction (``sum``, ``mean``) takes for this call; 0 for
    any other operator, or where the kernel reduces without a staging buffer."""
    if func not in _REDUCTIONS:
        return 0
    x = args[0] if args else kwargs.get("self")
    if not isinstance(x, torch.Tensor) or x.numel() == 0 or x.numel() >= 2**31:
        return 0
    where = _REDUCTIONS[func]
    dims: Any = None
    if where is not None:
        dims = args[where] if len(args) > where else kwargs.get("dim")
    ndim = x.dim()
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        reduced = set(range(ndim))
    else:
        listed = dims if isinstance(dims, (list, tuple)) else [dims]
        reduced = {int(d) % max(ndim, 1) for d in listed}
    dtype = kwargs.get("dtype") or x.dtype
    if x.is_complex() or dtype.is_complex:
        return 0
    acc = 8 if torch.float64 in (x.dtype, dtype) or not dtype.is_floating_point else 4
    cfg = reduction_config(
        [int(n) for n in x.shape],
        [int(s) for s in x.stride()],
        sorted(reduced),
        x.element_size(),
        acc,
        multiprocessors,
        storage_offset=int(x.storage_offset()),
    )
    return cfg.nbytes


#: The operator name of a cuBLAS handle's workspace in a trace (one record per handle).
CUBLAS_WORKSPACE = "cublas workspace"
#: Operators that run on a cuBLAS handle (matrix products; ``linear`` and ``matmul``
#: reach them as these).
_CUBLAS_OPS = frozenset(
    {
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "addbmm",
        "mv",
        "addmv",
        "dot",
        "vdot",
        "_addmm_activation",
        "_int_mm",
        "_scaled_mm",
        "_grouped_mm",
        "_scaled_grouped_mm",
    }
)


#: The operator name of the forward thread's cuBLASLt workspace in a trace.
CUBLASLT_WORKSPACE = "cublaslt workspace"
#: Products that run through cuBLASLt (a bias or activation epilogue, scaled fp8): the
#: first on a thread makes its cuBLASLt workspace (``addmm`` with a bias vector, as
#: ``nn.Linear`` and GPT-2's ``Conv1D`` call it; the recorded H200 steps made it there).
_CUBLASLT_OPS = frozenset({"addmm", "_addmm_activation", "_scaled_mm"})

#: The threads whose cuBLAS handles a step's workspace records stand for, in order: the
#: forward's (and the optimizer's), then autograd's device thread's (the backward: True).
_THREADS = (False, True)


def _first_products(trace: Trace) -> dict[int, list[int]]:
    """Event index of each cuBLAS handle's first product -> that handle's workspace record
    (the first handle's: any phase but backward; the second's: the backward), and of the
    forward's first cuBLASLt product -> the cuBLASLt workspace's record, in that order."""
    records = trace.records
    handles = [e for e in trace.events if e >= 0 and records[e].op == CUBLAS_WORKSPACE]
    wanted = [(sid, bwd, _CUBLAS_OPS) for sid, bwd in zip(handles, _THREADS, strict=False)]
    wanted += [
        (e, False, _CUBLASLT_OPS)
        for e in trace.events
        if e >= 0 and records[e].op == CUBLASLT_WORKSPACE
    ][:1]
    at: dict[int, list[int]] = {}
    for sid, backward, ops in wanted:
        for i, e in enumerate(trace.events):
            rec = records[e] if e >= 0 else None
            if rec and rec.op in ops and (rec.phase == "backward") == backward:
                at.setdefault(i, []).append(sid)
                break
    return at


def without_idle_cublas(trace: Trace) -> None:
    """Take out of ``trace`` (in place) each cuBLAS workspace whose thread ran no matrix
    product, and the cuBLASLt workspace where the forward ran no bias-epilogue product:
    PyTorch makes a handle's workspace at its first product, and a step of cuDNN RNNs and
    elementwise work alone makes none (the recorded H200 steps of LSTMs and GRUs allocated
    none); a model without biases makes no cuBLASLt workspace."""
    records = trace.records
    used = {sid for sids in _first_products(trace).values() for sid in sids}
    handles = [e for e in trace.events if e >= 0 and records[e].op == CUBLAS_WORKSPACE]
    lt = [e for e in trace.events if e >= 0 and records[e].op == CUBLASLT_WORKSPACE]
    # the two threads' handles; any more a profile counts are not tied to a thread here
    idle = {e for e in handles[: len(_THREADS)] + lt[:1] if e not in used}
    if idle:
        trace.events[:] = [e for e in trace.events if (e if e >= 0 else ~e) not in idle]


def first_step(trace: Trace) -> Trace:
    """``trace`` as a process's first step takes it: each cuBLAS workspace made just after
    the first allocation of a matrix product on its handle's thread (the first handle's:
    any phase but backward; the second's: backward, on autograd's device thread), and the
    cuBLASLt workspace after the forward's first bias-epilogue product, instead of held
    from the start. A handle that no traced product allocated for keeps its place (the
    loop's; :func:`without_idle_cublas` takes it out). The records are shared with
    ``trace``."""
    at = _first_products(trace)  # event index -> the workspaces made after it
    if not at:
        return trace
    moved = {sid for sids in at.values() for sid in sids}
    events: list[int] = []
    for i, e in enumerate(trace.events):
        if e not in moved:
            events.append(e)
        events.extend(at.get(i, ()))
    return dataclasses.replace(trace, events=events)
