"""The cache's copies: to the device (on a side stream, each marked by an event), values
encoded for the host and disk tiers (bf16, zstd where it pays), and its files written and
read with the disk's speed measured."""

from __future__ import annotations

import contextlib
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from vramctl.cache._codec import Compressor, PartMeta
from vramctl.cache._disk import DiskStore
from vramctl.cache._ledger import Entry, Ledger
from vramctl.device import Device

__all__ = ["TierIO"]


class TierIO:
    """Copies between ``device``, host memory and ``store`` (None: no disk tier).

    ``compress`` is the cache's setting: True compresses the host tier too, "auto" the
    disk tier's files where zstd pays, False never.
    """

    def __init__(
        self,
        device: Device,
        ledger: Ledger,
        compressor: Compressor,
        compress: bool | str,
        store: DiskStore | None,
    ) -> None:
        self.device = device
        self.ledger = ledger
        self.compressor = compressor
        self.compress = compress
        #: zstd in the host tier too (compress=True); "auto" compresses the disk tier's files.
        self.compress_host = compress is True
        self.store = store
        #: Bytes written and seconds, bytes read and seconds: the disk's measured speed.
        self.disk_io = [0, 0.0, 0, 0.0]
        self._side: Any = None

    # -- the device ---------------------------------------------------------------

    def on_device(self, t: torch.Tensor) -> bool:
        if self.device.is_simulated:
            return self.device.owns(t)
        return t.device == self.device.torch_device

    def host(self) -> contextlib.AbstractContextManager[Any]:
        """Host-side work: not counted by a simulated device."""
        return self.device.uncounted()

    def to_device(self, src: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A copy of CPU (or device) ``src`` on the device, in ``dtype``."""
        dev = self.device
        if dev.is_cuda:
            out = torch.empty(src.shape, dtype=dtype, device=dev.torch_device)
            side = self.side_stream()
            side.wait_stream(torch.cuda.current_stream(dev.torch_device))
            with torch.cuda.stream(side):
                out.copy_(src, non_blocking=src.is_pinned())
            out.record_stream(side)
            return out
        with dev.counting():
            out = torch.empty(src.shape, dtype=dtype)
        out.copy_(src)
        return out

    def side_stream(self) -> Any:
        if self._side is None:
            self._side = torch.cuda.Stream(self.device.torch_device)
        return self._side

    def event(self) -> Any:
        if not self.device.is_cuda:
            return None
        event = torch.cuda.Event()
        event.record(self.side_stream())
        return event

    def wait_ready(self, entry: Entry) -> None:
        """Make the caller's stream wait for ``entry``'s copy to the device."""
        if entry.ready is not None:
            torch.cuda.current_stream(self.device.torch_device).wait_event(entry.ready)

    # -- the host and disk tiers' form ---------------------------------------------

    def encode(
        self, entry: Entry, cpu: list[torch.Tensor], tier: str, *, stored: bool = False
    ) -> tuple[list[torch.Tensor], list[PartMeta]]:
        """The form CPU parts take in the host or disk ``tier``: bf16 where asked, zstd where
        it pays. ``stored``: the parts are in their host form already (zstd ones kept)."""
        compress = self.compress_host or (tier == "disk" and self._disk_compression_pays())
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

    def _disk_compression_pays(self) -> bool:
        """Whether zstd pays on this disk, by what was measured: the seconds it saves
        writing and reading the bytes it removes against its own seconds, or the room it
        saves when the disk tier is over 80% full. Tried until both are measured."""
        if self.compress is False:
            return False
        per_byte = self.compressor.seconds_per_byte()
        written, w_s, read, r_s = self.disk_io
        if per_byte is None or not (written and w_s and read and r_s) or self.compressor.tries < 8:
            return True
        ratio = self.compressor.packed_bytes / max(1, self.compressor.raw_bytes)
        saved = (1 - ratio) * (w_s / written + r_s / read)
        ledger = self.ledger
        return saved > per_byte or ledger.used["disk"] > 0.8 * ledger.limit["disk"]

    # -- the disk -----------------------------------------------------------------

    def write(
        self,
        path: Path,
        encoded: str | None,
        layout: dict[str, Any] | None,
        stored: list[torch.Tensor],
        crcs: list[int],
    ) -> int:
        """Write a value's file (timed); returns its bytes."""
        assert self.store is not None
        w0 = time.perf_counter()
        charge = self.store.write(path, encoded, layout, stored, crcs)
        self.disk_io[0] += charge
        self.disk_io[1] += time.perf_counter() - w0
        return charge

    def read(self, path: Path, count: int) -> list[torch.Tensor]:
        """Read a value's ``count`` stored parts from its file (timed, checked)."""
        assert self.store is not None
        r0 = time.perf_counter()
        parts = self.store.read(path, count)
        self.disk_io[2] += sum(p.nbytes for p in parts)
        self.disk_io[3] += time.perf_counter() - r0
        return parts
