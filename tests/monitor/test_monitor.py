"""The sampler: a real daemon thread over real devices (the CPU, simulated GPUs, NVML fakes)."""

from __future__ import annotations

import itertools
import json
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import vramctl
from tests.fake_nvml import FakeGpu
from vramctl.monitor import (
    Event,
    ExportError,
    Monitor,
    MonitorError,
    Sample,
    Shrink,
    UsageRule,
    load_jsonl,
)

MiB = 2**20


@pytest.mark.parametrize("interval", [0, -1, 0.0])
def test_interval_must_be_positive(interval: float) -> None:
    with pytest.raises(MonitorError, match="positive number of seconds"):
        Monitor(["cpu"], interval=interval)


def test_no_devices_is_an_error() -> None:
    with pytest.raises(MonitorError, match="at least one device"):
        Monitor([], interval=1)


def test_unknown_device_is_a_clear_error() -> None:
    with pytest.raises(vramctl.UnknownDeviceError, match="cuda:7"):
        Monitor(["cuda:7"])


def test_samples_on_a_daemon_thread_at_the_interval() -> None:
    mon = Monitor(["cpu"], interval=0.05, rules=[])
    with mon:
        assert mon.running
        assert mon._thread is not None and mon._thread.daemon
        time.sleep(0.5)
    assert not mon.running
    n = mon.samples_taken
    # About 10 samples in 0.5 s; a loaded 2-core machine may drop a few.
    assert 5 <= n <= 12, n
    stamps = [s.timestamp for s in mon.history.samples("cpu")]
    assert stamps == sorted(stamps)
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    assert 0.03 < sorted(gaps)[len(gaps) // 2] < 0.1
    # Stopped means stopped.
    time.sleep(0.15)
    assert mon.samples_taken == n


def test_start_twice_and_stop_without_start_are_harmless() -> None:
    mon = Monitor(["cpu"], interval=0.05, rules=[])
    mon.stop()
    mon.start()
    first = mon._thread
    mon.start()
    assert mon._thread is first
    mon.stop()
    assert not mon.running


def test_history_is_a_bounded_ring_buffer_and_peaks_outlive_it() -> None:
    sim = vramctl.simulate("T4-16GB")
    mon = Monitor([sim], interval=1.0, history=3, rules=[])
    with sim:
        big = torch.empty(64 * MiB, dtype=torch.uint8)
        mon.sample()
        del big
        for _ in range(4):
            mon.sample()
    kept = mon.history.samples(sim.id)
    assert len(kept) == 3
    assert all(s.memory.used == 0 for s in kept)
    # The 64 MiB moment has left the buffer; the peak keeps it.
    assert mon.history.peak(sim.id).used == 64 * MiB
    assert mon.history.peak(sim.id).allocated == 64 * MiB


def test_cpu_is_sampled_like_a_gpu() -> None:
    mon = Monitor(["cpu"], interval=1.0, rules=[], processes=3)
    (s,) = mon.sample()
    mem = s.memory
    assert mem.total > 0 and mem.used > 0 and mem.free > 0
    assert mem.process_used > 0  # this process's RSS
    assert 0 < mem.utilization < 1
    assert len(s.processes) == 3
    assert s.processes[0].used >= s.processes[-1].used


def test_fake_gpus_are_sampled_through_nvml(gpus: list[FakeGpu]) -> None:
    gpus[1].used = 30 * 2**30
    mon = Monitor(interval=1.0, rules=[])
    assert [d.id for d in mon.devices] == ["cuda:0", "cuda:1", "cuda:2", "cpu"]
    samples = {s.device: s for s in mon.sample()}
    assert samples["cuda:1"].memory.used == 30 * 2**30
    assert samples["cuda:1"].memory.total == gpus[1].total
    assert samples["cuda:0"].memory.temperature_c == 40


def test_gpu_alert_fires_from_nvml_readings(gpus: list[FakeGpu]) -> None:
    got: list[object] = []
    mon = Monitor(["cuda:0"], interval=1.0, rules=[UsageRule(0.8, 0.95)], on_alert=got.append)
    gpus[0].used = int(gpus[0].total * 0.5)
    mon.sample()
    assert got == []
    gpus[0].used = int(gpus[0].total * 0.85)
    mon.sample()
    gpus[0].used = int(gpus[0].total * 0.97)
    mon.sample()
    levels = [a.level.name for a in got]  # type: ignore[attr-defined]
    assert levels == ["WARNING", "CRITICAL"]


def test_subscribers_get_samples_and_a_failing_one_does_not_stop_sampling() -> None:
    seen: list[Event] = []

    def broken(event: Event) -> None:
        raise RuntimeError("boom")

    mon = Monitor(["cpu"], interval=0.05, rules=[])
    mon.subscribe(broken)
    remove = mon.subscribe(seen.append)
    with mon:
        time.sleep(0.3)
    assert mon.samples_taken >= 3
    assert [e.kind for e in seen][:3] == ["sample"] * 3
    assert seen[0].data["samples"][0]["device"] == "cpu"
    remove()
    before = len(seen)
    mon.sample()
    assert len(seen) == before


def test_guard_events_reach_the_monitor_and_an_alert_can_shrink_the_guard() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = vramctl.Guard(
        model,
        opt,
        forward=lambda m, b: m(b[0]),
        loss_fn=lambda out, b: nn.functional.mse_loss(out, b[1]),
    )
    batch = (torch.randn(64, 32), torch.randn(64, 1))
    guard.step(batch)
    assert guard.piece_limit is None

    sim = vramctl.simulate("T4-16GB")
    mon = Monitor([sim], interval=1.0, rules=[UsageRule(0.5, 0.9, kind="gpu")])
    shrink = Shrink(guard)
    mon.on_alert(shrink, level="warning")
    mon.start()
    try:
        with sim:
            ballast = torch.empty(int(sim.total_bytes * 0.6), dtype=torch.uint8)
            mon.sample()
            del ballast
    finally:
        mon.stop()
    assert shrink.calls == 1
    assert guard.piece_limit == 32
    guard_events = [e for e in mon.events if e.kind == "guard"]
    assert [e.data["event"] for e in guard_events] == ["shrink"]
    # The next step runs in two pieces and gives the same update as a whole one would.
    result = guard.step(batch)
    assert result.pieces == 2


def test_shrink_needs_something_that_shrinks() -> None:
    with pytest.raises(vramctl.VramctlError, match="no shrink"):
        Shrink(object())  # type: ignore[arg-type]


def test_adaptive_batcher_shrinks_on_request() -> None:
    data = list(range(1000))
    batcher = vramctl.AdaptiveBatcher(
        data, per_sample_bytes=1024, budget=64 * 1024, device="cpu", shuffle=False
    )
    it = iter(batcher)
    first = len(next(it))
    Shrink(batcher, factor=0.5)(
        vramctl.monitor.Alert("memory", vramctl.monitor.Level.WARNING, "cpu", "high")
    )
    assert len(next(it)) <= first // 2


def test_export_jsonl_round_trip_and_html_plot(tmp_path: Path) -> None:
    sim = vramctl.simulate("T4-16GB")
    mon = Monitor(["cpu", sim], interval=1.0, rules=[])
    for _ in range(3):
        mon.sample()
    path = mon.export(tmp_path / "mem.jsonl")
    lines = path.read_text().splitlines()
    assert len(lines) == 6
    assert json.loads(lines[0])["schema"] == "vramctl.sample/1"
    back = load_jsonl(path)
    assert sorted(back.devices) == ["cpu", "sim:T4-16GB"]
    orig = mon.history.samples("cpu")[-1]
    again = back.samples("cpu")[-1]
    assert again.memory == orig.memory
    assert again.processes == orig.processes

    page = mon.export(tmp_path / "mem.html").read_text()
    assert "uPlot" in page and "sim:T4-16GB" in page
    # Self-contained: no script or stylesheet from elsewhere.
    assert "<script src" not in page and "<link" not in page


def test_export_to_an_unwritable_path_is_a_clear_error(tmp_path: Path) -> None:
    mon = Monitor(["cpu"], interval=1.0, rules=[])
    mon.sample()
    with pytest.raises(ExportError, match="cannot write the history"):
        mon.export(tmp_path / "missing" / "mem.jsonl")
    with pytest.raises(ExportError, match="cannot write the plot"):
        mon.export(tmp_path / "missing" / "mem.html")


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_png_plot_is_an_image_with_a_panel_per_device(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="PNG plots need matplotlib: the [plot] extra")
    import matplotlib.image
    import numpy as np

    sim = vramctl.simulate("T4-16GB")
    mon = Monitor(["cpu", sim], interval=1.0, rules=[])
    for _ in range(3):
        mon.sample()
    path = mon.export(tmp_path / "mem.png")
    data = path.read_bytes()
    assert len(data) > 1000 and data[:8] == PNG_SIGNATURE
    image = matplotlib.image.imread(path)  # decodes the whole file
    height, width, channels = image.shape
    assert channels in (3, 4) and width >= 500
    assert height * 10 == width * 6  # two panels of 10 x 3 inches
    rgb = (image[..., :3] * 255).round().astype(int).reshape(-1, 3)
    assert len(np.unique(rgb, axis=0)) > 10  # not blank: text, axes and lines
    first_series = np.array([0x1F, 0x77, 0xB4])  # matplotlib's first colour (C0)
    # The line is drawn (its length follows the samples' values, which a loaded machine
    # moves: 100 pixels were seen on one, thousands on a quiet one; a blank panel has 0).
    assert (np.abs(rgb - first_series).sum(axis=1) <= 6).sum() > 50

    one = Monitor(["cpu"], interval=1.0, rules=[])
    one.sample()
    h, w, _ = matplotlib.image.imread(one.export(tmp_path / "one.png")).shape
    assert h * 10 == w * 3  # one panel


def test_png_plot_names_its_extra_when_matplotlib_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import vramctl._optional as optional

    monkeypatch.setattr(optional, "find_spec", lambda name: None)
    mon = Monitor(["cpu"], interval=1.0, rules=[])
    mon.sample()
    with pytest.raises(ExportError, match=r"vramctl\[plot\]"):
        mon.export(tmp_path / "mem.png")
    assert not (tmp_path / "mem.png").exists()


def test_load_jsonl_names_the_bad_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps(Sample("cpu", vramctl.get_device("cpu").memory()).to_dict()) + "\n{not json\n"
    )
    with pytest.raises(ExportError, match=r"bad.jsonl:2"):
        load_jsonl(bad)


