"""The step-aware leak detector on real training loops: real models, optimizers and allocations."""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from vramctl import VramctlError
from vramctl.monitor._leak import (
    LeakDetector,
    LeakDetectorError,
    LeakReport,
    LeakSuspect,
)
from vramctl.monitor._trend import Window, mann_kendall, theil_sen, trend

MiB = 2**20
HERE = Path(__file__)


@pytest.fixture(autouse=True)
def _one_thread():
    """Small models run faster on one thread, and do not fight other jobs for the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def line_of(marker: str) -> int:
    """The line of this file that carries ``marker`` in a comment."""
    for number, text in enumerate(HERE.read_text().splitlines(), 1):
        if text.rstrip().endswith(f"# {marker}"):
            return number
    raise AssertionError(f"no line marked {marker!r}")


def mlp(width: int = 128, d_in: int = 32, classes: int = 10) -> nn.Module:
    return nn.Sequential(
        nn.Linear(d_in, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
    )


def run(
    detector: LeakDetector,
    steps: int,
    body: Callable[[int], None],
) -> list[LeakReport]:
    """Call ``body(i)`` then ``detector.step()`` for each step; every report returned."""
    reports = []
    for i in range(steps):
        body(i)
        report = detector.step()
        if report is not None:
            reports.append(report)
    return reports


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor):
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss


# -- healthy loops: no report ------------------------------------------------------------


def test_healthy_mlp_adam_never_alarms() -> None:
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    detector = LeakDetector("cpu")
    losses: list[float] = []

    def body(i: int) -> None:
        loss = train_step(model, opt, torch.randn(64, 32), torch.randint(0, 10, (64,)))
        losses.append(loss.item())  # a number, not the tensor: no leak

    assert run(detector, 200, body) == []
    assert detector.steps == 200 and len(detector.readings) == 40
    assert detector.reports == [] and not detector.census_active


def test_healthy_convnet_never_alarms() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    detector = LeakDetector("cpu")

    def body(i: int) -> None:
        train_step(model, opt, torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,)))

    assert run(detector, 200, body) == []


def test_healthy_cache_that_fills_then_stops_never_alarms() -> None:
    """A cache of 16 entries of 512 KiB fills over the first 16 steps, then stays."""
    torch.manual_seed(2)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cache: dict[int, torch.Tensor] = {}
    detector = LeakDetector("cpu")

    def body(i: int) -> None:
        train_step(model, opt, torch.randn(64, 32), torch.randint(0, 10, (64,)))
        key = i % 16
        if key not in cache:
            cache[key] = torch.randn(128, 1024)  # 512 KiB per entry, 8 MiB in all

    assert run(detector, 200, body) == []
    assert len(cache) == 16


def test_healthy_variable_batches_never_alarm() -> None:
    """Memory at the step's end goes up and down by megabytes with the batch size."""
    torch.manual_seed(3)
    rng = random.Random(3)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    detector = LeakDetector("cpu")
    held: dict[str, torch.Tensor] = {}

    def body(i: int) -> None:
        b = rng.choice([8, 32, 64, 128, 256])
        held["x"] = x = torch.randn(b, 3, 32, 32)  # up to 3 MiB, alive until the next step
        train_step(model, opt, x[:, :, ::8, ::8], torch.randint(0, 10, (b,)))

    assert run(detector, 200, body) == []
    spread = max(detector.readings) - min(detector.readings)
    assert spread > 1 * MiB  # the test is not vacuous: the readings really move


