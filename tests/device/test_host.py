"""The host's limits, read once in the device layer: the cgroup memory limit and CPU quota
(v1, v2, a nested cgroup, none) against fake cgroup trees, and the CPU device using them."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

import vramctl
from vramctl.device import _host
from vramctl.device._host import affinity_cpus, cgroup_memory, cpu_quota

GiB, MiB = 2**30, 2**20


def _tree(
    tmp_path: Path, self_cgroup: str, files: dict[str, str], *, v2: bool
) -> tuple[Path, Path]:
    """A cgroup mount at ``tmp_path/cgroup`` with ``files`` (paths under it) and the
    process's ``/proc/self/cgroup`` at ``tmp_path/self_cgroup``."""
    root = tmp_path / "cgroup"
    root.mkdir()
    if v2:
        (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text + "\n")
    own = tmp_path / "self_cgroup"
    own.write_text(self_cgroup)
    return root, own


def test_v2_at_the_root(tmp_path: Path) -> None:
    root, own = _tree(
        tmp_path,
        "0::/\n",
        {"memory.max": str(4 * GiB), "memory.current": str(GiB), "cpu.max": "150000 100000"},
        v2=True,
    )
    assert cgroup_memory(root, own) == _host.CgroupMemory("v2", 4 * GiB, GiB, 3 * GiB)
    assert cpu_quota(root, own) == 1.5


def test_v2_nested_the_limit_is_the_smallest_on_the_way_up(tmp_path: Path) -> None:
    # The limits sit on the parent (memory) and the grandparent (CPU); the process's own
    # cgroup has none, and the root's files say "max".
    root, own = _tree(
        tmp_path,
        "0::/kubepods/pod1/ctr\n",
        {
            "memory.max": "max",
            "cpu.max": "max 100000",
            "kubepods/cpu.max": "200000 100000",
            "kubepods/pod1/memory.max": str(2 * GiB),
            "kubepods/pod1/memory.current": str(int(1.5 * GiB)),
            "kubepods/pod1/cpu.max": "max 100000",
            "kubepods/pod1/ctr/memory.max": "max",
            "kubepods/pod1/ctr/memory.current": str(GiB),
            "kubepods/pod1/ctr/cpu.max": "max 100000",
        },
        v2=True,
    )
    got = cgroup_memory(root, own)
    assert (got.version, got.limit, got.usage) == ("v2", 2 * GiB, GiB)
    # What may still be allocated is the parent's room: its other children use memory too.
    assert got.headroom == GiB // 2
    assert got.to_dict() == {"version": "v2", "limit": 2 * GiB, "usage": GiB}
    assert cpu_quota(root, own) == 2.0


def test_v1_with_the_controllers_mounted_together(tmp_path: Path) -> None:
    root, own = _tree(
        tmp_path,
        "12:cpuset:/\n5:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n",
        {
            "cpuset/cpuset.cpus": "0-3",  # "cpuset" must not be taken for "cpu"
            "memory/memory.limit_in_bytes": "9223372036854771712",  # v1's "no limit"
            "memory/docker/abc/memory.limit_in_bytes": str(16 * GiB),
            "memory/docker/abc/memory.usage_in_bytes": str(GiB),
            "cpu,cpuacct/cpu.cfs_quota_us": "-1",
            "cpu,cpuacct/cpu.cfs_period_us": "100000",
            "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "50000",
            "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000",
        },
        v2=False,
    )
    assert cgroup_memory(root, own) == _host.CgroupMemory("v1", 16 * GiB, GiB, 15 * GiB)
    assert cpu_quota(root, own) == 0.5


def test_v1_in_a_container_whose_own_cgroup_is_the_mount(tmp_path: Path) -> None:
    # /proc/self/cgroup names the host's path, which the container's mount does not have
    # (as on this machine): the mount's root is the container's cgroup.
    root, own = _tree(
        tmp_path,
        "4:memory:/process_api/ab3a\n1:cpu:/\n0::/\n",
        {
            "memory/memory.limit_in_bytes": str(8 * GiB),
            "memory/memory.usage_in_bytes": str(2 * GiB),
            "cpu/cpu.cfs_quota_us": "-1",
            "cpu/cpu.cfs_period_us": "100000",
        },
        v2=False,
    )
    assert cgroup_memory(root, own) == _host.CgroupMemory("v1", 8 * GiB, 2 * GiB, 6 * GiB)
    assert cpu_quota(root, own) is None


def test_no_cgroup(tmp_path: Path) -> None:
    nothing = tmp_path / "none"
    assert cgroup_memory(nothing, nothing) == _host.CgroupMemory("")
    assert cpu_quota(nothing, nothing) is None
    # v2 without limits: a version, no limit.
    root, own = _tree(tmp_path, "0::/\n", {"memory.max": "max", "memory.current": "100"}, v2=True)
    assert cgroup_memory(root, own) == _host.CgroupMemory("v2", None, 100, None)


def test_the_real_host_is_read() -> None:
    got = cgroup_memory()
    assert got.version in ("v2", "v1", "")
    assert got.limit is None or got.limit > 0
    quota = cpu_quota()
    assert quota is None or quota > 0
    assert 1 <= affinity_cpus() <= (psutil.cpu_count() or 1)


def test_the_cpu_device_honours_a_nested_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A limit set on the parent of this process's cgroup, none at the root: the CPU device
    # read only the root's memory.max before, and gave the host's RAM.
    root, own = _tree(
        tmp_path,
        "0::/job/step\n",
        {
            "memory.max": "max",
            "memory.current": str(10 * GiB),
            "job/memory.max": str(GiB),
            "job/memory.current": str(900 * MiB),
            "job/step/memory.max": "max",
            "job/step/memory.current": str(100 * MiB),
        },
        v2=True,
    )
    monkeypatch.setattr(_host, "CGROUP_ROOT", root)
    monkeypatch.setattr(_host, "SELF_CGROUP", own)
    assert psutil.virtual_memory().total > GiB  # the limit is below the host's memory
    mem = vramctl.get_device("cpu").memory()
    assert mem.total == GiB
    assert mem.free is not vramctl.NA and mem.free <= 124 * MiB
    assert mem.used + mem.free == mem.total  # type: ignore[operator]


def test_the_cpu_device_honours_a_v1_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root, own = _tree(
        tmp_path,
        "4:memory:/docker/abc\n0::/\n",
        {
            "memory/docker/abc/memory.limit_in_bytes": str(GiB),
            "memory/docker/abc/memory.usage_in_bytes": str(GiB // 4),
        },
        v2=False,
    )
    monkeypatch.setattr(_host, "CGROUP_ROOT", root)
    monkeypatch.setattr(_host, "SELF_CGROUP", own)
    mem = vramctl.get_device("cpu").memory()
    assert mem.total == GiB and mem.free is not vramctl.NA and mem.free <= 3 * GiB // 4
