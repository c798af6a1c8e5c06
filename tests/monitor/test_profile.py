"""profile(name): time and peak-memory delta per operation, on the CPU and a simulated GPU."""

from __future__ import annotations

import pytest
import torch

import vramctl
from vramctl.monitor import Profiler

MiB = 2**20


def test_cpu_peak_counts_temporaries_and_net_counts_what_is_kept() -> None:
    prof = Profiler()
    kept = []
    for _ in range(3):
        with prof.profile("step", device="cpu"):
            a = torch.ones(1024, 1024)  # 4 MiB, freed at the end of the block
            b = a * 2  # another 4 MiB at the same time
            kept.append(b.sum(dim=0))  # 4 KiB kept
            del a, b
    st = prof.stats["step"]
    assert st.calls == 3
    assert 8 * MiB <= st.peak_delta < 9 * MiB
    assert st.net_delta == 3 * 4096
    assert st.total_s > 0 and st.min_s <= st.mean_s <= st.max_s


def test_simulated_gpu_uses_its_own_count() -> None:
    sim = vramctl.simulate("T4-16GB")
    prof = Profiler()
    with sim:
        base = torch.empty(16 * MiB, dtype=torch.uint8)
        with prof.profile("grow", device=sim):
            tmp = torch.empty(32 * MiB, dtype=torch.uint8)
            keep = torch.empty(8 * MiB, dtype=torch.uint8)
            del tmp
        del base, keep
    st = prof.stats["grow"]
    assert st.peak_delta == 40 * MiB
    assert st.net_delta == 8 * MiB


def test_summary_and_table_are_sorted_by_total_time() -> None:
    prof = Profiler()
    with prof.profile("fast"):
        torch.ones(4)
    with prof.profile("slow"):
        torch.randn(512, 512) @ torch.randn(512, 512)
    rows = prof.summary()
    assert [r["name"] for r in rows] == ["slow", "fast"]
    assert rows[0]["peak_delta_bytes"] >= 512 * 512 * 4
    table = prof.table().splitlines()
    assert table[0].split()[:2] == ["operation", "calls"]
    assert table[2].startswith("slow")


def test_an_error_inside_is_still_counted_and_raised() -> None:
    prof = Profiler()
    with pytest.raises(ValueError), prof.profile("fails"):
        raise ValueError("inside")
    assert prof.stats["fails"].calls == 1


def test_a_name_is_required() -> None:
    with pytest.raises(ValueError, match="needs a name"), Profiler().profile(""):
        pass
