"""``vramctl.plan``: the fastest way to train a model at an effective batch on a device.

The planner enumerates fine-tuning (full; LoRA; QLoRA: LoRA on 4-bit weights) ×
precision × activation checkpointing (none, selective, full) × offloading (the saved
activations, the optimizer's state, both) × optimizer (AdamW, fused AdamW, 8-bit AdamW
where torchao or bitsandbytes is installed) × micro-batch with gradient accumulation
(priced holding the earlier micro-batches' gradients). Each
combination's largest micro-batch that fits comes from
:func:`vramctl.estimator.max_batch_size` (traces on fake tensors; the micro-batch must
divide the effective batch), and its time from the estimate's step time: ``accumulation``
forward and backward passes and one optimizer step. Nothing runs on the device.

With ``parallel`` (a list of layouts, e.g. ``["ddp:8", "fsdp:8", "zero2:8"]``) each layout
is one more axis value: the step is priced per rank (:func:`vramctl.estimate`'s
``parallel=``), and the effective batch is split over the data-parallel ranks first (each
rank's share is ``effective_batch / world_size``; tensor parallel ranks share one batch).
Communication time is not priced: layouts compare by their ranks' compute and by the
accumulation their memory forces.

With ``adapter`` (PEFT's LoRA settings) or ``quant`` (the 4-bit format of QLoRA), or
``finetune=["full", "lora", "qlora"]``, the way the model is fine-tuned is one more axis:
the adapter and quantization are traced as :func:`vramctl.estimate` traces them
(``adapter=``, ``quant=``). An adapter's plans run on a 16-bit base (bf16, or fp16 on a
GPU before compute capability 8.0), as PEFT's users load it, and do not offload the
adapter's optimizer state (a few MiB).

The result keeps every combination: the fastest that fits, the runner-up, and why each
other was rejected (does not fit, or slower than the best by so much).
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from vramctl._errors import VramctlError
from vramctl._units import format_bytes
from vramctl.device import ComputeCapability, Device
from vramctl.estimator import Estimate, EstimateError, Parallel, QuantSpec, Step
from vramctl.estimator._shared import (
    StepSessions,
    Target,
    quant_spec,
    resolve_source,
    resolve_target,
    run_target,
)
from vramctl.optimize._checkpoint import apply_checkpointing, find_blocks
from vramctl.optimize._errors import OptimizeError

__all__ = ["FINETUNE", "Plan", "PlanResult", "plan", "precisions_for"]

CHECKPOINTING = ("none", "selective", "full")
OFFLOAD = ("none", "activations", "optimizer", "activations+optimizer")
#: How the model is trained: every weight; a LoRA adapter on a frozen 16-bit base; a LoRA
#: adapter on a frozen 4-bit base (QLoRA).
FINETUNE = ("full", "lora", "qlora")
#: The adapter an adapter's plan takes when none is given: LoRA r=16 on every linear layer.
DEFAULT_ADAPTER = "r=16,alpha=32,targets=all-linear"
#: The quantization a QLoRA plan takes when none is given (the QLoRA paper's).
DEFAULT_QUANT = QuantSpec("nf4", double_quant=True)


@dataclass(frozen=True)
class Plan:
    """One way to run the step: its settings, memory and predicted time."""

    precision: str
    checkpointing: str
    offload: str
    optimizer: str
    micro_batch: int
    accumulation: int
    #: TF32 for fp32 matrix multiplies (GPUs of compute capability 8.0 and later).
    tf32: bool = False
    #: The peak the fit is judged at (the safe end of the device range for a GPU).
    peak_bytes: int = 0
    budget_bytes: int = 0
    fits: bool = False
    #: Predicted seconds of one effective batch: ``accumulation`` forward and backward
    #: passes and one optimizer step (None where no time model applies).
    seconds: float | None = None
    #: The time model's relative error on the device (see :attr:`seconds_range`).
    seconds_error: float | None = None
    #: Why the plan was not chosen (empty for the best).
    rejected: str = ""
    #: How the plan was priced: "traced"; "search" for the micro-batch past the largest
    #: that fits (its peak from the search's traces); "pruned" for one not priced.
    priced: str = "traced"
    estimate: Estimate | None = field(default=None, compare=False, repr=False)
    #: The distributed layout (``Parallel.describe()``); None for one process.
    parallel: str | None = None
    #: Ranks the effective batch is split over (the data-parallel ranks).
    data_parallel: int = 1
    layout: Parallel | None = field(default=None, compare=False, repr=False)
    #: How the model is trained: ``"full"``, ``"lora"`` or ``"qlora"`` (:data:`FINETUNE`).
    finetune: str = "full"
    #: The adapter (``"lora"``, ``"qlora"``) and quantization (``"qlora"``) it was priced
    #: with, as :func:`vramctl.estimate` takes them.
    adapter: Any = field(default=None, compare=False, repr=False)
    quant: Any = field(default=None, compare=False, repr=False)

    @property
    def effective_batch(self) -> int:
        return self.micro_batch * self.accumulation * self.data_parallel

    @property
    def seconds_range(self) -> tuple[float, float] | None:
        """``seconds`` less and more the time model's error: where the effective batch's
        time is expected to fall."""
        if self.seconds is None:
            return None
        error = self.seconds_error or 0.0
        return self.seconds * (1 - error), self.seconds * (1 + error)

    def equivalent_to(self, other: Plan) -> bool:
        """Whether the two plans' time ranges overlap: neither is faster by more than the
        time model can tell."""
        mine, theirs = self.seconds_range, other.seconds_range
        if mine is None or theirs is None:
            return False
        return mine[0] <= theirs[1] and theirs[0] <= mine[1]

    @property
    def samples_per_second(self) -> float | None:
        if not self.seconds:
            return None
        return self.effective_batch / self.seconds

    @property
    def label(self) -> str:
        """A short description: ``amp-bf16, selective, micro 16 x 16, adamw-fused``."""
        parts = [self.parallel] if self.parallel else []
        if self.finetune != "full":
            parts.append(self.finetune)
        parts.append(self.precision + ("+tf32" if self.tf32 else ""))
        parts.append(f"ckpt {self.checkpointing}")
        if self.offload != "none":
            parts.append(f"offload {self.offload}")
        parts.append(self.optimizer)
        parts.append(f"micro {self.micro_batch} x {self.accumulation}")
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "finetune": self.finetune,
            "precision": self.precision,
            "tf32": self.tf32,
            "checkpointing": self.checkpointing,
            "offload": self.offload,
            "optimizer": self.optimizer,
            "micro_batch": self.micro_batch,
            "accumulation": self.accumulation,
            "effective_batch": self.effective_batch,
            "peak_bytes": self.peak_bytes,
            "budget_bytes": self.budget_bytes,
            "fits": self.fits,
            "seconds": self.seconds,
            "seconds_range": list(self.seconds_range or ()) or None,
            "samples_per_second": self.samples_per_second,
            "priced": self.priced,
            "rejected": self.rejected,
            "parallel": self.parallel,
            "data_parallel": self.data_parallel,
        }

    def apply(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        device: Device | str | int | None = None,
    ) -> Any:
        """Apply this plan to ``model``: see :func:`vramctl.optimize.apply_plan`."""
        from vramctl.optimize._apply_plan import apply_plan

        return apply_plan(self, model, optimizer, device=device)


@dataclass(frozen=True)
class PlanResult:
    """Every plan priced, the fastest that fits first."""

    model: str
    device: str
    effective_batch: int
    mode: str
    best: Plan | None
    runner_up: Plan | None
    #: Every plan, fitting ones first (fastest first), then those that do not fit.
    plans: tuple[Plan, ...]
    #: Axes left out, with the reason (an optimizer not installed, no blocks to wrap).
    skipped: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    elapsed: float = 0.0

    @property
    def rejected(self) -> list[Plan]:
        return [p for p in self.plans if p is not self.best]

    @property
    def equivalent(self) -> list[Plan]:
        """The fitting plans whose time range overlaps the best's: the time model cannot
        tell them from it (the best is still the fastest predicted)."""
        best = self.best
        if best is None:
            return []
        return [p for p in self.plans if p is not best and p.fits and p.equivalent_to(best)]

    def apply(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        device: Device | str | int | None = None,
    ) -> Any:
        """Apply the best plan (see :meth:`Plan.apply`)."""
        if self.best is None:
            raise OptimizeError(
                f"no plan fits {self.device} at effective batch {self.effective_batch}: "
                + (self.plans[0].rejected if self.plans else "nothing was priced")
            )
        return self.best.apply(model, optimizer, device=device)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "device": self.device,
            "effective_batch": self.effective_batch,
            "mode": self.mode,
            "best": self.best.to_dict() if self.best else None,
            "runner_up": self.runner_up.to_dict() if self.runner_up else None,
            "equivalent_to_best": [p.label for p in self.equivalent],
            "plans": [p.to_dict() for p in self.plans],
            "skipped": list(self.skipped),
            "notes": list(self.notes),
            "elapsed_s": round(self.elapsed, 3),
        }

    def __str__(self) -> str:
        lines = [f"{self.model} on {self.device}, effective batch {self.effective_batch}:"]
        if self.best is None:
            lines.append("  no plan fits")
        for tag, p in (("best", self.best), ("runner-up", self.runner_up)):
            if p is not None:
                lines.append(f"  {tag}: {p.label}: {_describe(p)}")
        for p in self.plans:
            if p is not self.best and p is not self.runner_up:
                lines.append(f"  rejected: {p.label}: {p.rejected}")
        lines += [f"  skipped: {s}" for s in self.skipped]
        return "\n".join(lines)


def _slower(p: Plan, best: Plan) -> str:
    """Why a fitting plan lost to ``best``."""
    if best.seconds and p.seconds:
        slower = f"{p.seconds / best.seconds - 1:.0%} slower than the best"
        if p.equivalent_to(best):
            slower += f" (within the time model's ±{100 * (best.seconds_error or 0):.0f}%)"
        return slower
    return "uses more memory than the best (no time prediction)"


def _describe(p: Plan) -> str:
    peak = f"peak {format_bytes(p.peak_bytes)} of {format_bytes(p.budget_bytes)}"
    if p.seconds is None:
        return peak
    return f"{peak}, {p.seconds:.3f} s per effective batch ({p.samples_per_second:.1f} samples/s)"


def precisions_for(capability: ComputeCapability | None) -> list[str]:
    """The precisions worth pricing on a device: bf16 autocast from compute capability 8.0,
    fp16 autocast (with a GradScaler) on 7.x, fp32 always; a device without a capability
    (the CPU) gets fp32 and bf16 autocast (CPU autocast runs bf16)."""
    if capability is None:
        return ["fp32", "amp-bf16"]
    if capability.major >= 8:
        return ["fp32", "amp-bf16"]
    if capability.major == 7:
        return ["fp32", "amp-fp16"]
    return ["fp32"]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def eight_bit_available() -> str | None:
    """The package an 8-bit AdamW would come from (torchao, bitsandbytes), or None."""
    for name in ("torchao", "bitsandbytes"):
        if importlib.util.find_spec(name) is not None:
            return name
    return None


def _tunings(
    finetune: list[str] | None,
    adapter: Any,
    quant: Any,
    mode: str,
    skipped: list[str],
    notes: list[str],
) -> list[str]:
    """The fine-tuning axis's values (see :func:`plan`)."""
    if finetune is None:
        tunings = ["full"] if adapter is None and quant is None else list(FINETUNE)
    else:
        tunings = list(dict.fromkeys(finetune))
        unknown = [t for t in tunings if t not in FINETUNE]
        if unknown or not tunings:
            raise OptimizeError(
                f"finetune must be among {', '.join(FINETUNE)}, got {', '.join(unknown) or 'none'}"
            )
    if tunings == ["full"]:
        if adapter is not None or quant is not None:
            raise OptimizeError("adapter and quant are for the 'lora' and 'qlora' plans")
        return tunings
    if mode != "train":
        raise OptimizeError("the fine-tuning axis (LoRA, QLoRA) is priced for training")
    if importlib.util.find_spec("peft") is None:
        tuned = [t for t in tunings if t != "full"]
        if tunings == tuned:
            raise OptimizeError(
                f"{', '.join(tuned)} plans need PEFT: pip install 'vramctl[finetune]'"
            )
        skipped.append(f"{', '.join(tuned)}: needs PEFT (pip install 'vramctl[finetune]')")
        return ["full"]
    if adapter is None:
        notes.append(f"adapter: LoRA {DEFAULT_ADAPTER} (the default; give one to change it)")
    if "qlora" in tunings and quant is None:
        notes.append(f"QLoRA's weights: {DEFAULT_QUANT.describe()} (the default)")
    return tunings


