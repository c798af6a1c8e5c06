"""``vramctl.estimate``: a step's peak memory on a device, from a trace on fake tensors."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import logging
import numbers
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.nn.utils.stateless import _reparametrize_module

from vramctl._errors import InvalidSizeError, UnknownDeviceError, VramctlError
from vramctl._step import call_model
from vramctl._tensors import tensors
from vramctl._units import format_bytes, looks_like_size, parse_size
from vramctl.device._base import Device
from vramctl.device._capability import ComputeCapability
from vramctl.device.catalog import gpu_spec
from vramctl.estimator import _cuda_model, zoo
from vramctl.estimator._allocator import (
    AllocatorConfig,
    AllocatorOutOfMemory,
    CachingAllocatorModel,
)
from vramctl.estimator._autocast import CudaAutocast
from vramctl.estimator._calibration import Calibration, CalibrationSource, resolve_calibration
from vramctl.estimator._cpu_kernels import cpu_output_bytes, cpu_workspace
from vramctl.estimator._trace import DataDependentError, EagerLinear, Trace, Tracer

__all__ = ["Estimate", "EstimateError", "Target", "estimate", "resolve_target"]

MODES = ("train", "infer")
PRECISIONS = ("fp32", "bf16", "fp16", "amp-bf16", "amp-fp16")
OPTIMIZERS = ("adamw", "adam", "sgd", "sgd-momentum", "rmsprop", "adagrad", "none")
CATEGORIES = (
    "parameters",
    "gradients",
    "optimizer",
    "inputs",
    "activations",
    "temporaries",
    "workspaces",
    "allocator",
    "context",
)

ModelSource = nn.Module | str | Callable[[], nn.Module]
BatchSource = Any


class EstimateError(VramctlError):
    """A model, batch or step that cannot be estimated; the message says what to supply."""


@dataclass(frozen=True)
class Target:
    """The device an estimate is for."""

    name: str
    #: Memory a process can use in all (CUDA: the capacity ``cudaMemGetInfo`` reports).
    capacity: int
    capability: ComputeCapability | None
    #: Whether CUDA's extras (context, workspaces, caching allocator) are modelled.
    cuda: bool
    #: The measured CUDA constants used for it (None: the built-in ones).
    calibration: Calibration | None = field(default=None, compare=False)

    @property
    def constants(self) -> Calibration:
        """The CUDA constants estimates for this target use."""
        return _cuda_model.constants(self.name, self.capability, self.calibration)


def resolve_target(
    device: Target | Device | str | int | None, calibration: CalibrationSource = None
) -> Target:
    """A catalog name (``"A10G-24GB"``), a size (``"24GiB"``), ``"cpu"``, a local GPU or a Device.

    ``None`` takes this machine's first GPU, or the CPU where there is none; a
    :class:`Target` is taken as it is unless ``calibration`` is given.

    ``calibration`` picks the CUDA constants of a GPU target: None looks up a
    profile made by ``vramctl calibrate`` for this GPU (or one of the same compute
    capability), False uses the built-in constants, and a
    :class:`~vramctl.estimator.Calibration` or a profile's path is used as it is.
    """
    if isinstance(device, Target):
        if calibration is None or not device.cuda:
            return device
        return dataclasses.replace(
            device, calibration=resolve_calibration(calibration, device.name, device.capability)
        )
    target = _resolve_device(device)
    if not target.cuda:
        return target
    found = resolve_calibration(calibration, target.name, target.capability)
    return dataclasses.replace(target, calibration=found) if found is not None else target


def run_target(device: Device) -> Target | Device:
    """What the estimator is handed for a step that really runs on ``device``.

    A CUDA device is estimated as itself (its context, workspaces and caching
    allocator are modelled). Any other device (the CPU, a simulated GPU) counts the
    live tensor storages of this host's CPU kernels, with none of CUDA's extras.
    """
    if device.is_cuda:
        return device
    return Target(device.id if device.is_gpu else "cpu", device.capacity(), None, cuda=False)


def _resolve_device(device: Device | str | int | None) -> Target:
    from vramctl.device import get_device, gpus

    if device is None:
        found = gpus()
        device = found[0] if found else "cpu"
    if isinstance(device, str):
        text = device.strip()
        low = text.lower()
        if low == "cpu" or low.startswith(("cuda", "gpu-", "mig-")) or low.isdigit():
            device = get_device(text)
        else:
            body = text.removeprefix("sim:").strip()
            spec = None
            with contextlib.suppress(UnknownDeviceError):
                spec = gpu_spec(body)
            if spec is not None:
                return Target(spec.name, spec.cuda_total_bytes, spec.capability, True)
            if looks_like_size(body):
                # A size ("16GiB", "sim:16GiB"); a bad one ("-3GiB") says what is wrong.
                size = parse_size(body)
                if size <= 0:
                    raise InvalidSizeError(f"invalid size {body!r}: a device needs a positive size")
                return Target(body, size, None, True)
            spec = gpu_spec(text)  # raises with the catalog listed
            return Target(spec.name, spec.cuda_total_bytes, spec.capability, True)
    if isinstance(device, int):
        device = get_device(device)
    total = device.memory().total
    if not isinstance(total, int):
        raise VramctlError(f"cannot read the memory total of {device.id}")
    cc = device.capability if isinstance(device.capability, ComputeCapability) else None
    if device.spec is not None and not device.is_cuda:  # a simulated catalog GPU
        return Target(device.spec.name, total, device.spec.capability, True)
    return Target(device.name if device.is_gpu else "cpu", total, cc, device.is_gpu)


@dataclass(frozen=True)
class Estimate:
    """A step's predicted peak memory on a device, and where it goes.

    ``peak_allocated`` and ``peak_reserved`` are what ``torch.cuda``'s
    ``max_memory_allocated`` and ``max_memory_reserved`` would report;
    ``peak_device`` adds the CUDA context (what ``nvidia-smi`` shows for the
    process). On a CPU target the three equal ``logical_peak``, the bytes of
    live tensor storages.
    """

    model: str
    device: str
    capacity: int
    mode: str
    precision: str
    batch_size: int | None
    seq_len: int | None
    seconds: float | None
    logical_peak: int
    peak_allocated: int
    peak_reserved: int
    peak_device: int
    #: Bytes by category at the peak; they sum to ``peak_device``.
    breakdown: dict[str, int]
    peak_op: str
    peak_module: str
    peak_phase: str
    target_utilization: float
    fits: bool
    #: Assumptions where the trace could not know values (data-dependent operators).
    assumptions: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    alloc_retries: int = 0
    ops: int = 0
    elapsed: float = 0.0
    parameters: int = 0

    @property
    def budget(self) -> int:
        """The bytes the step may use: capacity times target utilization."""
        return int(self.capacity * self.target_utilization)

    @property
    def headroom(self) -> int:
        """Budget left at the peak (negative when it does not fit)."""
        return self.budget - self.peak_device

    @property
    def exact(self) -> bool:
        """True when no value had to be assumed."""
        return not self.assumptions

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "device": self.device,
            "capacity_bytes": self.capacity,
            "mode": self.mode,
            "precision": self.precision,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "seconds": self.seconds,
            "parameters": self.parameters,
            "logical_peak_bytes": self.logical_peak,
            "peak_allocated_bytes": self.peak_allocated,
            "peak_reserved_bytes": self.peak_reserved,
            "peak_device_bytes": self.peak_device,
            "breakdown_bytes": dict(self.breakdown),
            "peak_at": {"op": self.peak_op, "module": self.peak_module, "phase": self.peak_phase},
            "target_utilization": self.target_utilization,
            "budget_bytes": self.budget,
            "headroom_bytes": self.headroom,
            "fits": self.fits,
            "exact": self.exact,
            "assumptions": list(self.assumptions),
            "notes": list(self.notes),
            "alloc_retries": self.alloc_retries,
            "ops": self.ops,
            "elapsed_s": round(self.elapsed, 4),
        }

    def __str__(self) -> str:
        verdict = "fits" if self.fits else "does NOT fit"
        lines = [
            f"{self.model} {self.mode} {self.precision} batch {self.batch_size} on {self.device}: "
            f"peak {format_bytes(self.peak_device)} of {format_bytes(self.budget)} "
            f"({self.target_utilization:.0%} of {format_bytes(self.capacity)}), {verdict}",
            f"  allocated {format_bytes(self.peak_allocated)}, "
            f"reserved {format_bytes(self.peak_reserved)}; peak at {self.peak_op} in "
            f"{self.peak_module or '(top level)'} ({self.peak_phase})",
        ]
        lines += [f"  {k:<12} {format_bytes(v):>12}" for k, v in self.breakdown.items() if v]
        lines += [f"  assumed: {a}" for a in self.assumptions]
        return "\n".join(lines)


# -- the step -----------------------------------------------------------------------


@dataclass(frozen=True)
class StepSpec:
    """What one step does: the same for a traced and a real run."""

    mode: str = "train"
    precision: str = "fp32"
    optimizer: str | Callable[..., torch.optim.Optimizer] | None = "adamw"
    checkpointing: bool = False
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
    #: ``torch.autocast`` device type for the amp precisions.
    autocast_device: str = "cpu"
    #: Use the multi-tensor (foreach) optimizer kernels, as PyTorch does on CUDA.
    foreach: bool | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise EstimateError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.precision not in PRECISIONS:
            raise EstimateError(
                f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}"
            )
        if isinstance(self.optimizer, str) and self.optimizer not in OPTIMIZERS:
            raise EstimateError(
                f"optimizer must be one of {', '.join(OPTIMIZERS)} or a callable taking the "
                f"parameters, got {self.optimizer!r}"
            )

    @property
    def param_dtype(self) -> torch.dtype | None:
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision)

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return {"amp-bf16": torch.bfloat16, "amp-fp16": torch.float16}.get(self.precision)

    def make_optimizer(self, params: list[torch.Tensor]) -> torch.optim.Optimizer | None:
        opt = self.optimizer
        if self.mode != "train" or opt is None or opt == "none" or not params:
            return None
        if callable(opt):
            return opt(params)
        kw: dict[str, Any] = {} if self.foreach is None else {"foreach": self.foreach}
        if opt == "adamw":
            return torch.optim.AdamW(params, lr=1e-4, **kw)
        if opt == "adam":
            return torch.optim.Adam(params, lr=1e-4, **kw)
        if opt == "sgd":
            return torch.optim.SGD(params, lr=1e-3, **kw)
        if opt == "sgd-momentum":
            return torch.optim.SGD(params, lr=1e-3, momentum=0.9, **kw)
        if opt == "rmsprop":
            return torch.optim.RMSprop(params, lr=1e-4, **kw)
        return torch.optim.Adagrad(params, lr=1e-3, **kw)

    def forward_context(self) -> contextlib.AbstractContextManager[Any]:
        stack = contextlib.ExitStack()
        if self.mode == "infer":
            stack.enter_context(torch.no_grad())
        dtype = self.autocast_dtype
        if dtype is not None:
            stack.enter_context(torch.autocast(self.autocast_device, dtype=dtype))
        return stack

    def loss(self, out: Any, batch: Any) -> torch.Tensor:
        if self.loss_fn is not None:
            return self.loss_fn(out, batch)
        loss = getattr(out, "loss", None)
        if loss is None and isinstance(out, Mapping):
            loss = out.get("loss")
        if isinstance(loss, torch.Tensor):
            return loss
        first = next(iter(_flat_tensors(out)), None)
        if first is None:
            raise EstimateError(
                "the model's output has no tensor to take a loss from; pass loss_fn=(output, batch)"
            )
        # A typical loss: it holds about as much as MSE or cross-entropy over the output
        # (an output-sized result and output-sized gradients), where a bare mean holds none.
        return first.float().square().mean()


def prepare_model(model: nn.Module, spec: StepSpec) -> None:
    """Put a model in the state the step needs (train or eval, checkpointing)."""
    model.train(spec.mode == "train")
    if spec.checkpointing:
        # transformers 5 renames it activation_checkpointing_enable (the old name warns).
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
            return
        enable = getattr(model, "gradient_checkpointing_enable", None)
        if enable is None:
            raise EstimateError(
                f"{type(model).__name__} has no gradient_checkpointing_enable(); wrap its blocks "
                "in torch.utils.checkpoint yourself and pass checkpointing=False"
            )
        enable(gradient_checkpointing_kwargs={"use_reentrant": False})


#: Attributes ``gradient_checkpointing_enable()`` sets on a module (Hugging Face).
_CHECKPOINT_ATTRS = ("gradient_checkpointing", "_gradient_checkpointing_func")


@contextlib.contextmanager
def _step_mode(model: nn.Module, spec: StepSpec) -> Iterator[None]:
    """The model in the step's mode (train or eval, checkpointing) for a while.

    The user's module is theirs: its modules' training flags and checkpointing
    settings are put back afterwards.
    """
    saved = [
        (m, m.training, {a: m.__dict__[a] for a in _CHECKPOINT_ATTRS if a in m.__dict__})
        for m in model.modules()
    ]
    try:
        prepare_model(model, spec)
        yield
    finally:
        for m, training, attrs in saved:
            m.training = training
            for a in _CHECKPOINT_ATTRS:
                if a in attrs:
                    m.__dict__[a] = attrs[a]
                else:
                    m.__dict__.pop(a, None)


def warm_optimizer(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    """Take one step on zero gradients so the optimizer's state exists (steady state)."""
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def run_step(
    model: nn.Module,
    batch: Any,
    spec: StepSpec,
    optimizer: torch.optim.Optimizer | None,
    phase: Callable[[str], None] = lambda _: None,
) -> None:
    """One step: forward (and loss, backward and optimizer step when training)."""
    phase("forward")
    with spec.forward_context():
        out = call_model(model, batch)
        loss = spec.loss(out, batch) if spec.mode == "train" else None
    if loss is None:
        del out
        return
    phase("backward")
    loss.backward()
    del out, loss
    if optimizer is not None:
        phase("optimizer")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


