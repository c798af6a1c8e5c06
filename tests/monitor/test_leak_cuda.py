"""The leak detector on a real GPU: ``torch.cuda.memory_allocated`` readings, the tensor census
on CUDA tensors, and the CUDA allocator's own records of where each live block was allocated.

Skipped where no CUDA device is usable (see ``tests/conftest.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from vramctl.monitor._leak import LeakDetector, LeakReport

pytestmark = pytest.mark.cuda

MiB = 2**20
DEVICE = "cuda:0"
HERE = Path(__file__)


def line_of(marker: str) -> int:
    for number, text in enumerate(HERE.read_text().splitlines(), 1):
        if text.rstrip().endswith(f"# {marker}"):
            return number
    raise AssertionError(f"no line marked {marker!r}")


def mlp(width: int = 256, d_in: int = 64) -> nn.Module:
    return nn.Sequential(
        nn.Linear(d_in, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
    ).to(DEVICE)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, b: int = 64) -> None:
    x = torch.randn(b, 64, device=DEVICE)
    y = torch.randint(0, 10, (b,), device=DEVICE)
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    opt.step()


def run(detector: LeakDetector, steps: int, body: Callable[[int], None]) -> list[LeakReport]:
    reports = []
    for i in range(steps):
        body(i)
        report = detector.step()
        if report is not None:
            reports.append(report)
    return reports


def history_enabled() -> bool:
    return bool(torch._C._cuda_isHistoryEnabled())


def test_cuda_healthy_training_never_alarms() -> None:
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    detector = LeakDetector(DEVICE)
    assert detector.signal == "torch.cuda.memory_allocated(0)"
    assert run(detector, 200, lambda i: train_step(model, opt, b=[32, 64, 128][i % 3])) == []


def test_cuda_list_of_tensors_is_found_named_and_history_turned_off() -> None:
    torch.manual_seed(1)
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    kept: list[torch.Tensor] = []
    detector = LeakDetector(DEVICE)

    def body(i: int) -> None:
        train_step(model, opt)
        kept.append(torch.randn(256, 1024, device=DEVICE))  # cuda-list-leak

    reports = run(detector, 50, body)
    assert [r.step for r in reports] == [25]
    report = reports[0]
    assert abs(report.rate_bytes_per_step - MiB) < 0.01 * MiB
    assert report.device == DEVICE
    top = report.suspects[0]
    assert (top.shape, top.dtype, top.count, top.holder) == ((256, 1024), "float32", 2, "list")
    assert top.source == "tensor"
    assert top.site.endswith(f"test_leak_cuda.py:{line_of('cuda-list-leak')} in body")
    # The allocator saw the same blocks at the same line: not listed twice.
    assert not [s for s in report.suspects if s.source == "allocator" and s.site == top.site]
    assert report.causes[0].startswith("a list that grows every step")
    # The census is over: no dispatch mode, no allocator history, new blocks carry no frames.
    assert _get_current_dispatch_mode() is None and not detector.census_active
    assert not history_enabled()
    probe = torch.empty(3 * MiB + 4096, dtype=torch.uint8, device=DEVICE)
    snap = torch.cuda.memory._snapshot()
    blocks = [
        b
        for seg in snap["segments"]
        for b in seg["blocks"]
        if b.get("requested_size") == probe.numel() and b["state"] == "active_allocated"
    ]
    assert blocks and all(not b.get("frames") for b in blocks)


def test_cuda_loss_kept_with_its_graph_is_found() -> None:
    torch.manual_seed(2)
    model = mlp(width=256)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    xv = torch.randn(512, 64, device=DEVICE)
    yv = torch.randint(0, 10, (512,), device=DEVICE)
    val_losses: list[torch.Tensor] = []
    detector = LeakDetector(DEVICE)

    def body(i: int) -> None:
        train_step(model, opt)
        val_losses.append(F.cross_entropy(model(xv), yv))  # cuda-graph-leak

    reports = run(detector, 50, body)
    assert len(reports) == 1 and reports[0].step <= 50
    top = reports[0].suspects[0]
    assert (top.shape, top.holder) == ((512, 256), "autograd graph")
    assert top.site.endswith(f":{line_of('cuda-graph-leak')} in body")
    assert reports[0].causes[0].startswith("a loss or output accumulated with its autograd graph")


def test_cuda_memory_outside_tensors_is_named_from_the_allocator_frames() -> None:
    """Raw allocator blocks (as a C++ extension would take) are invisible to the tensor census."""
    ptrs: list[int] = []
    detector = LeakDetector(DEVICE)
    try:

        def body(i: int) -> None:
            ptrs.append(torch.cuda.caching_allocator_alloc(2 * MiB))  # raw-leak

        reports = run(detector, 50, body)
        assert [r.step for r in reports] == [25]
        rows = [s for s in reports[0].suspects if s.source == "allocator"]
        assert rows, reports[0].format()
        assert rows[0].site.endswith(f":{line_of('raw-leak')} in body")
        assert rows[0].count == 2 and rows[0].nbytes >= 4 * MiB and rows[0].shape is None
        assert any("CUDA blocks" in c for c in reports[0].causes)
    finally:
        for p in ptrs:
            torch.cuda.caching_allocator_delete(p)


def test_cuda_history_you_record_is_left_alone() -> None:
    torch.cuda.memory._record_memory_history(enabled="all", max_entries=100_000)
    try:
        kept: list[torch.Tensor] = []
        detector = LeakDetector(DEVICE)
        reports = run(detector, 50, lambda i: kept.append(torch.ones(MiB // 4, device=DEVICE)))
        assert len(reports) == 1
        assert "already being recorded" in reports[0].census
        assert reports[0].suspects[0].holder == "list"  # the tensor census still names it
        assert history_enabled()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def test_cuda_census_changes_no_result() -> None:
    def train(census: bool) -> list[torch.Tensor]:
        torch.manual_seed(3)
        model = mlp()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        detector = LeakDetector(DEVICE, census=census)
        kept: list[torch.Tensor] = []
        for _ in range(40):
            train_step(model, opt)
            kept.append(torch.randn(256, 1024, device=DEVICE))
            detector.step()
        assert len(detector.reports) == 1
        return [p.detach().cpu() for p in model.parameters()]

    with_census, without = train(True), train(False)
    assert all(
        torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(with_census, without, strict=True)
    )
