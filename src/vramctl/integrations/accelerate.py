"""Accelerate's ``find_executable_batch_size``, with vramctl's batch-size search inside.

A drop-in for :func:`accelerate.utils.find_executable_batch_size`: the same decorator, called
the same ways (``@find_executable_batch_size``, ``@find_executable_batch_size(
starting_batch_size=...)``, ``find_executable_batch_size(fn, 128)``), calling
``function(batch_size, *args, **kwargs)`` and never above ``starting_batch_size``. Where
Accelerate, after an out-of-memory error, calls the whole function again at 0.9 times the
size (many failed starts, silently, down to zero), this one measures (from a
``starting_batch_size`` of 256 up, a small probe first: ``small_first``):

- each call is a *probe*: a global optimizer-step hook counts the optimizer steps, and the
  device's peak meter measures the peak device memory over the first ``steps_per_probe``
  of them; the probe fits when that peak stays within ``target`` of the device's capacity;
- then, if the search (``vramctl.fit._search.Search``, the one behind
  :func:`vramctl.fit.fit_batch_size`) is settled, the call simply goes on: the last probe
  *is* the run, so when the first size fits nothing extra is run at all; otherwise the hook
  ends the call and the search picks the next size from the measured peaks (up from a
  fitting probe, inside a bracket, or well down after an out-of-memory error);
- what a failed or ended call held is freed (its frames cleared, then the allocator's cache)
  before the next one starts, and with ``restore=True`` the modules, optimizers and
  learning-rate schedulers passed in come back to their state before the first call, so the
  run that completes starts from the same weights as a plain run at its size would.

Every trial is logged (logger ``vramctl.integrations``; a warning for each out-of-memory
error, naming the next size) and kept in the decorated function's ``trials``.

>>> import torch, vramctl
>>> from vramctl.integrations.accelerate import find_executable_batch_size
>>> @find_executable_batch_size(starting_batch_size=128)
... def train(batch_size, model):
...     opt = torch.optim.AdamW(model.parameters())
...     x = torch.randn(batch_size, 16, 64)
...     for _ in range(3):
...         model(x).square().mean().backward()
...         opt.step()
...         opt.zero_grad()
...     return batch_size
>>> with vramctl.simulate("16MiB"):
...     model = torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.GELU(),
...                                 torch.nn.Linear(1024, 10))
...     ran = train(model)
>>> ran == train.batch_size, [t.outcome for t in train.trials]
(True, ['oom', 'fit', 'fit', 'fit'])
"""

from __future__ import annotations

import functools
import gc
import inspect
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Concatenate, Generic, Literal, ParamSpec, TypeVar, overload

import torch
from torch.optim.lr_scheduler import LRScheduler
from torch.optim.optimizer import register_optimizer_step_post_hook

from vramctl._errors import VramctlError
from vramctl._optional import require
from vramctl._units import format_bytes
from vramctl.device import Device, PeakMeter, resolve
from vramctl.fit import Probe
from vramctl.fit._shared import Search, to_host
from vramctl.guard import is_oom, release
from vramctl.guard._shared import OomCounters, requested_bytes

require("accelerate", extra="accelerate", what="vramctl.integrations.accelerate")

__all__ = [
    "BatchSizeSearchError",
    "SearchingFunction",
    "Trial",
    "find_executable_batch_size",
]

P = ParamSpec("P")
R = TypeVar("R")

log = logging.getLogger("vramctl.integrations")

#: Stop when the next probe would add less than this share to the largest size that fits.
TOLERANCE = 0.01
#: Probes from the first that fits, after which the largest that fitted is taken.
MAX_PROBES = 8
#: Trials in one call, after which the search gives up (a safeguard; it takes a few).
MAX_TRIALS = 32
#: A small first probe is ``starting_batch_size`` divided by this (``small_first``).
SMALL_FIRST = 16
#: ``small_first=None`` probes small first from this ``starting_batch_size`` up: a ceiling to
#: search under more than a size expected to fit (below it, as Accelerate's default of 128, the
#: start is tried first and, where it fits, is the run at once).
SMALL_FIRST_FROM = 256

Outcome = Literal["fit", "over_budget", "oom"]


