"""``TensorCache``: tensors kept on the device while they fit, in pinned host memory or on disk
when they do not, under a hard byte budget per tier.

Every value lives in exactly one tier. :meth:`TensorCache.get` returns it on
the device: a device-tier hit costs nothing; a host or disk hit copies it up
(into the device tier when it fits there, making room by moving the coldest
values down a tier). Room is always made before a copy starts, so no tier
ever holds more than its budget, not even during a move. The lowest tier
drops its coldest values when it is full (a later ``get`` misses).

>>> import torch, vramctl
>>> features = [torch.full((256, 256), float(i)) for i in range(8)]  # 256 KiB each
>>> with vramctl.simulate("64MiB"):
...     cache = vramctl.TensorCache(gpu="1MiB", host="4MiB")
...     for i, f in enumerate(features):
...         cache.put(i, f)  # host memory, where they are
...     x = cache.get(3)  # copied to the device; it stays in the host tier
...     x = cache.get(3)  # a second hit: moved up to the device tier
...     tiers = cache.stats()["tiers"]
>>> float(x[0, 0]), tiers["gpu"]["items"], tiers["host"]["items"]
(3.0, 1, 7)
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from vramctl._errors import VramctlError
from vramctl._units import format_bytes, parse_size
from vramctl.cache._codec import Compressor, Layout, PartMeta, checksum
from vramctl.cache._disk import FORMAT as FORMAT_TAG
from vramctl.cache._disk import CorruptItemError, DiskStore, encode_key
from vramctl.cache._policy import EvictionPolicy, make_policy
from vramctl.cache._pool import Block, HostPool
from vramctl.cache._pool import aligned as _aligned
from vramctl.device import Device, get_device, resolve
from vramctl.guard import add_reliever, is_oom, remove_reliever

__all__ = ["TIERS", "CacheError", "TensorCache", "ValueTooLargeError"]

log = logging.getLogger("vramctl.cache")

#: The tiers, fastest first.
TIERS = ("gpu", "host", "disk")

_MISSING: Any = object()


class CacheError(VramctlError, ValueError):
    """The cache was given a setting or a value it cannot use."""


class ValueTooLargeError(CacheError):
    """A value is larger than every tier's budget."""


def _size(name: str, value: int | str | None) -> int:
    if value is None:
        return 0
    try:
        n = parse_size(value)
    except VramctlError as exc:
        raise CacheError(f"{name}={value!r}: {exc}") from None
    if n < 0:
        raise CacheError(f"{name}={value!r}: a budget is 0 bytes or more")
    return n


def _compact(t: torch.Tensor) -> bool:
    """Whether ``t`` is its whole storage (keeping it keeps nothing more alive)."""
    return t.is_contiguous() and t.untyped_storage().nbytes() == t.nbytes


class _Entry:
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


@dataclass
class _TierStats:
    hits: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    evictions: int = 0  # values moved out (or dropped) to make room
    peak: int = 0
    seconds_in: float = 0.0  # time spent copying values into this tier

    def to_dict(self) -> dict[str, Any]:
        return {
            "hits": self.hits,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "evictions": self.evictions,
            "peak_bytes": self.peak,
            "seconds_in": round(self.seconds_in, 6),
        }


