"""The Hugging Face ``Trainer``'s batch size, fitted: :func:`fit_trainer_batch_size`
(:mod:`vramctl.integrations.transformers`)."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vramctl._errors import VramctlError
from vramctl._optional import require

require(
    ("transformers", "accelerate"), extra="transformers", what="vramctl.integrations.transformers"
)

from transformers import (  # noqa: E402
    PreTrainedModel,
    Trainer,
    TrainingArguments,
    default_data_collator,
)

from vramctl.device import Device  # noqa: E402
from vramctl.estimator import Step  # noqa: E402
from vramctl.fit import FitError, FitResult, fit_batch_size  # noqa: E402
from vramctl.fit._shared import cache_root  # noqa: E402
from vramctl.integrations._data import batch_maker, loss_of, split_effective_batch  # noqa: E402
from vramctl.integrations._hf_common import (  # noqa: E402
    TrainerIntegrationError,
    log,
    training_device,
)

__all__ = ["TrainerBatchSize", "fit_trainer_batch_size"]


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
    estimate_options: Step | Mapping[str, Any] | None = None,
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
    ``estimate_options`` are :func:`~vramctl.fit.fit_batch_size`'s: a :class:`vramctl.Step`
    or a mapping of its fields; the Trainer's loss and precision fill in where they say
    nothing.
    """
    _check_fit_input(model, args, train_dataset, data_collator, effective_batch)
    effective = (
        effective_batch
        if effective_batch is not None
        else int(args.per_device_train_batch_size) * int(args.gradient_accumulation_steps)
    )
    dev = training_device(args, device)
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

    # The estimate's options (a Step, or a mapping as fit_batch_size takes), with the
    # Trainer's loss and precision where they say nothing (Step.of's rule).
    defaults: dict[str, Any] = {"loss_fn": lambda out, batch: _model_loss(out)}
    if dtype is not None:
        defaults["precision"] = "amp-bf16" if args.bf16 else "amp-fp16"
    options: Step | dict[str, Any]
    if isinstance(estimate_options, Mapping):
        options = {**defaults, **estimate_options}
    else:
        options = Step.of(estimate_options, **defaults)
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
