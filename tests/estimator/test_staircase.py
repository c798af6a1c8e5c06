"""Estimates on a GPU that replays the caching allocator, and sizes that fit again above an
edge (the allocator's staircase)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

import vramctl
from tests.fit.models import SmallCnn
from vramctl.estimator import AllocatorConfig, AllocatorOutOfMemory, CachingAllocatorModel
from vramctl.estimator import estimate as estimate_step
from vramctl.estimator._maxbatch import _past_edge
from vramctl.estimator._staircase import Requests
from vramctl.estimator._target import run_target
from vramctl.estimator._trace import StorageRecord, Trace
from vramctl.estimator._verdict import replay

MiB = 2**20


def test_a_simulated_gpu_with_an_allocator_model_is_estimated_with_it() -> None:
    with vramctl.simulate("64MiB", allocator=CachingAllocatorModel()) as gpu:
        target = run_target(gpu)
        assert not target.cuda and target.allocator is not None
        assert target.allocator.capacity is None  # the budget is the estimate's to judge
    with vramctl.simulate("64MiB") as plain:
        assert run_target(plain).allocator is None


def test_its_reserved_peak_is_the_devices() -> None:
    """The requests the device's allocator model sees are the trace's less the CPU kernels'
    scratch (host memory no simulated GPU counts): the replay reserves what it did."""
    torch.manual_seed(0)
    with vramctl.simulate("1GiB", allocator=CachingAllocatorModel()) as gpu:
        model = SmallCnn()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(2):
            out = model(torch.randn(300, 3, 32, 32))
            out.float().square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del out
        real = gpu.memory()
        est = estimate_step(
            model,
            lambda b: torch.randn(b, 3, 32, 32),
            batch_size=300,
            device=run_target(gpu),
            optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
        )
    assert est.peak_reserved == real.peak_reserved
    assert abs(est.peak_allocated - real.peak_allocated) <= 0.01 * real.peak_allocated
    assert est.peak_device == est.peak_reserved
    assert any("caching allocator model" in n for n in est.notes)


def _step(b: int) -> Trace:
    """Three blocks of 100 KiB per sample, live together. Up to 68 samples the three share
    one 20 MiB segment; from 69 they need two (40 MiB); from 103 each is over 10 MiB and
    gets a segment of its own, rounded to 2 MiB (36 MiB up to 122 samples)."""
    records = [StorageRecord(100 * 1024 * b, "", "", "forward") for _ in range(3)]
    return Trace(events=[0, 1, 2, ~0, ~1, ~2], records=records)


def _fits(b: int, capacity: int) -> bool:
    try:
        replay(_step(b), capacity, AllocatorConfig())
    except AllocatorOutOfMemory:
        return False
    return True


def test_the_largest_size_the_replay_serves_is_found_from_two_traces() -> None:
    cap = 64 * MiB
    requests = Requests.between(_step(30), _step(31), 30)
    assert requests is not None
    got = requests.largest(30, 10_000, cap, AllocatorConfig())
    assert got is not None and _fits(got, cap) and not _fits(got + 1, cap)
    assert all(not _fits(b, cap) for b in range(got + 1, got + 40))
    # traces whose requests differ in number are not extrapolated
    other = Trace(events=[0, ~0], records=[StorageRecord(MiB, "", "", "forward")])
    assert Requests.between(_step(30), other, 30) is None


def test_an_edge_below_a_stretch_that_fits_again_is_passed() -> None:
    """The staircase above within 36 MiB: 68 fits, 69-102 do not, 103-122 fit again. From
    the first edge the search moves to the second, where a trace confirms it."""
    cap = 36 * MiB
    fits = [b for b in range(1, 200) if _fits(b, cap)]
    assert fits == [*range(1, 69), *range(103, 123)]
    traced: list[int] = []

    def at(b: int) -> Any:
        traced.append(b)
        peak = replay(_step(b), None, AllocatorConfig()).peak_reserved
        return SimpleNamespace(fits=_fits(b, cap), peak_device=peak, peak_reserved=peak)

    requests = {68: _step(68), 69: _step(69)}
    assert _past_edge(at, requests, 68, cap, 10_000, AllocatorConfig()) == 122
    assert traced == [68, 122, 123]  # the edge read, then the traces of 122 and 123

    # where the traces say otherwise, the edge stays
    def refused(b: int) -> Any:
        return SimpleNamespace(fits=b <= 68, peak_device=0, peak_reserved=0)

    assert _past_edge(refused, requests, 68, cap, 10_000, AllocatorConfig()) == 68


def test_a_refit_takes_the_bytes_a_real_step_did_not_allocate_as_a_tensor_per_sample() -> None:
    """The estimate holds a fourth block per sample at its peak (its step keeps the model's
    output through backward); the real step does not. From the real step's allocated peak
    at one size, the refit moves the cap by that block and replays the estimate's requests:
    its answer is the real step's largest. (Where the block the real step lacks shares a
    20 MiB segment with others, the moved cap can overstate the room: a probe there fails,
    and the fit's search goes on from it.)"""

    def step(b: int, blocks: int) -> Trace:
        records = [StorageRecord(200 * 1024 * b, "", "", "forward") for _ in range(blocks)]
        return Trace(events=[*range(blocks), *(~i for i in range(blocks))], records=records)

    def fits(b: int, cap: int) -> bool:
        try:
            replay(step(b, 3), cap, AllocatorConfig())
        except AllocatorOutOfMemory:
            return False
        return True

    cap = 100 * MiB
    requests = Requests.between(step(60, 4), step(61, 4), 60)
    assert requests is not None
    real_at_60 = 3 * 200 * 1024 * 60
    got = requests.refit(60, real_at_60, 10_000, cap, AllocatorConfig())
    real_max = max(b for b in range(52, 300) if fits(b, cap))
    assert got == real_max == 163
    # the estimate's own requests stop well below
    assert (requests.largest(60, 10_000, cap, AllocatorConfig()) or 0) < 0.8 * real_max


