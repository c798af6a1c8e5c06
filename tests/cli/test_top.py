"""``vramctl top``: the frame, the command, and the keys in a real pseudo-terminal."""

from __future__ import annotations

import fcntl
import io
import logging
import os
import re
import select
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Iterator, Sequence

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

import vramctl
from tests.fake_nvml import FakeGpu, FakeProcess, GiB
from vramctl.cli._app import app
from vramctl.cli._top import (
    SORT_KEYS,
    SPARK_BLOCKS,
    TopState,
    _logs_as_events,
    sparkline,
    top_view,
)
from vramctl.guard import GuardEvent
from vramctl.monitor import Event, Finding, Level, Monitor, Sample, UsageRule

runner = CliRunner()
MiB = 2**20


def render(monitor: Monitor, **kwargs: object) -> str:
    console = Console(record=True, width=120, file=io.StringIO())
    console.print(top_view(monitor, width=120, **kwargs))  # type: ignore[arg-type]
    return console.export_text()


@pytest.fixture
def sim() -> vramctl.SimulatedDevice:
    return vramctl.simulate("T4-16GB")


@pytest.fixture
def monitor(sim: vramctl.SimulatedDevice) -> Iterator[Monitor]:
    mon = Monitor(["cpu", sim], interval=0.05, rules=[], processes=3)
    yield mon
    mon.stop()


def sample_with(mon: Monitor, sim: vramctl.SimulatedDevice, sizes: Sequence[int]) -> None:
    """One sample per size, with that many bytes held on the simulated GPU."""
    for nbytes in sizes:
        with sim:
            held = torch.empty(nbytes, dtype=torch.uint8)  # counted, never touched
        mon.sample()
        del held


def line_of(text: str, device: str, label: str) -> str:
    """The line labelled ``label`` in ``device``'s block of the devices table."""
    block = text[text.index(device) :]
    return next(line for line in block.splitlines() if label in line)


# -- pieces --------------------------------------------------------------------------------------


def test_sparkline_scales_to_the_values_shown() -> None:
    assert sparkline([0.0, 0.5, 1.0, 0.25]) == "▁▅█▃"
    assert sparkline([0.3, 0.1, 0.2], width=2) == "▁█"  # the newest only
    flat = sparkline([0.4] * 5)
    assert len(set(flat)) == 1 and flat[0] in SPARK_BLOCKS  # no wave drawn from noise
    assert sparkline([vramctl.NA, 0.1, 0.3]) == " ▁█"
    assert sparkline([]) == ""


def test_keys_cycle_the_sort_reverse_pause_and_quit() -> None:
    state = TopState()
    seen = [state.sort]
    for _ in SORT_KEYS:
        assert state.press("s")
        seen.append(state.sort)
    assert seen == ["memory", "pid", "name", "device", "memory"]
    assert state.press("r") and state.reverse
    assert [state.press("p") and state.paused for _ in range(2)] == [True, False]
    assert state.press("x")  # other keys do nothing
    assert not state.press("q")
    assert not TopState().press("\x03")


# -- the frame -----------------------------------------------------------------------------------


def test_frame_shows_devices_bars_sparklines_and_na(
    monitor: Monitor, sim: vramctl.SimulatedDevice
) -> None:
    sample_with(monitor, sim, [0, 512 * MiB, 1024 * MiB, 256 * MiB, 768 * MiB])
    text = render(monitor)
    assert "vramctl top" in text and "sort: memory" in text
    assert "q quit · s sort · r reverse · p pause" in text
    assert "cpu" in text and "sim:T4-16GB" in text
    mem = line_of(text, "sim:T4-16GB", "memory")
    assert "█" in mem and "░" in mem and "768.00 MiB / 14.58 GiB" in mem
    history = line_of(text, "sim:T4-16GB", "history")
    spark = re.search(f"[{SPARK_BLOCKS}]{{5}}", history)
    assert spark is not None and spark.group() == "▁▅█▃▆", history
    assert "peak 1.00 GiB" in history and "(5 samples)" in history
    # Readings a device cannot give are N/A: the CPU has no allocator figures here,
    # the simulated GPU no fragmentation, temperature or power.
    assert "allocated N/A" in line_of(text, "cpu", "process")
    assert "fragmentation N/A" in line_of(text, "sim:T4-16GB", "process")
    assert "temperature N/A" in line_of(text, "sim:T4-16GB", "GPU")
    assert "GPU " not in text[text.index("cpu") : text.index("sim:T4-16GB")]