def _tuned(step: Step, tuning: str, adapter: Any, quant: Any, kbit_prep: bool) -> Step:
    """The request of one fine-tuning: ``step`` with its adapter and quantization."""
    if tuning == "full":
        return step
    adapter = DEFAULT_ADAPTER if adapter is None else adapter
    if tuning == "lora":
        return step.replace(adapter=adapter)
    try:
        spec = quant_spec(DEFAULT_QUANT if quant is None else quant)
    except EstimateError as exc:
        raise OptimizeError(str(exc)) from exc
    return step.replace(adapter=adapter, quant=spec, kbit_prep=kbit_prep)


def _finetune_of(step: Step) -> str:
    """The fine-tuning axis's value of a request (the inverse of :func:`_tuned`)."""
    if step.adapter is None:
        return "full"
    return "lora" if step.quant is None else "qlora"


def _sixteen_bit(capability: ComputeCapability | None, cuda: bool) -> str:
    """The precision an adapter's 16-bit base runs in on a device: bf16 from compute
    capability 8.0 and on the CPU, fp16 before (no bf16 tensor cores), fp32 on a GPU of
    no tensor cores."""
    if not cuda or capability is None or capability.major >= 8:
        return "bf16"
    return "fp16" if capability.major == 7 else "fp32"


def _combination(
    step: Step, precision: str, offload: str, layout: Parallel | None, tf32: bool
) -> Step:
    """The request of one combination of the plan's axes."""
    return step.replace(
        precision=precision,
        offload_activations="activations" in offload,
        offload_optimizer="optimizer" in offload,
        parallel=layout,
        tf32=tf32,
    )


