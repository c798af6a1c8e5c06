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
  ``:4096:8`` (32 MiB) from Hopper on (``CublasHandlePool.cpp``; the recorded
  H200 steps: 32 MiB each). Training uses two handles: the forward runs on the
  main thread, the backward on the autograd engine's device thread. A thread's
  first product with a bias epilogue (cuBLASLt) also makes cuBLASLt's workspace
  (``CUBLASLT_WORKSPACE_SIZE``, 1 MiB by default);
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
from vramctl.estimator._calibration import CUBLASLT_WORKSPACE_BYTES, TRAIN_HANDLES, Calibration

__all__ = [
    "builtin",
    "constants",
    "context_bytes",
    "cublas_workspace_bytes",
    "device_uncertainty",
]

MiB = 2**20

#: CUDA context by compute capability major version (lazy loading, CUDA 12).
CONTEXT_BYTES: dict[int, int] = {7: 310 * MiB, 8: 420 * MiB, 9: 520 * MiB, 10: 560 * MiB}
CONTEXT_DEFAULT = 520 * MiB

CUBLAS_WORKSPACE_BYTES = 4096 * 1024 * 2 + 16 * 1024 * 8
CUBLAS_WORKSPACE_HOPPER_BYTES = 4096 * 1024 * 8
CUDNN_WORKSPACE_CAP = 1024 * MiB
#: A convolution's cuDNN workspace, as a multiple of its largest output.
CUDNN_WORKSPACE_RATIO = 1.0


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
        cublaslt_workspace_bytes=CUBLASLT_WORKSPACE_BYTES,
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


# -- how far above the modelled figure nvidia-smi may read -----------------------------
#
# The constants above model a context-light stack: CUDA 12 with lazy module loading (the
# default on Linux from CUDA 12.2; it needs a driver of 515 or newer, and a library built
# before CUDA 11.7 loads all of its kernels at start) and cuDNN's heuristics picking each
# convolution's algorithm (``torch.backends.cudnn.benchmark`` off). A real process differs
# mostly upwards:
#
# - eager module loading (an older CUDA or driver, ``CUDA_MODULE_LOADING=EAGER``) puts
#   every kernel image of PyTorch, cuBLAS and cuDNN that the GPU's architecture can run on
#   the device at start: a context of one to two GiB in place of a few hundred MiB;
# - even with lazy loading, each kernel a step uses for the first time loads its module,
#   so a model with many distinct kernels holds more context than the modelled one;
# - ``cudnn.benchmark=True`` times every algorithm of each new convolution shape with
#   the workspace it asks for, and the caching allocator keeps those blocks reserved;
#   cuDNN's own kernels join the context.
#
# Published ``nvidia-smi`` figures for ResNet-50 training at batch 32-64 on an older CUDA
# stack sit about 1.5 GB above a context-light prediction. Without a profile for the GPU,
# an estimate therefore says that ``nvidia-smi`` may read up to 1 GiB more (the context),
# and 1.5 GiB more for a step with convolutions (cuDNN's kernels and autotuning). A profile
# measured on the same GPU model with this software stack (``vramctl calibrate``) leaves
# the kernels its workloads did not load: 128 MiB. One measured on another GPU (of the
# same compute capability, or named explicitly) leaves what differs by GPU model, its
# kernel images and cuDNN's choices: 512 MiB. A CPU target has no context: 0.
#
# These are allowances, not measurements. Where the profile carries evidence from steps
# recorded on that GPU (``Calibration.evidence``: the largest share by which NVML's
# reading exceeded the estimate over a recorded corpus), the allowance is that share of
# the estimated device peak, rounded up to a MiB, in place of the 128 MiB: the range is
# what was seen there, narrower or wider.

#: ``nvidia-smi`` may read this much above an estimate made with the built-in constants.
UNCALIBRATED_UNCERTAINTY = 1024 * MiB
#: ... and this much more when the step runs convolutions (cuDNN's kernels, autotuning).
UNCALIBRATED_CONVOLUTION_UNCERTAINTY = 512 * MiB
#: With a profile measured on another GPU model.
OTHER_GPU_UNCERTAINTY = 512 * MiB
#: With a profile measured on this GPU model.
CALIBRATED_UNCERTAINTY = 128 * MiB


def device_uncertainty(
    calibration: Calibration | None, same_gpu: bool, convolutions: bool, peak_device: int = 0
) -> int:
    """Bytes ``nvidia-smi`` may read above the modelled device peak of a CUDA step.

    ``calibration`` is the profile used (None: the built-in constants), ``same_gpu``
    whether it was measured on the target's GPU model, ``convolutions`` whether the
    step runs any. The figures and their reasons are above; a profile with evidence from
    recorded steps on the target's GPU gives the largest shortfall seen there instead, in
    proportion to ``peak_device`` (the estimated device peak).
    """
    if calibration is None:
        return UNCALIBRATED_UNCERTAINTY + (
            UNCALIBRATED_CONVOLUTION_UNCERTAINTY if convolutions else 0
        )
    if not same_gpu:
        return OTHER_GPU_UNCERTAINTY
    if calibration.evidence is not None:
        return calibration.evidence.allowance(peak_device)
    return CALIBRATED_UNCERTAINTY
