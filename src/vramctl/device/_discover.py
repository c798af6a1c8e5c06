"""Finding devices: every CUDA device (NVML first, then ``torch.cuda``) and the CPU."""

from __future__ import annotations

import logging
import os
import sys
import threading

import pynvml

from vramctl._errors import UnknownDeviceError
from vramctl._units import looks_like_size
from vramctl.device._base import Device
from vramctl.device._catalog import catalog, catalog_miss
from vramctl.device._cpu import CpuDevice
from vramctl.device._cuda import CudaDevice
from vramctl.device._nvml import nvml_available, nvml_gpus, nvml_reason

__all__ = ["DEVICE_FORMS", "devices", "get_device", "gpus"]

log = logging.getLogger("vramctl.device")

DEVICE_FORMS = (
    "an index (0), cuda:N, cuda, cpu, a GPU- or MIG- UUID (or a unique prefix), "
    "or sim:NAME for a simulated GPU: a catalog name (sim:T4-16GB, or T4-16GB) or a size "
    "(sim:16GiB)"
)

_lock = threading.Lock()
_cache: dict[str, Device] = {}  # keeps each device's health across calls

# What a GPU driver leaves in /dev on Linux: NVIDIA's, AMD's (ROCm), WSL's.
_GPU_NODES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")


def _torch_may_see_gpus() -> bool:
    """Whether asking ``torch.cuda`` (where NVML does not run) could find a GPU.

    Once PyTorch is imported it is asked. Before, on Linux, a machine without any GPU
    driver's device node has none to find: listing its devices (the CPU) then needs
    no import of PyTorch, which takes seconds.
    """
    if "torch" in sys.modules or not sys.platform.startswith("linux"):
        return True
    return any(os.path.exists(node) for node in _GPU_NODES)


def gpus() -> list[Device]:
    """The CUDA devices this process can see (MIG instances included), in CUDA's order.

    Uses NVML where it runs; otherwise ``torch.cuda`` (for example on ROCm).
    Returns an empty list on a machine without GPUs. Device objects are reused
    between calls so that their health history is kept.
    """
    found: list[Device] = []
    with _lock:
        if nvml_available():
            try:
                listed = nvml_gpus()
            except pynvml.NVMLError as exc:
                log.warning("NVML could not list devices: %s", exc)
                listed = []
            for g in listed:
                key = f"{g.cuda_index}:{g.uuid}"
                if key not in _cache:
                    _cache[key] = CudaDevice.from_nvml(g)
                found.append(_cache[key])
        elif _torch_may_see_gpus():
            import torch

            if torch.cuda.is_available():
                log.debug("%s; using torch.cuda", nvml_reason())
                for i in range(torch.cuda.device_count()):
                    key = f"{i}:torch"
                    if key not in _cache:
                        _cache[key] = CudaDevice.from_torch(i)
                    found.append(_cache[key])
    return found


def devices(*, include_cpu: bool = True) -> list[Device]:
    """Every device: the CUDA devices (see :func:`gpus`), then the CPU.

    >>> import vramctl
    >>> vramctl.devices()[-1].id
    'cpu'
    """
    found = gpus()
    if include_cpu:
        with _lock:
            if "cpu" not in _cache:
                _cache["cpu"] = CpuDevice()
            found.append(_cache["cpu"])
    return found


def get_device(spec: Device | int | str) -> Device:
    """Resolve a device from its index, id, UUID, a catalog GPU or a size (see :func:`resolve`).

    Raises :class:`UnknownDeviceError` naming the value, the devices present and
    the accepted forms.
    """
    if isinstance(spec, Device):
        return spec
    if isinstance(spec, bool) or not isinstance(spec, int | str):
        raise UnknownDeviceError(f"unknown device {spec!r}: use {DEVICE_FORMS}")
    from vramctl.device._simulate import simulate

    text = str(spec).strip()
    low = text.lower()
    if low.startswith("sim:"):
        return simulate(text[4:])
    if low == "cuda":
        low = "cuda:0"
    if isinstance(spec, int) or low.isdigit():
        low = f"cuda:{int(low)}"
    present = devices()
    for dev in present:
        if dev.id == low:
            return dev
    if text.startswith(("GPU-", "MIG-")):
        hits = [d for d in present if isinstance(d.uuid, str) and d.uuid.startswith(text)]
        if len(hits) == 1:
            return hits[0]
    names = ", ".join(d.id for d in present)
    if low.startswith("cuda") and all(not d.is_gpu for d in present):
        raise UnknownDeviceError(
            f"unknown device {text!r}: CUDA is not available on this machine (no GPU is "
            f"visible); it has {names}"
        )
    catalog_names = ""
    if not low.startswith(("cuda", "gpu-", "mig-")):
        if looks_like_size(text):
            return simulate(text)  # a bad size ("-3GiB") says what is wrong with it
        try:
            return simulate(text)  # a catalog GPU ("T4-16GB")
        except UnknownDeviceError:
            near = catalog_miss(text)  # close to catalog GPUs: name them, never guess one
            if near is not None:
                raise UnknownDeviceError(near) from None
            catalog_names = "; catalog GPUs: " + ", ".join(s.name for s in catalog())
    raise UnknownDeviceError(
        f"unknown device {text!r}: this machine has {names}; use {DEVICE_FORMS}{catalog_names}"
    )
