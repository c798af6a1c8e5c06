"""``BucketingSampler``: duration buckets under a hard budget, streamed.

Items arrive one at a time (from a :class:`~vramctl.batching.Manifest` or any
iterable of :class:`~vramctl.batching.Item`). Each goes to the bucket of its
duration, where one batch is open. Before it joins, the sampler asks the
budget whether the batch with it would still be within: if not, the open batch
is emitted first and the item starts the next one. So **no batch is ever over
the budget**, not even by the one long item that arrives last (Lhotse's
dynamic samplers keep the item that crosses the budget). An item over the
budget on its own is emitted alone, marked ``oversize``, for the caller's
split or chunk path, and counted: never dropped.

Bucket edges are given, or estimated from the first ``edge_sample`` items so
that each bucket holds the same total duration. Memory is the open batches and
that prefix, whatever the length of the stream.

>>> from vramctl.batching import Item, PaddedDuration
>>> items = [Item(f"u{i}", d, index=i) for i, d in enumerate([3.0, 9.0, 3.2, 8.8, 3.1, 9.1])]
>>> s = BucketingSampler(items, PaddedDuration(10.0), edges=[5.0])
>>> [[i.id for i in b.items] for b in s]
[['u1'], ['u3'], ['u0', 'u2', 'u4'], ['u5']]
>>> s.stats.overruns, round(s.stats.padding, 3)
(0, 0.008)
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from vramctl.batching._adaptive import BatchingError
from vramctl.batching._budget import Budget
from vramctl.batching._manifest import Item

__all__ = ["Batch", "BucketingSampler", "SamplerStats", "duration_edges"]

_STATE_VERSION = 1


def duration_edges(durations: Iterable[float], num_buckets: int) -> list[float]:
    """Inner bucket edges that give each bucket the same total duration.

    Returns ``num_buckets - 1`` increasing edges (fewer when durations repeat);
    an item of duration ``d`` goes to bucket ``bisect_right(edges, d)``.

    >>> duration_edges([1, 2, 3, 4, 5, 6, 7, 8], 3)
    [6.0, 8.0]
    """
    if num_buckets < 1:
        raise BatchingError(f"num_buckets must be at least 1, got {num_buckets}")
    values = sorted(float(d) for d in durations)
    if not values or num_buckets == 1:
        return []
    step = sum(values) / num_buckets
    edges: list[float] = []
    acc, k, pending, prev = 0.0, 1, False, values[0]
    for d in values:
        if pending and d > prev:  # the bucket that filled ends below this duration
            edges.append(d)
            pending = False
        acc += d
        if acc >= k * step and len(edges) < num_buckets - 1:
            pending = True
            while acc >= k * step:
                k += 1
        prev = d
    return edges


@dataclass
class Batch:
    """A batch of items, all from one duration bucket."""

    items: list[Item]
    #: The longest item's duration: what the batch is padded to.
    longest: float
    bucket: int
    #: One item over the budget on its own (for a split or chunk path).
    oversize: bool = False
    #: The budget's measure of this batch.
    cost: float = 0.0

    def __len__(self) -> int:
        return len(self.items)

    @property
    def duration(self) -> float:
        """Seconds of real audio."""
        return sum(i.duration for i in self.items)

    @property
    def padded_duration(self) -> float:
        """Seconds once padded to the longest: ``len(batch) * longest``."""
        return len(self.items) * self.longest

    @property
    def padding(self) -> float:
        """The share of the padded batch that is padding."""
        padded = self.padded_duration
        return 1 - self.duration / padded if padded else 0.0


@dataclass
class SamplerStats:
    """What a pass has emitted so far."""

    items: int = 0
    batches: int = 0
    #: Seconds of audio, and seconds once padded.
    duration: float = 0.0
    padded_duration: float = 0.0
    #: Batches whose cost was over the budget's limit (0 by construction; counted anyway).
    overruns: int = 0
    #: The largest cost / limit of any batch.
    worst_ratio: float = 0.0
    #: Items over the budget on their own, emitted alone.
    oversize: int = 0
    #: Items per bucket.
    per_bucket: list[int] = field(default_factory=list)

    @property
    def padding(self) -> float:
        """The share of all padded seconds that are padding."""
        return 1 - self.duration / self.padded_duration if self.padded_duration else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "items": self.items,
            "batches": self.batches,
            "duration_s": round(self.duration, 3),
            "padded_duration_s": round(self.padded_duration, 3),
            "padding_pct": round(100 * self.padding, 3),
            "budget_overruns": self.overruns,
            "worst_overrun_ratio": round(self.worst_ratio, 4),
            "oversize": self.oversize,
        }


class _Open:
    """One bucket's open batch."""

    __slots__ = ("cap", "items", "longest")

    def __init__(self) -> None:
        self.items: list[Item] = []
        self.longest = 0.0
        self.cap = 0


