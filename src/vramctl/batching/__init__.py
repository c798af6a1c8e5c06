"""Batching that follows free memory: :class:`AdaptiveBatcher`."""

from __future__ import annotations

from vramctl.batching._adaptive import AdaptiveBatcher, BatchingError, MapDataset

__all__ = ["AdaptiveBatcher", "BatchingError", "MapDataset"]
