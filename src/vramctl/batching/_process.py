"""``process``: run a model over every item of an audio manifest, durably, under a hard budget.

The processing run puts the batching pieces together::

    manifest ─► skip what the progress store holds ─► chunk long recordings
      ─► BucketingSampler (per-bucket batch sizes from the estimator)
      ─► audio loaded by a thread pool, in order ─► one worker per device,
         each step under a Guard (split on OOM; the CPU when one item does not fit)
      ─► stitch chunk outputs per recording ─► postprocess
      ─► commit to the progress store (one transaction per batch) ─► export

A killed run loses and repeats nothing: a recording's output is committed
once, in the same transaction as the rest of its batch, and a restarted run
skips every recording the store holds (done or failed). Chunks of a recording
that was not finished are run again.

This module checks the arguments and runs the pieces: the items left and their loading
(``_stream``), one worker per device (``_worker``), and what is kept of the outputs and
committed (``_outputs``).

>>> import os, tempfile, torch, vramctl
>>> from vramctl.batching import process
>>> d = tempfile.mkdtemp()
>>> manifest = os.path.join(d, "clips.jsonl")
>>> with open(manifest, "w") as f:
...     for i, seconds in enumerate([1.0, 2.5, 0.5, 4.0]):
...         _ = f.write(f'{{"id": "c{i}", "duration": {seconds}}}\\n')
>>> frames = lambda: torch.nn.Conv1d(1, 4, 320, stride=320)   # 50 frames/s, 4 features
>>> result = process(frames, manifest, os.path.join(d, "out.jsonl"),
...                  forward=lambda m, wav, lengths: m(wav.unsqueeze(1)).transpose(1, 2),
...                  loader="synthetic", budget=vramctl.batching.PaddedDuration(5.0),
...                  devices=["cpu"])
>>> result.done, result.failed, result.lost
(4, 0, 0)
>>> import json
>>> [json.loads(line)["output"]["frames"] for line in open(result.output)]
[50, 125, 25, 200]
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any, Literal

import torch
from torch import nn

from vramctl._units import format_bytes
from vramctl._version import __version__
from vramctl.batching._adaptive import BatchingError
from vramctl.batching._audio import AudioBatches, load_audio, synthesize
from vramctl.batching._budget import Budget, MemoryBudget
from vramctl.batching._manifest import DEFAULT_SAMPLE_RATE, Item, Manifest, check_has_records
from vramctl.batching._models import ModelSource, callable_name, load_model, model_identity
from vramctl.batching._outputs import (
    Collector,
    Forward,
    Postprocess,
    default_forward,
    postprocess_of,
)
from vramctl.batching._progress import ProgressStore, check_writable, failures_path
from vramctl.batching._sampler import BucketingSampler
from vramctl.batching._stream import Loaded, Remaining, count_records
from vramctl.batching._worker import ModelFactory, Worker, model_factory
from vramctl.device import Device, get_device, gpus, use_device
from vramctl.device._shared import active_simulation, sort_devices

__all__ = ["ProcessInterrupted", "ProcessResult", "ProcessStatus", "process", "progress_path"]

log = logging.getLogger("vramctl.batching")

#: Seconds between two memory readings for the progress callback.
_MEMORY_EVERY = 0.5
#: On the CPU the batch memory is capped here: larger batches buy nothing there.
_CPU_BUDGET = 2 * 2**30
_LOADERS: dict[str, Callable[[Item, int], torch.Tensor]] = {
    "audio": load_audio,
    "synthetic": synthesize,
}


def progress_path(output: str | os.PathLike[str]) -> str:
    """The default progress store next to ``output``: ``out.jsonl`` → ``out.progress.db``.

    >>> progress_path("runs/out.jsonl")
    'runs/out.progress.db'
    """
    out = os.fspath(output)
    root, ext = os.path.splitext(out)
    return (root if ext in (".jsonl", ".json", ".ndjson") else out) + ".progress.db"


class ProcessInterrupted(KeyboardInterrupt):
    """A run stopped by Ctrl-C (or SIGTERM, where the caller turns it into one).

    Every batch before the interrupt is committed; the batch in flight is not. ``saved``
    recordings (done or failed) are in the progress store, of ``total`` in the manifest
    (None: not known); the same call resumes the run.
    """

    def __init__(self, saved: int, total: int | None, progress: str) -> None:
        of = f" of {total}" if total is not None else ""
        super().__init__(f"interrupted: saved {saved}{of}; run the same command to resume")
        self.saved = saved
        self.total = total
        self.progress = progress


@dataclass
class ProcessStatus:
    """A snapshot of a run, handed to ``on_progress`` after each batch."""

    #: Recordings done, failed, and skipped because an earlier run did them.
    done: int
    failed: int
    skipped: int
    #: Recordings in the manifest when known (a line count), else None.
    total: int | None
    #: Seconds of audio done in this run, and wall seconds since the start.
    seconds: float
    elapsed: float
    batches: int
    #: Padding of the batches so far (a fraction of the padded audio).
    padding: float
    #: Out-of-memory errors met and recovered by the guards, and batches sent to the CPU.
    ooms: int
    cpu_fallbacks: int
    #: Per device: (id, bytes in use, total bytes), read at most every half second.
    memory: list[tuple[str, int, int]] = field(default_factory=list)

    @property
    def items_per_s(self) -> float:
        return self.done / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def audio_hours_per_hour(self) -> float:
        """Hours of audio processed per hour of wall time."""
        return self.seconds / self.elapsed if self.elapsed > 0 else 0.0


@dataclass
class ProcessResult:
    """What a run did (this run's figures; ``store_*`` count earlier runs too)."""

    output: str
    failed_path: str
    progress_path: str
    done: int
    failed: int
    skipped: int
    #: Recordings neither done nor failed at the end (0 unless the run was cut short).
    lost: int
    seconds: float
    wall_s: float
    batches: int
    padding: float
    ooms: int
    ooms_recovered: int
    cpu_fallbacks: int
    store_done: int
    store_failed: int
    #: Bad manifest records (skipped, reported): how many, and the first ones.
    manifest_problems: int
    problems: list[str]
    devices: list[dict[str, Any]]
    budget: dict[str, Any]
    #: Manifest records skipped because an earlier record has their id (the first is kept).
    duplicate_ids: int = 0
    #: Recordings whose audio differs from the manifest's duration (beyond the tolerance of
    #: ``vramctl.batching.AudioBatches``), processed as read.
    length_mismatches: int = 0
    #: One line per kind of warning: the duplicate ids, then the first length differences.
    warnings: list[str] = field(default_factory=list)

    @property
    def items_per_s(self) -> float:
        return self.done / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def audio_hours_per_hour(self) -> float:
        return self.seconds / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["items_per_s"] = round(self.items_per_s, 3)
        d["audio_hours_per_hour"] = round(self.audio_hours_per_hour, 3)
        return d


# -- the run -----------------------------------------------------------------------------


def process(
    model: nn.Module | ModelFactory | str | ModelSource,
    manifest: str | os.PathLike[str] | Manifest,
    output: str | os.PathLike[str],
    *,
    forward: Forward | None = None,
    postprocess: Postprocess | str | None = None,
    devices: Sequence[Device | str | int] | None = None,
    max_devices: int | None = None,
    budget: Budget | None = None,
    target: float = 0.9,
    chunk_duration: float = 30.0,
    overlap: float = 1.0,
    num_buckets: int = 50,
    sample_rate: int | None = None,
    loader: Callable[[Item, int], torch.Tensor] | Literal["audio", "synthetic"] = "audio",
    num_workers: int | None = None,
    order: Literal["manifest", "id"] = "manifest",
    progress: str | os.PathLike[str] | None = None,
    resume: bool = True,
    overwrite: bool = False,
    frame_rate: float | None = None,
    config: dict[str, Any] | None = None,
    on_progress: Callable[[ProcessStatus], None] | None = None,
) -> ProcessResult:
    """Run ``model`` over every item of ``manifest``; write one output per recording.

    ``model`` is a folder saved with ``save_pretrained`` or a Hugging Face Hub id (its
    trained weights, run through its own feature extractor; a CTC model with a tokenizer
    transcribes), ``'package.module:factory'``, a built-in audio architecture (random
    weights), a zero-argument factory (called once per device, under a fixed seed) or a
    module (copied for each further device); see :func:`load_model`. ``forward(model,
    waveforms [B, T], lengths [B]) -> output`` runs one batch (default: the checkpoint's,
    else ``model(waveforms)``); the output has time on dim 1 (``[B, T', ...]``; a model
    output's ``logits`` or ``last_hidden_state`` is taken), optionally with the valid
    frames per item as ``(output, frames)``. Each recording's frames are stitched across
    its chunks and handed to ``postprocess``: ``"text"`` (a CTC checkpoint's greedy
    transcript; the default where there is one), ``"frames"`` (every frame),
    ``"embedding"`` (the mean over time), ``"summary"`` (frames, mean and spread; the
    default otherwise) or a callable ``(tensor [T', ...], item) -> JSON value``.

    Devices: ``devices`` as given; else the active :func:`vramctl.simulate`
    GPU; else every usable GPU, least loaded first (``max_devices`` of them);
    else the CPU. One worker per device takes the next batch when it is free.
    Each step runs under a :class:`~vramctl.guard.Guard`: a batch that runs out
    of memory finishes in pieces, and one whose single items do not fit runs on
    the CPU.

    Batches: recordings longer than ``chunk_duration`` seconds are cut into
    chunks overlapping by ``overlap`` seconds; a :class:`BucketingSampler` with
    ``num_buckets`` buckets fills batches up to ``budget`` (default:
    :meth:`MemoryBudget.for_model` at ``target`` of the smallest device's free
    memory, predicted without a trial step; 2 GiB at most on the CPU). Audio is
    read by ``loader`` (``"audio"``: files; ``"synthetic"``: deterministic noise
    of each item's length) at ``sample_rate`` (default: the checkpoint's, else 16 kHz)
    in ``num_workers`` threads (default: up to 4).

    Bad input is refused before any model is loaded: a manifest with no valid record
    raises :class:`~vramctl.batching.ManifestError`.

    Durability: every batch's outputs and failures are committed to a
    :class:`ProgressStore` at ``progress`` (default :func:`progress_path`) in
    one transaction. The run's identity (the manifest; the model's name, parameter
    shapes and a fingerprint of its weights; the forward, the output kind, chunking,
    sample rate and vramctl's major version) is stored with it. ``resume=True``
    continues a store left by an interrupted run with the same identity, skipping
    what it holds; a store of another identity raises :class:`RunConflictError`
    naming what changed. ``resume=False`` refuses an existing run, unless
    ``overwrite=True``, which discards it. At the end the outputs are exported to
    ``output`` as JSON Lines (``order``: manifest order or by id) and the failures
    (missing or unreadable audio) next to it.
    """
    t0 = time.perf_counter()
    if overwrite:
        resume = False
    load = _LOADERS[loader] if isinstance(loader, str) and loader in _LOADERS else loader
    if isinstance(load, str) or not callable(load):
        raise BatchingError(f"loader must be 'audio', 'synthetic' or a callable, got {loader!r}")
    if order not in ("manifest", "id"):
        raise BatchingError(f"order must be 'manifest' or 'id', got {order!r}")
    if not (math.isfinite(chunk_duration) and chunk_duration > 0):
        raise BatchingError(f"chunk_duration must be positive, got {chunk_duration!r}")
    if sample_rate is not None and sample_rate <= 0:
        raise BatchingError(f"sample_rate must be positive, got {sample_rate!r}")
    source = (
        manifest
        if isinstance(manifest, Manifest)
        else Manifest(manifest, sample_rate=sample_rate or DEFAULT_SAMPLE_RATE)
    )
    out = check_writable(output)
    check_writable(failures_path(out))
    store_path = os.fspath(progress) if progress is not None else progress_path(out)
    _check_not_manifest(source.path, output=out, failures=failures_path(out), progress=store_path)
    check_has_records(source)  # bad input: before any model is loaded
    src = load_model(model)
    post = postprocess_of(postprocess or src.default_output, src.decoder)
    rate = sample_rate or src.sample_rate or DEFAULT_SAMPLE_RATE
    if src.sample_rate and rate != src.sample_rate:
        raise BatchingError(
            f"model {src.name} takes audio at {src.sample_rate} Hz, not {rate} Hz: leave the"
            " sample rate out (the audio is resampled to the model's)"
        )
    if source.sample_rate != rate and not isinstance(manifest, Manifest):
        source = Manifest(manifest, sample_rate=rate)
    if src.random_weights:
        log.warning(
            "%s is built with random weights: its outputs are noise. For real outputs give a"
            " checkpoint (a folder saved with save_pretrained, or a Hub id)",
            src.name,
        )
    opts = _RunOptions(
        output=out,
        forward=forward or src.forward or default_forward,
        postprocess=post,
        loader=load,
        budget=budget,
        target=target,
        chunk=float(chunk_duration),
        overlap=float(overlap),
        num_buckets=num_buckets,
        sample_rate=rate,
        threads=num_workers if num_workers is not None else min(4, os.cpu_count() or 1),
        order=order,
        frame_rate=frame_rate,
        on_progress=on_progress,
    )
    devs = _pick_devices(devices, max_devices)
    workers = _workers(src.model, devs, opts)
    with workers[0].dev.uncounted():
        fingerprint = model_identity(workers[0].model)
    run_config = {
        "model": {"name": src.name, "kind": src.kind, **src.identity, **fingerprint},
        "forward": callable_name(opts.forward),
        "output_kind": callable_name(post),
        "chunk_duration": opts.chunk,
        "overlap": opts.overlap,
        "sample_rate": int(rate),
        "vramctl": __version__.split(".")[0],
        **(config or {}),
    }
    store = ProgressStore(
        store_path, manifest=source.path, config=run_config, resume=resume, overwrite=overwrite
    )
    try:
        return _run(workers, source, store, opts, t0)
    finally:
        store.close()


def _workers(
    model: nn.Module | ModelFactory, devs: list[Device], opts: _RunOptions
) -> list[Worker]:
    """One worker per device, each with its model (loaded or built now)."""
    make = model_factory(model, len(devs))
    return [
        Worker(partial(make, k), dev, opts.forward, opts.sample_rate) for k, dev in enumerate(devs)
    ]


@dataclass(frozen=True)
class _RunOptions:
    """``process``'s settings for the run, checked and resolved once."""

    output: str
    forward: Forward
    postprocess: Postprocess
    loader: Callable[[Item, int], torch.Tensor]
    #: None: the default memory budget at ``target`` of the smallest device's free memory.
    budget: Budget | None
    target: float
    chunk: float
    overlap: float
    num_buckets: int
    sample_rate: int
    #: Audio loading threads.
    threads: int
    order: Literal["manifest", "id"]
    frame_rate: float | None
    on_progress: Callable[[ProcessStatus], None] | None


def _run(
    workers: list[Worker],
    source: Manifest,
    store: ProgressStore,
    opts: _RunOptions,
    t0: float,
) -> ProcessResult:
    budget = opts.budget if opts.budget is not None else _default_budget(workers, opts)
    chunk = opts.chunk
    if budget.max_count(chunk) < 1:
        log.warning(
            "the budget holds no item of %g s: such items run alone, split by the guard", chunk
        )
    completed = store.completed()
    remaining = Remaining(source, completed, chunk, opts.overlap)
    sampler = BucketingSampler(remaining, budget, num_buckets=opts.num_buckets)
    total = count_records(source.path)
    audio = AudioBatches([], sample_rate=opts.sample_rate, loader=opts.loader)
    collector = Collector(
        store, opts.postprocess, opts.frame_rate, opts.sample_rate, remaining.rejected
    )
    status = ProcessStatus(0, 0, 0, total, 0.0, 0.0, 0, 0.0, 0, 0)
    last_memory = 0.0

    def report() -> None:
        nonlocal last_memory
        now = time.perf_counter()
        status.done, status.failed = collector.done, collector.failed
        status.skipped = remaining.skipped
        status.seconds = collector.seconds
        status.elapsed = now - t0
        status.batches = collector.batches
        status.padding = collector.padding
        status.ooms = sum(w.guard.ooms for w in workers)
        status.cpu_fallbacks = sum(w.cpu_fallbacks for w in workers)
        if now - last_memory >= _MEMORY_EVERY:
            status.memory = [_memory_of(w.dev) for w in workers]
            last_memory = now
        if opts.on_progress is not None:
            opts.on_progress(status)

    report()
    loaded = Loaded(sampler, audio, opts.threads)
    try:
        if len(workers) == 1:
            for batch in loaded:
                collector.take(workers[0].run(batch))
                report()
        else:
            _run_parallel(workers, loaded, collector, report)
    except KeyboardInterrupt as exc:
        # Ctrl-C (or a SIGTERM turned into one): the batch in flight is not committed, every
        # batch before it is. Say where the run stands; the same call resumes it.
        stats = store.stats()
        raise ProcessInterrupted(stats.done + stats.failed, total, store.path) from exc
    finally:
        loaded.close()
    collector.flush()  # recordings refused after the last batch
    if collector.pending():
        raise BatchingError(
            f"{collector.pending()} recording(s) have chunks missing at the end of the run:"
            " nothing of them was recorded; run again to redo them"
        )
    status.memory = [_memory_of(w.dev) for w in workers]
    report()
    exported = store.export(opts.output, order=opts.order)
    stats = store.stats()
    summaries = [w.summary() for w in workers]
    # Every recording this run drew from the manifest is now done or failed, or lost.
    lost = remaining.fresh - collector.done - collector.failed
    return ProcessResult(
        output=exported.path,
        failed_path=exported.failed_path,
        progress_path=store.path,
        done=collector.done,
        failed=collector.failed,
        skipped=remaining.skipped,
        lost=lost,
        seconds=collector.seconds,
        wall_s=time.perf_counter() - t0,
        batches=collector.batches,
        padding=collector.padding,
        ooms=sum(s["ooms"] for s in summaries),
        ooms_recovered=sum(s["ooms_recovered"] for s in summaries),
        cpu_fallbacks=sum(s["cpu_fallbacks"] for s in summaries),
        store_done=stats.done,
        store_failed=stats.failed,
        manifest_problems=source.skipped,
        problems=[str(p) for p in source.problems[:20]],
        devices=summaries,
        budget=_budget_info(budget, chunk),
        duplicate_ids=source.duplicates,
        length_mismatches=collector.length_mismatches,
        warnings=[
            *filter(None, [source.duplicates_message()]),
            *collector.length_warnings,
        ],
    )


def _run_parallel(
    workers: list[Worker],
    loaded: Loaded,
    collector: Collector,
    report: Callable[[], None],
) -> None:
    """One thread per device takes the next loaded batch; this thread records the results."""
    results: queue.Queue[tuple[str, Any]] = queue.Queue()
    stop = threading.Event()

    def work(w: Worker) -> None:
        try:
            with use_device(w.dev):
                while not stop.is_set():
                    try:
                        batch = next(loaded)
                    except StopIteration:
                        break
                    results.put(("done", w.run(batch)))
        except BaseException as exc:
            results.put(("error", exc))
        finally:
            results.put(("end", w.dev.id))

    threads = [
        threading.Thread(target=work, args=(w,), name=f"vramctl-{w.dev.id}", daemon=True)
        for w in workers
    ]
    for t in threads:
        t.start()
    running = len(threads)
    error: BaseException | None = None
    try:
        while running:
            kind, value = results.get()
            if kind == "end":
                running -= 1
            elif kind == "error":
                stop.set()
                error = error or value
            elif error is None:
                collector.take(value)
                report()
    finally:
        stop.set()
        for t in threads:
            t.join()
    if error is not None:
        raise error


def _pick_devices(
    devices: Sequence[Device | str | int] | None, max_devices: int | None
) -> list[Device]:
    """The devices to run on: as given, or an active simulation, or usable GPUs, or the CPU."""
    if devices is not None:
        found = [get_device(d) for d in devices]
        if not found:
            raise BatchingError("devices is empty: name at least one, or leave it out")
    else:
        sim = active_simulation()
        if sim is not None:
            found = [sim]
        else:
            usable = [g for g in gpus() if g.health.state.usable]
            found = sort_devices(usable) or [get_device("cpu")]
    if max_devices is not None:
        if max_devices < 1:
            raise BatchingError(f"max_devices must be at least 1, got {max_devices}")
        found = found[:max_devices]
    if len({d.id for d in found}) != len(found):
        raise BatchingError(f"a device is named twice: {[d.id for d in found]}")
    return found


def _memory_of(dev: Device) -> tuple[str, int, int]:
    mem = dev.memory()
    used = mem.used if isinstance(mem.used, int) else 0
    total = mem.total if isinstance(mem.total, int) else 0
    return (dev.id, used, total)


def _check_not_manifest(manifest: str, **targets: str) -> None:
    """Refuse a file the run writes that is the manifest: it would be overwritten."""
    source = os.path.realpath(manifest)
    for name, target in targets.items():
        if os.path.realpath(target) == source:
            raise BatchingError(
                f"the {name} file {target} is the manifest {manifest}: the run would overwrite"
                " it; give another output path"
            )


class _Forwarding(nn.Module):
    """``forward(model, waveforms, lengths)`` as a module, for the estimator."""

    def __init__(self, model: nn.Module, forward: Forward) -> None:
        super().__init__()
        self.inner = model
        self._fn = forward

    def forward(self, waveforms: torch.Tensor, lengths: torch.Tensor) -> Any:
        return self._fn(self.inner, waveforms, lengths)


def _default_budget(workers: list[Worker], opts: _RunOptions) -> MemoryBudget:
    """The estimator's budget for the chunk length on the device with the least room."""

    def make(n: int, seconds: float) -> tuple[torch.Tensor, torch.Tensor]:
        size = max(1, round(seconds * opts.sample_rate))
        # The waveforms on the meta device: the estimator needs their shape, not memory.
        return torch.empty(n, size, device="meta"), torch.full((n,), size, dtype=torch.int64)

    budgets = []
    for w in workers:
        cap = None if w.dev.is_gpu else _CPU_BUDGET
        view = getattr(opts.forward, "estimation", None)
        module, make_batch = (
            view(w.model, opts.sample_rate)
            if callable(view)
            else (_Forwarding(w.model, opts.forward), make)
        )
        mb = MemoryBudget.for_model(
            module,
            make_batch,
            max_duration=opts.chunk,
            device=w.dev,
            target=opts.target,
            budget_bytes=cap,
        )
        budgets.append(mb)
    return min(budgets, key=lambda b: b.budget_bytes)


def _budget_info(budget: Budget, chunk: float) -> dict[str, Any]:
    """``ProcessResult.budget``: the budget, and its batch sizes at fractions of ``chunk``."""
    info: dict[str, Any] = {"kind": type(budget).__name__, "limit": budget.limit}
    if isinstance(budget, MemoryBudget):
        info["budget_bytes"] = budget.budget_bytes
        info["limit_text"] = format_bytes(budget.budget_bytes)
        info["notes"] = list(budget.notes)
    # The sizes at the exact lengths (a rounded one can be past the longest the budget
    # covers), named by the length to the hundredth of a second.
    lengths = sorted({chunk * f for f in (0.125, 0.25, 0.5, 0.75, 1.0)})
    info["max_count"] = {f"{round(s, 2):g}s": budget.max_count(s) for s in lengths}
    return info
