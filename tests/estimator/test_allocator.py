"""The caching-allocator model against the documented rules of PyTorch's CUDA allocator.

``test_matches_the_real_allocator`` replays the same sequences on a real GPU.
"""

from __future__ import annotations

import random

import pytest

from vramctl.estimator import AllocatorConfig, AllocatorOutOfMemory, CachingAllocatorModel

KiB, MiB = 2**10, 2**20


def test_rounding_to_512_byte_blocks() -> None:
    cfg = AllocatorConfig()
    assert [cfg.round_size(n) for n in (0, 1, 512, 513, 1000, 1024)] == [
        512,
        512,
        512,
        1024,
        1024,
        1024,
    ]


def test_segment_sizes() -> None:
    cfg = AllocatorConfig()
    assert cfg.segment_size(512) == 2 * MiB  # small requests pack into 2 MiB
    assert cfg.segment_size(1 * MiB) == 2 * MiB
    assert cfg.segment_size(1 * MiB + 512) == 20 * MiB  # 1-10 MiB share 20 MiB buffers
    assert cfg.segment_size(10 * MiB - 512) == 20 * MiB
    assert cfg.segment_size(10 * MiB) == 10 * MiB  # from 10 MiB, rounded to 2 MiB
    assert cfg.segment_size(13 * MiB) == 14 * MiB


def test_small_requests_share_a_2mib_segment() -> None:
    a = CachingAllocatorModel()
    for _ in range(4):
        a.malloc(512 * KiB)
    assert a.reserved == 2 * MiB and a.segments == 1 and a.allocated == 2 * MiB
    a.malloc(1)
    assert a.reserved == 4 * MiB and a.segments == 2


def test_medium_requests_share_a_20mib_segment() -> None:
    a = CachingAllocatorModel()
    a.malloc(5 * MiB)
    a.malloc(5 * MiB)
    a.malloc(9 * MiB)
    assert a.reserved == 20 * MiB and a.segments == 1
    # 1 MiB left: not split off in the large pool (remainder must exceed 1 MiB) ...
    a.malloc(2 * MiB)
    assert a.reserved == 40 * MiB


def test_large_remainders_of_one_mib_or_less_are_not_split() -> None:
    a = CachingAllocatorModel()
    h = a.malloc(19 * MiB + 512)  # in a 20 MiB segment; remainder 1 MiB - 512: kept whole
    assert a.allocated == 20 * MiB and a.inactive_split == 0
    a.free(h)
    a.malloc(11 * MiB)  # reuses the cached 20 MiB block and splits off 9 MiB
    assert a.reserved == 20 * MiB and a.inactive_split == 9 * MiB


def test_frees_are_cached_and_merged() -> None:
    a = CachingAllocatorModel()
    x, y, z = a.malloc(5 * MiB), a.malloc(5 * MiB), a.malloc(5 * MiB)
    assert a.inactive_split == 5 * MiB
    a.free(y)
    assert a.inactive_split == 10 * MiB  # a hole in the middle
    a.free(x)
    a.free(z)
    # All three merged back with the tail into one 20 MiB block; nothing returned.
    assert a.allocated == 0 and a.reserved == 20 * MiB and a.inactive_split == 0
    a.malloc(20 * MiB)
    assert a.reserved == 20 * MiB and a.segments == 1


def test_best_fit_picks_the_smallest_cached_block() -> None:
    a = CachingAllocatorModel()
    big = a.malloc(40 * MiB)
    small = a.malloc(12 * MiB)
    a.free(big)
    a.free(small)
    a.malloc(12 * MiB)  # the 12 MiB segment, not a slice of the 40 MiB one
    assert a.inactive_split == 0 and a.reserved == 52 * MiB


def test_fragmentation_makes_reserved_exceed_allocated() -> None:
    a = CachingAllocatorModel()
    # Alternate keep/free 6 MiB blocks: the holes cannot serve a 12 MiB request.
    handles = [a.malloc(6 * MiB) for _ in range(6)]
    for h in handles[::2]:
        a.free(h)
    a.malloc(12 * MiB)
    assert a.allocated == 3 * 6 * MiB + 12 * MiB
    # Two 20 MiB segments with 6, 8 and 6+2 MiB holes, plus a new 12 MiB segment.
    assert a.reserved == 52 * MiB and a.inactive_split == 22 * MiB
    assert a.peak_reserved == a.reserved


