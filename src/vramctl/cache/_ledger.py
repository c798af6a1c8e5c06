"""The cache's books: what is where (each value's entry, each tier's eviction order) and how
many bytes each tier holds, may hold and has moved."""

from __future__ import annotations

import logging
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import torch

from vramctl._units import format_bytes
from vramctl.cache._codec import Layout
from vramctl.cache._policy import EvictionPolicy, make_policy
from vramctl.cache._pool import Block
from vramctl.cache._pool import aligned as _aligned

__all__ = ["TIERS", "Entry", "Ledger"]

log = logging.getLogger("vramctl.cache")

#: The tiers, fastest first.
TIERS = ("gpu", "host", "disk")


class Entry:
    """One value: its layout, the tier it is in and what it holds there."""

    __slots__ = (
        "below",
        "bf16",
        "charge",
        "dev",
        "encoded",
        "host",
        "key",
        "layout",
        "path",
        "pinned",
        "ready",
        "tier",
        "uses",
        "views",
    )

    def __init__(self, key: Hashable, layout: Layout, bf16: bool) -> None:
        self.key = key
        self.layout = layout
        self.bf16 = bf16
        self.tier = ""
        self.dev: list[torch.Tensor] | None = None
        self.host: list[Block] | None = None
        self.path: Path | None = None
        self.charge = 0  # bytes counted in the tier it is in
        self.pinned = False
        self.uses = 0
        self.ready: Any = None  # a CUDA event: the copy into its tier has finished
        self.views: list[torch.Tensor] | None = None  # the stored parts in its host blocks
        self.below = 0  # hits since it arrived in the host or disk tier
        self.encoded: str | None = None  # the key's JSON (None: not written reloadably)


class Ledger:
    """Each value's entry and each tier's eviction order, budget, limit and bytes: held,
    at the peak, moved in and out.

    ``cuda``: values on the device take the allocator's aligned blocks; ``compress_host``:
    the host tier keeps zstd parts compressed (else it decodes them).
    """

    def __init__(
        self, budget: dict[str, int], policy: str, *, cuda: bool, compress_host: bool
    ) -> None:
        self.budget = budget
        #: What each tier may hold now: its budget, or less while memory is short.
        self.limit = dict(budget)
        self.used = {t: 0 for t in TIERS}
        self.peak = {t: 0 for t in TIERS}
        self.bytes_in = {t: 0 for t in TIERS}
        self.bytes_out = {t: 0 for t in TIERS}
        self.budget_violations = 0
        self.entries: dict[Hashable, Entry] = {}
        self.policies: dict[str, EvictionPolicy] = {t: make_policy(policy) for t in TIERS}
        self.cuda = cuda
        self.compress_host = compress_host
        self._gets_since_aging = 0

    def charge(self, entry: Entry, tier: str) -> int:
        """What ``entry`` takes in ``tier`` (an estimate for the disk before it is written)."""
        metas = entry.layout.parts
        if tier == "gpu":
            return (
                sum(_aligned(m.nbytes) for m in metas)
                if self.cuda
                else sum(m.nbytes for m in metas)
            )
        if tier == "host" and not self.compress_host:  # zstd parts are decoded there
            return sum(
                _aligned(
                    m.numel * m.stored_dtype.itemsize if m.codec == "zstd" else m.stored_nbytes
                )
                for m in metas
            )
        stored = sum(_aligned(m.stored_nbytes or m.nbytes) for m in metas)
        return stored + (64 * 1024 if tier == "disk" else 0)

    def fits(self, entry: Entry, tier: str) -> bool:
        """Whether ``tier`` is in the cache and ``entry`` is within its limit."""
        return bool(self.budget[tier]) and self.charge(entry, tier) <= self.limit[tier]

    def account(self, tier: str, delta: int, *, moved: bool = True) -> None:
        """``delta`` bytes more (or fewer) in ``tier``; ``moved``: copied in or out."""
        self.used[tier] += delta
        self.peak[tier] = max(self.peak[tier], self.used[tier])
        if self.used[tier] > self.budget[tier]:
            self.budget_violations += 1
            log.error("the %s tier holds %d bytes over its budget", tier, self.used[tier])
        if moved and delta > 0:
            self.bytes_in[tier] += delta
        elif moved:
            self.bytes_out[tier] -= delta

    def admit(self, entry: Entry, tier: str) -> bool:
        """Whether ``entry`` should move up into ``tier`` on this hit: when it fits without
        moving anything out, or when it has been used more than the value it would push
        out first (TinyLFU's admission test), so that a hot value is not pushed out by a
        cooler one and the tier does not churn."""
        need = self.charge(entry, tier)
        if not self.budget[tier] or need > self.limit[tier]:
            return False
        if self.used[tier] + need <= self.limit[tier]:
            return True
        victim = self.policies[tier].victim()
        return victim is None or entry.uses > self.entries[victim].uses

    def age(self) -> None:
        """Halve every value's use count after ten gets per value: counts follow what is hot
        now, not what was once (amortized O(1) per get)."""
        self._gets_since_aging += 1
        if self._gets_since_aging >= 10 * max(16, len(self.entries)):
            self._gets_since_aging = 0
            for e in self.entries.values():
                e.uses //= 2

    def items(self, tier: str) -> int:
        """How many values ``tier`` holds."""
        return sum(1 for e in self.entries.values() if e.tier == tier)

    def budgets_text(self) -> str:
        return ", ".join(f"{t} {format_bytes(self.limit[t])}" for t in TIERS if self.budget[t])