class BucketingSampler:
    """Batches of similar-length items, each within ``budget``, from a stream.

    ``edges`` are the inner bucket edges in seconds; without them
    ``num_buckets`` edges are estimated from the first ``edge_sample`` items
    (equal total duration per bucket). ``shuffle`` draws items through a
    buffer of ``buffer_size`` with a seeded generator, so a pass is
    reproducible; batches leave in the order they fill. Iterating again starts a
    new pass (with ``seed + pass``).

    ``state_dict()`` records how far the current pass got (items consumed,
    open batches, the shuffle buffer, the generator); ``load_state_dict()`` on
    a sampler over the same stream resumes after the last batch emitted.
    """

    def __init__(
        self,
        items: Iterable[Item],
        budget: Budget,
        *,
        edges: Sequence[float] | None = None,
        num_buckets: int = 50,
        edge_sample: int = 20_000,
        shuffle: bool = False,
        buffer_size: int = 10_000,
        seed: int = 0,
    ) -> None:
        if not isinstance(budget, Budget):
            raise BatchingError(
                f"budget must have limit, max_count(longest) and cost(count, longest); "
                f"got {type(budget).__name__}"
            )
        if edges is not None:
            edges = [float(e) for e in edges]
            if any(math.isnan(e) for e in edges):
                raise BatchingError(f"edges must be numbers, got {edges}")
            if any(b <= a for a, b in itertools.pairwise(edges)):
                raise BatchingError(f"edges must increase, got {edges}")
        if edge_sample < 1 or buffer_size < 1:
            raise BatchingError("edge_sample and buffer_size must be at least 1")
        self.source = items
        self.budget = budget
        self.edges: list[float] | None = list(edges) if edges is not None else None
        self.num_buckets = num_buckets if edges is None else len(edges) + 1
        if self.num_buckets < 1:
            raise BatchingError(f"num_buckets must be at least 1, got {num_buckets}")
        self.edge_sample = edge_sample
        self.shuffle = shuffle
        self.buffer_size = buffer_size
        self.seed = seed
        self.stats = SamplerStats()
        self._pass = 0
        self._consumed = 0
        self._resume: dict[str, Any] | None = None
        self._open: list[_Open] = []
        self._buffer: list[Item] = []
        #: The pass has read its whole stream and is emptying the (shuffled) buffer.
        self._draining = False
        self._rng = random.Random(seed)

    # -- iteration -----------------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        resume, self._resume = self._resume, None
        if resume is None:
            self._rng = random.Random(self.seed + self._pass)
            self._consumed = 0
            self._buffer = []
            self._draining = False
            self.stats = SamplerStats()
        self._pass += 1
        stream: Iterator[Item] = iter(self.source)
        if self._consumed:  # resuming: what was consumed is in the open batches or emitted
            stream = itertools.islice(stream, self._consumed, None)
        if self.edges is None:
            prefix = list(itertools.islice(stream, self.edge_sample))
            self.edges = duration_edges((i.duration for i in prefix), self.num_buckets)
            stream = itertools.chain(prefix, stream)
        edges = self.edges
        if resume is None or not self._open:
            self._open = [_Open() for _ in range(len(edges) + 1)]
        if len(self.stats.per_bucket) != len(self._open):
            self.stats.per_bucket = [0] * len(self._open)
        if self.shuffle:
            yield from self._batches(self._shuffled(stream), edges, counted=True)
        else:
            yield from self._batches(stream, edges, counted=False)

    def _shuffled(self, stream: Iterator[Item]) -> Iterator[Item]:
        buf, rng, size = self._buffer, self._rng, self.buffer_size
        for item in stream:
            self._consumed += 1
            if len(buf) < size:
                buf.append(item)
                continue
            j = rng.randrange(size)
            out, buf[j] = buf[j], item
            yield out
        if not self._draining:  # a pass resumed while draining has its buffer shuffled already
            rng.shuffle(buf)
            self._draining = True
        while buf:
            yield buf.pop()

    def _batches(
        self, source: Iterator[Item], edges: list[float], counted: bool
    ) -> Iterator[Batch]:
        """Batches from ``source``; unless it counts itself, count what it gives here.

        The count (``_consumed``) is whole at every yield, for :meth:`state_dict`.
        """
        budget, opened, stats = self.budget, self._open, self.stats
        per_bucket = stats.per_bucket
        find = bisect.bisect_right
        n = self._consumed
        for item in source:
            n += 1
            d = item.duration
            if not d > 0.0:  # NaN, zero or negative (a Manifest skips them; other sources may not)
                raise BatchingError(
                    f"item {item.id!r} (index {item.index}) has a duration of {d!r}: "
                    "durations must be positive numbers"
                )
            b = find(edges, d)
            slot = opened[b]
            per_bucket[b] += 1
            if d > slot.longest:
                cap = budget.max_count(d)
                if cap < 1:
                    stats.oversize += 1
                    if not counted:
                        self._consumed = n
                    yield self._emit([item], d, b, oversize=True)
                    continue
                if len(slot.items) < cap:
                    slot.longest, slot.cap = d, cap
                    slot.items.append(item)
                    continue
            elif len(slot.items) < slot.cap:
                slot.items.append(item)
                continue
            # The item would take the open batch over: close it, then the item opens the next.
            # (The state is whole before the yield: a state_dict taken here resumes exactly.)
            cap = budget.max_count(d)
            if cap < 1:  # a budget that is not monotone in the length: alone, as oversize
                stats.oversize += 1
                if not counted:
                    self._consumed = n
                yield self._emit([item], d, b, oversize=True)
                continue
            batch = self._close(slot, b)
            slot.items.append(item)
            slot.longest, slot.cap = d, cap
            if not counted:
                self._consumed = n
            yield batch
        if not counted:
            self._consumed = n
        for b, slot in enumerate(opened):
            if slot.items:
                yield self._close(slot, b)

    def _close(self, slot: _Open, bucket: int) -> Batch:
        batch = self._emit(slot.items, slot.longest, bucket)
        slot.items, slot.longest, slot.cap = [], 0.0, 0
        return batch

    def _emit(
        self, items: list[Item], longest: float, bucket: int, oversize: bool = False
    ) -> Batch:
        stats = self.stats
        cost = self.budget.cost(len(items), longest)
        limit = self.budget.limit
        stats.items += len(items)
        stats.batches += 1
        duration = sum(i.duration for i in items)
        stats.duration += duration
        stats.padded_duration += len(items) * longest
        if not oversize:
            ratio = cost / limit
            stats.worst_ratio = max(stats.worst_ratio, ratio)
            if ratio > 1 + 1e-9:
                stats.overruns += 1
        return Batch(items, longest, bucket, oversize, cost)

    # -- resuming ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """How far the current pass got: enough to resume after the last batch emitted."""
        return {
            "version": _STATE_VERSION,
            "pass": self._pass,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "buffer_size": self.buffer_size,
            "consumed": self._consumed,
            "draining": self._draining,
            "edges": self.edges,
            "open": [[_item_state(i) for i in slot.items] for slot in self._open],
            "buffer": [_item_state(i) for i in self._buffer],
            "rng": self._rng.getstate(),
            "stats": self.stats.to_dict() | {"per_bucket": list(self.stats.per_bucket)},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the next iteration goes on where it stopped.

        Refuses a state saved with another ``shuffle``, ``seed`` or ``buffer_size``
        (the order would differ, or the buffered items be lost), other bucket edges,
        or open batches that this sampler's budget does not allow.
        """
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            raise BatchingError("not a BucketingSampler state (or from another version)")
        keys = ("shuffle", "seed", "buffer_size") if self.shuffle else ("shuffle",)
        saved_order = {k: state[k] for k in keys if k in state}
        order = {"shuffle": self.shuffle, "seed": self.seed, "buffer_size": self.buffer_size}
        mine = {k: order[k] for k in keys}
        if any(mine[k] != v for k, v in saved_order.items()) or (
            state["buffer"] and not self.shuffle
        ):
            raise BatchingError(
                f"the state was saved with {saved_order}; this sampler has "
                f"{mine}: the order would differ"
            )
        edges = state["edges"]
        if self.edges is not None and edges is not None and list(edges) != self.edges:
            raise BatchingError("the saved state has other bucket edges than this sampler")
        opened = []
        for b, saved in enumerate(state["open"]):
            slot = _Open()
            slot.items = [_item_from(s) for s in saved]
            if slot.items:
                slot.longest = max(i.duration for i in slot.items)
                slot.cap = self.budget.max_count(slot.longest)
                if len(slot.items) > slot.cap:
                    raise BatchingError(
                        f"the saved open batch of bucket {b} holds {len(slot.items)} items of up "
                        f"to {slot.longest:g} s; this sampler's budget allows {slot.cap}: "
                        "resume with the budget the state was saved with"
                    )
            opened.append(slot)
        if edges is not None:
            self.edges = list(edges)
        self._open = opened
        if int(state["pass"]) == 0:  # saved before the first pass began: start it afresh
            self._pass, self._resume = 0, None
            return
        self._pass = int(state["pass"]) - 1
        self._consumed = int(state["consumed"])
        self._draining = bool(state.get("draining", False))
        self._buffer = [_item_from(s) for s in state["buffer"]]
        rng = state["rng"]
        self._rng = random.Random()
        self._rng.setstate((rng[0], tuple(rng[1]), rng[2]))
        s = state["stats"]
        self.stats = SamplerStats(
            items=s["items"],
            batches=s["batches"],
            duration=s["duration_s"],
            padded_duration=s["padded_duration_s"],
            overruns=s["budget_overruns"],
            worst_ratio=s["worst_overrun_ratio"],
            oversize=s["oversize"],
            per_bucket=list(s["per_bucket"]),
        )
        self._resume = state


def _item_state(i: Item) -> list[Any]:
    if i.data is not None:
        raise BatchingError(
            f"item {i.id} holds in-memory data: a state_dict can only name items read from a "
            "manifest"
        )
    return [i.id, i.duration, i.path, i.index, i.offset, i.parent, i.chunk, i.extra]


def _item_from(s: list[Any]) -> Item:
    return Item(s[0], s[1], s[2], s[3], s[4], None, s[5], s[6], s[7])
