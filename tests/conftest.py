from __future__ import annotations

import importlib.util
import os

import pytest
import torch

# The tests never reach the network: Hub ids resolve from the (test's own) cache only.
os.environ["HF_HUB_OFFLINE"] = "1"

import vramctl.device._discover as discover
from tests.fake_nvml import FakeGpu, FakeNvml, make_gpus
from vramctl.device._nvml import reset_nvml

# Fails any test that leaves a stand-in (fake NVML, a patched torch.cuda) or a changed
# PyTorch setting behind, even when its teardown failed part way, and puts it back.
pytest_plugins = ["tests._isolation"]

# The dashboard is an optional extra ([server]); where it is not installed its tests are not
# collected (CI installs it, and with VRAMCTL_REQUIRE_BROWSER=1 it must be there).
collect_ignore_glob: list[str] = []
_server_missing = any(importlib.util.find_spec(m) is None for m in ("fastapi", "uvicorn"))
if _server_missing and os.environ.get("VRAMCTL_REQUIRE_BROWSER") != "1":
    collect_ignore_glob.append("server/*")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is usable here")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _gpu_left_empty(request: pytest.FixtureRequest):
    """After a ``cuda`` test, what it held goes back to the GPU: the next test (or device
    selection) sees the GPU's memory as free, not cached in this process's allocator."""
    yield
    if "cuda" in request.keywords and torch.cuda.is_available():
        import gc

        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def _own_config_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):
    """No test reads or writes the user's calibration profiles."""
    monkeypatch.setenv("VRAMCTL_CONFIG_DIR", str(tmp_path_factory.mktemp("config")))
    monkeypatch.delenv("VRAMCTL_CALIBRATION", raising=False)


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
    """Three fake GPUs behind the real pynvml API; CUDA_VISIBLE_DEVICES unset.

    ``torch.cuda`` is kept out of the picture, as on a machine without a CUDA build: on a
    machine with a real GPU, its allocator would otherwise be read for the fake GPUs.
    """
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    fake = FakeNvml(make_gpus())
    fake.install(monkeypatch)
    reset_nvml()
    return fake


@pytest.fixture
def gpus(fake_nvml: FakeNvml) -> list[FakeGpu]:
    return fake_nvml.gpus
