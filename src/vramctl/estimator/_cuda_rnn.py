"""Recurrent layers as cuDNN runs them, while a step for a CUDA GPU is traced on the host.

``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` call ``torch.lstm`` / ``gru`` / ``rnn_tanh`` /
``rnn_relu``, which on the host run oneDNN's kernels (``mkldnn_rnn_layer``) and on a CUDA
GPU run cuDNN's (``_cudnn_rnn``, ``aten/src/ATen/native/cudnn/RNN.cpp``). The two hold
different memory. PyTorch's fake kernel for ``_cudnn_rnn`` allocates no workspace and no
reserve, and there is none for its backward. :class:`CudnnRnn` runs each such call as
:class:`_CudnnRnnStep`, which allocates what the CUDA call does:

- forward: the input made contiguous in time-major order (a copy where ``batch_first``
  and more than one sample), the output, the last hidden (and cell) states, the weights
  copied into one buffer where they are not one already (under autocast: the casts),
  cuDNN's workspace for the call and, in training, its reserve, kept with the output
  until backward;
- backward: the output's gradient made contiguous, the input's and the initial states'
  gradients, the workspace again, and the weights' gradient as one zeroed buffer, which
  the parameters' gradients are views of.

A layer on a GPU holds its weights in one buffer (``flatten_parameters``, when it is
built or moved there), and ``_cudnn_rnn`` runs on that buffer as it is
(``try_get_weight_buf`` in ``aten/src/ATen/native/cudnn/RNN.cpp``); it copies the weights
only where they are not laid out so, as under autocast, whose casts are separate tensors.

The workspace and reserve sizes are cuDNN's (``cudnnGetRNNTempSpaceSizes``), which have
no public formula. They were fitted to the recorded H200 steps (2026-11-27 summary
corpus: two-layer LSTMs and GRUs of 512 and 1024, fp32 and bf16, batch 1 to 16): the
workspace is :data:`WORKSPACE_FIXED` plus, per sample and time step, the gates of one
layer, one layer's output and the input; the reserve is, per sample, time step and
layer, :data:`RESERVE_PER_STEP` hidden-sized vectors (5.5 for an LSTM, 6.4 for a GRU).
A float32 call's workspace holds the weights' bytes more (:meth:`RnnCall.workspace_bytes`
with the weights given): in those steps the fp32 layers, whose weights were one buffer,
made no copy, and their workspace was one allocation that large. The inference steps'
reserved peaks show it: a GRU's at batch 1 reserved 42 MiB, its 14 MiB of parameters'
segments and one 28 MiB segment, where a 10.5 MiB copy and an 18 MiB workspace take 12 and
20; with the weights in the workspace, the four fp32 inference rows of 512 are within 4.8%
(were 12.5% short to 9.5% over) and the zoo's 1024-wide LSTM trains at batch 1 and 4 to
the recorded reserved peak. Those steps ran with TF32 allowed for cuDNN (PyTorch's
default), where cuDNN may convert the fp32 weights into its workspace; whether it does so
with TF32 off was not recorded, so such a call is priced the same. The recorded steps'
allocated peaks are met within 1.9%. Plain RNNs, more or fewer than two layers and
bidirectional layers were not recorded: they take the same formulas unverified.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["RESERVE_PER_STEP", "WORKSPACE_FIXED", "CudnnRnn", "flat_weight_bytes", "rnn_call"]

#: Gates per cell (the rows of a weight matrix, in hidden sizes).
GATES = {"lstm": 4, "gru": 3, "rnn_tanh": 1, "rnn_relu": 1}
#: The training reserve per sample, time step and layer, in hidden-sized vectors of the
#: RNN's dtype (fitted at batch 16, rounded up; a plain RNN's two are a guess).
RESERVE_PER_STEP = {"lstm": 5.5, "gru": 6.4, "rnn_tanh": 2.0, "rnn_relu": 2.0}
#: The workspace's part that does not grow with the batch, in bytes: the largest of the
#: recorded steps' (16.9 to 17.8 MB).
WORKSPACE_FIXED = 17_760_256


@dataclass(frozen=True)
class RnnCall:
    """One unpacked ``torch.lstm``-family call, as ``_cudnn_rnn`` would run it."""

    cell: str
    layers: int
    directions: int
    batch_first: bool
    train: bool
    #: The dtype cuDNN runs in (autocast's where it is on).
    dtype: torch.dtype
    #: Hidden states given: (h0,) or (h0, c0).
    states: int
    steps: int
    batch: int
    input_size: int
    hidden: int

    def workspace_bytes(self, weights: int = 0) -> int:
        """cuDNN's workspace for the call, for ``weights`` elements of weights: a float32
        call's holds their bytes too (see the module's notes)."""
        per_step = (GATES[self.cell] + 1) * self.hidden * self.directions + self.input_size
        converted = weights * self._size if self.dtype == torch.float32 else 0
        return WORKSPACE_FIXED + self.batch * self.steps * per_step * self._size + converted

    def reserve_bytes(self) -> int:
        if not self.train:
            return 0
        per = RESERVE_PER_STEP[self.cell] * self.hidden * self.layers * self.directions
        return math.ceil(self.batch * self.steps * per) * self._size

    @property
    def _size(self) -> int:
        return self.dtype.itemsize


def rnn_call(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> RnnCall | None:
    """The call cuDNN would run for ``torch.<name>(*args)``; None where it would not (a
    packed sequence, fp64, cuDNN off) or the arguments are not the unpacked form's."""
    if name not in GATES or kwargs or len(args) != 9 or not torch.backends.cudnn.enabled:
        return None
    x, hx, params, _bias, layers, _dropout, train, bidirectional, batch_first = args
    states = tuple(hx) if isinstance(hx, list | tuple) else (hx,)
    if (
        not isinstance(x, torch.Tensor)
        or x.dim() != 3
        or not isinstance(params, list | tuple)
        or not all(isinstance(t, torch.Tensor) for t in (*states, *params))
        or not states
    ):
        return None
    dtype = x.dtype
    if torch.is_autocast_enabled("cpu") and dtype in _CUDNN_DTYPES:
        dtype = torch.get_autocast_dtype("cpu")
    if dtype not in _CUDNN_DTYPES:
        return None
    steps, batch = (x.shape[1], x.shape[0]) if batch_first else (x.shape[0], x.shape[1])
    return RnnCall(
        cell=name,
        layers=int(layers),
        directions=2 if bidirectional else 1,
        batch_first=bool(batch_first),
        train=bool(train),
        dtype=dtype,
        states=len(states),
        steps=int(steps),
        batch=int(batch),
        input_size=int(x.shape[2]),
        hidden=int(states[-1].shape[-1]),
    )


