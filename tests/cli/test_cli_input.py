"""Bad input and conflicting options across the commands: one line naming the value, status 2.

Also what each command prints where that went wrong before: each reading of a watch into a
pipe, an alert once, no progress bar left above an error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from vramctl.cli._app import app

runner = CliRunner()

# A folder that exists but where nothing can be created, even by root.
UNWRITABLE = Path("/proc")
needs_unwritable = pytest.mark.skipif(
    not UNWRITABLE.is_dir(), reason="needs /proc (a folder no one can write in)"
)


def one_line_error(result: Any, needle: str) -> None:
    """Exit status 2 and exactly one line on stderr, naming ``needle``, and no traceback."""
    stderr: str = result.stderr
    assert result.exit_code == 2, (result.exit_code, result.output)
    assert "Traceback" not in stderr
    assert stderr.startswith("error:"), stderr
    assert len(stderr.strip().splitlines()) == 1, stderr
    assert needle in stderr, stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["status", "--watch", "nan"], "--watch nan"),
        (["status", "--watch", "inf", "-n", "1"], "--watch inf"),
        (["status", "--json", "--watch", "inf", "-n", "2"], "--watch inf"),
        (["status", "--count", "2"], "--count 2"),
        (["devices", "--policy", "best-fit"], "--policy best-fit"),
        (["devices", "--target", "0.5", "--json"], "--target 0.5"),
        (["top", "--once", "--interval", "inf"], "--interval inf"),
        (["dashboard", "--interval", "inf"], "--interval inf"),
        (["monitor", "-n", "1", "--interval", "inf"], "--interval inf"),
        (["monitor", "-n", "1", "--duration", "nan"], "--duration nan"),
        (["monitor", "-n", "1", "--hold", "nan"], "--hold nan"),
        (["monitor", "-n", "1", "--horizon", "-1"], "--horizon -1"),
        (["monitor", "-n", "1", "--gpu-warning", "2"], "--gpu-warning 2"),
        (
            ["monitor", "-n", "1", "--host-warning", "0.9", "--host-critical", "0.5"],
            "--host-warning 0.9 is above --host-critical 0.5",
        ),
        (["estimate", "lstm", "--device", "cpu", "--calibration", "none.json"], "none.json"),
        (["calibrate", "--no-save", "--out", "profile.json"], "--no-save"),
        (["demo", "--clips", "2", "--model", "gpt2"], "--model 'gpt2'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], needle: str) -> None:
    one_line_error(runner.invoke(app, args), needle)


#: What a box drawn around an error is made of.
BOX = set("─│╭╮╰╯")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["estimate", "gpt2", "--seq-len", "0"], "estimate: --seq-len 0: must be at least 1"),
        (["estimate", "gpt2", "--seq-len", "many"], "--seq-len many: must be a whole number"),
        (["estimate", "gpt2", "--target-utilization", "2"], "--target-utilization 2: must be"),
        (["estimate", "gpt2", "--seq-len"], "'--seq-len' requires an argument"),
        (["dashboard", "--port", "99999"], "dashboard: --port 99999: must be at most 65535"),
        (["status", "-n", "0"], "--count 0: must be at least 1"),
        (["status", "--no-such-option"], "no such option: --no-such-option"),
        (["catalog", "--json=yes"], "'--json' does not take a value"),
        (["process", "wav2vec2-mini"], "missing argument"),
        (["no-such-command"], "no such command 'no-such-command'"),
        (["--no-such-option"], "no such option: --no-such-option"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(args: list[str], needle: str) -> None:
    # Typer's checks (ranges, types, unknown options, missing arguments), not vramctl's.
    result = runner.invoke(app, args, env={"COLUMNS": "80"})
    one_line_error(result, needle)
    assert not BOX & set(result.stderr), result.stderr
    assert result.stdout == ""
    command = args[0] if not args[0].startswith("-") and args[0] != "no-such-command" else ""
    assert f"{command} --help" in result.stderr


def test_a_guard_error_reaches_the_user_as_one_line() -> None:
    """The guard's bad-argument errors are vramctl's: a command that gives the guard a value
    of the user's prints what is wrong as one line, through the CLI's handler. (No command
    passes an option of its own to the guard's checks today; ``process`` builds its guard
    itself.)"""
    import typer
    from torch import nn

    from vramctl.cli._common import user_errors
    from vramctl.guard import Guard

    cli = typer.Typer()

    @cli.command()
    @user_errors
    def step(patience: int = 3, factor: float = 0.5) -> None:
        Guard(nn.Linear(2, 2), patience=patience).shrink(factor)

    result = runner.invoke(cli, ["--patience", "0"])
    one_line_error(result, "patience must be an integer of at least 1, got 0")
    one_line_error(runner.invoke(cli, ["--factor", "2"]), "factor must be between 0 and 1")


def test_a_usage_error_is_one_line_from_the_installed_command() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "vramctl", "dashboard", "--port", "99999"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "80"},
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), proc.stderr
    assert "--port 99999" in lines[0] and not BOX & set(proc.stderr)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--target", "2"], "--target 2"),
        (["--target", "-1"], "--target -1"),
        (["--budget", "-5s"], "--budget '-5s'"),
        (["--budget", "infs"], "--budget 'infs'"),
        (["--chunk", "inf"], "--chunk inf"),
        (["--overlap", "20"], "--overlap 20"),
    ],
)
def test_process_options_are_checked_before_the_run(
    args: list[str], needle: str, tmp_path: Path
) -> None:
    manifest = tmp_path / "m.jsonl"
    manifest.write_text('{"id": "a", "duration": 1.0}\n')
    out = tmp_path / "out.jsonl"
    base = ["process", "wav2vec2-mini", str(manifest), str(out), "--loader", "synthetic"]
    one_line_error(runner.invoke(app, [*base, "-d", "cpu", *args]), needle)
    assert not out.exists()


def test_process_names_each_audio_model_once(tmp_path: Path) -> None:
    manifest = tmp_path / "m.jsonl"
    manifest.write_text('{"id": "a", "duration": 1.0}\n')
    result = runner.invoke(app, ["process", "gpt2", str(manifest), str(tmp_path / "o.jsonl")])
    one_line_error(result, "gpt2 takes tokens, not audio")
    text = " ".join(result.stderr.split())
    assert "speech checkpoint" in text
    names = text.split("built-in audio model (", 1)[1].split(")")[0].split(", ")
    assert len(names) == len(set(names)) and "wav2vec2-base" in names


def test_an_error_during_a_run_is_not_left_under_a_progress_bar(tmp_path: Path) -> None:
    # Without --quiet or --json the bar is up when the library finds the manifest missing.
    missing = tmp_path / "missing.jsonl"
    result = runner.invoke(
        app, ["process", "wav2vec2-mini", str(missing), str(tmp_path / "o.jsonl")]
    )
    one_line_error(result, "missing.jsonl")


def test_demo_output_must_be_a_folder_it_can_write(tmp_path: Path) -> None:
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine\n")
    one_line_error(
        runner.invoke(app, ["demo", "--clips", "2", "--output", str(a_file)]), "--output"
    )
    assert a_file.read_text() == "mine\n"
    under_a_file = a_file / "demo"
    one_line_error(
        runner.invoke(app, ["demo", "--clips", "2", "--output", str(under_a_file)]), "--output"
    )


def test_calibrate_refuses_an_out_it_cannot_write_before_measuring(tmp_path: Path) -> None:
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine\n")
    for out in (a_file / "profile.json", tmp_path):
        result = runner.invoke(app, ["calibrate", "--out", str(out)])
        one_line_error(result, f"--out {str(out)!r}")


@needs_unwritable
def test_monitor_refuses_an_unwritable_plot_before_sampling() -> None:
    plot = UNWRITABLE / "vramctl-plot.html"
    result = runner.invoke(app, ["monitor", "-d", "cpu", "-n", "1", "--plot", str(plot)])
    one_line_error(result, "cannot write there")
    assert result.stdout == ""  # nothing sampled, nothing lost


def test_monitor_plot_check_leaves_no_file_behind(tmp_path: Path) -> None:
    plot = tmp_path / "mem.html"
    result = runner.invoke(app, ["monitor", "-d", "cpu", "-n", "1", "--plot", str(plot), "-q"])
    assert result.exit_code == 0, result.output
    assert "uPlot" in plot.read_text()
    result = runner.invoke(app, ["monitor", "-d", "cpu", "-n", "1", "--plot", "x.txt"])
    assert result.exit_code == 2
    assert not Path("x.txt").exists()


def test_monitor_prints_each_alert_once() -> None:
    result = runner.invoke(
        app,
        [
            "monitor",
            "-d",
            "cpu",
            "-i",
            "0.05",
            "-n",
            "2",
            "-q",
            "--host-warning",
            "0.001",
            "--host-critical",
            "0.002",
        ],
    )
    assert result.exit_code == 0, result.output
    fired = [line for line in result.stderr.splitlines() if "host_memory" in line]
    assert len(fired) == 1, result.stderr
    assert "[critical]" not in result.stderr  # the library's log line, through lastResort


def test_status_watch_into_a_pipe_prints_every_reading() -> None:
    # CliRunner's stdout is not a terminal: a live view would print only its last frame.
    result = runner.invoke(app, ["status", "-d", "cpu", "--watch", "0.05", "--count", "3"])
    assert result.exit_code == 0, result.output
    assert result.stdout.count("every 0.05 s") == 3


def test_devices_select_keeps_its_defaults() -> None:
    result = runner.invoke(app, ["devices", "--select", "1MiB", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["device"]["id"]


@pytest.mark.slow
def test_estimate_prints_no_transformers_config_warnings() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "vramctl", "estimate", "gpt2", "--batch", "1", "--json"],
        capture_output=True,
        text=True,
        timeout=240,
        env={k: v for k, v in os.environ.items() if k != "TRANSFORMERS_VERBOSITY"},
    )
    assert proc.returncode == 0, proc.stderr
    assert "[transformers]" not in proc.stderr and "loss_type" not in proc.stderr
    assert json.loads(proc.stdout)