def test_sampling_from_several_threads_is_safe() -> None:
    mon = Monitor(["cpu"], interval=0.02, history=10_000, rules=[])
    with mon:
        workers = [
            threading.Thread(target=lambda: [mon.sample() for _ in range(20)]) for _ in range(3)
        ]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    assert len(mon.history) == mon.samples_taken


def test_step_finds_a_leak_and_raises_an_alert_naming_the_line() -> None:
    mon = Monitor(["cpu"], rules=[])
    alerts: list[vramctl.monitor.Alert] = []
    mon.on_alert(alerts.append, level="error")
    kept = []
    report = None
    for _ in range(50):
        kept.append(torch.randn(256, 1024))  # the leak: 1 MiB kept every step
        report = mon.step()
        if report is not None:
            break
    assert report is not None and report.step <= 50
    assert [a.rule for a in alerts] == ["leak"]
    assert alerts[0].device == "cpu"
    assert "test_monitor.py" in alerts[0].suggestion
    assert [e.kind for e in mon.events].count("leak") == 1


def test_step_stays_quiet_on_a_healthy_loop() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = Monitor(["cpu"], rules=[])
    losses = []
    for _ in range(80):
        loss = nn.functional.cross_entropy(model(torch.randn(32, 64)), torch.randint(0, 10, (32,)))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        assert mon.step() is None
    assert not [e for e in mon.events if e.kind == "leak"]


