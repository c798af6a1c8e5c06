"""The cache's counters (gets, hits per tier, evictions, copy times, drops) and its
statistics: the dictionary ``TensorCache.stats`` returns and the Prometheus samples."""

from __future__ import annotations

from typing import Any

from vramctl.cache._ledger import TIERS, Ledger
from vramctl.cache._pool import HostPool

__all__ = ["Metrics", "Sample", "samples"]

#: A Prometheus sample: ``(name, "gauge" or "counter", help, labels, value)``.
Sample = tuple[str, str, str, dict[str, str], float]


class Metrics:
    """What the cache has done: gets, misses, puts and drops; per tier, hits, values moved
    out to make room and seconds spent copying values in."""

    def __init__(self) -> None:
        self.gets = self.misses = self.puts = self.dropped = 0
        self.bypass = 0  # gets served by a copy that the device tier could not keep
        self.corrupted = 0
        self.hits = {t: 0 for t in TIERS}
        self.evictions = {t: 0 for t in TIERS}  # values moved out (or dropped) to make room
        self.seconds_in = {t: 0.0 for t in TIERS}  # time spent copying values into a tier

    def stats(
        self,
        ledger: Ledger,
        pool: HostPool,
        *,
        device: str,
        policy: str,
        store_corrupted: int,
        under_pressure: list[str],
        compression: dict[str, Any],
    ) -> dict[str, Any]:
        """Counts, bytes and budget use per tier, and the whole cache's, JSON-ready."""
        tiers = {}
        for t in TIERS:
            budget, used = ledger.budget[t], ledger.used[t]
            tiers[t] = {
                "hits": self.hits[t],
                "bytes_in": ledger.bytes_in[t],
                "bytes_out": ledger.bytes_out[t],
                "evictions": self.evictions[t],
                "peak_bytes": ledger.peak[t],
                "seconds_in": round(self.seconds_in[t], 6),
                "budget_bytes": budget,
                "limit_bytes": ledger.limit[t],
                "used_bytes": used,
                "items": ledger.items(t),
                "use": round(used / budget, 4) if budget else None,
            }
        tiers["host"]["pool_held_bytes"] = pool.held
        tiers["host"]["pool_peak_held_bytes"] = pool.peak_held
        tiers["host"]["pinned"] = pool.pinned
        hits = sum(self.hits[t] for t in TIERS)
        return {
            "device": device,
            "policy": policy,
            "items": len(ledger.entries),
            "gets": self.gets,
            "hits": hits,
            "misses": self.misses,
            "hit_rate": round(hits / self.gets, 4) if self.gets else None,
            "puts": self.puts,
            "dropped": self.dropped,
            "bypass": self.bypass,
            "budget_violations": ledger.budget_violations,
            "corrupted_items": self.corrupted + store_corrupted,
            "under_pressure": under_pressure,
            "tiers": tiers,
            "compression": compression,
        }


def samples(s: dict[str, Any]) -> list[Sample]:
    """Prometheus samples of a cache's :meth:`Metrics.stats`: ``(name, "gauge" or
    "counter", help, labels, value)``."""
    out: list[Sample] = []
    for t, ts in s["tiers"].items():
        lab = {"tier": t}
        out += [
            (
                "cache_hits",
                "counter",
                "Cache hits, by the tier they were found in.",
                lab,
                ts["hits"],
            ),
            (
                "cache_evictions",
                "counter",
                "Values moved out of a tier to make room.",
                lab,
                ts["evictions"],
            ),
            (
                "cache_moved_in_bytes",
                "counter",
                "Bytes copied into a tier.",
                lab,
                ts["bytes_in"],
            ),
            (
                "cache_moved_out_bytes",
                "counter",
                "Bytes moved out of a tier.",
                lab,
                ts["bytes_out"],
            ),
            ("cache_budget_bytes", "gauge", "A tier's byte budget.", lab, ts["budget_bytes"]),
            (
                "cache_limit_bytes",
                "gauge",
                "What a tier may hold now (less under memory pressure).",
                lab,
                ts["limit_bytes"],
            ),
            ("cache_used_bytes", "gauge", "Bytes a tier holds.", lab, ts["used_bytes"]),
            ("cache_items", "gauge", "Values in a tier.", lab, ts["items"]),
        ]
    out += [
        ("cache_misses", "counter", "Gets of keys the cache does not hold.", {}, s["misses"]),
        ("cache_gets", "counter", "Gets.", {}, s["gets"]),
        ("cache_dropped", "counter", "Values dropped from the lowest tier.", {}, s["dropped"]),
        (
            "cache_budget_violations",
            "counter",
            "Times a tier held more than its budget.",
            {},
            s["budget_violations"],
        ),
        (
            "cache_compressed_bytes",
            "gauge",
            "Bytes of compressed parts (after).",
            {},
            s["compression"]["compressed_bytes"],
        ),
        (
            "cache_compression_raw_bytes",
            "gauge",
            "Bytes of compressed parts (before).",
            {},
            s["compression"]["raw_bytes"],
        ),
    ]
    return out