def _offload_of(step: Step) -> str:
    """The offload axis's value of a combination's request (the inverse of
    :func:`_combination`'s)."""
    parts = [
        name
        for name, on in (
            ("activations", step.offload_activations),
            ("optimizer", step.offload_optimizer),
        )
        if on
    ]
    return "+".join(parts) or "none"


def _budget(step: Step) -> int:
    """The bytes a plan may peak at: the share of its device the request allows."""
    assert isinstance(step.device, Target)
    return int(step.device.capacity * step.target_utilization)


def _step_seconds(est: Estimate, accumulation: int) -> float | None:
    if est.step_seconds is None:
        return None
    opt = est.phase_seconds.get("optimizer", 0.0) + est.phase_seconds.get("host", 0.0)
    return accumulation * (est.step_seconds - opt) + opt


def plan(
    model: nn.Module | str | Callable[[], nn.Module],
    make_batch: Callable[[int], Any] | None = None,
    *,
    device: Target | Device | str | int | None = None,
    effective_batch: int,
    mode: str = "train",
    seq_len: int | None = None,
    seconds: float | None = None,
    precisions: list[str] | None = None,
    checkpointing: list[str] | None = None,
    offload: list[str] | None = None,
    optimizers: list[str] | None = None,
    target_utilization: float = 0.9,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    progress: Callable[[str], None] | None = None,
    parallel: list[Parallel | str] | Parallel | str | None = None,
    finetune: list[str] | None = None,
    adapter: Any = None,
    quant: Any = None,
    kbit_prep: bool = False,
    prune: bool = True,
) -> PlanResult:
    """The fastest plan that fits ``device`` at ``effective_batch`` samples per step.

    ``model`` is an ``nn.Module`` (with ``make_batch``: ``batch_size -> batch``), or what
    :func:`vramctl.estimate` takes by name (a built-in model, a Hugging Face config),
    whose batches are made from ``seq_len`` or ``seconds``. ``device`` is a catalog GPU
    (``"A10G-24GB"``), a size, ``"cpu"``, a local or simulated device. The axes default
    to everything that applies to the device and the model; pass lists to narrow them
    (``precisions=["amp-bf16"]``). ``progress`` is called with a line per priced
    combination.

    ``mode="infer"`` prices precision and micro-batch only (no optimizer, no
    checkpointing).

    ``parallel`` adds distributed layouts as an axis (see the module's description); the
    micro-batch and peak of such a plan are one rank's.

    ``finetune`` is the fine-tuning axis (:data:`FINETUNE`): ``["full"]`` by default, and
    all three where ``adapter`` or ``quant`` is given. ``adapter`` is the LoRA adapter of
    the ``"lora"`` and ``"qlora"`` plans (anything :func:`vramctl.estimate`'s ``adapter``
    takes; default :data:`DEFAULT_ADAPTER`), ``quant`` the quantization of the
    ``"qlora"`` plans (default nf4 with double quantization), and ``kbit_prep`` prices
    those as PEFT's ``prepare_model_for_kbit_training`` leaves them.

    ``prune`` (the default) prices only the combinations that can beat the best one by
    what is exact in the time model (see :func:`_price_layout`); the others are listed
    with why they were not priced. ``prune=False`` prices every combination.
    """
    t0 = time.perf_counter()
    if effective_batch < 1:
        raise OptimizeError(f"effective_batch must be at least 1, got {effective_batch}")
    if mode not in ("train", "infer"):
        raise OptimizeError(f"mode must be 'train' or 'infer', got {mode!r}")
    # a Device runs the step: a simulated GPU's kernels run on the CPU (timed as the CPU's)
    target = resolve_target(run_target(device) if isinstance(device, Device) else device)
    module, batch_fn, name = _materialize(model, make_batch, seq_len, seconds)
    skipped: list[str] = []
    notes: list[str] = []

    capability = target.capability if target.cuda else None
    precs = precisions or precisions_for(capability)
    tunings = _tunings(finetune, adapter, quant, mode, skipped, notes)
    if mode == "infer":
        kinds = ["none"]
        offloads = ["none"]
        opts = ["none"]
    else:
        kinds = list(checkpointing or CHECKPOINTING)
        if ("selective" in kinds or "full" in kinds) and not find_blocks(module):
            skipped.append(f"checkpointing: {type(module).__name__} has no repeated blocks to wrap")
            kinds = ["none"]
        offloads = list(offload or OFFLOAD)
        unknown = [o for o in offloads if o not in OFFLOAD]
        if unknown:
            raise OptimizeError(
                f"offload must be among {', '.join(OFFLOAD)}, got {', '.join(unknown)}"
            )
        if offloads != ["none"] and not target.cuda and target.name == "cpu":
            skipped.append("offload: the CPU's memory is the host's")
            offloads = ["none"]
        opts = list(optimizers or ["adamw", "adamw-fused", "adamw-8bit"])
        if "adamw-8bit" in opts and eight_bit_available() is None:
            skipped.append("adamw-8bit: needs torchao or bitsandbytes (pip install torchao)")
            opts.remove("adamw-8bit")
    tf32 = target.cuda and target.capability is not None and target.capability.major >= 8
    # Every combination is this request with what it varies (precision, offload, layout,
    # TF32, optimizer) replaced.
    step = Step(
        device=target,
        mode=mode,
        target_utilization=target_utilization,
        loss_fn=loss_fn,
        tf32=False,
    )

    plans: list[Plan] = []
    first_opts = [o for o in opts if o != "adamw-fused"] if len(opts) > 1 else opts
    layouts = _layouts(parallel, mode, effective_batch, skipped)
    steps: dict[str, Step] = {}
    best_seconds: list[float] = []
    for tuning in tunings:
        steps[tuning] = _tuned(step, tuning, adapter, quant, kbit_prep)
        if tuning == "full":
            tuned_precs, tuned_offloads = precs, offloads
        else:
            tuned_precs = precisions or [_sixteen_bit(capability, target.cuda)]
            tuned_offloads = [o for o in offloads if "optimizer" not in o]
        for layout in layouts:
            plans += _price_layout(
                layout, module, batch_fn, steps[tuning], tuned_precs, kinds, tuned_offloads,
                first_opts, effective_batch=effective_batch, tf32=tf32, progress=progress,
                prune=prune, best=best_seconds,
            )  # fmt: skip
    if "adamw-fused" in opts and len(opts) > 1:
        # the fused kernel changes the optimizer step alone: priced for the fastest three
        top = sorted(
            (p for p in plans if p.fits and p.seconds is not None),
            key=lambda p: p.seconds or 0.0,
        )[:3]
        for p in top:
            if progress is not None:
                progress(f"{p.label} with adamw-fused")
            plans.append(_refused_optimizer(module, batch_fn, steps[p.finetune], p, "adamw-fused"))
        notes.append(
            "adamw-fused priced for the three fastest combinations (it changes the "
            "optimizer step alone)"
        )
    fitting = sorted(
        (p for p in plans if p.fits),
        key=lambda p: (p.seconds if p.seconds is not None else float("inf"), p.peak_bytes),
    )
    ranked = fitting[:1] + [replace(p, rejected=_slower(p, fitting[0])) for p in fitting[1:]]
    ranked += [p for p in plans if not p.fits]
    best = ranked[0] if fitting else None
    runner = ranked[1] if len(fitting) > 1 else None
    if best is not None and best.seconds is None:
        notes.append("no step-time prediction for this device: the plan with the least memory")
    return PlanResult(
        model=name,
        device=target.name,
        effective_batch=effective_batch,
        mode=mode,
        best=best,
        runner_up=runner,
        plans=tuple(ranked),
        skipped=tuple(skipped),
        notes=tuple(notes),
        elapsed=time.perf_counter() - t0,
    )


