"""fit_batch_size on a simulated GPU: real models, real optimizers, real allocations."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import vramctl
from tests.fit.models import (
    SmallCnn,
    TokenMlp,
    cnn_batch,
    mlp_batch,
    train_step,
    true_max,
)
from vramctl.fit import FitError, FitResult, fit_batch_size

MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[int], torch.Tensor], str]] = {
    # Sized so that the largest batch is in the low hundreds.
    "mlp": (TokenMlp, mlp_batch, "48MiB"),
    "cnn": (SmallCnn, cnn_batch, "32MiB"),
}


def tensors_of(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "opt": opt.state_dict()}


def assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("name", sorted(MODELS))
def test_within_3_percent_of_the_true_max_in_3_probes(name: str) -> None:
    """The fitted size against a real search; weights and optimizer state are unchanged."""
    cls, make_batch, size = MODELS[name]
    torch.manual_seed(0)
    with vramctl.simulate(size) as gpu:
        model = cls()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step = train_step(model, opt)
        step(make_batch(4))  # the optimizer has state: it must come back as it was
        with gpu.host():
            before = copy.deepcopy(tensors_of(model, opt))
        allocated = gpu.allocated_bytes
        rng = torch.get_rng_state()

        fit = fit_batch_size(step, make_batch, device=gpu, model=model, optimizer=opt, cache=False)

        assert gpu.allocated_bytes == allocated
        assert_same(tensors_of(model, opt), before)
        assert torch.equal(torch.get_rng_state(), rng)
        assert all(p.grad is None for p in model.parameters())

    # The truth by real OOMs, each try on a fresh simulated GPU of the budget fit targets.
    truth = true_max(model, opt, train_step, make_batch, fit.budget, near=fit.batch_size)
    assert 50 <= truth <= 500
    assert fit.source == "probe"
    assert fit.predicted is not None and fit.predicted > 0
    assert len(fit.probes) <= 3
    assert 0.97 * truth <= fit.batch_size <= truth
    assert fit.peak_used is not None and fit.peak_used <= fit.budget
    assert fit.budget == int(0.9 * gpu.total_bytes)
    assert (fit.batch_size, fit.peak_used, True) in fit.probes


def test_a_step_with_model_and_optimizer_attributes_seeds_the_estimate() -> None:
    class Step:
        def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
            self.model, self.optimizer = model, optimizer

        def __call__(self, batch: torch.Tensor) -> None:
            self.model(batch).square().mean().backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    with vramctl.simulate("48MiB") as gpu:
        model = TokenMlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        with gpu.host():
            weights = copy.deepcopy(model.state_dict())
        fit = fit_batch_size(Step(model, opt), mlp_batch, cache=False)  # device: the active one
        assert_same(model.state_dict(), weights)
        assert opt.state_dict()["state"] == {}
    assert fit.device == gpu.id
    assert fit.predicted is not None
    assert len(fit.probes) <= 3


def test_an_oom_probe_leaves_nothing_allocated() -> None:
    with vramctl.simulate("48MiB") as gpu:
        model = TokenMlp()
        opt = torch.optim.Adam(model.parameters())
        step = train_step(model, opt)
        allocated = gpu.allocated_bytes
        ooms = gpu.ooms
        fit = fit_batch_size(
            step, mlp_batch, device=gpu, model=model, optimizer=opt, start=2000, cache=False
        )
        assert gpu.ooms > ooms
        assert fit.probes[0] == (2000, None, False)
        assert gpu.allocated_bytes == allocated
        assert opt.state_dict()["state"] == {}
    assert 0 < fit.batch_size < 2000
    assert fit.peak_used is not None and fit.peak_used <= fit.budget


def test_every_probe_runs_under_the_budget_as_its_allocator_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each probe runs inside the device's ``capped(budget)`` (on CUDA: the allocator's cap,
    so that a step that fits once the cache is given back is not taken for a miss); the
    probe's peak is measured inside it."""
    from vramctl.device._simulate import SimulatedDevice

    seen: list[tuple[int, int]] = []
    real = SimulatedDevice.capped

    def capped(self: SimulatedDevice, budget: int) -> Any:
        seen.append((budget, self.allocated_bytes))
        return real(self, budget)

    monkeypatch.setattr(SimulatedDevice, "capped", capped)
    with vramctl.simulate("48MiB") as gpu:
        model = TokenMlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        fit = fit_batch_size(train_step(model, opt), mlp_batch, device=gpu, cache=False)
    assert len(seen) == len(fit.probes) >= 1
    assert {budget for budget, _ in seen} == {fit.budget}


