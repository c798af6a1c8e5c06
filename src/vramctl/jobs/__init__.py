"""Sharing GPUs among jobs: job specs, admission and placement by memory, the queue.

The layer between the run-time layers (``fit``, ``batching``, ``monitor``, ``guard``,
``estimator``) and the interfaces (``server``, ``cli``).
"""

from __future__ import annotations

from vramctl.jobs._ledger import AdmissionError, Ledger, Reservation
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

__all__: list[str] = [
    "AdmissionError",
    "BestFit",
    "ClusterState",
    "Fragmentation",
    "LeastLoaded",
    "Ledger",
    "MostFree",
    "Placement",
    "Policy",
    "Request",
    "Reservation",
    "Workload",
]