@dataclass(frozen=True)
class Trial:
    """One call of the decorated function at one batch size, and what came of it."""

    batch_size: int
    #: ``"fit"``: within the budget (or the call returned); ``"over_budget"``: it ran, but its
    #: peak passed ``target`` of the device; ``"oom"``: it ran out of memory.
    outcome: Outcome
    #: Peak device-level used bytes over the probe's optimizer steps (or the whole call);
    #: None after an out-of-memory error.
    peak: int | None
    #: Seconds from the call's start to its outcome (for the call that went on as the run:
    #: to the end of its probe's steps).
    seconds: float


class BatchSizeSearchError(VramctlError, RuntimeError):
    """No batch size from ``minimum`` to ``starting_batch_size`` fits; the message lists the
    sizes tried, what each did, the device and its budget, and what to do."""


class _Abort(BaseException):
    """Raised by the optimizer-step hook to end a probe that has measured what it needed.

    A ``BaseException`` (as ``KeyboardInterrupt``), so that a training loop's own
    ``except Exception`` does not swallow it.
    """


class _GiveUp(Exception):
    """The search has nothing left to try (raised to the caller, which records the trial
    first, then raises :class:`BatchSizeSearchError`)."""

    def __init__(self, why: str = "") -> None:
        super().__init__(why)
        self.why = why


@dataclass
class _Attempt:
    """One call of the function, while it runs."""

    batch_size: int
    #: A rerun of the largest size that fitted: measured, never ended early.
    final: bool
    base: int
    counters: OomCounters
    meter: PeakMeter
    thread: int
    t0: float
    steps: int = 0
    peak: int | None = None
    #: The peak was read (after ``steps_per_probe`` optimizer steps, or at the call's end).
    measured: bool = False
    #: The hook ended the call; ``next`` (and ``next_final``) say what to run then.
    aborted: bool = False
    next: int = 0
    next_final: bool = False
    error: BatchSizeSearchError | None = None

    def read(self) -> int:
        if not self.measured:
            self.measured = True
            self.meter.__exit__(None, None, None)
            self.peak = self.meter.peak_used
        assert self.peak is not None
        return self.peak


