"""The tiered tensor cache on a Zipf trace over more data than the device tier holds.

N items of 256 KiB to 1 MiB each (seeded, one generator per key), in three kinds:
``features`` (a float32 tensor), ``tokens`` (an int64 tensor of small token ids, which
zstd shrinks) and ``pair`` (a dict ``{"emb": float32, "ids": int64}``). Each item's
CRC-32 is taken when it is made. ``vramctl.TensorCache`` gets a device tier of 1/8 of
the data and a disk tier (a temporary directory) of 1/2, in two scenarios: *memory*, a
host tier as large as the data (what the plain dict holds), against the plain dict; and
*spill*, a host tier of half the data, the rest on disk, against Accelerate's offload
with the same memory. The items start in the host tier (``put``).

The trace draws keys with probability proportional to 1/rank^1.1 (ranks shuffled over
the keys, so key order says nothing of popularity). A warm-up trace (not timed) comes
first. Each access delivers the item on the device and uses it (``.sum()`` of its first
tensor, and a CUDA synchronize); its time is the get, the use and the synchronize. Three
workloads run the same warm-up and trace over the same data:

- ``cache``: ``cache.get(key)`` (policy ``lru``), in each scenario; each get's time is
  attributed to the tier ``cache.tier_of(key)`` named just before it;
- ``plain``: a dict of every item in pageable host memory, ``.to(device)`` each access;
- ``accelerate``: Accelerate's offload of the same tensors (``key``, or ``key.emb`` and
  ``key.ids``): those that fit in the cache's device and host budgets together stay in
  memory (``OffloadedWeightsLoader(state_dict=...)``), the rest are written with
  ``offload_state_dict`` and memory-mapped back; ``loader[name].to(device)`` each access.

``speedup_vs_plain`` (goal > 1) and ``speedup_vs_accelerate`` are the cache's accesses
per second over theirs. The cache runs the trace again with ``slru``, with ``lfu`` and
with ``lru`` and ``compress=False`` (hit rates per tier and accesses per second only);
``compression`` gives the seconds spent compressing and decompressing during the timed
trace, and their share of the cache's time. Every value the cache returns is checked
against its CRC-32 on a CPU copy, outside the timed get: ``corrupted_items`` counts the
items that ever came back different or that the cache reported corrupt (goal 0).
``budget_violations`` (goal 0) adds to the cache's own counter the budget checks made
from outside after every access: the device memory at its peak during the get, less what
the caller holds as a copy the device tier did not keep, within the device budget; the
host pool's bytes within the host budget; and (every 50 accesses) the files in the disk
directory within the disk budget.

Host-to-device bandwidth, measured on large values (64 MiB, 16 MiB with ``--quick``) as a
link is measured: a value in a cache's host tier read with ``get(key, promote=False)``,
against a plain copy of a tensor of the same size (pinned on CUDA,
``.to(device, non_blocking=True)`` and a synchronize), interleaved;
``h2d_bandwidth_ratio`` is the cache's over the plain copy's (goal >= 0.8), each the
median over the gets of bytes over seconds. ``h2d_small_items`` is the same on the
trace's own items (about 1 MiB), where the cache's fixed cost per get shows.

Without a GPU, or with ``--sim``, the device is a simulated GPU (``vramctl.simulate``):
its memory is counted, copies to it are memory copies on the CPU, so the bandwidth and
speed figures there say what the cache's bookkeeping costs, not what a PCIe link gives;
every tensor operation there also goes through the simulation's dispatch hook, which the
cache, doing more operations per get, pays more often. ``h2d_unsimulated`` repeats the
bandwidth comparison with no simulated GPU (the cache delivering to the CPU,
``device="cpu"``). The exit status is 0 when the correctness goals are met (and, on a
GPU, every goal).

The last line is one JSON object.

    python benchmarks/tensor_cache.py --quick     # 128 items, 2000 accesses: under a minute
    python benchmarks/tensor_cache.py             # 512 items, 10000 accesses
    python benchmarks/tensor_cache.py --cuda      # the same on this machine's GPU
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils._pytree import tree_leaves, tree_map

import vramctl
from vramctl.cache import CorruptItemError

import _common

KiB, MiB = 2**10, 2**20
KINDS = ("features", "tokens", "pair")
ZIPF_S = 1.1
DISK_CHECK_EVERY = 50
#: The simulated GPU's capacity (the cache's device tier is its own budget inside it).
SIM_GPU = "1GiB"
#: The cache's other runs on the same trace: (name, policy, compress).
VARIANTS = (("slru", "slru", "auto"), ("lfu", "lfu", "auto"), ("lru_uncompressed", "lru", False))


# -- the data -------------------------------------------------------------------------------


@dataclass
class Item:
    key: int
    kind: str
    value: Any  # CPU tensors, pageable
    nbytes: int
    crc: int


def digest(value: Any) -> int:
    """CRC-32 of a value's tensors (dtype, shape and bytes), read on the CPU."""
    crc = 0
    for leaf in tree_leaves(value):
        t = leaf.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        crc = zlib.crc32(f"{t.dtype}{tuple(t.shape)}".encode(), crc)
        crc = zlib.crc32(t.reshape(-1).view(torch.uint8).numpy(), crc)
    return crc


