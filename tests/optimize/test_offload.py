"""Offloading the optimizer's state and accumulating gradients: priced by the estimator, run
for real."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vramctl
from vramctl.estimator._spec import StepSpec
from vramctl.estimator._target import run_target
from vramctl.optimize import OffloadedOptimizer, OptimizeError, plan


class Wide(nn.Module):
    """Parameters dominate: the optimizer's state is most of a step's memory."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(512, 512) for _ in range(4))
        self.head = nn.Linear(512, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def _batch(n: int) -> torch.Tensor:
    return torch.randn(n, 512)


def _state_bytes(model: nn.Module) -> int:
    """AdamW's two moments."""
    return 2 * sum(p.numel() * p.element_size() for p in model.parameters())


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    torch.manual_seed(1)
    for _ in range(steps):
        model(_batch(4)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_the_offloaded_optimizer_steps_as_the_original_does() -> None:
    torch.manual_seed(0)
    a, b = Wide(), Wide()
    b.load_state_dict(a.state_dict())
    plain = torch.optim.AdamW(a.parameters(), lr=1e-2)
    offloaded = OffloadedOptimizer(torch.optim.AdamW(b.parameters(), lr=1e-2), device="cpu")
    sched = torch.optim.lr_scheduler.StepLR(offloaded, step_size=1, gamma=0.5)
    sched_a = torch.optim.lr_scheduler.StepLR(plain, step_size=1, gamma=0.5)
    for _ in range(3):
        _train(a, plain, 1)
        _train(b, offloaded, 1)
        sched.step()
        sched_a.step()
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb)
    # its state is the inner optimizer's, in host copies of the parameters, and the
    # scheduler's lr reaches the optimizer that steps
    state = offloaded.state_dict()
    assert state["param_groups"][0]["lr"] == pytest.approx(1e-2 / 8)
    assert len(state["state"]) == len(list(b.parameters()))
    assert all(hp is not p for p, hp in offloaded._pairs)
    with pytest.raises(OptimizeError, match="closure"):
        offloaded.step(lambda: 0.0)
    with pytest.raises(OptimizeError, match="already offloaded"):
        OffloadedOptimizer(offloaded)


def test_the_estimate_prices_the_state_off_the_device_and_the_copies_in_time() -> None:
    plain = vramctl.estimate(Wide(), _batch(4), device="cpu")
    off = vramctl.estimate(Wide(), _batch(4), device="cpu", offload_optimizer=True)
    assert plain.breakdown["optimizer"] == _state_bytes(Wide())
    assert off.breakdown["optimizer"] == 0
    assert off.peak_device <= plain.peak_device - _state_bytes(Wide()) // 2
    # the copies to and from the host, and the step on the host, cost time
    assert off.phase_seconds["host"] > 0
    assert off.time_breakdown["transfer"] > plain.time_breakdown.get("transfer", 0.0)
    assert off.step_seconds is not None and plain.step_seconds is not None
    assert off.step_seconds > plain.step_seconds


def test_on_a_simulated_gpu_the_measured_saving_is_the_predicted_one() -> None:
    peaks = {}
    for offload in (False, True):
        dev = vramctl.simulate(2**30)
        with dev:
            torch.manual_seed(0)
            model = dev.adopt(Wide())
            opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters())
            if offload:
                opt = OffloadedOptimizer(opt, dev)
            with dev.peak_meter() as meter:
                _train(model, opt, 2)
            peaks[offload] = meter.peak_used
        # the step's kernels run on the CPU: priced as a CPU target of the device's size
        est = vramctl.estimate(Wide(), _batch(4), device=run_target(dev), offload_optimizer=offload)
        assert abs(est.peak_device - peaks[offload]) <= 0.05 * peaks[offload]
    saved = peaks[False] - peaks[True]
    assert saved >= 0.9 * _state_bytes(Wide())


def test_a_device_too_small_for_the_state_gets_a_plan_that_offloads_it() -> None:
    need = vramctl.estimate(Wide(), _batch(8), device="cpu").peak_device
    dev = vramctl.simulate(int((need - _state_bytes(Wide()) // 2) / 0.9))
    result = plan(
        Wide(),
        _batch,
        device=dev,
        effective_batch=8,
        precisions=["fp32"],
        optimizers=["adamw"],
        offload=["none", "optimizer"],
    )
    best = result.best
    assert best is not None and best.offload == "optimizer", str(result)
    assert any(p.offload == "none" and not p.fits for p in result.plans)
    with dev:
        model = dev.adopt(Wide())
        applied = result.apply(model, device=dev)
        assert isinstance(applied.step.optimizer, OffloadedOptimizer)
        for _ in range(2):
            for _ in range(best.accumulation):
                applied.step.backward(applied.model(_batch(best.micro_batch)).square().mean())
            applied.step.step()


def test_on_the_cpu_the_optimizer_is_not_offloaded_and_the_plan_says_why() -> None:
    from vramctl.optimize import Plan

    p = Plan("fp32", "none", "optimizer", "adamw", 2, 1, fits=True)
    applied = p.apply(Wide(), device="cpu")
    assert not isinstance(applied.step.optimizer, OffloadedOptimizer)
    assert any("not offloaded" in n for n in applied.notes)
    spec = StepSpec(offload_optimizer=True)
    assert spec.offload_optimizer


def test_a_micro_batch_of_accumulation_is_priced_holding_the_earlier_gradients() -> None:
    measured = {}
    for micro_batches in (1, 3):
        dev = vramctl.simulate(2**30)
        with dev:
            torch.manual_seed(0)
            model = dev.adopt(Wide())
            opt = torch.optim.AdamW(model.parameters())
            _train(model, opt, 1)  # the optimizer's state exists, as in the estimate
            with dev.peak_meter() as meter:
                for _ in range(micro_batches):
                    model(_batch(2048)).square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            measured[micro_batches] = meter.peak_used
    first = vramctl.estimate(Wide(), _batch(2048), device=run_target(dev))
    later = vramctl.estimate(Wide(), _batch(2048), device=run_target(dev), grad_accumulation=True)
    assert later.breakdown["gradients"] == _state_bytes(Wide()) // 2
    for est, real in ((first, measured[1]), (later, measured[3])):
        assert abs(est.peak_device - real) <= 0.05 * real
    assert measured[3] > measured[1]
