"""Choosing a device with room, and switching the current device."""

from __future__ import annotations

import contextlib
import contextvars
import enum
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vramctl._errors import VramctlError
from vramctl._na import NA
from vramctl._units import format_bytes, parse_size
from vramctl.device._base import Device
from vramctl.device._discover import devices, get_device
from vramctl.device._memory import MemoryState

if TYPE_CHECKING:  # PyTorch is imported where a model or CUDA is asked, not to list devices
    import torch

__all__ = [
    "Policy",
    "Selection",
    "current_device",
    "rank_devices",
    "resolve",
    "select_device",
    "sort_devices",
    "use_device",
]

log = logging.getLogger("vramctl.device")


class Policy(str, enum.Enum):
    """How to choose among the GPUs that fit.

    - ``most-free``: the most free memory (spreads jobs out);
    - ``least-loaded``: the lowest compute utilization, then the lowest memory use;
    - ``best-fit``: the least free memory that still fits (packs jobs, keeps big GPUs free).
    """

    MOST_FREE = "most-free"
    LEAST_LOADED = "least-loaded"
    BEST_FIT = "best-fit"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: Policy | str) -> Policy:
        try:
            return cls(value)
        except ValueError:
            forms = ", ".join(p.value for p in cls)
            raise VramctlError(f"unknown policy {value!r}: use one of {forms}") from None


@dataclass(frozen=True)
class Verdict:
    """Why one device was or was not a candidate."""

    device: Device
    memory: MemoryState
    fits: bool
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device.id,
            "fits": self.fits,
            "reason": self.reason,
            "free": None if self.memory.free is NA else self.memory.free,
        }


@dataclass(frozen=True)
class Selection:
    """The chosen device, why, and what every candidate looked like.

    ``considered`` holds every GPU's verdict; ``fallback`` the CPU's, when no GPU fitted
    and the CPU was chosen. :attr:`fits` says whether the chosen device has room.
    """

    device: Device
    reason: str
    need_bytes: int
    policy: Policy
    considered: list[Verdict] = field(default_factory=list)
    fallback: Verdict | None = None

    @property
    def fell_back(self) -> bool:
        """True when no GPU fitted and the CPU was chosen."""
        return self.device.kind == "cpu"

    @property
    def fits(self) -> bool:
        """Whether the chosen device has room: a GPU that fits, or else the CPU that does."""
        return self.fallback is None or self.fallback.fits

    @property
    def verdicts(self) -> list[Verdict]:
        """Every device's verdict: the GPUs', then the CPU's when it was considered."""
        return [*self.considered, *([self.fallback] if self.fallback is not None else [])]

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device.to_dict(),
            "reason": self.reason,
            "need_bytes": self.need_bytes,
            "policy": self.policy.value,
            "fits": self.fits,
            "fell_back_to_cpu": self.fell_back,
            "considered": [v.to_dict() for v in self.considered],
            "fallback": None if self.fallback is None else self.fallback.to_dict(),
        }


def _judge(dev: Device, need: int, target: float) -> Verdict:
    mem = dev.memory()
    health = dev.health
    if not health.state.usable:
        return Verdict(dev, mem, False, f"{health.state}: {health.reason}")
    if mem.free is NA or mem.total is NA:
        return Verdict(dev, mem, False, "free memory is not available")
    if not mem.fits(need, target):
        room = mem.headroom(target)
        room_b = 0 if room is NA else max(0, min(room, mem.free))
        return Verdict(
            dev,
            mem,
            False,
            f"{format_bytes(room_b)} usable within {target:.0%} of "
            f"{format_bytes(mem.total)}, needs {format_bytes(need)}",
        )
    return Verdict(dev, mem, True, f"{format_bytes(mem.free)} free")


def _order(verdicts: list[Verdict], policy: Policy) -> list[Verdict]:
    def free(v: Verdict) -> int:
        return 0 if v.memory.free is NA else v.memory.free

    if policy is Policy.MOST_FREE:
        return sorted(verdicts, key=lambda v: -free(v))
    if policy is Policy.BEST_FIT:
        return sorted(verdicts, key=free)

    def load(v: Verdict) -> tuple[float, float]:
        util = v.memory.compute_utilization
        frac = v.memory.utilization
        return (101.0 if util is NA else util, 1.0 if frac is NA else frac)

    return sorted(verdicts, key=load)


def sort_devices(
    devs: Sequence[Device], policy: Policy | str = Policy.LEAST_LOADED
) -> list[Device]:
    """``devs`` in ``policy``'s order of preference, with no memory need to meet."""
    return [v.device for v in _order([_judge(d, 0, 1.0) for d in devs], Policy.parse(policy))]


