"""vramctl in Lightning: three callbacks, one line each.

- :class:`VramctlBatchSize` picks the batch size before training with
  :func:`vramctl.fit.fit_batch_size` (estimate-seeded, a target share of the device, 1-3 real
  probes, cached) and sets it where Lightning's own ``BatchSizeFinder`` does (the model, its
  ``hparams``, the datamodule); under DDP every rank measures its own device and all take the
  smallest answer (or rank 0's).
- :class:`VramctlGuard` survives an out-of-memory error inside a training step of Lightning's
  automatic optimization: the batch finishes in pieces with the same gradients, as
  :class:`vramctl.Guard` does, and the optimizer steps once.
- :class:`VramctlMonitor` logs the device's memory through the trainer's loggers, raises the
  monitor's alerts as warnings and runs the leak detector once per step.

>>> import lightning as L
>>> from vramctl.integrations.lightning import VramctlBatchSize, VramctlGuard, VramctlMonitor
>>> callbacks = [VramctlBatchSize(), VramctlGuard(), VramctlMonitor()]

Needs ``pip install 'vramctl[lightning]'``. See ``docs/integrations.md``.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from vramctl._errors import VramctlError
from vramctl._optional import require

require("lightning", extra="lightning", what="vramctl.integrations.lightning")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.utilities.parsing import lightning_hasattr, lightning_setattr  # noqa: E402

from vramctl.device import Device, resolve  # noqa: E402
from vramctl.fit import FitResult, fit_batch_size  # noqa: E402
from vramctl.guard import Guard, GuardEvent, is_oom  # noqa: E402
from vramctl.guard._shared import OomCounters, batch_size_of, drop_grads, restore_grads, stash_grads  # noqa: E402
from vramctl.integrations._data import batch_maker, loss_of  # noqa: E402
from vramctl.monitor import Alert, LeakReport, Monitor  # noqa: E402

__all__ = ["LightningIntegrationError", "VramctlBatchSize", "VramctlGuard", "VramctlMonitor"]

log = logging.getLogger("vramctl.integrations")

DeviceArg = Device | str | int | Callable[["pl.Trainer"], Device | str | int] | None


class LightningIntegrationError(VramctlError, RuntimeError):
    """A callback cannot do its work with this trainer or module (the message says why)."""


def _device(arg: DeviceArg, trainer: pl.Trainer, module: pl.LightningModule) -> Device:
    """The device the callback measures: ``arg`` (a callable gets the trainer), else the
    active simulated GPU, else the one the module's parameters are on."""
    if callable(arg) and not isinstance(arg, Device):
        arg = arg(trainer)
    if arg is not None:
        return resolve(arg)
    dev = resolve(None, model=module)
    if not dev.active and module.device.type == "cuda":
        dev = resolve(module.device.index or 0)
    return dev


@contextlib.contextmanager
def _entered(dev: Device, *owners: Any) -> Iterator[Device]:
    """``dev``, entered for the block if it is a simulated GPU not yet active (with ``owners``
    adopted, as if moved onto it)."""
    if dev.active:
        yield dev
        return
    with dev as entered:  # type: ignore[attr-defined]
        for owner in owners:
            if owner is not None:
                entered.adopt(owner)
        yield entered


@contextlib.contextmanager
def _no_logging(module: pl.LightningModule) -> Iterator[None]:
    """``self.log`` and ``self.log_dict`` do nothing inside (a probe is not a training step)."""
    had = {name: name in vars(module) for name in ("log", "log_dict")}
    module.log = lambda *args, **kwargs: None  # type: ignore[method-assign]
    module.log_dict = lambda *args, **kwargs: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        for name, own in had.items():
            if not own:
                delattr(module, name)


def _optimizer(trainer: pl.Trainer, what: str) -> torch.optim.Optimizer:
    if not trainer.optimizers:
        raise LightningIntegrationError(
            f"{what} needs the optimizer: configure_optimizers returned none"
        )
    if len(trainer.optimizers) > 1:
        raise LightningIntegrationError(
            f"{what} supports one optimizer in automatic optimization; this module has "
            f"{len(trainer.optimizers)}"
        )
    return trainer.optimizers[0]


