"""Seeding the search: the estimator's answer for the step as the device will count it.

The estimator (:func:`vramctl.max_batch_size`) traces the model on fake
tensors. It is handed the model as the step calls it (a Guard's ``forward``),
the optimizer rebuilt from its class and defaults, and a device whose budget is
what the real device has left for this step; see :func:`predict`.

>>> import torch
>>> from vramctl.fit._seed import as_called
>>> class Step:
...     forward = staticmethod(lambda model, batch: model(batch[0]))
>>> wrapped = as_called(torch.nn.Linear(4, 2), Step(), "tuple")
>>> wrapped(torch.zeros(3, 4), torch.zeros(3)).shape
torch.Size([3, 2])
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from vramctl._step import call_model
from vramctl.device import Device
from vramctl.estimator import MaxBatch, Step, estimate, max_batch_size
from vramctl.estimator._shared import Target, resolve_target, run_allocator, run_target

__all__ = ["Reading", "Seed", "as_called", "batch_structure", "estimate_request", "predict"]


def batch_structure(batch: Any) -> str:
    """``"dict"``, ``"tuple"``, ``"list"`` or ``"one"``: how a model is called with it."""
    if isinstance(batch, Mapping):
        return "dict"
    if isinstance(batch, tuple):
        return "tuple"
    return "list" if isinstance(batch, list) else "one"


class _Called(torch.nn.Module):
    """A model as a step calls it: ``forward(model, batch)``."""

    def __init__(
        self, model: torch.nn.Module, forward: Callable[[Any, Any], Any], structure: str
    ) -> None:
        super().__init__()
        self.inner = model
        self._call = forward
        self._structure = structure

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        batch: Any
        if self._structure == "dict":
            batch = dict(kwargs)
        elif self._structure == "tuple":
            batch = tuple(args)
        elif self._structure == "list":
            batch = list(args)
        else:
            batch = args[0]
        return self._call(self.inner, batch)


def as_called(model: torch.nn.Module, step: Any, structure: str) -> torch.nn.Module:
    """``model``, wrapped in the step's own ``forward(model, batch)`` when it has one."""
    forward = getattr(step, "forward", None)
    if not callable(forward) or forward is call_model or isinstance(step, torch.nn.Module):
        return model
    return _Called(model, forward, structure)


def _optimizer_factory(opt: torch.optim.Optimizer) -> Callable[..., torch.optim.Optimizer]:
    """Builds the same optimizer class with the same defaults (for the estimator)."""
    cls = type(opt)
    try:
        accepted = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        accepted = {}  # type: ignore[assignment]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        kwargs = dict(opt.defaults)
    else:
        kwargs = {k: v for k, v in opt.defaults.items() if k in accepted}

    def build(params: Any) -> torch.optim.Optimizer:
        return cls(params, **kwargs)

    return build


def _held_bytes(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, on_gpu: bool = False
) -> int:
    """Bytes of the weights, buffers and optimizer state (the estimator counts these itself).

    ``on_gpu``: only those on a CUDA device.
    """
    seen: dict[int, int] = {}
    tensors: list[torch.Tensor] = [*model.parameters(), *model.buffers()]
    if optimizer is not None:
        for state in optimizer.state.values():
            tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    for t in tensors:
        if on_gpu and not t.is_cuda:
            continue
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _unusable(
    device: Device, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
) -> tuple[int, int] | None:
    """Bytes of a GPU the step cannot have, and the GPU's total (None where it cannot say).

    That is what other processes hold plus this process's live tensors other than
    the model and optimizer state (which the estimator counts itself), less this
    process's CUDA context (the estimator models it) and its cached free blocks
    (the step reuses them). The total is the one the estimator takes (NVML's).
    """
    mem = device.memory()
    if not isinstance(mem.used, int) or not isinstance(mem.total, int):
        return None
    reserved = mem.reserved if isinstance(mem.reserved, int) else 0
    allocated = mem.allocated if isinstance(mem.allocated, int) else 0
    if isinstance(mem.process_used, int) and mem.process_used > 0:
        context = max(0, mem.process_used - reserved)
    else:
        # Not listed by NVML (another PID namespace): a modelled context once CUDA started,
        # from the GPU's calibration profile where there is one.
        context = 0
        if reserved:
            context = resolve_target(device).constants.context_bytes
    held = _held_bytes(model, optimizer, on_gpu=True)
    unusable = mem.used - context - (reserved - allocated) - held
    return max(0, unusable), mem.total


