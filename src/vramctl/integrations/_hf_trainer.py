"""The Hugging Face ``Trainer``'s training step, guarded against OOM: :class:`GuardedTrainer`
and :class:`GuardedTrainingMixin` (:mod:`vramctl.integrations.transformers`)."""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from vramctl._optional import require

require(
    ("transformers", "accelerate"), extra="transformers", what="vramctl.integrations.transformers"
)

from transformers import Trainer  # noqa: E402

from vramctl.device import Device  # noqa: E402
from vramctl.guard import Guard, GuardEvent, is_oom, release  # noqa: E402
from vramctl.guard._shared import (  # noqa: E402
    OomCounters,
    batch_size_of,
    drop_grads,
    restore_grads,
    slice_batch,
    stash_grads,
)
from vramctl.integrations._hf_callback import VramctlCallback  # noqa: E402
from vramctl.integrations._hf_common import TrainerIntegrationError, training_device  # noqa: E402

__all__ = ["REDUCTIONS", "GuardedTrainer", "GuardedTrainingMixin"]

#: Loss reductions the guarded step accepts: "auto" finds out (see GuardedTrainingMixin).
REDUCTIONS = ("auto", "mean", "sum")


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
            "device": training_device(self.args, guard_device),
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
