"""One estimate session: the model built on fake tensors, traced at one or more batches, and
each trace replayed through the CUDA caching-allocator model into an :class:`Estimate`."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import logging
import numbers
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_unflatten

from vramctl._errors import VramctlError
from vramctl._step import call_model
from vramctl._units import format_bytes
from vramctl.device import catalog
from vramctl.estimator import _cuda_model
from vramctl.estimator._allocator import (
    AllocatorConfig,
    AllocatorOutOfMemory,
    CachingAllocatorModel,
)
from vramctl.estimator._autocast import cuda_autocast
from vramctl.estimator._calibration import measured_on
from vramctl.estimator._cpu_kernels import (
    cpu_output_bytes,
    cpu_workspace,
    rank_thread_count,
    rank_threads,
)
from vramctl.estimator._distributed import (
    DDPStandIn,
    FakeWorld,
    fsdp_categories,
    local,
    wrap_fake,
    zero_model_states,
    zero_trace,
)
from vramctl.estimator._hub import check_positions, eager_masks
from vramctl.estimator._opcost import OpCost
from vramctl.estimator._parallel import Parallel
from vramctl.estimator._request import Step
from vramctl.estimator._result import CATEGORIES, Estimate, no_bf16_note, uncalibrated_note
from vramctl.estimator._spec import (
    BatchSource,
    EstimateError,
    ModelSource,
    StepSpec,
    flat_tensors,
    resolve_source,
    run_step,
    step_mode,
    warm_optimizer,
)
from vramctl.estimator._target import Target, resolve_target
from vramctl.estimator._timing import Rates, predict
from vramctl.estimator._trace import (
    DataDependentError,
    EagerLinear,
    Trace,
    Tracer,
    no_op_module_to,
    storage_resizes,
)

__all__ = ["NCCL_UNCERTAINTY", "Session", "build_estimate", "make_batch_for", "open_session"]

#: What NCCL's communicator buffers may add on a GPU, outside PyTorch's allocator.
NCCL_UNCERTAINTY = 1 << 30


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
    #: Whether verdicts judge at the safe end of the device peak's range.
    safe: bool = True
    #: The request it was opened for, and the rates its steps are timed with (None: not
    #: timed; a session of the tests, opened by hand).
    request: Step | None = None
    rates: Rates | None = None
    #: Host bytes of the tensors of the last batch traced (the search bounds its batches).
    last_batch_bytes: int = 0
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
    #: Host bytes one rank keeps under ZeRO's offload (set by the last trace).
    zero_host: int = 0

    @classmethod
    def open(
        cls,
        source: ModelSource,
        spec: StepSpec,
        target: Target,
        parallel: Parallel | None = None,
        **options: Any,
    ) -> Session:
        """Build ``source`` on fake tensors; ``options`` are :func:`resolve_source`'s."""
        resolved = resolve_source(source, **options)
        name, obj = resolved.name, resolved.model
        s = cls(name, spec, target, entry=resolved.entry, parallel=parallel)
        s.source_notes = resolved.notes
        t0 = time.perf_counter()
        builder = Tracer(s.fake_mode)
        builder.record = False
        with s.fake_mode, builder:
            try:
                model = obj if isinstance(obj, nn.Module) else _build(obj)
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
            if parallel is not None:
                s._wrap(parallel)
                model = s.model
            with (
                _reparametrize_module(model, s.state, tie_weights=True, strict=False),
                step_mode(model, spec),
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

    def _wrap(self, parallel: Parallel) -> None:
        """Give the model its fake state for good, then apply ``parallel`` to it."""
        from vramctl._blocks import find_blocks

        assert self.model is not None
        model = self.model
        blocks = find_blocks(model)
        self.largest_block = max(
            (sum(p.numel() for p in b.parameters()) for b in blocks), default=0
        )
        if parallel.strategy not in ("ddp", "fsdp", "tp"):
            return  # ZeRO: the model states are priced after the trace
        model = self.model = _private_copy(model, self.state)
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
        used_len, used_sec = self.lengths_used(batch, seq_len, seconds)
        est = build_estimate(
            self,
            traced,
            target_utilization=self.target_utilization,
            seq_len=used_len,
            seconds=used_sec,
            elapsed=time.perf_counter() - t0,
            allocator_config=self.allocator_config,
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

    def trace(self, batch: Any, batch_size: int | None) -> _Traced:
        assert self.model is not None
        model, spec = self.model, self.spec
        tracer = Tracer(self.fake_mode)
        consts = self.target.constants
        cudnn = _CudnnWorkspace(
            consts.cudnn_workspace_ratio, consts.cudnn_workspace_cap, consts.cudnn_workspace_fixed
        )
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
            # FSDP2 warns of the views a fake forward returns; a real one returns the same.
            es.enter_context(warnings.catch_warnings())
            warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
            es.enter_context(self.fake_mode)
            if self.state:
                es.enter_context(
                    _reparametrize_module(model, self.state, tie_weights=True, strict=False)
                )
            es.enter_context(step_mode(model, spec))
            fake_batch = _fake_batch(batch, self.fake_mode, tracer, spec)
            es.enter_context(EagerLinear())
            es.enter_context(eager_masks())
            es.enter_context(no_op_module_to())
            if self.target.cuda and spec.autocast_dtype is not None:
                es.enter_context(cuda_autocast())
            es.enter_context(tracer)
            es.enter_context(storage_resizes(tracer))
            if self.parallel is not None and self.parallel.strategy == "fsdp":
                es.enter_context(fsdp_categories(tracer, gloo=not self.target.cuda))
            if self.parallel is not None and not self.target.cuda:
                es.enter_context(
                    rank_threads(self.parallel.ranks_per_node or self.parallel.world_size)
                )
            if self.target.cuda:
                handles = consts.train_handles if spec.mode == "train" else 1
                for _ in range(handles):
                    _pseudo(tracer, consts.cublas_workspace_bytes, "cublas workspace", "workspaces")
            held = (
                self.state.values()
                if self.state
                else [local(t) for t in (*model.parameters(), *model.buffers())]
            )
            for t in held:
                sid = tracer.register(t)
                if sid is not None:
                    param_ids.add(sid)
            if self.ddp is not None:
                tracer.category = "buckets"
                for t in self.ddp.buckets:
                    tracer.register(t)
                tracer.category = ""
            if self.optimizer is not None and not spec.offload_optimizer:
                for t in _optimizer_tensors(self.optimizer):
                    sid = tracer.register(t)
                    if sid is not None:
                        states.add(sid)
            for t in flat_tensors(fake_batch):
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
        if self.parallel is not None and self.parallel.zero_stage is not None:
            return self._zero(tracer.trace, categories, batch_size, cudnn.calls > 0)
        return _Traced(tracer.trace, categories, batch_size, cudnn.calls > 0)

    def _zero(
        self, trace: Trace, categories: dict[int, str], batch_size: int | None, conv: bool
    ) -> _Traced:
        """The single-process trace with one rank's model states under a ZeRO stage."""
        assert self.parallel is not None
        params = self.parameter_count
        param_bytes = self.params[0].element_size() if self.params else 4
        state_elements = 0
        if self.optimizer is not None and params:
            state_elements = round(
                sum(t.numel() for t in _optimizer_tensors(self.optimizer)) / params
            )
        half = self.spec.param_dtype is not None
        states = zero_model_states(
            self.parallel,
            parameters=params,
            param_bytes=param_bytes,
            state_elements=state_elements,
            largest_block=self.largest_block,
            half=half,
        )
        self.zero_host = states.host
        out = zero_trace(trace, categories, states)
        cats = {sid: rec.category for sid, rec in enumerate(out.records)}
        return _Traced(out, cats, batch_size, conv)

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
        if spec.grad_accumulation:
            # the earlier micro-batches' gradients: backward adds into them in place
            for p in self.params:
                p.grad = torch.zeros_like(p)
                sid = tracer.sid_of(p.grad)
                if sid is not None:
                    grads.add(sid)
        phase("forward")
        with spec.forward_context(), _saved_on_host(tracer, spec.offload_activations):
            out = call_model(self.model, batch)
            loss = spec.loss(out, batch)
        phase("backward")
        tracer.module = "loss"
        loss.backward()
        tracer.settle()
        del out, loss
        for p in self.params:
            if p.grad is not None:
                sid = tracer.sid_of(local(p.grad))
                if sid is not None:
                    grads.add(sid)
        if self.optimizer is not None and spec.offload_optimizer:
            phase("optimizer")
            _host_step(tracer, self.optimizer, self.params)
        elif self.optimizer is not None:
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


@contextlib.contextmanager
def _saved_on_host(tracer: Tracer, on: bool) -> Iterator[None]:
    """The saved tensors leave device memory in forward and come back in backward, as
    ``torch.autograd.graph.save_on_cpu`` does: packing drops autograd's reference (the
    tensor is freed where nothing else holds it) and unpacking allocates its copy."""
    if not on:
        yield
        return

    def pack(t: torch.Tensor) -> tuple[torch.Size, torch.dtype]:
        nbytes = t.numel() * t.element_size()
        tracer.trace.costs.append(OpCost("transfer", tracer.phase, "other", 0, nbytes, True))
        return t.shape, t.dtype

    def unpack(packed: tuple[torch.Size, torch.dtype]) -> torch.Tensor:
        shape, dtype = packed
        t = torch.empty(shape, dtype=dtype)
        tracer.trace.costs.append(
            OpCost("transfer", tracer.phase, "other", 0, t.numel() * t.element_size(), True)
        )
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def _host_step(tracer: Tracer, optimizer: torch.optim.Optimizer, params: list[Any]) -> None:
    """The optimizer step of an offloaded optimizer: the gradients are copied to the host,
    the step runs there (its operators priced as the host's, its memory not the
    device's) and the parameters are copied back in place."""
    grads = [p.grad for p in params if p.grad is not None]
    moved = sum(g.numel() * g.element_size() for g in grads)
    tracer.trace.costs.append(OpCost("transfer", tracer.phase, "other", 0, moved, True))
    tracer.host = True
    try:
        optimizer.step()
    finally:
        tracer.host = False
    moved = sum(p.numel() * p.element_size() for p in params if p.grad is not None)
    tracer.trace.costs.append(OpCost("transfer", tracer.phase, "other", 0, moved, True))
    optimizer.zero_grad(set_to_none=True)


def _build(factory: Callable[[], Any]) -> Any:
    """Call ``factory`` under the fake mode; if it converts a parameter (``.to(dtype)``
    in ``__init__``), which a fake parameter refuses (``Module._apply`` swaps a fake
    tensor, and the fake mode holds a weak reference to it), build it on the meta device
    instead: the session gives every parameter and buffer a fresh fake tensor anyway."""
    try:
        return factory()
    except RuntimeError as exc:
        if "Couldn't swap" not in str(exc):
            raise
    with _disable_current_modes(), torch.device("meta"):
        return factory()


def _optimizer_name(session: Session) -> str | None:
    if session.optimizer is None:
        return None
    opt = session.spec.optimizer
    if isinstance(opt, str):
        return opt
    return str(getattr(opt, "__qualname__", None) or type(session.optimizer).__name__)


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
    """A convolution's cuDNN workspace: ``fixed`` plus ``ratio`` times its largest output,
    at most ``cap``."""

    def __init__(self, ratio: float, cap: int, fixed: int = 0) -> None:
        self.ratio, self.cap, self.fixed, self.calls = ratio, cap, fixed, 0

    def __call__(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], outs: list[torch.Tensor]
    ) -> int:
        if func not in _CONV_OPS or not outs:
            return 0
        self.calls += 1
        biggest = max(t.untyped_storage().nbytes() for t in outs)
        return min(self.fixed + int(biggest * self.ratio), self.cap)


def _claim_nodes(out: Any, module: str, table: dict[int, str]) -> None:
    """Attribute the autograd nodes a module's forward made to it (children claimed theirs)."""
    todo = [t.grad_fn for t in flat_tensors(out) if t.grad_fn is not None]
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
                yield local(v)


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


def _private_copy(model: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are ``state``'s fake tensors (tied
    ones stay tied), for a wrapper that changes the model it wraps (FSDP2 swaps in its
    shards, DDP's stand-in adds hooks): the model given is left as it was, and no weight is
    copied."""
    memo: dict[int, Any] = {}
    named: list[tuple[str, torch.Tensor]] = [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]
    for name, t in named:
        if id(t) not in memo and name in state:
            fake = state[name]
            memo[id(t)] = (
                nn.Parameter(fake, requires_grad=t.requires_grad)
                if isinstance(t, nn.Parameter)
                else fake
            )
    try:
        return copy.deepcopy(model, memo)
    except Exception as exc:
        raise EstimateError(
            f"could not copy {type(model).__name__} to wrap it: {type(exc).__name__}: {exc}"
        ) from exc


def _offloaded(trace: Trace, categories: dict[int, str]) -> tuple[Trace, int]:
    """One FSDP2 rank with CPU offload: its sharded parameters, gradients and optimizer
    state (and the optimizer's step) are in host memory; the device keeps the rest."""
    host = 0
    records = []
    for sid, rec in enumerate(trace.records):
        cat = categories.get(sid, rec.category)
        if cat in ("parameters", "gradients", "optimizer") or (
            rec.phase == "optimizer" and cat == "temporaries"
        ):
            if cat != "temporaries":
                host += rec.nbytes
            rec = dataclasses.replace(rec, nbytes=0)
        records.append(rec)
    out = dataclasses.replace(trace, records=records)
    return out, host


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
        if isinstance(x, FakeTensor):
            f = x
        elif x.device.type != "cpu":
            # A batch already on the GPU is traced on the host, as the model is: only its
            # shape counts, and the values of integer tensors (token ids, lengths).
            if x.is_floating_point():
                with mode:
                    f = torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device="cpu")
                f.requires_grad_(x.requires_grad)
            else:
                with _disable_current_modes():  # a real copy, made outside the fake mode
                    host = x.detach().cpu()
                f = mode.from_tensor(host)
                tracer.known[f] = host
        else:
            f = mode.from_tensor(x)
            if not x.is_floating_point():
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
        if rec.category and sid not in grads and sid not in states:
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
    par = session.parallel
    host = 0
    if par is not None and par.strategy == "fsdp" and par.offload:
        trace, host = _offloaded(trace, traced.categories)
    elif par is not None and par.zero_stage is not None:
        host = session.zero_host
    logical, at = trace.peak()
    by_cat = dict.fromkeys(CATEGORIES, 0)
    for sid in trace.live_at(at):
        by_cat[traced.categories[sid]] += trace.records[sid].nbytes
    peak_rec = trace.records[trace.events[at]] if at >= 0 else None
    budget = int(target.capacity * target_utilization)
    notes: list[str] = []
    retries = {False: 0, True: 0}
    fits = {False: False, True: False}  # at the point estimate, at the safe end
    uncertainty = 0
    calibrated = True
    profile = None
    if target.cuda:
        consts = target.constants
        context = consts.context_bytes + (consts.cudnn_context_bytes if traced.convolutions else 0)
        if allocator_config is None and target.calibration is not None:
            allocator_config = consts.allocator
        alloc = _replay(trace, None, allocator_config)
        allocated, reserved = alloc.peak_allocated, alloc.peak_reserved
        cal = target.calibration
        same_gpu = cal is not None and measured_on(cal, target.name)
        calibrated = same_gpu
        profile = cal.describe() if cal is not None else None
        uncertainty = _cuda_model.device_uncertainty(cal, same_gpu, traced.convolutions)
        if par is not None and par.world_size > 1:
            uncertainty += NCCL_UNCERTAINTY
            notes.append(
                f"NCCL's own buffers are outside PyTorch's allocator and not modelled: "
                f"nvidia-smi may read up to {format_bytes(NCCL_UNCERTAINTY)} more per rank "
                "(NVLS and many channels take the most)"
            )
        for safe in (False, True):
            extra = context + (uncertainty if safe else 0)
            fits[safe] = reserved + extra <= budget
            if not fits[safe] and budget > extra:
                try:
                    tight = _replay(trace, budget - extra, allocator_config)
                except AllocatorOutOfMemory:
                    pass
                else:
                    fits[safe], retries[safe] = True, tight.alloc_retries
        if retries[session.safe]:
            notes.append(
                f"fits only because the allocator frees its cache {retries[session.safe]} "
                "time(s) (alloc retries slow a step)"
            )
        by_cat["allocator"] = reserved - logical
        by_cat["context"] = context
        peak_device = reserved + context
        if cal is None:
            varies = (
                "the CUDA context and cuDNN's kernels and workspaces vary"
                if traced.convolutions
                else "the CUDA context varies"
            )
            notes.append(
                f"CUDA constants: built-in values; nvidia-smi may read up to "
                f"{format_bytes(uncertainty)} more ({varies} with the driver, CUDA version "
                "and module loading)"
            )
        elif same_gpu:
            notes.append(f"CUDA constants measured on {cal.describe()}")
        else:
            notes.append(
                f"CUDA constants measured on {cal.describe()}, another GPU than "
                f"{target.name}; nvidia-smi may read up to {format_bytes(uncertainty)} more"
            )
        if not calibrated:
            notes.append(uncalibrated_note(target.name, target.capability is None))
    else:
        allocated = reserved = peak_device = logical
        fits[False] = fits[True] = peak_device <= budget
        notes.append("CPU target: live tensor bytes, no CUDA context or allocator modelled")
        if par is not None and par.world_size > 1:
            ranks = par.ranks_per_node or par.world_size
            threads = rank_thread_count(ranks)
            notes.append(
                f"a CPU rank over gloo: its reduce-scatter's copy of the input is counted; "
                f"kernel scratch measured with {threads} thread(s) a rank, as torchrun starts "
                f"{ranks} rank(s) on a host"
            )
    request, rates = session.request, session.rates
    tp = request.throughput if request is not None and request.throughput else None
    if tp is None and rates is not None:
        tp = rates.target(target)
    timed = None
    if tp is None:
        notes.append(
            f"step time: not predicted for a GPU known only by its size ({target.name}); "
            "name a catalog GPU"
        )
    else:
        on_host = target.cuda and any(c.phase == "host" for c in trace.costs)
        tf32 = bool(request is not None and request.tf32)
        timed = predict(
            trace.costs,
            tp,
            tf32=target.cuda and _tf32_capable(target) and tf32,
            host=rates.host() if on_host and rates is not None else None,
        )
    cc = target.capability
    bf16 = torch.bfloat16 in (spec.param_dtype, spec.autocast_dtype)
    if bf16 and target.cuda and cc is not None and not cc.bf16:
        notes.append(no_bf16_note(target.name, str(cc)))
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
        fits=fits[session.safe],
        assumptions=tuple(trace.assumptions),
        notes=tuple(notes),
        alloc_retries=retries[session.safe],
        ops=trace.ops,
        elapsed=elapsed,
        parameters=session.parameter_count,
        optimizer=_optimizer_name(session),
        checkpointing=spec.checkpointing,
        cuda=target.cuda,
        calibration=profile,
        calibrated=calibrated,
        device_uncertainty=uncertainty,
        safe=session.safe,
        fits_point=fits[False],
        fits_safe=fits[True],
        flops=timed.flops if timed else sum(c.flops for c in trace.costs),
        bytes_moved=timed.bytes if timed else sum(c.bytes for c in trace.costs),
        step_seconds=timed.seconds if timed else None,
        time_breakdown=dict(timed.by_group) if timed else {},
        phase_seconds=dict(timed.by_phase) if timed else {},
        throughput=tp.source if tp else None,
        parallel=par.describe() if par is not None else None,
        world_size=par.world_size if par is not None else 1,
        host_per_rank=host,
        host_per_node=host * ((par.ranks_per_node or par.world_size) if par else 1),
    )


def _tf32_capable(target: Target) -> bool:
    cc = target.capability
    return cc is not None and cc.major >= 8


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
    )
    if isinstance(parallel, str):
        parallel = Parallel.parse(parallel)
    if parallel is not None and step.mode != "train":
        raise EstimateError("parallel= estimates a training step; pass mode='train'")
    session = Session.open(
        model,
        spec,
        target,
        parallel,
        task=step.task,
        image_size=step.image_size,
        trust_remote_code=step.trust_remote_code,
    )
    session.request = step
    session.rates = rates
    session.target_utilization = step.target_utilization
    session.allocator_config = step.allocator_config
    session.safe = step.safe
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
