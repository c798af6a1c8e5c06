"""The public surface is exactly what we intend (as httpx checks its own)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import subprocess
import sys
from types import ModuleType

import pytest

import vramctl
import vramctl.batching
import vramctl.cache
import vramctl.cli
import vramctl.device
import vramctl.doctor
import vramctl.estimator
import vramctl.fit
import vramctl.guard
import vramctl.jobs
import vramctl.monitor
import vramctl.optimize
import vramctl.server

EXPECTED = {
    "Plan",
    "PlanResult",
    "plan",
    "FitError",
    "FitResult",
    "fit_batch_size",
    "AdaptiveBatcher",
    "BatchingError",
    "Guard",
    "GuardEvent",
    "MemoryReport",
    "SplitBatchNormWarning",
    "Step",
    "StepDoesNotFitError",
    "StepResult",
    "guarded",
    "is_oom",
    "TensorCache",
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
    "Parallel",
    "Monitor",
    "NotAvailable",
    "OptimizationReport",
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
    "doctor",
    "estimate",
    "format_bytes",
    "get_device",
    "gpu_spec",
    "gpus",
    "max_batch_size",
    "optimize",
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


def test_public_names_are_listed_by_dir() -> None:
    # The packages import their heavy names on first use (PEP 562); dir() still lists them.
    doctor_package = importlib.import_module("vramctl.doctor")
    for package in (vramctl, vramctl.device, vramctl.jobs, doctor_package):
        assert set(package.__all__) <= set(dir(package)), package.__name__


def _fresh(code: str) -> None:
    """Run ``code`` in a fresh interpreter (nothing of vramctl or PyTorch imported yet)."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_import_vramctl_does_not_import_pytorch() -> None:
    _fresh(
        "import sys, vramctl, vramctl.device, vramctl.jobs\n"
        "assert 'torch' not in sys.modules, 'import vramctl imported torch'\n"
        "from vramctl import Guard, estimate\n"
        "assert 'torch' in sys.modules and estimate.__module__.startswith('vramctl.estimator')"
    )


def test_optimize_stays_the_function_when_its_package_is_imported_first() -> None:
    # Importing a subpackage binds it on its parent: vramctl.optimize must stay the function.
    _fresh(
        "import sys, vramctl\n"
        "from vramctl.optimize import plan\n"
        "assert vramctl.optimize is sys.modules['vramctl.optimize'].optimize, vramctl.optimize\n"
        "assert vramctl.plan is plan"
    )


def test_doctor_stays_the_function_when_its_package_is_imported_first() -> None:
    # As for optimize: the package vramctl.doctor must not replace the function, and
    # importing it (for the report's types) imports no PyTorch.
    _fresh(
        "import sys, vramctl\n"
        "from vramctl.doctor import DoctorReport\n"
        "assert 'torch' not in sys.modules, 'vramctl.doctor imported torch'\n"
        "d = sys.modules['vramctl.doctor']\n"
        "assert vramctl.doctor is d.doctor and callable(vramctl.doctor), vramctl.doctor\n"
        "from vramctl.optimize import doctor\n"
        "assert vramctl.doctor is doctor"
    )


def test_public_objects_say_they_are_from_vramctl() -> None:
    for name in vramctl.__all__:
        obj = getattr(vramctl, name)
        if isinstance(obj, type) or inspect.isfunction(obj):
            assert obj.__module__.startswith("vramctl"), (name, obj.__module__)


BATCHING = {
    "AdaptiveBatcher",
    "ModelSource",
    "OUTPUT_KINDS",
    "ProcessInterrupted",
    "RunConflictError",
    "load_model",
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
    "check_bind",
    "cleanup",
    "default_rules",
    "load_jsonl",
    "metrics_text",
    "parse_address",
    "plot",
    "profile",
    "profiler",
    "serve_prometheus",
    "static_file",
}
SERVER = {
    "ApiError",
    "DashboardServer",
    "JobServer",
    "JobService",
    "create_app",
    "dashboard_router",
    "install_error_handlers",
    "jobs_router",
    "serve_dashboard",
    "serve_jobs",
    "service_token",
}