class _Held:
    """The modules, optimizers and schedulers passed in: grads dropped after a failed or
    ended call and, with ``restore``, their state (and the RNG's) put back."""

    def __init__(self, dev: Device, objects: list[Any], restore: bool) -> None:
        self.dev = dev
        self.objects = objects
        self.restore = restore
        self.states: list[tuple[Any, Any]] = []
        self.modes: list[tuple[torch.nn.Module, bool]] = []
        self.rng: torch.Tensor | None = None
        self.cuda_rng: torch.Tensor | None = None
        if restore:
            with dev.uncounted():  # host copies: on a simulated GPU they take none of its budget
                self.states = [(obj, to_host(obj.state_dict())) for obj in objects]
            self.modes = [
                (m, m.training)
                for obj in objects
                if isinstance(obj, torch.nn.Module)
                for m in obj.modules()
            ]
            self.rng = torch.get_rng_state()
            if dev.is_cuda:
                self.cuda_rng = torch.cuda.get_rng_state(dev.torch_device)

    def reset(self) -> None:
        for obj in self.objects:
            if isinstance(obj, torch.nn.Module | torch.optim.Optimizer):
                obj.zero_grad(set_to_none=True)
        if not self.restore:
            return
        for obj, state in self.states:
            if isinstance(obj, torch.nn.Module):
                obj.load_state_dict(state)  # copied into the parameters
                continue
            with self.dev.uncounted():
                fresh = to_host(state)  # an optimizer may keep the tensors it is given
            obj.load_state_dict(fresh)
            if isinstance(obj, torch.optim.Optimizer):
                self.dev.adopt(obj)  # a simulated GPU counts the state put back
        for m, training in self.modes:
            m.training = training
        if self.rng is not None:
            torch.set_rng_state(self.rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state(self.cuda_rng, self.dev.torch_device)


class _Call:
    """One call of the decorated function: its device, budget, search and trials."""

    def __init__(
        self, owner: SearchingFunction[Any, Any], dev: Device, start: int, known: bool = False
    ) -> None:
        self.owner = owner
        self.dev = dev
        self.start = start
        self.capacity = dev.capacity()
        self.budget = int(owner.target * self.capacity)
        self.search = Search(
            self.budget, upper=start, slope_hint=None, tolerance=TOLERANCE, ceiling=start
        )
        self.trials: list[Trial] = []
        #: Device-level used bytes before the first probe.
        self.base: int | None = None
        #: The small first probe (``small_first``): its size, or None (``start`` first).
        self.small = self.small_first(known)
        #: What to run after a call that did not complete: its size, and whether in full.
        self.next_size = start if self.small is None else self.small
        self.next_final = False
        #: A run ran out of memory after its probe's steps: every call runs in full since.
        self.late = False

    def small_first(self, known: bool) -> int | None:
        """The first probe's size where it is a small one, else None (``start`` first):
        ``start / 16`` (at least ``minimum``, at most a quarter of ``start``), for a first
        call (no size ``known`` to fit) without ``reduce_batch_size_fn``, where
        ``small_first`` is True, or None and ``start`` is 256 or more.

        Its peak, and the next probe's (the size its bytes per sample reach the budget at:
        it fits), put the line through two measured points at the edge: three trials where
        ``start`` is far above what fits. Tried first, such a ``start`` runs out of memory
        and measures nothing; the probes after it find the scale, then the line (four or
        more)."""
        owner = self.owner
        wanted = owner.small_first
        if wanted is None:
            wanted = self.start >= SMALL_FIRST_FROM
        if known or not wanted or owner.reduce_batch_size_fn is not None:
            return None
        small = max(owner.minimum, self.start // SMALL_FIRST)
        return small if 4 * small <= self.start else None

    def after_returned(self, att: _Attempt) -> int | None:
        """The small first probe returned before its probe's steps (inference, a short
        loop): it measured a point, not the largest size. The next size to run, in full
        (once: that call's result is the answer), or None to keep this call's result."""
        if self.small is None or att.batch_size != self.small or self.trials:
            return None
        peak = att.read()
        fits = peak <= self.budget
        self.search.probes.append(Probe(att.batch_size, peak, fits, att.base))
        seconds = time.perf_counter() - att.t0
        try:
            nxt = self.choose(oom=False)
        except _GiveUp:
            nxt = None
        if nxt is None or (fits and nxt <= att.batch_size):
            return None
        outcome: Outcome = "fit" if fits else "over_budget"
        self.record(att.batch_size, outcome, peak, seconds, f"running {nxt} in full next", att)
        return nxt

    # -- the hook's side: a probe's steps are done -------------------------------------

    def on_step(self, att: _Attempt) -> None:
        """After each optimizer step of ``att``'s thread: at the probe's last, decide."""
        if att.measured or threading.get_ident() != att.thread:
            return
        att.steps += 1
        if att.steps < self.owner.steps_per_probe:
            return
        peak = att.read()
        b = att.batch_size
        seconds = time.perf_counter() - att.t0
        oom = att.counters.rose(self.dev)  # the step caught an OOM itself (a Guard splits)
        outcome: Outcome = "oom" if oom else "fit" if peak <= self.budget else "over_budget"
        if att.final:  # the largest that fitted, run again to the end
            self.record(b, outcome, None if oom else peak, seconds, f"running at {b}", att)
            return
        if oom:
            self.search.probes.append(Probe(b, None, False, att.base, peak))
        else:
            self.search.probes.append(Probe(b, peak, outcome == "fit", att.base))
        try:
            nxt = self.choose(oom)
        except _GiveUp as stop:
            self.record(b, outcome, None if oom else peak, seconds, "giving up", att)
            att.error = BatchSizeSearchError(stop.why + self.nothing_fits())
        else:
            if nxt is None and outcome == "fit" and b == self.search.lo:
                self.owner.batch_size = b
                self.record(b, outcome, peak, seconds, f"running at {b}", att)
                return
            if nxt is None:
                att.next, att.next_final = self.search.lo, True
                then = f"running {att.next}, the largest that fitted, from the start"
            else:
                att.next = nxt
                then = f"trying {nxt} next"
            self.record(b, outcome, None if oom else peak, seconds, then, att)
        att.aborted = True
        raise _Abort

    # -- the decorator's side: a call ran out of memory ---------------------------------

    def on_oom(self, att: _Attempt, floor: int) -> tuple[int, bool]:
        """``att`` ran out of memory: the next size, and whether that run is final."""
        b = att.batch_size
        seconds = time.perf_counter() - att.t0
        if att.steps >= self.owner.steps_per_probe:  # after its probe fitted: not a fit after all
            self.search.probes = [p for p in self.search.probes if p.batch_size != b]
            # The run needed more than its probe's steps did (longer batches later, an
            # evaluation): the probes' peaks are no guide to the run's. From here on each
            # call runs in full, and sizes come down by what the failed run needed.
            self.late = True
        self.search.probes.append(Probe(b, None, False, att.base, floor))
        try:
            nxt = self.shrink(b, floor, att.base) if self.late else self.choose(oom=True)
        except _GiveUp as stop:
            self.record(b, "oom", None, seconds, "giving up", att)
            raise BatchSizeSearchError(stop.why + self.nothing_fits()) from None
        if nxt is None:
            then = f"running {self.search.lo}, the largest that fitted, from the start"
            self.record(b, "oom", None, seconds, then, att)
            return self.search.lo, True
        then = f"running {nxt} in full next" if self.late else f"trying {nxt} next"
        self.record(b, "oom", None, seconds, then, att)
        return nxt, self.late

    def shrink(self, b: int, floor: int, base: int) -> int:
        """After a run ran out of memory past its probe: the size at which the bytes it
        needed (at least ``floor``) would have met the budget (at most 0.9 of ``b``)."""
        reduce = self.owner.reduce_batch_size_fn
        if reduce is not None:
            nxt = self.choose(oom=True)
            return b - 1 if nxt is None else nxt
        nxt = int(0.9 * b)
        if floor - base > 0 and self.budget > base:
            nxt = min(nxt, b * (self.budget - base) // (floor - base))
        return self.bounded(max(nxt, 0))

    def choose(self, oom: bool) -> int | None:
        """The next size to probe; None when settled on the largest that fitted.

        Raises :class:`_GiveUp` when no size from ``minimum`` up is left to try.
        """
        s = self.search
        reduce = self.owner.reduce_batch_size_fn
        if oom and reduce is not None:
            nxt = reduce()
            if isinstance(nxt, bool) or not isinstance(nxt, int):
                raise TypeError(f"reduce_batch_size_fn returned {nxt!r}, not an int")
            nxt = min(nxt, self.start)
            if s.lo and nxt <= s.lo:
                return None
            if any(p.batch_size == nxt and not p.fits for p in s.probes):
                raise _GiveUp(f"reduce_batch_size_fn returned {nxt}, which did not fit already: ")
        else:
            if s.lo and len(s.probes) - s.misses_before_fit() >= MAX_PROBES:
                return None
            found = s.next()
            if found is None:
                if s.lo:
                    return None
                raise _GiveUp
            nxt = found
        return self.bounded(nxt)

    def bounded(self, nxt: int) -> int:
        """``nxt``, or ``minimum`` where ``nxt`` is below it (once: then it gives up)."""
        s = self.search
        minimum = self.owner.minimum
        if nxt < minimum:
            hi = s.hi
            if any(p.batch_size == minimum for p in s.probes) or (hi is not None and hi <= minimum):
                raise _GiveUp
            nxt = minimum
        return nxt

    # -- reporting --------------------------------------------------------------------

    def record(
        self, b: int, outcome: Outcome, peak: int | None, seconds: float, then: str, att: _Attempt
    ) -> None:
        trial = Trial(b, outcome, peak, seconds)
        self.trials.append(trial)
        if outcome == "oom":
            log.warning(
                "batch size %d ran out of memory on %s after %.1f s; %s",
                b,
                self.dev.id,
                seconds,
                then,
            )
        else:
            what = "fits" if outcome == "fit" else "is over the budget"
            steps = f"{att.steps} optimizer steps" if att.steps else "the whole call"
            log.info(
                "batch size %d %s: peak %s of a %s budget on %s over %s (%.1f s); %s",
                b,
                what,
                format_bytes(peak) if peak is not None else "unknown",
                format_bytes(self.budget),
                self.dev.id,
                steps,
                seconds,
                then,
            )
        if self.owner.on_trial is not None:
            self.owner.on_trial(trial)

    def describe(self) -> str:
        def one(t: Trial) -> str:
            if t.outcome == "oom":
                return f"{t.batch_size} ran out of memory"
            peak = format_bytes(t.peak) if t.peak is not None else "unknown"
            if t.outcome == "over_budget":
                return f"{t.batch_size} peaked at {peak}, over the budget"
            return f"{t.batch_size} fitted (peak {peak})"

        tried = "; ".join(one(t) for t in self.trials) or "nothing"
        held = f"; {format_bytes(self.base)} was in use before the call" if self.base else ""
        return (
            f"Device {self.dev.id}: budget {format_bytes(self.budget)} (target "
            f"{self.owner.target:g} of {format_bytes(self.capacity)}){held}. Tried: {tried}."
        )

    def nothing_fits(self) -> str:
        lo, hi = self.owner.minimum, self.start
        sizes = f"batch size {lo}" if lo == hi else f"batch size from {lo} to {hi}"
        floors = [p.floor for p in self.search.probes if p.floor and p.batch_size == lo]
        need = f" (batch size {lo} needed more than {format_bytes(floors[0])})" if floors else ""
        return (
            f"no {sizes} fits on {self.dev.id}{need}. {self.describe()} "
            + (f"Lower minimum (now {lo}), or " if lo > 1 else "")
            + "raise target, free memory held elsewhere on the device, or make each step "
            "smaller (mixed precision, gradient checkpointing, a smaller per-device batch with "
            "gradient accumulation)."
        )


class SearchingFunction(Generic[P, R]):
    """The decorated function: call it without the batch size, as Accelerate's.

    After a call, :attr:`trials` lists that call's trials and :attr:`batch_size` is the size
    its completed run used; a later call starts there (as Accelerate's does).
    """

    # Set by functools.update_wrapper, from the function.
    __name__: str
    __qualname__: str
    __wrapped__: Callable[..., Any]
    #: The function's signature without the batch size (what a caller passes).
    __signature__: inspect.Signature

    def __init__(
        self,
        function: Callable[Concatenate[int, P], R],
        starting_batch_size: int,
        reduce_batch_size_fn: Callable[[], int] | None,
        *,
        minimum: int,
        device: Device | str | int | None,
        target: float,
        steps_per_probe: int,
        restore: bool,
        on_trial: Callable[[Trial], object] | None,
        small_first: bool | None = None,
    ) -> None:
        self.function = function
        self.starting_batch_size = starting_batch_size
        self.reduce_batch_size_fn = reduce_batch_size_fn
        self.minimum = minimum
        self.device = device
        self.target = target
        self.steps_per_probe = steps_per_probe
        self.restore = restore
        self.on_trial = on_trial
        self.small_first = small_first
        #: The last call's trials, in order.
        self.trials: list[Trial] = []
        #: The size the last call ran at (None before the first call).
        self.batch_size: int | None = None
        functools.update_wrapper(self, function)
        self._names: list[str] = []
        self._positional: int | None = None
        try:
            sig = inspect.signature(function)
        except (TypeError, ValueError):
            return
        params = list(sig.parameters.values())
        self._names = [p.name for p in params]
        kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        if all(p.kind != inspect.Parameter.VAR_POSITIONAL for p in params):
            self._positional = sum(p.kind in kinds for p in params)
        self.__signature__ = sig.replace(parameters=params[1:])

    def __repr__(self) -> str:
        name = getattr(self.function, "__qualname__", repr(self.function))
        return f"<find_executable_batch_size of {name}, batch_size={self.batch_size}>"

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        if self._positional is not None and len(args) + 1 > self._positional:
            name = getattr(self.function, "__name__", "function")
            passed = ", ".join(f"{n}={v}" for n, v in zip(self._names[1:], args[1:], strict=False))
            raise TypeError(
                f"Batch size was passed into `{name}` as the first argument when called. "
                f"Remove this as the decorator already does so: `{name}({passed})`"
            )
        values = [*args, *kwargs.values()]
        model = next((v for v in values if isinstance(v, torch.nn.Module)), None)
        dev = resolve(self.device, model=model)
        if not dev.active:
            raise BatchSizeSearchError(
                f"{dev.id} is not active: call the function inside its block "
                "(with vramctl.simulate(...) as gpu: train(...))"
            )
        known = self.batch_size is not None  # a size that ran before: tried first
        call = _Call(self, dev, self.batch_size or self.starting_batch_size, known)
        self.trials = call.trials
        kinds = (torch.nn.Module, torch.optim.Optimizer, LRScheduler)
        objects = list({id(v): v for v in values if isinstance(v, kinds)}.values())
        held = _Held(dev, objects, self.restore)
        b, final = call.next_size, False
        while True:
            try:
                done = self._attempt(call, b, final, args, kwargs)
            except BatchSizeSearchError:
                held.reset()  # the arguments go back as they were given
                raise
            if done is not None:
                self.batch_size = b
                return done[0]
            held.reset()
            if len(call.trials) >= MAX_TRIALS:
                raise BatchSizeSearchError(
                    f"gave up after {MAX_TRIALS} trials without settling. {call.describe()}"
                )
            b, final = call.next_size, call.next_final

    def _attempt(
        self, call: _Call, b: int, final: bool, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[R] | None:
        """One call at ``b``: ``(result,)`` when it ran to the end, else None (then
        ``call.next_size`` and ``call.next_final`` say what to run next)."""
        dev = call.dev
        gc.collect(1)  # young cycles only; a full collection follows a failure (release)
        dev.release_cache()
        att = _Attempt(
            batch_size=b,
            final=final,
            base=dev.capacity() - dev.available(),
            counters=OomCounters.read(dev),
            meter=dev.peak_meter(),
            thread=threading.get_ident(),
            t0=time.perf_counter(),
        )
        if call.base is None:
            call.base = att.base

        def hook(optimizer: torch.optim.Optimizer, a: tuple[Any, ...], k: dict[str, Any]) -> None:
            call.on_step(att)

        failure: BaseException | None = None
        floor: int | None = None
        att.meter.__enter__()
        handle = register_optimizer_step_post_hook(hook)
        try:
            result = self.function(b, *args, **kwargs)
        except _Abort as exc:
            failure = exc
        except Exception as exc:
            if not att.aborted:  # (an error raised while the loop unwound from the abort: ours)
                if not is_oom(exc, device=dev, counters=att.counters):
                    raise
                # A lower bound of what it needed: what was held when an allocation was
                # refused (the failed frames are still alive), plus the refused bytes.
                held = dev.capacity() - dev.available()
                floor = max(att.read(), held + requested_bytes(exc))
            failure = exc
        finally:
            handle.remove()
            if not att.measured:
                att.read()
        if failure is not None:
            release(failure, dev)  # outside the except block, so its frames let go
            failure = None
        if att.aborted:
            if att.error is not None:
                raise att.error
            call.next_size, call.next_final = att.next, att.next_final
            return None
        if floor is not None:
            call.next_size, call.next_final = call.on_oom(att, floor)
            return None
        if att.steps < self.steps_per_probe:  # returned before its probe's steps: it fitted
            nxt = call.after_returned(att)
            if nxt is not None:
                call.next_size, call.next_final = nxt, True
                return None
            call.record(b, "fit", att.peak, time.perf_counter() - att.t0, "done", att)
        return (result,)


@overload
def find_executable_batch_size(
    function: Callable[Concatenate[int, P], R],
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Callable[[], int] | None = None,
    *,
    minimum: int = 1,
    device: Device | str | int | None = None,
    target: float = 0.9,
    steps_per_probe: int = 2,
    restore: bool = True,
    on_trial: Callable[[Trial], object] | None = None,
    small_first: bool | None = None,
) -> SearchingFunction[P, R]: ...


@overload
def find_executable_batch_size(
    function: None = None,
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Callable[[], int] | None = None,
    *,
    minimum: int = 1,
    device: Device | str | int | None = None,
    target: float = 0.9,
    steps_per_probe: int = 2,
    restore: bool = True,
    on_trial: Callable[[Trial], object] | None = None,
    small_first: bool | None = None,
) -> Callable[[Callable[Concatenate[int, P], R]], SearchingFunction[P, R]]: ...


def find_executable_batch_size(
    function: Callable[Concatenate[int, P], R] | None = None,
    starting_batch_size: int = 128,
    reduce_batch_size_fn: Callable[[], int] | None = None,
    *,
    minimum: int = 1,
    device: Device | str | int | None = None,
    target: float = 0.9,
    steps_per_probe: int = 2,
    restore: bool = True,
    on_trial: Callable[[Trial], object] | None = None,
    small_first: bool | None = None,
) -> (
    SearchingFunction[P, R] | Callable[[Callable[Concatenate[int, P], R]], SearchingFunction[P, R]]
):
    """Run ``function(batch_size, *args, **kwargs)`` at the largest batch size that fits.

    The same decorator as Accelerate's (with or without arguments; the decorated function is
    called without the batch size, and passing it raises the same ``TypeError``), with
    vramctl's search in place of the 0.9 steps:

    - ``starting_batch_size`` is the largest size tried, and the first unless the first
      probe is a small one: with ``small_first=None`` (the default) from a
      ``starting_batch_size`` of 256 up (a ceiling to search under more than a size expected
      to fit), with ``small_first=True`` for any, the first call probes ``starting_batch_size
      // 16`` first (at least ``minimum``): its measured peak scales up to a size that fits,
      and the line through the two reaches the edge, so a start far above what fits takes
      three trials where trying it first (it runs out of memory and measures nothing) took
      four or more; a start that fits takes two or three where it took one. ``small_first=False``
      (and ``reduce_batch_size_fn``, and a later call, which starts from the size that ran)
      tries ``starting_batch_size`` first. A small first probe that returns before its
      probe's steps (inference, a short loop: nothing ends it) measured a point, not the
      largest size: the function is called once more, in full, at the size it scales up to,
      and that call's result is returned;
    - each call is a probe: over its first ``steps_per_probe`` optimizer steps (counted by a
      global ``torch.optim`` step hook, in the calling thread), the device's peak meter
      measures the peak; it fits when the peak stays within ``target * capacity`` of
      ``device`` (default: the current device, see :func:`vramctl.device.resolve`). If the
      search is settled then, the call goes on and its result is returned: the probe is
      the run. Otherwise the call is ended (by an exception raised from the hook, a
      ``BaseException`` that the decorator catches) and the next size probed. A call that
      returns before ``steps_per_probe`` optimizer steps (inference, a short loop) has
      fitted, and its result is returned. An out-of-memory error (or a peak over the
      budget) is a miss: what it held is freed, and the search picks the next size from
      the measured peaks (or ``reduce_batch_size_fn()`` does, after an out-of-memory error,
      as in Accelerate). If a larger probe fails after a smaller one fitted and was ended,
      the smaller one is run again, in full. A run that runs out of memory *after* its
      probe's steps (longer batches later, an evaluation) shows that the probes' peaks
      are no guide to the run's: the next size is scaled down by the bytes that run
      needed (at most 0.9 times it), and every later call runs in full.
    - never below ``minimum``: the search tries ``minimum`` itself before giving up, then
      raises :class:`BatchSizeSearchError` listing the sizes tried, what each did, the
      device and budget, and what to do;
    - ``restore=True``: the ``nn.Module``, optimizer and learning-rate scheduler arguments
      (top level of ``args``/``kwargs``) are copied to host memory before the first probe
      and put back (with the train/eval flags and the random number generators) before
      each call after an ended or failed one, so the run that completes starts from the
      same state as a plain call at its size. Objects the function makes itself are fresh
      on each call anyway. Gradients of those arguments are set to None after an ended or
      failed call in any case. With ``restore=False`` the weights keep what the ended
      probes' steps did to them.

    Every trial is logged on the ``vramctl.integrations`` logger (a warning for each
    out-of-memory error, with the next size) and passed to ``on_trial``. After a call the
    decorated function's ``trials`` lists them and ``batch_size`` is the size that ran; a
    later call starts from it, as Accelerate's does. Errors other than out-of-memory ones
    propagate unchanged.

    The search is per process, as Accelerate's is: in a distributed run each rank probes on
    its own, and a probe ended on one rank but not on another would leave the other waiting
    in a collective operation. Search in a single process, then give every rank that size.
    """
    if function is None:

        def decorate(fn: Callable[Concatenate[int, P], R]) -> SearchingFunction[P, R]:
            return find_executable_batch_size(
                fn,
                starting_batch_size,
                reduce_batch_size_fn,
                minimum=minimum,
                device=device,
                target=target,
                steps_per_probe=steps_per_probe,
                restore=restore,
                on_trial=on_trial,
                small_first=small_first,
            )

        return decorate
    for name, value in (
        ("starting_batch_size", starting_batch_size),
        ("minimum", minimum),
        ("steps_per_probe", steps_per_probe),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if minimum > starting_batch_size:
        raise ValueError(
            f"minimum ({minimum}) is above starting_batch_size ({starting_batch_size})"
        )
    if isinstance(target, bool) or not isinstance(target, int | float) or not 0 < target <= 1:
        raise ValueError(f"target must be in (0, 1], got {target!r}")
    if small_first is not None and not isinstance(small_first, bool):
        raise TypeError(f"small_first must be True, False or None, got {small_first!r}")
    for name, fn in (
        ("function", function),
        ("reduce_batch_size_fn", reduce_batch_size_fn),
        ("on_trial", on_trial),
    ):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be callable, got {fn!r}")
    return SearchingFunction(
        function,
        starting_batch_size,
        reduce_batch_size_fn,
        minimum=minimum,
        device=device,
        target=target,
        steps_per_probe=steps_per_probe,
        restore=restore,
        on_trial=on_trial,
        small_first=small_first,
    )
