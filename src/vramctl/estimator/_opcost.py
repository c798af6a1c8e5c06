"""What one traced operator costs: its floating-point operations, the bytes it moves and
whether it launches a kernel, so that a step's time can be predicted from its trace.

FLOPs come from PyTorch's own formulas (``torch.utils.flop_counter.flop_registry``,
what ``FlopCounterMode`` counts: a multiply-add is two), plus the CPU attention kernels
the registry leaves out. Bytes are what the operator reads and writes: its tensor
inputs' and outputs' elements (a broadcast input counted once). A view makes no kernel
and moves nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import flop_counter

from vramctl._tensors import tensors

__all__ = ["GROUPS", "OpCost", "op_cost"]

#: The operator groups a step's time is reported by.
GROUPS = ("matmul", "convolution", "attention", "memory", "optimizer", "transfer", "overhead")

_MATMUL = {"mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_grouped_mm", "addbmm"}
_CONV = {
    "convolution",
    "_convolution",
    "convolution_backward",
    "cudnn_convolution",
    "convolution_overrideable",
    "_slow_conv2d_forward",
    "_slow_conv2d_backward",
    "mkldnn_convolution",
}
#: One recurrent layer per call (the CPU's oneDNN kernels; CUDA's are traced as these).
_RNN = {"mkldnn_rnn_layer", "mkldnn_rnn_layer_backward"}
#: Operators that take lists of tensors and pay a fixed cost per tensor.
_LISTED = ("_foreach_", "_fused_")
_ATTENTION_PREFIX = ("_scaled_dot_product", "_flash_attention", "_efficient_attention")
#: Operators that make no kernel although their schema does not say they alias.
_NO_KERNEL = {
    "detach",
    "alias",
    "lift_fresh",
    "_unsafe_view",
    "view",
    "_reshape_alias",
    "set_",
    "_local_scalar_dense",
    "sym_size",
    "sym_stride",
    "sym_numel",
    "sym_storage_offset",
    "is_same_size",
    "_has_compatible_shallow_copy_type",
}


@dataclass(frozen=True, slots=True)
class OpCost:
    """One operator of a traced step."""

    group: str
    phase: str
    #: The compute dtype: "fp32", "bf16", "fp16", "fp64" or "other".
    dtype: str
    flops: int
    bytes: int
    #: Whether it launches a kernel (False: a view or metadata operator).
    kernel: bool
    #: Whether it writes into an input (``add_``, ``_foreach_mul_``): no new output memory.
    inplace: bool = False
    #: The ATen operator's name (``"bernoulli_"``): the measured per-element costs are
    #: kept by it.
    op: str = ""
    #: Elements of its largest tensor output (of its first input for an in-place one).
    elements: int = 0
    #: Tensors in its first list argument (a ``_foreach_`` or fused optimizer operator,
    #: which pays a fixed cost per tensor).
    tensors: int = 0
    #: Whether it ran through a Python dispatch mode of the step's own before reaching the
    #: trace (selective checkpointing's), which costs a Python call per operator.
    dispatch: bool = False


def _dtype_key(dtype: torch.dtype | None) -> str:
    return (
        {
            torch.float32: "fp32",
            torch.bfloat16: "bf16",
            torch.float16: "fp16",
            torch.float64: "fp64",
        }.get(dtype, "other")
        if dtype is not None
        else "other"
    )


def _nbytes(t: torch.Tensor) -> int:
    """Bytes an operator touches for ``t``: its elements, a broadcast (stride 0) counted once."""
    n = t.element_size()
    for size, stride in zip(t.shape, t.stride(), strict=False):
        if stride != 0:
            n *= size
    return n


def _attention_flops(name: str, args: tuple[Any, ...], outs: list[torch.Tensor]) -> int:
    """FLOPs of a scaled-dot-product attention kernel that the registry does not know (the
    CPU's): forward 4·B·H·L·S·D (scores and output), backward 2.5 times that."""
    q, k = args[0], args[1]
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor) or q.dim() < 3:
        return 0
    if "backward" in name:
        # the backward takes (grad_out, query, key, value, ...)
        if len(args) < 3 or not isinstance(args[2], torch.Tensor):
            return 0
        q, k = args[1], args[2]
    *batch, length, dim = q.shape
    source = k.shape[-2]
    b = 1
    for s in batch:
        b *= s
    forward = int(4 * b * length * source * dim)
    return forward * 5 // 2 if "backward" in name else forward


