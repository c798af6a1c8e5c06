"""The disk tier's files: one safetensors file per value, written whole or not at all.

Each file holds a value's stored parts (raw in their stored dtype, or zstd
bytes as uint8) and, in the safetensors header's metadata, the cache key, the
value's layout and a CRC-32 of every part. A file is written under a
temporary name and only then renamed to its final name (after an ``fsync``
when ``durable``), so a process killed in the middle of a write leaves a
temporary file (removed when the directory is opened again), never a torn
item. Reading checks every part's CRC: a file damaged on the disk (or torn by
a power cut without ``durable``) is reported, not returned.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import uuid
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vramctl._errors import VramctlError
from vramctl._optional import require

__all__ = ["CorruptItemError", "DiskItem", "DiskStore", "encode_key"]

log = logging.getLogger("vramctl.cache")

FORMAT = "vramctl.cache/1"
SUFFIX = ".safetensors"
TMP_MARK = ".tmp-"


class CorruptItemError(VramctlError, RuntimeError):
    """A value read back from the disk tier does not match its checksums."""


def _tag(key: Any) -> Any:
    if key is None or isinstance(key, (bool, int, float, str)):
        return key
    if isinstance(key, tuple):
        return {"tuple": [_tag(k) for k in key]}
    raise TypeError(type(key).__name__)


def _untag(data: Any) -> Any:
    if isinstance(data, dict):
        return tuple(_untag(k) for k in data["tuple"])
    return data


def encode_key(key: Hashable) -> str | None:
    """A key as JSON (strings, numbers, None and tuples of them), or None for other keys."""
    try:
        return json.dumps(_tag(key), sort_keys=True)
    except (TypeError, ValueError):
        return None


@dataclass(frozen=True)
class DiskItem:
    """A value found in the directory when it was opened."""

    key: Hashable
    layout: dict[str, Any]
    path: Path
    size: int


class DiskStore:
    """A directory of cached values (one safetensors file each)."""

    def __init__(
        self, directory: str | Path, *, verify: bool = True, durable: bool = False
    ) -> None:
        require(["safetensors", "numpy"], extra="cache", what="the tensor cache's disk tier")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.verify = verify
        self.durable = durable
        self.corrupted = 0  # files found damaged (on opening or reading)
        self.removed_partial = 0  # temporary files of writes that never finished
        for tmp in self.dir.glob(f"{TMP_MARK}*"):
            with contextlib.suppress(OSError):
                tmp.unlink()
                self.removed_partial += 1

    def path_for(self, key: Hashable, encoded: str | None) -> Path:
        if encoded is None:
            name = "anon-" + uuid.uuid4().hex
        else:
            name = hashlib.sha256(encoded.encode()).hexdigest()[:40]
        return self.dir / (name + SUFFIX)

    def scan(self) -> Iterator[DiskItem]:
        """The values already in the directory that can be read back (others are removed)."""
        from safetensors import safe_open

        for path in sorted(self.dir.glob(f"*{SUFFIX}")):
            try:
                with safe_open(str(path), framework="pt") as f:
                    meta = f.metadata() or {}
                if meta.get("format") != FORMAT or not meta.get("key") or not meta.get("layout"):
                    raise ValueError("not a reloadable cache item")
                key = _untag(json.loads(meta["key"]))
                layout = json.loads(meta["layout"])
                size = path.stat().st_size
            except Exception as exc:
                log.warning("removing %s from the cache directory: %s", path.name, exc)
                if not path.name.startswith("anon-"):
                    self.corrupted += 1
                with contextlib.suppress(OSError):
                    path.unlink()
                continue
            yield DiskItem(key, layout, path, size)

    def write(
        self,
        path: Path,
        key: str | None,
        layout: dict[str, Any] | None,
        stored: list[torch.Tensor],
        crcs: list[int],
    ) -> int:
        """Write ``stored`` (CPU tensors) to ``path`` atomically; returns the file's size."""
        from safetensors.torch import save_file

        meta = {
            "format": FORMAT,
            "key": key or "",
            "layout": json.dumps(layout) if layout is not None and key else "",
            "crc": json.dumps(crcs),
        }
        tensors: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for i, t in enumerate(stored):
            t = t.contiguous()
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen or t.untyped_storage().nbytes() != t.nbytes:
                t = t.clone()  # safetensors writes no two tensors of one storage
            seen.add(t.untyped_storage().data_ptr())
            tensors[f"p{i}"] = t
        tmp = path.with_name(f"{TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}-{path.name}")
        try:
            save_file(tensors, str(tmp), metadata=meta)
            if self.durable:
                fd = os.open(tmp, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        return path.stat().st_size

    def read(self, path: Path, count: int) -> list[torch.Tensor]:
        """The ``count`` stored parts of the file at ``path``, each checked against its CRC."""
        from safetensors import safe_open

        from vramctl.cache._codec import checksum

        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                parts = [f.get_tensor(f"p{i}") for i in range(count)]
            crcs = json.loads(meta.get("crc", "[]"))
        except Exception as exc:
            self.corrupted += 1
            raise CorruptItemError(f"{path.name}: cannot be read back ({exc})") from exc
        if self.verify:
            if len(crcs) != count:
                self.corrupted += 1
                raise CorruptItemError(f"{path.name}: {len(crcs)} checksums for {count} parts")
            for i, (t, crc) in enumerate(zip(parts, crcs, strict=True)):
                if checksum(t) != crc:
                    self.corrupted += 1
                    raise CorruptItemError(f"{path.name}: part {i} does not match its checksum")
        return parts

    def remove(self, path: Path) -> None:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()

    def clear(self) -> None:
        for path in self.dir.glob(f"*{SUFFIX}"):
            self.remove(path)
