"""A bounded pool of host memory: pinned where the device is a CUDA GPU.

``torch.autograd.graph.save_on_cpu(pin_memory=True)`` and ad hoc ``pin_memory()``
calls pin as much as they are given; PyTorch's host allocator also rounds each
pinned allocation up to a power of two and keeps freed blocks for reuse. The
pool instead holds a few large segments, never more bytes than its capacity
counted as the allocator holds them, and places each block inside one
(first fit, freed neighbours merged). A block is a byte range viewed as any
dtype and shape.

>>> from vramctl.cache import HostPool
>>> pool = HostPool(4096, pinned=False)
>>> block = pool.alloc(1000)
>>> block.size, pool.used, pool.held <= pool.capacity
(1024, 1024, True)
>>> pool.free(block); pool.used
0
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch

__all__ = ["ALIGN", "Block", "HostPool", "aligned"]

#: Every block starts on, and is a multiple of, this many bytes (any dtype is aligned).
ALIGN = 512

#: The default size of a segment, the unit the pool takes from the host.
SEGMENT = 64 * 2**20


def aligned(n: int) -> int:
    """The bytes a block for ``n`` bytes takes: whole units of ALIGN, at least one."""
    return max(ALIGN, -(-n // ALIGN) * ALIGN)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


class _Segment:
    def __init__(self, size: int, pinned: bool) -> None:
        self.size = size
        self.buffer = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
        self.free_at: dict[int, int] = {0: size}  # start -> size of each free range
        self.free_end: dict[int, int] = {size: 0}  # end -> start
        self.used = 0

    def alloc(self, n: int) -> int | None:
        for start, size in self.free_at.items():
            if size >= n:
                del self.free_at[start]
                del self.free_end[start + size]
                if size > n:
                    self.free_at[start + n] = size - n
                    self.free_end[start + size] = start + n
                self.used += n
                return start
        return None

    def free(self, start: int, n: int) -> None:
        self.used -= n
        end = start + n
        if start in self.free_end:  # merge with the free range before
            before = self.free_end.pop(start)
            del self.free_at[before]
            start = before
        if end in self.free_at:  # and with the one after
            after = self.free_at.pop(end)
            del self.free_end[end + after]
            end += after
        self.free_at[start] = end - start
        self.free_end[end] = start

    def largest(self) -> int:
        return max(self.free_at.values(), default=0)


@dataclass(eq=False)
class Block:
    """``size`` bytes at ``offset`` of one of a pool's segments."""

    segment: _Segment
    offset: int
    size: int

    def bytes(self, n: int | None = None) -> torch.Tensor:
        """The block's first ``n`` bytes (all by default) as a uint8 tensor."""
        return self.segment.buffer[self.offset : self.offset + (self.size if n is None else n)]

    def view(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The block's start as a tensor of ``dtype`` and ``shape`` (sharing its memory)."""
        numel = 1
        for s in shape:
            numel *= s
        raw = self.bytes(numel * dtype.itemsize)
        return raw.view(dtype).view(shape)


class HostPool:
    """At most ``capacity`` bytes of host memory, in segments of ``segment`` bytes.

    ``pinned`` pins the segments (page-locked memory: copies to and from a CUDA
    device run at the link's speed and can be asynchronous); it needs a CUDA
    device. :meth:`alloc` returns None when no segment has room and no new one
    may be taken: the caller frees blocks and tries again.
    """

    def __init__(self, capacity: int, *, pinned: bool, segment: int = SEGMENT) -> None:
        if capacity < 0:
            raise ValueError(f"capacity={capacity}: a pool holds 0 bytes or more")
        self.capacity = int(capacity)
        self.pinned = pinned
        self.segment = max(ALIGN, int(segment))
        self._segments: list[_Segment] = []
        self._lock = threading.Lock()
        #: Bytes the segments take (as the host allocator holds them), and in blocks.
        self.held = 0
        self.used = 0
        self.peak_held = 0

    def _cost(self, size: int) -> int:
        # PyTorch's pinned-memory allocator rounds each allocation up to a power of two.
        return _pow2(size) if self.pinned else size

    def _new_segment(self, n: int) -> _Segment | None:
        room = self.capacity - self.held
        size = max(n, min(self.segment, room // ALIGN * ALIGN))
        if self.pinned:
            size = _pow2(size)
            while size > room and size // 2 >= n:
                size //= 2
        size = aligned(size) if not self.pinned else size
        if size < n or self._cost(size) > room:
            return None
        seg = _Segment(size, self.pinned)
        self._segments.append(seg)
        self.held += self._cost(size)
        self.peak_held = max(self.peak_held, self.held)
        return seg

    def _drop_empty(self) -> bool:
        empty = [s for s in self._segments if s.used == 0]
        for seg in empty:
            self._segments.remove(seg)
            self.held -= self._cost(seg.size)
        if empty and self.pinned:
            # Hand the pinned pages back rather than keep them in PyTorch's host cache.
            with contextlib.suppress(AttributeError, RuntimeError):
                torch._C._host_emptyCache()
        return bool(empty)

    def fits(self, n: int) -> bool:
        """Whether a block of ``n`` bytes could ever be had (the pool empty)."""
        return self._cost(aligned(n)) <= self.capacity

    def alloc(self, n: int) -> Block | None:
        """A block of at least ``n`` bytes (a multiple of :data:`ALIGN`), or None."""
        size = aligned(n)
        with self._lock:
            for seg in self._segments:
                start = seg.alloc(size)
                if start is not None:
                    self.used += size
                    return Block(seg, start, size)
            new = self._new_segment(size)
            if new is None and self._drop_empty():
                new = self._new_segment(size)
            if new is None:
                return None
            start = new.alloc(size)
            assert start is not None
            self.used += size
            return Block(new, start, size)

    def free(self, block: Block) -> None:
        """Give ``block`` back to its segment."""
        with self._lock:
            block.segment.free(block.offset, block.size)
            self.used -= block.size

    def largest_free(self) -> int:
        """The largest block :meth:`alloc` could return now without a new segment."""
        with self._lock:
            return max((s.largest() for s in self._segments), default=0)

    def release(self) -> None:
        """Give back every segment with no block in it."""
        with self._lock:
            self._drop_empty()
