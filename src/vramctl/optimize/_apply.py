"""``vramctl.optimize``: apply the memory and speed settings that suit a model on a device,
and report each one, applied or skipped with the reason, with its predicted effect."""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vramctl._na import NA
from vramctl._units import format_bytes
from vramctl.device import Device, resolve
from vramctl.device._shared import affinity_cpus, cpu_quota
from vramctl.estimator import Estimate, estimate
from vramctl.optimize._checkpoint import KINDS, apply_checkpointing, find_blocks, is_checkpointed
from vramctl.optimize._checkpoint import has_transformers_checkpointing as _hf_checkpointing
from vramctl.optimize._compile import CompiledForward, compile_forward, short_error
from vramctl.optimize._errors import OptimizeError
from vramctl.optimize._helper import DTYPES, StepHelper
from vramctl.optimize._optimizer import fast_kernel, rebuild_optimizer
from vramctl.optimize._quantize import LINEAR_SHARE, linear_share, quantize_dynamic_int8
from vramctl.optimize._report import Optimization, OptimizationReport
from vramctl.optimize._settings import Overrides, read_overrides

__all__ = [
    "LEVELS",
    "MEMORY_BUDGET",
    "ORDER",
    "PRECISIONS",
    "Optimized",
    "optimize",
    "usable_cores",
]

LEVELS = ("none", "basic", "aggressive")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
_MODES = ("train", "infer")
#: The estimator's name of each precision (autocast: ``amp-``).
_ESTIMATOR_PRECISION = {"fp32": "fp32", "bf16": "amp-bf16", "fp16": "amp-fp16"}
#: ``torch._functorch.config.activation_memory_budget`` under ``torch.compile`` when
#: checkpointing is left to ``level="aggressive"``: keep about half the activations.
MEMORY_BUDGET = 0.5
#: The report's order: the order of application, compilation last.
ORDER = (
    "precision",
    "tf32",
    "cudnn_benchmark",
    "channels_last",
    "optimizer",
    "cpu_threads",
    "quantization",
    "checkpointing",
    "compile",
)
#: Layers cuDNN runs (its autotuner, ``cudnn.benchmark``, has something to choose).
_CUDNN_LAYERS = (nn.modules.conv._ConvNd, nn.RNNBase)


@dataclass(frozen=True)
class Optimized:
    """What :func:`optimize` returns; it unpacks: ``model, step, report = optimize(...)``."""

    #: The model, changed in place (the same object that was passed).
    model: nn.Module
    #: Autocast, loss scaling and the optimizer step in the chosen precision.
    step: StepHelper
    report: OptimizationReport

    def __iter__(self) -> Iterator[Any]:
        return iter((self.model, self.step, self.report))


def usable_cores() -> int:
    """The CPU cores this process may use: its CPU affinity, capped by a cgroup CPU quota
    (a container's ``--cpus``; v1 or v2, the smallest from its cgroup up)."""
    n = affinity_cpus()
    quota = cpu_quota()
    if quota is not None:
        n = min(n, max(1, math.ceil(quota)))
    return n


# -- predictions --------------------------------------------------------------------


class _Pricer:
    """The step priced by the estimator on the target device, per precision (the model as
    it is at the time of asking)."""

    def __init__(
        self,
        model: nn.Module,
        batch: Any,
        mode: str,
        optimizer: torch.optim.Optimizer | None,
        device: Device,
    ) -> None:
        self.model = model
        self.batch = batch
        self.mode = mode
        self.device = device
        self.optimizer = _estimator_optimizer(optimizer)
        #: Why there are no predictions (None: there are).
        self.why: str | None = (
            None
            if batch is not None
            else "no predicted effects: pass example_batch= (one batch the model's forward "
            "takes) to price each change with the estimator"
        )

    @property
    def available(self) -> bool:
        return self.why is None

    def price(self, precision: str) -> Estimate | None:
        if not self.available:
            return None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return estimate(
                    self.model,
                    self.batch,
                    mode=self.mode,
                    precision=_ESTIMATOR_PRECISION[precision],
                    optimizer=self.optimizer,
                    device=self.device,
                )
        except Exception as exc:
            self.why = (
                f"no predicted effects: the estimator could not price the step ({short_error(exc)})"
            )
            return None


