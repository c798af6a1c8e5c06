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

By default the co-tenant lives in this process (``--cotenant thread``). With
``--cuda --cotenant process`` it is a second Python process (this file, run with
``--cotenant-worker``) that takes and frees the same schedule's blocks with its own
``cudaMalloc``: this process sees them only as a failed allocation, and its caching
allocator frees its cache, retries and raises ``torch.OutOfMemoryError``. The
worker starts, and makes its CUDA context, before the ballast is measured. In
lock-step (``--cotenant-mode lockstep``, the default) every tick is a line down the
worker's stdin, answered once its grabs and releases are done and synchronised
(releases go back to the driver with ``torch.cuda.empty_cache()``), so every run
still sees the same pressure at the same tick; before each tick this process
synchronises and empties its own cache, so that the schedule, not what this
process keeps cached, decides whether the co-tenant's grabs find room.
``--cotenant-mode free`` lets the worker tick on its own clock
(``--cotenant-period``), and runs no longer see the same pressure. The worker exits
at the end of its input (when this process ends, however it ends) and is ended in
a ``finally``. ``--selftest-cotenant`` checks the worker and its protocol (host
memory; with ``--cuda``, the GPU).

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
and ``runs`` holds every run's row, with the co-tenant it had (``cotenant``) and
the co-tenant's grabs that were refused (``cotenant_refused``).

    python benchmarks/oom_chaos.py --quick     # under a minute on a 2-core CPU
    python benchmarks/oom_chaos.py             # 256 training steps per run
    python benchmarks/oom_chaos.py --cuda      # on a machine with an NVIDIA GPU
    python benchmarks/oom_chaos.py --cuda --cotenant process   # a second process
    python benchmarks/oom_chaos.py --selftest-cotenant [--cuda]  # check the worker
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import math
import os
import platform
import queue
import random
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import psutil
import torch
from torch import nn

import vramctl
from vramctl.device import SimulatedDevice
from vramctl.guard import Guard, available_bytes, is_oom

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
#: This file, run again as the co-tenant's own process (``--cotenant process``).
SCRIPT = os.path.abspath(__file__)
#: Seconds the co-tenant's process may take to start (Python, torch, the CUDA context),
#: and to answer a tick.
WORKER_START_TIMEOUT_S = 120.0
WORKER_TIMEOUT_S = 60.0


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


def held_per_tick(seed: int, ceiling: int) -> Iterator[int]:
    """The bytes the schedule holds after each tick, when every grab succeeds."""
    held: dict[int, int] = {}
    for acts in cotenant_schedule(seed, ceiling):
        for act, bid, size in acts:
            if act == "grab":
                held[bid] = size
            else:
                held.pop(bid, None)
        yield sum(held.values())


class SchedulePlayer:
    """Plays the schedule with a ``grab`` function: the blocks held, and the grabs refused.

    Both co-tenants use it: the thread (``grab`` is the session's) and the co-tenant's
    own process (``grab`` is ``torch.empty`` on its device, and ``after_release``
    gives the freed memory back to the driver at once).
    """

    def __init__(
        self,
        seed: int,
        ceiling: int,
        grab: Callable[[int], torch.Tensor],
        after_release: Callable[[], None] | None = None,
    ) -> None:
        self.schedule = cotenant_schedule(seed, ceiling)
        self.grab = grab
        self.after_release = after_release
        self.blocks: dict[int, tuple[torch.Tensor, int]] = {}
        self.ticks = 0
        self.refused = 0
        self.held = 0  # the schedule's bytes of the blocks held now
        self.peak_held = 0

    def play(self, n: int = 1) -> None:
        for _ in range(n):
            for act, bid, size in next(self.schedule):
                if act == "release":
                    block = self.blocks.pop(bid, None)
                    if block is not None:
                        self.held -= block[1]
                        del block
                        if self.after_release is not None:
                            self.after_release()
                    continue
                try:
                    self.blocks[bid] = (self.grab(size), size)
                except torch.OutOfMemoryError as exc:  # fragmentation, or the other process
                    self.refused += 1
                    free_failed(exc)
                    continue
                self.held += size
                self.peak_held = max(self.peak_held, self.held)
            self.ticks += 1

    def clear(self) -> None:
        self.blocks.clear()
        self.held = 0