def test_one_off_growth_never_alarms() -> None:
    """A 64 MiB buffer made once, mid-run, and kept: a step, not a trend."""
    kept: list[torch.Tensor] = []
    detector = LeakDetector("cpu")

    def body(i: int) -> None:
        if i == 60:
            kept.append(torch.ones(16 * MiB // 4))

    assert run(detector, 150, body) == []


def test_flat_memory_has_no_trend_and_no_division_by_zero() -> None:
    detector = LeakDetector("cpu", warmup=0, window=10)
    assert run(detector, 100, lambda i: None) == []
    flat = [1000] * 40
    t = trend(flat, 1.0)
    assert (t.slope, t.z, t.p_value, t.persistent) == (0.0, 0.0, 1.0, False)
    w = Window(10)
    for y in flat:
        w.push(y)
    assert w.ols_slope() == 0.0


def test_growth_below_min_rate_is_not_reported() -> None:
    kept: list[torch.Tensor] = []
    detector = LeakDetector("cpu", min_rate=256 * 1024)

    def body(i: int) -> None:
        kept.append(torch.ones(64 * 1024 // 4))  # 64 KiB per step: a quarter of min_rate

    assert run(detector, 120, body) == []


# -- leaks: found, and named ---------------------------------------------------------------


def test_loss_kept_with_its_graph_is_found_and_named() -> None:
    """A validation loss, computed with autograd on, appended every step: its graph stays."""
    torch.manual_seed(4)
    model = mlp(width=256, d_in=64)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    xv, yv = torch.randn(512, 64), torch.randint(0, 10, (512,))
    val_losses: list[torch.Tensor] = []
    detector = LeakDetector("cpu")

    def body(i: int) -> None:
        train_step(model, opt, torch.randn(64, 64), torch.randint(0, 10, (64,)))
        val_losses.append(F.cross_entropy(model(xv), yv))  # graph-leak

    reports = run(detector, 50, body)
    assert len(reports) == 1
    report = reports[0]
    assert 20 <= report.step <= 50
    assert 0.9 * MiB <= report.rate_bytes_per_step <= 1.2 * MiB  # two 512x256 float32 saved
    site = f"test_leak.py:{line_of('graph-leak')} in body"
    top = report.suspects[0]
    assert top.site.endswith(site), report.format()
    assert (top.shape, top.dtype, top.holder) == ((512, 256), "float32", "autograd graph")
    assert top.count == 4 and top.nbytes == 4 * 512 * 256 * 4  # 2 per step, 2 steps recorded
    loss_rows = [s for s in report.suspects if s.shape == ()]
    assert loss_rows and loss_rows[0].holder == "list" and loss_rows[0].requires_grad
    assert report.causes[0].startswith("a loss or output accumulated with its autograd graph")
    assert "loss.item()" in report.causes[0] and site in report.causes[0]


def test_running_total_of_losses_keeps_every_graph() -> None:
    """``total = total + loss``: no Python object holds the old graphs, the new total's does."""
    torch.manual_seed(8)
    model = mlp(width=256, d_in=64)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    xv, yv = torch.randn(512, 64), torch.randint(0, 10, (512,))
    total = [torch.zeros(())]
    detector = LeakDetector("cpu")

    def body(i: int) -> None:
        train_step(model, opt, torch.randn(64, 64), torch.randint(0, 10, (64,)))
        total[0] = total[0] + F.cross_entropy(model(xv), yv)  # total-leak

    reports = run(detector, 50, body)
    assert [r.step for r in reports] == [25]
    top = reports[0].suspects[0]
    site = f"test_leak.py:{line_of('total-leak')} in body"
    assert (top.shape, top.holder) == ((512, 256), "autograd graph") and top.site.endswith(site)
    cause = reports[0].causes[0]
    assert cause.startswith("a loss or output accumulated with its autograd graph")
    assert "total += loss" in cause and site in cause


def test_list_of_tensors_is_found_and_named() -> None:
    torch.manual_seed(5)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    activations: list[torch.Tensor] = []
    detector = LeakDetector("cpu")

    def body(i: int) -> None:
        train_step(model, opt, torch.randn(64, 32), torch.randint(0, 10, (64,)))
        activations.append(torch.randn(256, 1024))  # list-leak

    reports = run(detector, 50, body)
    assert [r.step for r in reports] == [25]  # 5 warmup steps, then 20 readings
    report = reports[0]
    assert abs(report.rate_bytes_per_step - MiB) < 0.05 * MiB
    assert report.p_value < 1e-3 and report.window == 20 and report.baseline_step == 6
    assert 18 * MiB <= report.growth_bytes <= 21 * MiB
    top = report.suspects[0]
    assert (top.shape, top.dtype, top.count, top.nbytes) == ((256, 1024), "float32", 2, 2 * MiB)
    assert top.holder == "list" and not top.requires_grad
    assert top.site.endswith(f"test_leak.py:{line_of('list-leak')} in body")
    assert len(report.causes) == 1
    assert report.causes[0].startswith("a list that grows every step")
    assert "append(" in report.causes[0] and top.site in report.causes[0]


def test_a_leak_every_eighth_step_is_recorded_when_it_strikes() -> None:
    """The census records until memory grows, so it sees the step that leaks."""
    kept: list[torch.Tensor] = []
    detector = LeakDetector("cpu")

    def body(i: int) -> None:
        if i % 8 == 7:
            kept.append(torch.ones(8 * MiB // 4))  # burst-leak

    reports = run(detector, 60, body)
    assert len(reports) == 1 and reports[0].step <= 50
    top = reports[0].suspects[0]
    assert (top.shape, top.holder, top.count) == ((8 * MiB // 4,), "list", 1)
    assert top.site.endswith(f":{line_of('burst-leak')} in body")


def test_a_growing_dict_is_named() -> None:
    class Trainer:
        def __init__(self) -> None:
            self.history: dict[int, torch.Tensor] = {}

    trainer = Trainer()
    detector = LeakDetector("cpu")

    def body(i: int) -> None:
        trainer.history[i] = torch.ones(512, 1024)  # dict-leak

    reports = run(detector, 50, body)
    assert len(reports) == 1
    top = reports[0].suspects[0]
    assert top.holder == "dict" and top.site.endswith(f":{line_of('dict-leak')} in body")
    assert "a dict that grows every step" in reports[0].causes[0]


def test_reports_once_per_leak_and_rearms_when_growth_stops() -> None:
    kept: list[torch.Tensor] = []
    detector = LeakDetector("cpu", census=False)

    def body(i: int) -> None:
        if i < 60 or 150 <= i < 210:  # two leaks, 90 flat steps between them
            kept.append(torch.ones(MiB // 4))

    reports = run(detector, 210, body)
    assert len(reports) == 2 and reports[0].step == 25
    assert 165 <= reports[1].step <= 185  # the second leak starts at step 151
    assert all(r.census == "off" and r.suspects == () for r in reports)


def test_census_off_detects_at_the_same_step_without_suspects() -> None:
    kept: list[torch.Tensor] = []
    detector = LeakDetector("cpu", census=False)
    reports = run(detector, 50, lambda i: kept.append(torch.ones(2 * MiB // 4)))
    assert [r.step for r in reports] == [25]
    assert reports[0].suspects == () and reports[0].causes == ()
    assert _get_current_dispatch_mode() is None


def test_census_changes_no_result_and_leaves_nothing_behind() -> None:
    """The same seeded leaky training with and without the census ends with the same weights."""

    def train(census: bool) -> tuple[list[torch.Tensor], LeakDetector]:
        torch.manual_seed(6)
        model = mlp()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        detector = LeakDetector("cpu", census=census)
        kept: list[torch.Tensor] = []
        for _ in range(40):
            x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))
            train_step(model, opt, x, y)
            kept.append(torch.randn(256, 1024))
            detector.step()
        return [p.detach().clone() for p in model.parameters()], detector

    with_census, d1 = train(True)
    without, d2 = train(False)
    assert len(d1.reports) == len(d2.reports) == 1
    assert d1.reports[0].suspects and not d2.reports[0].suspects
    assert all(torch.equal(a, b) for a, b in zip(with_census, without, strict=True))
    assert _get_current_dispatch_mode() is None and not d1.census_active


def test_close_ends_a_census_under_way() -> None:
    kept: list[torch.Tensor] = []
    detector = LeakDetector("cpu")
    for _ in range(16):  # the census starts at step 15 (10 readings after warmup)
        kept.append(torch.ones(MiB // 4))
        detector.step()
    assert detector.census_active and _get_current_dispatch_mode() is not None
    detector.close()
    assert not detector.census_active and _get_current_dispatch_mode() is None


def test_hook_runs_after_each_optimizer_step_and_reports_everywhere(
    caplog: pytest.LogCaptureFixture,
) -> None:
    torch.manual_seed(7)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[LeakReport] = []
    detector = LeakDetector("cpu", on_leak=seen.append)
    handle = detector.hook(opt)
    kept: list[torch.Tensor] = []
    with caplog.at_level(logging.WARNING, logger="vramctl.monitor"):
        for _ in range(40):
            train_step(model, opt, torch.randn(64, 32), torch.randint(0, 10, (64,)))
            kept.append(torch.randn(256, 1024))  # hook-leak
    assert detector.steps == 40
    assert [r.step for r in seen] == [25] and detector.reports == seen
    assert seen[0].suspects[0].site.endswith(f":{line_of('hook-leak')} in {_name()}")
    assert any("memory leak on cpu at step 25" in r.getMessage() for r in caplog.records)
    handle.remove()
    opt.step()
    assert detector.steps == 40


def _name() -> str:
    return "test_hook_runs_after_each_optimizer_step_and_reports_everywhere"


def test_report_is_json_ready_and_readable() -> None:
    kept: list[torch.Tensor] = []
    detector = LeakDetector("cpu")
    report = run(detector, 50, lambda i: kept.append(torch.ones(MiB // 4)))[0]
    data = json.loads(json.dumps(report.to_dict()))
    assert data["step"] == report.step and data["suspects"][0]["shape"] == [262144]
    assert data["signal"] == detector.signal and data["device"] == "cpu"
    text = str(report)
    assert text.startswith("memory leak on cpu at step 25: +1.00 MiB per step")
    assert "held by a list" in text and "likely cause: a list that grows" in text
    assert isinstance(report.suspects[0], LeakSuspect)


def test_signal_says_what_is_read() -> None:
    detector = LeakDetector("cpu")
    assert detector.signal in (
        "malloc in use (glibc mallinfo2)",
        "process RSS (/proc/self/statm)",
        "process RSS (psutil)",
    )
    before = detector.read()
    block = torch.ones(8 * MiB // 4)
    assert detector.read() - before >= 8 * MiB - 64 * 1024
    del block
    assert "signal=" in repr(detector)


# -- the statistics --------------------------------------------------------------------------


def test_mann_kendall_and_theil_sen_on_known_series() -> None:
    rising = list(range(20))
    z, p = mann_kendall(rising)
    assert z == pytest.approx(189 / (20 * 19 * 45 / 18) ** 0.5) and p < 1e-8
    z, p = mann_kendall(rising[::-1])
    assert z < 0 and p > 0.999
    assert theil_sen([3 * i + (100 if i == 7 else 0) for i in range(30)]) == 3.0  # robust
    w = Window(5)
    for y in [10, 20, 30, 40, 50, 60, 70]:  # the window slides: exact slope 10
        w.push(y)
    assert len(w) == 5 and w.ols_slope() == 10.0


def test_a_single_jump_is_not_persistent() -> None:
    jump = [0] * 20 + [50 * MiB] * 20
    t = trend(jump, 256 * 1024)
    assert t.p_value < 1e-3  # the rank test alone would call it a trend
    assert not t.persistent


# -- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"min_rate": 0}, "more than 0 bytes"),
        ({"min_rate": -5}, "min_rate"),
        ({"min_rate": "lots"}, "min_rate"),
        ({"window": 9}, "at least 10 readings"),
        ({"window": 10.5}, "at least 10 readings"),
        ({"confidence": 0.0}, "strictly between 0 and 1"),
        ({"confidence": 1.0}, "strictly between 0 and 1"),
        ({"confidence": 1.5}, "strictly between 0 and 1"),
        ({"warmup": -1}, "0 or more"),
        ({"on_leak": 3}, "function of one LeakReport"),
    ],
)
def test_bad_settings_are_refused_clearly(kwargs: dict[str, object], words: str) -> None:
    with pytest.raises(LeakDetectorError, match=words) as info:
        LeakDetector("cpu", **kwargs)  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError) and isinstance(info.value, VramctlError)


def test_sizes_with_units_are_accepted() -> None:
    assert LeakDetector("cpu", min_rate="1MiB").min_rate == MiB


@pytest.mark.parametrize("device", ["meta", "not-a-device"])
def test_unknown_devices_are_refused(device: str) -> None:
    with pytest.raises(LeakDetectorError, match="use 'cpu'"):
        LeakDetector(device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_cuda_without_cuda_is_refused() -> None:
    with pytest.raises(LeakDetectorError, match="CUDA is not available"):
        LeakDetector("cuda:0")


def test_a_leak_of_sparse_tensors_is_named_with_their_real_size() -> None:
    """A sparse tensor's bytes are in its values and indices, which the census must see."""
    torch.manual_seed(3)
    kept: list[torch.Tensor] = []
    detector = LeakDetector("cpu")

    def body(i: int) -> None:
        idx = torch.randint(0, 4096, (2, 2**15))
        coo = torch.sparse_coo_tensor(idx, torch.randn(2**15), (4096, 4096), check_invariants=True)
        kept.append(coo.coalesce())  # sparse-leak

    reports = run(detector, 60, body)
    assert len(reports) == 1, [r.step for r in reports]
    report = reports[0]
    top = report.suspects[0]
    assert top.site.endswith(f"test_leak.py:{line_of('sparse-leak')} in body"), report.format()
    assert (top.shape, top.dtype, top.holder) == ((4096, 4096), "float32", "list")
    alive = {id(t): t for t in kept}
    sizes = {
        t._values().untyped_storage().nbytes() + t._indices().untyped_storage().nbytes()
        for t in alive.values()
    }
    # Each kept tensor is 2**15 entries less duplicates: 12 bytes (a value, two indices) each.
    assert 2 <= top.count <= 16  # the census records until memory has grown by min_rate
    assert min(sizes) * top.count <= top.nbytes <= max(sizes) * top.count
    assert top.nbytes > top.count * 0.99 * 12 * 2**15


def test_graph_walk_sees_nodes_whose_python_objects_are_made_afresh() -> None:
    """torch (2.11 at least) makes a C++ node's Python object afresh on each read and frees it
    once dropped: a later node's object may get the same id(), yet it is a node not seen."""
    from types import SimpleNamespace

    from vramctl.monitor._census import _graph_storages, _storage_key

    class Node:
        __slots__ = ("_rest", "_saved_x")

        def __init__(self, saved: list[torch.Tensor]) -> None:
            self._saved_x, self._rest = saved[0], saved[1:]

        @property
        def next_functions(self) -> tuple[tuple[Node, int], ...]:
            return ((Node(self._rest), 0),) if self._rest else ()

    saved = [torch.ones(i + 1) for i in range(6)]
    found = _graph_storages([SimpleNamespace(grad_fn=Node(saved))])  # type: ignore[list-item]
    assert [i for i, t in enumerate(saved) if _storage_key(t) in found] == list(range(6))