def _estimator_optimizer(
    optimizer: torch.optim.Optimizer | None,
) -> str | Callable[[list[torch.Tensor]], torch.optim.Optimizer]:
    """The estimator's optimizer for the step: the given one's class and settings (fused
    kernels aside: the trace runs on fake host tensors), else AdamW."""
    if optimizer is None:
        return "adamw"
    cls = type(optimizer)
    settings = {
        k: v
        for k, v in optimizer.defaults.items()
        if k not in ("fused", "capturable", "differentiable")
    }

    def make(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        try:
            return cls(params, **settings)
        except TypeError:
            return torch.optim.AdamW(params)

    make.__name__ = cls.__name__.lower()
    return make


def _delta(before: Estimate | None, after: Estimate | None) -> tuple[int | None, float | None]:
    if before is None or after is None:
        return None, None
    seconds = (
        after.step_seconds - before.step_seconds
        if after.step_seconds is not None and before.step_seconds is not None
        else None
    )
    return after.peak_device - before.peak_device, seconds


# -- the checks ---------------------------------------------------------------------


def _forward_check(
    model: nn.Module, batch: Any, device_type: str, dtype: torch.dtype
) -> str | None:
    """Run one forward on ``batch`` under autocast; None if it runs, else the error. The
    model's buffers (a BatchNorm's statistics) and the random state are left as they were."""
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    args, kwargs = (
        ((), dict(batch))
        if isinstance(batch, Mapping)
        else (tuple(batch), {})
        if isinstance(batch, tuple | list)
        else ((batch,), {})
    )
    try:
        with (
            # The dropout masks drawn here leave the random state as it was.
            torch.random.fork_rng(devices=None if device_type == "cuda" else []),
            torch.no_grad(),
            torch.autocast(device_type, dtype=dtype),
        ):
            torch.func.functional_call(model, buffers, args, kwargs, strict=False)
    except torch.OutOfMemoryError:
        return None  # the dtype has its kernels; the example batch did not fit
    except Exception as exc:
        return short_error(exc)
    return None


def _has(model: nn.Module, kinds: type | tuple[type, ...]) -> bool:
    return any(isinstance(m, kinds) for m in model.modules())


# -- one run of optimize ------------------------------------------------------------


class _Run:
    def __init__(
        self,
        model: nn.Module,
        device: Device,
        mode: str,
        level: str,
        env: Overrides,
        pricer: _Pricer,
    ) -> None:
        self.model = model
        self.device = device
        self.mode = mode
        self.level = level
        self.env = env
        self.pricer = pricer
        #: level "none" changes nothing: each entry says what would be done.
        self.dry = level == "none"
        self.report = OptimizationReport(device=device.id, level=level, mode=mode)
        self.estimates: dict[str, Estimate | None] = {}

    @property
    def auto_level(self) -> str:
        """The level ``"auto"`` choices follow (a dry run reports what "aggressive" would do)."""
        return "aggressive" if self.dry else self.level

    def applied(
        self,
        name: str,
        reason: str,
        effect: tuple[int | None, float | None] = (None, None),
    ) -> bool:
        """Record ``name`` as applied (or, in a dry run, as what would be); True when the
        caller should go on and apply it."""
        if self.dry:
            reason = f"would apply (level='none' changes nothing): {reason}"
        self.report.add(Optimization(name, not self.dry, reason, *effect))
        return not self.dry

    def skipped(self, name: str, reason: str) -> None:
        self.report.add(Optimization(name, False, reason))

    def priced(self, precision: str) -> Estimate | None:
        """The model as it is now, priced (cached per precision until the model changes)."""
        if precision not in self.estimates:
            self.estimates[precision] = self.pricer.price(precision)
        return self.estimates[precision]

    def describe_device(self) -> str:
        cc = self.device.capability
        return f"{self.device.name}" + ("" if cc is NA else f" (compute capability {cc})")


def _check_choice(name: str, value: object, choices: tuple[object, ...]) -> None:
    if value not in choices:
        shown = ", ".join(repr(c) for c in choices)
        raise OptimizeError(f"{name} must be one of {shown}, got {value!r}")


def _switch(name: str, value: bool | str) -> bool | None:
    """A True/False/"auto" argument: its bool, or None for "auto"."""
    if value == "auto":
        return None
    if isinstance(value, bool):
        return value
    raise OptimizeError(f"{name} must be True, False or 'auto', got {value!r}")


def optimize(
    model: nn.Module,
    *,
    device: Device | str | int | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    mode: str = "train",
    precision: str = "auto",
    checkpointing: str | bool = "auto",
    compile: bool | str = "auto",
    channels_last: bool | str = "auto",
    quantize: bool | str = "auto",
    level: str = "basic",
    example_batch: Any = None,
    static_shapes: bool = True,
    compile_options: Mapping[str, Any] | None = None,
) -> Optimized:
    """Apply the memory and speed settings that suit ``model`` on ``device``; return the
    model (changed in place), a step helper and a report (:class:`Optimized`, which
    unpacks as ``model, step, report``).

    ``level``: ``"basic"`` applies precision (autocast by the device's compute
    capability), TF32, ``cudnn.benchmark``, channels-last, a fused or foreach optimizer and
    the CPU thread count; ``"aggressive"`` adds activation checkpointing, ``torch.compile``
    (on a CUDA GPU) and int8 quantization (inference on the CPU); ``"none"`` changes
    nothing and reports what ``"aggressive"`` would do. An explicit argument
    (``precision="bf16"``, ``checkpointing="full"``, ``compile=True`` ...) wins over the
    level, and a ``VRAMCTL_*`` variable over both (``VRAMCTL_AMP``, ``VRAMCTL_AMP_DTYPE``,
    ``VRAMCTL_TF32``, ``VRAMCTL_CHECKPOINTING``, ``VRAMCTL_COMPILE``,
    ``VRAMCTL_CHANNELS_LAST``).

    ``device`` is anything :func:`vramctl.device.resolve` takes (None: the current one);
    the model should already be on it. ``optimizer`` (training) is rebuilt with fused or
    foreach kernels where PyTorch has them; use ``step.optimizer`` from then on.
    ``example_batch``, one batch the forward takes, lets the estimator price each change
    (the report's memory and time deltas) and checks that the forward runs in the chosen
    precision (where it raises, fp32). ``static_shapes=False`` leaves
    ``cudnn.benchmark`` off. ``compile_options`` go to ``torch.compile`` (``mode``,
    ``backend``, ``fullgraph`` ...).

    An optimization that cannot apply is skipped with its reason; one that fails on the
    model (a compile error at the first call) is undone and the model runs without it.
    """
    _check_choice("mode", mode, _MODES)
    _check_choice("level", level, LEVELS)
    _check_choice("precision", precision, PRECISIONS)
    if isinstance(checkpointing, bool):
        checkpointing = "full" if checkpointing else "none"
    _check_choice("checkpointing", checkpointing, ("auto", *KINDS))
    want_compile = _switch("compile", compile)
    want_channels_last = _switch("channels_last", channels_last)
    want_quantize = _switch("quantize", quantize)
    if not isinstance(model, nn.Module):
        raise OptimizeError(f"optimize takes an nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise OptimizeError(
            f"optimizer must be a torch.optim.Optimizer over the model's parameters, got "
            f"{type(optimizer).__name__}"
        )
    env = read_overrides()
    dev = resolve(device, model=model)
    device_type = dev.torch_device.type
    run = _Run(model, dev, mode, level, env, _Pricer(model, example_batch, mode, optimizer, dev))

    chosen = _precision(run, precision, example_batch, device_type)
    _tf32(run)
    _cudnn_benchmark(run, static_shapes)
    _channels_last(run, want_channels_last)
    new_optimizer = _optimizer(run, optimizer)
    _cpu_threads(run)
    _quantization(run, want_quantize, chosen)
    compiling = _decide_compile(run, want_compile)
    budget = _checkpointing(run, checkpointing, chosen, compiling)
    _compile(run, compiling, budget, compile_options or {})
    run.report.entries.sort(key=lambda o: ORDER.index(o.name))
    if run.pricer.why is not None:
        run.report.notes.append(run.pricer.why)
    elif example_batch is not None:
        opt = type(optimizer).__name__ if optimizer is not None else "AdamW (assumed)"
        what = f"a training step with {opt}" if mode == "train" else "an inference step"
        run.report.notes.append(
            f"effects predicted by the estimator on {dev.id}: {what} on example_batch "
            "(negative: less memory, less time)"
        )

    precision_now = "fp32" if run.dry else chosen
    scaler = (
        torch.amp.GradScaler(device_type) if precision_now == "fp16" and mode == "train" else None
    )
    step = StepHelper(
        precision_now,
        device_type,
        new_optimizer if new_optimizer is not None else optimizer,
        scaler=scaler,
    )
    return Optimized(model, step, run.report)


# -- each optimization --------------------------------------------------------------


def _auto_precision(run: _Run, amp_forced: bool) -> tuple[str, str]:
    """The precision the device suits, and why."""
    cc = run.device.capability
    scaler = " with a GradScaler" if run.mode == "train" else ""
    if cc is NA and run.device.is_gpu:
        if amp_forced:
            return "fp16", f"fp16 autocast{scaler} ({run.device.name}: compute capability unknown)"
        return "fp32", (
            f"fp32: {run.device.name}'s compute capability is unknown; precision='bf16' or "
            "'fp16' asks for autocast"
        )
    if cc is NA:
        if amp_forced:
            return "bf16", "bf16 autocast on the CPU"
        return "fp32", "fp32: the CPU's default (CPU autocast only when asked: precision='bf16')"
    if cc.bf16:
        return "bf16", f"bf16 autocast: {run.describe_device()} has bf16 tensor cores"
    if cc.fp16_tensor_cores or amp_forced:
        return "fp16", (
            f"fp16 autocast{scaler}: {run.describe_device()} has fp16 tensor cores and no "
            "native bf16"
        )
    return "fp32", f"fp32: {run.describe_device()} has no tensor cores for fp16 or bf16"


def _precision(run: _Run, asked: str, batch: Any, device_type: str) -> str:
    env = run.env
    cc = run.device.capability
    if env.amp is False:
        run.skipped("precision", f"fp32: {env.source('amp')}")
        return "fp32"
    if env.amp_dtype is not None:
        chosen, why = env.amp_dtype, f"{env.amp_dtype} autocast: {env.source('amp_dtype')}"
    elif env.amp and asked in ("auto", "fp32"):
        chosen, why = _auto_precision(run, amp_forced=True)
        why += f" ({env.source('amp')})"
    elif asked == "auto":
        chosen, why = _auto_precision(run, amp_forced=False)
    else:
        chosen, why = asked, f"{asked} " + ("as asked" if asked == "fp32" else "autocast, as asked")
        if asked == "bf16" and cc is not NA and not cc.bf16:
            why += f" ({run.describe_device()} has no native bf16: slower than fp16)"
        if asked == "fp16" and run.mode == "train":
            why += ", with a GradScaler"
    if chosen == "fp32":
        run.skipped("precision", why)
        return "fp32"
    dtype = DTYPES[chosen]
    assert dtype is not None
    if batch is not None:
        error = _forward_check(run.model, batch, device_type, dtype)
        if error is not None:
            run.skipped(
                "precision",
                f"fp32: the forward failed under {chosen} autocast on the example batch ({error})",
            )
            return "fp32"
    effect = _delta(run.priced("fp32"), run.priced(chosen))
    if run.mode == "train" and chosen == "fp16" and "GradScaler" not in why:
        why += " (with a GradScaler)"
    run.applied("precision", why, effect)
    return chosen


def _not_cuda(run: _Run) -> str:
    if run.device.is_simulated:
        return "not a CUDA device (a simulated GPU runs its kernels on the CPU)"
    return "not a CUDA device"


def _tf32(run: _Run) -> None:
    cc = run.device.capability
    if not run.device.is_cuda:
        run.skipped("tf32", _not_cuda(run))
    elif run.env.tf32 is False:
        run.skipped("tf32", run.env.source("tf32"))
    elif cc is NA or not cc.tf32:
        run.skipped("tf32", f"{run.describe_device()} has no TF32 tensor cores (8.0 and later)")
    elif run.applied(
        "tf32",
        "fp32 matmuls and convolutions on TF32 tensor cores "
        "(torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)",
    ):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def _cudnn_benchmark(run: _Run, static_shapes: bool) -> None:
    if not run.device.is_cuda:
        run.skipped("cudnn_benchmark", _not_cuda(run))
    elif not _has(run.model, _CUDNN_LAYERS):
        run.skipped("cudnn_benchmark", "no convolution or recurrent layers for cuDNN to tune")
    elif not static_shapes:
        run.skipped(
            "cudnn_benchmark",
            "static_shapes=False: cuDNN would benchmark again for each new input shape",
        )
    elif torch.backends.cudnn.benchmark:
        run.skipped("cudnn_benchmark", "torch.backends.cudnn.benchmark is already on")
    elif run.applied(
        "cudnn_benchmark",
        "cuDNN benchmarks its algorithms once per input shape and keeps the fastest "
        "(assumes the shapes repeat; static_shapes=False leaves it off)",
    ):
        torch.backends.cudnn.benchmark = True


def _channels_last(run: _Run, want: bool | None) -> None:
    env = run.env
    if not _has(run.model, nn.Conv2d):
        run.skipped("channels_last", "no Conv2d layers: the memory format changes nothing")
    elif env.channels_last is False:
        run.skipped("channels_last", env.source("channels_last"))
    elif env.channels_last is None and want is False:
        run.skipped("channels_last", "channels_last=False")
    elif run.applied(
        "channels_last",
        "4-D weights in channels-last (NHWC) layout, which cuDNN's tensor-core and oneDNN's "
        "convolutions prefer; pass images as x.to(memory_format=torch.channels_last) too",
    ):
        run.model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        run.estimates.clear()


def _optimizer(run: _Run, optimizer: torch.optim.Optimizer | None) -> torch.optim.Optimizer | None:
    if optimizer is None:
        run.skipped("optimizer", "no optimizer given (optimizer=...)")
        return None
    if run.mode != "train":
        run.skipped("optimizer", "inference takes no optimizer step")
        return None
    kernel, why = fast_kernel(optimizer)
    if kernel is None:
        run.skipped("optimizer", why)
        return None
    if not run.applied("optimizer", why + "; use step.optimizer (state and settings kept)"):
        return None
    return rebuild_optimizer(optimizer, kernel)


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def _cpu_threads(run: _Run) -> None:
    if run.device.is_cuda:
        run.skipped("cpu_threads", "the step runs on the GPU")
        return
    if os.environ.get("OMP_NUM_THREADS"):
        run.skipped(
            "cpu_threads", f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} sets the threads"
        )
        return
    cores, threads = usable_cores(), torch.get_num_threads()
    have = f"{_count(threads, 'intra-op thread')} for {_count(cores, 'usable core')}"
    if threads <= cores:
        run.skipped("cpu_threads", f"{have}: nothing to change")
    elif run.applied("cpu_threads", f"{have} (CPU affinity, cgroup quota): set to {cores}"):
        torch.set_num_threads(cores)


