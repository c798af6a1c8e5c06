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

``--cuda`` runs the same models (and the same ``--quick`` subset) on this
machine's GPU instead: real CUDA allocations, real ``torch.OutOfMemoryError``.
C is chosen per model for the GPU (256 MiB to 2 GiB: a true largest batch in the
hundreds to low thousands, steps of milliseconds), and a ballast tensor shrinks
the GPU so that this process has the room each run is given. The true-max
search, Lightning, Accelerate (``starting_batch_size=4096``, above every
expected answer) and the survival check get a room of 0.9 C: what this process
can allocate, with the CUDA context, the libraries' handles and workspaces
(loaded by a warm-up before any room is made) and other processes outside it.
vramctl's ``target`` is a share of the whole GPU, so its ballast leaves 0.9 C
plus the tenth of the GPU above its budget: the budget then leaves the step the
same 0.9 C. The ballast is whole 2 MiB pages: the others' room is at least 0.9
C, vramctl's at most (up to 2 MiB less). Every run gets a fresh ballast after
``gc.collect()`` and ``torch.cuda.empty_cache()``, so blocks a failed trial left
cached do not shrink the next. Every tool's answer is checked for 200 steps (50
with ``--quick``). ``--models`` picks a subset.

The last line is one JSON object with vramctl's figures
(``min_fraction_of_true_max``, ``max_probes``, ``survived_200_steps``), a row
per model and tool, and the device (the GPU's name, ``torch.version.cuda`` and
the driver with ``--cuda``).

    python benchmarks/fit_search.py --quick          # two models, smaller devices, under a minute
    python benchmarks/fit_search.py                  # four models, the larger devices
    python benchmarks/fit_search.py --cuda --quick   # on the GPU: two models
    python benchmarks/fit_search.py --cuda           # on the GPU: four models
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import vramctl
from vramctl.fit import fit_batch_size
from vramctl.guard import is_oom

import _common

TARGET = 0.9
SURVIVAL_STEPS = 200
#: On the GPU, --quick checks every tool's answer for this many steps.
CUDA_QUICK_STEPS = 50
#: Accelerate's starting batch size: above every true answer here (its default, 128, in --quick).
ACCELERATE_START = 1024
QUICK_ACCELERATE_START = 128
#: On the GPU: above every true answer expected there (hundreds to about 2,000), quick or not.
CUDA_ACCELERATE_START = 4096
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
    #: C on the GPU (--cuda) for the full run and for --quick: a true largest batch in the
    #: hundreds to low thousands, steps of milliseconds on a large GPU.
    cuda_capacity: int
    cuda_quick_capacity: int

    def room(self, cuda: bool, quick: bool) -> int:
        """C for this run."""
        if cuda:
            return self.cuda_quick_capacity if quick else self.cuda_capacity
        return self.quick_capacity if quick else self.capacity

    def batch(self, b: int, device: str = "cpu") -> torch.Tensor:
        if self.tokens:
            return torch.randint(0, 1000, (b, *self.shape), device=device)
        return torch.randn(b, *self.shape, device=device)

    def sample(self) -> torch.Tensor:
        return self.batch(1)[0]


