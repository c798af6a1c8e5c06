"""Memory pressure: shrinking tiers by hand, on monitor alerts, and when a guarded step runs out."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import vramctl
from tests.cache.values import KiB, MiB, check_budgets, digest
from tests.guard.models import loss_fn
from tests.guard.models import make as make_model
from vramctl.cache import CacheError, TensorCache
from vramctl.guard import Guard, _guard, relieve
from vramctl.monitor import Alert, Level, Monitor, UsageRule
from vramctl.monitor._prometheus import metrics_text

NewCache = Callable[..., TensorCache]


def fill_device_tier(cache: TensorCache, n: int, nbytes: int) -> dict[int, str]:
    """``n`` values of ``nbytes`` made on the (simulated) device and put there."""
    want = {}
    for i in range(n):
        value = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(i))
        cache.put(i, value)
        assert cache.tier_of(i) == "gpu"
        want[i] = digest(value)
    return want


def test_shrink_moves_values_down_and_holds_the_lower_limit(
    new_cache: NewCache, tmp_path: Path
) -> None:
    with vramctl.simulate("64MiB") as gpu:
        cache = new_cache(gpu=64 * KiB, host=128 * KiB, disk_dir=tmp_path, disk="8MiB")
        want = fill_device_tier(cache, 16, 4 * KiB)
        assert cache.used["gpu"] == 64 * KiB
        moved = cache.shrink("gpu", 0.5)
        assert moved >= 32 * KiB and cache.limit["gpu"] == 32 * KiB
        assert cache.stats()["under_pressure"] == ["gpu"]
        check_budgets(cache, gpu=gpu, disk_dir=tmp_path, limits=True)
        # While shrunk: new values and promotions keep to the lower limit.
        for i in range(16):
            assert digest(cache.get(i)) == want[i]
            check_budgets(cache, gpu=gpu, disk_dir=tmp_path, limits=True)
        for i in range(16, 24):
            value = torch.full((2048,), float(i))  # 8 KiB, made on the device
            cache.put(i, value)
            want[i] = digest(value)
            del value
            check_budgets(cache, gpu=gpu, disk_dir=tmp_path, limits=True)
        assert gpu.allocated_bytes <= 32 * KiB
        cache.restore("gpu")
        assert cache.limit == cache.budget and cache.stats()["under_pressure"] == []
        cache.prefetch(range(24)).result()
        assert cache.used["gpu"] == 64 * KiB  # the whole budget again
        # The host tier shrinks the same way; nothing is lost.
        cache.shrink("host", 0.25)
        assert cache.used["host"] <= 32 * KiB
        check_budgets(cache, gpu=gpu, disk_dir=tmp_path, limits=True)
        assert set(cache.keys()) == set(want)
        for i, d in want.items():
            assert digest(cache.get(i, promote=False)) == d
        with pytest.raises(CacheError, match="factor"):
            cache.shrink("gpu", 1.0)
        cache.shrink("gpu", 0.0)
        assert cache.used["gpu"] == 0 and gpu.allocated_bytes == 0


def test_on_alert_shrinks_on_a_warning_and_restores_when_it_resolves(
    new_cache: NewCache,
) -> None:
    with vramctl.simulate("64MiB") as gpu:
        cache = new_cache(gpu=64 * KiB, host="1MiB")
        fill_device_tier(cache, 16, 4 * KiB)

        def alert(device: str, level: Level = Level.WARNING, resolved: bool = False) -> Alert:
            return Alert("memory", level, device, "memory use is high", 0.9, 0.8, "", resolved)

        cache.on_alert(alert("cuda:7"))  # another device: nothing to do
        cache.on_alert(alert("sim:other"))
        assert cache.limit == cache.budget
        cache.on_alert(alert(gpu.id))
        assert cache.limit["gpu"] == 32 * KiB and cache.used["gpu"] <= 32 * KiB
        assert gpu.allocated_bytes <= 32 * KiB
        cache.on_alert(alert(gpu.id, Level.CRITICAL))  # already shrunk: no further
        assert cache.limit["gpu"] == 32 * KiB
        cache.on_alert(alert(gpu.id, Level.INFO, resolved=True))
        assert cache.limit == cache.budget
        # Host memory alerts ("cpu") shrink the host tier.
        cache.evict(tier="gpu")
        host_before = cache.used["host"]
        cache.on_alert(alert("cpu"), factor=0.25)
        assert cache.limit["host"] == cache.budget["host"] // 4
        assert cache.used["host"] <= min(host_before, cache.limit["host"])
        cache.on_alert(alert("cpu", Level.INFO, resolved=True))
        assert cache.limit == cache.budget


def test_an_attached_monitor_shrinks_the_device_tier_and_reports_the_cache(
    new_cache: NewCache,
) -> None:
    with vramctl.simulate("8MiB") as gpu:
        cache = new_cache(gpu="4MiB", host="16MiB")
        monitor = Monitor([gpu], interval=1.0, rules=[UsageRule(0.5, 0.9)])
        cache.attach(monitor)
        want = fill_device_tier(cache, 12, 256 * KiB)  # 3 MiB: 37.5% of the device
        for i in range(12):
            cache.get(i)
        monitor.sample()
        assert cache.limit == cache.budget
        hog = torch.empty(2 * MiB, dtype=torch.uint8)  # 62.5%: a warning
        monitor.sample()
        assert cache.limit["gpu"] == 2 * MiB and cache.used["gpu"] <= 2 * MiB
        assert gpu.allocated_bytes - hog.nbytes <= 2 * MiB
        assert [(a["rule"], a["level"]) for a in monitor.summary()["active_alerts"]] == [
            ("memory", "warning")
        ]
        del hog
        monitor.sample()  # 25%: resolved
        assert cache.limit == cache.budget
        assert monitor.summary()["active_alerts"] == []
        for i, d in want.items():
            assert digest(cache.get(i)) == d
        stats = cache.stats()
        summary = monitor.summary()
        text = metrics_text(monitor)
    reported = json.loads(json.dumps(summary))["sources"]["cache"]  # JSON-ready
    assert reported["gets"] == stats["gets"] == 24
    assert reported["tiers"]["gpu"]["hits"] == stats["tiers"]["gpu"]["hits"] > 0
    assert reported["tiers"]["gpu"]["evictions"] > 0
    assert 'vramctl_cache_hits_total{tier="gpu"}' in text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
    for tier in ("gpu", "host", "disk"):
        lab = (("tier", tier),)
        assert samples[("vramctl_cache_hits_total", lab)] == stats["tiers"][tier]["hits"]
        assert samples[("vramctl_cache_used_bytes", lab)] == stats["tiers"][tier]["used_bytes"]
        assert samples[("vramctl_cache_budget_bytes", lab)] == stats["tiers"][tier]["budget_bytes"]
    assert samples[("vramctl_cache_gets_total", ())] == 24
    assert samples[("vramctl_cache_budget_violations_total", ())] == 0


# -- the guard's first answer to an out-of-memory error -----------------------------------


def _step_need(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> int:
    """Bytes a forward and backward on ``batch`` takes over the model."""
    with vramctl.simulate("1GiB") as gpu:
        gpu.adopt(model)
        base = gpu.allocated_bytes
        gpu.reset_peak()
        loss_fn()(model(batch[0]), batch).backward()
        return gpu.peak_bytes - base


def _pressured_step(new_cache: NewCache, relieve_oom: bool) -> tuple[object, ...]:
    model, batch = make_model("mlp", 256)
    twin = copy.deepcopy(model)
    need = _step_need(copy.deepcopy(model), batch)
    fill = 32 * 16 * KiB  # the cache's device tier: 32 values of 16 KiB
    with vramctl.simulate("1GiB") as probe:
        probe.adopt(copy.deepcopy(model))
        params = probe.allocated_bytes
    # Room for the model and the cache's values, and half of what the step needs.
    with vramctl.simulate(params + fill + need // 2) as gpu:
        gpu.adopt(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        cache = new_cache(gpu=fill, host="4MiB", relieve_oom=relieve_oom)
        want = fill_device_tier(cache, 32, 16 * KiB)
        before = cache.used["gpu"]
        guard = Guard(model, opt, forward=lambda m, b: m(b[0]), loss_fn=loss_fn(), device=gpu)
        result = guard.step(batch)
        after = cache.used["gpu"]
        for i, d in want.items():
            assert digest(cache.get(i, promote=False)) == d
    # The same step with room to spare.
    opt2 = torch.optim.SGD(twin.parameters(), lr=0.1)
    loss_fn()(twin(batch[0]), batch).backward()
    opt2.step()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        if relieve_oom:  # the step ran whole, as the unpressured one: the same numbers
            assert torch.equal(p, q)
        else:  # in pieces: the same up to rounding
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    return result, list(guard.events), before, after, cache


def test_the_guard_asks_the_cache_for_room_before_splitting_the_batch(
    new_cache: NewCache,
) -> None:
    result, events, before, after, cache = _pressured_step(new_cache, relieve_oom=True)
    kinds = [e.kind for e in events]  # type: ignore[attr-defined]
    assert result.ooms >= 1 and result.pieces == 1  # type: ignore[attr-defined]
    assert kinds[:2] == ["oom", "relieve"] and "relieve" in kinds
    assert set(kinds) <= {"oom", "relieve"}  # no split, no offload
    assert after < before  # type: ignore[operator]
    # Closing the cache takes it off the guard's list.
    fn = cache._reliever  # type: ignore[attr-defined]
    assert fn in _guard._relievers
    cache.close()  # type: ignore[attr-defined]
    assert fn not in _guard._relievers


def test_without_relieve_oom_the_guard_splits_the_batch(new_cache: NewCache) -> None:
    n_before = len(_guard._relievers)
    result, events, before, after, _ = _pressured_step(new_cache, relieve_oom=False)
    assert len(_guard._relievers) == n_before
    assert result.pieces >= 2  # type: ignore[attr-defined]
    assert "relieve" not in [e.kind for e in events]  # type: ignore[attr-defined]
    assert after == before


def test_a_reliever_answers_for_its_own_device_only(new_cache: NewCache) -> None:
    with vramctl.simulate("64MiB") as gpu:
        cache = new_cache(gpu=64 * KiB, host="1MiB")
        fill_device_tier(cache, 8, 8 * KiB)
        assert relieve(vramctl.get_device("cpu"), 1) == 0
        assert relieve(vramctl.device.resolve("sim:32MiB"), 1) == 0
        assert cache.used["gpu"] == 64 * KiB
        freed = relieve(gpu, 10 * KiB)
        assert freed >= 10 * KiB and cache.used["gpu"] == 64 * KiB - freed
        assert gpu.allocated_bytes == cache.used["gpu"]
        assert relieve(gpu, 0) == cache.budget["gpu"] - freed  # 0: as much as it can
        assert cache.used["gpu"] == 0
        cache.close()
        cache.put("x", torch.ones(10))
        assert relieve(gpu, 0) == 0 and cache.tier_of("x") == "gpu"
