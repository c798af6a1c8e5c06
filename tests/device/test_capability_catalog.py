from __future__ import annotations

import pytest

from vramctl import ComputeCapability, UnknownDeviceError, catalog, gpu_spec
from vramctl.device._catalog import match_gpu_name

REQUIRED = {
    "H100-80GB",
    "H200-141GB",
    "A100-80GB",
    "A100-40GB",
    "L40S-48GB",
    "A10G-24GB",
    "L4-24GB",
    "RTX4090-24GB",
    "RTX3090-24GB",
    "V100-32GB",
    "V100-16GB",
    "T4-16GB",
}


def test_catalog_has_the_common_gpus() -> None:
    names = {s.name for s in catalog()}
    assert names >= REQUIRED
    for spec in catalog():
        # NVML total is below the marketed size and above what CUDA exposes.
        marketed = int(spec.name.rsplit("-", 1)[1].removesuffix("GB"))
        assert spec.cuda_total_bytes < spec.total_bytes <= marketed * 2**30
        assert spec.total_bytes - spec.cuda_total_bytes < 4 * 2**30


@pytest.mark.parametrize(
    ("text", "name"),
    [
        ("T4-16GB", "T4-16GB"),
        ("t4", "T4-16GB"),
        ("a100_80gb", "A100-80GB"),
        ("NVIDIA A10G", "A10G-24GB"),
        ("rtx4090", "RTX4090-24GB"),
    ],
)
def test_gpu_spec_lookup(text: str, name: str) -> None:
    assert gpu_spec(text).name == name


@pytest.mark.parametrize(
    ("text", "name"),
    [
        ("NVIDIA A100-SXM4-80GB", "A100-80GB"),  # an NVML name that states its size
        ("NVIDIA A100 80GB PCIe", "A100-80GB"),
        ("Tesla V100-PCIE-32GB", "V100-32GB"),
        ("a100-40", "A100-40GB"),  # documented aliases
        ("v100-32", "V100-32GB"),
        ("H100", "H100-80GB"),  # one entry of that model
        ("Tesla T4", "T4-16GB"),
    ],
)
def test_a_name_that_is_not_exact_resolves_only_to_its_one_entry(text: str, name: str) -> None:
    assert gpu_spec(text).name == name


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("A100-80G", "unknown GPU 'A100-80G': did you mean A100-80GB?"),
        ("V100-32G", "unknown GPU 'V100-32G': did you mean V100-32GB?"),
        ("A100-40G", "unknown GPU 'A100-40G': did you mean A100-40GB?"),
        ("T4-32GB", "unknown GPU 'T4-32GB': did you mean T4-16GB?"),
        ("A10", "unknown GPU 'A10': did you mean A10G-24GB?"),
        ("A100", "'A100' matches several GPUs: A100-40GB, A100-80GB; name one"),
        ("V100", "'V100' matches several GPUs: V100-16GB, V100-32GB; name one"),
        ("NVIDIA A100 PCIe", "matches several GPUs: A100-40GB, A100-80GB; name one"),
    ],
)
def test_a_near_miss_or_an_ambiguous_name_is_refused_naming_the_candidates(
    text: str, message: str
) -> None:
    """Matching by NVML pattern took A100-80G and A100 for the A100-40GB, V100-32G for the
    V100-16GB: a wrong GPU, said only in a table's title."""
    with pytest.raises(UnknownDeviceError) as err:
        gpu_spec(text)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_unknown_gpu_lists_the_catalog() -> None:
    with pytest.raises(UnknownDeviceError) as err:
        gpu_spec("B300-288GB")
    assert "'B300-288GB'" in str(err.value) and "T4-16GB" in str(err.value)


@pytest.mark.parametrize(
    ("nvml_name", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", "H100-80GB"),
        ("NVIDIA H100 PCIe", "H100-80GB"),
        ("NVIDIA H100 NVL", None),
        ("NVIDIA H200", "H200-141GB"),
        ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
        ("NVIDIA A100-PCIE-40GB", "A100-40GB"),
        ("Tesla V100-SXM2-32GB", "V100-32GB"),
        ("Tesla V100-PCIE-16GB", "V100-16GB"),
        ("Tesla T4", "T4-16GB"),
        ("NVIDIA GeForce RTX 3090", "RTX3090-24GB"),
        ("NVIDIA L4", "L4-24GB"),
        ("NVIDIA L40S", "L40S-48GB"),
        ("NVIDIA A10", None),
    ],
)
def test_nvml_names_map_to_catalog(nvml_name: str, expected: str | None) -> None:
    spec = match_gpu_name(nvml_name)
    assert (spec.name if spec else None) == expected


@pytest.mark.parametrize(
    ("cc", "bf16", "tf32", "fp8", "arch"),
    [
        ("7.0", False, False, False, "Volta"),
        ("7.5", False, False, False, "Turing"),
        ("8.0", True, True, False, "Ampere"),
        ("8.6", True, True, False, "Ampere"),
        ("8.9", True, True, True, "Ada Lovelace"),
        ("9.0", True, True, True, "Hopper"),
        ("sm_100", True, True, True, "Blackwell"),
    ],
)
def test_capability_flags(cc: str, bf16: bool, tf32: bool, fp8: bool, arch: str) -> None:
    c = ComputeCapability.parse(cc)
    assert (c.bf16, c.tf32, c.fp8, c.architecture) == (bf16, tf32, fp8, arch)


def test_capability_parse_rejects_garbage() -> None:
    with pytest.raises(ValueError, match=r"8\.6"):
        ComputeCapability.parse("fast")
