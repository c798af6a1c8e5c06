"""What monitoring costs a training loop: the slowdown at 1 Hz and 10 Hz, and one sample's cost.

The loop is a real training step (a 4-layer MLP, 1024 wide, AdamW, batch 64;
about 20 ms on one CPU thread). The monitor is ``vramctl.monitor.Monitor``
over every device (the GPUs and the CPU) with the default rules and the 5
largest processes per device, sampling on its daemon thread.

**Slowdown, attributed (the headline).** The loop runs for a while with the
monitor at 1 Hz (then at 10 Hz); every step's start and end are recorded, and
so is every sample's. A step that overlaps a sample is compared with the
median of the nearby steps that overlap none (up to 10 on each side); what it
took beyond that median is the time the sample cost the loop (the sampler's
own work, and the loop waiting for the interpreter lock while it ran). The
slowdown is that excess, summed, over the steps' time without it. Comparing
each step with its neighbours cancels the drift of a shared machine, which is
several percent from one second to the next here.

**Slowdown, block against block (for comparison).** Blocks of equal wall
time, rotating through no monitor, 1 Hz and 10 Hz; the median over rounds of
a monitored block's mean step time over the unmonitored block's. On a shared
2-core VM this moves by several percent either way between runs
(``ab_noise_pct`` is the spread of the unmonitored blocks), so it can only
bound the slowdown from above by that much.

**One sample.** The median wall time of ``Monitor.sample()`` called in a
loop (the CPU's process list is refreshed every 10 s, so most samples reuse
it), and ``sampler_cpu_pct_1hz``: the CPU time the sampling thread used, as
a share of the wall time, while the loop ran at 1 Hz.

The last line is one JSON object; ``overhead_pct_1hz`` is the headline (goal:
at most 0.5).

    python benchmarks/monitor_overhead.py --quick    # under a minute on a 2-core CPU
    python benchmarks/monitor_overhead.py            # longer runs, more rounds
    python benchmarks/monitor_overhead.py --cuda     # the loop on the GPU, NVML sampled
"""

from __future__ import annotations

import bisect
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import vramctl
from vramctl.monitor import Monitor, Sample

import _common


class TimedMonitor(Monitor):
    """A monitor that notes when each sample started and ended, and the CPU time it took."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.spans: list[tuple[float, float]] = []
        self.cpu_s = 0.0

    def sample(self) -> list[Sample]:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return super().sample()
        finally:
            self.cpu_s += time.thread_time() - c0
            self.spans.append((t0, time.perf_counter()))


def make_loop(device: torch.device, width: int, batch: int) -> Callable[[], None]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(width, width),
        nn.GELU(),
        nn.Linear(width, width),
        nn.GELU(),
        nn.Linear(width, width),
        nn.GELU(),
        nn.Linear(width, 10),
    ).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(batch, width, device=device)
    y = torch.randint(0, 10, (batch,), device=device)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()

    return step


def attributed(step: Callable[[], None], seconds: float, hz: float) -> dict[str, Any]:
    """Run the loop with a monitor at ``hz``; attribute each overlapping step's excess."""
    mon = TimedMonitor(interval=1.0 / hz)
    mon.sample()  # list the processes once, as a long-running monitor would have
    mon.spans.clear()
    mon.cpu_s = 0.0
    steps: list[tuple[float, float]] = []
    mon.start()
    t_end = time.perf_counter() + seconds
    try:
        while True:
            t0 = time.perf_counter()
            if t0 >= t_end:
                break
            step()
            steps.append((t0, time.perf_counter()))
    finally:
        mon.stop()
    wall = steps[-1][1] - steps[0][0]
    starts = [s for s, _ in mon.spans]
    hit = []
    for a, b in steps:
        # Any sample span [s0, s1] with s0 < b and s1 > a overlaps the step.
        i = bisect.bisect_left(starts, b)
        hit.append(any(mon.spans[j][1] > a for j in range(max(0, i - 3), i)))
    durations = [b - a for a, b in steps]
    excess = 0.0
    for i, (d, h) in enumerate(zip(durations, hit, strict=True)):
        if not h:
            continue
        near = [durations[j] for j in range(max(0, i - 10), min(len(steps), i + 11)) if not hit[j]]
        if near:
            excess += d - statistics.median(near)
    return {
        "overhead_pct": excess / (wall - excess) * 100.0,
        "excess_ms_per_sample": excess / max(1, len(mon.spans)) * 1e3,
        "samples": len(mon.spans),
        "steps": len(steps),
        "steps_overlapping": sum(hit),
        "sampler_cpu_pct": mon.cpu_s / wall * 100.0,
        "step_ms_median": statistics.median(durations) * 1e3,
    }


