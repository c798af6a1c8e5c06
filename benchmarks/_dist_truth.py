"""The measured truth of one distributed training step: each rank's peak, on CPU with gloo.

Every rank is its own Python process (``python -c`` bootstrapping this module with the
caller's import path, so it works the same from a benchmark script and from pytest), joined
by ``init_process_group("gloo", init_method="tcp://127.0.0.1:PORT")``, one torch thread
each. A rank builds the zoo model as ``estimate_accuracy.real_setup`` does (seed 0, the
step's precision, ``prepare_model``, floating inputs drawn from ``normal_``), wraps it with
:func:`vramctl.estimator._parallel.parallelize` (DDP; or FSDP2's ``fully_shard`` on the
repeated blocks and the root), builds the optimizer over the wrapped model's parameters
and warms it (``warm_optimizer``), runs the un-measured steps (two for DDP, whose reducer
rebuilds its buckets at the start of its second step; one otherwise), collects garbage and
measures one step under PyTorch's profiler, marked with ``record_function``:

- :func:`measure`, what the benchmarks use, is ``_common.cpu_step_peak`` for a rank: the
  bytes of the distinct storages the rank holds before the step, plus the most the step
  adds. What a rank holds: the wrapped model's parameters and buffers (FSDP2's DTensor
  parameters by their local shards, whose storage is FSDP's padded shard, counted once),
  the optimizer's state (local shards; not Adam's one-element ``step``), the batch, and
  DDP's gradient buckets, which the C++ reducer holds out of Python's sight (their sizes
  from ``reducer._get_zeros_like_grad_buckets()``, zeroed copies of the live buckets).
- :func:`measure_whole`, its check, profiles the rank's whole life from before the model is
  built and takes the allocator's own count of live bytes at its largest inside the step:
  nothing comes from Python's view of the tensors, so whatever a wrapper, the reducer or the
  process group keeps would show up as a difference. On lstm and t5-small, DDP (with and
  without ``gradient_as_bucket_view``) and FSDP2 (with and without
  ``reshard_after_forward``), 2 and 4 ranks, the two agree within 600 bytes.
  :func:`measure_both` gives both figures from one set of ranks (the whole-life profile,
  with Python's view of what the rank holds taken just before the step).

How the step's peak is read. Each rank turns on c10's ``caffe2_report_cpu_memory_usage``
flag (through ``ctypes``, before anything is allocated): the CPU allocator then keeps a
running total of its live bytes over every allocation and free on every thread, and each
allocation event the profiler records carries that total. The step's peak is the largest
total in the step less the total when it began. Two simpler readings are wrong here:

- ``_common.profiled_peak`` (the memory profiler's timeline) raises on FSDP2 steps of
  models with blocks (its data-flow pass asserts "version mismatch");
- any sum of the events' own sizes (the timeline's too) keeps blocks whose free was never
  recorded: gloo's reduce-scatter clones its whole input on the calling thread, and the
  clone is freed when gloo's worker thread lets go of the finished work, outside the
  profiler's thread state. That sum over-counts FSDP2 steps by up to a few clones (t5-small
  on 2 ranks: up to 67 MB, 14 % of the step), differently per rank and per run. Where
  nothing is lost (DDP; an LSTM's root-only FSDP2) the timeline, the events' sum and the
  allocator's total give the same peak to the byte.

The figures are PyTorch's CPU allocator's, on every thread (gloo's workers allocate
all-gather's flat output and reduce-scatter's input copy there: memory NCCL would not
take). What gloo allocates inside its own library, with ``malloc``, is in neither.

    import _dist_truth
    from vramctl.estimator._parallel import Parallel
    peaks = _dist_truth.measure("gpt2", Parallel("fsdp", 4), batch_size=2,
                                lengths={"seq_len": 64})   # one int per rank

A failure in any rank (or the timeout) kills every rank and raises ``RuntimeError`` with the
failed rank's output, traceback included.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MARKER = "vramctl::measured_step"

#: The child's first lines: the parent's import path, then this module's rank entry point.
_BOOT = (
    "import json, sys\n"
    "job = json.load(open(sys.argv[1]))\n"
    "sys.path[:0] = job['sys_path']\n"
    "import _dist_truth\n"
    "_dist_truth._rank_main(job)\n"
)


# -- the parent: launching the ranks ---------------------------------------------------------


def measure(model: str, parallel: Any, **kwargs: Any) -> list[int]:
    """Each rank's peak bytes (index: rank) of one steady-state training step of the zoo
    model ``model`` under ``parallel``: held storages plus the profiled step's peak.
    Keywords as :func:`run_ranks` (``batch_size``, ``precision``, ``optimizer``,
    ``lengths``, ``timeout``)."""
    return [int(r["peak"]) for r in run_ranks("step", model, parallel, **kwargs)]


def measure_whole(model: str, parallel: Any, **kwargs: Any) -> list[int]:
    """The same peaks as :func:`measure` (and its keywords), counted instead from every
    allocation the profiler saw over the rank's whole life (from before the model is
    built): a check of :func:`measure`'s baseline."""
    return [int(r["peak"]) for r in run_ranks("whole", model, parallel, **kwargs)]


