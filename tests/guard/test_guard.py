"""The guard on real models: split steps equal whole steps, real OOMs are survived."""

from __future__ import annotations

import contextlib
import copy
import itertools
import warnings
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

import vramctl
from tests.guard.models import forward, loss_fn, make
from vramctl.guard import Guard, GuardEvent, StepDoesNotFitError, guarded

MODELS = ["mlp", "cnn", "transformer", "lstm"]


def FWD(model: nn.Module, batch: Any) -> Any:  # (inputs, targets) batches
    return model(batch[0])


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def _rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    num = sum(float((x - y).double().square().sum()) for x, y in zip(a, b, strict=True))
    den = sum(float(y.double().square().sum()) for y in b)
    return (num / den) ** 0.5


def _full_grads(model: nn.Module, batch: Any, reduction: str) -> tuple[list[torch.Tensor], float]:
    model.zero_grad(set_to_none=True)
    loss = loss_fn(reduction)(model(batch[0]), batch)
    loss.backward()
    grads = _grads(model)
    model.zero_grad(set_to_none=True)
    return grads, float(loss.detach())


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("limit", [4, 7])  # 4: equal pieces of 22 -> 6 pieces; 7: unequal
def test_split_gradients_equal_the_whole_batch(name: str, reduction: str, limit: int) -> None:
    model, batch = make(name, 22)
    want, want_loss = _full_grads(model, batch, reduction)
    guard = Guard(
        model, forward=FWD, loss_fn=loss_fn(reduction), reduction=reduction, piece_limit=limit
    )
    fn = loss_fn(reduction)
    result = guard.train_step(batch, lambda piece: fn(model(piece[0]), piece), update=False)
    assert result.pieces == -(-22 // limit)
    assert _rel(_grads(model), want) <= 1e-6
    assert float(result.loss) == pytest.approx(want_loss, rel=1e-6)


def test_weight_fn_weights_pieces_by_their_own_count() -> None:
    # A token-mean loss with padding: each piece's mean is over its own non-padded tokens.
    model, (ids, y) = make("transformer", 9)
    y = y.clone()
    y[::2, 6:] = -100  # padding in every other sample

    def tok_loss(out: torch.Tensor, batch: Any) -> torch.Tensor:
        return nn.functional.cross_entropy(out.flatten(0, 1), batch[1].flatten(), ignore_index=-100)

    model.zero_grad()
    tok_loss(model(ids), (ids, y)).backward()
    want = _grads(model)
    model.zero_grad(set_to_none=True)
    guard = Guard(
        model,
        forward=FWD,
        loss_fn=tok_loss,
        piece_limit=2,
        weight_fn=lambda p: (p[1] != -100).sum(),
    )
    guard.step((ids, y), update=False)
    assert _rel(_grads(model), want) <= 1e-6


def test_guard_step_takes_one_optimizer_step_equal_to_the_whole_batch() -> None:
    model, batch = make("mlp", 30)
    twin = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt2 = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    guard = Guard(model, opt, forward=FWD, loss_fn=lambda out, b: loss_fn()(out, b), piece_limit=8)
    for _ in range(3):
        guard.step(batch)
        loss_fn()(twin(batch[0]), batch).backward()
        opt2.step()
        opt2.zero_grad()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        assert p.grad is None
    assert guard.summary()["split_steps"] == 3


def test_existing_gradients_are_kept_and_added_to() -> None:
    # Accumulating across guarded steps (update=False): earlier gradients survive an OOM.
    model, batch = make("mlp", 400)
    a, b = (batch[0][:10], batch[1][:10]), (batch[0][10:], batch[1][10:])
    want, _ = _full_grads(model, batch, "sum")
    need = _need(copy.deepcopy(model), b)
    fn = loss_fn("sum")
    with vramctl.simulate("64MiB") as gpu:
        gpu.adopt(model)
        guard = Guard(model, forward=FWD, loss_fn=fn, reduction="sum", device=gpu)
        guard.step(a, update=False)
        hog = gpu.adopt(torch.empty(gpu.free_bytes - need * 3 // 4, dtype=torch.uint8))
        guard.step(b, update=False)  # runs out of memory whole, finishes in pieces
        del hog
    assert guard.ooms >= 1
    assert _rel(_grads(model), want) <= 1e-6


def _need(model: nn.Module, batch: Any) -> int:
    """Bytes a forward and backward on ``batch`` takes over the model (grads included)."""
    with vramctl.simulate("1GiB") as gpu:
        gpu.adopt(model)
        base = gpu.allocated_bytes
        gpu.reset_peak()
        loss_fn()(model(batch[0]), batch).backward()
        peak = gpu.peak_bytes
        model.zero_grad(set_to_none=True)
    return peak - base


def _tight(model: nn.Module, batch: Any, slack: float) -> int:
    """A budget that fits one sample's step but only ``slack`` of the whole batch's activations."""
    with vramctl.simulate("1GiB") as gpu:
        gpu.adopt(model)
        base = gpu.allocated_bytes
    one = _need(model, (batch[0][:1], batch[1][:1]))
    whole = _need(model, batch)
    return base + one + int((whole - one) * slack)


@pytest.mark.parametrize("name", MODELS)
def test_real_oom_on_a_simulated_gpu_is_survived_with_the_same_gradients(name: str) -> None:
    model, batch = make(name, 64)
    want, _ = _full_grads(model, batch, "mean")
    budget = _tight(model, batch, 0.6)
    events: list[GuardEvent] = []
    with vramctl.simulate(budget) as gpu:
        gpu.adopt(model)
        guard = Guard(model, forward=FWD, loss_fn=loss_fn(), device=gpu, on_event=events.append)
        result = guard.step(batch, update=False)
        assert gpu.allocated_bytes < budget
    assert result.ooms >= 1 and result.pieces >= 2
    assert [e.kind for e in events][: result.ooms] == ["oom"] * result.ooms
    assert _rel(_grads(model), want) <= 1e-6
    summary = guard.summary()
    assert summary["ooms"] == result.ooms == summary["ooms_recovered"]
    assert summary["time_lost_s"] > 0


def test_inference_under_pressure_returns_every_output_in_order() -> None:
    model, (x, _) = make("cnn", 40)
    model.eval()
    with torch.no_grad():
        want = model(x)
    with vramctl.simulate("1GiB") as gpu:
        gpu.adopt(model)
        gpu.reset_peak()
        with torch.no_grad():
            model(x[:1])
        one = gpu.peak_bytes - gpu.allocated_bytes
        # Room for about 7 samples' activations: the whole batch fails.
        hog = gpu.adopt(torch.empty(gpu.free_bytes - 7 * one, dtype=torch.uint8))
        guard = Guard(model, device=gpu)
        got = guard.infer(x)
        del hog
    assert guard.ooms >= 1
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@dataclass
class Out:
    logits: torch.Tensor
    loss: torch.Tensor
    names: list[str]


def test_nested_outputs_are_reassembled() -> None:
    x = torch.arange(30.0).view(10, 3)
    names = [f"s{i}" for i in range(10)]

    @guarded(piece_limit=3)
    def run(batch: dict[str, Any]) -> tuple[Out, dict[str, Any]]:
        v = batch["x"]
        return (
            Out(v * 2, v.mean(), list(batch["names"])),
            {"sum": v.sum(dim=1), "const": 7},
        )

    out, extra = run({"x": x, "names": names})
    torch.testing.assert_close(out.logits, x * 2)
    torch.testing.assert_close(out.loss, x.mean())  # size-weighted mean of the pieces
    assert out.names == names
    torch.testing.assert_close(extra["sum"], x.sum(dim=1))
    assert extra["const"] == 7


def test_transformers_model_output_is_reassembled() -> None:
    from transformers.modeling_outputs import SequenceClassifierOutput

    x = torch.randn(9, 4)

    @guarded(piece_limit=4)
    def run(batch: torch.Tensor) -> SequenceClassifierOutput:
        return SequenceClassifierOutput(logits=batch + 1)

    out = run(x)
    assert isinstance(out, SequenceClassifierOutput)
    torch.testing.assert_close(out.logits, x + 1)


def _pressured(model: nn.Module, batch: Any) -> tuple[int, int]:
    """A budget where the whole step fits, and a co-tenant's size that makes it split."""
    with vramctl.simulate("1GiB") as gpu:
        gpu.adopt(model)
        base = gpu.allocated_bytes
    one = _need(model, (batch[0][:1], batch[1][:1]))
    whole = _need(model, batch)
    return base + whole + 4096, int((whole - one) * 0.6) + 4096


def test_piece_size_is_kept_and_grows_back_when_memory_frees() -> None:
    model, batch = make("mlp", 256)
    budget, squeeze = _pressured(model, batch)
    with vramctl.simulate(budget) as gpu:
        gpu.adopt(model)
        guard = Guard(model, forward=FWD, loss_fn=loss_fn(), device=gpu, patience=3)
        hog = gpu.adopt(torch.empty(squeeze, dtype=torch.uint8))
        guard.step(batch, update=False)
        limit = guard.piece_limit
        assert limit is not None and limit < 256
        for _ in range(3):  # memory still taken: the piece size is kept, no new OOM
            model.zero_grad(set_to_none=True)
            r = guard.step(batch, update=False)
            assert r.ooms == 0
            assert guard.piece_limit == limit
        del hog  # the co-tenant leaves
        for _ in range(8):
            model.zero_grad(set_to_none=True)
            guard.step(batch, update=False)
    kinds = [e.kind for e in guard.events]
    assert "grow" in kinds
    assert guard.piece_limit is None  # back to whole batches
    assert kinds.count("oom") == guard.ooms


def test_a_failed_probe_up_doubles_the_wait() -> None:
    model, batch = make("mlp", 256)
    budget, squeeze = _pressured(model, batch)
    with vramctl.simulate(budget) as gpu:
        gpu.adopt(model)
        guard = Guard(model, forward=FWD, loss_fn=loss_fn(), device=gpu, patience=2)
        hog = gpu.adopt(torch.empty(squeeze, dtype=torch.uint8))
        for _ in range(40):  # memory never frees: probes up are rare and back off
            model.zero_grad(set_to_none=True)
            guard.step(batch, update=False)
        del hog
    grows = [e.step for e in guard.events if e.kind == "grow"]
    assert 1 <= len(grows) <= 4
    gaps = [b - a for a, b in itertools.pairwise(grows)]
    assert gaps == sorted(gaps) and len(set(gaps)) == len(gaps)


def test_batchnorm_models_get_a_warning_when_split() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    guard = Guard(model, loss_fn=lambda out, b: out.mean(), piece_limit=3)
    with pytest.warns(vramctl.SplitBatchNormWarning):
        guard.step(torch.randn(10, 4), update=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        guard.step(torch.randn(10, 4), update=False)  # once per guard


def test_grad_scaler_and_clipping_keep_working_when_split() -> None:
    model, batch = make("mlp", 24)
    twin = copy.deepcopy(model)
    runs = []
    for m, limit in ((model, 5), (twin, None)):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        guard = Guard(
            m,
            opt,
            forward=FWD,
            loss_fn=loss_fn(),
            scaler=scaler,
            clip_grad_norm=0.05,
            piece_limit=limit,
        )
        for _ in range(3):
            guard.step(batch)
        runs.append(scaler.get_scale())
    assert runs[0] == runs[1]
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


def _tanh_need(model: nn.Module, x: torch.Tensor, offload: bool) -> int:
    with vramctl.simulate("1GiB") as gpu:
        gpu.adopt(model)
        base = gpu.allocated_bytes
        ctx = vramctl.guard.offload_activations(gpu) if offload else contextlib.nullcontext()
        with ctx:
            model(x).square().mean().backward()
        model.zero_grad(set_to_none=True)
        return gpu.peak_bytes - base


def test_one_sample_that_does_not_fit_is_offloaded_then_reported() -> None:
    # Few weights, many activations: offloading them is what lets one sample fit.
    model = nn.Sequential(nn.Linear(8, 4096), *[nn.Tanh() for _ in range(12)])
    x = torch.randn(1, 8)
    plain, offloaded = _tanh_need(model, x, False), _tanh_need(model, x, True)
    assert offloaded < plain * 0.7
    with vramctl.simulate("1GiB") as gpu:
        gpu.adopt(model)
        params = gpu.allocated_bytes
    with vramctl.simulate(params + (plain + offloaded) // 2) as gpu:
        gpu.adopt(model)
        guard = Guard(model, loss_fn=lambda out, b: out.square().mean(), device=gpu)
        r = guard.step(x, update=False)
        assert r.offloaded and r.ooms == 1
        assert [e.kind for e in guard.events] == ["oom", "offload"]
    model.zero_grad(set_to_none=True)
    with vramctl.simulate(params + offloaded // 2) as gpu:
        gpu.adopt(model)
        guard = Guard(model, loss_fn=lambda out, b: out.square().mean(), device=gpu)
        with pytest.raises(StepDoesNotFitError) as info:
            guard.step(x, update=False)
    report = info.value.report
    assert isinstance(info.value, torch.OutOfMemoryError)
    assert report.model_bytes >= params
    assert report.largest and report.largest[0].name.startswith("param ")
    assert "activations offloaded to host memory" in report.attempts
    assert "suggestion" in str(info.value)
    assert guard.events[-1].kind == "gave_up"


def test_errors_that_are_not_oom_pass_through_and_leave_gradients() -> None:
    model, batch = make("mlp", 8)
    loss_fn()(model(batch[0]), batch).backward()
    before = _grads(model)

    def bad(piece: Any) -> torch.Tensor:
        raise ValueError("not memory")

    guard = Guard(model)
    with pytest.raises(ValueError, match="not memory"):
        guard.train_step(batch, bad)
    assert all(torch.equal(a, b) for a, b in zip(_grads(model), before, strict=True))
    assert guard.ooms == 0


def test_guarded_training_function() -> None:
    model, batch = make("lstm", 12)
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fwd = forward(model)
    step = guarded(lambda b: loss_fn()(fwd(b), b), optimizer=opt, piece_limit=5)
    result = step(batch)
    assert result.pieces == 3 and result.batch_size == 12
    opt2 = torch.optim.SGD(twin.parameters(), lr=0.1)
    loss_fn()(twin(batch[0]), batch).backward()
    opt2.step()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="optimizer"):
        guarded(lambda b: b, train=True)


def test_listeners_see_every_guards_events() -> None:
    seen: list[GuardEvent] = []
    vramctl.guard.add_listener(seen.append)
    try:
        model, batch = make("mlp", 128)
        budget = _tight(model, batch, 0.6)
        with vramctl.simulate(budget) as gpu:
            gpu.adopt(model)
            Guard(model, forward=FWD, loss_fn=loss_fn(), device=gpu).step(batch, update=False)
    finally:
        vramctl.guard.remove_listener(seen.append)
    assert seen and seen[0].kind == "oom" and seen[0].to_dict()["batch_size"] == 128


@pytest.mark.cuda
def test_cuda_oom_is_survived_with_the_same_gradients() -> None:
    # cuDNN convolutions run in TF32 by default from Ampere on: pieces and the whole batch
    # would differ by TF32's rounding (5e-4 on an H200), not by anything the guard does.
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        _cuda_oom_is_survived_with_the_same_gradients()


def _cuda_oom_is_survived_with_the_same_gradients() -> None:
    dev = torch.device("cuda")
    model, batch = make("cnn", 256)
    model = model.to(dev)
    batch = (batch[0].to(dev), batch[1].to(dev))
    want, _ = _full_grads(model, batch, "mean")
    torch.cuda.reset_peak_memory_stats()
    loss_fn()(model(batch[0]), batch).backward()
    need = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
    model.zero_grad(set_to_none=True)
    # Measured after the step, with the cache given back: what the step kept cached would
    # otherwise be room the cap does not count, and the whole batch would fit.
    torch.cuda.empty_cache()
    # PyTorch's allocator is capped at what it holds now and half the step's need. A cap, not
    # a tensor taking the rest of the GPU: the driver keeps memory to load kernels (an H200's
    # driver failed with its own out-of-memory error when a tensor took nearly everything).
    total = torch.cuda.get_device_properties(dev).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + need // 2) / total)
    try:
        guard = Guard(model, forward=FWD, loss_fn=loss_fn())
        result = guard.step(batch, update=False)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert result.ooms >= 1
    assert _rel(_grads(model), want) <= 1e-5  # cuDNN/cuBLAS may pick other kernels per size


def test_an_optimizer_step_that_runs_out_of_memory_is_not_run_twice() -> None:
    # AdamW updates its moments and step count in place before it needs its temporaries.
    model = nn.Linear(256, 256)
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    x = torch.randn(8, 256)
    with vramctl.simulate("64MiB") as gpu:
        gpu.adopt(model)
        guard = Guard(model, opt, loss_fn=lambda out, b: out.square().mean(), device=gpu)
        guard.step(x)  # the optimizer's state now exists
        steps_before = [int(s["step"]) for s in opt.state.values()]
        grads = 4 * (256 * 256 + 256)
        hog = gpu.adopt(torch.empty(gpu.free_bytes - grads - 65536, dtype=torch.uint8))
        with pytest.raises(StepDoesNotFitError, match="optimizer step does not fit"):
            guard.step(x)
        del hog
    assert [int(s["step"]) for s in opt.state.values()] == [n + 1 for n in steps_before]
    summary = guard.summary()
    assert summary["ooms"] == 1 and summary["ooms_recovered"] == 0
    assert [e.kind for e in guard.events][-2:] == ["optimizer_oom", "gave_up"]


def test_a_guard_made_inside_a_simulated_gpu_uses_it() -> None:
    model, batch = make("mlp", 64)
    budget = _tight(model, batch, 0.6)
    with vramctl.simulate(budget) as gpu:
        gpu.adopt(model)
        assert vramctl.current_device() is gpu
        guard = Guard(model, forward=FWD, loss_fn=loss_fn())  # no device=
        assert guard.device is gpu and guard.offload  # offload works on a simulated GPU
        assert guard.step(batch, update=False).ooms >= 1
    assert vramctl.current_device().id == "cpu"
