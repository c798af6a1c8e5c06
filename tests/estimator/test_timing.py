"""The step-time model: FLOPs and bytes from the trace, rates per device, the prediction."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import vramctl
from vramctl.cli._app import app
from vramctl.estimator import Calibration, Throughput, builtin_calibration
from vramctl.estimator._opcost import OpCost
from vramctl.estimator._rates import cpu_profile_path, cpu_throughput, measure_throughput
from vramctl.estimator._timing import SCHEMA, gpu_throughput, predict


class Mlp(nn.Module):
    def __init__(self, width: int = 512, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def test_flops_of_a_linear_layer_are_counted_exactly() -> None:
    model = nn.Linear(256, 128, bias=False)
    x = torch.randn(32, 256)
    infer = vramctl.estimate(model, x, mode="infer", device="cpu")
    assert infer.flops == 2 * 32 * 256 * 128
    train = vramctl.estimate(model, x, mode="train", optimizer="sgd", device="cpu")
    # backward: the weight's gradient only (the input needs none): forward + one more
    assert train.flops == 2 * infer.flops
    assert infer.bytes_moved >= (32 * 256 + 256 * 128 + 32 * 128) * 4


def test_step_seconds_adds_up_by_group_and_by_phase() -> None:
    est = vramctl.estimate(Mlp(), torch.randn(64, 512), device="cpu")
    assert est.step_seconds is not None and est.step_seconds > 0
    assert sum(est.time_breakdown.values()) == pytest.approx(est.step_seconds)
    assert sum(est.phase_seconds.values()) == pytest.approx(est.step_seconds)
    assert set(est.phase_seconds) == {"forward", "backward", "optimizer"}
    assert est.time_breakdown["matmul"] > 0
    assert est.throughput is not None and est.throughput.startswith("measured on")


def test_a_faster_gpu_and_a_lower_precision_predict_less_time() -> None:
    t4 = vramctl.estimate("gpt2", batch_size=4, seq_len=128, device="T4-16GB")
    h100 = vramctl.estimate("gpt2", batch_size=4, seq_len=128, device="H100-80GB")
    assert t4.step_seconds is not None and h100.step_seconds is not None
    assert h100.step_seconds < t4.step_seconds / 3
    a100 = vramctl.estimate("gpt2", batch_size=8, seq_len=256, device="A100-80GB")
    bf16 = vramctl.estimate(
        "gpt2", batch_size=8, seq_len=256, device="A100-80GB", precision="amp-bf16"
    )
    assert bf16.time_breakdown["matmul"] < a100.time_breakdown["matmul"] / 4
    assert a100.flops == pytest.approx(bf16.flops, rel=0.01)


def test_tf32_speeds_up_fp32_matmuls_on_ampere(monkeypatch: pytest.MonkeyPatch) -> None:
    slow = vramctl.estimate("gpt2", batch_size=4, seq_len=128, device="A100-80GB")
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        fast = vramctl.estimate("gpt2", batch_size=4, seq_len=128, device="A100-80GB")
        volta = vramctl.estimate("gpt2", batch_size=4, seq_len=128, device="V100-32GB")
    finally:
        torch.set_float32_matmul_precision(saved)
    assert fast.time_breakdown["matmul"] < slow.time_breakdown["matmul"] / 4
    # no TF32 before compute capability 8.0
    assert volta.time_breakdown["matmul"] > slow.time_breakdown["matmul"]


def test_a_gpu_known_only_by_size_gets_no_time() -> None:
    est = vramctl.estimate(Mlp(), torch.randn(8, 512), device="24GiB")
    assert est.step_seconds is None
    assert any("step time: not predicted" in n for n in est.notes)
    assert est.flops > 0


def test_offloading_activations_trades_memory_for_transfer_time() -> None:
    kw = {"batch_size": 4, "seq_len": 256, "device": "A10G-24GB"}
    plain = vramctl.estimate("gpt2", **kw)
    off = vramctl.estimate("gpt2", offload_activations=True, **kw)
    assert off.breakdown["activations"] < plain.breakdown["activations"] / 2
    assert off.peak_device < plain.peak_device
    assert off.time_breakdown["transfer"] > 0
    assert "transfer" not in plain.time_breakdown
    assert off.step_seconds is not None and plain.step_seconds is not None
    assert off.step_seconds > plain.step_seconds


def test_a_gpu_profile_with_measured_throughput_replaces_the_data_sheet() -> None:
    spec = vramctl.gpu_spec("A100-80GB")
    sheet = gpu_throughput(spec)
    assert not sheet.measured and "data sheet" in sheet.source
    assert sheet.rate("matmul", "bf16") == pytest.approx(312e12 * 0.7)
    measured = Throughput(
        device="NVIDIA A100-SXM4-80GB",
        rates={"matmul": {"fp32": 1e12, "bf16": 2e12}},
        bandwidth=1e11,
        op_overhead=1e-5,
        view_overhead=1e-6,
        asynchronous=True,
        source="measured on NVIDIA A100-SXM4-80GB",
        measured=True,
    )
    cal = Calibration(
        **{
            **builtin_calibration("A100-80GB", spec.capability).__dict__,
            "device": "NVIDIA A100-SXM4-80GB",
            "measurements": {"throughput": measured.to_dict()},
        }
    )
    slow = vramctl.estimate(Mlp(), torch.randn(64, 512), device="A100-80GB", calibration=cal)
    fast = vramctl.estimate(Mlp(), torch.randn(64, 512), device="A100-80GB", calibration=False)
    assert slow.throughput == measured.source
    assert slow.step_seconds is not None and fast.step_seconds is not None
    assert slow.step_seconds > fast.step_seconds


def test_predict_sync_adds_overhead_and_async_overlaps_it() -> None:
    ops = [OpCost("memory", "forward", "fp32", 0, 1000, True) for _ in range(10)]
    base = {"rates": {"matmul": {"fp32": 1e9}}, "bandwidth": 1e6, "view_overhead": 0.0}
    sync = Throughput(device="x", op_overhead=1e-3, **base)  # type: ignore[arg-type]
    asyn = Throughput(device="x", op_overhead=1e-3, asynchronous=True, **base)  # type: ignore[arg-type]
    assert predict(ops, sync).seconds == pytest.approx(10 * (1e-3 + 1e-3))
    assert predict(ops, asyn).seconds == pytest.approx(10 * 1e-3)


def test_the_cpu_profile_is_measured_once_and_kept() -> None:
    path = cpu_profile_path()
    tp = cpu_throughput(remeasure=True)
    assert path.exists()
    doc = json.loads(path.read_text())
    assert doc["schema"] == SCHEMA
    assert Throughput.from_dict(doc) == tp
    assert tp.rates["matmul"]["fp32"] > 1e8  # any CPU does 0.1 GFLOP/s
    assert tp.bandwidth > 1e8
    assert cpu_throughput() == tp


def test_measure_throughput_reports_every_group() -> None:
    torch.manual_seed(1234)
    seeded = torch.get_rng_state()
    tp = measure_throughput("cpu", scale=0.25)
    # The first estimate on a machine measures it: a seeded run must not see that.
    assert torch.equal(torch.get_rng_state(), seeded)
    assert {"matmul", "convolution", "attention", "convolution_backward"} <= set(tp.rates)
    assert {"fp32", "bf16"} <= set(tp.rates["matmul"])
    assert tp.op_overhead > 0 and not tp.asynchronous
    # the measured terms beyond the roofline: arithmetic-bound element-wise operators,
    # rates by size, a multi-tensor operator's per-tensor cost, a dispatch mode's
    assert tp.per_element["bernoulli_"] > 0 and tp.per_element["tanh"] > 0
    # the same on bf16 inputs, but the optimizer's (fp32 state whatever the precision)
    assert tp.per_element["tanh@bf16"] > 0 and tp.per_element["_to_copy@bf16"] > 0
    assert "lerp_@bf16" not in tp.per_element and tp.per_element["nll_loss_backward"] > 0
    assert len(tp.op_curves["convolution_backward:fp32"]) >= 3
    assert tp.tensor_overhead >= 0 and tp.dispatch_overhead > 0
    assert tp.step_factor > 0 and tp.overhead_factor > 0
    # fitted apart on the reference steps under autocast, and kept through a profile
    assert tp.autocast_factors is not None and min(tp.autocast_factors) >= 0.5
    assert Throughput.from_dict(json.loads(json.dumps(tp.to_dict()))) == tp


def test_calibrate_cpu_prints_json_and_saves() -> None:
    result = CliRunner().invoke(app, ["calibrate", "--cpu", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["path"] == str(cpu_profile_path())
    assert doc["measured"] is True
    assert doc["rates"]["matmul"]["fp32"] > 0


def test_autocast_with_checkpointing_on_a_gpu_target_recomputes_in_the_same_dtypes() -> None:
    # the recomputation runs CUDA's autocast rules too (it used to refuse the saved tensors)
    kw = {"batch_size": 1, "seq_len": 64, "device": "A10G-24GB", "precision": "amp-bf16"}
    plain = vramctl.estimate("gpt2", **kw)
    ckpt = vramctl.estimate("gpt2", checkpointing=True, **kw)
    assert ckpt.flops > plain.flops  # the recomputed forward


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_the_cpu_is_measured_under_any_grad_mode(mode: str) -> None:
    # An inference estimate (a MemoryBudget's, under no_grad) may be what measures this
    # machine's CPU first: the measurement's training steps still run backward.
    context = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with context:
        tp = measure_throughput("cpu", scale=0.25)
    assert tp.op_overhead > 0


def _flat(**extra: object) -> Throughput:
    """A throughput with round figures: 1 TFLOP/s, 100 GB/s, 1 us an operator."""
    fields: dict[str, object] = {
        "device": "test",
        "rates": {"matmul": {"fp32": 1e12}},
        "bandwidth": 1e11,
        "op_overhead": 1e-6,
        "view_overhead": 0.0,
    }
    fields.update(extra)
    return Throughput(**fields)  # type: ignore[arg-type]


def test_an_arithmetic_bound_elementwise_operator_takes_its_measured_time() -> None:
    # dropout's random numbers: a million elements at 5 ns each, against 8 MB at 100 GB/s
    op = OpCost("memory", "forward", "fp32", 0, 8_000_000, True, True, "bernoulli_", 10**6)
    plain = predict([op], _flat()).seconds
    assert plain == pytest.approx(8e-5 + 1e-6)
    priced = predict([op], _flat(per_element={"bernoulli_": 5e-9})).seconds
    assert priced == pytest.approx(5e-3 + 1e-6)


def test_an_elementwise_operator_on_bf16_takes_its_bf16_cost_where_measured() -> None:
    tanh = OpCost("memory", "forward", "bf16", 0, 0, True, False, "tanh", 10**6)
    tp = _flat(per_element={"tanh": 1e-9, "tanh@bf16": 3e-9, "exp": 2e-9})
    assert predict([tanh], tp).seconds == pytest.approx(3e-3 + 1e-6)
    # fp32 keeps its own; a dtype not measured takes fp32's
    assert tp.element_cost("tanh", "fp32") == 1e-9
    assert tp.element_cost("exp", "bf16") == tp.element_cost("exp", "fp16") == 2e-9
    assert tp.element_cost("erf", "bf16") == 0.0


def test_a_step_under_autocast_takes_the_autocast_factors_but_not_on_the_host() -> None:
    kernel = OpCost("matmul", "forward", "bf16", 10**9, 0, True)  # 1 ms at 1 TFLOP/s
    tp = _flat(rates={"matmul": {"fp32": 1e12, "bf16": 1e12}}, step_factor=1.5)
    tp = Throughput.from_dict({**tp.to_dict(), "autocast_factors": [2.0, 3.0]})
    assert tp.autocast_factors == (2.0, 3.0)
    assert predict([kernel], tp).seconds == pytest.approx(1.5e-3 + 1e-6)
    assert predict([kernel], tp, autocast=True).seconds == pytest.approx(2e-3 + 3e-6)
    # an offloaded optimizer's step runs on the host, outside autocast: the host's factors
    host_op = OpCost("matmul", "host", "fp32", 10**9, 0, True)
    host = _flat(step_factor=1.25)
    timed = predict([host_op], tp, host=host, autocast=True).seconds
    assert timed == pytest.approx(1.25e-3 + 1e-6)


def test_the_step_factors_fit_recovers_known_factors() -> None:
    from vramctl.estimator._rates import _fit_factors

    # rows of (kernel, overhead) over measured, made by a = 1.5, b = 2.5 exactly
    rows = [(k, (1 - 1.5 * k) / 2.5) for k in (0.1, 0.3, 0.5, 0.6)]
    a, b = _fit_factors(rows)
    assert a == pytest.approx(1.5) and b == pytest.approx(2.5)
    # rows that cannot tell kernels from overheads: one factor for both
    assert _fit_factors([(0.5, 0.5), (0.5, 0.5)]) == (1.0, 1.0)


def test_per_tensor_and_dispatch_mode_costs_add_to_the_overhead() -> None:
    foreach = OpCost("optimizer", "optimizer", "fp32", 0, 0, True, True, "_foreach_add_", 0, 100)
    assert predict([foreach], _flat(tensor_overhead=1e-7)).seconds == pytest.approx(1.1e-5)
    through = OpCost("memory", "forward", "fp32", 0, 0, True, dispatch=True)
    assert predict([through], _flat(dispatch_overhead=2e-5)).seconds == pytest.approx(2.1e-5)


def test_a_host_transfer_on_the_cpu_is_a_memory_copy() -> None:
    # no host link: a copy reads and writes its bytes at the memory's bandwidth
    copy = OpCost("transfer", "forward", "other", 0, 10**8, True)
    assert predict([copy], _flat()).seconds == pytest.approx(2e8 / 1e11 + 1e-6)
    assert predict([copy], _flat(host_bandwidth=1e10)).seconds == pytest.approx(1e-2 + 1e-6)


def test_a_convolutions_backward_takes_its_own_rate_and_small_ones_their_fixed_cost() -> None:
    curves = {"convolution_backward:fp32": [(10**7, 1e10), (10**9, 1e11)]}
    tp = _flat(
        rates={
            "matmul": {"fp32": 1e12},
            "convolution": {"fp32": 1e12},
            "convolution_backward": {"fp32": 1e11},
        },
        op_curves=curves,
    )
    back = OpCost("convolution", "backward", "fp32", 10**9, 0, True, op="convolution_backward")
    assert predict([back], tp).seconds == pytest.approx(1e-2 + 1e-6)
    # below the smallest size measured: the smallest one's time
    small = OpCost("convolution", "backward", "fp32", 10**5, 0, True, op="convolution_backward")
    assert predict([small], tp).seconds == pytest.approx(1e-3 + 1e-6)
    forward = OpCost("convolution", "forward", "fp32", 10**9, 0, True, op="convolution")
    assert predict([forward], tp).seconds == pytest.approx(1e-3 + 1e-6)


def test_selective_checkpointing_prices_its_dispatch_mode() -> None:
    from vramctl.optimize import apply_checkpointing

    x = torch.randn(8, 64)
    step = vramctl.Step(device="cpu", throughput=_flat(dispatch_overhead=1e-3))

    def timed(kind: str) -> vramctl.Estimate:
        model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(4)])
        apply_checkpointing(model, kind)
        return vramctl.estimate(model, x, step=step)

    plain, full, selective = timed("none"), timed("full"), timed("selective")
    assert plain.step_seconds is not None and full.step_seconds is not None
    assert selective.step_seconds is not None
    # each operator of the blocks' forward and recomputation pays a millisecond
    assert selective.step_seconds - full.step_seconds > 10e-3
    assert abs(full.step_seconds - plain.step_seconds) < 1e-3
