"""The monitor on a real GPU: NVML readings, this process's allocator, fragmentation, profiling.

These stand for the paths the NVML fake exercises on machines without a GPU.
"""

from __future__ import annotations

import pytest
import torch

import vramctl
from vramctl.monitor import FragmentationRule, Monitor, Profiler, Sample
from vramctl.monitor._prometheus import metrics_text

pytestmark = pytest.mark.cuda

MiB = 2**20


def test_samples_agree_with_torch_and_the_driver() -> None:
    x = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda:0")
    mon = Monitor(["cuda:0"], rules=[])
    (s,) = mon.sample()
    free, total = torch.cuda.mem_get_info(0)
    mem = s.memory
    # NVML's total includes what the driver keeps back; CUDA's does not.
    assert total <= mem.total <= total + 2048 * MiB
    # The two free figures differ by that too, and by what others allocate between the readings.
    assert abs(mem.free - free) <= 256 * MiB
    assert mem.allocated == torch.cuda.memory_allocated(0)
    assert mem.reserved == torch.cuda.memory_reserved(0)
    assert mem.process_used >= mem.reserved
    text = metrics_text(mon)
    assert 'vramctl_allocator_allocated_bytes{device="cuda:0"' in text
    del x


def test_fragmentation_of_the_real_allocator_is_seen() -> None:
    torch.cuda.empty_cache()
    # Interleaved blocks carved from large segments, every other one freed: split blocks
    # that are cached but inactive.
    blocks = [torch.empty(3 * MiB, dtype=torch.uint8, device="cuda:0") for _ in range(200)]
    del blocks[::2]
    mon = Monitor(["cuda:0"], rules=[])
    (s,) = mon.sample()
    assert s.memory.inactive_split > 0
    assert s.memory.fragmentation > 0.3
    rule = FragmentationRule(0.3, min_reserved=64 * MiB, for_s=0)
    found = rule.evaluate(s, [s])
    assert found is not None and "expandable_segments:True" in found.suggestion
    del blocks
    torch.cuda.empty_cache()


def test_profile_uses_the_allocator_peak() -> None:
    # The first matrix multiply keeps a cuBLAS workspace: let it not be the profiled one.
    warm = torch.randn(64, 64, device="cuda:0")
    warm = warm @ warm
    del warm
    torch.cuda.synchronize()
    prof = Profiler()
    with prof.profile("matmul", device="cuda:0"):
        a = torch.randn(2048, 2048, device="cuda:0")
        b = a @ a
        del a, b
    st = prof.stats["matmul"]
    assert st.peak_delta >= 2 * 2048 * 2048 * 4
    assert st.net_delta == 0


def test_step_finds_a_gpu_leak() -> None:
    mon = Monitor(["cuda:0"], rules=[])
    kept = []
    report = None
    for _ in range(50):
        kept.append(torch.randn(256, 1024, device="cuda:0"))
        report = mon.step()
        if report is not None:
            break
    assert report is not None and report.step <= 50
    assert report.device == "cuda:0"


def test_sample_round_trips_through_json() -> None:
    mon = Monitor(["cuda:0"], rules=[])
    (s,) = mon.sample()
    assert Sample.from_dict(s.to_dict()).memory == s.memory
    assert vramctl.get_device("cuda:0").memory().total == s.memory.total
