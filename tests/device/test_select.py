from __future__ import annotations

import logging

import pytest

import vramctl
from tests.fake_nvml import FakeGpu, GiB
from vramctl import InvalidSizeError, Policy, VramctlError

# Fixture GPUs: cuda:0 A100 80 GiB with 20 GiB used and 80% busy; cuda:1 A100 with
# 10 GiB used and 5% busy; cuda:2 T4 15 GiB with 1 GiB used and idle.


def test_most_free_spreads_out(gpus: list[FakeGpu]) -> None:
    assert vramctl.select_device("8GiB", policy="most-free").id == "cuda:1"


def test_best_fit_packs_onto_the_smallest_gpu_that_fits(gpus: list[FakeGpu]) -> None:
    assert vramctl.select_device("8GiB", policy="best-fit").id == "cuda:2"
    assert vramctl.select_device("20GiB", policy="best-fit").id == "cuda:0"


def test_least_loaded_goes_by_compute_utilization(gpus: list[FakeGpu]) -> None:
    assert vramctl.select_device("8GiB", policy=Policy.LEAST_LOADED).id == "cuda:2"
    gpus[2].util = 99
    assert vramctl.select_device("8GiB", policy=Policy.LEAST_LOADED).id == "cuda:1"


def test_target_utilization_limits_what_fits(gpus: list[FakeGpu]) -> None:
    # T4: 15 GiB total, 1 GiB used. 12 GiB fits at target 1.0 but not at 0.8.
    t4 = ["cuda:2"]
    assert vramctl.select_device("12GiB", candidates=t4, target=1.0).id == "cuda:2"
    assert vramctl.select_device("12GiB", candidates=t4, target=0.8).id == "cpu"


def test_falls_back_to_cpu_with_the_reason_logged(
    gpus: list[FakeGpu], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "vramctl.device")
    sel = vramctl.rank_devices("200GiB")
    assert sel.device.id == "cpu" and sel.fell_back
    for dev in ("cuda:0", "cuda:1", "cuda:2"):
        assert dev in sel.reason
    assert "no GPU fits" in sel.reason
    vramctl.select_device("200GiB")
    assert any(r.levelno == logging.WARNING and "no GPU fits" in r.message for r in caplog.records)


def test_room_nowhere_is_said_with_every_verdict(
    gpus: list[FakeGpu], caplog: pytest.LogCaptureFixture
) -> None:
    sel = vramctl.rank_devices("99999999TiB")
    assert sel.device.id == "cpu" and sel.fell_back and not sel.fits
    assert [v.device.id for v in sel.verdicts] == ["cuda:0", "cuda:1", "cuda:2", "cpu"]
    assert sel.fallback is not None and not sel.fallback.fits
    assert "needs" in sel.fallback.reason and "the CPU has no room either" in sel.reason
    assert sel.to_dict()["fallback"]["device"] == "cpu" and sel.to_dict()["fits"] is False
    assert vramctl.rank_devices("8GiB").fits and vramctl.rank_devices("8GiB").fallback is None
    fell_back = vramctl.rank_devices("1MiB", candidates=["cpu"])
    assert fell_back.fits and fell_back.fallback is not None and fell_back.fallback.fits
    caplog.set_level(logging.INFO, "vramctl.device")
    vramctl.select_device("99999999TiB", candidates=["cpu"])  # no GPU, and the CPU is full
    assert any(r.levelno == logging.WARNING and "no room" in r.message for r in caplog.records)


def test_no_gpu_means_cpu() -> None:
    sel = vramctl.rank_devices("1MiB", candidates=["cpu"])
    assert sel.device.id == "cpu" and "no GPU found" in sel.reason


def test_selection_skips_disabled_devices(gpus: list[FakeGpu]) -> None:
    vramctl.get_device("cuda:1").health.disable("operator took it out")
    sel = vramctl.rank_devices("8GiB")
    assert sel.device.id == "cuda:0"
    verdict = {v.device.id: v for v in sel.considered}["cuda:1"]
    assert not verdict.fits and "operator took it out" in verdict.reason


def test_selection_skips_devices_with_unreadable_memory(gpus: list[FakeGpu]) -> None:
    dev = vramctl.get_device("cuda:1")
    dev.health._sleep = lambda s: None
    gpus[1].fail(3)
    sel = vramctl.rank_devices("8GiB", policy="most-free")
    assert sel.device.id == "cuda:0"


def test_bad_input_is_one_clear_error(gpus: list[FakeGpu]) -> None:
    with pytest.raises(InvalidSizeError, match="12 gigs"):
        vramctl.select_device("12 gigs")
    with pytest.raises(InvalidSizeError, match="negative"):
        vramctl.select_device(-1)
    with pytest.raises(VramctlError, match="most-free, least-loaded, best-fit"):
        vramctl.select_device("1GiB", policy="random")
    with pytest.raises(VramctlError, match="target"):
        vramctl.select_device("1GiB", target=1.5)


def test_selection_to_dict(gpus: list[FakeGpu]) -> None:
    d = vramctl.rank_devices(GiB).to_dict()
    assert d["device"]["id"] == "cuda:1" and d["need_bytes"] == GiB
    assert [c["device"] for c in d["considered"]] == ["cuda:0", "cuda:1", "cuda:2"]


def test_use_device_switches_and_restores() -> None:
    before = vramctl.current_device()
    sim = vramctl.simulate("1GiB")
    with vramctl.use_device("cpu") as cpu:
        assert vramctl.current_device() is cpu
        with vramctl.use_device(sim):
            assert vramctl.current_device() is sim
        assert vramctl.current_device() is cpu
    assert vramctl.current_device() is before


def test_use_device_restores_after_an_error() -> None:
    before = vramctl.current_device()
    with pytest.raises(RuntimeError), vramctl.use_device(vramctl.simulate("1GiB")):
        raise RuntimeError("boom")
    assert vramctl.current_device() is before
