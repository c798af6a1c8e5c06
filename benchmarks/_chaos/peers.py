"""The peers' runs: unguarded (crash, restart from a checkpoint) and Accelerate's.

- unguarded: an OOM crashes the job; it restarts from its last checkpoint (every
  ``checkpoint_every`` steps, kept in host memory; inference commits its outputs as
  often) after ``restart_ticks`` ticks of the co-tenant's schedule, and redoes the
  lost work.
- accelerate: the loop inside ``accelerate.utils.find_executable_batch_size``, as
  Accelerate documents it: on an OOM the whole function runs again from a fresh model
  and optimizer with 0.9 times the batch size.

``samples_redone`` counts the samples whose work was thrown away and done again (the
steps since the checkpoint and the failed batch; everything before each restart).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from vramctl.guard import is_oom

from .cotenant import THREAD, CotenantSpec, pressured
from .memory import Pressure, Session, checkpoint, host_copy, load, load_infer, restore
from .runs import Ledger, Row, close_row, infer_ledger, infer_model, infer_plan, weights
from .workload import Config, Data, Tallied, make_optimizer, plan, tallied
from _common import accelerate_search, free_failed

#: An unguarded run gives up (unfinished) after this many crashes per step of its plan:
#: it restarts from its last checkpoint, and where the whole batch hardly ever fits it
#: would crash and restart without end.
MAX_CRASHES_PER_STEP = 4


def _crashed_out(row: Row, steps: int) -> bool:
    if row.crashes < MAX_CRASHES_PER_STEP * steps:
        return False
    row.finished = False
    row.note = f"gave up after {row.crashes} crashes (the whole batch kept failing)"
    return True


def _tallied_step(
    s: Session, data: Data, model: Tallied, opt: torch.optim.Optimizer, e: int, lo: int, hi: int
) -> None:
    # In a function of its own, so that a failed step's tensors go with its frame.
    model.step(opt, load(s, data, e, lo, hi))


def _infer(s: Session, data: Data, model: nn.Module, lo: int, hi: int) -> torch.Tensor:
    with torch.no_grad():
        out = model(load_infer(s, data, lo, hi))
    return host_copy(s, out)


def _attempt(fn: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    """``fn()``, or the OOM it raised (a crash); any other error is a bug and goes up."""
    try:
        return fn(), None
    except Exception as exc:
        if not is_oom(exc):
            raise
        return None, exc


def _accelerate(row: Row, start: int, trial: Callable[[int], None]) -> list[int]:
    """Run ``trial`` under Accelerate's search; returns the batch sizes it tried."""
    found, tried = accelerate_search(start, trial)
    row.final_batch_size = found
    if not found:
        row.finished = False
        row.crashes = 1
        row.note = "No executable batch size found, reached zero."
    row.ooms = row.ooms_recovered = len(tried) - 1
    return tried


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
    ledger = Ledger(steps)
    with pressured(kind, p, cfg.seed, cot) as (s, tenant):
        model = tallied(cfg)
        s.adopt(model)
        opt = make_optimizer(cfg, model.net)
        ck = checkpoint(s, 0, model, opt)
        since = 0.0  # compute time since the checkpoint
        i = 0
        t_start = time.perf_counter()
        while i < len(steps):
            tenant.tick()
            e, lo, hi = steps[i]
            t0 = time.perf_counter()
            _, err = _attempt(lambda: _tallied_step(s, data, model, opt, e, lo, hi))  # noqa: B023
            s.sync()
            dt = time.perf_counter() - t0
            row.steps += 1
            if err is None:
                with s.host():
                    ledger.add(i, model.counts(hi - lo))
                i += 1
                since += dt
                if i % cfg.checkpoint_every == 0 and i < len(steps):
                    ck = checkpoint(s, i, model, opt)
                    since = 0.0
                continue
            # The job crashes: the work since the checkpoint and the failed batch are lost.
            row.crashes += 1
            row.ooms += 1
            row.samples_redone += sum(h - lo_ for _, lo_, h in steps[ck.step : i + 1])
            row.time_lost_s += since + dt
            free_failed(err)
            err = None
            model.clear()
            if _crashed_out(row, len(steps)):
                ledger.forget(ck.step)  # a job that ends here keeps its last checkpoint
                break
            tenant.tick(cfg.restart_ticks)  # the co-tenant goes on while the job restarts
            restore(s, ck, model, opt)
            ledger.forget(ck.step)
            i, since = ck.step, 0.0
        close_row(row, s, tenant, t_start, lambda: ledger, lambda: weights(model.net), ref)
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
    row = Row("accelerate", "train", batch_size=cfg.batch)
    with pressured(kind, p, cfg.seed, cot) as (s, tenant):
        model = tallied(cfg)
        s.adopt(model)
        opt = make_optimizer(cfg, model.net)
        initial = checkpoint(s, 0, model, opt)
        ledger = Ledger([])

        def trial(batch_size: int) -> None:
            # Accelerate's pattern: the function starts over with a fresh model and optimizer.
            nonlocal ledger
            restore(s, initial, model, opt)
            model.clear()
            steps = plan(cfg.n_samples, cfg.epochs, batch_size)
            ledger = Ledger(steps)
            done = current = 0
            t0 = time.perf_counter()
            try:
                for i, (e, lo, hi) in enumerate(steps):
                    tenant.tick()
                    current = hi - lo
                    row.steps += 1
                    _tallied_step(s, data, model, opt, e, lo, hi)
                    with s.host():
                        ledger.add(i, model.counts(current))
                    done += current
            except Exception:
                row.samples_redone += done + current
                s.sync()
                row.time_lost_s += time.perf_counter() - t0
                raise

        t_start = time.perf_counter()
        tried = _accelerate(row, cfg.batch, trial)
        close_row(row, s, tenant, t_start, lambda: ledger, lambda: weights(model.net), ref)
        row.extra["batch_sizes_tried"] = tried
    return row


