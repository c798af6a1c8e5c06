"""Predicting a step's time from its trace: a roofline per operator.

Each traced operator takes ``max(flops / rate, bytes / bandwidth)``, where ``rate`` is
what the device sustains for the operator's group (matrix multiplies, convolutions,
attention) and dtype, and ``bandwidth`` what it sustains for memory-bound kernels; each
kernel also costs a fixed overhead (PyTorch's dispatch, and on a GPU the launch). On the
CPU the overhead adds to the kernel's time; on a GPU the host runs ahead, so an
operator takes the longer of the two.

The rates are a :class:`Throughput`:

- for the CPU, measured here by :func:`measure_throughput` (a second or two of matrix
  multiplies, a convolution, attention, a large copy and many tiny operators) and kept
  as a profile beside the calibration profiles, so it is measured once per machine;
- for a GPU, ``vramctl calibrate`` measures the same on the GPU; without a profile, the
  catalog's data-sheet peaks times an efficiency per group (:data:`GPU_EFFICIENCY`).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import logging
import math
import os
import platform
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from vramctl._errors import UnknownDeviceError
from vramctl.device import GpuSpec, gpu_spec
from vramctl.estimator._calibration import calibration_dir, measured_on
from vramctl.estimator._opcost import GROUPS, OpCost
from vramctl.estimator._target import Target

__all__ = [
    "GPU_EFFICIENCY",
    "StepTime",
    "Throughput",
    "cpu_profile_path",
    "cpu_throughput",
    "gpu_throughput",
    "measure_throughput",
    "predict",
    "target_throughput",
    "tf32_matmul",
]

log = logging.getLogger(__name__)

SCHEMA = "vramctl.throughput/2"
#: The share of a GPU's data-sheet peak a typical training step's kernels reach, per
#: group, where no measured profile exists; ``vramctl calibrate`` replaces them.
GPU_EFFICIENCY = {"matmul": 0.70, "convolution": 0.50, "attention": 0.45, "memory": 0.75}
#: Host-side cost of one eager operator on a GPU (Python, dispatch, autograd, launch).
GPU_OP_OVERHEAD = 12e-6
#: Efficiency of host-device copies over the link's data-sheet rate.
HOST_LINK_EFFICIENCY = 0.8


@dataclass(frozen=True)
class Throughput:
    """What a device sustains, per operator group and dtype."""

    #: The device it describes ("cpu", a catalog GPU name).
    device: str
    #: FLOP/s by group ("matmul", "convolution", "attention") and dtype ("fp32", "bf16" ...).
    rates: dict[str, dict[str, float]]
    #: Bytes per second a memory-bound kernel moves.
    bandwidth: float
    #: Seconds per operator that launches a kernel, beyond its roofline time.
    op_overhead: float
    #: Seconds per view or metadata operator.
    view_overhead: float
    #: Whether the host queues kernels ahead of the device (a GPU): an operator then takes
    #: the longer of its kernel and its overhead, not their sum.
    asynchronous: bool = False
    #: Bytes per second between host and device memory (0: the device is the host).
    host_bandwidth: float = 0.0
    #: Where the figures come from ("measured ...", "data sheet ...").
    source: str = ""
    measured: bool = False
    #: Measured bandwidth by operator size where it varies with it (a CPU's caches, and
    #: the page faults of a new large output): ``(bytes moved, new output B/s, in-place
    #: B/s)`` rows, smallest first; empty: ``bandwidth`` at every size.
    bandwidth_curve: list[tuple[int, float, float]] = field(default_factory=list)

    #: Measured over predicted time of a reference training step (a small transformer
    #: and a small CNN) on this device: what the micro-benchmarks' best cases leave out
    #: (frequency under sustained load, caches shared with the rest of the step). Kernel
    #: times are multiplied by it.
    step_factor: float = 1.0
    #: Measured matrix-multiply rates by size where they vary with it: per dtype,
    #: ``(FLOPs of one multiply, FLOP/s)`` rows, smallest first.
    matmul_curve: dict[str, list[tuple[int, float]]] = field(default_factory=dict)

    def matmul_rate(self, dtype: str, flops: int) -> float:
        """FLOP/s of a matrix multiply of ``flops`` (small ones run below the peak)."""
        rows = self.matmul_curve.get(dtype)
        if not rows:
            return self.rate("matmul", dtype)
        if flops <= rows[0][0]:
            return rows[0][1]
        for lo, hi in itertools.pairwise(rows):
            if flops <= hi[0]:
                w = (math.log(flops) - math.log(lo[0])) / (math.log(hi[0]) - math.log(lo[0]))
                return float(lo[1] + w * (hi[1] - lo[1]))
        return rows[-1][1]

    def memory_bandwidth(self, nbytes: int, inplace: bool) -> float:
        """Bytes per second of a memory-bound kernel moving ``nbytes``."""
        curve = self.bandwidth_curve
        if not curve:
            return self.bandwidth
        col = 2 if inplace else 1
        if nbytes <= curve[0][0]:
            return curve[0][col]
        for lo, hi in itertools.pairwise(curve):
            if nbytes <= hi[0]:
                w = (math.log(nbytes) - math.log(lo[0])) / (math.log(hi[0]) - math.log(lo[0]))
                return float(lo[col] + w * (hi[col] - lo[col]))
        return curve[-1][col]

    def rate(self, group: str, dtype: str) -> float:
        table = self.rates.get(group) or self.rates["matmul"]
        if dtype in table:
            return table[dtype]
        return table.get("fp32", min(table.values()))

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Throughput:
        fields = {k: v for k, v in data.items() if k != "schema"}
        fields["bandwidth_curve"] = [tuple(r) for r in fields.get("bandwidth_curve", [])]
        fields["matmul_curve"] = {
            k: [tuple(r) for r in rows] for k, rows in fields.get("matmul_curve", {}).items()
        }
        return cls(**fields)


@dataclass(frozen=True)
class StepTime:
    """A step's predicted time and where it goes."""

    seconds: float
    flops: int
    bytes: int
    by_group: dict[str, float] = field(default_factory=dict)
    by_phase: dict[str, float] = field(default_factory=dict)
    #: Seconds of kernels bound by compute (the rest are bound by memory or overhead).
    compute_bound: float = 0.0


