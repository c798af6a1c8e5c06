"""Calibration profiles: fitting, saving, finding, and what they change in an estimate."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import vramctl
from vramctl.device import gpu_spec
from vramctl.estimator import (
    AllocatorConfig,
    Calibration,
    CalibrationError,
    DeviceEvidence,
    _cuda_model,
    calibrate,
    calibration_dir,
    find_calibration,
    list_calibrations,
    load_calibration,
)
from vramctl.estimator._calibrate import _measure_in_child
from vramctl.estimator._calibration import (
    ENV_CALIBRATION,
    STREAM_POOL_BYTES,
    fit_constants,
    workspace_envelope,
)
from vramctl.estimator._target import resolve_target

MiB = 2**20
A10G = gpu_spec("A10G-24GB")


def readings(**over: Any) -> dict[str, Any]:
    """Readings shaped like measure()'s, with figures chosen for the test."""
    doc: dict[str, Any] = {
        "device": "NVIDIA A10G",
        "capability": "8.6",
        "software": {"torch": "2.11.0", "cuda": "13.0"},
        "context": {"after_init": 300 * MiB, "after_matmul": 410 * MiB, "after_conv": 530 * MiB},
        "cublas": {
            "per_handle": 9 * MiB,
            "other_thread": 9 * MiB,
            "backward_extra": 9 * MiB,
            "backward_first": True,
        },
        "cudnn": [
            {"conv": "a", "pass": "forward", "output_bytes": 100 * MiB, "workspace_bytes": 0},
            {
                "conv": "a",
                "pass": "backward",
                "output_bytes": 10 * MiB,
                "workspace_bytes": 25 * MiB,
            },
        ],
        "allocator": {
            "expandable_segments": False,
            "min_block": 512,
            "small_size": MiB,
            "small_buffer": 2 * MiB,
            "large_buffer": 20 * MiB,
            "min_large_alloc": 10 * MiB,
            "round_large": 2 * MiB,
        },
    }
    doc.update(over)
    return doc


def fitted(**over: Any) -> Calibration:
    cal, _notes = fit_constants(
        readings(**over), _cuda_model.builtin("NVIDIA A10G", A10G.capability)
    )
    return replace(cal, created="2026-11-22T10:00:00+00:00", software={"torch": "2.11.0"})


def test_constants_are_fitted_from_the_readings() -> None:
    cal, notes = fit_constants(readings(), _cuda_model.builtin("NVIDIA A10G", A10G.capability))
    assert notes == []
    assert cal.context_bytes == 410 * MiB
    assert cal.cudnn_context_bytes == 120 * MiB
    assert cal.cublas_workspace_bytes == 9 * MiB
    assert cal.train_handles == 2  # the backward's thread kept one more handle's workspace
    # The lowest line over (100 MiB, 0) and (10 MiB, 25 MiB): flat at 25 MiB.
    assert (cal.cudnn_workspace_ratio, cal.cudnn_workspace_fixed) == (0.0, 25 * MiB)
    assert cal.cudnn_workspace_cap == _cuda_model.CUDNN_WORKSPACE_CAP
    assert cal.allocator.min_large_alloc == 10 * MiB


def test_a_backward_measured_after_another_thread_keeps_two_handles() -> None:
    """Profiles before 2026-11-27 measured the backward after a worker thread's matrix
    multiplies: autograd's thread took that thread's pooled handle and workspace, and the
    backward seemed to keep nothing. Every recorded training step on the H200 made two."""
    old = {"per_handle": 33 * MiB, "other_thread": 33 * MiB, "backward_extra": 0}
    builtin = _cuda_model.builtin("NVIDIA A10G", A10G.capability)
    cal, notes = fit_constants(readings(cublas=old), builtin)
    assert cal.train_handles == 2 and cal.cublas_workspace_bytes == 33 * MiB
    assert any("after another thread" in n for n in notes)
    # Measured first (as the probe now does), a backward that keeps nothing is believed.
    cal, notes = fit_constants(readings(cublas={**old, "backward_first": True}), builtin)
    assert cal.train_handles == 1 and notes == []