def _workspace(x: torch.Tensor, call: RnnCall, tracer: Any, weights: int) -> torch.Tensor:
    """cuDNN's workspace for one call on ``weights`` elements of weights, counted as a
    workspace by ``tracer`` (where given)."""
    before = getattr(tracer, "category", None)
    if tracer is not None:
        tracer.category = "workspaces"
    try:
        return x.new_empty((call.workspace_bytes(weights),), dtype=torch.uint8)
    finally:
        if tracer is not None:
            tracer.category = before


def _time_major(x: torch.Tensor, call: RnnCall) -> torch.Tensor:
    """The input as cuDNN takes it: in the call's dtype, time-major and contiguous (a copy
    where it was not already)."""
    xin = x if x.dtype == call.dtype else x.to(call.dtype)
    return (xin.transpose(0, 1) if call.batch_first else xin).contiguous()


class _CudnnRnnStep(torch.autograd.Function):
    """``_cudnn_rnn`` and its backward, by their allocations (the values are not computed:
    a trace's tensors have none)."""

    @staticmethod
    def forward(
        ctx: Any, call: RnnCall, tracer: Any, x: torch.Tensor, *tensors: torch.Tensor
    ) -> Any:
        states, weights = tensors[: call.states], tensors[call.states :]
        ctx.call, ctx.tracer = call, tracer
        ctx.weight_dtypes = [w.dtype for w in weights]
        ctx.input_dtype = x.dtype
        # autocast casts the input and each weight for the call
        casts = [w.to(call.dtype) for w in weights if w.dtype != call.dtype]
        time_major = _time_major(x, call)
        out_features = states[0].shape[-1] * call.directions
        y = x.new_empty((call.steps, call.batch, out_features), dtype=call.dtype)
        finals = [s.new_empty(s.shape, dtype=call.dtype) for s in states]
        ctx.weights = sum(w.numel() for w in weights)
        # weights already in the call's dtype are one buffer on a GPU, which cuDNN runs on
        # as it is; autocast's casts are copied into one
        weight_buf = x.new_empty((ctx.weights,), dtype=call.dtype) if casts else None
        workspace = _workspace(x, call, tracer, ctx.weights)
        reserve = x.new_empty((call.reserve_bytes(),), dtype=torch.uint8) if call.train else None
        del workspace, time_major
        if call.train:
            ctx.shapes = [w.shape for w in weights]
            # the copy (where there is one) is kept for backward, the casts it was made of
            # are not
            ctx.save_for_backward(x, weight_buf, reserve, y, *states)
        del casts, weight_buf
        out = y.transpose(0, 1) if call.batch_first else y
        return (out, *finals)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor, *grad_finals: torch.Tensor | None) -> Any:
        call: RnnCall = ctx.call
        x, _weight_buf, _reserve, _y, *states = ctx.saved_tensors
        # ``_cudnn_rnn_backward``: zeros for the gradients autograd did not give
        zeros = [
            s.new_zeros(s.shape, dtype=call.dtype)
            for s, gs in zip(states, grad_finals, strict=False)
            if gs is None
        ]
        # backward data: the input and the output's gradient time-major and contiguous
        # (copies that live for the call), the input's and the states' gradients
        time_major = _time_major(x, call)
        g = grad_out.transpose(0, 1) if call.batch_first else grad_out
        dy = g.to(call.dtype).contiguous()
        dx = x.new_empty((call.steps, call.batch, call.input_size), dtype=call.dtype)
        dstates = [s.new_empty(s.shape, dtype=call.dtype) for s in states]
        workspace = _workspace(x, call, ctx.tracer, ctx.weights)
        del workspace, dy, time_major
        # backward weights: the input again, one zeroed buffer for the weights' gradient
        # (the parameters' gradients are views of it), the workspace again
        time_major = _time_major(x, call)
        dw = x.new_zeros((ctx.weights,), dtype=call.dtype)
        workspace = _workspace(x, call, ctx.tracer, ctx.weights)
        del workspace, time_major, zeros
        grads: list[torch.Tensor] = []
        at = 0
        for shape, dtype in zip(ctx.shapes, ctx.weight_dtypes, strict=True):
            n = math.prod(shape)
            view = dw[at : at + n].view(shape)
            grads.append(view if dtype == call.dtype else view.to(dtype))
            at += n
        del dw
        dx_out = dx.transpose(0, 1) if call.batch_first else dx
        if ctx.input_dtype != call.dtype:
            dx_out = dx_out.to(ctx.input_dtype)
        dstates = [
            d if d.dtype == s.dtype else d.to(s.dtype) for d, s in zip(dstates, states, strict=True)
        ]
        return (None, None, dx_out, *dstates, *grads)


