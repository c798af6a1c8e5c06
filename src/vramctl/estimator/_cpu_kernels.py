"""Scratch memory of PyTorch's CPU kernels: measured once per shape on this host.

On a CPU, convolutions and LSTMs run through oneDNN, which asks PyTorch's CPU
allocator for scratch buffers (im2col columns, weight reorders into blocked
layouts, per-thread reduction buffers, packed RNN weights) that are not tensors
the operator returns, so a fake-tensor trace cannot see them. Their size depends
on the implementation oneDNN picks for the shape, the memory format, the dtype,
the instruction set and the thread count: a channels-last depthwise convolution's
weight gradient in bf16 pads every group to a 16 x 16 block (256 times the
weight), a grouped 1-D convolution's weight gradient keeps reduction copies of
the weight. No fixed rule covers them.

A CPU target is this machine, so the scratch is measured here: each distinct
kernel call (operator, shapes, strides, dtypes, arguments) runs once on
zero-filled tensors under the profiler's memory events, and its scratch is the
peak of the allocations during the call less what is still held after it (its
outputs). Results are cached for the process. A call too large to run
(:data:`PROBE_BYTES_LIMIT`), or one made while a profiler is already recording,
falls back to rules measured the same way: an fp32 convolution reorders its
output, and an LSTM layer packs its two weight matrices.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils._pytree import tree_flatten, tree_map

from vramctl._tensors import tensors

__all__ = ["PROBE_BYTES_LIMIT", "cpu_workspace", "probe_cache_clear"]

_aten = torch.ops.aten

#: Kernels whose scratch is measured. (Not ``mkldnn_rnn_layer_backward``: it reads the
#: forward's workspace, and oneDNN crashes on a zero-filled one.)
PROBED = {
    _aten.convolution.default,
    _aten.convolution_backward.default,
    _aten.mkldnn_rnn_layer.default,
}
#: A call whose tensors (inputs and outputs) exceed this is not run; the rule applies.
PROBE_BYTES_LIMIT = 512 << 20

_cache: dict[tuple[Any, ...], int] = {}


def probe_cache_clear() -> None:
    """Forget the measured scratch sizes (for tests)."""
    _cache.clear()


def cpu_workspace(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], outs: list[torch.Tensor]
) -> int:
    """Bytes of scratch the CPU kernel for ``func`` takes beyond its outputs."""
    if func not in PROBED:
        return 0
    key = _signature(func, args, kwargs)
    hit = _cache.get(key)
    if hit is not None:
        return hit
    nbytes = sum(_span_bytes(t) for t in tensors((args, kwargs))) + sum(
        _span_bytes(t) for t in outs
    )
    measured = None
    if nbytes <= PROBE_BYTES_LIMIT and not torch.autograd.profiler._is_profiler_enabled:
        measured = _measure(func, args, kwargs)
    value = measured if measured is not None else _rule(func, args, outs)
    _cache[key] = value
    return value


def _rule(func: Any, args: tuple[Any, ...], outs: list[torch.Tensor]) -> int:
    if func is _aten.convolution.default and outs and outs[0].dtype == torch.float32:
        return _span_bytes(outs[0])
    if func is _aten.mkldnn_rnn_layer.default:
        return sum(_span_bytes(t) for t in args[1:3])
    return 0


def _signature(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    def describe(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return ("T", tuple(x.shape), tuple(x.stride()), x.storage_offset(), x.dtype)
        return repr(x)

    flat, _ = tree_flatten((args, kwargs))
    return (func, torch.get_num_threads(), *(describe(x) for x in flat))


def _span_bytes(t: torch.Tensor) -> int:
    """Bytes of the memory a tensor's view reaches (its offset and strides)."""
    if t.numel() == 0:
        return 0
    span = 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride(), strict=True))
    return int((t.storage_offset() + span) * t.element_size())


def _zeros_like_layout(t: torch.Tensor) -> torch.Tensor:
    n = math.ceil(_span_bytes(t) / t.element_size()) if t.numel() else 0
    base = torch.zeros(n, dtype=t.dtype)
    return base.as_strided(t.shape, t.stride(), t.storage_offset() if t.numel() else 0)


def _measure(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    from torch.autograd.profiler import profile

    with unset_fake_temporarily():
        ra, rk = tree_map(
            lambda x: _zeros_like_layout(x) if isinstance(x, torch.Tensor) else x, (args, kwargs)
        )
        try:
            # The legacy (non-Kineto) profiler starts in milliseconds; it still reports
            # every allocation of the CPU allocator, in order.
            quiet, no_grad = _quiet_stderr(), torch.no_grad()
            with quiet, no_grad, profile(profile_memory=True, use_kineto=False) as prof:
                out = func(*ra, **rk)
        except Exception:
            return None
        del out, ra, rk
    live = peak = 0
    events = [e for e in prof.kineto_results.events() if e.name() == "[memory]"]
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return max(0, peak - live)  # what is still held is the outputs


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence the profiler's start and stop lines, which some builds print to fd 2."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
