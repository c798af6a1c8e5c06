"""``demo``: the whole story on whatever device is here, in about a minute on a CPU.

1. **Estimate.** A real audio model (wav2vec 2.0 from its ``transformers``
   config, random weights) is traced on fake tensors: the per-bucket batch
   sizes that fit the device, predicted without running a step.
2. **Fit.** One real step per bucket length: its measured peak beside the
   predicted one and the device's capacity. They are different quantities on
   every device (a simulated GPU does not count the scratch of the CPU kernels
   that the prediction includes); the report's ``fit_note`` says how.
3. **Process.** ``clips`` clips with the lengths of LibriSpeech utterances
   (a sample shipped with vramctl; the waveforms are synthesized) go through
   :func:`vramctl.batching.process`. Part way, a ballast tensor takes a large
   share of the device's memory (the *squeeze*, as another job would) and is
   released later: the guard finishes the batches that no longer fit in pieces.
4. **Report.** Throughput, peak memory against capacity, OOMs recovered,
   padding, and the clips lost (none).

On a machine without a GPU the device is a simulated GPU (``vramctl.simulate``)
on the CPU, which counts every live tensor and raises a real
``torch.OutOfMemoryError`` past its capacity.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import torch
from torch import nn

from vramctl import format_bytes
from vramctl._optional import require
from vramctl.batching import BatchingError, MemoryBudget, ProcessResult, ProcessStatus, process
from vramctl.device import Device, get_device, gpus, simulate

__all__ = ["DemoReport", "demo", "demo_lengths"]

SAMPLE_RATE = 16_000
#: The simulated GPU of a machine without one, for the small model.
SIM_CAPACITY = "256MiB"
#: wav2vec 2.0 shapes: the published base model, and a small one of the same design for CPUs.
MODELS: dict[str, dict[str, Any]] = {
    "wav2vec2-base": {},
    "wav2vec2-mini": {
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "intermediate_size": 1024,
        "conv_dim": (64,) * 7,
        "num_conv_pos_embeddings": 64,
    },
}
#: The squeeze: a ballast of this share of the capacity, from this share of the clips to that.
SQUEEZE = (0.5, 0.3, 0.75)


def demo_lengths() -> list[tuple[str, float]]:
    """The shipped sample of LibriSpeech train-clean-100 lengths: ``(utterance id, seconds)``.

    >>> lengths = demo_lengths()
    >>> len(lengths), round(min(s for _, s in lengths), 2), round(max(s for _, s in lengths), 2)
    (2000, 1.95, 19.3)
    """
    text = resources.files("vramctl.cli").joinpath("data/librispeech_lengths.csv")
    with text.open("r", encoding="utf-8") as f:
        return [(row[0], int(row[1]) / SAMPLE_RATE) for row in list(csv.reader(f))[1:]]


def build_model(name: str) -> nn.Module:
    """A wav2vec 2.0 encoder (``Wav2Vec2Model``) from its config, with random weights."""
    if name not in MODELS:
        raise BatchingError(f"unknown demo model {name!r}: use {' or '.join(MODELS)}")
    transformers = require("transformers", extra="zoo", what="the demo", error=BatchingError)
    torch.manual_seed(0)
    config = transformers.Wav2Vec2Config(**MODELS[name])
    model: nn.Module = transformers.Wav2Vec2Model(config)
    return model.eval()


@dataclass
class DemoReport:
    """What the demo did; :meth:`to_dict` is its JSON."""

    model: str
    parameters: int
    device: str
    simulated: bool
    capacity_bytes: int
    clips: int
    audio_seconds: float
    estimate_s: float
    #: Predicted batch size per bucket length: ``{"4.3s": 24, ...}``.
    batch_sizes: dict[str, int]
    budget_bytes: int
    #: One real step per bucket length: count, predicted and measured peak bytes.
    fit: list[dict[str, Any]]
    squeeze_bytes: int
    result: ProcessResult
    output_lines: int
    notes: list[str] = field(default_factory=list)
    #: What the fit's predicted and measured peaks each are on this device, and so why
    #: they differ.
    fit_note: str = ""

    @property
    def peak_bytes(self) -> int:
        return max((d["peak_bytes"] for d in self.result.devices), default=0)

    def to_dict(self) -> dict[str, Any]:
        r = self.result
        return {
            "model": self.model,
            "parameters": self.parameters,
            "device": self.device,
            "simulated": self.simulated,
            "capacity_bytes": self.capacity_bytes,
            "clips": self.clips,
            "audio_seconds": round(self.audio_seconds, 2),
            "estimate_s": round(self.estimate_s, 3),
            "budget_bytes": self.budget_bytes,
            "batch_sizes": self.batch_sizes,
            "fit": self.fit,
            "fit_note": self.fit_note,
            "squeeze_bytes": self.squeeze_bytes,
            "wall_s": round(r.wall_s, 3),
            "clips_per_s": round(r.items_per_s, 3),
            "audio_hours_per_hour": round(r.audio_hours_per_hour, 2),
            "peak_bytes": self.peak_bytes,
            "peak_of_capacity": round(self.peak_bytes / self.capacity_bytes, 4),
            "ooms": r.ooms,
            "ooms_recovered": r.ooms_recovered,
            "cpu_fallbacks": r.cpu_fallbacks,
            "padding_pct": round(100 * r.padding, 2),
            "batches": r.batches,
            "done": r.store_done,
            "failed": r.store_failed,
            "lost": self.clips - r.store_done - r.store_failed,
            "output": r.output,
            "output_lines": self.output_lines,
            "notes": self.notes,
        }


def _make_batch(n: int, seconds: float) -> torch.Tensor:
    return torch.zeros(n, max(1, round(seconds * SAMPLE_RATE)))


@contextlib.contextmanager
def _on(device: str | None) -> Iterator[tuple[Device, bool]]:
    """The demo's device: one named, else the first usable GPU, else a simulated one."""
    if device is not None and not device.lower().startswith("sim:"):
        yield get_device(device), False
        return
    found = [g for g in gpus() if g.health.state.usable] if device is None else []
    if found:
        yield found[0], False
        return
    size = device[4:] if device is not None else SIM_CAPACITY
    with simulate(size) as sim:
        yield sim, True


