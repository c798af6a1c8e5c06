"""Calibration profiles: a GPU's CUDA constants, measured on it, for later estimates.

A CPU trace counts tensor bytes exactly; what a CUDA device adds (the context,
cuBLAS and cuDNN workspaces, the caching allocator's rounding) is modelled with
constants (:mod:`vramctl.estimator._cuda_model`). ``vramctl calibrate``
measures them on a real GPU (:mod:`vramctl.estimator._calibrate`) and writes a
*profile*, a JSON file; later estimates for that GPU, or for one of the same
compute capability, use it in place of the built-in values.

Where profiles live: ``$VRAMCTL_CONFIG_DIR/calibration/``, else
``$XDG_CONFIG_HOME/vramctl/calibration/``, else ``~/.config/vramctl/calibration/``.
``VRAMCTL_CALIBRATION`` names one profile file to use for every CUDA estimate,
or is ``off`` to use the built-in constants.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from vramctl._errors import VramctlError
from vramctl.device import ComputeCapability
from vramctl.estimator._allocator import AllocatorConfig
from vramctl.estimator._conv_workspace import probe_table, workspace_lines

#: cuBLAS handles a training step uses: the forward's thread and autograd's device thread,
#: each with its workspace (seen in every recorded training step on an H200).
TRAIN_HANDLES = 2
#: PyTorch's default cuBLASLt workspace (``CUBLASLT_WORKSPACE_SIZE``, 1024 KiB), made
#: apart from the cuBLAS workspace by a thread's first product with a bias epilogue (the
#: recorded H200 steps: 1 MiB at the forward's first ``addmm``).
CUBLASLT_WORKSPACE_BYTES = 1024 * 1024
#: Device memory outside the caching allocator that PyTorch's pool of side streams takes,
#: where a profile did not measure it. A process's first ``torch.cuda.Stream()`` (or
#: NCCL's process group, which takes its streams from the pool) makes the whole pool at
#: once: 32 streams per priority level, up to 4 levels (``c10/cuda/CUDAStream.cpp``). On
#: the H200 (CUDA 13, torch 2.11) NVML's reading of the capture's process rose 70 MiB at
#: its first case with a side stream; no other case of 198 added more than 16 MiB.
STREAM_POOL_BYTES = 70 * 1024 * 1024

__all__ = [
    "Calibration",
    "CalibrationError",
    "CalibrationSource",
    "DeviceEvidence",
    "calibration_dir",
    "find_calibration",
    "fit_constants",
    "list_calibrations",
    "load_calibration",
    "measured_on",
    "resolve_calibration",
    "workspace_envelope",
]

log = logging.getLogger(__name__)

SCHEMA = "vramctl.calibration/1"
#: Environment variable naming the configuration directory.
ENV_CONFIG_DIR = "VRAMCTL_CONFIG_DIR"
#: Environment variable naming one profile to use, or ``off``.
ENV_CALIBRATION = "VRAMCTL_CALIBRATION"
MiB = 2**20

#: The allocator constants a calibration may measure (``AllocatorConfig`` field names).
ALLOCATOR_FIELDS = (
    "min_block",
    "small_size",
    "small_buffer",
    "large_buffer",
    "min_large_alloc",
    "round_large",
)


class CalibrationError(VramctlError):
    """A profile that cannot be read or made; the message names the file and the field."""


@dataclass(frozen=True)
class DeviceEvidence:
    """How far ``nvidia-smi`` read above the estimate over a GPU's recorded steps.

    Over ``steps`` steps of the recorded corpus named by ``source``, ``shortfall_pct`` is the
    largest amount by which a step's device peak (NVML's reading for the process) exceeded
    the estimated device peak of the same step, in percent of that estimate (0 where none
    did); ``shortfall`` the largest in bytes. An estimate for that GPU then says
    ``nvidia-smi`` may read up to ``shortfall_pct`` more than its device peak, in place of a
    fixed allowance: a range that covered every recorded step. ``median_pct`` is the median
    absolute error of those steps, ``created`` when it was worked out (by the estimator of
    that day: a later one may differ).
    """

    source: str
    steps: int
    shortfall_pct: float
    shortfall: int = 0
    median_pct: float = 0.0
    created: str = ""

    def allowance(self, peak_device: int) -> int:
        """Bytes above an estimated device peak that the evidence allows, to a MiB."""
        return -(-math.ceil(peak_device * self.shortfall_pct / 100.0) // MiB) * MiB

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "steps": self.steps,
            "shortfall_pct": self.shortfall_pct,
            "shortfall_bytes": self.shortfall,
            "median_pct": self.median_pct,
            "created": self.created,
        }

    @classmethod
    def from_dict(cls, doc: Any, source: str = "the profile") -> DeviceEvidence:
        where = f"{source}: field 'evidence.device_peak"
        if not isinstance(doc, dict):
            raise CalibrationError(f"{where}' must be an object")
        steps, short = doc.get("steps"), doc.get("shortfall_bytes", 0)
        for name, v, lo in (("steps", steps, 1), ("shortfall_bytes", short, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise CalibrationError(
                    f"{where}.{name}' must be an integer of at least {lo}, got {v!r}"
                )
        numbers: dict[str, float] = {}
        for name in ("shortfall_pct", "median_pct"):
            v = doc.get(name, None if name == "shortfall_pct" else 0.0)
            if (
                isinstance(v, bool)
                or not isinstance(v, (int, float))
                or not math.isfinite(v)
                or v < 0
            ):
                raise CalibrationError(f"{where}.{name}' must be a number of at least 0, got {v!r}")
            numbers[name] = float(v)
        assert isinstance(steps, int) and isinstance(short, int)
        return cls(
            source=str(doc.get("source", "")),
            steps=steps,
            shortfall_pct=numbers["shortfall_pct"],
            shortfall=short,
            median_pct=numbers["median_pct"],
            created=str(doc.get("created", "")),
        )

    def describe(self) -> str:
        what = f"{self.steps} recorded steps"
        return f"{what} ({self.source})" if self.source else what


def _evidence(doc: Any, source: str) -> DeviceEvidence | None:
    if doc is None:
        return None
    if not isinstance(doc, dict):
        raise CalibrationError(f"{source}: field 'evidence' must be an object")
    peak = doc.get("device_peak")
    return None if peak is None else DeviceEvidence.from_dict(peak, source)


@dataclass(frozen=True)
class Calibration:
    """CUDA constants measured on one GPU with one software stack.

    ``context_bytes`` is the CUDA context of a process that has run matrix
    multiplies (the driver's state and the kernels it loaded); a step with
    convolutions adds ``cudnn_context_bytes`` (cuDNN's kernels). Each cuBLAS
    handle keeps ``cublas_workspace_bytes``; a training step uses
    ``train_handles`` of them (the backward runs on autograd's device thread). The
    forward's handle also makes ``cublaslt_workspace_bytes`` for cuBLASLt at its first
    product with a bias epilogue (``addmm`` with a bias vector); None in profiles measured
    before the two were told apart, whose ``cublas_workspace_bytes`` holds both (see
    :meth:`cublas_split`).
    A convolution's cuDNN workspace is modelled as ``cudnn_workspace_fixed``
    plus ``cudnn_workspace_ratio`` times its largest output, at most
    ``cudnn_workspace_cap``: the line lies on or above every convolution
    measured, as low as it can (their upper envelope). ``cudnn_workspaces`` holds
    the workspace recorded on this GPU for each convolution call seen in a recorded
    corpus (by its shapes and arguments, cuDNN's heuristics' choice with
    ``cudnn.benchmark`` off); those calls take it in place of the line, and other calls
    of a kind the table holds take ``cudnn_workspace_lines``' line for their kind.
    """

    device: str
    capability: ComputeCapability | None
    context_bytes: int
    cudnn_context_bytes: int
    cublas_workspace_bytes: int
    train_handles: int
    cudnn_workspace_ratio: float
    cudnn_workspace_cap: int
    cudnn_workspace_fixed: int = 0
    #: cuBLASLt's workspace, made by the forward's first bias-epilogue product (None:
    #: included in ``cublas_workspace_bytes``, as profiles before 2026-11-30 measured it).
    cublaslt_workspace_bytes: int | None = None
    #: Recorded workspaces by convolution call (``conv_key``); others take their kind's
    #: line, else the one line.
    cudnn_workspaces: Mapping[str, int] = field(default_factory=dict)
    #: A line per kind of convolution fitted to ``cudnn_workspaces``' calls
    #: (:func:`~vramctl.estimator._conv_workspace.workspace_lines`): ``(fixed bytes, per
    #: activation byte, per weight byte)`` by kind, as ``"forward:dense"``, and by kind and
    #: dtype, as ``"forward:dense:float32"``.
    cudnn_workspace_lines: Mapping[str, tuple[int, float, float]] = field(default_factory=dict)
    #: Device memory outside the allocator that PyTorch's pool of side streams took when
    #: the process first asked for one (None: not measured, as profiles before 2026-12-01;
    #: :meth:`stream_pool` gives :data:`STREAM_POOL_BYTES` then).
    stream_pool_bytes: int | None = None
    allocator: AllocatorConfig = field(default_factory=AllocatorConfig)
    #: Versions the figures were measured with: torch, cuda, cudnn, driver.
    software: Mapping[str, str] = field(default_factory=dict)
    #: ISO 8601 time of the measurement.
    created: str = ""
    #: The raw readings the constants were fitted from.
    measurements: Mapping[str, Any] = field(default_factory=dict, compare=False)
    #: The file it was read from or written to.
    path: Path | None = field(default=None, compare=False)
    #: How far the device peak read above the estimate over recorded steps on this GPU
    #: (None: no recorded steps; estimates keep a fixed allowance).
    evidence: DeviceEvidence | None = None

    def cublas_split(self) -> tuple[int, int]:
        """``(cuBLAS workspace per handle, cuBLASLt workspace)``. A profile that measured
        them together gives PyTorch's default cuBLASLt size
        (:data:`CUBLASLT_WORKSPACE_BYTES`) of its figure to cuBLASLt: its probe's first
        products were a plain matrix product and a linear layer with a bias, and the
        recorded H200 steps show that a thread without a bias product (autograd's device
        thread) makes the rest alone (32 of the profile's 33 MiB)."""
        if self.cublaslt_workspace_bytes is not None:
            return self.cublas_workspace_bytes, self.cublaslt_workspace_bytes
        whole = self.cublas_workspace_bytes
        lt = CUBLASLT_WORKSPACE_BYTES if whole > 2 * CUBLASLT_WORKSPACE_BYTES else 0
        return whole - lt, lt

    def stream_pool(self) -> int:
        """What a step that uses side streams adds outside the allocator: the pool
        PyTorch makes at a process's first ``torch.cuda.Stream()``, or NCCL's process
        group's (the measured figure, else :data:`STREAM_POOL_BYTES`)."""
        if self.stream_pool_bytes is not None:
            return self.stream_pool_bytes
        return STREAM_POOL_BYTES

    def describe(self) -> str:
        """One line: which GPU, when, with what."""
        cc = f" (sm {self.capability.major}.{self.capability.minor})" if self.capability else ""
        soft = ", ".join(f"{k} {v}" for k, v in self.software.items() if v)
        when = self.created[:10] or "undated"
        return f"{self.device}{cc}, {when}" + (f", {soft}" if soft else "")

    def to_dict(self) -> dict[str, Any]:
        cc = self.capability
        return {
            "schema": SCHEMA,
            "device": self.device,
            "capability": f"{cc.major}.{cc.minor}" if cc else None,
            "created": self.created,
            "software": dict(self.software),
            "constants": {
                "context_bytes": self.context_bytes,
                "cudnn_context_bytes": self.cudnn_context_bytes,
                "cublas_workspace_bytes": self.cublas_workspace_bytes,
                **(
                    {"cublaslt_workspace_bytes": self.cublaslt_workspace_bytes}
                    if self.cublaslt_workspace_bytes is not None
                    else {}
                ),
                **(
                    {"stream_pool_bytes": self.stream_pool_bytes}
                    if self.stream_pool_bytes is not None
                    else {}
                ),
                "train_handles": self.train_handles,
                "cudnn_workspace_ratio": self.cudnn_workspace_ratio,
                "cudnn_workspace_cap": self.cudnn_workspace_cap,
                "cudnn_workspace_fixed": self.cudnn_workspace_fixed,
                **(
                    {"cudnn_workspaces": dict(sorted(self.cudnn_workspaces.items()))}
                    if self.cudnn_workspaces
                    else {}
                ),
                **(
                    {
                        "cudnn_workspace_lines": {
                            k: list(v) for k, v in sorted(self.cudnn_workspace_lines.items())
                        }
                    }
                    if self.cudnn_workspace_lines
                    else {}
                ),
                "allocator": {k: getattr(self.allocator, k) for k in ALLOCATOR_FIELDS},
            },
            "measurements": dict(self.measurements),
            **(
                {"evidence": {"device_peak": self.evidence.to_dict()}}
                if self.evidence is not None
                else {}
            ),
        }

    @classmethod
    def from_dict(cls, doc: Any, source: str = "the profile") -> Calibration:
        """Read a profile document; a missing or wrong field is a :class:`CalibrationError`."""
        if not isinstance(doc, dict):
            raise CalibrationError(f"{source}: expected a JSON object, got {type(doc).__name__}")
        if doc.get("schema") != SCHEMA:
            raise CalibrationError(
                f"{source}: field 'schema' is {doc.get('schema')!r}, expected {SCHEMA!r} "
                "(run `vramctl calibrate` again to write a current profile)"
            )
        device = doc.get("device")
        if not isinstance(device, str) or not device:
            raise CalibrationError(f"{source}: field 'device' must be the GPU's name")
        cc_text = doc.get("capability")
        cc = None
        if cc_text is not None:
            try:
                cc = ComputeCapability.parse(str(cc_text))
            except ValueError:
                raise CalibrationError(
                    f"{source}: field 'capability' is {cc_text!r}, expected a form like 9.0"
                ) from None
        consts = doc.get("constants")
        if not isinstance(consts, dict):
            raise CalibrationError(f"{source}: field 'constants' must be an object")

        def size(key: str, lo: int = 0) -> int:
            v = consts.get(key)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise CalibrationError(
                    f"{source}: field 'constants.{key}' must be an integer of at least {lo}, "
                    f"got {v!r}"
                )
            return v

        ratio = consts.get("cudnn_workspace_ratio")
        if (
            isinstance(ratio, bool)
            or not isinstance(ratio, (int, float))
            or not math.isfinite(ratio)
            or ratio < 0
        ):
            raise CalibrationError(
                f"{source}: field 'constants.cudnn_workspace_ratio' must be a number of at "
                f"least 0, got {ratio!r}"
            )
        fixed_given = "cudnn_workspace_fixed" in consts
        alloc_doc = consts.get("allocator", {})
        if not isinstance(alloc_doc, dict):
            raise CalibrationError(f"{source}: field 'constants.allocator' must be an object")
        alloc_kw: dict[str, Any] = {}
        for k in ALLOCATOR_FIELDS:
            if k in alloc_doc:
                v = alloc_doc[k]
                if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                    raise CalibrationError(
                        f"{source}: field 'constants.allocator.{k}' must be a positive "
                        f"integer, got {v!r}"
                    )
                alloc_kw[k] = v
        table = consts.get("cudnn_workspaces", {})
        if not isinstance(table, dict) or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
            for k, v in table.items()
        ):
            raise CalibrationError(
                f"{source}: field 'constants.cudnn_workspaces' must map convolution keys to "
                "byte counts of at least 0"
            )
        lines = _workspace_lines(consts.get("cudnn_workspace_lines", {}), source)
        software = doc.get("software", {})
        if not isinstance(software, dict):
            raise CalibrationError(f"{source}: field 'software' must be an object")
        measurements = doc.get("measurements", {})
        handles = size("train_handles", 1)
        cub = measurements.get("cublas") if isinstance(measurements, dict) else None
        if handles == 1 and isinstance(cub, dict) and stale_backward_probe(cub):
            handles = TRAIN_HANDLES  # see stale_backward_probe
        return cls(
            device=device,
            capability=cc,
            context_bytes=size("context_bytes"),
            cudnn_context_bytes=size("cudnn_context_bytes"),
            cublas_workspace_bytes=size("cublas_workspace_bytes"),
            cublaslt_workspace_bytes=(
                size("cublaslt_workspace_bytes") if "cublaslt_workspace_bytes" in consts else None
            ),
            train_handles=handles,
            cudnn_workspace_ratio=float(ratio),
            cudnn_workspace_cap=size("cudnn_workspace_cap"),
            # Profiles written before the fixed part was measured have none.
            cudnn_workspace_fixed=size("cudnn_workspace_fixed") if fixed_given else 0,
            cudnn_workspaces=table,
            cudnn_workspace_lines=lines,
            stream_pool_bytes=(
                size("stream_pool_bytes") if "stream_pool_bytes" in consts else None
            ),
            allocator=AllocatorConfig(**alloc_kw),
            software={str(k): str(v) for k, v in software.items() if v is not None},
            created=str(doc.get("created", "")),
            measurements=measurements if isinstance(measurements, dict) else {},
            evidence=_evidence(doc.get("evidence"), source),
        )

    def save(self, path: str | os.PathLike[str] | None = None) -> Calibration:
        """Write the profile (atomically) to ``path``, else to the default place for its GPU.

        Returns the calibration with ``path`` set.
        """
        target = Path(path) if path is not None else default_path(self.device, self.capability)
        target = target.expanduser()
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".calibration-", dir=target.parent)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(self.to_dict(), f, indent=2)
                f.write("\n")
            os.replace(tmp, target)
        except OSError as exc:
            with contextlib.suppress(NameError, OSError):
                os.unlink(tmp)
            raise CalibrationError(
                f"cannot write the calibration profile to {str(target)!r}: "
                f"{exc.strerror or exc}; pass a writable path"
            ) from None
        return replace(self, path=target)


def calibration_dir(config_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where profiles are kept: the ``calibration/`` folder of the configuration directory.

    The configuration directory is ``config_dir``, else ``$VRAMCTL_CONFIG_DIR``,
    else ``$XDG_CONFIG_HOME/vramctl``, else ``~/.config/vramctl``.
    """
    if config_dir is not None:
        base = Path(config_dir)
    elif os.environ.get(ENV_CONFIG_DIR):
        base = Path(os.environ[ENV_CONFIG_DIR])
    elif os.environ.get("XDG_CONFIG_HOME"):
        base = Path(os.environ["XDG_CONFIG_HOME"]) / "vramctl"
    else:
        base = Path.home() / ".config" / "vramctl"
    return base.expanduser() / "calibration"


def _norm(name: str) -> str:
    return " ".join(name.lower().split())


def default_path(
    device: str,
    capability: ComputeCapability | None,
    config_dir: str | os.PathLike[str] | None = None,
) -> Path:
    """The file a profile of ``device`` is saved to by default."""
    slug = re.sub(r"[^a-z0-9]+", "-", _norm(device)).strip("-") or "gpu"
    if capability is not None:
        slug += f"-sm{capability.major}{capability.minor}"
    return calibration_dir(config_dir) / f"{slug}.json"


def load_calibration(path: str | os.PathLike[str]) -> Calibration:
    """Read one profile file."""
    p = Path(path).expanduser()
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CalibrationError(
            f"no calibration profile at {str(p)!r}; run `vramctl calibrate` on the GPU to make one"
        ) from None
    except OSError as exc:
        raise CalibrationError(
            f"cannot read the calibration profile {str(p)!r}: {exc.strerror or exc}"
        ) from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CalibrationError(
            f"{p}: line {exc.lineno}: not valid JSON ({exc.msg}); run `vramctl calibrate` again"
        ) from None
    return replace(Calibration.from_dict(doc, str(p)), path=p)


def list_calibrations(config_dir: str | os.PathLike[str] | None = None) -> list[Calibration]:
    """Every readable profile in the calibration directory, newest first.

    A file that cannot be read is skipped with a warning naming it.
    """
    folder = calibration_dir(config_dir)
    found: list[Calibration] = []
    if not folder.is_dir():
        return found
    for p in sorted(folder.glob("*.json")):
        try:
            found.append(load_calibration(p))
        except CalibrationError as exc:
            log.warning("skipping a calibration profile: %s", exc)
    found.sort(key=lambda c: c.created, reverse=True)
    return found


def _catalog_name(device: str) -> str | None:
    from vramctl.device import gpu_spec
    from vramctl.device._shared import match_gpu_name

    spec = match_gpu_name(device)
    if spec is None:
        with contextlib.suppress(VramctlError):
            spec = gpu_spec(device.removeprefix("sim:"))
    return spec.name if spec is not None else None


def measured_on(cal: Calibration, device: str) -> bool:
    """Whether ``cal`` was measured on ``device``'s GPU model (its name, or its catalog model:
    a profile of ``NVIDIA A10G`` is for ``A10G-24GB``), not merely one of its capability."""
    if _norm(cal.device) == _norm(device):
        return True
    model = _catalog_name(device)
    return model is not None and _catalog_name(cal.device) == model


def find_calibration(
    device: str,
    capability: ComputeCapability | None,
    config_dir: str | os.PathLike[str] | None = None,
) -> Calibration | None:
    """The profile later estimates for ``device`` use, or None for the built-in constants.

    ``$VRAMCTL_CALIBRATION`` decides first: ``off`` gives None, a path gives that
    file's profile (an error if it cannot be read). Otherwise the newest profile
    of a GPU with the same name, else of the same catalog model (``NVIDIA A10G``
    for ``A10G-24GB``), else the newest of the same compute capability.
    """
    env = os.environ.get(ENV_CALIBRATION, "").strip()
    if env.lower() in ("off", "none", "0", "false", "no"):
        return None
    if env:
        return load_calibration(env)
    profiles = list_calibrations(config_dir)
    name = _norm(device)
    for c in profiles:
        if _norm(c.device) == name:
            return c
    model = _catalog_name(device)
    if model is not None:
        for c in profiles:
            if _catalog_name(c.device) == model:
                return c
    if capability is not None:
        for c in profiles:
            if c.capability == capability:
                return c
    return None


#: What ``calibration=`` accepts: a profile, a profile's path, True/None (look one up), False.
CalibrationSource = Calibration | str | os.PathLike[str] | bool | None


def resolve_calibration(
    source: CalibrationSource, device: str, capability: ComputeCapability | None
) -> Calibration | None:
    """Turn a ``calibration=`` argument into a profile (None: the built-in constants)."""
    if source is False:
        return None
    if source is None or source is True:
        return find_calibration(device, capability)
    if isinstance(source, Calibration):
        return source
    if isinstance(source, (str, os.PathLike)):
        return load_calibration(source)
    raise CalibrationError(
        f"calibration must be a Calibration, a profile's path, True or False; got "
        f"{type(source).__name__}"
    )


# -- from readings to constants ----------------------------------------------------------


def _int(doc: Mapping[str, Any], key: str, where: str) -> int | None:
    v = doc.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
        raise CalibrationError(f"measurements: '{where}.{key}' must be bytes, got {v!r}")
    return int(v)


def stale_backward_probe(cublas: Mapping[str, Any]) -> bool:
    """Whether a profile's ``backward_extra`` reading is void: measured after another
    thread had finished its matrix multiplies (profiles before 2026-11-27), so autograd's
    thread took that thread's pooled handle and workspace and seemed to keep none."""
    return not cublas.get("backward_first") and cublas.get("other_thread") is not None


def fit_constants(
    measurements: Mapping[str, Any], defaults: Calibration
) -> tuple[Calibration, list[str]]:
    """Set ``defaults``' constants from the readings of :func:`~._calibrate.measure`.

    Returns the calibration and notes on what could not be measured (where
    the built-in value is kept). The readings are:

    - ``context``: ``after_matmul`` and ``after_conv``, the process's device
      memory outside the caching allocator after each kind of work;
    - ``cublas``: ``per_handle``, the allocator bytes a thread's first matrix
      multiplies kept (a plain product, then a linear layer with a bias), ``lt``,
      what the second alone kept (cuBLASLt's workspace; profiles before 2026-11-30
      lack it), and ``backward_extra``, what a first backward kept beyond its
      gradients (the autograd thread's handles);
    - ``cudnn``: one row per convolution call, with ``output_bytes`` (its
      largest output) and ``workspace_bytes`` (its peak beyond inputs and
      outputs); the line kept lies on or above every one, so that no measured call is
      under-counted, each call's workspace goes into ``cudnn_workspaces`` by its key
      (``key``, or the one its label and dtype give), and a kind with enough of them gets
      its own line (``cudnn_workspace_lines``);
    - ``streams``: ``before`` and ``after``, the device memory outside the allocator
      before and after the process's first side stream (PyTorch's stream pool);
    - ``allocator``: the constants read off real segment sizes.
    """
    notes: list[str] = []
    ctx = measurements.get("context") or {}
    after_mm = _int(ctx, "after_matmul", "context")
    after_conv = _int(ctx, "after_conv", "context")
    context = defaults.context_bytes
    cudnn_context = defaults.cudnn_context_bytes
    if after_mm is None:
        notes.append("the CUDA context could not be read (no NVML); kept the built-in value")
    else:
        context = after_mm
        if after_conv is not None:
            cudnn_context = max(0, after_conv - after_mm)

    cub = measurements.get("cublas") or {}
    per_handle = _int(cub, "per_handle", "cublas")
    extra = _int(cub, "backward_extra", "cublas")
    workspace, handles = defaults.cublas_workspace_bytes, defaults.train_handles
    lt_bytes = defaults.cublaslt_workspace_bytes
    if per_handle:
        workspace = per_handle
        lt = _int(cub, "lt", "cublas")
        if lt is not None and 0 <= lt < per_handle:
            # measured apart: the plain product's workspace, then the bias product's
            workspace, lt_bytes = per_handle - lt, lt
        else:
            lt_bytes = None  # measured together (see Calibration.cublas_split)
        if extra is not None and not stale_backward_probe(cub):
            handles = 1 + round(extra / workspace)
        elif extra is not None:
            notes.append(
                "the backward's cuBLAS workspace was measured after another thread's; kept "
                f"the built-in {handles} handles for training"
            )
    else:
        notes.append("no cuBLAS workspace was seen; kept the built-in value")

    ratio, cap = defaults.cudnn_workspace_ratio, defaults.cudnn_workspace_cap
    fixed = defaults.cudnn_workspace_fixed
    rows = [r for r in measurements.get("cudnn") or [] if r.get("output_bytes")]
    table, lines = dict(defaults.cudnn_workspaces), dict(defaults.cudnn_workspace_lines)
    if rows:
        points = [(int(r["output_bytes"]), max(0, int(r["workspace_bytes"]))) for r in rows]
        ratio, fixed = workspace_envelope(points)
        cap = max(cap, *(ws for _, ws in points))
        # each measured call by its key, and a line per kind with enough of them
        table = {**probe_table(rows), **table}
        lines = workspace_lines(table)
    else:
        notes.append("no convolution was measured; kept the built-in cuDNN workspace rule")

    streams = measurements.get("streams") or {}
    pool_before = _int(streams, "before", "streams")
    pool_after = _int(streams, "after", "streams")
    pool = defaults.stream_pool_bytes
    if pool_before is not None and pool_after is not None:
        pool = max(0, pool_after - pool_before)
    elif streams:
        notes.append(
            "the stream pool's memory could not be read (no NVML); kept the built-in value"
        )

    alloc_doc = measurements.get("allocator") or {}
    allocator = defaults.allocator
    if alloc_doc.get("expandable_segments"):
        notes.append(
            "expandable_segments was on while calibrating: the probes read pages, not "
            "segments; kept the default constants (a step run with expandable segments is "
            "priced as such with allocator_config=, or the CLI's --alloc-conf)"
        )
    else:
        kw: dict[str, Any] = {k: int(alloc_doc[k]) for k in ALLOCATOR_FIELDS if alloc_doc.get(k)}
        allocator = replace(allocator, **kw)

    cal = replace(
        defaults,
        context_bytes=context,
        cudnn_context_bytes=cudnn_context,
        cublas_workspace_bytes=workspace,
        cublaslt_workspace_bytes=lt_bytes,
        train_handles=max(1, handles),
        cudnn_workspace_ratio=ratio,
        cudnn_workspace_cap=cap,
        cudnn_workspace_fixed=fixed,
        cudnn_workspaces=table,
        cudnn_workspace_lines=lines,
        stream_pool_bytes=pool,
        allocator=allocator,
        measurements=dict(measurements),
    )
    return cal, notes


def _workspace_lines(doc: Any, source: str) -> dict[str, tuple[int, float, float]]:
    """``constants.cudnn_workspace_lines``: each kind's ``[fixed bytes, per activation
    byte, per weight byte]``, all at least 0."""
    out: dict[str, tuple[int, float, float]] = {}

    def number(v: Any) -> bool:
        return (
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
        )

    ok = isinstance(doc, dict)
    for kind, line in doc.items() if ok else ():
        if (
            isinstance(line, list)
            and len(line) == 3
            and all(number(v) for v in line)
            and isinstance(line[0], int)
        ):
            out[str(kind)] = (int(line[0]), float(line[1]), float(line[2]))
        else:
            ok = False
    if not ok:
        raise CalibrationError(
            f"{source}: field 'constants.cudnn_workspace_lines' must map convolution kinds to "
            "[fixed bytes, per activation byte, per weight byte], each at least 0"
        )
    return out


def workspace_envelope(points: list[tuple[int, int]]) -> tuple[float, int]:
    """``(ratio, fixed)`` of the lowest line ``fixed + ratio * output`` that lies on or
    above every ``(output_bytes, workspace_bytes)`` point, both at least 0.

    A workspace is not proportional to the output (a small backward can take 100
    times its output), so the largest ratio alone would charge large convolutions
    gigabytes. The line minimises its total over the points (a linear programme in
    two unknowns: its optimum is at a vertex, one of the candidate slopes here).
    """
    slopes = {0.0}
    for i, (x1, y1) in enumerate(points):
        if x1 > 0:
            slopes.add(y1 / x1)
        for x2, y2 in points[i + 1 :]:
            if x1 != x2 and (y2 - y1) / (x2 - x1) > 0:
                slopes.add((y2 - y1) / (x2 - x1))
    total = sum(x for x, _ in points)
    best: tuple[float, float, int] | None = None
    for r in sorted(slopes):
        ratio = math.ceil(r * 1000) / 1000  # rounded up: the line stays above the points
        fixed = max(0, math.ceil(max(y - ratio * x for x, y in points)))
        cost = len(points) * fixed + ratio * total
        if best is None or cost < best[0]:
            best = (cost, ratio, fixed)
    assert best is not None
    return best[1], best[2]


def constant_rows(cal: Calibration, builtin: Calibration) -> list[tuple[str, Any, Any]]:
    """(name, built-in, calibrated) for each constant, for tables."""
    rows: list[tuple[str, Any, Any]] = [
        ("CUDA context", builtin.context_bytes, cal.context_bytes),
        ("cuDNN context (convolutions)", builtin.cudnn_context_bytes, cal.cudnn_context_bytes),
        ("cuBLAS workspace per handle", builtin.cublas_split()[0], cal.cublas_split()[0]),
        ("cuBLASLt workspace (bias products)", builtin.cublas_split()[1], cal.cublas_split()[1]),
        ("cuBLAS handles in training", builtin.train_handles, cal.train_handles),
        ("cuDNN workspace / output", builtin.cudnn_workspace_ratio, cal.cudnn_workspace_ratio),
        ("cuDNN workspace base", builtin.cudnn_workspace_fixed, cal.cudnn_workspace_fixed),
        ("cuDNN workspace cap", builtin.cudnn_workspace_cap, cal.cudnn_workspace_cap),
        ("stream pool (side streams, NCCL)", builtin.stream_pool(), cal.stream_pool()),
    ]
    for f in fields(AllocatorConfig):
        if f.name in ALLOCATOR_FIELDS:
            rows.append(
                (
                    f"allocator {f.name}",
                    getattr(builtin.allocator, f.name),
                    getattr(cal.allocator, f.name),
                )
            )
    return rows
