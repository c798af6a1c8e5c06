"""How fast the step-aware leak detector finds planted leaks, and how often it cries wolf.

A real training loop (an MLP 64-256-256-10, AdamW, seeded random batches) runs
with ``vramctl.monitor.LeakDetector`` called once per step, after the optimizer
step, with its defaults (min_rate 256 KiB per step, window 40, warmup 5,
confidence 0.999, census on). Each leak run plants one leak and stops at the
first report:

- ``list``: a tensor of the given size appended to a list every step;
- ``graph``: a validation loss computed with autograd on and appended every step
  (its graph keeps two activations of the given total size alive);
- ``accumulated``: the same validation loss summed into a running total
  (``total = total + loss``): nothing in Python holds the activations, the graph does;
- ``periodic``: 4 MiB every fourth step, ``bursty``: 8 MiB every eighth step
  (1 MiB per step on average);
- ``noisy``: 1 MiB per step in a loop whose batch size changes every step (16 to
  1024), and whose raw batch stays alive until the next step (memory swings by up
  to 4 MiB from step to step); ``very_noisy``: the same with batches of 16 to 4096
  (swings of up to 16 MiB, 16 times the leak).

``steps_to_detect`` counts from the first step, warmup included. ``site_named``
says whether the report's first suspect names the line that plants the leak.
``max_steps_to_detect`` is the largest over the leaks of 1 MiB per step or more
(the goal is 50); the 256 KiB leak (the default ``min_rate``) is reported apart.

The false alarms are counted over 10 different healthy loops (an MLP with AdamW,
variable batches, a conv net with BatchNorm, a bounded cache that fills, gradient
accumulation, periodic evaluation, a Transformer layer on variable lengths, a
one-off growth mid-run, a GRU on variable lengths, a scheduler with logging),
300 steps each (120 with ``--quick``): every report there is a false alarm.

The detector's own cost is the time of each ``step()`` call in the healthy
loops, right after the loop's step (its trend tests and any census included),
in CPU time of the calling thread, beside the loop's own time per step; every
fourth step times one reading of the memory instead.

The last line is one JSON object.

    python benchmarks/leak_detection.py --quick     # under a minute on a 2-core CPU
    python benchmarks/leak_detection.py             # 300 steps per healthy loop
    python benchmarks/leak_detection.py --cuda      # the same on this machine's GPU
"""

from __future__ import annotations

import collections
import gc
import math
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vramctl.monitor import LeakDetector, LeakReport

import _common

KiB, MiB = 2**10, 2**20
WIDTH = 256
D_IN = 64
HERE = Path(__file__)


def line_of(marker: str) -> int:
    """The line of this file that ends with the comment ``# marker``."""
    for number, text in enumerate(HERE.read_text().splitlines(), 1):
        if text.rstrip().endswith(f"# {marker}"):
            return number
    raise LookupError(marker)


# -- workloads ------------------------------------------------------------------------------


def mlp(dev: torch.device, seed: int, width: int = WIDTH) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(D_IN, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
    ).to(dev)


def batch(
    dev: torch.device, g: torch.Generator, b: int, d: int = D_IN
) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(b, d, generator=g).to(dev)
    y = torch.randint(0, 10, (b,), generator=g).to(dev)
    return x, y


def sgd_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor):
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss


#: A loop: called with the step index, returns nothing; built fresh for each run.
Body = Callable[[int], None]


