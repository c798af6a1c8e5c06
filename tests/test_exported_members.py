"""The public surface is exactly what we intend (as httpx checks its own)."""

from __future__ import annotations

import inspect

import vramctl
import vramctl.batching
import vramctl.device
import vramctl.monitor
import vramctl.server

EXPECTED = {
    "FitError",
    "FitResult",
    "fit_batch_size",
    "AdaptiveBatcher",
    "BatchingError",
    "Guard",
    "GuardEvent",
    "MemoryReport",
    "SplitBatchNormWarning",
    "StepDoesNotFitError",
    "StepResult",
    "guarded",
    "is_oom",
    "NA",
    "ComputeCapability",
    "Device",
    "Estimate",
    "EstimateError",
    "GpuSpec",
    "HealthState",
    "InvalidSizeError",
    "MaxBatch",
    "MemoryState",
    "Monitor",
    "NotAvailable",
    "Policy",
    "ProcessMemory",
    "Selection",
    "SimulatedDevice",
    "SimulatedOutOfMemoryError",
    "UnknownDeviceError",
    "VramctlError",
    "__version__",
    "catalog",
    "current_device",
    "devices",
    "estimate",
    "format_bytes",
    "get_device",
    "gpu_spec",
    "gpus",
    "max_batch_size",
    "parse_size",
    "rank_devices",
    "select_device",
    "simulate",
    "use_device",
}


def test_top_level_exports_are_the_intended_ones() -> None:
    assert set(vramctl.__all__) == EXPECTED
    for name in vramctl.__all__:
        assert hasattr(vramctl, name), name


def test_public_objects_say_they_are_from_vramctl() -> None:
    for name in vramctl.__all__:
        obj = getattr(vramctl, name)
        if isinstance(obj, type) or inspect.isfunction(obj):
            assert obj.__module__.startswith("vramctl"), (name, obj.__module__)


BATCHING = {
    "AdaptiveBatcher",
    "ProcessResult",
    "ProcessStatus",
    "ProgressStore",
    "process",
    "progress_path",
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
    "PaddedDuration",
    "QuadraticDuration",
    "SamplerStats",
    "Stitcher",
    "chunk_count",
    "chunk_items",
    "duration_edges",
    "items_from",
    "load_audio",
    "synthesize",
}


def test_batching_exports_are_the_intended_ones() -> None:
    assert set(vramctl.batching.__all__) == BATCHING
    for name in vramctl.batching.__all__:
        obj = getattr(vramctl.batching, name)
        if isinstance(obj, type) or inspect.isfunction(obj):
            assert obj.__module__.startswith("vramctl.batching"), (name, obj.__module__)


def test_device_layer_exports_resolve() -> None:
    for name in vramctl.device.__all__:
        assert hasattr(vramctl.device, name), name
    # Private modules stay behind the package.
    assert not any(n.startswith("_") for n in vramctl.device.__all__)


def test_devices_function_is_not_shadowed_by_the_package() -> None:
    assert callable(vramctl.devices)
    assert vramctl.devices()[-1].id == "cpu"


MONITOR = {
    "AddressError",
    "Alert",
    "AlertEngine",
    "AlertRuleError",
    "Event",
    "ExportError",
    "Finding",
    "FragmentationRule",
    "History",
    "LeakDetector",
    "LeakDetectorError",
    "LeakHook",
    "LeakReport",
    "LeakSuspect",
    "Level",
    "MetricsServer",
    "Monitor",
    "MonitorError",
    "OomRiskRule",
    "OpStats",
    "Peak",
    "Profiler",
    "RetriesRule",
    "Rule",
    "Sample",
    "Shrink",
    "UsageRule",
    "cleanup",
    "default_rules",
    "load_jsonl",
    "metrics_text",
    "parse_address",
    "plot",
    "profile",
    "profiler",
    "serve_prometheus",
}
SERVER = {"DashboardServer", "create_app", "dashboard_router", "serve_dashboard"}


def test_monitor_and_server_exports_are_the_intended_ones() -> None:
    assert set(vramctl.monitor.__all__) == MONITOR
    assert set(vramctl.server.__all__) == SERVER
    for package, prefix in (
        (vramctl.monitor, "vramctl.monitor"),
        (vramctl.server, "vramctl.server"),
    ):
        for name in package.__all__:
            obj = getattr(package, name)
            if isinstance(obj, type) or inspect.isfunction(obj):
                assert obj.__module__.startswith(prefix), (name, obj.__module__)
