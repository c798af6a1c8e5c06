"""``vramctl process`` and ``vramctl demo``, run as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vramctl.cli._app import app

runner = CliRunner()

FACTORY = """
import torch
from torch import nn

def frames():
    torch.manual_seed(0)
    return nn.Sequential(nn.Unflatten(1, (1, -1)), nn.Conv1d(1, 4, 320, stride=320))
"""


def test_process_writes_outputs_and_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "tinymodels.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(
        "".join(json.dumps({"id": f"c{i}", "duration": 1.0 + i % 3}) + "\n" for i in range(9))
        + '{"id": "bad", "duration": 0}\n'
    )
    out = tmp_path / "out.jsonl"
    args = ["process", "tinymodels:frames", str(manifest), str(out), "--loader", "synthetic"]
    first = runner.invoke(app, [*args, "--device", "cpu", "--json"])
    assert first.exit_code == 1, first.output  # a bad record: not everything was processed
    assert "1 bad manifest records were skipped" in first.stderr
    doc = json.loads(first.stdout)
    assert doc["schema"] == "vramctl.process/1"
    assert (doc["done"], doc["failed"], doc["lost"], doc["manifest_problems"]) == (9, 0, 0, 1)
    assert len(out.read_text().splitlines()) == 9
    again = runner.invoke(app, [*args, "--device", "cpu", "--allow-failures"])
    assert again.exit_code == 0, again.output
    assert "0 recordings done" in again.stdout and "9 done before" in again.stdout
    # The bad line is reported once (on stderr), with its field; stdout does not repeat it.
    assert again.stderr.count("must be positive") == 1 and "duration" in again.stderr
    assert "must be positive" not in again.stdout


def test_process_summary_warns_of_duplicate_ids_and_audio_of_another_length(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import wave

    (tmp_path / "tinymodels.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    with wave.open(str(tmp_path / "a.wav"), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(16000)
        f.writeframes(b"\0\0" * 16000)  # 1 s
    manifest = tmp_path / "m.jsonl"
    records = [("[a]", 1.0), ("b", 4.0), ("[a]", 1.0), ("c", 1.0)]  # b: the file holds 1 s
    manifest.write_text(
        "".join(json.dumps({"id": r, "path": "a.wav", "duration": d}) + "\n" for r, d in records)
    )
    out = tmp_path / "out.jsonl"
    args = ["process", "tinymodels:frames", str(manifest), str(out), "--device", "cpu"]
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output  # each id processed once: nothing failed
    doc = json.loads(result.stdout)
    assert (doc["done"], doc["duplicate_ids"], doc["length_mismatches"]) == (3, 1, 1)
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["[a]", "b", "c"]
    stderr = " ".join(result.stderr.split())  # the console wraps long lines
    # Named as they are found, then counted in the summary.
    assert "1 duplicate id skipped ([a] at line 3); the first of each is kept" in stderr
    assert "item 'b': the manifest says 4.00 s" in stderr and "holds 1.00 s" in stderr
    assert (
        "warning: 1 manifest records repeat an earlier id and were skipped (the first of each"
        " was processed); 1 recordings hold audio of another length than the manifest's"
        " duration; the first are named above"
    ) in stderr


def test_process_bad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    manifest = tmp_path / "m.jsonl"
    manifest.write_text('{"id": "a", "duration": 1.0}\n')
    result = runner.invoke(app, ["process", "gpt2", str(manifest), str(tmp_path / "o.jsonl")])
    assert result.exit_code == 2 and "not audio" in result.stderr
    result = runner.invoke(
        app, ["process", "wav2vec2-mini", str(tmp_path / "none.jsonl"), str(tmp_path / "o.jsonl")]
    )
    assert result.exit_code == 2 and "none.jsonl" in result.stderr


def test_process_help_explains_resume() -> None:
    result = runner.invoke(app, ["process", "--help"])
    assert result.exit_code == 0 and "resumes" in result.stdout


@pytest.mark.slow
def test_demo_runs_end_to_end_and_loses_nothing(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "vramctl",
            "demo",
            "--clips",
            "40",
            "--json",
            "--output",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["schema"] == "vramctl.demo/1"
    assert (doc["done"], doc["failed"], doc["lost"], doc["output_lines"]) == (40, 0, 0, 40)
    assert doc["ooms_recovered"] == doc["ooms"]
    assert doc["peak_bytes"] <= doc["capacity_bytes"]
    assert doc["fit"] and all(f["measured_bytes"] <= f["predicted_bytes"] for f in doc["fit"])
    assert (tmp_path / "outputs.jsonl").exists()


def test_process_takes_a_model_class_as_its_factory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "tinyclass.py").write_text(
        "import torch\nfrom torch import nn\n\n"
        "class Frames(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.conv = nn.Conv1d(1, 4, 320, stride=320)\n\n"
        "    def forward(self, x):\n"
        "        return self.conv(x.unsqueeze(1))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(
        "".join(json.dumps({"id": f"c{i}", "duration": 1.0}) + "\n" for i in range(3))
    )
    out = tmp_path / "out.jsonl"
    args = ["process", "tinyclass:Frames", str(manifest), str(out), "--loader", "synthetic"]
    result = runner.invoke(app, [*args, "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["done"] == 3
    assert len(out.read_text().splitlines()) == 3


def test_process_on_several_simulated_devices_counts_each_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "tinymodels.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(
        "".join(json.dumps({"id": f"c{i}", "duration": 4.0 + i % 3}) + "\n" for i in range(8))
    )
    out = tmp_path / "out.jsonl"
    args = ["process", "tinymodels:frames", str(manifest), str(out), "--loader", "synthetic"]
    result = runner.invoke(
        app, [*args, "-d", "sim:1MiB", "-d", "sim:8MiB", "--budget", "24s", "--json"]
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert (doc["done"], doc["lost"]) == (8, 0)
    assert [d["device"] for d in doc["devices"]] == ["sim:1MiB", "sim:8MiB"]
    assert all(0 < d["peak_bytes"] <= d["total_bytes"] for d in doc["devices"])
    assert len(out.read_text().splitlines()) == 8


def test_a_model_given_as_a_module_is_copied_per_device_not_shared(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from vramctl.batching._worker import Worker

    (tmp_path / "tinyinstance.py").write_text(FACTORY + "\nmodel = frames()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    # Each device's worker, as process makes them: the model each one runs.
    workers: list[Worker] = []
    init = Worker.__init__

    def record(self: Worker, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)  # type: ignore[arg-type]
        workers.append(self)

    monkeypatch.setattr(Worker, "__init__", record)
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(
        "".join(json.dumps({"id": f"c{i}", "duration": 1.0}) + "\n" for i in range(2))
    )
    out = tmp_path / "out.jsonl"
    args = ["process", "tinyinstance:model", str(manifest), str(out), "--loader", "synthetic"]
    result = runner.invoke(
        app, [*args, "-d", "sim:8MiB", "-d", "sim:16MiB", "--budget", "24s", "--json"]
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["done"] == 2
    # The one module given is copied for the second device: two models, no tensor shared,
    # so a change to one (a device moving it, a step updating it) does not show in the other.
    first, second = (w.model for w in workers)
    assert first is not second
    one, other = dict(first.named_parameters()), dict(second.named_parameters())
    assert one.keys() == other.keys() and one
    assert all(one[n].data_ptr() != other[n].data_ptr() for n in one)
    assert all(torch.equal(one[n], other[n]) for n in one)  # copies: the same weights
    with torch.no_grad():
        for p in second.parameters():
            p.add_(1.0)
    assert not any(torch.equal(one[n], other[n]) for n in one)
