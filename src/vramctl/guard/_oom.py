"""Recognising an out-of-memory error, and freeing what a failed attempt held.

An OOM is recognised by its type first (``torch.OutOfMemoryError``, which
includes CUDA's and the simulated device's, and Python's ``MemoryError``), then
by the allocators' own counters (the CUDA caching allocator's ``num_ooms``
and the simulated device's ``ooms`` rise when they refuse an allocation), and
only last by the messages of errors raised as plain ``RuntimeError``: cuBLAS
and cuDNN allocation failures and the CPU allocator's ``can't allocate
memory``. Errors wrapped by other libraries are followed through
``__cause__`` and ``__context__``.

>>> import torch
>>> from vramctl.guard import is_oom
>>> try:
...     torch.empty(2**62, dtype=torch.uint8)
... except RuntimeError as exc:
...     is_oom(exc)
True
"""

from __future__ import annotations

import gc
import re
import traceback
from dataclasses import dataclass

import torch

from vramctl._errors import VramctlError
from vramctl._units import parse_size
from vramctl.device import Device

__all__ = ["OomCounters", "is_oom", "release", "requested_bytes"]

# Messages of allocation failures that reach Python as plain RuntimeError.
_MESSAGES = (
    "out of memory",  # "CUDA error: out of memory" (a kernel's own cudaMalloc)
    "cublas_status_alloc_failed",
    "cudnn_status_alloc_failed",
    "cudnn_status_not_enough_workspace",
    "can't allocate memory",  # DefaultCPUAllocator
    "not enough memory",  # DefaultCPUAllocator on some platforms, MPS
    "failed to allocate",
)


@dataclass
class OomCounters:
    """Allocator OOM counters read before an attempt, to tell an OOM by its effect."""

    ooms: int = 0

    @classmethod
    def read(cls, device: Device | None) -> OomCounters:
        return cls(ooms=device.oom_count() if device is not None else 0)

    @staticmethod
    def kept(device: Device | None) -> bool:
        """True when ``device``'s allocator counts the allocations it refuses.

        Elsewhere (the host) the counters always read zero, so a caller that
        reads them before every attempt can skip the read.
        """
        return device is not None and device.counts_ooms

    def rose(self, device: Device | None) -> bool:
        """True when an allocator refused an allocation since :meth:`read`."""
        return device is not None and device.oom_count() > self.ooms


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and all(cur is not s for s in seen) and len(seen) < 16:
        seen.append(cur)
        cur = cur.__cause__ or cur.__context__
    return seen


def is_oom(
    exc: BaseException, *, device: Device | None = None, counters: OomCounters | None = None
) -> bool:
    """True when ``exc`` (or an error it wraps) is an allocation failure.

    With ``device`` and the ``counters`` read before the attempt, an error of
    any type counts as an OOM when the device's allocator recorded a refusal
    during the attempt, whatever its message says.
    """
    for err in _chain(exc):
        if isinstance(err, torch.OutOfMemoryError | MemoryError):
            return True
    if counters is not None and counters.rose(device):
        return True
    for err in _chain(exc):
        if isinstance(err, RuntimeError):
            text = str(err).lower()
            if any(m in text for m in _MESSAGES):
                return True
    return False


def release(exc: BaseException | None = None, device: Device | None = None) -> None:
    """Free what a failed attempt held: its frames' tensors, then the allocator's cache.

    Call it outside the ``except`` block (the PyTorch FAQ's advice): inside it,
    the traceback keeps every frame of the failed step, and so its tensors, alive.
    """
    if exc is not None:
        for err in _chain(exc):
            if err.__traceback__ is not None:
                traceback.clear_frames(err.__traceback__)
                err.__traceback__ = None
    gc.collect()
    if device is not None:
        device.release_cache()


def requested_bytes(exc: BaseException) -> int:
    """The bytes an out-of-memory error says were refused (0 when it does not say): a
    simulated GPU's ``requested``, else CUDA's "Tried to allocate ..." in the message, on the
    error or any error it was raised from."""
    cur: BaseException | None = exc
    for _ in range(16):
        if cur is None:
            break
        req = getattr(cur, "requested", None)  # a simulated GPU's error
        if isinstance(req, int) and not isinstance(req, bool):
            return req
        found = re.search(r"Tried to allocate ([\d.]+ ?[KMGTP]?i?B)", str(cur))
        if found:
            try:
                return parse_size(found.group(1))
            except VramctlError:
                return 0
        cur = cur.__cause__ or cur.__context__
    return 0
