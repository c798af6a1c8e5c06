"""The optimize layer: making a step fit and run fast on its device.

``optimize`` applies memory and speed settings to a model and reports each one,
and ``plan`` searches precision, checkpointing, micro-batch, optimizer and offload
for the fastest step that fits. It sits above the estimator (which prices memory
and time) and the guard. ``doctor``, the environment's check, is the package
:mod:`vramctl.doctor`'s; its names are re-exported here as they were before it moved.

The package is also the function of its name: ``vramctl.optimize(...)`` calls
:func:`optimize`, and ``vramctl.optimize.find_blocks`` is this package's name.
"""

from __future__ import annotations

from vramctl import _lazy
from vramctl.doctor import DoctorReport, Finding, doctor
from vramctl.optimize._apply import Optimized, optimize
from vramctl.optimize._apply_plan import AppliedPlan, apply_plan
from vramctl.optimize._checkpoint import apply_checkpointing, find_blocks
from vramctl.optimize._errors import OptimizeError
from vramctl.optimize._helper import StepHelper
from vramctl.optimize._offload import OffloadedOptimizer
from vramctl.optimize._plan import Plan, PlanResult, plan
from vramctl.optimize._report import Optimization, OptimizationReport

__all__ = [
    "AppliedPlan",
    "DoctorReport",
    "Finding",
    "OffloadedOptimizer",
    "Optimization",
    "OptimizationReport",
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
]

_lazy.callable_package(__name__)
