"""What a step that does not fit even one sample at a time gets: a memory report."""

from __future__ import annotations

import gc
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from vramctl._errors import VramctlError
from vramctl._tensors import storage
from vramctl._units import format_bytes
from vramctl.device import Device, MemoryState

__all__ = ["MemoryReport", "StepDoesNotFitError", "memory_report"]


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "bytes": self.nbytes,
        }


@dataclass(frozen=True)
class MemoryReport:
    """The device's state when a step gave up, its largest tensors, and what to try."""

    device: str
    state: MemoryState
    largest: list[TensorInfo]
    #: Bytes held by parameters, their gradients and the optimizer's state.
    model_bytes: int
    #: Bytes of all live tensors on the device.
    tensor_bytes: int
    suggestion: str
    error: str = ""
    attempts: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "state": self.state.to_dict(),
            "largest": [t.to_dict() for t in self.largest],
            "model_bytes": self.model_bytes,
            "tensor_bytes": self.tensor_bytes,
            "suggestion": self.suggestion,
            "error": self.error,
            "attempts": list(self.attempts),
        }

    def __str__(self) -> str:
        st = self.state
        lines = [
            f"memory on {self.device}: "
            + ", ".join(
                f"{k} {format_bytes(v)}"
                for k, v in (("total", st.total), ("used", st.used), ("free", st.free))
                if isinstance(v, int)
            ),
            f"  live tensors {format_bytes(self.tensor_bytes)}, of which parameters, "
            f"gradients and optimizer state {format_bytes(self.model_bytes)}",
        ]
        if self.largest:
            lines.append("  largest tensors:")
            lines += [
                f"    {format_bytes(t.nbytes):>10}  {t.name} {list(t.shape)} {t.dtype}"
                for t in self.largest
            ]
        lines += [f"  tried: {a}" for a in self.attempts]
        lines.append(f"  suggestion: {self.suggestion}")
        return "\n".join(lines)


class StepDoesNotFitError(VramctlError, torch.OutOfMemoryError):
    """The step runs out of memory even one sample at a time (and offloaded, where possible).

    It is a ``torch.OutOfMemoryError``, so existing handlers still catch it;
    :attr:`report` says what held the memory and what to try.
    """

    def __init__(self, message: str, report: MemoryReport) -> None:
        super().__init__(f"{message}\n{report}")
        self.report = report


def _names(
    model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None
) -> dict[int, str]:
    names: dict[int, str] = {}
    if model is not None:
        for n, p in model.named_parameters():
            names[id(p)] = f"param {n}"
            if p.grad is not None:
                names[id(p.grad)] = f"grad {n}"
        for n, b in model.named_buffers():
            names[id(b)] = f"buffer {n}"
    if optimizer is not None:
        pname = {
            id(q): names.get(id(q), "?").removeprefix("param ")
            for g in optimizer.param_groups
            for q in g["params"]
        }
        for owner, state in optimizer.state.items():
            for key, v in state.items():
                if isinstance(v, torch.Tensor):
                    names[id(v)] = f"optimizer {key} of {pname.get(id(owner), '?')}"
    return names


def memory_report(
    device: Device,
    *,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    error: BaseException | str = "",
    attempts: list[str] | None = None,
    top: int = 8,
) -> MemoryReport:
    """The device's state and its largest live tensors (found by the garbage collector)."""
    seen: dict[int, TensorInfo] = {}
    try:
        names = _names(model, optimizer)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # isinstance() on deprecated module attributes
            for obj in gc.get_objects():
                _note(obj, device, names, seen)
    except MemoryError:
        # The host itself is out of memory (a CPU step, or an address-space limit): the
        # list of live objects does not fit either. The report goes without its tensor
        # list rather than hiding the step's own error behind this one.
        seen.clear()
    infos = sorted(seen.values(), key=lambda t: -t.nbytes)
    tensor_bytes = sum(t.nbytes for t in infos)
    model_bytes = sum(
        t.nbytes for t in infos if t.name.split(" ")[0] in ("param", "grad", "optimizer", "buffer")
    )
    state = device.memory()
    suggestion = _suggest(state, model_bytes, tensor_bytes)
    return MemoryReport(
        device.id,
        state,
        infos[:top],
        model_bytes,
        tensor_bytes,
        suggestion,
        str(error).split("\n")[0][:500],
        list(attempts or []),
    )


def _note(obj: object, device: Device, names: dict[int, str], seen: dict[int, TensorInfo]) -> None:
    try:
        # a fake tensor (an estimate's, not yet collected) holds no memory
        if not isinstance(obj, torch.Tensor) or isinstance(obj, FakeTensor):
            return
        if not device.owns(obj):
            return
        st = storage(obj)
        if st is None:
            return
        key = st.data_ptr() or id(st)
    except Exception:
        return
    info = TensorInfo(
        names.get(id(obj), "tensor"),
        tuple(obj.shape),
        str(obj.dtype).removeprefix("torch."),
        st.nbytes(),
    )
    old = seen.get(key)
    if old is None or (old.name == "tensor" and info.name != "tensor"):
        seen[key] = info


def _suggest(state: MemoryState, model_bytes: int, tensor_bytes: int) -> str:
    total = state.total if isinstance(state.total, int) else 0
    others = 0
    if isinstance(state.used, int) and isinstance(state.process_used, int):
        others = max(0, state.used - state.process_used)
    if total and others > total // 4:
        return (
            f"other processes hold {format_bytes(others)} of {format_bytes(total)}; free them "
            "or move this job to a less busy device (vramctl select)"
        )
    if total and model_bytes > total // 2:
        return (
            f"parameters, gradients and optimizer state take {format_bytes(model_bytes)} of "
            f"{format_bytes(total)}: use bf16 weights, a lighter optimizer (SGD, 8-bit Adam), "
            "shard them (FSDP), or a larger device"
        )
    return (
        "the activations of a single sample do not fit in what is left: enable activation "
        "checkpointing (torch.utils.checkpoint), mixed precision (torch.autocast), or "
        "shorter inputs"
    )
