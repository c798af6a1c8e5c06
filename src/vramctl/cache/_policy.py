"""Eviction orders for one tier, each O(1) per operation.

A policy holds the keys a tier may evict, in the order it would evict them:
:meth:`~EvictionPolicy.victim` names the next one without removing it. Keys that may
not be evicted (pinned by the user, or in the middle of a move) are taken out
of the policy while they are so, which keeps every operation O(1).

>>> from vramctl.cache import make_policy
>>> p = make_policy("lru")
>>> for k in "abc":
...     p.add(k)
>>> p.touch("a")
>>> p.victim()
'b'
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Protocol

__all__ = ["LFU", "LRU", "POLICIES", "SLRU", "EvictionPolicy", "make_policy"]


class EvictionPolicy(Protocol):
    """What a tier's eviction order does: add, touch (a use), remove, name the next victim."""

    name: str

    def add(self, key: Hashable) -> None: ...

    def touch(self, key: Hashable) -> None: ...

    def remove(self, key: Hashable) -> None: ...

    def victim(self) -> Hashable | None: ...

    def __len__(self) -> int: ...

    def __contains__(self, key: object) -> bool: ...


class LRU:
    """Least recently used first: an ordered dict, oldest use at the front."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def add(self, key: Hashable) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: Hashable) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def victim(self) -> Hashable | None:
        return next(iter(self._order), None)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order


class LFU:
    """Least frequently used first (the least recently used among equals).

    Counts uses since the key arrived in this tier, in buckets of equal counts
    (an ordered dict each) linked in order of their counts, lowest first:
    every operation is O(1) (Shah, Mitra and Matani's constant-time LFU).
    """

    name = "lfu"

    def __init__(self) -> None:
        self._count: dict[Hashable, int] = {}
        self._buckets: dict[int, OrderedDict[Hashable, None]] = {}
        # The counts that have a bucket, as a doubly linked list: lowest at _head.
        self._next: dict[int, int | None] = {}
        self._prev: dict[int, int | None] = {}
        self._head: int | None = None

    def _link_after(self, after: int | None, n: int) -> None:
        nxt = self._head if after is None else self._next[after]
        self._prev[n], self._next[n] = after, nxt
        if after is None:
            self._head = n
        else:
            self._next[after] = n
        if nxt is not None:
            self._prev[nxt] = n
        self._buckets[n] = OrderedDict()

    def _unlink(self, n: int) -> None:
        prev, nxt = self._prev.pop(n), self._next.pop(n)
        if prev is None:
            self._head = nxt
        else:
            self._next[prev] = nxt
        if nxt is not None:
            self._prev[nxt] = prev
        del self._buckets[n]

    def add(self, key: Hashable) -> None:
        if key in self._count:
            self.touch(key)
            return
        self._count[key] = 1
        if 1 not in self._buckets:
            self._link_after(None, 1)
        self._buckets[1][key] = None

    def touch(self, key: Hashable) -> None:
        n = self._count.get(key)
        if n is None:
            return
        if n + 1 not in self._buckets:
            self._link_after(n, n + 1)
        self._buckets[n + 1][key] = None
        self._count[key] = n + 1
        del self._buckets[n][key]
        if not self._buckets[n]:
            self._unlink(n)

    def remove(self, key: Hashable) -> None:
        n = self._count.pop(key, None)
        if n is None:
            return
        del self._buckets[n][key]
        if not self._buckets[n]:
            self._unlink(n)

    def victim(self) -> Hashable | None:
        if self._head is None:
            return None
        return next(iter(self._buckets[self._head]))

    def __len__(self) -> int:
        return len(self._count)

    def __contains__(self, key: object) -> bool:
        return key in self._count


class SLRU:
    """LRU with frequency: a segmented LRU.

    New keys enter a probation segment; a key used again there moves to the
    protected segment (at most ``protected`` of the keys, 0.8 by default),
    whose least recent key falls back to probation when it is full. Victims
    come from probation first, so a burst of keys used once cannot push out
    the keys used again and again. Every operation is O(1).
    """

    name = "slru"

    def __init__(self, protected: float = 0.8) -> None:
        if not 0.0 < protected < 1.0:
            raise ValueError(f"protected={protected!r}: a fraction between 0 and 1")
        self.protected = protected
        self._probation: OrderedDict[Hashable, None] = OrderedDict()
        self._protected: OrderedDict[Hashable, None] = OrderedDict()

    def add(self, key: Hashable) -> None:
        if key in self._probation or key in self._protected:
            self.touch(key)
            return
        self._probation[key] = None

    def touch(self, key: Hashable) -> None:
        if key in self._protected:
            self._protected.move_to_end(key)
            return
        if key not in self._probation:
            return
        del self._probation[key]
        self._protected[key] = None
        limit = max(1, int(self.protected * len(self)))
        while len(self._protected) > limit:
            old, _ = self._protected.popitem(last=False)
            self._probation[old] = None  # the most recent end of probation

    def remove(self, key: Hashable) -> None:
        self._probation.pop(key, None)
        self._protected.pop(key, None)

    def victim(self) -> Hashable | None:
        for segment in (self._probation, self._protected):
            if segment:
                return next(iter(segment))
        return None

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected)

    def __contains__(self, key: object) -> bool:
        return key in self._probation or key in self._protected


#: The policy names :func:`make_policy` takes ("lru-freq" is another name for "slru").
POLICIES = ("lru", "lfu", "slru")


def make_policy(name: str) -> EvictionPolicy:
    """A new, empty policy by name: ``"lru"``, ``"lfu"``, or ``"slru"`` (``"lru-freq"``)."""
    key = name.strip().lower().replace("_", "-")
    if key == "lru":
        return LRU()
    if key == "lfu":
        return LFU()
    if key in ("slru", "lru-freq"):
        return SLRU()
    raise ValueError(
        f"policy={name!r}: use 'lru' (least recently used), 'lfu' (least frequently "
        "used) or 'slru' (LRU with frequency: keys used twice are protected)"
    )
