"""TensorCache on a simulated GPU: placement, hard budgets, nothing lost or corrupted, threads."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils import _pytree as pytree

import vramctl
from tests.cache.values import (
    KINDS,
    KiB,
    MiB,
    check_budgets,
    digest,
    disk_bytes,
    held_on,
    make,
    tensor_bytes,
)
from vramctl.cache import POLICIES, TIERS, CacheError, TensorCache, ValueTooLargeError
from vramctl.cache._pool import ALIGN

NewCache = Callable[..., TensorCache]


def to_device(value: Any) -> Any:
    """A copy of ``value`` made inside the active simulated GPU (so counted there)."""
    return pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, value)


# -- placement ------------------------------------------------------------------------


def test_device_values_go_to_the_device_tier_and_host_values_to_the_host_tier(
    new_cache: NewCache,
) -> None:
    with vramctl.simulate("64MiB") as gpu:
        cache = new_cache(gpu="1MiB", host="4MiB")
        assert cache.device is gpu
        on_gpu = torch.randn(1000)
        with gpu.uncounted():
            on_host = torch.randn(1000)
        cache.put("d", on_gpu)
        cache.put("h", on_host)
        assert cache.tier_of("d") == "gpu" and cache.tier_of("h") == "host"
        assert cache.used == {"gpu": 4000, "host": 4096, "disk": 0}
        # A device-tier value is shared, not copied.
        assert cache.get("d").data_ptr() == on_gpu.data_ptr()
        # A host hit is served by a copy on the device; the second (promote_after=2) moves
        # the value up into the device tier.
        got = cache.get("h")
        assert gpu.owns(got) and torch.equal(got, on_host) and cache.tier_of("h") == "host"
        got = cache.get("h")
        assert gpu.owns(got) and torch.equal(got, on_host)
        assert cache.tier_of("h") == "gpu" and cache.used["host"] == 0
        # promote=False: a copy on the device, the value stays where it is.
        cache.evict(tier="gpu")
        assert cache.tier_of("h") == "host" and cache.tier_of("d") == "host"
        for _ in range(3):
            got = cache.get("h", promote=False)
            assert gpu.owns(got) and torch.equal(got, on_host) and cache.tier_of("h") == "host"
        assert cache.stats()["bypass"] == 4
        del got
        check_budgets(cache, gpu=gpu, held=on_gpu.nbytes)


@pytest.mark.parametrize("promote_after", [1, 3])
def test_promote_after_counts_hits_below_the_device_tier(
    promote_after: int, new_cache: NewCache, tmp_path: Path
) -> None:
    with vramctl.simulate("64MiB") as gpu:
        cache = new_cache(
            gpu="1MiB", host="1MiB", disk_dir=tmp_path, disk="8MiB", promote_after=promote_after
        )
        with gpu.uncounted():
            x = torch.randn(256)
        for tier in ("host", "disk"):
            cache.put(tier, x, tier=tier)
            for _ in range(promote_after):
                assert cache.tier_of(tier) == tier
                assert torch.equal(cache.get(tier), x)
            assert cache.tier_of(tier) == "gpu", tier
        # Hits count from the value's arrival in its tier: moved down, it starts again.
        cache.evict(tier="gpu")
        assert cache.tier_of("host") == "host"
        for _ in range(promote_after - 1):
            cache.get("host")
        assert cache.tier_of("host") == "host"
        cache.get("host")
        assert cache.tier_of("host") == "gpu"
        # prefetch moves values up whatever their hits.
        cache.evict(tier="gpu")
        assert cache.prefetch(["host", "disk", "absent"]).result() == 2
        assert cache.tier_of("host") == cache.tier_of("disk") == "gpu"
    with pytest.raises(CacheError, match="promote_after"):
        TensorCache(host="1MiB", promote_after=0)


def test_a_value_larger_than_a_tier_skips_it(new_cache: NewCache, tmp_path: Path) -> None:
    with vramctl.simulate("64MiB") as gpu:
        cache = new_cache(gpu="64KiB", host="256KiB", disk_dir=tmp_path, disk="1MiB")
        big_on_gpu = torch.randn(32 * KiB)  # 128 KiB: larger than the device tier
        cache.put("a", big_on_gpu)
        assert cache.tier_of("a") == "host"
        with gpu.uncounted():
            larger = torch.randn(100 * KiB)  # 400 KiB: larger than the device and host tiers
            huge = torch.randn(512 * KiB)  # 2 MiB: larger than every tier
        cache.put("b", larger)
        assert cache.tier_of("b") == "disk"
        with pytest.raises(ValueTooLargeError, match="larger than every tier"):
            cache.put("c", huge)
        assert "c" not in cache and cache.tier_of("a") == "host"
        assert issubclass(ValueTooLargeError, CacheError)
        cache.put("d", torch.ones(10), tier="disk")  # a tier asked for
        assert cache.tier_of("d") == "disk"
        with pytest.raises(CacheError, match="tier="):
            cache.put("e", torch.ones(10), tier="ram")
        assert torch.equal(cache.get("b"), larger)
        check_budgets(cache, gpu=gpu, held=big_on_gpu.nbytes)


def test_the_coldest_value_moves_down_first(new_cache: NewCache) -> None:
    with vramctl.simulate("64MiB") as gpu:
        cache = new_cache(gpu=12 * KiB, host="1MiB")
        for k in "abc":
            cache.put(k, torch.full((1024,), float(ord(k))))  # 4 KiB each, on the device
        cache.get("a")
        cache.put("d", torch.zeros(1024))
        assert [cache.tier_of(k) for k in "abcd"] == ["gpu", "host", "gpu", "gpu"]
        assert cache.stats()["tiers"]["gpu"]["evictions"] == 1
        check_budgets(cache, gpu=gpu)


def test_lfu_keeps_the_most_used_value_on_the_device(new_cache: NewCache) -> None:
    with vramctl.simulate("64MiB"):
        cache = new_cache(gpu=8 * KiB, host="1MiB", policy="lfu")
        cache.put("a", torch.ones(1024))
        cache.put("b", torch.ones(1024))
        for _ in range(3):
            cache.get("a")
        cache.get("b")
        cache.put("c", torch.ones(1024))  # b (2 uses) goes, not a (4 uses)
        assert [cache.tier_of(k) for k in "abc"] == ["gpu", "host", "gpu"]


def test_mapping_interface(new_cache: NewCache) -> None:
    cache = new_cache(host="1MiB")
    cache["x"] = torch.arange(5)
    cache[("t", 2)] = {"v": torch.ones(2), "n": 3}
    assert len(cache) == 2 and set(cache) == {"x", ("t", 2)} and "x" in cache
    assert torch.equal(cache["x"], torch.arange(5)) and cache[("t", 2)]["n"] == 3
    del cache["x"]
    with pytest.raises(KeyError):
        cache.get("x")
    with pytest.raises(KeyError):
        del cache["x"]
    assert cache.get("x", "absent") == "absent"
    assert not cache.discard("x") and cache.discard(("t", 2))
    assert len(cache) == 0 and cache.used["host"] == 0
    stats = cache.stats()
    assert stats["misses"] == 2 and stats["gets"] == 4 and stats["puts"] == 2
    with pytest.raises(CacheError, match="every tier"):
        TensorCache()
    with pytest.raises(CacheError, match="disk_dir"):
        TensorCache(host="1MiB", disk="1MiB")
    with pytest.raises(CacheError, match="gpu="):
        TensorCache(gpu="lots")


def test_a_value_of_several_parts_fits_a_host_tier_larger_than_it(new_cache: NewCache) -> None:
    # Two 40 KiB tensors in an empty 100 KiB host tier (taken in 64 KiB segments): the
    # value is smaller than the tier, so it must not skip it.
    cache = new_cache(host=100 * KiB, segment=64 * KiB)
    pair = (torch.ones(10 * KiB), torch.zeros(10 * KiB))
    cache.put("pair", pair)
    assert cache.tier_of("pair") == "host"
    assert digest(cache.get("pair")) == digest(pair)
    check_budgets(cache)


def test_a_refused_put_keeps_the_value_already_under_its_key(new_cache: NewCache) -> None:
    cache = new_cache(host="64KiB")
    cache.put("k", torch.arange(10))
    with pytest.raises(ValueTooLargeError):
        cache.put("k", torch.ones(64 * KiB))  # 256 KiB: larger than every tier
    assert "k" in cache, "the refused put dropped the value already cached"
    assert torch.equal(cache.get("k"), torch.arange(10))


# -- pinning --------------------------------------------------------------------------


def test_a_pinned_value_stays_on_the_device_until_unpinned(new_cache: NewCache) -> None:
    with vramctl.simulate("64MiB") as gpu:
        cache = new_cache(gpu=16 * KiB, host="1MiB")
        with gpu.uncounted():
            w = torch.randn(2048)  # 8 KiB
        cache.put("w", w, pin=True)
        assert cache.tier_of("w") == "gpu"
        for i in range(6):
            cache.put(i, torch.randn(1024))  # 4 KiB each: the rest of the tier churns
        assert cache.evict(tier="gpu") > 0
        assert cache.tier_of("w") == "gpu" and cache.used["gpu"] == w.nbytes
        with pytest.raises(CacheError, match="pin=True"):
            cache.put("too_big", torch.randn(8 * KiB), pin=True)  # 32 KiB
        cache.unpin("w")
        cache.evict(tier="gpu")
        assert cache.tier_of("w") == "host"
        cache.pin("w")  # moved back up
        assert cache.tier_of("w") == "gpu" and torch.equal(cache.get("w"), w)
        with pytest.raises(KeyError):
            cache.pin("nothing")
        check_budgets(cache, gpu=gpu)


def test_put_pin_refuses_when_pinned_values_fill_the_device_tier(new_cache: NewCache) -> None:
    # pin=True promises the device: a value that cannot get there is refused, as pin() does,
    # not kept pinned in another tier.
    with vramctl.simulate("64MiB") as gpu:
        cache = new_cache(gpu="1MiB", host="4MiB")
        with gpu.uncounted():
            a, b = torch.ones(150 * KiB), torch.ones(150 * KiB)  # 600 KiB each
        cache.put("a", a, pin=True)
        with pytest.raises(CacheError):
            cache.put("b", b, pin=True)
            assert cache.tier_of("b") == "gpu", f"pinned, but in the {cache.tier_of('b')} tier"
        assert cache.tier_of("a") == "gpu"


def test_a_shrunk_tier_holds_its_limit_for_empty_values_too(
    new_cache: NewCache, tmp_path: Path
) -> None:
    # An empty tensor (or any value with a 0-byte part) still takes a 512-byte block of the
    # host pool: a tier shrunk to nothing must not take it.
    cache = new_cache(host="1MiB", disk_dir=tmp_path, disk="1MiB")
    cache.shrink("host", 0.0)
    cache.put("e", torch.empty(0, 3))
    assert cache.used["host"] <= cache.limit["host"] == 0, cache.tier_of("e")
    assert cache.get("e").shape == (0, 3)


# -- hard budgets -----------------------------------------------------------------------


def _workload(
    cache: TensorCache,
    gpu: Any,
    rng: random.Random,
    steps: int,
    sizes: list[int],
    disk_dir: Path | None,
    *,
    may_drop: bool,
) -> dict[str, int]:
    """Random puts, gets, prefetches, evictions, discards, shrinks, pins; after every one,
    every budget (and limit) holds, every value got is the one put, and pinned values are
    on the device."""
    keys = list(range(len(sizes)))
    want: dict[int, str] = {}
    pinned: set[int] = set()
    empty: set[int] = set()  # keys of values with no bytes at all
    trail: list[tuple[Any, ...]] = []  # the operations so far, for the messages
    names = ("put", "get", "hit", "prefetch", "evict", "discard", "shrink", "pin")
    counts = dict.fromkeys(names, 0)
    for step in range(steps):
        key = rng.choice(keys)
        op = rng.random()
        if op < 0.28 or key not in want:
            counts["put"] += 1
            value = make(rng.choice(KINDS), rng.randrange(10**6), sizes[key])
            tier = rng.choice([None, None, None, "gpu", "host", "disk"])
            pinned.discard(key)
            want.pop(key, None)
            placed = to_device(value) if rng.random() < 0.3 else value
            trail.append(("put", key, tier, "device" if placed is not value else "host"))
            try:
                cache.put(key, placed, tier=tier)
            except ValueTooLargeError:
                # Only while tiers are shrunk: larger than what each may hold now.
                n = tensor_bytes(value)
                assert cache.limit != cache.budget
                assert n > cache.limit["gpu"] and n > cache.limit["host"], step
                assert n + 64 * KiB > cache.limit["disk"], step
            else:
                want[key] = digest(value)
            finally:
                del placed
            (empty.add if tensor_bytes(value) == 0 else empty.discard)(key)
            del value  # (the simulated GPU counts a host sparse tensor's parts it has seen)
        elif op < 0.6:
            counts["get"] += 1
            trail.append(("get", key, cache.tier_of(key)))
            got = cache.get(key, None, promote=rng.random() < 0.8)
            if got is not None:
                counts["hit"] += 1
                assert digest(got) == want[key], (
                    f"step {step}: {key} came back changed, after {trail[-5:]}"
                )
            del got
        elif op < 0.67:
            counts["prefetch"] += 1
            trail.append(("prefetch", batch := rng.sample(keys, 4)))
            cache.prefetch(batch).result()
        elif op < 0.74:
            counts["evict"] += 1
            # (the disk tier's values are dropped: only where that is allowed)
            tier = rng.choice(TIERS if may_drop else ("gpu", "host"))
            nbytes = rng.choice([None, 1, 20 * KiB, 100 * KiB])
            trail.append(("evict", nbytes, tier))
            cache.evict(nbytes, tier=tier)
        elif op < 0.8:
            counts["discard"] += 1
            trail.append(("discard", key))
            present = key in cache
            assert present == (key in want)
            assert cache.discard(key) == present and key not in cache
            want.pop(key, None)
            pinned.discard(key)
        elif op < 0.86:
            counts["shrink"] += 1
            tier = rng.choice(TIERS if may_drop else ("gpu", "host"))
            if rng.random() < 0.5:
                trail.append(("shrink", tier, factor := rng.choice([0.0, 0.3, 0.6])))
                cache.shrink(tier, factor)
            else:
                trail.append(("restore", tier))
                cache.restore(tier)
        elif op < 0.93 and len(pinned) < 2 and sizes[key] <= 8 * KiB:
            counts["pin"] += 1
            trail.append(("pin", key))
            try:
                cache.pin(key)
            except CacheError:
                assert cache.tier_of(key) != "gpu"
            else:
                pinned.add(key)
        elif pinned:
            k = pinned.pop()
            trail.append(("unpin", k))
            cache.unpin(k)
        # After every operation: within budget, by count and in fact; within the limits
        # too (the device tier's pinned values excepted).
        where = f"step {step}, after {trail[-3:]}"
        try:
            check_budgets(cache, gpu=gpu, disk_dir=disk_dir)
        except AssertionError as exc:
            raise AssertionError(f"{where}: {exc}") from None
        for t in ("gpu", "disk") if not pinned else ("disk",):
            assert cache.used[t] <= cache.limit[t], (where, t)
        # (an empty value takes a 512-byte block: see test_a_shrunk_tier_holds_its_limit...)
        slack = ALIGN * sum(1 for k in empty if cache.tier_of(k) == "host")
        assert cache.used["host"] <= cache.limit["host"] + slack, where
        for k in pinned:
            assert cache.tier_of(k) == "gpu", f"{where}: pinned {k} left the device"
        lost = [k for k in want if k not in cache]
        if lost:
            assert may_drop, f"{where}: {lost} lost"
            for k in lost:
                del want[k]
        assert set(cache.keys()) == set(want)
    # Every value still held comes back intact, from whichever tier (moving nothing).
    for t in TIERS:
        cache.restore(t)
    for k, d in want.items():
        assert digest(cache.get(k, promote=False)) == d
    check_budgets(cache, gpu=gpu, disk_dir=disk_dir)
    return counts


@pytest.mark.parametrize(
    ("policy", "compress", "seed"), [("lru", "auto", 11), ("lfu", True, 12), ("slru", False, 13)]
)
def test_budgets_hold_after_every_operation(
    policy: str, compress: bool | str, seed: int, new_cache: NewCache, tmp_path: Path
) -> None:
    rng = random.Random(seed)
    budgets = {"gpu": 128 * KiB, "host": 256 * KiB, "disk": 512 * KiB}
    # 60 values, 3 of them larger than the device tier; together 3x the largest tier.
    sizes = [rng.choice([1 * KiB, 4 * KiB, 8 * KiB, 24 * KiB, 60 * KiB]) for _ in range(57)]
    sizes += [150 * KiB, 200 * KiB, 300 * KiB]
    assert sum(sizes) > 3 * budgets["disk"]
    with vramctl.simulate("64MiB") as gpu:
        cache = new_cache(**budgets, disk_dir=tmp_path, policy=policy, compress=compress)
        counts = _workload(cache, gpu, rng, 500, sizes, tmp_path, may_drop=True)
        stats = cache.stats()
    assert min(counts.values()) > 0 and counts["hit"] > 20
    assert stats["budget_violations"] == 0
    assert stats["dropped"] > 0  # the tiers did run full
    for t in TIERS:
        assert 0 < stats["tiers"][t]["peak_bytes"] <= budgets[t]
        assert stats["tiers"][t]["evictions"] > 0


def test_nothing_is_lost_when_the_disk_holds_everything(
    new_cache: NewCache, tmp_path: Path
) -> None:
    rng = random.Random(21)
    sizes = [rng.choice([2 * KiB, 16 * KiB, 48 * KiB, 100 * KiB]) for _ in range(30)]
    with vramctl.simulate("64MiB") as gpu:
        cache = new_cache(gpu=96 * KiB, host=192 * KiB, disk_dir=tmp_path, disk="32MiB")
        counts = _workload(cache, gpu, rng, 400, sizes, tmp_path, may_drop=False)
        assert cache.stats()["dropped"] == 0
    assert counts["hit"] == counts["get"]


# -- every kind of value, exact ---------------------------------------------------------


def test_every_kind_of_value_comes_back_exact_from_every_tier(
    new_cache: NewCache, tmp_path: Path
) -> None:
    values = {(k, i): make(k, seed=100 + i, nbytes=24 * KiB) for k in KINDS for i in (0, 1)}
    values[("nothing", 0)] = {"n": 3, "s": "text", "t": (1, 2.5, None)}  # no tensor at all
    want = {k: digest(v) for k, v in values.items()}
    with vramctl.simulate("64MiB") as gpu:
        cache = new_cache(gpu=64 * KiB, host="1MiB", disk_dir=tmp_path, disk="16MiB")
        for k, v in values.items():
            cache.put(k, to_device(v) if k[1] else v)
        assert tensor_bytes(values) > 4 * cache.budget["gpu"]
        rng = random.Random(3)
        order = list(values)

        def check(k: Any, tier: str, *, promote: bool = False) -> None:
            assert cache.tier_of(k) == tier, (k, tier)
            got = cache.get(k, promote=promote)
            assert digest(got) == want[k], (k, tier)
            assert type(got) is type(values[k])
            del got
            check_budgets(cache, gpu=gpu, held=held_on(gpu, values), disk_dir=tmp_path)

        for k in rng.sample(order, len(order)):  # each up to the device tier in turn
            cache.prefetch([k]).result()
            check(k, "gpu")
        cache.evict(tier="gpu")  # all to host memory (device to host)
        for k in rng.sample(order, len(order)):
            check(k, "host")
        cache.evict(tier="host")  # all to disk
        for k in rng.sample(order, len(order)):
            check(k, "disk")
        for k in rng.sample(order, len(order)):  # and back up (disk to device)
            cache.prefetch([k]).result()
            check(k, "gpu")
        for _ in range(3):  # gets moving values wherever the cache sees fit
            for k in rng.sample(order, len(order)):
                check(k, cache.tier_of(k), promote=True)  # type: ignore[arg-type]
        check_budgets(cache, gpu=gpu, held=held_on(gpu, values), disk_dir=tmp_path)
        assert len(cache) == len(values) and cache.stats()["dropped"] == 0


def test_bf16_is_close_and_keeps_the_dtype_and_other_keys_are_exact(
    new_cache: NewCache, tmp_path: Path
) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g)  # float32
    nested = {"w": torch.randn(512, generator=g, dtype=torch.float64), "ids": torch.arange(100)}
    cache = new_cache(host="1MiB", disk_dir=tmp_path, disk="4MiB")
    cache.put("lossy", x, bf16=True)
    assert cache.used["host"] == x.nbytes // 2  # stored as bfloat16
    cache.put("exact", x)
    cache.put("nested", nested, bf16=True)
    for move in (False, True):
        if move:
            cache.evict(tier="host")
            assert {cache.tier_of(k) for k in ("lossy", "exact", "nested")} == {"disk"}
        lossy, exact, back = cache.get("lossy"), cache.get("exact"), cache.get("nested")
        assert lossy.dtype == torch.float32 and lossy.shape == x.shape
        torch.testing.assert_close(lossy, x, rtol=1e-2, atol=1e-2)
        assert not torch.equal(lossy, x)  # lossy: bfloat16 keeps 8 bits of mantissa
        assert torch.equal(exact, x)
        assert back["w"].dtype == torch.float64
        torch.testing.assert_close(back["w"], nested["w"], rtol=1e-2, atol=1e-2)
        assert torch.equal(back["ids"], nested["ids"])  # integers are never downcast


def test_integer_data_is_kept_compressed_and_random_floats_are_not(new_cache: NewCache) -> None:
    cache = new_cache(host="4MiB", compress=True)  # (True: in the host tier too)
    g = torch.Generator().manual_seed(1)
    ints = torch.randint(0, 4, (64 * KiB,), generator=g)  # 512 KiB of small int64 values
    floats = torch.randn(64 * KiB, generator=g)  # 256 KiB
    flags = torch.rand(64 * KiB, generator=g) < 0.1  # 64 KiB of bools
    cache.put("ints", ints)
    cache.put("floats", floats)
    cache.put("flags", flags)
    comp = cache.stats()["compression"]
    assert comp["enabled"] and comp["kept"] == 2 and comp["tries"] == 2  # floats not tried
    assert comp["raw_bytes"] == ints.nbytes + flags.nbytes
    assert comp["ratio"] < 0.5 and comp["compressed_bytes"] < comp["raw_bytes"] // 2
    assert floats.nbytes <= cache.used["host"] < floats.nbytes + comp["compressed_bytes"] + 4 * KiB
    noise = torch.randint(-(2**62), 2**62, (8 * KiB,), generator=g)  # incompressible int64
    cache.put("noise", noise)
    comp2 = cache.stats()["compression"]
    assert comp2["tries"] == 3 and comp2["kept"] == 2
    for k, v in {"ints": ints, "floats": floats, "flags": flags, "noise": noise}.items():
        assert torch.equal(cache.get(k), v)
    assert cache.stats()["compression"]["decompress_s"] > 0

    plain = new_cache(host="4MiB", compress=False)
    plain.put("ints", ints)
    assert plain.used["host"] == ints.nbytes and plain.stats()["compression"]["kept"] == 0


def test_auto_compression_compresses_the_disk_tier_only(
    new_cache: NewCache, tmp_path: Path
) -> None:
    g = torch.Generator().manual_seed(2)
    ints = torch.randint(0, 4, (64 * KiB,), generator=g)  # 512 KiB of small int64 values
    floats = torch.randn(16 * KiB, generator=g)
    cache = new_cache(host="4MiB", disk_dir=tmp_path, disk="16MiB")  # compress="auto"
    cache.put("ints", ints)
    cache.put("floats", floats)
    assert cache.used["host"] == ints.nbytes + floats.nbytes  # raw in host memory
    assert cache.stats()["compression"]["kept"] == 0
    cache.evict(tier="host")
    assert cache.tier_of("ints") == cache.tier_of("floats") == "disk"
    comp = cache.stats()["compression"]
    assert comp["kept"] == 1 and comp["raw_bytes"] == ints.nbytes and comp["ratio"] < 0.5
    assert disk_bytes(tmp_path) < ints.nbytes // 2 + floats.nbytes + 2 * 64 * KiB
    for k, v in {"ints": ints, "floats": floats}.items():
        for _ in range(3):  # from disk each time (there is no device tier)
            assert torch.equal(cache.get(k), v)


# -- threads ----------------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_threads_sharing_keys_get_every_value_intact(
    policy: str, new_cache: NewCache, tmp_path: Path
) -> None:
    n_keys, n_threads = 24, 4
    kinds = [KINDS[i % len(KINDS)] for i in range(n_keys)]
    sizes = [(4 * KiB, 16 * KiB, 40 * KiB)[i % 3] for i in range(n_keys)]
    want = {k: digest(make(kinds[k], k, sizes[k])) for k in range(n_keys)}
    errors: list[BaseException] = []
    over: list[tuple[str, int]] = []
    start = threading.Barrier(n_threads + 1)
    done = threading.Event()
    with vramctl.simulate("64MiB") as gpu:
        cache = new_cache(
            gpu=96 * KiB, host=192 * KiB, disk_dir=tmp_path, disk="8MiB", policy=policy
        )
        for k in range(n_keys):
            cache.put(k, make(kinds[k], k, sizes[k]))

        def work(seed: int) -> None:
            rng = random.Random(seed)
            start.wait()
            try:
                for _ in range(150):
                    k = rng.randrange(n_keys)
                    op = rng.random()
                    if op < 0.25:
                        cache.put(k, make(kinds[k], k, sizes[k]))
                    elif op < 0.8:
                        got = cache.get(k, promote=rng.random() < 0.7)
                        if digest(got) != want[k]:
                            errors.append(AssertionError(f"{k} came back changed"))
                        del got
                    elif op < 0.92:
                        cache.prefetch([rng.randrange(n_keys) for _ in range(3)]).result()
                    else:  # (not the disk tier: its values would be dropped)
                        cache.evict(rng.choice([None, 32 * KiB]), tier=rng.choice(["gpu", "host"]))
            except BaseException as exc:
                errors.append(exc)

        def watch() -> None:
            # Not even during a move does a tier hold more than its budget.
            start.wait()
            while not done.wait(0.0005):
                for t in TIERS:
                    if cache.used[t] > cache.budget[t]:
                        over.append((t, cache.used[t]))
                if cache.pool.held > cache.budget["host"]:
                    over.append(("pool", cache.pool.held))

        threads = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
        watcher = threading.Thread(target=watch)
        for th in [*threads, watcher]:
            th.start()
        for th in threads:
            th.join()
        done.set()
        watcher.join()
        assert not errors, errors[:3]
        assert not over, over[:3]
        check_budgets(cache, gpu=gpu, disk_dir=tmp_path)
        assert len(cache) == n_keys and cache.stats()["dropped"] == 0
        for k in range(n_keys):
            assert digest(cache.get(k)) == want[k]
        stats = cache.stats()
    assert stats["budget_violations"] == 0 and stats["gets"] > 300


# -- what the device tier really holds --------------------------------------------------


def test_a_view_of_a_larger_device_storage_is_charged_what_it_keeps_alive(
    new_cache: NewCache,
) -> None:
    # The device tier keeps a put device value's storage alive: a small view of a large
    # tensor must not let it hold more device memory than its budget.
    with vramctl.simulate("64MiB") as gpu:
        cache = new_cache(gpu="64KiB", host="4MiB")
        big = torch.ones(MiB // 4)  # 1 MiB
        cache.put("small", big[:10])
        del big
        assert torch.equal(cache.get("small"), torch.ones(10))
        check_budgets(cache, gpu=gpu)


# -- a real GPU -----------------------------------------------------------------------------


def _cuda_allocated() -> int:
    """This process's CUDA allocations, once the copies ended and their blocks came back."""
    torch.cuda.synchronize()
    torch.empty(1, device="cuda")  # the allocator frees blocks other streams used, here
    return torch.cuda.memory_allocated()


