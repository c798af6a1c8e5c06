"""CUDA's autocast policy on a trace that runs on CPU tensors.

A CPU-only PyTorch build cannot carry a step on fake CUDA tensors, so the trace
runs under ``torch.autocast("cpu")``. The CPU policy casts the same matrix
operators to the low-precision dtype as CUDA's does, but it leaves in that dtype
many operators CUDA runs in fp32: layer, group and RMS norms, softmax and
log-softmax, ``exp``/``log``/``pow``/``rsqrt`` and friends, sums and cumulative
sums, most losses, upsampling. Their outputs are twice as large on a GPU.

:class:`CudaAutocast` is a ``TorchFunctionMode`` that, while CPU autocast is
enabled (so a model's own ``torch.autocast(..., enabled=False)`` regions are
honoured), applies CUDA's rules to those operators: ``fp32`` operators get their
low-precision floating inputs cast to fp32, and ``fp32_set_opt_dtype``
operators (softmax, sum ...) run with ``dtype=torch.float32`` when no dtype is
given. The operator lists are PyTorch's (``ATen/autocast_mode.h``:
``AT_FORALL_FP32`` and ``AT_FORALL_FP32_SET_OPT_DTYPE``); a test checks them
against the installed headers where they are shipped. Operators that joined the
lists in a recent PyTorch (``rms_norm``, in 2.12) are applied only where the
installed PyTorch's CUDA autocast has a kernel for them.

A function mode sees the Python-level call only, not operators a composite
calls inside C++. ``cross_entropy`` is one: ATen's composite takes the log-softmax
in the logits' own dtype (it passes that dtype, so the fp32 rule does not apply)
and casts the log-probabilities to fp32 for the NLL, an fp32 operator. CPU autocast
instead casts the logits at the composite, which would hold fp32 log-probabilities
and their fp32 gradient; the mode runs CUDA's order. ``interpolate`` reaches the
fp32 upsampling operators and is cast itself.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.nn import _reduction
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from vramctl.estimator._patch import patched

__all__ = [
    "CUDA_FP32",
    "CUDA_FP32_SET_OPT_DTYPE",
    "CudaAutocast",
    "cuda_autocast",
    "recomputed_too",
]


def _cuda_autocasts(op: str) -> bool:
    """Whether this PyTorch's CUDA autocast has a kernel (a policy) for ``op``.

    The autocast kernels are registered in CPU-only builds too. Where the
    dispatcher cannot be asked, the operator is taken to be listed.
    """
    try:
        return bool(torch._C._dispatch_has_kernel_for_dispatch_key(op, "AutocastCUDA"))
    except (AttributeError, RuntimeError):
        return True


#: Operators in ``AT_FORALL_FP32`` since a recent PyTorch only (``rms_norm``: 2.12); an
#: older CUDA autocast leaves them to type promotion, as the CPU trace does.
_RECENT_FP32 = frozenset(n for n in ("rms_norm",) if _cuda_autocasts(f"aten::{n}"))

#: CUDA autocast runs these in fp32 (``AT_FORALL_FP32``), by ATen base name.
CUDA_FP32 = _RECENT_FP32 | frozenset(
    {
        "acos",
        "asin",
        "cosh",
        "erfinv",
        "exp",
        "expm1",
        "log",
        "log10",
        "log2",
        "log1p",
        "reciprocal",
        "rsqrt",
        "sinh",
        "tan",
        "pow",
        "softplus",
        "layer_norm",
        "native_layer_norm",
        "group_norm",
        "frobenius_norm",
        "nuclear_norm",
        "cosine_similarity",
        "poisson_nll_loss",
        "cosine_embedding_loss",
        "nll_loss",
        "nll_loss2d",
        "hinge_embedding_loss",
        "kl_div",
        "l1_loss",
        "smooth_l1_loss",
        "huber_loss",
        "mse_loss",
        "margin_ranking_loss",
        "multilabel_margin_loss",
        "soft_margin_loss",
        "triplet_margin_loss",
        "multi_margin_loss",
        "binary_cross_entropy_with_logits",
        "dist",
        "pdist",
        "cdist",
        "renorm",
        "logsumexp",
        "upsample_nearest1d",
        "_upsample_nearest_exact1d",
        "upsample_nearest2d",
        "_upsample_nearest_exact2d",
        "upsample_nearest3d",
        "_upsample_nearest_exact3d",
        "upsample_linear1d",
        "upsample_bilinear2d",
        "_upsample_bilinear2d_aa",
        "upsample_trilinear3d",
        "upsample_bicubic2d",
        "_upsample_bicubic2d_aa",
    }
)
#: CUDA autocast gives these ``dtype=float32`` when none is passed.
CUDA_FP32_SET_OPT_DTYPE = frozenset(
    {
        "prod",
        "softmax",
        "log_softmax",
        "cumprod",
        "cumsum",
        "linalg_vector_norm",
        "linalg_matrix_norm",
        "sum",
    }
)
#: Python-level names that reach an fp32 operator through a composite.
_PYTHON_FP32 = frozenset({"interpolate", "upsample"})
_CROSS_ENTROPY = inspect.signature(torch.nn.functional.cross_entropy)

_LOW = (torch.float16, torch.bfloat16)


def _to_fp32(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.dtype in _LOW:
        return x.to(torch.float32)
    return x


class CudaAutocast(TorchFunctionMode):
    """Apply CUDA autocast's fp32 rules while CPU autocast is enabled."""

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name and torch.is_autocast_enabled("cpu"):
            if func is torch.nn.functional.cross_entropy:
                return _cross_entropy(*args, **kwargs)
            if name in CUDA_FP32 or name in _PYTHON_FP32:
                args, kwargs = tree_map(_to_fp32, (args, kwargs))
            elif (
                name in CUDA_FP32_SET_OPT_DTYPE
                and kwargs.get("dtype") is None
                and args
                and isinstance(args[0], torch.Tensor)
                and args[0].is_floating_point()
                and not any(isinstance(a, torch.dtype) for a in args[1:])
            ):
                kwargs = {**kwargs, "dtype": torch.float32}
        return func(*args, **kwargs)


