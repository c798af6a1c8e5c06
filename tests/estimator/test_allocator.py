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


#: Sequences whose expandable-segment figures differ from the fixed segments' in a way of
#: their own: a block at the mapped end passed over for a hole, a remainder of 1 MiB or less
#: split off, a hole mapped again after the cache was emptied.
EXPANDABLE_SEQUENCES = {
    "tail": [("m", 10 * MiB), ("m", 4 * MiB), ("f", 0), ("m", 5 * MiB)],
    "remainder": [("m", 21 * MiB + 512 * KiB), ("m", 1 * MiB), ("f", 0), ("m", 21 * MiB)],
    "unmapped": [("m", 30 * MiB), ("m", 15 * MiB), ("f", 0), ("e", 0), ("m", 25 * MiB)],
}


def replay_model(
    seq: list[tuple[str, int]], config: AllocatorConfig | None = None
) -> dict[str, int]:
    a = CachingAllocatorModel(config)
    handles: list[int | None] = []
    for op, arg in seq:
        if op == "m":
            handles.append(a.malloc(arg))
        elif op == "e":
            a.empty_cache()
        else:
            h = handles[arg]
            assert h is not None
            a.free(h)
            handles[arg] = None
    return {k: a.stats()[k] for k in ("allocated", "reserved", "inactive_split", "peak_reserved")}


def replay_real(seq: list[tuple[str, int]]) -> dict[str, int]:
    import torch

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    if torch.cuda.memory_reserved() != 0:
        pytest.skip("another test holds CUDA memory; the replay needs a clean allocator")
    torch.cuda.reset_peak_memory_stats()
    tensors: list[torch.Tensor | None] = []
    for op, arg in seq:
        if op == "m":
            tensors.append(torch.empty(arg, dtype=torch.uint8, device="cuda"))
        elif op == "e":
            torch.cuda.empty_cache()
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
    return real


@pytest.mark.cuda
@pytest.mark.parametrize("name", sorted(SEQUENCES))
def test_matches_the_real_allocator(name: str) -> None:
    assert replay_model(SEQUENCES[name]) == replay_real(SEQUENCES[name])


@pytest.mark.cuda
@pytest.mark.parametrize("name", sorted({**SEQUENCES, **EXPANDABLE_SEQUENCES}))
def test_matches_the_real_allocator_with_expandable_segments(name: str) -> None:
    import torch

    seq = {**SEQUENCES, **EXPANDABLE_SEQUENCES}[name]
    torch.cuda.empty_cache()
    torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    try:
        real = replay_real(seq)
    finally:
        torch.cuda.empty_cache()
        torch.cuda.memory._set_allocator_settings("expandable_segments:False")
    assert replay_model(seq, AllocatorConfig(expandable_segments=True)) == real


# -- expandable segments ---------------------------------------------------------------------

EXPANDABLE = AllocatorConfig(expandable_segments=True)


def test_an_expandable_segment_maps_the_pages_a_request_needs() -> None:
    a = CachingAllocatorModel(EXPANDABLE, record_history=True)
    a.malloc(1)
    assert (a.allocated, a.reserved) == (512, 2 * MiB)  # one small page
    a.malloc(3 * MiB)
    assert a.reserved == 22 * MiB  # one large page
    a.malloc(5 * MiB)  # from the 17 MiB left at the mapped end
    assert (a.allocated, a.reserved) == (512 + 8 * MiB, 22 * MiB)
    a.malloc(15 * MiB)  # 12 MiB left there: one more page, and the block spans both
    assert a.reserved == 42 * MiB and a.segments == 2  # a segment per pool
    a.malloc(50 * MiB)  # 17 MiB left at the end: two more pages for the other 33 MiB
    assert a.reserved == 82 * MiB
    assert [(act, size) for act, _, size in a.history] == [
        ("segment_map", 2 * MiB),
        ("segment_map", 20 * MiB),
        ("segment_map", 20 * MiB),
        ("segment_map", 40 * MiB),
    ]
    # fixed segments: 2 MiB, 20 MiB (3 and 5 MiB), 16 MiB, 50 MiB
    fixed = CachingAllocatorModel()
    for n in (1, 3 * MiB, 5 * MiB, 15 * MiB, 50 * MiB):
        fixed.malloc(n)
    assert fixed.reserved == 88 * MiB