def test_a_step_that_catches_its_own_oom_does_not_fit() -> None:
    """A Guard finishes an oversized step in pieces; the probe still counts as not fitting."""
    with vramctl.simulate("48MiB") as gpu:
        model = TokenMlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        guard = vramctl.guard.Guard(
            model, opt, loss_fn=lambda out, batch: out.square().mean(), device=gpu
        )
        fit = fit_batch_size(guard, mlp_batch, start=600, cache=False)
        assert guard.piece_limit is None  # what the guard learnt while probing is undone
    assert fit.probes[0] == (600, None, False)
    assert 0 < fit.batch_size < 600


def test_a_guard_is_estimated_as_it_calls_the_model() -> None:
    """Its forward(model, batch) and loss_fn(out, batch) reach the estimate."""
    model = nn.Sequential(nn.Linear(64, 1024), nn.GELU(), nn.Linear(1024, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def make_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 16, 64), torch.randn(n, 16, 1)

    def guard_of(model: nn.Module, opt: torch.optim.Optimizer) -> vramctl.Guard:
        return vramctl.guard.Guard(  # on the device active where it is made
            model,
            opt,
            loss_fn=lambda out, batch: (out - batch[1]).square().mean(),
            forward=lambda m, batch: m(batch[0]),
        )

    with vramctl.simulate("24MiB") as gpu:
        gpu.adopt(model)
        guard = guard_of(model, opt)
        assert guard.device is gpu
        fit = fit_batch_size(guard, make_batch, cache=False)
    truth = true_max(model, opt, guard_of, make_batch, fit.budget, near=fit.batch_size)
    assert not any("estimate failed" in n for n in fit.notes)
    assert fit.predicted is not None and fit.predicted > 0
    assert len(fit.probes) <= 3
    assert 0.97 * truth <= fit.batch_size <= truth


def test_without_a_model_it_searches_from_start() -> None:
    with vramctl.simulate("48MiB") as gpu:
        model = TokenMlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step = train_step(model, opt)
        fit = fit_batch_size(step, mlp_batch, device=gpu, cache=False)
    truth = true_max(model, opt, train_step, mlp_batch, fit.budget, near=fit.batch_size)
    assert fit.predicted is None
    assert fit.probes[0][0] == 1
    assert 0.97 * truth <= fit.batch_size <= truth


def test_max_and_target_are_respected() -> None:
    with vramctl.simulate("48MiB") as gpu:
        model = TokenMlp()
        step = train_step(model, torch.optim.SGD(model.parameters(), lr=0.1))
        capped = fit_batch_size(step, mlp_batch, max=20, cache=False)
        started = fit_batch_size(step, mlp_batch, start=7, max=400, cache=False)
        low = fit_batch_size(step, mlp_batch, target=0.5, start=50, cache=False)
        high = fit_batch_size(step, mlp_batch, target=0.9, start=50, cache=False)
    assert capped.batch_size == 20 and all(b <= 20 for b, _, _ in capped.probes)
    assert any("max=20" in n for n in capped.notes)
    assert started.probes[0][0] == 7 and all(b <= 400 for b, _, _ in started.probes)
    assert low.budget == int(0.5 * gpu.total_bytes)
    assert low.batch_size < high.batch_size


def test_nothing_fits_says_what_batch_1_needs() -> None:
    with vramctl.simulate("16MiB") as gpu:
        model = nn.Linear(64, 4096)
        step = train_step(model, torch.optim.SGD(model.parameters(), lr=0.1))

        def huge(b: int) -> torch.Tensor:
            return torch.randn(b, 3000, 64)  # 0.77 MB of input, 49 MB of output per sample

        with pytest.raises(FitError) as info:
            fit_batch_size(step, huge, device=gpu, model=model, cache=False)
        assert gpu.allocated_bytes == sum(p.nbytes for p in model.parameters())
    msg = str(info.value)
    assert "batch size 1" in msg and "sim:16MiB" in msg
    assert "budget of 14.40 MiB" in msg  # 0.9 x 16 MiB
    assert "gradient checkpointing" in msg


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"target": 0}, "target must be in"),
        ({"target": 1.5}, "target must be in"),
        ({"start": 0}, "start must be a positive integer"),
        ({"start": 8, "max": 4}, "above max"),
        ({"steps_per_probe": 0}, "at least 1"),
    ],
)
def test_bad_arguments(kwargs: dict[str, Any], match: str) -> None:
    with vramctl.simulate("48MiB"), pytest.raises(FitError, match=match):
        fit_batch_size(lambda b: None, mlp_batch, cache=False, **kwargs)


