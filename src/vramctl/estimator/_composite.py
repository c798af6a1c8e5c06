"""Intermediates of composite kernels: operators a trace sees as one call, whose kernel
calls other operators on any device and frees their outputs before it returns.

A fake-tensor trace sees such an operator's outputs only; what its kernel makes on the way
is as real on a GPU as on a CPU, so the rule here serves every target.

- ``_safe_softmax`` (SDPA's math backend; ``aten/src/ATen/native/transformers/attention.cpp``)
  computes the softmax into its result first, then marks the input's ``-inf`` entries
  (``isneginf``: one bool per element), reduces them to a bool per row (``all``), and
  zeroes the fully masked rows in place (``where_out`` into the result) with a scalar zero.
  On top of the input and the result it holds one bool per score while it runs: 64 MiB for
  the scores of 4 x 16 heads x 1,024 x 1,024 tokens. The recorded H200 step of that
  attention, forced onto the math backend, peaked 64 MiB above the trace without it.
  Measured here on the CPU kernel (PyTorch 2.13): scores + rows + one element, to the
  byte.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["composite_intermediates"]

_aten = torch.ops.aten


def composite_intermediates(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], outs: list[torch.Tensor]
) -> tuple[int, ...]:
    """The bytes of each intermediate a composite kernel makes after its outputs and frees
    before it returns, in the order it makes them; empty for any other operator."""
    if func is _aten._safe_softmax.default:
        x = args[0] if args else kwargs.get("self")
        if not isinstance(x, torch.Tensor) or x.numel() == 0 or not outs:
            return ()
        dim = args[1] if len(args) > 1 else kwargs.get("dim", -1)
        rows = x.numel() // max(int(x.shape[int(dim)]), 1) if x.dim() else 1
        # isneginf's mask, all's row mask, the scalar zero
        return (x.numel(), rows, outs[0].element_size())
    return ()