def demo(
    clips: int = 300,
    *,
    model: str | None = None,
    device: str | None = None,
    output: str | os.PathLike[str] | None = None,
    squeeze: bool = True,
    on_stage: Callable[[str], None] | None = None,
    on_progress: Callable[[ProcessStatus], None] | None = None,
) -> DemoReport:
    """Estimate, fit and process ``clips`` LibriSpeech-length clips; see the module doc.

    ``model``: ``"wav2vec2-base"`` (95M parameters; the default on a GPU) or
    ``"wav2vec2-mini"`` (the same design, 4 layers of 256; the default on a
    CPU). ``device``: a GPU, ``"cpu"``, or ``"sim:SIZE"`` / ``"sim:GPU-NAME"``
    for a simulated one (the default without a GPU: ``sim:256MiB``).
    ``output``: a folder for the manifest, the outputs and the progress store
    (default: a temporary folder, removed afterwards); a folder left by an
    interrupted demo resumes.
    """
    if clips < 1:
        raise BatchingError(f"clips must be at least 1, got {clips}")
    stage = on_stage or (lambda text: None)
    with contextlib.ExitStack() as stack:
        if output is None:
            folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="vramctl-demo-"))
        else:
            folder = os.fspath(output)
            os.makedirs(folder, exist_ok=True)
        dev, simulated = stack.enter_context(_on(device))
        name = model or ("wav2vec2-base" if dev.is_cuda else "wav2vec2-mini")
        return _demo(clips, name, dev, simulated, folder, squeeze, stage, on_progress)
    raise AssertionError("unreachable")  # pragma: no cover


