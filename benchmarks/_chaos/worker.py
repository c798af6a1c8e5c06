"""The co-tenant's own process (``oom_chaos.py --cotenant-worker``), and its self-test.

The worker plays the schedule on its device as the main process asks, over stdin and
stdout; ``selftest_cotenant`` (``oom_chaos.py --selftest-cotenant``) checks it and its
protocol, on the CPU or, with ``--cuda``, on the GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import traceback
from typing import Any

import psutil
import torch

import vramctl

from .cotenant import SCRIPT, ProcessCoTenant, SchedulePlayer, cotenant_schedule, held_per_tick


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

        def grab(n: int) -> torch.Tensor:
            try:
                return torch.empty(n, dtype=torch.uint8, device=dev)
            except torch.OutOfMemoryError:
                raise
            except RuntimeError as exc:  # uncached: cudaMalloc's own "out of memory"
                if "out of memory" not in str(exc).lower():
                    raise
                raise torch.OutOfMemoryError(str(exc).splitlines()[0]) from None

        player = SchedulePlayer(
            args.seed,
            args.ceiling,
            grab,
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
            if not cuda:
                return player.held
            # Uncached (PYTORCH_NO_CUDA_MEMORY_CACHING) the allocator counts nothing: the
            # driver's 2 MiB pages of the blocks held.
            pages = sum(-(-size // (2 << 20)) * (2 << 20) for _, size in player.blocks.values())
            return max(int(torch.cuda.memory_reserved(dev)), pages)

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
