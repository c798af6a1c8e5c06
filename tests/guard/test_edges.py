"""The guard at its edges: errors mid-step, stale OOM counts, odd batches and outputs, flapping."""

from __future__ import annotations

import contextlib
import itertools
from typing import Any

import pytest
import torch
from torch import nn

import vramctl
from tests.guard.models import loss_fn, make
from tests.guard.test_guard import FWD, _full_grads, _grads, _pressured, _rel, _tanh_need
from vramctl import VramctlError
from vramctl.guard import Guard, GuardError, StepDoesNotFitError, guarded
from vramctl.guard._split import merge_outputs, split_batch


def _grads_or_none(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("earlier", [False, True])
def test_an_error_in_a_later_piece_leaves_the_gradients_as_they_were(earlier: bool) -> None:
    model, batch = make("mlp", 12)
    if earlier:
        loss_fn()(model(batch[0]), batch).backward()
    before = _grads_or_none(model)
    calls = 0

    def loss_of(piece: Any) -> torch.Tensor:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise ValueError("a bad sample")
        return loss_fn()(model(piece[0]), piece)

    guard = Guard(model, piece_limit=4)
    with pytest.raises(ValueError, match="a bad sample"):
        guard.train_step(batch, loss_of)
    after = _grads_or_none(model)
    for a, b in zip(after, before, strict=True):
        assert (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def test_giving_up_keeps_the_gradients_accumulated_before() -> None:
    model = nn.Sequential(nn.Linear(8, 4096), *[nn.Tanh() for _ in range(12)])
    plain = _tanh_need(model, torch.randn(1, 8), False)
    with vramctl.simulate("1GiB") as gpu:
        gpu.adopt(model)
        params = gpu.allocated_bytes
    with vramctl.simulate(params * 2 + plain // 2) as gpu:
        gpu.adopt(model)
        with gpu.host():
            for p in model.parameters():
                p.grad = torch.ones_like(p)  # accumulated by earlier update=False steps
        gpu.adopt([p.grad for p in model.parameters()])
        guard = Guard(model, loss_fn=lambda out, b: out.square().mean(), device=gpu, offload=False)
        with pytest.raises(StepDoesNotFitError):
            guard.step(torch.randn(4, 8), update=False)
    for p in model.parameters():
        assert p.grad is not None and torch.equal(p.grad, torch.ones_like(p))


@pytest.mark.parametrize("error", [ValueError("a bad hook"), KeyboardInterrupt()])
def test_an_error_in_the_whole_batchs_backward_leaves_the_gradients_as_they_were(
    error: BaseException,
) -> None:
    # The whole-batch attempt fails after part of its gradients were accumulated.
    model, batch = make("mlp", 12)
    loss_fn()(model(batch[0]), batch).backward()
    before = _grads_or_none(model)

    def fail(grad: torch.Tensor) -> torch.Tensor:
        raise error

    model.net[0].weight.register_hook(fail)  # the last layer's gradients are in by then
    guard = Guard(model, forward=FWD, loss_fn=loss_fn())
    with pytest.raises(type(error)):
        guard.step(batch, update=False)
    for a, b in zip(_grads_or_none(model), before, strict=True):
        assert a is not None and b is not None and torch.equal(a, b)
    assert guard.ooms == 0 and guard.steps == 0


def test_giving_up_on_the_whole_batch_of_one_keeps_the_gradients() -> None:
    # One sample that runs out of memory on the host: nothing smaller to try, no offload.
    model, batch = make("mlp", 1)
    loss_fn()(model(batch[0]), batch).backward()
    before = _grads_or_none(model)

    def oom(grad: torch.Tensor) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    model.net[0].weight.register_hook(oom)
    guard = Guard(model, forward=FWD, loss_fn=loss_fn(), device="cpu")
    with pytest.raises(StepDoesNotFitError):
        guard.step(batch, update=False)
    for a, b in zip(_grads_or_none(model), before, strict=True):
        assert a is not None and b is not None and torch.equal(a, b)
    assert guard.ooms == 1 and [e.kind for e in guard.events] == ["oom", "gave_up"]


def test_a_guarded_function_gets_its_extra_arguments_in_every_piece() -> None:
    seen: list[tuple[int, float]] = []

    @guarded(piece_limit=4)
    def scaled(x: torch.Tensor, scale: float, *, shift: float = 0.0) -> torch.Tensor:
        seen.append((len(x), scale))
        return x * scale + shift

    x = torch.arange(10.0)
    assert torch.equal(scaled(x, 2.0, shift=1.0), x * 2.0 + 1.0)
    assert seen == [(4, 2.0), (4, 2.0), (2, 2.0)]
    assert torch.equal(scaled.guard.infer_step(x, lambda b: b + 1), x + 1)


def test_an_oom_from_before_the_step_does_not_make_a_bug_an_oom() -> None:
    with vramctl.simulate("1MiB") as gpu:
        model = nn.Linear(4, 2)
        gpu.adopt(model)
        guard = Guard(model, loss_fn=lambda out, b: out.sum(), device=gpu)
        with contextlib.suppress(torch.OutOfMemoryError):
            torch.zeros(1 << 20)  # someone else's OOM, caught, between the guard's steps
        seen: list[int] = []

        def bug(piece: torch.Tensor) -> torch.Tensor:
            seen.append(len(piece))
            raise ValueError("a bug")

        with pytest.raises(ValueError, match="a bug"):
            guard.train_step(torch.randn(8, 4), bug)
        with pytest.raises(ValueError, match="a bug"):
            guarded(bug, device=gpu)(torch.randn(8, 4))
    assert seen == [8, 8]  # run once each, not split as if it had run out of memory
    assert guard.ooms == 0 and guard.piece_limit is None and not guard.events


def test_params_the_optimizer_holds_outside_the_model_are_not_counted_twice() -> None:
    # A learnable temperature in the loss: its gradient from a failed attempt must go.
    model, (x, _) = make("mlp", 16)
    temp = nn.Parameter(torch.tensor(2.0))
    opt = torch.optim.SGD([*model.parameters(), temp], lr=0.1)

    def loss(out: torch.Tensor, batch: Any) -> torch.Tensor:
        return (out * temp).square().mean()

    loss(model(x), x).backward()
    want = temp.grad.clone()  # type: ignore[union-attr]
    temp.grad = None
    model.zero_grad(set_to_none=True)
    failed = False

    def oom_once(grad: torch.Tensor) -> torch.Tensor:
        nonlocal failed
        if not failed:  # after temp's gradient was accumulated, the backward runs out
            failed = True
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return grad

    model.net[0].weight.register_hook(oom_once)
    guard = Guard(model, opt, loss_fn=loss)
    result = guard.step(x, update=False)
    assert result.ooms == 1 and result.pieces == 2
    assert temp.grad is not None
    torch.testing.assert_close(temp.grad, want)


def test_a_scalar_tensor_before_the_batch_tensors_is_not_the_batch() -> None:
    model, (x, y) = make("mlp", 10)
    batch = {"scale": torch.tensor(0.5), "x": x, "y": y}
    fn = loss_fn()

    def loss(out: torch.Tensor, b: dict[str, Any]) -> torch.Tensor:
        return fn(out * b["scale"], (b["x"], b["y"]))

    model.zero_grad(set_to_none=True)
    loss(model(x), batch).backward()
    want = _grads(model)
    model.zero_grad(set_to_none=True)
    guard = Guard(model, forward=lambda m, b: m(b["x"]), loss_fn=loss, piece_limit=3)
    result = guard.step(batch, update=False)
    assert result.batch_size == 10 and result.pieces == 4
    assert _rel(_grads(model), want) <= 1e-6


def test_an_empty_batch_runs_once_whole() -> None:
    model = nn.Linear(4, 2)
    out = guarded(lambda b: model(b), piece_limit=3)(torch.randn(0, 4))
    assert out.shape == (0, 2)
    guard = Guard(model, loss_fn=lambda out, b: out.sum(), piece_limit=2, patience=1)
    for _ in range(3):  # the piece size grows back on an empty batch too
        r = guard.step(torch.randn(0, 4), update=False)
        assert r.batch_size == 0 and r.pieces == 1 and float(r.loss) == 0.0
    assert guard.piece_limit is None


def test_a_piece_of_padding_only_adds_nothing_and_is_not_nan() -> None:
    # A token-mean loss over target tokens: a piece with none has the mean 0/0.
    model, (x, y) = make("mlp", 8)
    y = y.clone()
    y[4:] = -100

    def token_mean(out: torch.Tensor, batch: Any) -> torch.Tensor:
        ce = nn.functional.cross_entropy(out, batch[1].clamp(min=0), reduction="none")
        mask = (batch[1] != -100).float()
        return (ce * mask).sum() / mask.sum()

    want_loss = float(token_mean(model(x), (x, y)).detach())
    model.zero_grad(set_to_none=True)
    token_mean(model(x), (x, y)).backward()
    want = _grads(model)
    model.zero_grad(set_to_none=True)
    guard = Guard(
        model,
        forward=FWD,
        loss_fn=token_mean,
        piece_limit=4,
        weight_fn=lambda p: (p[1] != -100).sum(),
    )
    result = guard.step((x, y), update=False)
    assert result.pieces == 2
    assert float(result.loss) == pytest.approx(want_loss, rel=1e-6)
    assert _rel(_grads(model), want) <= 1e-6


def test_lists_of_per_sample_records_are_split_and_joined() -> None:
    ids = [[i, i + 1, i + 2][: 1 + i % 3] for i in range(10)]  # token ids, ragged
    meta = [{"id": i} for i in range(10)]
    batch = {"x": torch.arange(10.0).view(10, 1), "ids": ids, "meta": meta}
    pieces = split_batch(batch, 3)
    assert [len(p["ids"]) for p in pieces] == [4, 3, 3]
    assert [r for p in pieces for r in p["ids"]] == ids
    assert [r for p in pieces for r in p["meta"]] == meta

    @guarded(piece_limit=4)
    def run(b: dict[str, Any]) -> tuple[list[list[int]], list[dict[str, int]]]:
        assert len(b["ids"]) == len(b["x"]) == len(b["meta"])
        return [[*r, int(v)] for r, v in zip(b["ids"], b["x"][:, 0], strict=True)], b["meta"]

    got_ids, got_meta = run(batch)
    assert got_ids == [[*r, i] for i, r in enumerate(ids)]
    assert got_meta == meta
    # Equal pieces: per-sample lists are joined too, a list of outputs is merged by position.
    lists = [[[0, 0], [1, 1]], [[2, 2], [3, 3]]]
    assert merge_outputs(lists, [2, 2]) == [[0, 0], [1, 1], [2, 2], [3, 3]]
    logits = [torch.zeros(2, 3), torch.ones(2, 3)]
    merged = merge_outputs([[logits[0], torch.tensor(1.0)], [logits[1], torch.tensor(3.0)]], [2, 2])
    assert merged[0].shape == (4, 3) and float(merged[1]) == 2.0


def test_memory_that_comes_and_goes_does_not_make_the_piece_size_flap() -> None:
    model, batch = make("mlp", 256)
    budget, squeeze = _pressured(model, batch)
    with vramctl.simulate(budget) as gpu:
        gpu.adopt(model)
        guard = Guard(model, forward=FWD, loss_fn=loss_fn(), device=gpu, patience=2)
        hog: torch.Tensor | None = None
        for i in range(80):
            # A co-tenant that holds its memory three steps in four.
            if i % 4 and hog is None:
                hog = gpu.adopt(torch.empty(squeeze, dtype=torch.uint8))
            elif i % 4 == 0:
                hog = None
            model.zero_grad(set_to_none=True)
            guard.step(batch, update=False)
    grows = [e.step for e in guard.events if e.kind == "grow"]
    gaps = [b - a for a, b in itertools.pairwise(grows)]
    assert guard.ooms <= 8  # an OOM every fourth step flaps: 20 of them
    assert gaps == sorted(gaps) and gaps[-1] > gaps[0]


def test_the_split_step_equals_the_whole_one_after_a_real_oom_with_a_dict_batch() -> None:
    model, (x, y) = make("transformer", 32)
    batch = {"ids": x, "labels": y, "texts": [f"t{i}" for i in range(32)], "flag": True}
    want, _ = _full_grads(model, (x, y), "mean")
    fn = loss_fn()
    guard = Guard(
        model,
        forward=lambda m, b: m(b["ids"]),
        loss_fn=lambda out, b: fn(out, (b["ids"], b["labels"])),
    )
    calls: list[int] = []
    old = guard.forward

    def forward(m: nn.Module, b: dict[str, Any]) -> torch.Tensor:
        calls.append(len(b["texts"]))
        assert len(b["texts"]) == len(b["ids"]) and b["flag"] is True
        if len(calls) == 1:
            raise RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB")
        return old(m, b)

    guard.forward = forward
    result = guard.step(batch, update=False)
    assert calls == [32, 16, 16] and result.ooms == 1
    torch.testing.assert_close(_grads(model), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"piece_limit": 0}, "piece_limit"),
        ({"piece_limit": 2.5}, "piece_limit"),
        ({"piece_limit": "4"}, "piece_limit"),
        ({"patience": 0}, "patience"),
        ({"patience": True}, "patience"),
        ({"history": -1}, "history"),
        ({"clip_grad_norm": -1.0}, "clip_grad_norm"),
        ({"clip_grad_norm": float("nan")}, "clip_grad_norm"),
        ({"reduction": "none"}, "reduction"),
        ({"loss_fn": "mse"}, "loss_fn"),
        ({"optimizer": lambda out, b: out}, "optimizer"),
        ({"model": "resnet"}, "model"),
    ],
)
def test_bad_arguments_are_clear_value_errors(kwargs: dict[str, Any], match: str) -> None:
    args = {"model": nn.Linear(2, 2), **kwargs}
    model, optimizer = args.pop("model"), args.pop("optimizer", None)
    with pytest.raises(ValueError, match=match) as raised:
        Guard(model, optimizer, **args)
    # vramctl's bad-input error (the CLI prints it as one line), still a ValueError.
    assert isinstance(raised.value, GuardError) and isinstance(raised.value, VramctlError)
    assert "\n" not in str(raised.value)


