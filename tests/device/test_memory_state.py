from __future__ import annotations

import json

import pytest

from vramctl import NA, MemoryState

GiB = 2**30


def state(**kw: object) -> MemoryState:
    base: dict[str, object] = {
        "device": "cuda:0",
        "total": 16 * GiB,
        "used": 4 * GiB,
        "free": 12 * GiB,
        "allocated": 2 * GiB,
        "reserved": 3 * GiB,
        "inactive_split": GiB // 2,
    }
    base.update(kw)
    return MemoryState(**base)  # type: ignore[arg-type]


def test_utilization_and_fragmentation_are_ratios() -> None:
    s = state()
    assert s.utilization == 0.25
    assert s.fragmentation == pytest.approx(1 / 6)


def test_missing_readings_stay_not_available() -> None:
    s = MemoryState(device="cuda:0")
    assert s.utilization is NA and s.fragmentation is NA and s.headroom() is NA
    assert s.fits(1) is False  # never guess that something fits
    assert state(reserved=0).fragmentation is NA  # a ratio over nothing is not 0


def test_headroom_and_fits_respect_target_and_free() -> None:
    s = state()
    assert s.headroom(0.5) == 4 * GiB
    assert s.fits(4 * GiB, target=0.5)
    assert not s.fits(4 * GiB + 1, target=0.5)
    # free is lower than the target suggests (another process reserved memory):
    tight = state(used=4 * GiB, free=GiB)
    assert not tight.fits(2 * GiB, target=1.0)


def test_addition_aggregates_devices() -> None:
    a, b = state(), state(device="cuda:1", used=8 * GiB, free=8 * GiB, temperature_c=70.0)
    total = a + b
    assert total.total == 32 * GiB and total.used == 12 * GiB and total.free == 20 * GiB
    assert total.device == "cuda:0+cuda:1"
    assert total.temperature_c is NA  # per-device readings do not add
    assert sum([a, b]) == total
    assert (a + MemoryState(device="x")).total is NA


def test_subtraction_gives_the_change_between_readings() -> None:
    before, after = state(), state(used=6 * GiB, free=10 * GiB, allocated=4 * GiB)
    delta = after - before
    assert delta.used == 2 * GiB and delta.free == -2 * GiB and delta.allocated == 2 * GiB
    assert delta.total == 0
    with pytest.raises(ValueError, match="cuda:1"):
        _ = after - state(device="cuda:1")


def test_to_dict_is_json_with_null_for_missing() -> None:
    d = state(power_w=NA).to_dict()
    text = json.dumps(d)
    assert json.loads(text)["power_w"] is None
    assert d["utilization"] == 0.25 and d["total"] == 16 * GiB
