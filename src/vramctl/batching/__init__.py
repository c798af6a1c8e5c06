"""Batching: adaptive batch sizes, and duration buckets under a hard budget, streamed."""

from __future__ import annotations

from vramctl.batching._adaptive import AdaptiveBatcher, BatchingError, MapDataset
from vramctl.batching._audio import AudioBatches, AudioError, load_audio, synthesize
from vramctl.batching._budget import Budget, MemoryBudget, PaddedDuration, QuadraticDuration
from vramctl.batching._chunk import Stitcher, chunk_count, chunk_items
from vramctl.batching._manifest import Item, Manifest, ManifestError, ManifestProblem, items_from
from vramctl.batching._models import OUTPUT_KINDS, ModelSource, load_model
from vramctl.batching._process import (
    ProcessInterrupted,
    ProcessResult,
    ProcessStatus,
    process,
    progress_path,
)
from vramctl.batching._progress import ProgressStore, RunConflictError
from vramctl.batching._sampler import Batch, BucketingSampler, SamplerStats, duration_edges

__all__ = [
    "OUTPUT_KINDS",
    "AdaptiveBatcher",
    "AudioBatches",
    "AudioError",
    "Batch",
    "BatchingError",
    "BucketingSampler",
    "Budget",
    "Item",
    "Manifest",
    "ManifestError",
    "ManifestProblem",
    "MapDataset",
    "MemoryBudget",
    "ModelSource",
    "PaddedDuration",
    "ProcessInterrupted",
    "ProcessResult",
    "ProcessStatus",
    "ProgressStore",
    "QuadraticDuration",
    "RunConflictError",
    "SamplerStats",
    "Stitcher",
    "chunk_count",
    "chunk_items",
    "duration_edges",
    "items_from",
    "load_audio",
    "load_model",
    "process",
    "progress_path",
    "synthesize",
]
