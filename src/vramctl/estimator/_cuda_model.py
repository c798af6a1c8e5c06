"""What a CUDA device adds to a step's memory beyond its tensors: the modelled constants.

A CPU trace counts tensor storages exactly. A CUDA process also holds:

- the **CUDA context** (driver state, kernels of loaded modules): outside the
  caching allocator, so it shows in ``nvidia-smi`` but not in
  ``torch.cuda.memory_reserved``. With lazy module loading (the default since
  CUDA 11.7 in PyTorch's wheels) it is a few hundred MiB and grows with the
  architecture's kernel images;
- **cuBLAS workspaces**, one per (thread, stream) handle, taken from the caching
  allocator at the first matrix multiply and kept: PyTorch's default
  ``CUBLAS_WORKSPACE_CONFIG`` is ``:4096:2:16:8`` (8.125 MiB) before Hopper and
  ``:4096:8:16:8`` (32.125 MiB) from Hopper on, as cuBLAS's documentation
  recommends (4 MiB, 32 MiB for Hopper). Training uses two handles: the forward
  runs on the main thread, the backward on the autograd engine's device thread;
- **cuDNN workspaces** for convolutions, taken from the caching allocator for
  the duration of the call. Their size depends on the algorithm cuDNN's
  heuristics pick; the model takes the convolution's output size, bounded by
  ``CUDNN_WORKSPACE_CAP``;
- the caching allocator's rounding and cached segments, which the allocator
  model (:class:`~vramctl.estimator.CachingAllocatorModel`) replays.

The built-in constants below are estimates from public sources. ``vramctl
calibrate`` measures them on a real GPU and writes a profile
(:mod:`vramctl.estimator._calibration`); an estimate for that GPU, or for one of
the same compute capability, uses the profile instead (:func:`constants`).
"""

from __future__ import annotations

from vramctl.device import ComputeCapability
from vramctl.estimator._allocator import AllocatorConfig
from vramctl.estimator._calibration import Calibration

__all__ = ["builtin", "constants", "context_bytes", "cublas_workspace_bytes"]

MiB = 2**20

#: CUDA context by compute capability major version (lazy loading, CUDA 12).
CONTEXT_BYTES: dict[int, int] = {7: 310 * MiB, 8: 420 * MiB, 9: 520 * MiB, 10: 560 * MiB}
CONTEXT_DEFAULT = 520 * MiB

CUBLAS_WORKSPACE_BYTES = 4096 * 1024 * 2 + 16 * 1024 * 8
CUBLAS_WORKSPACE_HOPPER_BYTES = 4096 * 1024 * 8 + 16 * 1024 * 8
CUDNN_WORKSPACE_CAP = 1024 * MiB
#: A convolution's cuDNN workspace, as a multiple of its largest output.
CUDNN_WORKSPACE_RATIO = 1.0
#: cuBLAS handles a training step uses: the forward's thread and autograd's device thread.
TRAIN_HANDLES = 2


def context_bytes(cc: ComputeCapability | None) -> int:
    """The CUDA context modelled for a device of compute capability ``cc``."""
    if cc is None:
        return CONTEXT_DEFAULT
    return CONTEXT_BYTES.get(cc.major, CONTEXT_DEFAULT)


def cublas_workspace_bytes(cc: ComputeCapability | None) -> int:
    """One cuBLAS handle's workspace with PyTorch's default configuration."""
    if cc is not None and cc.major >= 9:
        return CUBLAS_WORKSPACE_HOPPER_BYTES
    return CUBLAS_WORKSPACE_BYTES


def builtin(device: str, cc: ComputeCapability | None) -> Calibration:
    """The built-in constants for a device, in the form a measured profile takes."""
    return Calibration(
        device=device,
        capability=cc,
        context_bytes=context_bytes(cc),
        cudnn_context_bytes=0,
        cublas_workspace_bytes=cublas_workspace_bytes(cc),
        train_handles=TRAIN_HANDLES,
        cudnn_workspace_ratio=CUDNN_WORKSPACE_RATIO,
        cudnn_workspace_cap=CUDNN_WORKSPACE_CAP,
        allocator=AllocatorConfig(),
    )


def constants(
    device: str, cc: ComputeCapability | None, calibration: Calibration | None
) -> Calibration:
    """The constants an estimate uses: the profile's where there is one, else the built-in."""
    return calibration if calibration is not None else builtin(device, cc)
