"""SeenIds: the compact set of ids a manifest pass has given out."""

from __future__ import annotations

import random

from vramctl.batching._ids import SeenIds


def test_it_answers_as_a_set_does_across_merges() -> None:
    seen = SeenIds(chunk=997)  # many merges, and a bitmap that grows several times
    ref: set[str] = set()
    rng = random.Random(7)
    for _ in range(60_000):
        rid = f"utt-{rng.randrange(40_000)}"
        assert seen.add(rid) == (rid not in ref), rid
        ref.add(rid)
    assert len(seen) == len(ref)
    # Every id, old (merged) and recent, is still known.
    assert not any(seen.add(rid) for rid in ref)


def test_it_holds_fingerprints_not_strings() -> None:
    seen = SeenIds(chunk=1000)
    for i in range(10_000):
        seen.add(f"a-rather-long-utterance-identifier-{i:06d}")
    assert len(seen._old) == 10_000 and not seen._recent
    # 8 bytes a fingerprint and 16 bits of bitmap an id, rounded up to a power of two.
    assert seen._old.itemsize * len(seen._old) == 80_000
    assert len(seen._bits) <= 2 * 2 * 10_000
