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

import copy
import functools
import logging
import math
import os
import queue
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import Any, Literal

import torch
from torch import nn

from vramctl._units import format_bytes
from vramctl.batching._adaptive import BatchingError
from vramctl.batching._audio import AudioBatches, load_audio, synthesize
from vramctl.batching._budget import Budget, MemoryBudget
from vramctl.batching._chunk import Stitcher, chunk_items
from vramctl.batching._manifest import Item, Manifest
from vramctl.batching._progress import (
    ProgressStore,
    check_writable,
    failures_path,
)
from vramctl.batching._sampler import BucketingSampler
from vramctl.device import Device, active_simulation, get_device, gpus, sort_devices, use_device
from vramctl.guard import Guard, StepDoesNotFitError

__all__ = ["ProcessResult", "ProcessStatus", "process", "progress_path"]

log = logging.getLogger("vramctl.batching")

ModelFactory = Callable[[], nn.Module]
Forward = Callable[[nn.Module, torch.Tensor, torch.Tensor], Any]
Postprocess = Callable[[torch.Tensor, Item], Any]

#: Seconds between two memory readings for the progress callback.
_MEMORY_EVERY = 0.5
#: On the CPU the batch memory is capped here: larger batches buy nothing there.
_CPU_BUDGET = 2 * 2**30
#: A recording that would make more chunks than this is recorded as failed, not run: its
#: duration is not believable (about 34 days at 30 s chunks; its outputs would not fit in
#: memory for stitching anyway).
_MAX_CHUNKS = 100_000


def progress_path(output: str | os.PathLike[str]) -> str:
    """The default progress store next to ``output``: ``out.jsonl`` → ``out.progress.db``.

    >>> progress_path("runs/out.jsonl")
    'runs/out.progress.db'
    """
    out = os.fspath(output)
    root, ext = os.path.splitext(out)
    return (root if ext in (".jsonl", ".json", ".ndjson") else out) + ".progress.db"


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


# -- forward and postprocess ----------------------------------------------------------


def default_forward(model: nn.Module, waveforms: torch.Tensor, lengths: torch.Tensor) -> Any:
    """``model(waveforms)``; of a Hugging Face output, ``last_hidden_state`` or ``logits``."""
    return model(waveforms)


