"""One estimate session: the model built once on fake tensors (:mod:`._build`), given a batch,
traced at one or more batches (:mod:`._trace_step`) and each trace judged into an
:class:`Estimate` (:mod:`._verdict`)."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import numbers
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from vramctl._errors import VramctlError
from vramctl._units import format_bytes
from vramctl.device import catalog
from vramctl.estimator._adapter import adapter_parameters, apply_adapter, describe_adapter
from vramctl.estimator._build import (
    build_module,
    fake_state,
    largest_block,
    private_copy,
    reparametrized,
    trainable,
)
from vramctl.estimator._distributed import DDPStandIn, FakeWorld, wrap_fake
from vramctl.estimator._generate import check_kv_dtype
from vramctl.estimator._hub import check_positions
from vramctl.estimator._parallel import Parallel
from vramctl.estimator._quant import (
    apply_quant,
    carried_quant,
    describe_quant,
    quant_storage_ids,
    swap_library_layers,
)
from vramctl.estimator._request import Step
from vramctl.estimator._result import Estimate
from vramctl.estimator._spec import (
    BatchSource,
    EstimateError,
    ModelSource,
    StepSpec,
    flat_tensors,
    resolve_source,
    step_mode,
    warm_optimizer,
)
from vramctl.estimator._target import Target, resolve_target
from vramctl.estimator._timing import Rates
from vramctl.estimator._trace import Tracer
from vramctl.estimator._trace_step import Traced, trace_step
from vramctl.estimator._verdict import build_estimate

__all__ = ["Session", "make_batch_for", "open_session"]


@dataclass
class Session:
    """A model built once on fake tensors, traced at as many batches as needed."""

    name: str
    spec: StepSpec
    target: Target
    #: The request it was opened for: what its verdicts judge by (the target utilization,
    #: the allocator's configuration, the safe end or the point estimate) and time with.
    request: Step
    fake_mode: FakeTensorMode = field(default_factory=FakeTensorMode)
    model: nn.Module | None = None
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    params: list[torch.Tensor] = field(default_factory=list)
    optimizer: torch.optim.Optimizer | None = None
    build_seconds: float = 0.0
    #: The rates its steps are timed with (None: not timed).
    rates: Rates | None = None
    #: Host bytes of the tensors of the last batch traced (the search bounds its batches).
    last_batch_bytes: int = 0
    #: The last step traced (the search replays it at other sizes).
    last_traced: Traced | None = None
    #: How a named model's batches are made (a built-in model, or one from its config).
    entry: Any = None
    #: Notes on the model's source: options given that it does not use.
    source_notes: tuple[str, ...] = ()
    #: The distributed layout one rank of which is estimated (None: one process).
    parallel: Parallel | None = None
    #: The fake process group FSDP and tensor parallel run on, while the session lives.
    world: FakeWorld | None = None
    ddp: DDPStandIn | None = None
    #: Parameters of the largest repeated block (what ZeRO-3 gathers at once).
    largest_block: int = 0

    @classmethod
    def open(
        cls,
        source: ModelSource,
        spec: StepSpec,
        target: Target,
        request: Step,
        parallel: Parallel | None = None,
        **options: Any,
    ) -> Session:
        """Build ``source`` on fake tensors; ``options`` are :func:`resolve_source`'s."""
        resolved = resolve_source(source, **options)
        name, obj = resolved.name, resolved.model
        s = cls(name, spec, target, request, entry=resolved.entry, parallel=parallel)
        s.source_notes = resolved.notes
        t0 = time.perf_counter()
        builder = Tracer(s.fake_mode)
        builder.record = False
        with s.fake_mode, builder:
            model = s.model = build_module(name, obj)
            quant = request.quant
            carried = getattr(getattr(resolved.entry, "config", None), "quantization_config", None)
            if carried is not None:  # a quantized checkpoint's config.json
                quant, note = carried_quant(carried, quant)
                if note:
                    s.source_notes = (*s.source_notes, note)
            swapped = swap_library_layers(model)
            if swapped is not None:  # a model bitsandbytes quantized
                if quant is not None:
                    raise EstimateError(
                        f"quant: {type(model).__name__}'s layers are already quantized by "
                        "bitsandbytes: give no quant"
                    )
                model = s.model = swapped
                quant = getattr(swapped, "vramctl_quant", True)
            if request.kbit_prep and quant is None:
                raise EstimateError("kbit_prep goes with quant (it prepares a quantized model)")
            if quant is not None and swapped is None:
                model = s.model = apply_quant(model, quant, spec.param_dtype)
            if request.adapter is not None:
                model = s.model = apply_adapter(model, request.adapter)
            # A PEFT model's adapters stay fp32 under a 16-bit base, as PEFT keeps them;
            # quantized storage keeps its library's dtypes.
            keep = adapter_parameters(model) | quant_storage_ids(model)
            if request.kbit_prep:  # prepare_model_for_kbit_training's fp32 upcast
                keep |= {id(p) for p in model.parameters()}
            s.state = fake_state(model, spec.param_dtype, keep)
            if parallel is not None:
                s._wrap(parallel)
                model = s.model
            with (
                reparametrized(model, s.state),
                step_mode(model, spec),
            ):
                s.params = trainable(model)
                s.optimizer = spec.make_optimizer(s.params)
                if s.optimizer is not None:
                    warm_optimizer(s.optimizer, s.params)
        s.build_seconds = time.perf_counter() - t0
        return s

    def _wrap(self, parallel: Parallel) -> None:
        """Give the model its fake state for good, then apply ``parallel`` to it."""
        assert self.model is not None
        model = self.model
        self.largest_block = largest_block(model)
        if parallel.strategy not in ("ddp", "fsdp", "tp"):
            return  # ZeRO: the model states are priced after the trace
        model = self.model = private_copy(model, self.state)
        self.state = {}
        if parallel.strategy in ("fsdp", "tp"):
            self.world = FakeWorld(parallel.world_size)
        try:
            self.ddp = wrap_fake(model, parallel)
        except Exception as exc:
            self.close()
            raise EstimateError(
                f"could not apply {parallel.describe()} to {self.name}: {type(exc).__name__}: {exc}"
            ) from exc

    def close(self) -> None:
        """Release the fake process group, if the session holds one."""
        if self.world is not None:
            self.world.close()
            self.world = None

    def estimate(
        self,
        batch: BatchSource,
        batch_size: int | None,
        seq_len: int | None,
        seconds: float | None,
    ) -> Estimate:
        """Trace one batch and turn the trace into an :class:`Estimate`."""
        t0 = time.perf_counter()
        # Past a learned position table: an error before any batch is made.
        too_long = check_positions(self.entry, self.model, seq_len) if batch is None else None
        real, size = make_batch_for(self, batch, batch_size, seq_len, seconds)
        self.last_batch_bytes = sum(t.nbytes for t in flat_tensors(real) if not t.is_meta)
        traced = self.trace(real, size)
        self.last_traced = traced
        used_len, used_sec = self.lengths_used(batch, seq_len, seconds)
        est = build_estimate(
            self,
            traced,
            seq_len=used_len,
            seconds=used_sec,
            elapsed=time.perf_counter() - t0,
        )
        why = (
            f"{self.name}'s inputs take no such length"
            if batch is None
            else "the batch is made by what was passed, not from it"
        )
        unused = [
            f"{name}={given} was given but not used: {why}"
            for name, given, used in (
                ("seq_len", seq_len, used_len),
                ("seconds", seconds, used_sec),
            )
            if given is not None and used is None
        ]
        adapter = describe_adapter(self.model) if self.model is not None else None
        if adapter is not None:
            est = dataclasses.replace(est, adapter=adapter)
        quant = describe_quant(self.model) if self.model is not None else None
        if quant is not None:
            est = dataclasses.replace(est, quant=quant)
        if getattr(self.optimizer, "eight_bit", None) is not None:
            kind = "8-bit" if getattr(self.optimizer, "eight_bit", False) else "paged"
            est = dataclasses.replace(
                est,
                notes=(
                    *est.notes,
                    f"the {kind} optimizer's state is bitsandbytes' own; its fused update's "
                    "time is not in step_seconds",
                ),
            )
        if self.spec.mode == "generate":
            kv = f", {self.spec.kv_dtype}" if self.spec.kv_dtype else ""
            note = (
                f"generate: the prefill and the last of {self.spec.max_new_tokens} tokens "
                f"({self.spec.cache} cache{kv}) traced; step_seconds is the time of those two "
                f"forwards, not of the whole generation's {self.spec.max_new_tokens} steps"
            )
            est = dataclasses.replace(est, notes=(*est.notes, note))
        paged = getattr(self.optimizer, "paged_bytes", 0)
        if paged:
            note = (
                f"the paged optimizer's state ({format_bytes(paged)}) is in CUDA unified "
                "memory, outside PyTorch's allocator and these peaks; nvidia-smi counts it "
                "while it is on the GPU, and when the GPU runs short the driver moves it to "
                "host memory, which slows the step instead of failing it"
            )
            est = dataclasses.replace(est, paged_optimizer=paged, notes=(*est.notes, note))
        notes = tuple(getattr(self.entry, "notes", ())) if batch is None else ()
        notes += self.source_notes
        if too_long is not None:
            notes += (too_long,)
        if unused or notes:
            est = dataclasses.replace(est, notes=(*est.notes, *notes, *unused))
        return est

    def lengths_used(
        self, batch: BatchSource, seq_len: int | None, seconds: float | None
    ) -> tuple[int | None, float | None]:
        """The lengths the traced batch was made with: a named model's, defaults filled in.

        A batch passed in (or built by a callable) is what it is: no length of ours went in.
        """
        if batch is None and self.entry is not None:
            result: tuple[int | None, float | None] = self.entry.lengths(seq_len, seconds)
            return result
        return None, None

    @property
    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.params) if self.params else 0

    def trace(self, batch: Any, batch_size: int | None) -> Traced:
        """One step's trace on ``batch`` (:func:`trace_step`)."""
        return trace_step(self, batch, batch_size)


