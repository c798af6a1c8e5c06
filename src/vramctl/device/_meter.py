"""A region's peak memory on any kind of device: :class:`PeakMeter`.

A meter reads three figures for the code inside its ``with`` block:

- ``peak_used``: the peak device-level *used* bytes, the quantity a target
  utilization is measured against (``used <= target * total``). On CUDA that is
  what other processes and the CUDA context hold plus this process's peak
  reserved bytes; on a simulated GPU its reserve plus its peak of live
  storages; on the CPU the host's used memory before the block plus the peak of
  the storages made inside it.
- ``peak_allocated``: how far this process's allocated bytes rose above their
  level at entry.
- ``net_allocated``: allocated bytes at exit less those at entry (what the block kept).

Each kind of device supplies the readings (``Device._peak_begin`` and
``Device._peak_end``); callers write ``with device.peak_meter() as m``.

>>> import torch, vramctl
>>> with vramctl.simulate("1GiB") as gpu:
...     with gpu.peak_meter() as meter:
...         x = torch.zeros(256, 1024)       # 1 MiB
...         del x
...     meter.peak_used
1048576
"""

from __future__ import annotations

import threading
import weakref
from types import TracebackType
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vramctl._tensors import storage, tensor_parts, tensors


class Metered(Protocol):
    """What a meter reads of a device (a :class:`~vramctl.Device` is one): the meter
    depends on these readings, not on the device's class."""

    def _peak_begin(self) -> Any: ...

    def _peak_end(self, token: Any) -> tuple[int, int, int]: ...

    def capacity(self) -> int: ...

    def available(self) -> int: ...


__all__ = ["HostCount", "PeakMeter", "available_bytes", "total_bytes"]


class PeakMeter:
    """Context manager: the peak memory of the code inside the ``with`` block on ``device``."""

    def __init__(self, device: Metered) -> None:
        self.device = device
        self.peak_used = 0
        self.peak_allocated = 0
        self.net_allocated = 0
        self._token: Any = None

    def __enter__(self) -> PeakMeter:
        self._token = self.device._peak_begin()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        token, self._token = self._token, None
        self.peak_used, self.peak_allocated, self.net_allocated = self.device._peak_end(token)


def total_bytes(device: Metered) -> int:
    """The device's capacity as a process sees it (``device.capacity()``)."""
    return device.capacity()


def available_bytes(device: Metered) -> int:
    """Bytes this process could allocate now (``device.available()``)."""
    return device.available()


#: Ops whose output is their input, yet a tensor made by the block (``torch.tensor(data)``).
_FRESH_OPS = ("aten::lift_fresh", "aten::lift")


class HostCount(TorchDispatchMode):
    """Counts the bytes of the host storages created while it is active, and their peak.

    Sparse tensors count their values and indices; ``torch.tensor(data)`` counts
    (it is made outside the dispatcher, then lifted); ``torch.from_numpy`` does not
    (its memory is numpy's and was there already).
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.live = 0
        self.peak = 0
        self._lock = threading.Lock()

    def _release(self, nbytes: int) -> None:
        with self._lock:
            self.live -= nbytes

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        fresh = str(getattr(func, "name", lambda: "")()).startswith(_FRESH_OPS)
        seen = set() if fresh else {id(s) for t in tensors((args, kwargs)) for s in _storages(t)}
        for t in tensors(out):
            if t.device.type != "cpu":
                continue
            for st in _storages(t):
                if id(st) in seen or (fresh and not st.resizable()):
                    continue  # (not resizable: memory torch did not allocate, torch.from_numpy)
                seen.add(id(st))
                nbytes = st.nbytes()
                weakref.finalize(st, self._release, nbytes)
                with self._lock:
                    self.live += nbytes
                    self.peak = max(self.peak, self.live)
        return out


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages holding a tensor's bytes: its own, or a sparse tensor's values and indices'."""
    return [st for p in tensor_parts(t) if (st := storage(p)) is not None]
