"""The throughputs a step's time is predicted with: measured here (the CPU, once per
machine, kept as a profile), or a GPU's calibrated profile or data sheet.

:data:`RATES` is what :func:`vramctl.estimate` and :func:`vramctl.max_batch_size` time their
steps with; a :class:`~vramctl.estimator.Step` with a ``throughput`` of its own overrides
its target's. Measuring predicts reference steps with the throughput being measured: it
opens sessions of its own (it never calls :func:`vramctl.estimate`, which times with this
module's rates).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from vramctl._errors import UnknownDeviceError
from vramctl.device import gpu_spec
from vramctl.estimator._calibration import calibration_dir, measured_on
from vramctl.estimator._target import Target
from vramctl.estimator._timing import (
    DATA_SHEET_ERROR,
    MEASURED_ERROR,
    SCHEMA,
    Rates,
    Throughput,
    gpu_throughput,
)

__all__ = [
    "RATES",
    "cpu_profile_path",
    "cpu_throughput",
    "measure_throughput",
    "target_throughput",
]

log = logging.getLogger(__name__)


def target_throughput(target: Target) -> Throughput | None:
    """The throughput a target's steps are timed with: the CPU's (measured here) for a
    target without CUDA (the CPU, a simulated GPU, whose kernels run on the CPU); a GPU's
    calibrated profile or data sheet; None for a GPU known only by its size."""
    if not target.cuda:
        return cpu_throughput()
    try:
        spec = gpu_spec(target.name)
    except UnknownDeviceError:
        return None
    cal = target.calibration
    measured = None
    if cal is not None and measured_on(cal, target.name):
        found = cal.measurements.get("throughput")
        measured = found if isinstance(found, dict) and "rates" in found else None
    return gpu_throughput(spec, measured)


# -- measuring ---------------------------------------------------------------------------


def _repeat(fn: Callable[[], Any], times: int) -> None:
    for _ in range(times):
        fn()


def _best(fn: Callable[[], Any], sync: Callable[[], None], *, repeat: int = 3) -> float:
    fn()  # warm up (kernel selection, caches)
    sync()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_throughput(device: str | torch.device = "cpu", *, scale: float = 1.0) -> Throughput:
    """Measure ``device``'s rates: matrix multiplies by dtype, a convolution, attention,
    a memory-bound kernel and the per-operator overhead (a second or two on the CPU).

    ``scale`` grows the problem sizes (a GPU needs larger ones to reach its rates).
    Its training steps run backward whatever the caller's grad mode: an inference
    estimate (under ``no_grad`` or ``inference_mode``) may be what measures a machine first.
    The CPU's random numbers it draws leave the caller's generator as it was (the first
    estimate on a machine measures it, and a seeded run must not see that; a GPU is
    measured only by ``vramctl calibrate``).
    """
    with torch.inference_mode(False), torch.enable_grad(), torch.random.fork_rng(devices=[]):
        return _measure_throughput(torch.device(device), scale)


def _measure_throughput(dev: torch.device, scale: float) -> Throughput:
    cuda = dev.type == "cuda"
    sync: Callable[[], None] = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)
    rates: dict[str, dict[str, float]] = {"matmul": {}, "convolution": {}, "attention": {}}
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    with torch.no_grad():
        n = int(1024 * scale)
        for key, dtype in dtypes.items():
            # a probe a 64th the work first sizes the measurement to about 10 ms a
            # multiply (an emulated dtype, such as fp16 on most CPUs, is 100x slower)
            m = max(64, n // 4)
            a = torch.randn(m, m, device=dev, dtype=dtype)
            probe = _best(partial(torch.matmul, a, a), sync, repeat=1)
            side = int((2 * m**3 / max(probe, 1e-9) * 0.01 / 2) ** (1 / 3)) // 64 * 64
            side = min(n, max(m, side))
            rates["matmul"][key] = _matmul_rate(side, side, side, dev, dtype, sync)
        curves: dict[str, list[tuple[int, float]]] = {}
        for key in ("fp32", "bf16"):
            rows = []
            # a step's multiplies: tall activations by square or wide weights
            for rows_, inner, cols in ((64, 64, 64), (256, 128, 128), (512, 256, 256)):
                r, i, c = (int(v * scale) for v in (rows_, inner, cols))
                rows.append((2 * r * i * c, _matmul_rate(r, i, c, dev, dtypes[key], sync)))
            for rows_, inner, cols in ((512, 256, 1024), (1024, 512, 1024)):
                r, i, c = (int(v * scale) for v in (rows_, inner, cols))
                rows.append((2 * r * i * c, _matmul_rate(r, i, c, dev, dtypes[key], sync)))
            big_flops = 2 * n**3
            rows.append((big_flops, rates["matmul"][key]))
            rows.sort()
            curves[key] = rows
        if cuda:
            with _tf32(True):
                a = torch.randn(n, n, device=dev)
                t = _best(partial(_repeat, partial(torch.matmul, a, a), 8), sync) / 8
                rates["matmul"]["tf32"] = 2 * n**3 / t
        op_curves: dict[str, list[tuple[int, float]]] = {}
        with torch.enable_grad():
            _trained_rates(rates, op_curves, dev, dtypes, sync, scale, cuda)
        curve: list[tuple[int, float, float]] = []
        for n in (2**16, 2**18, 2**20, 2**22, 2**24):
            # inputs cycled, so that each call reads what a step's operator reads: what an
            # earlier operator wrote a while ago, not its own last input, still in cache
            xs = [torch.ones(int(n * scale), device=dev) for _ in range(3)]
            moved = 2 * xs[0].nbytes

            def new_output(xs: list[torch.Tensor] = xs) -> None:
                for x in xs:
                    torch.mul(x, 2.0)

            def in_place(xs: list[torch.Tensor] = xs) -> None:
                for x in xs:
                    x.mul_(1.0)

            new = 3 * moved / _median(new_output, sync, repeat=5)
            inplace = 3 * moved / _median(in_place, sync, repeat=5)
            curve.append((moved, new, inplace))
            del xs
        bandwidth = curve[-1][1]
        small = torch.ones(8, device=dev)
        ops = 2000
        view_overhead = _best(lambda: [small.view(2, 4) for _ in range(ops)], sync) / ops
        listed = [torch.ones(1, device=dev) for _ in range(256)]
        one = _median(lambda: torch._foreach_add_(listed[:1], 1.0), sync)
        many = _median(lambda: torch._foreach_add_(listed, 1.0), sync)
        tensor_overhead = max(0.0, many - one) / (len(listed) - 1)
        per_element = {} if cuda else _per_element(dev, sync, scale)
    # An operator's overhead in a real step (Python, modules, autograd's bookkeeping, the
    # optimizer's loop), not a bare call's: a training step of many tiny layers, timed,
    # over the operators it runs.
    seconds, ops = _step_overhead(dev, sync)
    op_overhead = seconds / max(1, ops)
    dispatch_overhead = _dispatch_overhead(dev, sync)
    host = 0.0
    if cuda:
        pinned = torch.empty(int(2**26 * scale), dtype=torch.uint8, pin_memory=True)
        gpu = torch.empty_like(pinned, device=dev)
        host = pinned.nbytes / _best(lambda: gpu.copy_(pinned, non_blocking=True), sync)
    name = torch.cuda.get_device_name(dev) if cuda else "cpu"
    tp = Throughput(
        device=name,
        rates=rates,
        bandwidth=bandwidth,
        op_overhead=op_overhead,
        view_overhead=view_overhead,
        asynchronous=cuda,
        host_bandwidth=host,
        bandwidth_curve=curve if not cuda else [],
        matmul_curve=curves,
        op_curves=op_curves,
        per_element=per_element,
        tensor_overhead=tensor_overhead,
        dispatch_overhead=dispatch_overhead,
        source=f"measured on {_host_description() if not cuda else name}",
        measured=True,
    )
    return _step_factors(tp, dev, sync)


def _self_attention(q: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(q, q, q)


def _forward_backward(
    rates: dict[str, dict[str, float]],
    curves: dict[str, list[tuple[int, float]]],
    group: str,
    key: str,
    fn: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    flops: int,
    sync: Callable[[], None],
) -> None:
    """One size's forward and backward rates of ``group`` in dtype ``key``: the last
    size measured is the group's rate, each a point of its curve."""
    x.requires_grad_(True)
    with torch.no_grad():
        forward = flops / _median(partial(fn, x), sync, repeat=5)
    out = fn(x)
    grad = torch.randn_like(out)
    params = [p for p in getattr(fn, "parameters", list)() if p.requires_grad]
    backward = partial(torch.autograd.grad, out, [x, *params], grad, retain_graph=True)
    # the backward of both operands: twice the forward's FLOPs (attention's 2.5 times)
    done = (2.5 if group == "attention" else 2) * flops / _median(backward, sync, repeat=5)
    for name, rate in ((group, forward), (f"{group}_backward", done)):
        rates[name][key] = rate
        curves.setdefault(f"{name}:{key}", []).append((flops, rate))
        curves[f"{name}:{key}"].sort()


