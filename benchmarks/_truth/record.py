"""Recording a case's steps: on a real GPU, or on a simulated one in the same format.

Both run the case's real step twice (``cold``: the first step, after the allocator's cache
and cuBLAS' workspaces were emptied; ``warm``: the next one) under a dispatch mode that
numbers each aten operator call.

- **CUDA.** PyTorch's allocator history (``torch.cuda.memory._record_memory_history``,
  without stack frames) gives every allocation, free and segment. Each is tied to the
  operator call that made it by the allocator's own counters of allocations and frees
  (``memory_stats``), read before and after every call: the k-th allocation of the step
  belongs to the call during which the count passed k, or to none. The warm step also
  times each call on the GPU with CUDA events. The figures are PyTorch's peaks and NVML's
  reading for the process; the context is NVML's reading less the reserved bytes.
- **Simulated.** The same step runs on the CPU. Each storage an operator makes is an
  allocation of its size; its free is when the storage dies. That request stream goes
  through :class:`vramctl.estimator.CachingAllocatorModel`, whose segments and addresses
  make the trace. Its figures are the model's, so a simulated corpus checks the tools,
  never the estimator.
"""

from __future__ import annotations

import bisect
import gc
import os
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from _truth.cases import Built, build, case_allocator
from _truth.corpus import TraceBuilder


def op_name(func: Any) -> str:
    """An operator's name as the estimator's trace writes it (``mm``, ``addmm`` ...)."""
    return str(getattr(func, "__name__", func)).split(".")[0]


# -- the step -----------------------------------------------------------------------------


def prepare(spec: dict[str, Any], device: str) -> tuple[Built, Callable[[], None]]:
    """The case's model and batch on ``device`` and a function that runs one step."""
    from vramctl.estimator._spec import StepSpec, prepare_model, run_step, warm_optimizer

    built = build(spec, device)
    opts = spec.get("options") or {}
    kind = "cuda" if device.startswith("cuda") else "cpu"
    loss_fn = built.estimate_kwargs.get("loss_fn")
    step_spec = StepSpec(
        mode=spec["mode"],
        precision=spec["precision"],
        checkpointing=bool(spec.get("checkpointing")),
        autocast_device=kind,
        foreach=True if kind == "cuda" else None,
        loss_fn=loss_fn,
        max_new_tokens=int(spec.get("max_new_tokens") or 0),
        cache=str(spec.get("cache") or "dynamic"),
    )
    model = built.model
    if step_spec.param_dtype is not None:
        model.to(step_spec.param_dtype)
    prepare_model(model, step_spec)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = step_spec.make_optimizer(params)
    if opt is not None:
        warm_optimizer(opt, params)
    batch = built.batch
    if opts.get("grad_scaler"):
        scaler = torch.amp.GradScaler(kind)

        def step() -> None:
            with step_spec.forward_context():
                from vramctl._step import call_model

                out = call_model(model, batch)
                loss = step_spec.loss(out, batch)
            scaler.scale(loss).backward()
            del out, loss
            assert opt is not None
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)

        return built, step
    if opts.get("prefetch_stream") and kind == "cuda":
        side = torch.cuda.Stream()
        host = (
            {k: v.cpu().pin_memory() for k, v in batch.items()} if isinstance(batch, dict) else None
        )

        def step() -> None:
            with torch.cuda.stream(side):
                nxt = {k: v.to(device, non_blocking=True) for k, v in (host or {}).items()}
            run_step(model, batch, step_spec, opt)
            torch.cuda.current_stream().wait_stream(side)
            for v in nxt.values():
                v.record_stream(torch.cuda.current_stream())
            del nxt

        return built, step
    return built, lambda: run_step(model, batch, step_spec, opt)


# -- numbering operator calls --------------------------------------------------------------


class CallRecorder(TorchDispatchMode):
    """Numbers each operator call into a :class:`TraceBuilder`; hooks run around each."""

    def __init__(
        self,
        builder: TraceBuilder,
        before: Callable[[int], None] = lambda i: None,
        after: Callable[[int, Any], None] = lambda i, out: None,
    ) -> None:
        super().__init__()
        self.builder = builder
        self.before = before
        self.after = after
        self.current = -1

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        i = self.builder.call(op_name(func))
        outer, self.current = self.current, i
        self.before(i)
        try:
            out = func(*args, **(kwargs or {}))
        finally:
            self.current = outer
        self.after(i, out)
        return out


# -- CUDA -----------------------------------------------------------------------------------


def _counts(index: int) -> tuple[int, int]:
    """The allocator's counts of allocations and frees so far (read around every call)."""
    # The nested dict straight from C++: memory_stats() flattens and sorts it in Python.
    alloc = torch._C._cuda_memoryStats(index)["allocation"]["all"]
    return int(alloc["allocated"]), int(alloc["freed"])


