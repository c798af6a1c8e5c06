"""vramctl.estimate: exact counts on small models, data-dependent ops, bad input, CUDA modelling."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import vramctl
from tests.estimator.real_steps import cpu_step_peak, cuda_step_peaks
from vramctl.estimator import EstimateError
from vramctl.estimator._spec import StepSpec
from vramctl.estimator._target import resolve_target
from vramctl.estimator.zoo import LstmLanguageModel


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))


def param_bytes(m: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in m.parameters())


def test_inference_peak_is_exact_on_cpu() -> None:
    m = mlp()
    x = torch.randn(8, 256)
    est = vramctl.estimate(m, x, mode="infer", device="cpu")
    # Weights, the input, the first layer's output and the ReLU's output are alive together.
    expected = param_bytes(m) + x.nbytes + 2 * 8 * 512 * 4
    assert est.logical_peak == expected
    assert est.peak_device == expected
    assert est.breakdown["parameters"] == param_bytes(m)
    assert est.breakdown["inputs"] == x.nbytes
    assert est.exact and est.fits
    assert est.peak_module.startswith("Sequential")


def test_training_breakdown_has_gradients_and_adam_state() -> None:
    m = mlp()
    est = vramctl.estimate(m, torch.randn(32, 256), device="cpu", optimizer="adamw")
    p = param_bytes(m)
    assert est.breakdown["parameters"] == p
    assert est.breakdown["optimizer"] == 2 * p  # exp_avg and exp_avg_sq
    assert est.logical_peak >= 4 * p
    assert sum(est.breakdown.values()) == est.peak_device
    sgd = vramctl.estimate(m, torch.randn(32, 256), device="cpu", optimizer="sgd")
    assert sgd.breakdown["optimizer"] == 0
    assert sgd.logical_peak < est.logical_peak


def test_a_factory_is_built_on_fake_tensors() -> None:
    from torch._subclasses.fake_tensor import FakeTensor

    built: list[nn.Module] = []

    def big() -> nn.Module:  # 2.1 GB of fp32 weights if it were real
        m = nn.Sequential(*[nn.Linear(8192, 8192) for _ in range(8)])
        built.append(m)
        return m

    est = vramctl.estimate(big, torch.empty(4, 8192), mode="infer", device="A100-80GB")
    assert all(isinstance(p, FakeTensor) for p in built[0].parameters())
    assert est.breakdown["parameters"] == 8 * (8192 * 8192 + 8192) * 4


def test_cpu_estimate_matches_the_profiled_real_step() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.LayerNorm(256), nn.Linear(256, 64))
    batch = torch.randn(64, 128)
    est = vramctl.estimate(model, batch, device="cpu")
    truth = cpu_step_peak(model, batch, StepSpec())
    assert abs(est.logical_peak - truth) / truth < 0.01


class Gather(nn.Module):
    """Data-dependent code: a boolean mask from the input and .item() on weights."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        keep = ids[ids > 0]  # values known: real input
        h = self.proj(torch.randn(keep.numel(), 16))
        picked = h[h.sum(-1) > 0]  # values unknown: bounded by all rows
        if picked.sum().item() > 1e9:  # unknown scalar: assumed
            h = h * 2
        return picked


def test_data_dependent_ops_use_real_input_values_and_bound_the_rest() -> None:
    ids = torch.tensor([[0, 1, 2, 0], [3, 0, 0, 4]])  # four positive ids
    est = vramctl.estimate(Gather(), ids, mode="infer", device="cpu")
    assert not est.exact
    assert any("index" in a for a in est.assumptions)
    assert any("_local_scalar_dense" in a for a in est.assumptions)
    # keep has 4 elements (real values): h is 4x16 floats; the bound keeps all 4 rows.
    assert est.breakdown["activations"] + est.breakdown["temporaries"] >= 2 * 4 * 16 * 4


def test_ctc_model_with_labels_is_estimated() -> None:
    pytest.importorskip("transformers")
    est = vramctl.estimate("wav2vec2-base", batch_size=1, seconds=1.0, device="A10G-24GB")
    assert est.peak_device > est.breakdown["parameters"] > 300 * 2**20
    assert est.fits