def rank_devices(
    need: int | str,
    *,
    policy: Policy | str = Policy.MOST_FREE,
    target: float = 0.9,
    candidates: Sequence[Device | int | str] | None = None,
) -> Selection:
    """Choose a device for ``need`` bytes and explain the choice.

    A GPU fits when ``need`` stays within ``target`` of its total and within
    its free memory, and its health is usable. Among those that fit, ``policy``
    chooses. When none fits, or there is no GPU, the CPU is chosen, judged the same
    way: :attr:`Selection.fits` is False when it has no room either.
    """
    need_b = parse_size(need)
    pol = Policy.parse(policy)
    if not 0 < target <= 1:
        raise VramctlError(f"target {target!r} must be a fraction in (0, 1], e.g. 0.9")
    pool = [get_device(c) for c in candidates] if candidates is not None else devices()
    gpus = [d for d in pool if d.kind != "cpu"]
    cpu = next((d for d in pool if d.kind == "cpu"), None) or get_device("cpu")
    verdicts = [_judge(d, need_b, target) for d in gpus]
    fitting = [v for v in verdicts if v.fits]
    if fitting:
        best = _order(fitting, pol)[0]
        why = f"{pol} among {len(fitting)} of {len(gpus)} GPU(s) that fit: {best.reason}"
        return Selection(best.device, why, need_b, pol, verdicts)
    if not gpus:
        why = "no GPU found; using the CPU"
    else:
        why = "no GPU fits (" + "; ".join(f"{v.device.id}: {v.reason}" for v in verdicts) + ")"
    on_cpu = _judge(cpu, need_b, target)
    if not on_cpu.fits:
        why += f"; the CPU has no room either ({on_cpu.reason})"
    return Selection(cpu, why, need_b, pol, verdicts, on_cpu)


def select_device(
    need: int | str = 0,
    *,
    policy: Policy | str = Policy.MOST_FREE,
    target: float = 0.9,
    candidates: Sequence[Device | int | str] | None = None,
) -> Device:
    """The device to put ``need`` bytes of work on; the CPU when no GPU fits.

    The reason is logged at INFO (at WARNING on a fallback to the CPU from GPUs that did
    not fit, or to a CPU without room either: ``rank_devices(...).fits`` is False then).
    See :func:`rank_devices` for the explanation as data.

    >>> import vramctl
    >>> vramctl.select_device("1MiB").kind in ("cuda", "mig", "cpu")
    True
    """
    sel = rank_devices(need, policy=policy, target=target, candidates=candidates)
    level = logging.WARNING if sel.fell_back and (sel.considered or not sel.fits) else logging.INFO
    log.log(
        level, "selected %s for %s: %s", sel.device.id, format_bytes(sel.need_bytes), sel.reason
    )
    return sel.device


_current: contextvars.ContextVar[Device | None] = contextvars.ContextVar(
    "vramctl_current_device", default=None
)


def current_device() -> Device:
    """The device of the innermost :func:`use_device`.

    Otherwise the simulated GPU whose ``with`` block is active, then PyTorch's
    current CUDA device once CUDA is initialised, or the CPU.
    """
    return resolve(None)


def resolve(device: Device | int | str | None = None, *, model: Any = None) -> Device:
    """The device that user input names, by one set of rules for all of vramctl.

    - a :class:`Device`: itself;
    - an index (``1``, ``"1"``), ``"cuda"``, ``"cuda:1"``, ``"cpu"``, or a ``GPU-``/``MIG-``
      UUID (or a unique prefix): that device of this machine;
    - a catalog GPU (``"T4-16GB"``, ``"sim:T4-16GB"``) or a size (``"16GiB"``,
      ``"sim:16GiB"``): a new simulated GPU of that capacity (enter it to count);
    - ``None``: the device of the innermost :func:`use_device`, else the simulated GPU
      whose ``with`` block is active, else the CUDA device holding ``model``'s parameters
      (a module or an optimizer), else PyTorch's current CUDA device
      once CUDA is initialised, else the CPU.

    Anything else raises :class:`~vramctl.UnknownDeviceError` naming the accepted forms.

    >>> import vramctl
    >>> vramctl.device.resolve("cpu").id, vramctl.device.resolve("T4-16GB").id
    ('cpu', 'sim:T4-16GB')
    """
    if device is not None:
        return get_device(device)
    dev = _current.get()
    if dev is not None:
        return dev
    import torch

    from vramctl.device._simulate import active_simulation

    sim = active_simulation()
    if sim is not None:
        return sim
    p = _first_parameter(model)
    if p is not None and p.is_cuda:
        return get_device(p.device.index or 0)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return get_device(torch.cuda.current_device())
    return get_device("cpu")


def _first_parameter(obj: Any) -> torch.Tensor | None:
    """The first parameter of a module (``parameters()``) or an optimizer (``param_groups``)."""
    if obj is None:
        return None
    import torch

    if callable(getattr(obj, "parameters", None)):
        return next(iter(obj.parameters()), None)
    for group in getattr(obj, "param_groups", ()):
        for p in group.get("params", ()):
            return p if isinstance(p, torch.Tensor) else None
    return None


@contextlib.contextmanager
def use_device(device: Device | int | str) -> Iterator[Device]:
    """Make ``device`` current (``torch.cuda.device`` for a GPU) and restore the previous one.

    >>> import vramctl
    >>> with vramctl.use_device("cpu") as dev:
    ...     vramctl.current_device() is dev
    True
    """
    dev = get_device(device)
    token = _current.set(dev)
    try:
        if dev.is_cuda:
            import torch

            with torch.cuda.device(dev.torch_device):
                yield dev
        else:
            yield dev
    finally:
        _current.reset(token)
