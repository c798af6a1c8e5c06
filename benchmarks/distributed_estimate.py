"""How close is one rank's estimated peak to the peak a real distributed step reaches?

For zoo models (two transformers, a CNN, an audio model) x {DDP, FSDP2 resharding after
forward, FSDP2 keeping the gathered parameters} x world sizes {2, 4}: ``vramctl.estimate(...,
parallel=...)`` for a CPU target, against the peak of every rank of a real run: one process
per rank joined by gloo on this machine, each measured as ``estimate_accuracy`` measures one
process (the bytes it holds between steps plus the peak of PyTorch's profiler memory timeline
during a steady-state step; ``_dist_truth.py`` says how). The error of a row is its estimate
against the largest rank's measured peak.

Beside each model, for ZeRO stages 2 and 3 over the same ranks: vramctl's estimate of the
rank's peak (model states by DeepSpeed's definitions plus the traced activations), its model
states alone, and DeepSpeed's own ``estimate_zero2/zero3_model_states_mem_needs`` figure
(model states only, for half precision with Adam) where DeepSpeed installs. ZeRO needs
DeepSpeed's engine to run, so those rows are compared, not measured.

The last line is one JSON object: ``median_error_pct``, ``max_error_pct``,
``worst_underestimate_pct`` (positive: the estimate was under the measured peak) over the
measured rows, and ``rows``.

    python benchmarks/distributed_estimate.py --quick     # two models, under a minute
    python benchmarks/distributed_estimate.py             # the whole matrix
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from vramctl import format_bytes
from vramctl.estimator import Parallel, estimate, zoo

import _common
import _dist_truth

#: (model, its lengths, batch per rank): small lengths so that four real ranks are quick here.
MODELS: list[tuple[str, dict[str, Any], int]] = [
    ("t5-small", {"seq_len": 64}, 2),
    ("gpt2", {"seq_len": 64}, 2),
    ("resnet-50", {}, 2),
    ("wav2vec2-base", {"seconds": 1.0}, 2),
]
QUICK_MODELS = ["t5-small"]
LAYOUTS = ["ddp", "fsdp", "fsdp,no_reshard_after_forward"]
QUICK_LAYOUTS = ["ddp", "fsdp"]
WORLDS = (2, 4)
QUICK_WORLDS = (2,)


@dataclass
class Row:
    model: str
    layout: str
    world: int
    predicted: int | None = None
    measured: list[int] = field(default_factory=list)
    estimate_s: float | None = None
    measure_s: float | None = None
    error: str | None = None

    @property
    def error_pct(self) -> float | None:
        if self.predicted is None or not self.measured:
            return None
        top = max(self.measured)
        return 100.0 * (self.predicted - top) / top


def deepspeed_states(stage: int, params: int, largest: int, world: int) -> int | None:
    """DeepSpeed's model-states estimate per GPU (no offload), or None without DeepSpeed."""
    try:
        with warnings.catch_warnings(), _quiet_deepspeed():
            warnings.simplefilter("ignore")
            if stage == 2:
                from deepspeed.runtime.zero.stage_1_and_2 import (
                    estimate_zero2_model_states_mem_needs,
                )

                _cpu, gpu = estimate_zero2_model_states_mem_needs(
                    params, num_gpus_per_node=world, cpu_offload=False
                )
            else:
                from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

                _cpu, gpu, _largest = estimate_zero3_model_states_mem_needs(
                    params, largest, num_gpus_per_node=world, cpu_offload=False
                )
    except Exception:
        return None
    return int(gpu)


@contextlib.contextmanager
def _quiet_deepspeed() -> Iterator[None]:
    log = logging.getLogger("DeepSpeed")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def largest_block(name: str) -> int:
    from vramctl.optimize import find_blocks

    with torch.device("meta"):
        model = zoo.build(name)
    return max((sum(p.numel() for p in b.parameters()) for b in find_blocks(model)), default=0)


def zero_rows(name: str, lk: dict[str, Any], batch: int, world: int) -> list[dict[str, Any]]:
    """ZeRO 2 and 3 in bf16: vramctl's rank peak and model states, DeepSpeed's states."""
    out = []
    for stage in (2, 3):
        est = estimate(
            name, batch_size=batch, precision="bf16", device="cpu",
            parallel=Parallel(f"zero{stage}", world), **lk,
        )  # fmt: skip
        states = sum(est.breakdown[k] for k in ("parameters", "gradients", "optimizer"))
        largest = largest_block(name)
        ds = deepspeed_states(stage, est.parameters, largest, world)
        out.append(
            {
                "model": name,
                "stage": stage,
                "world": world,
                "peak": est.logical_peak,
                "model_states": states,
                "deepspeed_model_states": ds,
            }
        )
    return out


