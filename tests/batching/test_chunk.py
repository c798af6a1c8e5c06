"""chunk_items and Stitcher: windows that cover each recording, outputs stitched back whole."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from torch import nn

from vramctl import VramctlError
from vramctl.batching._adaptive import BatchingError
from vramctl.batching._audio import load_audio
from vramctl.batching._chunk import Stitcher, chunk_count, chunk_items
from vramctl.batching._manifest import Item

SR = 16_000
HOP = 320  # samples per frame: 20 ms, 50 frames/s
FRAME_RATE = SR / HOP


def windows(item: Item, **kw: float) -> list[tuple[float, float]]:
    return [(c.offset, c.duration) for c in chunk_items([item], **kw)]


def check_cover(item: Item, chunks: list[Item], max_duration: float, overlap: float) -> None:
    """The invariants every chunking must keep."""
    d = item.duration
    shortest = max(2 * overlap, 0.1 * max_duration)
    assert len(chunks) == chunk_count(d, max_duration, overlap)
    assert chunks[0].offset == item.offset
    assert math.isclose(chunks[-1].offset + chunks[-1].duration, item.offset + d, abs_tol=1e-9)
    for k, c in enumerate(chunks):
        assert c.id == f"{item.id}#{k}" and c.parent == item.id and c.chunk == k
        assert c.path == item.path and c.index == item.index and c.data is item.data
        assert c.extra is not None and c.extra["chunks"] == len(chunks)
        assert c.extra["parent_duration"] == d and c.extra["parent_offset"] == item.offset
        assert c.extra["speaker"] == "s1"  # the item's own extra entries are kept
        assert c.duration <= max_duration + 1e-9
        assert c.duration >= shortest - 1e-9, (d, k, c.duration)
    for a, b in itertools.pairwise(chunks):
        assert b.offset > a.offset  # in order, each adds audio of its own
        assert b.offset + b.duration > a.offset + a.duration
        assert a.offset + a.duration - b.offset >= overlap - 1e-9  # overlap at least `overlap`


# -- chunk_items ---------------------------------------------------------------------


def test_short_items_pass_through_unchanged() -> None:
    items = [Item("a", 3.0, path="a.wav", index=0), Item("b", 10.0, index=1, offset=2.0)]
    out = list(chunk_items(items, max_duration=10.0, overlap=1.0))
    assert out[0] is items[0] and out[1] is items[1]  # == max_duration is not chunked
    assert chunk_count(10.0, 10.0, 1.0) == 1


def test_long_item_windows_overlap_and_cover() -> None:
    item = Item("rec", 25.0, path="r.wav", index=7, offset=3.0, extra={"speaker": "s1"})
    chunks = list(chunk_items([item], max_duration=10.0, overlap=1.0))
    assert [(c.offset, c.duration) for c in chunks] == [(3.0, 10.0), (12.0, 10.0), (21.0, 7.0)]
    check_cover(item, chunks, 10.0, 1.0)
    assert item.extra == {"speaker": "s1"}  # the original's extra is not modified


def test_exact_multiple_gives_full_windows_only() -> None:
    # 28 s = 3 windows of 10 s stepping 9 s: no extra sliver of a window at the end
    assert windows(Item("a", 28.0), max_duration=10.0, overlap=1.0) == [
        (0.0, 10.0),
        (9.0, 10.0),
        (18.0, 10.0),
    ]
    assert windows(Item("a", 30.0), max_duration=10.0, overlap=0.0) == [
        (0.0, 10.0),
        (10.0, 10.0),
        (20.0, 10.0),
    ]


def test_tiny_remainder_moves_the_last_window_back() -> None:
    # 28.5 s: a 4th window at 27 s would be 1.5 s (< 2 * overlap): it starts at 26.5 s instead
    w = windows(Item("a", 28.5), max_duration=10.0, overlap=1.0)
    assert w == [(0.0, 10.0), (9.0, 10.0), (18.0, 10.0), (26.5, 2.0)]
    # no overlap: a 0.2 s sliver becomes 1 s (0.1 * max_duration)
    w = windows(Item("a", 30.2), max_duration=10.0, overlap=0.0)
    assert [(round(s, 6), round(d, 6)) for s, d in w][-1] == (29.2, 1.0)
    # just over max_duration: two windows, the second at least the minimum
    w = windows(Item("a", 10.05), max_duration=10.0, overlap=1.0)
    assert len(w) == 2 and math.isclose(w[1][1], 2.0) and math.isclose(sum(w[1]), 10.05)


def test_invariants_over_many_durations() -> None:
    rng = random.Random(5)
    for _ in range(400):
        max_duration = rng.choice([4.0, 10.0, 30.0, 7.3])
        overlap = rng.choice([0.0, 0.5, 1.0, max_duration * 0.45])
        d = rng.uniform(max_duration * 1.0001, max_duration * 12)
        item = Item("x", d, offset=rng.choice([0.0, 12.25]), extra={"speaker": "s1"})
        chunks = list(chunk_items([item], max_duration=max_duration, overlap=overlap))
        check_cover(item, chunks, max_duration, overlap)


def test_align_keeps_every_start_on_the_grid() -> None:
    rng = random.Random(1)
    for _ in range(200):
        d = rng.uniform(10.01, 95.0)
        item = Item("x", d, extra={"speaker": "s1"})
        chunks = list(chunk_items([item], max_duration=10.0, overlap=1.0, align=0.02))
        check_cover(item, chunks, 10.0, 1.0)
        for c in chunks:
            assert abs(c.offset / 0.02 - round(c.offset / 0.02)) < 1e-6


def test_streams_lazily() -> None:
    def endless() -> object:
        k = 0
        while True:
            yield Item(f"i{k}", 25.0)
            k += 1

    out = chunk_items(endless(), max_duration=10.0)  # type: ignore[arg-type]
    assert [next(out).id for _ in range(4)] == ["i0#0", "i0#1", "i0#2", "i1#0"]


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"max_duration": 0.0}, "max_duration"),
        ({"max_duration": -3.0}, "max_duration"),
        ({"max_duration": float("nan")}, "max_duration"),
        ({"max_duration": "10"}, "max_duration"),
        ({"max_duration": 10.0, "overlap": -0.5}, "overlap"),
        ({"max_duration": 10.0, "overlap": 5.0}, "half of max_duration"),
        ({"max_duration": 10.0, "overlap": 1.0, "align": 0.3}, "multiple of align"),
        ({"max_duration": 10.0, "overlap": 1.0, "align": 0.0}, "align"),
    ],
)
def test_bad_arguments_raise(kw: dict[str, object], words: str) -> None:
    with pytest.raises(BatchingError, match=words) as info:
        list(chunk_items([Item("a", 30.0)], **kw))  # type: ignore[arg-type]
    assert isinstance(info.value, VramctlError)
    with pytest.raises(BatchingError, match=words):
        chunk_count(30.0, kw["max_duration"], kw.get("overlap", 1.0), kw.get("align"))  # type: ignore[arg-type]


def test_infinite_duration_raises_instead_of_looping() -> None:
    with pytest.raises(BatchingError, match=r"'inf'.*finite"):
        list(chunk_items([Item("inf", math.inf)], max_duration=10.0))


# -- Stitcher ------------------------------------------------------------------------


def framewise(wave: torch.Tensor) -> torch.Tensor:
    """A purely frame-wise model: mean and energy of each 20 ms frame, [frames, 2]."""
    frames = wave[: wave.shape[0] // HOP * HOP].reshape(-1, HOP)
    return torch.stack([frames.mean(1), frames.pow(2).mean(1)], dim=1)


class ConvNet(nn.Module):
    """wav2vec2-like: a strided conv to 50 frames/s, then convs with a few frames of context."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.features = nn.Conv1d(1, 8, kernel_size=400, stride=HOP)
        self.context = nn.Sequential(
            nn.GELU(), nn.Conv1d(8, 8, 5, padding=2), nn.GELU(), nn.Conv1d(8, 4, 3, padding=1)
        )

    def forward(self, wave: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.context(self.features(wave[None, None]))
        return out[0].T  # [frames, 4]


def recording(seconds: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(round(seconds * SR)) / SR
    return torch.sin(2 * math.pi * 3.0 * t) + 0.3 * torch.randn(t.shape[0], generator=g)


def run_chunks(
    items: list[Item], model: object, *, max_duration: float, overlap: float, seed: int
) -> dict[str, torch.Tensor]:
    """Chunk, run the model on each chunk (shuffled order), stitch: recording id -> output."""
    chunks = list(chunk_items(items, max_duration=max_duration, overlap=overlap, align=1 / 50))
    random.Random(seed).shuffle(chunks)
    stitcher = Stitcher(FRAME_RATE)
    done: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for c in chunks:
            for rid, out in stitcher.add(c, model(load_audio(c, SR))):  # type: ignore[operator]
                assert rid not in done
                done[rid] = out
    assert stitcher.pending() == 0
    return done


def test_framewise_model_stitched_equals_whole_exactly() -> None:
    durations = [3.3, 10.0, 23.537, 28.0, 28.51, 41.006]
    items = [Item(f"r{i}", d, data=recording(d, i)) for i, d in enumerate(durations)]
    done = run_chunks(items, framewise, max_duration=10.0, overlap=1.0, seed=3)
    assert sorted(done) == sorted(i.id for i in items)
    for item in items:
        whole = framewise(item.data)
        assert abs(whole.shape[0] - round(item.duration * FRAME_RATE)) <= 1
        assert torch.equal(done[item.id], whole), item.id


def test_conv_model_with_context_matches_whole_recording() -> None:
    model = ConvNet().eval()
    durations = [12.345, 27.0, 33.71]
    items = [Item(f"c{i}", d, data=recording(d, 10 + i)) for i, d in enumerate(durations)]
    done = run_chunks(items, model, max_duration=8.0, overlap=1.0, seed=4)
    for item in items:
        with torch.no_grad():
            whole = model(item.data)
        got = done[item.id]
        assert got.shape == whole.shape
        torch.testing.assert_close(got, whole, atol=1e-5, rtol=1e-5)


def test_naive_concatenation_would_not_match() -> None:
    """The check above can fail: keeping each chunk's frames up to its end misplaces them."""
    item = Item("n", 20.0, data=recording(20.0, 7))
    chunks = list(chunk_items([item], max_duration=8.0, overlap=1.0))
    naive = torch.cat([framewise(load_audio(c, SR)) for c in chunks])
    assert naive.shape[0] > framewise(item.data).shape[0]  # overlaps counted twice


def test_frames_land_at_their_time_for_any_duration() -> None:
    """Without align: each stitched frame is within half a frame of its place in time."""
    rate = 50.0
    rng = random.Random(9)
    stitcher = Stitcher(rate)
    for n in range(150):
        d = rng.uniform(0.5, 70.0)
        chunks = list(chunk_items([Item(f"t{n}", d, offset=5.0)], max_duration=9.0, overlap=1.5))
        rng.shuffle(chunks)
        done = []
        for c in chunks:
            # output: the time (in the recording) of each of the chunk's frames
            local = torch.arange(round(c.duration * rate), dtype=torch.float64) / rate
            done += stitcher.add(c, (c.offset - 5.0) + local)
        assert len(done) == 1 and done[0][0] == f"t{n}"
        got = done[0][1]
        assert abs(got.shape[0] - round(d * rate)) <= 1
        expected = torch.arange(got.shape[0], dtype=torch.float64) / rate
        assert (got - expected).abs().max().item() <= 0.5 / rate + 1e-9
    assert stitcher.pending() == 0


def test_recordings_complete_when_their_last_chunk_arrives() -> None:
    items = [Item("a", 25.0), Item("b", 5.0), Item("c", 19.0)]
    chunks = list(chunk_items(items, max_duration=10.0, overlap=1.0))
    order = [chunks[i] for i in (2, 4, 3, 0, 5, 1)]  # a#2 c#0 b c#1... shuffled across batches
    assert [c.id for c in order] == ["a#2", "c#0", "b", "a#0", "c#1", "a#1"]
    stitcher = Stitcher(10.0)
    completed = []
    for c in order:
        out = stitcher.add(c, torch.zeros(round(c.duration * 10), 3))
        completed.append([rid for rid, _ in out])
        if c.id == "c#0":
            assert stitcher.pending() == 2
    assert completed == [[], [], ["b"], [], ["c"], ["a"]]
    assert stitcher.pending() == 0


def test_recordings_that_share_an_id_are_stitched_apart() -> None:
    # A manifest may repeat an id: its recordings are told apart by their manifest index, and
    # their chunks, arriving interleaved, are neither mixed nor refused as added twice.
    items = [Item("x", 25.0, index=0), Item("x", 19.0, index=1)]
    chunks = list(chunk_items(items, max_duration=10.0, overlap=1.0))
    order = sorted(chunks, key=lambda c: (c.chunk, c.index))  # x#0, x#0, x#1, x#1, x#2
    stitcher = Stitcher(10.0)
    done = []
    for c in order:
        frames = torch.arange(round(c.offset * 10), round((c.offset + c.duration) * 10))
        done += [
            (rid, len(t), torch.equal(t, torch.arange(len(t))))
            for rid, t in stitcher.add(c, frames)
        ]
    assert sorted(done) == [("x", 190, True), ("x", 250, True)]
    assert stitcher.pending() == 0
    stitcher.add(chunks[0], torch.zeros(100))
    stitcher.add(chunks[3], torch.zeros(100))
    assert stitcher.discard("x", index=1) and stitcher.pending() == 1
    assert stitcher.discard("x") and stitcher.pending() == 0


def test_stitcher_rejects_bad_input() -> None:
    with pytest.raises(BatchingError, match="frame_rate"):
        Stitcher(0.0)
    with pytest.raises(BatchingError, match="frame_rate"):
        Stitcher(float("inf"))
    stitcher = Stitcher(50.0)
    chunks = list(chunk_items([Item("a", 25.0)], max_duration=10.0))
    stitcher.add(chunks[0], torch.zeros(500))
    with pytest.raises(BatchingError, match="added twice"):
        stitcher.add(chunks[0], torch.zeros(500))
    with pytest.raises(BatchingError, match="time on dim 0"):
        stitcher.add(chunks[1], torch.tensor(1.0))
    bare = Item("z#0", 10.0, parent="z", chunk=0)
    with pytest.raises(BatchingError, match=r"extra\['chunks'\]"):
        stitcher.add(bare, torch.zeros(500))
    assert stitcher.pending() == 1