def test_an_old_profile_that_read_one_training_handle_reads_two() -> None:
    h200 = Path(__file__).parents[2] / "docs" / "benchmarks" / "gpu"
    for name in (
        "2026-11-25-nvidia-h200-calibration.json",
        "2026-11-27-nvidia-h200-calibration.json",
    ):
        doc = json.loads((h200 / name).read_text())
        assert doc["constants"]["train_handles"] == 1  # as it was written
        assert load_calibration(h200 / name).train_handles == 2
    fresh = fitted(cublas={"per_handle": MiB, "other_thread": MiB, "backward_extra": 0})
    doc = {**fresh.to_dict(), "measurements": {"cublas": {"backward_first": True}}}
    assert Calibration.from_dict(doc).train_handles == 2  # fitted() kept the built-in 2
    doc["constants"]["train_handles"] = 1
    assert Calibration.from_dict(doc).train_handles == 1


def test_the_workspace_line_is_the_lowest_over_every_measured_convolution() -> None:
    # As measured on an H200: a small backward took 116 times its output.
    points = [
        (25_690_112, 31_457_280),
        (4_816_896, 36_601_344),
        (6_422_528, 0),
        (26_206_208, 90_177_536),
        (52_420_608, 88_070_656),
        (256_000, 29_650_432),
        (1_228_800, 10_660_352),
    ]
    ratio, fixed = workspace_envelope(points)
    assert all(fixed + ratio * x >= y for x, y in points)
    # Touches the points it rests on, and at 100 MiB of output charges far less than the
    # largest ratio (116 x) would.
    assert min(fixed + ratio * x - y for x, y in points) < 1e3
    assert fixed + ratio * 100 * MiB < 5 * 100 * MiB
    assert workspace_envelope([(MiB, 0), (2 * MiB, 0)]) == (0.0, 0)
    assert workspace_envelope([(MiB, 3 * MiB)]) == (0.0, 3 * MiB)


def test_an_old_profile_without_the_fixed_workspace_reads_as_none() -> None:
    doc = fitted().to_dict()
    del doc["constants"]["cudnn_workspace_fixed"]
    assert Calibration.from_dict(doc).cudnn_workspace_fixed == 0


def test_what_was_not_measured_keeps_the_builtin_value_with_a_note() -> None:
    base = _cuda_model.builtin("NVIDIA A10G", A10G.capability)
    cal, notes = fit_constants(
        readings(
            context={"after_matmul": None},
            cublas={"per_handle": 0},
            cudnn=[],
            allocator={"expandable_segments": True, "small_buffer": 4 * MiB},
        ),
        base,
    )
    assert cal.context_bytes == base.context_bytes
    assert cal.cublas_workspace_bytes == base.cublas_workspace_bytes
    assert cal.cudnn_workspace_ratio == base.cudnn_workspace_ratio
    assert cal.allocator == base.allocator  # expandable segments: the model's constants stay
    assert len(notes) == 4
    assert any("expandable_segments" in n for n in notes)


def test_a_saved_profile_reads_back_equal(tmp_path: Path) -> None:
    cal = fitted().save()
    assert cal.path is not None
    assert cal.path.parent == calibration_dir()
    assert cal.path.name == "nvidia-a10g-sm86.json"
    back = load_calibration(cal.path)
    assert back == cal
    assert back.measurements["cublas"]["per_handle"] == 9 * MiB
    assert list_calibrations() == [back]
    other = fitted().save(tmp_path / "elsewhere" / "a10g.json")
    assert load_calibration(other.path or "") == cal


def test_bad_profiles_name_the_file_and_the_field(tmp_path: Path) -> None:
    good = fitted().to_dict()
    p = tmp_path / "p.json"

    def error_for(doc: Any) -> str:
        p.write_text(doc if isinstance(doc, str) else json.dumps(doc))
        with pytest.raises(CalibrationError) as info:
            load_calibration(p)
        return str(info.value)

    assert "line 1" in error_for("{not json")
    assert "'schema'" in error_for({**good, "schema": "other/9"})
    consts = dict(good["constants"])
    consts["context_bytes"] = -1
    msg = error_for({**good, "constants": consts})
    assert str(p) in msg and "constants.context_bytes" in msg
    consts = {**good["constants"], "cudnn_workspace_ratio": "big"}
    assert "cudnn_workspace_ratio" in error_for({**good, "constants": consts})
    consts = {**good["constants"], "allocator": {"round_large": 0}}
    assert "allocator.round_large" in error_for({**good, "constants": consts})
    with pytest.raises(CalibrationError, match="vramctl calibrate"):
        load_calibration(tmp_path / "missing.json")
    with pytest.raises(CalibrationError, match="cannot write"):
        fitted().save(p / "under-a-file.json")