def _trained_rates(
    rates: dict[str, dict[str, float]],
    curves: dict[str, list[tuple[int, float]]],
    dev: torch.device,
    dtypes: dict[str, torch.dtype],
    sync: Callable[[], None],
    scale: float,
    cuda: bool,
) -> None:
    """FLOP/s of a convolution's forward and backward, and (on the CPU) of a recurrent
    layer's, each as a training step runs them (the backward is often several times
    slower per FLOP than the forward); kept under the operators' ATen names."""
    for group in ("convolution", "attention"):
        rates[f"{group}_backward"] = {}
    if not cuda:
        rates["mkldnn_rnn_layer"] = {}
        rates["mkldnn_rnn_layer_backward"] = {}
    for key in ("fp32", "bf16"):
        dtype = dtypes[key]
        # small to large: a bottleneck's 1x1, a small CNN's first layers, a ResNet's
        # middle ones (a small convolution's time is mostly the call's fixed cost)
        for channels, side, k in ((32, 16, 1), (16, 32, 3), (32, 32, 3), (64, 56, 3)):
            conv = nn.Conv2d(channels, channels, k, padding=k // 2, bias=False).to(dev, dtype)
            x = torch.randn(int(8 * scale), channels, side, side, device=dev, dtype=dtype)
            flops = 2 * x.shape[0] * channels * channels * k * k * side * side
            _forward_backward(rates, curves, "convolution", key, conv, x, flops, sync)
        # a vision transformer's short sequences, a language model's longer ones
        for heads, length, dim in (
            (4, 64, 48),
            (8, 64, 48),
            (8, 128, 64),
            (8, 256, 64),
            (8, 512, 64),
        ):
            q = torch.randn(int(4 * scale), heads, length, dim, device=dev, dtype=dtype)
            flops = 4 * q.shape[0] * heads * length * length * dim
            _forward_backward(rates, curves, "attention", key, _self_attention, q, flops, sync)
        if cuda:
            continue
        rnn = nn.LSTM(256, 256, batch_first=True).to(dev)
        weights = sum(p.numel() for p in rnn.parameters() if p.dim() == 2)
        # one sequence to sixteen: a recurrent layer's steps are small multiplies, whose
        # rate falls with the batch (in bf16 most of all)
        for batch in (1, 4, 16):
            seq = torch.randn(int(batch * scale), 128, 256, device=dev, requires_grad=True)
            flops = 2 * seq.shape[0] * seq.shape[1] * weights
            with torch.autocast(dev.type, dtype, enabled=dtype != torch.float32):
                with torch.no_grad():
                    forward = flops / _median(partial(rnn, seq), sync, repeat=5)
                out = rnn(seq)[0]
            grad = torch.randn_like(out)
            params = [seq, *rnn.parameters()]
            backward = partial(torch.autograd.grad, out, params, grad, retain_graph=True)
            done = 2 * flops / _median(backward, sync, repeat=5)
            for name, rate in (("mkldnn_rnn_layer", forward), ("mkldnn_rnn_layer_backward", done)):
                rates[name][key] = rate
                curves.setdefault(f"{name}:{key}", []).append((flops, rate))


def _median(fn: Callable[[], Any], sync: Callable[[], None], *, repeat: int = 7) -> float:
    """The median time of ``fn`` (what a step's operator sees, where the best of a few
    runs is what an idle machine's warm caches allow)."""
    fn()
    sync()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _matmul_rate(
    rows: int,
    inner: int,
    cols: int,
    dev: torch.device,
    dtype: torch.dtype,
    sync: Callable[[], None],
) -> float:
    """FLOP/s of ``rows x inner`` by ``inner x cols`` multiplies as a training step runs
    them: the three layouts of a linear layer's forward and backward, on operands cycled
    so that no multiply finds the last one's in cache; the median of several rounds."""
    pairs = []
    for _ in range(3):
        x = torch.randn(rows, inner, device=dev, dtype=dtype)
        w = torch.randn(cols, inner, device=dev, dtype=dtype)
        g = torch.randn(rows, cols, device=dev, dtype=dtype)
        pairs.append((x, w, g))
    flops = 2 * rows * inner * cols
    reps = max(1, min(16, int(2e8 / flops)))

    def run() -> None:
        for _ in range(reps):
            for x, w, g in pairs:
                torch.matmul(x, w.t())  # forward
                torch.matmul(g, w)  # the input's gradient
                torch.matmul(g.t(), x)  # the weight's gradient

    return 3 * len(pairs) * reps * flops / _median(run, sync, repeat=5)


#: Element-wise operators whose arithmetic can bound them on a CPU, each on a tensor of
#: one element per float: the random numbers of dropout and initialisation, the
#: transcendental functions of activations, normalisations and optimizers.
_PER_ELEMENT: dict[str, Callable[[torch.Tensor], Any]] = {
    "bernoulli_": lambda x: x.bernoulli_(0.9),
    "normal_": lambda x: x.normal_(),
    "uniform_": lambda x: x.uniform_(),
    "tanh": torch.tanh,
    "tanh_backward": lambda x: torch.ops.aten.tanh_backward(x, x),
    "exp": torch.exp,
    "log": torch.log,
    "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt,
    "pow": lambda x: torch.pow(x, 3.0),
    "div": lambda x: torch.div(x, x),
    "sigmoid": torch.sigmoid,
    "erf": torch.erf,
    "gelu": torch.nn.functional.gelu,
    "gelu_backward": lambda x: torch.ops.aten.gelu_backward(x, x),
    "silu": torch.nn.functional.silu,
    "silu_backward": lambda x: torch.ops.aten.silu_backward(x, x),
    "_softmax": lambda x: torch.ops.aten._softmax(x.view(-1, 256), -1, False),
    "_softmax_backward_data": lambda x: torch.ops.aten._softmax_backward_data(
        x.view(-1, 256), x.view(-1, 256), -1, x.dtype
    ),
    "_log_softmax": lambda x: torch.ops.aten._log_softmax(x.view(-1, 256), -1, False),
    "_log_softmax_backward_data": lambda x: torch.ops.aten._log_softmax_backward_data(
        x.view(-1, 256), x.view(-1, 256), -1, x.dtype
    ),
    "native_layer_norm": lambda x: torch.ops.aten.native_layer_norm(
        x.view(-1, 256), [256], None, None, 1e-5
    ),
    "addcdiv_": lambda x: x.addcdiv_(x, x),
    "addcmul_": lambda x: x.addcmul_(x, x),
    "lerp_": lambda x: x.lerp_(x, 0.1),
    # autocast's casts (fp32 to bf16, and back on bf16 inputs), and the binary operators
    # of activations and their gradients
    "_to_copy": lambda x: x.to(torch.bfloat16 if x.dtype == torch.float32 else torch.float32),
    "mul": lambda x: torch.mul(x, x),
    "add": lambda x: torch.add(x, x),
    # the loss's gradient: a zeroed buffer of the logits' size, one element set per row
    "nll_loss_backward": lambda x: torch.ops.aten.nll_loss_backward(
        x.new_ones(()),
        x.view(-1, 256),
        torch.zeros(x.numel() // 256, dtype=torch.long, device=x.device),
        None,
        1,
        -100,
        x.new_tensor(float(x.numel() // 256)),
    ),
}
#: Those of :data:`_PER_ELEMENT` that a step runs on fp32 state whatever its precision
#: (the optimizer's): not measured on bf16.
_FP32_ONLY = {"addcdiv_", "addcmul_", "lerp_"}


def _per_element(dev: torch.device, sync: Callable[[], None], scale: float) -> dict[str, float]:
    """Seconds per element of each of :data:`_PER_ELEMENT`, at a million elements, on fp32
    (keyed by name) and on bf16 (``"name@bf16"``, but :data:`_FP32_ONLY`)."""
    n = int(2**20 * scale) // 256 * 256
    x = torch.rand(n, device=dev) + 0.5
    found = {}
    for dtype, suffix in ((torch.float32, ""), (torch.bfloat16, "@bf16")):
        for name, fn in _PER_ELEMENT.items():
            if suffix and name in _FP32_ONLY:
                continue
            y = x.to(dtype)
            found[name + suffix] = _median(partial(fn, y), sync, repeat=5) / n
    return found


def _dispatch_overhead(dev: torch.device, sync: Callable[[], None]) -> float:
    """Seconds per operator that passes through selective checkpointing's Python dispatch
    modes: a checkpointed stack of tiny layers trained with and without them, over the
    operators that pass (the forward's and the recomputation's)."""
    from torch.utils.checkpoint import (
        CheckpointPolicy,
        checkpoint,
        create_selective_checkpoint_contexts,
    )

    layers: list[nn.Module] = []
    for _ in range(24):
        layers += [nn.Linear(16, 16), nn.GELU()]
    model = nn.Sequential(*layers).to(dev)
    x = torch.randn(4, 16, device=dev, requires_grad=True)

    def recompute(*_: Any, **__: Any) -> CheckpointPolicy:
        return CheckpointPolicy.PREFER_RECOMPUTE

    def step(selective: bool) -> None:
        context = partial(create_selective_checkpoint_contexts, recompute)
        if selective:
            out = checkpoint(model, x, use_reentrant=False, context_fn=context)
        else:
            out = checkpoint(model, x, use_reentrant=False)
        out.sum().backward()

    counter = _Count()
    with counter:
        model(x)
    plain = _median(partial(step, False), sync)
    through = _median(partial(step, True), sync)
    return max(0.0, through - plain) / max(1, 2 * counter.ops)


class _LanguageModel(nn.Module):
    """A small causal language model as a training script writes one: token embeddings,
    two transformer layers under a causal mask, a head over an 8,000-token vocabulary and
    the cross-entropy of the next token (its large softmax, its gradient's zeroed buffer)."""

    def __init__(self, vocab: int = 8000, width: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, 4, 4 * width, batch_first=True, dropout=0.1)
        self.body = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], device=ids.device)
        hidden = self.body(self.embed(ids), mask=mask, is_causal=True)
        logits = self.head(hidden[:, :-1]).float()
        return nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


def _reference_models() -> list[tuple[nn.Module, torch.Tensor, str]]:
    """Training steps the time model is fitted to: a small transformer with dropout and a
    small language model, each in fp32 and under bf16 autocast, a small CNN, and two whose
    time is almost all per-operator overhead (a stack of tiny layers, a narrow transformer
    under autocast)."""
    layer = nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True, dropout=0.1)
    text = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    cnn = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(64, 64, 3, padding=1),
        nn.Flatten(),
        nn.Linear(64 * 32 * 32, 10),
    )
    tiny: list[nn.Module] = []
    for _ in range(24):
        tiny += [nn.Linear(16, 16), nn.GELU(), nn.LayerNorm(16)]
    # a transformer too narrow for its kernels to matter: a model's own Python per
    # operator (attention's reshapes, masks, dropout), under autocast
    narrow = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.1),
        4,
        enable_nested_tensor=False,
    )
    x = torch.randn(8, 128, 256)
    ids = torch.randint(0, 8000, (4, 128))
    return [
        (text, x, "fp32"),
        (text, x, "amp-bf16"),
        (_LanguageModel(), ids, "fp32"),
        (_LanguageModel(), ids, "amp-bf16"),
        (cnn, torch.randn(8, 3, 64, 64), "fp32"),
        (nn.Sequential(*tiny), torch.randn(4, 16), "fp32"),
        (narrow, torch.randn(2, 8, 16), "amp-bf16"),
    ]