def leak_loop(form: str, nbytes: int, dev: torch.device, seed: int) -> Body:
    """The training loop with one planted leak of ``nbytes`` per step."""
    model = mlp(dev, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    kept: list[torch.Tensor] = []
    held: dict[str, torch.Tensor] = {}
    val_b = max(1, nbytes // (2 * WIDTH * 4))  # two saved WIDTH-wide activations per sample
    xv, yv = batch(dev, g, val_b)
    total = [torch.zeros((), device=dev)]

    def body(i: int) -> None:
        b = {"noisy": rng.choice([16, 64, 256, 1024]), "very_noisy": rng.randint(16, 4096)}.get(
            form, 64
        )
        # The batch's raw rows (1024 features, of which the model sees 64) stay alive until
        # the next step: with a changing batch size, memory swings by up to 4 MiB.
        held["raw"] = raw = torch.randn(b, 1024, generator=g).to(dev)
        y = torch.randint(0, 10, (b,), generator=g).to(dev)
        sgd_step(model, opt, raw[:, :D_IN], y)
        if form == "list":
            kept.append(torch.randn(nbytes // 4, device=dev))  # leak:list
        elif form == "noisy":
            kept.append(torch.randn(nbytes // 4, device=dev))  # leak:noisy
        elif form == "very_noisy":
            kept.append(torch.randn(nbytes // 4, device=dev))  # leak:very_noisy
        elif form == "periodic" and i % 4 == 3:
            kept.append(torch.randn(nbytes, device=dev))  # leak:periodic
        elif form == "bursty" and i % 8 == 7:
            kept.append(torch.randn(2 * nbytes, device=dev))  # leak:bursty
        elif form == "graph":
            kept.append(F.cross_entropy(model(xv), yv))  # leak:graph
        elif form == "accumulated":
            total[0] = total[0] + F.cross_entropy(model(xv), yv)  # leak:accumulated

    return body


def healthy_loops(dev: torch.device, seed: int) -> dict[str, Callable[[], Body]]:
    """Ten healthy loops, each built by its factory."""

    def mlp_adamw() -> Body:
        model = mlp(dev, seed)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(seed)
        losses: list[float] = []

        def body(i: int) -> None:
            losses.append(sgd_step(model, opt, *batch(dev, g, 64)).item())

        return body

    def variable_batches() -> Body:
        model = mlp(dev, seed + 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        g = torch.Generator().manual_seed(seed + 1)
        rng = random.Random(seed + 1)
        held: dict[str, Any] = {}

        def body(i: int) -> None:
            held["batch"] = x, y = batch(dev, g, rng.choice([8, 32, 128, 512, 2048]))
            held["loss"] = sgd_step(model, opt, x, y)

        return body

    def convnet_bn() -> Body:
        torch.manual_seed(seed + 2)
        model = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(32, 10),
        ).to(dev)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(seed + 2)

        def body(i: int) -> None:
            x = torch.randn(32, 3, 16, 16, generator=g).to(dev)
            sgd_step(model, opt, x, torch.randint(0, 10, (32,), generator=g).to(dev))

        return body

    def bounded_cache() -> Body:
        model = mlp(dev, seed + 3)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(seed + 3)
        recent: collections.deque[torch.Tensor] = collections.deque(maxlen=12)

        def body(i: int) -> None:
            x, y = batch(dev, g, 64)
            sgd_step(model, opt, x, y)
            recent.append(torch.randn(MiB // 4, device=dev))  # fills 12 MiB in 12 steps, then stays

        return body

    def grad_accumulation() -> Body:
        model = mlp(dev, seed + 4)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(seed + 4)

        def body(i: int) -> None:
            opt.zero_grad(set_to_none=True)
            for _ in range(4):
                x, y = batch(dev, g, 32)
                (F.cross_entropy(model(x), y) / 4).backward()
            opt.step()

        return body

    def periodic_eval() -> Body:
        model = mlp(dev, seed + 5)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(seed + 5)
        xv, yv = batch(dev, g, 4096)
        history: list[float] = []

        def body(i: int) -> None:
            sgd_step(model, opt, *batch(dev, g, 64))
            if i % 20 == 19:
                with torch.no_grad():
                    history.append(F.cross_entropy(model(xv), yv).item())

        return body

    def transformer_varlen() -> Body:
        torch.manual_seed(seed + 6)
        layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True).to(dev)
        head = nn.Linear(64, 10).to(dev)
        params = [*layer.parameters(), *head.parameters()]
        opt = torch.optim.AdamW(params, lr=1e-3)
        g = torch.Generator().manual_seed(seed + 6)
        rng = random.Random(seed + 6)

        def body(i: int) -> None:
            length = rng.randint(8, 64)
            x = torch.randn(16, length, 64, generator=g).to(dev)
            y = torch.randint(0, 10, (16,), generator=g).to(dev)
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(head(layer(x).mean(1)), y).backward()
            opt.step()

        return body

    def one_off_growth() -> Body:
        model = mlp(dev, seed + 7)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(seed + 7)
        extra: list[torch.Tensor] = []

        def body(i: int) -> None:
            sgd_step(model, opt, *batch(dev, g, 64))
            if i == 60:  # an EMA copy of the weights and a 32 MiB buffer, made once, kept
                extra.extend(p.detach().clone() for p in model.parameters())
                extra.append(torch.zeros(8 * MiB, device=dev))

        return body

    def gru_varlen() -> Body:
        torch.manual_seed(seed + 8)
        rnn = nn.GRU(32, 64, batch_first=True).to(dev)
        head = nn.Linear(64, 10).to(dev)
        opt = torch.optim.Adam([*rnn.parameters(), *head.parameters()], lr=1e-3)
        g = torch.Generator().manual_seed(seed + 8)
        rng = random.Random(seed + 8)

        def body(i: int) -> None:
            x = torch.randn(16, rng.randint(4, 48), 32, generator=g).to(dev)
            y = torch.randint(0, 10, (16,), generator=g).to(dev)
            opt.zero_grad(set_to_none=True)
            out, _ = rnn(x)
            F.cross_entropy(head(out[:, -1]), y).backward()
            opt.step()

        return body

    def scheduler_logging() -> Body:
        model = mlp(dev, seed + 9)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=100_000)
        g = torch.Generator().manual_seed(seed + 9)
        log: dict[str, list[float]] = collections.defaultdict(list)

        def body(i: int) -> None:
            x, y = batch(dev, g, 64)
            opt.zero_grad(set_to_none=True)
            out = model(x)
            loss = F.cross_entropy(out, y)
            loss.backward()
            norm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            with torch.no_grad():
                log["acc"].append((out.argmax(1) == y).float().mean().item())
            log["loss"].append(loss.item())
            log["grad_norm"].append(float(norm))

        return body

    return {
        "mlp_adamw": mlp_adamw,
        "variable_batches": variable_batches,
        "convnet_batchnorm": convnet_bn,
        "bounded_cache": bounded_cache,
        "grad_accumulation": grad_accumulation,
        "periodic_eval": periodic_eval,
        "transformer_varlen": transformer_varlen,
        "one_off_growth": one_off_growth,
        "gru_varlen": gru_varlen,
        "scheduler_logging": scheduler_logging,
    }


# -- runs -----------------------------------------------------------------------------------


@dataclass
class LeakRow:
    form: str
    bytes_per_step: int
    steps_to_detect: int | None = None
    rate_estimated: float | None = None
    p_value: float | None = None
    site_named: bool = False
    top_site: str | None = None
    holder: str | None = None
    cause: str | None = None
    censuses: int = 0
    wall_s: float = 0.0


@dataclass
class HealthyRow:
    loop: str
    steps: int
    false_alarms: int = 0
    censuses: int = 0
    step_ms: float = 0.0
    detector_us_median: float = 0.0
    detector_us_mean: float = 0.0
    read_us_median: float = 0.0
    overhead_pct: float = 0.0
    reports: list[str] = field(default_factory=list)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


@dataclass
class Tick:
    """One step: the loop's time, the detector's (None on a probe step), a probe reading's."""

    body_s: float
    body_cpu_s: float
    step_s: float | None
    step_cpu_s: float | None
    read_s: float | None
    report: LeakReport | None


def drive(
    body: Body, detector: LeakDetector, steps: int, dev: torch.device, stop: bool
) -> Iterator[Tick]:
    """Run ``steps`` steps, timing the loop and ``detector.step()`` right after it.

    Times are wall (``perf_counter``) and this thread's CPU time (``thread_time``, which
    other processes on the machine do not inflate). Every fourth step is a probe: a
    reading of the memory is timed instead, right after the loop as ``step()`` would
    take it, and that step's ``step()`` is not timed.
    """
    for i in range(steps):
        c0, t0 = time.thread_time(), time.perf_counter()
        body(i)
        sync(dev)
        t1, c1 = time.perf_counter(), time.thread_time()
        read_s = step_s = step_cpu_s = None
        if i % 4 == 3:
            r0 = time.perf_counter()
            detector.read()
            read_s = time.perf_counter() - r0
            report = detector.step()
        else:
            c2, t2 = time.thread_time(), time.perf_counter()
            report = detector.step()
            t3, c3 = time.perf_counter(), time.thread_time()
            step_s, step_cpu_s = t3 - t2, c3 - c2
        yield Tick(t1 - t0, c1 - c0, step_s, step_cpu_s, read_s, report)
        if report is not None and stop:
            return


def run_leak(
    form: str, nbytes: int, dev: torch.device, steps: int, seed: int, detector_device: str
) -> LeakRow:
    row = LeakRow(form, nbytes)
    body = leak_loop(form, nbytes, dev, seed)
    detector = LeakDetector(detector_device)
    t0 = time.perf_counter()
    for i, tick in enumerate(drive(body, detector, steps, dev, stop=True)):
        report = tick.report
        if report is None:
            continue
        row.steps_to_detect = i + 1
        row.rate_estimated = report.rate_bytes_per_step
        row.p_value = report.p_value
        if report.suspects:
            top = report.suspects[0]
            row.top_site = top.site
            row.holder = top.holder
            row.site_named = top.site.endswith(f"{HERE.name}:{line_of(f'leak:{form}')} in body")
        row.cause = report.causes[0] if report.causes else None
    row.censuses = detector.censuses
    row.wall_s = round(time.perf_counter() - t0, 2)
    detector.close()
    del body
    gc.collect()
    return row


def run_healthy(
    name: str, factory: Callable[[], Body], dev: torch.device, steps: int, detector_device: str
) -> tuple[HealthyRow, list[Tick]]:
    body = factory()
    detector = LeakDetector(detector_device)
    row = HealthyRow(name, steps)
    ticks = list(drive(body, detector, steps, dev, stop=False))
    for tick in ticks:
        if tick.report is not None:
            row.false_alarms += 1
            row.reports.append(tick.report.format().splitlines()[0])
    timed = [t for t in ticks if t.step_s is not None]
    row.censuses = detector.censuses
    row.step_ms = round(1e3 * statistics.median(t.body_s for t in ticks), 3)
    row.detector_us_median = round(1e6 * statistics.median(t.step_cpu_s or 0.0 for t in timed), 2)
    row.detector_us_mean = round(1e6 * statistics.fmean(t.step_cpu_s or 0.0 for t in timed), 2)
    row.read_us_median = round(
        1e6 * statistics.median(t.read_s for t in ticks if t.read_s is not None), 2
    )
    row.overhead_pct = overhead(ticks, wall=dev.type == "cuda")
    detector.close()
    del body
    gc.collect()
    return row, ticks


def overhead(ticks: list[Tick], wall: bool = False) -> float:
    """The detector's mean time per step over the loop's mean time per step, in %.

    CPU time by default on the CPU side; wall time on a GPU (the loop waits for it).
    """
    timed = [t for t in ticks if t.step_s is not None]
    if wall:
        det = statistics.fmean(t.step_s or 0.0 for t in timed)
        loop = statistics.fmean(t.body_s for t in ticks)
    else:
        det = statistics.fmean(t.step_cpu_s or 0.0 for t in timed)
        loop = statistics.fmean(t.body_cpu_s for t in ticks)
    return round(100 * det / loop, 3)


# -- main -----------------------------------------------------------------------------------

MAIN_LEAKS = [
    ("list", 1 * MiB),
    ("list", 2 * MiB),
    ("list", 4 * MiB),
    ("list", 16 * MiB),
    ("graph", 1 * MiB),
    ("graph", 4 * MiB),
    ("accumulated", 1 * MiB),
    ("periodic", 1 * MiB),
    ("bursty", 1 * MiB),
    ("noisy", 1 * MiB),
    ("very_noisy", 1 * MiB),
]
SMALL_LEAKS = [("list", 256 * KiB), ("graph", 256 * KiB)]


def main() -> int:
    ap = _common.parser(
        __doc__,
        quick="120 steps per healthy loop (300 without); < 60 s",
        cuda="run the loops on this machine's GPU",
        seed="model, data and schedule seed",
        threads=True,
    )
    args = _common.parse(ap)
    dev = torch.device("cuda", 0) if args.cuda else torch.device("cpu")
    detector_device = str(dev)
    healthy_steps = 120 if args.quick else 300
    leak_steps = 100
    small_steps = 200
    started = time.perf_counter()

    print(f"# leaks (stop at the first report; {leak_steps} steps at most)", flush=True)
    header = f"{'form':<12}{'per step':>11}{'steps':>7}{'rate':>12}{'site':>6}  holder / cause"
    print(header)
    leaks: list[LeakRow] = []
    for form, nbytes in MAIN_LEAKS + SMALL_LEAKS:
        cap = small_steps if nbytes < MiB else leak_steps
        row = run_leak(form, nbytes, dev, cap, args.seed, detector_device)
        leaks.append(row)
        rate = "-" if row.rate_estimated is None else f"{row.rate_estimated / MiB:.3f} MiB"
        print(
            f"{form:<12}{nbytes / MiB:>7.3f} MiB{row.steps_to_detect or '-':>7}{rate:>12}"
            f"{'yes' if row.site_named else 'NO':>6}  {row.holder} / {(row.cause or '')[:60]}",
            flush=True,
        )

    print(f"# healthy loops ({healthy_steps} steps each; every report is a false alarm)")
    print(
        f"{'loop':<22}{'alarms':>7}{'census':>7}{'step ms':>9}{'det us':>8}{'mean us':>9}"
        f"{'read us':>9}{'cost %':>8}"
    )
    healthy: list[HealthyRow] = []
    ticks: list[Tick] = []
    for name, factory in healthy_loops(dev, args.seed).items():
        hrow, hticks = run_healthy(name, factory, dev, healthy_steps, detector_device)
        healthy.append(hrow)
        ticks += hticks
        print(
            f"{name:<22}{hrow.false_alarms:>7}{hrow.censuses:>7}{hrow.step_ms:>9.3f}"
            f"{hrow.detector_us_median:>8.2f}{hrow.detector_us_mean:>9.2f}"
            f"{hrow.read_us_median:>9.2f}{hrow.overhead_pct:>8.3f}",
            flush=True,
        )
        for text in hrow.reports:
            print(f"    {text}")

    main_rows = [r for r in leaks if r.bytes_per_step >= MiB]
    small_rows = [r for r in leaks if r.bytes_per_step < MiB]
    detected = [r.steps_to_detect for r in main_rows]
    max_steps = None if None in detected else max(d for d in detected if d is not None)
    det_cpu = sorted(t.step_cpu_s or 0.0 for t in ticks if t.step_s is not None)
    det_wall = [t.step_s or 0.0 for t in ticks if t.step_s is not None]
    read_us = 1e6 * statistics.median(t.read_s for t in ticks if t.read_s is not None)
    det_us = 1e6 * statistics.median(det_cpu)
    summary: dict[str, Any] = {
        "benchmark": "leak_detection",
        "side": "cuda" if args.cuda else "cpu",
        "quick": args.quick,
        "max_steps_to_detect": max_steps,
        "false_alarms": sum(h.false_alarms for h in healthy),
        "all_detected": None not in detected,
        "sites_named": sum(r.site_named for r in main_rows),
        "leaks_planted": len(main_rows),
        "small_leak": [asdict(r) for r in small_rows],
        "leaks": [asdict(r) for r in main_rows],
        "healthy": [asdict(h) for h in healthy],
        "healthy_steps": healthy_steps,
        "detector_us_per_step": {
            "clock": "CPU time of the calling thread (wall time in the *_wall figures)",
            "median": round(det_us, 2),
            "mean": round(1e6 * statistics.fmean(det_cpu), 2),
            "p99": round(1e6 * det_cpu[math.ceil(0.99 * len(det_cpu)) - 1], 2),
            "max": round(1e6 * det_cpu[-1], 1),
            "median_wall": round(1e6 * statistics.median(det_wall), 2),
            "mean_wall": round(1e6 * statistics.fmean(det_wall), 2),
            "reading_median_wall": round(read_us, 2),
            "steps": len(det_cpu),
        },
        # The detector's mean time per step over the loops' mean step time (censuses included).
        "overhead_pct": overhead(ticks, wall=args.cuda),
        "overhead_wall_pct": overhead(ticks, wall=True),
        "overhead_pct_by_loop": {h.loop: h.overhead_pct for h in healthy},
        "step_ms_median": round(1e3 * statistics.median(t.body_s for t in ticks), 3),
        "detector": {
            "min_rate": 256 * KiB,
            "window": 40,
            "warmup": 5,
            "confidence": 0.999,
            "signal": LeakDetector(detector_device, census=False).signal,
        },
        "wall_s": round(time.perf_counter() - started, 1),
        **_common.machine(args.cuda),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
    print(
        f"# max steps to detect (>= 1 MiB/step): {max_steps}; false alarms: "
        f"{summary['false_alarms']}; sites named: {summary['sites_named']}/{len(main_rows)}; "
        f"detector {summary['detector_us_per_step']['median']} us median per step "
        f"(reading the memory {summary['detector_us_per_step']['reading_median_wall']} us), "
        f"{summary['overhead_pct']}% of the healthy loops' time "
        f"(median step {summary['step_ms_median']} ms)",
        flush=True,
    )
    ok = max_steps is not None and max_steps <= 50 and summary["false_alarms"] == 0
    return _common.finish(summary, ok)


if __name__ == "__main__":
    sys.exit(main())
