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
from vramctl.estimator._timing import Rates, Throughput, gpu_throughput

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
            if side != m:
                a = torch.randn(side, side, device=dev, dtype=dtype)
                probe = _best(partial(torch.matmul, a, a), sync, repeat=1)
            reps = max(1, min(8, int(0.03 / max(probe, 1e-6))))
            t = _best(partial(_repeat, partial(torch.matmul, a, a), reps), sync) / reps
            rates["matmul"][key] = 2 * a.shape[0] ** 3 / t
        curves: dict[str, list[tuple[int, float]]] = {}
        for key in ("fp32", "bf16"):
            rows = []
            for side in (64, 128, 256, 512):
                a = torch.randn(int(side * scale), int(side * scale), device=dev, dtype=dtypes[key])
                flops = 2 * a.shape[0] ** 3
                reps = max(1, int(2e8 * scale**3 / flops))
                t = _best(partial(_repeat, partial(torch.matmul, a, a), reps), sync) / reps
                rows.append((flops, flops / t))
            big_flops = 2 * n**3
            rows.append((big_flops, rates["matmul"][key]))
            curves[key] = rows
        if cuda:
            with _tf32(True):
                a = torch.randn(n, n, device=dev)
                t = _best(partial(_repeat, partial(torch.matmul, a, a), 8), sync) / 8
                rates["matmul"]["tf32"] = 2 * n**3 / t
        for key in ("fp32", "bf16"):
            conv = nn.Conv2d(64, 64, 3, padding=1, bias=False).to(dev, dtypes[key])
            x = torch.randn(int(8 * scale), 64, 56, 56, device=dev, dtype=dtypes[key])
            t = _best(partial(conv, x), sync)
            rates["convolution"][key] = 2 * x.shape[0] * 64 * 64 * 9 * 56 * 56 / t
            q = torch.randn(int(4 * scale), 8, 512, 64, device=dev, dtype=dtypes[key])
            sdpa = torch.nn.functional.scaled_dot_product_attention
            t = _best(partial(sdpa, q, q, q), sync)
            rates["attention"][key] = 4 * q.shape[0] * 8 * 512 * 512 * 64 / t
        curve: list[tuple[int, float, float]] = []
        for n in (2**16, 2**18, 2**20, 2**22, 2**24):
            x = torch.ones(int(n * scale), device=dev)
            moved = 2 * x.nbytes
            new = moved / _best(partial(torch.mul, x, 2.0), sync)
            inplace = moved / _best(partial(x.mul_, 1.0), sync)
            curve.append((moved, new, inplace))
        bandwidth = curve[-1][1]
        small = torch.ones(8, device=dev)
        ops = 2000
        view_overhead = _best(lambda: [small.view(2, 4) for _ in range(ops)], sync) / ops
    # An operator's overhead in a real step (Python, modules, autograd's bookkeeping, the
    # optimizer's loop), not a bare call's: a training step of many tiny layers, timed,
    # over the operators it runs.
    op_overhead = _step_overhead(dev, sync)
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
        source=f"measured on {_host_description() if not cuda else name}",
        measured=True,
    )
    return replace(tp, step_factor=_step_factor(tp, dev, sync))


def _reference_models() -> list[tuple[nn.Module, torch.Tensor]]:
    layer = nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True, dropout=0.0)
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
    return [(text, torch.randn(8, 128, 256)), (cnn, torch.randn(8, 3, 64, 64))]


def _step_factor(tp: Throughput, dev: torch.device, sync: Callable[[], None]) -> float:
    """Measured over predicted time of the reference steps (1.0 where one cannot run). The
    steps are predicted with ``tp`` itself, the throughput being measured (a field of
    their request: nothing of this process's state tells the estimate)."""
    from vramctl.estimator._request import Step
    from vramctl.estimator._session import open_session

    target = Target(tp.device, 2**40, None, cuda=False)
    step = Step(device=target, calibration=False, throughput=tp, tf32=False)
    measured = predicted = 0.0
    for model, x in _reference_models():
        measured += _measure_step(model, x, dev, sync)
        session = open_session(model.cpu(), step, RATES)
        try:
            est = session.estimate(x.cpu(), None, None, None)
        finally:
            session.close()
        if est.step_seconds is None:
            return 1.0
        predicted += est.step_seconds
    return measured / predicted if predicted > 0 else 1.0


def _measure_step(
    model: nn.Module, x: torch.Tensor, dev: torch.device, sync: Callable[[], None]
) -> float:
    model, x = model.to(dev), x.to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _best(step, sync)


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _step_overhead(dev: torch.device, sync: Callable[[], None]) -> float:
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
    return _best(step, sync) / max(1, counter.ops)


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
            tp = Throughput.from_dict(json.loads(path.read_text()))
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