def test_gpu_readings_and_processes_sorted_by_the_chosen_key(gpus: list[FakeGpu]) -> None:
    gpus[1].processes = [
        FakeProcess(3999917, 1 * GiB),
        FakeProcess(3999931, 5 * GiB),
        FakeProcess(3999923, 3 * GiB),
    ]
    mon = Monitor(["cuda:1"], interval=0.05, rules=[], processes=5)
    mon.sample()

    def pids(text: str) -> list[int]:
        found = re.findall(r"\b(39999\d\d)\b", text)
        return [int(p) for p in found]

    text = render(mon)
    assert "temperature 40 °C" in text and "power 70 W" in text and "utilization 5%" in text
    assert pids(text) == [3999931, 3999923, 3999917]  # memory: the biggest first
    row = next(line for line in text.splitlines() if "3999931" in line)
    assert "5.00 GiB" in row and " 6% " in row  # its share of the 80 GiB device
    assert pids(render(mon, sort="pid")) == [3999917, 3999923, 3999931]
    assert pids(render(mon, sort="pid", reverse=True)) == [3999931, 3999923, 3999917]
    assert pids(render(mon, sort="memory", reverse=True)) == [3999917, 3999923, 3999931]
    assert "sort: pid (reversed)" in render(mon, sort="pid", reverse=True)
    with pytest.raises(vramctl.VramctlError, match="memory, pid, name, device"):
        top_view(mon, sort="size")


class Advice:
    name = "advice"
    for_s = 0.0

    def evaluate(self, sample: Sample, recent: Sequence[Sample]) -> Finding | None:
        if sample.device.startswith("sim"):
            return Finding(Level.WARNING, "something to fix", suggestion="do this about it")
        return None


def test_activity_shows_alerts_with_suggestions_and_guard_events(
    sim: vramctl.SimulatedDevice,
) -> None:
    mon = Monitor(["cpu", sim], interval=0.05, rules=[UsageRule(0.01, 0.02, kind=None), Advice()])
    text = render(mon)
    assert "no alerts or events yet (rules: memory, advice)" in text
    mon.sample()
    guard = GuardEvent("oom", step=7, batch_size=32, pieces=2, piece_limit=16, detail="split")
    mon.events.append(Event("guard", guard.to_dict()))
    mon.events.append(Event("leak", {"device": "cpu", "rate_bytes_per_step": MiB}))
    text = render(mon)
    assert re.search(r"CRITICAL\s+cpu memory: \d+% of memory in use", text), text
    assert "WARNING  sim:T4-16GB advice: something to fix" in text
    assert "→ do this about it" in text
    assert "guard oom" in text and "step 7: batch 32 in 2 pieces · split" in text
    assert "leak  cpu grows 1.00 MiB per step" in text
    assert "2 alerts active" in text
    # The newest first.
    assert text.index("leak") < text.index("guard oom") < text.index("advice:")


def test_library_warnings_show_as_activity_not_across_the_screen(
    monitor: Monitor, capsys: pytest.CaptureFixture[str]
) -> None:
    with _logs_as_events(monitor):
        logging.getLogger("vramctl.monitor").warning("a reading failed on %s", "cpu")
    logging.getLogger("vramctl.monitor").warning("after the view")
    assert "WARNING  a reading failed on cpu" in render(monitor)
    assert "after the view" not in render(monitor)
    assert "a reading failed" not in capsys.readouterr().err


# -- the command -----------------------------------------------------------------------------------


def test_top_once_prints_one_frame_of_both_devices() -> None:
    result = runner.invoke(
        app, ["top", "--once", "--device", "cpu", "--device", "sim:T4-16GB", "--interval", "0.05"]
    )
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "cpu" in out and "sim:T4-16GB" in out and "(2 samples)" in out
    assert "q quit" not in out  # no keys in a single frame


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--interval", "0"], "--interval 0: give a positive number of seconds"),
        (["--interval", "-1"], "--interval -1"),
        (["--device", "nope"], "unknown device 'nope'"),
        (["--sort", "size"], "--sort 'size'"),
    ],
)
def test_bad_input_is_one_line_without_traceback(args: list[str], needle: str) -> None:
    result = runner.invoke(app, ["top", "--once", *args])
    assert result.exit_code == 2
    assert needle in result.stderr
    assert result.stderr.startswith("error:") and result.stderr.count("\n") <= 2
    assert "Traceback" not in result.output + result.stderr