def _layouts(
    parallel: list[Parallel | str] | Parallel | str | None,
    mode: str,
    effective_batch: int,
    skipped: list[str],
) -> list[Parallel | None]:
    """The layouts to price: one process, or each given one whose data-parallel ranks
    divide the effective batch."""
    if parallel is None:
        return [None]
    if mode != "train":
        raise OptimizeError("parallel layouts are priced for training (mode='train')")
    given = parallel if isinstance(parallel, list) else [parallel]
    out: list[Parallel | None] = []
    for p in given:
        try:
            layout = Parallel.parse(p) if isinstance(p, str) else p
        except EstimateError as exc:
            raise OptimizeError(str(exc)) from exc
        dp = _data_parallel(layout)
        if effective_batch % dp:
            skipped.append(
                f"{layout.describe()}: {dp} data-parallel ranks do not divide the effective "
                f"batch {effective_batch}"
            )
            continue
        out.append(layout)
    if not out:
        raise OptimizeError("no parallel layout divides the effective batch: " + skipped[-1])
    return out


def _data_parallel(layout: Parallel | None) -> int:
    return 1 if layout is None or layout.strategy == "tp" else layout.world_size


def _price_layout(
    layout: Parallel | None,
    module: nn.Module,
    batch_fn: Callable[[int], Any],
    step: Step,
    precs: list[str],
    kinds: list[str],
    offloads: list[str],
    first_opts: list[str],
    *,
    effective_batch: int,
    tf32: bool,
    progress: Callable[[str], None] | None,
    prune: bool = True,
    best: list[float] | None = None,
) -> list[Plan]:
    """Every (precision, checkpointing, offload) of one layout, at each rank's share of the
    effective batch.

    Each precision's plain combination (the first checkpointing and offload) is priced
    first, by a full search. Then, with ``prune``, the others are priced only where they
    can be faster, by what is exact in the time model (``best`` holds the fastest fitting
    plan's seconds so far, shared across calls):

    - checkpointing and offloading only add recomputation and copies, and splitting a
      batch into micro-batches only adds per-micro-batch work: no plan of a precision is
      faster than its forward and backward of the whole effective batch at once (traced
      by the plain combination's search); where the best plan is faster, the precision's
      other combinations are not priced;
    - the others can only fit a larger micro-batch than the plain one: each is traced at
      the next micro-batch first, and where that does not fit, it would run the plain
      one's micro-batch at more cost, and is not priced further.
    """
    dp = _data_parallel(layout)
    share = effective_batch // dp
    plans: list[Plan] = []
    best = best if best is not None else []
    tuning = _finetune_of(step)
    where = "".join(
        f"{part}, "
        for part in (tuning if tuning != "full" else None, layout.describe() if layout else None)
        if part
    )
    label = layout.describe() if layout is not None else None

    def pruned(prec: str, kind: str, off: str, why: str) -> Plan:
        return Plan(
            precision=prec,
            checkpointing=kind,
            offload=off,
            optimizer=first_opts[0],
            micro_batch=share,
            accumulation=1,
            tf32=tf32 and prec == "fp32",
            budget_bytes=_budget(step),
            rejected=why,
            priced="pruned",
            parallel=label,
            data_parallel=dp,
            finetune=_finetune_of(step),
            adapter=step.adapter,
            quant=step.quant,
        )

    def note_best(priced: list[Plan]) -> None:
        for p in priced:
            if p.fits and p.seconds is not None and (not best or p.seconds < best[0]):
                best[:] = [p.seconds]

    def price(prec: str, kind: str, off: str, **found: Any) -> list[Plan]:
        """One combination's plans (``found``: what :func:`_price` takes besides)."""
        if progress is not None:
            progress(f"{where}{prec}, checkpointing {kind}, offload {off}")
        request = _combination(step, prec, off, layout, tf32 and prec == "fp32")
        return _price(
            module, batch_fn, request,
            kind=kind, optimizers=first_opts, effective_batch=share, **found,
        )  # fmt: skip

    combos = [(kind, off) for kind in kinds for off in offloads]
    #: per precision: the plain combination's micro-batch, whether it runs the whole
    #: share at once (and how), and the least seconds any of its plans can take
    plain: dict[str, tuple[int, str | None, float | None]] = {}
    #: per precision: the host's optimizer step of an offloaded optimizer, once seen
    host_seconds: dict[str, float] = {}
    # With more than one precision, each one's whole effective batch at once is traced
    # first (a trace each): its time bounds every plan of the precision, so the one with
    # the least is searched first, and a precision whose bound the best plan beats is
    # not searched at all.
    wholes: dict[str, Estimate] = {}
    if prune and len(precs) > 1 and combos[0][0] == "none":
        for prec in precs:
            request = _combination(step, prec, combos[0][1], layout, tf32 and prec == "fp32")
            found = _whole_of(module, batch_fn, request, "none", share)
            if found is not None:  # one that cannot be traced is searched as before
                wholes[prec] = found
    bound = {prec: _ideal_seconds([est]) for prec, est in wholes.items()}
    order = sorted(precs, key=lambda p: bound.get(p) or float("inf"))
    for prec in order:
        kind, off = combos[0]
        ideal = bound.get(prec)
        if ideal is not None and best and best[0] < ideal:
            plans.append(pruned(prec, kind, off, _cannot_beat(prec, off, best[0], ideal, 0.0)))
            plain[prec] = (0, None, ideal)
            continue
        whole_est: list[Estimate] = []
        priced = price(prec, kind, off, whole_out=whole_est, whole_known=wholes.get(prec))
        plans += priced
        note_best(priced)
        fitting = [p.micro_batch for p in priced if p.fits]
        whole = (
            f"checkpointing {kind}, offload {off}"
            if any(p.fits and p.accumulation == 1 for p in priced)
            else None
        )
        plain[prec] = (max(fitting, default=0), whole, _ideal_seconds(whole_est))
    #: what the cheap rules leave to price: (precision, checkpointing, offload)
    left: list[tuple[str, str, str]] = []
    for prec in precs:
        micro0, whole, ideal = plain[prec]
        for kind, off in combos[1:]:
            if whole is not None:
                why = (
                    f"not priced: {whole} already runs the whole effective batch at once, "
                    "and this adds recomputation or copies"
                )
                plans.append(pruned(prec, kind, off, why))
                continue
            host = host_seconds.get(prec, 0.0) if "optimizer" in off else 0.0
            if prune and ideal is not None and best and best[0] < ideal + host:
                plans.append(pruned(prec, kind, off, _cannot_beat(prec, off, best[0], ideal, host)))
                continue
            left.append((prec, kind, off))
    # With a best plan known, each combination left is traced once at its whole
    # effective batch: no plan of it is faster (its recomputation and copies included),
    # so the one with the least is priced first, and one the best beats is not priced.
    # A combination that adds checkpointing or offloading to another takes at least its
    # time: one whose smaller combination already cannot beat the best is not traced.
    own: dict[tuple[str, str, str], Estimate] = {}
    bounds: dict[tuple[str, str, str], float] = {}
    beaten: dict[tuple[str, str, str], str] = {}
    for key in sorted(left, key=lambda k: (KINDS_ORDER.get(k[1], 9), OFFLOAD_ORDER.get(k[2], 9))):
        if not (prune and best):
            break
        prec, kind, off = key
        under = next(
            (
                k
                for k, least in bounds.items()
                if k[0] == prec and least > best[0] and _adds_to((k[1], k[2]), (kind, off))
            ),
            None,
        )
        if under is not None:
            beaten[key] = (
                f"not priced: it adds recomputation or copies to checkpointing {under[1]}, "
                f"offload {under[2]}, which cannot beat the best plan ({best[0]:.3g} s)"
            )
            continue
        request = _combination(step, prec, off, layout, tf32 and prec == "fp32")
        found = _whole_of(module, batch_fn, request, kind, share)
        least = _bound_of(found, "optimizer" in off) if found is not None else None
        if found is not None and least is not None:
            own[key], bounds[key] = found, least
    for prec, kind, off in sorted(left, key=lambda k: bounds.get(k, 0.0)):
        micro0 = plain[prec][0]
        least = bounds.get((prec, kind, off))
        if (prec, kind, off) in beaten:
            plans.append(pruned(prec, kind, off, beaten[prec, kind, off]))
            continue
        if least is not None and best and best[0] < least:
            why = (
                f"not priced: it cannot beat the best plan ({best[0]:.3g} s): its whole "
                f"effective batch at once takes {least:.3g} s (its optimizer's step on the "
                "device left out)"
            )
            plans.append(pruned(prec, kind, off, why))
            continue
        seen: list[Estimate] = []
        priced = price(
            prec, kind, off,
            floor=micro0 if prune and micro0 > 0 else None, seen=seen,
            whole_known=own.get((prec, kind, off)),
        )  # fmt: skip
        plans += priced
        note_best(priced)
        seen += [p.estimate for p in priced if p.estimate is not None]
        if "optimizer" in off:
            # the offloaded optimizer's step on the host: once a step, whatever the
            # micro-batch, checkpointing or activations' offload (the least seen)
            took = [e.phase_seconds.get("host", 0.0) for e in seen]
            took = [t for t in [*took, host_seconds.get(prec, 0.0)] if t > 0]
            if took:
                host_seconds[prec] = min(took)
    return plans


