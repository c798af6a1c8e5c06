"""Tracing one step of a session's fake model: the step run under the :class:`Tracer` (the
setup's pseudo-allocations, the module and phase of each storage, the optimizer's step on
the device or the host), and each storage of the trace put in its category."""

from __future__ import annotations

import contextlib
import inspect
import logging
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes

from vramctl._errors import VramctlError
from vramctl._step import call_model
from vramctl.estimator._autocast import cuda_autocast, recomputed_too
from vramctl.estimator._build import reparametrized
from vramctl.estimator._composite import composite_intermediates
from vramctl.estimator._conv_workspace import CudnnWorkspace
from vramctl.estimator._cpu_kernels import cpu_output_bytes, cpu_workspace, rank_threads
from vramctl.estimator._cuda_kernels import (
    CUBLAS_WORKSPACE,
    CUBLASLT_WORKSPACE,
    kernel_intermediates,
    multiprocessors,
    reduction_scratch,
    without_idle_cublas,
)
from vramctl.estimator._cuda_rnn import CudnnRnn, flat_weight_bytes
from vramctl.estimator._distributed import (
    DDPStandIn,
    fsdp_categories,
    local,
    zero_model_states,
    zero_trace,
)
from vramctl.estimator._hub import eager_masks
from vramctl.estimator._opcost import OpCost
from vramctl.estimator._parallel import Parallel
from vramctl.estimator._spec import (
    EstimateError,
    StepSpec,
    flat_tensors,
    run_step,
    step_mode,
)
from vramctl.estimator._target import Target
from vramctl.estimator._trace import (
    DataDependentError,
    EagerLinear,
    StorageRecord,
    Trace,
    Tracer,
    no_op_module_to,
    storage_resizes,
)

__all__ = ["Opened", "Traceable", "Traced", "trace_step"]


class Opened(Protocol):
    """What both a step's trace and its verdict read of a session
    (:class:`~vramctl.estimator._session.Session`): the model's name, its step, the device,
    the layout over ranks, the optimizer and the parameters' count."""

    @property
    def name(self) -> str: ...
    @property
    def spec(self) -> StepSpec: ...
    @property
    def target(self) -> Target: ...
    @property
    def parallel(self) -> Parallel | None: ...
    @property
    def optimizer(self) -> torch.optim.Optimizer | None: ...
    @property
    def parameter_count(self) -> int: ...


class Traceable(Opened, Protocol):
    """What a step's trace reads of a session besides: its model on fake tensors, their
    state and trainable parameters, and the distributed stand-ins."""

    @property
    def fake_mode(self) -> FakeTensorMode: ...
    @property
    def model(self) -> nn.Module | None: ...
    @property
    def state(self) -> dict[str, torch.Tensor]: ...
    @property
    def params(self) -> list[torch.Tensor]: ...
    @property
    def ddp(self) -> DDPStandIn | None: ...
    @property
    def largest_block(self) -> int: ...


@dataclass
class Traced:
    """One step's trace, the category of each of its storages, and the batch it ran."""

    trace: Trace
    categories: dict[int, str]
    batch_size: int | None
    #: Whether the step ran convolutions (cuDNN's kernels join the CUDA context).
    convolutions: bool = False
    #: Host bytes one rank keeps under ZeRO's offload.
    host: int = 0


