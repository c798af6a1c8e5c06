"""The doctor: check the environment a PyTorch job runs in, and say what to change.

``doctor`` runs every check and returns a :class:`DoctorReport` of :class:`Finding` s. It
only reads: it never changes a setting, and it does not initialise CUDA (the driver is read
through NVML, the GPUs and the host's limits through the device layer). The checks, by
domain: ``_gpu`` (the GPUs, NVML, the driver against torch's CUDA build, each GPU's
processes, MIG, persistence, ECC and load), ``_torch`` (the allocator's settings, TF32,
cuDNN), ``_host`` (``/dev/shm``, the cgroup memory limit, swap, CPU threads) and
``_packages`` (the Python packages); ``_report`` holds the findings and the report,
``_doctor`` the run.

The package is also the function of its name: ``vramctl.doctor(...)`` calls
:func:`doctor`, and ``vramctl.doctor.DoctorReport`` is this package's name.

>>> from vramctl.doctor import doctor
>>> report = doctor()
>>> report.worst in ("ok", "info", "warning", "error")
True
>>> any(f.check == "host.shm" for f in report.findings)
True
"""

from __future__ import annotations

import typing

from vramctl import _lazy
from vramctl.doctor._report import DoctorReport, Finding

if typing.TYPE_CHECKING:
    from vramctl.doctor._doctor import doctor

# The run imports PyTorch: imported on first use (PEP 562), so that the report's types
# (for the command line's rendering) need none.
_LAZY = {"doctor": "vramctl.doctor._doctor"}

__all__ = ["DoctorReport", "Finding", "doctor"]


if not typing.TYPE_CHECKING:  # mypy sees the imports above
    __getattr__, __dir__ = _lazy.lazy_names(__name__, _LAZY, __all__)

_lazy.callable_package(__name__)
