"""The cache's moves between tiers: a new value placed, values moved down to make room
(dropped from the lowest tier), moved up on hits, copied to the device for a get, and
released; every move makes room before its copy starts, so no tier holds more than its
budget, not even during a move. All of it runs under the cache's lock."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Hashable
from dataclasses import replace
from typing import Any

import torch

from vramctl.cache._codec import Layout, PartMeta, checksum
from vramctl.cache._disk import FORMAT as FORMAT_TAG
from vramctl.cache._disk import CorruptItemError, encode_key
from vramctl.cache._io import TierIO
from vramctl.cache._ledger import TIERS, Entry, Ledger
from vramctl.cache._metrics import Metrics
from vramctl.cache._pool import Block, HostPool
from vramctl.cache._pool import aligned as _aligned
from vramctl.guard import is_oom

__all__ = ["Mover"]

log = logging.getLogger("vramctl.cache")


def _compact(t: torch.Tensor) -> bool:
    """Whether ``t`` is its whole storage (keeping it keeps nothing more alive)."""
    return t.is_contiguous() and t.untyped_storage().nbytes() == t.nbytes


class Mover:
    """Moves values between the tiers of ``ledger`` through ``io``, host memory from
    ``pool``, counting in ``metrics``."""

    def __init__(self, ledger: Ledger, metrics: Metrics, io: TierIO, pool: HostPool) -> None:
        self.ledger = ledger
        self.metrics = metrics
        self.io = io
        self.pool = pool
        self.deferred: list[tuple[Any, Block]] = []  # blocks a pending copy still reads

    def room(self, tier: str, nbytes: int) -> bool:
        """Move values out of ``tier`` until ``nbytes`` more fit in its limit."""
        policy = self.ledger.policies[tier]
        while self.ledger.used[tier] + nbytes > self.ledger.limit[tier]:
            victim = policy.victim()
            if victim is None:
                return False
            self.metrics.evictions[tier] += 1
            self.demote(self.ledger.entries[victim])
        return True

    def alloc_blocks(self, sizes: list[int]) -> tuple[list[Block], list[Block]] | None:
        """One block of the host pool for parts of ``sizes`` (room made first), and a block
        inside it for each part; or None. One block per value: a value that fits the tier
        never fails for want of a second segment."""
        total = sum(_aligned(s) for s in sizes)
        if not sizes:
            return [], []
        if total > self.ledger.limit["host"] or not self.room("host", total):
            return None
        policy = self.ledger.policies["host"]
        while True:
            block = self.pool.alloc(total)
            if block is not None:
                break
            if self.reclaim(wait=True):
                continue
            victim = policy.victim()
            if victim is None:  # fragmented, and nothing left to move: give up
                return None
            self.metrics.evictions["host"] += 1
            self.demote(self.ledger.entries[victim])
        subs: list[Block] = []
        offset = block.offset
        for size in sizes:
            subs.append(Block(block.segment, offset, _aligned(size)))
            offset += _aligned(size)
        return [block], subs

    def reclaim(self, wait: bool = False) -> bool:
        """Free the host blocks whose pending copies have finished (all of them: ``wait``)."""
        if not self.deferred:
            return False
        keep: list[tuple[Any, Block]] = []
        freed = False
        for event, block in self.deferred:
            if wait or event.query():
                event.synchronize()
                self.pool.free(block)
                freed = True
            else:
                keep.append((event, block))
        self.deferred = keep
        return freed

    def leave(self, entry: Entry) -> None:
        """Release what ``entry`` holds in its tier (its value is elsewhere, or forgotten)."""
        tier = entry.tier
        self.ledger.policies[tier].remove(entry.key)
        if tier == "gpu":
            entry.dev = None
        elif tier == "host":
            for block in entry.host or ():
                if entry.ready is not None:  # a copy still reads it: free it when it ends
                    self.deferred.append((entry.ready, block))
                else:
                    self.pool.free(block)
            entry.host = None
            entry.views = None
        elif entry.path is not None and self.io.store is not None:
            self.io.store.remove(entry.path)
            entry.path = None
        entry.ready = None
        self.ledger.account(tier, -entry.charge)
        entry.tier = ""
        entry.charge = 0

    def arrive(self, entry: Entry, tier: str, handle: Any, charge: int) -> None:
        """Record ``entry`` in ``tier``, holding ``handle`` there (its device tensors, its
        host blocks, or its file) and counted as ``charge`` bytes."""
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
            self.ledger.policies[tier].add(entry.key)

    def discard(self, key: Hashable) -> bool:
        """Forget ``key``, releasing what its value holds; False when it was not cached."""
        entry = self.ledger.entries.pop(key, None)
        if entry is None:
            return False
        if entry.tier:
            self.leave(entry)
        return True

    def pin(self, entry: Entry) -> None:
        """Keep ``entry`` (in the device tier) out of the device tier's eviction order."""
        entry.pinned = True
        self.ledger.policies["gpu"].remove(entry.key)

    def demote(self, entry: Entry) -> None:
        """Move ``entry`` one or more tiers down, or drop it from the lowest."""
        src = entry.tier
        self.ledger.policies[src].remove(entry.key)
        for dst in TIERS[TIERS.index(src) + 1 :]:
            if self.ledger.fits(entry, dst) and self.move(entry, dst):
                return
        self.leave(entry)
        del self.ledger.entries[entry.key]
        self.metrics.dropped += 1

    def promote(self, entry: Entry, tier: str = "gpu") -> bool:
        """Move ``entry`` up into ``tier`` when it fits there."""
        if self.ledger.charge(entry, tier) > self.ledger.limit[tier]:
            return False
        src = entry.tier
        self.ledger.policies[src].remove(entry.key)
        try:
            if self.move(entry, tier):
                return True
        except Exception as exc:
            if entry.tier != src or not is_oom(exc, device=self.io.device):
                raise
            # The device itself is full (another tenant): the value stays where it was.
            log.info("%r stays in the %s tier: the device is out of memory", entry.key, src)
        self.ledger.policies[src].add(entry.key)
        return False

    def place_new(
        self, entry: Entry, parts: list[torch.Tensor], tier: str, order: list[str]
    ) -> bool:
        """Put a new value's ``parts`` (wherever they are) into ``tier``, or a later one."""
        for t in order:
            if not self.ledger.fits(entry, t):
                continue
            if t == "gpu":
                need = self.ledger.charge(entry, "gpu")
                if not self.room("gpu", need):
                    continue
                t0 = time.perf_counter()
                dev = [
                    p if self.io.on_device(p) and _compact(p) else self.io.to_device(p, p.dtype)
                    for p in parts
                ]
                entry.ready = self.io.event()
                self.ledger.account("gpu", need)
                self.metrics.seconds_in["gpu"] += time.perf_counter() - t0
                self.arrive(entry, "gpu", dev, need)
                return True
            with self.io.host():
                cpu = [p if p.device.type == "cpu" else p.to("cpu") for p in parts]
                stored, metas = self.io.encode(entry, cpu, t)
            entry.layout.parts = metas
            placed = self.write_stored(entry, stored, t)
            if placed is not None:
                self.arrive(entry, t, *placed)
                return True
        return False

    def write_stored(
        self, entry: Entry, stored: list[torch.Tensor], tier: str
    ) -> tuple[Any, int] | None:
        """Copy stored parts into the host or disk ``tier`` (room made first); returns the
        blocks or file and the bytes counted, or None when no room can be made."""
        t0 = time.perf_counter()
        if tier == "host":
            with self.io.host():
                got = self.alloc_blocks([s.nbytes for s in stored])
                if got is None:
                    return None
                for block, s in zip(got[1], stored, strict=True):
                    block.bytes(s.nbytes).copy_(s.reshape(-1).view(torch.uint8))
            charge = sum(b.size for b in got[0])
            self.ledger.account("host", charge)
            self.metrics.seconds_in["host"] += time.perf_counter() - t0
            return got, charge
        assert self.io.store is not None
        layout_json = entry.layout.to_json()
        with self.io.host():
            crcs = [checksum(s) for s in stored]
        # The file: its header (the metadata as JSON, a line per part) and the parts.
        meta = [FORMAT_TAG, entry.encoded or "", json.dumps(layout_json), json.dumps(crcs)]
        header = len(json.dumps(meta)) + 160 * len(stored) + 256
        reserve = sum(s.nbytes for s in stored) + header
        if reserve > self.ledger.limit["disk"] or not self.room("disk", reserve):
            return None
        path = self.io.store.path_for(entry.key, entry.encoded)
        with self.io.host():
            self.ledger.used["disk"] += reserve  # held while the file is written
            try:
                charge = self.io.write(path, entry.encoded, layout_json, stored, crcs)
            finally:
                self.ledger.used["disk"] -= reserve
        if charge > reserve:  # never expected: the reservation bounds the file
            log.warning("%s took %d bytes, more than the %d reserved", path.name, charge, reserve)
        self.ledger.account("disk", charge)
        self.metrics.seconds_in["disk"] += time.perf_counter() - t0
        return path, charge

    def stored_parts(self, entry: Entry) -> list[torch.Tensor]:
        """``entry``'s stored parts as CPU tensors: views of its host blocks, or read from
        its file (checked against its checksums)."""
        metas = entry.layout.parts
        if entry.tier == "host":
            assert entry.views is not None
            if entry.ready is not None:  # the copy into these blocks may still run
                entry.ready.synchronize()
            return list(entry.views)
        assert entry.tier == "disk" and entry.path is not None and self.io.store is not None
        try:
            parts = self.io.read(entry.path, len(metas))
        except CorruptItemError:
            log.error("%r: its file failed its checksum; dropped from the cache", entry.key)
            self.discard(entry.key)
            raise
        return [
            p if m.codec == "zstd" else p.view(m.stored_dtype).view(m.shape)
            for p, m in zip(parts, metas, strict=True)
        ]

    def device_copy(self, entry: Entry) -> list[torch.Tensor]:
        """``entry``'s parts copied to the device (it stays in its tier)."""
        metas = entry.layout.parts
        with self.io.host():
            stored = self.stored_parts(entry)
            decoded = [
                self.io.compressor.decompress(s, m) if m.codec == "zstd" else s
                for s, m in zip(stored, metas, strict=True)
            ]
        out = [self.io.to_device(d, m.dtype) for d, m in zip(decoded, metas, strict=True)]
        event = self.io.event()
        if event is not None:
            torch.cuda.current_stream(self.io.device.torch_device).wait_event(event)
            if entry.tier == "host":
                entry.ready = event  # its blocks are read until the copy ends
        return out

    def move(self, entry: Entry, dst: str) -> bool:
        """Copy ``entry`` (out of its policy) into ``dst`` with room made first, then release
        its old tier. False when ``dst`` cannot make room."""
        src = entry.tier
        if dst == "gpu":
            need = self.ledger.charge(entry, "gpu")
            if not self.room("gpu", need):
                return False
            t0 = time.perf_counter()
            parts = self.device_copy(entry)
            self.leave(entry)
            entry.ready = self.io.event()
            self.ledger.account("gpu", need)
            self.metrics.seconds_in["gpu"] += time.perf_counter() - t0
            self.arrive(entry, "gpu", parts, need)
            return True
        if src == "gpu" and dst == "host" and self._plain(entry):
            return self._d2h_direct(entry)
        if src == "disk":  # up to the host tier: zstd parts decoded unless it compresses
            old = entry.layout.parts
            with self.io.host():
                parts = self.stored_parts(entry)
                decoded: list[torch.Tensor] = []
                metas: list[PartMeta] = []
                for p, m in zip(parts, old, strict=True):
                    if m.codec == "zstd" and not self.io.compress_host:
                        p = self.io.compressor.decompress(p, m)
                        m = replace(m, codec="raw", stored_nbytes=p.nbytes)
                    decoded.append(p)
                    metas.append(m)
            entry.layout.parts = metas
            placed = self.write_stored(entry, decoded, dst)
            if placed is None:
                entry.layout.parts = old
                return False
            del decoded, parts
            self.leave(entry)
            self.arrive(entry, dst, *placed)
            return True
        old = entry.layout.parts
        if src == "gpu":
            assert entry.dev is not None
            if entry.ready is not None:
                entry.ready.synchronize()
            with self.io.host():
                cpu = [t.to("cpu") for t in entry.dev]
                stored, metas = self.io.encode(entry, cpu, dst)
            entry.layout.parts = metas
        else:  # host -> disk: the host form, compressed where it pays on disk
            with self.io.host():
                stored, metas = self.io.encode(entry, self.stored_parts(entry), dst, stored=True)
            entry.layout.parts = metas
        placed = self.write_stored(entry, stored, dst)
        if placed is None:
            entry.layout.parts = old
            return False
        del stored
        self.leave(entry)
        self.arrive(entry, dst, *placed)
        return True

    def _plain(self, entry: Entry) -> bool:
        """Whether ``entry`` is stored exactly as it is on the device (no bf16, no zstd)."""
        if entry.bf16 and any(m.dtype.is_floating_point for m in entry.layout.parts):
            return False
        return not self.io.compress_host or not any(
            self.io.compressor.worth_trying(m.dtype, m.nbytes) for m in entry.layout.parts
        )

    def _d2h_direct(self, entry: Entry) -> bool:
        """Device to host tier with no temporary: straight into pool blocks."""
        assert entry.dev is not None
        metas = [
            replace(m, stored_dtype=m.dtype, codec="raw", stored_nbytes=m.nbytes)
            for m in entry.layout.parts
        ]
        with self.io.host():
            got = self.alloc_blocks([m.nbytes for m in metas])
            if got is None:
                return False
            blocks = got[1]
            t0 = time.perf_counter()
            if self.io.device.is_cuda:
                side = self.io.side_stream()
                side.wait_stream(torch.cuda.current_stream(self.io.device.torch_device))
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
        self.leave(entry)
        entry.ready = self.io.event()
        charge = sum(b.size for b in got[0])
        self.ledger.account("host", charge)
        self.metrics.seconds_in["host"] += time.perf_counter() - t0
        self.arrive(entry, "host", got, charge)
        return True

    def load_directory(self) -> None:
        """Take in the values that an earlier run left in the disk tier's directory."""
        assert self.io.store is not None
        for item in self.io.store.scan():
            try:
                layout = Layout.from_json(item.layout)
            except Exception as exc:  # a layout this version cannot read
                log.warning("ignoring %s: %s", item.path.name, exc)
                continue
            if self.ledger.used["disk"] + item.size > self.ledger.budget["disk"]:
                self.io.store.remove(item.path)
                continue
            entry = Entry(
                item.key, layout, bf16=any(m.stored_dtype != m.dtype for m in layout.parts)
            )
            entry.encoded = encode_key(item.key)
            self.ledger.entries[item.key] = entry
            self.ledger.account("disk", item.size, moved=False)
            self.arrive(entry, "disk", item.path, item.size)
