"""Applying a :class:`~vramctl.optimize.Plan` to a model: its LoRA adapter, checkpointing,
TF32, offloading the saved activations, the optimizer's kernel, and a step helper in the
plan's precision."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from vramctl._optional import require
from vramctl.device import Device, current_device, resolve
from vramctl.estimator import EstimateError
from vramctl.estimator._shared import lora_config
from vramctl.optimize._checkpoint import apply_checkpointing
from vramctl.optimize._errors import OptimizeError
from vramctl.optimize._helper import StepHelper
from vramctl.optimize._offload import OffloadedOptimizer
from vramctl.optimize._optimizer import fast_kernel, rebuild_optimizer


class Plan(Protocol):
    """What applying a plan reads of it (a :class:`~vramctl.optimize.Plan` is one; the
    plan's class calls this module, so this module names only the choices it applies)."""

    @property
    def precision(self) -> str: ...
    @property
    def checkpointing(self) -> str: ...
    @property
    def offload(self) -> str: ...
    @property
    def optimizer(self) -> str: ...
    @property
    def tf32(self) -> bool: ...
    @property
    def micro_batch(self) -> int: ...
    @property
    def accumulation(self) -> int: ...
    @property
    def finetune(self) -> str: ...
    @property
    def adapter(self) -> Any: ...


__all__ = ["AppliedPlan", "apply_plan"]

_AMP = {"fp32": "fp32", "amp-bf16": "bf16", "amp-fp16": "fp16", "bf16": "bf16", "fp16": "fp16"}


@dataclass
class AppliedPlan:
    """A plan applied to a model: run ``accumulation`` micro-batches of ``micro_batch``
    samples through ``step`` per optimizer step.

    ``undo()`` puts the model's checkpointing and offloading back as they were.
    """

    plan: Plan
    model: nn.Module
    step: StepHelper
    notes: list[str] = field(default_factory=list)
    _undo: list[Callable[[], None]] = field(default_factory=list, repr=False)

    @property
    def micro_batch(self) -> int:
        return self.plan.micro_batch

    @property
    def accumulation(self) -> int:
        return self.plan.accumulation

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()

    def __iter__(self) -> Any:
        return iter((self.model, self.step))


def _offload_forward(model: nn.Module, device: Device) -> Callable[[], None]:
    """Enter the device's activation offloading around every forward of ``model``."""
    stacks: list[contextlib.ExitStack] = []

    def pre(_mod: nn.Module, _args: Any) -> None:
        stack = contextlib.ExitStack()
        stack.enter_context(device.offload_activations())
        stacks.append(stack)

    def post(_mod: nn.Module, _args: Any, _out: Any) -> None:
        if stacks:
            stacks.pop().close()

    h1 = model.register_forward_pre_hook(pre)
    h2 = model.register_forward_hook(post, always_call=True)

    def undo() -> None:
        h1.remove()
        h2.remove()

    return undo


def _eight_bit(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    groups = optimizer.param_groups
    try:
        from torchao.optim import AdamW8bit

        return AdamW8bit(groups)  # type: ignore[no-any-return]
    except ImportError:
        pass
    try:
        import bitsandbytes as bnb

        opt = bnb.optim.AdamW8bit(groups)  # type: ignore[attr-defined,no-untyped-call,unused-ignore]
        return opt  # type: ignore[no-any-return,unused-ignore]
    except ImportError as exc:
        raise OptimizeError("adamw-8bit needs torchao or bitsandbytes installed") from exc


#: The layers of a model quantized for QLoRA (bitsandbytes' 4-bit and 8-bit linears).
_QUANTIZED_LINEARS = ("Linear4bit", "Linear8bitLt")


def _adapt(plan: Plan, model: nn.Module, notes: list[str]) -> tuple[nn.Module, Any]:
    """``model`` with the plan's LoRA adapter (PEFT's ``get_peft_model``), and a function that
    takes it off again (None where nothing was added)."""
    if plan.finetune == "full":
        return model, None
    peft = require("peft", extra="finetune", what=f"a {plan.finetune} plan")
    if isinstance(model, peft.PeftModel):
        notes.append("the model already is a PEFT model: its adapter is trained as it is")
        return model, None
    if plan.finetune == "qlora" and not any(
        type(m).__name__ in _QUANTIZED_LINEARS for m in model.modules()
    ):
        raise OptimizeError(
            "a qlora plan trains an adapter on 4-bit weights: load the model quantized "
            "(from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True, "
            "bnb_4bit_quant_type='nf4', bnb_4bit_use_double_quant=True))) and apply the "
            "plan to it"
        )
    try:
        config = lora_config(plan.adapter)
    except EstimateError as exc:
        raise OptimizeError(str(exc)) from exc
    adapted = peft.get_peft_model(model, config)
    notes.append(
        f"LoRA adapter added by PEFT: {adapted.get_nb_trainable_parameters()[0]:,} "
        "trainable parameters"
    )
    return adapted, adapted.unload


def apply_plan(
    plan: Plan,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    device: Device | str | int | None = None,
) -> AppliedPlan:
    """Apply ``plan`` to ``model`` (in place) and return the step helper that runs it.

    A ``lora`` or ``qlora`` plan adds its LoRA adapter with PEFT's ``get_peft_model``
    (``applied.model`` is then the PEFT model; ``undo()`` unloads it). A ``qlora`` plan
    needs the model loaded with 4-bit weights (bitsandbytes), as QLoRA loads it. An
    optimizer given is made again, with the same settings, over the adapter's parameters.

    ``optimizer`` is the user's; for ``adamw-fused`` it is rebuilt with ``fused=True``
    (same groups, hyper-parameters and state) where PyTorch has the kernel for its
    parameters, and for ``adamw-8bit`` rebuilt as torchao's (or bitsandbytes')
    ``AdamW8bit``. Without one, an ``AdamW`` of the plan's kind is made (``lr=1e-3``).
    A plan that offloads the optimizer wraps it in an
    :class:`~vramctl.optimize.OffloadedOptimizer` (its state and step in host memory):
    step the returned helper's ``step.optimizer``, not the one passed in.
    """
    dev = resolve(device) if device is not None else current_device()
    applied_notes: list[str] = []
    undo: list[Callable[[], None]] = []
    if plan.checkpointing != "none":
        undo.append(apply_checkpointing(model, plan.checkpointing))
    try:
        model, unload = _adapt(plan, model, applied_notes)
    except BaseException:
        for fn in reversed(undo):
            fn()
        raise
    if unload is not None:
        undo.append(unload)
        if optimizer is not None:
            # the optimizer given holds the base's weights, which the adapter freezes
            options = inspect.signature(type(optimizer).__init__).parameters
            kwargs = {k: v for k, v in optimizer.defaults.items() if k in options}
            trainable = [p for p in model.parameters() if p.requires_grad]
            optimizer = type(optimizer)(trainable, **kwargs)
            applied_notes.append(
                f"{type(optimizer).__name__} made again over the adapter's parameters "
                "(same settings)"
            )
    if plan.tf32 and dev.is_cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        applied_notes.append("TF32 on for matrix multiplies and convolutions")
    if "activations" in plan.offload:
        if dev.can_offload:
            undo.append(_offload_forward(model, dev))
        else:
            applied_notes.append(f"activations not offloaded: {dev.id}'s memory is the host's")
    if plan.optimizer != "none":
        if optimizer is None:
            params = [p for p in model.parameters() if p.requires_grad]
            fused = plan.optimizer == "adamw-fused"
            optimizer = torch.optim.AdamW(params, lr=1e-3, fused=True if fused else None)
            if plan.optimizer == "adamw-8bit":
                optimizer = _eight_bit(optimizer)
        elif plan.optimizer == "adamw-fused":
            kernel, why = fast_kernel(optimizer)
            if kernel is not None:
                optimizer = rebuild_optimizer(optimizer, kernel)
            applied_notes.append(why)
        elif plan.optimizer == "adamw-8bit":
            optimizer = _eight_bit(optimizer)
    if "optimizer" in plan.offload and optimizer is not None:
        if dev.can_offload:
            optimizer = OffloadedOptimizer(optimizer, dev)
            applied_notes.append("optimizer state and step in host memory")
        else:
            applied_notes.append(f"optimizer not offloaded: {dev.id}'s memory is the host's")
    precision = _AMP[plan.precision]
    device_type = dev.torch_device.type if dev.is_cuda else "cpu"
    scaler = None
    if precision == "fp16" and plan.optimizer != "none":
        scaler = torch.amp.GradScaler(device_type)
    step = StepHelper(precision, device_type, optimizer, scaler=scaler)
    return AppliedPlan(plan, model, step, applied_notes, undo)