# -- sources ------------------------------------------------------------------------


def load_model_source(source: ModelSource) -> tuple[str, Callable[[], nn.Module] | nn.Module]:
    """A display name and a builder (or the module) for a model source."""
    if isinstance(source, nn.Module):
        return type(source).__name__, source
    if isinstance(source, str):
        if ":" in source:
            mod_name, _, attr = source.partition(":")
            try:
                obj = getattr(importlib.import_module(mod_name), attr)
            except (ImportError, AttributeError) as exc:
                raise EstimateError(
                    f"cannot load model {source!r}: {exc}; give 'package.module:factory' "
                    "where factory() returns an nn.Module"
                ) from exc
            if isinstance(obj, nn.Module):
                return source, obj
            if not callable(obj):
                raise EstimateError(f"{source!r} is neither an nn.Module nor a factory")
            return source, obj
        entry = zoo.get(source)
        return entry.name, entry.build
    if callable(source):
        return getattr(source, "__name__", "model"), source
    raise EstimateError(
        f"cannot estimate a {type(source).__name__}: give an nn.Module, a built-in name "
        f"({', '.join(zoo.names())}), 'package.module:factory' or a factory"
    )


def _flat_tensors(tree: Any) -> Iterator[torch.Tensor]:
    return tensors(_unpack(tree))


