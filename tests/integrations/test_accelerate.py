"""vramctl's ``find_executable_batch_size``: Accelerate's call shape, measured probes.

Real models and optimizers on simulated GPUs, real out-of-memory errors; the truth is found by
running the step at each size under the budget until it fails (``tests.fit.models.true_max``).
"""

from __future__ import annotations

import copy
import gc
import logging
import weakref
from collections.abc import Callable
from typing import Any

import accelerate.utils  # type: ignore[import-untyped]
import pytest
import torch
from torch import nn
from torch.optim.optimizer import _global_optimizer_post_hooks

import vramctl
from tests.fit.models import TokenMlp, mlp_batch, train_step, true_max
from vramctl.integrations.accelerate import (
    BatchSizeSearchError,
    Trial,
    find_executable_batch_size,
)

MiB = 2**20
CAPACITY = 16 * MiB
BUDGET = int(0.9 * CAPACITY)
STEPS = 3  # optimizer steps the training function runs


def make_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TokenMlp()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def training(calls: list[int]) -> Callable[..., int]:
    """A training function in Accelerate's shape: ``train(batch_size, model, opt)``."""

    def train(batch_size: int, model: nn.Module, opt: torch.optim.Optimizer) -> int:
        calls.append(batch_size)
        x = mlp_batch(batch_size)
        step = train_step(model, opt)
        for _ in range(STEPS):
            step(x)
        return batch_size

    return train


def test_the_same_call_shapes_as_accelerate() -> None:
    calls: list[int] = []
    train = training(calls)
    bare = find_executable_batch_size(train)
    called = find_executable_batch_size(starting_batch_size=16)(train)
    positional = find_executable_batch_size(train, 8)
    with vramctl.simulate(CAPACITY) as gpu:
        model, opt = make_model()
        gpu.adopt(model)
        assert called(model, opt) == 16 == called.batch_size
        assert positional(model, opt=opt) == 8
        assert [t.batch_size for t in positional.trials] == [8]
        with pytest.raises(TypeError, match="Batch size was passed into `train`"):
            called(16, model, opt)
        assert bare(model, opt) == bare.batch_size
        assert bare.batch_size is not None and bare.batch_size <= 128
    assert bare.__name__ == "train"
    assert list(bare.__signature__.parameters) == ["model", "opt"]
    assert calls[:2] == [16, 8]  # each first size fitted: it was the run, nothing more ran
    with pytest.raises(ValueError, match="minimum"):
        find_executable_batch_size(train, 8, minimum=16)


def test_close_to_the_true_largest_in_few_trials_where_accelerate_takes_many() -> None:
    model, opt = make_model()
    calls: list[int] = []
    train = training(calls)
    searched = find_executable_batch_size(train, starting_batch_size=128)
    with vramctl.simulate(CAPACITY) as gpu:
        gpu.adopt(model)
        found = searched(model, opt)
    ours = len(calls)

    model, opt = make_model()
    truth = true_max(model, opt, train_step, mlp_batch, BUDGET, near=found, steps=STEPS)
    assert truth >= 40
    assert 0.97 * truth <= found <= truth
    assert found == searched.batch_size == calls[-1]
    assert ours == len(searched.trials) <= 4
    assert searched.trials[0] == Trial(128, "oom", None, searched.trials[0].seconds)
    assert all(t.peak is not None and t.peak <= BUDGET for t in searched.trials[1:])

    # Accelerate's, on a device of the budget's size (it has no target): 0.9 times, again.
    calls.clear()
    theirs = accelerate.utils.find_executable_batch_size(train, starting_batch_size=128)
    with vramctl.simulate(BUDGET) as gpu:
        model, opt = make_model()
        gpu.adopt(model)
        theirs(model, opt)
    assert len(calls) > ours, calls
    assert calls[-1] <= found


def test_far_above_what_fits_it_probes_small_first_and_takes_three_trials() -> None:
    # 1024 on a 16 MiB device that fits about 70: tried first, 1024, then 341 and 113 ran out
    # of memory and measured nothing (five trials). A probe of 1024 / 16 first measures the
    # scale, the next fits by it, and the line through the two is the edge.
    model, opt = make_model()
    calls: list[int] = []
    searched = find_executable_batch_size(training(calls), starting_batch_size=1024)
    with vramctl.simulate(CAPACITY) as gpu:
        gpu.adopt(model)
        found = searched(model, opt)
    assert calls[0] == 1024 // 16 and len(calls) == len(searched.trials) <= 3
    assert all(
        t.outcome == "fit" and t.peak is not None and t.peak <= BUDGET for t in searched.trials
    )
    assert found == calls[-1] == searched.batch_size
    model, opt = make_model()
    truth = true_max(model, opt, train_step, mlp_batch, BUDGET, near=found, steps=STEPS)
    assert 0.97 * truth <= found <= truth

    # A later call starts from the size that ran: one trial, the run.
    calls.clear()
    with vramctl.simulate(CAPACITY) as gpu:
        model, opt = make_model()
        gpu.adopt(model)
        assert searched(model, opt) == found
    assert calls == [found]

    # small_first=False: the start first, as Accelerate does (it runs out of memory here).
    calls.clear()
    first = find_executable_batch_size(training(calls), 1024, small_first=False)
    with vramctl.simulate(CAPACITY) as gpu:
        model, opt = make_model()
        gpu.adopt(model)
        assert 0.97 * truth <= first(model, opt) <= truth
    assert first.trials[0].batch_size == 1024 and first.trials[0].outcome == "oom"
    assert len(first.trials) > 3
    with pytest.raises(TypeError, match="small_first"):
        find_executable_batch_size(training([]), 1024, small_first="yes")  # type: ignore[call-overload]