def trace_step(session: Traceable, batch: Any, batch_size: int | None) -> Traced:
    """Trace one step of ``session``'s model on ``batch``, its storages categorized."""
    assert session.model is not None
    model, spec = session.model, session.spec
    tracer = Tracer(session.fake_mode)
    consts = session.target.constants
    cudnn = CudnnWorkspace(
        consts.cudnn_workspace_ratio,
        consts.cudnn_workspace_cap,
        consts.cudnn_workspace_fixed,
        consts.cudnn_workspaces,
        consts.cudnn_workspace_lines,
    )
    if session.target.cuda:
        cc = session.target.capability
        tracer.workspace = _CudaScratch(
            cudnn, multiprocessors(session.target.name, (cc.major, cc.minor) if cc else None)
        )
        # The recorded steps: a convolution's output, then its workspace; a reduction's
        # output, then its staging buffer and semaphores.
        tracer.scratch_after_outputs = True
    else:
        tracer.workspace = cpu_workspace
    tracer.intermediates = _cuda_intermediates if session.target.cuda else composite_intermediates
    tracer.output_bytes = None if session.target.cuda else cpu_output_bytes
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
        es.enter_context(session.fake_mode)
        if session.state:
            es.enter_context(reparametrized(model, session.state))
        es.enter_context(step_mode(model, spec))
        fake_batch = _fake_batch(batch, session.fake_mode, tracer, spec)
        es.enter_context(EagerLinear())
        es.enter_context(eager_masks())
        es.enter_context(no_op_module_to())
        if session.target.cuda and spec.autocast_dtype is not None:
            es.enter_context(cuda_autocast())
        if session.target.cuda:
            es.enter_context(cuda_attention_backends())
            es.enter_context(recomputed_too(CudaDropout))
            es.enter_context(recomputed_too(lambda: CudnnRnn(tracer)))
        es.enter_context(tracer)
        es.enter_context(storage_resizes(tracer))
        if session.parallel is not None and session.parallel.strategy == "fsdp":
            es.enter_context(fsdp_categories(tracer, gloo=not session.target.cuda))
        if session.parallel is not None and not session.target.cuda:
            es.enter_context(
                rank_threads(session.parallel.ranks_per_node or session.parallel.world_size)
            )
        if session.target.cuda:
            handles = consts.train_handles if spec.mode == "train" else 1
            per_handle, lt = consts.cublas_split()
            for _ in range(handles):
                _pseudo(tracer, per_handle, CUBLAS_WORKSPACE, "workspaces")
            if lt:  # the forward thread's, at its first bias-epilogue product
                _pseudo(tracer, lt, CUBLASLT_WORKSPACE, "workspaces")
        held = (
            list(session.state.items())
            if session.state
            else [(n, local(t)) for n, t in (*model.named_parameters(), *model.named_buffers())]
        )
        # on a GPU, each recurrent layer's weights are one buffer (``flatten_parameters``)
        flat = flat_weight_bytes(model) if session.target.cuda else {}
        for name, t in held:
            size = flat.get(name)
            if size == 0:  # in the buffer an earlier weight of its layer stands for
                continue
            sid = tracer.register(t, nbytes=size)
            if sid is not None:
                param_ids.add(sid)
        if session.ddp is not None:
            tracer.category = "buckets"
            for t in session.ddp.buckets:
                tracer.register(t)
            tracer.category = ""
        if session.optimizer is not None and not spec.offload_optimizer:
            for t in _optimizer_tensors(session.optimizer):
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
                _train(session, fake_batch, tracer, phase, grads, states)
            elif spec.mode == "generate":
                _generate(session, fake_batch, tracer, phase, inputs)
            else:
                run_step(model, fake_batch, spec, None, phase)
        except VramctlError:
            raise
        except DataDependentError as exc:
            raise EstimateError(
                f"could not trace {session.name}: {exc}; pass a smaller batch, or supply the "
                "values with a real batch (token ids, lengths, masks)"
            ) from exc
        except Exception as exc:
            where = tracer.module or "the step"
            if tracer.failed_op is None:  # raised by the model's (or loss's) own code
                raise EstimateError(
                    f"{session.name} raised {type(exc).__name__} at {where} ({tracer.phase}): {exc}"
                ) from exc
            raise EstimateError(
                f"could not trace {session.name} at {where}, op {tracer.failed_op} "
                f"({tracer.phase}): {type(exc).__name__}: {exc}; hint: pass a batch the "
                "model's forward accepts, a loss_fn=(output, batch) -> loss, or "
                "mode='infer' to estimate the forward alone"
            ) from exc
        del fake_batch
    tracer.close(inputs)
    tracer.trace.workspace_keys = cudnn.keys
    if session.target.cuda:
        without_idle_cublas(tracer.trace)
    categories = _categorize(tracer.trace, param_ids, grads, states, inputs)
    if session.parallel is not None and session.parallel.zero_stage is not None:
        return _zero(session, tracer.trace, categories, batch_size, cudnn.calls > 0)
    return Traced(tracer.trace, categories, batch_size, cudnn.calls > 0)


