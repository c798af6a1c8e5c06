from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from typing import Any

import psutil
import pytest
import typer.main
from typer.testing import CliRunner

import vramctl
from tests.fake_nvml import FakeGpu, FakeProcess, GiB
from vramctl.cli._app import app
from vramctl.device._host import cgroup_memory

runner = CliRunner()

MEMORY_KEYS = {
    "device",
    "total",
    "used",
    "free",
    "process_used",
    "allocated",
    "reserved",
    "peak_allocated",
    "peak_reserved",
    "inactive_split",
    "alloc_retries",
    "ooms",
    "temperature_c",
    "power_w",
    "compute_utilization",
    "timestamp",
    "utilization",
    "fragmentation",
}
DEVICE_KEYS = {
    "id",
    "kind",
    "index",
    "name",
    "uuid",
    "compute_capability",
    "features",
    "catalog",
    "health",
    "memory",
    "processes",
}
PROCESS_KEYS = {"pid", "used", "name", "user", "command", "kind"}


def check_status_schema(doc: dict) -> None:
    assert doc["schema"] == "vramctl.status/1"
    assert doc["version"] == vramctl.__version__
    assert isinstance(doc["timestamp"], float)
    for dev in doc["devices"]:
        assert set(dev) == DEVICE_KEYS
        assert set(dev["memory"]) == MEMORY_KEYS
        assert set(dev["health"]) == {"state", "reason", "consecutive_failures"}
        assert dev["health"]["state"] in {"available", "busy", "error", "disabled"}
        for proc in dev["processes"]:
            assert set(proc) == PROCESS_KEYS