def nbytes_of(value: Any) -> int:
    return sum(t.nbytes for t in tree_leaves(value))


#: The values the bandwidth is measured on: 64 MiB (16 MiB in a quick run).
LARGE_ITEM = 64 * MiB
LARGE_ITEM_QUICK = 16 * MiB


def make_item(key: int, seed: int) -> Item:
    """Item ``key``: 256 KiB to 1 MiB, its kind by ``key % 3``, its content by its seed."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + key)
    size = int(torch.randint(256 * KiB, MiB + 1, (1,), generator=g)) // 4096 * 4096
    kind = KINDS[key % 3]
    value: Any
    if kind == "features":
        value = torch.randn(size // 1024, 256, generator=g)
    elif kind == "tokens":
        value = torch.randint(0, 1000, (size // 8,), generator=g)
    else:
        value = {
            "emb": torch.randn(size // 2048, 256, generator=g),
            "ids": torch.randint(0, 1000, (size // 16,), generator=g),
        }
    return Item(key, kind, value, nbytes_of(value), digest(value))


def zipf_trace(n: int, length: int, rng: np.random.Generator, perm: np.ndarray) -> list[int]:
    """``length`` keys: rank r drawn with probability proportional to 1/r^s, mapped to keys
    by ``perm``."""
    p = 1.0 / np.arange(1, n + 1) ** ZIPF_S
    ranks = rng.choice(n, size=length, p=p / p.sum())
    return [int(perm[r]) for r in ranks]


def flat_names(item: Item) -> dict[str, torch.Tensor]:
    """The item's tensors under flat names, for Accelerate."""
    if isinstance(item.value, dict):
        return {f"{item.key}.{k}": v for k, v in item.value.items()}
    return {str(item.key): item.value}


# -- the device ------------------------------------------------------------------------------


class Target:
    """Where the values are delivered: a CUDA GPU, or a simulated one (entered)."""

    def __init__(self, cuda: bool, sim: Any) -> None:
        self.cuda = cuda
        self.sim = sim
        self.dev = torch.device("cuda", 0) if cuda else torch.device("cpu")

    @property
    def name(self) -> str:
        if self.cuda:
            return torch.cuda.get_device_name(0)
        return "cpu" if self.sim is None else str(self.sim.id)

    def to_device(self, value: Any) -> Any:
        """The copy a user writes: ``.to(device)`` (a counted copy on the simulated GPU)."""
        if self.cuda:
            return tree_map(lambda t: t.to(self.dev, non_blocking=t.is_pinned()), value)
        return tree_map(lambda t: torch.empty_like(t).copy_(t), value)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.dev)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.dev) if self.cuda else self.sim.allocated_bytes

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.dev)
        else:
            self.sim.reset_peak()

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.dev) if self.cuda else self.sim.peak_bytes

    def host(self) -> contextlib.AbstractContextManager[Any]:
        """Host-side allocations (not counted by the simulated GPU)."""
        return contextlib.nullcontext() if self.sim is None else self.sim.uncounted()