def _unpack(tree: Any) -> Any:
    """A model's output with its dataclasses (a ``ModelOutput`` too) opened into tuples."""
    if hasattr(tree, "to_tuple"):  # transformers ModelOutput
        tree = tree.to_tuple()
    elif dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        tree = tuple(getattr(tree, f.name) for f in dataclasses.fields(tree))
    if isinstance(tree, tuple | list):
        return [_unpack(x) for x in tree]
    if isinstance(tree, Mapping):
        return [_unpack(x) for x in tree.values()]
    return tree


# -- one session: a fake model, traced at one or more batches ------------------------


@dataclass
class _Traced:
    trace: Trace
    categories: dict[int, str]
    batch_size: int | None
    #: Whether the step ran convolutions (cuDNN's kernels join the CUDA context).
    convolutions: bool = False


@dataclass
class Session:
    """A model built once on fake tensors, traced at as many batches as needed."""

    name: str
    spec: StepSpec
    target: Target
    fake_mode: FakeTensorMode = field(default_factory=FakeTensorMode)
    model: nn.Module | None = None
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    params: list[torch.Tensor] = field(default_factory=list)
    optimizer: torch.optim.Optimizer | None = None
    build_seconds: float = 0.0
    target_utilization: float = 0.9
    allocator_config: AllocatorConfig | None = None

    @classmethod
    def open(cls, source: ModelSource, spec: StepSpec, target: Target) -> Session:
        name, obj = load_model_source(source)
        s = cls(name, spec, target)
        t0 = time.perf_counter()
        builder = Tracer(s.fake_mode)
        builder.record = False
        with s.fake_mode, builder:
            try:
                model = obj if isinstance(obj, nn.Module) else obj()
            except VramctlError:
                raise
            except Exception as exc:
                raise EstimateError(
                    f"model {name} failed to build: {type(exc).__name__}: {exc}"
                ) from exc
            if not isinstance(model, nn.Module):
                raise EstimateError(f"model {name}'s factory returned a {type(model).__name__}")
            s.model = model
            s.state = _fake_state(model, spec.param_dtype)
            with (
                _reparametrize_module(model, s.state, tie_weights=True, strict=False),
                _step_mode(model, spec),
            ):
                seen: set[int] = set()
                for p in model.parameters():
                    if p.requires_grad and id(p) not in seen:
                        seen.add(id(p))
                        s.params.append(p)
                s.optimizer = spec.make_optimizer(s.params)
                if s.optimizer is not None:
                    warm_optimizer(s.optimizer, s.params)
        s.build_seconds = time.perf_counter() - t0
        return s

    def estimate(
        self,
        source: ModelSource,
        batch: BatchSource,
        batch_size: int | None,
        seq_len: int | None,
        seconds: float | None,
    ) -> Estimate:
        """Trace one batch and turn the trace into an :class:`Estimate`."""
        t0 = time.perf_counter()
        real, size = make_batch_for(self, source, batch, batch_size, seq_len, seconds)
        traced = self.trace(real, size)
        return build_estimate(
            self,
            traced,
            target_utilization=self.target_utilization,
            seq_len=seq_len,
            seconds=seconds,
            elapsed=time.perf_counter() - t0,
            allocator_config=self.allocator_config,
        )

    @property
    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.params) if self.params else 0

    def trace(self, batch: Any, batch_size: int | None) -> _Traced:
        assert self.model is not None
        model, spec = self.model, self.spec
        tracer = Tracer(self.fake_mode)
        consts = self.target.constants
        cudnn = _CudnnWorkspace(consts.cudnn_workspace_ratio, consts.cudnn_workspace_cap)
        tracer.workspace = cudnn if self.target.cuda else cpu_workspace
        tracer.output_bytes = None if self.target.cuda else cpu_output_bytes
        names = {id(m): n for n, m in model.named_modules()}
        root = type(model).__name__
        stack: list[str] = []

        def pre(mod: nn.Module, _args: Any) -> None:
            stack.append(tracer.module)
            n = names.get(id(mod))
            if n is not None:
                tracer.module = f"{root}.{n}" if n else root

        def post(mod: nn.Module, _args: Any, out: Any) -> None:
            if tracer.phase == "forward" and torch.is_grad_enabled():
                _claim_nodes(out, tracer.module, tracer.node_module)
            tracer.module = stack.pop() if stack else ""

        def phase(p: str) -> None:
            tracer.phase = p
            tracer.module = "" if p != "optimizer" else "optimizer"

        param_ids = set()
        grads: set[int] = set()
        states: set[int] = set()
        inputs: set[int] = set()
        with contextlib.ExitStack() as es:
            # FakeTensorMode logs every refused operator; the error we raise says it once.
            fake_log = logging.getLogger("torch._subclasses.fake_tensor")
            es.callback(fake_log.setLevel, fake_log.level)
            fake_log.setLevel(logging.CRITICAL)
            es.enter_context(self.fake_mode)
            es.enter_context(
                _reparametrize_module(model, self.state, tie_weights=True, strict=False)
            )
            es.enter_context(_step_mode(model, spec))
            fake_batch = _fake_batch(batch, self.fake_mode, tracer, spec)
            es.enter_context(EagerLinear())
            if self.target.cuda and spec.autocast_dtype is not None:
                es.enter_context(CudaAutocast())
            es.enter_context(tracer)
            if self.target.cuda:
                handles = consts.train_handles if spec.mode == "train" else 1
                for _ in range(handles):
                    _pseudo(tracer, consts.cublas_workspace_bytes, "cublas workspace", "workspaces")
            for t in self.state.values():
                sid = tracer.register(t)
                if sid is not None:
                    param_ids.add(sid)
            if self.optimizer is not None:
                for t in _optimizer_tensors(self.optimizer):
                    sid = tracer.register(t)
                    if sid is not None:
                        states.add(sid)
            for t in _flat_tensors(fake_batch):
                sid = tracer.register(t)
                if sid is not None:
                    inputs.add(sid)
            h1 = nn.modules.module.register_module_forward_pre_hook(pre)
            h2 = nn.modules.module.register_module_forward_hook(post)
            es.callback(h1.remove)
            es.callback(h2.remove)
            try:
                if spec.mode == "train":
                    self._train(fake_batch, tracer, phase, grads, states)
                else:
                    run_step(model, fake_batch, spec, None, phase)
            except VramctlError:
                raise
            except DataDependentError as exc:
                raise EstimateError(
                    f"could not trace {self.name}: {exc}; pass a smaller batch, or supply the "
                    "values with a real batch (token ids, lengths, masks)"
                ) from exc
            except Exception as exc:
                where = tracer.module or "the step"
                if tracer.failed_op is None:  # raised by the model's (or loss's) own code
                    raise EstimateError(
                        f"{self.name} raised {type(exc).__name__} at {where} ({tracer.phase}): "
                        f"{exc}"
                    ) from exc
                raise EstimateError(
                    f"could not trace {self.name} at {where}, op {tracer.failed_op} "
                    f"({tracer.phase}): {type(exc).__name__}: {exc}; hint: pass a batch the "
                    "model's forward accepts, a loss_fn=(output, batch) -> loss, or "
                    "mode='infer' to estimate the forward alone"
                ) from exc
            del fake_batch
        categories = _categorize(tracer.trace, param_ids, grads, states, inputs)
        return _Traced(tracer.trace, categories, batch_size, cudnn.calls > 0)

    def _train(
        self,
        batch: Any,
        tracer: Tracer,
        phase: Callable[[str], None],
        grads: set[int],
        states: set[int],
    ) -> None:
        assert self.model is not None
        spec = self.spec
        phase("forward")
        with spec.forward_context():
            out = call_model(self.model, batch)
            loss = spec.loss(out, batch)
        phase("backward")
        tracer.module = "loss"
        loss.backward()
        del out, loss
        for p in self.params:
            if p.grad is not None:
                sid = tracer.sid_of(p.grad)
                if sid is not None:
                    grads.add(sid)
        if self.optimizer is not None:
            phase("optimizer")
            self.optimizer.step()
            for t in _optimizer_tensors(self.optimizer):
                sid = tracer.sid_of(t)
                if sid is not None:
                    states.add(sid)
            self.optimizer.zero_grad(set_to_none=True)
        else:
            for p in self.params:
                p.grad = None


