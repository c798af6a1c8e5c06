"""The co-tenant: a seeded schedule of grabs and releases, played in this process or another.

``cotenant_schedule`` is a pure function of the seed and the ceiling, so every run sees
the same pressure at the same tick. ``CoTenant`` plays it with the session's own
blocks, one tick a call; ``ProcessCoTenant`` has a second Python process play it (on a
GPU, blocks of another process's ``cudaMalloc``), driven over its stdin and stdout
(the worker's side is ``worker.py``). ``pressured`` gives a run its budget and its
co-tenant, and ends the co-tenant's process however the run ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .memory import CudaSession, Pressure, Session, session
from _common import free_failed

#: The co-tenant's small background blocks take at most this share of its ceiling.
JITTER = 0.08
#: Chance per quiet tick that a burst starts; a burst holds for 2 to 8 ticks.
BURST_P = 0.10
BURST_TICKS = (2, 8)
#: The script the co-tenant's own process runs (``oom_chaos.py --cotenant-worker``).
SCRIPT = str(Path(__file__).resolve().parents[1] / "oom_chaos.py")
#: Seconds the co-tenant's process may take to start (Python, torch, the CUDA context),
#: and to answer a tick.
WORKER_START_TIMEOUT_S = 120.0
WORKER_TIMEOUT_S = 60.0


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


def share_over(seed: int, p: Pressure, ticks: int) -> float:
    """Percent of the first ``ticks`` ticks at which the co-tenant holds so much that a
    whole-batch step cannot fit."""
    held = held_per_tick(seed, p.ceiling)
    over = sum(next(held) > p.full_fails_above for _ in range(ticks))
    return round(100.0 * over / ticks, 1)


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
    """The co-tenant in a second process (``oom_chaos.py --cotenant-worker``).

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
        env = dict(os.environ)
        if device.startswith("cuda"):
            # Its grabs are plain cudaMallocs (the driver's 2 MiB pages), freed at once: its
            # caching allocator would give every 1 to 10 MiB block a 20 MiB segment, more
            # than the whole batch's margin, and the schedule's bytes would not be its own.
            env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, env=env
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
