"""A catalog of common NVIDIA GPUs: memory as the driver reports it, and compute capability.

The simulated devices (:func:`vramctl.simulate`) and the estimator use it.
``total_bytes`` is the memory total NVML reports (what ``nvidia-smi`` prints in
MiB), which is a little less than the marketing size: the driver keeps some
back (ECC, firmware). PyTorch can allocate less again: the CUDA context takes
a few hundred MiB more once a process starts (see ``docs/simulate.md``).

>>> from vramctl import gpu_spec
>>> spec = gpu_spec("t4")
>>> spec.name, spec.total_mib, str(spec.capability)
('T4-16GB', 15360, '7.5')
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field, replace

from vramctl._errors import UnknownDeviceError
from vramctl.device._capability import ComputeCapability

__all__ = ["GpuSpec", "catalog", "catalog_miss", "gpu_spec", "match_gpu_name"]

MiB = 2**20


@dataclass(frozen=True)
class GpuSpec:
    """One catalog entry."""

    name: str
    total_mib: int
    #: The capacity PyTorch sees (``cudaMemGetInfo`` total, the "total capacity" of an
    #: OOM message) on recent drivers, in GiB; less than the NVML total.
    cuda_total_gib: float
    capability: ComputeCapability
    #: Regular expression matched against NVML / PyTorch device names.
    pattern: str
    aliases: tuple[str, ...] = field(default=())
    note: str = ""
    #: Dense peak throughput in TFLOP/s by compute dtype ("fp32", "tf32", "bf16", "fp16"),
    #: from the vendor's data sheet (no sparsity); a dtype without tensor cores is absent.
    peak_tflops: tuple[tuple[str, float], ...] = field(default=())
    #: Peak memory bandwidth, GB/s (10^9 bytes per second).
    bandwidth_gbs: float = 0.0
    #: Host link (PCIe) bandwidth per direction, GB/s.
    host_gbs: float = 0.0
    #: Streaming multiprocessors (the data sheet's SM count): CUDA kernels size their
    #: grids, and some their scratch buffers, by it.
    multiprocessors: int = 0

    def peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s for a compute dtype; a dtype the GPU has no fast path for runs at
        the fp32 rate (bf16 on a V100 or T4 is emulated)."""
        table = dict(self.peak_tflops)
        return table.get(dtype, table.get("fp32", 0.0)) * 1e12

    @property
    def total_bytes(self) -> int:
        """Memory total as NVML reports it, in bytes."""
        return self.total_mib * MiB

    @property
    def cuda_total_bytes(self) -> int:
        """The capacity a CUDA process sees, in bytes (what a simulated device offers)."""
        return int(self.cuda_total_gib * 2**30)

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "total_bytes": self.total_bytes,
            "total_mib": self.total_mib,
            "cuda_total_bytes": self.cuda_total_bytes,
            "compute_capability": str(self.capability),
            "architecture": self.capability.architecture,
            "features": self.capability.features(),
            "aliases": list(self.aliases),
            "note": self.note,
            "peak_tflops": dict(self.peak_tflops),
            "bandwidth_gbs": self.bandwidth_gbs,
            "host_gbs": self.host_gbs,
            "multiprocessors": self.multiprocessors,
        }


def _cc(text: str) -> ComputeCapability:
    return ComputeCapability.parse(text)