def test_a_small_first_probe_that_returns_is_a_point_then_one_full_call_runs() -> None:
    # Inference: nothing ends a call, so the small probe ran whole; it measured the bytes per
    # sample, and the function runs once more, in full, at the size they reach the budget at.
    calls: list[int] = []

    def infer(batch_size: int, model: nn.Module) -> int:
        calls.append(batch_size)
        with torch.no_grad():
            return int(model(mlp_batch(batch_size)).shape[0])

    searched = find_executable_batch_size(infer, 1024)
    with vramctl.simulate(CAPACITY) as gpu:
        model, _ = make_model()
        gpu.adopt(model)
        found = searched(model)
        assert calls == [64, found] and found > 64
        assert [t.outcome for t in searched.trials] == ["fit", "fit"]
        assert all(t.peak is not None and t.peak <= BUDGET for t in searched.trials)
        # The size it scaled to is within what fits: a quarter more does not.
        calls.clear()
        over = find_executable_batch_size(infer, int(found * 1.25), small_first=False)
        over(model)
        assert over.trials[0].outcome != "fit" or (over.trials[0].peak or 0) > BUDGET


def test_the_run_starts_from_the_weights_it_was_given() -> None:
    model, opt = make_model()
    initial = copy.deepcopy(model)
    calls: list[int] = []
    searched = find_executable_batch_size(training(calls), starting_batch_size=128)
    with vramctl.simulate(CAPACITY) as gpu:
        gpu.adopt(model)
        torch.manual_seed(1)
        found = searched(model, opt)
    assert len(calls) > 2  # probes were ended after changing the weights, then put back
    assert all(t.outcome == "fit" for t in searched.trials[1:])

    plain = initial
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    torch.manual_seed(1)
    training([])(found, plain, plain_opt)
    for k, v in plain.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    for i, state in plain_opt.state_dict()["state"].items():
        for k, v in state.items():
            assert torch.equal(opt.state_dict()["state"][i][k], v), (i, k)


def test_below_minimum_it_says_what_was_tried_and_what_to_do() -> None:
    calls: list[int] = []
    searched = find_executable_batch_size(training(calls), 128, minimum=100)
    with vramctl.simulate(CAPACITY) as gpu:
        model, opt = make_model()
        gpu.adopt(model)
        with pytest.raises(BatchSizeSearchError) as info:
            searched(model, opt)
    message = str(info.value)
    assert calls == [128, 100]  # the search's 42 is below minimum: minimum itself, once
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, vramctl.VramctlError)
    for part in (
        "no batch size from 100 to 128 fits on sim:16MiB",
        "budget 14.40 MiB (target 0.9 of 16.00 MiB)",
        "128 ran out of memory; 100 ran out of memory",
        "Lower minimum (now 100)",
        "gradient checkpointing",
    ):
        assert part in message, message


def test_when_not_even_one_fits() -> None:
    searched = find_executable_batch_size(training([]), 8)
    with vramctl.simulate("1MiB") as gpu:
        model, opt = make_model()
        gpu.adopt(model)
        with pytest.raises(BatchSizeSearchError, match="no batch size from 1 to 8 fits"):
            searched(model, opt)
    assert [t.outcome for t in searched.trials] == ["oom"] * len(searched.trials)
    assert searched.trials[-1].batch_size == 1


def test_reduce_batch_size_fn_replaces_the_choice_after_an_oom_bounded_by_minimum() -> None:
    asked: list[int] = []

    def reduce() -> int:
        asked.append(1)
        return 10

    searched = find_executable_batch_size(training([]), 128, reduce, minimum=20)
    with vramctl.simulate(CAPACITY) as gpu:
        model, opt = make_model()
        gpu.adopt(model)
        found = searched(model, opt)
    assert asked == [1]
    assert [t.batch_size for t in searched.trials][:2] == [128, 20]
    assert 20 < found < 128  # from a fitting 20, the search scales up


def test_inference_each_call_is_a_whole_probe() -> None:
    calls: list[int] = []

    def infer(batch_size: int, model: nn.Module) -> int:
        calls.append(batch_size)
        with torch.no_grad():
            return int(model(mlp_batch(batch_size)).shape[0])

    searched = find_executable_batch_size(infer, 4096)
    with vramctl.simulate(CAPACITY) as gpu:
        model, _ = make_model()
        gpu.adopt(model)
        found = searched(model)
    outcomes = [t.outcome for t in searched.trials]
    assert outcomes[-1] == "fit" and set(outcomes[:-1]) == {"oom"}
    assert found == calls[-1] == searched.batch_size
    assert found < 4096
    assert searched.trials[-1].peak is not None


