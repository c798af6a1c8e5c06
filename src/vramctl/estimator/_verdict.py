"""From a step's trace to an :class:`Estimate`: the trace replayed through the CUDA
caching-allocator model, the breakdown at the peak, whether it fits (at the point estimate
and at the safe end), the notes, and the step's predicted time."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import torch

from vramctl._units import format_bytes
from vramctl.estimator import _cuda_model
from vramctl.estimator._allocator import (
    AllocatorConfig,
    AllocatorOutOfMemory,
    CachingAllocatorModel,
)
from vramctl.estimator._calibration import measured_on
from vramctl.estimator._cpu_kernels import rank_thread_count
from vramctl.estimator._cuda_kernels import first_step
from vramctl.estimator._request import Step
from vramctl.estimator._result import CATEGORIES, Estimate, no_bf16_note, uncalibrated_note
from vramctl.estimator._target import Target
from vramctl.estimator._timing import Rates, predict
from vramctl.estimator._trace import Trace
from vramctl.estimator._trace_step import Opened, Traced

__all__ = ["NCCL_UNCERTAINTY", "Judged", "build_estimate"]

#: What NCCL's communicator buffers may add on a GPU, outside PyTorch's allocator.
NCCL_UNCERTAINTY = 1 << 30
#: The most steps a steady replay takes (:func:`replay`); a loop's layout repeats sooner.
STEADY_STEPS = 8


class Judged(Opened, Protocol):
    """What an estimate reads of a session besides: the request it judges and times the
    step by, and the rates it times it with."""

    @property
    def request(self) -> Step: ...
    @property
    def rates(self) -> Rates | None: ...


def build_estimate(
    session: Judged,
    traced: Traced,
    *,
    seq_len: int | None,
    seconds: float | None,
    elapsed: float,
) -> Estimate:
    """``traced`` judged on the session's device by its request: the peak and where it
    goes, whether it fits at the request's target utilization, and its predicted time."""
    trace, target, spec, request = traced.trace, session.target, session.spec, session.request
    target_utilization, allocator_config, safe = (
        request.target_utilization,
        request.allocator_config,
        request.safe,
    )
    par = session.parallel
    host = 0
    if par is not None and par.strategy == "fsdp" and par.offload:
        trace, host = _offloaded(trace, traced.categories)
    elif par is not None and par.zero_stage is not None:
        host = traced.host
    # a loop's peak, as the allocator's replay takes it: what a step makes and keeps (a
    # cache its forward makes once) is live from the next step's start
    loop = trace.loop()
    logical, at = loop.peak()
    by_cat = dict.fromkeys(CATEGORIES, 0)
    for sid in loop.live_at(at):
        by_cat[traced.categories[sid]] += trace.records[sid].nbytes
    peak_rec = trace.records[loop.events[at]] if at >= 0 else None
    budget = int(target.capacity * target_utilization)
    notes: list[str] = []
    retries = {False: 0, True: 0}
    fits = {False: False, True: False}  # at the point estimate, at the safe end
    first_step_allocated: int | None = None
    first_step_reserved: int | None = None
    state_reserved: int | None = None
    uncertainty = 0
    calibrated = True
    profile = None
    if target.cuda:
        consts = target.constants
        context = consts.context_bytes + (consts.cudnn_context_bytes if traced.convolutions else 0)
        multi_rank = par is not None and par.world_size > 1
        if request.side_streams or multi_rank:
            context += consts.stream_pool()
            notes.append(
                f"PyTorch's pool of side streams ({'NCCL' if multi_rank else 'the loop'}'s "
                f"streams) takes {format_bytes(consts.stream_pool())} outside its allocator "
                "(in the context)"
            )
        allocator_config = allocator_of(target, allocator_config)
        # a process's loop: its first step makes each cuBLAS workspace at its first
        # matrix product, where a block is free then, and the steps after it are served
        # from the blocks that step left cached and split
        seen = first_step(trace)
        alloc = replay(seen, None, allocator_config, steady=True)
        allocated, reserved = alloc.peak_allocated, alloc.peak_reserved
        first_replay = replay(seen, None, allocator_config)
        first = first_replay.peak_allocated
        first_step_allocated, first_step_reserved = first, first_replay.peak_reserved
        state_reserved = _state_reserved(trace, allocator_config)
        if first < allocated:
            notes.append(
                f"a process's first step allocates {format_bytes(first)} at its peak: it "
                "makes each cuBLAS workspace at its first matrix product, and the steps "
                "after it hold them from their start (the peaks above are a loop's)"
            )
        cal = target.calibration
        same_gpu = cal is not None and measured_on(cal, target.name)
        calibrated = same_gpu
        profile = cal.describe() if cal is not None else None
        uncertainty = _cuda_model.device_uncertainty(
            cal, same_gpu, traced.convolutions, reserved + context
        )
        if par is not None and par.world_size > 1:
            uncertainty += NCCL_UNCERTAINTY
            notes.append(
                f"NCCL's own buffers are outside PyTorch's allocator and not modelled: "
                f"nvidia-smi may read up to {format_bytes(NCCL_UNCERTAINTY)} more per rank "
                "(NVLS and many channels take the most)"
            )
        for end in (False, True):  # the point estimate, the safe end
            extra = context + (uncertainty if end else 0)
            fits[end], retries[end] = _fits_capped(seen, reserved, budget - extra, allocator_config)
        notes.extend(_retries_note(retries[safe]))
        notes.extend(_later_steps_note(seen, allocator_config, reserved))
        by_cat["allocator"] = reserved - logical
        by_cat["context"] = context
        peak_device = reserved + context
        if cal is None:
            varies = (
                "the CUDA context and cuDNN's kernels and workspaces vary"
                if traced.convolutions
                else "the CUDA context varies"
            )
            notes.append(
                f"CUDA constants: built-in values; nvidia-smi may read up to "
                f"{format_bytes(uncertainty)} more ({varies} with the driver, CUDA version "
                "and module loading)"
            )
        elif same_gpu and cal.evidence is not None:
            notes.append(
                f"CUDA constants measured on {cal.describe()}; over "
                f"{cal.evidence.describe()} nvidia-smi read at most "
                f"{cal.evidence.shortfall_pct:.1f}% above the estimate: it may read up to "
                f"{format_bytes(uncertainty)} more here"
            )
        elif same_gpu:
            notes.append(
                f"CUDA constants measured on {cal.describe()}; no recorded steps for this "
                f"GPU: nvidia-smi may read up to {format_bytes(uncertainty)} more (a fixed "
                "allowance)"
            )
        else:
            notes.append(
                f"CUDA constants measured on {cal.describe()}, another GPU than "
                f"{target.name}; nvidia-smi may read up to {format_bytes(uncertainty)} more"
            )
        if not calibrated:
            notes.append(uncalibrated_note(target.name, target.capability is None))
    elif target.allocator is not None:
        # A simulated GPU whose storages go through a caching allocator model: its
        # segments are the device's used memory; no context or workspace.
        seen = device_trace(traced, target)
        config = allocator_of(target, allocator_config)
        alloc = replay(seen, None, config, steady=True)
        # The device counts its live storages' bytes as allocated (not the blocks').
        allocated, reserved = alloc.peak_requested, alloc.peak_reserved
        first_step_allocated = allocated  # no workspaces on a simulated GPU
        first_step_reserved = replay(seen, None, config).peak_reserved
        state_reserved = _state_reserved(seen, config)
        peak_device = reserved
        fit, retried = _fits_capped(seen, reserved, budget, config)
        fits = dict.fromkeys((False, True), fit)
        retries = dict.fromkeys((False, True), retried)
        by_cat["allocator"] = reserved - logical
        notes.extend(_retries_note(retried))
        notes.extend(_later_steps_note(seen, config, reserved))
        notes.append(
            "simulated GPU with a caching allocator model: its segments counted, no CUDA "
            "context or workspace"
        )
    else:
        allocated = reserved = peak_device = logical
        fits[False] = fits[True] = peak_device <= budget
        notes.append("CPU target: live tensor bytes, no CUDA context or allocator modelled")
        if par is not None and par.world_size > 1:
            ranks = par.ranks_per_node or par.world_size
            threads = rank_thread_count(ranks)
            notes.append(
                f"a CPU rank over gloo: its reduce-scatter's copy of the input is counted; "
                f"kernel scratch measured with {threads} thread(s) a rank, as torchrun starts "
                f"{ranks} rank(s) on a host"
            )
    rates = session.rates
    tp = request.throughput
    if tp is None and rates is not None:
        tp = rates.target(target)
    timed = None
    if tp is None:
        notes.append(
            f"step time: not predicted for a GPU known only by its size ({target.name}); "
            "name a catalog GPU"
        )
    else:
        on_host = target.cuda and any(c.phase == "host" for c in trace.costs)
        tf32 = bool(request.tf32)
        timed = predict(
            trace.costs,
            tp,
            tf32=target.cuda and _tf32_capable(target) and tf32,
            host=rates.host() if on_host and rates is not None else None,
            autocast=spec.autocast_dtype is not None,
        )
        notes.append(
            f"step time: ±{100 * tp.error:.0f}% "
            f"({'measured on this device' if tp.measured else 'uncalibrated data sheet'}); "
            "the traced operators only: the training loop's own Python, data loading and "
            "waits on the host are not in it"
        )
    cc = target.capability
    bf16 = torch.bfloat16 in (spec.param_dtype, spec.autocast_dtype)
    if bf16 and target.cuda and cc is not None and not cc.bf16:
        notes.append(no_bf16_note(target.name, str(cc)))
    if spec.autocast_dtype is not None and target.cuda:
        notes.append(
            "autocast: CUDA's fp32 rules (norms, softmax, exp/log/pow, sums, losses) applied "
            "to a CPU trace"
        )
    return Estimate(
        model=session.name,
        device=target.name,
        capacity=target.capacity,
        mode=spec.mode,
        precision=spec.precision,
        batch_size=traced.batch_size,
        seq_len=seq_len,
        seconds=seconds,
        logical_peak=logical,
        peak_allocated=allocated,
        peak_reserved=reserved,
        peak_device=peak_device,
        breakdown=by_cat,
        peak_op=peak_rec.op if peak_rec else "",
        peak_module=peak_rec.module if peak_rec else "",
        peak_phase=peak_rec.phase if peak_rec else "",
        target_utilization=target_utilization,
        fits=fits[safe],
        assumptions=tuple(trace.assumptions),
        notes=tuple(notes),
        alloc_retries=retries[safe],
        ops=trace.ops,
        elapsed=elapsed,
        parameters=session.parameter_count,
        optimizer=_optimizer_name(session),
        checkpointing=spec.checkpointing,
        cuda=target.cuda,
        calibration=profile,
        calibrated=calibrated,
        device_uncertainty=uncertainty,
        safe=safe,
        fits_point=fits[False],
        fits_safe=fits[True],
        flops=timed.flops if timed else sum(c.flops for c in trace.costs),
        bytes_moved=timed.bytes if timed else sum(c.bytes for c in trace.costs),
        step_seconds=timed.seconds if timed else None,
        time_breakdown=dict(timed.by_group) if timed else {},
        phase_seconds=dict(timed.by_phase) if timed else {},
        throughput=tp.source if tp else None,
        step_seconds_error=tp.error if tp else None,
        parallel=par.describe() if par is not None else None,
        world_size=par.world_size if par is not None else 1,
        host_per_rank=host,
        host_per_node=host * ((par.ranks_per_node or par.world_size) if par else 1),
        first_step_peak_allocated=first_step_allocated,
        first_step_peak_reserved=first_step_reserved,
        state_reserved=state_reserved,
    )


