"""`vramctl monitor`: samples, alerts, exports, Prometheus, and bad input."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.fake_nvml import FakeGpu
from vramctl.cli._app import app

runner = CliRunner()


def test_json_lines_samples_and_alerts(tmp_path: Path) -> None:
    jsonl = tmp_path / "mem.jsonl"
    plot = tmp_path / "mem.html"
    result = runner.invoke(
        app,
        [
            "monitor",
            "-d",
            "cpu",
            "-d",
            "sim:T4-16GB",
            "-i",
            "0.05",
            "-n",
            "3",
            "--json",
            "--host-warning",
            "0.001",
            "--host-critical",
            "0.002",
            "--jsonl",
            str(jsonl),
            "--plot",
            str(plot),
        ],
    )
    assert result.exit_code == 0, result.output
    docs = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    samples = [d for d in docs if d["kind"] == "sample"]
    alerts = [d for d in docs if d["kind"] == "alert"]
    assert len(samples) >= 3
    assert [s["device"] for s in samples[0]["samples"]] == ["cpu", "sim:T4-16GB"]
    assert alerts and alerts[0]["rule"] == "host_memory" and alerts[0]["level"] == "critical"
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert len(rows) == 2 * len(samples)
    assert "uPlot" in plot.read_text()


def test_png_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="PNG plots need matplotlib: the [plot] extra")
    plot = tmp_path / "mem.png"
    args = ["monitor", "-d", "sim:T4-16GB", "-i", "0.05", "-n", "2", "--plot", str(plot)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert plot.stat().st_size > 1000 and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_human_output_has_lines_alerts_and_peaks(gpus: list[FakeGpu]) -> None:
    gpus[0].used = int(gpus[0].total * 0.9)
    result = runner.invoke(app, ["monitor", "-d", "0", "-i", "0.05", "-n", "2"])
    assert result.exit_code == 0, result.output
    assert "cuda:0" in result.stdout
    assert "peaks while monitoring" in result.stdout
    assert "warning" in result.stderr and "90% of memory in use" in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-i", "0"], "interval"),
        (["-i", "-2"], "interval"),
        (["--gpu-warning", "80"], "between 0 and 1"),
        (["--host-critical", "1.5"], "between 0 and 1"),
        (["--jsonl", "/nonexistent-dir/x.jsonl"], "cannot write the history"),
        (["--plot", "mem.txt"], ".html or .png"),
        (["--plot", "/nonexistent-dir/mem.html"], "does not exist"),
        (["--prometheus", "0.0.0.0:0"], "give a token"),
        (["--prometheus", "nine"], "not an address"),
        (["--duration", "0"], "positive number of seconds"),
        (["-d", "cuda:9"], "unknown device"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    args: list[str], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VRAMCTL_TOKEN", raising=False)
    result = runner.invoke(app, ["monitor", "-n", "1", *args])
    assert result.exit_code == 2, result.output
    assert message in result.stderr
    assert "Traceback" not in result.output


def test_a_port_in_use_is_a_clear_error() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        result = runner.invoke(app, ["monitor", "-n", "1", "--prometheus", f":{port}"])
    assert result.exit_code == 2
    assert f"port {port} on 127.0.0.1 is already in use" in result.stderr


def test_prometheus_endpoint_of_a_running_command() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vramctl",
            "monitor",
            "-d",
            "cpu",
            "-i",
            "0.2",
            "--quiet",
            "--duration",
            "20",
            "--prometheus",
            f":{port}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        body = ""
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read()
                body = body.decode()
                if "vramctl_memory_used_bytes" in body:
                    break
            except OSError:
                time.sleep(0.2)
        assert 'vramctl_memory_used_bytes{device="cpu",uuid=""}' in body
        assert "vramctl_monitor_samples_total" in body
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.skipif(os.name != "posix", reason="SIGTERM as a signal is POSIX")
def test_sigterm_stops_monitor_as_ctrl_c_does(tmp_path: Path) -> None:
    plot = tmp_path / "memory.html"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "vramctl", "monitor", "-d", "cpu", "-i", "0.2", "--json"),
            *("--duration", "120", "--plot", str(plot)),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        assert json.loads(proc.stdout.readline())  # started and sampling
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr
    assert plot.exists() and "plot written to" in stderr
