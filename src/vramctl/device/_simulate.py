"""Simulated GPUs: real PyTorch code on CPU tensors under a GPU's memory budget.

Inside ``with vramctl.simulate("T4-16GB"):`` every tensor storage that an
operator creates is counted while it is alive. When a new storage would take
the count past the budget, ``torch.OutOfMemoryError`` is raised at that
operator, with a message in the style of CUDA's. Freed storages give their
bytes back. Views and in-place operators share a storage and are not counted
twice.

What it counts: the bytes of live tensor storages created inside the context
(parameters, buffers, activations saved for backward, gradients, optimizer
state, outputs), plus anything handed to :meth:`SimulatedDevice.adopt` (the
simulated ``model.to("cuda")``).

What it cannot count: the CUDA context (300-600 MiB on a real GPU), cuBLAS and
cuDNN workspaces, kernels' internal scratch memory, and tensors made outside any
operator (``torch.from_numpy``). The estimator models those; see
``docs/simulate.md``. The caching allocator's rounding and cached-but-free blocks
are not counted either (reserved equals allocated), unless an allocator model is
given (``allocator=``, a :class:`vramctl.estimator.CachingAllocatorModel`): then
every storage is a request to it, reserved memory is its segments, and a request
it cannot place within the device, after giving its cache back and retrying, is
refused, as PyTorch's allocator does.

>>> import torch, vramctl
>>> with vramctl.simulate("64MiB") as gpu:
...     x = torch.zeros(1024, 1024)          # 4 MiB, counted
...     gpu.memory().allocated
4194304
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from vramctl._errors import InvalidSizeError, VramctlError
from vramctl._na import NA
from vramctl._tensors import storage, tensors
from vramctl._units import format_bytes, looks_like_size, parse_size
from vramctl.device._base import Device
from vramctl.device._catalog import GpuSpec, gpu_spec
from vramctl.device._health import DeviceHealth
from vramctl.device._memory import MemoryState, ProcessMemory

__all__ = ["SimulatedDevice", "SimulatedOutOfMemoryError", "active_simulation", "simulate"]


class SimulatedOutOfMemoryError(torch.OutOfMemoryError):
    """``torch.OutOfMemoryError`` raised by a simulated device; carries the figures."""

    def __init__(self, message: str, *, requested: int, free: int, total: int) -> None:
        super().__init__(message)
        self.requested = requested
        self.free = free
        self.total = total


def _storage_nbytes(size: list[int], stride: list[int] | None, itemsize: int) -> int:
    if any(s == 0 for s in size):
        return 0
    if stride is None:
        n = 1
        for s in size:
            n *= s
        return n * itemsize
    return (1 + sum((s - 1) * st for s, st in zip(size, stride, strict=False))) * itemsize


#: Operators whose output is a tensor argument's storage although their schema says not.
_REUSES_INPUT = frozenset({"aten::_unsafe_view"})


def _planned_bytes(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], dev: SimulatedDevice
) -> int | None:
    """Bytes a factory operator (one with a ``size`` argument) is about to allocate.

    A view (``view``, ``expand``, ``as_strided``) and ``_unsafe_view`` (matmul's reshape
    of its own output) allocate nothing; an in-place or ``out=`` operator (``resize_``,
    ``zeros.out``) only what its storage grows by, and nothing here for a storage this
    device does not count.
    """
    schema = getattr(func, "_schema", None)
    if schema is None:
        return None
    names = [a.name for a in schema.arguments]
    if "size" not in names or schema.name in _REUSES_INPUT:
        return None
    aliases = [r.alias_info for r in schema.returns if r.alias_info is not None]
    if aliases and not all(a.is_write for a in aliases):
        return None  # a view
    bound = dict(zip(names, args, strict=False))
    bound.update(kwargs)
    size = bound.get("size")
    if not isinstance(size, list | tuple) or not all(isinstance(s, int) for s in size):
        return None
    dtype = bound.get("dtype")
    if dtype is None:
        base = bound.get("self")
        dtype = base.dtype if isinstance(base, torch.Tensor) else torch.get_default_dtype()
    stride = bound.get("stride")
    planned = _storage_nbytes(list(size), list(stride) if stride else None, dtype.itemsize)
    if aliases:
        written = bound.get("out", bound.get("self"))
        st = storage(written) if isinstance(written, torch.Tensor) else None
        if st is None or not dev._tracks(st):
            return None
        planned -= dev._live[id(st)]
        return planned if planned > 0 else None
    return planned


def _is_cpu_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)
    )


class _Budget(TorchDispatchMode):
    """Counts live storages; refuses the allocation that would pass the limit."""

    def __init__(self, device: SimulatedDevice) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.device = device

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        dev = self.device
        if getattr(dev._local, "paused", 0):
            return func(*args, **kwargs)
        planned = _planned_bytes(func, args, kwargs, dev)
        if planned is not None and planned > dev.free_bytes:
            dev._refuse(planned)
        try:
            out = func(*args, **kwargs)
        except Exception as exc:
            if _is_cpu_oom(exc) and not isinstance(exc, SimulatedOutOfMemoryError):
                dev._refuse(planned or dev.total_bytes, cause=exc)
            raise
        # A fresh tensor built from Python data (torch.tensor) reaches us through lift_fresh.
        fresh_input = func in (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift.default)
        inputs = (
            set()
            if fresh_input
            else {id(s) for t in tensors((args, kwargs)) if (s := storage(t)) is not None}
        )
        new = []
        for t in tensors(out):
            st = storage(t)
            if st is None or (id(st) in inputs and not dev._tracks(st)):
                continue  # a view of, or in-place op on, a storage made outside
            if fresh_input and not st.resizable():
                continue  # memory torch did not allocate (torch.from_numpy, as_tensor)
            new.append(st)
        dev._account(new)
        return out


def _compact(n: int) -> str:
    for unit, scale in (
        ("TiB", 2**40),
        ("GiB", 2**30),
        ("TB", 10**12),
        ("GB", 10**9),
        ("MiB", 2**20),
        ("MB", 10**6),
        ("KiB", 2**10),
        ("KB", 10**3),
    ):
        if n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B"


class SimulatedDevice(Device):
    """A GPU from the catalog (or of a given size) simulated on the CPU.

    Enter it as a context manager to count allocations; :meth:`memory` reports
    a :class:`MemoryState` like a real device's.
    """

    kind = "sim"

    def __init__(
        self, spec: GpuSpec | None, total_bytes: int, *, reserve: int = 0, allocator: Any = None
    ) -> None:
        self.spec = spec
        self.name = spec.name if spec else _compact(total_bytes)
        self.id = f"sim:{self.name}"
        self.index = 0
        self.capability = spec.capability if spec else NA
        self.total_bytes = total_bytes
        self.reserve = reserve
        self.health = DeviceHealth(self.id)
        self._lock = threading.RLock()
        self._live: dict[int, int] = {}  # id(storage) -> counted bytes
        self._refs: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self._allocated = 0
        self._peak = 0
        self._mode: _Budget | None = None
        self._local = threading.local()  # .paused: this thread's uncounted() depth
        self.ooms = 0
        #: A caching allocator model that every storage is requested from (None: storages
        #: are counted as they are); its ``config.capacity`` is the device less the reserve.
        self.allocator = allocator
        self._handles: dict[int, int] = {}  # id(storage) -> the allocator model's handle
        if allocator is not None:
            allocator.config = dataclasses.replace(allocator.config, capacity=total_bytes - reserve)

    # -- Device interface ---------------------------------------------------------

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def allocated_bytes(self) -> int:
        return self._allocated

    @property
    def peak_bytes(self) -> int:
        return self._peak

    @property
    def free_bytes(self) -> int:
        """Bytes a request could take now: the free memory and, with an allocator model,
        its cached free blocks."""
        held = self._allocated if self.allocator is None else self.allocator.allocated
        return max(0, self.total_bytes - self.reserve - held)

    @property
    def reserved_bytes(self) -> int:
        """Bytes held from the device: the allocator model's segments, else the storages."""
        return self._allocated if self.allocator is None else int(self.allocator.reserved)

    def memory(self) -> MemoryState:
        with self._lock:
            used = self.reserved_bytes + self.reserve
            model = self.allocator
            return MemoryState(
                device=self.id,
                total=self.total_bytes,
                used=used,
                free=max(0, self.total_bytes - used),
                process_used=used,
                allocated=self._allocated,
                reserved=self.reserved_bytes,
                peak_allocated=self._peak,
                peak_reserved=self._peak if model is None else int(model.peak_reserved),
                # no allocator model: see the module docstring
                inactive_split=NA if model is None else int(model.inactive_split),
                alloc_retries=NA if model is None else int(model.alloc_retries),
                ooms=self.ooms,
            )

    def processes(self, limit: int | None = None) -> list[ProcessMemory]:
        return [ProcessMemory(pid=os.getpid(), used=self.reserved_bytes + self.reserve, kind="sim")]

    def reset_peak(self) -> None:
        """Start peak tracking again from the current allocation."""
        with self._lock:
            self._peak = self._allocated
            if self.allocator is not None:
                self.allocator.peak_reserved = self.allocator.reserved
                self.allocator.peak_allocated = self.allocator.allocated

    def release_cache(self) -> None:
        """With an allocator model: give its cached segments back (``empty_cache``)."""
        if self.allocator is not None:
            with self._lock:
                self.allocator.empty_cache()

    @contextlib.contextmanager
    def capped(self, budget: int) -> Iterator[None]:
        """With an allocator model: it may reserve no more than keeps the device's used
        memory within ``budget`` (less the reserve), and gives its cache back and retries
        before it refuses; the capacity before comes back afterwards."""
        model = self.allocator
        if model is None:
            yield
            return
        before = model.config
        limit = max(0, min(before.capacity or budget, budget - self.reserve))
        model.config = dataclasses.replace(before, capacity=limit)
        try:
            yield
        finally:
            model.config = before

    # -- behaviour (see Device) ---------------------------------------------------------

    @property
    def is_gpu(self) -> bool:
        return True

    @property
    def is_simulated(self) -> bool:
        return True

    def capacity(self) -> int:
        return self.total_bytes

    def available(self) -> int:
        return self.free_bytes

    def _peak_begin(self) -> Any:
        start = self._allocated
        self.reset_peak()
        return start

    def _peak_end(self, token: Any) -> tuple[int, int, int]:
        peak_used = self._peak if self.allocator is None else int(self.allocator.peak_reserved)
        return self.reserve + peak_used, self._peak - token, self._allocated - token

    def oom_count(self) -> int:
        return self.ooms

    @property
    def counts_ooms(self) -> bool:
        return True

    @property
    def active(self) -> bool:
        return any(
            isinstance(m, _Budget) and m.device is self for m in _get_current_dispatch_mode_stack()
        )

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Count this block's allocations in this thread too (a worker thread's step)."""
        if self.active:
            yield
            return
        with _Budget(self):
            yield

    def put(self, t: torch.Tensor) -> torch.Tensor:
        return t.clone()  # the simulated copy to the GPU: counted

    def owns(self, t: torch.Tensor) -> bool:
        st = storage(t)
        return st is not None and self._tracks(st)

    @contextlib.contextmanager
    def offload_activations(self) -> Iterator[None]:
        """Saved tensors are copied out of the budget and back in when backward needs them,
        which is what ``save_on_cpu`` does to a real GPU's memory."""

        def pack(t: torch.Tensor) -> Any:
            with self.uncounted():
                return t.detach().clone()

        def unpack(t: torch.Tensor) -> torch.Tensor:
            return t.clone()

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield

    # -- counting -----------------------------------------------------------------

    def _tracks(self, st: torch.UntypedStorage) -> bool:
        return id(st) in self._live and self._refs[id(st)]() is st

    def _account(self, storages: list[torch.UntypedStorage]) -> None:
        with self._lock:
            grow: list[tuple[torch.UntypedStorage, int]] = []
            total = 0
            for st in storages:
                nbytes = st.nbytes()
                known = self._live.get(id(st)) if self._tracks(st) else None
                extra = nbytes - known if known is not None else nbytes
                if extra > 0 or known is None:
                    grow.append((st, nbytes))
                    total += max(extra, 0)
            if total > self.free_bytes:
                self._refuse(total)
            if self.allocator is not None:
                self._request(grow)
            for st, nbytes in grow:
                key = id(st)
                if key not in self._live or self._refs[key]() is not st:
                    self._refs[key] = weakref.ref(st)
                    weakref.finalize(st, self._release, key, self._refs[key])
                    self._allocated += nbytes
                else:
                    self._allocated += nbytes - self._live[key]
                self._live[key] = nbytes
            self._peak = max(self._peak, self._allocated)

    def _request(self, grow: list[tuple[torch.UntypedStorage, int]]) -> None:
        """Ask the allocator model for each new (or grown) storage; all or none: a refused
        request gives back the ones made before it and raises the simulated OOM."""
        model = self.allocator
        made: list[tuple[int, int, int | None]] = []  # key, new handle, the handle it replaced
        for st, nbytes in grow:
            key = id(st)
            old = self._handles.get(key) if self._tracks(st) else None
            try:
                handle = model.malloc(nbytes)
            except Exception as exc:  # the model's own out-of-memory
                for _, h, _ in made:
                    model.free(h)
                for k, _, replaced in made:
                    if replaced is None:
                        self._handles.pop(k, None)
                    else:
                        self._handles[k] = replaced
                self._refuse(nbytes, cause=exc)
            made.append((key, handle, old))
            self._handles[key] = handle
        for _, _, replaced in made:
            if replaced is not None:
                model.free(replaced)

    def _release(self, key: int, ref: weakref.ref[torch.UntypedStorage]) -> None:
        with self._lock:
            if self._refs.get(key) is ref:
                self._allocated -= self._live.pop(key)
                del self._refs[key]
                handle = self._handles.pop(key, None)
                if handle is not None and self.allocator is not None:
                    self.allocator.free(handle)

    def _refuse(self, requested: int, cause: BaseException | None = None) -> None:
        self.ooms += 1
        free = self.free_bytes
        msg = (
            f"CUDA out of memory. Tried to allocate {format_bytes(requested)}. "
            f"Simulated GPU 0 ({self.name}) has a total capacity of "
            f"{format_bytes(self.total_bytes)} of which {format_bytes(free)} is free. "
            f"Of the allocated memory {format_bytes(self._allocated)} is allocated by PyTorch"
            + (f" and {format_bytes(self.reserve)} is held back as reserve" if self.reserve else "")
            + (
                ". (vramctl.simulate counts live tensor storages only: no CUDA context, "
                "workspaces or allocator rounding.)"
                if self.allocator is None
                else f", {format_bytes(self.reserved_bytes)} reserved in the allocator model's "
                "segments. (vramctl.simulate: no CUDA context or workspaces.)"
            )
        )
        raise SimulatedOutOfMemoryError(
            msg, requested=requested, free=free, total=self.total_bytes
        ) from cause

    def adopt(self, obj: Any) -> Any:
        """Count tensors made outside the context, as ``.to("cuda")`` would; returns ``obj``.

        Takes a module (parameters and buffers), an optimizer (its state), a
        tensor, or a list, tuple or dict of these.
        """
        found: list[torch.UntypedStorage] = []
        if isinstance(obj, torch.nn.Module):
            leaves: list[Any] = [*obj.parameters(), *obj.buffers()]
        elif isinstance(obj, torch.optim.Optimizer):
            leaves = list(tensors(list(obj.state.values())))
        else:
            leaves = list(tensors(obj))
        for leaf in leaves:
            for t in (leaf, getattr(leaf, "grad", None)):
                st = storage(t) if isinstance(t, torch.Tensor) else None
                if st is not None and not self._tracks(st) and all(st is not f for f in found):
                    found.append(st)
        self._account(found)
        return obj

    def holds(self, obj: Any) -> int:
        """Bytes of ``obj``'s tensors (a module, tensor, or container of them) counted here."""
        leaves = (
            [*obj.parameters(), *obj.buffers()]
            if isinstance(obj, torch.nn.Module)
            else list(tensors(obj))
        )
        seen: set[int] = set()
        held = 0
        with self._lock:
            for leaf in leaves:
                st = storage(leaf) if isinstance(leaf, torch.Tensor) else None
                if st is not None and id(st) not in seen and self._tracks(st):
                    seen.add(id(st))
                    held += self._live[id(st)]
        return held

    @contextlib.contextmanager
    def uncounted(self) -> Iterator[None]:
        """Allocations this thread makes inside are host memory, not a simulated GPU's.

        The simulated ``.to("cpu")``: what is made here is not counted, by this device
        or by any other simulated device active in this thread, so tensors copied
        inside (offloaded activations, a CPU fallback, a model made for another
        simulated device) take no budget. Tensors made here and used afterwards stay
        uncounted.
        """
        paused = [self] + [
            m.device
            for m in _get_current_dispatch_mode_stack()
            if isinstance(m, _Budget) and m.device is not self
        ]
        for dev in paused:
            dev._local.paused = getattr(dev._local, "paused", 0) + 1
        try:
            yield
        finally:
            for dev in paused:
                dev._local.paused -= 1

    def host(self) -> contextlib.AbstractContextManager[None]:
        """The same as :meth:`uncounted`."""
        return self.uncounted()

    # -- context ------------------------------------------------------------------

    def __enter__(self) -> SimulatedDevice:
        if self._mode is not None:
            raise VramctlError(f"{self.id} is already active; enter it once at a time")
        self._mode = _Budget(self)
        self._mode.__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(self, *exc: object) -> None:
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(*exc)  # type: ignore[no-untyped-call]


