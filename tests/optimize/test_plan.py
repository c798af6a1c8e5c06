"""vramctl.plan: priced on fake tensors, applied for real."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import vramctl
from vramctl.cli._app import app
from vramctl.optimize import OptimizeError, plan


def _encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(64, 4, 128, batch_first=True, dropout=0.0)
    return nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)


def _batch(n: int) -> torch.Tensor:
    return torch.randn(n, 32, 64)


class Distinct(nn.Module):
    """No repeated blocks: nothing for checkpointing to wrap."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 128)
        self.b = nn.Linear(128, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def test_the_best_plan_fits_and_every_other_says_why() -> None:
    result = plan(
        _encoder(), _batch, device="cpu", effective_batch=8, optimizers=["adamw"], prune=False
    )
    assert result.best is not None and result.best.fits
    assert result.best.micro_batch * result.best.accumulation == 8
    assert result.best.seconds is not None and result.best.seconds > 0
    assert result.runner_up is not None
    assert result.runner_up.seconds is not None
    assert result.runner_up.seconds >= result.best.seconds
    assert all(p.rejected for p in result.rejected)
    # the CPU's memory is the host's: no offloading to price there
    assert any(s.startswith("offload:") for s in result.skipped)
    assert {p.offload for p in result.plans} == {"none"}
    doc = json.loads(json.dumps(result.to_dict()))
    assert doc["best"]["effective_batch"] == 8
    assert {"precision", "checkpointing", "micro_batch", "rejected"} <= set(doc["plans"][0])


def test_a_tight_device_needs_accumulation_checkpointing_or_offloading() -> None:
    roomy = plan(
        _encoder(),
        _batch,
        device="cpu",
        effective_batch=16,
        optimizers=["adamw"],
        precisions=["fp32"],
    )
    assert roomy.best is not None and roomy.best.accumulation == 1
    peak = roomy.best.peak_bytes
    tight = vramctl.simulate(int(peak * 0.5 / 0.9))
    result = plan(
        _encoder(),
        _batch,
        device=tight,
        effective_batch=16,
        optimizers=["adamw"],
        precisions=["fp32"],
    )
    best = result.best
    assert best is not None and best.peak_bytes <= best.budget_bytes
    assert best.accumulation > 1 or best.checkpointing != "none" or best.offload != "none"
    assert any("does not fit" in p.rejected for p in result.plans)
    # and the plan really runs on that device: real steps, no out-of-memory error
    with tight:
        model = tight.adopt(_encoder())
        applied = result.apply(model, device=tight)
        for _ in range(best.accumulation):
            with applied.step.autocast():
                loss = applied.model(_batch(best.micro_batch)).square().mean()
            applied.step.backward(loss / best.accumulation)
        applied.step.step()
        applied.undo()


def test_checkpointing_is_skipped_with_a_reason_without_repeated_blocks() -> None:
    result = plan(
        Distinct(),
        _batch,
        device="cpu",
        effective_batch=4,
        optimizers=["adamw"],
        precisions=["fp32"],
    )
    assert {p.checkpointing for p in result.plans} == {"none"}
    assert any(s.startswith("checkpointing:") for s in result.skipped)


def test_eight_bit_adamw_is_skipped_without_its_package(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from vramctl.optimize import _plan

    installed = [n for n in ("torchao", "bitsandbytes") if importlib.util.find_spec(n)]
    assert _plan.eight_bit_available() == (installed[0] if installed else None)
    # as if neither were installed (the finetune extra brings both); put back after
    monkeypatch.setattr(_plan, "eight_bit_available", lambda: None)
    result = plan(Distinct(), _batch, device="cpu", effective_batch=2, precisions=["fp32"])
    assert any(s.startswith("adamw-8bit") for s in result.skipped)


def test_bad_input_is_a_clear_error() -> None:
    with pytest.raises(OptimizeError, match="make_batch"):
        plan(_encoder(), device="cpu", effective_batch=4)
    with pytest.raises(OptimizeError, match="effective_batch"):
        plan(_encoder(), _batch, device="cpu", effective_batch=0)
    with pytest.raises(OptimizeError, match="offload must be among"):
        plan(_encoder(), _batch, device="cpu", effective_batch=4, offload=["gradients"])


def test_the_plan_command_prints_json() -> None:
    result = CliRunner().invoke(
        app,
        [
            "plan",
            "lstm",
            "--device",
            "cpu",
            "--effective-batch",
            "4",
            "--seq-len",
            "16",
            "--precision",
            "fp32",
            "--optimizer",
            "adamw",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["model"] == "lstm" and doc["best"]["fits"] is True
    assert doc["best"]["micro_batch"] * doc["best"]["accumulation"] == 4


def test_a_rejection_within_the_estimates_uncertainty_says_so() -> None:
    one = vramctl.estimate(_encoder(), _batch(1), device="A10G-24GB")
    assert one.device_uncertainty > 0  # no profile of the GPU: a wide range
    # a budget above the point estimate, below its safe end
    util = (one.peak_device + one.device_uncertainty / 2) / one.capacity
    result = plan(
        _encoder(),
        _batch,
        device="A10G-24GB",
        effective_batch=4,
        optimizers=["adamw"],
        precisions=["fp32"],
        checkpointing=["none"],
        target_utilization=util,
    )
    assert result.best is None
    why = result.plans[0].rejected
    assert "not even a micro-batch of 1 fits with the estimate's uncertainty" in why
    assert "calibrate" in why


def test_pruning_keeps_the_choice_and_says_why_it_priced_less() -> None:
    """Pruned, the planner prices only what can beat the best plan (by what is exact in the
    time model) and chooses as the exhaustive planner does; every plan it did not price
    says why."""
    roomy = plan(_encoder(), _batch, device="cpu", effective_batch=16, precisions=["fp32"])
    assert roomy.best is not None
    tight = vramctl.simulate(int(roomy.best.peak_bytes * 0.45 / 0.9))
    kw: dict[str, object] = dict(
        device=tight, effective_batch=16, precisions=["fp32", "amp-bf16"], optimizers=["adamw"]
    )
    every = plan(_encoder(), _batch, prune=False, **kw)  # type: ignore[arg-type]
    pruned = plan(_encoder(), _batch, **kw)  # type: ignore[arg-type]
    assert every.best is not None and pruned.best is not None
    assert pruned.best.label == every.best.label
    assert pruned.best.seconds == every.best.seconds
    traced = [p for p in pruned.plans if p.priced == "traced"]
    assert len(traced) < len([p for p in every.plans if p.priced == "traced"])
    skipped = [p for p in pruned.plans if p.priced == "pruned"]
    assert skipped and all(p.rejected.startswith("not priced: ") for p in skipped)
    # the same combinations are listed either way
    combos = {(p.precision, p.checkpointing, p.offload) for p in every.plans}
    assert {(p.precision, p.checkpointing, p.offload) for p in pruned.plans} == combos


def test_a_precision_that_cannot_beat_the_best_plan_is_not_priced_further() -> None:
    """No plan of a precision is faster than its forward and backward of the whole
    effective batch at once: where the best plan so far is faster, its other combinations
    are listed as not priced, with both times."""
    from vramctl.estimator import Step
    from vramctl.estimator._shared import resolve_target, run_target
    from vramctl.optimize._plan import _price_layout

    roomy = plan(_encoder(), _batch, device="cpu", effective_batch=16, precisions=["fp32"])
    assert roomy.best is not None
    tight = resolve_target(run_target(vramctl.simulate(int(roomy.best.peak_bytes * 0.45 / 0.9))))
    step = Step(device=tight, mode="train", tf32=False)
    args = (None, _encoder(), _batch, step, ["fp32"], ["none", "full"], ["none"], ["adamw"])
    best = [1e-9]  # as if a plan of another precision took next to nothing
    plans = _price_layout(*args, effective_batch=16, tf32=False, progress=None, best=best)
    later = [p for p in plans if p.checkpointing == "full"]
    assert later and all(p.priced == "pruned" for p in later)
    assert "fp32 cannot beat the best plan (1e-09 s)" in later[0].rejected
    # without the prune it is priced
    plans = _price_layout(
        *args, effective_batch=16, tf32=False, progress=None, best=[1e-9], prune=False
    )
    assert any(p.checkpointing == "full" and p.priced == "traced" for p in plans)


def test_an_offloaded_optimizers_host_step_counts_toward_what_cannot_beat_the_best() -> None:
    """An offloaded optimizer steps on the host once a step, whatever the micro-batch:
    once seen, a combination that offloads it cannot be faster than the whole batch's
    forward and backward plus that step."""
    from vramctl.estimator import Step
    from vramctl.estimator._shared import resolve_target, run_target
    from vramctl.optimize._plan import _ideal_seconds, _price_layout

    roomy = plan(_encoder(), _batch, device="cpu", effective_batch=16, precisions=["fp32"])
    assert roomy.best is not None
    tight = resolve_target(run_target(vramctl.simulate(int(roomy.best.peak_bytes * 0.45 / 0.9))))
    step = Step(device=tight, mode="train", tf32=False)
    kinds, offs = ["none", "full"], ["none", "optimizer"]
    args = (None, _encoder(), _batch, step, ["fp32"], kinds, offs, ["adamw"])
    every = _price_layout(*args, effective_batch=16, tf32=False, progress=None, prune=False)
    # the plain combination's forward and backward of all 16 at once
    whole = vramctl.estimate(_encoder(), _batch(16), step=step.replace(precision="fp32"))
    ideal = _ideal_seconds([whole])
    host = min(
        p.estimate.phase_seconds["host"]
        for p in every
        if p.estimate is not None and p.estimate.phase_seconds.get("host")
    )
    assert ideal is not None and host > 0
    # a best plan between the two bounds: what offloads the optimizer, once its host step
    # was seen (none + optimizer is priced first), is not priced; full + none is
    best = [ideal + host / 2]
    plans = _price_layout(*args, effective_batch=16, tf32=False, progress=None, best=best)
    full_opt = next(p for p in plans if (p.checkpointing, p.offload) == ("full", "optimizer"))
    assert full_opt.priced == "pruned"
    # by the host step once seen, or by what it adds to the combination that offloads it
    assert "cannot beat the best plan" in full_opt.rejected
    assert "optimizer" in full_opt.rejected
    # full + none is not pruned by the host step: priced, or bounded by its own whole
    # batch (its recomputation counted), which the best beats
    full_none = next(p for p in plans if (p.checkpointing, p.offload) == ("full", "none"))
    if full_none.priced == "pruned":
        assert "its whole effective batch at once takes" in full_none.rejected
        took = float(full_none.rejected.split("at once takes ")[1].split(" s")[0])
        assert took > best[0]


def test_a_precision_whose_whole_batch_is_slower_than_the_best_is_not_searched() -> None:
    """With several precisions, each one's whole effective batch is traced first: the
    fastest bound is searched first, and a precision the best plan already beats is
    listed as not priced, its plain combination too."""
    from vramctl.estimator import Step
    from vramctl.estimator._shared import resolve_target, run_target
    from vramctl.optimize._plan import _price_layout

    roomy = plan(_encoder(), _batch, device="cpu", effective_batch=16, precisions=["fp32"])
    assert roomy.best is not None
    tight = resolve_target(run_target(vramctl.simulate(int(roomy.best.peak_bytes * 0.45 / 0.9))))
    step = Step(device=tight, mode="train", tf32=False)
    precs = ["fp32", "amp-bf16"]
    args = (None, _encoder(), _batch, step, precs, ["none"], ["none"], ["adamw"])
    plans = _price_layout(*args, effective_batch=16, tf32=False, progress=None, best=[1e-9])
    assert {p.precision for p in plans} == set(precs)
    assert all(p.priced == "pruned" for p in plans)
    assert all("cannot beat the best plan (1e-09 s)" in p.rejected for p in plans)
    # with no best yet, the faster-bounded precision is searched and priced
    plans = _price_layout(*args, effective_batch=16, tf32=False, progress=None, best=[])
    assert any(p.priced == "traced" for p in plans)


def test_plans_within_the_time_models_error_are_called_equivalent() -> None:
    result = plan(
        _encoder(), _batch, device="cpu", effective_batch=8, precisions=["fp32"],
        optimizers=["adamw"], checkpointing=["none", "full"],
    )  # fmt: skip
    best = result.best
    assert best is not None and best.seconds is not None and best.seconds_error
    low, high = best.seconds_range or (0.0, 0.0)
    assert low < best.seconds < high
    assert high / best.seconds - 1 == pytest.approx(best.seconds_error)
    for p in result.plans:
        if p is best or not p.fits or p.seconds is None:
            continue
        assert p.equivalent_to(best) == (p.seconds * (1 - best.seconds_error) <= high)
        assert ("within the time model's" in p.rejected) == p.equivalent_to(best)
    assert result.to_dict()["equivalent_to_best"] == [p.label for p in result.equivalent]
    far = dataclasses.replace(best, seconds=best.seconds * 10)
    assert not far.equivalent_to(best)


def test_a_combination_adds_to_those_with_less_checkpointing_or_offloading() -> None:
    from vramctl.optimize._plan import _adds_to

    assert _adds_to(("none", "none"), ("full", "activations"))
    assert _adds_to(("selective", "optimizer"), ("selective", "activations+optimizer"))
    assert _adds_to(("none", "activations"), ("full", "activations"))
    assert not _adds_to(("none", "activations"), ("none", "optimizer"))
    assert not _adds_to(("selective", "none"), ("full", "none"))  # not ordered
    assert not _adds_to(("full", "none"), ("full", "none"))
    assert not _adds_to(("full", "none"), ("none", "none"))


def test_the_summary_says_each_rejection_in_a_few_words() -> None:
    from vramctl.cli._plan import _short

    assert _short("12% slower than the best (within the time model's ±15%)") == "12% slower"
    pruned = (
        "not priced: fp32 cannot beat the best plan (9.06 s): its forward and backward of the "
        "whole effective batch at once take 9.62 s"
    )
    assert _short(pruned) == "cannot beat the best (at least 9.62 s)"
    added = (
        "not priced: it adds recomputation or copies to checkpointing none, offload "
        "activations, which cannot beat the best plan (9.06 s)"
    )
    assert _short(added) == "cannot beat the best (more than ckpt none, offload activations)"
