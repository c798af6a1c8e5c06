"""What the host allows this process: its cgroup's memory limit and CPU quota, and its CPUs.

The one reader of these facts, for every package: the CPU device's memory, ``optimize``'s
thread count and the doctor's host checks. It reads cgroup v2 (one tree, with
``cgroup.controllers`` at its root) and v1 (a tree per controller), and follows this
process's own cgroup, named in ``/proc/self/cgroup``, up to the root: a limit set on a
parent holds for its children, so the limit is the smallest on the way. ``root`` and
``self_cgroup`` name the cgroup mount and the process's cgroup file (a test points them at a
fake tree); left out, they are :data:`CGROUP_ROOT` and :data:`SELF_CGROUP`, read at the call.

>>> cgroup_memory().version in ("v2", "v1", "")
True
>>> affinity_cpus() >= 1
True
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

__all__ = [
    "CGROUP_ROOT",
    "SELF_CGROUP",
    "CgroupMemory",
    "affinity_cpus",
    "cgroup_memory",
    "cpu_quota",
]

#: Where the cgroup file system is mounted.
CGROUP_ROOT = Path("/sys/fs/cgroup")
#: This process's cgroups: ``ID:CONTROLLERS:PATH`` a line (v2's line is ``0::PATH``).
SELF_CGROUP = Path("/proc/self/cgroup")

_UNLIMITED = 2**62  # cgroup v1 writes "no limit" as a huge number (a page-rounded 2**63 - 1)

#: A folder or file to read; None for the default.
Where: TypeAlias = "str | os.PathLike[str] | None"


@dataclass(frozen=True)
class CgroupMemory:
    """This process's cgroup memory, in bytes; None where there is none or it cannot be read."""

    #: "v2", "v1", or "" where no cgroup memory controller is found.
    version: str
    #: The smallest limit from this process's cgroup up to the root.
    limit: int | None = None
    #: The memory this process's own cgroup uses (with its children).
    usage: int | None = None
    #: What may still be allocated before a limit is reached: the smallest ``limit - usage``
    #: of the cgroups on the way up that have a limit (a parent's limit counts its other
    #: children's use too).
    headroom: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """``{"version", "limit", "usage"}`` (as the doctor reports them)."""
        return {"version": self.version, "limit": self.limit, "usage": self.usage}


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max" or not text.lstrip("-").isdigit():
        return None
    value = int(text)
    return None if value >= _UNLIMITED or value < 0 else value


def _up(base: Path, rel: str) -> list[Path]:
    """The folders from ``base/rel`` up to ``base`` that exist (``[base]`` where none does:
    a container often mounts its own cgroup as the root, under a path that names the host's)."""
    parts = [p for p in rel.strip().split("/") if p]
    dirs = [base.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]
    found = [d for d in dirs if d.is_dir()]
    return found or [base]


def _v1_mount(root: Path, controller: str, controllers: str) -> Path:
    """The folder where cgroup v1 mounts ``controller``: ``root/cpu``, ``root/cpu,cpuacct``
    or the folder whose comma-separated name includes it."""
    for candidate in (root / controller, root / controllers):
        if candidate.is_dir():
            return candidate
    try:
        folders = sorted(p for p in root.iterdir() if p.is_dir())
    except OSError:
        folders = []
    return next((p for p in folders if controller in p.name.split(",")), root / controller)


def _cgroup_dirs(root: Path, self_cgroup: Path, controller: str) -> tuple[str, list[Path]]:
    """The cgroup version ("v2", "v1" or "") and this process's cgroup folders for
    ``controller``, from its own up to the root."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    v2 = (root / "cgroup.controllers").exists()
    for line in lines:
        _, controllers, rel = [*line.split(":", 2), "", ""][:3]
        if controllers == "" and v2:
            return "v2", _up(root, rel)
        if controller in controllers.split(","):
            return "v1", _up(_v1_mount(root, controller, controllers), rel)
    if v2:
        return "v2", [root]
    if not lines and (root / controller).is_dir():
        return "v1", [root / controller]
    return "", []


def _paths(root: Where, self_cgroup: Where) -> tuple[Path, Path]:
    return (
        CGROUP_ROOT if root is None else Path(root),
        SELF_CGROUP if self_cgroup is None else Path(self_cgroup),
    )


def cgroup_memory(root: Where = None, self_cgroup: Where = None) -> CgroupMemory:
    """This process's cgroup memory limit, use and headroom (v2 ``memory.max`` and
    ``memory.current``, v1 ``memory.limit_in_bytes`` and ``memory.usage_in_bytes``)."""
    version, dirs = _cgroup_dirs(*_paths(root, self_cgroup), "memory")
    limit_file, usage_file = (
        ("memory.max", "memory.current")
        if version == "v2"
        else ("memory.limit_in_bytes", "memory.usage_in_bytes")
    )
    limits: list[int] = []
    room: list[int] = []
    usage: int | None = None
    for d in dirs:
        limit, used = _read_int(d / limit_file), _read_int(d / usage_file)
        if usage is None:
            usage = used
        if limit is not None:
            limits.append(limit)
            if used is not None:
                room.append(max(0, limit - used))
    return CgroupMemory(
        version,
        min(limits) if limits else None,
        usage,
        min(room) if room else None,
    )


def cpu_quota(root: Where = None, self_cgroup: Where = None) -> float | None:
    """This process's cgroup CPU quota in CPUs (v2 ``cpu.max`` "200000 100000", or v1
    ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``, is 2.0): the smallest from its cgroup up
    to the root; None without one."""
    version, dirs = _cgroup_dirs(*_paths(root, self_cgroup), "cpu")
    quotas: list[float] = []
    for d in dirs:
        try:
            if version == "v2":
                quota, period = [*(d / "cpu.max").read_text().split(), ""][:2]
            else:
                quota = (d / "cpu.cfs_quota_us").read_text().strip()
                period = (d / "cpu.cfs_period_us").read_text().strip()
        except (OSError, ValueError):
            continue
        if quota.isdigit() and period.isdigit() and int(period) > 0:
            quotas.append(int(quota) / int(period))
    return min(quotas) if quotas else None


def affinity_cpus() -> int:
    """The CPUs this process may run on: its CPU affinity (all CPUs where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