def measure_both(model: str, parallel: Any, **kwargs: Any) -> tuple[list[int], list[int]]:
    """``(measure, measure_whole)``'s figures from one set of ranks: the whole-life profile
    of :func:`measure_whole`, with :func:`measure`'s baseline taken from Python's view of
    the same rank just before the measured step. The check at half the cost."""
    rows = run_ranks("whole", model, parallel, **kwargs)
    return [int(r["python_peak"]) for r in rows], [int(r["peak"]) for r in rows]


def run_ranks(
    method: str,
    model: str,
    parallel: Any,
    *,
    batch_size: int,
    precision: str = "fp32",
    optimizer: str = "adamw",
    lengths: dict[str, Any] | None = None,
    timeout: float = 300.0,
    timeline: bool = False,
) -> list[dict[str, Any]]:
    """Run ``method`` (``"step"``: :func:`measure`, ``"whole"``: :func:`measure_whole`) on
    ``parallel.world_size`` processes; each rank's result (``peak``, and the parts it was
    made of) in rank order."""
    if method not in ("step", "whole"):
        raise ValueError(f"method must be 'step' or 'whole', got {method!r}")
    if parallel.strategy not in ("ddp", "fsdp", "tp"):
        raise ValueError(f"{parallel.strategy} has no wrapper to run (ddp, fsdp or tp)")
    pdict = parallel.to_dict()
    if pdict.get("plan") is not None and not all(
        isinstance(v, str) for v in (parallel.plan or {}).values()
    ):
        raise ValueError("a tensor-parallel plan must name its styles ('colwise', 'rowwise')")
    job: dict[str, Any] = {
        "method": method,
        "model": model,
        "parallel": pdict,
        "batch_size": batch_size,
        "precision": precision,
        "optimizer": optimizer,
        "lengths": dict(lengths or {}),
        "timeout": timeout,
        "timeline": timeline,
        "sys_path": [str(HERE)] + [p for p in sys.path if p],
        "parent": os.getpid(),
    }
    last: RuntimeError | None = None
    for _attempt in range(3):  # a free port can be taken before rank 0 binds it
        try:
            return _launch(job, parallel.world_size, timeout)
        except _PortTaken as exc:
            last = RuntimeError(str(exc))
    assert last is not None
    raise last


class _PortTaken(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(job: dict[str, Any], world: int, timeout: float) -> list[dict[str, Any]]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="vramctl-dist-") as tmp:
        procs: list[subprocess.Popen[bytes]] = []
        logs: list[Path] = []
        outs: list[Path] = []
        try:
            for rank in range(world):
                out, log = Path(tmp) / f"rank{rank}.json", Path(tmp) / f"rank{rank}.log"
                spec = Path(tmp) / f"job{rank}.json"
                rjob = dict(job, rank=rank, world_size=world, port=port, out=str(out))
                spec.write_text(json.dumps(rjob))
                with open(log, "wb") as fh:
                    procs.append(
                        subprocess.Popen(
                            [sys.executable, "-c", _BOOT, str(spec)],
                            stdout=fh,
                            stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL,
                            env=env,
                        )
                    )
                logs.append(log)
                outs.append(out)
            deadline = time.monotonic() + timeout
            while True:
                codes = [p.poll() for p in procs]
                failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
                if failed:
                    rank = _first_cause(failed, logs)
                    text = logs[rank].read_text(errors="replace")
                    if "address already in use" in text.lower() or "EADDRINUSE" in text:
                        raise _PortTaken(text[-4000:])
                    code = int(codes[rank] or 0)
                    how = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
                    raise RuntimeError(f"rank {rank} of {world} failed ({how}):\n{text[-8000:]}")
                if all(c == 0 for c in codes):
                    break
                if time.monotonic() > deadline:
                    tails = "\n".join(
                        f"--- rank {r} ---\n{logs[r].read_text(errors='replace')[-2000:]}"
                        for r in range(world)
                    )
                    raise RuntimeError(f"ranks timed out after {timeout:.0f} s:\n{tails}")
                time.sleep(0.05)
            return [json.loads(o.read_text()) for o in outs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for p in procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=30)