def test_status_json_lists_the_cpu_with_the_hosts_memory() -> None:
    result = runner.invoke(app, ["status", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    check_status_schema(doc)
    cpu = doc["devices"][-1]
    assert cpu["id"] == "cpu" and cpu["kind"] == "cpu"
    limit = cgroup_memory().limit
    host = psutil.virtual_memory().total
    assert cpu["memory"]["total"] == (min(host, limit) if limit else host)
    assert cpu["memory"]["allocated"] is None  # not available, not zero
    assert 0 < len(cpu["processes"]) <= 5


def test_status_json_with_gpus_and_processes(gpus: list[FakeGpu]) -> None:
    gpus[1].processes = [FakeProcess(os.getpid(), 2 * GiB)]
    result = runner.invoke(app, ["status", "--json", "--processes", "3"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    check_status_schema(doc)
    ids = [d["id"] for d in doc["devices"]]
    assert ids == ["cuda:0", "cuda:1", "cuda:2", "cpu"]
    a100 = doc["devices"][0]
    assert a100["catalog"] == "A100-80GB" and a100["compute_capability"] == "8.0"
    assert a100["features"]["bf16"] is True and a100["features"]["fp8"] is False
    assert a100["memory"]["used"] == 20 * GiB and a100["memory"]["temperature_c"] == 40.0
    assert a100["processes"][0]["pid"] == 4242
    assert doc["devices"][1]["processes"][0]["used"] == 2 * GiB


def test_status_table_shows_each_device_and_processes(gpus: list[FakeGpu]) -> None:
    result = runner.invoke(app, ["status"], env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    out = result.stdout
    for text in (
        "cuda:0",
        "NVIDIA A100-SXM4-80GB",
        "cuda:2",
        "Tesla T4",
        "cpu",
        "4242",
        "20.00 GiB / 80.00 GiB used",
        "fragmentation",
        "7.5 (Turing)",
    ):
        assert text in out, text


def test_status_only_some_devices() -> None:
    result = runner.invoke(app, ["status", "--json", "-d", "cpu"])
    assert [d["id"] for d in json.loads(result.stdout)["devices"]] == ["cpu"]


def test_status_watch_json_prints_one_line_per_reading() -> None:
    result = runner.invoke(app, ["status", "--json", "--watch", "0.05", "--count", "3"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 3
    stamps = [json.loads(line)["timestamp"] for line in lines]
    assert stamps == sorted(stamps) and len(set(stamps)) == 3


def test_status_watch_live_view_stops_after_count() -> None:
    result = runner.invoke(app, ["status", "--watch", "0.05", "--count", "2"])
    assert result.exit_code == 0, result.output
    assert "cpu" in result.stdout


def test_devices_select_says_which_and_why(gpus: list[FakeGpu]) -> None:
    result = runner.invoke(app, ["devices", "--select", "8GiB", "--policy", "best-fit"])
    assert result.exit_code == 0, result.output
    assert "cuda:2" in result.stdout and "why: best-fit" in result.stdout
    result = runner.invoke(app, ["devices", "--select", "500GiB", "--json"])
    doc = json.loads(result.stdout)
    assert doc["schema"] == "vramctl.selection/1"
    assert doc["device"]["id"] == "cpu" and doc["fell_back_to_cpu"] is True
    assert "no GPU fits" in doc["reason"]


def test_devices_select_with_room_nowhere_exits_1_with_every_verdict(
    gpus: list[FakeGpu],
) -> None:
    result = runner.invoke(app, ["devices", "--select", "99999999TiB"], env={"COLUMNS": "200"})
    assert result.exit_code == 1, result.output
    assert "no device has room for" in result.stdout
    rows = [line for line in result.stdout.splitlines() if "needs" in line]
    for dev in ("cuda:0", "cuda:1", "cuda:2", "cpu"):
        assert any(re.search(rf"(?<![\w:]){dev}(?![\w:])", row) for row in rows), result.stdout
    result = runner.invoke(app, ["devices", "--select", "99999999TiB", "--json"])
    assert result.exit_code == 1, result.output
    doc = json.loads(result.stdout)
    assert doc["fits"] is False and doc["device"]["id"] == "cpu"
    verdicts = [*doc["considered"], doc["fallback"]]
    assert [v["device"] for v in verdicts] == ["cuda:0", "cuda:1", "cuda:2", "cpu"]
    assert not any(v["fits"] for v in verdicts)
    assert all("needs" in v["reason"] for v in verdicts)


def test_devices_select_without_a_gpu_exits_1_when_the_cpu_has_no_room() -> None:
    result = runner.invoke(app, ["devices", "--select", "99999999TiB", "--json"])
    assert result.exit_code == 1, result.output
    doc = json.loads(result.stdout)
    assert doc["fits"] is False and doc["fallback"]["device"] == "cpu"
    assert "needs" in doc["fallback"]["reason"]
    result = runner.invoke(app, ["devices", "--select", "1MiB", "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout)["fits"] is True


def test_devices_list_json(gpus: list[FakeGpu]) -> None:
    doc = json.loads(runner.invoke(app, ["devices", "--json"]).stdout)
    assert [d["id"] for d in doc["devices"]] == ["cuda:0", "cuda:1", "cuda:2", "cpu"]
    assert doc["devices"][2]["memory"]["total"] == gpus[2].total


def test_catalog_json_lists_the_simulated_gpus() -> None:
    doc = json.loads(runner.invoke(app, ["catalog", "--json"]).stdout)
    t4 = next(g for g in doc["gpus"] if g["name"] == "T4-16GB")
    assert t4["total_mib"] == 15360 and t4["compute_capability"] == "7.5"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["devices", "--select", "12 gigs"], "invalid size '12 gigs'"),
        (["devices", "--select", "-3GiB"], "cannot be negative"),
        (["devices", "--select", "1e400"], "invalid size '1e400'"),
        (["estimate", "lstm", "--device", "-3GiB"], "invalid size '-3GiB': a size cannot be"),
        (["estimate", "lstm", "--device", "sim:-3GiB"], "cannot be negative"),
        (["devices", "--select", "1GiB", "--policy", "random"], "unknown policy 'random'"),
        (["status", "--device", "cuda:7"], "unknown device 'cuda:7'"),
        (["status", "--watch", "0"], "--watch 0"),
    ],
)
def test_bad_input_is_one_line_without_traceback(args: list[str], needle: str) -> None:
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert needle in result.stderr
    assert "Traceback" not in result.output + result.stderr
    assert result.stderr.startswith("error:")


def test_help_explains_each_command() -> None:
    out = runner.invoke(app, ["--help"]).stdout
    for cmd in ("status", "devices", "catalog"):
        assert cmd in out
    status_help = runner.invoke(app, ["status", "--help"], env={"COLUMNS": "200"}).stdout
    assert "--watch" in status_help and "--json" in status_help and "N/A" in status_help
    assert "--policy" in runner.invoke(app, ["devices", "--help"]).stdout


def _commands() -> list[list[str]]:
    """``[]`` (vramctl itself), every command, and every command of a group."""
    group: Any = typer.main.get_command(app)
    out: list[list[str]] = [[]]
    for name in sorted(group.commands):
        out.append([name])
        inner = getattr(group.commands[name], "commands", {})
        out += [[name, sub] for sub in sorted(inner)]
    return out


@pytest.mark.parametrize("command", _commands(), ids=lambda c: " ".join(c) or "vramctl")
def test_help_reads_whole_at_80_columns(command: list[str]) -> None:
    result = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    text = result.stdout
    cmd: Any = typer.main.get_command(app)
    for name in command:
        cmd = cmd.commands[name]
    names = [n for p in cmd.params if not getattr(p, "hidden", False) for n in p.opts]
    names += [n for p in cmd.params for n in getattr(p, "secondary_opts", [])]
    assert "--help" in text
    assert names or getattr(cmd, "commands", None)  # a group may have only commands
    for name in names:
        if name.startswith("-"):  # an option: its whole name, not a cut one
            assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text), (name, text)
    assert "<bool>" not in text and "…" not in text
    widest = max(text.splitlines(), key=len)
    assert len(widest) <= 80, widest


def test_the_installed_command_runs() -> None:
    for cmd in (["vramctl"], [sys.executable, "-m", "vramctl"]):
        version = subprocess.run([*cmd, "--version"], capture_output=True, text=True, timeout=60)
        assert (
            version.returncode == 0 and version.stdout.strip() == f"vramctl {vramctl.__version__}"
        )
    bad = subprocess.run(
        ["vramctl", "devices", "--select", "12 gigs"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "12 gigs" in bad.stderr


def test_estimate_json_table_and_max_batch() -> None:
    import json as _json

    from typer.testing import CliRunner

    from vramctl.cli._app import app

    r = CliRunner().invoke(
        app,
        [
            "estimate",
            "lstm",
            "--batch",
            "1,4",
            "--seq-len",
            "32",
            "--device",
            "T4-16GB",
            "--max-batch",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    doc = _json.loads(r.stdout)
    assert doc["schema"] == "vramctl.estimate/1"
    one, four = doc["estimates"]
    assert one["batch_size"] == 1 and four["batch_size"] == 4
    assert four["peak_device_bytes"] > one["peak_device_bytes"]
    assert doc["max_batch"]["max_batch_size"] > 4
    text = CliRunner().invoke(app, ["estimate", "lstm", "--batch", "2", "--device", "T4-16GB"])
    assert text.exit_code == 0 and "breakdown at batch 2" in text.stdout


def test_estimate_bad_input_exits_2_with_the_fix() -> None:
    from typer.testing import CliRunner

    from vramctl.cli._app import app

    r = CliRunner().invoke(app, ["estimate", "lstm", "--device", "Z99-1GB"])
    assert r.exit_code == 2 and "A10G-24GB" in r.output
    r = CliRunner().invoke(app, ["estimate", "lstm", "--batch", "1,x"])
    assert r.exit_code == 2 and "1,8,32" in r.output
    r = CliRunner().invoke(app, ["estimate", "--list"])
    assert r.exit_code == 0 and "wav2vec2-base" in r.output


@pytest.mark.slow
def test_estimate_max_length_says_when_it_is_the_models_limit() -> None:
    from vramctl.cli._app import app

    r = runner.invoke(app, ["estimate", "gpt2", "--max-length", "--device", "H100-80GB"])
    assert r.exit_code == 0, r.output
    assert "longest seq_len at batch 1: 1024 (the model's limit)" in " ".join(r.stdout.split())