@pytest.mark.cuda
def test_on_a_real_gpu_pinned_memory_prefetch_and_round_trips(
    new_cache: NewCache, tmp_path: Path
) -> None:
    base = _cuda_allocated()
    budgets = {"gpu": 8 * MiB, "host": 16 * MiB, "disk": 256 * MiB}
    cache = new_cache(**budgets, disk_dir=tmp_path)
    assert cache.device.is_cuda and cache.pool.pinned
    assert cache.stats()["tiers"]["host"]["pinned"]
    values = {i: make(KINDS[i % len(KINDS)], i, 512 * KiB) for i in range(48)}
    want = {k: digest(v) for k, v in values.items()}

    def check() -> None:
        check_budgets(cache, disk_dir=tmp_path)
        assert _cuda_allocated() - base <= budgets["gpu"]

    for k, v in values.items():  # host values: the (pinned) host tier, then disk
        cache.put(k, v)
        check()
    assert {cache.tier_of(k) for k in values} == {"host", "disk"}
    assert cache.prefetch(list(range(40, 48))).result() > 0  # host to device, a side stream
    for k in range(40, 48):
        got = cache.get(k)
        assert all(t.is_cuda for t in pytree.tree_leaves(got) if isinstance(t, torch.Tensor))
        assert digest(got) == want[k]
        del got
        check()
    # Device values: device tier, then down (device to host) and back up (host to device).
    on_gpu = {
        k: pytree.tree_map(lambda x: x.cuda() if isinstance(x, torch.Tensor) else x, values[k])
        for k in range(8)
    }
    for k, v in on_gpu.items():
        cache.put(("gpu", k), v)
        assert cache.tier_of(("gpu", k)) == "gpu"
    del on_gpu, v
    check()
    cache.evict(tier="gpu")
    assert all(cache.tier_of(("gpu", k)) in ("host", "disk") for k in range(8))
    check()
    for k in range(8):
        assert digest(cache.get(("gpu", k))) == want[k]  # host to device
        check()
    for k in range(48):  # from every tier, with others moving down meanwhile
        assert digest(cache.get(k)) == want[k]
        check()
    assert cache.stats()["budget_violations"] == 0
    cache.clear()
    assert _cuda_allocated() == base