def test_cuda_modelling_adds_allocator_context_and_workspaces() -> None:
    m = mlp()
    cpu = vramctl.estimate(m, torch.randn(8, 256), device="cpu")
    gpu = vramctl.estimate(m, torch.randn(8, 256), device="T4-16GB")
    assert gpu.logical_peak > cpu.logical_peak  # plus two cuBLAS workspaces
    assert gpu.peak_reserved >= gpu.peak_allocated >= gpu.logical_peak
    assert gpu.peak_device == gpu.peak_reserved + gpu.breakdown["context"]
    # two cuBLAS workspaces, and cuBLASLt's, made by the first product with a bias
    assert gpu.breakdown["workspaces"] == 2 * (4096 * 1024 * 2 + 16 * 1024 * 8) + 1024 * 1024
    assert gpu.capacity == vramctl.gpu_spec("T4-16GB").cuda_total_bytes


def test_fits_follows_the_budget() -> None:
    m = mlp()
    x = torch.randn(8, 256)
    small = vramctl.estimate(m, x, device="600MiB")
    assert not small.fits and small.headroom < 0
    roomy = vramctl.estimate(m, x, device="8GiB", target_utilization=0.5)
    assert roomy.fits and roomy.budget == 4 * 2**30


def test_max_batch_size_is_confirmed_by_traces() -> None:
    m = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024))

    def mk(b):
        return torch.randn(b, 128, 1024)  # 512 KiB a sample per activation

    res = vramctl.max_batch_size(m, mk, device="2GiB", mode="infer")
    assert 4 < res.batch_size < 2000
    # three activations of 512 KiB live at the peak; the affine fit through the probes near
    # the answer carries the allocator's segment rounding (within 1%)
    assert res.per_sample > 0.99 * 3 * 512 * 2**10
    assert vramctl.estimate(m, mk, batch_size=res.batch_size, device="2GiB", mode="infer").fits
    over = vramctl.estimate(m, mk, batch_size=res.batch_size + 1, device="2GiB", mode="infer")
    assert not over.fits


def test_bad_input_names_what_to_supply() -> None:
    with pytest.raises(vramctl.UnknownDeviceError, match="A10G-24GB"):
        vramctl.estimate(mlp(), torch.randn(2, 256), device="Z99-1GB")
    with pytest.raises(vramctl.VramctlError, match=r"not a built-in model \(.*gpt2"):
        vramctl.estimate("gpt-17")
    with pytest.raises(EstimateError, match=r"expected Sequential\.forward"):
        vramctl.estimate(mlp(), lambda b: 1 / 0, batch_size=2)
    with pytest.raises(EstimateError, match="failed to build"):
        vramctl.estimate(lambda: nn.Linear(-1, 2), torch.randn(2, 2))
    with pytest.raises(
        EstimateError, match=r"could not trace Sequential at Sequential.0, op addmm"
    ):
        vramctl.estimate(mlp(), torch.randn(2, 7), device="cpu")
    with pytest.raises(EstimateError, match="precision must be one of"):
        vramctl.estimate(mlp(), torch.randn(2, 256), precision="fp8")


def test_device_given_as_a_bad_size_says_what_is_wrong() -> None:
    for device in ("-3GiB", "sim:-3GiB", " -1G"):
        with pytest.raises(vramctl.InvalidSizeError, match="cannot be negative"):
            resolve_target(device)
    with pytest.raises(vramctl.InvalidSizeError, match="positive"):
        resolve_target("0GiB")
    with pytest.raises(vramctl.InvalidSizeError, match="12gigs"):
        resolve_target("sim:12gigs")
    assert resolve_target("sim:2GiB").capacity == 2 * 2**30
    assert resolve_target(".5GiB").capacity == 2**29


def test_model_from_a_factory_path() -> None:
    est = vramctl.estimate(
        "vramctl.estimator.zoo:LstmLanguageModel",
        lambda b: torch.randint(0, 10_000, (b, 16)),
        batch_size=2,
        device="cpu",
        mode="infer",
    )
    assert est.model == "vramctl.estimator.zoo:LstmLanguageModel"
    assert est.parameters == sum(p.numel() for p in LstmLanguageModel().parameters())
    assert est.breakdown["parameters"] > 100 * 2**20


@pytest.mark.cuda
def test_estimate_against_a_real_cuda_step() -> None:
    torch.manual_seed(0)
    batch = torch.randn(256, 2048)
    real, _ = cuda_step_peaks(
        nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(4)]), batch, cold_cache=False
    )
    est = vramctl.estimate(
        nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(4)]), batch, device="cuda:0"
    )
    assert abs(est.peak_allocated - real) / real < 0.1


