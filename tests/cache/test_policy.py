"""Eviction policies: their orders, checked against brute-force models of the same rules."""

from __future__ import annotations

import copy
import random
from collections.abc import Hashable

import pytest

from vramctl.cache import LFU, LRU, POLICIES, SLRU, make_policy

# -- brute-force models: lists and counters, every operation O(n) ---------------------


class RefLRU:
    def __init__(self) -> None:
        self.order: list[Hashable] = []

    def add(self, key: Hashable) -> None:
        if key in self.order:
            self.order.remove(key)
        self.order.append(key)

    def touch(self, key: Hashable) -> None:
        if key in self.order:
            self.add(key)

    def remove(self, key: Hashable) -> None:
        if key in self.order:
            self.order.remove(key)

    def victim(self) -> Hashable | None:
        return self.order[0] if self.order else None

    def keys(self) -> set[Hashable]:
        return set(self.order)


class RefLFU:
    """Fewest uses first; among equal counts, the one whose last use is oldest."""

    def __init__(self) -> None:
        self.count: dict[Hashable, int] = {}
        self.last: dict[Hashable, int] = {}
        self.clock = 0

    def add(self, key: Hashable) -> None:
        if key in self.count:
            self.touch(key)
            return
        self.clock += 1
        self.count[key] = 1
        self.last[key] = self.clock

    def touch(self, key: Hashable) -> None:
        if key in self.count:
            self.clock += 1
            self.count[key] += 1
            self.last[key] = self.clock

    def remove(self, key: Hashable) -> None:
        self.count.pop(key, None)
        self.last.pop(key, None)

    def victim(self) -> Hashable | None:
        if not self.count:
            return None
        return min(self.count, key=lambda k: (self.count[k], self.last[k]))

    def keys(self) -> set[Hashable]:
        return set(self.count)


class RefSLRU:
    """Probation and protected lists, oldest first; a second use moves a key to protected,
    which holds at most ``max(1, int(fraction * all keys))`` (its oldest fall back to the
    newest end of probation); victims come from probation first."""

    def __init__(self, fraction: float = 0.8) -> None:
        self.fraction = fraction
        self.probation: list[Hashable] = []
        self.protected: list[Hashable] = []

    def add(self, key: Hashable) -> None:
        if key in self.probation or key in self.protected:
            self.touch(key)
        else:
            self.probation.append(key)

    def touch(self, key: Hashable) -> None:
        if key in self.protected:
            self.protected.remove(key)
            self.protected.append(key)
        elif key in self.probation:
            self.probation.remove(key)
            self.protected.append(key)
            limit = max(1, int(self.fraction * (len(self.probation) + len(self.protected))))
            while len(self.protected) > limit:
                self.probation.append(self.protected.pop(0))

    def remove(self, key: Hashable) -> None:
        for seg in (self.probation, self.protected):
            if key in seg:
                seg.remove(key)

    def victim(self) -> Hashable | None:
        for seg in (self.probation, self.protected):
            if seg:
                return seg[0]
        return None

    def keys(self) -> set[Hashable]:
        return set(self.probation) | set(self.protected)


REFERENCES = {"lru": RefLRU, "lfu": RefLFU, "slru": RefSLRU}


def eviction_order(policy: object) -> list[Hashable]:
    """Every key, in the order the policy would evict them (drains a copy)."""
    p = copy.deepcopy(policy)
    out = []
    while (v := p.victim()) is not None:  # type: ignore[attr-defined]
        out.append(v)
        p.remove(v)  # type: ignore[attr-defined]
    return out


def check_lfu_structure(p: LFU) -> None:
    """The constant-time LFU's buckets and their linked list agree with its counts."""
    counts = set(p._count.values())
    assert set(p._buckets) == counts
    assert all(p._buckets[n] for n in p._buckets), "an empty bucket was kept"
    for key, n in p._count.items():
        assert key in p._buckets[n]
    assert sum(len(b) for b in p._buckets.values()) == len(p._count)
    # The linked list: every count with a bucket once, in increasing order.
    seen, prev, node = [], None, p._head
    while node is not None:
        assert p._prev[node] == prev
        seen.append(node)
        prev, node = node, p._next[node]
    assert seen == sorted(counts)
    assert set(p._next) == set(p._prev) == counts


# -- the orders ---------------------------------------------------------------------


def test_lru_evicts_the_least_recently_used() -> None:
    p = LRU()
    for k in "abcd":
        p.add(k)
    assert p.victim() == "a"
    p.touch("a")
    assert eviction_order(p) == ["b", "c", "d", "a"]
    p.add("b")  # adding a key it holds is a use
    assert eviction_order(p) == ["c", "d", "a", "b"]
    p.remove("c")
    p.touch("zzz")  # a key it does not hold: nothing happens
    assert "zzz" not in p and "c" not in p
    assert eviction_order(p) == ["d", "a", "b"]
    assert len(p) == 3


