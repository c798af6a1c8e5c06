"""fit_batch_size at its edges: bad arguments, bad cache entries, a Guard that offloads."""

from __future__ import annotations

import dataclasses
import json
from collections import UserDict
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import vramctl
from tests.fit.models import TokenMlp, mlp_batch, train_step
from tests.guard.test_guard import _tanh_need
from vramctl.fit import FitError, fit_batch_size
from vramctl.fit._fit import _tensors


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"start": True}, "start must be a positive integer"),
        ({"max": -3}, "max must be a positive integer"),
        ({"target": True}, "target must be in"),
        ({"target": float("nan")}, "target must be in"),
        ({"steps_per_probe": 2.5}, "steps_per_probe must be an integer"),
        ({"steps_per_probe": "2"}, "steps_per_probe must be an integer"),
        ({"max_probes": 0}, "max_probes must be an integer"),
        ({"tolerance": "0.1"}, "tolerance must be in"),
        ({"mode": "training"}, "mode must be"),
        ({"cache_dir": 123}, "cache_dir must be a path"),
    ],
)
def test_bad_arguments_are_fit_errors(kwargs: dict[str, Any], match: str) -> None:
    calls: list[Any] = []
    with vramctl.simulate("48MiB"), pytest.raises(FitError, match=match):
        fit_batch_size(calls.append, mlp_batch, **kwargs)
    assert calls == []  # refused before any probe


@pytest.mark.parametrize("stored", [-5, 0, True, 10.0, "12", None])
def test_a_cache_entry_without_a_positive_batch_size_is_not_used(
    tmp_path: Path, stored: Any
) -> None:
    with vramctl.simulate("48MiB"):
        model = TokenMlp()
        step = train_step(model, torch.optim.SGD(model.parameters(), lr=0.1))
        first = fit_batch_size(step, mlp_batch, max=8, cache_dir=tmp_path)
        (path,) = (tmp_path / "fit").glob("*.json")
        data = json.loads(path.read_text())
        data["result"]["batch_size"] = stored
        path.write_text(json.dumps(data))
        again = fit_batch_size(step, mlp_batch, max=8, cache_dir=tmp_path)
    assert again.source == "probe" and again.batch_size == first.batch_size == 8
    assert json.loads(path.read_text())["result"]["batch_size"] == 8  # replaced


def test_a_guard_that_offloads_in_one_probe_does_not_offload_in_the_next() -> None:
    """Offloading is what a Guard learns from an OOM: each probe (and the caller) starts without.

    One sample fits only with its activations offloaded, which counts as not fitting.
    """
    model = nn.Sequential(nn.Linear(8, 4096), *[nn.Tanh() for _ in range(12)])
    x = torch.randn(1, 8)
    plain, offloaded = _tanh_need(model, x, False), _tanh_need(model, x, True)
    with vramctl.simulate("1GiB") as gpu:
        gpu.adopt(model)
        params = gpu.allocated_bytes
    with vramctl.simulate(params + (plain + offloaded) // 2) as gpu:
        gpu.adopt(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        guard = vramctl.Guard(model, opt, loss_fn=lambda out, b: out.square().mean(), device=gpu)
        with pytest.raises(FitError, match="not even batch size 1"):
            fit_batch_size(guard, lambda b: torch.randn(b, 8), start=4, cache=False)
        assert guard.piece_limit is None and not guard.summary()["offloading"]
    offloads = [e.step for e in guard.events if e.kind == "offload"]
    assert len(offloads) == 2  # the probe of 1 needed to offload again: it did not fit


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    names: list[str]


def test_the_input_bytes_of_mappings_and_dataclasses_are_counted() -> None:
    x, y = torch.zeros(2, 3), torch.zeros(4)
    assert [t.shape for t in _tensors(UserDict({"x": x, "y": y}))] == [x.shape, y.shape]
    assert [t.shape for t in _tensors(Batch(x, ["a", "b"]))] == [x.shape]