def snapshot_segments(snapshot: dict[str, Any], index: int) -> list[list[Any]]:
    out = []
    for seg in sorted(snapshot.get("segments", []), key=lambda s: s["address"]):
        if seg.get("device", index) != index:
            continue
        blocks = [[b["size"], 0 if b["state"] == "inactive" else 1] for b in seg["blocks"]]
        out.append([seg["address"], seg["total_size"], seg["stream"], seg["segment_type"], blocks])
    return out


def _history(on: bool) -> None:
    if not on:
        torch.cuda.memory._record_memory_history(None)
        return
    try:
        torch.cuda.memory._record_memory_history("all", context=None, clear_history=True)
    except TypeError:  # an older PyTorch: no clear_history
        torch.cuda.memory._record_memory_history(None)
        torch.cuda.memory._record_memory_history("all", context=None)


def nvml_process_bytes(index: int) -> int | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
            if p.pid == os.getpid() and p.usedGpuMemory is not None:
                return int(p.usedGpuMemory)
    except Exception:
        return None
    return None


def plain_step_peaks(step: Callable[[], None], index: int) -> dict[str, int]:
    """One more warm step with nothing recorded around it: its allocated and reserved
    peaks. A recorded step differs: while the recorder's dispatch mode is active, autograd
    sums every gradient out of place (``_truth.cases.recorded_per_call``)."""
    torch.cuda.synchronize(index)
    torch.cuda.reset_peak_memory_stats(index)
    step()
    torch.cuda.synchronize(index)
    return {
        "plain_max_allocated": torch.cuda.max_memory_allocated(index),
        "plain_max_reserved": torch.cuda.max_memory_reserved(index),
    }


