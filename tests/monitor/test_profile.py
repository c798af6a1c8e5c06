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


def test_cpu_counts_tensors_made_from_python_data_not_numpy_memory() -> None:
    import numpy as np

    prof = Profiler()
    data = [float(i) for i in range(2**18)]
    with prof.profile("tensor", device="cpu"):
        x = torch.tensor(data)  # made outside the dispatcher, then lifted
    assert prof.stats["tensor"].peak_delta == x.untyped_storage().nbytes() == 2**20
    arr = np.ones(2**18)
    with prof.profile("from_numpy", device="cpu"):
        y = torch.from_numpy(arr)  # numpy's memory, there before the block
    assert y.data_ptr() == arr.ctypes.data
    assert prof.stats["from_numpy"].peak_delta == 0


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_cpu_counts_sparse_tensors_values_and_indices() -> None:
    torch.manual_seed(0)
    n = 2**16
    idx = torch.randint(0, 4096, (2, n))
    coo = torch.sparse_coo_tensor(idx, torch.randn(n), (4096, 4096), check_invariants=True)
    prof = Profiler()
    with prof.profile("coalesce", device="cpu"):
        c = coo.coalesce()
    real = c._indices().untyped_storage().nbytes() + c._values().untyped_storage().nbytes()
    assert real > 1 * MiB
    assert prof.stats["coalesce"].net_delta == real
    assert prof.stats["coalesce"].peak_delta >= real
    with prof.profile("csr", device="cpu"):
        csr = c.to_sparse_csr()
    # New memory only: the CSR tensor may share the COO tensor's column indices and values.
    old = {p.untyped_storage().data_ptr() for p in (c._indices(), c._values())}
    parts = (csr.crow_indices(), csr.col_indices(), csr.values())
    new = [p.untyped_storage() for p in parts if p.untyped_storage().data_ptr() not in old]
    assert new
    assert prof.stats["csr"].net_delta == sum(st.nbytes() for st in new)
    # A view of a sparse tensor's values is not new memory; a meta tensor is none.
    with prof.profile("views", device="cpu"):
        v = c._values()
        m = torch.empty(2**20, device="meta") * 2
    assert prof.stats["views"].peak_delta == 0
    del v, m
