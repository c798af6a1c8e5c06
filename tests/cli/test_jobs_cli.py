"""``vramctl run``, ``submit``, ``jobs``, ``logs`` and ``cancel`` against a real store."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vramctl.cli._app import app
from vramctl.jobs import JobStore

runner = CliRunner()
PY = sys.executable


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("VRAMCTL_HOME", str(tmp_path))
    return tmp_path


def test_run_shows_the_jobs_output_and_exits_with_its_status(home: Path) -> None:
    ok = runner.invoke(
        app, ["run", "-m", "1GiB", "--devices", "sim:4GiB", "--", PY, "-c", "print('hello')"]
    )
    assert ok.exit_code == 0, ok.output
    assert "hello" in ok.stdout
    assert "succeeded on sim:4GiB" in ok.stderr
    bad = runner.invoke(
        app,
        ["run", "-m", "1GiB", "--devices", "sim:4GiB", "--", PY, "-c", "raise SystemExit(7)"],
    )
    assert bad.exit_code == 7
    assert "exited with status 7" in bad.stderr
    with JobStore(home / "jobs.db") as s:
        assert [j.state for j in s.list()] == ["succeeded", "failed"]


def test_run_waits_for_room_then_says_how_much_there_was(home: Path) -> None:
    result = runner.invoke(
        app,
        ["run", "-m", "9GiB", "--devices", "sim:4GiB", "--wait-timeout", "0.3", "--", "true"],
    )
    assert result.exit_code == 1
    assert "no device had 9.00 GiB free within 0.3 s (largest free: 4.00 GiB on sim:4GiB)" in (
        " ".join(result.stderr.split())
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "-m", "1GiB"], "no command: put it after --"),
        (["run", "-m", "1GiB", "--", "python train.py"], "is one argument, and vramctl runs"),
        (["submit", "--", "python", "x.py"], "memory: missing"),
        (["submit", "-m", "-3GiB", "--", "true"], "memory"),
        (["submit", "-m", "1GiB", "--label", "oops", "--", "true"], "--label 'oops'"),
        (["jobs", "--state", "done"], "unknown job state 'done'"),
        (["logs", "nope"], "no job 'nope'"),
        (["scheduler", "--policy", "first-fit"], "unknown placement policy"),
        (["submit", "-m", "1GiB", "--guard", "steps", "--", "true"], "guard.function: must be"),
        (["submit", "-m", "1GiB", "--guard-optimizer", "m:o", "--", "true"], "goes with --guard"),
    ],
)
def test_bad_input_is_one_line_and_status_2(home: Path, args: list[str], message: str) -> None:
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.stderr.split())
    assert "Traceback" not in result.output


def test_submit_list_cancel_and_logs(home: Path, tmp_path: Path) -> None:
    spec = tmp_path / "job.toml"
    spec.write_text('name = "train"\ncommand = ["true"]\nmemory = "2GiB"\n[labels]\nteam = "asr"\n')
    first = runner.invoke(app, ["submit", "--spec", str(spec), "--json"])
    assert first.exit_code == 0, first.output
    job = json.loads(first.stdout)
    assert (job["name"], job["state"]) == ("train", "queued")
    second = runner.invoke(app, ["submit", "-m", "1GiB", "--name", "other", "--", "true"])
    assert second.exit_code == 0 and "queued job" in second.stdout
    listed = json.loads(runner.invoke(app, ["jobs", "--json", "--label", "team=asr"]).stdout)
    assert [j["id"] for j in listed["jobs"]] == [job["id"]]
    cancelled = runner.invoke(app, ["cancel", job["id"]])
    assert cancelled.exit_code == 0 and f"cancelled job {job['id']}" in cancelled.stdout
    table = runner.invoke(app, ["jobs", "--state", "cancelled"], env={"COLUMNS": "120"})
    assert job["id"] in table.stdout and "other" not in table.stdout
    log = Path(JobStore(home / "jobs.db").get(job["id"]).log_path or "")
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("line one\n")
    shown = runner.invoke(app, ["logs", job["id"]])
    assert shown.exit_code == 0 and shown.stdout == "line one\n"


def test_run_guards_the_function_the_command_line_names(home: Path, tmp_path: Path) -> None:
    (tmp_path / "steps.py").write_text(
        "import torch\n\ndef embed(batch):\n"
        "    torch.empty(batch.shape[0], 2**26, dtype=torch.uint8)\n"
        "    return batch.sum(dim=1)\n"
    )
    code = "import torch, steps; print('rows', steps.embed(torch.ones(32, 4)).shape[0])"
    args = ["run", "-m", "1GiB", "--devices", "sim:4GiB", "--cwd", str(tmp_path)]
    plain = runner.invoke(app, [*args, "--", PY, "-c", code])
    assert plain.exit_code == 1 and "OutOfMemoryError" in plain.stdout
    guarded = runner.invoke(app, [*args, "--guard", "steps:embed", "--", PY, "-c", code])
    assert guarded.exit_code == 0, guarded.output
    assert "rows 32" in guarded.stdout and "the guard of steps:embed ran 1 of 1" in guarded.stdout
    with JobStore(home / "jobs.db") as s:
        assert s.list()[-1].spec.guard is not None
