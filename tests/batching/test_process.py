"""The processing run: outputs per recording, chunk stitching, failures, resume after a kill."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import vramctl
from vramctl.batching import (
    BatchingError,
    Item,
    PaddedDuration,
    ProcessStatus,
    ProgressStore,
    process,
    progress_path,
    synthesize,
)

RATE = 16000


class Frames(nn.Module):
    """A frame-wise model: one output frame per 320 samples (50 frames/s), 8 features.

    A ``kernel`` wider than the stride makes the windows overlap, as wav2vec2's do.
    """

    def __init__(self, kernel: int = 320, features: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv1d(1, features, kernel, stride=320)

    def forward(self, waveforms: torch.Tensor) -> torch.Tensor:
        return self.conv(waveforms.unsqueeze(1)).transpose(1, 2)


def write_manifest(path: Path, durations: list[float], paths: dict[int, str] | None = None) -> str:
    with open(path, "w") as f:
        for i, d in enumerate(durations):
            record: dict[str, Any] = {"id": f"r{i}", "duration": d}
            if paths and i in paths:
                record["path"] = paths[i]
            f.write(json.dumps(record) + "\n")
    return str(path)


def read_jsonl(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def full_output(item: Item) -> torch.Tensor:
    with torch.no_grad():
        return Frames()(synthesize(item, RATE)[None])[0]


def keep(output: torch.Tensor, item: Item) -> dict[str, Any]:
    return {"frames": int(output.shape[0]), "sum": round(float(output.double().sum()), 3)}


def test_each_recording_is_output_once_in_manifest_order_and_chunks_are_stitched(
    tmp_path: Path,
) -> None:
    durations = [2.0, 25.0, 0.7, 9.3, 14.0, 3.1]  # 25 s and 14 s are cut into 10 s chunks
    manifest = write_manifest(tmp_path / "m.jsonl", durations)
    statuses: list[ProcessStatus] = []
    result = process(
        Frames,
        manifest,
        tmp_path / "out.jsonl",
        postprocess=keep,
        loader="synthetic",
        budget=PaddedDuration(24.0),
        chunk_duration=10.0,
        overlap=1.0,
        devices=["cpu"],
        num_buckets=3,
        on_progress=statuses.append,
    )
    assert (result.done, result.failed, result.lost, result.skipped) == (6, 0, 0, 0)
    lines = read_jsonl(result.output)
    assert [line["id"] for line in lines] == [f"r{i}" for i in range(6)]
    assert [line["index"] for line in lines] == list(range(6))
    for line, seconds in zip(lines, durations, strict=True):
        whole = full_output(Item(line["id"], seconds))
        # Stitched chunks give the frames of the whole recording (a frame-wise model).
        assert line["output"]["frames"] == whole.shape[0]
        assert line["output"]["sum"] == pytest.approx(float(whole.double().sum()), abs=0.05)
    assert read_jsonl(result.failed_path) == []
    assert result.seconds == pytest.approx(sum(durations))
    assert statuses and statuses[-1].done == 6 and statuses[-1].memory
    assert result.batches >= 3 and 0 <= result.padding < 0.5
    assert os.path.exists(progress_path(tmp_path / "out.jsonl"))


def test_missing_audio_is_recorded_as_failed_and_the_rest_goes_on(tmp_path: Path) -> None:
    good = tmp_path / "good.npy"
    import numpy as np

    np.save(good, np.zeros(RATE, dtype=np.float32))
    manifest = tmp_path / "m.jsonl"
    with open(manifest, "w") as f:
        f.write(json.dumps({"id": "ok", "path": str(good), "duration": 1.0}) + "\n")
        f.write(json.dumps({"id": "gone", "path": str(tmp_path / "nope.wav"), "duration": 1.0}))
        f.write("\n{not json\n")
        f.write(json.dumps({"id": "neg", "path": str(good), "duration": -2}) + "\n")
    result = process(Frames, manifest, tmp_path / "out.jsonl", devices=["cpu"], num_workers=2)
    assert (result.done, result.failed, result.lost) == (1, 1, 0)
    assert [line["id"] for line in read_jsonl(result.output)] == ["ok"]
    (failed,) = read_jsonl(result.failed_path)
    assert failed["id"] == "gone" and "nope.wav" in failed["reason"]
    # The bad lines are reported with the file, the line and the field.
    assert result.manifest_problems == 2
    assert any(":3:" in p for p in result.problems)
    assert any(":4: duration" in p for p in result.problems)


def test_an_output_that_cannot_be_written_is_refused_before_any_work(tmp_path: Path) -> None:
    manifest = write_manifest(tmp_path / "m.jsonl", [1.0])
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(BatchingError, match="file"):
        process(Frames, manifest, blocker / "out.jsonl", loader="synthetic", devices=["cpu"])
    assert not (blocker.parent / "out.progress.db").exists()


def test_bad_arguments_name_the_argument(tmp_path: Path) -> None:
    manifest = write_manifest(tmp_path / "m.jsonl", [1.0])
    out = tmp_path / "out.jsonl"
    with pytest.raises(BatchingError, match="postprocess"):
        process(Frames, manifest, out, postprocess="words", devices=["cpu"])  # type: ignore[arg-type]
    with pytest.raises(BatchingError, match="loader"):
        process(Frames, manifest, out, loader="mp3", devices=["cpu"])  # type: ignore[arg-type]
    with pytest.raises(BatchingError, match="chunk_duration"):
        process(Frames, manifest, out, chunk_duration=0, devices=["cpu"])
    with pytest.raises(vramctl.UnknownDeviceError):
        process(Frames, manifest, out, devices=["cuda:7"])


def test_a_second_run_skips_everything_and_another_config_is_refused(tmp_path: Path) -> None:
    manifest = write_manifest(tmp_path / "m.jsonl", [1.0, 2.0, 3.0])
    out = tmp_path / "out.jsonl"
    first = process(Frames, manifest, out, loader="synthetic", devices=["cpu"])
    again = process(Frames, manifest, out, loader="synthetic", devices=["cpu"])
    assert (again.done, again.skipped, again.store_done) == (0, 3, 3)
    assert read_jsonl(again.output) == read_jsonl(first.output)
    with pytest.raises(BatchingError, match="chunk_duration"):
        process(Frames, manifest, out, loader="synthetic", devices=["cpu"], chunk_duration=5.0)


KILLED_RUN = """
import os, signal, sys, torch
from torch import nn
from vramctl.batching import PaddedDuration, process