# A process whose address space ends 3 MiB past what it has mapped: the leak detector's
# 4 MiB probe tensor cannot be allocated, for real (the kernel refuses the mapping).
_TIGHT_PROCESS = """
import ctypes, json, resource
# glibc's mmap threshold fixed (M_MMAP_THRESHOLD, which a large free otherwise raises): a
# 4 MiB block is a mapping of its own, never free heap already mapped.
ctypes.CDLL(None).mallopt(-3, 128 * 1024)
import torch
from torch import nn
from vramctl.monitor import Monitor

mon = Monitor(["cpu"], rules=[])
model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(16, 64)
def train():
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
train()
with open("/proc/self/statm") as f:
    mapped = int(f.read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (mapped + 3 * 2**20, resource.RLIM_INFINITY))
reports = []
for _ in range(8):
    train()
    reports.append(mon.step())
resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
print(json.dumps({"reports": [r is not None for r in reports], "leak": mon.summary()["leak"]}))
"""


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux's /proc")
def test_step_goes_on_where_the_heap_probe_cannot_be_allocated() -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _TIGHT_PROCESS], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.splitlines()[-1])
    assert got["reports"] == [False] * 8
    leak = got["leak"]
    assert leak["steps"] == 8 and leak["device"] == "cpu"
    assert leak["signal"].startswith("process RSS")
    assert "4 MiB probe tensor could not be allocated" in leak["signal_note"]
    assert "can't allocate memory" in leak["signal_note"]