SPECS = [
    Spec("mlp", Mlp, (16, 64), False, 160 * MiB, 48 * MiB, 512 * MiB, 192 * MiB),
    Spec("cnn", Cnn, (3, 32, 32), False, 96 * MiB, 32 * MiB, 768 * MiB, 256 * MiB),
    Spec("transformer", Transformer, (64,), True, 320 * MiB, 96 * MiB, 2048 * MiB, 768 * MiB),
    Spec("lstm", Lstm, (32,), True, 256 * MiB, 64 * MiB, 1024 * MiB, 384 * MiB),
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


def fresh(spec: Spec, device: str = "cpu") -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = spec.build().to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def train(spec: Spec, device: str, b: int, steps: int) -> None:
    """``steps`` real training steps of a fresh model at batch ``b``, a fresh batch each step."""
    model, opt = fresh(spec, device)
    step = make_step(model, opt)
    for _ in range(steps):
        step(spec.batch(b, device))


# -- where the steps run ----------------------------------------------------------------


class Session:
    """Simulated GPUs (``vramctl.simulate``): real allocations and OOMs, on this host's CPU.

    Every search, tool and check below runs through one of these; :class:`CudaSession`
    changes only where tensors live and how a room of a given size is made.
    """

    kind = "sim"
    #: Where models and batches are put (a simulated GPU counts this host's tensors).
    device = "cpu"
    #: Lightning's ``accelerator``.
    accelerator = "cpu"

    def room(self, nbytes: int) -> contextlib.AbstractContextManager[Any]:
        """A device on which this process can allocate ``nbytes``; yields it (a vramctl Device)."""
        return vramctl.simulate(nbytes)

    def fit_room(self, capacity: int) -> contextlib.AbstractContextManager[Any]:
        """vramctl's device: ``TARGET`` of it leaves the step ``TARGET * capacity``."""
        return self.room(capacity)

    def warm(self, spec: Spec) -> None:
        """Before a model's first measured run (nothing to load on a simulated GPU)."""

    def sync(self) -> None:
        """Wait for queued work (before a clock is read)."""

    def name(self) -> str:
        return "simulated (vramctl.simulate)"


class AllocatorSession(Session):
    """Simulated GPUs whose every storage is a request to PyTorch's caching allocator, as
    modelled (``vramctl.simulate(..., allocator=CachingAllocatorModel())``): reserved
    memory is whole segments, freed blocks stay cached, and a request that does not fit is
    refused only after the cache is given back. The allocator model replays the recorded
    H200 steps' segments exactly (``cuda_truth.py check``); there is no CUDA context,
    cuBLAS or cuDNN workspace here."""

    kind = "sim-allocator"

    def room(self, nbytes: int) -> contextlib.AbstractContextManager[Any]:
        from vramctl.estimator import CachingAllocatorModel

        return vramctl.simulate(nbytes, allocator=CachingAllocatorModel())

    def name(self) -> str:
        return "simulated with PyTorch's caching allocator (vramctl.simulate, allocator=)"


class CudaSession(Session):
    """This machine's GPU; a ballast tensor leaves this process the room asked for."""

    kind = "cuda"
    accelerator = "gpu"

    def __init__(self) -> None:
        self.index = torch.cuda.current_device()
        self.device = f"cuda:{self.index}"
        self.gpu = vramctl.get_device(self.index)
        self.ballast: torch.Tensor | None = None

    def available(self) -> int:
        """What this process could allocate now: free memory and the allocator's idle cache."""
        free = torch.cuda.mem_get_info(self.index)[0]
        idle = torch.cuda.memory_reserved(self.index) - torch.cuda.memory_allocated(self.index)
        return int(free + idle)

    @contextlib.contextmanager
    def room(self, nbytes: int, at_most: bool = False) -> Iterator[Any]:
        """The ballast is whole 2 MiB pages (what the allocator rounds a large block up to), so
        the room is ``nbytes`` rounded to them: up, or down with ``at_most``."""
        # A fresh ballast for every room: what an earlier trial left cached is given back first.
        self.ballast = None
        gc.collect()
        torch.cuda.empty_cache()
        have = self.available()
        if have < nbytes:
            raise RuntimeError(
                f"a room of {vramctl.format_bytes(nbytes)} was asked for; "
                f"{vramctl.format_bytes(have)} is free on {self.device}"
            )
        page = 2 * MiB
        spare = (have - nbytes) // page * page
        if at_most and spare < have - nbytes:
            spare += page
        if spare:
            self.ballast = torch.empty(spare, dtype=torch.uint8, device=self.device)
        got = self.available()
        if abs(got - nbytes) >= page:
            print(f"# room of {got} bytes for {nbytes} asked", file=sys.stderr, flush=True)
        try:
            yield self.gpu
        finally:
            self.ballast = None
            torch.cuda.empty_cache()

    def fit_room(self, capacity: int) -> contextlib.AbstractContextManager[Any]:
        # fit_batch_size's budget is TARGET of the whole GPU: leave the step TARGET * capacity
        # below it, as on a simulated GPU of that capacity (and never more than the others get).
        total = int(torch.cuda.mem_get_info(self.index)[1])
        return self.room(int(TARGET * capacity) + total - int(TARGET * total), at_most=True)

    def warm(self, spec: Spec) -> None:
        """Load the model's kernels and the CUDA libraries' handles and workspaces while the
        whole GPU is free: they stay, outside every room measured afterwards."""
        for b in (8, 64):
            train(spec, self.device, b, 2)
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    def sync(self) -> None:
        torch.cuda.synchronize()

    def name(self) -> str:
        return torch.cuda.get_device_name(self.index)


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


def runs(s: Session, spec: Spec, b: int, budget: int, steps: int) -> bool:
    """``steps`` real training steps at batch ``b`` (a fresh model) in a room of ``budget``."""
    ok = True
    with s.room(budget):
        try:
            train(spec, s.device, b, steps)
            s.sync()
        except RuntimeError as exc:
            if not is_oom(exc):
                raise
            ok = False
    return ok


def true_max(s: Session, spec: Spec, budget: int) -> tuple[int, int, bool]:
    """The largest batch whose steps run within ``budget`` (3 steps), the runs it took, and
    whether its edge held when run again (the answer runs, one more sample does not)."""
    tried = 0

    def ok(b: int) -> bool:
        nonlocal tried
        tried += 1
        return runs(s, spec, b, budget, 3)

    lo, hi = 0, 8
    while ok(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    held = not lo or (ok(lo) and not ok(lo + 1))  # the edge, checked once more
    if not held:
        print(f"# {spec.name}: the edge at {lo} did not hold when run again", file=sys.stderr)
    return lo, tried, held


# -- the tools ---------------------------------------------------------------------------


def run_vramctl(s: Session, spec: Spec, capacity: int) -> Outcome:
    with s.fit_room(capacity) as gpu:
        model, opt = fresh(spec, s.device)
        t0 = time.perf_counter()
        fit = fit_batch_size(
            make_step(model, opt),
            functools.partial(spec.batch, device=s.device),
            device=gpu,
            model=model,
            optimizer=opt,
            target=TARGET,
            cache=False,
        )
        s.sync()
        seconds = time.perf_counter() - t0
        del model, opt
    return Outcome(
        fit.batch_size,
        len(fit.probes),
        seconds,
        detail={
            "predicted": fit.predicted,
            "tried": [b for b, _, _ in fit.probes],
            "notes": list(fit.notes),
        },
    )


class _Dataset(torch.utils.data.Dataset[torch.Tensor]):
    def __init__(self, spec: Spec) -> None:
        self.spec = spec

    def __len__(self) -> int:
        return 1_000_000

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.spec.sample()


def run_lightning(s: Session, spec: Spec, budget: int) -> Outcome:
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

    with tempfile.TemporaryDirectory() as root, _common.quiet(), s.room(budget):
        lit = Lit()  # on the host: the trainer moves it to the device
        trainer = L.Trainer(
            accelerator=s.accelerator,
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
        s.sync()
        seconds = time.perf_counter() - t0
        del trainer
    trials = len(lit.trials) - 1 if len(lit.trials) > 1 else len(lit.trials)
    return Outcome(int(found or 0), trials, seconds, detail={"tried": lit.trials[:-1]})


def run_accelerate(s: Session, spec: Spec, budget: int, start: int) -> Outcome:
    with s.room(budget):
        model, opt = fresh(spec, s.device)
        step = make_step(model, opt)

        def trial(batch_size: int) -> None:
            opt.zero_grad(set_to_none=True)
            x = spec.batch(batch_size, s.device)
            for _ in range(2):
                step(x)

        t0 = time.perf_counter()
        found, tried = _common.accelerate_search(start, trial)
        s.sync()
        seconds = time.perf_counter() - t0
    if not found:
        raise RuntimeError("No executable batch size found, reached zero.")
    return Outcome(found, len(tried), seconds, detail={"tried": tried})


def accelerate_start(s: Session, quick: bool) -> int:
    if s.kind == "cuda":
        return CUDA_ACCELERATE_START
    return QUICK_ACCELERATE_START if quick else ACCELERATE_START


#: Each tool, given the session, the model, C, the room of 0.9 C and --quick.
TOOLS: dict[str, Callable[[Session, Spec, int, int, bool], Outcome]] = {
    "vramctl": lambda s, spec, capacity, budget, quick: run_vramctl(s, spec, capacity),
    "lightning": lambda s, spec, capacity, budget, quick: run_lightning(s, spec, budget),
    "accelerate": lambda s, spec, capacity, budget, quick: run_accelerate(
        s, spec, budget, accelerate_start(s, quick)
    ),
}


def main(argv: list[str] | None = None) -> int:
    ap = _common.parser(
        __doc__,
        quick="two models, smaller devices",
        cuda="run on this machine's GPU, shrunk by a ballast tensor, instead of simulated GPUs",
    )
    ap.add_argument("--models", help="comma-separated subset of " + ",".join(s.name for s in SPECS))
    ap.add_argument(
        "--tools", default=",".join(TOOLS), help="comma-separated subset of " + ",".join(TOOLS)
    )
    ap.add_argument(
        "--steps",
        type=int,
        help=f"real steps for the survival check ({SURVIVAL_STEPS}; {CUDA_QUICK_STEPS} with "
        "--cuda --quick)",
    )
    ap.add_argument(
        "--allocator",
        action="store_true",
        help="simulated GPUs that replay PyTorch's caching allocator (segments, cache, the "
        "retry before an OOM) instead of counting storages",
    )
    args = _common.parse(ap, argv)
    if args.allocator and args.cuda:
        ap.error("--allocator is for simulated GPUs; --cuda runs on the real one")
    wanted = args.models.split(",") if args.models else QUICK_MODELS if args.quick else None
    unknown = sorted(set(wanted or ()) - {s.name for s in SPECS})
    if unknown:
        ap.error(f"unknown model(s): {', '.join(unknown)}")
    specs = [s for s in SPECS if wanted is None or s.name in wanted]
    tools = [t for t in TOOLS if t in args.tools.split(",")]
    if args.steps is None:
        args.steps = CUDA_QUICK_STEPS if args.cuda and args.quick else SURVIVAL_STEPS
    session = CudaSession() if args.cuda else AllocatorSession() if args.allocator else Session()
    driver = _common.driver_version() if args.cuda else None
    started = time.perf_counter()

    rows: list[dict[str, Any]] = []
    if args.cuda:
        print(
            f"# {session.name()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
            f"driver {driver}; each room made by a ballast tensor",
            flush=True,
        )
    print(
        f"{'model':<12}{'C':>11}{'true max':>9}  {'tool':<11}{'batch':>6}{'of max':>8}"
        f"{'probes':>7}{'seconds':>8}  survives {args.steps} steps"
    )
    for spec in specs:
        # the allocator's segments (2 and 20 MiB) need rooms of a GPU run's size
        capacity = spec.room(args.cuda or args.allocator, args.quick)
        budget = int(TARGET * capacity)
        row: dict[str, Any] = {
            "model": spec.name,
            "capacity_bytes": capacity,
            "budget_bytes": budget,
        }
        rows.append(row)
        try:
            session.warm(spec)
            t0 = time.perf_counter()
            truth, truth_runs, held = true_max(session, spec, budget)
        except Exception as exc:  # no truth to compare with: the model's tools are not run
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            c = vramctl.format_bytes(capacity)
            print(f"{spec.name:<12}{c:>11}  true max: {row['error']}", flush=True)
            continue
        row.update(
            true_max=truth,
            true_max_runs=truth_runs,
            true_max_seconds=round(time.perf_counter() - t0, 2),
            true_max_edge_held=held,
            tools={},
        )
        for tool in tools:
            try:
                out = TOOLS[tool](session, spec, capacity, budget, args.quick)
            except Exception as exc:
                out = Outcome(error=f"{type(exc).__name__}: {exc}"[:300])
            gc.collect()
            if out.batch_size and truth:
                out.fraction = out.batch_size / truth
                if tool == "vramctl" or not args.quick or args.cuda:
                    try:
                        out.survived = runs(session, spec, out.batch_size, budget, args.steps)
                    except Exception as exc:
                        out.error = f"survival check: {type(exc).__name__}: {exc}"[:300]
            row["tools"][tool] = out.to_dict()
            print(
                f"{spec.name:<12}{vramctl.format_bytes(capacity):>11}{truth:>9}  {tool:<11}"
                f"{out.batch_size:>6}{out.fraction:>8.1%}{out.probes:>7}{out.seconds:>8.2f}  "
                f"{out.error or {True: 'yes', False: 'NO', None: 'not run'}[out.survived]}",
                flush=True,
            )

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
        "models_failed": [r["model"] for r in rows if "error" in r],
        "per_tool": {t: per_tool(t) for t in tools},
        "rows": rows,
        "wall_s": round(time.perf_counter() - started, 1),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "side": session.kind,
        "device": session.name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "driver": driver,
    }
    return _common.finish(summary, summary["survived_200_steps"] and not summary["models_failed"])


if __name__ == "__main__":
    sys.exit(main())
