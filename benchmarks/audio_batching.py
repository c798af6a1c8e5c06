"""Batching LibriSpeech-length audio: fixed batches, Lhotse's buckets, vramctl's buckets.

The clip lengths are LibriSpeech train-clean-100's (28,539 clips of 1.4-24.5 s,
``utterance_id,num_samples`` at 16 kHz), shuffled with a fixed seed (the file
is sorted by length). Three ways of batching them are compared:

- fixed: consecutive clips of the shuffled stream, one batch size for all
  (a batch that holds the longest clip is padded to it, so the worst case is
  that many longest clips): in part 1 the largest that never goes over the
  budget; in part 2 the fastest of a sweep (below);
- lhotse: ``lhotse.dataset.DynamicBucketingSampler`` (its ``max_duration`` is a
  soft limit: the cut that crosses it stays in the batch);
- vramctl: ``vramctl.batching.BucketingSampler`` under a hard budget.

Three parts:

1. Samplers alone, on all clips, under a budget of 600 s of padded audio per
   batch (``PaddedDuration(600)`` for vramctl; ``max_duration=600`` for
   Lhotse; ``600 // longest`` clips for fixed), 50 buckets, shuffled, seed 0.
   Measured from the batches, the same way for all three: padding (1 - audio
   seconds / padded seconds, a batch being padded to its longest clip), budget
   overruns (batches whose ``count * longest`` passes 600 s) and the worst ratio
   of that to 600 s, the number of batches, and items per second of the sampler
   alone (clips and cuts built beforehand; the best of a few passes).
2. End to end: a small wav2vec2 (``transformers.Wav2Vec2Model``, random weights,
   eval mode, ``torch.inference_mode()``) runs on a subset of the clips, fed
   deterministic noise padded with zeros to each batch's longest clip (as for
   wav2vec2-base, no attention mask). Memory is a simulated GPU of a few hundred
   MiB (``vramctl.simulate``: real tensor bytes counted, a real
   ``torch.OutOfMemoryError`` past the capacity), or with ``--cuda`` this
   machine's GPU shrunk to the same capacity by a ballast tensor. Each method
   gets the largest setting that never runs out of memory, found before the
   timing and reported apart: fixed, the largest batch size whose worst case
   (that many longest clips) runs, and then its halves (down to a quarter with
   ``--quick``, down to 1 without), which run too: on a CPU, where a batch costs
   about its padded audio, a smaller fixed batch wastes less padding and can be
   faster; Lhotse, the largest ``max_duration`` (1 s
   steps) whose batches on these clips all run (only the batches that no
   other batch dominates in both count and length are run); vramctl, the
   budget ``MemoryBudget.for_model(model, make_batch, max_duration=<longest
   clip>, device=<the GPU>, target=0.9)`` predicts from the estimator on fake
   tensors, with no trial run (or, where that fails, ``PaddedDuration`` with
   the largest budget that runs, searched as for Lhotse). The three then
   process the same clips, batch by batch, interleaved (the method that has
   processed the least audio goes next), so that other jobs on the machine
   slow all three alike. Timed: building each padded batch on the device and
   the forward pass. Throughput is seconds of audio (unpadded) per second of
   wall time, and clips per second; CPU time is reported beside it. An
   out-of-memory error is counted, and the batch is run again in halves. The
   fixed baseline is the fastest fixed batch size of the sweep (by audio per
   wall second); the largest safe one is reported beside it.
3. Streaming: a synthetic JSON Lines manifest of 10M records (1M with
   ``--quick``; durations drawn from the LibriSpeech lengths) is written to a
   temporary folder, and a fresh Python process streams it through
   ``BucketingSampler(Manifest(path), PaddedDuration(600), num_buckets=50)``.
   Reported: its peak RSS (``VmHWM``; ``ru_maxrss`` where there is no
   ``/proc``), the peak RSS after importing vramctl (which imports torch), and
   microseconds per item of the streaming alone.

The last line is one JSON object. Its top-level ``padding_pct``,
``budget_overruns``, ``worst_overrun_ratio`` (part 1), ``speedup_vs_fixed``
(against the fastest fixed batch), ``speedup_vs_fixed_largest`` (against the
largest safe one), ``speedup_vs_lhotse`` (part 2, wall-clock throughput ratios),
``stream_rss_mb`` and ``stream_us_per_item`` (part 3) are vramctl's; ``fixed``
(with the whole ``sweep``) and ``lhotse`` hold the peers' figures and ``e2e``
the end-to-end details.

    python benchmarks/audio_batching.py --quick     # under a minute on a 2-core CPU
    python benchmarks/audio_batching.py             # several minutes
    python benchmarks/audio_batching.py --cuda      # on a machine with an NVIDIA GPU
"""

from __future__ import annotations

import contextlib
import csv
import gc
import logging
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import vramctl
from vramctl.batching import BucketingSampler, Item, MemoryBudget, PaddedDuration

import _common
from _common import free_failed, quiet

SAMPLE_RATE = 16_000
SEED = 0
#: Part 1: the padded-duration budget per batch, and the buckets.
BUDGET_S = 600.0
BUCKETS = 50
#: Part 2: vramctl's share of the device (MemoryBudget.for_model's ``target``).
TARGET = 0.9
MiB = 2**20
DEFAULT_LENGTHS = (
    Path(__file__).resolve().parents[1].parent
    / "shared"
    / "data"
    / "librispeech-train-clean-100.lengths.csv"
)

