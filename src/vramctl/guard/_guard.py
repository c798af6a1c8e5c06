"""``Guard`` and ``guarded``: a step that survives an out-of-memory error with nothing lost.

When a step runs out of memory, what the failed attempt held is freed and the
*same* batch runs again in smaller pieces:

- training: forward and backward per piece, each piece's loss scaled by its
  share of the batch (``reduction="mean"``) so the accumulated gradients are
  the whole batch's, then one optimizer step (with ``GradScaler`` and gradient
  clipping as configured);
- inference: every piece's outputs, joined back in the original order; pieces
  that already ran are not run again.

The piece size that worked is kept for the next steps and probed back up
(after ``patience`` good steps, when memory has been freed; the wait doubles
after each failed probe, so it does not flap). When a single sample still does
not fit, the activations are offloaded to host memory; when that fails too,
:class:`StepDoesNotFitError` says what holds the memory and what to try.

>>> import torch, vramctl
>>> model = torch.nn.Linear(8, 2)
>>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
>>> guard = vramctl.Guard(model, opt, loss_fn=lambda out, batch: out.square().mean())
>>> result = guard.step(torch.randn(16, 8))
>>> result.pieces, guard.summary()["ooms"]
(1, 0)
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

import torch
from torch import nn
from torch.amp.grad_scaler import GradScaler

from vramctl._step import call_model, model_loss
from vramctl._units import format_bytes
from vramctl.device import Device, resolve
from vramctl.guard._dist import agree, average_gradients
from vramctl.guard._offload import can_offload, offload_activations
from vramctl.guard._oom import OomCounters, is_oom, release, requested_bytes
from vramctl.guard._report import StepDoesNotFitError, memory_report
from vramctl.guard._split import (
    GuardError,
    batch_size_of,
    merge_outputs,
    piece_sizes,
    slice_batch,
    split_batch,
)

__all__ = [
    "Guard",
    "GuardEvent",
    "GuardedFunction",
    "SplitBatchNormWarning",
    "StepResult",
    "add_listener",
    "add_reliever",
    "drop_grads",
    "guarded",
    "relieve",
    "remove_listener",
    "remove_reliever",
    "restore_grads",
    "stash_grads",
]

REDUCTIONS = ("mean", "sum")

log = logging.getLogger("vramctl.guard")

#: Called with every event of every guard (the monitor subscribes here).
_listeners: list[Callable[[GuardEvent], None]] = []


def add_listener(fn: Callable[[GuardEvent], None]) -> None:
    """Call ``fn(event)`` for every event of every guard in this process."""
    _listeners.append(fn)


def remove_listener(fn: Callable[[GuardEvent], None]) -> None:
    """Stop calling ``fn`` on guard events (see :func:`add_listener`); a no-op if not added."""
    with contextlib.suppress(ValueError):
        _listeners.remove(fn)


#: Asked to free device memory when a guard's attempt runs out of it (a tensor cache).
_relievers: list[Callable[[Device, int], int]] = []

#: Times a step retries the same piece size after relievers freed memory, at most.
MAX_RELIEFS = 8


def add_reliever(fn: Callable[[Device, int], int]) -> None:
    """Ask ``fn(device, nbytes)`` to free memory when a guard runs out of it on ``device``.

    The guard's first answer to an out-of-memory error: before it splits the batch,
    every reliever is asked for ``nbytes`` (what the failed allocation asked for; 0
    when the error does not say) and returns the bytes it freed. When they freed
    any, the same piece runs again. :class:`vramctl.TensorCache` registers itself
    here, moving its device tier's values to host memory.
    """
    _relievers.append(fn)


def remove_reliever(fn: Callable[[Device, int], int]) -> None:
    """Stop asking ``fn`` to free memory (see :func:`add_reliever`); a no-op if not added."""
    with contextlib.suppress(ValueError):
        _relievers.remove(fn)


def relieve(device: Device, nbytes: int) -> int:
    """Ask every reliever to free ``nbytes`` on ``device``; returns the bytes they freed."""
    freed = 0
    for fn in list(_relievers):
        try:
            freed += max(0, int(fn(device, nbytes)))
        except Exception:
            log.exception("reliever %r failed", fn)
    return freed


class SplitBatchNormWarning(UserWarning):
    """A model with BatchNorm ran in pieces: its batch statistics were computed per piece."""


@dataclass(frozen=True)
class GuardEvent:
    """One thing the guard did.

    ``kind`` is ``"oom"`` (an attempt ran out of memory and was freed),
    ``"peer_oom"`` (another rank ran out of memory, so this one ran again too),
    ``"relieve"`` (relievers such as a tensor cache freed device memory, so the same
    piece ran again),
    ``"grow"`` (the piece size was probed back up), ``"offload"`` (activations
    moved to host memory), ``"optimizer_oom"`` (the optimizer step ran out of
    memory: never retried, as it may have updated part of its state), ``"shrink"``
    (asked to run smaller pieces, e.g. by a monitor alert) or ``"gave_up"``.
    """

    kind: str
    step: int
    batch_size: int
    pieces: int
    piece_limit: int | None
    time_lost: float = 0.0
    available: int | None = None
    detail: str = ""
    timestamp: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "step": self.step,
            "batch_size": self.batch_size,
            "pieces": self.pieces,
            "piece_limit": self.piece_limit,
            "time_lost_s": round(self.time_lost, 6),
            "available_bytes": self.available,
            "detail": self.detail,
            "timestamp": self.timestamp,
        }


@dataclass(frozen=True)
class StepResult:
    """What a guarded training step did."""

    #: The whole batch's loss (detached), as if it had run in one piece.
    loss: torch.Tensor
    batch_size: int
    pieces: int
    #: Out-of-memory errors survived in this step, and the seconds they cost.
    ooms: int = 0
    time_lost: float = 0.0
    offloaded: bool = False


@dataclass
class _Attempt:
    failed: bool = False
    error: BaseException | None = None
    message: str = ""


class Guard:
    """Run training or inference steps that finish in pieces when memory runs out.

    ``model`` and ``optimizer`` make :meth:`step` a whole training step:
    ``loss_fn(model(batch), batch)`` (or the output's ``.loss`` or ``"loss"``, the
    output itself when it is a scalar, or a tuple's scalar first item), backward,
    optional unscaling and clipping, the optimizer step and ``zero_grad``. The model is
    called with a dict batch as keyword arguments, a tuple or list as positional
    arguments, anything else as its one argument; ``forward=(model, batch) -> output``
    says otherwise (``lambda m, b: m(b[0])`` for ``(inputs, targets)`` pairs).
    :meth:`infer` runs the model under
    ``torch.no_grad`` and returns its outputs. :func:`guarded` wraps any
    function instead of a model.

    ``reduction`` says how the loss reduces over samples: ``"mean"`` (pieces
    are weighted by their share of the batch, or by ``weight_fn(piece)``, for
    example the number of target tokens) or ``"sum"``.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        forward: Callable[[Any, Any], Any] | None = None,
        reduction: str = "mean",
        weight_fn: Callable[[Any], float | torch.Tensor] | None = None,
        scaler: GradScaler | None = None,
        clip_grad_norm: float | None = None,
        device: Device | str | int | None = None,
        piece_limit: int | None = None,
        offload: bool = True,
        patience: int = 16,
        sync: bool | None = None,
        on_event: Callable[[GuardEvent], None] | None = None,
        history: int = 10_000,
    ) -> None:
        _check_arguments(
            model,
            optimizer,
            reduction=reduction,
            piece_limit=piece_limit,
            patience=patience,
            clip_grad_norm=clip_grad_norm,
            history=history,
            callables={
                "loss_fn": loss_fn,
                "forward": forward,
                "weight_fn": weight_fn,
                "on_event": on_event,
            },
        )
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.forward: Callable[[Any, Any], Any] = forward or call_model
        self.reduction = reduction
        self.weight_fn = weight_fn
        self.scaler = scaler
        self.clip_grad_norm = clip_grad_norm
        self.device = resolve(device, model=model if model is not None else optimizer)
        #: Largest number of samples per piece (None: the whole batch).
        self.piece_limit = piece_limit
        self.offload = offload and can_offload(self.device)
        # Like offload, decided once for the guard's device: whether its allocator counts
        # OOMs, which are then read before every attempt (elsewhere they read zero).
        self._counted = OomCounters.kept(self.device)
        self.patience = patience
        self.on_event = on_event
        self.events: deque[GuardEvent] = deque(maxlen=history)
        self._params = _params(model, optimizer)
        self._sync = (
            sync if sync is not None else isinstance(model, nn.parallel.DistributedDataParallel)
        )
        self._bn_warned = False
        self._offloading = False
        self._streak = 0
        self._wait = patience
        self._free_at_oom: int | None = None
        self._grow_from: int | None = None
        self._last_n: int | None = None
        self.steps = 0
        self.samples = 0
        self.ooms = 0
        self.split_steps = 0
        self.recovered = 0
        self.time_lost = 0.0
        # OOMs (and seconds) recover() took over, counted in the step train_step runs next.
        self._taken_over = 0
        self._lost = 0.0
        self._reliefs = 0  # in this step

    # -- public -------------------------------------------------------------------

    def step(self, batch: Any, *, update: bool = True) -> StepResult:
        """One training step on ``batch``; ``update=False`` only accumulates gradients."""
        if self.model is None:
            raise GuardError("Guard.step needs a model; use guarded(fn, optimizer=...) otherwise")
        return self._train(batch, None, update)

    def infer(self, batch: Any) -> Any:
        """The model's outputs for ``batch`` under ``torch.no_grad``, whole or in pieces."""
        if self.model is None:
            raise GuardError("Guard.infer needs a model; use guarded(fn) otherwise")
        model = self.model

        def run(piece: Any) -> Any:
            with torch.no_grad():
                return self.forward(model, piece)

        return self.infer_step(batch, run)

    def __call__(self, batch: Any) -> Any:
        return self.step(batch) if self.optimizer is not None else self.infer(batch)

    def shrink(self, factor: float = 0.5) -> int | None:
        """Run smaller pieces from the next step on, before an OOM forces it.

        The piece limit becomes ``factor`` times the current one (or the last
        batch's size); it grows back after ``patience`` good steps, as after an
        OOM. An alert action (:class:`vramctl.monitor.Shrink`) calls this.
        Returns the new limit (None before the first step: nothing to shrink).
        """
        if not 0.0 < factor < 1.0:
            raise GuardError(f"factor must be between 0 and 1, got {factor}")
        current = self.piece_limit or self._last_n
        if current is None:
            return None
        self.piece_limit = max(1, int(current * factor))
        self._streak = 0
        self._free_at_oom = _available(self.device)
        n = self._last_n or current
        self._emit("shrink", n, math.ceil(n / self.piece_limit), 0.0, f"from {current}")
        return self.piece_limit

    def recover(self, error: BaseException, batch_size: int, seconds: float = 0.0) -> int:
        """Take over after an OOM that a framework met running a whole batch itself.

        A framework's loop (Lightning's, the Hugging Face ``Trainer``'s) runs the
        step; when it runs out of memory on a batch of ``batch_size``, this frees
        what the failed attempt held (its traceback's frames are cleared: call it
        after the ``except`` block, as the guard itself does), counts the OOM and
        ``seconds`` lost, and sets the piece size the batch is then run in with
        :meth:`train_step`. Returns that piece size. Raises
        :class:`StepDoesNotFitError` when one sample at a time already failed.
        """
        tried = min(self.piece_limit or batch_size, batch_size)
        limit = self._recover(_Attempt(True, error, str(error)), batch_size, max(tried, 1), seconds)
        self._taken_over += 1
        self._lost += seconds
        return limit

    @property
    def params(self) -> list[torch.Tensor]:
        """The parameters whose gradients a guarded step handles (the model's, the optimizer's)."""
        return self._params

    def record_step(self, batch_size: int) -> None:
        """Count a whole step of ``batch_size`` that a framework ran itself without an OOM.

        The guard's counts (steps, samples) and the good-step streak after which pieces
        grow back then include the steps the guard did not run.
        """
        self._done(batch_size, max(batch_size, 1))

    def summary(self, events: int = 20) -> dict[str, Any]:
        """Counts and the latest ``events`` events, JSON-ready."""
        return {
            "device": self.device.id,
            "steps": self.steps,
            "samples": self.samples,
            "ooms": self.ooms,
            "ooms_recovered": self.recovered,
            "split_steps": self.split_steps,
            "piece_limit": self.piece_limit,
            "offloading": self._offloading,
            "time_lost_s": round(self.time_lost, 6),
            "events": [e.to_dict() for e in list(self.events)[-events:]],
        }

    # -- training -----------------------------------------------------------------

    def train_step(
        self, batch: Any, loss_of: Callable[[Any], torch.Tensor], update: bool = True
    ) -> StepResult:
        """Run ``loss_of`` on ``batch`` (in pieces if need be), backward, optimizer step."""
        return self._train(batch, loss_of, update)

    def _train(
        self, batch: Any, loss_of: Callable[[Any], torch.Tensor] | None, update: bool
    ) -> StepResult:
        """:meth:`train_step`; ``loss_of=None`` is the model's loss (:meth:`step`)."""
        # batch_size_of, its commonest cases inline: a tensor, (inputs, targets).
        head = batch[0] if (type(batch) is tuple or type(batch) is list) and batch else batch
        n = head.shape[0] if type(head) is torch.Tensor and head.dim() else batch_size_of(batch)
        params = self._params
        if self.piece_limit is None and not self._sync and not self._offloading:
            # The steady state: the whole batch, nothing to agree on. It pays only for the
            # batch's size, a look for gradients to set aside, and the OOM counters where
            # the device keeps them; what a failure needs is done when one happens. Kept
            # inline: run between the model's steps, each call and lookup here is paid
            # with caches the model has just flushed.
            stash = None
            for p in params:  # usually none has a gradient: nothing to set aside
                if p.grad is not None:
                    stash = stash_grads(params)
                    break
            whole: torch.Tensor | None = None
            t0 = perf_counter()
            counters = OomCounters.read(self.device) if self._counted else None
            try:
                if loss_of is None:
                    whole = self._loss(self.forward(self.model, batch), batch)
                else:
                    whole = loss_of(batch)
                if self.scaler is None:
                    whole.backward()
                else:
                    self.scaler.scale(whole).backward()
            except BaseException as exc:
                drop_grads(params)
                if not isinstance(exc, Exception) or not is_oom(
                    exc, device=self.device, counters=counters
                ):
                    restore_grads(params, stash)
                    raise
                att = _Attempt(True, exc, str(exc))
            else:
                loss = whole.detach()
                if stash is not None:
                    restore_grads(params, stash, add=True)
                if update:
                    self._optimizer_step(n)
                self._last_n = n  # as _done(n, n)
                self._reliefs = 0
                self.steps += 1
                self.samples += n
                self._streak += 1
                if self._grow_from is not None:
                    self._probe_held()
                return StepResult(loss, n, 1)
            # Out of memory whole: the failed attempt is freed, the batch runs in pieces.
            whole = None
            ooms_before, lost_before = self.ooms, self.time_lost
            try:
                self._recover(att, n, n, perf_counter() - t0)
            except BaseException:
                restore_grads(params, stash)
                raise
        else:
            if self.piece_limit is not None and not self._taken_over:
                self._maybe_grow(n)
            # An OOM a framework met on this batch (recover()) belongs to this step.
            ooms_before, lost_before = self.ooms - self._taken_over, self.time_lost - self._lost
            self._taken_over, self._lost = 0, 0.0
            stash = stash_grads(params)
        try:
            loss, limit = self._gradients(batch, n, loss_of or self._model_loss)
        except BaseException:
            # An error that is not an OOM, or giving up: what this step accumulated goes,
            # the gradients that were there before it are put back as they were.
            drop_grads(params)
            restore_grads(params, stash)
            raise
        if stash is not None:
            restore_grads(params, stash, add=True)
        if update:
            self._optimizer_step(n)
        ooms = self.ooms - ooms_before
        self.recovered += ooms
        self._done(n, limit)
        return StepResult(
            loss,
            n,
            len(piece_sizes(n, math.ceil(n / limit))),
            ooms,
            self.time_lost - lost_before,
            self._offloading,
        )

    def _model_loss(self, piece: Any) -> torch.Tensor:
        return self._loss(self.forward(self.model, piece), piece)

    def _gradients(
        self, batch: Any, n: int, loss_of: Callable[[Any], torch.Tensor]
    ) -> tuple[torch.Tensor, int]:
        """Forward and backward over ``batch``, whole or in pieces: its loss and the piece size."""
        loss: torch.Tensor | None = None
        dev = self.device
        while True:
            limit = self.piece_limit or max(n, 1)
            t0 = perf_counter()
            failure: _Attempt | None = None
            loss = None
            counters = OomCounters.read(dev) if self._counted else None
            try:
                loss = self._accumulate(batch, n, limit, loss_of)
            except Exception as exc:
                if not is_oom(exc, device=dev, counters=counters):
                    raise
                failure = _Attempt(True, exc, str(exc))
            failed = failure is not None
            if self._sync:
                failed, agreed = agree(failed, limit)
                limit = min(limit, agreed)
            if not failed:
                break
            loss = None
            drop_grads(self._params)
            peer = failure is None
            if failure is None:
                failure = _Attempt(
                    message="another rank ran out of memory; every rank runs the step again"
                )
            self._recover(failure, n, limit, perf_counter() - t0, peer=peer)
        if self._sync:
            average_gradients(self._params)
        assert loss is not None
        return loss, limit

    def _accumulate(
        self, batch: Any, n: int, limit: int, loss_of: Callable[[Any], torch.Tensor]
    ) -> torch.Tensor:
        k = math.ceil(n / limit)
        if k <= 1:
            with self._piece_context():
                loss = loss_of(batch)
                self._backward(loss)
            return loss.detach()
        self._warn_batchnorm()
        pieces = split_batch(batch, k, size=n)
        sizes = piece_sizes(n, k)
        mean = self.reduction == "mean"
        if mean and self.weight_fn is not None:
            weights = [float(self.weight_fn(p)) for p in pieces]
        else:
            weights = [float(s) for s in sizes]
        total_w = sum(weights) if mean else 1.0
        acc: torch.Tensor | None = None
        for piece, w in zip(pieces, weights, strict=True):
            if mean and w == 0:
                # Nothing of this piece is in a weighted mean (a piece of padding only),
                # and its own mean would be 0/0: it is not run.
                continue
            scale = w / total_w if mean else 1.0
            with self._piece_context():
                loss = loss_of(piece)
                self._backward(loss * scale)
            part = loss.detach() * scale
            acc = part if acc is None else acc + part
            del loss
        if acc is None:  # every weight was 0: the mean over nothing, as a whole batch gives
            return torch.tensor(float("nan"))
        return acc

    def _backward(self, loss: torch.Tensor) -> None:
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()

    @contextlib.contextmanager
    def _piece_context(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if self._sync and isinstance(self.model, nn.parallel.DistributedDataParallel):
                stack.enter_context(self.model.no_sync())
            if self._offloading:
                stack.enter_context(offload_activations(self.device))
            yield

    def _optimizer_step(self, n: int) -> None:
        """Clip (unscaling first with a scaler), step, zero the gradients.

        An OOM here is not retried: the optimizer may already have updated part
        of its state in place (Adam's moments and step count), and running it
        again would apply the update twice. The step gives up with a report.
        """
        opt = self.optimizer
        if opt is None:
            return
        counters = OomCounters.read(self.device) if self._counted else None
        try:
            if self.scaler is not None:
                if self.clip_grad_norm is not None:
                    self.scaler.unscale_(opt)
                    nn.utils.clip_grad_norm_(self._params, self.clip_grad_norm)
                self.scaler.step(opt)
                self.scaler.update()
            else:
                if self.clip_grad_norm is not None:
                    nn.utils.clip_grad_norm_(self._params, self.clip_grad_norm)
                opt.step()
        except Exception as exc:
            if not is_oom(exc, device=self.device, counters=counters):
                raise
            att = _Attempt(True, exc, str(exc))
        else:
            opt.zero_grad(set_to_none=True)
            return
        release(att.error, self.device)
        att.error = None
        self.ooms += 1
        self._emit("optimizer_oom", n, 1, 0.0, att.message)
        self._give_up(
            n,
            att.message,
            [
                "nothing: the optimizer step ran out of memory after its gradients were "
                "complete, and may have updated part of its state, so it is not run twice; "
                "restore the last checkpoint, and leave room for its temporaries "
                "(foreach=False uses less)"
            ],
            what="the optimizer step does not fit",
        )

    def _loss(self, out: Any, piece: Any) -> torch.Tensor:
        loss = model_loss(out, piece, self.loss_fn)
        if loss is None:
            raise GuardError(
                "the model's output has no loss: pass loss_fn=(output, batch) -> scalar tensor"
            )
        return loss

    # -- inference ----------------------------------------------------------------

    def infer_step(self, batch: Any, fn: Callable[[Any], Any]) -> Any:
        """``fn(batch)``, or ``fn`` over pieces of it joined back in order when memory runs out.

        Pieces that finished are kept; only the rest is split further.
        """
        n = batch_size_of(batch)
        ooms_before = self.ooms
        dev = self.device
        if self.piece_limit is None:
            # The common case, kept lean: the whole batch (an empty one too) in one call.
            t0 = perf_counter()
            counters = OomCounters.read(dev) if self._counted else None
            try:
                result = fn(batch)
            except Exception as exc:
                if not is_oom(exc, device=dev, counters=counters):
                    raise
                att = _Attempt(True, exc, str(exc))
            else:
                self._done(n, n or 1)
                return result
            limit = self._recover(att, n, n, perf_counter() - t0, train=False)
            todo = _ranges(0, n, limit)
        else:
            self._maybe_grow(n)
            limit = self.piece_limit or n or 1
            # (start, end) ranges still to run, and outputs of the ranges done.
            todo = _ranges(0, n, limit) or [(0, n)]  # an empty batch runs once, whole
        done: list[tuple[int, int, Any]] = []
        while todo:
            lo, hi = todo[0]
            t0 = perf_counter()
            counters = OomCounters.read(dev) if self._counted else None
            try:
                piece = batch if (lo, hi) == (0, n) else slice_batch(batch, lo, hi, size=n)
                out = fn(piece)
                del piece
            except Exception as exc:
                if not is_oom(exc, device=dev, counters=counters):
                    raise
                att = _Attempt(True, exc, str(exc))
            else:
                done.append((lo, hi, out))
                del out
                todo.pop(0)
                continue
            piece = None
            limit = self._recover(att, n, hi - lo, perf_counter() - t0, train=False)
            todo = _ranges(lo, n, limit)
        self.recovered += self.ooms - ooms_before
        self._done(n, limit)
        if len(done) == 1:
            return done[0][2]
        return merge_outputs(
            [o for _, _, o in done], [hi - lo for lo, hi, _ in done], reduction=self.reduction
        )

    # -- piece size ---------------------------------------------------------------

    def _recover(
        self,
        att: _Attempt,
        n: int,
        tried: int,
        lost: float,
        train: bool = True,
        peer: bool = False,
    ) -> int:
        """Free the failed attempt, record it, and return the next piece size (or give up).

        ``peer``: this rank's attempt worked, another rank's did not.
        """
        wanted = requested_bytes(att.error) if att.error is not None else 0
        release(att.error, self.device)
        att.error = None
        self.ooms += 0 if peer else 1
        self.time_lost += lost
        kind = "peer_oom" if peer else "oom"
        self._streak = 0
        if not peer and not self._sync and _relievers and self._reliefs < MAX_RELIEFS:
            # Ranks must decide alike, so under DDP the batch is split without this.
            freed = relieve(self.device, wanted)
            if freed > 0:
                self._reliefs += 1
                self._emit(kind, n, math.ceil(n / tried), lost, att.message)
                self._emit("relieve", n, math.ceil(n / tried), 0.0, f"{format_bytes(freed)} freed")
                return tried
        free = _available(self.device)
        self._free_at_oom = free
        if self._grow_from is not None:
            # A probe back up failed: wait twice as long before the next one.
            self._wait = min(self._wait * 2, 4096)
            self._grow_from = None
        if tried > 1:
            new = max(1, tried // 2)
            self.piece_limit = new
            self._emit(kind, n, math.ceil(n / new), lost, att.message, free)
            return new
        if train and self.offload and not self._offloading:
            self._offloading = True
            self.piece_limit = 1
            self._emit(kind, n, n, lost, att.message, free)
            self._emit("offload", n, n, 0.0, "activations saved for backward go to host memory")
            return 1
        self._emit(kind, n, n, lost, att.message, free)
        tried_list = ["pieces of one sample"]
        if self._offloading:
            tried_list.append("activations offloaded to host memory")
        self._give_up(n, att.message, tried_list)
        raise AssertionError("unreachable")

    def _give_up(self, n: int, message: str, attempts: list[str], what: str = "") -> None:
        self._emit("gave_up", n, n, 0.0, message)
        report = memory_report(
            self.device,
            model=_unwrap(self.model),
            optimizer=self.optimizer,
            error=message,
            attempts=attempts,
        )
        raise StepDoesNotFitError(
            f"{what or 'the step does not fit even one sample at a time'} on {self.device.id}",
            report,
        )

    def _maybe_grow(self, n: int) -> None:
        """After ``patience`` good steps, try larger pieces if memory was freed since the OOM."""
        if self.piece_limit is None or self._streak < self._wait:
            return
        free = _available(self.device)
        # Ranks must decide alike: under DDP only the count of good steps decides.
        freed = not self._sync and (
            self._free_at_oom is None or (free is not None and free > self._free_at_oom * 1.05)
        )
        if not freed and self._streak < 4 * self._wait:
            return
        old = self.piece_limit
        self._grow_from = old
        self.piece_limit = None if old * 2 >= n else old * 2
        self._offloading = False
        self._streak = 0
        pieces = math.ceil(n / (self.piece_limit or max(n, 1)))
        self._emit("grow", n, pieces, 0.0, f"from {old}", free)

    def _done(self, n: int, limit: int) -> None:
        self._reliefs = 0
        self._last_n = n
        self.steps += 1
        self.samples += n
        self._streak += 1
        if limit < n:
            self.split_steps += 1
        if self._grow_from is not None:
            self._probe_held()

    def _probe_held(self) -> None:
        if self._streak >= self.patience:
            # The larger pieces held for ``patience`` steps: the probe up worked. An OOM
            # before that counts as a failed probe (the wait doubles), so memory that comes
            # and goes does not make the piece size flap.
            self._grow_from = None
            self._wait = self.patience

    def _warn_batchnorm(self) -> None:
        if self._bn_warned or self.model is None:
            return
        if any(
            isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training
            for m in self.model.modules()
        ):
            warnings.warn(
                "the batch ran in pieces: BatchNorm statistics were computed per piece, so "
                "this step is not exactly the whole batch's (use GroupNorm or LayerNorm, or "
                "a smaller batch, for exact steps)",
                SplitBatchNormWarning,
                stacklevel=4,
            )
        self._bn_warned = True

    def _emit(
        self,
        kind: str,
        n: int,
        pieces: int,
        lost: float,
        detail: str,
        available: int | None = None,
    ) -> None:
        event = GuardEvent(
            kind, self.steps, n, pieces, self.piece_limit, lost, available, detail.split("\n")[0]
        )
        self.events.append(event)
        for fn in [self.on_event, *_listeners]:
            if fn is not None:
                fn(event)


class GuardedFunction:
    """A function run by a :class:`Guard`: see :func:`guarded`."""

    def __init__(self, fn: Callable[..., Any], guard: Guard, train: bool) -> None:
        self.fn = fn
        self.guard = guard
        self.train = train
        self.__wrapped__ = fn
        self.__name__ = getattr(fn, "__name__", "guarded")
        self.__doc__ = getattr(fn, "__doc__", None)

    def __call__(self, batch: Any, *args: Any, **kwargs: Any) -> Any:
        fn = self.fn
        run = (lambda piece: fn(piece, *args, **kwargs)) if args or kwargs else fn
        if self.train:
            return self.guard.train_step(batch, run)
        return self.guard.infer_step(batch, run)

    def summary(self) -> dict[str, Any]:
        return self.guard.summary()


def guarded(
    fn: Callable[..., Any] | None = None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    model: nn.Module | None = None,
    train: bool | None = None,
    **options: Any,
) -> Any:
    """Guard a function of a batch, as a decorator (``@guarded``) or a call.

    For inference, ``fn(batch)`` returns outputs; under memory pressure it runs
    on pieces whose outputs are joined back in order. For training, pass the
    ``optimizer``: ``fn(batch)`` returns the loss, and the guard runs backward
    (per piece when it must) and the optimizer step, returning a
    :class:`StepResult`. Extra arguments of the call go to ``fn`` unchanged.
    ``options`` are :class:`Guard`'s.

    >>> import torch, vramctl
    >>> net = torch.nn.Linear(4, 3)
    >>> @vramctl.guarded
    ... def predict(x):
    ...     return net(x).argmax(dim=1)
    >>> predict(torch.randn(10, 4)).shape
    torch.Size([10])
    """

    def wrap(f: Callable[..., Any]) -> GuardedFunction:
        is_train = optimizer is not None if train is None else train
        if is_train and optimizer is None and model is None:
            raise GuardError("a guarded training function needs optimizer= (or model=)")
        return GuardedFunction(f, Guard(model, optimizer, **options), is_train)

    return wrap(fn) if fn is not None else wrap


# -- helpers ------------------------------------------------------------------------


def _unwrap(model: nn.Module | None) -> nn.Module | None:
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, nn.Module) else model


def _params(model: nn.Module | None, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """The model's parameters and the optimizer's (a loss's own weights), each once.

    Frozen ones are included: one unfrozen later has its gradients handled too.
    """
    seen: dict[int, torch.Tensor] = {}
    if model is not None:
        for p in model.parameters():
            seen.setdefault(id(p), p)
    if optimizer is not None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                seen.setdefault(id(p), p)
    return list(seen.values())


def _check_arguments(
    model: Any,
    optimizer: Any,
    *,
    reduction: Any,
    piece_limit: Any,
    patience: Any,
    clip_grad_norm: Any,
    history: Any,
    callables: dict[str, Any],
) -> None:
    """A one-line :class:`GuardError` for an argument that would otherwise fail later, or
    silently."""
    if model is not None and not isinstance(model, nn.Module):
        raise GuardError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not (
        hasattr(optimizer, "param_groups") and callable(getattr(optimizer, "step", None))
    ):
        raise GuardError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if not isinstance(reduction, str) or reduction not in REDUCTIONS:
        raise GuardError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    for name, value, least in (
        ("piece_limit", piece_limit, 1),
        ("patience", patience, 1),
        ("history", history, 0),
    ):
        if value is None and name == "piece_limit":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise GuardError(f"{name} must be an integer of at least {least}, got {value!r}")
    if clip_grad_norm is not None and (
        isinstance(clip_grad_norm, bool)
        or not isinstance(clip_grad_norm, int | float)
        or not clip_grad_norm > 0  # a negative norm would flip the gradients' sign
    ):
        raise GuardError(f"clip_grad_norm must be a positive number, got {clip_grad_norm!r}")
    for name, fn in callables.items():
        if fn is not None and not callable(fn):
            raise GuardError(f"{name} must be callable, got {fn!r}")


def _available(device: Device) -> int | None:
    try:
        return device.available()
    except Exception:
        return None


def _ranges(start: int, n: int, limit: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + limit, n)) for lo in range(start, n, limit)]


def stash_grads(params: Sequence[torch.Tensor]) -> list[torch.Tensor | None] | None:
    """Set existing gradients aside (no copy), so a failed attempt cannot touch them."""
    for p in params:  # usually all None: a plain loop is the cheapest look
        if p.grad is not None:
            break
    else:
        return None
    stash = [p.grad for p in params]
    for p in params:
        p.grad = None
    return stash


def restore_grads(
    params: Sequence[torch.Tensor], stash: list[torch.Tensor | None] | None, add: bool = False
) -> None:
    """Put gradients :func:`stash_grads` set aside back (``add``: onto the ones there now)."""
    if stash is None:
        return
    for p, old in zip(params, stash, strict=True):
        if old is None:
            continue
        if add and p.grad is not None:
            p.grad.add_(old)
        else:
            p.grad = old


def drop_grads(params: Sequence[torch.Tensor]) -> None:
    """Set every gradient to None (what a failed attempt accumulated)."""
    for p in params:
        p.grad = None
