"""Driver and GPU settings read through NVML (the stand-in's persistence, MIG and ECC)."""

from __future__ import annotations

import pynvml
import pytest

import vramctl
from tests.fake_nvml import FakeGpu, FakeNvml, GiB
from vramctl import NA
from vramctl.device import driver_info, gpu_settings


def test_driver_info_reads_the_driver_and_its_cuda_version(fake_nvml: FakeNvml) -> None:
    fake_nvml.cuda_driver_version = 12020
    info = driver_info()
    assert info.nvml and info.error == "" and info.reason == ""
    assert info.driver_version == "550.54.15"
    assert info.cuda_driver_version == (12, 2) and info.cuda_version_text == "12.2"
    assert info.gpu_count == 3
    assert info.to_dict()["cuda_driver_version"] == [12, 2]


@pytest.mark.parametrize(
    ("code", "kind"),
    [
        (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "library_not_found"),
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "driver_not_loaded"),
        (pynvml.NVML_ERROR_NO_PERMISSION, "no_permission"),
        (pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, "version_mismatch"),
        (pynvml.NVML_ERROR_UNKNOWN, "other"),
    ],
)
def test_driver_info_says_why_nvml_cannot_run(
    monkeypatch: pytest.MonkeyPatch, code: int, kind: str
) -> None:
    FakeNvml([], init_error=code).install(monkeypatch)
    info = driver_info()
    assert not info.nvml and info.error == kind and info.reason
    assert info.driver_version is NA and info.cuda_driver_version is NA


def test_gpu_settings_of_a_whole_gpu(gpus: list[FakeGpu]) -> None:
    gpus[0].persistence = False
    gpus[0].ecc_uncorrected_volatile, gpus[0].ecc_uncorrected_aggregate = 2, 5
    gpus[0].remapped_rows = (0, 1, True, False)
    s = gpu_settings(vramctl.get_device(0))
    assert s is not None
    assert (s.device, s.nvml_index, s.uuid, s.mig_instance) == ("cuda:0", 0, gpus[0].uuid, False)
    assert s.persistence_mode is False and s.mig_mode is False and s.mig_instances is NA
    assert s.ecc_mode is True and s.ecc_uncorrected_volatile == 2
    assert s.ecc_uncorrected_aggregate == 5 and s.ecc_corrected_volatile == 0
    assert s.remap_pending is True and s.remap_failed is False
    assert s.compute_mode == "default" and s.gpu_utilization == 80.0
    assert s.to_dict()["persistence_mode"] is False


def test_unsupported_settings_are_na(gpus: list[FakeGpu]) -> None:
    t4 = gpus[2]
    t4.persistence, t4.ecc_mode, t4.remapped_rows, t4.util = None, None, None, None
    s = gpu_settings(vramctl.get_device(2))
    assert s is not None
    assert s.persistence_mode is NA and s.ecc_mode is NA and s.ecc_uncorrected_volatile is NA
    assert s.remap_pending is NA and s.gpu_utilization is NA
    assert s.to_dict()["ecc_mode"] is None


def test_a_mig_instance_reports_its_gpus_settings(gpus: list[FakeGpu]) -> None:
    parent = gpus[0]
    parent.persistence = False
    parent.migs = [
        FakeGpu("NVIDIA A100-SXM4-80GB MIG 3g.40gb", "MIG-1111", 40 * GiB, parent=parent),
        FakeGpu("NVIDIA A100-SXM4-80GB MIG 3g.40gb", "MIG-2222", 40 * GiB, parent=parent),
    ]
    s = gpu_settings(vramctl.get_device("MIG-2222"))
    assert s is not None
    assert s.device == "cuda:1" and s.mig_instance and s.uuid == parent.uuid
    assert s.mig_mode is True and s.mig_instances == 2 and s.persistence_mode is False


def test_no_settings_for_devices_nvml_does_not_read(gpus: list[FakeGpu]) -> None:
    assert gpu_settings(vramctl.get_device("cpu")) is None
    assert gpu_settings(vramctl.get_device("sim:T4-16GB")) is None