def test_capacity_releases_cached_segments_then_ooms() -> None:
    a = CachingAllocatorModel(AllocatorConfig(capacity=64 * MiB))
    h = a.malloc(40 * MiB)
    a.free(h)  # cached: 40 MiB reserved, 0 allocated
    a.malloc(30 * MiB)  # served by splitting the cached block
    assert a.reserved == 40 * MiB and a.alloc_retries == 0
    b = CachingAllocatorModel(AllocatorConfig(capacity=64 * MiB))
    h1 = b.malloc(30 * MiB)
    b.free(h1)
    b.malloc(50 * MiB)  # 30 + 50 > 64: release the cached 30 MiB segment, retry
    assert b.alloc_retries == 1 and b.reserved == 50 * MiB
    with pytest.raises(AllocatorOutOfMemory) as err:
        b.malloc(20 * MiB)
    assert err.value.requested == 20 * MiB and b.ooms == 1


def test_max_split_size_keeps_oversize_blocks_whole() -> None:
    a = CachingAllocatorModel(AllocatorConfig(max_split_size=200 * MiB))
    h = a.malloc(300 * MiB)
    a.free(h)
    a.malloc(100 * MiB)  # may not carve an oversize cached block
    assert a.reserved == 400 * MiB
    a.malloc(290 * MiB)  # an oversize request within 20 MiB reuses it whole
    assert a.reserved == 400 * MiB and a.allocated == 400 * MiB


def test_random_sequences_keep_the_books_balanced() -> None:
    rng = random.Random(0)
    a = CachingAllocatorModel()
    live: list[int] = []
    for _ in range(3000):
        if live and rng.random() < 0.45:
            a.free(live.pop(rng.randrange(len(live))))
        else:
            live.append(a.malloc(rng.choice([rng.randrange(1, 4096), rng.randrange(1, 64 * MiB)])))
        assert a.allocated <= a.reserved <= a.peak_reserved
        assert a.inactive_split <= a.reserved - a.allocated
        assert a.requested <= a.allocated
    for h in live:
        a.free(h)
    assert a.allocated == 0 and a.requested == 0 and a.inactive_split == 0
    a.empty_cache()
    assert a.reserved == 0 and a.segments == 0


SEQUENCES = {
    "small": [("m", 1), ("m", 700 * KiB), ("m", 3000), ("f", 1), ("m", 200 * KiB)],
    "medium": [("m", 5 * MiB), ("m", 3 * MiB), ("f", 0), ("m", 4 * MiB), ("m", 9 * MiB)],
    "large": [("m", 40 * MiB), ("m", 12 * MiB + 1), ("f", 0), ("m", 12 * MiB), ("m", 30 * MiB)],
    "holes": [("m", 6 * MiB)] * 6 + [("f", 0), ("f", 2), ("f", 4), ("m", 12 * MiB)],
}


def replay_model(seq: list[tuple[str, int]]) -> dict[str, int]:
    a = CachingAllocatorModel()
    handles: list[int | None] = []
    for op, arg in seq:
        if op == "m":
            handles.append(a.malloc(arg))
        else:
            h = handles[arg]
            assert h is not None
            a.free(h)
            handles[arg] = None
    return {k: a.stats()[k] for k in ("allocated", "reserved", "inactive_split", "peak_reserved")}


@pytest.mark.cuda
@pytest.mark.parametrize("name", sorted(SEQUENCES))
def test_matches_the_real_allocator(name: str) -> None:
    import torch

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    if torch.cuda.memory_reserved() != 0:
        pytest.skip("another test holds CUDA memory; the replay needs a clean allocator")
    torch.cuda.reset_peak_memory_stats()
    tensors: list[torch.Tensor | None] = []
    for op, arg in SEQUENCES[name]:
        if op == "m":
            tensors.append(torch.empty(arg, dtype=torch.uint8, device="cuda"))
        else:
            tensors[arg] = None
    s = torch.cuda.memory_stats()
    real = {
        "allocated": s["allocated_bytes.all.current"],
        "reserved": s["reserved_bytes.all.current"],
        "inactive_split": s["inactive_split_bytes.all.current"],
        "peak_reserved": s["reserved_bytes.all.peak"],
    }
    del tensors
    torch.cuda.empty_cache()
    assert replay_model(SEQUENCES[name]) == real