# NVML totals (nvidia-smi's MiB) and CUDA-visible totals on R510 and later drivers,
# gathered from published nvidia-smi output and OOM messages; see docs/devices.md.
_CATALOG: tuple[GpuSpec, ...] = (
    GpuSpec("H200-141GB", 143771, 139.80, _cc("9.0"), r"\bH200\b", ("h200",)),
    GpuSpec(
        "H100-80GB",
        81559,
        79.11,
        _cc("9.0"),
        r"\bH100\b(?!.*(NVL|9[46]\s*GB))",
        ("h100",),
        "SXM5 and PCIe report the same total",
    ),
    GpuSpec("A100-80GB", 81920, 79.25, _cc("8.0"), r"\bA100\b.*80\s*GB", ("a100-80",)),
    GpuSpec("A100-40GB", 40960, 39.50, _cc("8.0"), r"\bA100\b(?!.*80\s*GB)", ("a100-40",)),
    GpuSpec("L40S-48GB", 46068, 44.40, _cc("8.9"), r"\bL40S\b", ("l40s",)),
    GpuSpec("A10G-24GB", 23028, 22.06, _cc("8.6"), r"\bA10G\b", ("a10g",), "AWS g5 instances"),
    GpuSpec("L4-24GB", 23034, 22.03, _cc("8.9"), r"\bL4\b", ("l4",)),
    GpuSpec("RTX4090-24GB", 24564, 23.64, _cc("8.9"), r"\b(RTX\s*)?4090\b", ("rtx4090", "4090")),
    GpuSpec("RTX3090-24GB", 24576, 23.70, _cc("8.6"), r"\b(RTX\s*)?3090\b", ("rtx3090", "3090")),
    GpuSpec("V100-32GB", 32768, 31.74, _cc("7.0"), r"\bV100\b.*32\s*GB", ("v100-32",)),
    GpuSpec("V100-16GB", 16384, 15.75, _cc("7.0"), r"\bV100\b(?!.*32\s*GB)", ("v100-16",)),
    GpuSpec("T4-16GB", 15360, 14.58, _cc("7.5"), r"\bT4\b", ("t4",)),
)


#: Dense peak TFLOP/s (fp32, tf32, bf16, fp16), memory bandwidth GB/s and PCIe GB/s per
#: direction, from NVIDIA's data sheets (SXM parts where there are two; the A10G and the
#: GeForce cards' tensor rates are those with fp32 accumulation).
_PEAKS: dict[str, tuple[float, float | None, float | None, float, float, float]] = {
    "H200-141GB": (67.0, 494.7, 989.4, 989.4, 4800.0, 64.0),
    "H100-80GB": (67.0, 494.7, 989.4, 989.4, 3350.0, 64.0),
    "A100-80GB": (19.5, 156.0, 312.0, 312.0, 2039.0, 32.0),
    "A100-40GB": (19.5, 156.0, 312.0, 312.0, 1555.0, 32.0),
    "L40S-48GB": (91.6, 183.0, 362.1, 362.1, 864.0, 32.0),
    "A10G-24GB": (31.2, 35.0, 70.0, 70.0, 600.0, 16.0),
    "L4-24GB": (30.3, 60.0, 121.0, 121.0, 300.0, 32.0),
    "RTX4090-24GB": (82.6, 82.6, 165.2, 165.2, 1008.0, 32.0),
    "RTX3090-24GB": (35.6, 35.6, 71.0, 71.0, 936.0, 32.0),
    "V100-32GB": (15.7, None, None, 125.0, 900.0, 16.0),
    "V100-16GB": (15.7, None, None, 125.0, 900.0, 16.0),
    "T4-16GB": (8.1, None, None, 65.0, 320.0, 16.0),
}


#: Streaming multiprocessors, from NVIDIA's data sheets (SXM parts where there are two).
_SMS = {
    "H200-141GB": 132,
    "H100-80GB": 132,
    "A100-80GB": 108,
    "A100-40GB": 108,
    "L40S-48GB": 142,
    "A10G-24GB": 80,
    "L4-24GB": 58,
    "RTX4090-24GB": 128,
    "RTX3090-24GB": 82,
    "V100-32GB": 80,
    "V100-16GB": 80,
    "T4-16GB": 40,
}


def _with_peaks(spec: GpuSpec) -> GpuSpec:
    fp32, tf32, bf16, fp16, bandwidth, host = _PEAKS[spec.name]
    rates = {"fp32": fp32, "tf32": tf32, "bf16": bf16, "fp16": fp16}
    return replace(
        spec,
        peak_tflops=tuple((k, v) for k, v in rates.items() if v is not None),
        bandwidth_gbs=bandwidth,
        host_gbs=host,
        multiprocessors=_SMS[spec.name],
    )


_CATALOG = tuple(_with_peaks(s) for s in _CATALOG)


def catalog() -> list[GpuSpec]:
    """All catalog entries, largest memory first."""
    return list(_CATALOG)


def _key(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower())