@pytest.mark.cuda
def test_estimate_against_a_real_cuda_step_with_expandable_segments() -> None:
    from vramctl.estimator import AllocatorConfig

    torch.manual_seed(0)
    batch = torch.randn(256, 2048)
    torch.cuda.empty_cache()
    torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    try:
        real_allocated, real_reserved = cuda_step_peaks(
            nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(4)]), batch, cold_cache=True
        )
    finally:
        torch.cuda.empty_cache()
        torch.cuda.memory._set_allocator_settings("expandable_segments:False")
    model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(4)])
    grown = vramctl.estimate(
        model,
        batch,
        device="cuda:0",
        allocator_config=AllocatorConfig.from_conf("expandable_segments:True"),
    )
    assert abs(grown.peak_allocated - real_allocated) / real_allocated < 0.1
    assert abs(grown.peak_reserved - real_reserved) / real_reserved < 0.1
    fixed = vramctl.estimate(model, batch, device="cuda:0")
    assert grown.peak_reserved <= fixed.peak_reserved


# -- what an estimate says it used, and how sure its device peak is ----------------------


def test_an_estimate_reports_the_inputs_it_used_defaults_included() -> None:
    est = vramctl.estimate("lstm", batch_size=2, device="cpu")
    assert est.seq_len == 256 and est.seconds is None  # lstm's default length
    assert est.optimizer == "adamw" and est.checkpointing is False
    doc = est.to_dict()
    assert doc["seq_len"] == 256 and doc["optimizer"] == "adamw" and doc["batch_size"] == 2
    infer = vramctl.estimate("lstm", batch_size=2, seq_len=32, device="cpu", mode="infer")
    assert infer.seq_len == 32 and infer.optimizer is None  # inference runs no optimizer
    assert vramctl.estimate(
        mlp(), torch.randn(4, 256), device="cpu", optimizer="sgd"
    ).optimizer == ("sgd")
    # A length that went nowhere is null, and a note says it was not used.
    given = vramctl.estimate(mlp(), torch.randn(4, 256), device="cpu", seq_len=128)
    assert given.seq_len is None
    assert any("seq_len=128 was given but not used" in n for n in given.notes)
    unused = vramctl.estimate("lstm", batch_size=1, seconds=3.0, device="cpu", mode="infer")
    assert unused.seconds is None and any("seconds=3.0" in n for n in unused.notes)


def test_zoo_lengths_are_the_ones_its_batches_are_made_with() -> None:
    from vramctl.estimator import zoo

    assert zoo.get("gpt2").lengths() == (512, None)
    assert zoo.get("llama-7b").lengths(seq_len=100) == (100, None)
    assert zoo.get("wav2vec2-base").lengths() == (None, 10.0)
    assert zoo.get("whisper-base").lengths() == (448, None)
    assert zoo.get("resnet-50").lengths(seq_len=64) == (None, None)
    assert zoo.make_batch("lstm", 2)["input_ids"].shape == (2, zoo.get("lstm").lengths()[0])


def test_a_gpu_estimate_without_a_profile_says_so_and_carries_its_uncertainty() -> None:
    GiB = 2**30
    est = vramctl.estimate(mlp(), torch.randn(8, 256), device="T4-16GB")
    assert est.cuda and not est.calibrated and est.calibration is None
    assert est.device_uncertainty == GiB
    assert est.peak_device_high == est.peak_device + GiB
    assert est.peak_device == est.peak_reserved + est.breakdown["context"]
    assert "no calibration profile for T4-16GB: run `vramctl calibrate` on it" in est.notes
    assert "no calibration profile for T4-16GB" in str(est)
    assert f"peak {est.device_range()} of" in str(est)  # the range is shown
    assert est.device_range().endswith(f"to {vramctl.format_bytes(est.peak_device_high)}")
    doc = est.to_dict()
    assert doc["calibrated"] is False and doc["device_uncertainty_bytes"] == GiB
    assert doc["peak_device_high_bytes"] == est.peak_device + GiB
    # Convolutions add cuDNN's kernels and autotuning workspaces: 1.5 GiB.
    conv = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU())
    conv_est = vramctl.estimate(conv, torch.randn(2, 3, 32, 32), device="T4-16GB")
    assert conv_est.device_uncertainty == GiB + GiB // 2
    # A CPU target has no context: no range, nothing to calibrate.
    cpu = vramctl.estimate(mlp(), torch.randn(8, 256), device="cpu")
    assert not cpu.cuda and cpu.calibrated and cpu.device_uncertainty == 0
    assert cpu.peak_device_high == cpu.peak_device
    assert not any("calibrat" in n for n in cpu.notes)