def _quantization(run: _Run, want: bool | None, precision: str) -> None:
    name = "quantization"
    if run.mode != "infer":
        run.skipped(name, "int8 dynamic quantization is for inference (mode='infer')")
        return
    if run.device.is_gpu:
        run.skipped(name, "int8 dynamic quantization runs on the CPU only")
        return
    linear, share = linear_share(run.model)
    if not linear:
        run.skipped(name, "no nn.Linear layers to quantize")
        return
    if want is False:
        run.skipped(name, "quantize=False")
        return
    if want is None and run.auto_level != "aggressive":
        run.skipped(
            name,
            "level='basic' keeps the weights exact; level='aggressive' or quantize=True "
            "quantizes nn.Linear to int8",
        )
        return
    if want is None and share < LINEAR_SHARE:
        run.skipped(name, f"nn.Linear holds {share:.0%} of the weights: int8 would save little")
        return
    if precision != "fp32" and not run.dry:
        run.skipped(name, f"{precision} autocast is on; int8 layers take fp32 inputs")
        return
    if any(m.weight.dtype != torch.float32 for m in run.model.modules() if type(m) is nn.Linear):
        run.skipped(name, "the nn.Linear weights are not all fp32")
        return
    saved = -3 * linear  # 4 bytes a weight become 1
    why = (
        f"nn.Linear weights to int8, activations quantized per batch "
        f"(torch.ao.quantization.quantize_dynamic): {format_bytes(4 * linear)} of weights "
        f"become {format_bytes(linear)}"
    )
    if not run.dry:
        error = quantize_dynamic_int8(run.model)
        if error is not None:
            run.skipped(name, error)
            return
    run.applied(name, why, (saved, None))


