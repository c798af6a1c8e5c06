"""What the Hugging Face ``Trainer``'s pieces share (:mod:`vramctl.integrations.transformers`):
their error, their logger and the training device."""

from __future__ import annotations

import logging
from typing import Any

from vramctl._errors import VramctlError
from vramctl._optional import require

require(
    ("transformers", "accelerate"), extra="transformers", what="vramctl.integrations.transformers"
)

from vramctl.device import Device, current_device, resolve  # noqa: E402

__all__ = ["TrainerIntegrationError", "log", "training_device"]

#: The pieces log as the module users import them from.
log = logging.getLogger("vramctl.integrations.transformers")


class TrainerIntegrationError(VramctlError, ValueError):
    """A setting the Hugging Face integration cannot work with, said with what to do."""


def training_device(args: Any, device: Device | str | int | None) -> Device:
    """``device``; else the active simulated GPU; else the device the Trainer trains on."""
    if device is not None:
        return resolve(device)
    current = current_device()
    if current.is_simulated:
        return current
    try:
        return resolve(str(args.device))
    except VramctlError:  # a device vramctl does not manage (mps, xla): its host
        return resolve("cpu")