#: The order combinations add cost in: checkpointing and offloading each add to none.
KINDS_ORDER = {"none": 0, "selective": 1, "full": 2}
OFFLOAD_ORDER = {"none": 0, "activations": 1, "optimizer": 1, "activations+optimizer": 2}


def _adds_to(smaller: tuple[str, str], larger: tuple[str, str]) -> bool:
    """Whether ``larger`` (checkpointing, offload) is ``smaller`` with more recomputation or
    copies: the same or more checkpointing (none below either kind) and offloading (none
    below each, each below both)."""
    (k1, o1), (k2, o2) = smaller, larger
    kinds = k1 == k2 or k1 == "none"
    offs = o1 == o2 or o1 == "none" or (o2 == "activations+optimizer" and o1 in OFFLOAD_ORDER)
    return (k1, o1) != (k2, o2) and kinds and offs


def _whole_of(
    module: nn.Module, batch_fn: Callable[[int], Any], request: Step, kind: str, share: int
) -> Estimate | None:
    """One combination (``request``, checkpointing ``kind``) at the whole effective batch
    at once (None where it cannot be traced)."""
    from vramctl.estimator import estimate

    train = request.mode == "train"
    undo = apply_checkpointing(module, kind) if kind != "none" else (lambda: None)
    try:
        return estimate(
            module,
            batch_fn(share),
            step=request.replace(optimizer="adamw" if train else None, grad_accumulation=False),
        )
    except VramctlError:
        return None
    finally:
        undo()