class CoTenant:
    """The co-tenant in this process: real blocks of the session's memory, one tick a call."""

    kind = "thread"

    def __init__(self, s: Session, seed: int, ceiling: int) -> None:
        self.player = SchedulePlayer(seed, ceiling, s.grab)

    @property
    def ticks(self) -> int:
        return self.player.ticks

    @property
    def refused(self) -> int:
        return self.player.refused

    def tick(self, n: int = 1) -> None:
        self.player.play(n)

    def figures(self) -> dict[str, Any]:
        return {"cotenant": self.kind, "cotenant_refused": self.refused}

    def close(self) -> None:
        self.player.clear()


class CotenantStartError(RuntimeError):
    """The co-tenant's process did not start: the benchmark stops (every run would fail)."""


class ProcessCoTenant:
    """The co-tenant in a second process (this file run with ``--cotenant-worker``).

    Its grabs are real allocations of another process: on a GPU this process's
    caching allocator sees them only as a failed ``cudaMalloc``, after which it
    frees its cache, retries and raises ``torch.OutOfMemoryError``.

    ``lockstep``: each :meth:`tick` sends "tick N" down the worker's stdin and waits
    for its answer, sent once the worker has played those ticks (its releases given
    back to the driver, ``torch.cuda.synchronize()`` done), so every run sees the
    same pressure at the same tick. ``free``: the first tick starts the worker's own
    clock (a tick every ``period`` seconds); later ticks only count. With
    ``release_cache`` (on a GPU) every tick first synchronises and empties this
    process's cache, so that the schedule, not what this process happens to keep
    cached, decides whether the co-tenant's grabs find room.
    """

    kind = "process"

    def __init__(
        self,
        device: str,
        seed: int,
        ceiling: int,
        *,
        mode: str = "lockstep",
        period: float = 0.02,
        release_cache: bool = False,
        start_timeout: float = WORKER_START_TIMEOUT_S,
        timeout: float = WORKER_TIMEOUT_S,
    ) -> None:
        self.mode = mode
        self.release_cache = release_cache
        self.timeout = timeout
        self.ticks = 0
        self.last: dict[str, Any] = {}
        self.round_trips: list[float] = []
        self.context_bytes: int | None = None  # set by start_cotenant on a GPU
        self.error = ""
        argv = [sys.executable, SCRIPT, "--cotenant-worker", "--worker-device", device]
        argv += ["--seed", str(seed), "--ceiling", str(ceiling), "--mode", mode]
        argv += ["--period", repr(period)]
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        self.pid = self.proc.pid
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        try:
            self.hello = self._answer("ready", start_timeout)
        except Exception as exc:
            self.close()
            raise CotenantStartError(f"the co-tenant's process did not start: {exc}") from exc
        except BaseException:
            self.close()
            raise
        self.start_s = time.perf_counter() - t0

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with contextlib.suppress(OSError, ValueError):
            for line in self.proc.stdout:
                self._lines.put(line)
        self._lines.put(None)

    def _answer(self, key: str, timeout: float) -> dict[str, Any]:
        """The worker's next answer that has ``key``; its other lines go to stderr."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(
                    f"the co-tenant's process (pid {self.pid}) did not answer in {timeout:g} s"
                )
            try:
                line = self._lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                try:
                    code: int | None = self.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    code = None
                raise RuntimeError(f"the co-tenant's process (pid {self.pid}) exited ({code})")
            try:
                msg = json.loads(line)
            except ValueError:
                msg = None
            if not isinstance(msg, dict):
                print(f"co-tenant: {line.rstrip()}", file=sys.stderr, flush=True)
                continue
            if "error" in msg:
                raise RuntimeError(f"the co-tenant's process failed: {msg['error']}")
            if key in msg:
                return msg

    def _ask(self, command: str) -> dict[str, Any]:
        stdin = self.proc.stdin
        assert stdin is not None
        try:
            stdin.write(command + "\n")
            stdin.flush()
        except (OSError, ValueError) as exc:
            code = self.proc.poll()
            raise RuntimeError(
                f"the co-tenant's process (pid {self.pid}) is gone ({code})"
            ) from exc
        self.last = self._answer("ticks", self.timeout)
        return self.last

    @property
    def refused(self) -> int:
        return int(self.last.get("refused", 0))

    def tick(self, n: int = 1) -> None:
        if self.release_cache:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        if self.mode == "lockstep" or self.ticks == 0:
            t0 = time.perf_counter()
            got = self._ask(f"tick {n}")["ticks"]
            self.round_trips.append(time.perf_counter() - t0)
            if self.mode == "lockstep" and got != self.ticks + n:
                raise RuntimeError(f"the co-tenant is at tick {got}, not {self.ticks + n}")
        self.ticks += n

    def stats(self) -> dict[str, Any]:
        return self._ask("stats")

    def figures(self) -> dict[str, Any]:
        try:
            st = self.stats()
        except RuntimeError as exc:  # the worker died: report what it said last
            st, self.error = self.last, str(exc)
        rt = statistics.median(self.round_trips) if self.round_trips else None
        out = {
            "cotenant": self.kind,
            "cotenant_mode": self.mode,
            "cotenant_refused": st.get("refused"),
            "cotenant_worker_ticks": st.get("ticks"),
            "cotenant_peak_held": st.get("peak_held"),
            "cotenant_peak_reserved": st.get("peak_reserved"),
            "cotenant_context_bytes": self.context_bytes,
            "cotenant_start_s": round(self.start_s, 2),
            "cotenant_tick_ms": None if rt is None else round(1e3 * rt, 3),
        }
        if self.error:
            out["cotenant_error"] = self.error
        return out

    def close(self) -> None:
        """Ask the worker to quit (then EOF on its stdin), and end it if it does not."""
        proc = self.proc
        if proc.stdin is not None:
            with contextlib.suppress(OSError, ValueError):
                if proc.poll() is None:
                    proc.stdin.write("quit\n")
                    proc.stdin.flush()
            with contextlib.suppress(OSError, ValueError):
                proc.stdin.close()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._reader.join(timeout=5)
        if proc.stdout is not None:
            with contextlib.suppress(OSError, ValueError):
                proc.stdout.close()


Tenant = CoTenant | ProcessCoTenant


@dataclass(frozen=True)
class CotenantSpec:
    """Which co-tenant a run has: "thread" (this process) or "process" (a second one)."""

    kind: str = "thread"
    mode: str = "lockstep"
    period: float = 0.02


THREAD = CotenantSpec()


def start_cotenant(s: Session, seed: int, ceiling: int, spec: CotenantSpec) -> Tenant:
    if spec.kind == "thread":
        return CoTenant(s, seed, ceiling)
    if not isinstance(s, CudaSession):
        raise ValueError("a co-tenant in another process needs a real GPU (--cuda)")
    free0 = int(torch.cuda.mem_get_info()[0])
    tenant = ProcessCoTenant(
        f"cuda:{torch.cuda.current_device()}",
        seed,
        ceiling,
        mode=spec.mode,
        period=spec.period,
        release_cache=True,
    )
    tenant.context_bytes = free0 - int(torch.cuda.mem_get_info()[0])
    return tenant


@contextlib.contextmanager
def pressured(
    kind: str, p: Pressure, seed: int, spec: CotenantSpec
) -> Iterator[tuple[Session, Tenant]]:
    """A session of ``p.budget`` bytes and its co-tenant, closed (its process ended) at exit.

    The co-tenant starts first: on a GPU, the ballast is measured with a second
    process's CUDA context already on the device.
    """
    with session(kind, p.budget) as s:
        tenant = start_cotenant(s, seed, p.ceiling, spec)
        try:
            if isinstance(s, CudaSession):
                s.limit(p.budget)
            yield s, tenant
        finally:
            tenant.close()


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
    held = held_per_tick(seed, p.ceiling)
    over = sum(next(held) > p.full_fails_above for _ in range(ticks))
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
    kind: str,
    cfg: Config,
    data: Data,
    p: Pressure,
    ref: list[torch.Tensor],
    cot: CotenantSpec = THREAD,
) -> Row:
    row = Row("unguarded", "train", batch_size=cfg.batch, final_batch_size=cfg.batch)
    steps = plan(cfg.n_samples, cfg.epochs, cfg.batch)
    with pressured(kind, p, cfg.seed, cot) as (s, tenant):
        model = build_model(cfg)
        s.adopt(model)
        opt = make_optimizer(cfg, model)
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
            except Exception as exc:  # an OOM crashes the job; any other error is a bug
                if not is_oom(exc):
                    raise
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
        row.extra.update(tenant.figures())
        row.samples_redone = row.samples_lost
        with s.host():
            row.match, row.max_abs_diff = compare(weights(model), ref)
        row.extra["checkpoint_every"] = cfg.checkpoint_every
        row.extra["restart_ticks"] = cfg.restart_ticks
    return row


def train_accelerate(
    kind: str,
    cfg: Config,
    data: Data,
    p: Pressure,
    ref: list[torch.Tensor],
    cot: CotenantSpec = THREAD,
) -> Row:
    from accelerate.utils import find_executable_batch_size

    row = Row("accelerate", "train", batch_size=cfg.batch)
    with pressured(kind, p, cfg.seed, cot) as (s, tenant):
        model = build_model(cfg)
        s.adopt(model)
        opt = make_optimizer(cfg, model)
        initial = checkpoint(s, 0, model, opt)
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
        row.extra.update(tenant.figures())
        row.samples_redone = row.samples_lost
        with s.host():
            row.match, row.max_abs_diff = compare(weights(model), ref)
        row.extra["batch_sizes_tried"] = attempts
    return row


def train_vramctl(
    kind: str,
    cfg: Config,
    data: Data,
    p: Pressure,
    ref: list[torch.Tensor],
    cot: CotenantSpec = THREAD,
) -> Row:
    row = Row("vramctl", "train", batch_size=cfg.batch, final_batch_size=cfg.batch)
    steps = plan(cfg.n_samples, cfg.epochs, cfg.batch)
    seen = [0]  # samples through the model's forward, failed attempts included

    def forward(m: nn.Module, b: Any) -> torch.Tensor:
        seen[0] += int(b[0].shape[0])
        out: torch.Tensor = m(b[0])
        return out

    with pressured(kind, p, cfg.seed, cot) as (s, tenant):
        model = build_model(cfg)
        s.adopt(model)
        opt = make_optimizer(cfg, model)
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
        row.extra.update(tenant.figures())
        row.final_batch_size = cfg.batch
        with s.host():
            row.match, row.max_abs_diff = compare(weights(model), ref)
        row.extra["split_steps"] = summary["split_steps"]
        row.extra["final_piece_limit"] = summary["piece_limit"]
        row.extra["events"] = _event_counts(guard)
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
    kind: str,
    cfg: Config,
    data: Data,
    p: Pressure,
    ref: list[torch.Tensor],
    cot: CotenantSpec = THREAD,
) -> Row:
    """Outputs are committed (written out) every ``checkpoint_every`` batches; a crash loses
    the uncommitted ones and the failed batch."""
    row = Row("unguarded", "infer", batch_size=cfg.infer_batch, final_batch_size=cfg.infer_batch)
    steps = infer_plan(cfg, cfg.infer_batch)
    with pressured(kind, p, cfg.seed + 1, cot) as (s, tenant):
        model = infer_model(cfg, s)
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
            except Exception as exc:
                if not is_oom(exc):
                    raise
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
        row.extra.update(tenant.figures())
        row.samples_redone = row.samples_lost
        with s.host():
            row.match, row.max_abs_diff = compare([torch.cat(committed)], ref)
    return row


def infer_accelerate(
    kind: str,
    cfg: Config,
    data: Data,
    p: Pressure,
    ref: list[torch.Tensor],
    cot: CotenantSpec = THREAD,
) -> Row:
    from accelerate.utils import find_executable_batch_size

    row = Row("accelerate", "infer", batch_size=cfg.infer_batch)
    with pressured(kind, p, cfg.seed + 1, cot) as (s, tenant):
        model = infer_model(cfg, s)
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
        row.extra.update(tenant.figures())
        row.samples_redone = row.samples_lost
        with s.host():
            row.match, row.max_abs_diff = compare([torch.cat(result)] if result else [], ref)
        row.extra["batch_sizes_tried"] = attempts
    return row


def infer_vramctl(
    kind: str,
    cfg: Config,
    data: Data,
    p: Pressure,
    ref: list[torch.Tensor],
    cot: CotenantSpec = THREAD,
) -> Row:
    row = Row("vramctl", "infer", batch_size=cfg.infer_batch, final_batch_size=cfg.infer_batch)
    seen = [0]

    def forward(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        seen[0] += int(x.shape[0])
        out: torch.Tensor = m(x)
        return out

    with pressured(kind, p, cfg.seed + 1, cot) as (s, tenant):
        model = infer_model(cfg, s)
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
        row.extra.update(tenant.figures())
        with s.host():
            row.match, row.max_abs_diff = compare([torch.cat(outs)] if outs else [], ref)
        row.extra["split_steps"] = summary["split_steps"]
        row.extra["final_piece_limit"] = summary["piece_limit"]
        row.extra["events"] = _event_counts(guard)
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


# -- the co-tenant's own process ---------------------------------------------------------


def cotenant_worker(argv: list[str]) -> int:
    """The co-tenant's process: plays the schedule on its device, as the main process asks.

    In, on stdin, one command a line: "tick N" (lockstep: play N ticks and answer
    once done; free: start ticking every ``--period`` seconds and answer at once),
    "stats", "quit". End of input (the main process is gone) ends it too. Out, one
    JSON object a line: {"ready": ...} once the device is initialised, then one answer
    per command with the ticks played, the grabs refused and the bytes held.
    """
    ap = argparse.ArgumentParser(prog="oom_chaos.py --cotenant-worker")
    ap.add_argument("--worker-device", default="cuda", help="cuda, cuda:N, or cpu (a check)")
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--ceiling", type=int, required=True)
    ap.add_argument("--mode", choices=("lockstep", "free"), default="lockstep")
    ap.add_argument("--period", type=float, default=0.02)
    args = ap.parse_args(argv)
    out = os.fdopen(os.dup(1), "w", buffering=1)  # the answers; stray prints go to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def say(**msg: Any) -> None:
        out.write(json.dumps(msg) + "\n")
        out.flush()

    try:
        torch.set_num_threads(1)
        dev = torch.device(args.worker_device)
        cuda = dev.type == "cuda"
        if cuda:
            if not torch.cuda.is_available():
                raise RuntimeError("no usable CUDA device in the co-tenant's process")
            torch.cuda.set_device(dev)
            torch.zeros(1, device=dev)  # the CUDA context and a kernel, before "ready"
            torch.cuda.synchronize(dev)
            torch.cuda.empty_cache()
        player = SchedulePlayer(
            args.seed,
            args.ceiling,
            lambda n: torch.empty(n, dtype=torch.uint8, device=dev),
            torch.cuda.empty_cache if cuda else None,  # freed memory goes back to the driver
        )
        lock = threading.Lock()
        stop = threading.Event()
        peak_reserved = 0

        def play(n: int) -> None:
            nonlocal peak_reserved
            with lock:
                player.play(n)
                if cuda:
                    torch.cuda.synchronize(dev)
                peak_reserved = max(peak_reserved, reserved())

        def reserved() -> int:
            return int(torch.cuda.memory_reserved(dev)) if cuda else player.held

        def stats() -> None:
            with lock:
                say(
                    ticks=player.ticks,
                    refused=player.refused,
                    held=player.held,
                    peak_held=player.peak_held,
                    reserved=reserved(),
                    peak_reserved=peak_reserved,
                )

        def free_running() -> None:
            try:
                while not stop.wait(args.period):
                    play(1)
            except Exception:  # the answers to "stats" show the clock stopped
                traceback.print_exc()

        clock: threading.Thread | None = None
        say(ready=True, pid=os.getpid(), device=str(dev))
        for line in sys.stdin:
            cmd, *rest = line.split() or [""]
            if cmd == "tick" and args.mode == "lockstep":
                play(int(rest[0]) if rest else 1)
            elif cmd == "tick" and clock is None:
                clock = threading.Thread(target=free_running, daemon=True)
                clock.start()
            elif cmd == "quit":
                break
            elif cmd not in ("tick", "stats"):
                say(error=f"unknown command {line.strip()!r}")
                continue
            stats()
        stop.set()
        if clock is not None:
            clock.join()
        with lock:
            player.clear()
        return 0
    except Exception as exc:
        say(error=f"{type(exc).__name__}: {exc}")
        return 1


_ORPHAN_PARENT = """
import subprocess, sys
p = subprocess.Popen(sys.argv[1:], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
print(p.pid, p.stdout.readline().strip(), flush=True)
sys.stdin.read()
"""


def _gone(pid: int, within: float) -> str:
    """ "exited" or "zombie" (exited, not yet reaped by whoever adopted it) once process
    ``pid`` has ended; "" when it is still running after ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return "zombie"
        except psutil.NoSuchProcess:
            return "exited"
        if time.monotonic() >= deadline:
            return ""
        time.sleep(0.05)


def selftest_cotenant(cuda: bool) -> int:
    """Check the co-tenant's process and its protocol; on the CPU, or on the GPU with --cuda.

    Lock-step ticks are answered, in step, with the blocks the schedule holds; the
    worker exits at end of input and is reaped; free-running ticks on its own; a
    worker that dies is reported, not waited on; a worker whose parent is killed
    exits. With ``cuda``, also: its grabs are seen by this process's
    ``torch.cuda.mem_get_info``, and its grabs are refused, without harm, when
    this process has taken the memory.
    """
    seed = 3
    ceiling = (1 << 30) if cuda else (64 << 20)
    device = "cuda:0" if cuda else "cpu"
    results: dict[str, Any] = {"device": device}
    failures: list[str] = []

    def check(name: str, ok: bool, detail: Any = None) -> None:
        print(f"{'ok  ' if ok else 'FAIL'} {name}" + (f": {detail}" if detail is not None else ""))
        if not ok:
            failures.append(name)

    free0 = int(torch.cuda.mem_get_info()[0]) if cuda else 0
    # 1. lock-step: every answer in step, holding what the schedule holds.
    t = ProcessCoTenant(device, seed, ceiling)
    try:
        results["start_s"] = round(t.start_s, 2)
        if cuda:
            results["context_bytes"] = free0 - int(torch.cuda.mem_get_info()[0])
        want = held_per_tick(seed, ceiling)
        wrong = 0
        for n in [1] * 40 + [10, 10]:
            t.tick(n)
            for _ in range(n):
                expected = next(want)
            wrong += t.last["held"] != expected
        check("lock-step ticks in step", t.last["ticks"] == t.ticks == 60, t.last)
        check("blocks held as scheduled", wrong == 0, f"{wrong} ticks differ")
        results["tick_ms"] = round(1e3 * statistics.median(t.round_trips), 3)
        if cuda:
            drop = free0 - int(torch.cuda.mem_get_info()[0])
            seen = drop - results["context_bytes"]
            check(
                "its memory is seen here",
                abs(seen - t.last["reserved"]) <= 64 << 20,
                f"free fell {vramctl.format_bytes(drop)}: context "
                f"{vramctl.format_bytes(results['context_bytes'])} + "
                f"{vramctl.format_bytes(seen)}; it reserves "
                f"{vramctl.format_bytes(t.last['reserved'])} for "
                f"{vramctl.format_bytes(t.last['held'])} held",
            )
            # Take nearly all the free memory here: a grab larger than what is left and
            # what it gives back meanwhile must be refused.
            ballast: torch.Tensor | None = None
            with contextlib.suppress(torch.OutOfMemoryError):
                spare = int(torch.cuda.mem_get_info()[0]) - (16 << 20)
                ballast = torch.empty(spare, dtype=torch.uint8, device="cuda")
            if ballast is not None:
                sched = cotenant_schedule(seed, ceiling)
                for _ in range(t.ticks):
                    next(sched)
                biggest = 0
                for _ in range(60):
                    biggest = max([biggest] + [n for act, _, n in next(sched) if act == "grab"])
                room = (16 << 20) + t.last["reserved"] + (2 << 20)
                before = t.refused
                t.tick(60)
                must = biggest > room
                check(
                    "grabs refused when the GPU is full",
                    t.refused > before or not must,
                    f"{t.refused - before} refused; the largest grab "
                    f"{vramctl.format_bytes(biggest)}, "
                    f"{'more' if must else 'no more'} than the "
                    f"{vramctl.format_bytes(room)} it could find",
                )
                del ballast
                torch.cuda.empty_cache()
                t.tick(1)
                check("still answering after refusals", t.last["ticks"] == t.ticks, t.last)
            else:
                print("skip the refusal check: no ballast could be allocated here")
        # 2. end of input: it exits by itself, and is reaped.
        assert t.proc.stdin is not None
        t.proc.stdin.close()
        try:
            code: int | None = t.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            code = None
        check("exits at end of input", code == 0, f"exit status {code}")
        check("reaped (no zombie)", not psutil.pid_exists(t.pid), t.pid)
    finally:
        t.close()
    # 3. free-running: it ticks on its own clock.
    t = ProcessCoTenant(device, seed, ceiling, mode="free", period=0.01)
    try:
        t.tick()
        time.sleep(0.5)
        st = t.stats()
        check("free-running ticks by itself", st["ticks"] >= 10, st)
    finally:
        t.close()
    check("quit ends it", t.proc.returncode == 0, t.proc.returncode)
    # 4. a worker that dies: the next tick says so at once, and close() is quiet.
    t = ProcessCoTenant(device, seed, ceiling)
    try:
        t.proc.kill()
        t0 = time.perf_counter()
        try:
            t.tick()
            check("a dead worker is reported", False)
        except RuntimeError as exc:
            check("a dead worker is reported", time.perf_counter() - t0 < 10, exc)
    finally:
        t.close()
    # 5. its parent killed: it reads end of input and exits.
    argv = [sys.executable, SCRIPT, "--cotenant-worker", "--worker-device", device]
    argv += ["--seed", str(seed), "--ceiling", str(ceiling)]
    parent = subprocess.Popen(
        [sys.executable, "-c", _ORPHAN_PARENT, *argv],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    pid = 0
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline().split()[0])
        parent.kill()
        parent.wait()
        gone = _gone(pid, 30)
        check("exits when its parent is killed", bool(gone), f"pid {pid}: {gone or 'running'}")
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        for pipe in (parent.stdin, parent.stdout):
            if pipe is not None:
                pipe.close()
        if pid and not _gone(pid, 0.1):
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()
    # 6. on this CPU-only machine, a CUDA worker says why it cannot start.
    if not torch.cuda.is_available():
        try:
            ProcessCoTenant("cuda", seed, ceiling).close()
            check("a CUDA worker without CUDA fails", False)
        except RuntimeError as exc:
            check("a CUDA worker without CUDA fails", "no usable CUDA" in str(exc), exc)
    results["failures"] = failures
    print(json.dumps({"selftest": "cotenant", **results}))
    return 1 if failures else 0


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


def _run(fn: Callable[..., Row], *args: Any) -> Row:
    """One run; an error that is not an OOM ends that run only, reported in its row."""
    try:
        return fn(*args)
    except CotenantStartError:
        raise
    except Exception as exc:
        traceback.print_exc()
        loop, run = fn.__name__.split("_", 1)
        first = str(exc).splitlines()[0][:200] if str(exc) else ""
        return Row(run, loop, finished=False, note=f"error: {type(exc).__name__}: {first}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--cotenant-worker"]:
        return cotenant_worker(argv[1:])
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
    ap.add_argument(
        "--cotenant",
        choices=("thread", "process"),
        default="thread",
        help="thread: the co-tenant's blocks are this process's (the default); process: a "
        "second Python process takes and frees GPU memory (needs --cuda)",
    )
    ap.add_argument(
        "--cotenant-mode",
        choices=("lockstep", "free"),
        default="lockstep",
        help="--cotenant process: lockstep (the default) plays one tick of the schedule before "
        "every step attempt and waits for it; free ticks on the process's own clock, so runs "
        "no longer see the same pressure",
    )
    ap.add_argument(
        "--cotenant-period",
        type=float,
        default=0.02,
        metavar="SECONDS",
        help="--cotenant-mode free: seconds between ticks (default 0.02)",
    )
    ap.add_argument(
        "--selftest-cotenant",
        action="store_true",
        help="check the co-tenant's process and its protocol, then exit (with --cuda: on the "
        "GPU; else with host memory)",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.cotenant == "process" and not (args.cuda or args.selftest_cotenant):
        ap.error(
            "--cotenant process needs --cuda: the second process takes real GPU memory, "
            "and the simulated GPU counts only this process's tensors"
        )
    if args.cotenant_mode != "lockstep" and args.cotenant != "process":
        ap.error("--cotenant-mode free needs --cotenant process")
    if args.cotenant_period <= 0:
        ap.error("--cotenant-period: give a positive number of seconds")
    if args.cuda and not torch.cuda.is_available():
        print("--cuda: no usable CUDA device on this machine", file=sys.stderr)
        return 2
    if args.selftest_cotenant:
        return selftest_cotenant(cuda=args.cuda)
    cot = CotenantSpec(args.cotenant, args.cotenant_mode, args.cotenant_period)
    cot_text = cot.kind if cot.kind == "thread" else f"{cot.kind} ({cot.mode})"
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
        f"batches of {cfg.infer_batch}; {kind}, {torch.get_num_threads()} thread(s); "
        f"co-tenant: {cot_text}",
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
        rows.append(_run(fn, kind, cfg, data, pt, ref_w, cot))
        _print_row(rows[-1])
    for fn in (infer_unguarded, infer_accelerate, infer_vramctl):
        rows.append(_run(fn, kind, cfg, data, pi, ref_out, cot))
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
        "cotenant": cot.kind,
        "cotenant_mode": cot.mode if cot.kind == "process" else None,
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
        "errors": [f"{r.loop} {r.run}: {r.note}" for r in rows if r.note.startswith("error: ")],
        "reference_train_s": round(ref_s, 3),
        "wall_s": round(time.perf_counter() - started, 1),
        "device": torch.cuda.get_device_name(0) if args.cuda else platform.processor() or "cpu",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "accelerate": acc_version,
    }
    print(json.dumps(summary))
    ok = summary["samples_lost"] == 0 and summary["crashes"] == 0 and summary["weights_match"]
    ok = ok and all(r.finished for r in ours)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