def _first_cause(failed: list[int], logs: list[Path]) -> int:
    """Of the failed ranks, the one whose error is not just a peer going away."""
    peer = ("connection closed", "connection reset", "broken pipe", "peer", "timed out")
    for rank in failed:
        tail = logs[rank].read_text(errors="replace")[-2000:].lower()
        if not any(p in tail for p in peer):
            return rank
    return failed[0]


# -- one rank --------------------------------------------------------------------------------


def _rank_main(job: dict[str, Any]) -> None:
    """A rank's process: join the group, measure, write the result file, leave."""
    import datetime
    import traceback

    import torch
    import torch.distributed as dist

    try:
        _orphan_watch(job["parent"])
        torch.set_num_threads(1)
        job["counted"] = _count_every_allocation()
        t0 = time.perf_counter()
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{job['port']}",
            rank=job["rank"],
            world_size=job["world_size"],
            timeout=datetime.timedelta(seconds=job["timeout"]),
        )
        result = _whole(job) if job["method"] == "whole" else _step(job)
        dist.barrier()  # no rank leaves while another still talks to it
        result["seconds"] = time.perf_counter() - t0
        tmp = job["out"] + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(result, fh)
        os.replace(tmp, job["out"])
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)


def _orphan_watch(parent: int) -> None:
    """Leave at once if the process that started the ranks goes away (its clean-up never
    ran): a rank must not wait on its peers until gloo's timeout."""
    import threading

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(3)

    threading.Thread(target=watch, name="vramctl-orphan-watch", daemon=True).start()


def _count_every_allocation() -> bool:
    """Turn on c10's ``caffe2_report_cpu_memory_usage`` flag: the CPU allocator then keeps
    its running total of live bytes for every allocation and free on every thread, not only
    those the profiler follows, and each allocation event the profiler records carries that
    total. False where the flag cannot be reached (the events' own sizes are used then)."""
    import ctypes

    import torch

    lib_dir = Path(torch.__file__).parent / "lib"
    for name in ("libc10.so", "libc10.dylib", "c10.dll"):
        if (lib_dir / name).exists():
            try:
                flag = ctypes.c_bool.in_dll(ctypes.CDLL(str(lib_dir / name)), _FLAG)
            except (OSError, ValueError):
                return False
            flag.value = True
            return True
    return False


_FLAG = "FLAGS_caffe2_report_cpu_memory_usage"


def _setup(job: dict[str, Any]) -> tuple[Any, Any, Any, Any]:
    """``(wrapped, batch, spec, optimizer)`` as ``estimate_accuracy.real_setup`` makes them,
    the model wrapped by ``parallelize`` before the optimizer is built over its parameters."""
    import torch

    from vramctl.estimator import zoo
    from vramctl.estimator._parallel import Parallel, parallelize
    from vramctl.estimator._spec import StepSpec, prepare_model, run_step, warm_optimizer

    parallel = Parallel(**job["parallel"])
    torch.manual_seed(0)
    spec = StepSpec(mode="train", precision=job["precision"], optimizer=job["optimizer"])
    model: Any = zoo.build(job["model"])
    if getattr(getattr(model, "config", None), "layerdrop", 0.0):
        model.config.layerdrop = 0.0  # the step that drops no layer, as the estimate
    if spec.param_dtype is not None:
        model.to(spec.param_dtype)
    prepare_model(model, spec)
    wrapped = parallelize(model, parallel)
    data = zoo.make_batch(job["model"], job["batch_size"], labels=True, **job["lengths"])
    for k, v in data.items():
        if v.is_floating_point():
            v = v.normal_().to(spec.param_dtype or v.dtype)
        data[k] = v
    params: list[Any] = [p for p in wrapped.parameters() if p.requires_grad]
    opt = spec.make_optimizer(params)
    if opt is not None:
        try:
            warm_optimizer(opt, params)
        except Exception:  # parameters that take no plain gradient: one real step instead
            opt.zero_grad(set_to_none=True)
            run_step(wrapped, data, spec, opt)
    return wrapped, data, spec, opt