def test_lfu_evicts_the_least_used_and_breaks_ties_by_recency() -> None:
    p = LFU()
    for k in "abc":
        p.add(k)
    p.touch("a")
    p.touch("b")  # a and b: 2 uses, a's last use the older; c: 1 use
    assert eviction_order(p) == ["c", "a", "b"]
    p.touch("a")  # a: 3 uses
    assert eviction_order(p) == ["c", "b", "a"]
    p.remove("c")
    assert p.victim() == "b"
    p.touch("b")
    p.touch("b")  # b: 4 uses
    assert eviction_order(p) == ["a", "b"]
    p.add("d")  # a newcomer has the fewest uses
    assert p.victim() == "d"
    check_lfu_structure(p)


def test_slru_protects_keys_used_twice_against_a_scan() -> None:
    capacity = 10

    def run(policy: object) -> set[str]:
        held: set[str] = set()

        def use(key: str) -> None:
            if key in held:
                policy.touch(key)  # type: ignore[attr-defined]
                return
            policy.add(key)  # type: ignore[attr-defined]
            held.add(key)
            while len(held) > capacity:
                victim = policy.victim()  # type: ignore[attr-defined]
                policy.remove(victim)  # type: ignore[attr-defined]
                held.remove(victim)

        for i in range(capacity):  # a full cache of keys used once
            use(f"cold{i}")
        hot = [f"hot{i}" for i in range(4)]
        for _ in range(2):
            for k in hot:
                use(k)
        for i in range(100):  # a scan: each key used once
            use(f"scan{i}")
        return {k for k in hot if k in held}

    assert run(SLRU()) == {f"hot{i}" for i in range(4)}
    assert run(LRU()) == set()  # what the scan does to plain LRU


def test_slru_protected_segment_is_bounded() -> None:
    p = SLRU(protected=0.5)
    for k in range(6):
        p.add(k)
    for k in range(6):
        p.touch(k)  # each used twice: at most 3 stay protected
    assert len(p._protected) == 3 and len(p._probation) == 3
    # The oldest protected keys fell back to probation, in order: evicted first.
    assert eviction_order(p) == [0, 1, 2, 3, 4, 5]


def test_make_policy_names() -> None:
    assert isinstance(make_policy("lru"), LRU)
    assert isinstance(make_policy(" LFU "), LFU)
    assert isinstance(make_policy("lru_freq"), SLRU)
    assert isinstance(make_policy("slru"), SLRU)
    assert {make_policy(n).name for n in POLICIES} == set(POLICIES)
    with pytest.raises(ValueError, match="policy='fifo'"):
        make_policy("fifo")
    with pytest.raises(ValueError, match="protected"):
        SLRU(protected=1.0)


@pytest.mark.parametrize("name", POLICIES)
def test_an_empty_policy_has_no_victim(name: str) -> None:
    p = make_policy(name)
    assert p.victim() is None and len(p) == 0
    p.remove("absent")
    p.touch("absent")
    p.add(("t", 1))
    assert p.victim() == ("t", 1)
    p.remove(("t", 1))
    assert p.victim() is None and len(p) == 0


@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_policy_matches_its_brute_force_model(name: str, seed: int) -> None:
    rng = random.Random(seed)
    p = make_policy(name)
    ref = REFERENCES[name]()
    keys = list(range(30))
    for step in range(3000):
        key = rng.choice(keys)
        op = rng.random()
        if op < 0.35:
            p.add(key)
            ref.add(key)
        elif op < 0.75:
            p.touch(key)
            ref.touch(key)
        elif op < 0.9:
            p.remove(key)
            ref.remove(key)
        else:  # evict, as a tier does
            v = p.victim()
            assert v == ref.victim()
            if v is not None:
                p.remove(v)
                ref.remove(v)
        assert p.victim() == ref.victim(), step
        assert len(p) == len(ref.keys())
        assert {k for k in keys if k in p} == ref.keys()
        if isinstance(p, LFU):
            check_lfu_structure(p)
        if step % 100 == 0:
            assert eviction_order(p) == eviction_order(ref)


def test_lfu_structures_stay_small_under_many_uses() -> None:
    # O(1) per operation: one bucket per distinct count, however many uses there were.
    p = LFU()
    for k in range(5):
        p.add(k)
    for _ in range(2000):
        for k in range(5):
            p.touch(k)
    check_lfu_structure(p)
    assert len(p._buckets) == 1 and p._count[0] == 2001
    p.touch(3)
    check_lfu_structure(p)
    assert len(p._buckets) == 2 and eviction_order(p) == [0, 1, 2, 4, 3]
