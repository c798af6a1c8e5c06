"""A recorded step's real request stream through the allocator model, against what happened.

The model starts from the step's recorded segments (``segments_before``), takes every
``alloc`` and ``free_completed`` of the trace in order, and keeps its own segments. The
real side is read off the same trace: the segments PyTorch made (``segment_alloc``) and
released (``segment_free``), and its reserved bytes at their largest. A single-stream step
whose segments are all the model's ``match``es when both the sizes of the segments made, in
order, and the reserved peak are the same. A step run with expandable segments is replayed
through the model's expandable segments (``config.expandable_segments``): the pages it maps
(``segment_map``), in order, and the reserved peak are judged the same way. Steps on
several streams, and expandable steps replayed with fixed segments, are reported, not judged
(``match`` is None).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from _truth.corpus import events, single_stream
from vramctl.estimator import AllocatorConfig, CachingAllocatorModel


@dataclass
class Replay:
    real_segments: list[int] = field(default_factory=list)
    model_segments: list[int] = field(default_factory=list)
    real_peak_reserved: int = 0
    model_peak_reserved: int = 0
    model_peak_allocated: int = 0
    #: Real peak of allocated bytes, blocks rounded as the allocator rounds them.
    real_peak_allocated: int = 0
    single_stream: bool = True
    expandable: bool = False
    #: Frees of blocks the trace never allocated and the segments did not hold.
    unknown_frees: int = 0
    match: bool | None = None
    first_difference: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["real_segments"] = len(self.real_segments)
        d["model_segments"] = len(self.model_segments)
        return d


def replay(trace: dict[str, Any], config: AllocatorConfig | None = None) -> Replay:
    cfg = config or AllocatorConfig()
    model = CachingAllocatorModel(cfg, record_history=True)
    handles = model.seed(trace["segments_before"])
    out = Replay(single_stream=single_stream(trace))
    reserved = sum(s[1] for s in trace["segments_before"])
    out.real_peak_reserved = reserved
    # The blocks allocated before the step, by address: the step may free them.
    live: dict[int, int] = {}
    for addr, _size, _stream, _pool, blocks in trace["segments_before"]:
        for bsize, is_allocated in blocks:
            if is_allocated:
                live[addr] = bsize
            addr += bsize
    allocated = sum(live.values())
    out.real_peak_allocated = allocated
    for action, addr, size, _stream, _op in events(trace):
        if action == "alloc":
            seen = len(model.history)
            handles[addr] = model.malloc(size)
            out.model_segments += [
                s for a, _, s in model.history[seen:] if a in ("segment_alloc", "segment_map")
            ]
            live[addr] = cfg.round_size(size)
            allocated += live[addr]
            out.real_peak_allocated = max(out.real_peak_allocated, allocated)
        elif action == "free_completed":
            h = handles.pop(addr, None)
            if h is None:
                out.unknown_frees += 1
                continue
            model.free(h)
            allocated -= live.pop(addr, 0)
        elif action in ("segment_alloc", "segment_map"):
            out.real_segments.append(size)
            reserved += size
            out.real_peak_reserved = max(out.real_peak_reserved, reserved)
            out.expandable |= action == "segment_map"
        elif action in ("segment_free", "segment_unmap"):
            reserved -= size
    out.model_peak_reserved = model.peak_reserved
    out.model_peak_allocated = model.peak_allocated
    if not out.single_stream or (out.expandable and not cfg.expandable_segments):
        return out
    out.match = (
        out.real_segments == out.model_segments
        and out.real_peak_reserved == out.model_peak_reserved
    )
    if not out.match:
        out.first_difference = _first_difference(out)
    return out


def _first_difference(r: Replay) -> str:
    for i, (a, b) in enumerate(zip(r.real_segments, r.model_segments, strict=False)):
        if a != b:
            return f"segment {i}: real {a} bytes, model {b}"
    if len(r.real_segments) != len(r.model_segments):
        return f"real made {len(r.real_segments)} segments, model {len(r.model_segments)}"
    return f"reserved peak: real {r.real_peak_reserved}, model {r.model_peak_reserved}"


def first_step_from(
    trace: Any, segments_before: list[list[Any]], config: Any = None, *, loop: bool = False
) -> int:
    """The reserved peak of the estimator's first step (``trace``, its cuBLAS workspaces
    made at their first use) begun from the segments a recorded step began with; with
    ``loop``, of that step and the loop's steps after it (as a recorded warm step follows
    the cold one, from the blocks the cold step left cached and split).

    A capture runs every case in one process, and empties the cache before a case's cold
    step; segments that still hold a live block stay, with the free stretches earlier cases
    left in them (a 32 MiB hole where a cuBLAS workspace was, between parameters). The
    estimator's own first step begins from the segments a fresh process makes the state
    in. Begun from the recorded ones instead, the step's storages (not the ``preexisting``
    ones: they are the recorded step's live blocks) go through the model in the trace's
    order; a free of a state storage is not replayed (which block it was is unknown)."""
    import dataclasses

    from vramctl.estimator._cuda_kernels import first_step
    from vramctl.estimator._verdict import replay as replay_trace

    step = first_step(trace)
    events = [e for e in step.events if e < 0 or step.records[e].op != "preexisting"]
    step = dataclasses.replace(step, events=events)
    return replay_trace(step, None, config, segments=segments_before, steady=loop).peak_reserved