def _warm_up(job: dict[str, Any], wrapped: Any, data: Any, spec: Any, opt: Any) -> None:
    """The un-measured steps, then a collection: DDP rebuilds its buckets (in the order
    backward used them) at the start of its second step, so its steady state is the third."""
    from vramctl.estimator._spec import run_step

    for _ in range(2 if job["parallel"]["strategy"] == "ddp" else 1):
        run_step(wrapped, data, spec, opt)
    gc.collect()


def _local(t: Any) -> Any:
    """A DTensor's local shard; any other tensor itself."""
    local = getattr(t, "_local_tensor", None)
    return t if local is None else local


def _held(wrapped: Any, data: Any, opt: Any) -> tuple[int, int]:
    """``(tensors, buckets)``: bytes of the distinct storages behind the parameters, buffers,
    batch and optimizer state (local shards of DTensors), and of DDP's gradient buckets."""
    import _common

    held = [_local(t) for t in _common.held_tensors(wrapped, data, opt)]
    return _common.storages_bytes(held), _ddp_bucket_bytes(wrapped)


def _ddp_bucket_bytes(wrapped: Any) -> int:
    """Bytes of DDP's gradient buckets (the reducer's flat gradient tensors); 0 without DDP."""
    reducer = getattr(wrapped, "reducer", None)
    if reducer is None:
        return 0
    # Zeroed copies of the live buckets: the same sizes, freed again at once.
    return sum(int(b.buffer().nbytes) for b in reducer._get_zeros_like_grad_buckets())


def _step(job: dict[str, Any]) -> dict[str, Any]:
    wrapped, data, spec, opt = _setup(job)
    _warm_up(job, wrapped, data, spec, opt)
    tensors, buckets = _held(wrapped, data, opt)
    with _profiling(job) as prof:
        _marked_step(wrapped, data, spec, opt)
    got = _window(prof, job)
    return {
        **got,
        "peak": tensors + buckets + got["step"],
        "held": tensors,
        "buckets": buckets,
    }


def _whole(job: dict[str, Any]) -> dict[str, Any]:
    with _profiling(job) as prof:
        wrapped, data, spec, opt = _setup(job)
        _warm_up(job, wrapped, data, spec, opt)
        held = sum(_held(wrapped, data, opt))  # measure's baseline, for measure_both
        _marked_step(wrapped, data, spec, opt)
    got = _window(prof, job)
    return {
        **got,
        "peak": got["allocated_peak"],
        "python_held": held,
        "python_peak": held + got["step"],
    }


@contextlib.contextmanager
def _profiling(job: dict[str, Any]) -> Iterator[Any]:
    """PyTorch's profiler with memory events; shapes and stacks too where the memory
    timeline is to be read (its data-flow pass needs them)."""
    from torch.profiler import ProfilerActivity, profile

    full = bool(job.get("timeline"))
    with profile(
        activities=[ProfilerActivity.CPU],
        profile_memory=True,
        record_shapes=full,
        with_stack=full,
    ) as prof:
        yield prof


def _marked_step(wrapped: Any, data: Any, spec: Any, opt: Any) -> None:
    from torch.autograd.profiler import record_function

    from vramctl.estimator._spec import run_step

    with record_function(MARKER):
        run_step(wrapped, data, spec, opt)