@contextlib.contextmanager
def cuda_attention_backends() -> Iterator[None]:
    """While a step for a CUDA GPU is traced on the host, scaled-dot-product attention runs
    the kernel the GPU would choose by the caller's settings (``sdpa_kernel``): where only
    the math backend is enabled, the math path, which keeps the whole score matrix (and
    computes in fp32 from bf16 or fp16 inputs, on CUDA as here); otherwise the host's fused
    kernel, which keeps what CUDA's fused kernels keep (the output and an fp32 logsumexp).
    A caller that enabled only a GPU's fused backend (memory-efficient, cuDNN) would find no
    host kernel without this.

    CUDA's fused kernels take dropout (they keep a random seed, not a mask); the host's
    does not, and would fall back to the math path, which keeps the score matrix and its
    dropout mask. Where the host's fused kernel takes the call without dropout, it runs so
    (:class:`CudaDropout`). A mask that needs a gradient sends both devices to the math
    path, as the recorded H200 steps show (T5's position bias)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cuda = torch.backends.cuda
    fused = cuda.flash_sdp_enabled() or cuda.mem_efficient_sdp_enabled() or cuda.cudnn_sdp_enabled()
    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH] if fused else [SDPBackend.MATH]
    with sdpa_kernel(backends):
        yield


#: ``F.scaled_dot_product_attention``'s parameters (a builtin: no signature to read).
_SDPA = inspect.Signature(
    [
        inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=d)
        for n, d in (
            ("query", inspect.Parameter.empty),
            ("key", inspect.Parameter.empty),
            ("value", inspect.Parameter.empty),
            ("attn_mask", None),
            ("dropout_p", 0.0),
            ("is_causal", False),
        )
    ]
    + [
        inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=d)
        for n, d in (("scale", None), ("enable_gqa", False))
    ]
)


def _shape_of(t: Any) -> Any:
    """A host tensor with ``t``'s sizes, dtype and gradient flag on a storage of one row:
    what the backend choice reads (it reads no values and no strides but the last). Made
    with the fake mode and the tracer off."""
    if not isinstance(t, torch.Tensor):
        return t
    row = torch.empty(max(int(t.shape[-1]), 1) if t.dim() else 1, dtype=t.dtype)
    strides = [0] * (t.dim() - 1) + [1] if t.dim() else []
    stand_in = row.as_strided(tuple(int(n) for n in t.shape), strides)
    return stand_in.requires_grad_(t.requires_grad) if t.is_floating_point() else stand_in


def _host_chooses_fused(a: dict[str, Any]) -> bool:
    """Whether the host's backend choice, under the enabled backends, takes a fused kernel
    for this call without dropout."""
    try:
        with _disable_current_modes():
            q, k, v, mask = (_shape_of(a[n]) for n in ("query", "key", "value", "attn_mask"))
            choice = torch._fused_sdp_choice(
                q,
                k,
                v,
                mask,
                0.0,
                a["is_causal"],
                scale=a["scale"],
                enable_gqa=a["enable_gqa"],
            )
    except (RuntimeError, TypeError, ValueError):
        return False
    return bool(choice != 0)  # SDPBackend.MATH is 0


class CudaDropout(TorchFunctionMode):
    """While a step for a CUDA GPU is traced on the host, dropout takes the kernels it
    takes on CUDA.

    ``F.dropout`` in training runs ``native_dropout``, which keeps a one-byte mask for
    backward. On the host it draws a noise tensor of the input's dtype, multiplies, and
    keeps the noise (four bytes an element in fp32 where CUDA keeps one). In-place dropout
    and a probability of 0 or 1 take the same path on both devices (ATen's
    ``is_fused_kernel_acceptable``).

    Attention with dropout runs on the host's fused kernel where that kernel takes the
    call without dropout (see :func:`cuda_attention_backends`)."""

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.dropout:
            bound = _DROPOUT.bind(*args, **kwargs).arguments
            x, p = bound["input"], float(bound.get("p", 0.5))
            if (
                bound.get("training", True)
                and not bound.get("inplace", False)
                and 0 < p < 1
                and isinstance(x, torch.Tensor)
                and x.numel() > 0
            ):
                return torch.native_dropout(x, p, True)[0]
        elif func is torch.nn.functional.scaled_dot_product_attention:
            call = _SDPA.bind(*args, **kwargs)
            call.apply_defaults()
            a = call.arguments
            if a["dropout_p"] > 0 and _host_chooses_fused(a):
                a["dropout_p"] = 0.0
                return func(*call.args, **call.kwargs)
        return func(*args, **kwargs)


_DROPOUT = inspect.signature(torch.nn.functional.dropout)


def _zero(
    session: Traceable,
    trace: Trace,
    categories: dict[int, str],
    batch_size: int | None,
    conv: bool,
) -> Traced:
    """The single-process trace with one rank's model states under a ZeRO stage."""
    assert session.parallel is not None
    params = session.parameter_count
    param_bytes = session.params[0].element_size() if session.params else 4
    state_elements = 0
    if session.optimizer is not None and params:
        state_elements = round(
            sum(t.numel() for t in _optimizer_tensors(session.optimizer)) / params
        )
    half = session.spec.param_dtype is not None
    states = zero_model_states(
        session.parallel,
        parameters=params,
        param_bytes=param_bytes,
        state_elements=state_elements,
        largest_block=session.largest_block,
        half=half,
    )
    out = zero_trace(trace, categories, states)
    cats = {sid: rec.category for sid, rec in enumerate(out.records)}
    return Traced(out, cats, batch_size, conv, host=states.host)