def test_fits_judges_the_safe_end_unless_asked_not_to() -> None:
    x = torch.randn(8, 256)
    probe = vramctl.estimate(mlp(), x, device="4GiB", target_utilization=1.0)
    # A generic GPU whose memory lies between the point estimate and the safe end.
    size = f"{(probe.peak_device + probe.device_uncertainty // 2) // 1024}KiB"
    safe = vramctl.estimate(mlp(), x, device=size, target_utilization=1.0)
    assert safe.peak_device == probe.peak_device
    assert safe.fits_point and not safe.fits_safe
    assert safe.safe and not safe.fits and safe.headroom < 0
    assert safe.headroom == safe.budget - safe.peak_device_high
    optimistic = vramctl.estimate(mlp(), x, device=size, target_utilization=1.0, safe=False)
    assert optimistic.fits and not optimistic.safe and not optimistic.fits_safe
    assert optimistic.headroom == optimistic.budget - optimistic.peak_device > 0
    assert "no calibration profile for a" in str(safe)  # a GPU named by its size
    # max_batch_size judges the same way.
    mk = lambda b: torch.randn(b, 256)  # noqa: E731
    assert vramctl.max_batch_size(mlp(), mk, device=size, target_utilization=1.0).batch_size == 0
    loose = vramctl.max_batch_size(mlp(), mk, device=size, target_utilization=1.0, safe=False)
    assert loose.batch_size > 0 and not loose.safe


CONFIGS = Path(__file__).parent / "configs"


@pytest.mark.parametrize("precision", ["bf16", "amp-bf16"])
def test_bf16_on_a_gpu_without_native_bf16_is_said(precision: str) -> None:
    """A V100 or T4 (compute capability below 8.0) has no bf16: an estimate says so."""
    for device, cc in (("T4-16GB", "7.5"), ("V100-32GB", "7.0")):
        est = vramctl.estimate(mlp(), torch.randn(4, 256), device=device, precision=precision)
        said = [n for n in est.notes if n.startswith("no native bf16")]
        assert len(said) == 1, est.notes
        assert f"on {device} (compute capability {cc}; bf16 needs 8.0" in said[0]
        assert "fp16" in said[0] and said[0] in str(est)
    for device, p in (("A10G-24GB", precision), ("T4-16GB", "fp16"), ("cpu", precision)):
        est = vramctl.estimate(mlp(), torch.randn(4, 256), device=device, precision=p)
        assert not any("bf16" in n for n in est.notes), (device, p, est.notes)


@pytest.mark.parametrize("size", [100_000_000, 10**20])
def test_a_batch_beyond_any_gpu_is_refused_in_one_line(size: int) -> None:
    """Its inputs were built in host memory: a 56-line traceback, or an int64 overflow."""
    with pytest.raises(EstimateError) as err:
        vramctl.estimate("lstm", batch_size=size, device="A100-80GB")
    msg = str(err.value)
    assert msg.startswith(f"batch {size} of lstm is beyond any GPU's reach: its inputs alone")
    assert "H200-141GB" in msg and "smaller batch size or seq_len" in msg and "\n" not in msg
    with pytest.raises(EstimateError, match="beyond any GPU's reach"):
        vramctl.estimate("lstm", seq_len=10**15, device="A100-80GB")


def test_a_huge_batch_within_reach_is_traced_on_shapes_alone() -> None:
    """114 GiB of token ids: more than this host has, and none of it is made."""
    size = 60_000_000
    est = vramctl.estimate("lstm", batch_size=size, mode="infer", device="H200-141GB")
    assert est.breakdown["inputs"] == size * 256 * 8  # int64 token ids
    assert not est.fits


def test_a_large_batch_keeps_the_values_its_trace_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Beyond REAL_INPUT_BYTES the audio is shapes alone, but CTC's labels (checked against
    the vocabulary) repeat a small real batch's rows: the same estimate as a real batch."""
    from vramctl.estimator import _session

    path = str(CONFIGS / "tiny-wav2vec2")
    real = vramctl.estimate(path, batch_size=4, seconds=1.0, device="A10G-24GB")
    monkeypatch.setattr(_session, "REAL_INPUT_BYTES", 1024)
    shaped = vramctl.estimate(path, batch_size=4, seconds=1.0, device="A10G-24GB")
    assert shaped.breakdown == real.breakdown and shaped.peak_device == real.peak_device
