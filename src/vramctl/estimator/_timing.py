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

import itertools
import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from vramctl.device import GpuSpec
from vramctl.estimator._opcost import GROUPS, OpCost
from vramctl.estimator._target import Target

__all__ = [
    "GPU_EFFICIENCY",
    "Rates",
    "StepTime",
    "Throughput",
    "gpu_throughput",
    "predict",
    "tf32_matmul",
]

log = logging.getLogger(__name__)

SCHEMA = "vramctl.throughput/4"
#: The share of a GPU's data-sheet peak a typical training step's kernels reach, per
#: group, where no measured profile exists; ``vramctl calibrate`` replaces them.
GPU_EFFICIENCY = {"matmul": 0.70, "convolution": 0.50, "attention": 0.45, "memory": 0.75}
#: Host-side cost of one eager operator on a GPU (Python, dispatch, autograd, launch).
GPU_OP_OVERHEAD = 12e-6
#: The least relative error a measured profile claims: what the planner's benchmark
#: measures across plans on the CPU (docs/benchmarks/plan_quality.md), where the
#: reference steps alone would claim less.
MEASURED_ERROR = 0.15
#: The relative error of a data sheet's rates: never checked against a run on the GPU.
DATA_SHEET_ERROR = 0.5
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

    #: What kernel times are multiplied by, fitted with ``overhead_factor`` to reference
    #: training steps measured on this device (see ``_reference_models`` in ``_rates``):
    #: what the micro-benchmarks leave out (frequency under sustained load, caches shared
    #: with the rest of the step).
    step_factor: float = 1.0
    #: The same for the per-operator overheads (Python, modules, autograd, the
    #: allocator): fitted with ``step_factor`` to the reference steps' measured times.
    overhead_factor: float = 1.0
    #: ``(step_factor, overhead_factor)`` fitted to the reference steps run under autocast
    #: alone, for a step under autocast (its per-operator casts and dispatch, and its
    #: lower-precision kernels, are not fp32's); ``None``: the plain factors.
    autocast_factors: tuple[float, float] | None = None
    #: The relative error of a step's predicted time on this device: for a measured
    #: profile, the largest error left on its reference steps after the fit, and never
    #: under :data:`MEASURED_ERROR`; for a data sheet, :data:`DATA_SHEET_ERROR`.
    error: float = 0.5
    #: Measured matrix-multiply rates by size where they vary with it: per dtype,
    #: ``(FLOPs of one multiply, FLOP/s)`` rows, smallest first.
    matmul_curve: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    #: Measured rates by size of other operators whose rate varies with it: per
    #: ``"name:dtype"`` (a group, ``"convolution:fp32"``, or a backward,
    #: ``"attention_backward:bf16"``), ``(FLOPs of one call, FLOP/s)`` rows, smallest first.
    op_curves: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    #: Seconds per element of the element-wise operators whose arithmetic, not their
    #: memory, bounds them on this device (random numbers, transcendental functions,
    #: softmax), by ATen name; an operator takes the longer of this and its bytes' time.
    #: ``"name@bf16"`` is the same operator on bf16 inputs (a CPU converts each element
    #: through fp32, so its cost is not fp32's); other dtypes take the name's fp32 cost.
    per_element: dict[str, float] = field(default_factory=dict)
    #: Seconds per tensor of an operator over a list of tensors (``_foreach_add_``, a
    #: fused optimizer's step), beyond its fixed ``op_overhead``.
    tensor_overhead: float = 0.0
    #: Seconds an operator costs for passing through a Python dispatch mode (selective
    #: checkpointing runs every operator of its blocks through one).
    dispatch_overhead: float = 0.0

    def matmul_rate(self, dtype: str, flops: int) -> float:
        """FLOP/s of a matrix multiply of ``flops`` (small ones run below the peak)."""
        rows = self.matmul_curve.get(dtype)
        if not rows:
            return self.rate("matmul", dtype)
        return _along(rows, flops)

    def op_rate(self, group: str, op: str, dtype: str, flops: int) -> float:
        """FLOP/s of one compute-bound operator: by its measured curve where one exists
        (its own name's, else its group's backward or forward), else its group's rate."""
        if group == "matmul" and op not in self.rates:
            return self.matmul_rate(dtype, flops)
        for key in (op, f"{group}_backward" if op.endswith("_backward") else group):
            rows = self.op_curves.get(f"{key}:{dtype}")
            if rows:
                # below the smallest measured, the call's fixed cost: the same time
                return (
                    _along(rows, flops) if flops >= rows[0][0] else rows[0][1] * flops / rows[0][0]
                )
            if dtype in self.rates.get(key, {}):
                return self.rates[key][dtype]
        return self.rate(group, dtype)

    def element_cost(self, op: str, dtype: str) -> float:
        """Seconds per element of ``op`` on ``dtype`` inputs (0 where not measured)."""
        if dtype != "fp32":
            found = self.per_element.get(f"{op}@{dtype}")
            if found is not None:
                return found
        return self.per_element.get(op, 0.0)

    def memory_bandwidth(self, nbytes: int, inplace: bool) -> float:
        """Bytes per second of a memory-bound kernel moving ``nbytes``."""
        curve = self.bandwidth_curve
        if not curve:
            return self.bandwidth
        col = 2 if inplace else 1
        return _along([(row[0], row[col]) for row in curve], nbytes)

    def rate(self, group: str, dtype: str) -> float:
        table = self.rates.get(group) or self.rates["matmul"]
        if dtype in table:
            return table[dtype]
        return table.get("fp32", min(table.values()))

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Throughput:
        """A kept throughput (an older schema's fields take their defaults)."""
        known = set(cls.__dataclass_fields__)
        fields = {k: v for k, v in data.items() if k in known}
        fields["bandwidth_curve"] = [tuple(r) for r in fields.get("bandwidth_curve", [])]
        for name in ("matmul_curve", "op_curves"):
            fields[name] = {k: [tuple(r) for r in rows] for k, rows in fields.get(name, {}).items()}
        if fields.get("autocast_factors") is not None:
            fields["autocast_factors"] = tuple(fields["autocast_factors"])
        return cls(**fields)