def active_simulation() -> SimulatedDevice | None:
    """The innermost simulated device whose ``with`` block this thread is in, if any."""
    for mode in reversed(_get_current_dispatch_mode_stack()):
        if isinstance(mode, _Budget):
            return mode.device
    return None


def simulate(
    device: str | int, *, reserve: int | str = 0, allocator: Any = None
) -> SimulatedDevice:
    """A simulated GPU: a catalog name (``"T4-16GB"``) or a size (bytes or ``"16GiB"``).

    A catalog GPU offers the capacity a CUDA process sees on it (``cuda_total_bytes``,
    the "total capacity" of its OOM messages). ``reserve`` holds some of it back,
    for example to stand in for the CUDA context. ``allocator``: a caching allocator model
    (:class:`vramctl.estimator.CachingAllocatorModel`) that every storage is requested
    from, so that reserved memory, rounding, cached blocks and the retry before an OOM
    behave as PyTorch's allocator does (see the module docstring).

    >>> import torch, vramctl
    >>> with vramctl.simulate("T4-16GB") as gpu:
    ...     model = torch.nn.Linear(1024, 1024)
    ...     gpu.memory().allocated == (1024 * 1024 + 1024) * 4
    True
    """
    spec: GpuSpec | None = None
    if isinstance(device, str):
        text = device.strip().removeprefix("sim:")
        if looks_like_size(text):
            total = parse_size(text)  # names what is wrong with a bad size ("-3GiB")
        else:
            spec = gpu_spec(text)
            total = spec.cuda_total_bytes
    else:
        total = parse_size(device)
    reserve_bytes = parse_size(reserve)
    if total <= 0:
        raise InvalidSizeError(f"a simulated device needs a positive size, got {device!r}")
    if reserve_bytes >= total:
        raise VramctlError(
            f"reserve {format_bytes(reserve_bytes)} leaves nothing of {format_bytes(total)}"
        )
    return SimulatedDevice(spec, total, reserve=reserve_bytes, allocator=allocator)