# -- the batch size -------------------------------------------------------------------------


class _ProbeStep:
    """One training step of the module, as fit_batch_size probes it and the estimator sees it."""

    def __init__(
        self, trainer: pl.Trainer, module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        self.trainer = trainer
        self.model = module
        self.optimizer = optimizer

    @staticmethod
    def forward(model: Any, batch: Any) -> torch.Tensor:
        return loss_of(model.training_step(batch, 0))

    @staticmethod
    def loss_fn(output: Any, batch: Any) -> torch.Tensor:
        return loss_of(output)

    def __call__(self, batch: Any) -> None:
        with self.trainer.precision_plugin.train_step_context():
            loss = self.forward(self.model, batch)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class VramctlBatchSize(pl.Callback):
    """Pick the largest batch size that fits ``target`` of the device before training starts.

    At ``on_fit_start`` (the optimizer exists, nothing has trained), this runs
    :func:`vramctl.fit.fit_batch_size` on the module's own ``training_step`` and
    optimizer, with batches of real samples from the train dataloader's dataset and
    collate function, moved by the module's transfer hooks. The estimator seeds the
    search, 1-3 real probes settle it, and the weights, optimizer state and random
    generators are put back afterwards. The answer is set as ``batch_arg_name`` on
    the model, its ``hparams`` or the datamodule (where Lightning's ``BatchSizeFinder``
    looks) and the train dataloader is built again with it.

    ``max_val`` caps the answer (default: none above the dataset's length).
    ``device``: where to measure (default: the active simulated GPU, else the
    module's GPU); a callable gets the trainer (one device per rank). A simulated GPU
    given by name is entered for the search with the module and optimizer adopted.
    Under DDP each rank measures its own device; ``agree="min"`` (default) gives every
    rank the smallest answer, ``agree="rank0"`` rank 0's. ``result`` holds the
    :class:`~vramctl.fit.FitResult` (this rank's) and ``batch_size`` the size set.
    """

    def __init__(
        self,
        *,
        batch_arg_name: str = "batch_size",
        target: float = 0.9,
        max_val: int | None = None,
        device: DeviceArg = None,
        cache: bool = True,
        steps_per_probe: int = 2,
        agree: str = "min",
        estimate: bool = True,
    ) -> None:
        if agree not in ("min", "rank0"):
            raise LightningIntegrationError(f"agree must be 'min' or 'rank0', got {agree!r}")
        if max_val is not None and (isinstance(max_val, bool) or max_val < 1):
            raise LightningIntegrationError(f"max_val must be a positive integer, got {max_val!r}")
        self.batch_arg_name = batch_arg_name
        self.target = target
        self.max_val = max_val
        self.device = device
        self.cache = cache
        self.steps_per_probe = steps_per_probe
        self.agree = agree
        self.estimate = estimate
        self.result: FitResult | None = None
        self.batch_size: int | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not lightning_hasattr(pl_module, self.batch_arg_name):
            raise LightningIntegrationError(
                f"VramctlBatchSize sets {self.batch_arg_name!r}, which is not an attribute of "
                "the model, its hparams or the datamodule: add it (self.batch_size = 32 in "
                "__init__, used by train_dataloader) or pass batch_arg_name="
            )

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.scale_batch_size(trainer, pl_module)

    def scale_batch_size(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> int:
        """Run the search now and set the answer; returns it."""
        optimizer = _optimizer(trainer, "VramctlBatchSize")
        loop = trainer.fit_loop
        loop.setup_data()
        loader = trainer.train_dataloader
        if isinstance(loader, list | tuple | dict):
            raise LightningIntegrationError(
                "VramctlBatchSize needs one train dataloader; this module has several"
            )
        if not isinstance(loader, torch.utils.data.DataLoader):
            raise LightningIntegrationError(
                f"VramctlBatchSize needs a torch DataLoader for training, got {type(loader)}"
            )
        make_batch = batch_maker(
            loader.dataset, loader.collate_fn, to_device=trainer.strategy.batch_to_device
        )
        upper = self.max_val
        try:
            length = len(loader.dataset)  # type: ignore[arg-type]
        except TypeError:
            length = None
        if length:
            upper = length if upper is None else min(upper, length)
        dev = _device(self.device, trainer, pl_module)
        step = _ProbeStep(trainer, pl_module, optimizer)
        with _entered(dev, pl_module, optimizer) as active, _no_logging(pl_module):
            was_training = pl_module.training
            pl_module.train()
            try:
                self.result = fit_batch_size(
                    step,
                    make_batch,
                    device=active,
                    target=self.target,
                    max=upper,
                    model=pl_module,
                    optimizer=optimizer,
                    cache=self.cache,
                    steps_per_probe=self.steps_per_probe,
                    estimate=self.estimate,
                )
            finally:
                pl_module.train(was_training)
        size = self._agreed(trainer, self.result.batch_size)
        lightning_setattr(pl_module, self.batch_arg_name, size)
        self.batch_size = size
        loop._combined_loader = None  # built again with the new size
        loop.setup_data()
        log.info(
            "VramctlBatchSize: %s = %d on %s (%d probes, %s)",
            self.batch_arg_name,
            size,
            self.result.device,
            len(self.result.probes),
            self.result.source,
        )
        return size

    def _agreed(self, trainer: pl.Trainer, size: int) -> int:
        if trainer.world_size <= 1:
            return size
        if self.agree == "rank0":
            return int(trainer.strategy.broadcast(size, src=0))
        # Every rank's answer, then the smallest: a rank whose GPU has less room decides.
        sizes = trainer.strategy.all_gather(
            torch.tensor([size], device=trainer.strategy.root_device)
        )
        return int(torch.as_tensor(sizes).min().item())


# -- the guard ------------------------------------------------------------------------------


class _Held:
    """A tensor saved for backward, held here so that a failed backward can let it go."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor | None) -> None:
        self.tensor = tensor


@dataclass
class _Whole:
    """A batch whose training_step ran whole; its backward is Lightning's, watched."""

    batch: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    raw: torch.Tensor
    n: int
    #: What the forward saved for backward: let go when the backward runs out of memory
    #: (Lightning still holds the loss, and with it the graph).
    held: list[_Held]


class _Deferred(torch.autograd.Function):
    """A loss whose gradients were already computed in pieces: backward adds them, scaled by
    the gradient Lightning's backward brings (its accumulation and AMP scaling)."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, value: torch.Tensor, apply: Any) -> torch.Tensor:
        ctx.add_grads = apply
        return value.detach().clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:
        ctx.add_grads(grad)
        return None, None, None


class VramctlGuard(pl.Callback):
    """OOM recovery for Lightning's automatic optimization: the batch finishes in pieces.

    The module's ``training_step`` and ``backward`` are watched. While batches fit,
    Lightning runs them as always (the only cost: a look for gradients to set aside
    and one scalar gradient per step). When the forward or the backward runs out of
    memory, the failed attempt is freed and the **same batch** runs through a
    :class:`vramctl.Guard`: forward and backward per piece, each piece's loss weighted
    by its share, so the gradients are the whole batch's; Lightning then clips, steps
    the optimizer once and logs as usual, with its gradient accumulation and AMP
    scaling applied exactly. Later steps keep the smaller pieces until ``patience``
    good steps have passed, then grow back (see ``docs/guard.md``).

    ``guard`` is the :class:`vramctl.Guard` (its ``events`` and ``summary()``).
    ``reduction``, ``weight_fn``, ``patience``, ``offload`` and ``piece_limit`` are the
    guard's. Limits: manual optimization is not supported (its steps are the user's
    code: use :class:`vramctl.Guard` there) and neither are several processes (DDP,
    FSDP, DeepSpeed: the pieces would need the ranks to agree inside Lightning's
    backward); BatchNorm statistics are per piece. A split step logs once, as a whole
    one does: each piece's ``self.log`` (and ``self.log_dict``) calls are held, and each
    name is logged once with the whole batch's value (``reduce_fx`` ``"mean"``: the
    pieces' values weighted by their sizes, or by the ``batch_size`` given; ``"sum"``,
    ``"max"``, ``"min"``: theirs over the pieces; a torchmetrics ``Metric``: the last
    call, its state holding every piece's). Where the whole batch's forward ran and
    logged before its backward ran out of memory, the pieces log nothing more (a value
    logged before a forward ran out of memory is logged again by the pieces).
    """

    def __init__(
        self,
        *,
        device: DeviceArg = None,
        reduction: str = "mean",
        weight_fn: Callable[[Any], float | torch.Tensor] | None = None,
        patience: int = 16,
        offload: bool = True,
        piece_limit: int | None = None,
        on_event: Callable[[GuardEvent], None] | None = None,
    ) -> None:
        self.device = device
        self.options: dict[str, Any] = {
            "reduction": reduction,
            "weight_fn": weight_fn,
            "patience": patience,
            "offload": offload,
            "piece_limit": piece_limit,
            "on_event": on_event,
        }
        self.guard: Guard | None = None
        self._module: pl.LightningModule | None = None
        self._trainer: pl.Trainer | None = None
        self._whole: _Whole | None = None
        self._training_step: Callable[..., Any] | None = None
        self._backward: Callable[..., Any] | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not pl_module.automatic_optimization:
            raise LightningIntegrationError(
                "VramctlGuard works with automatic optimization; with manual optimization the "
                "steps are your code: run them through vramctl.Guard(model, optimizer).step"
            )
        if trainer.world_size > 1:
            raise LightningIntegrationError(
                f"VramctlGuard runs in one process; this trainer has {trainer.world_size} "
                "(DDP, FSDP and DeepSpeed are not supported: use vramctl.Guard in your own "
                "loop, whose ranks agree on every OOM)"
            )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        optimizer = _optimizer(trainer, "VramctlGuard")
        dev = _device(self.device, trainer, pl_module)
        self.guard = Guard(pl_module, optimizer, device=dev, **self.options)
        self._module, self._trainer = pl_module, trainer
        self._training_step = pl_module.training_step
        self._backward = pl_module.backward
        pl_module.training_step = self._guarded_training_step  # type: ignore[method-assign]
        pl_module.backward = self._guarded_backward  # type: ignore[method-assign]

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._unwrap()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._unwrap()

    def _unwrap(self) -> None:
        module = self._module
        if module is not None:
            for name in ("training_step", "backward"):
                if name in vars(module):
                    delattr(module, name)
        self._module = None
        self._whole = None

    # -- the watched hooks ----------------------------------------------------------------

    def _guarded_training_step(self, batch: Any, *args: Any, **kwargs: Any) -> Any:
        guard, step = self.guard, self._training_step
        assert guard is not None and step is not None
        self._whole = None
        n = batch_size_of(batch)
        if guard.piece_limit is None:
            counters = OomCounters.read(guard.device)
            t0 = time.perf_counter()
            failure: BaseException | None = None
            held: list[_Held] = []

            def pack(t: torch.Tensor) -> _Held:
                h = _Held(t)
                held.append(h)
                return h

            try:
                with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
                    out = step(batch, *args, **kwargs)
            except Exception as exc:
                if not is_oom(exc, device=guard.device, counters=counters):
                    raise
                failure = exc
            else:
                raw = _loss_or_none(out)
                if raw is not None and raw.requires_grad:
                    self._whole = _Whole(batch, args, kwargs, raw, n, held)
                return out
            guard.recover(failure, n, time.perf_counter() - t0)
            failure = None
        return self._split_before_backward(batch, args, kwargs)

    def _guarded_backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        guard, backward, whole = self.guard, self._backward, self._whole
        assert guard is not None and backward is not None
        self._whole = None
        if whole is None:  # a split step's stand-in, or a step the guard does not watch
            backward(loss, *args, **kwargs)
            return
        try:
            # What Lightning did to the loss (accumulation, AMP scaling) as one factor, while
            # its graph is whole: the pieces get the same.
            (factor,) = torch.autograd.grad(loss, whole.raw, retain_graph=True)
        except RuntimeError:
            backward(loss, *args, **kwargs)
            return
        params = guard.params
        stash = stash_grads(params)
        counters = OomCounters.read(guard.device)
        t0 = time.perf_counter()
        failure: BaseException | None = None
        try:
            backward(loss, *args, **kwargs)
        except Exception as exc:
            if not is_oom(exc, device=guard.device, counters=counters):
                restore_grads(params, stash)
                raise
            failure = exc
        else:
            restore_grads(params, stash, add=True)
            guard.record_step(whole.n)
            return
        del loss
        whole.raw = None  # type: ignore[assignment]
        for h in whole.held:
            h.tensor = None
        whole.held.clear()
        drop_grads(params)
        restore_grads(params, stash)
        guard.recover(failure, whole.n, time.perf_counter() - t0)
        failure = None
        scale = factor.detach()
        # The whole batch's training_step ran, and logged: its pieces do not log again.
        self._pieces(whole.batch, whole.args, whole.kwargs, scale, logged=True)

    def _split_before_backward(
        self, batch: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> torch.Tensor:
        """The batch in pieces before Lightning's zero_grad and backward: the gradients are
        kept aside and added by the stand-in loss's backward, times the factor it brings."""
        guard, trainer = self.guard, self._trainer
        assert guard is not None and trainer is not None
        params = guard.params
        batch_idx = args[0] if args else kwargs.get("batch_idx", 0)
        zeroing = int(batch_idx) % max(1, trainer.accumulate_grad_batches) == 0
        if zeroing:  # Lightning clears them before its backward: clear them now, not after
            drop_grads(params)
        old = stash_grads(params)
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        multiplier = float(scaler.get_scale()) if scaler is not None else 1.0
        result = self._pieces(batch, args, kwargs, torch.tensor(multiplier))
        new = stash_grads(params)
        restore_grads(params, old)

        def add(grad: torch.Tensor) -> None:
            if new is None:
                return
            factor = grad.detach() / multiplier
            for g in new:
                if g is not None:
                    g.mul_(factor.to(g.dtype))
            restore_grads(params, new, add=True)
            new.clear()

        anchor = torch.zeros((), requires_grad=True)
        value = (result / multiplier).to(torch.float32)
        out: torch.Tensor = _Deferred.apply(anchor, value, add)  # type: ignore[no-untyped-call]
        return out

    def _pieces(
        self,
        batch: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        scale: torch.Tensor,
        *,
        logged: bool = False,
    ) -> torch.Tensor:
        """Forward and backward of ``batch`` in the guard's pieces, each loss times ``scale``:
        the gradients land in ``.grad``; returns the whole batch's loss times ``scale``.
        The pieces' ``self.log`` calls are made once per name for the whole batch after
        the last piece (none where the whole batch's step has ``logged`` already)."""
        guard, step, trainer, module = self.guard, self._training_step, self._trainer, self._module
        assert guard is not None and step is not None and trainer is not None
        assert module is not None
        logs = _PieceLogs(module, guard)

        def piece_loss(piece: Any) -> torch.Tensor:
            logs.piece(piece)
            return loss_of(step(piece, *args, **kwargs)) * scale.to(torch.float32)

        with logs.held(), trainer.precision_plugin.train_step_context(), torch.enable_grad():
            result = guard.train_step(batch, piece_loss, update=False)
        if not logged:
            logs.log_once()
        return result.loss


#: ``LightningModule.log``'s parameters: how a call's name, value, reduction and batch size
#: are found.
_LOG = inspect.signature(pl.LightningModule.log)


class _PieceLogs:
    """A split step's ``self.log`` calls: held while its pieces run, then made once per
    name with the whole batch's value (:meth:`log_once`).

    A call belongs to the guard's attempt it was made in (its OOM count then): an
    attempt that runs out of memory is run again in smaller pieces, and only the last
    attempt's calls are the batch's."""

    def __init__(self, module: pl.LightningModule, guard: Guard) -> None:
        self.module = module
        self.guard = guard
        self.log = module.log  # the module's own (or what another callback put there)
        #: Each name's calls: (attempt, the piece's size, the call's arguments).
        self.calls: dict[str, list[tuple[int, int, inspect.BoundArguments]]] = {}
        self.size = 0

    def piece(self, piece: Any) -> None:
        """The next calls are ``piece``'s."""
        self.size = batch_size_of(piece)

    def _hold(self, *args: Any, **kwargs: Any) -> None:
        try:  # read as Lightning's own log reads it, whatever wraps it
            call = _LOG.bind(self.module, *args, **kwargs)
        except TypeError:
            self.log(*args, **kwargs)  # not a call this knows: as it was (or its error)
            return
        call.apply_defaults()
        value = call.arguments["value"]
        if isinstance(value, torch.Tensor) and not call.arguments.get("enable_graph"):
            call.arguments["value"] = value.detach()  # as Lightning does: not the piece's graph
        self.calls.setdefault(call.arguments["name"], []).append((self.guard.ooms, self.size, call))

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """``self.log`` (``self.log_dict`` calls it) held inside."""
        module = self.module
        own = "log" in vars(module)
        module.log = self._hold  # type: ignore[method-assign]
        try:
            yield
        finally:
            if own:
                module.log = self.log  # type: ignore[method-assign]
            else:
                del module.log

    def log_once(self) -> None:
        """Each name held, logged once with the last attempt's pieces combined."""
        attempt = self.guard.ooms
        for calls in self.calls.values():
            kept = [(size, call) for a, size, call in calls if a == attempt]
            if kept:
                call = _combined(kept).arguments
                self.log(**{k: v for k, v in call.items() if k != "self"})


def _combined(calls: list[tuple[int, inspect.BoundArguments]]) -> inspect.BoundArguments:
    """One ``self.log`` call for the pieces' ``calls`` (each with its piece's size): the
    last call, with the pieces' values reduced as Lightning reduces a name's values over
    batches, and their ``batch_size`` summed where they gave one."""
    last = calls[-1][1]
    values = [c.arguments["value"] for _, c in calls]
    if len(calls) == 1 or not all(_scalar(v) for v in values):
        return last  # a torchmetrics Metric holds every piece's state itself
    given = [c.arguments.get("batch_size") for _, c in calls]
    sizes = [
        float(g) if g is not None else float(n) for (n, _), g in zip(calls, given, strict=True)
    ]
    first = values[0]
    like = first if isinstance(first, torch.Tensor) and first.is_floating_point() else None
    stacked = torch.stack([torch.as_tensor(v).detach().to(torch.float64).cpu() for v in values])
    fx = last.arguments.get("reduce_fx", "mean")
    name = fx.lower() if isinstance(fx, str) else getattr(fx, "__name__", "")
    if fx is torch.sum or name == "sum":
        value = stacked.sum()
    elif fx is torch.max or name == "max":
        value = stacked.max()
    elif fx is torch.min or name == "min":
        value = stacked.min()
    elif (fx is torch.mean or name in ("mean", "avg")) and sum(sizes) > 0:
        value = (stacked * torch.tensor(sizes, dtype=torch.float64)).sum() / sum(sizes)
    else:  # a reduction Lightning refuses anyway
        return last
    out = inspect.BoundArguments(last.signature, last.arguments.copy())
    out.arguments["value"] = (
        value.to(like.dtype).to(like.device) if like is not None else value.to(torch.float32)
    )
    if any(g is not None for g in given):
        out.arguments["batch_size"] = int(sum(sizes))
    return out


def _scalar(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _trainer_every(trainer: pl.Trainer) -> int:
    """The trainer's ``log_every_n_steps`` (its logger connector sets it on the trainer)."""
    every = getattr(trainer, "log_every_n_steps", None)
    return every if isinstance(every, int) and every > 0 else 50


def _unpack(h: _Held) -> torch.Tensor:
    if h.tensor is None:
        raise LightningIntegrationError("this step's graph was freed after an OOM")
    return h.tensor


def _loss_or_none(out: Any) -> torch.Tensor | None:
    if out is None:
        return None
    try:
        return loss_of(out)
    except VramctlError:
        return None


# -- the monitor ----------------------------------------------------------------------------


class VramctlMonitor(pl.Callback):
    """The device's memory through the trainer's loggers, alerts as warnings, leaks per step.

    A :class:`vramctl.Monitor` samples the training device every ``interval``
    seconds on a daemon thread from ``on_fit_start`` to the end of fitting. Every
    ``log_every_n_steps`` optimizer steps (default: the trainer's) its latest reading is
    logged to every logger of the trainer, as ``{prefix}used_bytes``,
    ``{prefix}total_bytes``, ``{prefix}peak_used_bytes``, ``{prefix}allocated_bytes``,
    ``{prefix}reserved_bytes`` and ``{prefix}alerts``, with a :class:`VramctlGuard`'s
    ``{prefix}ooms`` and ``{prefix}split_steps`` when one is among the callbacks.
    Alerts at ``alert_level`` or above are logged as warnings (logger
    ``vramctl.integrations``); ``leaks=True`` runs the leak detector after every
    training batch, and ``stop_on_leak=True`` stops training at the first leak.
    ``monitor`` holds the :class:`vramctl.Monitor`; ``leaks_found`` the reports.
    """

    def __init__(
        self,
        *,
        device: DeviceArg = None,
        interval: float = 1.0,
        rules: Any = None,
        log_every_n_steps: int | None = None,
        prefix: str = "vramctl/",
        leaks: bool = True,
        stop_on_leak: bool = False,
        alert_level: str = "warning",
    ) -> None:
        if log_every_n_steps is not None and log_every_n_steps < 1:
            raise LightningIntegrationError(
                f"log_every_n_steps must be at least 1, got {log_every_n_steps!r}"
            )
        self.device = device
        self.interval = interval
        self.rules = rules
        self.log_every_n_steps = log_every_n_steps
        self.prefix = prefix
        self.leaks = leaks
        self.stop_on_leak = stop_on_leak
        self.alert_level = alert_level
        self.monitor: Monitor | None = None
        self.leaks_found: list[LeakReport] = []
        self.alerts: list[Alert] = []
        self._dev: Device | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._dev = dev = _device(self.device, trainer, pl_module)
        self.monitor = Monitor([dev], interval=self.interval, rules=self.rules)
        self.monitor.on_alert(self._alert, level=self.alert_level)
        self.monitor.start()

    def _alert(self, alert: Alert) -> None:
        self.alerts.append(alert)
        log.warning("vramctl: %s", alert)

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        mon = self.monitor
        if mon is None:
            return
        if self.leaks:
            report = mon.step()
            if report is not None:
                self.leaks_found.append(report)
                log.warning("vramctl: %s", report)
                if self.stop_on_leak:
                    trainer.should_stop = True
        every = self.log_every_n_steps or _trainer_every(trainer)
        if trainer.loggers and (trainer.global_step % every == 0):
            self.log_memory(trainer)

    def metrics(self, trainer: pl.Trainer | None = None) -> dict[str, float]:
        """The latest reading (sampled now) as the numbers logged."""
        mon, dev = self.monitor, self._dev
        if mon is None or dev is None:
            return {}
        mon.sample()
        latest = mon.history.latest(dev.id)
        if latest is None:
            return {}
        state = latest.memory
        peak = mon.history.peak(dev.id)
        p = self.prefix
        out: dict[str, float] = {}
        for name, value in (
            ("used_bytes", state.used),
            ("total_bytes", state.total),
            ("allocated_bytes", state.allocated),
            ("reserved_bytes", state.reserved),
            ("peak_used_bytes", getattr(peak, "used", None)),
        ):
            if isinstance(value, int | float) and not isinstance(value, bool):
                out[p + name] = float(value)
        out[p + "alerts"] = float(len(self.alerts))
        out[p + "leaks"] = float(len(self.leaks_found))
        for cb in trainer.callbacks if trainer is not None else []:  # type: ignore[attr-defined]
            if isinstance(cb, VramctlGuard) and cb.guard is not None:
                out[p + "ooms"] = float(cb.guard.ooms)
                out[p + "split_steps"] = float(cb.guard.split_steps)
        return out

    def log_memory(self, trainer: pl.Trainer) -> None:
        metrics = self.metrics(trainer)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.loggers and self.monitor is not None:
            self.log_memory(trainer)
        self._stop()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._stop()

    def _stop(self) -> None:
        if self.monitor is not None:
            self.monitor.stop()
