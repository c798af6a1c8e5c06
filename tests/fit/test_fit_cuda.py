"""fit_batch_size on a real GPU (``cuda``-marked: skipped where none is usable)."""

from __future__ import annotations

import contextlib
import copy
import gc
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import vramctl
from tests.fit.models import train_step, true_max
from vramctl.fit import fit_batch_size

pytestmark = pytest.mark.cuda

GiB = 2**30


class Wide(nn.Module):
    """About 6 MB of activations per sample (256 tokens of width 2048, fp32)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def batch(b: int) -> torch.Tensor:
    return torch.randn(b, 256, 512, device="cuda")


def target_for(dev: vramctl.Device, room: int) -> float:
    """The target that leaves ``room`` bytes over what the GPU holds now."""
    free, total = torch.cuda.mem_get_info(dev.index)
    return min(1.0, (total - free + room) / total)


def capped_to(dev: vramctl.Device) -> Callable[[int, list[Any]], Any]:
    """A room on ``dev`` where the allocator refuses what would take its used memory past a
    budget: ``torch.cuda.set_per_process_memory_fraction`` caps this process's reserved memory
    at the budget less what is held outside the allocator (the CUDA context, other processes).
    What ``held`` (the model and optimizer) holds is on the GPU already, in the reserved memory.
    """

    @contextlib.contextmanager
    def room(budget: int, held: list[Any]) -> Iterator[Callable[[], int]]:
        i = dev.index
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(i)
        outside = total - free - torch.cuda.memory_reserved(i)
        torch.cuda.set_per_process_memory_fraction((budget - outside) / total, i)
        try:
            yield lambda: int(torch.cuda.memory_stats(i).get("num_ooms", 0))
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, i)
            gc.collect()
            torch.cuda.empty_cache()

    return room


@pytest.fixture
def gpu() -> vramctl.Device:
    gc.collect()
    torch.cuda.empty_cache()
    return vramctl.get_device("cuda:0")


def test_within_3_percent_of_a_real_search(gpu: vramctl.Device) -> None:
    torch.manual_seed(0)
    model = Wide().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = train_step(model, opt)
    step(batch(2))
    before = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    allocated = torch.cuda.memory_allocated(gpu.index)
    target = target_for(gpu, 3 * GiB)

    fit = fit_batch_size(step, batch, model=model, optimizer=opt, target=target, cache=False)

    assert fit.device == gpu.id  # found from the model's parameters
    assert torch.cuda.memory_allocated(gpu.index) == allocated
    for k, v in before["model"].items():
        assert torch.equal(model.state_dict()[k], v)
    for i, state in before["opt"]["state"].items():
        for k, v in state.items():
            assert torch.equal(opt.state_dict()["state"][i][k], v)
    truth = true_max(
        model, opt, train_step, batch, fit.budget, near=fit.batch_size, room=capped_to(gpu)
    )
    assert truth >= 20
    assert 0.97 * truth <= fit.batch_size <= truth
    assert fit.predicted is not None
    assert len(fit.probes) <= 4  # the goal is 3; the allocator's rounding may cost one more


def test_capped_refuses_past_the_budget_and_gives_the_fraction_back(
    gpu: vramctl.Device,
) -> None:
    """``capped(budget)``: inside, an allocation that would take the device's used memory
    past ``budget`` is refused (the allocator's own OOM); after the block, even one left by
    an error, the fraction set before is back."""
    free, total = torch.cuda.mem_get_info(gpu.index)
    budget = total - free + torch.cuda.memory_reserved(gpu.index) + 256 * 2**20
    torch.cuda.set_per_process_memory_fraction(0.99, gpu.index)
    try:
        with pytest.raises(RuntimeError, match="boom"), gpu.capped(budget):
            small = torch.empty(128 * 2**20, dtype=torch.uint8, device="cuda")
            with pytest.raises(torch.OutOfMemoryError):
                torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
            del small
            raise RuntimeError("boom")
        assert torch.cuda.get_per_process_memory_fraction(gpu.index) == pytest.approx(0.99)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, gpu.index)
        torch.cuda.empty_cache()


def test_an_oom_on_the_gpu_is_recovered(gpu: vramctl.Device) -> None:
    model = Wide().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = train_step(model, opt)
    gc.collect()  # what earlier tests left for the collector is not this search's to free
    allocated = torch.cuda.memory_allocated(gpu.index)
    free, _ = torch.cuda.mem_get_info(gpu.index)
    oversize = int(2 * free // (256 * 2048 * 4 * 3)) + 1  # twice what the free memory holds
    fit = fit_batch_size(step, batch, device=gpu, start=oversize, cache=False)
    assert fit.probes[0] == (oversize, None, False)
    assert 0 < fit.batch_size < oversize
    assert torch.cuda.memory_allocated(gpu.index) == allocated


def test_the_seed_leaves_out_what_this_process_and_others_already_hold(
    gpu: vramctl.Device,
) -> None:
    from vramctl.fit._seed import _estimator_target

    model = Wide().cuda()
    opt = torch.optim.AdamW(model.parameters())
    total = gpu.memory().total
    assert isinstance(total, int)
    free_share = _estimator_target(gpu, 0.9, model, opt)
    assert free_share is not None
    ballast = torch.empty(int(0.5 * total), dtype=torch.uint8, device="cuda")
    try:
        shared = _estimator_target(gpu, 0.9, model, opt)
        assert shared is not None
        # The ballast is gone from the step's share; the model's own weights are not.
        assert shared[1] == pytest.approx(free_share[1] - ballast.numel() / total, abs=0.01)
    finally:
        del ballast
        torch.cuda.empty_cache()