def _estimator_target(
    device: Device,
    target: float,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
) -> tuple[Target | Device, float] | None:
    """The device and utilization to hand the estimator.

    A real GPU is estimated as itself (the estimator models this process's CUDA
    context and caching allocator), with the share of its memory that is left
    for the step: other processes' memory and this process's other live tensors
    subtracted (see :func:`_unusable`). The CPU is
    estimated with the share of its memory that is left for this step (the
    host's other users subtracted).
    A simulated GPU counts live tensor storages of this host's CPU kernels, with
    no CUDA context, workspaces or caching allocator: it is estimated as such
    (a target without CUDA's extras, whose kernel scratch is measured here),
    with the share of its capacity left for this step.
    """
    if device.is_cuda:
        reading = _unusable(device, model, optimizer)
        if reading is None:
            return device, target
        unusable, total = reading
        room = int(target * total) - unusable
        return (device, room / total) if room > 0 else None
    total = device.capacity()
    used = total - device.available()
    room = int(target * total) - (used - _held_bytes(model, optimizer))
    if room <= 0:
        return None
    return run_target(device), room / total


def estimate_request(
    options: Step | Mapping[str, Any] | None,
    step: Callable[[Any], Any],
    mode: str,
    optimizer: torch.optim.Optimizer | None,
) -> tuple[Step, dict[str, Any], tuple[bool, ...]]:
    """The step a fit estimates, the other arguments of its search (``seq_len`` ...), and
    the readings of its loop to estimate (``keep_output`` values).

    ``options`` (a :class:`~vramctl.Step` or a mapping) say what they say; the fit's
    own knowledge fills the rest: the mode and optimizer it found, the step's
    ``loss_fn`` (a Guard's: ``(output, batch) -> loss``) and ``safe=True``: the seed of
    a search by real steps is the largest batch whose device peak fits at the top of its
    range (on a real GPU the range is what ``nvidia-smi`` may read above the estimate;
    elsewhere there is none and the safe end is the point estimate). A first probe that
    fits is scaled up from its measured peak; one that overshoots measures nothing, and
    the search must step down blind.

    A fit cannot see whether its step holds the model's output through backward: where
    the options do not say (``keep_output``), a training step is estimated both ways,
    and the first probe's allocations tell which the step is (:func:`predict`).
    """
    search: dict[str, Any] = {}
    if isinstance(options, Mapping):
        options, search = Step.split(options)
    defaults: dict[str, Any] = {
        "mode": mode,
        "optimizer": _optimizer_factory(optimizer) if optimizer is not None else None,
        "safe": True,
    }
    if callable(getattr(step, "loss_fn", None)):
        defaults["loss_fn"] = step.loss_fn  # type: ignore[attr-defined]
    request = Step.of(options, **defaults)
    said = (isinstance(options, Mapping) and "keep_output" in options) or (
        isinstance(options, Step) and not options.keep_output
    )
    readings = (request.keep_output,) if said or request.mode != "train" else (True, False)
    return request, search, readings


@dataclass(frozen=True)
class Reading:
    """The estimator's answer for one reading of the step's loop: whether it holds the
    model's output through backward (``keep_output``)."""

    keep_output: bool
    #: The largest batch the estimate says fits.
    batch_size: int
    #: Whether the estimate found the edge (``batch_size`` fits, one more sample does not)
    #: with no range to allow for: a probe at ``batch_size`` that allocates what
    #: ``allocated_at`` predicts there confirms it.
    edge: bool = False
    #: ``(batch_size, allocated) -> batch size``: the estimate's answer once a real step
    #: allocated that much at that size (see :meth:`vramctl.estimator.MaxBatch.refit`);
    #: None without a caching allocator to replay.
    refit: Callable[[int, int], int | None] | None = field(default=None, compare=False)
    #: ``batch_size -> bytes``: the estimate's peak allocated bytes at a size (None where
    #: it cannot say).
    allocated_at: Callable[[int], int | None] | None = field(default=None, compare=False)

    def describe(self) -> str:
        return (
            "a loop that holds the model's output through backward"
            if self.keep_output
            else "a loop that lets go of the model's output before backward"
        )