def _pseudo(tracer: Tracer, nbytes: int, op: str, category: str) -> None:
    from vramctl.estimator._trace import StorageRecord

    sid = len(tracer.trace.records)
    tracer.trace.records.append(StorageRecord(nbytes, op, "", "setup", category=category))
    tracer.trace.events.append(sid)


_CONV_OPS = {
    torch.ops.aten.convolution.default,
    torch.ops.aten.convolution_backward.default,
}


class _CudnnWorkspace:
    """A convolution's cuDNN workspace: ``ratio`` times its largest output, at most ``cap``."""

    def __init__(self, ratio: float, cap: int) -> None:
        self.ratio, self.cap, self.calls = ratio, cap, 0

    def __call__(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], outs: list[torch.Tensor]
    ) -> int:
        if func not in _CONV_OPS or not outs:
            return 0
        self.calls += 1
        biggest = max(t.untyped_storage().nbytes() for t in outs)
        return min(int(biggest * self.ratio), self.cap)


def _claim_nodes(out: Any, module: str, table: dict[int, str]) -> None:
    """Attribute the autograd nodes a module's forward made to it (children claimed theirs)."""
    todo = [t.grad_fn for t in _flat_tensors(out) if t.grad_fn is not None]
    while todo:
        node = todo.pop()
        seq = node._sequence_nr()
        if seq in table:
            continue
        table[seq] = module
        todo.extend(n for n, _ in node.next_functions if n is not None)


