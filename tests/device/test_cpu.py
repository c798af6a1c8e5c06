from __future__ import annotations

import os
from pathlib import Path

import psutil

import vramctl
from vramctl import NA
from vramctl.device._host import cgroup_memory


def test_cpu_memory_is_the_hosts() -> None:
    cpu = vramctl.get_device("cpu")
    mem = cpu.memory()
    vm = psutil.virtual_memory()
    limit = cgroup_memory().limit
    expected_total = min(vm.total, limit) if limit is not None else vm.total
    assert mem.total == expected_total
    assert mem.used + mem.free == mem.total  # type: ignore[operator]
    assert abs(mem.free - vm.available) < 2**30 or limit is not None  # type: ignore[operator]
    rss = psutil.Process().memory_info().rss
    assert abs(mem.process_used - rss) < 64 * 2**20  # type: ignore[operator]
    assert mem.allocated is NA and mem.temperature_c is NA  # no allocator, no sensor: not zero


def test_cpu_processes_include_this_one() -> None:
    procs = vramctl.get_device("cpu").processes()
    me = [p for p in procs if p.pid == os.getpid()]
    assert me and me[0].used > 0  # type: ignore[operator]
    used = [p.used for p in procs]
    assert used == sorted(used, reverse=True)  # type: ignore[type-var]
    assert len(vramctl.get_device("cpu").processes(limit=2)) == 2


def test_cgroup_limit_parsing(tmp_path: Path) -> None:
    # A cgroup v2 mount that is this process's own cgroup (its root), as in a container.
    (tmp_path / "cgroup.controllers").write_text("memory\n")
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "memory.current").write_text("1234\n")
    own = tmp_path / "self_cgroup"
    own.write_text("0::/\n")
    got = cgroup_memory(tmp_path, own)
    assert (got.limit, got.usage) == (None, 1234)
    (tmp_path / "memory.max").write_text("8589934592\n")
    got = cgroup_memory(tmp_path, own)
    assert (got.limit, got.usage) == (8589934592, 1234)
    got = cgroup_memory(tmp_path / "missing", tmp_path / "missing")
    assert (got.limit, got.usage) == (None, None)
