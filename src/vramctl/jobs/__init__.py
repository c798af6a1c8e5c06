"""Sharing GPUs among jobs: job specs, admission and placement by memory, the queue.

The layer between the run-time layers (``fit``, ``batching``, ``monitor``, ``guard``,
``estimator``) and the interfaces (``server``, ``cli``).
"""

from __future__ import annotations

import typing

from vramctl import _lazy
from vramctl.jobs._client import JobClient, JobClientError
from vramctl.jobs._queue import Queue
from vramctl.jobs._settings import POLICIES, Settings, load_settings
from vramctl.jobs._spec import (
    DeviceConstraints,
    GuardOptions,
    JobSpec,
    JobSpecError,
    MemoryNeed,
    ModelNeed,
    load_spec,
)
from vramctl.jobs._store import ACTIVE, FINISHED, STATES, Job, JobStore, JobStoreError, vramctl_home
from vramctl.jobs._supervise import OVERRUN_GROWTH, overrun_need

if typing.TYPE_CHECKING:
    from vramctl.jobs._ledger import AdmissionError, Ledger, Reservation
    from vramctl.jobs._need import (
        BATCH_SIZE_ENV,
        GRAD_ACCUM_ENV,
        batch_plan,
        check_placeable,
        price,
    )
    from vramctl.jobs._placement import (
        BestFit,
        ClusterState,
        Fragmentation,
        LeastLoaded,
        MostFree,
        Placement,
        Policy,
        Request,
        Workload,
    )
    from vramctl.jobs._pricing import EstimateWorker
    from vramctl.jobs._ray import (
        RayAgent,
        RayGpu,
        RayRunner,
        connect,
        node_resources,
        ray_devices,
    )
    from vramctl.jobs._scheduler import LocalRunner, Runner, Scheduler

# The names whose modules import PyTorch or the estimator (placement, pricing, the
# scheduler, Ray), imported on first use (PEP 562): submitting, listing and cancelling
# jobs need neither.
_LAZY = {
    **dict.fromkeys(("AdmissionError", "Ledger", "Reservation"), "vramctl.jobs._ledger"),
    **dict.fromkeys(
        (
            "BATCH_SIZE_ENV",
            "GRAD_ACCUM_ENV",
            "batch_plan",
            "check_placeable",
            "price",
        ),
        "vramctl.jobs._need",
    ),
    "EstimateWorker": "vramctl.jobs._pricing",
    **dict.fromkeys(
        (
            "BestFit",
            "ClusterState",
            "Fragmentation",
            "LeastLoaded",
            "MostFree",
            "Placement",
            "Policy",
            "Request",
            "Workload",
        ),
        "vramctl.jobs._placement",
    ),
    **dict.fromkeys(
        (
            "RayAgent",
            "RayGpu",
            "RayRunner",
            "connect",
            "node_resources",
            "ray_devices",
        ),
        "vramctl.jobs._ray",
    ),
    **dict.fromkeys(("LocalRunner", "Runner", "Scheduler"), "vramctl.jobs._scheduler"),
}

__all__ = [
    "ACTIVE",
    "BATCH_SIZE_ENV",
    "FINISHED",
    "GRAD_ACCUM_ENV",
    "OVERRUN_GROWTH",
    "POLICIES",
    "STATES",
    "AdmissionError",
    "BestFit",
    "ClusterState",
    "DeviceConstraints",
    "EstimateWorker",
    "Fragmentation",
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
    "MemoryNeed",
    "ModelNeed",
    "MostFree",
    "Placement",
    "Policy",
    "Queue",
    "RayAgent",
    "RayGpu",
    "RayRunner",
    "Request",
    "Reservation",
    "Runner",
    "Scheduler",
    "Settings",
    "Workload",
    "batch_plan",
    "check_placeable",
    "connect",
    "load_settings",
    "load_spec",
    "node_resources",
    "overrun_need",
    "price",
    "ray_devices",
    "vramctl_home",
]


if not typing.TYPE_CHECKING:  # mypy sees the imports above
    __getattr__, __dir__ = _lazy.lazy_names(__name__, _LAZY, __all__)