#: A clip: its id and its length in samples at 16 kHz.
Clip = tuple[str, int]


@dataclass(frozen=True)
class ModelSpec:
    """A small wav2vec2 and the simulated GPU it runs on."""

    name: str
    hidden: int
    layers: int
    heads: int
    intermediate: int
    #: Channels of each of the 7 feature-encoder convolutions (wav2vec2-base has 512).
    conv: int
    capacity_mib: int

    def build(self) -> torch.nn.Module:
        from transformers import Wav2Vec2Config, Wav2Vec2Model

        config = Wav2Vec2Config(
            hidden_size=self.hidden,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            intermediate_size=self.intermediate,
            conv_dim=(self.conv,) * 7,
            feat_extract_norm="group",  # wav2vec2-base's: padded with zeros, no attention mask
            num_conv_pos_embeddings=64,
            num_conv_pos_embedding_groups=16,
            apply_spec_augment=False,
        )
        torch.manual_seed(SEED)
        return Wav2Vec2Model(config).eval()

    def describe(self) -> str:
        return (
            f"wav2vec2 (random weights): {self.layers} layers of {self.hidden} "
            f"({self.heads} heads, FFN {self.intermediate}), 7 convolutions of {self.conv} channels"
        )


FULL_MODEL = ModelSpec("wav2vec2-256x4", 256, 4, 4, 1024, 64, capacity_mib=256)
#: --quick: a smaller wav2vec2, so that the end-to-end part takes seconds on a 2-core CPU.
QUICK_MODEL = ModelSpec("wav2vec2-128x2", 128, 2, 2, 512, 32, capacity_mib=128)
#: On a GPU: wav2vec2-base itself (95M parameters), in 4 GiB.
BASE_MODEL = ModelSpec("wav2vec2-base", 768, 12, 12, 3072, 512, capacity_mib=4096)
MODELS = {"quick": QUICK_MODEL, "small": FULL_MODEL, "base": BASE_MODEL}
FULL_CLIPS, QUICK_CLIPS = 400, 100
#: On a GPU (full run) the end-to-end part takes more clips.
CUDA_CLIPS = 800
FULL_STREAM, QUICK_STREAM = 10_000_000, 1_000_000
#: Part 2's buckets (Lhotse and vramctl alike): a few hundred clips fill few of 50 buckets.
E2E_BUCKETS = 10
#: Part 2's fixed batch sizes: the largest safe one and its halves, this many at most.
QUICK_FIXED_SIZES, FULL_FIXED_SIZES = 3, 16


# -- data ------------------------------------------------------------------------------


def load_lengths(path: Path) -> list[Clip]:
    """The clips of the lengths file, shuffled with a fixed seed (the file is sorted)."""
    if not path.is_file():
        raise SystemExit(
            f"lengths file not found: {path}\n"
            "pass --lengths PATH to a CSV with columns utterance_id,num_samples (16 kHz), such "
            "as librispeech-train-clean-100.lengths.csv from the project's shared data"
        )
    with path.open(newline="") as f:
        clips = [(row["utterance_id"], int(row["num_samples"])) for row in csv.DictReader(f)]
    random.Random(SEED).shuffle(clips)
    return clips


def seconds(samples: int) -> float:
    return samples / SAMPLE_RATE


@dataclass
class BatchFigures:
    """Padding and budget figures of a list of batches (each a list of durations)."""

    batches: int
    items: int
    audio_s: float
    padded_s: float
    overruns: int
    worst_ratio: float
    max_batch: int

    @classmethod
    def of(cls, batches: Sequence[Sequence[float]], budget: float) -> BatchFigures:
        audio = padded = worst = 0.0
        overruns = 0
        for b in batches:
            cost = len(b) * max(b)
            audio += sum(b)
            padded += cost
            worst = max(worst, cost / budget)
            overruns += cost > budget * (1 + 1e-9)
        return cls(
            len(batches),
            sum(len(b) for b in batches),
            audio,
            padded,
            overruns,
            worst,
            max((len(b) for b in batches), default=0),
        )

    @property
    def padding_pct(self) -> float:
        return 100 * (1 - self.audio_s / self.padded_s) if self.padded_s else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "batches": self.batches,
            "items": self.items,
            "mean_batch": round(self.items / self.batches, 2) if self.batches else 0,
            "max_batch": self.max_batch,
            "padding_pct": round(self.padding_pct, 3),
            "budget_overruns": self.overruns,
            "worst_overrun_ratio": round(self.worst_ratio, 4),
        }


def make_cuts(clips: Sequence[Clip]) -> Any:
    from lhotse import CutSet, MonoCut

    return CutSet.from_cuts(
        MonoCut(id=cid, start=0.0, duration=seconds(n), channel=0, recording=None)
        for cid, n in clips
    )


def lhotse_sampler(cuts: Any, max_duration: float, num_buckets: int) -> Any:
    from lhotse.dataset import DynamicBucketingSampler

    return DynamicBucketingSampler(
        cuts, max_duration=max_duration, num_buckets=num_buckets, shuffle=True, seed=SEED
    )


# -- part 1: the samplers alone --------------------------------------------------------


def best_of(repeats: int, fn: Callable[[], Any]) -> tuple[Any, float]:
    best, out = float("inf"), None
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return out, best


