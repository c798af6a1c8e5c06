"""For vramctl's other packages only: the device layer's helpers that other vramctl packages
use (the host's limits for the doctor and optimize, matching a GPU's name, ordering devices,
the active simulation).

Not the public surface (that is ``vramctl.device``); the import contracts let sibling
packages import this module and no other private one of ``vramctl.device``.
"""

from __future__ import annotations

from vramctl.device._catalog import match_gpu_name
from vramctl.device._host import affinity_cpus, cgroup_memory, cpu_quota
from vramctl.device._select import sort_devices
from vramctl.device._simulate import active_simulation

__all__ = [
    "active_simulation",
    "affinity_cpus",
    "cgroup_memory",
    "cpu_quota",
    "match_gpu_name",
    "sort_devices",
]
