"""How close, and how fast, does each tool find the largest batch that fits?

For several real models (an MLP, a CNN, a small transformer, an LSTM language
model) training with AdamW on a simulated GPU, this finds the true largest
batch size by a real search (doubling, then bisection, then the edge checked:
the answer runs and one more sample runs out of memory), then asks three tools
for it:

- vramctl: ``vramctl.fit.fit_batch_size`` on a simulated GPU of capacity C with
  ``target=0.9`` (its budget is 0.9 C);
- Lightning: ``Tuner.scale_batch_size(mode="binsearch")`` with its defaults
  (``init_val=2``, ``steps_per_trial=3``, ``margin=0.05``);
- Accelerate: ``find_executable_batch_size`` (``starting_batch_size=1024``,
  above every true answer here, where its default of 128 would cap some; 128 in
  ``--quick``, where every answer is below it), each trial two training steps.

Lightning and Accelerate look for the edge where memory runs out, so they run on
a simulated GPU of 0.9 C: all three are asked for the same thing, the largest
batch whose step peaks within 0.9 C. For each tool the benchmark reports the
probes (trial runs) it made, the seconds it took, its answer as a fraction of
the true largest batch, and whether that batch size survives 200 real training
steps (fresh batches each step) on a simulated GPU of 0.9 C.

``--quick`` runs the CNN and the LSTM on smaller simulated GPUs and checks only
vramctl's answers for 200 steps (the others' are reported as not run).

The last line is one JSON object with vramctl's figures
(``min_fraction_of_true_max``, ``max_probes``, ``survived_200_steps``) and a
row per model and tool.

    python benchmarks/fit_search.py --quick     # two models, smaller devices, under a minute
    python benchmarks/fit_search.py             # four models, the larger devices
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import platform
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import vramctl
from vramctl.fit import fit_batch_size

TARGET = 0.9
SURVIVAL_STEPS = 200
#: Accelerate's starting batch size: above every true answer here (its default, 128, in --quick).
ACCELERATE_START = 1024
QUICK_ACCELERATE_START = 128
#: --quick runs these models, and the survival check for vramctl's answers only.
QUICK_MODELS = ("cnn", "lstm")
MiB = 2**20


class Mlp(nn.Module):
    """A token-wise MLP: 16 tokens of width 64 per sample."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(64, 1024), nn.GELU(), nn.Linear(1024, 256), nn.GELU(), nn.Linear(256, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Cnn(nn.Module):
    """Two convolution blocks with batch norm on 32x32 RGB images."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(4),
            nn.Flatten(),
            nn.Linear(512, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class Transformer(nn.Module):
    """Two encoder layers (width 128, 4 heads) over 64 tokens, and a 1000-word head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(1000, 128)
        layer = nn.TransformerEncoderLayer(128, 4, 256, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(128, 1000)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.emb(ids)))


class Lstm(nn.Module):
    """A two-layer LSTM language model (width 128) over 32 tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(1000, 128)
        self.lstm = nn.LSTM(128, 128, 2, batch_first=True)
        self.head = nn.Linear(128, 1000)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(self.emb(ids))[0])


@dataclass(frozen=True)
class Spec:
    name: str
    build: Callable[[], nn.Module]
    #: One sample's shape; token ids (0-999) or normal floats.
    shape: tuple[int, ...]
    tokens: bool
    #: Simulated capacity C for the full run and for --quick.
    capacity: int
    quick_capacity: int

    def batch(self, b: int) -> torch.Tensor:
        if self.tokens:
            return torch.randint(0, 1000, (b, *self.shape))
        return torch.randn(b, *self.shape)

    def sample(self) -> torch.Tensor:
        return self.batch(1)[0]


SPECS = [
    Spec("mlp", Mlp, (16, 64), False, 160 * MiB, 48 * MiB),
    Spec("cnn", Cnn, (3, 32, 32), False, 96 * MiB, 32 * MiB),
    Spec("transformer", Transformer, (64,), True, 320 * MiB, 96 * MiB),
    Spec("lstm", Lstm, (32,), True, 256 * MiB, 64 * MiB),
]


def loss_of(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Cross-entropy against the input tokens for the language models, else the mean square."""
    if x.dtype == torch.long:
        return nn.functional.cross_entropy(out.flatten(0, -2).float(), x.flatten())
    return out.float().square().mean()


