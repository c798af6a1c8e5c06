"""One rank of a distributed training step, traced in this process on fake tensors.

- FSDP2 and tensor parallel run PyTorch's own ``fully_shard`` and ``parallelize_module`` on
  the fake model, over a fake process group of ``world_size`` ranks (collectives do
  nothing; every buffer they need is still allocated, as on the real rank). FSDP2 frees
  and re-allocates gathered parameters by resizing their storages; the tracer sees that.
- DDP's reducer is C++ that reads the data of its tensors, so a stand-in does what it does
  to memory: flat gradient buckets made with the wrapper and kept, each gradient copied into
  its bucket when autograd has accumulated it (and replaced by its bucket view with
  ``gradient_as_bucket_view``), the buffers flattened for their broadcast before forward.
- ZeRO stages change what a rank keeps of the model states, by DeepSpeed's definitions:
  the single-process trace's parameters, gradients and optimizer state are resized to the
  rank's part (:func:`zero_trace`); activations and temporaries are the trace's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from vramctl.estimator._parallel import Parallel, ParallelError, parallelize
from vramctl.estimator._patch import patched
from vramctl.estimator._trace import StorageRecord, Trace, Tracer

__all__ = [
    "DDPStandIn",
    "FakeWorld",
    "fsdp_categories",
    "local",
    "zero_model_states",
    "zero_trace",
]

#: DDP's first bucket is capped at 1 MiB (``dist._DEFAULT_FIRST_BUCKET_BYTES``).
FIRST_BUCKET_BYTES = 1024 * 1024
#: DDP broadcasts buffers in flat chunks of up to 250 MiB.
BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024


def local(t: Any) -> Any:
    """The local tensor of a ``DTensor`` (a rank's shard); any other value as it is."""
    inner = getattr(t, "_local_tensor", None)
    return t if inner is None else inner


# -- a fake process group --------------------------------------------------------------


class FakeWorld:
    """The default process group as a fake one of ``world_size`` ranks, held while any
    session needs it (this process is rank 0)."""

    _lock = threading.Lock()
    _holders = 0
    _size = 0

    def __init__(self, world_size: int) -> None:
        import torch.distributed as dist

        # Registers the "fake" backend (part of PyTorch's wheels).
        import torch.testing._internal.distributed.fake_pg  # noqa: F401

        with FakeWorld._lock:
            if FakeWorld._holders:
                if FakeWorld._size != world_size:
                    raise ParallelError(
                        f"another estimate holds a fake world of {FakeWorld._size} ranks; "
                        f"close it before estimating {world_size}"
                    )
            elif dist.is_initialized():
                raise ParallelError(
                    "this process already has a process group: estimate FSDP and tensor "
                    "parallel layouts before init_process_group, or from `vramctl estimate`"
                )
            else:
                store = dist.HashStore()  # type: ignore[attr-defined]
                dist.init_process_group("fake", store=store, rank=0, world_size=world_size)
                FakeWorld._size = world_size
            FakeWorld._holders += 1
        self._open = True

    def close(self) -> None:
        import torch.distributed as dist

        with FakeWorld._lock:
            if not self._open:
                return
            self._open = False
            FakeWorld._holders -= 1
            if FakeWorld._holders == 0 and dist.is_initialized():
                dist.destroy_process_group()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


# -- DDP --------------------------------------------------------------------------------


@dataclass
class DDPStandIn:
    """What ``DistributedDataParallel`` does to a rank's memory, on the fake model."""

    model: nn.Module
    parallel: Parallel
    #: The flat gradient buckets, kept for the wrapper's life.
    buckets: list[torch.Tensor] = field(default_factory=list)
    views: dict[int, torch.Tensor] = field(default_factory=dict)
    handles: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        params: list[torch.Tensor] = [
            p for p in dict.fromkeys(self.model.parameters()) if p.requires_grad
        ]
        cap = int(self.parallel.bucket_cap_mb * 1024 * 1024)
        for group in _buckets(params[::-1], cap):
            numel = sum(p.numel() for p in group)
            flat = torch.empty(numel, dtype=group[0].dtype)
            self.buckets.append(flat)
            offset = 0
            for p in group:
                self.views[id(p)] = flat[offset : offset + p.numel()].view(p.shape)
                offset += p.numel()
        for p in params:
            self.handles.append(p.register_post_accumulate_grad_hook(self._ready))
        if self.parallel.broadcast_buffers and self.parallel.world_size > 1:
            self.handles.append(self.model.register_forward_pre_hook(self._broadcast))

    def _ready(self, p: torch.Tensor) -> None:
        view = self.views[id(p)]
        if p.grad is None or p.grad.untyped_storage() is view.untyped_storage():
            return
        view.copy_(p.grad)
        if self.parallel.gradient_as_bucket_view:
            p.grad = view

    def _broadcast(self, module: nn.Module, _args: Any) -> None:
        if not torch.is_grad_enabled():
            return
        bufs = [b for b in module.buffers() if b.numel()]
        for chunk in _buckets(bufs, BROADCAST_BUCKET_BYTES, first=BROADCAST_BUCKET_BYTES):
            flat = torch.cat([b.reshape(-1) for b in chunk])
            del flat

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _buckets(
    tensors: list[torch.Tensor], cap: int, first: int = FIRST_BUCKET_BYTES
) -> list[list[torch.Tensor]]:
    """Tensors in buckets by dtype, in order, each closed once it reaches its cap (the
    first at ``first``), as DDP's ``compute_bucket_assignment_by_size`` does."""
    open_: dict[torch.dtype, tuple[list[torch.Tensor], int]] = {}
    done: list[list[torch.Tensor]] = []
    limits: dict[torch.dtype, int] = {}
    for t in tensors:
        group, size = open_.get(t.dtype, ([], 0))
        group.append(t)
        size += t.numel() * t.element_size()
        limit = limits.setdefault(t.dtype, first)
        if size >= limit:
            done.append(group)
            open_.pop(t.dtype, None)
            limits[t.dtype] = cap
        else:
            open_[t.dtype] = (group, size)
    done.extend(g for g, _ in open_.values())
    return done


# -- FSDP2 -------------------------------------------------------------------------------


@contextlib.contextmanager
def fsdp_categories(tracer: Tracer, *, gloo: bool = False) -> Iterator[None]:
    """Storages FSDP2 makes while gathering parameters are ``unsharded``; those it makes
    while reducing gradients (other than the sharded gradients) are ``buckets``.

    With ``gloo`` (a CPU rank), each reduce-scatter also holds a copy of its whole input
    for the call, as gloo's does (NCCL reduces in place)."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    except ImportError:  # pragma: no cover - an older PyTorch
        yield
        return
    with contextlib.ExitStack() as es:
        if gloo:
            es.enter_context(_gloo_reduce_scatter_copies())
        es.enter_context(_fsdp_phases(tracer, FSDPParamGroup))
        yield


@contextlib.contextmanager
def _gloo_reduce_scatter_copies() -> Iterator[None]:
    """``reduce_scatter_single`` / ``reduce_scatter_tensor`` allocate a copy of their input
    that lives for the call (gloo copies the input before reducing it)."""
    import torch.distributed as dist

    names = [n for n in ("reduce_scatter_single", "reduce_scatter_tensor") if hasattr(dist, n)]

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            source = kwargs.get("input", args[1] if len(args) > 1 else None)
            copy = torch.empty_like(source) if isinstance(source, torch.Tensor) else None
            try:
                return fn(*args, **kwargs)
            finally:
                del copy

        return call

    with contextlib.ExitStack() as es:
        for name in names:
            es.enter_context(patched(dist, name, wrap))
        yield


@contextlib.contextmanager
def _fsdp_phases(tracer: Tracer, group_class: Any) -> Iterator[None]:
    categories = {
        "unshard": "unsharded",
        "wait_for_unshard": "unsharded",
        "post_backward": "buckets",
    }

    def wrap(category: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def make(fn: Callable[..., Any]) -> Callable[..., Any]:
            def method(self: Any, *args: Any, **kwargs: Any) -> Any:
                before, tracer.category = tracer.category, category
                try:
                    return fn(self, *args, **kwargs)
                finally:
                    tracer.category = before

            return method

        return make

    with contextlib.ExitStack() as es:
        for name, category in categories.items():
            es.enter_context(patched(group_class, name, wrap(category)))
        yield


def wrap_fake(model: nn.Module, parallel: Parallel) -> DDPStandIn | None:
    """Apply ``parallel`` to the fake ``model`` (a fake world is open for fsdp and tp)."""
    if parallel.strategy == "ddp":
        return DDPStandIn(model, parallel)
    if parallel.strategy in ("fsdp", "tp"):
        if parallel.strategy == "fsdp" and parallel.offload:
            # CPUOffloadPolicy needs a CUDA mesh; the rank's host-side state is priced by
            # moving the sharded parameters, gradients and optimizer state off the device.
            parallel = dataclasses.replace(parallel, offload=False)
        parallelize(model, parallel)
        return None
    return None


# -- ZeRO ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ZeroStates:
    """What one rank holds of the model states under a ZeRO stage (bytes)."""

    parameters: int
    gradients: int
    optimizer: int
    #: Gathered parameters in flight (stage 3) at most.
    unsharded: int
    #: DeepSpeed's gradient reduction buckets during backward.
    buckets: int
    #: What the rank keeps in host memory (offload).
    host: int


def zero_model_states(
    parallel: Parallel,
    *,
    parameters: int,
    param_bytes: int,
    state_elements: int,
    largest_block: int,
    half: bool,
) -> ZeroStates:
    """One rank's model states under ``parallel.zero_stage``, by DeepSpeed's definitions.

    ``parameters`` is the count, ``param_bytes`` the bytes per parameter as trained
    (2 in bf16/fp16, 4 in fp32), ``state_elements`` the optimizer's state elements per
    parameter (Adam: 2), ``largest_block`` the parameters of the largest block (what stage 3
    gathers at once). In half precision DeepSpeed keeps an fp32 master copy with the
    optimizer's fp32 state: ``4 + 4 * state_elements`` bytes a parameter; in fp32 the state
    alone. Stage 1 shards that optimizer part over the ranks, stage 2 the gradients too,
    stage 3 the parameters as well; stage 2 and 3 reduce gradients through buckets of
    ``reduce_bucket_size`` elements (two with stage 3's overlapped communication), and
    stage 3 gathers up to ``prefetch_bucket_size`` parameters ahead of the one in use.
    """
    n = parallel.world_size
    stage = parallel.zero_stage or 0
    per = 4 + 4 * state_elements if half else 4 * state_elements
    opt = parameters * per
    grads = parameters * param_bytes
    params = parameters * param_bytes
    unsharded = buckets = 0
    host = 0
    if stage >= 1:
        opt = math.ceil(parameters / n) * per
    if stage >= 2:
        grads = math.ceil(parameters / n) * param_bytes
        buckets = min(parallel.reduce_bucket_size, parameters) * param_bytes
    if stage >= 3:
        params = math.ceil(parameters / n) * param_bytes
        live = min(largest_block + parallel.prefetch_bucket_size, parameters)
        unsharded = min(live, parallel.max_live_parameters) * param_bytes
        buckets *= 2
    if parallel.offload:
        host = opt + (math.ceil(parameters / n) * 4 if half else 0)
        opt = 0
        if stage >= 3:
            host += params
            params = 0
    return ZeroStates(params, grads, opt, unsharded, buckets, host)


def zero_trace(trace: Trace, categories: dict[int, str], states: ZeroStates) -> Trace:
    """The single-process ``trace`` with one rank's model states under ZeRO: each
    parameter, gradient and optimizer record resized by its category's share, the
    gathered parameters and reduction buckets of stage 3 and 2 added through backward."""
    totals: dict[str, int] = {}
    for sid, rec in enumerate(trace.records):
        cat = categories.get(sid, rec.category)
        totals[cat] = totals.get(cat, 0) + rec.nbytes
    wanted = {
        "parameters": states.parameters,
        "gradients": states.gradients,
        "optimizer": states.optimizer,
    }
    records: list[StorageRecord] = []
    for sid, rec in enumerate(trace.records):
        cat = categories.get(sid, rec.category)
        nbytes = rec.nbytes
        if cat in wanted and totals.get(cat):
            nbytes = round(rec.nbytes * wanted[cat] / totals[cat])
        records.append(
            StorageRecord(nbytes, rec.op, rec.module, rec.phase, cat, rec.freed_phase, rec.node)
        )
    events = list(trace.events)
    extra = [("unsharded", states.unsharded), ("buckets", states.buckets)]
    first_backward = next(
        (i for i, e in enumerate(events) if e >= 0 and trace.records[e].phase == "backward"),
        None,
    )
    first_forward = next(
        (i for i, e in enumerate(events) if e >= 0 and trace.records[e].phase == "forward"),
        None,
    )
    last_backward = max(
        (i for i, e in enumerate(events) if e >= 0 and trace.records[e].phase == "backward"),
        default=None,
    )
    if first_backward is not None and last_backward is not None:
        inserts: list[tuple[int, int]] = []
        for cat, nbytes in extra:
            if nbytes <= 0:
                continue
            sid = len(records)
            phase = "forward" if cat == "unsharded" else "backward"
            records.append(StorageRecord(nbytes, "zero", "", phase, cat, "backward"))
            start = (
                first_forward
                if cat == "unsharded" and first_forward is not None
                else (first_backward)
            )
            inserts.append((start, sid))
            inserts.append((last_backward + 1, ~sid))
        for at, e in sorted(inserts, key=lambda x: x[0], reverse=True):
            events.insert(at, e)
    out = Trace(events=events, records=records)
    out.assumptions = list(trace.assumptions)
    out.ops = trace.ops
    out.costs = list(trace.costs)
    return out
