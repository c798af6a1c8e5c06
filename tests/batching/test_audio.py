"""load_audio, synthesize and AudioBatches: the right samples, errors that name the item."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import wave
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import vramctl._optional
from vramctl import VramctlError
from vramctl.batching._audio import AudioBatches, AudioError, load_audio, synthesize
from vramctl.batching._chunk import Stitcher, chunk_items
from vramctl.batching._manifest import Item

SR = 16_000


def pcm(seconds: float, rate: int = SR, freq: float = 220.0, seed: int = 0) -> np.ndarray:
    """int16 samples: a tone plus noise (so that any slicing mistake shows)."""
    rng = np.random.default_rng(seed)
    t = np.arange(round(seconds * rate)) / rate
    x = 0.5 * np.sin(2 * np.pi * freq * t) + 0.05 * rng.standard_normal(t.shape[0])
    return np.round(x * 32767).astype(np.int16)


def write_wav(path: Path, samples: np.ndarray, rate: int = SR) -> Path:
    """Write int16 samples ([n] mono or [n, channels]) with the standard library."""
    channels = 1 if samples.ndim == 1 else samples.shape[1]
    with wave.open(str(path), "wb") as f:
        f.setnchannels(channels)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes(samples.astype("<i2").tobytes())
    return path


# -- load_audio ----------------------------------------------------------------------


def test_wav_round_trip_whole_and_chunk(tmp_path: Path) -> None:
    samples = pcm(3.0)
    path = write_wav(tmp_path / "a.wav", samples)
    whole = load_audio(Item("a", 3.0, path=str(path)))
    assert whole.dtype == torch.float32 and whole.shape == (48_000,)
    assert torch.equal(whole, torch.from_numpy(samples.astype(np.float32) / 32768))
    chunk = load_audio(Item("a#1", 0.5, path=str(path), offset=1.25, parent="a", chunk=1))
    assert torch.equal(chunk, whole[20_000:28_000])
    # an offset into the file alone (a Lhotse-style cut) is sliced too
    cut = load_audio(Item("cut", 0.25, path=str(path), offset=2.0))
    assert torch.equal(cut, whole[32_000:36_000])


def test_wav_reads_only_the_frames_it_needs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_wav(tmp_path / "long.wav", pcm(20.0))
    asked: list[int] = []
    real = wave.Wave_read.readframes

    def readframes(self: wave.Wave_read, n: int) -> bytes:
        asked.append(n)
        return real(self, n)

    monkeypatch.setattr(wave.Wave_read, "readframes", readframes)
    out = load_audio(Item("x#3", 0.5, path=str(path), offset=15.0, parent="x", chunk=3))
    # The header's last frame (is the file whole?), then the chunk's frames.
    assert out.shape == (8_000,) and asked == [1, 8_000]


def test_wav_stereo_is_averaged_and_other_rates_resampled(tmp_path: Path) -> None:
    left, right = pcm(1.0, seed=1), pcm(1.0, freq=330.0, seed=2)
    path = write_wav(tmp_path / "st.wav", np.stack([left, right], axis=1))
    out = load_audio(Item("st", 1.0, path=str(path)))
    expected = (left.astype(np.float32) + right.astype(np.float32)) / 2 / 32768
    torch.testing.assert_close(out, torch.from_numpy(expected), atol=1e-6, rtol=0)

    t8 = np.arange(8_000) / 8_000
    slow = np.round(0.5 * np.sin(2 * np.pi * 50 * t8) * 32767).astype(np.int16)  # 50 Hz at 8 kHz
    path = write_wav(tmp_path / "8k.wav", slow, rate=8_000)
    up = load_audio(Item("8k", 1.0, path=str(path)), sample_rate=SR)
    assert up.shape == (16_000,)
    t16 = (np.arange(16_000) + 0.5) / 16_000 - 0.5 / 8_000  # interpolate's sample positions
    ref = torch.from_numpy(0.5 * np.sin(2 * np.pi * 50 * t16)).float()
    assert (up - ref)[4:-4].abs().max() < 2e-3  # approximate: linear interpolation
    chunk = load_audio(Item("8k#0", 0.5, path=str(path), offset=0.5, parent="8k"), sample_rate=SR)
    assert chunk.shape == (8_000,)


def test_npy_memory_mapped_with_offset(tmp_path: Path) -> None:
    data = np.arange(32_000, dtype=np.float32) / 32_000
    path = tmp_path / "a.npy"
    np.save(path, data)
    whole = load_audio(Item("a", 2.0, path=str(path)))
    assert torch.equal(whole, torch.from_numpy(data))
    part = load_audio(Item("a#2", 0.75, path=str(path), offset=1.0, parent="a", chunk=2))
    assert torch.equal(part, torch.from_numpy(data[16_000:28_000]))
    np.save(tmp_path / "b.npy", np.zeros((2, 100), dtype=np.float32))
    with pytest.raises(AudioError, match=r"'b'.*1-D"):
        load_audio(Item("b", 1.0, path=str(tmp_path / "b.npy")))


def test_missing_file_names_item_and_path(tmp_path: Path) -> None:
    path = tmp_path / "nowhere" / "gone.wav"
    with pytest.raises(AudioError) as info:
        load_audio(Item("utt-42", 1.0, path=str(path)))
    err = info.value
    assert isinstance(err, OSError) and isinstance(err, VramctlError)
    assert "utt-42" in str(err) and str(path) in str(err)
    with pytest.raises(AudioError, match=r"'bare'.*neither data nor a path"):
        load_audio(Item("bare", 1.0))


def test_other_formats_need_soundfile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "a.flac"
    path.write_bytes(b"not really flac")
    monkeypatch.setattr(vramctl._optional, "find_spec", lambda name: None)
    with pytest.raises(AudioError, match=r"'a'.*a\.flac.*soundfile"):
        load_audio(Item("a", 1.0, path=str(path)))


def test_soundfile_reads_flac_chunks(tmp_path: Path) -> None:
    soundfile = pytest.importorskip("soundfile")
    samples = pcm(2.0, rate=8_000)
    path = tmp_path / "a.flac"
    soundfile.write(str(path), samples, 8_000, subtype="PCM_16")
    whole = load_audio(Item("a", 2.0, path=str(path)), sample_rate=8_000)
    torch.testing.assert_close(whole, torch.from_numpy(samples / 32768).float())
    part = load_audio(Item("a#1", 0.5, path=str(path), offset=1.0, parent="a"), sample_rate=8_000)
    assert torch.equal(part, whole[8_000:12_000])
    resampled = load_audio(Item("a", 2.0, path=str(path)), sample_rate=SR)
    assert resampled.shape == (32_000,)
    (tmp_path / "bad.ogg").write_bytes(b"garbage")
    with pytest.raises(AudioError, match=r"'bad'.*bad\.ogg"):
        load_audio(Item("bad", 1.0, path=str(tmp_path / "bad.ogg")))


def test_in_memory_data() -> None:
    t = torch.linspace(-1, 1, 16_000)
    assert torch.equal(load_audio(Item("t", 1.0, data=t)), t)
    chunk = Item("t#1", 0.25, offset=0.5, data=t, parent="t", chunk=1)
    assert torch.equal(load_audio(chunk), t[8_000:12_000])
    arr = (np.arange(16_000) % 100).astype(np.int16)
    got = load_audio(Item("n#0", 0.5, data=arr, parent="n"))
    assert torch.equal(got, torch.from_numpy(arr[:8_000].astype(np.float32) / 32768))
    assert load_audio(Item("f", 1.0, data=np.ones(10, dtype=np.float64))).dtype == torch.float32
    with pytest.raises(AudioError, match=r"'m'.*1-D"):
        load_audio(Item("m", 1.0, data=torch.zeros(2, 10)))
    with pytest.raises(AudioError, match=r"'o#5'.*outside"):
        load_audio(Item("o#5", 1.0, offset=3.0, data=t, parent="o"))
    with pytest.raises(AudioError, match="sample_rate"):
        load_audio(Item("t", 1.0, data=t), sample_rate=0)


# -- synthesize ----------------------------------------------------------------------


def test_synthesize_is_deterministic_and_item_specific() -> None:
    a = synthesize(Item("utt", 2.5))
    assert a.shape == (40_000,) and a.dtype == torch.float32
    assert a.abs().max() <= 1.0 and a.std() > 0.05
    assert torch.equal(a, synthesize(Item("utt", 2.5)))
    assert not torch.allclose(a, synthesize(Item("utt", 2.5), seed=1))
    assert not torch.allclose(a, synthesize(Item("utt2", 2.5)))
    assert synthesize(Item("utt", 1.0, path="ignored.wav"), sample_rate=8_000).shape == (8_000,)


def test_synthesize_does_not_depend_on_pythons_hash_seed() -> None:
    code = (
        "from vramctl.batching._audio import synthesize; "
        "from vramctl.batching._manifest import Item; "
        "print(repr(synthesize(Item('utt', 0.5)).double().sum().item()))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    here = synthesize(Item("utt", 0.5)).double().sum().item()
    assert math.isclose(float(out.stdout), here, rel_tol=0, abs_tol=1e-6)


def test_synthesized_chunk_is_the_slice_of_its_recording() -> None:
    parent = Item("long", 47.3, offset=4.0)
    whole = synthesize(parent)
    chunks = list(chunk_items([parent], max_duration=10.0, overlap=1.0))
    assert len(chunks) == 6
    for c in chunks:
        lo = round((c.offset - 4.0) * SR)
        got = synthesize(c)
        assert got.shape[0] == round((c.offset - 4.0 + c.duration) * SR) - lo
        torch.testing.assert_close(got, whole[lo : lo + got.shape[0]], atol=1e-6, rtol=0)
    with pytest.raises(AudioError, match="parent_duration"):
        synthesize(Item("x#0", 1.0, parent="x"))


# -- AudioBatches --------------------------------------------------------------------


def make_items(tmp_path: Path) -> tuple[list[list[Item]], set[str]]:
    """Seven batches of mixed sources; two items point at missing files."""
    write_wav(tmp_path / "w.wav", pcm(4.0))
    batches: list[list[Item]] = []
    missing = set()
    for b in range(7):
        batch = []
        for j in range(3):
            k = 3 * b + j
            if k % 8 == 5:
                batch.append(Item(f"i{k}", 1.0, path=str(tmp_path / f"gone{k}.wav"), index=k))
                missing.add(f"i{k}")
            elif k % 2:
                data = torch.full((8_000 + 1600 * j,), float(k))
                batch.append(Item(f"i{k}", 0.5 + 0.1 * j, data=data, index=k))
            else:
                wav = str(tmp_path / "w.wav")
                batch.append(Item(f"i{k}", 0.25, path=wav, index=k, offset=0.25 * j, parent="w"))
        batches.append(batch)
    return batches, missing


def check_batches(out: list[dict[str, Any]], batches: list[list[Item]], missing: set[str]) -> None:
    assert len(out) == len(batches)
    for got, want in zip(out, batches, strict=True):
        items = got["items"]
        errors = got["errors"]
        assert isinstance(items, list) and isinstance(errors, list)
        assert [i.id for i in items] == [i.id for i in want if i.id not in missing]  # in order
        assert [i.id for i, _ in errors] == [i.id for i in want if i.id in missing]
        for item, message in errors:
            assert item.id in message and "gone" in message
        waveforms, lengths = got["waveforms"], got["lengths"]
        assert isinstance(waveforms, torch.Tensor) and isinstance(lengths, torch.Tensor)
        assert lengths.dtype == torch.int64 and waveforms.dtype == torch.float32
        assert waveforms.shape == (len(items), int(lengths.max()) if len(items) else 0)
        for row, item in enumerate(items):
            n = int(lengths[row])
            assert torch.equal(waveforms[row, :n], load_audio(item))
            assert not waveforms[row, n:].any()  # zero padding


def test_audio_batches_pad_and_report_errors(tmp_path: Path) -> None:
    batches, missing = make_items(tmp_path)
    assert missing == {"i5", "i13"}
    out = list(AudioBatches(batches))
    check_batches(out, batches, missing)
    assert out[0]["lengths"].tolist() == [4_000, 9_600, 4_000]


def test_audio_batches_with_dataloader_workers_in_order(tmp_path: Path) -> None:
    batches, missing = make_items(tmp_path)
    loader = DataLoader(AudioBatches(batches), batch_size=None, num_workers=2)
    out = list(loader)
    check_batches(out, batches, missing)
    seen = [i.id for b in out for i in b["items"]] + [i.id for b in out for i, _ in b["errors"]]
    everything = [i.id for b in batches for i in b]
    assert sorted(seen) == sorted(everything) and len(seen) == len(set(seen))  # exactly once


def test_loader_output_that_is_not_a_waveform_is_reported() -> None:
    def bad_loader(item: Item, sample_rate: int) -> torch.Tensor:
        return torch.zeros(2, 3) if item.id == "b" else torch.ones(5)

    out = next(iter(AudioBatches([[Item("a", 1.0), Item("b", 1.0)]], loader=bad_loader)))
    assert [i.id for i in out["items"]] == ["a"]
    assert out["errors"][0][0].id == "b" and "(2, 3)" in out["errors"][0][1]
    empty = AudioBatches([[]]).collate([])
    assert empty["waveforms"].shape == (0, 0) and empty["lengths"].shape == (0,)


def test_chunked_recording_end_to_end_with_workers(tmp_path: Path) -> None:
    """Chunk a wav, load the chunks in DataLoader workers, run a model, stitch: the whole output."""
    samples = pcm(23.537, seed=4)
    path = str(write_wav(tmp_path / "rec.wav", samples))
    rec = Item("rec", 23.537, path=path)
    chunks = list(chunk_items([rec], max_duration=5.0, overlap=0.5, align=0.02))
    batches = [chunks[i : i + 2] for i in range(0, len(chunks), 2)]

    def model(w: torch.Tensor) -> torch.Tensor:  # frame-wise: 20 ms frame means
        return w[: w.shape[0] // 320 * 320].reshape(-1, 320).mean(1)

    stitcher = Stitcher(50.0)
    done = []
    for batch in DataLoader(AudioBatches(batches), batch_size=None, num_workers=2):
        assert not batch["errors"]
        for row, item in enumerate(batch["items"]):
            done += stitcher.add(item, model(batch["waveforms"][row, : batch["lengths"][row]]))
    assert [rid for rid, _ in done] == ["rec"]
    assert torch.equal(done[0][1], model(load_audio(rec)))


# -- truncated files, and audio of another length than the manifest says --------------


def test_a_truncated_wav_is_an_error_not_a_short_waveform(tmp_path: Path) -> None:
    whole = write_wav(tmp_path / "whole.wav", pcm(2.0))
    data = whole.read_bytes()
    cut = tmp_path / "cut.wav"
    cut.write_bytes(data[: len(data) // 2 + 1])  # a copy cut short, mid-frame
    item = Item("cut", 2.0, path=str(cut))
    with pytest.raises(AudioError, match=r"'cut'.*cut\.wav.*truncated.*says 2\.000 s.*holds 0\.99"):
        load_audio(item)
    # Even where only its intact first part is asked for (a chunk): the file is damaged.
    with pytest.raises(AudioError, match="truncated"):
        load_audio(Item("cut#0", 0.5, path=str(cut), parent="cut"))
    # In a batch it is reported in "errors" with the reason; the other item loads.
    batch = AudioBatches([]).collate([item, Item("whole", 2.0, path=str(whole))])
    assert [i.id for i in batch["items"]] == ["whole"] and batch["lengths"].tolist() == [32_000]
    assert [(i.id, "truncated" in why) for i, why in batch["errors"]] == [("cut", True)]


def test_a_truncated_wav_read_by_soundfile_is_an_error(tmp_path: Path) -> None:
    soundfile = pytest.importorskip("soundfile")
    path = tmp_path / "float.wav"  # 32-bit float: the wave module does not read it
    soundfile.write(str(path), np.zeros(SR, dtype=np.float32), SR, subtype="FLOAT")
    assert load_audio(Item("f", 1.0, path=str(path))).shape == (SR,)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - SR])  # a quarter of the samples gone
    # libsndfile reads the frames the file holds without a word: the header is checked.
    assert soundfile.info(str(path)).frames == SR * 3 // 4
    with pytest.raises(AudioError, match=r"'f'.*truncated.*says 1\.000 s.*holds 0\.750 s"):
        load_audio(Item("f", 1.0, path=str(path)))


def test_audio_of_another_length_than_declared_is_loaded_and_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = str(write_wav(tmp_path / "a.wav", pcm(1.0)))
    items = [
        Item("short", 2.0, path=path),  # the file holds half of what the manifest says
        Item("long", 0.5, path=path),  # twice
        Item("close", 1.05, path=path),  # within 0.1 s: a manifest's rounding
        Item("seg", 0.4, path=path, offset=0.5),  # a part of a longer file: fine
        Item("late", 0.9, path=path, offset=0.5),  # a part that runs past the file's end
        Item("mem", 3.0, data=torch.zeros(SR)),
    ]
    with caplog.at_level("WARNING", logger="vramctl.batching"):
        batch = AudioBatches([]).collate(items)
    assert [i.id for i in batch["items"]] == [i.id for i in items]  # all loaded, as read
    assert batch["lengths"].tolist() == [SR, SR, SR, 6_400, 8_000, SR]
    notes = {i.id: why for i, why in batch["warnings"]}
    assert sorted(notes) == ["late", "long", "mem", "short"]
    assert notes["short"] == (
        f"item 'short': the manifest says 2.00 s, {path!r} holds 1.00 s (the whole file is"
        " processed)"
    )
    assert "the manifest says 0.50 s" in notes["long"] and "holds 1.00 s" in notes["long"]
    assert "from 0.5 s on, 0.50 s (it is read up to the file's end)" in notes["late"]
    assert "its data holds 1.00 s" in notes["mem"]
    assert [r.getMessage() for r in caplog.records] == [batch["warnings"][k][1] for k in range(4)]


def test_a_chunked_recording_is_checked_once_against_its_whole_file(tmp_path: Path) -> None:
    path = str(write_wav(tmp_path / "long.wav", pcm(25.0)))
    longer = list(chunk_items([Item("r", 12.0, path=path, index=0)], max_duration=5.0))
    shorter = list(chunk_items([Item("s", 40.0, path=path, index=1)], max_duration=5.0))
    batch = AudioBatches([]).collate(longer + shorter)
    notes = [(i.id, why) for i, why in batch["warnings"]]
    assert [i for i, _ in notes] == ["r#0", "s#0"]  # once per recording, by its first chunk
    assert "item 'r': the manifest says 12.00 s" in notes[0][1]
    assert "holds 25.00 s (only its first 12.00 s are processed)" in notes[0][1]
    assert "item 's': the manifest says 40.00 s" in notes[1][1] and "25.00 s" in notes[1][1]
    # The chunks of "s" past the file's end fail, naming the offset; none is dropped silently.
    assert {i.id for i, _ in batch["errors"]} == {c.id for c in shorter if c.offset >= 25.0}


def test_a_loader_of_your_own_is_checked_by_the_waveform_it_gives() -> None:
    def half(item: Item, rate: int) -> torch.Tensor:
        return torch.zeros(round(item.duration * rate / 2))

    batch = AudioBatches([], loader=half).collate([Item("a", 4.0), Item("b", 0.1)])
    assert [(i.id, why) for i, why in batch["warnings"]] == [
        ("a", "item 'a': the manifest says 4.00 s, the audio loaded is 2.00 s (the whole file"
         " is processed)")
    ]  # fmt: skip
    synthetic = AudioBatches([], loader=synthesize).collate([Item("a", 4.0), Item("b", 0.1)])
    assert synthetic["warnings"] == []


def test_length_warnings_are_logged_a_few_times_then_only_listed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = str(write_wav(tmp_path / "a.wav", pcm(0.5)))
    audio = AudioBatches([])
    with caplog.at_level("WARNING", logger="vramctl.batching"):
        batches = [
            audio.collate([Item(f"i{b}{k}", 3.0, path=path) for k in range(4)]) for b in range(5)
        ]
    assert sum(len(b["warnings"]) for b in batches) == 20
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 6 and "not logged one by one" in messages[-1]