#: How many times each reference step is timed, in turn, for the fit.
_FIT_ROUNDS = 3


def _step_factors(tp: Throughput, dev: torch.device, sync: Callable[[], None]) -> Throughput:
    """``tp`` with the factors its reference steps' kernel and overhead times are multiplied
    by to best match their measured times (least squares on the relative error): the plain
    ones from the fp32 steps, ``autocast_factors`` from those under autocast (``(1, 1)``
    where one cannot run); and as its error the largest relative error left, at least
    :data:`MEASURED_ERROR`. The steps are predicted with ``tp`` itself, the throughput
    being measured (a field of their request: nothing of this process's state tells the
    estimate)."""
    from vramctl.estimator._request import Step
    from vramctl.estimator._session import open_session

    target = Target(tp.device, 2**40, None, cuda=False)
    models = _reference_models()
    predicted = []
    for model, x, precision in models:
        step = Step(
            device=target, calibration=False, throughput=tp, tf32=False, precision=precision
        )
        session = open_session(model, step, RATES)
        try:
            est = session.estimate(x, None, None, None)
        finally:
            session.close()
        if est.step_seconds is None:
            return replace(tp, error=DATA_SHEET_ERROR)
        overhead = est.time_breakdown.get("overhead", 0.0)
        predicted.append((est.step_seconds - overhead, overhead))
    # Each step timed in turn, :data:`_FIT_ROUNDS` times over, and its median kept: a
    # spell of a shared machine's slowness falls on every step alike, not on one.
    times: list[list[float]] = [[] for _ in models]
    for _ in range(_FIT_ROUNDS):
        for (model, x, precision), found in zip(models, times, strict=True):
            found.append(_measure_step(model, x, dev, sync, precision))
    rows: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for (_, _, precision), (kernel, overhead), found in zip(models, predicted, times, strict=True):
        measured = statistics.median(found)
        if measured <= 0:
            return replace(tp, error=DATA_SHEET_ERROR)
        rows[precision != "fp32"].append((kernel / measured, overhead / measured))
    plain = _fit_factors(rows[False])
    under = _fit_factors(rows[True]) if rows[True] else plain
    left = max(
        abs(a * k + b * o - 1)
        for (a, b), group in ((plain, rows[False]), (under, rows[True]))
        for k, o in group
    )
    return replace(
        tp,
        step_factor=plain[0],
        overhead_factor=plain[1],
        autocast_factors=under,
        error=max(MEASURED_ERROR, left),
    )


