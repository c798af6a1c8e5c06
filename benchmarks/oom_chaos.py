"""What is lost when a co-tenant takes the memory mid-run: unguarded, Accelerate, vramctl's guard.

A training loop (an MLP, AdamW, a fixed seeded dataset) and an inference loop
run while a co-tenant grabs and releases random amounts of device memory on a
seeded schedule, one tick before every step attempt, so every run sees the same
pressure at the same tick. The memory is real: on the CPU a simulated GPU
(``vramctl.simulate``) whose budget leaves room for the whole batch only when
the co-tenant is quiet, and where the co-tenant's blocks are real
``torch.empty`` tensors counted against it; with ``--cuda`` the machine's GPU,
shrunk by a ballast tensor to the same room, with ``torch.empty(...,
device="cuda")`` blocks for the co-tenant. The co-tenant never takes so much
that a quarter of the batch (and the optimizer step) cannot run.

Three runs of each loop, side by side:

- unguarded: an OOM crashes the job; it restarts from its last checkpoint
  (every ``--checkpoint-every`` steps, kept in host memory) after
  ``--restart-ticks`` ticks of the co-tenant's schedule, and redoes the lost
  work. ``samples_lost`` counts the samples whose work was thrown away (the
  steps since the checkpoint and the failed batch).
- accelerate: the loop inside ``accelerate.utils.find_executable_batch_size``,
  as Accelerate documents it: on an OOM the whole function runs again from a
  fresh model and optimizer with 0.9 times the batch size. Every restart
  throws away all the work before it; the final weights are those of another
  batch size.
- vramctl: ``vramctl.Guard(...).step(batch)`` and ``Guard.infer(x)``: a step
  that runs out of memory is finished in pieces, with the whole batch's
  gradients, and inference outputs come back whole and in order.

A reference run with no co-tenant gives the final weights and outputs each run
is compared with (``torch.allclose``, rtol 1e-4, atol 1e-6; the largest
absolute difference is printed too). The guard's overhead is timed outside any
simulated device, on a plain CPU training step of about 10 ms, interleaved with
the same step unguarded (medians of many repetitions).

The last line is one JSON object; its top-level ``samples_lost``, ``crashes``,
``ooms_recovered``, ``weights_match`` and ``guard_overhead_pct`` are vramctl's,
and ``runs`` holds every run's row.

    python benchmarks/oom_chaos.py --quick     # under a minute on a 2-core CPU
    python benchmarks/oom_chaos.py             # 256 training steps per run
    python benchmarks/oom_chaos.py --cuda      # on a machine with an NVIDIA GPU
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import math
import platform
import random
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import nn

import vramctl
from vramctl.device import SimulatedDevice
from vramctl.guard import Guard, available_bytes

#: The largest difference ``weights_match`` and ``outputs_match`` accept.
RTOL, ATOL = 1e-4, 1e-6
#: The room the step has with no co-tenant: the whole step's need, plus this share.
HEADROOM = 0.10
#: The co-tenant always leaves a quarter-batch step this share more than it needs.
MARGIN = 0.20
#: The co-tenant's small background blocks take at most this share of its ceiling.
JITTER = 0.08
#: Chance per quiet tick that a burst starts; a burst holds for 2 to 8 ticks.
BURST_P = 0.10
BURST_TICKS = (2, 8)


@dataclass(frozen=True)
class Config:
    """The workload: data, model, batch sizes and how long each loop runs."""

    n_samples: int = 8192
    d_in: int = 32
    width: int = 128
    depth: int = 3
    classes: int = 10
    batch: int = 512
    infer_batch: int = 1024
    epochs: int = 16
    infer_passes: int = 32
    lr: float = 1e-3
    weight_decay: float = 0.01
    seed: int = 0
    checkpoint_every: int = 8
    restart_ticks: int = 10

    @property
    def train_steps(self) -> int:
        return self.epochs * math.ceil(self.n_samples / self.batch)

    @property
    def infer_steps(self) -> int:
        return self.infer_passes * math.ceil(self.n_samples / self.infer_batch)


FULL = Config()
QUICK = replace(FULL, epochs=4, infer_passes=8)
#: On a GPU the tensors are made larger, so that the caching allocator's 2 MiB and
#: 20 MiB segments are small beside the step's need.
CUDA_FULL = replace(FULL, n_samples=65536, width=1024, batch=8192, infer_batch=16384)
CUDA_QUICK = replace(CUDA_FULL, epochs=4, infer_passes=8)


# -- data and model --------------------------------------------------------------------


@dataclass
class Data:
    x: torch.Tensor
    y: torch.Tensor
    orders: list[torch.Tensor]


def make_data(cfg: Config) -> Data:
    """A fixed dataset (labels from a noisy linear teacher) and one shuffle per epoch."""
    g = torch.Generator().manual_seed(cfg.seed)
    x = torch.randn(cfg.n_samples, cfg.d_in, generator=g)
    teacher = torch.randn(cfg.d_in, cfg.classes, generator=g)
    y = (x @ teacher + 0.5 * torch.randn(cfg.n_samples, cfg.classes, generator=g)).argmax(1)
    orders = [torch.randperm(cfg.n_samples, generator=g) for _ in range(cfg.epochs)]
    return Data(x, y, orders)


def build_model(cfg: Config) -> nn.Module:
    """An MLP with GELU: no dropout, no BatchNorm, so a batch in pieces is the same step."""
    torch.manual_seed(cfg.seed + 1)
    layers: list[nn.Module] = [nn.Linear(cfg.d_in, cfg.width), nn.GELU()]
    for _ in range(cfg.depth - 1):
        layers += [nn.Linear(cfg.width, cfg.width), nn.GELU()]
    layers.append(nn.Linear(cfg.width, cfg.classes))
    return nn.Sequential(*layers)


def make_optimizer(cfg: Config, model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)


def ce_loss(out: torch.Tensor, batch: Any) -> torch.Tensor:
    return nn.functional.cross_entropy(out, batch[1])


def _forward_pair(model: nn.Module, batch: Any) -> torch.Tensor:
    out: torch.Tensor = model(batch[0])  # (inputs, targets) batches
    return out


def plan(n: int, epochs: int, size: int) -> list[tuple[int, int, int]]:
    """(epoch, start, end) of every batch of ``size`` over ``epochs`` passes of ``n`` samples."""
    return [(e, lo, min(lo + size, n)) for e in range(epochs) for lo in range(0, n, size)]


# -- where the memory is: a simulated GPU, a real GPU, or the plain CPU ------------------


class Session:
    """The plain CPU: no budget. The reference runs and the overhead timing use it."""

    def __init__(self) -> None:
        self.device: Any = vramctl.get_device("cpu")

    def adopt(self, model: nn.Module) -> None:
        pass

    def put(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def grab(self, n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.uint8)

    def host(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def sync(self) -> None:
        pass

    def allocated(self) -> int:
        return 0

    def reset_peak(self) -> None:
        pass

    def peak(self) -> int:
        return 0

    def adopt_optimizer(self, opt: torch.optim.Optimizer) -> None:
        pass


class SimSession(Session):
    """A simulated GPU of ``budget`` bytes: real allocations, real OOMs, on the CPU."""

    def __init__(self, gpu: SimulatedDevice) -> None:
        self.device = gpu
        self.gpu = gpu

    def adopt(self, model: nn.Module) -> None:
        self.gpu.adopt(model)

    def adopt_optimizer(self, opt: torch.optim.Optimizer) -> None:
        self.gpu.adopt(opt)

    def put(self, t: torch.Tensor) -> torch.Tensor:
        return t.clone()  # the copy to the device: counted, and refused when it does not fit

    def grab(self, n: int) -> torch.Tensor:
        block = torch.empty(n, dtype=torch.uint8)
        self.gpu.adopt(block)  # refused (an OOM) when it does not fit
        return block

    def host(self) -> contextlib.AbstractContextManager[Any]:
        return self.gpu.host()

    def allocated(self) -> int:
        return int(self.gpu.allocated_bytes)

    def reset_peak(self) -> None:
        self.gpu.reset_peak()

    def peak(self) -> int:
        return int(self.gpu.peak_bytes)


class CudaSession(Session):
    """The real GPU; a ballast tensor leaves this process ``budget`` bytes in all."""

    def __init__(self) -> None:
        self.device = vramctl.get_device(0)
        self.ballast: torch.Tensor | None = None

    def limit(self, budget: int) -> None:
        gc.collect()
        torch.cuda.empty_cache()
        more = budget - torch.cuda.memory_allocated()
        spare = available_bytes(self.device) - more
        if spare > 0:
            self.ballast = torch.empty(spare, dtype=torch.uint8, device="cuda")

    def adopt(self, model: nn.Module) -> None:
        model.to("cuda")

    def put(self, t: torch.Tensor) -> torch.Tensor:
        return t.to("cuda")

    def grab(self, n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.uint8, device="cuda")

    def sync(self) -> None:
        torch.cuda.synchronize()

    def allocated(self) -> int:
        return int(torch.cuda.memory_allocated())

    def reset_peak(self) -> None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

    def peak(self) -> int:
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated())


@contextlib.contextmanager
def session(kind: str, budget: int | None) -> Iterator[Session]:
    """``kind`` is "sim", "cuda" or "cpu"; ``budget=None`` is a device with no pressure."""
    if kind == "cpu":
        yield Session()
    elif kind == "sim":
        with vramctl.simulate(budget if budget is not None else 1 << 40) as gpu:
            yield SimSession(gpu)
    else:
        s = CudaSession()
        try:
            yield s
        finally:
            s.ballast = None
            gc.collect()
            torch.cuda.empty_cache()


def to_host(tree: Any) -> Any:
    """A copy of every tensor in ``tree`` in host memory (a checkpoint)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {k: to_host(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(to_host(v) for v in tree)
    return tree


@dataclass
class Checkpoint:
    step: int
    model: dict[str, Any]
    optimizer: dict[str, Any]


def checkpoint(s: Session, step: int, model: nn.Module, opt: torch.optim.Optimizer) -> Checkpoint:
    with s.host():
        return Checkpoint(step, to_host(model.state_dict()), to_host(opt.state_dict()))


def restore(s: Session, ck: Checkpoint, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Load a checkpoint in place: the parameters are copied into, the optimizer state reloaded."""
    opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        model.load_state_dict(ck.model)  # copies into the device's parameters
    with s.host():
        fresh = to_host(ck.optimizer)  # the optimizer keeps the tensors it is given
    opt.load_state_dict(fresh)  # on CUDA: moved to the parameters' device
    s.adopt_optimizer(opt)  # on the simulated GPU: counted, as a copy to the GPU is


def free_failed(exc: BaseException | None) -> None:
    """What a crash frees: the failed step's tensors (held by the traceback's frames)."""
    while exc is not None:
        if exc.__traceback__ is not None:
            traceback.clear_frames(exc.__traceback__)
            exc.__traceback__ = None
        exc = exc.__cause__ or exc.__context__
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def load(s: Session, data: Data, e: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``lo:hi`` of epoch ``e``, copied to the device."""
    with s.host():
        idx = data.orders[e % len(data.orders)][lo:hi]
        x, y = data.x[idx], data.y[idx]
    return s.put(x), s.put(y)


def load_infer(s: Session, data: Data, lo: int, hi: int) -> torch.Tensor:
    with s.host():
        x = data.x[lo:hi].clone()
    return s.put(x)


# -- the co-tenant ---------------------------------------------------------------------


def cotenant_schedule(seed: int, ceiling: int) -> Iterator[list[tuple[str, int, int]]]:
    """Per tick, the co-tenant's actions: ("grab", id, bytes) and ("release", id, 0).

    A pure function of ``seed`` and ``ceiling``: quiet ticks with small background
    blocks (at most ``JITTER`` of the ceiling), and bursts that grab 15% to 100% of
    the rest in one to three blocks, hold them for a few ticks and let them go. What
    it holds never passes ``ceiling``. Tick 0 is quiet.
    """
    rng = random.Random(seed)
    jitter_cap = int(JITTER * ceiling)
    jitter: dict[int, int] = {}
    burst: list[int] = []
    hold = 0
    next_id = 0
    yield []
    while True:
        acts: list[tuple[str, int, int]] = []
        if hold > 0:
            hold -= 1
            if hold == 0:
                acts += [("release", b, 0) for b in burst]
                burst = []
        elif rng.random() < BURST_P:
            total = int(rng.uniform(0.15, 1.0) * (ceiling - jitter_cap))
            parts = rng.randint(1, 3)
            for i in range(parts):
                acts.append(("grab", next_id, total // parts + (total % parts if i == 0 else 0)))
                burst.append(next_id)
                next_id += 1
            hold = rng.randint(*BURST_TICKS)
        if rng.random() < 0.5:
            size = int(rng.uniform(0.1, 0.5) * jitter_cap)
            if sum(jitter.values()) + size <= jitter_cap:
                acts.append(("grab", next_id, size))
                jitter[next_id] = size
                next_id += 1
        elif jitter:
            victim = rng.choice(sorted(jitter))
            del jitter[victim]
            acts.append(("release", victim, 0))
        yield acts


class CoTenant:
    """Plays the schedule on a session: real blocks of memory, grabbed and released."""

    def __init__(self, s: Session, seed: int, ceiling: int) -> None:
        self.s = s
        self.schedule = cotenant_schedule(seed, ceiling)
        self.blocks: dict[int, torch.Tensor] = {}
        self.ticks = 0
        self.refused = 0

    def tick(self, n: int = 1) -> None:
        for _ in range(n):
            for act, bid, size in next(self.schedule):
                if act == "release":
                    self.blocks.pop(bid, None)
                    continue
                try:
                    self.blocks[bid] = self.s.grab(size)
                except torch.OutOfMemoryError as exc:  # only where the device is fragmented
                    self.refused += 1
                    free_failed(exc)
            self.ticks += 1

    def close(self) -> None:
        self.blocks.clear()


# -- calibration -----------------------------------------------------------------------


@dataclass
class Pressure:
    """The budget of a loop and the co-tenant's ceiling, from the step's measured need."""

    base: int  # parameters, buffers, optimizer state
    need_full: int  # a whole-batch step above the base (the batch's copy included)
    need_quarter: int  # the same batch run in quarters
    room: int
    ceiling: int

    @property
    def budget(self) -> int:
        return self.base + self.room

    @property
    def full_fails_above(self) -> int:
        return self.room - self.need_full


def share_over(seed: int, p: Pressure, ticks: int) -> float:
    """Percent of the first ``ticks`` ticks at which the co-tenant holds so much that a
    whole-batch step cannot fit."""
    schedule = cotenant_schedule(seed, p.ceiling)
    held: dict[int, int] = {}
    over = 0
    for _ in range(ticks):
        for act, bid, size in next(schedule):
            if act == "grab":
                held[bid] = size
            else:
                held.pop(bid, None)
        over += sum(held.values()) > p.full_fails_above
    return round(100.0 * over / ticks, 1)


def calibrate(kind: str, cfg: Config, data: Data, train: bool) -> Pressure:
    """Measure a step's need, whole and in quarters, on a device with no pressure."""
    with session(kind, None) as s:
        model = build_model(cfg)
        s.adopt(model)
        if train:
            opt = make_optimizer(cfg, model)
            guard = Guard(model, opt, loss_fn=ce_loss, forward=_forward_pair)
            guard.step(load(s, data, 0, 0, cfg.batch))  # the optimizer's state is made here
        else:
            model.eval()
            guard = Guard(model)
        needs = []
        for limit in (None, cfg.batch // 4 if train else cfg.infer_batch // 4):
            gc.collect()
            s.sync()
            base = s.allocated()
            guard.piece_limit = limit
            s.reset_peak()
            if train:
                guard.step(load(s, data, 0, 0, cfg.batch))
            else:
                out = guard.infer(load_infer(s, data, 0, cfg.infer_batch))
                del out
            needs.append(s.peak() - base)
        del guard, model
    room = int(needs[0] * (1 + HEADROOM))
    ceiling = room - int(needs[1] * (1 + MARGIN))
    if ceiling <= room - needs[0]:
        raise SystemExit(
            f"this workload cannot be squeezed: a whole step needs {needs[0]} bytes and a "
            f"quarter-batch step {needs[1]}; use a larger batch or a narrower model"
        )
    return Pressure(base, needs[0], needs[1], room, ceiling)


# -- rows ------------------------------------------------------------------------------


@dataclass
class Row:
    run: str
    loop: str
    finished: bool = True
    crashes: int = 0
    ooms: int = 0
    ooms_recovered: int = 0
    samples_lost: int = 0
    samples_redone: int = 0
    steps: int = 0
    batch_size: int = 0
    final_batch_size: int = 0
    match: bool | None = None
    max_abs_diff: float | None = None
    wall_s: float = 0.0
    time_lost_s: float = 0.0
    ticks: int = 0
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        key = "weights_match" if self.loop == "train" else "outputs_match"
        d[key] = d.pop("match")
        d["wall_s"] = round(self.wall_s, 3)
        d["time_lost_s"] = round(self.time_lost_s, 3)
        extra = d.pop("extra")
        d.update(extra)
        return d


def compare(got: list[torch.Tensor], want: list[torch.Tensor]) -> tuple[bool, float | None]:
    """``torch.allclose`` on every tensor, and the largest absolute difference."""
    if len(got) != len(want) or any(a.shape != b.shape for a, b in zip(got, want, strict=True)):
        return False, None
    diff = max(float((a.double() - b.double()).abs().max()) for a, b in zip(got, want, strict=True))
    ok = all(torch.allclose(a, b, rtol=RTOL, atol=ATOL) for a, b in zip(got, want, strict=True))
    return ok, diff


def weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().to("cpu", copy=True) for p in model.parameters()]


# -- training --------------------------------------------------------------------------


def train_step(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> None:
    """The plain training step, as an unguarded loop writes it."""
    loss = ce_loss(model(x), (x, y))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _load_and_train(
    s: Session, data: Data, model: nn.Module, opt: torch.optim.Optimizer, e: int, lo: int, hi: int
) -> None:
    # In a function of its own, so that a failed step's tensors go with its frame.
    x, y = load(s, data, e, lo, hi)
    train_step(model, opt, x, y)


def train_reference(kind: str, cfg: Config, data: Data) -> tuple[list[torch.Tensor], float]:
    with session("cpu" if kind == "sim" else kind, None) as s:
        model = build_model(cfg)
        s.adopt(model)
        opt = make_optimizer(cfg, model)
        t0 = time.perf_counter()
        for e, lo, hi in plan(cfg.n_samples, cfg.epochs, cfg.batch):
            x, y = load(s, data, e, lo, hi)
            train_step(model, opt, x, y)
        s.sync()
        return weights(model), time.perf_counter() - t0


def train_unguarded(
    kind: str, cfg: Config, data: Data, p: Pressure, ref: list[torch.Tensor]
) -> Row:
    row = Row("unguarded", "train", batch_size=cfg.batch, final_batch_size=cfg.batch)
    steps = plan(cfg.n_samples, cfg.epochs, cfg.batch)
    with session(kind, p.budget) as s:
        if isinstance(s, CudaSession):
            s.limit(p.budget)
        model = build_model(cfg)
        s.adopt(model)
        opt = make_optimizer(cfg, model)
        tenant = CoTenant(s, cfg.seed, p.ceiling)
        ck = checkpoint(s, 0, model, opt)
        since = 0.0  # compute time since the checkpoint
        i = 0
        t_start = time.perf_counter()
        while i < len(steps):
            tenant.tick()
            e, lo, hi = steps[i]
            t0 = time.perf_counter()
            err: BaseException | None = None
            try:
                _load_and_train(s, data, model, opt, e, lo, hi)
            except torch.OutOfMemoryError as exc:
                err = exc
            s.sync()
            dt = time.perf_counter() - t0
            row.steps += 1
            if err is None:
                i += 1
                since += dt
                if i % cfg.checkpoint_every == 0 and i < len(steps):
                    ck = checkpoint(s, i, model, opt)
                    since = 0.0
                continue
            # The job crashes: the work since the checkpoint and the failed batch are lost.
            row.crashes += 1
            row.ooms += 1
            row.samples_lost += sum(h - lo_ for _, lo_, h in steps[ck.step : i + 1])
            row.time_lost_s += since + dt
            free_failed(err)
            err = None
            tenant.tick(cfg.restart_ticks)  # the co-tenant goes on while the job restarts
            restore(s, ck, model, opt)
            i, since = ck.step, 0.0
        row.wall_s = time.perf_counter() - t_start
        row.ticks = tenant.ticks
        row.extra["cotenant_refused"] = tenant.refused
        row.samples_redone = row.samples_lost
        with s.host():
            row.match, row.max_abs_diff = compare(weights(model), ref)
        row.extra["checkpoint_every"] = cfg.checkpoint_every
        row.extra["restart_ticks"] = cfg.restart_ticks
        tenant.close()
    return row


def train_accelerate(
    kind: str, cfg: Config, data: Data, p: Pressure, ref: list[torch.Tensor]
) -> Row:
    from accelerate.utils import find_executable_batch_size

    row = Row("accelerate", "train", batch_size=cfg.batch)
    with session(kind, p.budget) as s:
        if isinstance(s, CudaSession):
            s.limit(p.budget)
        model = build_model(cfg)
        s.adopt(model)
        opt = make_optimizer(cfg, model)
        initial = checkpoint(s, 0, model, opt)
        tenant = CoTenant(s, cfg.seed, p.ceiling)
        attempts: list[int] = []

        @find_executable_batch_size(starting_batch_size=cfg.batch)
        def training_loop(batch_size: int) -> int:
            # Accelerate's pattern: the function starts over with a fresh model and optimizer.
            attempts.append(batch_size)
            restore(s, initial, model, opt)
            done = 0
            t0 = time.perf_counter()
            current = 0
            try:
                for e, lo, hi in plan(cfg.n_samples, cfg.epochs, batch_size):
                    tenant.tick()
                    current = hi - lo
                    row.steps += 1
                    _load_and_train(s, data, model, opt, e, lo, hi)
                    done += current
            except Exception:
                row.samples_lost += done + current
                s.sync()
                row.time_lost_s += time.perf_counter() - t0
                raise
            return batch_size

        t_start = time.perf_counter()
        try:
            row.final_batch_size = training_loop()
        except RuntimeError as exc:  # "No executable batch size found, reached zero."
            if "No executable batch size" not in str(exc):
                raise
            row.finished = False
            row.crashes = 1
            row.note = str(exc).split("\n")[0][:200]
        s.sync()
        row.wall_s = time.perf_counter() - t_start
        row.ooms = row.ooms_recovered = len(attempts) - 1
        row.ticks = tenant.ticks
        row.extra["cotenant_refused"] = tenant.refused
        row.samples_redone = row.samples_lost
        with s.host():
            row.match, row.max_abs_diff = compare(weights(model), ref)
        row.extra["batch_sizes_tried"] = attempts
        tenant.close()
    return row


def train_vramctl(kind: str, cfg: Config, data: Data, p: Pressure, ref: list[torch.Tensor]) -> Row:
    row = Row("vramctl", "train", batch_size=cfg.batch, final_batch_size=cfg.batch)
    steps = plan(cfg.n_samples, cfg.epochs, cfg.batch)
    seen = [0]  # samples through the model's forward, failed attempts included

    def forward(m: nn.Module, b: Any) -> torch.Tensor:
        seen[0] += int(b[0].shape[0])
        out: torch.Tensor = m(b[0])
        return out

    with session(kind, p.budget) as s:
        if isinstance(s, CudaSession):
            s.limit(p.budget)
        model = build_model(cfg)
        s.adopt(model)
        opt = make_optimizer(cfg, model)
        tenant = CoTenant(s, cfg.seed, p.ceiling)
        guard = Guard(model, opt, loss_fn=ce_loss, forward=forward, device=s.device)
        contributed = 0
        t_start = time.perf_counter()
        for e, lo, hi in steps:
            tenant.tick()
            try:
                batch = load(s, data, e, lo, hi)
                result = guard.step(batch)
                del batch
            except Exception as exc:  # the guard gave up (or the batch's copy failed)
                row.crashes += 1
                row.finished = False
                row.note = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                break
            row.steps += 1
            contributed += result.batch_size
        s.sync()
        row.wall_s = time.perf_counter() - t_start
        summary = guard.summary(events=0)
        row.ooms = summary["ooms"]
        row.ooms_recovered = summary["ooms_recovered"]
        row.time_lost_s = summary["time_lost_s"]
        total = cfg.n_samples * cfg.epochs
        row.samples_lost = total - contributed
        row.samples_redone = seen[0] - contributed
        row.ticks = tenant.ticks
        row.extra["cotenant_refused"] = tenant.refused
        row.final_batch_size = cfg.batch
        with s.host():
            row.match, row.max_abs_diff = compare(weights(model), ref)
        row.extra["split_steps"] = summary["split_steps"]
        row.extra["final_piece_limit"] = summary["piece_limit"]
        row.extra["events"] = _event_counts(guard)
        tenant.close()
    return row


def _event_counts(guard: Guard) -> dict[str, int]:
    counts: dict[str, int] = {}
    for ev in guard.events:
        counts[ev.kind] = counts.get(ev.kind, 0) + 1
    return counts


# -- inference -------------------------------------------------------------------------


def infer_model(cfg: Config, s: Session) -> nn.Module:
    model = build_model(cfg)
    s.adopt(model)
    return model.eval()


def infer_plan(cfg: Config, size: int) -> list[tuple[int, int, int]]:
    return plan(cfg.n_samples, cfg.infer_passes, size)


def infer_reference(kind: str, cfg: Config, data: Data) -> list[torch.Tensor]:
    with session("cpu" if kind == "sim" else kind, None) as s:
        model = infer_model(cfg, s)
        outs = []
        with torch.no_grad():
            for _, lo, hi in infer_plan(cfg, cfg.infer_batch):
                outs.append(model(load_infer(s, data, lo, hi)).to("cpu", copy=True))
        return [torch.cat(outs)]


def _host_copy(s: Session, t: torch.Tensor) -> torch.Tensor:
    with s.host():
        return t.detach().to("cpu", copy=True)


def infer_unguarded(
    kind: str, cfg: Config, data: Data, p: Pressure, ref: list[torch.Tensor]
) -> Row:
    """Outputs are committed (written out) every ``checkpoint_every`` batches; a crash loses
    the uncommitted ones and the failed batch."""
    row = Row("unguarded", "infer", batch_size=cfg.infer_batch, final_batch_size=cfg.infer_batch)
    steps = infer_plan(cfg, cfg.infer_batch)
    with session(kind, p.budget) as s:
        if isinstance(s, CudaSession):
            s.limit(p.budget)
        model = infer_model(cfg, s)
        tenant = CoTenant(s, cfg.seed + 1, p.ceiling)
        committed: list[torch.Tensor] = []
        pending: list[torch.Tensor] = []
        since = 0.0
        i = 0
        t_start = time.perf_counter()
        while i < len(steps):
            tenant.tick()
            _, lo, hi = steps[i]
            t0 = time.perf_counter()
            err: BaseException | None = None
            try:
                with torch.no_grad():
                    out = model(load_infer(s, data, lo, hi))
                pending.append(_host_copy(s, out))
                del out
            except torch.OutOfMemoryError as exc:
                err = exc
            s.sync()
            dt = time.perf_counter() - t0
            row.steps += 1
            if err is None:
                i += 1
                since += dt
                if i % cfg.checkpoint_every == 0:
                    committed += pending
                    pending, since = [], 0.0
                continue
            row.crashes += 1
            row.ooms += 1
            row.samples_lost += sum(h - lo_ for _, lo_, h in steps[i - len(pending) : i + 1])
            row.time_lost_s += since + dt
            free_failed(err)
            err = None
            tenant.tick(cfg.restart_ticks)
            i -= len(pending)
            pending, since = [], 0.0
        committed += pending
        row.wall_s = time.perf_counter() - t_start
        row.ticks = tenant.ticks
        row.extra["cotenant_refused"] = tenant.refused
        row.samples_redone = row.samples_lost
        with s.host():
            row.match, row.max_abs_diff = compare([torch.cat(committed)], ref)
        tenant.close()
    return row


def infer_accelerate(
    kind: str, cfg: Config, data: Data, p: Pressure, ref: list[torch.Tensor]
) -> Row:
    from accelerate.utils import find_executable_batch_size

    row = Row("accelerate", "infer", batch_size=cfg.infer_batch)
    with session(kind, p.budget) as s:
        if isinstance(s, CudaSession):
            s.limit(p.budget)
        model = infer_model(cfg, s)
        tenant = CoTenant(s, cfg.seed + 1, p.ceiling)
        attempts: list[int] = []
        result: list[torch.Tensor] = []

        @find_executable_batch_size(starting_batch_size=cfg.infer_batch)
        def inference_loop(batch_size: int) -> int:
            attempts.append(batch_size)
            outs: list[torch.Tensor] = []
            done = current = 0
            t0 = time.perf_counter()
            try:
                for _, lo, hi in infer_plan(cfg, batch_size):
                    tenant.tick()
                    current = hi - lo
                    row.steps += 1
                    with torch.no_grad():
                        out = model(load_infer(s, data, lo, hi))
                    outs.append(_host_copy(s, out))
                    del out
                    done += current
            except Exception:
                row.samples_lost += done + current
                s.sync()
                row.time_lost_s += time.perf_counter() - t0
                raise
            result[:] = outs
            return batch_size

        t_start = time.perf_counter()
        try:
            row.final_batch_size = inference_loop()
        except RuntimeError as exc:  # "No executable batch size found, reached zero."
            if "No executable batch size" not in str(exc):
                raise
            row.finished = False
            row.crashes = 1
            row.note = str(exc).split("\n")[0][:200]
        s.sync()
        row.wall_s = time.perf_counter() - t_start
        row.ooms = row.ooms_recovered = len(attempts) - 1
        row.ticks = tenant.ticks
        row.extra["cotenant_refused"] = tenant.refused
        row.samples_redone = row.samples_lost
        with s.host():
            row.match, row.max_abs_diff = compare([torch.cat(result)] if result else [], ref)
        row.extra["batch_sizes_tried"] = attempts
        tenant.close()
    return row


def infer_vramctl(kind: str, cfg: Config, data: Data, p: Pressure, ref: list[torch.Tensor]) -> Row:
    row = Row("vramctl", "infer", batch_size=cfg.infer_batch, final_batch_size=cfg.infer_batch)
    seen = [0]

    def forward(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        seen[0] += int(x.shape[0])
        out: torch.Tensor = m(x)
        return out

    with session(kind, p.budget) as s:
        if isinstance(s, CudaSession):
            s.limit(p.budget)
        model = infer_model(cfg, s)
        tenant = CoTenant(s, cfg.seed + 1, p.ceiling)
        guard = Guard(model, forward=forward, device=s.device)
        outs: list[torch.Tensor] = []
        contributed = 0
        t_start = time.perf_counter()
        for _, lo, hi in infer_plan(cfg, cfg.infer_batch):
            tenant.tick()
            try:
                out = guard.infer(load_infer(s, data, lo, hi))
                outs.append(_host_copy(s, out))
                del out
            except Exception as exc:
                row.crashes += 1
                row.finished = False
                row.note = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                break
            row.steps += 1
            contributed += outs[-1].shape[0]
            if outs[-1].shape[0] != hi - lo:
                row.note = "an output of the wrong length"
        s.sync()
        row.wall_s = time.perf_counter() - t_start
        summary = guard.summary(events=0)
        row.ooms = summary["ooms"]
        row.ooms_recovered = summary["ooms_recovered"]
        row.time_lost_s = summary["time_lost_s"]
        row.samples_lost = cfg.n_samples * cfg.infer_passes - contributed
        row.samples_redone = seen[0] - contributed
        row.ticks = tenant.ticks
        row.extra["cotenant_refused"] = tenant.refused
        with s.host():
            row.match, row.max_abs_diff = compare([torch.cat(outs)] if outs else [], ref)
        row.extra["split_steps"] = summary["split_steps"]
        row.extra["final_piece_limit"] = summary["piece_limit"]
        row.extra["events"] = _event_counts(guard)
        tenant.close()
    return row


# -- the guard's overhead --------------------------------------------------------------


def _overhead_fns(width: int, batch: int, seed: int) -> dict[str, Callable[[], None]]:
    """The same plain CPU training step: unguarded, unguarded again (a twin), and guarded.

    The twin is an A/A control: how far two identical unguarded steps differ is the
    resolution of the timing on this machine.
    """
    cfg = replace(FULL, width=width, seed=seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, cfg.d_in, generator=g)
    y = torch.randint(0, cfg.classes, (batch,), generator=g)

    def plain() -> Callable[[], None]:
        model = build_model(cfg)
        opt = make_optimizer(cfg, model)
        return lambda: train_step(model, opt, x, y)

    def guarded() -> Callable[[], None]:
        model = build_model(cfg)
        guard = Guard(model, make_optimizer(cfg, model), loss_fn=ce_loss, forward=_forward_pair)

        def step() -> None:
            guard.step((x, y))

        return step

    return {"plain": plain(), "twin": plain(), "guarded": guarded()}


def _interleaved(fns: dict[str, Callable[[], None]], reps: int) -> dict[str, dict[str, float]]:
    """Median CPU and wall seconds per call of each function, calls interleaved.

    Every repetition calls each function once, in an order that rotates through all
    permutations, so drift and order effects fall on every function alike. CPU time
    is the process's (``time.process_time``): what the step costs, whatever else the
    machine runs; wall time also counts the time other processes hold the CPU.
    """
    names = list(fns)
    orders = list(itertools.permutations(names))
    for _ in range(max(5, reps // 20)):  # warm-up
        for fn in fns.values():
            fn()
    gc.collect()
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for i in range(reps):
        for name in orders[i % len(orders)]:
            fn = fns[name]
            c0, w0 = time.process_time(), time.perf_counter()
            fn()
            w1, c1 = time.perf_counter(), time.process_time()
            wall[name].append(w1 - w0)
            cpu[name].append(c1 - c0)
    return {
        n: {"wall": statistics.median(wall[n]), "cpu": statistics.median(cpu[n])} for n in names
    }


def measure_overhead(reps: int, target_ms: float = 10.0) -> dict[str, Any]:
    """The guard's overhead on a ~10 ms plain CPU training step, and its own cost in us.

    The headline is the difference of the median per-step CPU times, guarded and
    plain, over the plain median. Beside it: the same in wall time, and for both
    clocks the A/A control (a second, identical plain step against the first), which
    says how far apart two identical steps measure on this machine.
    """
    width, batch = 512, 64
    for _ in range(4):  # size the batch so that the plain step takes about target_ms
        plain = _overhead_fns(width, batch, seed=1)["plain"]
        for _ in range(3):
            plain()
        t = []
        for _ in range(15):
            t0 = time.process_time()
            plain()
            t.append(time.process_time() - t0)
        new = max(8, round(batch * target_ms / (1e3 * statistics.median(t)) / 8) * 8)
        if abs(new - batch) <= 8:
            break
        batch = new
    m = _interleaved(_overhead_fns(width, batch, seed=1), reps)

    def pct(name: str, clock: str) -> float:
        return round(100.0 * (m[name][clock] - m["plain"][clock]) / m["plain"][clock], 3)

    # The guard's own cost in absolute terms, on a step too small to hide it.
    tiny = _interleaved(_overhead_fns(16, 8, seed=2), reps)
    us = 1e6 * (tiny["guarded"]["cpu"] - tiny["plain"]["cpu"])
    return {
        "guard_overhead_pct": pct("guarded", "cpu"),
        "step_ms_plain": round(1e3 * m["plain"]["cpu"], 3),
        "step_ms_guarded": round(1e3 * m["guarded"]["cpu"], 3),
        "overhead": {
            "clock": "process CPU time (time.process_time), medians",
            "model": f"MLP {FULL.d_in}-{width}x{FULL.depth}-{FULL.classes}, AdamW",
            "batch": batch,
            "reps": reps,
            "aa_pct": pct("twin", "cpu"),
            "wall_pct": pct("guarded", "wall"),
            "wall_aa_pct": pct("twin", "wall"),
            "wall_step_ms_plain": round(1e3 * m["plain"]["wall"], 3),
            "wall_step_ms_guarded": round(1e3 * m["guarded"]["wall"], 3),
            "guard_us": round(us, 2),
            "guard_us_pct_of_step": round(100.0 * us / (1e6 * m["plain"]["cpu"]), 3),
            "tiny_step_us": round(1e6 * tiny["plain"]["cpu"], 2),
        },
    }


# -- main ------------------------------------------------------------------------------


def _print_row(r: Row) -> None:
    match = "-" if r.match is None else ("yes" if r.match else "NO")
    diff = "-" if r.max_abs_diff is None else f"{r.max_abs_diff:.1e}"
    print(
        f"{r.loop:<6}{r.run:<11}{'yes' if r.finished else 'NO':>5}{r.crashes:>8}{r.ooms:>6}"
        f"{r.samples_lost:>9}{r.samples_redone:>8}{r.steps:>7}{r.final_batch_size:>7}"
        f"{match:>7}{diff:>9}{r.wall_s:>8.2f}{r.time_lost_s:>8.2f}  {r.note}",
        flush=True,
    )


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="The last line printed is one JSON object with the figures.",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="64 training steps and 64 inference batches per run (256 each without); under 60 s",
    )
    ap.add_argument(
        "--cuda",
        action="store_true",
        help="use this machine's GPU: real CUDA allocations for the loops and the co-tenant",
    )
    ap.add_argument("--seed", type=int, default=0, help="data, model and co-tenant seed")
    ap.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads, fixed for stable timings"
    )
    ap.add_argument(
        "--checkpoint-every",
        type=int,
        help="unguarded runs: steps between checkpoints (commits for inference); default 8",
    )
    ap.add_argument(
        "--restart-ticks",
        type=int,
        help="unguarded runs: co-tenant ticks a crash and restart take; default 10",
    )
    ap.add_argument(
        "--overhead-reps",
        type=int,
        help="interleaved repetitions of the ~10 ms step for the overhead (1500; quick 400)",
    )
    ap.add_argument("--no-overhead", action="store_true", help="skip the overhead timing")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.cuda and not torch.cuda.is_available():
        print("--cuda: no usable CUDA device on this machine", file=sys.stderr)
        return 2
    kind = "cuda" if args.cuda else "sim"
    configs = {(False, False): FULL, (False, True): QUICK}
    configs.update({(True, False): CUDA_FULL, (True, True): CUDA_QUICK})
    cfg = replace(configs[args.cuda, args.quick], seed=args.seed)
    if args.checkpoint_every:
        cfg = replace(cfg, checkpoint_every=args.checkpoint_every)
    if args.restart_ticks is not None:
        cfg = replace(cfg, restart_ticks=args.restart_ticks)
    started = time.perf_counter()
    data = make_data(cfg)

    pt = calibrate(kind, cfg, data, train=True)
    pi = calibrate(kind, cfg, data, train=False)
    for name, p in (("train", pt), ("infer", pi)):
        print(
            f"# {name}: base {vramctl.format_bytes(p.base)}, whole step "
            f"{vramctl.format_bytes(p.need_full)}, in quarters "
            f"{vramctl.format_bytes(p.need_quarter)}; room {vramctl.format_bytes(p.room)}, "
            f"co-tenant up to {vramctl.format_bytes(p.ceiling)} (the whole batch fails above "
            f"{vramctl.format_bytes(p.full_fails_above)})",
            flush=True,
        )
    print(
        f"# {cfg.train_steps} training steps of {cfg.batch}, {cfg.infer_steps} inference "
        f"batches of {cfg.infer_batch}; {kind}, {torch.get_num_threads()} thread(s)",
        flush=True,
    )
    ref_w, ref_s = train_reference(kind, cfg, data)
    ref_out = infer_reference(kind, cfg, data)
    print(
        f"{'loop':<6}{'run':<11}{'done':>5}{'crashes':>8}{'ooms':>6}{'lost':>9}{'redone':>8}"
        f"{'steps':>7}{'batch':>7}{'match':>7}{'maxdiff':>9}{'wall s':>8}{'lost s':>8}"
    )
    rows: list[Row] = []
    for fn in (train_unguarded, train_accelerate, train_vramctl):
        rows.append(fn(kind, cfg, data, pt, ref_w))
        _print_row(rows[-1])
    for fn in (infer_unguarded, infer_accelerate, infer_vramctl):
        rows.append(fn(kind, cfg, data, pi, ref_out))
        _print_row(rows[-1])

    overhead: dict[str, Any] = {"guard_overhead_pct": None}
    if not args.no_overhead:
        reps = args.overhead_reps or (400 if args.quick else 1500)
        overhead = measure_overhead(reps)
        o = overhead["overhead"]
        print(
            f"# overhead (CPU time): plain {overhead['step_ms_plain']} ms, guarded "
            f"{overhead['step_ms_guarded']} ms per step: {overhead['guard_overhead_pct']:+.2f}% "
            f"(A/A {o['aa_pct']:+.2f}%); wall time {o['wall_pct']:+.2f}% (A/A "
            f"{o['wall_aa_pct']:+.2f}%); the guard's own cost on a {o['tiny_step_us']:.0f} us "
            f"step: {o['guard_us']} us",
            flush=True,
        )

    ours = [r for r in rows if r.run == "vramctl"]
    train_v = next(r for r in ours if r.loop == "train")
    infer_v = next(r for r in ours if r.loop == "infer")
    # Ticks at which the co-tenant held enough that the whole batch could not fit.
    held = share_over(cfg.seed, pt, cfg.train_steps)
    held_infer = share_over(cfg.seed + 1, pi, cfg.infer_steps)
    try:
        import accelerate

        acc_version = accelerate.__version__
    except ImportError:  # pragma: no cover - the comparison needs it
        acc_version = None
    summary: dict[str, Any] = {
        "benchmark": "oom_chaos",
        "side": kind,
        "quick": args.quick,
        "samples_lost": sum(r.samples_lost for r in ours),
        "crashes": sum(r.crashes for r in ours),
        "ooms_recovered": sum(r.ooms_recovered for r in ours),
        "weights_match": train_v.match,
        "outputs_match": infer_v.match,
        "max_abs_diff": train_v.max_abs_diff,
        **overhead,
        "train_steps": cfg.train_steps,
        "infer_batches": cfg.infer_steps,
        "batch": cfg.batch,
        "infer_batch": cfg.infer_batch,
        "pressure": {
            "train": {**asdict(pt), "ticks_whole_batch_cannot_fit_pct": held},
            "infer": {**asdict(pi), "ticks_whole_batch_cannot_fit_pct": held_infer},
        },
        "runs": [r.to_dict() for r in rows],
        "reference_train_s": round(ref_s, 3),
        "wall_s": round(time.perf_counter() - started, 1),
        "device": torch.cuda.get_device_name(0) if args.cuda else platform.processor() or "cpu",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "accelerate": acc_version,
    }
    print(json.dumps(summary))
    ok = summary["samples_lost"] == 0 and summary["crashes"] == 0 and summary["weights_match"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
