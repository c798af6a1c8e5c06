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
from vramctl.cache._codec import Compressor, Layout
from vramctl.cache._disk import CorruptItemError, DiskStore
from vramctl.cache._ledger import TIERS
from vramctl.cache._policy import LFU, LRU, POLICIES, SLRU, EvictionPolicy, make_policy
from vramctl.cache._pool import HostPool

__all__ = [
    "LFU",
    "LRU",
    "POLICIES",
    "SLRU",
    "TIERS",
    "CacheError",
    "Compressor",
    "CorruptItemError",
    "DiskStore",
    "EvictionPolicy",
    "HostPool",
    "Layout",
    "TensorCache",
    "ValueTooLargeError",
    "make_policy",
]
