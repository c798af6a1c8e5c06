"""vramctl for the Hugging Face ``Trainer``: monitoring, a fitted batch size, OOM recovery.

Three pieces, each usable on its own (``pip install 'vramctl[transformers]'``):

- :class:`VramctlCallback`, a ``TrainerCallback``: a :class:`vramctl.Monitor` on the
  training device from ``on_train_begin`` to ``on_train_end``; leak detection at every
  optimizer step (``monitor.step()``); memory readings (``vramctl/used_gib``,
  ``vramctl/peak_gib``, and a guarded trainer's ``vramctl/ooms`` ...) added to every log, so
  that they are in ``trainer.state.log_history`` and, with :meth:`VramctlCallback.attach`,
  reach the reporting integrations (TensorBoard, W&B ...); alerts logged as warnings (or
  above) and leak reports as warnings; ``stop_on_leak=True`` stops training at a leak.
- :func:`fit_trainer_batch_size`, the replacement for ``auto_find_batch_size``: called
  before the ``Trainer`` is built, it fits the per-device batch with
  :func:`vramctl.fit.fit_batch_size` (a few real steps like the Trainer's, seeded by the
  estimator, cached) and splits the effective batch into per-device batch and
  accumulation steps exactly (:func:`vramctl.integrations.split_effective_batch`).
- :class:`GuardedTrainer` (or :class:`GuardedTrainingMixin` for your own ``Trainer``
  subclass): a ``training_step`` that survives an out-of-memory error in forward or
  backward. The batch is run again in pieces by a :class:`vramctl.Guard`, each piece's loss
  computed as the Trainer computes it, so the accumulated gradients are the whole batch's;
  the piece size grows back to whole batches after ``patience`` good steps.

One process and one device: DeepSpeed, FSDP and multi-GPU runs are not supported by the
guarded training step (a clear error says so). See ``docs/integrations.md``.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from vramctl._errors import VramctlError
from vramctl._optional import require

require(
    ("transformers", "accelerate"), extra="transformers", what="vramctl.integrations.transformers"
)

from transformers import (  # noqa: E402
    DefaultFlowCallback,
    PreTrainedModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    default_data_collator,
)

from vramctl.device import Device, current_device, resolve  # noqa: E402
from vramctl.fit import FitError, FitResult, cache_root, fit_batch_size  # noqa: E402
from vramctl.guard import (  # noqa: E402
    Guard,
    GuardEvent,
    OomCounters,
    batch_size_of,
    drop_grads,
    is_oom,
    release,
    restore_grads,
    slice_batch,
    stash_grads,
)
from vramctl.integrations._data import batch_maker, loss_of, split_effective_batch  # noqa: E402
from vramctl.monitor import Alert, LeakReport, Level, Monitor, Rule  # noqa: E402

__all__ = [
    "GuardedTrainer",
    "GuardedTrainingMixin",
    "TrainerBatchSize",
    "TrainerIntegrationError",
    "VramctlCallback",
    "fit_trainer_batch_size",
]

log = logging.getLogger(__name__)

GiB = 2**30

#: The reading names this module adds to the Trainer's logs.
PREFIX = "vramctl/"

#: Loss reductions the guarded step accepts: "auto" finds out (see GuardedTrainingMixin).
REDUCTIONS = ("auto", "mean", "sum")


class TrainerIntegrationError(VramctlError, ValueError):
    """A setting the Hugging Face integration cannot work with, said with what to do."""


def _training_device(args: Any, device: Device | str | int | None) -> Device:
    """``device``; else the active simulated GPU; else the device the Trainer trains on."""
    if device is not None:
        return resolve(device)
    current = current_device()
    if current.is_simulated:
        return current
    try:
        return resolve(str(args.device))
    except VramctlError:  # a device vramctl does not manage (mps, xla): its host
        return resolve("cpu")


def _gib(value: Any) -> float | None:
    return round(value / GiB, 6) if isinstance(value, int) and value >= 0 else None


# -- the callback ---------------------------------------------------------------------


class VramctlCallback(TrainerCallback):
    """A ``TrainerCallback`` that monitors the training device's memory.

    - ``on_train_begin`` starts a :class:`vramctl.Monitor` on ``device`` (default: the
      active simulated GPU, else the Trainer's ``args.device``) sampling every
      ``interval`` seconds with ``rules`` (default: the monitor's default rules);
      ``on_train_end`` stops it (:attr:`monitor` stays readable afterwards).
    - ``on_step_end`` (once per optimizer step) calls ``monitor.step()``: a leak is
      logged as a warning with its report, kept in :attr:`leaks`, and with
      ``stop_on_leak=True`` stops training (``control.should_training_stop``).
    - Alerts at ``alert_level`` or above are kept in :attr:`alerts`; the monitor logs
      every alert once, on the ``vramctl.monitor`` logger at its level (warning, error,
      critical).
    - ``on_log`` adds the readings of :meth:`readings` to the logs: ``vramctl/used_gib``
      (the device's memory in use now), ``vramctl/peak_gib`` (its highest: the highest
      sample since training began, or what is held outside this process's allocator now
      plus the allocator's peak, which sees the spikes between samples), and for a
      guarded trainer ``vramctl/ooms`` (OOMs survived) and ``vramctl/split_steps`` (steps
      run in pieces). They are written into the entry of ``trainer.state.log_history``
      for that log as well. The Trainer calls callbacks in
      order, and adds the reporting integrations' before yours: call :meth:`attach` (a
      :class:`GuardedTrainer` does it for the instances in its ``callbacks``) to run this
      one before them, so that they report the readings too.
    """

    def __init__(
        self,
        device: Device | str | int | None = None,
        interval: float = 1.0,
        rules: Sequence[Rule] | None = None,
        *,
        stop_on_leak: bool = False,
        alert_level: Level | str = Level.WARNING,
        guard: Guard | None = None,
    ) -> None:
        if not isinstance(interval, int | float) or isinstance(interval, bool) or interval <= 0:
            raise TrainerIntegrationError(
                f"interval={interval!r}: the sampling interval is a positive number of seconds"
            )
        if guard is not None and not isinstance(guard, Guard):
            raise TrainerIntegrationError(f"guard must be a vramctl.Guard, got {guard!r}")
        self.device_spec = device
        self.interval = float(interval)
        self.rules = None if rules is None else list(rules)
        self.stop_on_leak = bool(stop_on_leak)
        self.alert_level = Level.parse(alert_level)
        #: The guard whose counts are logged (set by :meth:`attach` or a GuardedTrainer).
        self.guard = guard
        #: The monitor of the latest training run (None before the first).
        self.monitor: Monitor | None = None
        self.device: Device | None = None
        #: Leaks reported, and alerts at ``alert_level`` or above, in this callback's runs.
        self.leaks: list[LeakReport] = []
        self.alerts: list[Alert] = []

    def attach(self, trainer: Any) -> VramctlCallback:
        """Add this callback to ``trainer`` right after its ``DefaultFlowCallback``.

        There it runs before the reporting integrations, which then log its readings;
        ``trainer.add_callback`` would put it after them. Takes the trainer's ``guard``
        (a :class:`GuardedTrainer`'s) when it has one. Returns the callback.
        """
        handler = getattr(trainer, "callback_handler", None)
        callbacks = getattr(handler, "callbacks", None)
        if not isinstance(callbacks, list):
            raise TrainerIntegrationError(
                f"attach needs a transformers Trainer, got {type(trainer).__name__}"
            )
        if any(cb is self for cb in callbacks):
            callbacks.remove(self)
        at = next(
            (i + 1 for i, cb in enumerate(callbacks) if isinstance(cb, DefaultFlowCallback)), 0
        )
        callbacks.insert(at, self)
        found = getattr(trainer, "guard", None)
        if self.guard is None and isinstance(found, Guard):
            self.guard = found
        return self

    # -- events ---------------------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.close()
        self.device = dev = _training_device(args, self.device_spec)
        self.monitor = mon = Monitor([dev], self.interval, rules=self.rules)
        mon.on_alert(self._on_alert, level=self.alert_level)
        mon.start()
        mon.sample()  # the peak starts from what training begins with
        return control

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        mon, dev = self.monitor, self.device
        if mon is None or dev is None:
            return control
        # The detector's own tensors (its first reading's probe) are host memory, not the
        # training device's: on a simulated GPU they would take its budget.
        with dev.uncounted():
            report = mon.step()
        if report is not None:
            self.leaks.append(report)
            log.warning("vramctl: %s", report.format())
            if self.stop_on_leak:
                log.warning(
                    "vramctl: training stops at step %d (stop_on_leak=True)", state.global_step
                )
                control.should_training_stop = True
        return control

    def on_log(
        self,
        args: Any,
        state: Any,
        control: Any,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        if logs is None or self.monitor is None:
            return control
        readings = self.readings(sample=True)
        history = getattr(state, "log_history", None)
        if history:
            # The Trainer appends a copy of ``logs`` (with "step") just before on_log.
            entry = history[-1]
            if (
                isinstance(entry, dict)
                and entry.get("step") == state.global_step
                and all(k in entry for k in logs)
            ):
                entry.update(readings)
        logs.update(readings)
        return control

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.monitor is not None:
            self.monitor.stop()
        return control

    # -- readings -------------------------------------------------------------------

    def readings(self, sample: bool = False) -> dict[str, float | int]:
        """The numbers added to the logs (``sample=True`` reads the device first)."""
        mon, dev = self.monitor, self.device
        out: dict[str, float | int] = {}
        if mon is not None and dev is not None:
            if sample:
                mon.sample()
            latest = mon.history.latest(dev.id)
            now = latest.memory if latest is not None else None
            used = _gib(now.used) if now is not None else None
            if used is not None:
                out[PREFIX + "used_gib"] = used
            peak = mon.history.peak(dev.id)
            highs = [peak.used]
            if (
                now is not None
                and isinstance(now.used, int)
                and isinstance(now.reserved, int)
                and isinstance(peak.reserved, int)
            ):
                # What is held outside this process's allocator now, plus the allocator's
                # own peak, which sees the spikes between samples.
                highs.append(now.used - now.reserved + peak.reserved)
            found = [v for v in map(_gib, highs) if v is not None]
            if found:
                out[PREFIX + "peak_gib"] = max(found)
        if self.guard is not None:
            out[PREFIX + "ooms"] = self.guard.ooms
            out[PREFIX + "split_steps"] = self.guard.split_steps
        return out

    def close(self) -> None:
        """Stop the monitor (training that ends with an error does not call on_train_end)."""
        if self.monitor is not None:
            self.monitor.stop()

    def _on_alert(self, alert: Alert) -> None:
        # The monitor has logged it already (logger "vramctl.monitor", at its level); a
        # leak's whole report is logged by on_step_end.
        if alert.rule != "leak":
            self.alerts.append(alert)


# -- the fitted batch size ----------------------------------------------------------------


@dataclass(frozen=True)
class TrainerBatchSize:
    """What :func:`fit_trainer_batch_size` found: the Trainer's two batch settings.

    ``per_device_train_batch_size * gradient_accumulation_steps == effective_batch``
    exactly; ``fit`` is the batch-size fit it is based on (``fit.batch_size`` is the
    largest per-device batch that fitted, up to the effective batch).
    """

    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    effective_batch: int
    fit: FitResult

    def apply(self, args: Any) -> Any:
        """Set the two fields on ``args`` (a ``TrainingArguments``) and return it.

        Call it before the ``Trainer`` is built (it reads them then). A set
        ``auto_find_batch_size`` is turned off: its halving loop would override the fit.
        """
        if not isinstance(args, TrainingArguments):
            raise TrainerIntegrationError(
                f"apply needs the TrainingArguments, got {type(args).__name__}"
            )
        args.per_device_train_batch_size = self.per_device_train_batch_size
        args.gradient_accumulation_steps = self.gradient_accumulation_steps
        if getattr(args, "auto_find_batch_size", False):
            log.warning(
                "vramctl: auto_find_batch_size turned off: the batch size was fitted instead"
            )
            args.auto_find_batch_size = False
        return args


def fit_trainer_batch_size(
    model: torch.nn.Module,
    args: Any,
    train_dataset: Any,
    data_collator: Callable[[list[Any]], Any] | None = None,
    *,
    effective_batch: int | None = None,
    device: Device | str | int | None = None,
    target: float = 0.9,
    cache: bool = True,
    cache_dir: str | Path | None = None,
    estimate: bool = True,
    estimate_options: dict[str, Any] | None = None,
) -> TrainerBatchSize:
    """The per-device batch and accumulation steps for ``args``, fitted to the device.

    The documented replacement for ``TrainingArguments(auto_find_batch_size=True)``: call
    it before the ``Trainer`` is built, then ``.apply(args)``. It runs
    :func:`vramctl.fit.fit_batch_size` with a step like the Trainer's (the dict batch as
    the model's keyword arguments, its ``loss``, backward, gradient clipping with
    ``args.max_grad_norm``, the optimizer the Trainer builds from ``args`` (AdamW with the
    args' learning rate and weight decay by default), autocast with ``args.bf16`` or
    ``args.fp16``, gradient checkpointing with ``args.gradient_checkpointing``) on batches
    of ``train_dataset`` collated by ``data_collator`` (default: ``default_data_collator``;
    give the Trainer's). The first probe is the estimator's answer, so it usually takes three
    real probes or fewer, and the answer is cached (``cache``, ``cache_dir``).

    The search goes up to ``effective_batch`` (default: the args'
    ``per_device_train_batch_size * gradient_accumulation_steps``, per device); the
    effective batch is then split exactly (:func:`~vramctl.integrations.split_effective_batch`):
    the per-device batch is the largest divisor of it that fits. ``device`` defaults to the
    active simulated GPU, else ``args.device``; the model is placed there (as the Trainer
    would) and its weights, optimizer state and random number generators are put back after
    the probes. ``target`` is the share of the device the step may peak at.

    Unlike ``auto_find_batch_size``, nothing is halved blindly and no failed attempt stays
    alive: each probe measures its peak, and an OOM is freed outside the ``except`` block.
    """
    _check_fit_input(model, args, train_dataset, data_collator, effective_batch)
    effective = (
        effective_batch
        if effective_batch is not None
        else int(args.per_device_train_batch_size) * int(args.gradient_accumulation_steps)
    )
    dev = _training_device(args, device)
    if not getattr(model, "hf_device_map", None):
        dev.adopt(model)  # where the Trainer puts it (a simulated GPU counts it)
    if getattr(args, "gradient_checkpointing", False):
        enable = getattr(model, "gradient_checkpointing_enable", None)
        if callable(enable):  # as Trainer.train does
            enable(gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs)
    was_training = model.training
    model.train()
    optimizer = _trainer_optimizer(model, args)
    params = [p for p in model.parameters() if p.requires_grad]
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
    clip = float(args.max_grad_norm or 0.0)
    device_type = dev.torch_device.type

    def step(batch: Any) -> None:
        autocast = (
            torch.autocast(device_type=device_type, dtype=dtype)
            if dtype is not None
            else contextlib.nullcontext()
        )
        with autocast:
            out = model(**batch)
        loss = _model_loss(out)
        loss.backward()
        del out, loss
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(params, clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    options = dict(estimate_options or {})
    options.setdefault("loss_fn", lambda out, batch: _model_loss(out))
    if dtype is not None:
        options.setdefault("precision", "amp-bf16" if args.bf16 else "amp-fp16")
    # The fit's cache key hashes the step's code, not the values it closes over: the
    # settings that change its memory choose the cache's folder.
    tag = f"amp-{dtype}-gc{int(bool(args.gradient_checkpointing))}-clip{int(clip > 0)}"
    where = cache_root(cache_dir) / "transformers" / tag.replace("torch.", "")
    make_batch = batch_maker(
        train_dataset,
        _without_unused_columns(data_collator or default_data_collator, _input_names(model, args)),
        to_device=_batch_mover(dev),
    )
    try:
        fit = fit_batch_size(
            step,
            make_batch,
            device=dev,
            target=target,
            max=effective,
            model=model,
            optimizer=optimizer,
            cache=cache,
            cache_dir=where,
            estimate=estimate,
            estimate_options=options,
        )
    finally:
        optimizer.zero_grad(set_to_none=True)
        model.train(was_training)
    per_device, accumulation = split_effective_batch(effective, fit.batch_size)
    if per_device < fit.batch_size:
        log.info(
            "vramctl: %d samples per device fit, %d divides the effective batch %d exactly",
            fit.batch_size,
            per_device,
            effective,
        )
    return TrainerBatchSize(per_device, accumulation, effective, fit)


def _check_fit_input(
    model: Any, args: Any, dataset: Any, collator: Any, effective_batch: Any
) -> None:
    if not isinstance(model, torch.nn.Module):
        raise FitError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(args, TrainingArguments):
        raise FitError(f"args must be the Trainer's TrainingArguments, got {type(args).__name__}")
    if dataset is None:
        raise FitError("train_dataset is None: the batch size is fitted on real samples")
    if hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__") and len(dataset) == 0:
        raise FitError("train_dataset is empty: no batch can be made from it")
    if collator is not None and not callable(collator):
        raise FitError(f"data_collator must be callable, got {collator!r}")
    if effective_batch is not None and (
        isinstance(effective_batch, bool)
        or not isinstance(effective_batch, int)
        or effective_batch < 1
    ):
        raise FitError(f"effective_batch must be a positive integer, got {effective_batch!r}")
    for name in ("per_device_train_batch_size", "gradient_accumulation_steps"):
        value = getattr(args, name, None)
        if effective_batch is None and (not isinstance(value, int) or value < 1):
            raise FitError(f"args.{name} must be a positive integer, got {value!r}")


def _trainer_optimizer(model: torch.nn.Module, args: Any) -> torch.optim.Optimizer:
    """The optimizer the Trainer would build from ``args``, on the trainable parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise FitError("the model has no trainable parameters: there is nothing to fit")
    groups = [{"params": params, "weight_decay": args.weight_decay}]
    try:
        hf_model = model if isinstance(model, PreTrainedModel) else None
        cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, hf_model)
        if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer):
            opt: torch.optim.Optimizer = cls(groups, **kwargs)
            return opt
    except Exception as exc:  # an optimizer from a package that is not installed
        log.info("vramctl: the args' optimizer could not be built (%s); fitting with AdamW", exc)
    return torch.optim.AdamW(groups, lr=args.learning_rate)


def _model_loss(output: Any) -> torch.Tensor:
    try:
        return loss_of(output)
    except VramctlError:
        raise FitError(
            "the model returned no loss: the Trainer trains on the model's loss, so the "
            "dataset's samples need labels (or pass a data_collator that adds them)"
        ) from None


def _input_names(model: torch.nn.Module, args: Any) -> set[str] | None:
    """The batch keys the Trainer keeps (``remove_unused_columns``), or None for all."""
    if not getattr(args, "remove_unused_columns", True):
        return None
    try:
        names = set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return None
    return names | {"label", "label_ids", "labels", *(args.label_names or [])}


def _without_unused_columns(
    collate: Callable[[list[Any]], Any], keep: set[str] | None
) -> Callable[[list[Any]], Any]:
    """``collate`` given only the samples' keys the model takes, as the Trainer does."""
    if keep is None:
        return collate

    def collate_kept(samples: list[Any]) -> Any:
        return collate(
            [
                {k: v for k, v in s.items() if k in keep} if isinstance(s, Mapping) else s
                for s in samples
            ]
        )

    return collate_kept


def _batch_mover(dev: Device) -> Callable[[Any], Any]:
    def move(batch: Any) -> Any:
        if not isinstance(batch, Mapping):
            raise FitError(
                f"the collated batch is a {type(batch).__name__}: the Trainer calls the model "
                "with a dict batch (its keys as keyword arguments)"
            )
        return {k: dev.put(v) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    return move


# -- the guarded training step --------------------------------------------------------------

if TYPE_CHECKING:
    _TrainerBase = Trainer  # the mixin is mixed into a Trainer: its attributes are there
else:
    _TrainerBase = object


class GuardedTrainingMixin(_TrainerBase):
    """A ``training_step`` that survives an out-of-memory error: mix it into a ``Trainer``.

    ``class MyTrainer(GuardedTrainingMixin, Trainer)``, or use :class:`GuardedTrainer`.
    :attr:`guard` is the :class:`vramctl.Guard` that runs the step:

    - while ``guard.piece_limit`` is None (the steady state), the Trainer's own
      ``training_step`` runs the whole batch; gradients accumulated by earlier
      micro-batches are set aside first (no copy) and added back after, so a failed
      attempt cannot touch them;
    - on an out-of-memory error in forward or backward (``vramctl.is_oom``, with the
      device's OOM counters), the attempt's gradients are dropped, the old ones put back,
      the failed attempt is freed outside the ``except`` block (``guard.recover``), and the
      same batch runs in pieces (``guard.train_step(..., update=False)``). Each piece's
      loss is computed as the Trainer computes it (``compute_loss`` with
      ``num_items_in_batch``, its division by the accumulation steps, Accelerate's
      division and ``GradScaler``), so the pieces' gradients add up to the whole batch's.
      The piece size is kept for the next steps and grows back after ``patience`` good ones.

    How a piece's loss adds up (``loss_reduction``): ``"sum"`` when the loss is a sum over
    the whole batch's items divided by ``num_items_in_batch`` (each piece's loss is its
    share: causal LM losses of models that take loss kwargs); ``"mean"`` when it is a mean
    over the micro-batch (pieces weighted by what the Trainer counts as its items: labels
    other than -100, shifted for a causal LM, so a token mean is weighted by tokens and a
    sample mean by samples; else by samples; or by your ``weight_fn(piece)``). ``"auto"`` (the
    default) measures it once, on the first recovery: the loss of samples 0 and 1 together
    against theirs apart (no gradients, in eval mode, random state kept). The Trainer's own
    flag (``model_accepts_loss_kwargs``) is not enough: models that take ``**kwargs`` but
    compute a plain mean, such as ``BertForSequenceClassification``, have it set.

    Not supported (a :class:`TrainerIntegrationError` says so): several processes or GPUs
    (``args.world_size > 1``, ``n_gpu > 1``), DeepSpeed, FSDP, and the LOMO optimizers
    (they update the weights inside backward). An OOM in the optimizer step is not
    recovered (it may already have updated part of its state).
    """

    guard: Guard

    def __init__(
        self,
        *args: Any,
        weight_fn: Callable[[Any], float | torch.Tensor] | None = None,
        loss_reduction: str = "auto",
        guard_device: Device | str | int | None = None,
        patience: int = 16,
        piece_limit: int | None = None,
        offload: bool = True,
        on_guard_event: Callable[[GuardEvent], None] | None = None,
        **kwargs: Any,
    ) -> None:
        if loss_reduction not in REDUCTIONS:
            raise TrainerIntegrationError(
                f"loss_reduction must be 'auto', 'mean' or 'sum', got {loss_reduction!r}"
            )
        if weight_fn is not None and not callable(weight_fn):
            raise TrainerIntegrationError(f"weight_fn must be callable, got {weight_fn!r}")
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if training_args is not None:
            _check_supported(training_args)
        super().__init__(*args, **kwargs)
        _check_supported(self.args, self)
        self._vramctl_weight_fn = weight_fn
        self._vramctl_reduction = loss_reduction
        self._vramctl_found: dict[bool, str] = {}  # by "num_items_in_batch is given"
        self._vramctl_params: list[torch.Tensor] | None = None
        self._vramctl_with_optimizer = False
        self._vramctl_options: dict[str, Any] = {
            "device": _training_device(self.args, guard_device),
            "patience": patience,
            "piece_limit": piece_limit,
            "offload": offload,
            "on_event": on_guard_event,
        }
        self.guard = self._vramctl_guard()
        for cb in list(self.callback_handler.callbacks):
            if isinstance(cb, VramctlCallback):
                cb.attach(self)

    def _vramctl_guard(self) -> Guard:
        """A guard for the model the Trainer trains now (``model_init`` makes a new one)."""
        optimizer = self.optimizer if isinstance(self.optimizer, torch.optim.Optimizer) else None
        try:
            guard = Guard(
                self.model,
                optimizer,
                scaler=getattr(self.accelerator, "scaler", None),
                **self._vramctl_options,
            )
        except ValueError as exc:
            raise TrainerIntegrationError(str(exc)) from None
        for cb in self.callback_handler.callbacks:
            if isinstance(cb, VramctlCallback) and cb.guard in (None, getattr(self, "guard", None)):
                cb.guard = guard
        self._vramctl_params = None
        return guard

    def training_step(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        guard = self.guard
        if guard.model is not self.model:  # model_init made a new model for this run
            guard = self.guard = self._vramctl_guard()
        if guard.piece_limit is not None:
            return self._vramctl_pieces(model, inputs, num_items_in_batch)
        params = self._vramctl_parameters()
        stash = stash_grads(params)
        dev = guard.device
        counters = OomCounters.read(dev) if OomCounters.kept(dev) else None
        t0 = time.perf_counter()
        error: BaseException | None = None
        try:
            loss: torch.Tensor = super().training_step(model, inputs, num_items_in_batch)
        except Exception as exc:
            drop_grads(params)
            if not is_oom(exc, device=dev, counters=counters):
                restore_grads(params, stash)
                raise
            error = exc
        else:
            restore_grads(params, stash, add=True)
            # Counted as the guard counts its own whole steps (the good steps before it
            # grows back, a probe of larger pieces that held).
            n = batch_size_of(inputs)
            guard.record_step(n)
            return loss
        # Out of memory whole: the attempt is freed here, outside the except block.
        restore_grads(params, stash)
        stash = None
        guard.recover(error, batch_size_of(inputs), time.perf_counter() - t0)
        error = None
        return self._vramctl_pieces(model, inputs, num_items_in_batch)

    # -- pieces -------------------------------------------------------------------------

    def _vramctl_pieces(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        num_items_in_batch: torch.Tensor | int | None,
    ) -> torch.Tensor:
        """The Trainer's step on ``inputs``, run by the guard (in pieces while it must)."""
        guard = self.guard
        model.train()
        opt_train = getattr(self.optimizer, "train", None)
        if callable(opt_train):  # schedule-free optimizers
            opt_train()
        prepared = self._prepare_inputs(inputs)
        scaled = self._vramctl_scaled_for_ga(num_items_in_batch)
        ga = getattr(self, "current_gradient_accumulation_steps", None)
        ga = ga if isinstance(ga, int) and ga > 0 else int(self.args.gradient_accumulation_steps)
        acc = int(getattr(self.accelerator, "gradient_accumulation_steps", 1) or 1)

        def piece_loss(piece: Any) -> torch.Tensor:
            # A shallow copy: compute_loss may pop "labels" from what it is given.
            piece = dict(piece) if isinstance(piece, Mapping) else piece
            with self.compute_loss_context_manager():
                out = self.compute_loss(model, piece, num_items_in_batch=num_items_in_batch)
            loss = out if isinstance(out, torch.Tensor) else out[0]
            if not scaled:
                loss = loss / ga
            return loss / acc if acc != 1 else loss  # Accelerate's backward divides too

        guard.reduction = self._vramctl_reduction_for(
            model, prepared, piece_loss, num_items_in_batch, scaled
        )
        guard.weight_fn = self._vramctl_weight_fn or self._vramctl_items
        guard.scaler = getattr(self.accelerator, "scaler", None)
        result = guard.train_step(prepared, piece_loss, update=False)
        every = getattr(self.args, "torch_empty_cache_steps", None)
        if every is not None and self.state.global_step % every == 0:
            guard.device.release_cache()
        loss = result.loss * acc if acc != 1 else result.loss
        return loss.detach().to(self.args.device)

    def _vramctl_scaled_for_ga(self, num_items_in_batch: torch.Tensor | int | None) -> bool:
        """Whether the Trainer takes the loss as scaled for accumulation (its own rule)."""
        given = getattr(self, "loss_is_scaled_for_ga", None)
        if given is not None:
            return bool(given)
        return bool(
            (getattr(self, "model_accepts_loss_kwargs", False) and num_items_in_batch is not None)
            or getattr(self, "compute_loss_func", None) is not None
        )

    def _vramctl_reduction_for(
        self,
        model: torch.nn.Module,
        batch: Any,
        piece_loss: Callable[[Any], torch.Tensor],
        num_items_in_batch: torch.Tensor | int | None,
        scaled: bool,
    ) -> str:
        if self._vramctl_reduction != "auto":
            return self._vramctl_reduction
        key = num_items_in_batch is not None
        found = self._vramctl_found.get(key)
        if found is not None:
            return found
        fallback = "sum" if scaled and num_items_in_batch is not None else "mean"
        n = batch_size_of(batch)
        if n < 2:  # one sample runs whole: no reduction is needed yet
            return fallback
        measured, why = _measure_reduction(
            model,
            batch,
            n,
            piece_loss,
            self._vramctl_weight_fn or self._vramctl_items,
            self.guard.device,
        )
        if measured is None:
            warnings.warn(
                f"vramctl could not tell how the loss reduces over samples ({why}); its pieces "
                f"are combined as a {fallback}: pass loss_reduction='mean' or 'sum' (and a "
                "weight_fn for a mean over tokens) to say it",
                UserWarning,
                stacklevel=3,
            )
            measured = fallback
        self._vramctl_found[key] = measured
        return measured

    def _vramctl_items(self, piece: Any) -> int:
        """A piece's weight in a mean: the items the Trainer counts in ``num_items_in_batch``
        (labels other than -100, shifted for a causal LM's loss), else its samples."""
        labels = None
        if isinstance(piece, Mapping):
            if isinstance(piece.get("shift_labels"), torch.Tensor):
                labels = piece["shift_labels"]
            elif isinstance(piece.get("labels"), torch.Tensor):
                labels = piece["labels"]
                if labels.dim() >= 2 and self._vramctl_shifts_labels():
                    labels = labels[..., 1:]
        if labels is None:
            return batch_size_of(piece)
        return int(labels.ne(-100).sum())

    def _vramctl_shifts_labels(self) -> bool:
        """Whether the loss predicts label ``i + 1`` at position ``i`` (a causal LM's)."""
        found: bool | None = getattr(self, "_vramctl_shift", None)
        if found is None:
            found = bool(getattr(self, "_loss_shifts_labels", False)) or _causal_lm_loss(
                self.accelerator.unwrap_model(self.model)
            )
            self._vramctl_shift = found
        return found

    def _vramctl_parameters(self) -> list[torch.Tensor]:
        params = self._vramctl_params
        if params is None or (self.optimizer is not None and not self._vramctl_with_optimizer):
            model = self.model
            seen: dict[int, torch.Tensor] = (
                {} if model is None else {id(p): p for p in model.parameters()}
            )
            opt = self.optimizer
            for group in getattr(opt, "param_groups", ()):
                for p in group["params"]:
                    seen.setdefault(id(p), p)
            params = self._vramctl_params = list(seen.values())
            self._vramctl_with_optimizer = opt is not None
        return params


class GuardedTrainer(GuardedTrainingMixin, Trainer):
    """A ``transformers.Trainer`` whose training step survives out-of-memory errors.

    Takes the ``Trainer``'s arguments, and keyword-only: ``weight_fn``,
    ``loss_reduction`` (``"auto"``, ``"mean"``, ``"sum"``), ``guard_device``,
    ``patience``, ``piece_limit``, ``offload`` and ``on_guard_event`` (see
    :class:`GuardedTrainingMixin` and :class:`vramctl.Guard`). ``trainer.guard`` is the
    :class:`vramctl.Guard`; :class:`VramctlCallback` instances in ``callbacks`` are attached
    to it (their logs gain ``vramctl/ooms`` and ``vramctl/split_steps``).
    """


def _causal_lm_loss(model: Any) -> bool:
    """Whether ``model``'s loss function is transformers' causal LM loss (which shifts the
    labels) and not an encoder-decoder's. The Trainer's own test reads the model's
    ``loss_type``, which is None for class names such as ``GPT2LMHeadModel``, whose loss
    function is then the causal LM's all the same."""
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:  # transformers before 4.46
        return False
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        return False
    try:
        return getattr(model, "loss_function", None) is ForCausalLMLoss
    except Exception:
        return False


def _check_supported(args: Any, trainer: Any = None) -> None:
    """A clear error for the setups the guarded step does not support."""
    problems = []
    world = getattr(args, "world_size", 1)
    if isinstance(world, int) and world > 1:
        problems.append(f"{world} processes (args.world_size)")
    n_gpu = getattr(args, "n_gpu", 0)
    if isinstance(n_gpu, int) and n_gpu > 1:
        problems.append(f"{n_gpu} GPUs in one process (DataParallel)")
    if getattr(args, "deepspeed", None) or getattr(trainer, "is_deepspeed_enabled", False):
        problems.append("DeepSpeed")
    if getattr(args, "fsdp", None) or getattr(trainer, "is_fsdp_enabled", False):
        problems.append("FSDP")
    optim = str(getattr(args, "optim", "")).lower()
    if "lomo" in optim:
        problems.append(f"the {optim.rsplit('.', 1)[-1]} optimizer (it updates inside backward)")
    if problems:
        raise TrainerIntegrationError(
            "the guarded training step runs one process on one device, and is not supported "
            f"with {', '.join(problems)}: use the plain Trainer there (VramctlCallback and "
            "fit_trainer_batch_size still work), or vramctl.Guard in your own loop"
        )


@contextlib.contextmanager
def _kept_random_state(dev: Device) -> Iterator[None]:
    devices = [dev.torch_device.index or 0] if dev.is_cuda else []
    with torch.random.fork_rng(devices=devices):
        yield


def _measure_reduction(
    model: torch.nn.Module,
    batch: Any,
    n: int,
    piece_loss: Callable[[Any], torch.Tensor],
    weight_fn: Callable[[Any], float | torch.Tensor] | None,
    dev: Device,
) -> tuple[str | None, str]:
    """``"sum"`` or ``"mean"``: how the loss of samples 0 and 1 relates to theirs apart."""
    a, b, both = (slice_batch(batch, lo, hi, size=n) for lo, hi in ((0, 1), (1, 2), (0, 2)))
    was_training = model.training
    failure: BaseException | None = None
    values: list[float] = []
    try:
        with torch.no_grad(), _kept_random_state(dev):
            model.eval()
            values = [float(piece_loss(p)) for p in (a, b, both)]
    except Exception as exc:
        if not is_oom(exc, device=dev):
            raise
        failure = exc
    finally:
        model.train(was_training)
    if failure is not None:
        release(failure, dev)
        return None, "measuring it ran out of memory"
    la, lb, lab = values
    wa, wb = (1.0, 1.0) if weight_fn is None else (float(weight_fn(a)), float(weight_fn(b)))
    if not all(math.isfinite(v) for v in (la, lb, lab, wa, wb)) or wa + wb <= 0:
        return None, "a loss or a weight of one sample is not finite"
    errors = {"sum": abs(lab - (la + lb)), "mean": abs(lab - (wa * la + wb * lb) / (wa + wb))}
    best = min(errors, key=lambda k: errors[k])
    other = errors["mean" if best == "sum" else "sum"]
    scale = max(abs(lab), abs(la), abs(lb), 1e-12)
    if errors[best] <= 2e-2 * scale and other > 10 * errors[best]:
        return best, ""
    return None, (
        f"two samples' loss {lab:.6g} is neither their sum {la + lb:.6g} nor their "
        f"mean {(wa * la + wb * lb) / (wa + wb):.6g}"
    )