def _demo(
    clips: int,
    name: str,
    dev: Device,
    simulated: bool,
    folder: str,
    squeeze: bool,
    stage: Callable[[str], None],
    on_progress: Callable[[ProcessStatus], None] | None,
) -> DemoReport:
    lengths = demo_lengths()
    picked = [lengths[i % len(lengths)] for i in range(clips)]
    manifest = os.path.join(folder, "clips.jsonl")
    text = "".join(
        json.dumps(
            {"id": utt if k < len(lengths) else f"{utt}~{k // len(lengths)}", "duration": seconds}
        )
        + "\n"
        for k, (utt, seconds) in enumerate(picked)
    )
    _write_if_changed(manifest, text)
    longest = max(s for _, s in picked)
    capacity = dev.capacity()

    stage(f"building {name} (random weights) on {dev.id}")
    net = dev.adopt(build_model(name))
    params = sum(p.numel() for p in net.parameters())

    stage("estimating the batch size of each bucket (fake tensors, no step run)")
    t0 = time.perf_counter()
    budget = MemoryBudget.for_model(
        net,
        _make_batch,
        max_duration=longest,
        device=dev,
        target=0.9,
        budget_bytes=None if dev.is_gpu else min(capacity, 2 * 2**30),
    )
    estimate_s = time.perf_counter() - t0

    stage("fitting: one real step per bucket length, measured")
    fit = []
    # A quarter, half and all of the longest clip: lengths in the run's batch-size table.
    for seconds in (longest / 4, longest / 2, longest):
        n = max(budget.max_count(seconds), 1)
        with dev.uncounted():  # the batch in host memory: only its copy on the device counts
            batch = _make_batch(n, seconds)
        meter = dev.peak_meter()
        with torch.no_grad(), meter:
            out = net(dev.put(batch))  # a simulated GPU counts its copy inside the meter
            del out
        del batch
        fit.append(
            {
                "seconds": seconds,
                "count": n,
                "predicted_bytes": int(budget.peak(n, seconds)),
                "measured_bytes": int(meter.peak_used),
            }
        )

    ballast: list[torch.Tensor] = []
    share, start, stop = SQUEEZE
    notes: list[str] = []
    if squeeze and not dev.is_gpu:
        squeeze = False
        notes.append("no squeeze on the CPU: the host's memory is not the demo's to take")
    squeeze_bytes = int(share * capacity) if squeeze else 0

    def progress(status: ProcessStatus) -> None:
        finished = status.done + status.failed + status.skipped
        if squeeze_bytes and not ballast and start * clips <= finished < stop * clips:
            stage(f"squeeze: another job takes {format_bytes(squeeze_bytes)} of the device")
            ballast.append(_ballast(dev, squeeze_bytes))
        elif ballast and finished >= stop * clips:
            ballast.clear()
            stage("squeeze over: the memory is given back")
        if on_progress is not None:
            on_progress(status)

    stage(f"processing {clips} clips under the guard")
    del net
    result = process(
        lambda: build_model(name),
        manifest,
        os.path.join(folder, "outputs.jsonl"),
        loader="synthetic",
        budget=budget,
        devices=[dev],
        chunk_duration=longest,
        num_buckets=10 if clips < 2000 else 50,
        on_progress=progress,
        config={"demo_model": name},
    )
    ballast.clear()
    with open(result.output, encoding="utf-8") as f:
        lines = sum(1 for _ in f)
    if simulated:
        notes.append(
            "no GPU here: a simulated GPU on the CPU (it counts live tensors only: no CUDA"
            " context, workspaces or allocator rounding)"
        )
    return DemoReport(
        model=name,
        parameters=params,
        device=dev.id,
        simulated=simulated,
        capacity_bytes=capacity,
        clips=clips,
        audio_seconds=sum(s for _, s in picked),
        estimate_s=estimate_s,
        batch_sizes=result.budget["max_count"],  # at fractions of the longest clip
        budget_bytes=budget.budget_bytes,
        fit=fit,
        squeeze_bytes=squeeze_bytes,
        result=result,
        output_lines=lines,
        notes=notes,
        fit_note=_fit_note(dev),
    )


def _fit_note(dev: Device) -> str:
    """What the fit compares on ``dev``: the predicted peak is the estimator's figure for
    the step (:meth:`MemoryBudget.peak`), the measured one ``dev.peak_meter()``'s
    ``peak_used``; they are not the same quantity on any device."""
    if dev.is_simulated:
        return (
            "the predicted peak is the step's memory as the CPU kernels that run it use it: its"
            " tensors plus the scratch that kernels such as convolutions allocate inside a"
            " call, which PyTorch's profiler counts on a CPU (the estimate_accuracy"
            " benchmark's median error of 0.00% is against that count). A simulated GPU"
            " counts only the tensors operators return, not that scratch, so it measures"
            " less: the difference is the scratch, on the safe side, not an error of the"
            " estimate"
        )
    if dev.is_cuda:
        return (
            "the predicted peak is this process's allocator (reserved) as the estimator"
            " models it for this GPU; the measured one is the device's used memory at the"
            " step's peak, which also holds the CUDA context and other processes' memory"
        )
    return (
        "the predicted peak is the step's own memory (its tensors and the CPU kernels'"
        " scratch); the measured one is the host's used memory at the step's peak, every"
        " process's included"
    )


def _write_if_changed(path: str, text: str) -> None:
    """Write ``text`` to ``path`` unless it holds it already.

    An interrupted demo's progress store knows its manifest by size and modification
    time: the same manifest written again would look like another run's.
    """
    try:
        with open(path, encoding="utf-8") as f:
            if f.read() == text:
                return
    except (OSError, UnicodeDecodeError):
        pass
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def _ballast(dev: Device, nbytes: int) -> torch.Tensor:
    """A tensor of ``nbytes`` held on ``dev`` (counted by a simulated GPU)."""
    return torch.empty(max(nbytes // 4, 1), device=dev.torch_device)