def sampler_part(clips: Sequence[Clip], repeats: int, buckets: int) -> dict[str, dict[str, Any]]:
    """Padding, overruns, batches and items/s of the three samplers over all clips."""
    items = [Item(cid, seconds(n), index=i) for i, (cid, n) in enumerate(clips)]
    with quiet():
        cuts = make_cuts(clips)
    longest = max(i.duration for i in items)
    fixed_n = int(BUDGET_S // longest)

    def fixed() -> list[list[Item]]:
        return [items[k : k + fixed_n] for k in range(0, len(items), fixed_n)]

    def lhotse() -> list[Any]:
        with quiet():
            return list(lhotse_sampler(cuts, BUDGET_S, buckets))

    def ours() -> tuple[list[Any], BucketingSampler]:
        s = BucketingSampler(
            items, PaddedDuration(BUDGET_S), num_buckets=buckets, shuffle=True, seed=SEED
        )
        return list(s), s

    # Each pass is timed alone; the durations are read from its batches afterwards.
    out: dict[str, dict[str, Any]] = {}
    fixed_batches, t = best_of(repeats, fixed)
    durations = [[i.duration for i in b] for b in fixed_batches]
    out["fixed"] = {
        **BatchFigures.of(durations, BUDGET_S).to_dict(),
        "batch_size": fixed_n,
        "items_per_s": round(len(items) / t),
    }
    lhotse_batches, t = best_of(repeats, lhotse)
    durations = [[c.duration for c in b] for b in lhotse_batches]
    out["lhotse"] = {
        **BatchFigures.of(durations, BUDGET_S).to_dict(),
        "items_per_s": round(len(items) / t),
    }
    (our_batches, sampler), t = best_of(repeats, ours)
    durations = [[i.duration for i in b.items] for b in our_batches]
    figures = BatchFigures.of(durations, BUDGET_S)
    own = sampler.stats  # the sampler's own count must agree with the batches
    agrees = (
        own.batches == figures.batches
        and own.overruns == figures.overruns
        and abs(100 * own.padding - figures.padding_pct) < 1e-6
    )
    out["vramctl"] = {
        **figures.to_dict(),
        "items_per_s": round(len(items) / t),
        "oversize": own.oversize,
        "own_stats_agree": agrees,
    }
    for r in out.values():
        r["complete"] = r["items"] == len(items)
    return out


# -- part 2: end to end ----------------------------------------------------------------


class SimMemory:
    """A simulated GPU of ``capacity`` bytes on the CPU."""

    kind = "sim"

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.gpu = vramctl.simulate(capacity)
        self.device: Any = self.gpu
        self.torch_device = torch.device("cpu")

    def __enter__(self) -> SimMemory:
        self.gpu.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.gpu.__exit__(*exc)

    def place(self, model: torch.nn.Module) -> torch.nn.Module:
        self.gpu.adopt(model)  # the simulated model.to("cuda")
        return model

    def host(self) -> contextlib.AbstractContextManager[Any]:
        return self.gpu.host()

    def reset_peak(self) -> None:
        self.gpu.reset_peak()

    def peak(self) -> int:
        return int(self.gpu.peak_bytes)

    def sync(self) -> None:
        pass

    def after_oom(self) -> None:
        pass


class CudaMemory(SimMemory):
    """This machine's GPU, shrunk by a ballast tensor so that PyTorch has ``capacity`` bytes."""

    kind = "cuda"

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.device = vramctl.get_device(0)
        self.torch_device = torch.device("cuda", 0)
        self.ballast: torch.Tensor | None = None

    def __enter__(self) -> CudaMemory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.ballast = None
        gc.collect()
        torch.cuda.empty_cache()

    def place(self, model: torch.nn.Module) -> torch.nn.Module:
        model = model.to(self.torch_device)
        gc.collect()
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info()
        spare = free - (self.capacity - torch.cuda.memory_allocated())
        if spare > 0:
            self.ballast = torch.empty(spare, dtype=torch.uint8, device=self.torch_device)
        return model

    def host(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def reset_peak(self) -> None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

    def peak(self) -> int:
        torch.cuda.synchronize()
        ballast = self.ballast.numel() if self.ballast is not None else 0
        return int(torch.cuda.max_memory_allocated()) - ballast

    def sync(self) -> None:
        torch.cuda.synchronize()

    def after_oom(self) -> None:
        torch.cuda.empty_cache()


class Runner:
    """Runs the model on padded batches of clips (by index) or on worst-case shapes."""

    def __init__(self, model: torch.nn.Module, mem: SimMemory, lengths: Sequence[int]) -> None:
        self.model = model
        self.mem = mem
        self.lengths = list(lengths)
        longest = max(self.lengths)
        # One noise buffer on the host; clip i is a slice of it at its own offset.
        g = torch.Generator().manual_seed(SEED)
        with mem.host():
            self.noise = 0.1 * torch.randn(longest + SAMPLE_RATE, generator=g)
        self.probes = 0
        self.probe_s = 0.0

    def _forward(self, x: torch.Tensor) -> None:
        with torch.inference_mode():
            out = self.model(x).last_hidden_state
            del out

    def padded(self, rows: Sequence[int]) -> torch.Tensor:
        """The batch of these clips, zero-padded to the longest, on the device."""
        width = max(self.lengths[r] for r in rows)
        x = torch.zeros(len(rows), width, device=self.mem.torch_device)
        for k, r in enumerate(rows):
            n = self.lengths[r]
            start = (r * 7919) % SAMPLE_RATE
            x[k, :n].copy_(self.noise[start : start + n])
        return x

    def run(self, rows: Sequence[int]) -> int:
        """Process these clips; on an out-of-memory error, again in halves. Returns the OOMs."""
        try:
            self._forward(self.padded(rows))
            self.mem.sync()
            return 0
        except torch.OutOfMemoryError as exc:
            free_failed(exc)
            self.mem.after_oom()
        if len(rows) == 1:
            raise RuntimeError(f"one clip of {seconds(self.lengths[rows[0]]):.2f} s does not fit")
        half = len(rows) // 2
        return 1 + self.run(rows[:half]) + self.run(rows[half:])

    def fits(self, count: int, samples: int) -> bool:
        """Does a batch of ``count`` clips padded to ``samples`` run? (a real trial run)"""
        t0 = time.perf_counter()
        self.probes += 1
        try:
            x = torch.zeros(count, samples, device=self.mem.torch_device)
            x[:, : min(samples, self.noise.numel())].copy_(self.noise[:samples])
            self._forward(x)
            del x
            self.mem.sync()
            return True
        except torch.OutOfMemoryError as exc:
            free_failed(exc)
            self.mem.after_oom()
            return False
        finally:
            self.probe_s += time.perf_counter() - t0


class Shapes:
    """What trial runs found: a batch shape (count, samples) fits or not; memory is monotone.

    A shape no larger in both count and length than one that ran runs too; one no
    smaller than one that failed fails too: neither is run again.
    """

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.ok: list[tuple[int, int]] = []
        self.bad: list[tuple[int, int]] = []

    def fits(self, count: int, samples: int) -> bool:
        if any(count <= n and samples <= s for n, s in self.ok):
            return True
        if any(count >= n and samples >= s for n, s in self.bad):
            return False
        good = self.runner.fits(count, samples)
        (self.ok if good else self.bad).append((count, samples))
        return good

    def all_fit(self, batches: Sequence[Sequence[int]], lengths: Sequence[int]) -> bool:
        """Do all these batches run? Only those no other batch dominates are tried."""
        shapes = {(len(b), max(lengths[r] for r in b)) for b in batches}
        front = [
            (n, s)
            for n, s in shapes
            if not any((m >= n and t >= s) and (m, t) != (n, s) for m, t in shapes)
        ]
        # The largest first: a failure is found early, and fails fast.
        return all(self.fits(n, s) for n, s in sorted(front, key=lambda x: -x[0] * x[1]))


def largest_ok(ok: Callable[[int], bool], start: int, floor: int, cap: int) -> int:
    """The largest integer in [floor, cap] for which ``ok`` holds (assumed monotone).

    Doubles (or halves) from ``start`` to bracket the edge, then bisects. 0 if
    not even ``floor`` holds.
    """
    start = max(floor, min(start, cap))
    if ok(start):
        lo, hi = start, None
        while hi is None:
            nxt = min(cap, lo * 2)
            if nxt == lo:
                return lo
            if ok(nxt):
                lo = nxt
            else:
                hi = nxt
    else:
        hi, lo = start, None
        while lo is None:
            nxt = max(floor, hi // 2)
            if ok(nxt):
                lo = nxt
            elif nxt == floor:
                return 0
            else:
                hi = nxt
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo


@dataclass
class Method:
    """One way of batching the clips, and how it fared end to end."""

    name: str
    batches: list[list[int]] = field(default_factory=list)
    setting: dict[str, Any] = field(default_factory=dict)
    search_s: float = 0.0
    search_runs: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    ooms: int = 0
    peak: int = 0
    audio_s: float = 0.0
    done: int = 0
    #: The real peak of each batch run, and (vramctl's MemoryBudget) the budget's prediction.
    peaks: list[int] = field(default_factory=list)
    predict: Callable[[int, float], float] | None = None

    def figures(self, lengths: Sequence[int], capacity: int) -> dict[str, Any]:
        durations = [[seconds(lengths[r]) for r in b] for b in self.batches]
        fig = BatchFigures.of(durations, 1.0).to_dict()
        for key in ("budget_overruns", "worst_overrun_ratio"):
            fig.pop(key)  # the budget here is memory: see ooms and peak
        extra: dict[str, Any] = {}
        if self.predict is not None and self.peaks:
            # How the budget's predicted peak compares with the peak each batch reached.
            ratios = [
                peak / self.predict(len(b), max(seconds(lengths[r]) for r in b))
                for b, peak in zip(self.batches, self.peaks, strict=True)
            ]
            extra["real_over_predicted_peak"] = {
                "min": round(min(ratios), 4),
                "mean": round(sum(ratios) / len(ratios), 4),
                "max": round(max(ratios), 4),
            }
        return {
            "setting": self.setting,
            **fig,
            "clips": self.done,
            "ooms": self.ooms,
            "peak_mib": round(self.peak / MiB, 1),
            "peak_of_capacity": round(self.peak / capacity, 4),
            "wall_s": round(self.wall_s, 3),
            "cpu_s": round(self.cpu_s, 3),
            "audio_s_per_s": round(self.audio_s / self.wall_s, 2) if self.wall_s else None,
            "clips_per_s": round(self.done / self.wall_s, 3) if self.wall_s else None,
            "audio_s_per_cpu_s": round(self.audio_s / self.cpu_s, 2) if self.cpu_s else None,
            "search_runs": self.search_runs,
            "search_s": round(self.search_s, 2),
            **extra,
        }


def plan_fixed(runner: Runner, shapes: Shapes, n_clips: int) -> Method:
    """The largest fixed batch size whose worst case (that many longest clips) runs."""
    m = Method("fixed")
    t0, p0 = time.perf_counter(), runner.probes
    longest = max(runner.lengths)
    size = largest_ok(lambda n: shapes.fits(n, longest), 8, 1, n_clips)
    if size == 0:
        raise SystemExit("not even one longest clip fits the capacity: raise --capacity")
    m.search_s, m.search_runs = time.perf_counter() - t0, runner.probes - p0
    m.batches = [list(range(k, min(k + size, n_clips))) for k in range(0, n_clips, size)]
    m.setting = {"batch_size": size}
    return m


def fixed_sweep(largest: Method, n_clips: int, sizes: int) -> list[Method]:
    """The largest safe fixed batch and its halves (``sizes`` of them at most): each is
    safe, as its worst case is a part of the largest one's."""
    out, size = [largest], largest.setting["batch_size"] // 2
    while size >= 1 and len(out) < sizes:
        m = Method(f"fixed {size}", setting={"batch_size": size, "largest_safe": False})
        m.batches = [list(range(k, min(k + size, n_clips))) for k in range(0, n_clips, size)]
        out.append(m)
        size //= 2
    largest.name = f"fixed {largest.setting['batch_size']}"
    largest.setting["largest_safe"] = True
    return out


def plan_lhotse(runner: Runner, shapes: Shapes, clips: Sequence[Clip], start: float) -> Method:
    """The largest max_duration (whole seconds) whose batches on these clips all run."""
    m = Method("lhotse")
    index = {cid: i for i, (cid, _) in enumerate(clips)}
    with quiet():
        cuts = make_cuts(clips)

    def batches(md: float) -> list[list[int]]:
        with quiet():
            return [[index[c.id] for c in b] for b in lhotse_sampler(cuts, md, E2E_BUCKETS)]

    t0, p0 = time.perf_counter(), runner.probes
    floor = int(seconds(max(runner.lengths))) + 1
    total = int(sum(seconds(n) for _, n in clips)) + 1
    md = largest_ok(lambda d: shapes.all_fit(batches(d), runner.lengths), int(start), floor, total)
    if md == 0:
        raise SystemExit("Lhotse: no max_duration runs on this capacity: raise --capacity")
    m.search_s, m.search_runs = time.perf_counter() - t0, runner.probes - p0
    m.batches = batches(md)
    m.setting = {"max_duration": md, "num_buckets": E2E_BUCKETS}
    return m


def plan_vramctl(
    runner: Runner, shapes: Shapes, clips: Sequence[Clip], budget_kind: str, start: float
) -> Method:
    """BucketingSampler under MemoryBudget.for_model (or the largest PaddedDuration that runs)."""
    m = Method("vramctl")
    items = [Item(cid, seconds(n), index=i) for i, (cid, n) in enumerate(clips)]
    longest = max(i.duration for i in items)
    mem = runner.mem

    def sample(budget: Any) -> list[list[int]]:
        s = BucketingSampler(items, budget, num_buckets=E2E_BUCKETS, shuffle=True, seed=SEED)
        return [[i.index for i in b.items] for b in s]

    def make_batch(count: int, secs: float) -> torch.Tensor:
        return torch.zeros(count, round(secs * SAMPLE_RATE), device=mem.torch_device)

    t0, p0 = time.perf_counter(), runner.probes
    error = None
    if budget_kind == "memory":
        try:
            # The estimator makes a few real tensors of its own (the batch make_batch
            # returns, kernels' workspace probes): inside an active simulation they would
            # count against the simulated GPU, so it runs on the host side of it.
            with mem.host():
                budget: Any = MemoryBudget.for_model(
                    runner.model,
                    make_batch,
                    max_duration=longest,
                    device=mem.device,
                    target=TARGET,
                    budget_bytes=int(TARGET * mem.capacity) if mem.kind == "cuda" else None,
                )
            m.batches = sample(budget)
            m.predict = budget.peak
            edges = [longest * k / 8 for k in (1, 2, 4, 6, 8)]
            m.setting = {
                "budget": "MemoryBudget.for_model",
                "budget_mib": round(budget.budget_bytes / MiB, 1),
                "max_count": {f"{s:.2f}s": n for s, n in budget.table(edges)},
                "notes": list(budget.notes),
            }
        except Exception as exc:  # reported, and the fallback is used
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            budget_kind = "padded"
    if budget_kind == "padded":
        floor = int(longest) + 1
        total = int(sum(i.duration for i in items)) + 1
        md = largest_ok(
            lambda d: shapes.all_fit(sample(PaddedDuration(d)), runner.lengths),
            int(start),
            floor,
            total,
        )
        if md == 0:
            raise SystemExit("vramctl: no PaddedDuration runs on this capacity: raise --capacity")
        m.batches = sample(PaddedDuration(md))
        m.setting = {"budget": "PaddedDuration (largest that runs)", "max_duration": md}
    if error is not None:
        m.setting["for_model_error"] = error
    m.setting["num_buckets"] = E2E_BUCKETS
    m.search_s, m.search_runs = time.perf_counter() - t0, runner.probes - p0
    return m


def interleaved(runner: Runner, methods: Sequence[Method]) -> None:
    """Run every method's batches, the one with the least audio processed going next."""
    mem = runner.mem
    pos = dict.fromkeys((m.name for m in methods), 0)
    while True:
        left = [m for m in methods if pos[m.name] < len(m.batches)]
        if not left:
            return
        m = min(left, key=lambda m: m.audio_s)
        rows = m.batches[pos[m.name]]
        pos[m.name] += 1
        mem.reset_peak()
        c0, w0 = time.process_time(), time.perf_counter()
        m.ooms += runner.run(rows)
        w1, c1 = time.perf_counter(), time.process_time()
        m.wall_s += w1 - w0
        m.cpu_s += c1 - c0
        m.peaks.append(mem.peak())
        m.peak = max(m.peak, m.peaks[-1])
        m.audio_s += sum(seconds(runner.lengths[r]) for r in rows)
        m.done += len(rows)


def end_to_end(
    clips: Sequence[Clip],
    spec: ModelSpec,
    capacity: int,
    cuda: bool,
    budget_kind: str,
    fixed_sizes: int,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Each method's figures (``fixed``: the fastest fixed batch size), and every fixed
    batch size's."""
    lengths = [n for _, n in clips]
    mem: SimMemory = CudaMemory(capacity) if cuda else SimMemory(capacity)
    model = spec.build()
    if not cuda:  # the model's weights count against the simulated GPU, as on a real one
        model = mem.place(model)
    with mem:
        if cuda:
            model = mem.place(model)
        runner = Runner(model, mem, lengths)
        runner._forward(runner.padded([0]))  # warm-up (kernels, allocator), not timed
        # Each search has its own record of trial runs, so that its cost is its own.
        fixed = plan_fixed(runner, Shapes(runner), len(clips))
        # The duration searches start from the fixed batch's padded seconds.
        start = fixed.setting["batch_size"] * seconds(max(lengths))
        lhotse = plan_lhotse(runner, Shapes(runner), clips, start)
        ours = plan_vramctl(runner, Shapes(runner), clips, budget_kind, start)
        sweep = fixed_sweep(fixed, len(clips), fixed_sizes)
        methods = [*sweep, lhotse, ours]
        interleaved(runner, methods)
    for m in methods:
        assert sorted(r for b in m.batches for r in b) == list(range(len(clips))), m.name
    fixed_rows = [m.figures(lengths, capacity) for m in sweep]
    best = max(fixed_rows, key=lambda r: r["audio_s_per_s"] or 0.0)
    out = {"fixed": best, "lhotse": lhotse.figures(lengths, capacity)}
    out["vramctl"] = ours.figures(lengths, capacity)
    return out, fixed_rows


# -- part 3: streaming a large manifest ------------------------------------------------

#: The streaming process. Its peak RSS is read from /proc/self/status (VmHWM) where there is
#: one: on Linux, ru_maxrss survives exec, so a child started from this large process would
#: report this process's RSS as its own.
STREAM_CHILD = """
import json, resource, sys, time
def rss_mb():
    try:
        with open("/proc/self/status") as f:
            return next(int(x.split()[1]) for x in f if x.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return r / 2**20 if sys.platform == "darwin" else r / 1024
t0 = time.perf_counter()
from vramctl.batching import BucketingSampler, Manifest, PaddedDuration
import_s, base = time.perf_counter() - t0, rss_mb()
t1 = time.perf_counter()
s = BucketingSampler(Manifest(sys.argv[1]), PaddedDuration(float(sys.argv[2])),
                     num_buckets=int(sys.argv[3]))
items = batches = 0
for b in s:
    items += len(b)
    batches += 1
wall = time.perf_counter() - t1
print(json.dumps({"items": items, "batches": batches, "wall_s": wall, "import_s": import_s,
                  "rss_baseline_mb": base, "rss_mb": rss_mb(),
                  "padding_pct": 100 * s.stats.padding, "overruns": s.stats.overruns}))
"""


def write_manifest(path: Path, n: int, lengths: Sequence[int]) -> float:
    """``n`` JSON Lines records with durations drawn from ``lengths``; returns the seconds taken."""
    t0 = time.perf_counter()
    rng = random.Random(SEED)
    durations = [repr(seconds(k)) for k in lengths]
    chunk = 200_000
    with path.open("w", encoding="utf-8") as f:
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            picks = rng.choices(durations, k=hi - lo)
            f.write(
                "".join(
                    f'{{"id":"s{i:08d}","path":"audio/s{i:08d}.flac","duration":{d}}}\n'
                    for i, d in zip(range(lo, hi), picks, strict=True)
                )
            )
    return time.perf_counter() - t0


def streaming_part(n: int, lengths: Sequence[int], buckets: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="vramctl-stream-") as tmp:
        path = Path(tmp) / "manifest.jsonl"
        write_s = write_manifest(path, n, lengths)
        size = path.stat().st_size
        done = subprocess.run(
            [sys.executable, "-c", STREAM_CHILD, str(path), str(BUDGET_S), str(buckets)],
            capture_output=True,
            text=True,
            check=False,
        )
    if done.returncode != 0:
        raise SystemExit(f"the streaming process failed:\n{done.stderr[-2000:]}")
    r = _common.last_json(done.stdout)
    return {
        "stream_items": n,
        "stream_items_seen": r["items"],
        "stream_batches": r["batches"],
        "stream_rss_mb": round(r["rss_mb"], 1),
        "stream_rss_baseline_mb": round(r["rss_baseline_mb"], 1),
        "stream_rss_growth_mb": round(r["rss_mb"] - r["rss_baseline_mb"], 1),
        "stream_us_per_item": round(1e6 * r["wall_s"] / max(1, r["items"]), 3),
        "stream_wall_s": round(r["wall_s"], 2),
        "stream_import_s": round(r["import_s"], 2),
        "stream_padding_pct": round(r["padding_pct"], 3),
        "stream_overruns": r["overruns"],
        "stream_manifest_mb": round(size / MiB, 1),
        "stream_write_s": round(write_s, 2),
    }


# -- main ------------------------------------------------------------------------------


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def main(argv: list[str] | None = None) -> int:
    ap = _common.parser(
        __doc__,
        quick=f"{QUICK_CLIPS} clips on a smaller wav2vec2, a {QUICK_STREAM:,}-line manifest, "
        f"{QUICK_FIXED_SIZES} fixed batch sizes; under a minute",
        cuda="end to end on this machine's GPU",
        threads=True,
    )
    ap.add_argument(
        "--lengths", type=Path, default=DEFAULT_LENGTHS, help="the LibriSpeech lengths CSV"
    )
    ap.add_argument(
        "--clips", type=int, help=f"clips end to end (default {FULL_CLIPS}; quick {QUICK_CLIPS})"
    )
    ap.add_argument("--capacity", help="the device's capacity end to end, e.g. 256MiB")
    ap.add_argument(
        "--stream-items", type=int, help=f"manifest lines (default {FULL_STREAM:,}; quick 1M)"
    )
    ap.add_argument(
        "--buckets",
        type=int,
        default=BUCKETS,
        help=f"the samplers' buckets alone and streaming (default {BUCKETS})",
    )
    ap.add_argument(
        "--budget",
        choices=("memory", "padded"),
        default="memory",
        help="vramctl's end-to-end budget: MemoryBudget.for_model, or the largest "
        "PaddedDuration that runs (searched as Lhotse's max_duration is)",
    )
    ap.add_argument(
        "--model",
        choices=sorted(MODELS),
        help="the end-to-end model: quick (2x128), small (4x256) or base (wav2vec2-base). "
        "Default: base with --cuda, else quick with --quick and small without",
    )
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: sampler,e2e,stream")
    args = _common.parse(ap, argv)
    logging.getLogger("vramctl").setLevel(logging.ERROR)
    with contextlib.suppress(ImportError):
        import transformers

        transformers.logging.set_verbosity_error()
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if args.model is not None:
        spec = MODELS[args.model]
    else:
        spec = BASE_MODEL if args.cuda else QUICK_MODEL if args.quick else FULL_MODEL
    full_clips = CUDA_CLIPS if args.cuda else FULL_CLIPS
    n_clips = args.clips or (QUICK_CLIPS if args.quick else full_clips)
    capacity = vramctl.parse_size(args.capacity) if args.capacity else spec.capacity_mib * MiB
    n_stream = args.stream_items or (QUICK_STREAM if args.quick else FULL_STREAM)
    started = time.perf_counter()
    clips = load_lengths(args.lengths)
    lengths = [n for _, n in clips]
    total_h = sum(seconds(n) for n in lengths) / 3600
    print(
        f"# {len(clips):,} clips, {total_h:.1f} h, {seconds(min(lengths)):.2f}-"
        f"{seconds(max(lengths)):.2f} s, shuffled (seed {SEED}); torch "
        f"{torch.__version__}, {torch.get_num_threads()} thread(s)",
        flush=True,
    )

    part1: dict[str, dict[str, Any]] = {}
    if "sampler" not in skip:
        part1 = sampler_part(clips, repeats=2 if args.quick else 3, buckets=args.buckets)
        print(
            f"\n## samplers alone: {BUDGET_S:g} s of padded audio per batch, {args.buckets} buckets"
        )
        print(
            f"{'method':<9}{'batches':>8}{'mean':>8}{'padding %':>10}{'overruns':>9}"
            f"{'worst':>8}{'items/s':>11}"
        )
        for name, r in part1.items():
            print(
                f"{name:<9}{r['batches']:>8}{r['mean_batch']:>8.1f}{r['padding_pct']:>10.2f}"
                f"{r['budget_overruns']:>9}{r['worst_overrun_ratio']:>8.3f}{r['items_per_s']:>11,}",
                flush=True,
            )

    part2: dict[str, dict[str, Any]] = {}
    sweep: list[dict[str, Any]] = []
    subset = clips[:n_clips]
    if "e2e" not in skip:
        fixed_sizes = QUICK_FIXED_SIZES if args.quick else FULL_FIXED_SIZES
        part2, sweep = end_to_end(subset, spec, capacity, args.cuda, args.budget, fixed_sizes)
        where = "GPU (ballast)" if args.cuda else "simulated GPU"
        print(
            f"\n## end to end: {len(subset)} clips, "
            f"{sum(seconds(n) for _, n in subset):.0f} s of audio; {spec.describe()}; "
            f"{where} of {vramctl.format_bytes(capacity)}; the fixed baseline (*) is the "
            "fastest fixed batch size"
        )
        print(
            f"{'method':<9}{'setting':>22}{'batches':>8}{'mean':>7}{'pad %':>7}{'OOMs':>5}"
            f"{'peak MiB':>9}{'wall s':>8}{'audio s/s':>10}{'clips/s':>8}{'search':>12}"
        )
        rows = [("fixed*" if r is part2["fixed"] else "fixed", r) for r in sweep]
        for name, r in [*rows, ("lhotse", part2["lhotse"]), ("vramctl", part2["vramctl"])]:
            s = r["setting"]
            setting = (
                f"batch {s['batch_size']}{' (largest)' if s['largest_safe'] else ''}"
                if "batch_size" in s
                else f"max_duration {s['max_duration']}"
                if "max_duration" in s
                else f"{s['budget_mib']} MiB predicted"
            )
            print(
                f"{name:<9}{setting:>22}{r['batches']:>8}{r['mean_batch']:>7.1f}"
                f"{r['padding_pct']:>7.2f}{r['ooms']:>5}{r['peak_mib']:>9.1f}{r['wall_s']:>8.2f}"
                f"{r['audio_s_per_s']:>10.2f}{r['clips_per_s']:>8.2f}"
                f"{r['search_runs']:>4} runs {r['search_s']:>4.1f}s",
                flush=True,
            )
            if "for_model_error" in s:
                print(f"#   MemoryBudget.for_model failed: {s['for_model_error']}")

    part3: dict[str, Any] = {}
    if "stream" not in skip:
        part3 = streaming_part(n_stream, lengths, args.buckets)
        print(
            f"\n## streaming {part3['stream_items']:,} manifest lines "
            f"({part3['stream_manifest_mb']} MiB, written in {part3['stream_write_s']} s): "
            f"{part3['stream_us_per_item']} us/item, peak RSS {part3['stream_rss_mb']} MB "
            f"({part3['stream_rss_baseline_mb']} MB after importing vramctl), "
            f"{part3['stream_batches']:,} batches, padding {part3['stream_padding_pct']}%, "
            f"{part3['stream_overruns']} overruns",
            flush=True,
        )

    ours1 = part1.get("vramctl", {})
    ours2 = part2.get("vramctl", {})
    largest = next((r for r in sweep if r["setting"]["largest_safe"]), {})

    def speedup(peer: dict[str, Any] | None, key: str) -> float | None:
        return _ratio(ours2.get(key), (peer or {}).get(key))

    summary: dict[str, Any] = {
        "benchmark": "audio_batching",
        "quick": args.quick,
        "padding_pct": ours1.get("padding_pct"),
        "budget_overruns": ours1.get("budget_overruns"),
        "worst_overrun_ratio": ours1.get("worst_overrun_ratio"),
        "batches": ours1.get("batches"),
        "sampler_items_per_s": ours1.get("items_per_s"),
        "speedup_vs_fixed": speedup(part2.get("fixed"), "audio_s_per_s"),
        "speedup_vs_fixed_largest": speedup(largest, "audio_s_per_s"),
        "speedup_vs_lhotse": speedup(part2.get("lhotse"), "audio_s_per_s"),
        "speedup_vs_fixed_cpu": speedup(part2.get("fixed"), "audio_s_per_cpu_s"),
        "speedup_vs_fixed_largest_cpu": speedup(largest, "audio_s_per_cpu_s"),
        "speedup_vs_lhotse_cpu": speedup(part2.get("lhotse"), "audio_s_per_cpu_s"),
        "fixed_best_batch": part2["fixed"]["setting"]["batch_size"] if part2 else None,
        "fixed_largest_batch": largest["setting"]["batch_size"] if largest else None,
        "e2e_ooms": ours2.get("ooms"),
        "audio_s_per_s": ours2.get("audio_s_per_s"),
        "clips_per_s": ours2.get("clips_per_s"),
        **part3,
        "vramctl": {"sampler": part1.get("vramctl"), "e2e": ours2 or None},
        "fixed": {"sampler": part1.get("fixed"), "e2e": part2.get("fixed"), "sweep": sweep},
        "lhotse": {"sampler": part1.get("lhotse"), "e2e": part2.get("lhotse")},
        "e2e": {
            "clips": len(subset),
            "audio_s": round(sum(seconds(n) for _, n in subset), 1),
            "longest_s": seconds(max(n for _, n in subset)),
            "model": spec.describe(),
            "device": "cuda (ballast)" if args.cuda else "simulated GPU",
            "capacity_mib": round(capacity / MiB, 1),
            "num_buckets": E2E_BUCKETS,
        },
        "sampler_budget_s": BUDGET_S,
        "sampler_buckets": args.buckets,
        "clips": len(clips),
        "wall_s": round(time.perf_counter() - started, 1),
        **_common.machine(args.cuda),
        "lhotse_version": _common.version("lhotse"),
    }
    failed = bool(ours2.get("ooms")) or bool(ours1.get("budget_overruns"))
    failed |= part3.get("stream_items_seen", n_stream) != n_stream
    return _common.finish(summary, not failed)


if __name__ == "__main__":
    sys.exit(main())