class TensorCache:
    """Tensors (or nested structures of them) by key, on the device, in pinned host
    memory or on disk, each tier under a hard byte budget.

    ``gpu``, ``host`` and ``disk`` are the tiers' budgets (bytes or sizes such as
    ``"2GiB"``; 0 leaves a tier out). The disk tier needs ``disk_dir`` (its
    budget defaults to 90% of the free space there); values already in that
    directory from an earlier run are found again. ``device`` is where
    :meth:`get` delivers values (the current CUDA device, else the active
    simulated GPU, else the CPU). ``policy`` orders evictions in every tier:
    ``"lru"``, ``"lfu"`` or ``"slru"`` (LRU with frequency), each O(1).

    Host memory comes from a bounded pool (:class:`HostPool`), pinned when the
    device is a CUDA GPU. ``compress="auto"`` stores integer and boolean parts
    zstd-compressed on disk where that makes them at least 20% smaller;
    ``compress=True`` compresses them in the host tier too (less memory, but a
    compression each time a value comes down from the device); False never.
    ``promote_after`` is how many hits a value found in the host or disk tier
    takes before it moves up to the device tier (the hits before are served by a
    copy): 2 by default, so values used once do not push out the hot ones. When
    the device tier is full, a value moves up only if it has been used more than
    the value it would push out (use counts halve as time passes).
    ``durable=True`` flushes each disk write to the disk before it counts (a
    power cut then loses nothing written; a killed process loses nothing either
    way). ``relieve_oom`` lets a :class:`vramctl.Guard` that
    meets an out-of-memory error on the device ask this cache to move values off
    it before it splits the batch.

    Values are shared, not copied, when they are already in the tier they are put
    in or read from: treat what :meth:`get` returns as read-only.
    """

    def __init__(
        self,
        gpu: int | str | None = None,
        host: int | str | None = None,
        disk_dir: str | Path | None = None,
        disk: int | str | None = None,
        *,
        device: Device | str | int | None = None,
        policy: str = "lru",
        compress: bool | str = "auto",
        promote_after: int = 2,
        verify: bool = True,
        durable: bool = False,
        pin_memory: bool | None = None,
        relieve_oom: bool = True,
        segment: int | str = "64MiB",
    ) -> None:
        if compress not in (True, False, "auto"):
            raise CacheError(f"compress={compress!r}: use 'auto', True or False")
        if not isinstance(promote_after, int) or promote_after < 1:
            raise CacheError(f"promote_after={promote_after!r}: a number of hits, 1 or more")
        #: A value found below the device tier moves up on this many hits there (1: every one).
        self.promote_after = promote_after
        #: zstd in the host tier too (compress=True); "auto" compresses the disk tier's files.
        self._compress_host = compress is True
        self._compress = compress
        #: Bytes written and seconds, bytes read and seconds: the disk's measured speed.
        self._disk_io = [0, 0.0, 0, 0.0]
        if device is None and torch.cuda.is_available():
            dev = get_device(torch.cuda.current_device())
        else:
            dev = resolve(device)
        self.device = dev
        self.budget = {
            "gpu": _size("gpu", gpu),
            "host": _size("host", host),
            "disk": _size("disk", disk),
        }
        self._store: DiskStore | None = None
        if disk_dir is not None:
            self._store = DiskStore(disk_dir, verify=verify, durable=durable)
            if disk is None:
                self.budget["disk"] = int(shutil.disk_usage(self._store.dir).free * 0.9)
        elif self.budget["disk"]:
            raise CacheError(f"disk={disk!r} needs disk_dir=, the directory to keep values in")
        if not any(self.budget.values()):
            raise CacheError("every tier's budget is 0: give gpu=, host= or disk_dir=")
        #: What each tier may hold now: its budget, or less while memory is short.
        self.limit = dict(self.budget)
        self.used = {t: 0 for t in TIERS}
        self.policy_name = make_policy(policy).name
        self._policies: dict[str, EvictionPolicy] = {t: make_policy(policy) for t in TIERS}
        pinned = dev.is_cuda if pin_memory is None else bool(pin_memory)
        self.pool = HostPool(self.budget["host"], pinned=pinned, segment=_size("segment", segment))
        self.compressor = Compressor(compress)
        self._entries: dict[Hashable, _Entry] = {}
        self._lock = threading.RLock()
        self._stats = {t: _TierStats() for t in TIERS}
        self.gets = self.misses = self.puts = self.dropped = 0
        self._gets_since_aging = 0
        self.bypass = 0  # gets served by a copy that the device tier could not keep
        self.budget_violations = 0
        self.corrupted = 0
        self._pressure: dict[str, float] = {}
        self._side: Any = None
        self._deferred: list[tuple[Any, Block]] = []  # blocks a pending copy still reads
        self._executor: ThreadPoolExecutor | None = None
        self._reliever: Callable[[Device, int], int] | None = None
        if relieve_oom and self.budget["gpu"]:
            ref = weakref.ref(self)

            def relieve(device: Device, nbytes: int) -> int:
                cache = ref()
                if cache is None or device.id != cache.device.id:
                    return 0
                return cache.evict(nbytes or None, tier="gpu")

            self._reliever = relieve
            add_reliever(relieve)
        if self._store is not None:
            self._load_directory()

    # -- the public operations ------------------------------------------------------

    def put(
        self,
        key: Hashable,
        value: Any,
        *,
        tier: str | None = None,
        bf16: bool = False,
        pin: bool = False,
    ) -> None:
        """Keep ``value`` (a tensor or a nested structure of tensors) under ``key``.

        It goes to ``tier`` when given, else to the device tier when its tensors are
        on the device already and to the host tier otherwise; a tier it is larger
        than is skipped. ``bf16=True`` stores its floating-point tensors as bfloat16
        in the host and disk tiers (lossy; they come back in their own dtype).
        ``pin=True`` keeps it on the device until :meth:`unpin`.
        """
        layout, parts = Layout.of(value)
        if tier is not None and tier not in TIERS:
            raise CacheError(f"tier={tier!r}: use one of {', '.join(TIERS)}")
        entry = _Entry(key, layout, bf16)
        with self._lock:
            self.puts += 1
            on_device = bool(parts) and all(self._on_device(p) for p in parts)
            want = "gpu" if pin else tier or ("gpu" if on_device else "host")
            order = [want] + [t for t in TIERS if t != want]
            for t in order:
                if self.budget[t] and self._charge(entry, t) <= self.limit[t]:
                    break
            else:
                raise ValueTooLargeError(
                    f"{key!r} takes {format_bytes(layout.nbytes)}: larger than every tier "
                    f"({self._budgets_text()})"
                )
            if pin and t != "gpu":
                raise CacheError(
                    f"pin=True: {key!r} ({format_bytes(layout.nbytes)}) does not fit the "
                    f"device tier's {format_bytes(self.limit['gpu'])}"
                )
            entry.encoded = encode_key(key)
            self._discard(key)  # only now: a refused value leaves the one cached as it was
            self._entries[key] = entry
            try:
                placed = self._place_new(entry, parts, t, order[order.index(t) :])
            except BaseException:
                self._entries.pop(key, None)
                raise
            if not placed:
                del self._entries[key]
                raise CacheError(
                    f"no room for {key!r} ({format_bytes(layout.nbytes)}): the values "
                    "pinned on the device fill its tier"
                )
            if pin:
                if entry.tier != "gpu":
                    self._discard(key)
                    raise CacheError(
                        f"pin=True: no room for {key!r} in the device tier: the values "
                        "pinned there fill it"
                    )
                self._pin(entry)

    def get(self, key: Hashable, default: Any = _MISSING, *, promote: bool = True) -> Any:
        """The value under ``key`` on the device (``default``, or KeyError, when absent).

        A host or disk hit is copied to the device and, when ``promote`` and it fits,
        kept in the device tier (moving colder values down to make room).
        """
        with self._lock:
            self.gets += 1
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                if default is _MISSING:
                    raise KeyError(key)
                return default
            entry.uses += 1
            self._stats[entry.tier].hits += 1
            self._policies[entry.tier].touch(key)
            self._age()
            if entry.tier != "gpu":
                entry.below += 1
                if promote and entry.below >= self.promote_after:
                    if self._admit(entry, "gpu"):
                        self._promote(entry, "gpu")
                    if entry.tier == "disk" and self._admit(entry, "host"):
                        self._promote(entry, "host")
            if entry.tier == "gpu":
                assert entry.dev is not None
                self._wait_ready(entry)
                return entry.layout.rebuild(list(entry.dev))
            self.bypass += 1
            return entry.layout.rebuild(self._device_copy(entry))

    def __getitem__(self, key: Hashable) -> Any:
        return self.get(key)

    def __setitem__(self, key: Hashable, value: Any) -> None:
        self.put(key, value)

    def __delitem__(self, key: Hashable) -> None:
        with self._lock:
            if key not in self._entries:
                raise KeyError(key)
            self._discard(key)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[Hashable]:
        with self._lock:
            return list(self._entries)

    def tier_of(self, key: Hashable) -> str | None:
        """The tier ``key``'s value is in now (None when it is not cached)."""
        entry = self._entries.get(key)
        return None if entry is None else entry.tier

    def discard(self, key: Hashable) -> bool:
        """Forget ``key`` (and delete its file); False when it was not cached."""
        with self._lock:
            return self._discard(key)

    def prefetch(self, keys: Hashable | Iterable[Hashable]) -> Future[int]:
        """Start moving ``keys``' values to the device tier, in the background.

        Returns a future of how many were moved. On a CUDA device the copies run on a
        side stream from pinned memory and :meth:`get` waits only for its own value's
        copy (an event), not for the device.
        """
        todo: list[Hashable] = (
            [keys] if isinstance(keys, (str, int, tuple)) else list(keys)  # type: ignore[arg-type]
        )
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="vramctl-cache")
            return self._executor.submit(self._prefetch, todo)

    def pin(self, key: Hashable) -> None:
        """Keep ``key``'s value in the device tier (moved there now) until :meth:`unpin`."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                raise KeyError(key)
            if entry.tier != "gpu":
                self._promote(entry)
            if entry.tier != "gpu":
                raise CacheError(
                    f"cannot pin {key!r} ({format_bytes(entry.layout.nbytes)}): the device "
                    f"tier ({format_bytes(self.limit['gpu'])}) cannot make room for it"
                )
            self._pin(entry)

    def unpin(self, key: Hashable) -> None:
        """Let ``key``'s value be moved down again."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.pinned:
                entry.pinned = False
                self._policies[entry.tier].add(key)

    def evict(self, nbytes: int | str | None = None, *, tier: str = "gpu") -> int:
        """Move at least ``nbytes`` of values out of ``tier`` (all of them for None).

        Values go down a tier (the disk tier's are dropped); pinned values stay.
        Returns the bytes ``tier`` gave up.
        """
        if tier not in TIERS:
            raise CacheError(f"tier={tier!r}: use one of {', '.join(TIERS)}")
        want = None if nbytes is None else parse_size(nbytes)
        with self._lock:
            before = self.used[tier]
            policy = self._policies[tier]
            while policy and (want is None or before - self.used[tier] < want):
                victim = policy.victim()
                assert victim is not None
                self._stats[tier].evictions += 1
                self._demote(self._entries[victim])
            if tier == "host":
                self._reclaim(wait=True)
                self.pool.release()
            if tier == "gpu":
                self.device.release_cache()
            return before - self.used[tier]

    def clear(self) -> None:
        """Forget every value (and delete the disk tier's files)."""
        with self._lock:
            for key in list(self._entries):
                self._discard(key)
            self._reclaim(wait=True)
            self.pool.release()

    def close(self) -> None:
        """Stop the prefetch thread and stop answering the guard; values stay on disk."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self._reliever is not None:
            remove_reliever(self._reliever)
            self._reliever = None

    def __enter__(self) -> TensorCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- memory pressure ----------------------------------------------------------

    def shrink(self, tier: str = "gpu", factor: float = 0.5) -> int:
        """Hold at most ``factor`` of ``tier``'s budget until :meth:`restore`; returns bytes
        moved out."""
        if not 0.0 <= factor < 1.0:
            raise CacheError(f"factor={factor!r}: a fraction of the budget, 0 or more, below 1")
        with self._lock:
            self._pressure[tier] = factor
            self.limit[tier] = int(self.budget[tier] * factor)
            excess = self.used[tier] - self.limit[tier]
            return self.evict(excess, tier=tier) if excess > 0 else 0

    def restore(self, tier: str = "gpu") -> None:
        """Give ``tier`` its whole budget again."""
        with self._lock:
            self._pressure.pop(tier, None)
            self.limit[tier] = self.budget[tier]

    def on_alert(self, alert: Any, *, factor: float = 0.5) -> None:
        """A monitor alert action: shrink the tier on the alert's device, restore it when
        the alert resolves (``monitor.on_alert(cache.on_alert, level="warning")``)."""
        device = str(getattr(alert, "device", ""))
        if device == self.device.id:
            tier = "gpu"
        elif device == "cpu":
            tier = "host"
        else:
            return
        if getattr(alert, "resolved", False):
            self.restore(tier)
            log.info("memory alert on %s resolved: the %s tier has its budget again", device, tier)
        elif tier not in self._pressure:
            moved = self.shrink(tier, factor)
            log.info(
                "memory alert on %s: the %s tier holds at most %s (%s moved out)",
                device,
                tier,
                format_bytes(self.limit[tier]),
                format_bytes(moved),
            )

    def attach(self, monitor: Any, *, level: str = "warning", factor: float = 0.5) -> None:
        """Shrink tiers on ``monitor``'s memory alerts at ``level`` or above and grow them
        back when the alerts resolve; publish the cache's statistics through it (its
        summary and its Prometheus metrics)."""
        monitor.on_alert(lambda alert: self.on_alert(alert, factor=factor), level=level, rule=None)
        monitor.add_source(self)

    # -- statistics ---------------------------------------------------------------

    name = "cache"

    def stats(self) -> dict[str, Any]:
        """Counts, bytes and budget use per tier, and the whole cache's, JSON-ready."""
        with self._lock:
            tiers = {}
            for t in TIERS:
                s = self._stats[t].to_dict()
                s.update(
                    budget_bytes=self.budget[t],
                    limit_bytes=self.limit[t],
                    used_bytes=self.used[t],
                    items=sum(1 for e in self._entries.values() if e.tier == t),
                    use=round(self.used[t] / self.budget[t], 4) if self.budget[t] else None,
                )
                tiers[t] = s
            tiers["host"]["pool_held_bytes"] = self.pool.held
            tiers["host"]["pool_peak_held_bytes"] = self.pool.peak_held
            tiers["host"]["pinned"] = self.pool.pinned
            hits = sum(self._stats[t].hits for t in TIERS)
            return {
                "device": self.device.id,
                "policy": self.policy_name,
                "items": len(self._entries),
                "gets": self.gets,
                "hits": hits,
                "misses": self.misses,
                "hit_rate": round(hits / self.gets, 4) if self.gets else None,
                "puts": self.puts,
                "dropped": self.dropped,
                "bypass": self.bypass,
                "budget_violations": self.budget_violations,
                "corrupted_items": self.corrupted + (self._store.corrupted if self._store else 0),
                "under_pressure": sorted(self._pressure),
                "tiers": tiers,
                "compression": self.compressor.stats(),
            }

    def metrics(self) -> list[tuple[str, str, str, dict[str, str], float]]:
        """Prometheus samples: ``(name, "gauge" or "counter", help, labels, value)``."""
        s = self.stats()
        out: list[tuple[str, str, str, dict[str, str], float]] = []
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

    # -- placing and moving (all under the lock) ------------------------------------

    def _budgets_text(self) -> str:
        return ", ".join(f"{t} {format_bytes(self.limit[t])}" for t in TIERS if self.budget[t])

    def _on_device(self, t: torch.Tensor) -> bool:
        if self.device.is_simulated:
            return self.device.owns(t)
        return t.device == self.device.torch_device

    def _host(self) -> contextlib.AbstractContextManager[Any]:
        """Host-side work: not counted by a simulated device."""
        return self.device.uncounted()

    def _charge(self, entry: _Entry, tier: str) -> int:
        """What ``entry`` takes in ``tier`` (an estimate for the disk before it is written)."""
        metas = entry.layout.parts
        if tier == "gpu":
            return (
                sum(_aligned(m.nbytes) for m in metas)
                if self.device.is_cuda
                else sum(m.nbytes for m in metas)
            )
        if tier == "host" and not self._compress_host:  # zstd parts are decoded there
            return sum(
                _aligned(
                    m.numel * m.stored_dtype.itemsize if m.codec == "zstd" else m.stored_nbytes
                )
                for m in metas
            )
        stored = sum(_aligned(m.stored_nbytes or m.nbytes) for m in metas)
        return stored + (64 * 1024 if tier == "disk" else 0)

    def _account(self, tier: str, delta: int, *, moved: bool = True) -> None:
        self.used[tier] += delta
        st = self._stats[tier]
        st.peak = max(st.peak, self.used[tier])
        if self.used[tier] > self.budget[tier]:
            self.budget_violations += 1
            log.error("the %s tier holds %d bytes over its budget", tier, self.used[tier])
        if moved and delta > 0:
            st.bytes_in += delta
        elif moved:
            st.bytes_out -= delta

    def _room(self, tier: str, nbytes: int) -> bool:
        """Move values out of ``tier`` until ``nbytes`` more fit in its limit."""
        policy = self._policies[tier]
        while self.used[tier] + nbytes > self.limit[tier]:
            victim = policy.victim()
            if victim is None:
                return False
            self._stats[tier].evictions += 1
            self._demote(self._entries[victim])
        return True

    def _alloc_blocks(self, sizes: list[int]) -> tuple[list[Block], list[Block]] | None:
        """One block of the host pool for parts of ``sizes`` (room made first), and a block
        inside it for each part; or None. One block per value: a value that fits the tier
        never fails for want of a second segment."""
        total = sum(_aligned(s) for s in sizes)
        if not sizes:
            return [], []
        if total > self.limit["host"] or not self._room("host", total):
            return None
        policy = self._policies["host"]
        while True:
            block = self.pool.alloc(total)
            if block is not None:
                break
            if self._reclaim(wait=True):
                continue
            victim = policy.victim()
            if victim is None:  # fragmented, and nothing left to move: give up
                return None
            self._stats["host"].evictions += 1
            self._demote(self._entries[victim])
        subs: list[Block] = []
        offset = block.offset
        for size in sizes:
            subs.append(Block(block.segment, offset, _aligned(size)))
            offset += _aligned(size)
        return [block], subs

    def _reclaim(self, wait: bool = False) -> bool:
        """Free the host blocks whose pending copies have finished (all of them: ``wait``)."""
        if not self._deferred:
            return False
        keep: list[tuple[Any, Block]] = []
        freed = False
        for event, block in self._deferred:
            if wait or event.query():
                event.synchronize()
                self.pool.free(block)
                freed = True
            else:
                keep.append((event, block))
        self._deferred = keep
        return freed

    def _leave(self, entry: _Entry) -> None:
        """Release what ``entry`` holds in its tier (its value is elsewhere, or forgotten)."""
        tier = entry.tier
        self._policies[tier].remove(entry.key)
        if tier == "gpu":
            entry.dev = None
        elif tier == "host":
            for block in entry.host or ():
                if entry.ready is not None:  # a copy still reads it: free it when it ends
                    self._deferred.append((entry.ready, block))
                else:
                    self.pool.free(block)
            entry.host = None
            entry.views = None
        elif entry.path is not None and self._store is not None:
            self._store.remove(entry.path)
            entry.path = None
        entry.ready = None
        self._account(tier, -entry.charge)
        entry.tier = ""
        entry.charge = 0

    def _arrive(self, entry: _Entry, tier: str, handle: Any, charge: int) -> None:
        if tier == "gpu":
            entry.dev = handle
        elif tier == "host":
            entry.host, subs = handle
            entry.views = [
                b.bytes(m.stored_nbytes) if m.codec == "zstd" else b.view(m.stored_dtype, m.shape)
                for b, m in zip(subs, entry.layout.parts, strict=True)
            ]
        else:
            entry.path = handle
        if tier != "gpu":
            entry.below = 0
        entry.tier = tier
        entry.charge = charge
        if not entry.pinned:
            self._policies[tier].add(entry.key)

    def _discard(self, key: Hashable) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        if entry.tier:
            self._leave(entry)
        return True

    def _pin(self, entry: _Entry) -> None:
        entry.pinned = True
        self._policies["gpu"].remove(entry.key)

    def _demote(self, entry: _Entry) -> None:
        """Move ``entry`` one or more tiers down, or drop it from the lowest."""
        src = entry.tier
        self._policies[src].remove(entry.key)
        for dst in TIERS[TIERS.index(src) + 1 :]:
            fits = self.budget[dst] and self._charge(entry, dst) <= self.limit[dst]
            if fits and self._move(entry, dst):
                return
        self._leave(entry)
        del self._entries[entry.key]
        self.dropped += 1

    def _admit(self, entry: _Entry, tier: str) -> bool:
        """Whether ``entry`` should move up into ``tier`` on this hit: when it fits without
        moving anything out, or when it has been used more than the value it would push
        out first (TinyLFU's admission test), so that a hot value is not pushed out by a
        cooler one and the tier does not churn."""
        need = self._charge(entry, tier)
        if not self.budget[tier] or need > self.limit[tier]:
            return False
        if self.used[tier] + need <= self.limit[tier]:
            return True
        victim = self._policies[tier].victim()
        return victim is None or entry.uses > self._entries[victim].uses

    def _age(self) -> None:
        """Halve every value's use count after ten gets per value: counts follow what is hot
        now, not what was once (amortized O(1) per get)."""
        self._gets_since_aging += 1
        if self._gets_since_aging >= 10 * max(16, len(self._entries)):
            self._gets_since_aging = 0
            for e in self._entries.values():
                e.uses //= 2

    def _promote(self, entry: _Entry, tier: str = "gpu") -> bool:
        """Move ``entry`` up into ``tier`` when it fits there."""
        if self._charge(entry, tier) > self.limit[tier]:
            return False
        src = entry.tier
        self._policies[src].remove(entry.key)
        try:
            if self._move(entry, tier):
                return True
        except Exception as exc:
            if entry.tier != src or not is_oom(exc, device=self.device):
                raise
            # The device itself is full (another tenant): the value stays where it was.
            log.info("%r stays in the %s tier: the device is out of memory", entry.key, src)
        self._policies[src].add(entry.key)
        return False

    # -- the copies ---------------------------------------------------------------

    def _place_new(
        self, entry: _Entry, parts: list[torch.Tensor], tier: str, order: list[str]
    ) -> bool:
        """Put a new value's ``parts`` (wherever they are) into ``tier``, or a later one."""
        for t in order:
            if not self.budget[t] or self._charge(entry, t) > self.limit[t]:
                continue
            if t == "gpu":
                need = self._charge(entry, "gpu")
                if not self._room("gpu", need):
                    continue
                t0 = time.perf_counter()
                dev = [
                    p if self._on_device(p) and _compact(p) else self._to_device(p, p.dtype)
                    for p in parts
                ]
                entry.ready = self._event()
                self._account("gpu", need)
                self._stats["gpu"].seconds_in += time.perf_counter() - t0
                self._arrive(entry, "gpu", dev, need)
                return True
            with self._host():
                cpu = [p if p.device.type == "cpu" else p.to("cpu") for p in parts]
                stored, metas = self._encode(entry, cpu, t)
            entry.layout.parts = metas
            placed = self._write_stored(entry, stored, t)
            if placed is not None:
                self._arrive(entry, t, *placed)
                return True
        return False

    def _write_stored(
        self, entry: _Entry, stored: list[torch.Tensor], tier: str
    ) -> tuple[Any, int] | None:
        """Copy stored parts into the host or disk ``tier`` (room made first); returns the
        blocks or file and the bytes counted, or None when no room can be made."""
        t0 = time.perf_counter()
        if tier == "host":
            with self._host():
                got = self._alloc_blocks([s.nbytes for s in stored])
                if got is None:
                    return None
                for block, s in zip(got[1], stored, strict=True):
                    block.bytes(s.nbytes).copy_(s.reshape(-1).view(torch.uint8))
            charge = sum(b.size for b in got[0])
            self._account("host", charge)
            self._stats["host"].seconds_in += time.perf_counter() - t0
            return got, charge
        assert self._store is not None
        layout_json = entry.layout.to_json()
        with self._host():
            crcs = [checksum(s) for s in stored]
        # The file: its header (the metadata as JSON, a line per part) and the parts.
        meta = [FORMAT_TAG, entry.encoded or "", json.dumps(layout_json), json.dumps(crcs)]
        header = len(json.dumps(meta)) + 160 * len(stored) + 256
        reserve = sum(s.nbytes for s in stored) + header
        if reserve > self.limit["disk"] or not self._room("disk", reserve):
            return None
        path = self._store.path_for(entry.key, entry.encoded)
        with self._host():
            self.used["disk"] += reserve  # held while the file is written
            try:
                w0 = time.perf_counter()
                charge = self._store.write(path, entry.encoded, layout_json, stored, crcs)
                self._disk_io[0] += charge
                self._disk_io[1] += time.perf_counter() - w0
            finally:
                self.used["disk"] -= reserve
        if charge > reserve:  # never expected: the reservation bounds the file
            log.warning("%s took %d bytes, more than the %d reserved", path.name, charge, reserve)
        self._account("disk", charge)
        self._stats["disk"].seconds_in += time.perf_counter() - t0
        return path, charge

    def _disk_compression_pays(self) -> bool:
        """Whether zstd pays on this disk, by what was measured: the seconds it saves
        writing and reading the bytes it removes against its own seconds, or the room it
        saves when the disk tier is over 80% full. Tried until both are measured."""
        if self._compress is False:
            return False
        per_byte = self.compressor.seconds_per_byte()
        written, w_s, read, r_s = self._disk_io
        if per_byte is None or not (written and w_s and read and r_s) or self.compressor.tries < 8:
            return True
        ratio = self.compressor.packed_bytes / max(1, self.compressor.raw_bytes)
        saved = (1 - ratio) * (w_s / written + r_s / read)
        return saved > per_byte or self.used["disk"] > 0.8 * self.limit["disk"]

    def _encode(
        self, entry: _Entry, cpu: list[torch.Tensor], tier: str, *, stored: bool = False
    ) -> tuple[list[torch.Tensor], list[PartMeta]]:
        """The form CPU parts take in the host or disk ``tier``: bf16 where asked, zstd where
        it pays. ``stored``: the parts are in their host form already (zstd ones kept)."""
        compress = self._compress_host or (tier == "disk" and self._disk_compression_pays())
        out: list[torch.Tensor] = []
        metas: list[PartMeta] = []
        for t, meta in zip(cpu, entry.layout.parts, strict=True):
            if stored and meta.codec == "zstd":
                out.append(t)
                metas.append(meta)
                continue
            t = t.contiguous()
            if entry.bf16 and t.dtype.is_floating_point and t.dtype != torch.bfloat16:
                s = t.to(torch.bfloat16)
                meta = replace(meta, stored_dtype=s.dtype, codec="raw", stored_nbytes=s.nbytes)
            elif compress and (packed := self.compressor.compress(t)) is not None:
                s = torch.frombuffer(bytearray(packed), dtype=torch.uint8)
                meta = replace(meta, stored_dtype=t.dtype, codec="zstd", stored_nbytes=s.nbytes)
            else:
                s = t
                meta = replace(meta, stored_dtype=t.dtype, codec="raw", stored_nbytes=t.nbytes)
            out.append(s)
            metas.append(meta)
        return out, metas

    def _stored_parts(self, entry: _Entry) -> list[torch.Tensor]:
        """``entry``'s stored parts as CPU tensors: views of its host blocks, or read from
        its file (checked against its checksums)."""
        metas = entry.layout.parts
        if entry.tier == "host":
            assert entry.views is not None
            if entry.ready is not None:  # the copy into these blocks may still run
                entry.ready.synchronize()
            return list(entry.views)
        assert entry.tier == "disk" and entry.path is not None and self._store is not None
        try:
            r0 = time.perf_counter()
            parts = self._store.read(entry.path, len(metas))
            self._disk_io[2] += sum(p.nbytes for p in parts)
            self._disk_io[3] += time.perf_counter() - r0
        except CorruptItemError:
            log.error("%r: its file failed its checksum; dropped from the cache", entry.key)
            self._discard(entry.key)
            raise
        return [
            p if m.codec == "zstd" else p.view(m.stored_dtype).view(m.shape)
            for p, m in zip(parts, metas, strict=True)
        ]

    def _to_device(self, src: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A copy of CPU (or device) ``src`` on the device, in ``dtype``."""
        dev = self.device
        if dev.is_cuda:
            out = torch.empty(src.shape, dtype=dtype, device=dev.torch_device)
            side = self._side_stream()
            side.wait_stream(torch.cuda.current_stream(dev.torch_device))
            with torch.cuda.stream(side):
                out.copy_(src, non_blocking=src.is_pinned())
            out.record_stream(side)
            return out
        with dev.counting():
            out = torch.empty(src.shape, dtype=dtype)
        out.copy_(src)
        return out

    def _side_stream(self) -> Any:
        if self._side is None:
            self._side = torch.cuda.Stream(self.device.torch_device)
        return self._side

    def _event(self) -> Any:
        if not self.device.is_cuda:
            return None
        event = torch.cuda.Event()
        event.record(self._side_stream())
        return event

    def _wait_ready(self, entry: _Entry) -> None:
        """Make the caller's stream wait for ``entry``'s copy to the device."""
        if entry.ready is not None:
            torch.cuda.current_stream(self.device.torch_device).wait_event(entry.ready)

    def _device_copy(self, entry: _Entry) -> list[torch.Tensor]:
        """``entry``'s parts copied to the device (it stays in its tier)."""
        metas = entry.layout.parts
        with self._host():
            stored = self._stored_parts(entry)
            decoded = [
                self.compressor.decompress(s, m) if m.codec == "zstd" else s
                for s, m in zip(stored, metas, strict=True)
            ]
        out = [self._to_device(d, m.dtype) for d, m in zip(decoded, metas, strict=True)]
        event = self._event()
        if event is not None:
            torch.cuda.current_stream(self.device.torch_device).wait_event(event)
            if entry.tier == "host":
                entry.ready = event  # its blocks are read until the copy ends
        return out

    def _move(self, entry: _Entry, dst: str) -> bool:
        """Copy ``entry`` (out of its policy) into ``dst`` with room made first, then release
        its old tier. False when ``dst`` cannot make room."""
        src = entry.tier
        if dst == "gpu":
            need = self._charge(entry, "gpu")
            if not self._room("gpu", need):
                return False
            t0 = time.perf_counter()
            parts = self._device_copy(entry)
            self._leave(entry)
            entry.ready = self._event()
            self._account("gpu", need)
            self._stats["gpu"].seconds_in += time.perf_counter() - t0
            self._arrive(entry, "gpu", parts, need)
            return True
        if src == "gpu" and dst == "host" and self._plain(entry):
            return self._d2h_direct(entry)
        if src == "disk":  # up to the host tier: zstd parts decoded unless it compresses
            old = entry.layout.parts
            with self._host():
                parts = self._stored_parts(entry)
                decoded: list[torch.Tensor] = []
                metas: list[PartMeta] = []
                for p, m in zip(parts, old, strict=True):
                    if m.codec == "zstd" and not self._compress_host:
                        p = self.compressor.decompress(p, m)
                        m = replace(m, codec="raw", stored_nbytes=p.nbytes)
                    decoded.append(p)
                    metas.append(m)
            entry.layout.parts = metas
            placed = self._write_stored(entry, decoded, dst)
            if placed is None:
                entry.layout.parts = old
                return False
            del decoded, parts
            self._leave(entry)
            self._arrive(entry, dst, *placed)
            return True
        old = entry.layout.parts
        if src == "gpu":
            assert entry.dev is not None
            if entry.ready is not None:
                entry.ready.synchronize()
            with self._host():
                cpu = [t.to("cpu") for t in entry.dev]
                stored, metas = self._encode(entry, cpu, dst)
            entry.layout.parts = metas
        else:  # host -> disk: the host form, compressed where it pays on disk
            with self._host():
                stored, metas = self._encode(entry, self._stored_parts(entry), dst, stored=True)
            entry.layout.parts = metas
        placed = self._write_stored(entry, stored, dst)
        if placed is None:
            entry.layout.parts = old
            return False
        del stored
        self._leave(entry)
        self._arrive(entry, dst, *placed)
        return True

    def _plain(self, entry: _Entry) -> bool:
        """Whether ``entry`` is stored exactly as it is on the device (no bf16, no zstd)."""
        if entry.bf16 and any(m.dtype.is_floating_point for m in entry.layout.parts):
            return False
        return not self._compress_host or not any(
            self.compressor.worth_trying(m.dtype, m.nbytes) for m in entry.layout.parts
        )

    def _d2h_direct(self, entry: _Entry) -> bool:
        """Device to host tier with no temporary: straight into pool blocks."""
        assert entry.dev is not None
        metas = [
            replace(m, stored_dtype=m.dtype, codec="raw", stored_nbytes=m.nbytes)
            for m in entry.layout.parts
        ]
        with self._host():
            got = self._alloc_blocks([m.nbytes for m in metas])
            if got is None:
                return False
            blocks = got[1]
            t0 = time.perf_counter()
            if self.device.is_cuda:
                side = self._side_stream()
                side.wait_stream(torch.cuda.current_stream(self.device.torch_device))
                if entry.ready is not None:
                    side.wait_event(entry.ready)
                with torch.cuda.stream(side):
                    for b, m, t in zip(blocks, metas, entry.dev, strict=True):
                        b.view(m.dtype, m.shape).copy_(t, non_blocking=True)
                        t.record_stream(side)
            else:
                for b, m, t in zip(blocks, metas, entry.dev, strict=True):
                    b.view(m.dtype, m.shape).copy_(t)
        entry.layout.parts = metas
        self._leave(entry)
        entry.ready = self._event()
        charge = sum(b.size for b in got[0])
        self._account("host", charge)
        self._stats["host"].seconds_in += time.perf_counter() - t0
        self._arrive(entry, "host", got, charge)
        return True

    # -- background work and the directory -------------------------------------------

    def _prefetch(self, keys: list[Hashable]) -> int:
        moved = 0
        with contextlib.ExitStack() as stack:
            if self.device.is_simulated:
                stack.enter_context(self.device.counting())
            for key in keys:
                with self._lock:
                    entry = self._entries.get(key)
                    if entry is None or entry.tier == "gpu" or not self.budget["gpu"]:
                        continue
                    try:
                        if self._promote(entry):
                            moved += 1
                    except CorruptItemError as exc:  # dropped already: the others go on
                        log.error("prefetch of %r: %s", key, exc)
        return moved

    def _load_directory(self) -> None:
        assert self._store is not None
        for item in self._store.scan():
            try:
                layout = Layout.from_json(item.layout)
            except Exception as exc:  # a layout this version cannot read
                log.warning("ignoring %s: %s", item.path.name, exc)
                continue
            if self.used["disk"] + item.size > self.budget["disk"]:
                self._store.remove(item.path)
                continue
            entry = _Entry(
                item.key, layout, bf16=any(m.stored_dtype != m.dtype for m in layout.parts)
            )
            entry.encoded = encode_key(item.key)
            self._entries[item.key] = entry
            self._account("disk", item.size, moved=False)
            self._arrive(entry, "disk", item.path, item.size)

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self.keys())

    def __repr__(self) -> str:
        return f"TensorCache({len(self)} values, {self._budgets_text()}, on {self.device.id})"