def _offloaded(trace: Trace, categories: dict[int, str]) -> tuple[Trace, int]:
    """One FSDP2 rank with CPU offload: its sharded parameters, gradients and optimizer
    state (and the optimizer's step) are in host memory; the device keeps the rest."""
    host = 0
    records = []
    for sid, rec in enumerate(trace.records):
        cat = categories.get(sid, rec.category)
        if cat in ("parameters", "gradients", "optimizer") or (
            rec.phase == "optimizer" and cat == "temporaries"
        ):
            if cat != "temporaries":
                host += rec.nbytes
            rec = dataclasses.replace(rec, nbytes=0)
        records.append(rec)
    out = dataclasses.replace(trace, records=records)
    return out, host


def replay(
    trace: Trace,
    capacity: int | None,
    config: AllocatorConfig | None,
    sizes: list[int] | None = None,
    *,
    steady: bool = False,
    segments: list[list[Any]] | None = None,
) -> CachingAllocatorModel:
    """``trace``'s requests through the caching allocator model (``capacity``: its cap,
    above which it gives its cache back and retries, then raises
    :class:`~vramctl.estimator.AllocatorOutOfMemory`); ``sizes``: each storage's bytes
    in place of its record's.

    ``steady``: the step is taken again, as a loop takes it, until the allocator's layout
    after a step repeats (at most :data:`STEADY_STEPS` steps): a step's storages that it
    frees (its inputs, activations, gradients and temporaries) are requested anew, from
    the blocks the steps before it left cached and split. A second step can need a
    segment the first did not, or fail under a cap the first fitted.

    ``segments``: begin from these (as :meth:`CachingAllocatorModel.segments_state` or a
    recorded snapshot gives them) instead of an empty cache."""
    cfg = config or AllocatorConfig()
    if capacity is not None:
        cfg = AllocatorConfig(**{**cfg.__dict__, "capacity": capacity})
    alloc = CachingAllocatorModel(cfg)
    if segments is not None:
        alloc.seed(segments)
    nbytes = sizes if sizes is not None else [r.nbytes for r in trace.records]

    def run(events: list[int]) -> None:
        handles: dict[int, int] = {}
        for e in events:
            if e >= 0:
                handles[e] = alloc.malloc(nbytes[e])
            else:
                h = handles.pop(~e, None)
                if h is not None:
                    alloc.free(h)

    run(trace.events)
    if steady:
        freed = {~e for e in trace.events if e < 0}
        again = [e for e in trace.events if (e if e >= 0 else ~e) in freed]
        layout = alloc.layout()
        for _ in range(STEADY_STEPS - 1):
            run(again)
            after = alloc.layout()
            if after == layout:
                break
            layout = after
    return alloc