def infer_unguarded(
    kind: str,
    cfg: Config,
    data: Data,
    p: Pressure,
    ref: torch.Tensor,
    cot: CotenantSpec = THREAD,
) -> Row:
    """Outputs are committed (written out) every ``checkpoint_every`` batches; a crash loses
    the uncommitted ones and the failed batch."""
    row = Row("unguarded", "infer", batch_size=cfg.infer_batch, final_batch_size=cfg.infer_batch)
    steps = infer_plan(cfg, cfg.infer_batch)
    with pressured(kind, p, cfg.seed + 1, cot) as (s, tenant):
        model = infer_model(cfg, s)
        committed: list[tuple[int, torch.Tensor]] = []
        pending: list[tuple[int, torch.Tensor]] = []
        since = 0.0
        i = 0
        t_start = time.perf_counter()
        while i < len(steps):
            tenant.tick()
            _, lo, hi = steps[i]
            t0 = time.perf_counter()
            out, err = _attempt(lambda: _infer(s, data, model, lo, hi))  # noqa: B023
            s.sync()
            dt = time.perf_counter() - t0
            row.steps += 1
            if err is None:
                pending.append((i, out))
                i += 1
                since += dt
                if i % cfg.checkpoint_every == 0:
                    committed += pending
                    pending, since = [], 0.0
                continue
            row.crashes += 1
            row.ooms += 1
            row.samples_redone += sum(h - lo_ for _, lo_, h in steps[i - len(pending) : i + 1])
            row.time_lost_s += since + dt
            free_failed(err)
            err = None
            if _crashed_out(row, len(steps)):
                pending = []  # lost with the crash; the committed outputs stay
                break
            tenant.tick(cfg.restart_ticks)
            i -= len(pending)
            pending, since = [], 0.0
        committed += pending
        close_row(
            row,
            s,
            tenant,
            t_start,
            lambda: infer_ledger(cfg, steps, committed, ref),
            lambda: [torch.cat([o for _, o in committed])] if committed else [],
            [ref],
        )
    return row


def infer_accelerate(
    kind: str,
    cfg: Config,
    data: Data,
    p: Pressure,
    ref: torch.Tensor,
    cot: CotenantSpec = THREAD,
) -> Row:
    row = Row("accelerate", "infer", batch_size=cfg.infer_batch)
    with pressured(kind, p, cfg.seed + 1, cot) as (s, tenant):
        model = infer_model(cfg, s)
        steps: list[tuple[int, int, int]] = []
        result: list[tuple[int, torch.Tensor]] = []

        def trial(batch_size: int) -> None:
            outs: list[tuple[int, torch.Tensor]] = []
            done = current = 0
            t0 = time.perf_counter()
            steps[:] = infer_plan(cfg, batch_size)
            try:
                for i, (_, lo, hi) in enumerate(steps):
                    tenant.tick()
                    current = hi - lo
                    row.steps += 1
                    outs.append((i, _infer(s, data, model, lo, hi)))
                    done += current
            except Exception:
                row.samples_redone += done + current
                s.sync()
                row.time_lost_s += time.perf_counter() - t0
                raise
            result[:] = outs

        t_start = time.perf_counter()
        tried = _accelerate(row, cfg.infer_batch, trial)
        close_row(
            row,
            s,
            tenant,
            t_start,
            lambda: infer_ledger(cfg, steps, result, ref),
            lambda: [torch.cat([o for _, o in result])] if result else [],
            [ref],
        )
        row.extra["batch_sizes_tried"] = tried
    return row
