from __future__ import annotations

import pytest
import torch

import vramctl.device._discover as discover
from tests.fake_nvml import FakeGpu, FakeNvml, make_gpus
from vramctl.device._nvml import reset_nvml


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is usable here")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_devices():
    """Each test discovers devices afresh (device objects carry health history)."""
    discover._cache.clear()
    reset_nvml()
    yield
    discover._cache.clear()
    reset_nvml()


@pytest.fixture
def fake_nvml(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    """Three fake GPUs behind the real pynvml API; CUDA_VISIBLE_DEVICES unset."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    fake = FakeNvml(make_gpus())
    fake.install(monkeypatch)
    reset_nvml()
    return fake


@pytest.fixture
def gpus(fake_nvml: FakeNvml) -> list[FakeGpu]:
    return fake_nvml.gpus