def _cross_entropy(*args: Any, **kwargs: Any) -> Any:
    """``F.cross_entropy`` as CUDA autocast runs ATen's composite: the log-softmax in the
    logits' dtype, then NLL on its fp32 cast. Probability targets and label smoothing take
    other composites; they keep the earlier rule (fp32 logits)."""
    a = _CROSS_ENTROPY.bind(*args, **kwargs)
    a.apply_defaults()
    x, target = a.arguments["input"], a.arguments["target"]
    if (
        not isinstance(x, torch.Tensor)
        or not isinstance(target, torch.Tensor)
        or x.dtype not in _LOW
        or target.is_floating_point()
        or a.arguments["label_smoothing"] > 0
    ):
        args, kwargs = tree_map(_to_fp32, (args, kwargs))
        return torch.nn.functional.cross_entropy(*args, **kwargs)
    reduction = a.arguments["reduction"]
    if a.arguments["size_average"] is not None or a.arguments["reduce"] is not None:
        reduction = _reduction.legacy_get_string(a.arguments["size_average"], a.arguments["reduce"])
    with torch.autocast("cpu", enabled=False):
        logp = torch.log_softmax(x, 0 if x.dim() == 1 else 1, dtype=x.dtype)
        return torch.nn.functional.nll_loss(
            logp.float(),
            target,
            weight=_to_fp32(a.arguments["weight"]),
            ignore_index=a.arguments["ignore_index"],
            reduction=reduction,
        )


@contextlib.contextmanager
def cuda_autocast() -> Iterator[None]:
    """:class:`CudaAutocast` for a step, activation checkpointing's recomputation included."""
    with recomputed_too(CudaAutocast):
        yield


#: The function modes the current trace enters around a checkpoint's recomputation, in
#: the order they were entered (per thread and task: estimates may run concurrently).
_RECOMPUTE_MODES: contextvars.ContextVar[tuple[Callable[[], TorchFunctionMode], ...]] = (
    contextvars.ContextVar("vramctl_recompute_modes", default=())
)


def _recompute(original: Callable[..., Any]) -> Callable[..., Any]:
    def run(fn: Any, *args: Any, **kwargs: Any) -> Any:
        with contextlib.ExitStack() as es:
            for mode in _RECOMPUTE_MODES.get():
                es.enter_context(mode())
            return original(fn, *args, **kwargs)

    return run


@contextlib.contextmanager
def recomputed_too(mode: Callable[[], TorchFunctionMode]) -> Iterator[None]:
    """A function mode (made by ``mode``) for a step, activation checkpointing's
    recomputation included.

    Backward runs a checkpointed block's forward again without the Python function modes
    of the forward (autocast itself is restored by the checkpoint), so the mode is
    entered again around the recomputation; without it the recomputed tensors could
    differ from the saved ones (a dtype, a dropout mask's) and the checkpoint refuse them.
    Modes entered so nest: each recomputation runs under all of them, in order, and only
    in the trace that entered them (:func:`~vramctl.estimator._patch.patched`).
    """
    import torch.utils.checkpoint as checkpoint

    token = _RECOMPUTE_MODES.set((*_RECOMPUTE_MODES.get(), mode))
    try:
        with contextlib.ExitStack() as es:
            if getattr(checkpoint, "_run_fn_with_dynamo_disabled", None) is not None:
                es.enter_context(patched(checkpoint, "_run_fn_with_dynamo_disabled", _recompute))
            es.enter_context(mode())
            yield
    finally:
        _RECOMPUTE_MODES.reset(token)
