"""The host pool: bounded, blocks disjoint, freed neighbours merged."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from vramctl.cache import HostPool
from vramctl.cache._pool import ALIGN, Block

KiB = 2**10


def _pattern(tag: int, size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(tag)
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)


def _check_disjoint(blocks: list[Block]) -> None:
    by_segment: dict[int, list[tuple[int, int]]] = {}
    for b in blocks:
        assert b.offset % ALIGN == 0 and b.size % ALIGN == 0 and b.size >= ALIGN
        assert b.offset + b.size <= b.segment.size
        by_segment.setdefault(id(b.segment), []).append((b.offset, b.offset + b.size))
    for ranges in by_segment.values():
        ranges.sort()
        for (_, end), (start, _) in itertools.pairwise(ranges):
            assert end <= start, "two live blocks overlap"


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_random_allocs_and_frees_stay_within_capacity_and_never_overlap(seed: int) -> None:
    rng = random.Random(seed)
    capacity = rng.choice([64 * KiB, 100 * KiB, 257 * KiB])
    pool = HostPool(capacity, pinned=False, segment=rng.choice([16 * KiB, 48 * KiB, 64 * KiB]))
    live: dict[int, tuple[Block, torch.Tensor]] = {}
    refused = 0
    for step in range(600):
        if live and (rng.random() < 0.45 or len(live) > 40):
            tag = rng.choice(list(live))
            block, want = live.pop(tag)
            assert torch.equal(block.bytes(want.numel()), want)
            pool.free(block)
        else:
            n = rng.choice([1, 100, 512, 513, 3000, 8 * KiB, 20 * KiB])
            block = pool.alloc(n)
            if block is None:
                refused += 1
            else:
                assert block.size >= n
                data = _pattern(step, n)
                block.bytes(n).copy_(data)
                live[step] = (block, data)
        assert pool.held <= pool.capacity
        assert pool.peak_held <= pool.capacity
        assert pool.used == sum(b.size for b, _ in live.values())
        _check_disjoint([b for b, _ in live.values()])
        if step % 25 == 0:  # what was written into every live block is still there
            for block, want in live.values():
                assert torch.equal(block.bytes(want.numel()), want)
    assert refused > 0  # the pool did run full
    for block, _ in live.values():
        pool.free(block)
    assert pool.used == 0
    pool.release()
    assert pool.held == 0


def test_freed_neighbours_merge_into_the_whole_segment() -> None:
    pool = HostPool(8 * KiB, pinned=False, segment=8 * KiB)
    blocks = [pool.alloc(ALIGN) for _ in range(16)]
    assert all(b is not None for b in blocks)
    assert pool.alloc(1) is None  # full
    segment = blocks[0].segment  # type: ignore[union-attr]
    order = list(range(16))
    random.Random(5).shuffle(order)
    for i in order[:-1]:
        pool.free(blocks[i])  # type: ignore[arg-type]
    assert pool.largest_free() < 8 * KiB  # one block still splits the segment
    pool.free(blocks[order[-1]])  # type: ignore[arg-type]
    assert pool.largest_free() == 8 * KiB
    whole = pool.alloc(8 * KiB)
    assert whole is not None and whole.segment is segment and whole.offset == 0
    assert pool.held == 8 * KiB


def test_a_freed_block_merges_with_both_neighbours() -> None:
    pool = HostPool(2 * KiB, pinned=False, segment=2 * KiB)
    a, b, c, d = (pool.alloc(ALIGN) for _ in range(4))
    assert None not in (a, b, c, d)
    pool.free(a)  # type: ignore[arg-type]
    pool.free(c)  # type: ignore[arg-type]
    assert pool.largest_free() == ALIGN
    assert pool.alloc(2 * ALIGN) is None  # two free blocks, apart
    pool.free(b)  # type: ignore[arg-type]  # joins a and c
    assert pool.largest_free() == 3 * ALIGN
    three = pool.alloc(3 * ALIGN)
    assert three is not None and three.offset == 0 and three.segment is d.segment  # type: ignore[union-attr]


def test_alloc_returns_none_when_full_and_fits_says_what_could_ever_fit() -> None:
    pool = HostPool(4 * KiB, pinned=False)
    assert pool.fits(4 * KiB) and pool.fits(1) and pool.fits(0)
    assert not pool.fits(4 * KiB + 1)
    assert pool.alloc(4 * KiB + 1) is None
    block = pool.alloc(4 * KiB)
    assert block is not None and block.size == 4 * KiB
    assert pool.alloc(1) is None
    pool.free(block)
    again = pool.alloc(3 * KiB)
    assert again is not None
    assert pool.held <= pool.capacity


def test_an_empty_pool_takes_no_memory_and_gives_back_empty_segments() -> None:
    pool = HostPool(1 * KiB * KiB, pinned=False, segment=64 * KiB)
    assert pool.held == 0 and pool.largest_free() == 0
    blocks = [pool.alloc(60 * KiB) for _ in range(3)]
    assert all(b is not None for b in blocks)
    assert pool.held == 3 * 64 * KiB  # a segment each
    for b in blocks:
        pool.free(b)  # type: ignore[arg-type]
    pool.release()
    assert pool.held == 0 and pool.used == 0


def test_a_block_is_viewed_as_any_dtype_and_shape() -> None:
    pool = HostPool(4 * KiB, pinned=False)
    block = pool.alloc(6 * 8)
    assert block is not None
    view = block.view(torch.float64, (2, 3))
    view.copy_(torch.arange(6, dtype=torch.float64).view(2, 3))
    assert block.view(torch.float64, (6,)).tolist() == [0, 1, 2, 3, 4, 5]
    assert block.bytes(48).view(torch.float64)[5] == 5


def test_negative_capacity_is_refused() -> None:
    with pytest.raises(ValueError, match="capacity"):
        HostPool(-1, pinned=False)


@pytest.mark.parametrize("capacity", [1000, 10**6, 4 * KiB + 100, 700 * KiB + 1])
def test_what_fits_an_empty_pool_is_allocated(capacity: int) -> None:
    # A capacity that is not a multiple of ALIGN (a budget such as "1MB"): fits() says a
    # block fits the empty pool, so alloc() must give it.
    for n in (1, ALIGN, capacity // 2, capacity - ALIGN):
        pool = HostPool(capacity, pinned=False)
        assert pool.fits(n)
        block = pool.alloc(n)
        assert block is not None, f"HostPool({capacity}).alloc({n}) is None though fits({n})"
        assert pool.held <= capacity
