"""Real-GPU checks of the paths the NVML stand-in covers elsewhere. Skipped without CUDA."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import pynvml
import pytest
import torch

import vramctl
from vramctl import NA, HealthState

pytestmark = pytest.mark.cuda
MiB = 2**20
GiB = 2**30
#: What the other process holds on the GPU.
HOLD = 2 * GiB
#: Two readings of the same thing, taken a moment apart, may differ this much.
NEAR = 64 * MiB
#: A CUDA context (another process's, beside what it allocates) is at most this large.
CONTEXT = 2 * GiB
# A child that holds HOLD bytes on cuda:0, says "ready", and waits for end of input.
_HOLDER = """
import sys
import torch
x = torch.empty(int(sys.argv[1]), dtype=torch.uint8, device="cuda:0")
torch.cuda.synchronize()
print("ready", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def gpu() -> vramctl.Device:
    devs = vramctl.gpus()
    assert devs, "torch sees a GPU but vramctl lists none"
    return devs[0]


def test_gpus_match_torch(gpu: vramctl.Device) -> None:
    assert len(vramctl.gpus()) == torch.cuda.device_count()
    props = torch.cuda.get_device_properties(0)
    assert gpu.name == props.name
    assert gpu.capability == vramctl.ComputeCapability(props.major, props.minor)
    uuid = getattr(props, "uuid", None)
    if uuid is not None and gpu.kind == "cuda":
        assert gpu.uuid == f"GPU-{uuid}"


def test_memory_matches_mem_get_info(gpu: vramctl.Device) -> None:
    torch.cuda.init()
    mem = gpu.memory()
    free, total = torch.cuda.mem_get_info(0)
    assert mem.total is not NA and mem.free is not NA
    # NVML's total includes memory the driver keeps back; CUDA's does not.
    assert total <= mem.total <= total + 2 * 1024 * MiB
    assert abs(mem.free - free) <= 256 * MiB  # other processes may move a little
    assert mem.used + mem.free == mem.total
    assert gpu.health.state in (HealthState.AVAILABLE, HealthState.BUSY)


def test_allocator_figures_match_memory_stats(gpu: vramctl.Device) -> None:
    x = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda:0")
    y = torch.empty(3 * MiB + 5, dtype=torch.uint8, device="cuda:0")
    del y
    mem = gpu.memory()
    stats = torch.cuda.memory_stats(0)
    assert mem.allocated == stats["allocated_bytes.all.current"] >= 256 * MiB
    assert mem.reserved == stats["reserved_bytes.all.current"]
    assert mem.peak_allocated == stats["allocated_bytes.all.peak"]
    assert mem.inactive_split == stats["inactive_split_bytes.all.current"]
    assert mem.fragmentation == pytest.approx(
        stats["inactive_split_bytes.all.current"] / stats["reserved_bytes.all.current"]
    )
    del x


def test_this_process_is_listed(gpu: vramctl.Device) -> None:
    torch.empty(64 * MiB, dtype=torch.uint8, device="cuda:0")
    procs = gpu.processes()
    mine = [p for p in procs if p.pid == os.getpid()]
    if not mine:
        pytest.skip("NVML lists host PIDs only (this process runs in another PID namespace)")
    assert mine[0].used is not NA and mine[0].used >= 64 * MiB


def test_selection_places_small_work_on_a_gpu() -> None:
    dev = vramctl.select_device("16MiB")
    assert dev.kind in ("cuda", "mig")
    with vramctl.use_device(dev):
        assert torch.cuda.current_device() == dev.index


def test_simulated_t4_oom_matches_a_real_oom_type(gpu: vramctl.Device) -> None:
    with pytest.raises(torch.OutOfMemoryError) as real:
        torch.empty(2**50, dtype=torch.uint8, device="cuda:0")
    with vramctl.simulate("T4-16GB"), pytest.raises(torch.OutOfMemoryError) as sim:
        torch.empty(2**50, dtype=torch.uint8)
    assert str(real.value).startswith("CUDA out of memory. Tried to allocate")
    assert str(sim.value).startswith("CUDA out of memory. Tried to allocate")


# -- another process holding memory --------------------------------------------------


class NvmlMemory(NamedTuple):
    total: int
    used: int
    free: int


@pytest.fixture
def nvml(gpu: vramctl.Device) -> Iterator[Callable[[], NvmlMemory]]:
    """NVML's memory reading of ``gpu``, through pynvml itself (not vramctl)."""
    assert isinstance(gpu.uuid, str)
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByUUID(gpu.uuid.encode())

        def read() -> NvmlMemory:
            m = pynvml.nvmlDeviceGetMemoryInfo(handle)
            return NvmlMemory(int(m.total), int(m.used), int(m.free))

        yield read
    finally:
        pynvml.nvmlShutdown()


@pytest.fixture
def hold() -> Iterator[Callable[[int], subprocess.Popen[str]]]:
    """Start a child process that holds ``nbytes`` on cuda:0; every child is killed after."""
    children: list[subprocess.Popen[str]] = []

    def start(nbytes: int) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-c", _HOLDER, str(nbytes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        children.append(proc)
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        line = proc.stdout.readline().strip() if ready else ""
        if line != "ready":
            pytest.fail(f"the child holding {nbytes} bytes did not start ({proc.poll()}): {line!r}")
        return proc

    try:
        yield start
    finally:
        for proc in children:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()


def _between(value: int, a: int, b: int, slack: int = NEAR) -> bool:
    """``value`` lies between two readings ``a`` and ``b``, give or take ``slack``."""
    return min(a, b) - slack <= value <= max(a, b) + slack


def _context_first() -> None:
    """This process's own CUDA context, made before any reading, so it moves none of them."""
    torch.cuda.init()
    torch.cuda.mem_get_info(0)
    torch.cuda.synchronize(0)


def test_readings_agree_with_another_process_holding_memory(
    gpu: vramctl.Device,
    nvml: Callable[[], NvmlMemory],
    hold: Callable[[int], subprocess.Popen[str]],
) -> None:
    _context_first()
    nvml_before = nvml()
    cuda_before = torch.cuda.mem_get_info(0)
    hold(HOLD)
    n0 = nvml()
    mem = gpu.memory()
    free, total = torch.cuda.mem_get_info(0)
    n1 = nvml()
    assert abs(n1.used - n0.used) <= NEAR, f"the GPU's memory moved during the readings: {n0} {n1}"
    # vramctl's reading is NVML's, at nearly the same moment.
    assert mem.total == n0.total
    assert mem.used is not NA and mem.free is not NA
    assert _between(mem.used, n0.used, n1.used), (mem.used, n0, n1)
    assert _between(mem.free, n0.free, n1.free), (mem.free, n0, n1)
    assert mem.used + mem.free == mem.total
    # torch.cuda's free is NVML's, give or take the memory the driver keeps back.
    assert total <= n0.total
    assert _between(free, n0.free, n1.free, slack=256 * MiB), (free, n0, n1)
    # Both saw the other process arrive: its HOLD bytes and its CUDA context.
    nvml_drop = nvml_before.free - n1.free
    cuda_drop = cuda_before[0] - free
    assert HOLD <= nvml_drop <= HOLD + CONTEXT, nvml_drop
    assert abs(nvml_drop - cuda_drop) <= NEAR, (nvml_drop, cuda_drop)
    assert mem.used >= HOLD


def test_other_process_is_listed_with_its_memory(
    gpu: vramctl.Device, hold: Callable[[int], subprocess.Popen[str]]
) -> None:
    child = hold(HOLD)
    procs = gpu.processes()
    if all(p.used is NA for p in procs):
        pytest.skip(f"NVML lists no process with its memory here: {procs}")
    assert any(p.used is not NA and p.used >= HOLD for p in procs), procs
    listed = {p.pid: p for p in procs}
    if child.pid not in listed:
        pytest.skip("NVML lists host PIDs only (the child runs in another PID namespace)")
    used = listed[child.pid].used
    assert used is not NA and HOLD <= used <= HOLD + CONTEXT, listed[child.pid]
    assert listed[child.pid].kind == "compute"


def _status_json(*args: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "vramctl", "status", "--json", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    doc: dict[str, Any] = json.loads(out.stdout)
    return doc


def test_status_json_agrees_with_nvml_with_another_process_holding_memory(
    gpu: vramctl.Device,
    nvml: Callable[[], NvmlMemory],
    hold: Callable[[int], subprocess.Popen[str]],
) -> None:
    _context_first()
    child = hold(HOLD)
    n0 = nvml()
    doc = _status_json("--device", str(gpu.index), "--processes", "1000")
    n1 = nvml()
    assert doc["schema"] == "vramctl.status/1"
    [dev] = [d for d in doc["devices"] if d["id"] == gpu.id]
    assert dev["uuid"] == gpu.uuid
    mem = dev["memory"]
    assert mem["total"] == n0.total
    # "vramctl status" makes no CUDA context of its own, so NVML's figures hold throughout.
    assert _between(mem["used"], n0.used, n1.used), (mem["used"], n0, n1)
    assert _between(mem["free"], n0.free, n1.free), (mem["free"], n0, n1)
    assert mem["used"] + mem["free"] == mem["total"]
    assert mem["used"] >= HOLD
    procs = {p["pid"]: p for p in dev["processes"]}
    if all(p["used"] is None for p in procs.values()):
        pytest.skip(f"NVML lists no process with its memory here: {procs}")
    assert any(p["used"] is not None and p["used"] >= HOLD for p in procs.values()), procs
    if child.pid not in procs:
        pytest.skip("NVML lists host PIDs only (the child runs in another PID namespace)")
    assert HOLD <= procs[child.pid]["used"] <= HOLD + CONTEXT
    assert procs[child.pid]["command"] is None or "-c" in procs[child.pid]["command"]