def test_make_batch_failing_is_a_fit_error(tmp_path: Path) -> None:
    def broken(b: int) -> torch.Tensor:
        raise KeyError("no such column")

    with vramctl.simulate("48MiB") as gpu:
        with pytest.raises(FitError, match=r"make_batch\(1\) failed: KeyError"):
            fit_batch_size(lambda b: None, broken, device=gpu, cache_dir=tmp_path)
        with pytest.raises(FitError, match=r"make_batch\(1\) failed: KeyError"):
            fit_batch_size(lambda b: None, broken, device=gpu, cache=False)


def test_a_simulated_device_must_be_active() -> None:
    gpu = vramctl.simulate("48MiB")
    with pytest.raises(FitError, match="not active"):
        fit_batch_size(lambda b: None, mlp_batch, device=gpu, cache=False)


def test_the_cpu_device() -> None:
    model = TokenMlp()
    step = train_step(model, torch.optim.SGD(model.parameters(), lr=0.1))
    fit = fit_batch_size(step, mlp_batch, device="cpu", max=32, cache=False)
    assert fit.device == "cpu"
    assert fit.batch_size == 32


def test_result_to_dict() -> None:
    fit = FitResult(
        batch_size=48,
        peak_used=100,
        budget=200,
        predicted=40,
        probes=[(40, 90, True), (48, 100, True)],
        elapsed=0.5,
        device="sim:1GiB",
    )
    d = fit.to_dict()
    assert d["batch_size"] == 48 and d["source"] == "probe"
    assert d["probes"][1] == {"batch_size": 48, "peak_used_bytes": 100, "fits": True}
    with pytest.raises(AttributeError):
        fit.batch_size = 1  # type: ignore[misc]


def test_the_estimate_for_a_gpu_leaves_out_what_other_processes_hold(
    gpus: list[Any],
) -> None:
    """The seed's budget on a shared GPU: the target share, less other processes' memory."""
    import os

    from tests.fake_nvml import FakeProcess
    from vramctl.fit._seed import _estimator_target

    model = nn.Linear(8, 8)
    busy = vramctl.get_device("cuda:0")  # 20 GiB of 80 held by pid 4242 (and the driver)
    where = _estimator_target(busy, 0.9, model, None)
    assert where is not None and where[0] is busy
    total = gpus[0].total
    assert where[1] == pytest.approx((0.9 * total - gpus[0].used) / total)
    # This process's own memory is the step's, not another's.
    gpus[0].processes.append(FakeProcess(os.getpid(), 4 * 2**30))
    gpus[0].used += 4 * 2**30
    again = _estimator_target(busy, 0.9, model, None)
    assert again is not None and again[1] == pytest.approx(where[1])
    # A GPU others fill beyond the target leaves no room: the estimate is skipped.
    gpus[0].used = int(0.95 * total)
    assert _estimator_target(busy, 0.9, model, None) is None
    idle = vramctl.get_device("cuda:1")
    share = _estimator_target(idle, 0.9, model, None)
    assert share is not None and share[1] == pytest.approx((0.9 * total - gpus[1].used) / total)


