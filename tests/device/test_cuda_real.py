"""Real-GPU checks of the paths the NVML stand-in covers elsewhere. Skipped without CUDA."""

from __future__ import annotations

import os

import pytest
import torch

import vramctl
from vramctl import NA, HealthState

pytestmark = pytest.mark.cuda
MiB = 2**20


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
