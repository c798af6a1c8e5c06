"""The cache of fitted sizes: hits, misses, corrupt files, atomic writes, what the key sees."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import vramctl
from tests.fit.models import TokenMlp, mlp_batch, train_step
from vramctl.fit import fit_batch_size
from vramctl.fit._cache import (
    ENV_CACHE_DIR,
    cache_root,
    input_signature,
    load,
    model_identity,
    step_identity,
    store,
)


def files(root: Path) -> list[Path]:
    return sorted((root / "fit").glob("*"))


def test_a_second_call_is_answered_from_the_cache(tmp_path: Path) -> None:
    with vramctl.simulate("48MiB") as gpu:
        model = TokenMlp()
        step = train_step(model, torch.optim.SGD(model.parameters(), lr=0.1))
        first = fit_batch_size(step, mlp_batch, start=64, cache_dir=tmp_path)
        second = fit_batch_size(step, mlp_batch, start=64, cache_dir=tmp_path)
        other_target = fit_batch_size(step, mlp_batch, start=64, target=0.5, cache_dir=tmp_path)
    assert first.source == "probe" and first.probes
    assert second.source == "cache" and second.probes == []
    assert (second.batch_size, second.peak_used) == (first.batch_size, first.peak_used)
    assert second.budget == first.budget and second.device == gpu.id
    assert other_target.source == "probe"  # the target is part of the key
    assert len(files(tmp_path)) == 2
    data = json.loads(files(tmp_path)[0].read_text())
    assert data["schema"] == "vramctl.fit/1"
    assert {"step", "model", "inputs", "device", "free_band", "target"} <= data["key"].keys()


def test_the_cache_directory_comes_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV_CACHE_DIR, str(tmp_path))
    assert cache_root() == tmp_path / "fit"
    assert cache_root("/elsewhere") == Path("/elsewhere/fit")
    monkeypatch.delenv(ENV_CACHE_DIR)
    assert cache_root() == Path.home() / ".cache" / "vramctl" / "fit"
    monkeypatch.setenv(ENV_CACHE_DIR, str(tmp_path))
    with vramctl.simulate("48MiB"):
        model = TokenMlp()
        step = train_step(model, torch.optim.SGD(model.parameters(), lr=0.1))
        fit_batch_size(step, mlp_batch, max=8)
    assert len(files(tmp_path)) == 1


@pytest.mark.parametrize(
    "garbage",
    [b'{"schema":', b"", b"[1, 2]", b'{"schema": "other"}', b"\xff\xfe\x00"],
)
def test_a_corrupt_cache_file_is_ignored_and_replaced(tmp_path: Path, garbage: bytes) -> None:
    with vramctl.simulate("48MiB"):
        model = TokenMlp()
        step = train_step(model, torch.optim.SGD(model.parameters(), lr=0.1))
        first = fit_batch_size(step, mlp_batch, max=8, cache_dir=tmp_path)
        (path,) = files(tmp_path)
        path.write_bytes(garbage)
        again = fit_batch_size(step, mlp_batch, max=8, cache_dir=tmp_path)
        third = fit_batch_size(step, mlp_batch, max=8, cache_dir=tmp_path)
    assert again.source == "probe" and again.batch_size == first.batch_size
    assert json.loads(path.read_text())["result"]["batch_size"] == first.batch_size
    assert third.source == "cache"


def test_less_free_memory_is_another_key(tmp_path: Path) -> None:
    with vramctl.simulate("48MiB") as gpu:
        model = TokenMlp()
        step = train_step(model, torch.optim.SGD(model.parameters(), lr=0.1))
        roomy = fit_batch_size(step, mlp_batch, start=64, cache_dir=tmp_path)
        held = torch.empty(gpu.total_bytes // 4, dtype=torch.uint8)  # a quarter of the device
        tight = fit_batch_size(step, mlp_batch, start=64, cache_dir=tmp_path)
        del held
        again = fit_batch_size(step, mlp_batch, start=64, cache_dir=tmp_path)
    assert tight.source == "probe" and tight.batch_size < roomy.batch_size
    assert again.source == "cache" and again.batch_size == roomy.batch_size


def test_the_key_sees_code_model_and_input_shapes() -> None:
    def step_a(x: torch.Tensor) -> None:
        x.sum()

    def step_b(x: torch.Tensor) -> None:
        x.mean()

    assert step_identity(step_a)["code"] != step_identity(step_b)["code"]
    assert step_identity(step_a)["name"].endswith("step_a")
    assert step_identity(step_a) == step_identity(step_a)
    small, wide = nn.Linear(8, 8), nn.Linear(8, 16)
    assert model_identity(small, None) != model_identity(wide, None)
    assert model_identity(small, None) == model_identity(nn.Linear(8, 8), None)
    opt = torch.optim.SGD(small.parameters(), lr=0.1)
    assert model_identity(small, opt) != model_identity(small, None)
    assert model_identity(None, None) is None
    batch = {"ids": torch.zeros(1, 7, dtype=torch.long), "mask": torch.ones(1, 7)}
    assert input_signature(batch) == {
        "ids": {"shape": [1, 7], "dtype": "torch.int64"},
        "mask": {"shape": [1, 7], "dtype": "torch.float32"},
    }
    assert input_signature((torch.zeros(1, 3), 4)) == [
        {"shape": [1, 3], "dtype": "torch.float32"},
        4,
    ]


def test_writes_are_atomic_and_failures_are_quiet(tmp_path: Path) -> None:
    root = tmp_path / "fit"
    key = {"step": "s", "target": 0.9}
    path = store(root, key, {"batch_size": 3})
    assert path is not None and path.parent == root
    assert [p.name for p in root.iterdir()] == [path.name]  # no temporary file left behind
    assert load(root, key) == {"batch_size": 3}
    assert load(root, {"step": "other", "target": 0.9}) is None
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    assert store(blocked / "fit", key, {"batch_size": 3}) is None
    # A file whose key differs (a hash collision, a hand edit) is not used.
    data = json.loads(path.read_text())
    data["key"]["step"] = "edited"
    path.write_text(json.dumps(data))
    assert load(root, key) is None
