"""A tiered tensor cache: the device, pinned host memory, disk, each under a hard budget.

>>> import torch, vramctl
>>> with vramctl.simulate("64MiB"):
...     cache = vramctl.TensorCache(gpu="1MiB", host="8MiB")
...     cache.put("emb", torch.ones(512, 512))       # 1 MiB: too large to share the device tier
...     float(cache.get("emb").sum())
262144.0
"""

from __future__ import annotations

from vramctl.cache._cache import CacheError, TensorCache, ValueTooLargeError
from vramctl.cache._codec import Compressor, Layout, PartMeta, checksum, compressible
from vramctl.cache._disk import CorruptItemError, DiskStore, encode_key
from vramctl.cache._ledger import TIERS
from vramctl.cache._policy import LFU, LRU, POLICIES, SLRU, EvictionPolicy, make_policy
from vramctl.cache._pool import ALIGN, Block, HostPool

__all__ = [
    "ALIGN",
    "LFU",
    "LRU",
    "POLICIES",
    "SLRU",
    "TIERS",
    "Block",
    "CacheError",
    "Compressor",
    "CorruptItemError",
    "DiskStore",
    "EvictionPolicy",
    "HostPool",
    "Layout",
    "PartMeta",
    "TensorCache",
    "ValueTooLargeError",
    "checksum",
    "compressible",
    "encode_key",
    "make_policy",
]