def test_every_guard_error_is_vramctls_one_line_error() -> None:
    model = nn.Linear(2, 2)
    for call in (
        lambda: Guard(None).step(torch.ones(2, 2)),
        lambda: Guard(None).infer(torch.ones(2, 2)),
        lambda: Guard(model).shrink(1.5),
        lambda: guarded(lambda b: b, train=True),
        lambda: merge_outputs([torch.ones(1)], [1, 1]),
        lambda: Guard(model, torch.optim.SGD(model.parameters(), lr=0.1)).step(
            torch.ones(2, 2)  # the output is no loss, and no loss_fn was given
        ),
    ):
        with pytest.raises(GuardError) as raised:
            call()
        assert isinstance(raised.value, VramctlError) and isinstance(raised.value, ValueError)
        assert "\n" not in str(raised.value)


def test_giving_up_when_the_host_itself_is_out_of_memory_still_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The report's scan of live objects can run out of memory too; the step's error wins."""
    from types import SimpleNamespace

    import vramctl.guard._report as report_module

    def no_room() -> list[object]:
        raise MemoryError

    monkeypatch.setattr(report_module, "gc", SimpleNamespace(get_objects=no_room))
    calls = []

    def never_fits(batch: torch.Tensor) -> torch.Tensor:
        calls.append(len(batch))
        raise MemoryError("no room for the activations")

    with pytest.raises(StepDoesNotFitError, match="one sample at a time") as info:
        guarded(never_fits, device="cpu")(torch.zeros(4, 2))
    assert calls[-1] == 1 and calls[0] == 4
    assert info.value.report.largest == [] and info.value.report.tensor_bytes == 0


def test_a_report_passes_over_fake_tensors_in_the_process() -> None:
    """An estimate's fake tensors may still be alive (garbage not yet collected) when a
    step gives up: the report lists real tensors only, and does not fail on those."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vramctl.device import get_device
    from vramctl.guard import memory_report

    real = torch.zeros(1024, 1024)
    with FakeTensorMode():
        fake = nn.Parameter(torch.empty(4096, 4096))
    report = memory_report(get_device("cpu"), error="out of memory", top=100_000)
    sizes = [t.shape for t in report.largest]
    assert (1024, 1024) in sizes and (4096, 4096) not in sizes
    del real, fake