def _optimizer_tensors(opt: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for st in opt.state.values():
        for k, v in st.items():
            # Adam's ``step`` counter stays on the host unless ``capturable``.
            if isinstance(v, torch.Tensor) and not (k == "step" and v.numel() == 1):
                yield v


def _fake_state(model: nn.Module, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Fresh fake parameters and buffers for ``model`` (tied ones stay tied), cast to ``dtype``."""
    made: dict[int, torch.Tensor] = {}
    state: dict[str, torch.Tensor] = {}
    named: list[tuple[str, torch.Tensor]] = [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]
    for name, t in named:
        if id(t) not in made:
            dt = dtype if dtype is not None and t.is_floating_point() else t.dtype
            f = torch.empty_strided(t.size(), t.stride(), dtype=dt, device="cpu")
            if isinstance(t, nn.Parameter):
                f.requires_grad_(t.requires_grad)
            made[id(t)] = f
        state[name] = made[id(t)]
    return state


def _fake_batch(batch: Any, mode: FakeTensorMode, tracer: Tracer, spec: StepSpec) -> Any:
    from torch.utils._pytree import tree_map

    def fake(x: Any) -> Any:
        f: torch.Tensor
        if not isinstance(x, torch.Tensor):
            return x
        if x.is_meta:  # no values and no device: a fake CPU tensor of its shape
            with mode:
                f = torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device="cpu")
            return f.requires_grad_(x.requires_grad) if f.is_floating_point() else f
        f = x if isinstance(x, FakeTensor) else mode.from_tensor(x)
        if not x.is_floating_point() and not isinstance(x, FakeTensor):
            tracer.known[f] = x
        if spec.param_dtype is not None and f.is_floating_point():
            f = f.to(spec.param_dtype)
        return f

    return tree_map(fake, batch)


def _categorize(
    trace: Trace, params: set[int], grads: set[int], states: set[int], inputs: set[int]
) -> dict[int, str]:
    cats: dict[int, str] = {}
    for sid, rec in enumerate(trace.records):
        if rec.category:
            cats[sid] = rec.category
        elif sid in params:
            cats[sid] = "parameters"
        elif sid in grads:
            cats[sid] = "gradients"
        elif sid in states:
            cats[sid] = "optimizer"
        elif sid in inputs:
            cats[sid] = "inputs"
        elif rec.phase == "forward" and rec.freed_phase != "forward":
            cats[sid] = "activations"
        else:
            cats[sid] = "temporaries"
        rec.category = cats[sid]
    return cats


# -- from a trace to an Estimate ----------------------------------------------------


def _replay(
    trace: Trace, capacity: int | None, config: AllocatorConfig | None
) -> CachingAllocatorModel:
    cfg = config or AllocatorConfig()
    if capacity is not None:
        cfg = AllocatorConfig(**{**cfg.__dict__, "capacity": capacity})
    alloc = CachingAllocatorModel(cfg)
    handles: dict[int, int] = {}
    records = trace.records
    for e in trace.events:
        if e >= 0:
            handles[e] = alloc.malloc(records[e].nbytes)
        else:
            h = handles.pop(~e, None)
            if h is not None:
                alloc.free(h)
    return alloc


def build_estimate(
    session: Session,
    traced: _Traced,
    *,
    target_utilization: float,
    seq_len: int | None,
    seconds: float | None,
    elapsed: float,
    allocator_config: AllocatorConfig | None = None,
) -> Estimate:
    trace, target, spec = traced.trace, session.target, session.spec
    logical, at = trace.peak()
    by_cat = dict.fromkeys(CATEGORIES, 0)
    for sid in trace.live_at(at):
        by_cat[traced.categories[sid]] += trace.records[sid].nbytes
    peak_rec = trace.records[trace.events[at]] if at >= 0 else None
    budget = int(target.capacity * target_utilization)
    notes: list[str] = []
    retries = 0
    if target.cuda:
        consts = target.constants
        context = consts.context_bytes + (consts.cudnn_context_bytes if traced.convolutions else 0)
        if allocator_config is None and target.calibration is not None:
            allocator_config = consts.allocator
        alloc = _replay(trace, None, allocator_config)
        allocated, reserved = alloc.peak_allocated, alloc.peak_reserved
        fits = reserved + context <= budget
        if not fits and budget > context:
            try:
                tight = _replay(trace, budget - context, allocator_config)
            except AllocatorOutOfMemory:
                pass
            else:
                fits, retries = True, tight.alloc_retries
                notes.append(
                    f"fits only because the allocator frees its cache {retries} time(s) "
                    "(alloc retries slow a step)"
                )
        by_cat["allocator"] = reserved - logical
        by_cat["context"] = context
        peak_device = reserved + context
        if target.calibration is not None:
            notes.append(f"CUDA constants measured on {target.calibration.describe()}")
        else:
            notes.append(
                "CUDA constants: built-in values, not measured on this GPU (`vramctl calibrate` "
                "measures them)"
            )
    else:
        allocated = reserved = peak_device = logical
        fits = peak_device <= budget
        notes.append("CPU target: live tensor bytes, no CUDA context or allocator modelled")
    if spec.autocast_dtype is not None and target.cuda:
        notes.append(
            "autocast: CUDA's fp32 rules (norms, softmax, exp/log/pow, sums, losses) applied "
            "to a CPU trace"
        )
    return Estimate(
        model=session.name,
        device=target.name,
        capacity=target.capacity,
        mode=spec.mode,
        precision=spec.precision,
        batch_size=traced.batch_size,
        seq_len=seq_len,
        seconds=seconds,
        logical_peak=logical,
        peak_allocated=allocated,
        peak_reserved=reserved,
        peak_device=peak_device,
        breakdown=by_cat,
        peak_op=peak_rec.op if peak_rec else "",
        peak_module=peak_rec.module if peak_rec else "",
        peak_phase=peak_rec.phase if peak_rec else "",
        target_utilization=target_utilization,
        fits=fits,
        assumptions=tuple(trace.assumptions),
        notes=tuple(notes),
        alloc_retries=retries,
        ops=trace.ops,
        elapsed=elapsed,
        parameters=session.parameter_count,
    )


def open_session(
    model: ModelSource,
    *,
    device: Target | Device | str | int | None,
    target_utilization: float,
    mode: str,
    optimizer: str | Callable[..., torch.optim.Optimizer] | None,
    precision: str,
    checkpointing: bool,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    allocator_config: AllocatorConfig | None,
    calibration: CalibrationSource = None,
) -> Session:
    """Check the arguments, resolve the device and build the model on fake tensors."""
    _check_utilization(target_utilization)
    target = resolve_target(device, calibration)
    spec = StepSpec(
        mode=mode,
        precision=precision,
        optimizer=optimizer,
        checkpointing=checkpointing,
        loss_fn=loss_fn,
        autocast_device="cpu",
        foreach=True if target.cuda else None,
    )
    session = Session.open(model, spec, target)
    session.target_utilization = target_utilization
    session.allocator_config = allocator_config
    return session


def make_batch_for(
    session: Session,
    source: ModelSource,
    batch: BatchSource,
    batch_size: int | None,
    seq_len: int | None,
    seconds: float | None,
) -> tuple[Any, int | None]:
    """The batch to trace, and its batch size."""
    _check_batch_size(batch_size)
    if batch is None:
        if isinstance(source, str) and ":" not in source:
            entry = zoo.get(source)
            size = batch_size or 1
            return (
                entry.make_batch(
                    size, seq_len=seq_len, seconds=seconds, labels=session.spec.mode == "train"
                ),
                size,
            )
        raise EstimateError(
            f"no batch for {session.name}: pass a tensor, a tuple or dict of tensors, or a "
            f"callable batch_size -> batch; {_expected_inputs(session)}"
        )
    if callable(batch) and not isinstance(batch, torch.Tensor):
        size = batch_size or 1
        try:
            return batch(size), size
        except Exception as exc:
            raise EstimateError(
                f"could not build a batch of {size} for {session.name}: "
                f"{type(exc).__name__}: {exc}; {_expected_inputs(session)}"
            ) from exc
    first = next(iter(_flat_tensors(batch)), None)
    if first is None:
        raise EstimateError(
            f"the batch for {session.name} holds no tensors; {_expected_inputs(session)}"
        )
    return batch, (batch_size or (first.shape[0] if first.dim() else None))


def _expected_inputs(session: Session) -> str:
    model = session.model
    if model is None:
        return "expected the model's forward arguments"
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return "expected the model's forward arguments"
    return f"expected {type(model).__name__}.forward{sig}"


def estimate(
    model: ModelSource,
    batch: BatchSource = None,
    *,
    mode: str = "train",
    optimizer: str | Callable[..., torch.optim.Optimizer] | None = "adamw",
    precision: str = "fp32",
    batch_size: int | None = None,
    seq_len: int | None = None,
    seconds: float | None = None,
    device: Target | Device | str | int | None = None,
    checkpointing: bool = False,
    target_utilization: float = 0.9,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    allocator_config: AllocatorConfig | None = None,
    calibration: CalibrationSource = None,
) -> Estimate:
    """Predict a step's peak memory on ``device`` without running it.

    ``model`` is an ``nn.Module``, a built-in name (see
    :func:`vramctl.estimator.zoo.names`), ``"package.module:factory"``, or a
    zero-argument factory. ``batch`` is a tensor, a tuple or dict of tensors
    (what the model's forward takes), or a callable ``batch_size -> batch``;
    built-in models build their own from ``batch_size`` and ``seq_len`` or
    ``seconds``.

    The step runs on fake tensors: no real memory, no real compute. Training
    is forward, loss, backward and an optimizer step, with the optimizer's state
    already made (a steady-state step); inference is the forward under
    ``no_grad``.

    For a GPU, the CUDA constants (context, workspaces, allocator) come from a
    profile made by ``vramctl calibrate`` on that GPU or one of its compute
    capability, where there is one; ``calibration=False`` uses the built-in ones,
    and a :class:`~vramctl.estimator.Calibration` or a profile's path picks one.
    """
    t0 = time.perf_counter()
    session = open_session(
        model,
        device=device,
        target_utilization=target_utilization,
        mode=mode,
        optimizer=optimizer,
        precision=precision,
        checkpointing=checkpointing,
        loss_fn=loss_fn,
        allocator_config=allocator_config,
        calibration=calibration,
    )
    est = session.estimate(model, batch, batch_size, seq_len, seconds)
    return dataclasses.replace(est, elapsed=time.perf_counter() - t0)


def _check_batch_size(n: object) -> None:
    if n is None:
        return
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        raise EstimateError(f"batch_size must be a positive integer, got {n!r}")


def _check_utilization(u: float) -> None:
    if not 0 < u <= 1:
        raise EstimateError(f"target_utilization must be in (0, 1], got {u}")


def parse_batches(text: str | Sequence[int]) -> list[int]:
    """``"1,8,32"`` -> ``[1, 8, 32]``; every size must be a positive integer."""
    items = text.split(",") if isinstance(text, str) else list(text)
    out = []
    for item in items:
        try:
            n = int(str(item).strip())
        except ValueError:
            raise EstimateError(
                f"batch sizes are positive integers like 1,8,32; got {text!r}"
            ) from None
        if n < 1:
            raise EstimateError(f"batch sizes must be at least 1; got {n}")
        out.append(n)
    return out