def _bound_of(whole: Estimate, offloaded: bool) -> float | None:
    """The least time any plan of a combination takes, from its whole effective batch at
    once: its forward and backward (copies and recomputation included) and, with the
    optimizer offloaded, its step on the host (once a step, at any micro-batch); the
    device's optimizer step is left out (another optimizer's differs)."""
    ideal = _ideal_seconds([whole])
    if ideal is None:
        return None
    return ideal + (whole.phase_seconds.get("host", 0.0) if offloaded else 0.0)


def _cannot_beat(prec: str, off: str, best: float, ideal: float, host: float) -> str:
    """Why a combination that cannot beat the best plan was not priced."""
    what = f"{prec} with its optimizer offloaded" if host else prec
    took = f"{ideal:.3g} s" + (
        f", and the optimizer's step on the host {host:.3g} s" if host else ""
    )
    return (
        f"not priced: {what} cannot beat the best plan ({best:.3g} s): its forward and "
        f"backward of the whole effective batch at once take {took}"
    )


def _ideal_seconds(whole: list[Estimate]) -> float | None:
    """The forward and backward of a whole effective batch at once (the optimizer's step
    left out): less than any plan of its precision takes (see :func:`_price_layout`)."""
    seconds = whole[0].step_seconds if whole else None
    if seconds is None:
        return None
    phases = whole[0].phase_seconds
    return seconds - sum(phases.get(k, 0.0) for k in ("optimizer", "host"))


