"""Alert rules, hold times, levels, sinks and the built-in rules."""

from __future__ import annotations

import logging
import time

import pytest
import torch

import vramctl
from vramctl import MemoryState
from vramctl.monitor import (
    Alert,
    AlertEngine,
    AlertRuleError,
    FragmentationRule,
    Level,
    Monitor,
    OomRiskRule,
    RetriesRule,
    Sample,
    UsageRule,
    cleanup,
    default_rules,
)

GiB = 2**30
MiB = 2**20


def gpu(used: int, t: float, total: int = 16 * GiB, **kw: object) -> Sample:
    return Sample(
        "cuda:0",
        MemoryState("cuda:0", total=total, used=used, free=total - used, timestamp=t, **kw),  # type: ignore[arg-type]
    )


def run(engine: AlertEngine, samples: list[Sample]) -> list[Alert]:
    fired: list[Alert] = []
    for i, s in enumerate(samples):
        fired += engine.evaluate(s, samples[: i + 1])
    return fired


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"warning": 1.5}, "between 0 and 1"),
        ({"critical": 0.0}, "between 0 and 1"),
        ({"warning": -0.2}, "between 0 and 1"),
        ({"warning": 80}, "for 80% write 0.8"),
        ({"warning": 0.9, "critical": 0.8}, "warning level comes first"),
        ({"for_s": -1}, "hold time"),
        ({"kind": "tpu"}, "kind"),
    ],
)
def test_bad_rule_settings_are_clear_errors(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(AlertRuleError, match=match):
        UsageRule(**kwargs)  # type: ignore[arg-type]


def test_bad_fragmentation_threshold() -> None:
    with pytest.raises(AlertRuleError, match="between 0 and 1"):
        FragmentationRule(threshold=30)


def test_defaults_follow_the_seed_levels() -> None:
    rules = default_rules()
    usage = [r for r in rules if isinstance(r, UsageRule)]
    assert {(r.kind, r.warning, r.critical) for r in usage} == {
        ("gpu", 0.80, 0.95),
        ("cpu", 0.75, 0.90),
    }
    assert {r.name for r in rules} >= {"fragmentation", "alloc_retries", "oom_risk"}


def test_levels_escalate_step_down_and_resolve() -> None:
    engine = AlertEngine([UsageRule(0.8, 0.95)])
    series = [0.5, 0.85, 0.86, 0.97, 0.9, 0.5, 0.5]
    fired = run(engine, [gpu(int(16 * GiB * u), t) for t, u in enumerate(series)])
    assert [(a.level.name, a.resolved) for a in fired] == [
        ("WARNING", False),
        ("CRITICAL", False),
        ("WARNING", False),
        ("INFO", True),
    ]
    assert fired[0].value == pytest.approx(0.85)
    assert fired[0].threshold == 0.8
    assert "85% of memory in use" in fired[0].message


def test_a_hold_time_keeps_short_spikes_quiet() -> None:
    engine = AlertEngine([UsageRule(0.8, 0.95, for_s=3.0)])
    high = int(16 * GiB * 0.9)
    low = int(16 * GiB * 0.5)
    # Spikes of 2 s never alert; 4 s of high memory does, once, 3 s after it began.
    times = [0, 1, 2, 3, 4, 5, 10, 11, 12, 13, 14]
    useds = [high, high, low, high, high, low, high, high, high, high, high]
    fired = run(engine, [gpu(u, t) for t, u in zip(times, useds, strict=True)])
    assert [(a.level.name, a.timestamp) for a in fired] == [("WARNING", 13)]


def test_callbacks_filter_by_level_and_rule_and_logging_gets_everything(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = AlertEngine([UsageRule(0.8, 0.95)])
    critical_only: list[Alert] = []
    everything: list[Alert] = []
    other_rule: list[Alert] = []
    engine.on_alert(critical_only.append, level="critical")
    remove = engine.on_alert(everything.append)
    engine.on_alert(other_rule.append, rule="fragmentation")
    with caplog.at_level(logging.INFO, logger="vramctl.monitor"):
        run(engine, [gpu(int(16 * GiB * u), t) for t, u in enumerate([0.85, 0.97, 0.1])])
    assert [a.level.name for a in critical_only] == ["CRITICAL", "INFO"]  # + resolved
    assert len(everything) == 3
    assert other_rule == []
    assert [r.levelno for r in caplog.records] == [logging.WARNING, logging.CRITICAL, logging.INFO]
    assert caplog.records[1].vramctl_alert["level"] == "critical"  # type: ignore[attr-defined]
    remove()
    run(engine, [gpu(int(16 * GiB * 0.9), 10)])
    assert len(everything) == 3


def test_a_failing_callback_or_rule_does_not_break_the_others(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Broken:
        name = "broken"
        for_s = 0.0

        def evaluate(self, sample: Sample, recent: object) -> None:
            raise ZeroDivisionError

    engine = AlertEngine([Broken(), UsageRule(0.8, 0.95)])
    got: list[Alert] = []

    def bad(alert: Alert) -> None:
        raise RuntimeError("callback bug")

    engine.on_alert(bad)
    engine.on_alert(got.append)
    run(engine, [gpu(int(16 * GiB * 0.9), 0)])
    assert [a.rule for a in got] == ["memory"]
    assert "alert rule broken failed" in caplog.text
    assert "callback" in caplog.text


def test_not_a_rule_is_refused() -> None:
    with pytest.raises(AlertRuleError, match="not an alert rule"):
        AlertEngine([object()])  # type: ignore[list-item]


def test_fragmentation_suggests_expandable_segments() -> None:
    rule = FragmentationRule(0.30, min_reserved=1 * GiB, for_s=0)
    ok = gpu(8 * GiB, 0, reserved=4 * GiB, inactive_split=1 * GiB)
    frag = gpu(8 * GiB, 1, reserved=4 * GiB, inactive_split=int(1.6 * GiB))
    small = gpu(1 * GiB, 2, reserved=512 * MiB, inactive_split=400 * MiB)
    assert rule.evaluate(ok, [ok]) is None
    assert rule.evaluate(small, [small]) is None  # too little reserved to matter
    found = rule.evaluate(frag, [frag])
    assert found is not None and found.level is Level.WARNING
    assert found.value == pytest.approx(0.4)
    assert "expandable_segments:True" in found.suggestion


def test_retries_rising_alert_and_then_quiet() -> None:
    engine = AlertEngine([RetriesRule(window_s=10)])
    counts = [0, 0, 3, 3, 3]
    times = [0, 1, 2, 20, 21]
    fired = run(engine, [gpu(GiB, t, alloc_retries=c) for t, c in zip(times, counts, strict=True)])
    assert [(a.level.name, a.resolved) for a in fired] == [("WARNING", False), ("INFO", True)]
    assert "3 allocator retries" in fired[0].message


def test_oom_risk_extrapolates_the_trend() -> None:
    rule = OomRiskRule(horizon_s=60, window_s=30, min_samples=5)
    # 100 MiB/s towards 16 GiB from 10 GiB: full in about 61 s from t=0, so ~51 s at t=10.
    rising = [gpu(10 * GiB + 100 * MiB * t, t) for t in range(11)]
    found = rule.evaluate(rising[-1], rising)
    assert found is not None and found.level is Level.ERROR
    assert found.value == pytest.approx((6 * GiB - 1000 * MiB) / (100 * MiB), rel=0.01)
    assert "full in 51 s" in found.message
    near = [gpu(15 * GiB + 100 * MiB * t, t) for t in range(6)]
    found = rule.evaluate(near[-1], near)
    assert found is not None and found.level is Level.CRITICAL
    flat = [gpu(15 * GiB, t) for t in range(11)]
    assert rule.evaluate(flat[-1], flat) is None
    slow = [gpu(10 * GiB + MiB * t, t) for t in range(11)]
    assert rule.evaluate(slow[-1], slow) is None
    assert rule.evaluate(rising[2], rising[:3]) is None  # too few samples


def test_oom_risk_fires_on_real_growing_memory() -> None:
    sim = vramctl.simulate("2GiB")
    got: list[Alert] = []
    mon = Monitor([sim], interval=1.0, rules=[OomRiskRule(horizon_s=30, window_s=30)])
    mon.on_alert(got.append, level="error")
    held = []
    with sim:
        for _ in range(8):
            held.append(torch.empty(64 * MiB, dtype=torch.uint8))
            mon.sample()
            time.sleep(0.02)
    del held
    # 64 MiB every ~20 ms towards 2 GiB: full in well under the 30 s horizon.
    assert got, "memory growing this fast should be an OOM risk"
    assert got[0].rule == "oom_risk"
    assert got[0].value is not None and got[0].value < 30


def test_cleanup_runs_gc_and_returns_bytes() -> None:
    assert cleanup() == 0  # no CUDA here: nothing cached to hand back


def test_a_warning_that_held_fires_though_memory_rose_to_critical_meanwhile() -> None:
    # Over 80% from t=0, over 95% from t=3: the warning has held its 5 s at t=5 and fires
    # then; the critical fires once it has held 5 s of its own, at t=8.
    engine = AlertEngine([UsageRule(0.8, 0.95, for_s=5.0)])
    useds = {0: 0.85, 1: 0.85, 2: 0.85, 3: 0.97, 4: 0.97, 5: 0.97, 6: 0.97, 7: 0.97, 8: 0.97}
    fired = run(engine, [gpu(int(16 * GiB * u), t) for t, u in useds.items()])
    assert [(a.level.name, a.timestamp) for a in fired] == [("WARNING", 5), ("CRITICAL", 8)]
    assert "critical for less than 5 s" in fired[0].message
    assert fired[1].threshold == 0.95
    # Memory that stays under the critical level meanwhile fires the warning alone.
    engine = AlertEngine([UsageRule(0.8, 0.95, for_s=5.0)])
    fired = run(engine, [gpu(int(16 * GiB * 0.85), t) for t in range(9)])
    assert [(a.level.name, a.timestamp) for a in fired] == [("WARNING", 5)]
