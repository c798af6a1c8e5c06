"""8-bit and paged AdamW in a traced step: the state bitsandbytes keeps, not its arithmetic.

The estimator traces a step on fake tensors, where bitsandbytes' optimizers cannot run (its
CUDA kernels update the state in place). :class:`Blockwise8bitAdamW` keeps exactly the state
that bitsandbytes' ``AdamW8bit`` keeps, read from its source and pinned by the tests against
the library on the CPU:

- for a parameter of at least 4096 elements (``min_8bit_size``): both moments as ``uint8``
  codes of the parameter's shape, one fp32 ``absmax`` per 256 values for each, and the two
  256-value fp32 quantization maps, which all parameters share;
- for a smaller one: both moments in fp32, as plain AdamW.

The update runs in one fused kernel per parameter and allocates nothing, so the traced step
allocates nothing either.

The paged variants (``PagedAdamW``, ``PagedAdamW8bit``) keep the same state in CUDA unified
memory (``cudaMallocManaged``), outside PyTorch's caching allocator. It is not in
``max_memory_allocated`` or ``max_memory_reserved``; the driver moves it to host memory
when the GPU runs short, which slows the step rather than failing it. The traced step
allocates it outside the trace and counts it in :attr:`paged_bytes`, which the estimate
reports on its own (``Estimate.paged_optimizer``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["BLOCK", "MIN_8BIT_SIZE", "Blockwise8bitAdamW"]

#: Values per fp32 ``absmax`` of bitsandbytes' blockwise 8-bit optimizer state.
BLOCK = 256
#: Parameters smaller than this keep fp32 state (bitsandbytes' ``min_8bit_size``).
MIN_8BIT_SIZE = 4096


class Blockwise8bitAdamW(torch.optim.Optimizer):
    """AdamW with bitsandbytes' state: 8-bit blockwise (``eight_bit``) or fp32, in the
    allocator's memory or paged (``paged``)."""

    def __init__(
        self, params: Iterable[torch.Tensor], *, eight_bit: bool = True, paged: bool = False
    ) -> None:
        super().__init__(params, {"lr": 1e-4})
        self.eight_bit = eight_bit
        self.paged = paged
        #: Bytes of state kept in unified memory (paged), outside the caching allocator.
        self.paged_bytes = 0
        self._maps: tuple[torch.Tensor, torch.Tensor] | None = None

    def _empty(self, p: torch.Tensor, shape: Any, dtype: torch.dtype) -> torch.Tensor:
        if not self.paged:
            return torch.zeros(shape, dtype=dtype, device=p.device)
        n = math.prod(shape) if shape else 1
        self.paged_bytes += n * torch.empty((), dtype=dtype).element_size()
        with _disable_current_modes():  # unified memory: not the allocator's, not traced
            return torch.empty(shape, dtype=dtype, device="meta")

    def _shared_maps(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._maps is None:
            self._maps = (
                self._empty(p, (256,), torch.float32),
                self._empty(p, (256,), torch.float32),
            )
        return self._maps

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if state:
                    continue  # the fused update allocates nothing
                state["step"] = 0
                if self.eight_bit and p.numel() >= MIN_8BIT_SIZE:
                    state["state1"] = self._empty(p, p.shape, torch.uint8)
                    state["state2"] = self._empty(p, p.shape, torch.uint8)
                    blocks = math.ceil(p.numel() / BLOCK)
                    state["absmax1"] = self._empty(p, (blocks,), torch.float32)
                    state["absmax2"] = self._empty(p, (blocks,), torch.float32)
                    state["qmap1"], state["qmap2"] = self._shared_maps(p)
                else:
                    state["state1"] = self._empty(p, p.shape, torch.float32)
                    state["state2"] = self._empty(p, p.shape, torch.float32)