def predict(
    costs: Iterable[OpCost], tp: Throughput, *, tf32: bool = False, host: Throughput | None = None
) -> StepTime:
    """The step's time on ``tp``'s device from its operators' costs.

    ``tf32``: fp32 matrix multiplies run on TF32 tensor cores (``allow_tf32``). Operators
    of the ``"host"`` phase (an offloaded optimizer's step) run at ``host``'s rates (the
    CPU's; default ``tp``'s).
    """
    by_group = dict.fromkeys(GROUPS, 0.0)
    by_phase: dict[str, float] = {}
    flops = moved = 0
    compute_bound = 0.0
    device = tp
    for op in costs:
        if op.phase == "setup":
            continue
        tp = host if host is not None and op.phase == "host" else device
        kernel = 0.0
        overhead = tp.view_overhead
        if op.kernel:
            overhead = tp.op_overhead
            dtype = "tf32" if tf32 and op.dtype == "fp32" and op.group == "matmul" else op.dtype
            rate = (
                tp.matmul_rate(dtype, op.flops)
                if op.group == "matmul"
                else tp.rate(op.group, dtype)
            )
            compute = op.flops / rate if op.flops else 0.0
            link = tp.host_bandwidth or tp.bandwidth / 2  # the host: a copy reads and writes
            bandwidth = tp.memory_bandwidth(op.bytes, op.inplace)
            memory = op.bytes / (link if op.group == "transfer" else bandwidth)
            kernel = max(compute, memory) * tp.step_factor
            if compute > memory:
                compute_bound += compute
            by_group[op.group] += kernel
            flops += op.flops
            moved += op.bytes
        t = max(kernel, overhead) if tp.asynchronous else kernel + overhead
        by_group["overhead"] += t - kernel
        by_phase[op.phase] = by_phase.get(op.phase, 0.0) + t
    seconds = sum(by_group.values())
    return StepTime(
        seconds=seconds,
        flops=flops,
        bytes=moved,
        by_group={k: v for k, v in by_group.items() if v},
        by_phase=by_phase,
        compute_bound=compute_bound,
    )


def tf32_matmul() -> bool:
    """Whether fp32 matrix multiplies may run on TF32 tensor cores (PyTorch's setting)."""
    return bool(torch.backends.cuda.matmul.allow_tf32) or (
        torch.get_float32_matmul_precision() != "highest"
    )


def target_throughput(target: Target) -> Throughput | None:
    """The throughput a target's steps are timed with: the CPU's (measured here) for a
    target without CUDA (the CPU, a simulated GPU, whose kernels run on the CPU); a GPU's
    calibrated profile or data sheet; None for a GPU known only by its size."""
    if _measuring:
        return _measuring[-1]
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


# -- GPUs: data sheet, or a calibrated profile ------------------------------------------


def gpu_throughput(spec: GpuSpec, measured: dict[str, Any] | None = None) -> Throughput:
    """A catalog GPU's throughput: measured (a calibration profile's) or its data sheet's
    peaks times :data:`GPU_EFFICIENCY`."""
    if measured:
        return Throughput.from_dict(measured)
    peaks = {k: spec.peak_flops(k) for k in ("fp32", "tf32", "bf16", "fp16")}
    rates = {
        group: {k: v * GPU_EFFICIENCY[group] for k, v in peaks.items()}
        for group in ("matmul", "convolution", "attention")
    }
    # cuDNN runs fp32 convolutions on TF32 tensor cores by default (allow_tf32 is True there).
    rates["convolution"]["fp32"] = rates["convolution"]["tf32"]
    return Throughput(
        device=spec.name,
        rates=rates,
        bandwidth=spec.bandwidth_gbs * 1e9 * GPU_EFFICIENCY["memory"],
        op_overhead=GPU_OP_OVERHEAD,
        view_overhead=GPU_OP_OVERHEAD / 4,
        asynchronous=True,
        host_bandwidth=spec.host_gbs * 1e9 * HOST_LINK_EFFICIENCY,
        source=f"{spec.name} data sheet x efficiency (no measured profile)",
        measured=False,
    )


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
    """
    with torch.inference_mode(False), torch.enable_grad():
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
    """Measured over predicted time of the reference steps (1.0 where one cannot run)."""
    from vramctl.estimator._estimate import estimate
    from vramctl.estimator._target import Target

    target = Target(tp.device, 2**40, None, cuda=False)
    measured = predicted = 0.0
    _measuring.append(tp)
    try:
        for model, x in _reference_models():
            measured += _measure_step(model, x, dev, sync)
            est = estimate(model.cpu(), x.cpu(), device=target, calibration=False)
            if est.step_seconds is None:
                return 1.0
            predicted += est.step_seconds
    finally:
        _measuring.pop()
    return measured / predicted if predicted > 0 else 1.0


#: The throughput being measured: the reference steps are predicted with it.
_measuring: list[Throughput] = []


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