def open_session(model: ModelSource, step: Step, rates: Rates) -> Session:
    """Check the request, resolve its device and build the model on fake tensors; its steps
    are timed with ``rates`` (``step.throughput`` first)."""
    check_utilization(step.target_utilization)
    target = resolve_target(step.device, step.calibration)
    parallel = step.parallel
    spec = StepSpec(
        mode=step.mode,
        precision=step.precision,
        optimizer=step.optimizer,
        checkpointing=step.checkpointing,
        loss_fn=step.loss_fn,
        autocast_device="cpu",
        # Tensor parallel mixes sharded and whole parameters, which the multi-tensor
        # (foreach) kernels refuse: its optimizer steps one parameter at a time.
        foreach=True if target.cuda and not _is_tp(parallel) else None,
        offload_activations=step.offload_activations,
        offload_optimizer=step.offload_optimizer,
        grad_accumulation=step.grad_accumulation,
        keep_output=step.keep_output,
        max_new_tokens=step.max_new_tokens or 0,
        cache=step.cache,
        kv_dtype=step.kv_dtype,
    )
    if step.mode == "generate" and not step.max_new_tokens:
        raise EstimateError("mode='generate' needs max_new_tokens (the tokens after the prompt)")
    if step.mode == "generate":
        check_kv_dtype(step.cache, step.kv_dtype)
    if step.mode == "generate" and step.cache == "offloaded" and not target.cuda:
        raise EstimateError(
            "cache='offloaded' keeps the cache in host memory while a GPU computes: give a GPU "
            f"device (a name such as 'L4-24GB', or a size), not {target.name!r}"
        )
    if isinstance(parallel, str):
        parallel = Parallel.parse(parallel)
    if parallel is not None and step.mode != "train":
        raise EstimateError("parallel= estimates a training step; pass mode='train'")
    session = Session.open(
        model,
        spec,
        target,
        step,
        parallel,
        task=step.task,
        image_size=step.image_size,
        trust_remote_code=step.trust_remote_code,
    )
    session.rates = rates
    return session