class CudnnRnn(TorchFunctionMode):
    """Runs each unpacked ``torch.lstm`` / ``gru`` / ``rnn_tanh`` / ``rnn_relu`` call as
    cuDNN would on a CUDA GPU (:class:`_CudnnRnnStep`); any other call as it is.
    ``tracer`` (a trace's :class:`~vramctl.estimator._trace.Tracer`) counts cuDNN's
    workspaces as workspaces."""

    def __init__(self, tracer: Any = None) -> None:
        super().__init__()
        self.tracer = tracer

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in GATES and func is getattr(torch, name, None):
            call = rnn_call(name, args, kwargs)
            if call is not None:
                x, hx, params = args[0], args[1], args[2]
                states = tuple(hx) if isinstance(hx, list | tuple) else (hx,)
                # (output, hy, cy) for an LSTM, (output, hy) for the others
                outs = _CudnnRnnStep.apply(call, self.tracer, x, *states, *params)  # type: ignore[no-untyped-call]
                return tuple(outs)
        return func(*args, **kwargs)


def flat_weight_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Each recurrent layer's weights as a GPU holds them: ``nn.LSTM``/``GRU``/``RNN`` on
    CUDA copy their weights into one buffer when built or moved there
    (``flatten_parameters``), and the parameters become views of it. Maps each such
    weight's name to the buffer's bytes for the layer's first weight, 0 for the others
    (a layer whose weights differ in dtype, or are not floating, stays as it is)."""
    out: dict[str, int] = {}
    for prefix, module in model.named_modules():
        if not isinstance(module, torch.nn.RNNBase):
            continue
        names = [n for n in module._flat_weights_names if getattr(module, n, None) is not None]
        weights = [getattr(module, n) for n in names]
        dtypes = {w.dtype for w in weights}
        if not weights or len(dtypes) != 1 or dtypes.pop() not in _CUDNN_DTYPES:
            continue
        total = sum(w.numel() * w.element_size() for w in weights)
        full = [f"{prefix}.{n}" if prefix else n for n in names]
        out.update(dict.fromkeys(full, 0))
        out[full[0]] = total
    return out


_CUDNN_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