def clean_step_seconds(step: Callable[[], None], index: int, runs: int = 3) -> float:
    """The median wall time of ``runs`` more warm steps, nothing recorded around them: what
    the step takes (the recorded steps' times carry the per-call recording)."""
    times = []
    for _ in range(runs):
        torch.cuda.synchronize(index)
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize(index)
        times.append(time.perf_counter() - t0)
    return round(sorted(times)[len(times) // 2], 5)


def record_cuda_step(step: Callable[[], None], index: int, timed: bool) -> tuple[dict, dict]:
    """One real step on ``cuda:index``: its trace and its figures."""
    torch.cuda.synchronize(index)
    builder = TraceBuilder()
    builder.segments_before = snapshot_segments(torch.cuda.memory._snapshot(), index)
    allocated0 = torch.cuda.memory_allocated(index)
    reserved0 = torch.cuda.memory_reserved(index)
    torch.cuda.reset_peak_memory_stats(index)
    retries0 = torch.cuda.memory_stats(index).get("num_alloc_retries", 0)
    a0, f0 = _counts(index)
    marks: dict[int, tuple[int, int, int, int]] = {}
    events: dict[int, tuple[Any, Any]] = {}
    pending: dict[int, tuple[int, int]] = {}

    def before(i: int) -> None:
        if timed:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            events[i] = (start, None)
        pending[i] = _counts(index)

    def after(i: int, out: Any) -> None:
        a, f = _counts(index)
        ba, bf = pending.pop(i)
        marks[i] = (ba - a0, a - a0, bf - f0, f - f0)
        if timed:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            events[i] = (events[i][0], end)

    _history(True)
    t0 = time.perf_counter()
    try:
        with CallRecorder(builder, before, after):
            step()
        torch.cuda.synchronize(index)
        snap = torch.cuda.memory._snapshot()
    finally:
        _history(False)
    wall = time.perf_counter() - t0
    trace = snap["device_traces"][index] if snap.get("device_traces") else []
    dropped = add_history(builder, trace, marks)
    if timed:
        for i, (start, end) in events.items():
            if end is not None:
                builder.calls[i][1] = round(start.elapsed_time(end) * 1000.0, 1)
    nvml = nvml_process_bytes(index)
    reserved_now = torch.cuda.memory_reserved(index)
    figures = {
        "max_allocated": torch.cuda.max_memory_allocated(index),
        "max_reserved": torch.cuda.max_memory_reserved(index),
        "nvml_bytes": nvml,
        "context_bytes": None if nvml is None else nvml - reserved_now,
        "allocated_before": allocated0,
        "reserved_before": reserved0,
        "alloc_retries": torch.cuda.memory_stats(index).get("num_alloc_retries", 0) - retries0,
        "wall_s": round(wall, 4),
    }
    if dropped:
        figures["dropped_entries"] = dropped
    return builder.build(), figures


def add_history(
    builder: TraceBuilder,
    entries: list[dict[str, Any]],
    marks: dict[int, tuple[int, int, int, int]],
) -> int:
    """Add a step's allocator history (a snapshot's ``device_traces`` entries) as events.

    ``marks[call]`` is ``(allocations before, after, frees before, after)`` the call,
    counted from the step's start. The k-th ``alloc`` is tied to the call whose span of
    allocations holds k, the k-th ``free_requested`` likewise by frees; the rest to none.
    Returns how many entries of other actions (``snapshot``, ``user_defined`` ...) were
    left out.
    """
    by_alloc = _owner(marks, 0)
    by_free = _owner(marks, 2)
    n_alloc = n_free = dropped = 0
    for entry in entries:
        action = entry["action"]
        call = -1
        if action == "alloc":
            call = by_alloc(n_alloc)
            n_alloc += 1
        elif action == "free_requested":
            call = by_free(n_free)
            n_free += 1
        elif action not in KEPT:
            dropped += 1
            continue
        builder.event(action, entry["addr"], entry["size"], entry.get("stream", 0), call)
    return dropped


KEPT = ("free_completed", "segment_alloc", "segment_free", "segment_map", "segment_unmap", "oom")


def _owner(marks: dict[int, tuple[int, int, int, int]], at: int) -> Callable[[int], int]:
    """For the k-th allocation (``at`` 0) or free (``at`` 2): the call it happened in, or -1.

    Calls do not nest (the mode is off while an operator runs), so their spans of the
    allocator's counts do not overlap.
    """
    spans = sorted((m[at], m[at + 1], i) for i, m in marks.items() if m[at + 1] > m[at])
    starts = [lo for lo, _, _ in spans]

    def find(k: int) -> int:
        j = bisect.bisect_right(starts, k) - 1
        if j >= 0 and spans[j][0] <= k < spans[j][1]:
            return spans[j][2]
        return -1

    return find


# -- simulated ----------------------------------------------------------------------------


class _StorageLife:
    """Allocations and frees of the storages operators make, in order, on the host."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, int, int, int]] = []  # (kind, key, nbytes, call)
        self.recorder: CallRecorder | None = None
        self._next = 0
        self._seen: dict[int, int] = {}

    def adopt(self, out: Any, call: int) -> None:
        from vramctl._tensors import storage, tensors

        for t in tensors(out):
            st = storage(t)
            if st is None or st.nbytes() == 0:
                continue
            ptr = st.data_ptr()
            if ptr in self._seen:
                continue
            key = self._next
            self._next += 1
            self._seen[ptr] = key
            self.requests.append(("alloc", key, st.nbytes(), call))
            weakref.finalize(st, self._died, ptr, key)

    def _died(self, ptr: int, key: int) -> None:
        if self._seen.get(ptr) == key:
            del self._seen[ptr]
        rec = self.recorder
        self.requests.append(("free", key, 0, rec.current if rec is not None else -1))


def record_simulated(spec: dict[str, Any]) -> tuple[dict[str, dict], dict[str, dict]]:
    """A case's cold and warm steps on the CPU, through the allocator model (with
    expandable segments where the case runs with them)."""
    from vramctl.estimator import CachingAllocatorModel

    life = _StorageLife()
    setup = TraceBuilder()
    with CallRecorder(setup, after=lambda i, out: life.adopt(out, -1)):
        built, step = prepare(spec, "cpu")
        from vramctl._tensors import tensors

        for t in [*built.model.parameters(), *built.model.buffers(), *tensors(built.batch)]:
            life.adopt(t, -1)
    gc.collect()
    model = CachingAllocatorModel(case_allocator(spec), record_history=True)
    handles: dict[int, int] = {}
    _apply(model, life.requests, handles, None)
    traces: dict[str, dict] = {}
    figures: dict[str, dict] = {}
    for name in ("cold", "warm"):
        if name == "cold":
            model.empty_cache()
        builder = TraceBuilder()
        builder.segments_before = model.segments_state()
        life.requests = []
        before = (model.allocated, model.reserved)
        model.peak_allocated, model.peak_reserved = model.allocated, model.reserved
        t0 = time.perf_counter()
        recorder = CallRecorder(builder, after=lambda i, out: life.adopt(out, i))
        life.recorder = recorder
        with recorder:
            step()
        gc.collect()
        life.recorder = None
        wall = time.perf_counter() - t0
        _apply(model, life.requests, handles, builder)
        traces[name] = builder.build()
        figures[name] = {
            "max_allocated": model.peak_allocated,
            "max_reserved": model.peak_reserved,
            "nvml_bytes": None,
            "context_bytes": None,
            "allocated_before": before[0],
            "reserved_before": before[1],
            "alloc_retries": 0,
            "wall_s": round(wall, 4),
            "step_s": None,
        }
    del built, step
    gc.collect()
    return traces, figures


def _apply(
    model: Any,
    requests: list[tuple[str, int, int, int]],
    handles: dict[int, int],
    builder: TraceBuilder | None,
) -> None:
    for kind, key, nbytes, call in requests:
        seen = len(model.history)
        if kind == "alloc":
            h = model.malloc(nbytes)
            handles[key] = h
            new = model.history[seen:]
            if builder is not None:
                for action, addr, size in new:
                    builder.event(action, addr, size, 0, -1)
                builder.event("alloc", model.address(h), nbytes, 0, call)
        else:
            h = handles.pop(key, None)
            if h is None:
                continue
            addr, size = model.address(h), model.requested_size(h)
            model.free(h)
            if builder is not None:
                builder.event("free_requested", addr, size, 0, call)
                builder.event("free_completed", addr, size, 0, -1)