def _along(rows: list[tuple[int, float]], flops: int) -> float:
    """A rate from ``(size, rate)`` rows (FLOPs or bytes), interpolated in log size."""
    if flops <= rows[0][0]:
        return rows[0][1]
    for lo, hi in itertools.pairwise(rows):
        if flops <= hi[0]:
            w = (math.log(flops) - math.log(lo[0])) / (math.log(hi[0]) - math.log(lo[0]))
            return float(lo[1] + w * (hi[1] - lo[1]))
    return rows[-1][1]


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
    costs: Iterable[OpCost],
    tp: Throughput,
    *,
    tf32: bool = False,
    host: Throughput | None = None,
    autocast: bool = False,
) -> StepTime:
    """The step's time on ``tp``'s device from its operators' costs.

    ``tf32``: fp32 matrix multiplies run on TF32 tensor cores (``allow_tf32``). Operators
    of the ``"host"`` phase (an offloaded optimizer's step) run at ``host``'s rates (the
    CPU's; default ``tp``'s). ``autocast``: the step runs under autocast, whose fitted
    factors (``Throughput.autocast_factors``) its device's operators take.
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
        kernel_factor, overhead_factor = tp.step_factor, tp.overhead_factor
        if autocast and tp is device and tp.autocast_factors is not None:
            kernel_factor, overhead_factor = tp.autocast_factors
        kernel = 0.0
        overhead = tp.view_overhead
        if op.kernel:
            overhead = tp.op_overhead
            dtype = "tf32" if tf32 and op.dtype == "fp32" and op.group == "matmul" else op.dtype
            rate = tp.op_rate(op.group, op.op, dtype, op.flops)
            compute = op.flops / rate if op.flops else 0.0
            if op.group == "transfer" and tp.host_bandwidth:
                memory = op.bytes / tp.host_bandwidth
            elif op.group == "transfer":  # the host itself: a copy reads and writes
                memory = 2 * op.bytes / tp.memory_bandwidth(2 * op.bytes, False)
            else:
                memory = op.bytes / tp.memory_bandwidth(op.bytes, op.inplace)
            arithmetic = op.elements * tp.element_cost(op.op, op.dtype)
            compute = max(compute, arithmetic)
            kernel = max(compute, memory) * kernel_factor
            if compute > memory:
                compute_bound += compute
            by_group[op.group] += kernel
            flops += op.flops
            moved += op.bytes
        overhead += op.tensors * tp.tensor_overhead
        overhead *= overhead_factor
        if op.dispatch:
            overhead += tp.dispatch_overhead
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


@dataclass(frozen=True)
class Rates:
    """Where a step's time comes from: the throughput of its target (None where it is not
    known: a GPU known only by its size) and of the host (an offloaded optimizer's step)."""

    target: Callable[[Target], Throughput | None]
    host: Callable[[], Throughput]


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
        error=DATA_SHEET_ERROR,
    )
