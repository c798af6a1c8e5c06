"""The device an estimate is for: :class:`Target`, from user input or a :class:`Device`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from vramctl._errors import VramctlError
from vramctl.device import ComputeCapability, Device, gpus, resolve
from vramctl.estimator import _cuda_model
from vramctl.estimator._allocator import AllocatorConfig
from vramctl.estimator._calibration import Calibration, CalibrationSource, resolve_calibration

__all__ = ["Target", "resolve_target", "run_target"]


@dataclass(frozen=True)
class Target:
    """The device an estimate is for."""

    name: str
    #: Memory a process can use in all (CUDA: the capacity ``cudaMemGetInfo`` reports).
    capacity: int
    capability: ComputeCapability | None
    #: Whether CUDA's extras (context, workspaces, caching allocator) are modelled.
    cuda: bool
    #: The measured CUDA constants used for it (None: the built-in ones).
    calibration: Calibration | None = field(default=None, compare=False)
    #: A device without CUDA's extras whose storages still go through a caching allocator
    #: (a simulated GPU with an allocator model): its constants. Its peak is the
    #: allocator's reserved peak. None: live tensor bytes (the CPU, a plain simulated GPU).
    allocator: AllocatorConfig | None = None

    @property
    def constants(self) -> Calibration:
        """The CUDA constants estimates for this target use."""
        return _cuda_model.constants(self.name, self.capability, self.calibration)


def resolve_target(
    device: Target | Device | str | int | None, calibration: CalibrationSource = None
) -> Target:
    """A catalog name (``"A10G-24GB"``), a size (``"24GiB"``), ``"cpu"``, a local GPU or a Device.

    ``None`` takes this machine's first GPU, or the CPU where there is none; a
    :class:`Target` is taken as it is unless ``calibration`` is given.

    ``calibration`` picks the CUDA constants of a GPU target: None looks up a
    profile made by ``vramctl calibrate`` for this GPU (or one of the same compute
    capability), False uses the built-in constants, and a
    :class:`~vramctl.estimator.Calibration` or a profile's path is used as it is.
    """
    if isinstance(device, Target):
        if calibration is None or not device.cuda:
            return device
        return dataclasses.replace(
            device, calibration=resolve_calibration(calibration, device.name, device.capability)
        )
    target = resolve_device(device)
    if not target.cuda:
        return target
    found = resolve_calibration(calibration, target.name, target.capability)
    return dataclasses.replace(target, calibration=found) if found is not None else target


def run_target(device: Device) -> Target | Device:
    """What the estimator is handed for a step that really runs on ``device``.

    A CUDA device is estimated as itself (its context, workspaces and caching
    allocator are modelled). Any other device (the CPU, a simulated GPU) counts the
    live tensor storages of this host's CPU kernels, with none of CUDA's extras; a
    simulated GPU with an allocator model (``vramctl.simulate(..., allocator=)``) counts
    that allocator's segments, with its constants.
    """
    if device.is_cuda:
        return device
    model = getattr(device, "allocator", None)
    config = getattr(model, "config", None)
    allocator = (
        dataclasses.replace(config, capacity=None) if isinstance(config, AllocatorConfig) else None
    )
    name = device.id if device.is_gpu else "cpu"
    return Target(name, device.capacity(), None, cuda=False, allocator=allocator)


def run_allocator(
    device: Device | None, requested: AllocatorConfig | None
) -> AllocatorConfig | None:
    """The caching allocator's configuration for a step that really runs on ``device`` in
    this process: ``requested`` where given; on a CUDA device, else, this process's
    ``PYTORCH_CUDA_ALLOC_CONF`` (expandable segments, ``max_split_size_mb``), which PyTorch
    reads when its allocator starts."""
    if requested is not None or device is None or not device.is_cuda:
        return requested
    return AllocatorConfig.from_env()


def resolve_device(device: Device | str | int | None) -> Target:
    """The target of a device named by user input (:func:`vramctl.device.resolve`'s rules).

    ``None`` is this machine's first GPU, or the CPU where there is none. A simulated
    GPU stands for the GPU of its catalog entry, or for a GPU of its size: CUDA's
    extras are modelled for it.
    """
    if device is None:
        found = gpus()
        device = found[0] if found else "cpu"
    dev = resolve(device)
    total = dev.memory().total
    if not isinstance(total, int):
        raise VramctlError(f"cannot read the memory total of {dev.id}")
    cc = dev.capability if isinstance(dev.capability, ComputeCapability) else None
    return Target(dev.name if dev.is_gpu else "cpu", total, cc, dev.is_gpu)
