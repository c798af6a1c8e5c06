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
  work.
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
absolute difference is printed too). Each sample is also looked for in what the
run produced: in training, a zero ``tally`` parameter added to the loss as
``tally[i].mean()`` (it changes neither the loss nor the model's gradients) has,
after each step, a gradient that counts how many times each sample's loss reached
the update; in inference, the outputs got back are matched to each sample's
reference output. ``samples_lost`` counts the samples found 0 times in the final
result, ``samples_duplicated`` those found more than once, and ``samples_redone``
the samples that went through the model again (work thrown away).

The guard's overhead is timed outside any simulated device, on a plain CPU
training step of about 10 ms, interleaved with the same step unguarded and with
a second, identical unguarded step (an A/A control: how far apart two identical
steps measure on this machine), medians of many repetitions.

The last line is one JSON object; its top-level ``samples_lost``,
``samples_duplicated``, ``samples_redone``, ``crashes``, ``ooms_recovered``,
``weights_match``, ``outputs_match``, ``guard_overhead_pct`` and ``aa_overhead_pct``
are vramctl's, and ``runs`` holds every run's row, with the co-tenant it had
(``cotenant``) and the co-tenant's grabs that were refused (``cotenant_refused``).
The exit status is 0 when vramctl lost and duplicated no sample, did not crash,
finished both loops, and its weights and outputs match.

    python benchmarks/oom_chaos.py --quick     # under a minute on a 2-core CPU
    python benchmarks/oom_chaos.py             # 256 training steps per run
    python benchmarks/oom_chaos.py --cuda      # on a machine with an NVIDIA GPU
    python benchmarks/oom_chaos.py --cuda --cotenant process   # a second process
    python benchmarks/oom_chaos.py --selftest-cotenant [--cuda]  # check the worker
"""

from __future__ import annotations

import faulthandler
import gc
import itertools
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

import torch
from torch import nn

import vramctl
from vramctl.guard import Guard

import _common
from _chaos import peers, runs
from _chaos.cotenant import THREAD, CotenantSpec, pressured, share_over
from _chaos.memory import Pressure, host_copy, load, load_infer, session
from _chaos.runs import Ledger, Row, close_row, infer_ledger, infer_model, infer_plan, weights
from _chaos.worker import cotenant_worker, selftest_cotenant
from _chaos.workload import (
    CUDA_FULL,
    CUDA_QUICK,
    FULL,
    QUICK,
    Config,
    Data,
    build_model,
    ce_loss,
    forward_pair,
    make_data,
    make_optimizer,
    plan,
    tallied,
    train_step,
)

#: The room the step has with no co-tenant: the whole step's need, plus this share.
HEADROOM = 0.10
#: The co-tenant always leaves a quarter-batch step this share more than it needs.
MARGIN = 0.20
#: A run still going after this many seconds has the stacks of every thread printed to
#: stderr (again every as many seconds), so that a stuck run says where it is.
WATCHDOG_S = 120.0


def calibrate(kind: str, cfg: Config, data: Data, train: bool) -> Pressure:
    """Measure a step's need, whole and in quarters, on a device with no pressure.

    On a GPU the need is the growth of the caching allocator's reserved bytes from an
    empty cache (what a ballast-capped device must give, after a tick that emptied
    the cache), not of the live tensors' bytes.
    """
    with session(kind, None) as s:
        if train:
            model = tallied(cfg)
            s.adopt(model)
            opt = make_optimizer(cfg, model.net)
            guard = Guard(model, opt, loss_fn=model.loss, forward=forward_pair)
            guard.step(load(s, data, 0, 0, cfg.batch))  # the optimizer's state is made here
            model.clear()
        else:
            model = infer_model(cfg, s)
            guard = Guard(model)
        needs = []
        for limit in (None, cfg.batch // 4 if train else cfg.infer_batch // 4):
            gc.collect()
            s.sync()
            base = s.footprint()  # on a GPU: reserved bytes, the cache emptied
            guard.piece_limit = limit
            s.reset_peak()
            if train:
                guard.step(load(s, data, 0, 0, cfg.batch))
                model.clear()
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


# -- vramctl's runs ----------------------------------------------------------------------


def _guard_figures(row: Row, guard: Guard) -> None:
    summary = guard.summary(events=0)
    row.ooms = summary["ooms"]
    row.ooms_recovered = summary["ooms_recovered"]
    row.time_lost_s = summary["time_lost_s"]
    row.extra["split_steps"] = summary["split_steps"]
    row.extra["final_piece_limit"] = summary["piece_limit"]
    counts: dict[str, int] = {}
    for ev in guard.events:
        counts[ev.kind] = counts.get(ev.kind, 0) + 1
    row.extra["events"] = counts


def _gave_up(row: Row, exc: BaseException) -> None:
    row.crashes += 1
    row.finished = False
    row.note = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"


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
    ledger = Ledger(steps)
    seen = [0]  # samples through the model's forward, failed attempts included

    def forward(m: nn.Module, b: Any) -> torch.Tensor:
        seen[0] += int(b[0].shape[0])
        out: torch.Tensor = m(b[0])
        return out

    with pressured(kind, p, cfg.seed, cot) as (s, tenant):
        model = tallied(cfg)
        s.adopt(model)
        opt = make_optimizer(cfg, model.net)
        guard = Guard(model, opt, loss_fn=model.loss, forward=forward, device=s.device)
        contributed = 0
        t_start = time.perf_counter()
        for i, (e, lo, hi) in enumerate(steps):
            tenant.tick()
            try:
                batch = load(s, data, e, lo, hi)
                result = guard.step(batch)
                del batch
            except Exception as exc:  # the guard gave up (or the batch's copy failed)
                _gave_up(row, exc)
                break
            with s.host():
                ledger.add(i, model.counts(hi - lo))
            row.steps += 1
            contributed += result.batch_size
        close_row(row, s, tenant, t_start, lambda: ledger, lambda: weights(model.net), ref)
        row.samples_redone = seen[0] - contributed
        _guard_figures(row, guard)
    return row


def infer_vramctl(
    kind: str,
    cfg: Config,
    data: Data,
    p: Pressure,
    ref: torch.Tensor,
    cot: CotenantSpec = THREAD,
) -> Row:
    row = Row("vramctl", "infer", batch_size=cfg.infer_batch, final_batch_size=cfg.infer_batch)
    steps = infer_plan(cfg, cfg.infer_batch)
    seen = [0]

    def forward(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        seen[0] += int(x.shape[0])
        out: torch.Tensor = m(x)
        return out

    with pressured(kind, p, cfg.seed + 1, cot) as (s, tenant):
        model = infer_model(cfg, s)
        guard = Guard(model, forward=forward, device=s.device)
        outs: list[tuple[int, torch.Tensor]] = []
        contributed = 0
        t_start = time.perf_counter()
        for i, (_, lo, hi) in enumerate(steps):
            tenant.tick()
            try:
                out = guard.infer(load_infer(s, data, lo, hi))
                outs.append((i, host_copy(s, out)))
                del out
            except Exception as exc:
                _gave_up(row, exc)
                break
            row.steps += 1
            contributed += outs[-1][1].shape[0]
            if outs[-1][1].shape[0] != hi - lo:
                row.note = "an output of the wrong length"
        close_row(
            row,
            s,
            tenant,
            t_start,
            lambda: infer_ledger(cfg, steps, outs, ref),
            lambda: [torch.cat([o for _, o in outs])] if outs else [],
            [ref],
        )
        row.samples_redone = seen[0] - contributed
        _guard_figures(row, guard)
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
        guard = Guard(model, make_optimizer(cfg, model), loss_fn=ce_loss, forward=forward_pair)

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
    plain, over the plain median; beside it, ``aa_overhead_pct``, the same for the
    A/A control (a second, identical plain step against the first): how far apart
    two identical steps measure on this machine, so an overhead within it is noise.
    Both again in wall time, and the guard's own cost in microseconds on a tiny step,
    with that step's A/A difference.
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
        "aa_overhead_pct": pct("twin", "cpu"),
        "step_ms_plain": round(1e3 * m["plain"]["cpu"], 3),
        "step_ms_guarded": round(1e3 * m["guarded"]["cpu"], 3),
        "overhead": {
            "clock": "process CPU time (time.process_time), medians",
            "model": f"MLP {FULL.d_in}-{width}x{FULL.depth}-{FULL.classes}, AdamW",
            "batch": batch,
            "reps": reps,
            "wall_pct": pct("guarded", "wall"),
            "wall_aa_pct": pct("twin", "wall"),
            "wall_step_ms_plain": round(1e3 * m["plain"]["wall"], 3),
            "wall_step_ms_guarded": round(1e3 * m["guarded"]["wall"], 3),
            "guard_us": round(us, 2),
            "guard_aa_us": round(1e6 * (tiny["twin"]["cpu"] - tiny["plain"]["cpu"]), 2),
            "guard_us_pct_of_step": round(100.0 * us / (1e6 * m["plain"]["cpu"]), 3),
            "tiny_step_us": round(1e6 * tiny["plain"]["cpu"], 2),
        },
    }


# -- main ------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--cotenant-worker"]:
        return cotenant_worker(argv[1:])
    ap = _common.parser(
        __doc__,
        quick="64 training steps and 64 inference batches per run (256 each without); under 60 s",
        cuda="use this machine's GPU: real CUDA allocations for the loops and the co-tenant",
        seed="data, model and co-tenant seed",
        threads=True,
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
    args = _common.parse(ap, argv)
    if args.cotenant == "process" and not (args.cuda or args.selftest_cotenant):
        ap.error(
            "--cotenant process needs --cuda: the second process takes real GPU memory, "
            "and the simulated GPU counts only this process's tensors"
        )
    if args.cotenant_mode != "lockstep" and args.cotenant != "process":
        ap.error("--cotenant-mode free needs --cotenant process")
    if args.cotenant_period <= 0:
        ap.error("--cotenant-period: give a positive number of seconds")
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
    ref_w, ref_s = runs.train_reference(kind, cfg, data)
    ref_out = runs.infer_reference(kind, cfg, data)
    print(runs.HEADER, flush=True)
    rows: list[Row] = []
    todo: list[tuple[Callable[..., Row], Pressure, Any]] = [
        (peers.train_unguarded, pt, ref_w),
        (peers.train_accelerate, pt, ref_w),
        (train_vramctl, pt, ref_w),
        (peers.infer_unguarded, pi, ref_out),
        (peers.infer_accelerate, pi, ref_out),
        (infer_vramctl, pi, ref_out),
    ]
    for fn, p, ref in todo:
        faulthandler.dump_traceback_later(WATCHDOG_S, repeat=True, file=sys.stderr)
        try:
            rows.append(runs.run(fn, kind, cfg, data, p, ref, cot))
        finally:
            faulthandler.cancel_dump_traceback_later()
        runs.print_row(rows[-1])

    overhead: dict[str, Any] = {"guard_overhead_pct": None, "aa_overhead_pct": None}
    if not args.no_overhead:
        overhead = measure_overhead(args.overhead_reps or (400 if args.quick else 1500))
        o = overhead["overhead"]
        print(
            f"# overhead (CPU time): plain {overhead['step_ms_plain']} ms, guarded "
            f"{overhead['step_ms_guarded']} ms per step: {overhead['guard_overhead_pct']:+.2f}% "
            f"(A/A {overhead['aa_overhead_pct']:+.2f}%); wall time {o['wall_pct']:+.2f}% (A/A "
            f"{o['wall_aa_pct']:+.2f}%); the guard's own cost on a {o['tiny_step_us']:.0f} us "
            f"step: {o['guard_us']} us (A/A {o['guard_aa_us']} us)",
            flush=True,
        )

    ours = [r for r in rows if r.run == "vramctl"]
    train_v = next(r for r in ours if r.loop == "train")
    infer_v = next(r for r in ours if r.loop == "infer")
    summary: dict[str, Any] = {
        "benchmark": "oom_chaos",
        "side": kind,
        "quick": args.quick,
        "cotenant": cot.kind,
        "cotenant_mode": cot.mode if cot.kind == "process" else None,
        "samples_lost": sum(r.samples_lost for r in ours),
        "samples_duplicated": sum(r.samples_duplicated for r in ours),
        "samples_redone": sum(r.samples_redone for r in ours),
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
            # Ticks at which the co-tenant held enough that the whole batch could not fit.
            "train": {
                **asdict(pt),
                "ticks_whole_batch_cannot_fit_pct": share_over(cfg.seed, pt, cfg.train_steps),
            },
            "infer": {
                **asdict(pi),
                "ticks_whole_batch_cannot_fit_pct": share_over(cfg.seed + 1, pi, cfg.infer_steps),
            },
        },
        "runs": [r.to_dict() for r in rows],
        "errors": [f"{r.loop} {r.run}: {r.note}" for r in rows if r.note.startswith("error: ")],
        "reference_train_s": round(ref_s, 3),
        "wall_s": round(time.perf_counter() - started, 1),
        **_common.machine(args.cuda),
        "accelerate": _common.version("accelerate"),
    }
    ok = summary["samples_lost"] == 0 and summary["samples_duplicated"] == 0
    ok = ok and summary["crashes"] == 0 and all(r.finished for r in ours)
    return _common.finish(summary, ok and bool(train_v.match) and bool(infer_v.match))


if __name__ == "__main__":
    sys.exit(main())
