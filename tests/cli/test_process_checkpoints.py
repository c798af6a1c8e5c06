"""Bring your own model: saved CTC checkpoints transcribe a folder of WAV files through the
command line; a resume checks the model; exit codes and interrupts say where a run stands."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from tests.batching.checkpoints import reference_text, save_parakeet, save_wav2vec2, write_wavs
from vramctl.batching import Manifest, ManifestError, ProgressStore, load_model, process
from vramctl.batching._models import model_identity
from vramctl.cli._app import app

pytest.importorskip("transformers")

runner = CliRunner()
#: Two short clips, one longer than the 4 s chunks used below, one short.
SECONDS = [1.2, 2.5, 9.0, 0.8]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpts")
    return {
        "wav2vec2": save_wav2vec2(root / "wav2vec2"),
        "parakeet": save_parakeet(root / "parakeet"),
        "wavs": root / "wavs",
        "_": write_wavs(root / "wavs", SECONDS)[0],
    }


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("kind", ["wav2vec2", "parakeet"])
def test_a_saved_ctc_checkpoint_transcribes_a_folder_of_wavs(
    kind: str, ckpts: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "out.jsonl"
    args = ["process", str(ckpts[kind]), str(ckpts["wavs"]), str(out), "-d", "cpu"]
    result = runner.invoke(app, [*args, "--chunk", "4", "--overlap", "0.5", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert (doc["done"], doc["failed"], doc["lost"]) == (4, 0, 0)
    got = lines(out)
    assert [g["id"] for g in got] == ["clip00", "clip01", "clip02", "clip03"]
    for g, seconds in zip(got, SECONDS, strict=True):
        assert isinstance(g["output"]["text"], str)
        if seconds < 4:  # one chunk: exactly what transformers alone transcribes
            wav = ckpts["wavs"] / f"{g['id']}.wav"
            assert g["output"]["text"] == reference_text(ckpts[kind], wav)
    # The long recording was run in chunks and stitched into one transcript of its length.
    frames = {"wav2vec2": 49.9, "parakeet": 12.5}[kind]  # output frames per second
    assert abs(got[2]["output"]["frames"] - SECONDS[2] * frames) <= 2


def test_a_resume_with_another_model_is_refused_and_overwrite_starts_over(
    ckpts: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "out.jsonl"
    first = runner.invoke(app, ["process", str(ckpts["wav2vec2"]), str(ckpts["wavs"]), str(out)])
    assert first.exit_code == 0, first.output
    before = out.read_text()
    other = ["process", str(ckpts["parakeet"]), str(ckpts["wavs"]), str(out), "-q"]
    refused = runner.invoke(app, other)
    assert refused.exit_code == 2
    message = " ".join(refused.stderr.split())
    assert "made by a different run (4 done, 0 failed)" in message
    assert "model.name" in message and "--overwrite" in message
    assert "resume=" not in message and "overwrite=True" not in message  # the CLI's own words
    assert out.read_text() == before  # nothing of the first run was touched
    again = runner.invoke(app, [*other, "--overwrite"])
    assert again.exit_code == 0, again.output
    assert out.read_text() != before and "0 done before" in again.stdout


def test_a_resume_with_changed_weights_is_refused(ckpts: dict[str, Path], tmp_path: Path) -> None:
    model = save_wav2vec2(tmp_path / "model", seed=1)
    out = tmp_path / "out.jsonl"
    args = ["process", str(model), str(ckpts["wavs"]), str(out), "-q"]
    assert runner.invoke(app, args).exit_code == 0
    save_wav2vec2(model, seed=2)  # the same path and architecture, retrained
    refused = runner.invoke(app, args)
    assert refused.exit_code == 2 and "model.weights" in refused.stderr
    fresh = runner.invoke(app, [*args, "--fresh", "--overwrite"])
    assert fresh.exit_code == 2 and "exclude each other" in fresh.stderr
    fresh = runner.invoke(app, [*args, "--fresh"])
    assert fresh.exit_code == 2 and "already holds a run" in fresh.stderr


def test_output_kinds(ckpts: dict[str, Path], tmp_path: Path) -> None:
    base = ["process", str(ckpts["wav2vec2"]), str(ckpts["wavs"])]
    out = tmp_path / "emb.jsonl"
    assert runner.invoke(app, [*base, str(out), "--output-kind", "embedding"]).exit_code == 0
    assert len(lines(out)[0]["output"]["embedding"]) == 32  # the vocabulary's logits
    out = tmp_path / "frames.jsonl"
    assert runner.invoke(app, [*base, str(out), "--output-kind", "frames"]).exit_code == 0
    first = lines(out)[0]["output"]
    assert len(first["values"]) == first["frames"] and len(first["values"][0]) == 32
    bad = runner.invoke(app, [*base, str(tmp_path / "x.jsonl"), "--output-kind", "words"])
    assert bad.exit_code == 2 and "--output-kind 'words'" in bad.stderr
    # Text needs a tokenizer: a built-in architecture (random weights) gives frames.
    manifest = tmp_path / "m.jsonl"
    manifest.write_text('{"id": "a", "duration": 1.0}\n')
    args = ["process", "wav2vec2-mini", str(manifest), str(tmp_path / "t.jsonl")]
    text = runner.invoke(app, [*args, "--loader", "synthetic", "--output-kind", "text"])
    assert text.exit_code == 2 and "needs a CTC checkpoint with a tokenizer" in text.stderr


def test_exit_codes_tell_a_script_what_happened(ckpts: dict[str, Path], tmp_path: Path) -> None:
    # Bad input is found before any model loads: this model does not exist at all.
    nomodel = ["process", "no_such_module_here:build"]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    result = runner.invoke(app, [*nomodel, str(empty), str(tmp_path / "o.jsonl")])
    assert result.exit_code == 2 and "holds no records" in result.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('not json\n{"id": "x", "duration": -1}\n{"duration": 2}\n')
    result = runner.invoke(app, [*nomodel, str(bad), str(tmp_path / "o.jsonl")])
    assert result.exit_code == 2
    assert "no valid record: all 3 of its records are bad" in result.stderr
    assert result.stderr.count("bad.jsonl:2") == 1  # each bad line once, on one stream
    assert result.stdout == ""
    # A recording that fails (its file is missing): exit 1 with a summary, unless allowed.
    manifest = tmp_path / "m.jsonl"
    wav = ckpts["wavs"] / "clip00.wav"
    manifest.write_text(
        json.dumps({"id": "ok", "path": str(wav), "duration": 1.2})
        + "\n"
        + json.dumps({"id": "gone", "path": str(tmp_path / "gone.wav"), "duration": 1.0})
        + "\n"
    )
    args = ["process", str(ckpts["wav2vec2"]), str(manifest), str(tmp_path / "out.jsonl"), "-q"]
    result = runner.invoke(app, args)
    assert result.exit_code == 1
    assert "1 recordings failed" in " ".join(result.stderr.split())
    assert runner.invoke(app, [*args, "--allow-failures"]).exit_code == 0


def test_ctrl_c_saves_and_the_same_command_resumes(tmp_path: Path) -> None:
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(
        "".join(json.dumps({"id": f"r{i}", "duration": 1.0 + i % 3}) + "\n" for i in range(600))
    )
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-c"]
    code = (
        "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler);"
        " from vramctl.cli import main; sys.argv = ['vramctl'] + sys.argv[1:]; main()"
    )
    args = ["process", "wav2vec2-mini", str(manifest), str(out), "--loader", "synthetic"]
    args += ["--budget", "20s", "-d", "cpu", "-q"]
    proc = subprocess.Popen([*cmd, code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    db = tmp_path / "out.progress.db"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None and committed(db) == 0:
        time.sleep(0.1)  # until a first batch is committed
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    text = " ".join(stderr.decode().split())
    assert proc.returncode == 130, text
    assert "of 600 recordings" in text and "run the same command to resume" in text
    found = re.search(r"interrupted: saved (\d+) of 600", text)
    assert found, text
    saved = int(found.group(1))
    assert 0 < saved < 600
    resumed = subprocess.run([*cmd, code, *args, "--json"], capture_output=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr.decode()[-2000:]
    doc = json.loads(resumed.stdout)
    assert doc["skipped"] == saved and doc["done"] == 600 - saved and doc["lost"] == 0
    assert len(out.read_text().splitlines()) == 600


def committed(db: Path) -> int:
    """Recordings a running process has committed to its store (0 before it has one)."""
    if not db.exists():
        return 0
    try:
        with ProgressStore.reader(db) as store:
            stats = store.stats()
            return int(stats.done + stats.failed)
    except Exception:  # made but not yet set up by the writer
        return 0


def test_sigterm_ends_a_run_as_ctrl_c_does(tmp_path: Path) -> None:
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(
        "".join(json.dumps({"id": f"r{i}", "duration": 3.0}) + "\n" for i in range(600))
    )
    args = ["process", "wav2vec2-mini", str(manifest), str(tmp_path / "o.jsonl")]
    args += ["--loader", "synthetic", "--budget", "20s", "-d", "cpu", "-q"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "vramctl", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    db = tmp_path / "o.progress.db"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None and committed(db) == 0:
        time.sleep(0.1)  # the run is under way (its SIGTERM handler is in place)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr.decode()[-2000:]
    assert "run the same command to resume" in " ".join(stderr.decode().split())


def test_module_factory_is_found_in_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "mymodel_cwd.py").write_text(
        "import torch\ndef build():\n    return torch.nn.Conv1d(1, 4, 320, stride=320)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    source = load_model("mymodel_cwd:build")
    assert source.kind == "factory" and isinstance(source.model(), torch.nn.Conv1d)
    missing = runner.invoke(app, ["estimate", "nosuchmodule_x:build", "--batch", "2"])
    assert missing.exit_code == 2
    message = " ".join(missing.stderr.split())
    assert "no module named 'nosuchmodule_x'" in message and str(tmp_path) in message
    assert "PYTHONPATH" in message
    noattr = runner.invoke(app, ["estimate", "mymodel_cwd:nothing", "--batch", "2"])
    assert noattr.exit_code == 2 and "has no 'nothing'" in noattr.stderr


def test_a_folder_is_a_manifest_of_its_audio_files(ckpts: dict[str, Path], tmp_path: Path) -> None:
    folder = tmp_path / "rec"
    write_wavs(folder / "a", [1.0])
    write_wavs(folder / "b", [0.5, 2.0])
    (folder / "notes.txt").write_text("not audio")
    (folder / "b" / "broken.wav").write_bytes(b"RIFF0000WAVE")
    m = Manifest(folder)
    items = list(m)
    assert [(i.id, round(i.duration, 3)) for i in items] == [
        ("a/clip00", 1.0),
        ("b/clip00", 0.5),
        ("b/clip01", 2.0),
    ]
    assert m.skipped == 1 and "broken.wav" in str(m.problems[0])
    with pytest.raises(ManifestError, match="holds no audio files"):
        process("no_such:model", tmp_path / "a_missing_folder_made_empty", tmp_path / "o.jsonl")


def test_model_identity_follows_the_weights() -> None:
    def build() -> torch.nn.Module:
        return torch.nn.Linear(8, 4)

    a, b = build(), build()
    assert model_identity(a)["shapes"] == model_identity(b)["shapes"]
    assert model_identity(a)["weights"] != model_identity(b)["weights"]
    c = torch.nn.Linear(8, 4)
    c.load_state_dict(a.state_dict())
    assert model_identity(a) == model_identity(c)
    with torch.no_grad():
        c.weight[3, 7] += 1.0  # the last value: the sample reaches both ends of a tensor
    assert model_identity(a)["weights"] != model_identity(c)["weights"]


@pytest.fixture(autouse=True)
def _empty_folder(tmp_path: Path) -> None:
    os.makedirs(tmp_path / "a_missing_folder_made_empty", exist_ok=True)