def gpu_spec(name: str) -> GpuSpec:
    """Look up a catalog entry by name or alias, ignoring case and punctuation.

    ``"T4-16GB"``, ``"t4"`` and ``"a100_80gb"`` resolve, and so does a name as NVML
    reports it (``"NVIDIA A10G"``, ``"NVIDIA A100-SXM4-80GB"``) when it fits one entry
    only. A name that is close to an entry (``"A100-80G"``) or fits several
    (``"A100"``: the 40 GB and the 80 GB cards) is refused, naming the candidates:
    a guessed GPU would give a silently wrong answer. Otherwise
    :class:`UnknownDeviceError` lists the known names.

    >>> gpu_spec("a100-80gb").name
    'A100-80GB'
    """
    found = _lookup(name)
    if found is not None:
        return found
    miss = catalog_miss(name, "GPU")
    if miss is not None:
        raise UnknownDeviceError(miss)
    known = ", ".join(s.name for s in _CATALOG)
    raise UnknownDeviceError(f"unknown GPU {name!r}: the catalog has {known}")


def _family(spec: GpuSpec) -> str:
    """A pattern for the model part of an entry's name (``A100``; ``RTX 4090`` or ``4090``)."""
    model = spec.name.rsplit("-", 1)[0]
    rtx = re.fullmatch(r"RTX(\d+)", model)
    return rf"\b(RTX\s*)?{rtx[1]}\b" if rtx else rf"\b{model}\b"


def _gigabytes(spec: GpuSpec) -> int:
    """The marketed size in the entry's name (80 for ``A100-80GB``)."""
    return int(spec.name.rsplit("-", 1)[1].removesuffix("GB"))


def _text(name: str) -> str:
    return name.upper().replace("-", " ").replace("_", " ")


def _same_model(name: str) -> list[GpuSpec]:
    """The entries of the GPU model ``name`` names, smallest first (``A100``: both)."""
    found = [s for s in _CATALOG if re.search(_family(s), _text(name))]
    return sorted(found, key=_gigabytes)


def _stated_sizes(name: str, unit: str = r"G(?:I?B)?") -> set[int]:
    """The sizes in gigabytes ``name`` states (``80`` in ``A100-80G``)."""
    return {int(n) for n in re.findall(rf"\b(\d+)\s*{unit}\b", _text(name))}


def _lookup(name: str) -> GpuSpec | None:
    """The one entry ``name`` means: its name or an alias (ignoring case and punctuation), or
    an NVML-style name that states the entry's size (``NVIDIA A100-SXM4-80GB``) or names
    a model the catalog has one entry of (``NVIDIA A10G``)."""
    key = _key(name)
    for spec in _CATALOG:
        if key == _key(spec.name) or key in {_key(a) for a in spec.aliases}:
            return spec
    models = _same_model(name)
    stated = _stated_sizes(name)
    if stated:
        in_gb = _stated_sizes(name, "GB")
        hits = [s for s in models if _gigabytes(s) in in_gb and stated == {_gigabytes(s)}]
    else:
        hits = models if len(models) == 1 else []
    hits = [s for s in hits if re.search(s.pattern, _text(name), flags=re.IGNORECASE)]
    return hits[0] if len(hits) == 1 else None


def catalog_miss(name: str, what: str = "device") -> str | None:
    """Why ``name`` is not one catalog entry, in one line, when it is close to some:
    ``"'A100' matches several GPUs: A100-40GB, A100-80GB; name one"`` or ``"unknown
    device 'A100-80G': did you mean A100-80GB?"``. None when nothing in the catalog is
    close (or ``name`` is one entry)."""
    if _lookup(name) is not None:
        return None
    models = _same_model(name)
    stated = _stated_sizes(name)
    if len(models) > 1 and not stated:
        return f"{name!r} matches several GPUs: {', '.join(s.name for s in models)}; name one"
    if models:
        names = [s.name for s in models if _gigabytes(s) in stated] or [s.name for s in models]
    else:
        forms = {_key(f): s.name for s in _CATALOG for f in (s.name, *s.aliases)}
        close = difflib.get_close_matches(_key(name), forms, n=3, cutoff=0.75)
        names = list(dict.fromkeys(forms[c] for c in close))
    if not names:
        return None
    return f"unknown {what} {name!r}: did you mean {' or '.join(names)}?"


def match_gpu_name(device_name: str) -> GpuSpec | None:
    """The catalog entry for a name as NVML or PyTorch reports it, if any.

    >>> match_gpu_name("NVIDIA A100-SXM4-80GB").name
    'A100-80GB'
    """
    text = device_name.upper().replace("-", " ").replace("_", " ")
    for spec in _CATALOG:
        if re.search(spec.pattern, text, flags=re.IGNORECASE):
            return spec
    return None
