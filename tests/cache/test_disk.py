"""The disk tier: found again by a new cache, damage detected, killed writers leave no torn item."""

from __future__ import annotations

import contextlib
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import vramctl
from tests.cache.values import KiB, check_budgets, digest, disk_bytes, make
from vramctl.cache import CorruptItemError, TensorCache

NewCache = Callable[..., TensorCache]


def items(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


def temp_files(directory: Path) -> list[Path]:
    return sorted(directory.glob(".tmp-*"))


def flip_data_bytes(path: Path, at: int = 0, count: int = 4) -> None:
    """Invert ``count`` bytes of a safetensors file's data (after its JSON header)."""
    raw = bytearray(path.read_bytes())
    (header,) = struct.unpack("<Q", raw[:8])
    start = 8 + header + at
    assert start + count <= len(raw), "the file has no data there"
    for i in range(start, start + count):
        raw[i] ^= 0xFF
    path.write_bytes(bytes(raw))


def test_host_zero_and_no_device_tier_puts_values_straight_to_disk(
    new_cache: NewCache, tmp_path: Path
) -> None:
    cache = new_cache(host=0, disk_dir=tmp_path, disk="1GiB")
    x = torch.randn(1000)
    cache.put("x", x)
    assert cache.tier_of("x") == "disk" and len(items(tmp_path)) == 1
    assert cache.used["disk"] == disk_bytes(tmp_path) > x.nbytes
    assert torch.equal(cache.get("x"), x)
    assert cache.tier_of("x") == "disk"  # no faster tier to move it to
    cache.put("x", x * 2)  # replaced: still one file
    assert len(items(tmp_path)) == 1 and torch.equal(cache.get("x"), x * 2)
    assert cache.discard("x") and items(tmp_path) == [] and cache.used["disk"] == 0


@pytest.mark.parametrize("durable", [False, True])
def test_a_new_cache_finds_the_values_in_the_directory(
    durable: bool, new_cache: NewCache, tmp_path: Path
) -> None:
    values = {
        "name": make("float", 1),
        7: make("int", 2, 64 * KiB),  # compressed on disk
        ("layer", 3, "w"): make("nested", 3),
        (("a", 1), None, 2.5): make("sparse", 4),
        "flags": make("bool", 5),
        "half": make("bf16", 6),
        "empty": make("empty", 7),
        "scalar": make("scalar", 8),
    }
    want = {k: digest(v) for k, v in values.items()}
    lossy = torch.randn(3000, generator=torch.Generator().manual_seed(9))
    with vramctl.simulate("64MiB"):
        first = new_cache(
            gpu="64KiB", host="256KiB", disk_dir=tmp_path, disk="64MiB", durable=durable
        )
        for k, v in values.items():
            first.put(k, v)
        first.put("lossy", lossy, bf16=True)
        first.put(frozenset({1}), torch.ones(3))  # a key with no JSON form: not kept
        first.prefetch(list(values)).result()  # through the device tier
        first.evict(tier="gpu")
        first.evict(tier="host")  # everything to disk
        assert {first.tier_of(k) for k in first} == {"disk"}
        first.close()
        del first
        assert len(items(tmp_path)) == len(values) + 2
        again = new_cache(gpu="64KiB", host="256KiB", disk_dir=tmp_path, disk="64MiB")
        assert len(items(tmp_path)) == len(values) + 1  # the anonymous key's file is gone
        assert again.used["disk"] == disk_bytes(tmp_path)
        assert set(again.keys()) == {*values, "lossy"}
        assert {type(k) for k in again} == {str, int, tuple}
        for k, d in want.items():
            assert again.tier_of(k) == "disk"
            assert digest(again.get(k)) == d, k
        back = again.get("lossy")
        assert back.dtype == torch.float32 and not torch.equal(back, lossy)
        torch.testing.assert_close(back, lossy, rtol=1e-2, atol=1e-2)
        stats = again.stats()
    assert stats["corrupted_items"] == 0


def test_a_file_damaged_on_disk_is_reported_and_forgotten(
    new_cache: NewCache, tmp_path: Path
) -> None:
    with vramctl.simulate("64MiB"):
        cache = new_cache(gpu="1MiB", host=0, disk_dir=tmp_path, disk="16MiB")
        good, bad = make("float", 1), make("int", 2, 64 * KiB)
        cache.put("good", good, tier="disk")
        cache.put("bad", bad, tier="disk")
        assert cache.tier_of("bad") == "disk"
        (path,) = [p for p in items(tmp_path) if _key_of(p) == '"bad"']
        flip_data_bytes(path, at=100)
        with pytest.raises(CorruptItemError):
            cache.get("bad")
        assert "bad" not in cache and not path.exists()
        assert cache.stats()["corrupted_items"] == 1
        assert cache.get("bad", None) is None
        assert torch.equal(cache.get("good"), good)  # the others are unharmed
        check_budgets(cache, disk_dir=tmp_path)


@pytest.mark.parametrize("promote", [True, False])
def test_damage_is_found_on_every_read_path(
    promote: bool, new_cache: NewCache, tmp_path: Path
) -> None:
    cache = new_cache(host=0, disk_dir=tmp_path, disk="16MiB")
    cache.put("x", make("float", 3, 64 * KiB))
    (path,) = items(tmp_path)
    flip_data_bytes(path, at=64 * KiB - 8)  # the last bytes of the data
    with pytest.raises(CorruptItemError):
        cache.get("x", promote=promote)
    assert "x" not in cache and cache.used["disk"] == 0
    assert cache.stats()["corrupted_items"] == 1


def test_a_damaged_file_is_found_by_a_new_cache_too(new_cache: NewCache, tmp_path: Path) -> None:
    first = new_cache(host=0, disk_dir=tmp_path, disk="16MiB")
    first.put("a", make("float", 1))
    first.put("b", make("float", 2))
    first.close()
    pa = next(p for p in items(tmp_path) if _key_of(p) == '"a"')
    flip_data_bytes(pa, at=0)
    junk = tmp_path / ("0" * 40 + ".safetensors")
    junk.write_bytes(b"\x00" * 100)  # not a safetensors file at all
    again = new_cache(host=0, disk_dir=tmp_path, disk="16MiB")
    assert not junk.exists() and set(again.keys()) == {"a", "b"}
    assert again.stats()["corrupted_items"] == 1  # the junk, found on opening
    with pytest.raises(CorruptItemError):
        again.get("a")
    assert again.stats()["corrupted_items"] == 2 and set(again.keys()) == {"b"}
    assert digest(again.get("b")) == digest(make("float", 2))


def test_prefetch_skips_a_damaged_file_and_moves_the_others(
    new_cache: NewCache, tmp_path: Path
) -> None:
    with vramctl.simulate("64MiB"):
        cache = new_cache(gpu="1MiB", host=0, disk_dir=tmp_path, disk="8MiB")
        good = make("float", 1)
        cache.put("bad", make("float", 0), tier="disk")
        cache.put("good", good, tier="disk")
        (path,) = [p for p in items(tmp_path) if _key_of(p) == '"bad"']
        flip_data_bytes(path)
        future = cache.prefetch(["bad", "good"])
        with contextlib.suppress(CorruptItemError):  # reported there, or not
            future.result()
        assert "bad" not in cache and cache.stats()["corrupted_items"] == 1
        assert cache.tier_of("good") == "gpu", "one damaged file stopped the whole prefetch"
        assert torch.equal(cache.get("good"), good)


def test_a_new_cache_keeps_what_fits_its_disk_budget(new_cache: NewCache, tmp_path: Path) -> None:
    first = new_cache(host=0, disk_dir=tmp_path, disk="64MiB")
    for i in range(6):
        first.put(i, make("float", i, 64 * KiB))
    first.close()
    one = disk_bytes(tmp_path) // 6
    again = new_cache(host=0, disk_dir=tmp_path, disk=2 * one + one // 2)
    assert len(again) == 2 and len(items(tmp_path)) == 2
    check_budgets(again, disk_dir=tmp_path)
    for i in again:
        assert digest(again.get(i)) == digest(make("float", i, 64 * KiB))  # type: ignore[arg-type]
    again.clear()
    assert items(tmp_path) == [] and len(again) == 0 and again.used["disk"] == 0


def test_leftover_temporary_files_are_removed_on_opening(
    new_cache: NewCache, tmp_path: Path
) -> None:
    first = new_cache(host=0, disk_dir=tmp_path, disk="16MiB")
    first.put("kept", torch.arange(10))
    first.close()
    (kept,) = items(tmp_path)
    torn = tmp_path / f".tmp-12345-abcdef12-{kept.name}"
    torn.write_bytes(kept.read_bytes()[:50])  # a write that never finished
    other = tmp_path / ".tmp-999-00000000-x.safetensors"
    other.write_bytes(b"partial")
    again = new_cache(host=0, disk_dir=tmp_path, disk="16MiB")
    assert temp_files(tmp_path) == []
    assert again.keys() == ["kept"] and torch.equal(again.get("kept"), torch.arange(10))
    assert again.stats()["corrupted_items"] == 0


def test_a_value_whose_tensors_share_memory_goes_to_disk(
    new_cache: NewCache, tmp_path: Path
) -> None:
    # Tied weights: one tensor under two names. The disk tier writes safetensors files,
    # which refuse tensors that share memory unless each part is written on its own.
    w = torch.randn(64, 8)
    value = {"embed": w, "head": w, "rows": w[:4]}
    cache = new_cache(host=0, disk_dir=tmp_path, disk="16MiB")
    cache.put("tied", value)
    back = cache.get("tied")
    assert digest(back) == digest(value)
    assert cache.tier_of("tied") == "disk"


def test_the_disk_budget_counts_the_whole_file(new_cache: NewCache, tmp_path: Path) -> None:
    # A value's file holds its layout (constant leaves too) in its header: a large header
    # still counts against the budget, so the files never take more than it.
    cache = new_cache(host=0, disk_dir=tmp_path, disk=300 * KiB)
    for i in range(3):
        cache.put(i, {"t": torch.ones(1), "note": "x" * 200_000})
        check_budgets(cache, disk_dir=tmp_path)


# -- a writer killed mid-write ------------------------------------------------------------

WRITER = r"""
import os
import sys
import threading

import torch

from vramctl.cache import TensorCache

# argv[2]: the item whose write stops after its temporary file is written, before its
# rename (-1: none), so that the kill lands inside a write.
stop_at = int(sys.argv[2])
current = -1
rename = os.replace


def replace(src, dst):
    if current == stop_at:
        print("writing", current, flush=True)
        threading.Event().wait()
    return rename(src, dst)


os.replace = replace
cache = TensorCache(host=0, disk_dir=sys.argv[1], disk="1GiB")
for current in range(48):
    key = ("item", current)
    cache.put(key, torch.randn(1 << 19, generator=torch.Generator().manual_seed(current)))
    print(current, cache.tier_of(key), flush=True)
threading.Event().wait()
"""


def expected(i: int) -> str:
    return digest(torch.randn(1 << 19, generator=torch.Generator().manual_seed(i)))


@pytest.mark.parametrize("inside_a_write", [True, False])
def test_a_writer_killed_mid_write_leaves_whole_items_only(
    inside_a_write: bool, new_cache: NewCache, tmp_path: Path
) -> None:
    err = (tmp_path / "stderr").open("w")
    disk = tmp_path / "cache"
    stop_at = 4 if inside_a_write else -1
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(disk), str(stop_at)],
        stdout=subprocess.PIPE,
        stderr=err,
        text=True,
    )
    reported: list[int] = []
    torn: list[Path] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            word, i = line.split()
            if word == "writing":  # item 4's file is written, not yet renamed
                torn = temp_files(disk)
                break
            assert i == "disk"  # host=0, no device tier: straight to disk
            reported.append(int(word))
            assert int(word) != stop_at, "the write did not stop before its rename"
            if not inside_a_write and len(reported) == 4:
                break  # and kill it while it writes the next items
        proc.kill()  # SIGKILL
    finally:
        proc.kill()
        proc.wait(30)
        err.close()
    assert reported[:4] == [0, 1, 2, 3], (tmp_path / "stderr").read_text()[-2000:]
    assert proc.returncode == -9
    if inside_a_write:
        assert reported == [0, 1, 2, 3] and len(torn) == 1  # the write in progress
    cache = new_cache(host=0, disk_dir=disk, disk="1GiB")
    assert temp_files(disk) == []
    found = sorted(k[1] for k in cache)
    assert set(reported) <= set(found)
    assert found == list(range(len(found)))  # written in order: no gap, nothing torn
    if inside_a_write:
        assert found == reported
    for i in found:
        assert digest(cache.get(("item", i))) == expected(i), i
    assert cache.stats()["corrupted_items"] == 0


def _key_of(path: Path) -> str:
    """The cache key a disk item's header names."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return str((f.metadata() or {}).get("key"))


def test_flip_data_bytes_changes_the_data_only(new_cache: NewCache, tmp_path: Path) -> None:
    # The header, and so the key and the checksums, still read.
    cache = new_cache(host=0, disk_dir=tmp_path, disk="1MiB")
    cache.put("k", torch.zeros(256))
    (path,) = items(tmp_path)
    before = path.read_bytes()
    flip_data_bytes(path, at=10, count=2)
    after = path.read_bytes()
    assert _key_of(path) == '"k"' and len(before) == len(after)
    assert sum(a != b for a, b in zip(before, after, strict=True)) == 2