def use(value: Any) -> None:
    """The trivial use: the sum of the first tensor."""
    tree_leaves(value)[0].sum()


def ms_stats(seconds: list[float]) -> dict[str, Any]:
    if not seconds:
        return {"count": 0, "mean": None, "p50": None, "p95": None}
    s = sorted(seconds)
    return {
        "count": len(s),
        "mean": round(1e3 * statistics.fmean(s), 4),
        "p50": round(1e3 * s[len(s) // 2], 4),
        "p95": round(1e3 * s[max(0, math.ceil(0.95 * len(s)) - 1)], 4),
    }


@dataclass
class Run:
    name: str
    seconds: list[float] = field(default_factory=list)
    bytes: int = 0
    setup_s: float = 0.0

    def figures(self) -> dict[str, Any]:
        total = sum(self.seconds)
        return {
            "accesses": len(self.seconds),
            "seconds": round(total, 4),
            "per_s": round(len(self.seconds) / total, 1) if total else None,
            "gbps": round(self.bytes / total / 1e9, 4) if total else None,
            "latency_ms": ms_stats(self.seconds),
            "setup_s": round(self.setup_s, 3),
        }


def drive(access: Callable[[int], Any], keys: list[int], target: Target, run: Run | None) -> None:
    """Access ``keys`` in turn, timing each get, use and synchronize when ``run`` is given."""
    for key in keys:
        t0 = time.perf_counter()
        value = access(key)
        use(value)
        target.sync()
        dt = time.perf_counter() - t0
        if run is not None:
            run.seconds.append(dt)
            run.bytes += nbytes_of(value)
        del value


# -- the workloads -------------------------------------------------------------------------


def plain_run(items: dict[int, Item], warm: list[int], trace: list[int], target: Target) -> Run:
    run = Run("plain")
    data = {k: it.value for k, it in items.items()}

    def access(key: int) -> Any:
        return target.to_device(data[key])

    drive(access, warm, target, None)
    drive(access, trace, target, run)
    return run


def accelerate_run(
    items: dict[int, Item],
    warm: list[int],
    trace: list[int],
    target: Target,
    in_memory_bytes: int,
    folder: Path,
) -> tuple[Run, dict[str, Any]]:
    from accelerate.utils import OffloadedWeightsLoader, offload_state_dict

    run = Run("accelerate")
    memory: dict[str, torch.Tensor] = {}
    offload: dict[str, torch.Tensor] = {}
    held = 0
    for key in sorted(items):  # in key order, as a device map fills: popularity unknown
        it = items[key]
        if held + it.nbytes <= in_memory_bytes:
            memory.update(flat_names(it))
            held += it.nbytes
        else:
            offload.update(flat_names(it))
    t0 = time.perf_counter()
    with target.host():
        offload_state_dict(str(folder), offload)
        loader = OffloadedWeightsLoader(state_dict=memory, save_folder=str(folder))
    run.setup_s = time.perf_counter() - t0

    def load(name: str) -> torch.Tensor:
        with target.host():  # read into host memory, then the copy to the device
            t = loader[name]
        return target.to_device(t)

    def access(key: int) -> Any:
        if items[key].kind == "pair":
            return {"emb": load(f"{key}.emb"), "ids": load(f"{key}.ids")}
        return load(str(key))

    drive(access, warm, target, None)
    drive(access, trace, target, run)
    info = {
        "in_memory_bytes": held,
        "in_memory_tensors": len(memory),
        "offloaded_tensors": len(offload),
        "offloaded_bytes": sum(t.nbytes for t in offload.values()),
    }
    return run, info


@dataclass
class Checks:
    device: int = 0
    host: int = 0
    disk: int = 0
    worst_device_over: int = 0
    disk_checks: int = 0
    corrupted: set[int] = field(default_factory=set)
    misses: int = 0
    peak_device: int = 0  # the device tier's use at its peak, seen from outside


def dir_bytes(path: Path) -> int:
    total = 0
    with os.scandir(path) as it:
        for entry in it:
            with contextlib.suppress(FileNotFoundError):
                if entry.is_file():
                    total += entry.stat().st_size
    return total


def make_cache(
    budgets: dict[str, int], folder: Path, policy: str, target: Target, compress: Any = "auto"
) -> Any:
    return vramctl.TensorCache(
        gpu=budgets["gpu"],
        host=budgets["host"],
        disk_dir=folder,
        disk=budgets["disk"],
        device="cuda:0" if target.cuda else None,
        policy=policy,
        compress=compress,
    )


def refetching(cache: Any, items: dict[int, Item]) -> Callable[[int], Any]:
    """``cache.get``, and on a miss (a value dropped from the disk tier) the value put again
    from its source."""

    def access(key: int) -> Any:
        value = cache.get(key, None)
        if value is None:
            cache.put(key, items[key].value)
            value = cache.get(key)
        return value

    return access


def fill(cache: Any, items: dict[int, Item], target: Target) -> float:
    t0 = time.perf_counter()
    for key in sorted(items):
        cache.put(key, items[key].value)
    target.sync()
    return time.perf_counter() - t0


def cache_run(
    items: dict[int, Item],
    warm: list[int],
    trace: list[int],
    target: Target,
    budgets: dict[str, int],
    folder: Path,
) -> tuple[Any, Run, dict[str, list[float]], Checks, dict[str, float]]:
    """The cache with policy LRU: timed per tier, every value checked, budgets watched.

    Also returns the seconds the cache spent compressing and decompressing during the trace.
    """
    base = target.allocated()
    cache = make_cache(budgets, folder, "lru", target)
    run = Run("cache")
    run.setup_s = fill(cache, items, target)
    drive(refetching(cache, items), warm, target, None)
    before = cache.stats()["compression"]
    by_tier: dict[str, list[float]] = {"gpu": [], "host": [], "disk": [], "miss": []}
    checks = Checks()
    for i, key in enumerate(trace):
        tier = cache.tier_of(key) or "miss"
        target.reset_peak()
        t0 = time.perf_counter()
        try:
            value = cache.get(key, None)
        except CorruptItemError:
            value = None
            checks.corrupted.add(key)
        peak = target.peak()
        if value is None:  # not cached (dropped, or corrupt): fetched again from the source
            checks.misses += 1
            cache.put(key, items[key].value)
            value = cache.get(key)
        use(value)
        target.sync()
        dt = time.perf_counter() - t0
        run.seconds.append(dt)
        by_tier[tier].append(dt)
        nbytes = nbytes_of(value)
        run.bytes += nbytes
        # Outside the timed access: the value's checksum, and the budgets.
        with target.host():
            if digest(value) != items[key].crc:
                checks.corrupted.add(key)
        copy = nbytes if cache.tier_of(key) != "gpu" else 0  # a copy the device tier did not keep
        over = peak - base - copy - budgets["gpu"]
        checks.peak_device = max(checks.peak_device, peak - base - copy)
        if over > 0:
            checks.device += 1
            checks.worst_device_over = max(checks.worst_device_over, over)
        if cache.pool.held > budgets["host"]:
            checks.host += 1
        if i % DISK_CHECK_EVERY == 0:
            checks.disk_checks += 1
            if dir_bytes(folder) > budgets["disk"]:
                checks.disk += 1
        del value
    after = cache.stats()["compression"]
    codec = {k: round(after[k] - before[k], 4) for k in ("compress_s", "decompress_s")}
    return cache, run, by_tier, checks, codec


def variant_run(
    policy: str,
    compress: Any,
    items: dict[int, Item],
    warm: list[int],
    trace: list[int],
    target: Target,
    budgets: dict[str, int],
    folder: Path,
) -> dict[str, Any]:
    """Hits per tier and accesses per second on the same trace with another policy or
    without compression (no checks; one timer around the whole trace)."""
    cache = make_cache(budgets, folder, policy, target, compress)
    fill(cache, items, target)
    access = refetching(cache, items)
    drive(access, warm, target, None)
    counts = {"gpu": 0, "host": 0, "disk": 0, "miss": 0}
    t0 = time.perf_counter()
    for key in trace:
        counts[cache.tier_of(key) or "miss"] += 1
        value = access(key)
        use(value)
        target.sync()
        del value
    wall = time.perf_counter() - t0
    violations = cache.budget_violations
    dropped = cache.dropped
    cache.clear()
    cache.close()
    n = len(trace)
    return {
        "hit_rate": round(1 - counts["miss"] / n, 4),
        "hit_rate_by_tier": {t: round(c / n, 4) for t, c in counts.items() if t != "miss"},
        "per_s": round(n / wall, 1),
        "budget_violations": violations,
        "dropped": dropped,
    }


def h2d_bandwidth(cache: Any, items: dict[int, Item], target: Target, reps: int) -> dict[str, Any]:
    """A host-tier hit (``promote=False``) against a plain copy of the same size, interleaved."""
    keys = [k for k, it in items.items() if it.kind == "features" and cache.tier_of(k) == "host"]
    keys = sorted(keys, key=lambda k: -items[k].nbytes)[:8]
    if not keys:
        return {"keys": 0}
    sources = {}
    with target.host():
        for k in keys:
            t = items[k].value.clone()
            sources[k] = t.pin_memory() if target.cuda else t
    cache_s: list[float] = []
    copy_s: list[float] = []
    nbytes: list[int] = []
    for _ in range(reps):
        for k in keys:
            src = sources[k]
            t0 = time.perf_counter()
            out = target.to_device(src)
            target.sync()
            copy_s.append(time.perf_counter() - t0)
            del out
            t0 = time.perf_counter()
            out = cache.get(k, promote=False)
            target.sync()
            cache_s.append(time.perf_counter() - t0)
            del out
            nbytes.append(items[k].nbytes)
    cache_gbps = statistics.median(b / s for b, s in zip(nbytes, cache_s, strict=True)) / 1e9
    copy_gbps = statistics.median(b / s for b, s in zip(nbytes, copy_s, strict=True)) / 1e9
    return {
        "keys": len(keys),
        "reps": reps,
        "item_bytes": sorted({items[k].nbytes for k in keys}),
        "cache_gbps": round(cache_gbps, 3),
        "pinned_copy_gbps": round(copy_gbps, 3),
        "ratio": round(cache_gbps / copy_gbps, 4),
        "cache_ms_median": round(1e3 * statistics.median(cache_s), 4),
        "copy_ms_median": round(1e3 * statistics.median(copy_s), 4),
        "pinned": bool(target.cuda),
    }


def h2d_large(target: Target, reps: int, size: int) -> dict[str, Any]:
    """Bandwidth, measured on large values (as nvbandwidth measures a link): four float32
    tensors of ``size`` bytes in a cache's host tier, read with ``get(key, promote=False)``,
    against a plain copy of the same tensor (pinned on CUDA)."""
    items: dict[int, Item] = {}
    with target.host():
        for k in range(4):
            g = torch.Generator().manual_seed(1000 + k)
            value = torch.randn(size // 4, generator=g)
            items[k] = Item(k, "features", value, value.nbytes, 0)
    cache = vramctl.TensorCache(
        host=sum(it.nbytes for it in items.values()) + size,
        device="cuda:0" if target.cuda else None,
    )
    for it in items.values():
        cache.put(it.key, it.value, tier="host")
    try:
        return h2d_bandwidth(cache, items, target, reps)
    finally:
        cache.clear()
        cache.close()


def h2d_unsimulated(items: dict[int, Item], reps: int) -> dict[str, Any]:
    """The same comparison with no simulated GPU: the cache delivers to the CPU
    (``device="cpu"``, the largest ``features`` items in its host tier) and the plain copy
    is ``torch.empty_like(t).copy_(t)``; neither pays the simulation's dispatch."""
    feats = sorted(
        (it for it in items.values() if it.kind == "features"), key=lambda it: -it.nbytes
    )[:8]
    cache = vramctl.TensorCache(host=2 * sum(it.nbytes for it in feats), device="cpu")
    for it in feats:
        cache.put(it.key, it.value, tier="host")
    try:
        return h2d_bandwidth(cache, {it.key: it for it in feats}, Target(False, None), reps)
    finally:
        cache.clear()
        cache.close()


# -- main -----------------------------------------------------------------------------------


@contextlib.contextmanager
def device_context(cuda: bool) -> Iterator[Target]:
    if cuda:
        yield Target(True, None)
        return
    with vramctl.simulate(SIM_GPU) as gpu:
        yield Target(False, gpu)


def main(argv: list[str] | None = None) -> int:
    ap = _common.parser(
        __doc__,
        quick="128 items, 2000 accesses; under a minute",
        cuda="on this machine's GPU (the default where CUDA is usable)",
        seed="data and trace seed",
        threads=True,
    )
    ap.add_argument("--sim", action="store_true", help="a simulated GPU even where CUDA is usable")
    ap.add_argument("--items", type=int, help="how many items (128 quick, 512 full)")
    ap.add_argument("--accesses", type=int, help="timed accesses (2000 quick, 10000 full)")
    args = _common.parse(ap, argv)
    cuda = bool(args.cuda) or (torch.cuda.is_available() and not args.sim)
    n = args.items or (128 if args.quick else 512)
    accesses = args.accesses or (2000 if args.quick else 10000)
    reps = 10 if args.quick else 30
    warm_n = max(200, accesses // 5)
    started = time.perf_counter()

    items = {k: make_item(k, args.seed) for k in range(n)}
    total = sum(it.nbytes for it in items.values())
    # spill: the host tier holds half the data, the rest is on disk (against Accelerate's
    # offload with the same memory); memory: the host tier holds what the plain dict holds
    # (all of it), the device tier 1/8 (against the plain dict).
    budgets = {"gpu": total // 8, "host": total // 2, "disk": total // 2}
    budgets_memory = {"gpu": total // 8, "host": total + total // 16, "disk": total // 2}
    rng = np.random.default_rng(args.seed)
    perm = rng.permutation(n)
    warm = zipf_trace(n, warm_n, rng, perm)
    trace = zipf_trace(n, accesses, rng, perm)
    by_kind = {kind: sum(1 for it in items.values() if it.kind == kind) for kind in KINDS}
    print(
        f"# {n} items ({by_kind}), {total / MiB:.1f} MiB; budgets: device "
        f"{budgets['gpu'] / MiB:.1f} MiB, host {budgets['host'] / MiB:.1f} MiB, disk "
        f"{budgets['disk'] / MiB:.1f} MiB; trace {accesses} accesses (zipf s={ZIPF_S}, "
        f"{len(set(trace))} distinct keys) after {warm_n} warm-up",
        flush=True,
    )

    with (
        device_context(cuda) as target,
        tempfile.TemporaryDirectory(prefix="vramctl-cache-bench-") as tmp,
    ):
        tmpdir = Path(tmp)
        print(f"# device: {target.name}", flush=True)

        plain = plain_run(items, warm, trace, target)
        print(f"plain       {plain.figures()['per_s']:>10} accesses/s", flush=True)
        acc, acc_info = accelerate_run(
            items, warm, trace, target, budgets["gpu"] + budgets["host"], tmpdir / "accelerate"
        )
        print(f"accelerate  {acc.figures()['per_s']:>10} accesses/s", flush=True)

        mem_cache, mem_run, mem_tier, mem_checks, _ = cache_run(
            items, warm, trace, target, budgets_memory, tmpdir / "cache-memory"
        )
        mem_stats = mem_cache.stats()
        mem_cache.clear()
        mem_cache.close()
        del mem_cache
        print(f"cache (memory) {mem_run.figures()['per_s']:>7} accesses/s", flush=True)
        folder = tmpdir / "cache-lru"
        cache, run, by_tier, checks, codec = cache_run(items, warm, trace, target, budgets, folder)
        print(f"cache (spill) {run.figures()['per_s']:>8} accesses/s", flush=True)
        h2d_small = h2d_bandwidth(cache, items, target, reps)
        stats = cache.stats()
        cache.clear()
        cache.close()
        del cache
        h2d = h2d_large(target, reps, LARGE_ITEM_QUICK if args.quick else LARGE_ITEM)

        variants: dict[str, Any] = {}
        for name, policy, compress in VARIANTS:
            variants[name] = variant_run(
                policy, compress, items, warm, trace, target, budgets, tmpdir / f"cache-{name}"
            )
            print(f"cache ({name}) {variants[name]['per_s']:>9} accesses/s", flush=True)
        device_name = target.name
    # Outside the simulated GPU: the cache's own cost per host-tier get, beside a plain copy.
    h2d_cpu = None if cuda else h2d_unsimulated(items, reps)

    figures = {"cache": run.figures(), "plain": plain.figures(), "accelerate": acc.figures()}
    for name, f in figures.items():
        lat = f["latency_ms"]
        print(
            f"{name:<11} {f['per_s']:>9} /s {f['gbps']:>8} GB/s  mean {lat['mean']} ms "
            f"p50 {lat['p50']} p95 {lat['p95']} (setup {f['setup_s']} s)"
        )
    hit_by_tier = {t: round(len(by_tier[t]) / accesses, 4) for t in ("gpu", "host", "disk")}
    hit_rate = round(1 - len(by_tier["miss"]) / accesses, 4)
    latency = {t: ms_stats(s) for t, s in by_tier.items() if s}
    for t, lat in latency.items():
        print(
            f"  {t:<5} {hit_by_tier.get(t, 0.0):>7.2%} of accesses: mean {lat['mean']} ms, "
            f"p50 {lat['p50']}, p95 {lat['p95']}"
        )
    speedup_plain = round(mem_run.figures()["per_s"] / figures["plain"]["per_s"], 3)
    speedup_acc = round(figures["cache"]["per_s"] / figures["accelerate"]["per_s"], 3)
    own = stats["budget_violations"] + mem_stats["budget_violations"]
    violations = own + checks.device + checks.host + checks.disk
    violations += mem_checks.device + mem_checks.host + mem_checks.disk
    # Items that came back different from their checksum, or that the cache reported corrupt.
    corrupted = len(checks.corrupted | mem_checks.corrupted)
    comp = stats["compression"]
    h2d_ratio = h2d.get("ratio")
    goals = {
        "h2d_bandwidth_ratio_ge_0.8": h2d_ratio is not None and h2d_ratio >= 0.8,
        "budget_violations_0": violations == 0,
        "corrupted_items_0": corrupted == 0
        and stats["corrupted_items"] + mem_stats["corrupted_items"] == 0,
        "speedup_vs_plain_gt_1": speedup_plain > 1,
    }
    summary: dict[str, Any] = {
        "benchmark": "tensor_cache",
        "side": "cuda" if cuda else "sim",
        "quick": args.quick,
        "device": device_name,
        "items": n,
        "items_by_kind": by_kind,
        "data_bytes": total,
        "budgets": budgets,
        "accesses": accesses,
        "warmup_accesses": warm_n,
        "distinct_keys": len(set(trace)),
        "zipf_s": ZIPF_S,
        "policy": "lru",
        "hit_rate": hit_rate,
        "hit_rate_by_tier": hit_by_tier,
        "latency_ms_by_tier": latency,
        "throughput_per_s": {k: f["per_s"] for k, f in figures.items()},
        "gbps_delivered": {k: f["gbps"] for k, f in figures.items()},
        "latency_ms": {k: f["latency_ms"] for k, f in figures.items()},
        "setup_s": {k: f["setup_s"] for k, f in figures.items()},
        "speedup_vs_plain": speedup_plain,
        "memory_scenario": {
            "budgets": budgets_memory,
            "per_s": mem_run.figures()["per_s"],
            "latency_ms": mem_run.figures()["latency_ms"],
            "hit_rate_by_tier": {
                t: round(len(mem_tier[t]) / accesses, 4) for t in ("gpu", "host", "disk")
            },
            "latency_ms_by_tier": {t: ms_stats(v) for t, v in mem_tier.items() if v},
            "bypass": mem_stats["bypass"],
        },
        "speedup_vs_accelerate": speedup_acc,
        "h2d_bandwidth_ratio": h2d_ratio,
        "h2d_gbps": {"cache": h2d.get("cache_gbps"), "pinned_copy": h2d.get("pinned_copy_gbps")},
        "h2d": h2d,
        "h2d_small_items": h2d_small,
        "h2d_unsimulated": h2d_cpu,
        "budget_violations": violations,
        "budget_violations_by_check": {
            "cache_counter": own,
            "device_peak": checks.device,
            "host_pool": checks.host,
            "disk_dir": checks.disk,
            "disk_dir_checks": checks.disk_checks,
            "worst_device_over_bytes": checks.worst_device_over,
        },
        "device_tier_peak_seen_bytes": checks.peak_device,
        "corrupted_items": corrupted,
        "cache_corrupted_counter": stats["corrupted_items"],
        "misses": checks.misses,
        "compression": {
            "ratio": comp["ratio"],
            "raw_bytes": comp["raw_bytes"],
            "compressed_bytes": comp["compressed_bytes"],
            "compress_s": comp["compress_s"],
            "decompress_s": comp["decompress_s"],
            "tries": comp["tries"],
            "trace_compress_s": codec["compress_s"],
            "trace_decompress_s": codec["decompress_s"],
            "trace_share": round(
                (codec["compress_s"] + codec["decompress_s"]) / figures["cache"]["seconds"], 4
            ),
        },
        "cache_stats": {
            "gets": stats["gets"],
            "dropped": stats["dropped"],
            "bypass": stats["bypass"],
            "tiers": {
                t: {
                    k: s[k]
                    for k in (
                        "hits",
                        "items",
                        "used_bytes",
                        "peak_bytes",
                        "budget_bytes",
                        "evictions",
                        "seconds_in",
                    )
                }
                for t, s in stats["tiers"].items()
            },
            "host_pool_peak_held_bytes": stats["tiers"]["host"]["pool_peak_held_bytes"],
            "host_pinned": stats["tiers"]["host"]["pinned"],
        },
        "accelerate": {"version": _common.version("accelerate"), **acc_info},
        "variants": variants,
        "goals": goals,
        "wall_s": round(time.perf_counter() - started, 1),
        **_common.machine(cuda),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
    summary["device"] = device_name
    print(
        f"# hit rate {hit_rate} (gpu {hit_by_tier['gpu']}, host {hit_by_tier['host']}, disk "
        f"{hit_by_tier['disk']}); speedup vs plain {speedup_plain}, vs accelerate "
        f"{speedup_acc}; h2d {h2d.get('cache_gbps')} GB/s vs {h2d.get('pinned_copy_gbps')} "
        f"(ratio {h2d_ratio}); budget violations {violations}; corrupted {corrupted}; "
        f"compression ratio {comp['ratio']}",
        flush=True,
    )
    if h2d_cpu is not None:
        print(
            f"# h2d with no simulated GPU: cache {h2d_cpu.get('cache_gbps')} GB/s vs plain copy "
            f"{h2d_cpu.get('pinned_copy_gbps')} GB/s (ratio {h2d_cpu.get('ratio')})",
            flush=True,
        )
    correct = goals["budget_violations_0"] and goals["corrupted_items_0"]
    return _common.finish(summary, all(goals.values()) if cuda else correct)


if __name__ == "__main__":
    sys.exit(main())