@dataclass(frozen=True)
class Seed:
    """The estimator's answer for a fit: where the search starts and what it knows."""

    #: The largest batch the estimate says fits (None: no estimate); with two readings of
    #: the loop, the smaller of their answers.
    batch_size: int | None = None
    #: Bytes per sample near it.
    slope: float | None = None
    #: Why there is no estimate.
    note: str | None = None
    #: The estimate's answer per reading of the loop, the first probe's first.
    readings: tuple[Reading, ...] = ()

    def matching(self, batch_size: int, allocated: int, within: float) -> Reading | None:
        """The reading whose estimate allocates within ``within`` (a share) of what a real
        step of ``batch_size`` samples ``allocated`` (the nearest, where two do)."""
        best: tuple[float, Reading] | None = None
        for reading in self.readings:
            predicted = reading.allocated_at(batch_size) if reading.allocated_at else None
            if not predicted:
                continue
            off = abs(allocated - predicted) / predicted
            if off <= within and (best is None or off < best[0]):
                best = (off, reading)
                if off == 0:
                    break
        return best[1] if best is not None else None


def predict(
    model: torch.nn.Module,
    make_batch: Callable[[int], Any],
    device: Device,
    target: float,
    request: Step,
    optimizer: torch.optim.Optimizer | None,
    search: dict[str, Any],
    readings: tuple[bool, ...] = (True,),
) -> Seed:
    """The estimator's answer for ``request`` on the room the fit has, for each reading of
    the loop (``keep_output``), and its per-sample slope near the smallest (or a note
    saying why not)."""
    answers: list[tuple[bool, MaxBatch]] = []
    try:
        where = _estimator_target(device, target, model, optimizer)
        if where is None:
            return Seed(note="no room left for the step: the estimate was skipped")
        on = request.replace(
            device=where[0],
            target_utilization=where[1],
            allocator_config=run_allocator(device, request.allocator_config),
        )
        with device.uncounted():
            # The seed of a search by real steps: the safe end of the estimate's range (see
            # estimate_request), so that the first probe fits and measures a real peak.
            for keep in readings:
                step = on.replace(keep_output=keep)
                answers.append((keep, max_batch_size(model, make_batch, step=step, **search)))
    except Exception as exc:
        failed = f"estimate failed ({type(exc).__name__}: {exc})"
        if not answers:
            return Seed(note=f"{failed}; searched without it")
        # The first reading stands alone: the probes cannot tell the loop apart.
        note: str | None = f"{failed} for the loop's other reading; searched with one"
    else:
        note = None
    answers.sort(key=lambda a: a[1].batch_size)
    est = answers[0][1]
    points = sorted({b: p for b, p, _ in est.curve}.items())
    slope = est.per_sample
    if est.batch_size > 1:
        near = [(b, p) for b, p in points if b >= est.batch_size / 2]
        if len(near) >= 2 and near[-1][0] - near[0][0] >= 2:
            slope = (near[-1][1] - near[0][1]) / (near[-1][0] - near[0][0])
    lengths = {k: v for k, v in search.items() if k in ("seq_len", "seconds")}

    def reading(keep: bool, found: MaxBatch) -> Reading:
        at = found.estimate
        edge = at is not None and found.limit_found and at.device_uncertainty == 0
        known = {found.batch_size: at.peak_allocated} if at is not None else {}

        def allocated_at(b: int) -> int | None:
            if b not in known:
                try:
                    with device.uncounted():
                        known[b] = estimate(
                            model,
                            make_batch,
                            batch_size=b,
                            step=on.replace(keep_output=keep),
                            **lengths,
                        ).peak_allocated
                except Exception:
                    return None
            return known[b]

        refit = found.refit if found.replayable is not None else None
        return Reading(keep, found.batch_size, edge, refit, allocated_at)

    return Seed(
        est.batch_size,
        slope if slope > 0 else None,
        note,
        tuple(reading(keep, found) for keep, found in answers),
    )