def _hidden(out: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(time-major output [B, T', ...], frames per item or None) from a forward's result."""
    frames = None
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], torch.Tensor):
        out, frames = out
    if not isinstance(out, torch.Tensor):
        for name in ("last_hidden_state", "logits"):
            value = out.get(name) if isinstance(out, Mapping) else getattr(out, name, None)
            if isinstance(value, torch.Tensor):
                out = value
                break
        else:
            if hasattr(out, "to_tuple"):  # a transformers ModelOutput
                out = out.to_tuple()
            elif isinstance(out, Mapping):
                out = tuple(out.values())
            if isinstance(out, tuple | list) and out and isinstance(out[0], torch.Tensor):
                out = out[0]
    if not isinstance(out, torch.Tensor) or out.dim() < 2:
        raise BatchingError(
            "the forward must return a tensor [batch, time, ...] (or a model output with"
            f" last_hidden_state, or (output, frames)); got {type(out).__name__}"
            + (f" of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else "")
        )
    return out, frames


def _frames(model: nn.Module, lengths: torch.Tensor, padded: int, out_len: int) -> torch.Tensor:
    """Valid output frames per item: the model's own rule when it has one, else in proportion."""
    rule = getattr(model, "_get_feat_extract_output_lengths", None)
    if callable(rule):
        try:
            return torch.as_tensor(rule(lengths)).to(torch.int64).clamp(0, out_len)
        except Exception:
            log.debug("the model's _get_feat_extract_output_lengths failed", exc_info=True)
    return ((lengths * out_len + padded - 1) // max(padded, 1)).clamp(0, out_len)


def _frame_rate(
    model: nn.Module,
    padded: int,
    out_len: int,
    sample_rate: int,
    probe: Callable[[int], int] | None = None,
    fallback: float | None = None,
) -> float:
    """Output frames per second of audio.

    The slope of the model's own rule (``_get_feat_extract_output_lengths``); else
    the slope measured with ``probe`` (the output length for an input of that many
    samples) between 2 s and 10 s of input; else ``fallback`` or the batch's ratio. The ratio is a
    little off for a strided convolution, whose ``(padded - kernel) // stride + 1``
    frames fall short of ``padded / stride``: a long recording's later chunks would
    be placed further and further off. 8 s apart, the two probes differ by exactly
    ``8 s / hop`` frames for any hop that divides 8 s of samples.
    """
    rule = getattr(model, "_get_feat_extract_output_lengths", None)
    if callable(rule):
        try:
            a, b = (int(rule(torch.tensor([n * sample_rate]))[0]) for n in (10, 110))
            if b > a:
                return (b - a) / 100.0
        except Exception:
            log.debug("the model's _get_feat_extract_output_lengths failed", exc_info=True)
    if probe is not None:
        try:
            a, b = probe(2 * sample_rate), probe(10 * sample_rate)
            if b > a:
                return (b - a) / 8.0
        except Exception:
            log.debug("measuring the model's frame rate failed", exc_info=True)
    if fallback is not None:
        return fallback
    return out_len * sample_rate / max(padded, 1)


def summarize(output: torch.Tensor, item: Item) -> dict[str, Any]:
    """The default postprocess: the output's frames, feature size, mean and spread."""
    x = output.detach().float()
    return {
        "frames": int(x.shape[0]),
        "dim": int(x[0].numel()) if x.shape[0] else 0,
        "mean": round(float(x.mean()), 6) if x.numel() else 0.0,
        "std": round(float(x.std()), 6) if x.numel() > 1 else 0.0,
    }


def embed(output: torch.Tensor, item: Item) -> dict[str, Any]:
    """Postprocess ``"embedding"``: the output averaged over time, as a list."""
    x = output.detach().float().flatten(1)
    vec = x.mean(0) if x.shape[0] else torch.zeros(x.shape[1])
    return {"frames": int(x.shape[0]), "embedding": [round(v, 6) for v in vec.tolist()]}


_POSTPROCESS: dict[str, Postprocess] = {"summary": summarize, "embedding": embed}
_LOADERS: dict[str, Callable[[Item, int], torch.Tensor]] = {
    "audio": load_audio,
    "synthetic": synthesize,
}


# -- devices and workers -----------------------------------------------------------------


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


class _Rows:
    """Per-item outputs of one piece; the guard hands back a list of them for a split batch."""

    __slots__ = ("rows",)

    def __init__(self, rows: list[torch.Tensor]) -> None:
        self.rows = rows

    @staticmethod
    def join(result: _Rows | list[_Rows]) -> list[torch.Tensor]:
        parts = result if isinstance(result, list) else [result]
        return [row for part in parts for row in part.rows]


@dataclass
class _Done:
    """One batch's outcome: per-item outputs (host tensors) and per-item failures."""

    outputs: list[tuple[Item, torch.Tensor]]
    failures: list[tuple[Item, str]]
    padded_seconds: float
    seconds: float
    frame_rate: float | None = None


class _Worker:
    """One device: its model, its guard, and a CPU copy made when one item does not fit."""

    def __init__(
        self,
        make_model: Callable[[], nn.Module],
        dev: Device,
        forward: Forward,
        sample_rate: int,
    ) -> None:
        self.dev = dev
        self.sample_rate = sample_rate
        self.user_forward = forward
        self._make_model = make_model
        with dev.uncounted():  # made on the host; counted once, by its own device
            self.model = _place(make_model(), dev)
        self.guard = Guard(self.model, device=dev, forward=self._forward)
        self._cpu: Guard | None = None
        self.cpu_fallbacks = 0
        self.batches = 0
        self.items = 0
        self.peak = 0
        #: Output frames per second of audio: the first batch's, then measured (chunks).
        self.frame_rate: float | None = None
        self._rate_measured = False

    def _forward(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> _Rows:
        waveforms, lengths = batch["waveforms"], batch["lengths"]
        if model is self.model:  # not the CPU fallback's copy
            waveforms = self.dev.put(waveforms)
        out, frames = _hidden(self.user_forward(model, waveforms, lengths))
        del waveforms
        padded, out_len = int(batch["waveforms"].shape[1]), int(out.shape[1])
        if frames is None:
            frames = _frames(model, lengths, padded, out_len)
        if self.frame_rate is None:
            self.frame_rate = _frame_rate(model, padded, out_len, self.sample_rate)
        frames = frames.to("cpu")
        with self.dev.uncounted():  # outputs leave the device at once: the next piece has room
            rows = [out[i, : int(frames[i])].detach().to("cpu").clone() for i in range(len(out))]
        return _Rows(rows)

    def _output_length(self, model: nn.Module, samples: int) -> int:
        """The model's output frames for one input of ``samples`` samples (zeros)."""
        waveforms = torch.zeros(1, samples)
        if model is self.model:
            waveforms = self.dev.put(waveforms)
        with torch.no_grad():
            out, _ = _hidden(self.user_forward(model, waveforms, torch.tensor([samples])))
        return int(out.shape[1])

    def run(self, loaded: dict[str, Any]) -> _Done:
        items: list[Item] = loaded["items"]
        failures = [(item, message) for item, message in loaded["errors"]]
        outputs: list[tuple[Item, torch.Tensor]] = []
        if items:
            batch = {"waveforms": loaded["waveforms"], "lengths": loaded["lengths"]}
            try:
                with self.dev.counting():
                    rows = _Rows.join(self.guard.infer(batch))
            except StepDoesNotFitError as exc:
                log.warning("%s: %s; running this batch on the CPU", self.dev.id, exc)
                rows = self._on_cpu(batch)
            outputs = list(zip(items, rows, strict=True))
            self.batches += 1
            self.items += len(items)
            if not self._rate_measured and any(i.parent is not None for i in items):
                # Chunks are stitched by the frame rate: measure it rather than take the
                # first batch's ratio (once, and only for a run with long recordings).
                self._rate_measured = True
                probe = functools.partial(self._output_length, self.model)
                with self.dev.counting():
                    self.frame_rate = _frame_rate(
                        self.model, 0, 0, self.sample_rate, probe, fallback=self.frame_rate
                    )
        self.peak = max(self.peak, _peak(self.dev))
        durations = [i.duration for i in items]
        return _Done(
            outputs,
            failures,
            len(durations) * max(durations, default=0.0),
            sum(durations),
            self.frame_rate,
        )

    def _on_cpu(self, batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        self.cpu_fallbacks += 1
        with self.dev.uncounted():
            if self._cpu is None:
                cpu = get_device("cpu")
                model = self._make_model().to("cpu").eval()
                self._cpu = Guard(model, device=cpu, forward=self._forward)
            return _Rows.join(self._cpu.infer(batch))

    def summary(self) -> dict[str, Any]:
        mem = self.dev.memory()
        total = mem.total if isinstance(mem.total, int) else None
        return {
            "device": self.dev.id,
            "batches": self.batches,
            "items": self.items,
            "peak_bytes": self.peak,
            "total_bytes": total,
            "ooms": self.guard.ooms,
            "ooms_recovered": self.guard.recovered,
            "cpu_fallbacks": self.cpu_fallbacks,
        }


def _place(model: nn.Module, dev: Device) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise BatchingError(f"the model factory must return an nn.Module, got {type(model)}")
    placed: nn.Module = dev.adopt(model)  # a simulated GPU counts it: its model.to("cuda")
    return placed.eval()


def _peak(dev: Device) -> int:
    mem = dev.memory()
    for value in (mem.peak_reserved, mem.peak_allocated, mem.used):
        if isinstance(value, int):
            return value
    return 0


# -- the item stream ---------------------------------------------------------------------


class _Remaining:
    """The manifest's items that the store does not hold, long ones chunked; re-iterable.

    A recording that would make more than :data:`_MAX_CHUNKS` chunks is not run: its
    duration is not believable (and its chunk list alone would exhaust memory). It goes to
    ``rejected`` as a failure ``(index, id, reason)``, which the collector records.
    """

    def __init__(
        self,
        source: Manifest | Iterable[Item],
        completed: Any,
        chunk: float,
        overlap: float,
    ) -> None:
        self.source = source
        self.completed = completed
        self.chunk = chunk
        self.overlap = overlap
        self.skipped = 0
        self.fresh = 0
        #: Recordings refused before chunking, for the collector to record as failed.
        #: (A deque: the sampler may run in a worker thread, the collector in the main one.)
        self.rejected: deque[tuple[int, str, str]] = deque()
        #: The longest recording that makes at most _MAX_CHUNKS chunks.
        self.longest = overlap + _MAX_CHUNKS * (chunk - overlap)

    def __iter__(self) -> Iterator[Item]:
        self.skipped = 0
        self.fresh = 0
        return chunk_items(self._fresh(), max_duration=self.chunk, overlap=self.overlap)

    def _fresh(self) -> Iterator[Item]:
        completed, longest = self.completed, self.longest
        for item in self.source:
            if item.index in completed:
                self.skipped += 1
                continue
            self.fresh += 1
            if item.duration > longest:
                self.rejected.append(
                    (
                        item.index,
                        item.id,
                        f"duration {item.duration!r} s would make more than {_MAX_CHUNKS} chunks"
                        f" of {self.chunk:g} s (longer than {longest:g} s): check the manifest's"
                        " duration, or raise chunk_duration",
                    )
                )
                continue
            yield item


def _count_records(path: str) -> int | None:
    """Non-blank lines of a JSON Lines or CSV manifest (less a CSV header), read fast.

    A line of only white space (``\\r`` of CRLF endings included) is blank, as the
    manifest reader takes it.
    """
    if not os.path.isfile(path) or path.endswith(".gz"):
        return None
    lines = 0
    blank = 0
    tail = b""  # the last line when it has no newline
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            if block[-1:] != b"\n":
                block += f.readline()  # whole lines only: a blank line is not cut in two
            lines += block.count(b"\n")
            if _FIRST_BLANK.match(block):  # a block starts a line: the regex below needs a \n
                blank += 1
            blank += len(_BLANK_LINE.findall(block))
            tail = block[block.rfind(b"\n") + 1 :]
    lines += bool(tail.strip())
    if path.lower().endswith(".csv"):
        lines -= 1
    return max(lines - blank, 0)


#: A line of only white space after a newline (it is not consumed: runs of blanks count).
_BLANK_LINE = re.compile(rb"\n[ \t\r\f\v]*(?=\n)")
#: A block's first line of only white space.
_FIRST_BLANK = re.compile(rb"[ \t\r\f\v]*\n")


# -- the run -----------------------------------------------------------------------------


def process(
    model: nn.Module | ModelFactory,
    manifest: str | os.PathLike[str] | Manifest,
    output: str | os.PathLike[str],
    *,
    forward: Forward | None = None,
    postprocess: Postprocess | Literal["summary", "embedding"] = "summary",
    devices: Sequence[Device | str | int] | None = None,
    max_devices: int | None = None,
    budget: Budget | None = None,
    target: float = 0.9,
    chunk_duration: float = 30.0,
    overlap: float = 1.0,
    num_buckets: int = 50,
    sample_rate: int = 16000,
    loader: Callable[[Item, int], torch.Tensor] | Literal["audio", "synthetic"] = "audio",
    num_workers: int | None = None,
    order: Literal["manifest", "id"] = "manifest",
    progress: str | os.PathLike[str] | None = None,
    resume: bool = True,
    frame_rate: float | None = None,
    config: dict[str, Any] | None = None,
    on_progress: Callable[[ProcessStatus], None] | None = None,
) -> ProcessResult:
    """Run ``model`` over every item of ``manifest``; write one output per recording.

    ``model`` is a zero-argument factory (called once per device) or a module
    (copied for each further device). ``forward(model, waveforms [B, T],
    lengths [B]) -> output`` runs one batch (default: ``model(waveforms)``);
    the output has time on dim 1 (``[B, T', ...]``; a model output's
    ``last_hidden_state`` is taken), optionally with the valid frames per item
    as ``(output, frames)``. Each recording's frames are stitched across its
    chunks, handed to ``postprocess(tensor [T', ...], item)`` (or
    ``"summary"``, ``"embedding"``) and the JSON value it returns is recorded.

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
    of each item's length) in ``num_workers`` threads (default: up to 4).

    Durability: every batch's outputs and failures are committed to a
    :class:`ProgressStore` at ``progress`` (default :func:`progress_path`) in
    one transaction; ``resume=True`` continues a store left by a killed run
    with the same manifest and settings, skipping what it holds. At the end the
    outputs are exported to ``output`` as JSON Lines (``order``: manifest order
    or by id) and the failures (missing or unreadable audio) next to it.
    """
    t0 = time.perf_counter()
    post = _postprocess(postprocess)
    load = _LOADERS[loader] if isinstance(loader, str) and loader in _LOADERS else loader
    if isinstance(load, str) or not callable(load):
        raise BatchingError(f"loader must be 'audio', 'synthetic' or a callable, got {loader!r}")
    if order not in ("manifest", "id"):
        raise BatchingError(f"order must be 'manifest' or 'id', got {order!r}")
    if not (math.isfinite(chunk_duration) and chunk_duration > 0):
        raise BatchingError(f"chunk_duration must be positive, got {chunk_duration!r}")
    fwd = forward or default_forward
    source = (
        manifest if isinstance(manifest, Manifest) else Manifest(manifest, sample_rate=sample_rate)
    )
    out = check_writable(output)
    check_writable(failures_path(out))
    store_path = os.fspath(progress) if progress is not None else progress_path(out)
    _check_not_manifest(source.path, output=out, failures=failures_path(out), progress=store_path)
    run_config = {
        "chunk_duration": float(chunk_duration),
        "overlap": float(overlap),
        "sample_rate": int(sample_rate),
        "postprocess": getattr(post, "__name__", type(post).__name__),
        **(config or {}),
    }
    devs = _pick_devices(devices, max_devices)
    store = ProgressStore(store_path, manifest=source.path, config=run_config, resume=resume)
    try:
        return _run(
            model, source, store, out, devs, fwd, post, load,
            budget=budget, target=target, chunk=float(chunk_duration), overlap=float(overlap),
            num_buckets=num_buckets, sample_rate=sample_rate, num_workers=num_workers,
            order=order, frame_rate=frame_rate, on_progress=on_progress, t0=t0,
        )  # fmt: skip
    finally:
        store.close()


def _check_not_manifest(manifest: str, **targets: str) -> None:
    """Refuse a file the run writes that is the manifest: it would be overwritten."""
    source = os.path.realpath(manifest)
    for name, target in targets.items():
        if os.path.realpath(target) == source:
            raise BatchingError(
                f"the {name} file {target} is the manifest {manifest}: the run would overwrite"
                " it; give another output path"
            )


def _postprocess(value: Postprocess | str) -> Postprocess:
    if isinstance(value, str):
        if value not in _POSTPROCESS:
            raise BatchingError(
                f"postprocess must be {' or '.join(map(repr, _POSTPROCESS))} or a callable,"
                f" got {value!r}"
            )
        return _POSTPROCESS[value]
    if not callable(value):
        raise BatchingError(f"postprocess must be a callable, got {value!r}")
    return value


def _factory(model: nn.Module | ModelFactory, devices: int) -> Callable[[int], nn.Module]:
    """Model for the k-th device: a given module is used on the first, copies on the rest.

    Each call after the first for a device (the CPU fallback's model) gets a copy of the
    module as given, never the module that device runs (moving it would move that).
    """
    if isinstance(model, nn.Module):
        module = model
        copies = [copy.deepcopy(model) for _ in range(devices - 1)]  # before it moves
        pristine = copy.deepcopy(model)  # for the CPU fallbacks, made before it moves
        given: set[int] = set()

        def make(k: int) -> nn.Module:
            if k in given:
                return copy.deepcopy(pristine)
            given.add(k)
            return module if k == 0 else copies[k - 1]

        return make
    if not callable(model):
        raise BatchingError(f"model must be an nn.Module or a factory, got {type(model)}")
    factory = model
    return lambda k: factory()


class _Forwarding(nn.Module):
    """``forward(model, waveforms, lengths)`` as a module, for the estimator."""

    def __init__(self, model: nn.Module, forward: Forward) -> None:
        super().__init__()
        self.inner = model
        self._fn = forward

    def forward(self, waveforms: torch.Tensor, lengths: torch.Tensor) -> Any:
        return self._fn(self.inner, waveforms, lengths)


def _default_budget(
    workers: list[_Worker], forward: Forward, chunk: float, target: float, sample_rate: int
) -> MemoryBudget:
    def make(n: int, seconds: float) -> tuple[torch.Tensor, torch.Tensor]:
        size = max(1, round(seconds * sample_rate))
        return torch.zeros(n, size), torch.full((n,), size, dtype=torch.int64)

    budgets = []
    for w in workers:
        cap = None if w.dev.is_gpu else _CPU_BUDGET
        mb = MemoryBudget.for_model(
            _Forwarding(w.model, forward),
            make,
            max_duration=chunk,
            device=w.dev,
            target=target,
            budget_bytes=cap,
        )
        budgets.append(mb)
    return min(budgets, key=lambda b: b.budget_bytes)


def _budget_info(budget: Budget, chunk: float) -> dict[str, Any]:
    info: dict[str, Any] = {"kind": type(budget).__name__, "limit": budget.limit}
    if isinstance(budget, MemoryBudget):
        info["budget_bytes"] = budget.budget_bytes
        info["limit_text"] = format_bytes(budget.budget_bytes)
        info["notes"] = list(budget.notes)
    # The sizes at the exact lengths (a rounded one can be past the longest the budget
    # covers), named by the length to the hundredth of a second.
    info["max_count"] = {f"{round(s, 2):g}s": budget.max_count(s) for s in budget_lengths(chunk)}
    return info


def budget_lengths(chunk: float) -> list[float]:
    """The lengths a run reports its batch sizes at: fractions of ``chunk``, up to it."""
    return sorted({chunk * f for f in _REPORTED_FRACTIONS})


_REPORTED_FRACTIONS = (0.125, 0.25, 0.5, 0.75, 1.0)


def _run(
    model: nn.Module | ModelFactory,
    source: Manifest,
    store: ProgressStore,
    out: str,
    devs: list[Device],
    fwd: Forward,
    post: Postprocess,
    load: Callable[[Item, int], torch.Tensor],
    *,
    budget: Budget | None,
    target: float,
    chunk: float,
    overlap: float,
    num_buckets: int,
    sample_rate: int,
    num_workers: int | None,
    order: Literal["manifest", "id"],
    frame_rate: float | None,
    on_progress: Callable[[ProcessStatus], None] | None,
    t0: float,
) -> ProcessResult:
    make = _factory(model, len(devs))
    workers = [_Worker(partial(make, k), dev, fwd, sample_rate) for k, dev in enumerate(devs)]
    if budget is None:
        budget = _default_budget(workers, fwd, chunk, target, sample_rate)
    if budget.max_count(chunk) < 1:
        log.warning(
            "the budget holds no item of %g s: such items run alone, split by the guard", chunk
        )
    completed = store.completed()
    remaining = _Remaining(source, completed, chunk, overlap)
    sampler = BucketingSampler(remaining, budget, num_buckets=num_buckets)
    total = _count_records(source.path)
    audio = AudioBatches([], sample_rate=sample_rate, loader=load)
    threads = num_workers if num_workers is not None else min(4, os.cpu_count() or 1)
    collector = _Collector(store, post, frame_rate, sample_rate, remaining.rejected)
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
        if on_progress is not None:
            on_progress(status)

    report()
    loaded = _Loaded(sampler, audio, threads)
    try:
        if len(workers) == 1:
            for batch in loaded:
                collector.take(workers[0].run(batch))
                report()
        else:
            _run_parallel(workers, loaded, collector, report)
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
    exported = store.export(out, order=order)
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
    )


class _Loaded:
    """Batches loaded ahead by a thread pool, handed out in the sampler's order."""

    def __init__(self, sampler: BucketingSampler, audio: AudioBatches, threads: int) -> None:
        self._batches = iter(sampler)
        self._audio = audio
        self._pool = ThreadPoolExecutor(threads, "vramctl-load") if threads > 0 else None
        self._ahead: deque[Future[dict[str, Any]]] = deque()
        self._depth = 2 * threads + 2
        self._lock = threading.Lock()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self

    def __next__(self) -> dict[str, Any]:
        with self._lock:
            if self._pool is None:
                batch = next(self._batches)
                return self._audio.collate(batch.items)
            while len(self._ahead) < self._depth:
                nxt = next(self._batches, None)
                if nxt is None:
                    break
                self._ahead.append(self._pool.submit(self._audio.collate, nxt.items))
            if not self._ahead:
                raise StopIteration
            future = self._ahead.popleft()
        return future.result()

    def close(self) -> None:
        for f in self._ahead:
            f.cancel()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


def _run_parallel(
    workers: list[_Worker],
    loaded: _Loaded,
    collector: _Collector,
    report: Callable[[], None],
) -> None:
    """One thread per device takes the next loaded batch; this thread records the results."""
    results: queue.Queue[tuple[str, Any]] = queue.Queue()
    stop = threading.Event()

    def work(w: _Worker) -> None:
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


class _Collector:
    """Stitches chunk outputs, postprocesses whole recordings and commits each batch."""

    def __init__(
        self,
        store: ProgressStore,
        post: Postprocess,
        frame_rate: float | None,
        sample_rate: int,
        rejected: deque[tuple[int, str, str]] | None = None,
    ) -> None:
        self.store = store
        self.post = post
        #: Failures found before a batch (see _Remaining): recorded with the next commit.
        self.rejected: deque[tuple[int, str, str]] = rejected if rejected is not None else deque()
        self.sample_rate = sample_rate
        self.stitcher: Stitcher | None = Stitcher(frame_rate) if frame_rate else None
        self._given_rate = bool(frame_rate)
        #: Chunked recordings that failed, as (id, manifest index): ids may repeat.
        self.failed_parents: set[tuple[str, int]] = set()
        self.done = 0
        self.failed = 0
        self.seconds = 0.0
        self.batches = 0
        self._padded = 0.0
        self._real = 0.0

    @property
    def padding(self) -> float:
        return 1.0 - self._real / self._padded if self._padded > 0 else 0.0

    def pending(self) -> int:
        return self.stitcher.pending() if self.stitcher is not None else 0

    def _stitcher_for(self, item: Item, rate: float | None) -> Stitcher:
        if self.stitcher is None:
            self.stitcher = Stitcher(rate or 1.0)
        elif (
            item.parent is not None
            and rate
            and not self._given_rate
            and rate != self.stitcher.frame_rate
            and not self.stitcher.pending()
        ):
            # A batch with chunks carries the measured rate; one without, its own ratio.
            self.stitcher.frame_rate = rate
        return self.stitcher

    def _drain(self) -> list[tuple[int, str, str]]:
        out = []
        while self.rejected:
            out.append(self.rejected.popleft())
        return out

    def flush(self) -> None:
        """Record the failures found before any batch that no batch has carried yet."""
        failures = self._drain()
        if failures:
            self.store.commit([], failures)
            self.failed += len(failures)

    def take(self, batch: _Done) -> None:
        results: list[tuple[int, str, Any, float]] = []
        failures: list[tuple[int, str, str]] = self._drain()
        for item, reason in batch.failures:
            name = item.parent or item.id
            if item.parent is not None:
                if (name, item.index) in self.failed_parents:
                    continue
                self.failed_parents.add((name, item.index))
                if self.stitcher is not None:
                    self.stitcher.discard(name, item.index)
            failures.append((item.index, name, reason))
        for item, output in batch.outputs:
            if item.parent is not None and (item.parent, item.index) in self.failed_parents:
                continue
            for rec_id, whole in self._stitcher_for(item, batch.frame_rate).add(item, output):
                rec = _recording(item, rec_id)
                try:
                    value = self.post(whole, rec)
                except Exception as exc:
                    failures.append((rec.index, rec.id, f"postprocess failed: {exc!r}"))
                    continue
                results.append((rec.index, rec.id, value, rec.duration))
        self.store.commit(results, failures)
        self.done += len(results)
        self.failed += len(failures)
        self.seconds += sum(r[3] for r in results)
        self.batches += 1
        self._padded += batch.padded_seconds
        self._real += batch.seconds


def _recording(item: Item, rec_id: str) -> Item:
    """The whole recording a (possibly chunk) item belongs to."""
    if item.parent is None:
        return item
    extra = dict(item.extra or {})
    duration = float(extra.pop("parent_duration", item.duration))
    offset = float(extra.pop("parent_offset", 0.0))
    extra.pop("chunks", None)
    return replace(
        item, id=rec_id, duration=duration, offset=offset, parent=None, chunk=0, extra=extra or None
    )
