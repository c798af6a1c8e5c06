"""A lazy NVML session through the maintained ``nvidia-ml-py`` binding (``pynvml``).

NVML is initialised on first use. A machine without the library or driver is
simply a machine with no NVIDIA devices; that is remembered, with the reason.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import pynvml

from vramctl._na import NA, NotAvailable

__all__ = [
    "NvmlGpu",
    "nvml_available",
    "nvml_error",
    "nvml_gpus",
    "nvml_reason",
    "optional",
    "reset_nvml",
]

T = TypeVar("T")
log = logging.getLogger("vramctl.device")

# Errors that mean "this reading does not exist here" rather than "the device failed".
_ABSENT = (
    pynvml.NVMLError_NotSupported,
    pynvml.NVMLError_NoPermission,
    pynvml.NVMLError_FunctionNotFound,
    pynvml.NVMLError_NoData,
)
# Errors of nvmlInit that mean "no NVIDIA stack on this machine".
_NO_LIBRARY = (
    pynvml.NVMLError_LibraryNotFound,
    pynvml.NVMLError_DriverNotLoaded,
    pynvml.NVMLError_NoPermission,
    pynvml.NVMLError_LibRmVersionMismatch,
    pynvml.NVMLError_FunctionNotFound,
)

_lock = threading.Lock()
_state: dict[str, Any] = {"ok": None, "reason": "", "error": None}


def nvml_available() -> bool:
    """Initialise NVML once; False (with :func:`nvml_reason`) when it cannot run here."""
    with _lock:
        if _state["ok"] is None:
            try:
                pynvml.nvmlInit()
                _state["ok"], _state["reason"], _state["error"] = True, "", None
            except _NO_LIBRARY as exc:
                _state["ok"], _state["reason"] = False, f"NVML unavailable: {exc}"
                _state["error"] = exc
            except pynvml.NVMLError as exc:
                _state["ok"], _state["reason"] = False, f"NVML failed to initialise: {exc}"
                _state["error"] = exc
        return bool(_state["ok"])


def nvml_reason() -> str:
    """Why NVML is not available (empty when it is)."""
    return str(_state["reason"])


def nvml_error() -> BaseException | None:
    """The error that kept NVML from initialising (None when it runs or was not tried)."""
    error = _state["error"]
    return error if isinstance(error, BaseException) else None


def reset_nvml() -> None:
    """Forget the NVML session so the next call initialises again (tests, recovery)."""
    with _lock:
        if _state["ok"]:
            with contextlib.suppress(pynvml.NVMLError):
                pynvml.nvmlShutdown()
        _state["ok"], _state["reason"], _state["error"] = None, "", None


def optional(fn: Callable[..., T], *args: Any) -> T | NotAvailable:
    """Call an NVML query; ``NA`` when the reading is not supported or not permitted.

    Other NVML errors (a lost GPU, a timeout) propagate, so health tracking sees them.
    """
    try:
        return fn(*args)
    except _ABSENT:
        return NA


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


@dataclass(frozen=True)
class NvmlGpu:
    """One NVML device as CUDA would number it: a whole GPU or a MIG instance."""

    cuda_index: int
    handle: Any
    uuid: str
    name: str
    #: The physical GPU's NVML index (PCI bus order).
    nvml_index: int
    #: For a MIG instance, its index within the parent GPU; None for a whole GPU.
    mig_index: int | None = None


def _physical() -> list[tuple[int, Any, str, str, list[NvmlGpu]]]:
    """(nvml index, handle, uuid, name, MIG instances) for every physical GPU.

    A GPU that cannot be read (fallen off the bus: ``NVMLError_GpuIsLost``) keeps its
    place with a ``None`` handle, so the others keep their numbers; it lists no device.
    """
    out: list[tuple[int, Any, str, str, list[NvmlGpu]]] = []
    for i in range(pynvml.nvmlDeviceGetCount()):
        try:
            out.append(_one_physical(i))
        except pynvml.NVMLError as exc:
            log.warning("NVML device %d cannot be read, leaving it out: %s", i, exc)
            out.append((i, None, "", "", []))
    return out


def _one_physical(i: int) -> tuple[int, Any, str, str, list[NvmlGpu]]:
    handle = pynvml.nvmlDeviceGetHandleByIndex(i)
    uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
    name = _text(pynvml.nvmlDeviceGetName(handle))
    migs: list[NvmlGpu] = []
    mode = optional(pynvml.nvmlDeviceGetMigMode, handle)
    if mode is not NA and mode[0] == pynvml.NVML_DEVICE_MIG_ENABLE:
        for j in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
            try:
                mh = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, j)
            except pynvml.NVMLError_NotFound:
                continue
            mig_uuid = _text(pynvml.nvmlDeviceGetUUID(mh))
            mig_name = optional(pynvml.nvmlDeviceGetName, mh)
            migs.append(
                NvmlGpu(
                    -1, mh, mig_uuid, f"{name} MIG" if mig_name is NA else _text(mig_name), i, j
                )
            )
    return i, handle, uuid, name, migs


def nvml_gpus(visible: str | None = None) -> list[NvmlGpu]:
    """The devices a CUDA process would see, in CUDA's numbering.

    Follows ``CUDA_VISIBLE_DEVICES`` (``visible`` overrides it): integer indices,
    ``GPU-`` and ``MIG-`` UUIDs or their unique prefixes; as in CUDA, an entry
    that matches nothing ends the list. A GPU with MIG enabled contributes its
    instances instead of itself. Ordering follows NVML's PCI bus order, which is
    CUDA's when ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (and on most single-model nodes).
    """
    if visible is None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    physical = _physical()

    def expand(entry: tuple[int, Any, str, str, list[NvmlGpu]]) -> list[NvmlGpu]:
        i, handle, uuid, name, migs = entry
        return migs if migs else [NvmlGpu(-1, handle, uuid, name, i)]

    chosen: list[NvmlGpu] = []
    if visible is None:
        for entry in physical:
            chosen.extend(expand(entry))
    else:
        for raw in visible.split(","):
            token = raw.strip()
            found: list[NvmlGpu] = []
            if token.isdigit() and int(token) < len(physical):
                found = expand(physical[int(token)])
            elif token.startswith("GPU-"):
                hits = [e for e in physical if e[2].startswith(token)]
                found = expand(hits[0]) if len(hits) == 1 else []
            elif token.startswith("MIG-"):
                migs = [m for e in physical for m in e[4] if m.uuid.startswith(token)]
                found = migs[:1] if len(migs) == 1 else []
            if not found:
                break
            seen = {c.uuid for c in chosen if c.handle is not None}
            chosen.extend(g for g in found if g.handle is None or g.uuid not in seen)
    # An unreadable GPU keeps its CUDA number (CUDA counted it when it started) but is
    # not listed.
    return [
        NvmlGpu(k, g.handle, g.uuid, g.name, g.nvml_index, g.mig_index)
        for k, g in enumerate(chosen)
        if g.handle is not None
    ]