def _token_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 1024),
        torch.nn.GELU(),
        torch.nn.Linear(1024, 256),
        torch.nn.GELU(),
        torch.nn.Linear(256, 10),
    )


def _loop(model: torch.nn.Module, b: int, steps: int, *, keep_output: bool = True) -> int | None:
    """The step at which a training loop of ``b`` samples a step (a new batch each) runs
    out of memory, or None."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for i in range(1, steps + 1):
        try:
            x = torch.randn(b, 16, 64)
            out = model(x)
            loss = out.float().square().mean() if keep_output else model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del out, loss, x
        except torch.OutOfMemoryError:
            return i
    return None


def test_a_size_whose_second_step_runs_out_of_memory_does_not_fit() -> None:
    """The first step of a loop takes its segments from an empty cache; the second is served
    from the blocks the first left cached, and splits them: at 1850 samples this MLP's
    second step needs a segment the cap has no room for, though its first step fitted. The
    estimate replays the loop's steps, not one, and says so; at 1824 the loop runs."""
    budget = int(0.9 * 512 * MiB)

    def estimated(b: int) -> Any:
        with vramctl.simulate(budget, allocator=CachingAllocatorModel()) as gpu:
            return estimate_step(
                _token_mlp(),
                lambda n: torch.randn(n, 16, 64),
                batch_size=b,
                device=run_target(gpu),
                target_utilization=1.0,
                optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4),
            )

    def real(b: int) -> int | None:
        with vramctl.simulate(budget, allocator=CachingAllocatorModel()):
            return _loop(_token_mlp(), b, 4)

    assert real(1850) == 2
    assert not estimated(1850).fits
    assert real(1824) is None
    assert estimated(1824).fits


def test_a_loop_that_lets_go_of_the_output_before_backward_is_estimated_as_one() -> None:
    """``keep_output=False`` prices a loop whose step returns the loss alone (Lightning's,
    the Hugging Face Trainer's): the model's output is let go before backward, so only
    what the loss saved stays. Its allocations are the device's to the byte, and they are
    not the held output's."""

    def built() -> torch.nn.Module:  # on the device, as the estimate counts it
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 2048)
        )

    def loss_fn(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # cross-entropy saves its log-softmax, not the output
        return torch.nn.functional.cross_entropy(
            out.flatten(0, 1), torch.zeros(out.shape[0] * out.shape[1], dtype=torch.long)
        )

    def real(keep: bool) -> int:
        with vramctl.simulate("1GiB", allocator=CachingAllocatorModel()) as gpu:
            model = built()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            for _ in range(2):
                x = torch.randn(64, 16, 64)
                out = model(x)
                loss = loss_fn(out, x)
                if not keep:
                    del out
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                del loss, x
            return int(gpu.memory().peak_allocated)

    def estimated(keep: bool) -> int:
        with vramctl.simulate("1GiB", allocator=CachingAllocatorModel()) as gpu:
            return estimate_step(
                built(),
                lambda n: torch.randn(n, 16, 64),
                batch_size=64,
                device=run_target(gpu),
                optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4),
                loss_fn=loss_fn,
                keep_output=keep,
            ).peak_allocated

    held, let_go = real(True), real(False)
    assert let_go < held - 64 * 16 * 2048 * 4 // 2  # most of the output's 8 MiB
    assert estimated(True) == held
    assert estimated(False) == let_go