def _state_reserved(trace: Trace, config: AllocatorConfig | None) -> int:
    """The reserved bytes of the segments a fresh process makes the step's state in: the
    storages that exist before the step (``preexisting``), through the allocator model in
    the trace's order."""
    state = [e for e in trace.events if e >= 0 and trace.records[e].op == "preexisting"]
    return replay(dataclasses.replace(trace, events=state), None, config).peak_reserved


def allocator_of(target: Target, requested: AllocatorConfig | None) -> AllocatorConfig | None:
    """The caching allocator's configuration a step on ``target`` is replayed with: the
    request's, over a calibration profile's measured one (CUDA) or a simulated GPU's
    model's; None where the target has no caching allocator (the CPU, a plain simulated
    GPU)."""
    if target.cuda:
        measured = target.constants.allocator if target.calibration is not None else None
        if measured is None:
            return requested or AllocatorConfig()
        return measured if requested is None else requested.over(measured)
    if target.allocator is not None:
        return target.allocator if requested is None else requested
    return None


def device_trace(traced: Traced, target: Target) -> Trace:
    """The requests the device's allocator sees of a one-process step: on CUDA all of
    them, in a process's first step's order (:func:`first_step`: each cuBLAS workspace made
    at its first use), which a loop's replay (``steady``) begins with; on a simulated GPU,
    none of the kernels' scratch (host memory it never sees)."""
    if target.cuda:
        return first_step(traced.trace)
    trace, categories = traced.trace, traced.categories
    records = trace.records
    events = [
        e
        for e in trace.events
        if categories.get(e if e >= 0 else ~e, records[e if e >= 0 else ~e].category)
        != "workspaces"
    ]
    return dataclasses.replace(trace, events=events)


