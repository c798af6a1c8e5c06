"""A model of PyTorch's CUDA caching allocator, for replaying a traced step.

Peak *reserved* memory decides an OOM, and the allocated peak alone
under-counts it. This model replays a sequence of allocations and frees
through the rules of ``c10/cuda/CUDACachingAllocator.cpp`` (native backend,
one stream, default ``PYTORCH_CUDA_ALLOC_CONF``):

- every request is rounded up to a multiple of 512 bytes (at least 512);
- requests of at most 1 MiB come from the *small* pool, larger ones from the
  *large* pool;
- a request that no cached block can serve makes a new segment
  (``cudaMalloc``): 2 MiB for a small request, 20 MiB for a large request under
  10 MiB, otherwise the request rounded up to 2 MiB;
- the smallest cached block that fits is used (best fit, ties by address);
- a block is split when the remainder is at least 512 bytes (small pool) or
  more than 1 MiB (large pool), and blocks of ``max_split_size`` or more are not
  split;
- a freed block is merged with free neighbours in its segment and cached, not
  returned to the device;
- when a new segment would pass the device's capacity, cached segments that are
  entirely free are released and the allocation retried (one *alloc retry*);
  if it still does not fit, that is an OOM.

With ``expandable_segments:True`` (:attr:`AllocatorConfig.expandable_segments`) each pool
has one segment that grows in place instead (PyTorch's ``ExpandableSegment``):

- a request that no mapped free block serves maps pages at the segment's lowest address
  with room (normally its end, after the free block there): pages of 2 MiB in the small
  pool and 20 MiB in the large pool, as few as the request needs; reserved memory is the
  pages mapped;
- best fit still chooses among the mapped free blocks, but the block at the mapped end
  counts as large as the segment can grow, so any other block that fits comes first;
- a block is split whenever 512 bytes or more remain, in both pools;
- emptying the cache unmaps every whole page of the free blocks, wherever they lie.

>>> from vramctl.estimator import CachingAllocatorModel
>>> a = CachingAllocatorModel()
>>> h = a.malloc(1)
>>> a.allocated, a.reserved
(512, 2097152)
"""

from __future__ import annotations

import bisect
import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["AllocatorConfig", "AllocatorOutOfMemory", "CachingAllocatorModel"]

KiB, MiB = 2**10, 2**20

#: The variables PyTorch's caching allocator reads its configuration from, in order.
ALLOC_CONF_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


