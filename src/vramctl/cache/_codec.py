"""A cached value's layout, its parts' stored form (compressed where it pays), checksums.

A value is a tensor or a nested structure of them (dicts, lists, tuples,
named tuples: whatever ``torch.utils._pytree`` flattens); other leaves (ints,
strings) are kept as they are. A sparse COO tensor is two parts, its indices
and values. Each tensor part is stored in host memory and on disk either raw
or, for integer and boolean data where zstd makes it smaller by enough to pay
for the work, compressed; floating-point parts are downcast to bfloat16 only
where the caller asked for it.

>>> import torch
>>> from vramctl.cache import Layout
>>> layout, parts = Layout.of({"ids": torch.arange(4), "n": 4})
>>> len(parts), layout.rebuild(parts)["n"]
(1, 4)
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from vramctl._optional import available, require

__all__ = ["Compressor", "Layout", "PartMeta", "checksum", "compressible"]

#: A compressed part is kept only when it is at most this fraction of the raw bytes.
KEEP_RATIO = 0.8
#: After this many tries of a dtype whose mean ratio is above KEEP_RATIO, stop trying it.
GIVE_UP_AFTER = 8


@dataclass(frozen=True)
class PartMeta:
    """One tensor part: its dtype and shape on the device, and how it is stored."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    stored_dtype: torch.dtype
    codec: str = "raw"  # "raw" or "zstd"
    stored_nbytes: int = 0

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        """Bytes on the device (the original dtype)."""
        return self.numel * self.dtype.itemsize

    def to_json(self) -> dict[str, Any]:
        return {
            "dtype": str(self.dtype).removeprefix("torch."),
            "shape": list(self.shape),
            "stored_dtype": str(self.stored_dtype).removeprefix("torch."),
            "codec": self.codec,
            "stored_nbytes": self.stored_nbytes,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PartMeta:
        return cls(
            dtype=getattr(torch, data["dtype"]),
            shape=tuple(int(s) for s in data["shape"]),
            stored_dtype=getattr(torch, data["stored_dtype"]),
            codec=str(data["codec"]),
            stored_nbytes=int(data["stored_nbytes"]),
        )


@dataclass(frozen=True)
class _Sparse:
    """Where a sparse COO tensor was: its two parts' indices and its size."""

    indices: int
    values: int
    size: tuple[int, ...]
    coalesced: bool


@dataclass
class Layout:
    """How to rebuild a value from its parts: the tree, its constant leaves, sparse tensors."""

    spec: pytree.TreeSpec
    #: Per leaf: an int (the index of its part), a _Sparse, or ("const", value).
    slots: list[Any]
    parts: list[PartMeta] = field(default_factory=list)

    @classmethod
    def of(cls, value: Any) -> tuple[Layout, list[torch.Tensor]]:
        """The layout of ``value`` and its tensor parts (dense, in order)."""
        leaves, spec = pytree.tree_flatten(value)
        slots: list[Any] = []
        parts: list[torch.Tensor] = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                if leaf.layout == torch.sparse_coo:
                    coalesced = leaf.is_coalesced()
                    parts += [leaf._indices().detach(), leaf._values().detach()]
                    slots.append(
                        _Sparse(len(parts) - 2, len(parts) - 1, tuple(leaf.shape), coalesced)
                    )
                    continue
                if leaf.layout != torch.strided:
                    raise TypeError(
                        f"a {leaf.layout} tensor cannot be cached: use dense or sparse COO tensors"
                    )
                slots.append(len(parts))
                parts.append(leaf.detach())
            else:
                slots.append(("const", leaf))
        metas = [PartMeta(p.dtype, tuple(p.shape), p.dtype, "raw", p.nbytes) for p in parts]
        return cls(spec, slots, metas), parts

    @property
    def nbytes(self) -> int:
        """Bytes of the value on the device."""
        return sum(p.nbytes for p in self.parts)

    def rebuild(self, parts: list[torch.Tensor]) -> Any:
        leaves: list[Any] = []
        for slot in self.slots:
            if isinstance(slot, int):
                leaves.append(parts[slot])
            elif isinstance(slot, _Sparse):
                leaves.append(
                    torch.sparse_coo_tensor(
                        parts[slot.indices],
                        parts[slot.values],
                        slot.size,
                        is_coalesced=slot.coalesced,
                        check_invariants=False,
                    )
                )
            else:
                leaves.append(slot[1])
        return pytree.tree_unflatten(leaves, self.spec)

    def to_json(self) -> dict[str, Any] | None:
        """A JSON form for the disk (None when a constant leaf or the tree cannot be written)."""
        import json

        slots: list[Any] = []
        for slot in self.slots:
            if isinstance(slot, int):
                slots.append(slot)
            elif isinstance(slot, _Sparse):
                slots.append(
                    {"sparse": [slot.indices, slot.values, list(slot.size), slot.coalesced]}
                )
            else:
                try:
                    json.dumps(slot[1])
                except (TypeError, ValueError):
                    return None
                slots.append({"const": slot[1]})
        try:
            spec = pytree.treespec_dumps(self.spec)
        except Exception:  # a node type that has no serialized form
            return None
        return {"spec": spec, "slots": slots, "parts": [p.to_json() for p in self.parts]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Layout:
        slots: list[Any] = []
        for slot in data["slots"]:
            if isinstance(slot, int):
                slots.append(slot)
            elif "sparse" in slot:
                i, v, size, coalesced = slot["sparse"]
                slots.append(_Sparse(int(i), int(v), tuple(size), bool(coalesced)))
            else:
                slots.append(("const", slot["const"]))
        parts = [PartMeta.from_json(p) for p in data["parts"]]
        return cls(pytree.treespec_loads(data["spec"]), slots, parts)


def raw_bytes(t: torch.Tensor) -> Any:
    """A contiguous CPU tensor's bytes as a buffer (no copy)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def checksum(t: torch.Tensor) -> int:
    """CRC-32 of a CPU tensor's bytes (made contiguous first)."""
    return zlib.crc32(raw_bytes(t.contiguous())) & 0xFFFFFFFF


def compressible(dtype: torch.dtype) -> bool:
    """Integer and boolean data: what lossless compression is tried on."""
    return not dtype.is_floating_point and not dtype.is_complex


@dataclass
class _DtypeRecord:
    tries: int = 0
    raw: int = 0
    packed: int = 0


class Compressor:
    """zstd for integer and boolean parts, kept where it makes them small enough.

    Keeps the measured figures: tries, bytes before and after, seconds spent
    each way; stops trying a dtype whose data did not shrink in
    :data:`GIVE_UP_AFTER` tries.
    """

    def __init__(self, enabled: bool | str = "auto", level: int = 1) -> None:
        if enabled is True:
            require(["zstandard", "numpy"], extra="cache", what="compression of cached tensors")
        self.enabled = bool(enabled) and available("zstandard") and available("numpy")
        self.level = level
        self._zstd: Any = None
        self._by_dtype: dict[torch.dtype, _DtypeRecord] = {}
        self.tries = 0
        self.tried_bytes = 0
        self.kept = 0
        self.raw_bytes = 0  # of the parts kept compressed
        self.packed_bytes = 0
        self.seconds_compress = 0.0
        self.seconds_decompress = 0.0
        self.bytes_decompressed = 0

    def _codec(self) -> Any:
        if self._zstd is None:
            import zstandard

            self._zstd = (
                zstandard.ZstdCompressor(level=self.level),
                zstandard.ZstdDecompressor(),
            )
        return self._zstd

    def worth_trying(self, dtype: torch.dtype, nbytes: int) -> bool:
        if not self.enabled or not compressible(dtype) or nbytes < 4096:
            return False
        rec = self._by_dtype.get(dtype)
        return rec is None or rec.tries < GIVE_UP_AFTER or rec.packed <= KEEP_RATIO * rec.raw

    def compress(self, t: torch.Tensor) -> bytes | None:
        """``t``'s bytes compressed, or None where that does not pay."""
        if not self.worth_trying(t.dtype, t.nbytes):
            return None
        comp, _ = self._codec()
        t0 = time.perf_counter()
        packed = comp.compress(raw_bytes(t.contiguous()))
        self.seconds_compress += time.perf_counter() - t0
        self.tries += 1
        self.tried_bytes += t.nbytes
        rec = self._by_dtype.setdefault(t.dtype, _DtypeRecord())
        rec.tries += 1
        rec.raw += t.nbytes
        rec.packed += len(packed)
        if len(packed) > KEEP_RATIO * t.nbytes:
            return None
        self.kept += 1
        self.raw_bytes += t.nbytes
        self.packed_bytes += len(packed)
        return bytes(packed)

    def decompress(self, packed: torch.Tensor, meta: PartMeta) -> torch.Tensor:
        """A part's tensor (stored dtype) from its compressed bytes in ``packed`` (uint8)."""
        _, dec = self._codec()
        t0 = time.perf_counter()
        data = dec.decompress(
            raw_bytes(packed), max_output_size=meta.numel * meta.stored_dtype.itemsize
        )
        out = torch.frombuffer(bytearray(data), dtype=meta.stored_dtype).view(meta.shape)
        self.seconds_decompress += time.perf_counter() - t0
        self.bytes_decompressed += len(data)
        return out

    def seconds_per_byte(self) -> float | None:
        """Measured seconds to compress and decompress one byte, or None before tries."""
        if not self.tried_bytes or not self.bytes_decompressed or not self.seconds_decompress:
            return None
        return (
            self.seconds_compress / self.tried_bytes
            + self.seconds_decompress / self.bytes_decompressed
        )

    def stats(self) -> dict[str, Any]:
        return {
            "enabled": self.enabled,
            "tries": self.tries,
            "kept": self.kept,
            "raw_bytes": self.raw_bytes,
            "compressed_bytes": self.packed_bytes,
            "ratio": round(self.packed_bytes / self.raw_bytes, 4) if self.raw_bytes else None,
            "compress_s": round(self.seconds_compress, 6),
            "decompress_s": round(self.seconds_decompress, 6),
            "decompress_bytes_per_s": (
                round(self.bytes_decompressed / self.seconds_decompress)
                if self.seconds_decompress
                else None
            ),
        }