def test_the_seed_for_a_gpu_prices_this_processs_allocator_setting(
    gpus: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fit on a GPU estimates the caching allocator as this process runs it: the
    environment's PYTORCH_CUDA_ALLOC_CONF (expandable segments), unless the options say."""
    from vramctl.estimator import AllocatorConfig, Step
    from vramctl.fit import _seed

    priced: list[Any] = []

    def search(model: Any, make_batch: Any, *, step: Step, **kw: Any) -> Any:
        priced.append(step.allocator_config)
        raise RuntimeError("stop here")

    monkeypatch.setattr(_seed, "max_batch_size", search)
    gpu = vramctl.get_device("cuda:1")

    def seed(request: Step) -> None:
        _seed.predict(nn.Linear(8, 8), torch.zeros, gpu, 0.9, request, None, {})

    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    seed(Step())
    split = AllocatorConfig(max_split_size=256 * 2**20)
    seed(Step(allocator_config=split))  # the caller's own setting stands
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    seed(Step())
    assert priced == [AllocatorConfig(expandable_segments=True), split, None]


def test_estimate_options_as_a_step_or_a_mapping_seed_the_same_search() -> None:
    # The options reach the estimate as one vramctl.Step, whichever way they are given;
    # fp16 activations seed a larger batch than the fp32 default.
    seeds = {}
    for name, options in (
        ("none", None),
        ("mapping", {"precision": "amp-fp16"}),
        ("step", vramctl.Step(precision="amp-fp16")),
    ):
        with vramctl.simulate("48MiB"):
            torch.manual_seed(0)
            model = TokenMlp()
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            fit = fit_batch_size(
                train_step(model, opt),
                mlp_batch,
                model=model,
                optimizer=opt,
                cache=False,
                max_probes=1,
                estimate_options=options,
            )
        seeds[name] = fit.predicted
    assert seeds["mapping"] == seeds["step"] is not None
    assert seeds["none"] is not None and seeds["step"] > seeds["none"]


def test_estimate_options_of_another_type_are_refused() -> None:
    with (
        vramctl.simulate("48MiB"),
        pytest.raises(FitError, match=r"vramctl\.Step or a mapping"),
    ):
        options: Any = ["fp16"]
        fit_batch_size(lambda b: None, mlp_batch, cache=False, estimate_options=options)


def test_the_seed_is_judged_at_the_safe_end_unless_the_caller_says_otherwise() -> None:
    """On a real GPU the estimate's range runs above its point estimate; the first probe is
    placed so that the range's top fits (a first probe that fits measures a real peak)."""
    from vramctl.fit._seed import estimate_request

    model = TokenMlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = train_step(model, opt)
    request, _, readings = estimate_request(None, step, "train", opt)
    assert request.safe is True
    assert readings == (True, False)  # the loop's hold on the output: both, unless said
    request, _, readings = estimate_request({"safe": False}, step, "train", opt)
    assert request.safe is False
    _, _, readings = estimate_request({"keep_output": False}, step, "train", opt)
    assert readings == (False,)
    _, _, readings = estimate_request(None, step, "infer", None)
    assert readings == (True,)


def test_on_a_gpu_that_replays_the_caching_allocator_the_answer_runs_under_its_cap() -> None:
    """A simulated GPU whose storages go through the caching allocator model: every probe
    is capped at the budget (the allocator gives its cache back and retries before it
    refuses); the answer runs again under the same cap with no OOM, and the only OOMs the
    device saw are the probes that did not fit."""
    from vramctl.estimator import CachingAllocatorModel

    torch.manual_seed(0)
    with vramctl.simulate("48MiB", allocator=CachingAllocatorModel()) as gpu:
        model = TokenMlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step = train_step(model, opt)
        fit = fit_batch_size(step, mlp_batch, device=gpu, model=model, optimizer=opt, cache=False)
        assert fit.batch_size >= 1
        assert all(peak is None or peak <= fit.budget for _, peak, ok in fit.probes if ok)
        with gpu.capped(fit.budget):
            for _ in range(3):
                step(mlp_batch(fit.batch_size))
        assert gpu.memory().ooms == sum(1 for _, peak, _ in fit.probes if peak is None)


def holding_step(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[Any], None]:
    """A step that keeps the model's output until backward is done (as the estimator's
    step does, and most training loops: ``out = model(x); loss = ...; loss.backward()``)."""

    def step(x: torch.Tensor) -> None:
        out = model(x)
        loss = out.float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del out

    return step


def test_a_probe_that_allocates_what_the_estimate_said_confirms_its_edge() -> None:
    """On a GPU that replays the caching allocator, the estimate replays it too and finds
    the edge (b fits, b + 1 does not); the first probe, at b, allocates what the estimate
    predicted, so the edge holds without probing further. It is the real edge, as a probe
    measures it (on a fresh device, model and optimizer, from a settled allocator, under
    the budget as a cap): b fits, b + 1 does not.

    (A run that starts with what the model's initialisation left cached can fail
    below it: the allocator's cache depends on the history, which no probe repeats.)"""
    from vramctl.estimator import CachingAllocatorModel
    from vramctl.fit._probe import Prober

    def fresh(b: int) -> bool:
        torch.manual_seed(0)
        with vramctl.simulate("96MiB", allocator=CachingAllocatorModel()) as gpu:
            model = SmallCnn()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            probe = Prober(holding_step(model, opt), cnn_batch, gpu, fit.budget, 2, [model, opt])
            return probe(b).fits

    torch.manual_seed(0)
    with vramctl.simulate("96MiB", allocator=CachingAllocatorModel()) as gpu:
        model = SmallCnn()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step = holding_step(model, opt)
        fit = fit_batch_size(step, cnn_batch, device=gpu, model=model, optimizer=opt, cache=False)
    assert len(fit.probes) == 1 and fit.batch_size == fit.predicted
    assert any("the estimate's edge held" in n for n in fit.notes)
    assert fresh(fit.batch_size) and not fresh(fit.batch_size + 1)


def test_a_probe_follows_the_reading_of_the_loop_whose_allocations_it_matched() -> None:
    """Two readings of the loop (holding the model's output through backward, or not):
    a probe that allocated as one predicted (within 1%) confirms that reading's edge at its
    answer, or goes on to its answer from below it; one that matches neither, and a probe
    that failed, are not followed."""
    from vramctl.fit._fit import _follow
    from vramctl.fit._search import Probe, Search
    from vramctl.fit._seed import Reading, Seed

    holds = Reading(True, 100, True, allocated_at={100: 200_000_000}.get)
    lets_go = Reading(False, 120, True, None, {100: 190_000_000, 120: 230_000_000}.get)
    seed = Seed(100, 1e6, None, (holds, lets_go))

    def follow(*probes: tuple[int, int | None]) -> tuple[int | None, int | None, list[str]]:
        search = Search(10**9, None, 1e6, 0.01, None)
        for b, allocated in probes:
            fits = allocated is not None
            search.probes.append(Probe(b, 250_000_000 if fits else None, fits, 0, None, allocated))
        notes: list[str] = []
        return _follow(search, seed, notes), search.edge, notes

    got, edge, notes = follow((100, 201_000_000))
    assert (got, edge) == (None, 101) and "holds the model's output" in notes[0]
    got, edge, notes = follow((100, 190_500_000))
    assert (got, edge) == (120, None) and "lets go of the model's output" in notes[0]
    got, edge, _ = follow((100, 190_500_000), (120, 229_000_000))
    assert (got, edge) == (None, 121)
    assert follow((100, 150_000_000))[:2] == (None, None)  # no refit to fall back on
    assert follow((100, None))[:2] == (None, None)


def test_a_refit_goes_no_further_than_the_first_probes_peak_scaled_to_the_budget() -> None:
    """A first probe that allocated what no reading predicted refits the estimate. The
    refit is the estimate's own requests less the missing bytes, not the real step's: it is
    probed only where the probe's measured peak, scaled to the budget, reaches as far."""
    from vramctl.fit._fit import _follow
    from vramctl.fit._search import Probe, Search, scaled
    from vramctl.fit._seed import Reading, Seed

    def follow(refit_to: int) -> tuple[int | None, list[str]]:
        reading = Reading(True, 100, False, lambda _b, _a: refit_to, {100: 200_000_000}.get)
        search = Search(1_000_000_000, None, 1e6, 0.01, None)
        # 100 samples added 300 MB over the 100 MB held: 300 fit the budget by scaling
        search.probes.append(Probe(100, 400_000_000, True, 100_000_000, None, 150_000_000))
        assert scaled(search.probes[0], search.budget) == 300
        notes: list[str] = []
        return _follow(search, Seed(100, 1e6, None, (reading,)), notes), notes

    got, notes = follow(320)
    assert got == 300 and "probing 300 first" in notes[0] and "320" in notes[0]
    got, notes = follow(280)
    assert got == 280 and notes == ["refitted the estimate to the first probe's allocations: 280"]


def test_a_first_probe_that_allocates_less_than_estimated_refits_the_estimate() -> None:
    """The estimate keeps the model's output through backward; this step does not, so the
    first probe allocates less than predicted. The second probe is the estimate refitted to
    it (the difference taken as bytes per sample, the allocator's staircase replayed), and
    the search ends within 3% of what probing alone finds, in at most three probes."""
    from vramctl.estimator import CachingAllocatorModel

    def fit_on_fresh_gpu(**kw: Any) -> FitResult:
        torch.manual_seed(0)
        with vramctl.simulate("96MiB", allocator=CachingAllocatorModel()) as gpu:
            # an output of 128 KiB per sample, eight times its hidden layer
            model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 2048))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

            def step(x: torch.Tensor) -> None:
                # cross-entropy keeps its log-softmax, not the output (the estimate's
                # default loss, the mean square, keeps the output)
                out = model(x).flatten(0, 1)
                target = torch.zeros(out.shape[0], dtype=torch.long)
                nn.functional.cross_entropy(out, target).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            return fit_batch_size(
                step, mlp_batch, device=gpu, model=model, optimizer=opt, cache=False, **kw
            )

    fit = fit_on_fresh_gpu()
    assert any("refitted the estimate" in n for n in fit.notes)
    assert len(fit.probes) <= 3
    probed = fit_on_fresh_gpu(estimate=False, start=32, max_probes=20, tolerance=0.0)
    assert fit.batch_size >= 0.97 * probed.batch_size