DEVICE = {
    "ComputeCapability",
    "CpuDevice",
    "CudaDevice",
    "Device",
    "DeviceHealth",
    "DriverInfo",
    "GpuSettings",
    "GpuSpec",
    "HealthPolicy",
    "HealthState",
    "MemoryState",
    "PeakMeter",
    "Policy",
    "ProcessMemory",
    "Selection",
    "SimulatedDevice",
    "SimulatedOutOfMemoryError",
    "active_simulation",
    "affinity_cpus",
    "available_bytes",
    "catalog",
    "cgroup_memory",
    "cpu_quota",
    "current_device",
    "devices",
    "driver_info",
    "get_device",
    "gpu_settings",
    "gpu_spec",
    "gpus",
    "match_gpu_name",
    "rank_devices",
    "resolve",
    "select_device",
    "simulate",
    "sort_devices",
    "total_bytes",
    "use_device",
}
ESTIMATOR = {
    "BATCH_BOUND",
    "GPU_EFFICIENCY",
    "StepTime",
    "Throughput",
    "cpu_profile_path",
    "cpu_throughput",
    "gpu_throughput",
    "measure_throughput",
    "target_throughput",
    "LENGTH_BOUND",
    "MODES",
    "PRECISIONS",
    "SEARCH_INPUT_BYTES",
    "STRATEGIES",
    "TASKS",
    "Parallel",
    "ParallelError",
    "parallelize",
    "AllocatorConfig",
    "AllocatorOutOfMemory",
    "CachingAllocatorModel",
    "Calibration",
    "CalibrationError",
    "ConfigModel",
    "Estimate",
    "EstimateError",
    "MaxBatch",
    "ResolvedSource",
    "Step",
    "StepSpec",
    "Target",
    "builtin_calibration",
    "calibrate",
    "calibration_dir",
    "config_model",
    "constant_rows",
    "estimate",
    "find_calibration",
    "list_calibrations",
    "load_calibration",
    "load_model_source",
    "max_batch_size",
    "prepare_model",
    "resolve_source",
    "resolve_target",
    "run_step",
    "run_target",
    "warm_optimizer",
    "zoo",
}
GUARD = {
    "Guard",
    "GuardError",
    "GuardEvent",
    "GuardedFunction",
    "MemoryReport",
    "OomCounters",
    "PeakMeter",
    "SplitBatchNormWarning",
    "StepDoesNotFitError",
    "StepResult",
    "add_listener",
    "add_reliever",
    "relieve",
    "remove_reliever",
    "requested_bytes",
    "available_bytes",
    "batch_size_of",
    "can_offload",
    "guarded",
    "is_oom",
    "memory_report",
    "merge_outputs",
    "offload_activations",
    "piece_sizes",
    "release",
    "drop_grads",
    "restore_grads",
    "stash_grads",
    "remove_listener",
    "slice_batch",
    "split_batch",
    "total_bytes",
}
FIT = {
    "FitError",
    "FitResult",
    "Probe",
    "Search",
    "cache_root",
    "fit_batch_size",
    "requested_bytes",
    "to_host",
}
OPTIMIZE = {
    "AppliedPlan",
    "DoctorReport",
    "Finding",
    "Optimization",
    "OptimizationReport",
    "OffloadedOptimizer",
    "OptimizeError",
    "Optimized",
    "Plan",
    "PlanResult",
    "StepHelper",
    "apply_checkpointing",
    "apply_plan",
    "doctor",
    "find_blocks",
    "optimize",
    "plan",
}
DOCTOR = {"DoctorReport", "Finding", "doctor"}
CLI = {"main"}

JOBS = {
    "ACTIVE",
    "AdmissionError",
    "BATCH_SIZE_ENV",
    "BestFit",
    "ClusterState",
    "DeviceConstraints",
    "EstimateWorker",
    "FINISHED",
    "Fragmentation",
    "GRAD_ACCUM_ENV",
    "GuardOptions",
    "Job",
    "JobClient",
    "JobClientError",
    "JobSpec",
    "JobSpecError",
    "JobStore",
    "JobStoreError",
    "LeastLoaded",
    "Ledger",
    "LocalRunner",
    "MAX_SIZE",
    "MemoryNeed",
    "ModelNeed",
    "MostFree",
    "POLICIES",
    "Placement",
    "Queue",
    "RayAgent",
    "RayGpu",
    "RayRunner",
    "Policy",
    "Request",
    "Reservation",
    "Runner",
    "STATES",
    "Scheduler",
    "Settings",
    "Workload",
    "batch_plan",
    "check_placeable",
    "connect",
    "device_capacity",
    "job_env",
    "job_from_dict",
    "load_settings",
    "load_spec",
    "matching_devices",
    "node_resources",
    "outside_vramctl",
    "price",
    "ray_devices",
    "resource_name",
    "vramctl_home",
}

CACHE = {
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
}

PACKAGES = {
    vramctl.batching: BATCHING,
    vramctl.cache: CACHE,
    vramctl.cli: CLI,
    vramctl.device: DEVICE,
    # ``vramctl.doctor`` is the function: the package is the module of that name.
    importlib.import_module("vramctl.doctor"): DOCTOR,
    vramctl.estimator: ESTIMATOR,
    vramctl.fit: FIT,
    vramctl.guard: GUARD,
    vramctl.jobs: JOBS,
    vramctl.monitor: MONITOR,
    # ``vramctl.optimize`` is the function: the package is the module of that name.
    importlib.import_module("vramctl.optimize"): OPTIMIZE,
    vramctl.server: SERVER,
}


@pytest.mark.parametrize("package", list(PACKAGES), ids=lambda p: p.__name__)
def test_each_package_exports_the_intended_names(package: ModuleType) -> None:
    assert set(package.__all__) == PACKAGES[package]
    for name in package.__all__:
        obj = getattr(package, name)
        if isinstance(obj, type) or inspect.isfunction(obj):
            # Defined in vramctl (a package may re-export a lower layer's name, as the
            # guard does the device layer's peak meter), never a private module's leak.
            assert obj.__module__.startswith("vramctl."), (name, obj.__module__)


def _modules() -> list[str]:
    return sorted(
        m.name
        for m in pkgutil.walk_packages(vramctl.__path__, "vramctl.")
        if "__main__" not in m.name
    )


@pytest.mark.parametrize("name", _modules())
def test_every_module_declares_its_public_names(name: str) -> None:
    module = importlib.import_module(name)
    if name == "vramctl._version":
        return  # one constant, re-exported by the package
    assert isinstance(getattr(module, "__all__", None), list), f"{name} has no __all__"
    for public in module.__all__:
        assert hasattr(module, public), (name, public)