# The probe's allocation refused with PyTorch's out-of-memory error, in a process of its own:
# its heap is fresh, so a leak shows in its RSS (a long-lived process reuses freed heap
# first, and its RSS lags), and the patch of torch.empty ends with it.
_PROBE_REFUSED = """
import json
import torch
from vramctl.monitor import Monitor, _heap

real_empty = torch.empty
probes = []

def tight_empty(*size, **kw):
    if size == (_heap.PROBE_BYTES,) and kw.get("dtype") is torch.uint8:
        probes.append(1)
        raise torch.OutOfMemoryError("CPU out of memory: tried to allocate 4.00 MiB")
    return real_empty(*size, **kw)

torch.empty = tight_empty
mon = Monitor(["cpu"], rules=[])
kept = []
report = None
for _ in range(80):
    kept.append(torch.randn(512, 1024))  # the leak: 2 MiB kept (and written) every step
    report = mon.step()
    if report is not None:
        break
refused = len(probes)
leak = mon.summary()["leak"]
# A failed probe is not kept: the next detector probes again, and may read the heap.
torch.empty = real_empty
again = Monitor(["cpu"], rules=[])
again.step()
print(json.dumps({
    "refused": refused,
    "probes": len(probes),
    "rate": None if report is None else report.rate_bytes_per_step,
    "report_signal": None if report is None else report.signal,
    "leak": leak,
    "again": again.summary()["leak"],
    "malloc_readable": _heap._malloc_reader() is not None,
}))
"""


def test_a_heap_probe_out_of_memory_is_reported_and_leaks_are_still_found() -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _PROBE_REFUSED], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.splitlines()[-1])
    assert got["refused"] == 1
    # Read from RSS, the leak is still found.
    assert got["rate"] is not None and got["rate"] >= 1 * MiB, got
    leak = got["leak"]
    assert leak["signal"].startswith("process RSS") and leak["signal"] == got["report_signal"]
    assert leak["signal_note"].startswith("glibc's malloc counters unchecked: their 4 MiB probe")
    assert "OutOfMemoryError: CPU out of memory" in leak["signal_note"]
    assert got["probes"] == 1  # the next detector's probe was not refused (torch.empty back)
    note = got["again"]["signal_note"]
    if got["malloc_readable"] and note is None:
        assert got["again"]["signal"] == "malloc in use (glibc mallinfo2)"
    else:
        assert "probe tensor could not be allocated" not in (note or "")


def test_an_alert_callback_may_sample_again_without_deadlock() -> None:
    # An action that frees memory, then reads the devices again to see the effect.
    gpu = vramctl.simulate("T4-16GB")
    mon = Monitor([gpu], rules=[UsageRule(0.5, 0.9)])
    seen: list[str] = []

    def act(alert: object) -> None:
        seen.append(str(alert))
        mon.sample()
        mon.history.latest(gpu.id)

    mon.on_alert(act)
    mon.subscribe(lambda e: mon.summary() if e.kind == "alert" else None)
    done = threading.Event()

    def work() -> None:
        with gpu:
            ballast = torch.empty(int(gpu.total_bytes * 0.6), dtype=torch.uint8)
            mon.sample()
            del ballast
        done.set()

    threading.Thread(target=work, daemon=True).start()
    assert done.wait(10), "sample() deadlocked in an alert callback that samples"
    assert len(seen) == 1 and "[warning]" in seen[0]
    assert mon.samples_taken == 2


def test_stop_from_a_subscriber_then_start_leaves_one_sampling_thread() -> None:
    mon = Monitor(["cpu"], interval=0.02, rules=[])
    stopped = threading.Event()
    release = threading.Event()

    def sub(event: Event) -> None:
        if event.kind == "sample" and not stopped.is_set():
            mon.stop()  # on the sampling thread: it cannot join itself
            stopped.set()
            release.wait(5)  # still busy when start() comes

    mon.subscribe(sub)
    mon.start()
    assert stopped.wait(5)
    mon.start()
    release.set()
    time.sleep(0.3)
    threads = [t for t in threading.enumerate() if t.name == "vramctl-monitor"]
    try:
        assert len(threads) == 1, threads
    finally:
        mon.stop()
    for t in threads:
        t.join(5)
    assert not any(t.is_alive() for t in threads)


@pytest.mark.parametrize("name", ["mem.csv", "mem.txt", "mem.json", "mem"])
def test_export_to_an_unknown_kind_of_file_is_an_error(tmp_path: Path, name: str) -> None:
    mon = Monitor(["cpu"], rules=[])
    mon.sample()
    with pytest.raises(ExportError, match=r"\.jsonl.*\.html or \.png"):
        mon.export(tmp_path / name)
    assert not (tmp_path / name).exists()
    assert len(load_jsonl(mon.export(tmp_path / "mem.ndjson"))) == 1