def _fits_capped(
    trace: Trace, reserved: int, room: int, config: AllocatorConfig | None
) -> tuple[bool, int]:
    """Whether a step whose unbounded replay reserves ``reserved`` fits the allocator's
    ``room``: at once, or once the allocator, capped there, gives its cache back and
    retries; and how many times it retried."""
    if reserved <= room:
        return True, 0
    if room <= 0:
        return False, 0
    try:
        tight = replay(trace, room, config, steady=True)
    except AllocatorOutOfMemory:
        return False, 0
    return True, tight.alloc_retries


def _retries_note(retries: int) -> list[str]:
    if not retries:
        return []
    return [
        f"fits only because the allocator frees its cache {retries} time(s) "
        "(alloc retries slow a step)"
    ]


def _later_steps_note(trace: Trace, config: AllocatorConfig | None, reserved: int) -> list[str]:
    """A note where a loop's later steps reserve more than its first (``reserved``: the
    loop's peak)."""
    first = replay(trace, None, config).peak_reserved
    if reserved <= first:
        return []
    note = (
        f"a loop's later steps reserve {format_bytes(reserved - first)} more than its first "
        f"({format_bytes(first)}): they are served from the blocks the first left cached, "
        "and split them; PyTorch's remedies are PYTORCH_CUDA_ALLOC_CONF's max_split_size_mb "
        "and expandable_segments:True (both priced with allocator_config=)"
    )
    base = config or AllocatorConfig()
    if not base.expandable_segments:
        grown = dataclasses.replace(base, expandable_segments=True)
        alt = replay(trace, None, grown, steady=True).peak_reserved
        if alt < reserved:
            note += (
                f"; with expandable_segments:True the loop would reserve "
                f"{format_bytes(reserved - alt)} less"
            )
    return [note]


def _tf32_capable(target: Target) -> bool:
    cc = target.capability
    return cc is not None and cc.major >= 8


def _optimizer_name(session: Judged) -> str | None:
    if session.optimizer is None:
        return None
    opt = session.spec.optimizer
    if isinstance(opt, str):
        return opt
    return str(getattr(opt, "__qualname__", None) or type(session.optimizer).__name__)
