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

import logging
import shutil
import threading
import weakref
from collections.abc import Callable, Hashable, Iterable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch

from vramctl._errors import VramctlError
from vramctl._units import format_bytes, parse_size
from vramctl.cache._codec import Compressor, Layout
from vramctl.cache._disk import DiskStore, encode_key
from vramctl.cache._io import TierIO
from vramctl.cache._ledger import TIERS, Entry, Ledger
from vramctl.cache._metrics import Metrics, samples
from vramctl.cache._mover import Mover
from vramctl.cache._policy import make_policy
from vramctl.cache._pool import HostPool
from vramctl.cache._prefetch import Prefetcher
from vramctl.device import Device, get_device, resolve
from vramctl.guard import add_reliever, remove_reliever

__all__ = ["CacheError", "TensorCache", "ValueTooLargeError"]

log = logging.getLogger("vramctl.cache")

_MISSING: Any = object()

_T = TypeVar("_T")


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


class _Part(Generic[_T]):
    """An attribute of the cache that one of its parts keeps (read and written there)."""

    def __init__(self, part: str) -> None:
        self.part = part
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, cache: Any, owner: type | None = None) -> _T:
        value: _T = getattr(getattr(cache, self.part), self.name)
        return value

    def __set__(self, cache: Any, value: _T) -> None:
        setattr(getattr(cache, self.part), self.name, value)


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

    #: Each tier's byte budget, what it may hold now and what it holds (the ledger's).
    budget: _Part[dict[str, int]] = _Part("_ledger")
    limit: _Part[dict[str, int]] = _Part("_ledger")
    used: _Part[dict[str, int]] = _Part("_ledger")
    budget_violations: _Part[int] = _Part("_ledger")
    #: What the cache has done (its metrics').
    gets: _Part[int] = _Part("_metrics")
    misses: _Part[int] = _Part("_metrics")
    puts: _Part[int] = _Part("_metrics")
    dropped: _Part[int] = _Part("_metrics")
    bypass: _Part[int] = _Part("_metrics")  # gets served by a copy the device tier could not keep
    corrupted: _Part[int] = _Part("_metrics")

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
        if device is None and torch.cuda.is_available():
            dev = get_device(torch.cuda.current_device())
        else:
            dev = resolve(device)
        self.device = dev
        budget = {
            "gpu": _size("gpu", gpu),
            "host": _size("host", host),
            "disk": _size("disk", disk),
        }
        store: DiskStore | None = None
        if disk_dir is not None:
            store = DiskStore(disk_dir, verify=verify, durable=durable)
            if disk is None:
                budget["disk"] = int(shutil.disk_usage(store.dir).free * 0.9)
        elif budget["disk"]:
            raise CacheError(f"disk={disk!r} needs disk_dir=, the directory to keep values in")
        if not any(budget.values()):
            raise CacheError("every tier's budget is 0: give gpu=, host= or disk_dir=")
        self.policy_name = make_policy(policy).name
        self._ledger = Ledger(budget, policy, cuda=dev.is_cuda, compress_host=compress is True)
        pinned = dev.is_cuda if pin_memory is None else bool(pin_memory)
        self.pool = HostPool(budget["host"], pinned=pinned, segment=_size("segment", segment))
        self.compressor = Compressor(compress)
        self._metrics = Metrics()
        self._io = TierIO(dev, self._ledger, self.compressor, compress, store)
        self._mover = Mover(self._ledger, self._metrics, self._io, self.pool)
        self._lock = threading.RLock()
        self._prefetcher = Prefetcher(self._mover, self._lock)
        self._pressure: dict[str, float] = {}
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
        if store is not None:
            self._mover.load_directory()

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
        entry = Entry(key, layout, bf16)
        with self._lock:
            self._metrics.puts += 1
            on_device = bool(parts) and all(self._io.on_device(p) for p in parts)
            want = "gpu" if pin else tier or ("gpu" if on_device else "host")
            order = [want] + [t for t in TIERS if t != want]
            for t in order:
                if self._ledger.fits(entry, t):
                    break
            else:
                raise ValueTooLargeError(
                    f"{key!r} takes {format_bytes(layout.nbytes)}: larger than every tier "
                    f"({self._ledger.budgets_text()})"
                )
            if pin and t != "gpu":
                raise CacheError(
                    f"pin=True: {key!r} ({format_bytes(layout.nbytes)}) does not fit the "
                    f"device tier's {format_bytes(self.limit['gpu'])}"
                )
            entry.encoded = encode_key(key)
            self._mover.discard(key)  # only now: a refused value leaves the one cached as it was
            self._ledger.entries[key] = entry
            try:
                placed = self._mover.place_new(entry, parts, t, order[order.index(t) :])
            except BaseException:
                self._ledger.entries.pop(key, None)
                raise
            if not placed:
                del self._ledger.entries[key]
                raise CacheError(
                    f"no room for {key!r} ({format_bytes(layout.nbytes)}): the values "
                    "pinned on the device fill its tier"
                )
            if pin:
                if entry.tier != "gpu":
                    self._mover.discard(key)
                    raise CacheError(
                        f"pin=True: no room for {key!r} in the device tier: the values "
                        "pinned there fill it"
                    )
                self._mover.pin(entry)

    def get(self, key: Hashable, default: Any = _MISSING, *, promote: bool = True) -> Any:
        """The value under ``key`` on the device (``default``, or KeyError, when absent).

        A host or disk hit is copied to the device and, when ``promote`` and it fits,
        kept in the device tier (moving colder values down to make room).
        """
        with self._lock:
            self._metrics.gets += 1
            entry = self._ledger.entries.get(key)
            if entry is None:
                self._metrics.misses += 1
                if default is _MISSING:
                    raise KeyError(key)
                return default
            entry.uses += 1
            self._metrics.hits[entry.tier] += 1
            self._ledger.policies[entry.tier].touch(key)
            self._ledger.age()
            if entry.tier != "gpu":
                entry.below += 1
                if promote and entry.below >= self.promote_after:
                    if self._ledger.admit(entry, "gpu"):
                        self._mover.promote(entry, "gpu")
                    if entry.tier == "disk" and self._ledger.admit(entry, "host"):
                        self._mover.promote(entry, "host")
            if entry.tier == "gpu":
                assert entry.dev is not None
                self._io.wait_ready(entry)
                return entry.layout.rebuild(list(entry.dev))
            self._metrics.bypass += 1
            return entry.layout.rebuild(self._mover.device_copy(entry))

    def __getitem__(self, key: Hashable) -> Any:
        return self.get(key)

    def __setitem__(self, key: Hashable, value: Any) -> None:
        self.put(key, value)

    def __delitem__(self, key: Hashable) -> None:
        with self._lock:
            if key not in self._ledger.entries:
                raise KeyError(key)
            self._mover.discard(key)

    def __contains__(self, key: object) -> bool:
        return key in self._ledger.entries

    def __len__(self) -> int:
        return len(self._ledger.entries)

    def keys(self) -> list[Hashable]:
        with self._lock:
            return list(self._ledger.entries)

    def tier_of(self, key: Hashable) -> str | None:
        """The tier ``key``'s value is in now (None when it is not cached)."""
        entry = self._ledger.entries.get(key)
        return None if entry is None else entry.tier

    def discard(self, key: Hashable) -> bool:
        """Forget ``key`` (and delete its file); False when it was not cached."""
        with self._lock:
            return self._mover.discard(key)

    def prefetch(self, keys: Hashable | Iterable[Hashable]) -> Future[int]:
        """Start moving ``keys``' values to the device tier, in the background.

        Returns a future of how many were moved. On a CUDA device the copies run on a
        side stream from pinned memory and :meth:`get` waits only for its own value's
        copy (an event), not for the device.
        """
        todo: list[Hashable] = (
            [keys] if isinstance(keys, (str, int, tuple)) else list(keys)  # type: ignore[arg-type]
        )
        return self._prefetcher.submit(todo)

    def pin(self, key: Hashable) -> None:
        """Keep ``key``'s value in the device tier (moved there now) until :meth:`unpin`."""
        with self._lock:
            entry = self._ledger.entries.get(key)
            if entry is None:
                raise KeyError(key)
            if entry.tier != "gpu":
                self._mover.promote(entry)
            if entry.tier != "gpu":
                raise CacheError(
                    f"cannot pin {key!r} ({format_bytes(entry.layout.nbytes)}): the device "
                    f"tier ({format_bytes(self.limit['gpu'])}) cannot make room for it"
                )
            self._mover.pin(entry)

    def unpin(self, key: Hashable) -> None:
        """Let ``key``'s value be moved down again."""
        with self._lock:
            entry = self._ledger.entries.get(key)
            if entry is not None and entry.pinned:
                entry.pinned = False
                self._ledger.policies[entry.tier].add(key)

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
            policy = self._ledger.policies[tier]
            while policy and (want is None or before - self.used[tier] < want):
                victim = policy.victim()
                assert victim is not None
                self._metrics.evictions[tier] += 1
                self._mover.demote(self._ledger.entries[victim])
            if tier == "host":
                self._mover.reclaim(wait=True)
                self.pool.release()
            if tier == "gpu":
                self.device.release_cache()
            return before - self.used[tier]

    def clear(self) -> None:
        """Forget every value (and delete the disk tier's files)."""
        with self._lock:
            for key in list(self._ledger.entries):
                self._mover.discard(key)
            self._mover.reclaim(wait=True)
            self.pool.release()

    def close(self) -> None:
        """Stop the prefetch thread and stop answering the guard; values stay on disk."""
        self._prefetcher.close()
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
            store = self._io.store
            return self._metrics.stats(
                self._ledger,
                self.pool,
                device=self.device.id,
                policy=self.policy_name,
                store_corrupted=store.corrupted if store else 0,
                under_pressure=sorted(self._pressure),
                compression=self.compressor.stats(),
            )

    def metrics(self) -> list[tuple[str, str, str, dict[str, str], float]]:
        """Prometheus samples: ``(name, "gauge" or "counter", help, labels, value)``."""
        return samples(self.stats())

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self.keys())

    def __repr__(self) -> str:
        return (
            f"TensorCache({len(self)} values, {self._ledger.budgets_text()}, on {self.device.id})"
        )