def main() -> int:
    ap = _common.parser(__doc__, quick="t5-small, DDP and FSDP2 over 2 ranks (under a minute)")
    ap.add_argument("--models", help="comma-separated model names (default: the four)")
    ap.add_argument("--worlds", help="comma-separated world sizes (default 2,4)")
    args = _common.parse(ap)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings.filterwarnings("ignore")
    chosen = MODELS
    if args.models:
        wanted = set(args.models.split(","))
        chosen = [m for m in MODELS if m[0] in wanted]
    elif args.quick:
        chosen = [m for m in MODELS if m[0] in QUICK_MODELS]
    worlds = QUICK_WORLDS if args.quick else WORLDS
    if args.worlds:
        worlds = tuple(int(w) for w in args.worlds.split(","))
    layouts = QUICK_LAYOUTS if args.quick else LAYOUTS

    started = time.perf_counter()
    rows: list[Row] = []
    zero: list[dict[str, Any]] = []
    print(
        f"{'model':<15}{'layout':<32}{'ranks':>6}{'estimated':>13}{'measured (max rank)':>21}"
        f"{'error':>9}{'real s':>8}"
    )
    for name, lk, batch in chosen:
        for world in worlds:
            for text in layouts:
                strategy, _, opts = text.partition(",")
                par = Parallel.parse(f"{strategy}:{world}{',' + opts if opts else ''}")
                row = Row(name, text, world)
                rows.append(row)
                try:
                    t0 = time.perf_counter()
                    est = estimate(name, batch_size=batch, device="cpu", parallel=par, **lk)
                    row.estimate_s = time.perf_counter() - t0
                    row.predicted = est.logical_peak
                    t0 = time.perf_counter()
                    row.measured = _dist_truth.measure(name, par, batch_size=batch, lengths=lk)
                    row.measure_s = time.perf_counter() - t0
                except Exception as exc:
                    row.error = f"{type(exc).__name__}: {exc}"[-400:]
                err = row.error_pct
                print(
                    f"{name:<15}{text:<32}{world:>6}"
                    f"{format_bytes(row.predicted) if row.predicted else '-':>13}"
                    f"{format_bytes(max(row.measured)) if row.measured else 'FAILED':>21}"
                    f"{'' if err is None else f'{err:+.2f}%':>9}"
                    f"{row.measure_s or 0:>8.1f}",
                    flush=True,
                )
            if not args.quick:
                zero += zero_rows(name, lk, batch, world)
    if zero:
        print(
            f"\n{'model':<15}{'ZeRO':>5}{'ranks':>6}{'rank peak':>13}{'model states':>14}"
            f"{'DeepSpeed states':>18}"
        )
        for z in zero:
            ds = z["deepspeed_model_states"]
            print(
                f"{z['model']:<15}{z['stage']:>5}{z['world']:>6}{format_bytes(z['peak']):>13}"
                f"{format_bytes(z['model_states']):>14}"
                f"{format_bytes(ds) if ds else 'not installed':>18}"
            )
    figures = _common.error_stats(
        [(r.predicted, max(r.measured) if r.measured else None) for r in rows]
    )
    for r in rows:
        if r.error:
            print(f"# {r.model} {r.layout} x{r.world}: {r.error}", file=sys.stderr)
    summary = {
        "benchmark": "distributed_estimate",
        "quick": args.quick,
        "device": platform.processor() or "cpu",
        "rows": figures["rows"],
        "failed_rows": sum(1 for r in rows if r.error),
        "median_error_pct": figures["median_pct"],
        "max_error_pct": figures["max_pct"],
        "worst_underestimate_pct": figures["worst_under_pct"],
        "by_row": {
            f"{r.model} {r.layout} x{r.world}": None
            if r.error_pct is None
            else round(r.error_pct, 3)
            for r in rows
        },
        "zero": zero,
        "seconds_per_estimate": (
            round(statistics.mean(r.estimate_s for r in rows if r.estimate_s), 3)
            if any(r.estimate_s for r in rows)
            else None
        ),
        "wall_s": round(time.perf_counter() - started, 1),
        "torch": torch.__version__,
    }
    return _common.finish(summary, summary["failed_rows"] == 0)


if __name__ == "__main__":
    sys.exit(main())