def _materialize(
    model: nn.Module | str | Callable[[], nn.Module],
    make_batch: Callable[[int], Any] | None,
    seq_len: int | None,
    seconds: float | None,
) -> tuple[nn.Module, Callable[[int], Any], str]:
    """The module to price (a named model built on the meta device: no memory) and its
    batches."""
    if isinstance(model, nn.Module):
        if make_batch is None:
            raise OptimizeError("plan() of an nn.Module needs make_batch: batch_size -> batch")
        return model, make_batch, type(model).__name__
    try:
        resolved = resolve_source(model)
    except EstimateError as exc:
        raise OptimizeError(str(exc)) from exc
    with torch.device("meta"):
        built = resolved.model if isinstance(resolved.model, nn.Module) else resolved.model()
    if not isinstance(built, nn.Module):
        raise OptimizeError(f"{resolved.name}'s factory returned a {type(built).__name__}")
    if make_batch is None:
        entry = resolved.entry
        if entry is None:
            raise OptimizeError(f"plan() of {resolved.name} needs make_batch: batch_size -> batch")

        def make_batch(n: int) -> Any:
            return entry.make_batch(n, seq_len=seq_len, seconds=seconds)

    return built, make_batch, resolved.name


def _price(
    module: nn.Module,
    batch_fn: Callable[[int], Any],
    step: Step,
    *,
    kind: str,
    optimizers: list[str],
    effective_batch: int,
    floor: int | None = None,
    whole_out: list[Estimate] | None = None,
    seen: list[Estimate] | None = None,
    whole_known: Estimate | None = None,
) -> list[Plan]:
    """The plans of one combination (``step``: its precision, offload, layout and TF32;
    ``kind``: its checkpointing): the largest micro-batch that fits with AdamW, then each
    other optimizer at that micro-batch.

    ``floor`` is a micro-batch known to fit a cheaper combination: this one is traced at
    the next micro-batch (a divisor of the effective batch) and up, and where the next
    does not fit, it is one plan marked dominated. ``whole_out`` receives the estimate
    of the whole effective batch at once, where it was traced (``whole_known``: that
    estimate, already made)."""
    layout = step.parallel if isinstance(step.parallel, Parallel) else None
    train = step.mode == "train"
    base = Plan(
        precision=step.precision,
        checkpointing=kind,
        offload=_offload_of(step),
        optimizer="adamw" if train else "none",
        micro_batch=0,
        accumulation=0,
        tf32=bool(step.tf32),
        budget_bytes=_budget(step),
        parallel=layout.describe() if layout is not None else None,
        data_parallel=_data_parallel(layout),
        layout=layout,
        finetune=_finetune_of(step),
        adapter=step.adapter,
        quant=step.quant,
    )
    offload = base.offload
    undo = apply_checkpointing(module, kind) if kind != "none" else (lambda: None)
    sessions = StepSessions(module)
    try:

        def price(micro: int, optimizer: str = base.optimizer) -> Plan:
            known = (
                whole_known if micro == effective_batch and optimizer == base.optimizer else None
            )
            return _at(
                module, batch_fn, step, base, optimizer, micro, effective_batch, known, sessions
            )

        if floor is not None:
            return _climb(price, base, optimizers, effective_batch, floor, seen)
        micro, traced = _largest_divisor(price, base.budget_bytes, effective_batch)
        if micro == 0 and traced and traced[min(traced)].rejected.startswith("could not"):
            return [traced[min(traced)]]
        whole: Plan | None = None
        if micro < effective_batch:
            # one micro-batch of the whole effective batch holds no earlier gradients
            whole = _at(
                module,
                batch_fn,
                step,
                base,
                base.optimizer,
                effective_batch,
                effective_batch,
                whole_known,
                sessions,
            )
            if whole_out is not None and whole.estimate is not None:
                whole_out.append(whole.estimate)
            if whole.fits:
                micro = effective_batch
            traced[effective_batch] = whole
        if micro == 0:
            first = traced.get(1)
            one = first.estimate.peak_device if first and first.estimate else None
            why = "not even a micro-batch of 1 fits"
            if one is not None and one > base.budget_bytes:
                why += f" (peak {format_bytes(one)} > {format_bytes(base.budget_bytes)})"
            elif one is not None:
                why += (
                    f" with the estimate's uncertainty (peak {format_bytes(one)} of "
                    f"{format_bytes(base.budget_bytes)} before it; `vramctl calibrate` "
                    "on the GPU narrows it)"
                )
            return [
                replace(
                    base,
                    micro_batch=1,
                    accumulation=effective_batch,
                    rejected=why,
                    peak_bytes=one or 0,
                )
            ]
        out = [traced[micro]]
        out += [price(micro, opt) for opt in _others(optimizers, offload)]
        larger = [d for d in _divisors(effective_batch) if d > micro]
        if larger:
            nxt = larger[0]
            above = traced.get(nxt)
            why = f"micro-batch {nxt} does not fit"
            if above is not None and above.peak_bytes:
                peak, budget = format_bytes(above.peak_bytes), format_bytes(base.budget_bytes)
                why += f" (peak {peak} > {budget})"
            out.append(
                replace(
                    base,
                    micro_batch=nxt,
                    accumulation=effective_batch // nxt,
                    rejected=why,
                    peak_bytes=above.peak_bytes if above is not None else 0,
                    priced="search",
                )
            )
        return out
    finally:
        sessions.close()
        undo()