def test_a_broken_file_is_skipped_when_listing(caplog: pytest.LogCaptureFixture) -> None:
    good = fitted().save()
    (calibration_dir() / "broken.json").write_text("[]")
    assert list_calibrations() == [good]
    assert "broken.json" in caplog.text


def test_lookup_prefers_the_same_gpu_then_its_model_then_its_capability(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert find_calibration("NVIDIA A10G", A10G.capability) is None
    same_cc = replace(fitted(), device="NVIDIA RTX A6000").save()
    assert find_calibration("NVIDIA A10G", A10G.capability) == same_cc
    exact = fitted().save()
    assert find_calibration("NVIDIA A10G", A10G.capability) == exact
    # A catalog name finds the profile of the real GPU it stands for.
    assert find_calibration("A10G-24GB", A10G.capability) == exact
    assert find_calibration("NVIDIA H100 80GB HBM3", vramctl.ComputeCapability(9, 0)) is None

    monkeypatch.setenv(ENV_CALIBRATION, "off")
    assert find_calibration("NVIDIA A10G", A10G.capability) is None
    pinned = fitted().save(tmp_path / "pinned.json")
    monkeypatch.setenv(ENV_CALIBRATION, str(pinned.path))
    assert find_calibration("NVIDIA H100 80GB HBM3", None) == pinned
    monkeypatch.setenv(ENV_CALIBRATION, str(tmp_path / "nowhere.json"))
    with pytest.raises(CalibrationError, match=r"nowhere\.json"):
        find_calibration("NVIDIA A10G", A10G.capability)


def lstm_train(**kw: Any) -> vramctl.Estimate:
    return vramctl.estimate("lstm", batch_size=2, seq_len=16, device="A10G-24GB", **kw)


def test_an_estimate_uses_the_measured_constants() -> None:
    builtin = lstm_train(calibration=False)
    cal = replace(
        fitted(), context_bytes=1000 * MiB, cublas_workspace_bytes=5 * MiB, train_handles=3
    )
    measured = lstm_train(calibration=cal)
    assert builtin.breakdown["context"] == _cuda_model.context_bytes(A10G.capability)
    assert measured.breakdown["context"] == 1000 * MiB  # no convolution: no cuDNN context
    # The profile measured cuBLAS's and cuBLASLt's workspaces together (5 MiB): each handle
    # makes 4 MiB, and cuBLASLt's 1 MiB comes only with a bias product, which this LSTM's
    # step (its head on cuDNN's time-major output: mm and an add) does not run.
    assert cal.cublas_split() == (4 * MiB, 1 * MiB)
    assert measured.breakdown["workspaces"] == 3 * 4 * MiB
    assert builtin.breakdown["workspaces"] == 2 * _cuda_model.cublas_workspace_bytes(
        A10G.capability
    )
    assert any("measured on NVIDIA A10G" in n for n in measured.notes)
    assert any("built-in values" in n for n in builtin.notes)
    # The same through the profile's path.
    saved = cal.save()
    assert lstm_train(calibration=str(saved.path)).peak_device == measured.peak_device


def test_the_stream_pool_is_measured_saved_and_priced_where_a_step_takes_side_streams() -> None:
    cal = fitted(streams={"before": 410 * MiB, "after": 480 * MiB})
    assert cal.stream_pool_bytes == 70 * MiB
    back = load_calibration(cal.save().path or "")
    assert back.stream_pool_bytes == 70 * MiB and back == cal
    # a profile that did not measure it takes the H200's figure
    old = fitted()
    assert old.stream_pool_bytes is None and old.stream_pool() == STREAM_POOL_BYTES
    assert "stream_pool_bytes" not in old.to_dict()["constants"]
    builtin = _cuda_model.builtin("NVIDIA A10G", A10G.capability)
    _, notes = fit_constants(readings(streams={"before": 400 * MiB, "after": None}), builtin)
    assert any("stream pool" in n for n in notes)

    cal = replace(cal, stream_pool_bytes=64 * MiB)
    plain = lstm_train(calibration=cal)
    side = lstm_train(calibration=cal, side_streams=True)
    assert side.breakdown["context"] - plain.breakdown["context"] == 64 * MiB
    assert side.peak_device - plain.peak_device == 64 * MiB
    assert (side.peak_allocated, side.peak_reserved) == (plain.peak_allocated, plain.peak_reserved)
    assert any("side streams" in n for n in side.notes)
    assert not any("side streams" in n for n in plain.notes)
    # a CPU has no streams to pool
    cpu = vramctl.estimate("lstm", batch_size=2, seq_len=16, device="cpu", side_streams=True)
    assert (
        cpu.peak_device
        == vramctl.estimate("lstm", batch_size=2, seq_len=16, device="cpu").peak_device
    )


def test_a_step_over_several_gpus_holds_the_stream_pool_for_nccls_streams() -> None:
    """NCCL's process group takes its streams from PyTorch's pool, which makes it whole."""
    cal = replace(fitted(), stream_pool_bytes=64 * MiB)
    ddp = lstm_train(calibration=cal, parallel="ddp:2")
    assert ddp.breakdown["context"] == cal.context_bytes + 64 * MiB
    assert any("NCCL's streams" in n for n in ddp.notes)


def test_a_saved_profile_is_found_for_its_gpu_without_being_named() -> None:
    cal = replace(fitted(), context_bytes=777 * MiB).save()
    est = lstm_train()
    assert est.breakdown["context"] == 777 * MiB
    assert resolve_target("A10G-24GB").calibration == cal
    # The CPU takes no calibration.
    assert resolve_target("cpu").calibration is None
    assert lstm_train(calibration=False).breakdown["context"] != 777 * MiB


class Conv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(16, 64, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


def test_convolutions_add_cudnn_context_and_the_measured_workspace() -> None:
    x = torch.randn(8, 16, 64, 64)

    def run(cal: Calibration) -> vramctl.Estimate:
        return vramctl.estimate(Conv(), x, mode="infer", device="A10G-24GB", calibration=cal)

    base = replace(
        fitted(), cudnn_context_bytes=50 * MiB, cudnn_workspace_ratio=0.0, cudnn_workspace_fixed=0
    )
    none = run(base)
    assert none.breakdown["context"] == base.context_bytes + 50 * MiB
    out_bytes = 8 * 64 * 64 * 64 * 4
    big = run(replace(base, cudnn_workspace_ratio=3.0))
    assert big.peak_allocated - none.peak_allocated == 3 * out_bytes
    capped = run(replace(base, cudnn_workspace_ratio=3.0, cudnn_workspace_cap=MiB))
    assert capped.peak_allocated - none.peak_allocated == MiB
    line = run(replace(base, cudnn_workspace_ratio=3.0, cudnn_workspace_fixed=6 * MiB))
    assert line.peak_allocated - none.peak_allocated == 6 * MiB + 3 * out_bytes


def test_a_recorded_convolution_takes_its_recorded_workspace_and_others_the_line(
    tmp_path: Path,
) -> None:
    from vramctl.estimator._conv_workspace import conv_key

    x = torch.randn(8, 16, 64, 64)
    conv = Conv().conv
    key = conv_key(
        torch.ops.aten.convolution.default,
        (x, conv.weight, conv.bias, [1, 1], [1, 1], [1, 1], False, [0, 0], 1),
    )
    assert key == (
        "convolution(float32[8, 16, 64, 64],float32[64, 16, 3, 3],float32[64],"
        "[1,1],[1,1],[1,1],False,[0,0],1)"
    )
    base = replace(fitted(), cudnn_workspace_ratio=3.0, cudnn_workspace_fixed=6 * MiB)
    table = replace(base, cudnn_workspaces={key: 5 * MiB, "convolution(other)": 1})

    def run(cal: Calibration, batch: torch.Tensor = x) -> vramctl.Estimate:
        return vramctl.estimate(Conv(), batch, mode="infer", device="A10G-24GB", calibration=cal)

    # the recorded call holds what a flat 5 MiB workspace would
    flat = run(replace(base, cudnn_workspace_ratio=0.0, cudnn_workspace_fixed=5 * MiB))
    assert run(table).peak_allocated == flat.peak_allocated < run(base).peak_allocated
    # another batch is another call: the line
    other = torch.randn(4, 16, 64, 64)
    assert run(table, other).peak_allocated == run(base, other).peak_allocated
    # the table is saved and read back with the profile; a bad entry names the field
    back = load_calibration(table.save(tmp_path / "t.json").path or "")
    assert back.cudnn_workspaces == {key: 5 * MiB, "convolution(other)": 1}
    doc = table.to_dict()
    doc["constants"]["cudnn_workspaces"] = {key: -1}
    with pytest.raises(CalibrationError, match="cudnn_workspaces"):
        Calibration.from_dict(doc)


def test_the_measured_allocator_constants_drive_the_replay() -> None:
    cal = fitted()
    wide = replace(cal, allocator=replace(cal.allocator, small_buffer=8 * MiB))
    a, b = lstm_train(calibration=cal), lstm_train(calibration=wide)
    assert a.peak_allocated == b.peak_allocated
    assert b.peak_reserved > a.peak_reserved


def test_calibrating_without_a_gpu_is_a_clear_error() -> None:
    with pytest.raises(CalibrationError, match="no CUDA GPU"):
        calibrate()
    with pytest.raises(CalibrationError, match="cpu device"):
        calibrate("cpu")


def test_the_fresh_process_reports_its_failure() -> None:
    """The measuring process is real; on a machine without CUDA it fails with its reason."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the cuda tests measure it")
    with pytest.raises(CalibrationError, match=r"the calibration process failed: .*CUDA"):
        _measure_in_child(0, timeout=120)


def test_a_profile_of_this_gpu_narrows_the_device_range_and_another_gpus_does_less() -> None:
    builtin = lstm_train(calibration=False)
    assert not builtin.calibrated and builtin.device_uncertainty == 1024 * MiB
    assert any("no calibration profile for A10G-24GB" in n for n in builtin.notes)
    own = lstm_train(calibration=fitted())  # measured on an NVIDIA A10G: this GPU's model
    assert own.calibrated and own.device_uncertainty == _cuda_model.CALIBRATED_UNCERTAINTY
    assert own.calibration is not None and own.calibration.startswith("NVIDIA A10G")
    assert not any("no calibration profile" in n for n in own.notes)
    assert own.to_dict()["calibration"] == own.calibration
    # Another GPU of the same compute capability (8.6): its constants, but not its certainty.
    other = replace(fitted(), device="NVIDIA GeForce RTX 3090")
    lent = lstm_train(calibration=other)
    assert lent.calibration is not None and not lent.calibrated
    assert lent.device_uncertainty == _cuda_model.OTHER_GPU_UNCERTAINTY
    assert any("another GPU than A10G-24GB" in n for n in lent.notes)
    assert any("no calibration profile for A10G-24GB" in n for n in lent.notes)
    # Found by its compute capability alone, it is the same.
    other.save()
    found = lstm_train()
    assert found.calibration == lent.calibration and not found.calibrated


def test_evidence_from_recorded_steps_sets_the_range_in_place_of_the_allowance(
    tmp_path: Path,
) -> None:
    """A profile with evidence from steps recorded on its GPU: the range's top is the
    largest shortfall seen there, as a share of the estimated device peak (rounded up to a
    MiB), and the estimate says where it comes from; the profile reads back with it; the
    same profile without evidence keeps the fixed allowance and says that no steps were
    recorded."""
    seen = DeviceEvidence(source="a10g corpus", steps=40, shortfall_pct=2.5, median_pct=0.9)
    cal = replace(fitted(), evidence=seen)
    est = lstm_train(calibration=cal)
    want = -(-math.ceil(est.peak_device * 0.025) // MiB) * MiB
    assert est.calibrated and est.device_uncertainty == want
    assert est.peak_device_high == est.peak_device + want
    assert any("40 recorded steps (a10g corpus)" in n and "2.5%" in n for n in est.notes)
    plain = lstm_train(calibration=fitted())
    assert plain.device_uncertainty == _cuda_model.CALIBRATED_UNCERTAINTY
    assert any("no recorded steps for this GPU" in n for n in plain.notes)
    # another GPU's evidence says nothing about this one
    lent = lstm_train(calibration=replace(cal, device="NVIDIA GeForce RTX 3090"))
    assert lent.device_uncertainty == _cuda_model.OTHER_GPU_UNCERTAINTY
    back = load_calibration(cal.save(tmp_path / "with-evidence.json").path or "")
    assert back.evidence == seen
    doc = cal.to_dict()
    doc["evidence"] = {"device_peak": {**seen.to_dict(), "shortfall_pct": -1}}
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    with pytest.raises(CalibrationError, match=r"evidence\.device_peak\.shortfall_pct"):
        load_calibration(tmp_path / "bad.json")


def test_a_jobs_allocator_setting_keeps_the_calibrations_measured_constants() -> None:
    # max_split_size_mb from a job's PYTORCH_CUDA_ALLOC_CONF goes over the profile's
    # measured constants; it does not put PyTorch's defaults back in their place.
    wide = replace(fitted(), allocator=replace(fitted().allocator, small_buffer=8 * MiB))
    conf = AllocatorConfig.from_conf("max_split_size_mb:64")
    alone, with_conf = (
        lstm_train(calibration=wide),
        lstm_train(calibration=wide, allocator_config=conf),
    )
    defaults = lstm_train(calibration=fitted(), allocator_config=conf)
    # the profile's wider small-pool buffers are kept under the job's setting ...
    assert with_conf.peak_reserved > defaults.peak_reserved
    # ... and the setting applies (cuDNN's weight buffer and workspace for the LSTM are
    # over 64 MiB: such blocks are no longer split)
    assert with_conf.peak_reserved != alone.peak_reserved


def test_cublas_and_cublaslt_workspaces_are_told_apart() -> None:
    """A profile that measured cuBLAS's and cuBLASLt's workspaces together gives PyTorch's
    default 1 MiB of its figure to cuBLASLt; one that measured them apart keeps both, also
    through its file; the built-in constants give Hopper's 32 MiB and 1 MiB."""
    from vramctl.estimator._calibration import Calibration

    together = replace(fitted(), cublas_workspace_bytes=33 * MiB, cublaslt_workspace_bytes=None)
    assert together.cublas_split() == (32 * MiB, MiB)
    assert replace(together, cublas_workspace_bytes=MiB).cublas_split() == (MiB, 0)
    apart = replace(together, cublas_workspace_bytes=32 * MiB, cublaslt_workspace_bytes=0)
    assert apart.cublas_split() == (32 * MiB, 0)
    assert Calibration.from_dict(apart.to_dict()).cublas_split() == (32 * MiB, 0)
    assert Calibration.from_dict(together.to_dict()).cublaslt_workspace_bytes is None
    hopper = _cuda_model.builtin("NVIDIA H100", vramctl.ComputeCapability(9, 0))
    assert hopper.cublas_split() == (32 * MiB, MiB)


def test_a_probe_that_reads_cublaslt_apart_is_fitted_apart() -> None:
    probe = {"per_handle": 33 * MiB, "lt": MiB, "backward_extra": 32 * MiB}
    builtin = _cuda_model.builtin("NVIDIA H200", vramctl.ComputeCapability(9, 0))
    cal, _ = fit_constants(readings(cublas=probe), builtin)
    assert cal.cublas_split() == (32 * MiB, MiB)
    assert cal.train_handles == 2


@pytest.mark.parametrize("bias", [True, False])
def test_only_a_bias_product_makes_the_cublaslt_workspace(bias: bool) -> None:
    model = nn.Sequential(nn.Linear(256, 256, bias=bias), nn.ReLU(), nn.Linear(256, 8, bias=bias))
    est = vramctl.estimate(
        model, torch.randn(64, 256), mode="infer", device="H200-141GB", calibration=False
    )
    assert est.breakdown["workspaces"] == 32 * MiB + (MiB if bias else 0)
