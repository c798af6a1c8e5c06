"""What an estimate returns: :class:`Estimate`, its breakdown by category."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vramctl._units import format_bytes

__all__ = ["CATEGORIES", "Estimate", "no_bf16_note", "uncalibrated_note"]

CATEGORIES = (
    "parameters",
    "gradients",
    "optimizer",
    "inputs",
    "activations",
    "kv_cache",
    "temporaries",
    "unsharded",
    "buckets",
    "workspaces",
    "allocator",
    "context",
)


@dataclass(frozen=True)
class Estimate:
    """A step's predicted peak memory on a device, and where it goes.

    Three peaks, each what a different tool would show for the step's process:

    - ``peak_allocated``: PyTorch's allocator peak, what
      ``torch.cuda.max_memory_allocated`` would report (live tensor blocks);
    - ``peak_reserved``: what ``torch.cuda.max_memory_reserved`` would report (the
      caching allocator's segments, cached blocks included);
    - ``peak_device``: ``peak_reserved`` plus the CUDA context (driver state and loaded
      kernels, outside the allocator): what ``nvidia-smi`` shows for the process. It is
      the sum of ``breakdown``, whose ``context`` entry is what the reserved peak leaves
      out.

    ``peak_device`` is modelled with constants that differ by driver, CUDA version,
    module loading and ``cudnn.benchmark``: ``nvidia-smi`` may read up to
    ``device_uncertainty`` more, ``peak_device_high`` (large when ``calibrated`` is
    False: no ``vramctl calibrate`` profile for the GPU). ``fits`` and ``headroom``
    judge by ``peak_device_high`` unless the estimate was made with ``safe=False``.

    On a CPU target the three peaks equal ``logical_peak``, the bytes of live tensor
    storages, and there is no uncertainty.
    """

    model: str
    device: str
    capacity: int
    mode: str
    precision: str
    batch_size: int | None
    #: The tokens per sample the batch was made with (a built-in text model's default
    #: included); None when the model's inputs take no such length.
    seq_len: int | None
    #: The audio seconds per sample, as ``seq_len`` is for tokens.
    seconds: float | None
    #: Bytes of live tensor storages at the peak, before any CUDA modelling.
    logical_peak: int
    #: What ``torch.cuda.max_memory_allocated`` would report.
    peak_allocated: int
    #: What ``torch.cuda.max_memory_reserved`` would report (no CUDA context).
    peak_reserved: int
    #: ``peak_reserved`` plus the CUDA context: what ``nvidia-smi`` shows for the process
    #: (the point estimate, and the low end of its range).
    peak_device: int
    #: Bytes by category at the peak; they sum to ``peak_device``.
    breakdown: dict[str, int]
    peak_op: str
    peak_module: str
    peak_phase: str
    target_utilization: float
    #: Whether the step fits the budget, judged at ``peak_device_high`` (``safe``, the
    #: default) or at ``peak_device`` (made with ``safe=False``).
    fits: bool
    #: Assumptions where the trace could not know values (data-dependent operators).
    assumptions: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    alloc_retries: int = 0
    ops: int = 0
    elapsed: float = 0.0
    parameters: int = 0
    #: The optimizer the training step used (its name, or a callable's); None for
    #: inference or none.
    optimizer: str | None = None
    checkpointing: bool = False
    #: Whether CUDA's extras (context, workspaces, caching allocator) were modelled.
    cuda: bool = False
    #: The calibration profile whose constants were used, described (its GPU, date and
    #: software); None for the built-in constants or a CPU target.
    calibration: str | None = None
    #: False for a GPU estimate without a profile measured on this GPU model (built-in
    #: constants, or another GPU's profile): its ``peak_device`` is then the least certain
    #: figure. True for a profile of this GPU, and for a CPU target (nothing to calibrate).
    calibrated: bool = True
    #: Bytes ``nvidia-smi`` may read above ``peak_device`` (the CUDA context and cuDNN
    #: workspaces vary by driver, CUDA version, module loading and ``cudnn.benchmark``).
    device_uncertainty: int = 0
    #: Whether ``fits`` and ``headroom`` judge at ``peak_device_high`` (True) or at
    #: ``peak_device`` (False).
    safe: bool = True
    #: Whether the step fits at ``peak_device``, the point estimate.
    fits_point: bool = False
    #: Whether the step fits at ``peak_device_high``, the safe end.
    fits_safe: bool = False
    #: Floating-point operations of the step (forward, backward and optimizer; a
    #: multiply-add counts two), as ``torch.utils.flop_counter`` counts them.
    flops: int = 0
    #: Bytes the step's operators read and write in device memory (a roofline's traffic).
    bytes_moved: int = 0
    #: The predicted time of one step on the target, in seconds (None: not predicted).
    step_seconds: float | None = None
    #: Predicted seconds by operator group (matmul, convolution, attention, memory,
    #: optimizer, overhead); they sum to ``step_seconds``.
    time_breakdown: dict[str, float] = field(default_factory=dict)
    #: Predicted seconds by phase (forward, backward, optimizer); they sum to
    #: ``step_seconds``.
    phase_seconds: dict[str, float] = field(default_factory=dict)
    #: Where the time model's rates came from (a measured profile, a data sheet).
    throughput: str | None = None
    #: The relative error of ``step_seconds`` on this device (0.15: within 15%), from
    #: the time model's measured error there (see :attr:`step_seconds_range`).
    step_seconds_error: float | None = None
    #: The distributed layout the step was estimated under (``Parallel.describe()``);
    #: None for one process. The peaks and breakdown are then one rank's (rank 0, which
    #: holds the largest shard where shards differ).
    parallel: str | None = None
    #: The PEFT adapter on the model (method, rank, targets, trainable parameters), if any.
    adapter: str | None = None
    #: The quantized weights (format, layers, bits a weight), if any.
    quant: str | None = None
    #: Bytes of a paged optimizer's state (``paged-adamw``, ``paged-adamw-8bit``): in CUDA
    #: unified memory, outside the caching allocator and every peak above.
    paged_optimizer: int = 0
    world_size: int = 1
    #: Host bytes one rank keeps (offloaded parameters, gradients and optimizer state).
    host_per_rank: int = 0
    #: Host bytes a node needs for its ranks' offloaded state.
    host_per_node: int = 0
    #: A process's first step, on a GPU: its allocated peak. ``peak_allocated`` is a
    #: loop's, whose later steps hold the cuBLAS workspaces from their start; the first
    #: makes each at its first matrix product, possibly after its peak. None where not
    #: modelled (a CPU target).
    first_step_peak_allocated: int | None = None
    #: A process's first step, on a GPU: its reserved peak, from an empty cache but for the
    #: segments the model's state was made in. ``peak_reserved`` is a loop's, whose later
    #: steps start from the segments the first one left. None where not modelled.
    first_step_peak_reserved: int | None = None
    #: On a GPU: the reserved bytes of the segments the step's state (parameters, buffers,
    #: optimizer state, the batch) is made in, in a fresh process, before its first step.
    #: A process whose history left it other segments starts its first step from those.
    state_reserved: int | None = None

    @property
    def budget(self) -> int:
        """The bytes the step may use: capacity times target utilization."""
        return int(self.capacity * self.target_utilization)

    @property
    def peak_device_high(self) -> int:
        """The high (safe) end of what ``nvidia-smi`` may show: ``peak_device`` plus
        ``device_uncertainty``."""
        return self.peak_device + self.device_uncertainty

    @property
    def step_seconds_range(self) -> tuple[float, float] | None:
        """``step_seconds`` less and more its relative error: where the step's time is
        expected to fall (None where no time is predicted)."""
        if self.step_seconds is None:
            return None
        error = self.step_seconds_error or 0.0
        return self.step_seconds * (1 - error), self.step_seconds * (1 + error)

    @property
    def judged_peak(self) -> int:
        """The peak ``fits`` and ``headroom`` judge by: ``peak_device_high`` when ``safe``."""
        return self.peak_device_high if self.safe else self.peak_device

    @property
    def headroom(self) -> int:
        """Budget left at ``judged_peak`` (negative when it does not fit)."""
        return self.budget - self.judged_peak

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
            "optimizer": self.optimizer,
            "checkpointing": self.checkpointing,
            "parameters": self.parameters,
            "cuda": self.cuda,
            "calibrated": self.calibrated,
            "calibration": self.calibration,
            "logical_peak_bytes": self.logical_peak,
            "peak_allocated_bytes": self.peak_allocated,
            "peak_reserved_bytes": self.peak_reserved,
            "peak_device_bytes": self.peak_device,
            "first_step_peak_allocated_bytes": self.first_step_peak_allocated,
            "first_step_peak_reserved_bytes": self.first_step_peak_reserved,
            "state_reserved_bytes": self.state_reserved,
            "device_uncertainty_bytes": self.device_uncertainty,
            "peak_device_high_bytes": self.peak_device_high,
            "breakdown_bytes": dict(self.breakdown),
            "peak_at": {"op": self.peak_op, "module": self.peak_module, "phase": self.peak_phase},
            "target_utilization": self.target_utilization,
            "budget_bytes": self.budget,
            "safe": self.safe,
            "headroom_bytes": self.headroom,
            "fits": self.fits,
            "fits_point": self.fits_point,
            "fits_safe": self.fits_safe,
            "exact": self.exact,
            "assumptions": list(self.assumptions),
            "notes": list(self.notes),
            "flops": self.flops,
            "bytes_moved": self.bytes_moved,
            "step_seconds": self.step_seconds,
            "time_breakdown_s": dict(self.time_breakdown),
            "phase_seconds": dict(self.phase_seconds),
            "throughput": self.throughput,
            "step_seconds_range": list(self.step_seconds_range or ()) or None,
            "parallel": self.parallel,
            "adapter": self.adapter,
            "quant": self.quant,
            "paged_optimizer_bytes": self.paged_optimizer,
            "world_size": self.world_size,
            "host_per_rank_bytes": self.host_per_rank,
            "host_per_node_bytes": self.host_per_node,
            "alloc_retries": self.alloc_retries,
            "ops": self.ops,
            "elapsed_s": round(self.elapsed, 4),
        }

    def device_range(self) -> str:
        """``peak_device`` and, when uncertain, the range up to ``peak_device_high``."""
        if not self.device_uncertainty:
            return format_bytes(self.peak_device)
        return f"{format_bytes(self.peak_device)} to {format_bytes(self.peak_device_high)}"

    def __str__(self) -> str:
        verdict = "fits" if self.fits else "does NOT fit"
        if self.fits_point != self.fits_safe:
            verdict += f" (at the {'safe end' if self.safe else 'point estimate'})"
        per = f" per rank, {self.parallel}" if self.parallel else ""
        lines = [
            f"{self.model} {self.mode} {self.precision} batch {self.batch_size}{per} on "
            f"{self.device}: "
            f"peak {self.device_range()} of {format_bytes(self.budget)} "
            f"({self.target_utilization:.0%} of {format_bytes(self.capacity)}), {verdict}",
        ]
        if self.cuda:
            lines.append(
                f"  allocated {format_bytes(self.peak_allocated)} (max_memory_allocated), "
                f"reserved {format_bytes(self.peak_reserved)} (max_memory_reserved), "
                f"device {format_bytes(self.peak_device)} (nvidia-smi: reserved + context)"
            )
        lines.append(
            f"  peak at {self.peak_op} in {self.peak_module or '(top level)'} ({self.peak_phase})"
        )
        lines += [f"  {k:<12} {format_bytes(v):>12}" for k, v in self.breakdown.items() if v]
        if self.host_per_rank:
            lines.append(
                f"  host         {format_bytes(self.host_per_rank):>12} per rank "
                f"(offloaded), {format_bytes(self.host_per_node)} per node"
            )
        if self.step_seconds is not None:
            lines.append(
                f"  step time    {self.step_seconds:.4g} s predicted "
                f"(±{100 * (self.step_seconds_error or 0):.0f}%, {self.flops / 1e9:,.1f} "
                f"GFLOP; rates: {self.throughput})"
            )
        lines += [f"  assumed: {a}" for a in self.assumptions]
        lines += [f"  {n}" for n in self.notes if n.startswith((_UNCALIBRATED, _NO_BF16))]
        return "\n".join(lines)


def uncalibrated_note(device: str, generic: bool = False) -> str:
    """What an estimate for a GPU without its own calibration profile says (``generic``: a
    GPU named by its size alone, which no profile can be found for)."""
    if generic:
        return (
            f"{_UNCALIBRATED} for a {device} GPU: run `vramctl calibrate` on the GPU "
            "you mean and pass its profile"
        )
    return f"{_UNCALIBRATED} for {device}: run `vramctl calibrate` on it"


_UNCALIBRATED = "no calibration profile"


def no_bf16_note(device: str, capability: str) -> str:
    """What a bf16 estimate for a GPU without native bf16 (compute capability below 8.0:
    V100, T4) says."""
    return (
        f"{_NO_BF16} on {device} (compute capability {capability}; bf16 needs 8.0, Ampere or "
        "later): PyTorch's bf16 matmuls there either fail or run emulated, many times slower; "
        "the memory estimate holds, but use fp16 or amp-fp16 on this GPU"
    )


_NO_BF16 = "no native bf16"