def _largest_divisor(
    price: Callable[[int], Plan], budget: int, effective_batch: int
) -> tuple[int, dict[int, Plan]]:
    """The largest divisor of the effective batch below it whose micro-batch fits (0: not
    even the smallest), and each plan traced on the way: the smallest divisor and a
    larger one, then from where the line through their peaks meets the budget, up or
    down until one fits and the next does not (a peak grows with the micro-batch)."""
    divs = [d for d in _divisors(effective_batch) if d < effective_batch]
    traced: dict[int, Plan] = {}

    def at(i: int) -> Plan:
        d = divs[i]
        if d not in traced:
            traced[d] = price(d)
        return traced[d]

    if not divs or not at(0).fits:
        return 0, traced
    if len(divs) == 1:
        return divs[0], traced
    j = min(len(divs) - 1, 2)
    low, high = at(0), at(j)
    i = 0
    if high.fits:
        slope = (high.peak_bytes - low.peak_bytes) / (divs[j] - divs[0])
        reach = [
            k for k, d in enumerate(divs)
            if slope <= 0 or low.peak_bytes + slope * (d - divs[0]) <= budget
        ]  # fmt: skip
        i = max(j, max(reach, default=j))
    while i > 0 and not at(i).fits:
        i -= 1
    while i + 1 < len(divs) and at(i + 1).fits:
        i += 1
    return divs[i], traced


def _others(optimizers: list[str], offload: str) -> list[str]:
    """The optimizers priced besides AdamW at its micro-batch."""
    others = [o for o in optimizers if o != "adamw"]
    if "optimizer" in offload:
        # 8-bit states in host memory save the device nothing more
        others = [o for o in others if o != "adamw-8bit"]
    return others


def _climb(
    price: Callable[..., Plan],
    base: Plan,
    optimizers: list[str],
    effective_batch: int,
    floor: int,
    seen: list[Estimate] | None = None,
) -> list[Plan]:
    """A combination that can only fit more than ``floor`` (see :func:`_price`): priced
    (``price(micro, optimizer)``) at each micro-batch above it until one does not fit
    (each estimate put in ``seen``)."""
    above = [d for d in _divisors(effective_batch) if d > floor]
    fitting: Plan | None = None
    failed: Plan | None = None
    for micro in above:
        at = price(micro)
        if seen is not None and at.estimate is not None:
            seen.append(at.estimate)
        if not at.fits:
            failed = at
            break
        fitting = at
    if fitting is None:
        assert failed is not None
        return [
            replace(
                failed,
                micro_batch=floor,
                accumulation=effective_batch // floor,
                fits=False,
                seconds=None,
                estimate=None,
                priced="pruned",
                rejected=f"not priced: micro-batch {failed.micro_batch} does not fit (peak "
                f"{format_bytes(failed.peak_bytes)} > {format_bytes(base.budget_bytes)}), so "
                f"it runs micro-batch {floor}, as a plan without its recomputation or copies does",
            )
        ]
    micro = fitting.micro_batch
    out = [fitting]
    for opt in _others(optimizers, base.offload):
        out.append(price(micro, opt))
    if failed is not None:
        why = f"micro-batch {failed.micro_batch} {failed.rejected}"
        out.append(replace(failed, priced="search", seconds=None, estimate=None, rejected=why))
    return out


def _refused_optimizer(
    module: nn.Module, batch_fn: Callable[[int], Any], step: Step, p: Plan, optimizer: str
) -> Plan:
    """``p`` again with another optimizer (its checkpointing applied for the trace)."""
    undo = apply_checkpointing(module, p.checkpointing) if p.checkpointing != "none" else None
    try:
        combination = _combination(step, p.precision, p.offload, p.layout, p.tf32)
        return _at(
            module,
            batch_fn,
            combination,
            replace(p, estimate=None),
            optimizer,
            p.micro_batch,
            p.effective_batch,
            None,
        )
    finally:
        if undo is not None:
            undo()


def _at(
    module: nn.Module,
    batch_fn: Callable[[int], Any],
    step: Step,
    base: Plan,
    optimizer: str,
    micro: int,
    effective_batch: int,
    known: Estimate | None,
    sessions: StepSessions | None = None,
) -> Plan:
    """``base`` with ``optimizer`` at micro-batch ``micro``, priced as ``step`` (its
    combination's request), or from ``known`` (an estimate of it already made); traced
    in ``sessions``, where given (the model built once per request)."""
    from vramctl.estimator import estimate

    train = step.mode == "train"
    est = known
    if est is None:
        request = step.replace(
            optimizer=optimizer if train else None,
            grad_accumulation=train and micro < effective_batch,
        )
        try:
            if sessions is not None:
                est = sessions.estimate(request, batch_fn, micro)
            else:
                est = estimate(module, batch_fn(micro), step=request)
        except VramctlError as exc:
            return replace(
                base,
                optimizer=optimizer,
                micro_batch=micro,
                accumulation=effective_batch // micro,
                rejected=f"could not be priced: {exc}",
            )
    peak = est.judged_peak
    fits = peak <= base.budget_bytes
    return replace(
        base,
        optimizer=optimizer,
        micro_batch=micro,
        accumulation=effective_batch // micro,
        peak_bytes=peak,
        fits=fits,
        seconds=_step_seconds(est, effective_batch // micro),
        seconds_error=est.step_seconds_error,
        rejected=""
        if fits
        else f"does not fit (peak {format_bytes(peak)} > {format_bytes(base.budget_bytes)})",
        estimate=est,
    )