# -- a real terminal -------------------------------------------------------------------------------

ANSI = re.compile(r"\x1b(\[[0-?]*[ -/]*[@-~]|\][^\x07]*\x07|[()][0-9A-Za-z]|[=>78])")


class Terminal:
    """A pseudo-terminal whose output is read (and kept, escapes removed) as it comes."""

    def __init__(self, cols: int = 120, rows: int = 40) -> None:
        self.master, self.slave = os.openpty()
        fcntl.ioctl(self.slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        self.text = ""

    def read_until(self, needle: str, proc: subprocess.Popen[bytes], timeout: float) -> bool:
        start = len(self.text)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if needle in self.text[start:]:
                return True
            ready, _, _ = select.select([self.master], [], [], 0.1)
            if ready:
                try:
                    chunk = os.read(self.master, 65536)
                except OSError:  # the child closed the terminal
                    break
                self.text += ANSI.sub("", chunk.decode(errors="replace"))
            elif proc.poll() is not None:
                break
        return needle in self.text[start:]

    def close(self) -> None:
        os.close(self.master)
        os.close(self.slave)


@pytest.mark.skipif(sys.platform == "win32", reason="needs a POSIX pseudo-terminal")
def test_keys_in_a_real_terminal_change_the_sort_and_quit() -> None:
    term = Terminal()
    before = termios.tcgetattr(term.slave)
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "120", "LINES": "40"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "vramctl", "top", "--interval", "0.2", "--device", "cpu"],
        stdin=term.slave,
        stdout=term.slave,
        stderr=term.slave,
        env=env,
        start_new_session=True,
    )
    try:
        assert term.read_until("sort: memory", proc, 30), term.text[-2000:]
        assert "q quit · s sort" in term.text
        # In cbreak mode: no echo, and keys arrive without Enter.
        assert not termios.tcgetattr(term.slave)[3] & (termios.ICANON | termios.ECHO)
        os.write(term.master, b"s")
        assert term.read_until("sort: pid", proc, 5), term.text[-2000:]
        os.write(term.master, b"r")
        assert term.read_until("sort: pid (reversed)", proc, 5), term.text[-2000:]
        os.write(term.master, b"p")
        assert term.read_until("PAUSED", proc, 5), term.text[-2000:]
        os.write(term.master, b"q")
        term.read_until("\0never", proc, 5)  # drain the output while it exits
        assert proc.wait(timeout=5) == 0
        assert termios.tcgetattr(term.slave) == before  # the terminal's settings are back
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        term.close()


@pytest.mark.parametrize("encoding", ["ascii", "latin-1"])
def test_frame_prints_on_a_console_that_cannot_write_unicode(
    monitor: Monitor, sim: vramctl.SimulatedDevice, encoding: str
) -> None:
    sample_with(monitor, sim, [1 * GiB, 2 * GiB, 3 * GiB])
    raw = io.BytesIO()
    out = io.TextIOWrapper(raw, encoding=encoding, errors="strict", write_through=True)
    console = Console(file=out, width=80, force_terminal=False)
    console.print(top_view(monitor, width=80))  # raised UnicodeEncodeError
    text = raw.getvalue().decode(encoding)
    assert "sim:T4-16GB" in text and "memory" in text and "#" in text


def test_once_in_a_narrow_non_utf8_pipe() -> None:
    env = {**os.environ, "COLUMNS": "40", "PYTHONIOENCODING": "ascii", "LANG": "C"}
    proc = subprocess.run(
        [sys.executable, "-m", "vramctl", "top", "--once", "-i", "0.01", "-d", "cpu", "-p", "1"],
        capture_output=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")[-2000:]
    assert b"cpu" in proc.stdout and proc.stdout.isascii()


def test_status_view_prints_on_an_ascii_console(gpus: list[FakeGpu]) -> None:
    from vramctl.cli._render import snapshot, status_view

    raw = io.BytesIO()
    out = io.TextIOWrapper(raw, encoding="ascii", errors="strict", write_through=True)
    Console(file=out, width=100).print(status_view(snapshot(vramctl.devices(), 2)))
    assert "cuda:0" in raw.getvalue().decode("ascii")