def make_step(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[torch.Tensor], None]:
    def step(x: torch.Tensor) -> None:
        loss_of(model(x), x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def fresh(spec: Spec) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = spec.build()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


@dataclass
class Outcome:
    batch_size: int = 0
    probes: int = 0
    seconds: float = 0.0
    fraction: float = 0.0
    survived: bool | None = None
    error: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch_size,
            "probes": self.probes,
            "seconds": round(self.seconds, 2),
            "fraction_of_true_max": round(self.fraction, 4),
            "survived_200_steps": self.survived,
            "error": self.error,
            **self.detail,
        }


def runs(spec: Spec, b: int, budget: int, steps: int) -> bool:
    """``steps`` real training steps at batch ``b`` on a simulated GPU of ``budget`` bytes."""
    ok = True
    with vramctl.simulate(budget):
        model, opt = fresh(spec)
        step = make_step(model, opt)
        try:
            for _ in range(steps):
                step(spec.batch(b))
        except torch.OutOfMemoryError:
            ok = False
        del model, opt, step
    return ok


def true_max(spec: Spec, budget: int) -> tuple[int, int]:
    """The largest batch whose steps run within ``budget`` (3 steps), and the runs it took."""
    tried = 0

    def ok(b: int) -> bool:
        nonlocal tried
        tried += 1
        return runs(spec, b, budget, 3)

    lo, hi = 0, 8
    while ok(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    if lo and not (ok(lo) and not ok(lo + 1)):  # the edge, checked once more
        raise RuntimeError(f"{spec.name}: the edge at {lo} did not hold when run again")
    return lo, tried


# -- the tools ---------------------------------------------------------------------------


def run_vramctl(spec: Spec, capacity: int) -> Outcome:
    with vramctl.simulate(capacity) as gpu:
        model, opt = fresh(spec)
        t0 = time.perf_counter()
        fit = fit_batch_size(
            make_step(model, opt),
            spec.batch,
            device=gpu,
            model=model,
            optimizer=opt,
            target=TARGET,
            cache=False,
        )
        seconds = time.perf_counter() - t0
    return Outcome(
        fit.batch_size,
        len(fit.probes),
        seconds,
        detail={"predicted": fit.predicted, "tried": [b for b, _, _ in fit.probes]},
    )


class _Dataset(torch.utils.data.Dataset[torch.Tensor]):
    def __init__(self, spec: Spec) -> None:
        self.spec = spec

    def __len__(self) -> int:
        return 1_000_000

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.spec.sample()


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Lightning's info lines and warnings off (its tuner prints every trial)."""
    names = ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning")
    levels = {n: logging.getLogger(n).level for n in names}
    for n in names:
        logging.getLogger(n).setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            yield
        finally:
            for n, level in levels.items():
                logging.getLogger(n).setLevel(level)


def run_lightning(spec: Spec, budget: int) -> Outcome:
    import lightning as L
    from lightning.pytorch.tuner import Tuner

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net, _ = fresh(spec)
            self.batch_size = 2
            self.trials: list[int] = []
            self.seen: list[tuple[int, int]] = []

        def train_dataloader(self) -> torch.utils.data.DataLoader[torch.Tensor]:
            self.trials.append(self.batch_size)
            return torch.utils.data.DataLoader(_Dataset(spec), batch_size=self.batch_size)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            self.seen.append((batch_idx, batch.shape[0]))
            return loss_of(self.net(batch), batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    with tempfile.TemporaryDirectory() as root, quiet(), vramctl.simulate(budget):
        lit = Lit()
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=root,
        )
        t0 = time.perf_counter()
        found = Tuner(trainer).scale_batch_size(lit, mode="binsearch")
        seconds = time.perf_counter() - t0
    trials = len(lit.trials) - 1 if len(lit.trials) > 1 else len(lit.trials)
    return Outcome(int(found or 0), trials, seconds, detail={"tried": lit.trials[:-1]})


def run_accelerate(spec: Spec, budget: int, start: int = ACCELERATE_START) -> Outcome:
    from accelerate.utils import find_executable_batch_size

    tried: list[int] = []
    with vramctl.simulate(budget):
        model, opt = fresh(spec)
        step = make_step(model, opt)

        @find_executable_batch_size(starting_batch_size=start)  # type: ignore[misc]
        def trial(batch_size: int) -> int:
            tried.append(batch_size)
            opt.zero_grad(set_to_none=True)
            x = spec.batch(batch_size)
            for _ in range(2):
                step(x)
            return batch_size

        t0 = time.perf_counter()
        found = trial()
        seconds = time.perf_counter() - t0
    return Outcome(int(found), len(tried), seconds, detail={"tried": tried})


TOOLS: dict[str, Callable[[Spec, int, int, bool], Outcome]] = {
    "vramctl": lambda spec, capacity, budget, quick: run_vramctl(spec, capacity),
    "lightning": lambda spec, capacity, budget, quick: run_lightning(spec, budget),
    "accelerate": lambda spec, capacity, budget, quick: run_accelerate(
        spec, budget, QUICK_ACCELERATE_START if quick else ACCELERATE_START
    ),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller simulated GPUs (under a minute)")
    ap.add_argument("--models", help="comma-separated subset of " + ",".join(s.name for s in SPECS))
    ap.add_argument(
        "--tools", default=",".join(TOOLS), help="comma-separated subset of " + ",".join(TOOLS)
    )
    ap.add_argument(
        "--steps", type=int, default=SURVIVAL_STEPS, help="real steps for the survival check"
    )
    args = ap.parse_args(argv)
    wanted = args.models.split(",") if args.models else QUICK_MODELS if args.quick else None
    specs = [s for s in SPECS if wanted is None or s.name in wanted]
    tools = [t for t in TOOLS if t in args.tools.split(",")]
    started = time.perf_counter()

    rows: list[dict[str, Any]] = []
    print(
        f"{'model':<12}{'C':>8}{'true max':>9}  {'tool':<11}{'batch':>6}{'of max':>8}"
        f"{'probes':>7}{'seconds':>8}  survives {args.steps} steps"
    )
    for spec in specs:
        capacity = spec.quick_capacity if args.quick else spec.capacity
        budget = int(TARGET * capacity)
        t0 = time.perf_counter()
        truth, truth_runs = true_max(spec, budget)
        truth_s = time.perf_counter() - t0
        row: dict[str, Any] = {
            "model": spec.name,
            "capacity_bytes": capacity,
            "budget_bytes": budget,
            "true_max": truth,
            "true_max_runs": truth_runs,
            "true_max_seconds": round(truth_s, 2),
            "tools": {},
        }
        for tool in tools:
            try:
                out = TOOLS[tool](spec, capacity, budget, args.quick)
            except Exception as exc:
                out = Outcome(error=f"{type(exc).__name__}: {exc}"[:300])
            gc.collect()
            if out.batch_size and truth:
                out.fraction = out.batch_size / truth
                if tool == "vramctl" or not args.quick:
                    out.survived = runs(spec, out.batch_size, budget, args.steps)
            row["tools"][tool] = out.to_dict()
            print(
                f"{spec.name:<12}{vramctl.format_bytes(capacity):>8}{truth:>9}  {tool:<11}"
                f"{out.batch_size:>6}{out.fraction:>8.1%}{out.probes:>7}{out.seconds:>8.2f}  "
                f"{out.error or {True: 'yes', False: 'NO', None: 'not run'}[out.survived]}",
                flush=True,
            )
        rows.append(row)

    mine = [r["tools"]["vramctl"] for r in rows if "vramctl" in r["tools"]]

    def per_tool(tool: str) -> dict[str, Any]:
        outs = [r["tools"][tool] for r in rows if tool in r["tools"]]
        ok = [o for o in outs if not o["error"]]
        return {
            "min_fraction_of_true_max": min((o["fraction_of_true_max"] for o in ok), default=None),
            "mean_fraction_of_true_max": (
                round(sum(o["fraction_of_true_max"] for o in ok) / len(ok), 4) if ok else None
            ),
            "max_probes": max((o["probes"] for o in ok), default=None),
            "total_probes": sum(o["probes"] for o in ok),
            "total_seconds": round(sum(o["seconds"] for o in ok), 2),
            "survived_200_steps": (
                None
                if any(o["survived_200_steps"] is None for o in ok)
                else all(o["survived_200_steps"] for o in ok) and len(ok) == len(outs)
            ),
            "errors": len(outs) - len(ok),
        }

    summary = {
        "benchmark": "fit_search",
        "quick": args.quick,
        "target": TARGET,
        "survival_steps": args.steps,
        "min_fraction_of_true_max": min(
            (o["fraction_of_true_max"] for o in mine if not o["error"]), default=None
        ),
        "max_probes": max((o["probes"] for o in mine), default=None),
        "survived_200_steps": bool(mine) and all(o["survived_200_steps"] for o in mine),
        "per_tool": {t: per_tool(t) for t in tools},
        "rows": rows,
        "wall_s": round(time.perf_counter() - started, 1),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "torch": torch.__version__,
    }
    print(json.dumps(summary))
    return 0 if summary["survived_200_steps"] else 1


if __name__ == "__main__":
    sys.exit(main())