@dataclass(frozen=True)
class AllocatorConfig:
    """The allocator's constants (PyTorch's defaults) and the device capacity."""

    min_block: int = 512
    small_size: int = 1 * MiB
    small_buffer: int = 2 * MiB
    large_buffer: int = 20 * MiB
    min_large_alloc: int = 10 * MiB
    round_large: int = 2 * MiB
    #: ``max_split_size_mb`` of ``PYTORCH_CUDA_ALLOC_CONF``; None is unlimited.
    max_split_size: int | None = None
    #: Bytes the allocator may reserve in all (None: unlimited).
    capacity: int | None = None
    #: ``expandable_segments:True``: one segment per pool that maps pages as it grows
    #: (``small_buffer`` pages for the small pool, ``large_buffer`` for the large).
    expandable_segments: bool = False

    @classmethod
    def from_conf(cls, text: str | None) -> AllocatorConfig | None:
        """The configuration a ``PYTORCH_CUDA_ALLOC_CONF`` value sets, as far as this model
        follows it; None where it sets nothing the model follows (the defaults apply, or a
        calibration profile's constants).

        The model follows ``max_split_size_mb`` and ``expandable_segments``.
        ``roundup_power2_divisions``, ``garbage_collection_threshold`` and the
        ``cudaMallocAsync`` backend are not modelled: ignored, as is a value PyTorch refuses.

        >>> conf = "expandable_segments:True,max_split_size_mb:128"
        >>> AllocatorConfig.from_conf(conf).max_split_size // MiB
        128
        >>> AllocatorConfig.from_conf("expandable_segments:True").expandable_segments
        True
        >>> AllocatorConfig.from_conf("garbage_collection_threshold:0.6") is None
        True
        """
        items, item, depth = [], "", 0
        for ch in text or "":
            depth += (ch == "[") - (ch == "]")
            if ch == "," and depth == 0:
                items.append(item)
                item = ""
            else:
                item += ch
        items.append(item)
        split: int | None = None
        expandable = False
        for entry in items:
            key, _, value = entry.replace(" ", "").partition(":")
            # PyTorch refuses 20 MiB or less (its large segment) at the first allocation.
            if key == "max_split_size_mb" and value.isdigit() and int(value) > 20:
                split = int(value) * MiB
            elif key == "expandable_segments":
                expandable = value.lower() == "true"
        if split is None and not expandable:
            return None
        return cls(max_split_size=split, expandable_segments=expandable)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> AllocatorConfig | None:
        """The configuration ``env`` (default: this process's environment) gives PyTorch's
        caching allocator: ``PYTORCH_CUDA_ALLOC_CONF``, else ``PYTORCH_ALLOC_CONF``, read
        by :meth:`from_conf`; None where neither is set.

        >>> AllocatorConfig.from_env({"PYTORCH_ALLOC_CONF": "expandable_segments:True"})
        AllocatorConfig(..., expandable_segments=True)
        >>> AllocatorConfig.from_env({}) is None
        True
        """
        env = os.environ if env is None else env
        for name in ALLOC_CONF_ENV:
            if name in env:
                return cls.from_conf(env[name])
        return None

    def over(self, base: AllocatorConfig) -> AllocatorConfig:
        """This configuration over ``base``: its fields that differ from PyTorch's defaults,
        and ``base``'s for the rest. A job's ``max_split_size_mb`` (:meth:`from_conf`) over
        a calibration's measured constants keeps both.

        >>> measured = AllocatorConfig(large_buffer=40 * MiB)
        >>> both = AllocatorConfig(max_split_size=128 * MiB).over(measured)
        >>> both.large_buffer // MiB, both.max_split_size // MiB
        (40, 128)
        """
        default = AllocatorConfig()
        return dataclasses.replace(
            base,
            **{
                f.name: getattr(self, f.name)
                for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(default, f.name)
            },
        )

    def round_size(self, nbytes: int) -> int:
        if nbytes < self.min_block:
            return self.min_block
        return -(-nbytes // self.min_block) * self.min_block

    def segment_size(self, rounded: int) -> int:
        if rounded <= self.small_size:
            return self.small_buffer
        if rounded < self.min_large_alloc:
            return self.large_buffer
        return -(-rounded // self.round_large) * self.round_large


class AllocatorOutOfMemory(Exception):
    """The modelled device cannot reserve a segment for a request."""

    def __init__(self, requested: int, reserved: int, capacity: int) -> None:
        super().__init__(
            f"allocator model out of memory: {requested} bytes requested with {reserved} of "
            f"{capacity} bytes reserved"
        )
        self.requested = requested
        self.reserved = reserved
        self.capacity = capacity


class _Block:
    __slots__ = (
        "addr",
        "allocated",
        "mapped",
        "next",
        "prev",
        "requested",
        "seg",
        "size",
        "small",
    )

    def __init__(self, addr: int, size: int, seg: int, small: bool, mapped: bool = True) -> None:
        self.addr = addr
        self.size = size
        self.seg = seg
        self.small = small
        #: Backed by pages (always, but for an expandable segment's unmapped stretches).
        self.mapped = mapped
        self.allocated = False
        self.requested = 0
        self.prev: _Block | None = None
        self.next: _Block | None = None

    @property
    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


class _Pool:
    """Free blocks ordered by (size, address), as the allocator's std::set."""

    def __init__(self) -> None:
        self.keys: list[tuple[int, int]] = []
        self.blocks: dict[tuple[int, int], _Block] = {}
        #: An expandable segment's unmapped stretches, by address.
        self.unmapped: list[tuple[int, _Block]] = []

    def add(self, b: _Block) -> None:
        key = (b.size, b.addr)
        bisect.insort(self.keys, key)
        self.blocks[key] = b

    def remove(self, b: _Block) -> None:
        key = (b.size, b.addr)
        del self.keys[bisect.bisect_left(self.keys, key)]
        del self.blocks[key]

    def best_fit(self, size: int) -> _Block | None:
        i = bisect.bisect_left(self.keys, (size, -1))
        if i == len(self.keys):
            return None
        block = self.blocks[self.keys[i]]
        # An expandable segment's block at its mapped end is as large as the segment can
        # grow: a larger block that can grow less (any other) is the better fit.
        j = i + 1
        while j < len(self.keys):
            other = self.blocks[self.keys[j]]
            if _growable(other) >= _growable(block):
                break
            block = other
            j += 1
        return block

    def add_unmapped(self, b: _Block) -> None:
        bisect.insort(self.unmapped, (b.addr, b), key=lambda item: item[0])

    def remove_unmapped(self, b: _Block) -> None:
        i = bisect.bisect_left(self.unmapped, b.addr, key=lambda item: item[0])
        del self.unmapped[i]


def _growable(b: _Block) -> int:
    """What a free block can serve: its size, and the unmapped stretch after it."""
    after = b.next
    return b.size + (after.size if after is not None and not after.mapped else 0)


class CachingAllocatorModel:
    """Replays ``malloc``/``free`` through the caching allocator's rules and keeps its statistics.

    The figures mirror ``torch.cuda.memory_stats``: ``allocated`` and
    ``reserved`` (current and peak), ``inactive_split`` (free bytes in split
    segments: the fragmentation numerator), ``alloc_retries`` and ``ooms``.
    """

    def __init__(
        self, config: AllocatorConfig | None = None, *, record_history: bool = False
    ) -> None:
        self.config = config or AllocatorConfig()
        #: With ``record_history``: ``(action, address, size)`` for each segment made
        #: (``segment_alloc``) or released (``segment_free``), as PyTorch's history names them.
        self.history: list[tuple[str, int, int]] = []
        self._record = record_history
        self._segment_addr: dict[int, int] = {}
        self._small, self._large = _Pool(), _Pool()
        self._live: dict[int, _Block] = {}
        self._segments: dict[int, int] = {}  # segment id -> size (an expandable one's mapped)
        #: The expandable segments (their ids), and each one's page.
        self._expandable: dict[int, int] = {}
        self._next_handle = 0
        self._next_addr = 0
        self._next_segment = 0
        self.allocated = 0
        self.requested = 0
        self.reserved = 0
        self.peak_allocated = 0
        self.peak_reserved = 0
        self.peak_requested = 0
        self.alloc_retries = 0
        self.ooms = 0

    # -- public -------------------------------------------------------------------

    def malloc(self, nbytes: int) -> int:
        """Allocate ``nbytes``; returns a handle for :meth:`free`."""
        cfg = self.config
        size = cfg.round_size(nbytes)
        small = size <= cfg.small_size
        pool = self._small if small else self._large
        block = self._find(pool, size)
        if block is None:
            if cfg.expandable_segments:
                block = self._grow(pool, size, small, nbytes)
            else:
                block = self._new_segment(size, small, nbytes)
        else:
            pool.remove(block)
        self._maybe_split(block, size, pool)
        block.allocated = True
        block.requested = nbytes
        self.allocated += block.size
        self.requested += nbytes
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_requested = max(self.peak_requested, self.requested)
        handle = self._next_handle
        self._next_handle += 1
        self._live[handle] = block
        return handle

    def free(self, handle: int) -> None:
        """Free a block: it is merged with free neighbours and cached."""
        block = self._live.pop(handle)
        block.allocated = False
        self.allocated -= block.size
        self.requested -= block.requested
        pool = self._small if block.small else self._large
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.allocated and neighbour.mapped:
                pool.remove(neighbour)
                self._merge(block, neighbour)
        pool.add(block)

    def empty_cache(self) -> None:
        """Release every cached segment that is entirely free (``torch.cuda.empty_cache``),
        and unmap every whole page of an expandable segment's free blocks."""
        for pool in (self._small, self._large):
            for key in list(pool.keys):
                b = pool.blocks[key]
                if b.seg in self._expandable:
                    self._unmap(b, pool)
                elif not b.is_split:
                    pool.remove(b)
                    size = self._segments.pop(b.seg)
                    self.reserved -= size
                    addr = self._segment_addr.pop(b.seg)
                    if self._record:
                        self.history.append(("segment_free", addr, size))

    def address(self, handle: int) -> int:
        """The address of a live block (the model's own address space)."""
        return self._live[handle].addr

    def requested_size(self, handle: int) -> int:
        """The bytes a live block was requested for."""
        return self._live[handle].requested

    def segments_state(self) -> list[list[Any]]:
        """Each segment as ``[address, size, stream, pool, [[block size, allocated], ...]]``.

        The layout of ``torch.cuda.memory._snapshot()``'s segments, reduced (stream 0,
        pool ``small`` or ``large``, blocks in address order, allocated 1 or 0).
        An expandable segment is given as PyTorch's snapshot gives it: each stretch of mapped
        pages is a segment of its own.
        """
        firsts: dict[int, _Block] = {}
        every = [
            *self._live.values(),
            *(b for pool in (self._small, self._large) for b in pool.blocks.values()),
            *(b for pool in (self._small, self._large) for _, b in pool.unmapped),
        ]
        for block in every:
            if block.prev is None:
                firsts[block.seg] = block
        out: list[list[Any]] = []
        for first in sorted(firsts.values(), key=lambda b: b.addr):
            pool_name = "small" if first.small else "large"
            run: list[list[int]] = []
            start = first.addr
            b: _Block | None = first
            while b is not None:
                if b.mapped:
                    if not run:
                        start = b.addr
                    run.append([b.size, 1 if b.allocated else 0])
                if run and (b.next is None or not b.next.mapped):
                    out.append([start, sum(size for size, _ in run), 0, pool_name, run])
                    run = []
                b = b.next
        return out

    def layout(self) -> tuple[tuple[str, int, tuple[tuple[int, int], ...]], ...]:
        """The segments' pools, sizes and blocks in address order, without the addresses:
        equal layouts serve the same requests the same way."""
        return tuple(
            (pool, size, tuple((b, a) for b, a in blocks))
            for _addr, size, _stream, pool, blocks in self.segments_state()
        )

    def seed(self, segments: list[list[Any]]) -> dict[int, int]:
        """Start from existing segments (as :meth:`segments_state` gives them, or a snapshot's).

        Returns ``{the block's address in segments: handle}`` for every allocated block, so
        that a replay can free blocks made before it began. Segments keep their order by
        address; the model gives them its own addresses.
        """
        if self.config.expandable_segments:
            return self._seed_expandable(segments)
        handles: dict[int, int] = {}
        for addr, size, _stream, pool_name, blocks in sorted(segments, key=lambda s: s[0]):
            small = pool_name == "small"
            pool = self._small if small else self._large
            seg = self._next_segment
            self._next_segment += 1
            self._segments[seg] = size
            self._segment_addr[seg] = self._next_addr
            self.reserved += size
            prev: _Block | None = None
            offset, real = 0, addr
            for bsize, allocated in blocks:
                b = _Block(self._next_addr + offset, bsize, seg, small)
                b.prev = prev
                if prev is not None:
                    prev.next = b
                if allocated:
                    b.allocated = True
                    b.requested = bsize
                    self.allocated += bsize
                    self.requested += bsize
                    handle = self._next_handle
                    self._next_handle += 1
                    self._live[handle] = b
                    handles[real] = handle
                prev = b
                offset += bsize
                real += bsize
            b2 = prev
            while b2 is not None:
                if not b2.allocated:
                    pool.add(b2)
                b2 = b2.prev
            self._next_addr += size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self.peak_requested = max(self.peak_requested, self.requested)
        return handles

    def _seed_expandable(self, segments: list[list[Any]]) -> dict[int, int]:
        """:meth:`seed` with expandable segments: a pool's segments (PyTorch's snapshot gives
        each stretch of mapped pages as one) are the stretches of one expandable segment,
        unmapped between them and after the last; its first stretch is taken to begin it."""
        handles: dict[int, int] = {}
        pools = [
            sorted((s for s in segments if (s[3] == "small") == small), key=lambda s: s[0])
            for small in (True, False)
        ]
        # the pools' segments in the order of their addresses, as they were made
        for stretches in sorted((p for p in pools if p), key=lambda p: p[0][0]):
            small = stretches[0][3] == "small"
            pool = self._small if small else self._large
            first = self._new_expandable(small)  # the segment, all of it unmapped
            base, real0, span = first.addr, stretches[0][0], first.size
            chain: list[_Block] = []
            end = 0  # the offset the stretches reach
            for addr, size, _stream, _pool, blocks in stretches:
                offset = addr - real0
                if offset > end:
                    chain.append(_Block(base + end, offset - end, first.seg, small, False))
                for bsize, allocated in blocks:
                    b = _Block(base + offset, bsize, first.seg, small)
                    if allocated:
                        b.allocated = True
                        b.requested = bsize
                        self.allocated += bsize
                        self.requested += bsize
                        handles[real0 + offset] = self._next_handle
                        self._live[self._next_handle] = b
                        self._next_handle += 1
                    chain.append(b)
                    offset += bsize
                end = offset
                self._segments[first.seg] += size
                self.reserved += size
            if span > end:
                chain.append(_Block(base + end, span - end, first.seg, small, False))
            for prev, b in zip([None, *chain], chain, strict=False):
                b.prev = prev
                if prev is not None:
                    prev.next = b
                if not b.mapped:
                    pool.add_unmapped(b)
                elif not b.allocated:
                    pool.add(b)
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self.peak_requested = max(self.peak_requested, self.requested)
        return handles

    @property
    def inactive_split(self) -> int:
        """Free bytes in segments that are split (cached but not usable as a whole)."""
        return sum(
            b.size
            for pool in (self._small, self._large)
            for b in pool.blocks.values()
            if b.is_split and b.seg not in self._expandable  # as PyTorch counts it
        )

    @property
    def segments(self) -> int:
        return len(self._segments)

    def stats(self) -> dict[str, Any]:
        return {
            "allocated": self.allocated,
            "reserved": self.reserved,
            "requested": self.requested,
            "peak_allocated": self.peak_allocated,
            "peak_reserved": self.peak_reserved,
            "peak_requested": self.peak_requested,
            "inactive_split": self.inactive_split,
            "segments": self.segments,
            "alloc_retries": self.alloc_retries,
            "ooms": self.ooms,
        }

    # -- rules --------------------------------------------------------------------

    def _find(self, pool: _Pool, size: int) -> _Block | None:
        block = pool.best_fit(size)
        limit = self.config.max_split_size
        if block is None or limit is None:
            return block
        # Oversize blocks are kept for oversize requests within one large buffer of them.
        if size < limit and block.size >= limit:
            return None
        if size >= limit and block.size >= size + self.config.large_buffer:
            return None
        return block

    def _new_segment(self, size: int, small: bool, nbytes: int) -> _Block:
        seg_size = self.config.segment_size(size)
        cap = self.config.capacity
        if cap is not None and self.reserved + seg_size > cap:
            self.empty_cache()
            self.alloc_retries += 1
            if self.reserved + seg_size > cap:
                self.ooms += 1
                raise AllocatorOutOfMemory(nbytes, self.reserved, cap)
        seg = self._next_segment
        self._next_segment += 1
        self._segments[seg] = seg_size
        self._segment_addr[seg] = self._next_addr
        self.reserved += seg_size
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        if self._record:
            self.history.append(("segment_alloc", self._next_addr, seg_size))
        block = _Block(self._next_addr, seg_size, seg, small)
        self._next_addr += seg_size
        return block

    # -- expandable segments ------------------------------------------------------

    def _grow(self, pool: _Pool, size: int, small: bool, nbytes: int) -> _Block:
        """A free block of at least ``size`` bytes made by mapping pages of the pool's
        expandable segment; past the capacity the cache's free pages are unmapped and the
        mapping retried once (an alloc retry), then it is an OOM."""
        block = self._try_grow(pool, size, small)
        if block is None:
            self.empty_cache()
            self.alloc_retries += 1
            block = self._try_grow(pool, size, small)
            if block is None:
                self.ooms += 1
                raise AllocatorOutOfMemory(nbytes, self.reserved, self.config.capacity or 0)
        return block

    def _try_grow(self, pool: _Pool, size: int, small: bool) -> _Block | None:
        cfg = self.config
        # PyTorch checks its cap against what a fixed segment for the request would take.
        if cfg.capacity is not None and self.reserved + cfg.segment_size(size) > cfg.capacity:
            return None
        block = self._room(pool, size, small)
        if not block.mapped:
            mapped = self._map(block, min(block.size, size), pool)
            if mapped is None:
                return None
            block = mapped
        while block.size < size:  # a free block, then an unmapped stretch after it
            after = block.next
            assert after is not None and not after.mapped
            mapped = self._map(after, min(size - block.size, after.size), pool)
            if mapped is None:
                return None
            block = mapped
        pool.remove(block)
        return block

    def _room(self, pool: _Pool, size: int, small: bool) -> _Block:
        """Where the expandable segment can serve ``size`` bytes: its lowest unmapped
        stretch with room (with the free block before it), else a new segment's."""
        for _, gap in pool.unmapped:
            first = gap
            if gap.prev is not None and not gap.prev.allocated:  # a free block before it
                first = gap.prev
            room = 0
            b: _Block | None = first
            while room < size and b is not None and not b.allocated:
                room += b.size
                b = b.next
            if room >= size:
                return first
        block = self._new_expandable(small)
        pool.add_unmapped(block)
        return block

    def _new_expandable(self, small: bool) -> _Block:
        """A new expandable segment for a pool: one unmapped block over its address space."""
        cfg = self.config
        page = cfg.small_buffer if small else cfg.large_buffer
        # The address space PyTorch reserves: the device's memory and an eighth.
        span = (cfg.capacity or 2**47) * 9 // 8
        span = -(-span // page) * page
        seg = self._next_segment
        self._next_segment += 1
        self._segments[seg] = 0
        self._expandable[seg] = page
        base = -(-self._next_addr // cfg.large_buffer) * cfg.large_buffer
        self._segment_addr[seg] = base
        self._next_addr = base + span
        return _Block(base, span, seg, small, mapped=False)

    def _map(self, gap: _Block, size: int, pool: _Pool) -> _Block | None:
        """Map the pages of ``gap`` (unmapped) that its first ``size`` bytes need; the block
        they make, merged with free neighbours and cached; None past the capacity."""
        page = self._expandable[gap.seg]
        mapped = -(-size // page) * page
        cap = self.config.capacity
        if cap is not None and self.reserved + mapped > cap:
            return None
        pool.remove_unmapped(gap)
        gap.mapped = True
        if mapped < gap.size:
            pool.add_unmapped(self._cut(gap, mapped, mapped=False))
        for neighbour in (gap.prev, gap.next):
            if neighbour is not None and not neighbour.allocated and neighbour.mapped:
                pool.remove(neighbour)
                self._merge(gap, neighbour)
        pool.add(gap)
        self._segments[gap.seg] += mapped
        self.reserved += mapped
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        if self._record:
            self.history.append(("segment_map", gap.addr, mapped))
        return gap

    def _unmap(self, block: _Block, pool: _Pool) -> None:
        """Unmap the whole pages of a free block of an expandable segment; the segment goes
        when none of it is mapped."""
        page = self._expandable[block.seg]
        begin = -(-block.addr // page) * page
        end = (block.addr + block.size) // page * page
        if begin >= end:
            return
        pool.remove(block)
        if begin > block.addr:  # the free bytes before the first whole page stay mapped
            head, block = block, self._cut(block, begin - block.addr)
            pool.add(head)
        if end < block.addr + block.size:  # and those after the last
            pool.add(self._cut(block, end - block.addr))
        block.mapped = False
        self._segments[block.seg] -= block.size
        self.reserved -= block.size
        if self._record:
            self.history.append(("segment_unmap", block.addr, block.size))
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.mapped:
                pool.remove_unmapped(neighbour)
                self._merge(block, neighbour)
        if block.prev is None and block.next is None:  # nothing of it is mapped
            del self._segments[block.seg], self._expandable[block.seg]
            del self._segment_addr[block.seg]
        else:
            pool.add_unmapped(block)

    def _maybe_split(self, block: _Block, size: int, pool: _Pool) -> None:
        cfg = self.config
        remaining = block.size - size
        if block.small or cfg.expandable_segments:
            split = remaining >= cfg.min_block
        else:
            limit = cfg.max_split_size
            split = (limit is None or size < limit) and remaining > cfg.small_size
        if split:
            pool.add(self._cut(block, size))

    @staticmethod
    def _cut(block: _Block, size: int, mapped: bool = True) -> _Block:
        """``block`` cut after its first ``size`` bytes: the rest, a block of its own
        (``mapped`` or not) linked after it, is returned."""
        rest = _Block(block.addr + size, block.size - size, block.seg, block.small, mapped)
        rest.prev, rest.next = block, block.next
        if block.next is not None:
            block.next.prev = rest
        block.next = rest
        block.size = size
        return rest

    @staticmethod
    def _merge(block: _Block, other: _Block) -> None:
        if other is block.prev:
            block.addr = other.addr
            block.prev = other.prev
            if other.prev is not None:
                other.prev.next = block
        else:
            block.next = other.next
            if other.next is not None:
                other.next.prev = block
        block.size += other.size