def _decide_compile(run: _Run, want: bool | None) -> str | None:
    """What asks for ``torch.compile`` (None: it is not to apply, and its entry says why;
    :func:`_compile` writes the entry of one that applies)."""
    env = run.env
    if isinstance(run.model.__dict__.get("forward"), CompiledForward) or hasattr(
        run.model, "_orig_mod"
    ):
        run.skipped("compile", "the model is compiled already")
        return None
    if env.compile is not None:
        if not env.compile:
            run.skipped("compile", env.source("compile"))
        return env.source("compile") if env.compile else None
    if want is not None:
        if not want:
            run.skipped("compile", "compile=False")
        return "compile=True" if want else None
    if run.auto_level != "aggressive":
        run.skipped(
            "compile", "level='basic' does not compile; level='aggressive' or compile=True does"
        )
        return None
    if not run.device.is_cuda:
        run.skipped(
            "compile",
            f"{_not_cuda(run)}: compile='auto' compiles on a CUDA GPU only; compile=True "
            "compiles here too",
        )
        return None
    return "level='aggressive'"


def _checkpointing(run: _Run, asked: str, precision: str, compiling: str | None) -> float | None:
    """Checkpoint the activations as asked; the memory budget for ``torch.compile`` instead,
    where that is how it is done (returned)."""
    name = "checkpointing"
    env = run.env
    if run.mode != "train":
        run.skipped(name, "inference keeps no activations for a backward pass")
        return None
    if env.checkpointing is not None:
        kind, source = env.checkpointing, env.source("checkpointing")
    elif asked != "auto":
        kind, source = asked, f"checkpointing={asked!r}"
    elif run.auto_level != "aggressive":
        run.skipped(
            name,
            "level='basic' leaves it off; level='aggressive' or checkpointing='selective' or "
            "'full' turns it on",
        )
        return None
    else:
        kind, source = "auto", "level='aggressive'"
    if kind == "none":
        run.skipped(name, f"none ({source})")
        return None
    if is_checkpointed(run.model):
        run.skipped(name, "the model checkpoints its activations already")
        return None
    if kind == "auto" and compiling is not None:
        run.applied(
            name,
            f"under torch.compile: its partitioner recomputes activations to keep about "
            f"{MEMORY_BUDGET:.0%} of them (torch._functorch.config.activation_memory_budget="
            f"{MEMORY_BUDGET}; {source})",
        )
        return MEMORY_BUDGET
    hf = _hf_checkpointing(run.model)
    if not find_blocks(run.model) and not (hf and kind in ("full", "auto")):
        run.skipped(
            name,
            f"{type(run.model).__name__} has no repeated blocks to checkpoint (no "
            "nn.ModuleList or nn.Sequential of two or more modules of one type)",
        )
        return None
    before = run.priced(precision)
    if kind == "auto":
        picked = _auto_kind(run, precision, before, bool(find_blocks(run.model)))
        if picked is None:
            return None
        kind = picked
    undo = apply_checkpointing(run.model, kind)
    run.estimates.clear()
    after = run.priced(precision)
    how = (
        "transformers' activation checkpointing of its layers"
        if kind == "full" and hf
        else f"{len(find_blocks(run.model))} repeated blocks under torch.utils.checkpoint"
        + (", keeping matmul, convolution and attention outputs" if kind == "selective" else "")
    )
    if not run.applied(name, f"{kind}: {how} ({source})", _delta(before, after)):
        undo()
        run.estimates.clear()
    return None