def _train(
    session: Traceable,
    batch: Any,
    tracer: Tracer,
    phase: Callable[[str], None],
    grads: set[int],
    states: set[int],
) -> None:
    assert session.model is not None
    spec = session.spec
    if spec.grad_accumulation:
        # the earlier micro-batches' gradients: backward adds into them in place
        for p in session.params:
            p.grad = torch.zeros_like(p)
            sid = tracer.sid_of(p.grad)
            if sid is not None:
                grads.add(sid)
    phase("forward")
    with spec.forward_context(), _saved_on_host(tracer, spec.offload_activations):
        out = call_model(session.model, batch)
        loss = spec.loss(out, batch)
    if not spec.keep_output:
        out = None  # the loop returns the loss alone: autograd holds what backward needs
    phase("backward")
    tracer.module = "loss"
    loss.backward()
    tracer.settle()
    del out, loss
    for p in session.params:
        if p.grad is not None:
            sid = tracer.sid_of(local(p.grad))
            if sid is not None:
                grads.add(sid)
    if session.optimizer is not None and spec.offload_optimizer:
        phase("optimizer")
        _host_step(tracer, session.optimizer, session.params)
    elif session.optimizer is not None:
        phase("optimizer")
        session.optimizer.step()
        for t in _optimizer_tensors(session.optimizer):
            sid = tracer.sid_of(t)
            if sid is not None:
                states.add(sid)
        session.optimizer.zero_grad(set_to_none=True)
    else:
        for p in session.params:
            p.grad = None


def _generate(
    session: Traceable, batch: Any, tracer: Tracer, phase: Callable[[str], None], inputs: set[int]
) -> None:
    """A whole ``generate``: the prefill and the last decode step traced (see
    :mod:`vramctl.estimator._generate`), the cache's tensors in their own category."""
    from vramctl.estimator._generate import run_generate

    assert session.model is not None
    spec = session.spec

    @contextlib.contextmanager
    def unrecorded() -> Iterator[None]:
        was, tracer.record = tracer.record, False
        try:
            yield
        finally:
            tracer.record = was

    def transfer(nbytes: int) -> None:  # an offloaded cache's move, in the step's time
        if tracer.record:
            tracer.trace.costs.append(OpCost("transfer", tracer.phase, "other", 0, nbytes, True))

    def register(tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            sid = tracer.register(t)
            if sid is not None and t.dtype in (torch.long, torch.int):
                inputs.add(sid)
            elif sid is not None:
                tracer.trace.records[sid].category = "kv_cache"

    with spec.forward_context():
        run_generate(
            session.model, batch, spec.max_new_tokens, spec.cache,
            phase=phase, unrecorded=unrecorded, register=register, transfer=transfer,
            kv_dtype=spec.kv_dtype,
        )  # fmt: skip


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


def _pseudo(tracer: Tracer, nbytes: int, op: str, category: str) -> None:
    sid = len(tracer.trace.records)
    tracer.trace.records.append(StorageRecord(nbytes, op, "", "setup", category=category))
    tracer.trace.events.append(sid)


def _cuda_intermediates(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], outs: list[torch.Tensor]
) -> tuple[int, ...]:
    """What a CUDA target's kernel makes after its outputs: a composite kernel's
    intermediates (every target's) and a CUDA kernel's own."""
    return composite_intermediates(func, args, kwargs, outs) + kernel_intermediates(
        func, args, kwargs, outs
    )


class _CudaScratch:
    """A CUDA kernel's scratch around an operator: a convolution's cuDNN workspace, a
    reduction's staging buffer (:mod:`~vramctl.estimator._cuda_kernels`)."""

    def __init__(self, cudnn: CudnnWorkspace, sms: tuple[int, int]) -> None:
        self.cudnn, self.sms = cudnn, sms

    def __call__(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], outs: list[torch.Tensor]
    ) -> int:
        return self.cudnn(func, args, kwargs, outs) or reduction_scratch(
            func, args, kwargs, self.sms
        )


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
