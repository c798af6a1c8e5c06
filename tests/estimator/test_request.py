"""``vramctl.Step``: an estimate's request as one value, with nothing read from globals."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
from torch import nn

import vramctl
from vramctl.estimator import EstimateError, Step
from vramctl.estimator._request import STEP_FIELDS
from vramctl.estimator._timing import gpu_throughput


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(2048, 8192), nn.GELU(), nn.Linear(8192, 2048))


#: Large enough for its time on a GPU to be its matrix multiplies', not its overheads.
X = torch.randn(4096, 2048)


def test_a_step_gives_what_its_options_give_one_by_one() -> None:
    step = Step(device="A100-80GB", precision="bf16", tf32=False, checkpointing=False)
    by_value = vramctl.estimate(model(), X, step=step)
    by_options = vramctl.estimate(model(), X, device="A100-80GB", precision="bf16", tf32=False)
    assert by_value.peak_device == by_options.peak_device
    assert by_value.step_seconds == by_options.step_seconds
    found = vramctl.max_batch_size(model(), lambda n: torch.randn(n, 2048), step=step, limit=64)
    assert found.batch_size == 64


def test_every_option_of_estimate_and_max_batch_size_is_a_field() -> None:
    import inspect

    for fn in (vramctl.estimate, vramctl.max_batch_size):
        params = set(inspect.signature(fn).parameters)
        assert params >= STEP_FIELDS, fn.__name__
    assert {f.name for f in dataclasses.fields(Step)} == STEP_FIELDS


def test_a_step_and_its_options_together_are_refused() -> None:
    with pytest.raises(EstimateError, match="not both: precision"):
        vramctl.estimate(model(), X, step=Step(), precision="bf16")
    with pytest.raises(EstimateError, match=r"must be a vramctl\.Step"):
        vramctl.estimate(model(), X, step={"precision": "bf16"})  # type: ignore[arg-type]


def test_tf32_is_a_field_and_no_estimate_reads_or_writes_the_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    step = Step(device="A100-80GB", tf32=True)
    with_tf32 = vramctl.estimate(model(), X, step=step)
    without = vramctl.estimate(model(), X, step=step.replace(tf32=False))
    assert with_tf32.step_seconds is not None and without.step_seconds is not None
    assert with_tf32.step_seconds < without.step_seconds
    assert with_tf32.peak_device == without.peak_device  # time only

    # Once the step is made, the process's setting is neither read nor written.
    def refuse(*args: object) -> None:
        raise AssertionError("an estimate touched torch's float32 matmul setting")

    monkeypatch.setattr(torch, "get_float32_matmul_precision", refuse)
    monkeypatch.setattr(torch, "set_float32_matmul_precision", refuse)
    assert vramctl.estimate(model(), X, step=step).step_seconds == with_tf32.step_seconds


def test_the_default_tf32_is_the_process_setting_when_the_step_is_made() -> None:
    saved = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert Step().tf32 is True
        torch.set_float32_matmul_precision("highest")
        assert Step().tf32 is bool(torch.backends.cuda.matmul.allow_tf32)
    finally:
        torch.set_float32_matmul_precision(saved)


def test_the_throughput_is_a_field() -> None:
    sheet = gpu_throughput(vramctl.gpu_spec("A100-80GB"))
    slow = dataclasses.replace(
        sheet,
        rates={g: {d: r / 10 for d, r in by.items()} for g, by in sheet.rates.items()},
        bandwidth=sheet.bandwidth / 10,
        source="a tenth of the data sheet",
    )
    step = Step(device="A100-80GB", tf32=False)
    fast = vramctl.estimate(model(), X, step=step.replace(throughput=sheet))
    tenth = vramctl.estimate(model(), X, step=step.replace(throughput=slow))
    assert fast.step_seconds is not None and tenth.step_seconds is not None
    assert tenth.step_seconds > 5 * fast.step_seconds
    assert tenth.throughput == "a tenth of the data sheet"


def test_two_threads_estimate_at_once_each_with_its_own_request() -> None:
    steps = [Step(device="A100-80GB", tf32=on) for on in (True, False)] * 3
    alone = {s.tf32: vramctl.estimate(model(), X, step=s).step_seconds for s in steps[:2]}
    got: list[tuple[bool | None, float | None]] = []
    errors: list[BaseException] = []
    start = threading.Barrier(len(steps))

    def run(step: Step) -> None:
        try:
            start.wait()
            got.append((step.tf32, vramctl.estimate(model(), X, step=step).step_seconds))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(s,)) for s in steps]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert len(got) == len(steps)
    assert all(seconds == alone[tf32] for tf32, seconds in got), (got, alone)


# -- Step.of: a caller's defaults under a user's request -------------------------------


def test_of_a_mapping_takes_its_keys_as_given_and_the_defaults_for_the_rest() -> None:
    step = Step.of({"precision": "bf16", "safe": True}, mode="inference", safe=False)
    assert (step.precision, step.mode, step.safe) == ("bf16", "inference", True)
    assert Step.of(None, mode="inference") == Step(mode="inference")


def test_of_a_step_fills_only_what_it_leaves_at_the_default() -> None:
    given = Step(precision="bf16", optimizer="sgd")
    step = Step.of(given, precision="fp32", optimizer="adamw", mode="inference", safe=False)
    assert (step.precision, step.optimizer) == ("bf16", "sgd")  # the step's own
    assert (step.mode, step.safe) == ("inference", False)  # at the default: the caller's


def test_of_refuses_what_is_not_a_field() -> None:
    with pytest.raises(EstimateError, match="not an option of an estimate: seq_len"):
        Step.of({"precision": "bf16", "seq_len": 128})
    with pytest.raises(EstimateError, match=r"not a field of vramctl\.Step: sequence"):
        Step.of(None, sequence=1)
    with pytest.raises(EstimateError, match=r"a vramctl\.Step or a mapping"):
        Step.of(["bf16"])  # type: ignore[arg-type]


def test_split_separates_a_searchs_own_arguments() -> None:
    fields, rest = Step.split({"precision": "bf16", "limit": 8, "seq_len": 16})
    assert fields == {"precision": "bf16"} and rest == {"limit": 8, "seq_len": 16}