def run_block(step: Callable[[], None], seconds: float, mon: Monitor | None) -> float:
    """Mean step time over a block of ``seconds``, with ``mon`` sampling (None: none)."""
    if mon is not None:
        mon.start()
    try:
        n = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            step()
            n += 1
        return (time.perf_counter() - t0) / n
    finally:
        if mon is not None:
            mon.stop()


def sample_cost(repeats: int) -> dict[str, Any]:
    mon = Monitor()
    mon.sample()  # the first sample lists the CPU's processes; later ones reuse the list
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mon.sample()
        times.append(time.perf_counter() - t0)
    return {
        "sample_us_median": statistics.median(times) * 1e6,
        "sample_us_p95": sorted(times)[int(0.95 * len(times))] * 1e6,
        "devices": [d.id for d in mon.devices],
    }


def main() -> int:
    ap = _common.parser(
        __doc__,
        quick="shorter runs (under a minute)",
        cuda="run the loop on the GPU",
        threads=True,
    )
    ap.add_argument("--seconds", type=float, default=None, help="loop seconds at 1 Hz")
    ap.add_argument("--rounds", type=int, default=None, help="block-against-block rounds")
    args = _common.parse(ap)
    seconds = args.seconds or (20.0 if args.quick else 120.0)
    rounds = args.rounds or (3 if args.quick else 12)
    block = 2.0
    device = torch.device("cuda" if args.cuda else "cpu")
    width, batch = (4096, 1024) if args.cuda else (1024, 64)
    step = make_loop(device, width, batch)
    for _ in range(10):  # warm up: allocator, kernels, AdamW state
        step()

    t_start = time.perf_counter()
    cost = sample_cost(100 if args.quick else 500)
    at_1hz = attributed(step, seconds, 1.0)
    print(f"1 Hz: {json.dumps(at_1hz)}", file=sys.stderr)
    at_10hz = attributed(step, seconds / 2, 10.0)
    print(f"10 Hz: {json.dumps(at_10hz)}", file=sys.stderr)

    monitors: dict[str, Monitor | None] = {
        "none": None,
        "1hz": Monitor(interval=1.0),
        "10hz": Monitor(interval=0.1),
    }
    for m in monitors.values():
        if m is not None:
            m.sample()
    names = list(monitors)
    rows: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % 3 :] + names[: r % 3]:
            rows[name].append(run_block(step, block, monitors[name]))

    def ab(name: str) -> float:
        ratios = [m / b for m, b in zip(rows[name], rows["none"], strict=True)]
        return (statistics.median(ratios) - 1.0) * 100.0

    base = rows["none"]
    result = {
        "benchmark": "monitor_overhead",
        "quick": args.quick,
        "device": str(device),
        "overhead_pct_1hz": round(at_1hz["overhead_pct"], 3),
        "overhead_pct_10hz": round(at_10hz["overhead_pct"], 3),
        "excess_ms_per_sample_1hz": round(at_1hz["excess_ms_per_sample"], 3),
        "sampler_cpu_pct_1hz": round(at_1hz["sampler_cpu_pct"], 4),
        "sampler_cpu_pct_10hz": round(at_10hz["sampler_cpu_pct"], 4),
        "sample_us_median": round(cost["sample_us_median"], 1),
        "sample_us_p95": round(cost["sample_us_p95"], 1),
        "monitored_devices": cost["devices"],
        "step_ms_median": round(at_1hz["step_ms_median"], 3),
        "samples_1hz": at_1hz["samples"],
        "steps_1hz": at_1hz["steps"],
        "steps_overlapping_1hz": at_1hz["steps_overlapping"],
        "ab_slowdown_pct_1hz": round(ab("1hz"), 2),
        "ab_slowdown_pct_10hz": round(ab("10hz"), 2),
        "ab_noise_pct": round((max(base) - min(base)) / statistics.median(base) * 100.0, 2),
        "ab_rounds": rounds,
        "wall_s": round(time.perf_counter() - t_start, 1),
        "torch": torch.__version__,
        "vramctl": vramctl.__version__,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads",
        "goal_overhead_pct_1hz": 0.5,
    }
    return _common.finish(result)


if __name__ == "__main__":
    sys.exit(main())