def _window(prof: Any, job: dict[str, Any]) -> dict[str, Any]:
    """What the profile's allocation events say about the marked step.

    ``step``: the most the step added to what was live when it started; ``allocated_peak``
    and ``allocated_at_start``: the allocator's running total of live bytes at its largest
    in the step and when it started (with the flag of :func:`_count_every_allocation`: the
    whole process since the rank began; without it, summed from the events since the
    profiler began, as below).

    ``events_step`` and ``events_peak``: the same from the events' own sizes, summed in time
    order from the profiler's start. That sum keeps a block whose free was not recorded,
    which happens: gloo's reduce-scatter clones its input in the calling thread, and the
    clone is freed when gloo's worker thread lets go of the finished work, after the state
    that makes the profiler record it is gone.

    ``other_threads_peak`` and ``other_threads_at_peak``: live bytes that threads other than
    the step's allocated (gloo's workers: all-gather's flat output), most in the step and
    at the events' peak. ``peak_in``: the operators around the allocation at the
    allocator's peak, innermost first (where to look when a row is off). With ``timeline``
    in the job, ``timeline_step``: the step's peak from the memory profiler's timeline, as
    ``_common.profiled_peak`` reads it.
    """
    from torch._C._profiler import _EventType

    # (time, size, ptr, thread, running total)
    allocs: list[tuple[int, int, int, int, int]] = []
    where: dict[tuple[int, int], Any] = {}  # (time, ptr) -> the allocation's event
    window: tuple[int, int, int] | None = None  # (start, end, thread)
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        kind = node.typed[0]
        if kind == _EventType.Allocation:
            f = node.typed[1]
            allocs.append(
                (node.start_time_ns, f.alloc_size, f.ptr, node.start_tid, f.total_allocated)
            )
            where[(node.start_time_ns, f.ptr)] = node
        elif kind == _EventType.TorchOp and _name(node) == MARKER:
            window = (node.start_time_ns, node.end_time_ns, node.start_tid)
    if window is None:
        raise RuntimeError(f"the profile has no {MARKER} event")
    start, end, main = window
    allocs.sort()
    counted = bool(job.get("counted"))
    owner: dict[int, bool] = {}  # live block -> allocated by another thread
    live = other = ev_start = ev_peak = other_peak = other_at_peak = 0
    total_start: int | None = None
    total_peak = 0
    peak_at: tuple[int, int] | None = None
    for t, size, ptr, tid, total in allocs:
        if t > end:
            break
        foreign = owner.pop(ptr, tid != main) if size < 0 else tid != main
        if size > 0:
            owner[ptr] = foreign
        live += size
        other += size if foreign else 0
        if t < start:
            ev_start = live
            continue
        if total_start is None:
            total_start = total - size  # the total just before the step's first event
        if total > total_peak:
            total_peak, peak_at = total, (t, ptr)
        if live > ev_peak:
            ev_peak, other_at_peak = live, other
        other_peak = max(other_peak, other)
    ev_peak = max(ev_peak, ev_start)
    if counted and total_start is not None:
        alloc_start, alloc_peak = total_start, max(total_peak, total_start)
    else:
        alloc_start, alloc_peak = ev_start, ev_peak
    out: dict[str, Any] = {
        "step": alloc_peak - alloc_start,
        "allocated_peak": alloc_peak,
        "allocated_at_start": alloc_start,
        "events_step": ev_peak - ev_start,
        "events_peak": ev_peak,
        "other_threads_peak": other_peak,
        "other_threads_at_peak": other_at_peak,
        "counted": counted,
        "step_ns": end - start,
        "peak_in": _callers(where.get(peak_at)) if peak_at else [],
    }
    if job.get("timeline"):
        out.update(_timeline_step(prof, start, end))
    return out


def _timeline_step(prof: Any, start: int, end: int) -> dict[str, Any]:
    """The step's peak over its start from the memory profiler's timeline (CREATE and
    DESTROY events), as ``_common.profiled_peak`` reads it. Its data-flow pass fails on some
    profiles (an assertion, "version mismatch", with FSDP2): then ``timeline_step`` is None
    and ``timeline_error`` says why."""
    from torch.profiler._memory_profiler import Action

    try:
        timeline = prof._memory_profile().timeline
    except Exception as exc:
        return {"timeline_step": None, "timeline_error": f"{type(exc).__name__}: {exc}"[:300]}
    live = peak = at_start = 0
    for t, action, _key, size in timeline:
        if t > end:
            break
        live += size if action == Action.CREATE else -size if action == Action.DESTROY else 0
        if t < start:
            at_start = live
        else:
            peak = max(peak, live)
    return {"timeline_step": max(peak, at_start) - at_start}


def _callers(node: Any) -> list[str]:
    """The names of the operators around an allocation, innermost first (the allocator's
    peak: where in the step it happened)."""
    names: list[str] = []
    node = getattr(node, "parent", None)
    while node is not None and len(names) < 8:
        names.append(_name(node))
        node = node.parent
    return names


def _name(node: Any) -> str:
    try:
        return str(node.name)
    except UnicodeDecodeError:  # seen on some events' names (not the marker's)
        return ""