def _fit_factors(rows: list[tuple[float, float]]) -> tuple[float, float]:
    """``(a, b)`` minimising the squared relative errors ``a * kernel + b * overhead - 1``
    over ``rows`` of (predicted kernel, predicted overhead) over measured, each kept within
    0.5-4; one common factor where the rows cannot tell the two apart."""
    kk = sum(k * k for k, _ in rows)
    ko = sum(k * o for k, o in rows)
    oo = sum(o * o for _, o in rows)
    det = kk * oo - ko * ko
    if det <= 1e-12:
        total = sum(k + o for k, o in rows)
        a = b = len(rows) / total if total > 0 else 1.0
        return a, b
    a = (oo * sum(k for k, _ in rows) - ko * sum(o for _, o in rows)) / det
    b = (kk * sum(o for _, o in rows) - ko * sum(k for k, _ in rows)) / det
    return min(4.0, max(0.5, a)), min(4.0, max(0.5, b))


def _measure_step(
    model: nn.Module,
    x: torch.Tensor,
    dev: torch.device,
    sync: Callable[[], None],
    precision: str = "fp32",
) -> float:
    model, x = model.to(dev), x.to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    amp = precision == "amp-bf16"

    def step() -> None:
        with torch.autocast(dev.type, torch.bfloat16, enabled=amp):
            out = model(x)
        out.float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _median(step, sync, repeat=5)


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _step_overhead(dev: torch.device, sync: Callable[[], None]) -> tuple[float, int]:
    """A training step of many tiny layers: (its seconds, the operators it runs)."""
    layers: list[nn.Module] = []
    for _ in range(24):
        layers += [nn.Linear(16, 16), nn.GELU(), nn.LayerNorm(16)]
    model = nn.Sequential(*layers).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(4, 16, device=dev)

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    counter = _Count()
    with counter:
        step()
    return _median(step, sync), counter.ops