def test_other_errors_propagate_unchanged() -> None:
    error = ValueError("a bug in the loop")

    def train(batch_size: int, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        training([])(batch_size, model, opt)
        if batch_size < 128:
            raise error

    searched = find_executable_batch_size(train, 128)
    with vramctl.simulate(CAPACITY) as gpu:
        model, opt = make_model()
        gpu.adopt(model)
        with pytest.raises(ValueError) as info:
            searched(model, opt)
    assert info.value is error
    assert not _global_optimizer_post_hooks  # the hook is gone


def test_an_oom_after_the_probe_steps_scales_down_and_runs_in_full() -> None:
    ends: list[int] = []

    def train(batch_size: int, model: nn.Module, opt: torch.optim.Optimizer) -> int:
        training([])(batch_size, model, opt)
        if batch_size > 60:  # a later phase (longer batches, evaluation) needs far more
            torch.empty(batch_size * 300_000, dtype=torch.uint8)
        ends.append(batch_size)
        return batch_size

    searched = find_executable_batch_size(train, 128)
    with vramctl.simulate(CAPACITY) as gpu:
        model, opt = make_model()
        gpu.adopt(model)
        found = searched(model, opt)
    late = next(i for i, t in enumerate(searched.trials) if t.outcome == "oom" and i > 0)
    assert searched.trials[late - 1].batch_size == searched.trials[late].batch_size > 60
    assert searched.trials[late + 1 :] == searched.trials[-1:]  # then one run, in full
    assert 30 <= found <= 60 and ends == [found]


def test_each_trial_is_logged_and_reported(caplog: pytest.LogCaptureFixture) -> None:
    seen: list[Trial] = []
    searched = find_executable_batch_size(training([]), 128, on_trial=seen.append)
    caplog.set_level(logging.INFO, logger="vramctl.integrations")
    with vramctl.simulate(CAPACITY) as gpu:
        model, opt = make_model()
        gpu.adopt(model)
        searched(model, opt)
    assert seen == searched.trials and len(seen) >= 2
    records = [r for r in caplog.records if r.name == "vramctl.integrations"]
    assert len(records) == len(seen)
    oom = records[0]
    assert oom.levelno == logging.WARNING
    assert oom.getMessage().startswith("batch size 128 ran out of memory on sim:16MiB")
    assert f"trying {seen[1].batch_size} next" in oom.getMessage()
    assert f"running at {searched.batch_size}" in records[-1].getMessage()


def test_what_a_failed_or_ended_call_made_is_freed_before_the_next() -> None:
    refs: list[weakref.ref[torch.Tensor]] = []
    alive: list[int] = []

    def train(batch_size: int, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        alive.append(sum(r() is not None for r in refs))
        big = torch.empty(MiB, dtype=torch.uint8)
        refs.append(weakref.ref(big))
        training([])(batch_size, model, opt)

    searched = find_executable_batch_size(train, 128)
    with vramctl.simulate(CAPACITY) as gpu:
        model, opt = make_model()
        gpu.adopt(model)
        searched(model, opt)
        held = gpu.allocated_bytes
    gc.collect()
    assert len(refs) >= 3 and searched.trials[0].outcome == "oom"
    assert alive == [0] * len(alive)  # nothing of an earlier call was alive in the next
    assert all(r() is None for r in refs)
    assert not any(p.grad is not None for p in model.parameters())  # zero_grad after each step
    assert held < 2 * MiB  # the model and its optimizer state, nothing of the probes


# -- on a real GPU ------------------------------------------------------------------------


@pytest.mark.cuda
def test_on_a_real_gpu() -> None:
    from tests.fit.test_fit_cuda import Wide, batch, capped_to, target_for

    gc.collect()
    torch.cuda.empty_cache()
    gpu = vramctl.get_device("cuda:0")
    torch.manual_seed(0)
    model = Wide().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    target = target_for(gpu, 3 * 2**30)
    calls: list[int] = []

    def train(batch_size: int, model: nn.Module, opt: torch.optim.Optimizer) -> int:
        calls.append(batch_size)
        x = batch(batch_size)
        step = train_step(model, opt)
        for _ in range(STEPS):
            step(x)
        return batch_size

    searched: Any = find_executable_batch_size(train, 1024, target=target, device=gpu)
    found = searched(model, opt)
    budget = int(target * gpu.capacity())
    assert all(t.peak is None or t.outcome != "fit" or t.peak <= budget for t in searched.trials)
    truth = true_max(
        model, opt, train_step, batch, budget, near=found, steps=STEPS, room=capped_to(gpu)
    )
    assert truth >= 20
    assert 0.97 * truth <= found <= truth
    assert len(calls) <= 6