def _is_tp(parallel: Parallel | str | None) -> bool:
    if isinstance(parallel, str):
        return parallel.strip().lower().startswith("tp")
    return parallel is not None and parallel.strategy == "tp"


def make_batch_for(
    session: Session,
    batch: BatchSource,
    batch_size: int | None,
    seq_len: int | None,
    seconds: float | None,
) -> tuple[Any, int | None]:
    """The batch to trace, and its batch size."""
    check_batch_size(batch_size)
    if batch is None:
        entry = session.entry
        if entry is not None:
            size = batch_size or 1
            return _named_batch(session, size, seq_len, seconds), size
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
    first = next(iter(flat_tensors(batch)), None)
    if first is None:
        raise EstimateError(
            f"the batch for {session.name} holds no tensors; {_expected_inputs(session)}"
        )
    return batch, (batch_size or (first.shape[0] if first.dim() else None))


#: The largest batch of a named model built in host memory, with real values (token ids,
#: labels), for a trace; a larger one is built by its shapes alone.
REAL_INPUT_BYTES = 1 << 30


def _named_batch(session: Session, size: int, seq_len: int | None, seconds: float | None) -> Any:
    """A named model's batch of ``size``, built so that its size takes no host memory.

    Its bytes are worked out on the meta device first: inputs that no GPU could hold
    (more than the target's capacity and the largest catalog GPU's) are refused. Up to
    :data:`REAL_INPUT_BYTES` the batch is real (the trace reads the values of token ids
    and labels). Beyond, it is made of meta tensors (shapes only; the floats' values are
    never read), its integer inputs repeating the rows of a small real batch where they
    fit :data:`REAL_INPUT_BYTES` (unknown values otherwise: the trace assumes them).
    """
    entry = session.entry
    labels = session.spec.mode == "train"

    def build(n: int, meta: bool) -> Any:
        with torch.device("meta") if meta else contextlib.nullcontext():
            return entry.make_batch(n, seq_len=seq_len, seconds=seconds, labels=labels)

    def nbytes(batch: Any, ints: bool = False) -> int:
        return sum(t.nbytes for t in flat_tensors(batch) if not (ints and t.is_floating_point()))

    try:
        one, two = nbytes(build(1, True)), nbytes(build(2, True))
    except VramctlError:
        raise
    except Exception:  # an entry that cannot be built on the meta device: as it is
        return build(size, False)
    per_sample = two - one
    need = one + per_sample * (size - 1)
    largest = max(catalog(), key=lambda s: s.cuda_total_bytes)
    target = session.target
    if need > max(target.capacity, largest.cuda_total_bytes):
        bigger = (
            f"{target.name}'s {format_bytes(target.capacity)}"
            if target.capacity > largest.cuda_total_bytes
            else f"the largest catalog GPU's ({largest.name}, "
            f"{format_bytes(largest.cuda_total_bytes)})"
        )
        length = getattr(entry, "length_arg", None)
        raise EstimateError(
            f"batch {size} of {session.name} is beyond any GPU's reach: its inputs alone "
            f"would take {format_bytes(need)} ({format_bytes(per_sample)} a sample), more "
            f"than {bigger}; pass a smaller batch size" + (f" or {length}" if length else "")
        )
    if need <= REAL_INPUT_BYTES:
        return build(size, False)
    shaped = build(size, True)
    if nbytes(shaped, ints=True) > REAL_INPUT_BYTES:
        return shaped
    rows = min(size, 64)
    flat, tree = tree_flatten(shaped)
    real, real_tree = tree_flatten(build(rows, False))
    if real_tree != tree:
        return shaped
    out = []
    for m, r in zip(flat, real, strict=True):
        batch_major = (
            isinstance(m, torch.Tensor)
            and isinstance(r, torch.Tensor)
            and m.dim() > 0
            and m.shape[0] == size
            and r.shape == (rows, *m.shape[1:])
        )
        if batch_major and not m.is_floating_point():
            m = r.index_select(0, torch.arange(size) % rows)
        out.append(m)
    return tree_unflatten(out, tree)


def _expected_inputs(session: Session) -> str:
    model = session.model
    if model is None:
        return "expected the model's forward arguments"
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return "expected the model's forward arguments"
    return f"expected {type(model).__name__}.forward{sig}"


def check_batch_size(n: object) -> None:
    if n is None:
        return
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        raise EstimateError(f"batch_size must be a positive integer, got {n!r}")


def check_utilization(u: float) -> None:
    if not 0 < u <= 1:
        raise EstimateError(f"target_utilization must be in (0, 1], got {u}")