@contextlib.contextmanager
def _tf32(on: bool) -> Any:
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = on
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


# -- the CPU: measured once per machine, kept --------------------------------------------


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _host_description() -> str:
    return f"{_cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def cpu_profile_path(config_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where this machine's CPU throughput profile is kept (one per CPU model, thread count
    and torch version)."""
    key = hashlib.sha1(_host_description().encode()).hexdigest()[:12]
    return calibration_dir(config_dir).parent / "throughput" / f"cpu-{key}.json"


_CPU: dict[str, Throughput] = {}


def cpu_throughput(*, remeasure: bool = False, save: bool = True) -> Throughput:
    """This machine's CPU throughput: the kept profile, else measured now (and kept)."""
    path = cpu_profile_path()
    host = _host_description()
    if not remeasure:
        with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
            data = json.loads(path.read_text())
            if data.get("schema") != SCHEMA:  # measured by an older version: again
                raise ValueError(data.get("schema"))
            tp = Throughput.from_dict(data)
            _CPU[host] = tp
            return tp
        cached = _CPU.get(host)
        if cached is not None:
            return cached
    tp = measure_throughput("cpu")
    _CPU[host] = tp
    if save:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(tp.to_dict(), indent=2) + "\n")
            tmp.replace(path)
        except OSError as exc:
            log.info("could not keep the CPU throughput profile at %s: %s", path, exc)
    return tp


#: The rates estimates are timed with: the target's (measured here for the CPU and the
#: simulated GPUs, a GPU's profile or data sheet) and this host's CPU.
RATES = Rates(target=target_throughput, host=lambda: cpu_throughput())