def _rnn_flops(name: str, args: tuple[Any, ...]) -> int:
    """FLOPs of one recurrent layer (LSTM, GRU): each token multiplies the input and the
    hidden state by their weights (2·tokens·weights forward; the backward twice that)."""
    x = args[0]
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        return 0
    tokens = x.numel() // max(1, x.shape[-1])
    weights = sum(a.numel() for a in args[1:3] if isinstance(a, torch.Tensor) and a.dim() == 2)
    forward = 2 * tokens * weights
    return 2 * forward if "backward" in name else forward


def _conv_backward_flops(args: tuple[Any, ...]) -> int:
    """A convolution's backward: each gradient asked for (input, weight) costs what the
    forward does, ``2 * output elements * (input channels / groups) * kernel``. (The
    registry's formula counts a grouped convolution, depthwise ones too, as a dense one.)"""
    if len(args) < 11:
        return 0
    grad_out, weight, mask = args[0], args[2], args[10]
    if not isinstance(grad_out, torch.Tensor) or not isinstance(weight, torch.Tensor):
        return 0
    kernel = 1
    for k in weight.shape[1:]:
        kernel *= int(k)
    forward = 2 * grad_out.numel() * kernel
    return forward * sum(1 for m in list(mask)[:2] if m)


def op_cost(
    func: Any,
    name: str,
    phase: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    out: Any,
    *,
    dispatch: bool = False,
) -> OpCost:
    """The cost of one operator call (``out`` is what it returned; ``dispatch``: it ran
    through a Python dispatch mode of the step's own first)."""
    outs = list(tensors(out))
    ins = list(tensors((args, kwargs)))
    dtype = _dtype_key(ins[0].dtype if ins else (outs[0].dtype if outs else None))
    view = (
        getattr(func, "is_view", False)
        or name in _NO_KERNEL
        or getattr(func, "namespace", "") == "prim"
    )
    if view:
        return OpCost("overhead", phase, dtype, 0, 0, False, op=name, dispatch=dispatch)
    moved = sum(_nbytes(t) for t in ins) + sum(_nbytes(t) for t in outs)
    packet = getattr(func, "overloadpacket", None)
    formula = flop_counter.flop_registry.get(packet) if packet is not None else None
    flops = 0
    if formula is not None:
        try:
            flops = int(formula(*args, **kwargs, out_val=out))
        except Exception:  # a formula that does not take this overload's arguments
            flops = 0
    if name in _RNN:
        group = "matmul"
        flops = _rnn_flops(name, args)
    elif name in _MATMUL:
        group = "matmul"
    elif name in _CONV:
        group = "convolution"
        if name == "convolution_backward":
            flops = _conv_backward_flops(args) or flops
    elif name.startswith(_ATTENTION_PREFIX):
        group = "attention"
        if not flops:
            flops = _attention_flops(name, args, outs)
    elif phase == "optimizer":
        group = "optimizer"
    else:
        group = "memory"
    inplace = name.endswith("_")
    elements = max((t.numel() for t in outs), default=0)
    if inplace and ins:
        elements = ins[0].numel()
    first = args[0] if args else None
    listed = len(first) if isinstance(first, (list, tuple)) and name.startswith(_LISTED) else 0
    return OpCost(
        group, phase, dtype, flops, moved, True, inplace, name, elements, listed, dispatch
    )
