"""The optimize layer: making a step fit and run fast on its device.

``optimize`` applies memory and speed settings to a model and reports each one,
``plan`` searches precision, checkpointing, micro-batch, optimizer and offload
for the fastest step that fits, and ``doctor`` checks the environment. It sits
above the estimator (which prices memory and time) and the guard.
"""

from __future__ import annotations

from vramctl.optimize._doctor import DoctorReport, Finding, doctor

__all__ = ["DoctorReport", "Finding", "doctor"]