class Frames(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv1d(1, 8, 320, stride=320)
    def forward(self, w):
        return self.conv(w.unsqueeze(1)).transpose(1, 2)

kill_after = int(sys.argv[3])
def on_progress(status):
    if kill_after and status.batches >= kill_after:
        os.kill(os.getpid(), signal.SIGKILL)   # no clean-up of any kind

r = process(Frames, sys.argv[1], sys.argv[2], loader="synthetic", budget=PaddedDuration(12.0),
            chunk_duration=6.0, devices=["cpu"], num_buckets=4, on_progress=on_progress)
print(r.done, r.skipped, r.lost)
"""


def test_a_killed_run_resumes_losing_and_repeating_nothing(tmp_path: Path) -> None:
    durations = [1.0 + (i * 7.3) % 14.0 for i in range(40)]  # some over 6 s: chunked
    manifest = write_manifest(tmp_path / "m.jsonl", durations)
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(KILLED_RUN))
    out = tmp_path / "out.jsonl"

    def run(kill_after: int, output: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(script), manifest, str(output), str(kill_after)],
            capture_output=True,
            text=True,
            timeout=240,
        )

    killed = run(5, out)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    with ProgressStore.reader(progress_path(out)) as store:
        committed = store.stats().done
    assert 0 < committed < 40
    resumed = run(0, out)
    assert resumed.returncode == 0, resumed.stderr
    done, skipped, lost = map(int, resumed.stdout.split())
    assert (done + skipped, lost) == (40, 0) and skipped == committed
    clean = run(0, tmp_path / "clean.jsonl")
    assert clean.returncode == 0, clean.stderr
    resumed_lines, clean_lines = read_jsonl(str(out)), read_jsonl(str(tmp_path / "clean.jsonl"))
    assert [line["id"] for line in resumed_lines] == [f"r{i}" for i in range(40)]
    assert resumed_lines == clean_lines  # the same outputs as a run never killed


def test_on_a_simulated_gpu_a_squeeze_is_recovered_by_the_guard(tmp_path: Path) -> None:
    manifest = write_manifest(tmp_path / "m.jsonl", [4.0 + (i % 5) for i in range(80)])
    ballast: list[torch.Tensor] = []

    with vramctl.simulate("6MiB") as gpu:

        def squeeze(status: ProcessStatus) -> None:
            if status.batches == 2 and not ballast:  # take most of what is free
                ballast.append(torch.empty(int(gpu.free_bytes * 0.8) // 4))
            if status.batches == 5 and ballast:
                ballast.clear()

        result = process(
            Frames,
            manifest,
            tmp_path / "out.jsonl",
            loader="synthetic",
            on_progress=squeeze,
            num_buckets=2,
        )
    assert result.devices[0]["device"] == gpu.id
    assert (result.done, result.failed, result.lost) == (80, 0, 0)
    assert result.batches >= 6
    assert result.ooms >= 1 and result.ooms_recovered == result.ooms
    assert result.budget["kind"] == "MemoryBudget"
    assert result.devices[0]["peak_bytes"] <= gpu.total_bytes


def test_one_item_that_fits_nowhere_on_the_gpu_runs_on_the_cpu(tmp_path: Path) -> None:
    manifest = write_manifest(tmp_path / "m.jsonl", [1.0, 8.0])
    with vramctl.simulate("300KiB"):
        result = process(
            Frames,
            manifest,
            tmp_path / "out.jsonl",
            loader="synthetic",
            budget=PaddedDuration(10.0),
        )
    assert (result.done, result.lost) == (2, 0) and result.cpu_fallbacks >= 1


def test_workers_on_several_devices_share_the_batches(tmp_path: Path) -> None:
    from vramctl.batching._outputs import Collector, default_forward, summarize
    from vramctl.batching._process import _run_parallel
    from vramctl.batching._stream import Loaded, Remaining
    from vramctl.batching._worker import Worker

    manifest = write_manifest(tmp_path / "m.jsonl", [1.0 + i % 4 for i in range(24)])
    cpu = vramctl.get_device("cpu")
    workers = [Worker(Frames, cpu, default_forward, RATE) for _ in range(3)]
    with ProgressStore(tmp_path / "p.db") as store:
        collector = Collector(store, summarize, None, RATE)
        source = Remaining(vramctl.batching.Manifest(manifest), store.completed(), 30.0, 1.0)
        sampler = vramctl.batching.BucketingSampler(source, PaddedDuration(6.0), num_buckets=2)
        audio = vramctl.batching.AudioBatches([], loader=synthesize)
        loaded = Loaded(sampler, audio, 2)
        _run_parallel(workers, loaded, collector, lambda: None)
        loaded.close()
        assert collector.done == 24 and store.stats().done == 24
    assert sum(w.batches for w in workers) == collector.batches
    assert sum(w.items for w in workers) == 24


def test_an_error_in_the_model_stops_the_run_and_keeps_what_was_committed(tmp_path: Path) -> None:
    manifest = write_manifest(tmp_path / "m.jsonl", [1.0] * 12)
    calls = 0
    broken = True

    def forward(model: nn.Module, waveforms: torch.Tensor, lengths: torch.Tensor) -> Any:
        nonlocal calls
        calls += 1
        if calls == 3 and broken:
            raise RuntimeError("a bug in the model")
        return model(waveforms)

    out = tmp_path / "out.jsonl"
    with pytest.raises(RuntimeError, match="a bug"):
        process(
            Frames,
            manifest,
            out,
            forward=forward,
            loader="synthetic",
            budget=PaddedDuration(2.0),
            devices=["cpu"],
        )
    with ProgressStore.reader(progress_path(out)) as store:
        assert store.stats().done == 4  # two batches of two, committed before the error
    broken = False  # the bug fixed; the same forward function resumes the run
    resumed = process(Frames, manifest, out, forward=forward, loader="synthetic", devices=["cpu"])
    assert (resumed.skipped, resumed.done, resumed.lost) == (4, 8, 0)


def test_a_repeated_id_is_processed_once_the_first_record_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A manifest that repeats an id: its first record is run, the later ones are skipped
    # (not run, not written) with one warning, and the run's result counts them.
    import numpy as np

    durations = [14.0, 19.0, 14.0, 2.0] + [1.0 + (i * 0.37) % 5 for i in range(20)]
    paths = {}
    for i, seconds in enumerate(durations):
        if i != 2:  # recording 2 ("x" as well) has no audio file: skipped, so never read
            np.save(tmp_path / f"{i}.npy", synthesize(Item(f"r{i}", seconds), RATE).numpy())
        paths[i] = f"{i}.npy"  # relative to the manifest's folder
    manifest = tmp_path / "m.jsonl"
    with open(manifest, "w") as f:
        for i, seconds in enumerate(durations):
            rid = "x" if i < 3 else f"r{i}"
            f.write(json.dumps({"id": rid, "path": paths[i], "duration": seconds}) + "\n")
    with caplog.at_level("WARNING", logger="vramctl.batching"):
        result = process(
            Frames,
            manifest,
            tmp_path / "out.jsonl",
            postprocess=keep,
            budget=PaddedDuration(60.0),
            chunk_duration=6.0,
            devices=["cpu"],
            num_buckets=4,
        )
    assert (result.done, result.failed, result.lost) == (len(durations) - 2, 0, 0)
    lines = read_jsonl(result.output)
    assert [line["index"] for line in lines] == [0, *range(3, len(durations))]
    assert [line["id"] for line in lines].count("x") == 1
    whole = full_output(Item("r0", durations[0]))
    assert lines[0]["output"]["frames"] == whole.shape[0]
    assert lines[0]["output"]["sum"] == pytest.approx(float(whole.double().sum()), abs=0.05)
    assert read_jsonl(result.failed_path) == []
    message = (
        f"{manifest}: 2 duplicate ids skipped (x at line 2, x at line 3); the first of each is kept"
    )
    assert (result.duplicate_ids, result.warnings) == (2, [message])
    assert result.manifest_problems == 0
    assert caplog.text.count("duplicate ids skipped") == 1  # once, though read twice
    assert result.to_dict()["duplicate_ids"] == 2


def test_truncated_audio_fails_and_another_length_is_reported_in_the_result(
    tmp_path: Path,
) -> None:
    import wave

    def wav(name: str, seconds: float) -> Path:
        path = tmp_path / name
        with wave.open(str(path), "wb") as f:
            f.setnchannels(1)
            f.setsampwidth(2)
            f.setframerate(RATE)
            f.writeframes(b"\1\0" * round(seconds * RATE))
        return path

    wav("ok.wav", 1.0)
    wav("short.wav", 1.0)  # the manifest says 3 s
    wav("long.wav", 20.0)  # the manifest says 8 s: only 8 s of chunks are read
    cut = wav("cut.wav", 2.0)
    cut.write_bytes(cut.read_bytes()[: 44 + RATE])  # half a second of its two: truncated
    records = [("ok", 1.0), ("short", 3.0), ("long", 8.0), ("cut", 2.0)]
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(
        "".join(json.dumps({"id": r, "path": f"{r}.wav", "duration": d}) + "\n" for r, d in records)
    )
    result = process(Frames, manifest, tmp_path / "out.jsonl", devices=["cpu"], chunk_duration=5.0)
    assert (result.done, result.failed, result.lost) == (3, 1, 0)
    assert [line["id"] for line in read_jsonl(result.output)] == ["ok", "short", "long"]
    (failed,) = read_jsonl(result.failed_path)
    assert failed["id"] == "cut" and "truncated" in failed["reason"]
    assert "says 2.000 s of audio, the file holds 0.500 s" in failed["reason"]
    assert result.length_mismatches == 2
    assert [w.split(":")[0] for w in result.warnings] == ["item 'short'", "item 'long'"]
    assert "the manifest says 3.00 s" in result.warnings[0] and "holds 1.00 s" in result.warnings[0]
    assert "only its first 8.00 s are processed" in result.warnings[1]
    # The run is done: a second one skips everything, the failure included.
    again = process(Frames, manifest, tmp_path / "out.jsonl", devices=["cpu"], chunk_duration=5.0)
    assert (again.skipped, again.done, again.failed, again.length_mismatches) == (4, 0, 0, 0)


def test_a_duration_too_long_to_be_real_is_recorded_as_failed_not_run(tmp_path: Path) -> None:
    # 1e300 s would make 1e299 chunks: the run would never end (or run out of memory making
    # the chunk list). It is recorded as failed, with the reason, and the rest goes on.
    manifest = write_manifest(tmp_path / "m.jsonl", [2.0, 1e300, 3.0, 1e12])

    def run() -> Any:
        return process(
            Frames,
            manifest,
            tmp_path / "out.jsonl",
            loader="synthetic",
            budget=PaddedDuration(12.0),
            chunk_duration=6.0,
            devices=["cpu"],
        )

    result = run()
    assert (result.done, result.failed, result.lost) == (2, 2, 0)
    assert [line["id"] for line in read_jsonl(result.output)] == ["r0", "r2"]
    failed = read_jsonl(result.failed_path)
    assert [f["id"] for f in failed] == ["r1", "r3"]
    assert all("chunks" in f["reason"] and "duration" in f["reason"] for f in failed)
    again = run()
    assert (again.done, again.failed, again.skipped) == (0, 0, 4)


def test_an_output_that_is_the_manifest_is_refused(tmp_path: Path) -> None:
    manifest = write_manifest(tmp_path / "m.jsonl", [1.0, 2.0])
    before = Path(manifest).read_bytes()
    for output, progress in ((manifest, None), (tmp_path / "out.jsonl", manifest)):
        with pytest.raises(BatchingError, match="manifest"):
            process(
                Frames,
                manifest,
                output,
                progress=progress,
                loader="synthetic",
                devices=["cpu"],
            )
    assert Path(manifest).read_bytes() == before
    assert not (tmp_path / "m.progress.db").exists()


def test_a_manifest_with_crlf_and_blank_lines_has_the_total_of_its_records(
    tmp_path: Path,
) -> None:
    # The progress bar's total: CRLF blank lines, runs of blank lines and lines of spaces
    # are no records (as the reader takes them), so a finished run reaches its total.
    manifest = tmp_path / "m.jsonl"
    manifest.write_bytes(
        b'\xef\xbb\xbf{"id": "a", "duration": 1.0}\r\n\r\n'
        b'{"id": "b", "duration": 2.0}\r\n\r\n\r\n  \t\r\n'
        b'{"id": "c", "duration": 1.5}\n\n\n'
        b'{"id": "d", "duration": 1.0}'
    )
    statuses: list[ProcessStatus] = []
    result = process(
        Frames,
        manifest,
        tmp_path / "out.jsonl",
        loader="synthetic",
        devices=["cpu"],
        on_progress=statuses.append,
    )
    assert (result.done, result.manifest_problems) == (4, 0)
    assert statuses[-1].total == 4 == statuses[-1].done


def test_the_reported_batch_sizes_cover_the_longest_clip_exactly() -> None:
    from vramctl.batching._budget import MemoryBudget
    from vramctl.batching._process import _budget_info

    # The longest clip, 19.295 s, would round up to 19.3 s: past the budget's last anchor.
    budget = MemoryBudget(2**30, [(5.0, 2**20, 2**20), (19.295, 2**21, 2**22)])
    sizes = _budget_info(budget, 19.295)["max_count"]
    assert list(sizes)[-1] == "19.3s"
    # Each size is taken at the exact length: a rounded 19.3 s has no finite peak (size 0).
    assert all(n > 0 for n in sizes.values()), sizes


def test_a_simulated_device_counts_the_steps_even_when_not_entered(tmp_path: Path) -> None:
    # devices=["sim:..."] without a `with` block: the steps run on it are still counted
    # (a 40 s batch of float32 audio is 2.4 MiB: it cannot fit 2 MiB in one piece).
    manifest = write_manifest(tmp_path / "m.jsonl", [4.0 + (i % 5) for i in range(10)])
    result = process(
        Frames,
        manifest,
        tmp_path / "out.jsonl",
        loader="synthetic",
        devices=["sim:2MiB"],
        budget=PaddedDuration(40.0),
        num_buckets=2,
    )
    assert (result.done, result.lost) == (10, 0)
    assert result.ooms >= 1 and result.ooms_recovered == result.ooms
    assert result.devices[0]["peak_bytes"] > 2**20


def test_several_simulated_devices_each_count_their_own_steps_and_stitch_right(
    tmp_path: Path,
) -> None:
    durations = [2.0, 25.0, 0.7, 9.3, 14.0, 3.1, 31.3, 5.5]
    manifest = write_manifest(tmp_path / "m.jsonl", durations)
    result = process(
        Frames,
        manifest,
        tmp_path / "out.jsonl",
        postprocess=keep,
        loader="synthetic",
        devices=["sim:3MiB", "sim:1MiB", "sim:8MiB"],
        budget=PaddedDuration(24.0),
        chunk_duration=10.0,
        num_buckets=3,
        order="id",
    )
    assert (result.done, result.failed, result.lost) == (8, 0, 0)
    lines = read_jsonl(result.output)
    assert [line["id"] for line in lines] == sorted(f"r{i}" for i in range(8))
    for line in lines:
        whole = full_output(Item(line["id"], durations[int(line["id"][1:])]))
        assert line["output"]["frames"] == whole.shape[0]
        assert line["output"]["sum"] == pytest.approx(float(whole.double().sum()), abs=0.05)
    devices = {d["device"]: d for d in result.devices}
    assert sum(d["items"] for d in devices.values()) >= 8
    # Each device counted its own steps (24 s of audio is 1.5 MiB: past 1 MiB in one piece).
    assert all(d["peak_bytes"] > 10_000 for d in devices.values())
    assert devices["sim:1MiB"]["ooms"] >= 1
    assert all(d["peak_bytes"] <= d["total_bytes"] for d in devices.values())


def test_the_cpu_fallback_of_a_given_module_leaves_the_devices_model_in_place() -> None:
    from vramctl.batching._worker import model_factory

    module = Frames()
    make = model_factory(module, 2)
    assert make(0) is module and make(1) is not module
    fallback = make(0)  # the CPU copy made when one item does not fit
    assert fallback is not module and fallback is not make(1)
    assert torch.equal(fallback.conv.weight, module.conv.weight)


#: wav2vec2-like framing: a 400-sample window every 320 samples (49.97 frames/s at 30 s).
OverlappingFrames = functools.partial(Frames, kernel=400, features=4)


def test_a_long_recording_through_overlapping_windows_is_stitched_in_place(
    tmp_path: Path,
) -> None:
    manifest = write_manifest(tmp_path / "m.jsonl", [300.0])
    result = process(
        OverlappingFrames,
        manifest,
        tmp_path / "out.jsonl",
        postprocess=keep,
        loader="synthetic",
        devices=["cpu"],
        chunk_duration=30.0,
    )
    assert (result.done, result.lost) == (1, 0)
    (line,) = read_jsonl(result.output)
    with torch.no_grad():
        whole = OverlappingFrames()(synthesize(Item("r0", 300.0), RATE)[None])[0]
    # Each chunk's frames land where the whole recording's do: none drift, none are missing.
    assert abs(line["output"]["frames"] - whole.shape[0]) <= 1
    assert line["output"]["sum"] == pytest.approx(float(whole.double().sum()), rel=2e-3)


def test_chunks_after_whole_clips_are_stitched_at_the_measured_rate(tmp_path: Path) -> None:
    # The first batches hold short clips only (their ratio is 49.8 frames/s); the long
    # recording's chunks come later and must still land where the whole recording's do.
    manifest = write_manifest(tmp_path / "m.jsonl", [10.0] * 4 + [300.0])
    result = process(
        OverlappingFrames,
        manifest,
        tmp_path / "out.jsonl",
        postprocess=keep,
        loader="synthetic",
        devices=["cpu"],
        chunk_duration=30.0,
        budget=PaddedDuration(30.0),  # the fourth 10 s clip closes a first batch of three
    )
    assert (result.done, result.lost) == (5, 0)
    line = read_jsonl(result.output)[-1]
    with torch.no_grad():
        whole = OverlappingFrames()(synthesize(Item("r4", 300.0), RATE)[None])[0]
    assert abs(line["output"]["frames"] - whole.shape[0]) <= 1
