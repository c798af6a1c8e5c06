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

__all__ = [
    "PROBE_BYTES_LIMIT",
    "cpu_output_bytes",
    "cpu_workspace",
    "probe_cache_clear",
    "rank_thread_count",
    "rank_threads",
]

_aten = torch.ops.aten

#: Kernels whose scratch is measured. (Not ``mkldnn_rnn_layer_backward``: it reads the
#: forward's workspace, and oneDNN crashes on a zero-filled one; it is given its forward's.)
PROBED = {
    _aten.convolution.default,
    _aten.convolution_backward.default,
    _aten.mkldnn_rnn_layer.default,
    # ``F.scaled_dot_product_attention``'s CPU kernels keep per-thread blocks of scores,
    # row maxima and sums, and (backward) per-thread gradient accumulators.
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
}
#: Libraries whose operators are measured too: optimum-quanto's (the quantized KV cache)
#: are Python functions registered as one operator, whose intermediates a trace of the
#: operator cannot see.
PROBED_NAMESPACES = ("quanto",)
#: A call whose tensors (inputs and outputs) exceed this is not run; the rule applies.
PROBE_BYTES_LIMIT = 512 << 20

_cache: dict[tuple[Any, ...], int] = {}
#: Kernel call -> the real bytes of its outputs (measured alongside the scratch).
_out_cache: dict[tuple[Any, ...], list[int]] = {}
#: An LSTM layer's input and weight shapes -> its forward's scratch (its backward's too).
_rnn_scratch: dict[tuple[Any, ...], int] = {}

#: Kernels whose fake (meta) outputs are smaller than the real ones: a training LSTM
#: layer's oneDNN workspace, which the meta kernel returns empty and the real one
#: fills with the gates of every step (about 64 bytes per step, sample and hidden unit).
SIZED_OUTPUTS = {_aten.mkldnn_rnn_layer.default}
#: Bytes per (time step, sample, hidden unit) of an fp32 training LSTM layer's workspace,
#: when the call is too large to measure (measured here: 62 to 66).
RNN_WORKSPACE_BYTES = 66


def probe_cache_clear() -> None:
    """Forget the measured scratch sizes (for tests)."""
    _cache.clear()
    _out_cache.clear()
    _rnn_scratch.clear()


def rank_thread_count(ranks_on_host: int) -> int:
    """The intra-op threads of each of ``ranks_on_host`` ranks sharing this host (see
    :func:`rank_threads`)."""
    if ranks_on_host <= 1:
        return torch.get_num_threads()
    try:
        return max(1, int(os.environ.get("OMP_NUM_THREADS", "1")))
    except ValueError:
        return 1


@contextlib.contextmanager
def rank_threads(ranks_on_host: int) -> Iterator[int]:
    """Probe kernels with the intra-op threads of one of ``ranks_on_host`` ranks sharing
    this host: one, as ``torchrun`` starts them when ``OMP_NUM_THREADS`` is not set (a
    kernel's scratch can grow with its threads: per-thread reduction buffers), or
    ``OMP_NUM_THREADS`` where it is. Yields the thread count used."""
    before = torch.get_num_threads()
    threads = rank_thread_count(ranks_on_host)
    if threads != before:
        torch.set_num_threads(threads)
    try:
        yield threads
    finally:
        if threads != before:
            torch.set_num_threads(before)


def cpu_output_bytes(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], outs: list[torch.Tensor]
) -> list[int] | None:
    """The real bytes of each output of ``func`` where the fake outputs understate them."""
    if func not in SIZED_OUTPUTS or len(outs) < 4:
        return None
    cpu_workspace(func, args, kwargs, outs)  # measures both, once per call signature
    hit = _out_cache.get(_signature(func, args, kwargs))
    if hit is not None and len(hit) == len(outs):
        return hit
    sizes = [_span_bytes(t) for t in outs]
    if _train_flag(args, kwargs) and torch.is_grad_enabled():
        x, hidden = outs[0], outs[1]
        steps_and_samples = x.numel() // max(1, x.shape[-1])
        sizes[3] = RNN_WORKSPACE_BYTES * steps_and_samples * hidden.shape[-1]
    return sizes


def _train_flag(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    train = kwargs.get("train", args[15] if len(args) > 15 else False)
    return bool(train)


def cpu_workspace(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], outs: list[torch.Tensor]
) -> int:
    """Bytes of scratch the CPU kernel for ``func`` takes beyond its outputs."""
    if func is _aten.mkldnn_rnn_layer_backward.default:
        # It cannot run on a zero-filled workspace; measured, it takes what its forward
        # took, to 1-2% (the same weight reorders and gate buffers).
        return _rnn_scratch.get(_rnn_layer(args), 0)
    if func not in PROBED and getattr(func, "namespace", None) not in PROBED_NAMESPACES:
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
        found = _measure(func, args, kwargs)
        if found is not None:
            measured, _out_cache[key] = found
    value = measured if measured is not None else _rule(func, args, outs)
    _cache[key] = value
    if func is _aten.mkldnn_rnn_layer.default:
        _rnn_scratch[_rnn_layer(args)] = value
    return value


def _rnn_layer(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """An LSTM layer call's input and weight shapes (the same in its forward and backward)."""
    return tuple((tuple(t.shape), t.dtype) for t in args[:3] if isinstance(t, torch.Tensor))


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
    grad = func in SIZED_OUTPUTS and torch.is_grad_enabled()
    return (func, torch.get_num_threads(), grad, *(describe(x) for x in flat))


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


def _measure(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[int, list[int]] | None:
    """The scratch of one real call on zero-filled tensors, and its outputs' bytes."""
    from torch.autograd.profiler import profile

    with unset_fake_temporarily():
        ra, rk = tree_map(
            lambda x: _zeros_like_layout(x) if isinstance(x, torch.Tensor) else x, (args, kwargs)
        )
        try:
            # The legacy (non-Kineto) profiler starts in milliseconds; it still reports
            # every allocation of the CPU allocator, in order.
            # Grad mode as the step has it: an LSTM layer keeps its workspace only with grad.
            quiet = _quiet_stderr()
            grad = torch.set_grad_enabled(func in SIZED_OUTPUTS and torch.is_grad_enabled())
            with quiet, grad, profile(profile_memory=True, use_kineto=False) as prof:
                out = func(*ra, **rk)
        except Exception:
            return None
        sizes = [_span_bytes(t) for t in tensors(out)]
        del out, ra, rk
    live = peak = 0
    events = [e for e in prof.kineto_results.events() if e.name() == "[memory]"]
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return max(0, peak - live), sizes  # what is still held is the outputs


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
