"""What monitoring costs a training loop: the slowdown at 1 Hz and 10 Hz, and one sample's cost.

A real training loop (a 4-layer MLP, 1024 wide, AdamW, batch 256; about
25 ms a step on a 2-core CPU) runs in blocks of equal wall time. Each round
runs three blocks in a rotating order: no monitor, a ``vramctl.monitor.Monitor``
sampling every device at 1 Hz, and one at 10 Hz (every device: the GPUs and
the CPU, with the default rules and the 5 largest processes per device). A
block's figure is its mean step time; a round's slowdown is the monitored
block's mean over the unmonitored one's, and the result is the median over
rounds (so a background hiccup in one round does not decide it).

One sample's cost is timed apart: the median of many ``Monitor.sample()``
calls. ``sampler_duty_pct_1hz`` is that cost as a share of a second, the
part of one core the sampler takes at 1 Hz: the floor under any slowdown.

The last line is one JSON object; ``overhead_pct_1hz`` is the headline (goal:
at most 0.5).

    python benchmarks/monitor_overhead.py --quick    # under a minute on a 2-core CPU
    python benchmarks/monitor_overhead.py            # longer blocks, more rounds
    python benchmarks/monitor_overhead.py --cuda     # the loop on the GPU, NVML sampled
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn

import vramctl
from vramctl.monitor import Monitor


def make_loop(device: torch.device, width: int, batch: int) -> Any:
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


def run_block(step: Any, seconds: float, hz: float | None) -> tuple[float, int]:
    """Mean step time over a block of ``seconds``, with a monitor at ``hz`` (None: none)."""
    mon = Monitor(interval=1.0 / hz) if hz else None
    if mon is not None:
        mon.start()
    try:
        n = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            step()
            n += 1
        elapsed = time.perf_counter() - t0
    finally:
        samples = 0
        if mon is not None:
            mon.stop()
            samples = mon.samples_taken
    return elapsed / n, samples


def sample_cost(repeats: int) -> dict[str, float]:
    mon = Monitor()
    mon.sample()  # the first sample lists the CPU's processes; later ones reuse the list
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mon.sample()
        times.append(time.perf_counter() - t0)
    return {
        "sample_us_median": statistics.median(times) * 1e6,
        "sample_us_mean": statistics.fmean(times) * 1e6,
        "sample_us_p95": sorted(times)[int(0.95 * len(times))] * 1e6,
        "devices": [d.id for d in mon.devices],  # type: ignore[dict-item]
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="short blocks, fewer rounds (< 60 s)")
    ap.add_argument("--cuda", action="store_true", help="run the loop on the GPU")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--block", type=float, default=None, help="seconds per block")
    args = ap.parse_args()
    rounds = args.rounds or (4 if args.quick else 12)
    block = args.block or (3.5 if args.quick else 10.0)
    if args.cuda and not torch.cuda.is_available():
        sys.exit("--cuda: no usable CUDA device here")
    device = torch.device("cuda" if args.cuda else "cpu")
    width, batch = (4096, 1024) if args.cuda else (1024, 256)
    step = make_loop(device, width, batch)
    for _ in range(10):  # warm up: allocator, kernels, AdamW state
        step()

    cost = sample_cost(200 if args.quick else 1000)
    configs: list[tuple[str, float | None]] = [("none", None), ("1hz", 1.0), ("10hz", 10.0)]
    rows: dict[str, list[float]] = {name: [] for name, _ in configs}
    samples: dict[str, int] = {name: 0 for name, _ in configs}
    t_start = time.perf_counter()
    for r in range(rounds):
        order = configs[r % 3 :] + configs[: r % 3]
        for name, hz in order:
            mean, n = run_block(step, block, hz)
            rows[name].append(mean)
            samples[name] += n
        print(
            f"round {r + 1}/{rounds}: "
            + ", ".join(f"{k} {v[-1] * 1e3:.2f} ms" for k, v in rows.items()),
            file=sys.stderr,
        )

    def slowdown(name: str) -> float:
        ratios = [m / b for m, b in zip(rows[name], rows["none"], strict=True)]
        return (statistics.median(ratios) - 1.0) * 100.0

    base_spread = (max(rows["none"]) - min(rows["none"])) / statistics.median(rows["none"]) * 100.0
    result = {
        "benchmark": "monitor_overhead",
        "quick": args.quick,
        "device": str(device),
        "overhead_pct_1hz": round(slowdown("1hz"), 3),
        "overhead_pct_10hz": round(slowdown("10hz"), 3),
        "sampler_duty_pct_1hz": round(cost["sample_us_median"] / 1e6 * 100.0, 4),
        "sampler_duty_pct_10hz": round(cost["sample_us_median"] / 1e6 * 10 * 100.0, 4),
        "sample_us_median": round(cost["sample_us_median"], 1),
        "sample_us_mean": round(cost["sample_us_mean"], 1),
        "sample_us_p95": round(cost["sample_us_p95"], 1),
        "monitored_devices": cost["devices"],
        "step_ms_median": {k: round(statistics.median(v) * 1e3, 3) for k, v in rows.items()},
        "baseline_spread_pct": round(base_spread, 2),
        "samples_taken": {"1hz": samples["1hz"], "10hz": samples["10hz"]},
        "rounds": rounds,
        "block_s": block,
        "wall_s": round(time.perf_counter() - t_start, 1),
        "torch": torch.__version__,
        "vramctl": vramctl.__version__,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads",
        "goal_overhead_pct_1hz": 0.5,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
