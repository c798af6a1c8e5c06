"""The ids a manifest pass has given out, in about 10 bytes an id.

A pass over a 10M-line manifest must skip a record whose id an earlier record has, without
holding 10M strings (a ``set`` of short ids costs about 115 bytes an id, over 1 GB at 10M).
:class:`SeenIds` keeps each id's 64-bit fingerprint instead:

- the latest ids (at most ``chunk`` of them) in a ``set``;
- the older ones in one sorted ``array('q')`` (8 bytes an id), merged in by PyTorch's sort;
- a bitmap of 16 bits an old id in front of the sorted array, so that most new ids are
  answered by one byte lookup and only about one in sixteen is looked up by bisection.

A fingerprint is Python's 64-bit ``hash`` of the id (keyed per process, which is all a pass
needs). Two different ids share one with a chance of about n²/2⁶⁵: 3e-6 over a 10M-line
manifest; the later would then be skipped as a duplicate, and named in the pass's warning.

>>> seen = SeenIds()
>>> [seen.add(i) for i in ("a", "b", "a")]
[True, True, False]
>>> len(seen)
2
"""

from __future__ import annotations

from array import array
from bisect import bisect_left

__all__ = ["SeenIds"]

#: Old fingerprints read at once when the bitmap is rebuilt (bounds its extra memory).
_SLICE = 1 << 20


class SeenIds:
    """A set of ids that only grows, answering :meth:`add` with whether the id was new."""

    #: Bits of the old ids' bitmap per old id (rounded up to a power of two in all).
    bits_per_id = 16

    __slots__ = ("_bits", "_mask", "_old", "_recent", "chunk")

    def __init__(self, chunk: int = 1 << 18) -> None:
        #: Ids kept in the ``set`` before their fingerprints are merged into the sorted array.
        self.chunk = chunk
        self._recent: set[str] = set()
        self._old = array("q")
        self._bits = bytearray(1)
        self._mask = 7  # bits in the bitmap, less one

    def __len__(self) -> int:
        return len(self._recent) + len(self._old)

    def add(self, rid: str) -> bool:
        """Add ``rid``; True when it is new, False when an earlier call added it."""
        recent = self._recent
        if rid in recent:
            return False
        h = hash(rid)  # computed once: a str keeps its hash
        i = h & self._mask  # the low bits, also of a negative hash
        if self._bits[i >> 3] >> (i & 7) & 1 and self._in_old(h):
            return False
        recent.add(rid)
        if len(recent) >= self.chunk:
            self._merge()
        return True

    def _in_old(self, h: int) -> bool:
        old = self._old
        j = bisect_left(old, h)
        return j < len(old) and old[j] == h

    def _merge(self) -> None:
        """Move the recent fingerprints into the sorted array; set their bits in the bitmap."""
        import torch

        new = torch.frombuffer(array("q", map(hash, self._recent)), dtype=torch.int64)
        new = new.sort().values
        n, k = len(self._old), new.numel()
        merged = array("q", [0]) * (n + k)
        out = torch.frombuffer(merged, dtype=torch.int64)
        if n:
            old = torch.frombuffer(self._old, dtype=torch.int64)
            out[torch.searchsorted(old, new) + torch.arange(k)] = new
            # Each old fingerprint moves up by the new ones below it; a slice at a time, so
            # that the merge needs the new array and little more.
            for start in range(0, n, _SLICE):
                part = old[start : start + _SLICE]
                moved = torch.searchsorted(new, part)
                moved += torch.arange(start, start + part.numel())
                out.index_copy_(0, moved, part)
            del old, part, moved
        else:
            out.copy_(new)
        self._old = merged
        self._recent = set()

        bits = 8
        while bits < (n + k) * self.bits_per_id:
            bits *= 2
        if bits != self._mask + 1:  # grown: every old id's bit, in the larger bitmap
            self._bits = bytearray(bits // 8)
            self._mask = bits - 1
            self._set_bits(out)
        else:
            self._set_bits(new)

    def _set_bits(self, values: object) -> None:
        import torch

        assert isinstance(values, torch.Tensor)
        bitmap = torch.frombuffer(self._bits, dtype=torch.uint8)
        for part in values.split(_SLICE):
            index = torch.unique(part & self._mask)
            add = torch.zeros_like(bitmap)
            # Distinct bits of one byte are distinct powers of two: their sum is their OR.
            add.index_add_(0, index >> 3, (1 << (index & 7)).to(torch.uint8))
            bitmap.bitwise_or_(add)
