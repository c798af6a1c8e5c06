"""``vramctl calibrate`` and ``vramctl estimate --calibration`` in the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from tests.estimator.test_calibration import fitted
from vramctl.cli._app import app

runner = CliRunner()
MiB = 2**20


def test_without_a_gpu_it_says_why_and_exits_2() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the cuda tests calibrate it")
    done = subprocess.run(
        [sys.executable, "-m", "vramctl", "calibrate"], capture_output=True, text=True, check=False
    )
    assert done.returncode == 2
    assert "no CUDA GPU here" in done.stderr
    assert "Traceback" not in done.stderr
    result = runner.invoke(app, ["calibrate", "cpu"])
    assert result.exit_code == 2
    assert "calibrate a whole CUDA GPU" in result.output


def test_list_shows_the_saved_profiles() -> None:
    result = runner.invoke(app, ["calibrate", "--list"])
    assert result.exit_code == 0, result.output
    assert "no calibration profiles" in result.output
    saved = fitted().save()
    result = runner.invoke(app, ["calibrate", "--list"])
    assert result.exit_code == 0, result.output
    assert "A10G" in result.output and "8.6" in result.output
    doc = json.loads(runner.invoke(app, ["calibrate", "--list", "--json"]).output)
    assert doc["schema"] == "vramctl.calibrations/1"
    [profile] = doc["profiles"]
    assert profile["path"] == str(saved.path)
    assert profile["constants"]["context_bytes"] == saved.context_bytes


def test_estimate_takes_a_profile_or_off(tmp_path: Path) -> None:
    cal = replace(fitted(), context_bytes=999 * MiB).save(tmp_path / "mine.json")
    args = ["estimate", "lstm", "--seq-len", "16", "--device", "A10G-24GB", "--json"]

    def context(*extra: str) -> int:
        result = runner.invoke(app, [*args, *extra])
        assert result.exit_code == 0, result.output
        return int(json.loads(result.output)["estimates"][0]["breakdown_bytes"]["context"])

    assert context("--calibration", str(cal.path)) == 999 * MiB
    builtin = context("--calibration", "off")
    assert builtin != 999 * MiB
    assert context() == builtin  # no profile saved where it is looked up
    cal.save()  # now in the calibration directory
    assert context() == 999 * MiB
    assert context("--calibration", "off") == builtin
    result = runner.invoke(app, [*args, "--calibration", str(tmp_path / "none.json")])
    assert result.exit_code == 2
    assert "none.json" in result.output
