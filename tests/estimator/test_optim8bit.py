"""8-bit and paged AdamW (``optimizer="adamw-8bit"``, ``"paged-adamw"``,
``"paged-adamw-8bit"``): bitsandbytes' own state, against the library on the CPU."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

import vramctl
from tests.estimator.real_steps import cpu_step_peak
from vramctl.estimator._optim8bit import MIN_8BIT_SIZE, Blockwise8bitAdamW
from vramctl.estimator._spec import StepSpec

pytest.importorskip("transformers")
from tests.estimator.small_llama import QV, batch, llama


def layout(opt: torch.optim.Optimizer, p: torch.Tensor) -> dict[str, tuple]:
    return {
        k: (tuple(v.shape), v.dtype) for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)
    }


def test_the_state_is_bitsandbytes_own() -> None:
    bnb = pytest.importorskip("bitsandbytes")
    # 16,384, 4,096 and 512 weights: the last is under bitsandbytes' min_8bit_size
    model = nn.Sequential(nn.Linear(256, 64), nn.Linear(64, 64), nn.Linear(64, 8))
    params = list(model.parameters())
    real = bnb.optim.AdamW8bit(params, lr=1e-3)
    ours = Blockwise8bitAdamW(params)
    model(torch.randn(2, 256)).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        real.step()
    ours.step()
    for p in params:
        want = {k: v for k, v in layout(real, p).items() if k != "step"}
        assert {k: v for k, v in layout(ours, p).items() if k != "step"} == want
    big, mid, small = params[0], params[2], params[4]
    assert big.numel() > mid.numel() == MIN_8BIT_SIZE > small.numel()
    # one pair of quantization maps for all parameters, as bitsandbytes keeps them
    for opt in (real, ours):
        assert opt.state[big]["qmap1"].data_ptr() == opt.state[mid]["qmap1"].data_ptr()


@pytest.mark.parametrize("lora", [None, QV], ids=["full", "lora"])
def test_a_step_is_priced_as_bitsandbytes_adamw8bit_runs_it(lora: dict | None) -> None:
    """bitsandbytes' AdamW8bit on the CPU, a real step on the shrunk Llama: exact. (The
    LoRA matrices are under 4096 values: their state stays fp32, as in AdamW.)"""
    bnb = pytest.importorskip("bitsandbytes")
    peft = pytest.importorskip("peft")
    model = llama()
    if lora:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = peft.get_peft_model(model, peft.LoraConfig(**lora))
    spec = StepSpec(optimizer=lambda ps: bnb.optim.AdamW8bit(ps, lr=1e-4))
    real = cpu_step_peak(model, batch(), spec)
    est = vramctl.estimate(llama(), batch(), device="cpu", optimizer="adamw-8bit", adapter=lora)
    assert abs(est.peak_allocated - real) / real < 1e-4, (est.peak_allocated, real)
    plain = vramctl.estimate(llama(), batch(), device="cpu", optimizer="adamw", adapter=lora)
    if lora is None:
        assert est.breakdown["optimizer"] < plain.breakdown["optimizer"] / 3
    else:
        # the same state but AdamW's step counters, a 4-byte tensor per trained matrix,
        # kept through the loop's next step (bitsandbytes counts its steps in Python)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            peft_model = peft.get_peft_model(llama(), peft.LoraConfig(**lora))
        trained = sum(p.requires_grad for p in peft_model.parameters())
        assert trained == 8  # lora_A and lora_B of q and v in two layers
        assert plain.peak_allocated - est.peak_allocated == 4 * trained


def test_a_paged_optimizers_state_is_shown_apart() -> None:
    eight = vramctl.estimate(llama(), batch(), device="H100-80GB", optimizer="adamw-8bit")
    paged = vramctl.estimate(llama(), batch(), device="H100-80GB", optimizer="paged-adamw-8bit")
    assert paged.paged_optimizer == eight.breakdown["optimizer"] > 0
    assert paged.breakdown.get("optimizer", 0) == 0
    assert paged.peak_allocated < eight.peak_allocated
    assert "unified memory" in paged.notes[-1]
    assert json.loads(json.dumps(paged.to_dict()))["paged_optimizer_bytes"] == paged.paged_optimizer
    fp32 = vramctl.estimate(llama(), batch(), device="H100-80GB", optimizer="paged-adamw")
    trained = sum(p.numel() for p in llama().parameters())
    assert fp32.paged_optimizer == 8 * trained