def test_an_expandable_segment_splits_off_any_remainder() -> None:
    seq = EXPANDABLE_SEQUENCES["remainder"]
    fixed, grown = replay_model(seq), replay_model(seq, EXPANDABLE)
    # fixed: the 21 MiB request takes the whole freed 22 MiB block (1 MiB left is not
    # split in the large pool), beside the 1 MiB small block; expandable: exactly 21 MiB
    assert fixed["allocated"] == 23 * MiB
    assert grown["allocated"] == 22 * MiB


def test_the_block_at_the_mapped_end_is_the_last_choice() -> None:
    def layout(config: AllocatorConfig | None) -> list[list[int]]:
        a = CachingAllocatorModel(config)
        first = a.malloc(9 * MiB)
        a.malloc(4 * MiB)  # 7 MiB free after it, to the end of the 20 MiB
        a.free(first)  # a 9 MiB hole before it
        a.malloc(5 * MiB)
        return a.segments_state()[-1][4]

    # fixed segments: best fit, the 7 MiB after
    assert layout(None) == [[9 * MiB, 0], [4 * MiB, 1], [5 * MiB, 1], [2 * MiB, 0]]
    # expandable: those 7 MiB can grow with the segment, so the hole is the better fit
    assert layout(EXPANDABLE) == [[5 * MiB, 1], [4 * MiB, 0], [4 * MiB, 1], [7 * MiB, 0]]


def test_emptying_the_cache_unmaps_whole_free_pages_and_maps_them_again() -> None:
    a = CachingAllocatorModel(EXPANDABLE)
    first = a.malloc(30 * MiB)  # pages 0-1
    a.malloc(15 * MiB)  # 10 MiB left on page 1, then page 2
    assert a.reserved == 60 * MiB
    a.free(first)
    a.empty_cache()  # page 0 (free) unmapped; page 1 holds 15 MiB of the second block
    assert a.reserved == 40 * MiB and a.allocated == 15 * MiB
    # the segment reads as two stretches of mapped pages, as PyTorch's snapshot gives it
    assert [s[1] for s in a.segments_state()] == [40 * MiB]  # pages 1-2
    a.free(a.malloc(5 * MiB))  # a free page first: the segment reads as two stretches
    assert a.segments_state()[0][0] > 0
    a.malloc(25 * MiB)  # the hole (page 0, with 10 MiB free after it on page 1) serves
    assert a.reserved == 60 * MiB and a.peak_reserved == 60 * MiB
    assert [s[1] for s in a.segments_state()] == [60 * MiB]


def test_an_empty_expandable_segment_goes_with_the_cache() -> None:
    a = CachingAllocatorModel(EXPANDABLE)
    handles = [a.malloc(n) for n in (1, 700 * KiB, 3 * MiB, 40 * MiB)]
    for h in handles:
        a.free(h)
    assert a.allocated == 0 and a.inactive_split == 0  # PyTorch counts none for them
    a.empty_cache()
    assert a.reserved == 0 and a.segments == 0 and a.segments_state() == []


def test_an_expandable_segment_past_its_capacity_retries_then_runs_out() -> None:
    a = CachingAllocatorModel(AllocatorConfig(expandable_segments=True, capacity=60 * MiB))
    keep = a.malloc(30 * MiB)
    gone = a.malloc(20 * MiB)
    a.free(gone)  # 10 MiB of page 1 and all of page 2 free: 40 MiB mapped
    a.malloc(25 * MiB)  # 30 MiB free at the end already: no mapping
    assert a.reserved == 60 * MiB and a.alloc_retries == 0
    with pytest.raises(AllocatorOutOfMemory):
        a.malloc(30 * MiB)
    assert a.alloc_retries == 1 and a.ooms == 1
    a.free(keep)


def test_the_conf_string_turns_expandable_segments_on() -> None:
    cfg = AllocatorConfig.from_conf("expandable_segments:True")
    assert cfg is not None and cfg.expandable_segments and cfg.max_split_size is None
    assert AllocatorConfig.from_conf("expandable_segments:False") is None
    both = AllocatorConfig.from_conf("max_split_size_mb:64,expandable_segments:true")
    assert both is not None and both.expandable_segments and both.max_split_size == 64 * MiB
    # over a calibration's measured constants, the switch is kept
    assert cfg.over(AllocatorConfig(large_buffer=40 * MiB)).expandable_segments