def _auto_kind(run: _Run, precision: str, before: Estimate | None, blocks: bool) -> str | None:
    """Checkpointing where it helps: none where the step fits without, else the lightest
    kind that fits (by the estimator; without a prediction, selective)."""
    if before is not None and before.fits:
        run.skipped(
            "checkpointing",
            f"the step fits without it (predicted {format_bytes(before.peak_device)} of a "
            f"{format_bytes(before.budget)} budget); checkpointing='selective' or 'full' "
            "forces it",
        )
        return None
    if not blocks:
        return "full"  # transformers' own
    if before is None:
        return "selective"
    undo = apply_checkpointing(run.model, "selective")
    run.estimates.clear()
    try:
        selective = run.priced(precision)
    finally:
        undo()
        run.estimates.clear()
    return "selective" if selective is not None and selective.fits else "full"


def _compile(
    run: _Run, source: str | None, budget: float | None, options: Mapping[str, Any]
) -> None:
    if source is None:
        return
    shown = ", ".join(f"{k}={v!r}" for k, v in options.items())
    if not run.applied(
        "compile",
        f"torch.compile({shown or 'the forward'}), compiled at the first call; where that "
        f"fails, the model runs eagerly and this entry says why ({source})",
    ):
        return
    model_name = type(run.model).__name__

    def fall_back(exc: BaseException) -> None:
        why = short_error(exc)
        run.report.add(Optimization("compile", False, f"torch.compile failed, runs eagerly: {why}"))
        if budget is not None:
            run.report.add(
                Optimization(
                    "checkpointing",
                    False,
                    "torch.compile failed, so its activation memory budget does not apply",
                )
            )
        warnings.warn(
            f"vramctl.optimize: torch.compile of {model_name} failed at its first call; it "
            f"runs eagerly ({why})",
            RuntimeWarning,
            stacklevel=5,
        )

    compile_forward(run.model, options, fall_back, budget)
