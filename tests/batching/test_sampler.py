"""Manifests, budgets and the bucketing sampler: hard budgets, nothing lost, exact resume."""

from __future__ import annotations

import csv
import json
import random
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import vramctl
from vramctl.batching import (
    Batch,
    BatchingError,
    BucketingSampler,
    Budget,
    Item,
    Manifest,
    ManifestError,
    MemoryBudget,
    PaddedDuration,
    QuadraticDuration,
    duration_edges,
)
from vramctl.estimator._target import run_target


def _lengths(n: int, seed: int = 0) -> list[float]:
    """LibriSpeech-like clip lengths: most 10-17 s, a tail down to 1 s and up to 25 s."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        d = rng.gauss(13.5, 3.0) if rng.random() < 0.85 else rng.uniform(1.0, 25.0)
        out.append(round(min(25.0, max(1.0, d)), 3))
    return out


def _items(n: int, seed: int = 0) -> list[Item]:
    return [Item(f"u{i}", d, index=i) for i, d in enumerate(_lengths(n, seed))]


# -- manifests -----------------------------------------------------------------------


def test_jsonl_and_csv_manifests_stream_the_same_items(tmp_path: Path) -> None:
    lengths = _lengths(50)
    jl, cs = tmp_path / "m.jsonl", tmp_path / "m.csv"
    with jl.open("w") as f:
        for i, d in enumerate(lengths):
            f.write(json.dumps({"id": f"u{i}", "audio_filepath": f"a/{i}.wav", "duration": d}))
            f.write("\n")
    with cs.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["utterance_id", "num_samples"])
        for i, d in enumerate(lengths):
            w.writerow([f"u{i}", round(d * 16000)])
    a, b = list(Manifest(jl)), list(Manifest(cs))
    assert [i.id for i in a] == [i.id for i in b] == [f"u{i}" for i in range(50)]
    assert [i.duration for i in a] == pytest.approx([i.duration for i in b], abs=1e-4)
    assert a[3].path == str(tmp_path / "a" / "3.wav")  # relative to the manifest's folder
    assert b[0].path is None


def test_bad_lines_are_reported_with_file_line_and_field_and_reading_goes_on(
    tmp_path: Path,
) -> None:
    p = tmp_path / "m.jsonl"
    p.write_text(
        "\n".join(
            [
                json.dumps({"id": "a", "duration": 2.0}),
                "{not json",
                json.dumps({"id": "b"}),
                json.dumps({"id": "c", "duration": -1}),
                json.dumps({"duration": 3.0}),
                json.dumps({"id": "d", "duration": 0}),
                json.dumps([1, 2]),
                json.dumps({"id": "e", "duration": 4.0, "text": "hello"}),
            ]
        )
        + "\n"
    )
    m = Manifest(p)
    got = list(m)
    assert [(i.id, i.index) for i in got] == [("a", 0), ("e", 7)]
    assert got[1].extra == {"text": "hello"}
    found = [(q.line, q.field) for q in m.problems]
    assert found == [(2, None), (3, "duration"), (4, "duration"), (5, "id"), (6, "duration"),
                     (7, None)]  # fmt: skip
    assert m.skipped == 6
    assert str(m.problems[2]).startswith(f"{p}:4: duration: must be positive")


def test_blank_lines_crlf_and_bad_bytes_in_json_lines(tmp_path: Path) -> None:
    p = tmp_path / "m.jsonl"
    p.write_bytes(
        b'{"id": "a", "duration": 1.5}\r\n'
        b"\n"
        b"   \t\n"
        b'{"id": "b\xff", "duration": 2.0}\n'
        b'{"id": "c\xc3\xa9", "duration": 3.0}'  # UTF-8, and no newline at the end
    )
    m = Manifest(p)
    got = list(m)
    # Blank lines are not records; a line that is not UTF-8 is reported, not fatal.
    assert [(i.id, i.index, i.duration) for i in got] == [("a", 0, 1.5), ("c\u00e9", 2, 3.0)]
    assert [(q.line, q.field) for q in m.problems] == [(4, None)]
    assert "not valid JSON" in m.problems[0].message


def test_a_csv_line_that_is_not_utf8_is_reported_and_reading_goes_on(tmp_path: Path) -> None:
    p = tmp_path / "m.csv"
    p.write_bytes(b"id,duration\na,1.5\nb\xff,2.0\nc\xc3\xa9,3.0\n")
    m = Manifest(p)
    assert [(i.id, i.index) for i in m] == [("a", 0), ("c\u00e9", 2)]
    assert [(q.line, q.message) for q in m.problems] == [(3, "not valid UTF-8")]


def test_a_byte_order_mark_does_not_cost_the_first_record(tmp_path: Path) -> None:
    # Editors on Windows start UTF-8 files with a BOM: it is not part of the first record
    # (JSON Lines) or of the first column's name (CSV: else every row lacks its id).
    jl, cs = tmp_path / "m.jsonl", tmp_path / "m.csv"
    jl.write_bytes(b'\xef\xbb\xbf{"id": "a", "duration": 1.5}\r\n{"id": "b", "duration": 2}\r\n')
    cs.write_bytes(b"\xef\xbb\xbfid,duration\r\na,1.5\r\nb,2\r\n")
    for path in (jl, cs):
        m = Manifest(path)
        assert [(i.id, i.index, i.duration) for i in m] == [("a", 0, 1.5), ("b", 1, 2.0)]
        assert m.problems == [] and m.skipped == 0


def test_a_record_with_other_fields_than_the_first_keeps_them(tmp_path: Path) -> None:
    # The first record teaches the reader a fast path; a later record with as many fields
    # but other ones (an offset, another alias, its own sample rate, extras) keeps them all.
    p = tmp_path / "m.jsonl"
    records = [
        {"id": "a", "path": "a.wav", "duration": 1.0},
        {"id": "b", "duration": 2.0, "offset": 5.0},
        {"id": "c", "duration": 2.0, "audio_filepath": "c.wav"},
        {"id": "d", "duration": 2.0, "text": "hi"},
        {"id": "e", "path": "e.wav", "num_samples": 16000},
    ]
    p.write_text("".join(json.dumps(r) + "\n" for r in records))
    q = tmp_path / "n.jsonl"
    q.write_text(
        json.dumps({"id": "a", "path": "a.wav", "num_samples": 16000}) + "\n"
        + json.dumps({"id": "b", "num_samples": 16000, "sample_rate": 8000}) + "\n"
    )  # fmt: skip
    got = {i.id: i for i in Manifest(p)}
    assert got["b"].offset == 5.0
    assert got["c"].path == str(tmp_path / "c.wav")
    assert got["d"].extra == {"text": "hi"}
    assert got["e"].duration == 1.0 and got["e"].path == str(tmp_path / "e.wav")
    assert [(i.id, i.duration) for i in Manifest(q)] == [("a", 1.0), ("b", 2.0)]


def test_csv_problems_name_the_line_a_record_starts_on(tmp_path: Path) -> None:
    p = tmp_path / "m.csv"
    p.write_text('id,duration,text\na,1.0,"two\nlines"\nb,x,y\nc,1.0,"and\n\nthree"\nd,2\n')
    m = Manifest(p)
    assert [i.id for i in m] == ["a", "c"]
    assert [(q.line, q.field) for q in m.problems] == [(4, "duration"), (8, None)]


def test_a_missing_manifest_or_unknown_format_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="no such file"):
        Manifest(tmp_path / "nope.jsonl")
    (tmp_path / "m.txt").write_text("")
    with pytest.raises(ManifestError, match="unknown format"):
        Manifest(tmp_path / "m.txt", format="yaml")


def test_a_lhotse_cutset_manifest_is_read(tmp_path: Path) -> None:
    lhotse = pytest.importorskip("lhotse")
    cuts = lhotse.CutSet.from_cuts(
        lhotse.MonoCut(id=f"c{i}", start=0.0, duration=d, channel=0, recording=None)
        for i, d in enumerate([1.5, 2.5, 3.5])
    )
    path = tmp_path / "cuts.jsonl.gz"
    cuts.to_file(path)
    got = list(Manifest(path, format="lhotse"))
    assert [(i.id, i.duration) for i in got] == [("c0", 1.5), ("c1", 2.5), ("c2", 3.5)]


def test_a_repeated_id_is_skipped_keeping_the_first_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ids = ["u0", "u1", "u2", "u1", "u3", "u0", "u1"] + [f"v{i}" for i in range(20)]
    jl, cs = tmp_path / "m.jsonl", tmp_path / "m.csv"
    jl.write_text(
        "".join(json.dumps({"id": r, "duration": 1.0 + n}) + "\n" for n, r in enumerate(ids))
    )
    cs.write_text("id,duration\n" + "".join(f"{r},{1.0 + n}\n" for n, r in enumerate(ids)))
    for path, first_line in ((jl, 4), (cs, 5)):  # the CSV's header is line 1
        m = Manifest(path)
        caplog.clear()
        with caplog.at_level("WARNING", logger="vramctl.batching"):
            got = list(m)
        # The first record of each id is kept (its duration, its index); later ones skipped.
        assert [(i.id, i.index, i.duration) for i in got[:4]] == [
            ("u0", 0, 1.0), ("u1", 1, 2.0), ("u2", 2, 3.0), ("u3", 4, 5.0)
        ]  # fmt: skip
        assert len(got) == 24 and len({i.id for i in got}) == 24
        assert m.duplicates == 3 and m.skipped == 0 and m.problems == []
        assert m.duplicate_ids == [("u1", f"line {first_line}"), ("u0", f"line {first_line + 2}"),
                                   ("u1", f"line {first_line + 3}")]  # fmt: skip
        (record,) = caplog.records  # one warning for the pass, not one per record
        assert record.getMessage() == (
            f"{path}: 3 duplicate ids skipped (u1 at line {first_line}, u0 at line"
            f" {first_line + 2}, u1 at line {first_line + 3}); the first of each is kept"
        )
    # Every consumer sees each id once: a sampler over the manifest, and its budget.
    sampler = BucketingSampler(Manifest(jl), PaddedDuration(60.0))
    seen = [i.id for b in sampler for i in b.items]
    assert sorted(seen) == sorted(set(ids)) and sampler.stats.items == 24


def test_a_pass_that_stops_early_warns_of_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"id": "a", "duration": 1.0}) + "\n" for _ in range(3)))
    m = Manifest(path)
    with caplog.at_level("WARNING", logger="vramctl.batching"):
        assert next(iter(m)).id == "a"
        assert list(m) == [Item("a", 1.0, None, 0)]
    assert [r.getMessage() for r in caplog.records] == [
        f"{path}: 2 duplicate ids skipped (a at line 2, a at line 3); the first of each is kept"
    ]
    assert m.duplicates_message() == caplog.records[0].getMessage()


def test_many_duplicates_name_the_first_five(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text(
        "".join(json.dumps({"id": f"d{i % 2}", "duration": 1.0}) + "\n" for i in range(40))
    )
    m = Manifest(path)
    assert [i.id for i in m] == ["d0", "d1"]
    assert m.duplicates == 38 and len(m.duplicate_ids) == 20
    message = m.duplicates_message()
    assert message is not None
    assert (
        "38 duplicate ids skipped (d0 at line 3, d1 at line 4, d0 at line 5, d1 at line 6,"
        in message
    )
    assert "d0 at line 7, ...); the first of each is kept" in message


def test_a_folder_with_one_name_in_two_formats_keeps_the_first(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import wave

    for name in ("a.wav", "b.wav", "sub/c.wav"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        with wave.open(str(tmp_path / name), "wb") as f:
            f.setnchannels(1)
            f.setsampwidth(2)
            f.setframerate(8000)
            f.writeframes(b"\0\0" * 8000)
    # Another file whose id is "a" (the path without its extension): a.npy is not audio,
    # a.WAV on a case-sensitive file system is.
    (tmp_path / "a.WAV").write_bytes((tmp_path / "a.wav").read_bytes())
    m = Manifest(tmp_path)
    with caplog.at_level("WARNING", logger="vramctl.batching"):
        got = [i.id for i in m]
    assert got == ["a", "b", "sub/c"]
    assert m.duplicates == 1 and m.duplicate_ids == [("a", "a.wav")]
    assert "1 duplicate id skipped (a at a.wav)" in caplog.text


def test_a_lhotse_cutset_with_a_repeated_cut_id_keeps_the_first(tmp_path: Path) -> None:
    lhotse = pytest.importorskip("lhotse")
    cuts = lhotse.CutSet.from_cuts(
        lhotse.MonoCut(id=cid, start=0.0, duration=d, channel=0, recording=None)
        for cid, d in [("c0", 1.5), ("c1", 2.5), ("c0", 3.5), ("c2", 4.5)]
    )
    path = tmp_path / "cuts.jsonl.gz"
    cuts.to_file(path)
    m = Manifest(path, format="lhotse")
    assert [(i.id, i.duration, i.index) for i in m] == [
        ("c0", 1.5, 0),
        ("c1", 2.5, 1),
        ("c2", 4.5, 3),
    ]
    assert m.duplicate_ids == [("c0", "cut 3")]


def test_in_memory_records_with_a_repeated_id_keep_the_first(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from vramctl.batching import items_from

    records: list[Any] = [
        {"id": "a", "duration": 1.0},
        Item("b", 2.0),
        {"id": "a", "duration": 3.0},
        Item("b", 4.0),
    ]
    with caplog.at_level("WARNING", logger="vramctl.batching"):
        got = [(i.id, i.duration) for i in items_from(records)]
    assert got == [("a", 1.0), ("b", 2.0)]
    assert "<records>: 2 duplicate ids skipped (a at record 2, b at record 3)" in caplog.text


# -- budgets -------------------------------------------------------------------------


def test_budgets_are_exact_at_their_limits() -> None:
    b = PaddedDuration(600.0)
    assert b.max_count(15.0) == 40 and b.cost(40, 15.0) == 600.0
    assert b.max_count(601.0) == 0
    assert PaddedDuration(600.0, max_items=8).max_count(1.0) == 8
    q = QuadraticDuration(100.0, quadratic_duration=10.0)
    assert q.max_count(10.0) == 5 and q.cost(5, 10.0) <= 100.0 < q.cost(6, 10.0)
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(BatchingError, match="max_duration"):
            PaddedDuration(bad)


class Conv(nn.Module):
    """A small frame model: strided convolutions and a projection, as audio front ends."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv1d(1, 32, 10, stride=5), nn.GELU(), nn.Conv1d(32, 64, 4, stride=4)
        )
        self.head = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.net(x.unsqueeze(1)).transpose(1, 2))


def test_memory_budget_takes_the_estimates_options_as_a_step_or_one_by_one() -> None:
    rate = 1000
    with vramctl.simulate("64MiB") as gpu, torch.inference_mode():
        model = Conv().eval()

        def make(n: int, seconds: float) -> torch.Tensor:
            return torch.zeros(n, max(1, round(seconds * rate)))

        def table(**options: Any) -> list[tuple[float, int]]:
            mb = MemoryBudget.for_model(model, make, max_duration=8.0, device=gpu, **options)
            return mb.table([2.0, 8.0])

        one_by_one = table(precision="bf16")
        assert one_by_one == table(step=vramctl.Step(precision="bf16"))
        assert one_by_one != table()  # bf16 activations: more items fit than in fp32
        with pytest.raises(BatchingError, match="not both: precision"):
            table(step=vramctl.Step(), precision="bf16")


def test_memory_budget_predicts_batches_that_run_within_a_simulated_gpu() -> None:
    torch.manual_seed(0)
    rate = 1000  # samples per second: small tensors, the same shape of cost
    with vramctl.simulate("64MiB") as gpu, torch.inference_mode():
        model = Conv().eval()

        def make(n: int, seconds: float) -> torch.Tensor:
            return torch.zeros(n, max(1, round(seconds * rate)))

        mb = MemoryBudget.for_model(model, make, max_duration=30.0, device=gpu, target=0.9)
        assert mb.max_count(31.0) == 0
        counts = mb.table([1.0, 4.0, 8.0, 15.0, 30.0])
        assert [n for _, n in counts] == sorted((n for _, n in counts), reverse=True)
        assert counts[-1][1] >= 1
        for seconds, n in counts:  # the predicted batch runs, and is not far below the edge
            gpu.reset_peak()
            model(make(n, seconds))
            assert gpu.memory().peak_allocated <= mb.budget_bytes + 1
            if seconds >= mb.anchors[0].seconds:  # below the first anchor: its count (safe)
                assert gpu.memory().peak_allocated > 0.8 * mb.budget_bytes


def test_memory_budget_leaves_a_simulated_gpu_untouched_and_counts_only_what_it_holds() -> None:
    rate = 1000
    host_model = Conv().eval()  # made outside the simulation: host memory, not the GPU's

    def make(n: int, seconds: float) -> torch.Tensor:
        return torch.zeros(n, max(1, round(seconds * rate)))

    with vramctl.simulate("64MiB") as gpu, torch.inference_mode():
        gpu.reset_peak()
        before = gpu.memory().allocated
        mb = MemoryBudget.for_model(host_model, make, max_duration=30.0, device=gpu, target=0.5)
        # The estimator's probes are not the batch's memory: nothing was counted meanwhile.
        assert gpu.memory().peak_allocated == before
        assert gpu.holds(host_model) == 0
        assert mb.budget_bytes == int(0.5 * gpu.total_bytes) - before
        inside = gpu.adopt(Conv().eval())
        weights = gpu.holds(inside)
        assert weights == sum(p.numel() * 4 for p in inside.parameters())
        mb2 = MemoryBudget.for_model(inside, make, max_duration=30.0, device=gpu, target=0.5)
        # The adopted model's weights stay in the budget (the estimate counts them itself).
        assert mb2.budget_bytes == mb.budget_bytes


def test_small_items_on_a_large_gpu_are_priced_from_a_line_wider_than_the_rounding() -> None:
    rate = 16000  # one item of 0.25 s: far less than the allocator's 20 MiB blocks

    def make(n: int, seconds: float) -> torch.Tensor:
        return torch.empty(n, max(1, round(seconds * rate)), device="meta")

    asked: list[int] = []

    def counted(n: int, seconds: float) -> torch.Tensor:
        asked.append(n)
        return make(n, seconds)

    with vramctl.simulate("140GiB") as gpu, torch.inference_mode():
        model = Conv().eval()
        mb = MemoryBudget.for_model(model, counted, max_duration=0.25, device=gpu, anchors=1)
        n = mb.max_count(0.25)
        where = run_target(gpu)
        at_n = vramctl.estimate(model, make(n, 0.25), device=where, mode="infer")
        assert 0.8 * mb.budget_bytes < at_n.peak_reserved <= mb.budget_bytes
        over = vramctl.estimate(model, make(int(n * 1.05), 0.25), device=where, mode="infer")
        assert over.peak_reserved > mb.budget_bytes
    # The second anchor grew past the rounding; the count at the edge was checked.
    assert asked[:2] == [1, 4] and max(asked[2:-1]) > 4 and asked[-1] == n


# -- the sampler ---------------------------------------------------------------------


def test_edges_split_the_total_duration_evenly() -> None:
    lengths = _lengths(5000)
    edges = duration_edges(lengths, 10)
    assert len(edges) == 9 and edges == sorted(edges)
    totals = [0.0] * 10
    import bisect

    for d in lengths:
        totals[bisect.bisect_right(edges, d)] += d
    assert max(totals) < 1.3 * sum(lengths) / 10
    with pytest.raises(BatchingError):
        duration_edges(lengths, 0)


@pytest.mark.parametrize("shuffle", [False, True])
def test_no_batch_is_over_budget_and_every_item_comes_out_once(shuffle: bool) -> None:
    items = _items(3000)
    budget = PaddedDuration(120.0)
    s = BucketingSampler(items, budget, shuffle=shuffle, buffer_size=500)
    seen: list[str] = []
    for batch in s:
        assert batch.padded_duration <= 120.0 + 1e-9
        assert batch.longest == max(i.duration for i in batch.items)
        seen.extend(i.id for i in batch.items)
    assert sorted(seen) == sorted(i.id for i in items) and len(seen) == len(set(seen))
    assert s.stats.overruns == 0 and s.stats.worst_ratio <= 1.0
    assert s.stats.padding < 0.03  # buckets keep padding low on LibriSpeech-like lengths
    if shuffle:
        assert seen != sorted(seen, key=lambda x: int(x[1:]))


def test_the_long_item_that_arrives_last_closes_the_batch_first() -> None:
    items = [Item(f"s{i}", 9.0, index=i) for i in range(6)] + [Item("long", 9.9, index=6)]
    s = BucketingSampler(items, PaddedDuration(60.0), edges=[])
    sizes = [(len(b), b.longest) for b in s]
    # 6 x 9.0 = 54 fits; with the long one it would be 7 x 9.9 = 69.3: it starts a new batch.
    assert sizes == [(6, 9.0), (1, 9.9)]
    assert s.stats.worst_ratio <= 1.0


def test_an_item_over_the_budget_alone_is_emitted_alone_and_counted() -> None:
    items = [Item("a", 5.0, index=0), Item("huge", 700.0, index=1), Item("b", 5.0, index=2)]
    s = BucketingSampler(items, PaddedDuration(600.0), edges=[])
    batches = list(s)
    assert [(b.oversize, [i.id for i in b.items]) for b in batches] == [
        (True, ["huge"]),
        (False, ["a", "b"]),
    ]
    assert s.stats.oversize == 1 and s.stats.overruns == 0


def test_a_resumed_pass_continues_exactly_where_it_stopped() -> None:
    items = _items(2000, seed=3)

    def make() -> BucketingSampler:
        return BucketingSampler(
            items, PaddedDuration(90.0), num_buckets=12, shuffle=True, buffer_size=300, seed=7
        )

    whole = [[i.id for i in b.items] for b in make()]
    first = make()
    it = iter(first)
    head = [[i.id for i in next(it).items] for _ in range(25)]
    state = json.loads(json.dumps(first.state_dict()))  # it survives JSON
    second = make()
    second.load_state_dict(state)
    tail = [[i.id for i in b.items] for b in second]
    assert head + tail == whole
    assert second.stats.items == len(items)


def test_bad_sampler_input_is_a_clear_error() -> None:
    with pytest.raises(BatchingError, match="budget must have"):
        BucketingSampler([], 600)  # type: ignore[arg-type]
    with pytest.raises(BatchingError, match="edges must increase"):
        BucketingSampler([], PaddedDuration(10), edges=[3.0, 2.0])
    s = BucketingSampler(_items(10), PaddedDuration(10), num_buckets=3)
    with pytest.raises(BatchingError, match="not a BucketingSampler state"):
        s.load_state_dict({"version": 99})


# -- edges of the contract: resume anywhere, bad input, odd budgets --------------------


def _ids(batches: Iterable[Batch]) -> list[list[str]]:
    return [[i.id for i in b.items] for b in batches]


def _resume_everywhere(make: Callable[[], BucketingSampler], passes: int = 2) -> None:
    """A state taken after every batch of ``passes`` passes resumes into the same batches."""
    whole = make()
    runs = [_ids(whole) for _ in range(passes)]
    flat = [b for run in runs for b in run]
    for k in range(len(flat) + 1):
        first = make()
        got: list[list[str]] = []
        it, done = iter(first), 0
        while len(got) < k:
            try:
                got.append([i.id for i in next(it).items])
            except StopIteration:
                it, done = iter(first), done + 1
        state = json.loads(json.dumps(first.state_dict()))
        second = make()
        second.load_state_dict(state)
        rest = [b for _ in range(passes - done) for b in _ids(second)]
        assert got + rest == flat, f"resumed after batch {k}"


def test_a_pass_resumed_while_its_shuffle_buffer_drains_gives_the_same_batches() -> None:
    # A buffer larger than the stream: every batch leaves while the buffer drains.
    items = [Item(f"u{i}", 1.0 + i * 37 % 11, index=i) for i in range(40)]
    _resume_everywhere(
        lambda: BucketingSampler(
            items, PaddedDuration(20.0), num_buckets=3, shuffle=True, buffer_size=100, seed=1
        )
    )


def test_a_state_saved_before_the_first_pass_resumes_into_the_same_passes() -> None:
    items = [Item("a", 1.0, index=0), Item("b", 1.0, index=1), Item("c", 2.0, index=2)]
    _resume_everywhere(
        lambda: BucketingSampler(
            items, PaddedDuration(1.0), edges=[], shuffle=True, buffer_size=3, seed=0
        ),
        passes=3,
    )


def test_random_streams_keep_the_contract_and_resume_anywhere() -> None:
    rng = random.Random(5)
    for _ in range(40):
        n = rng.randint(0, 30)
        items = [Item(f"u{i}", rng.choice([rng.uniform(0.05, 30.0), 5.0]), index=i)
                 for i in range(n)]  # fmt: skip
        budgets: list[Budget] = [
            PaddedDuration(rng.uniform(1.0, 60.0)),
            QuadraticDuration(40.0, 7.0),
            PaddedDuration(30.0, max_items=2),
        ]
        budget = rng.choice(budgets)  # fmt: skip
        options = {
            "num_buckets": rng.randint(1, 60),
            "edge_sample": rng.randint(1, 40),
            "shuffle": rng.random() < 0.5,
            "buffer_size": rng.randint(1, 20),
            "seed": rng.randint(0, 3),
        }

        def make(
            items: list[Item] = items, budget: Budget = budget, o: dict[str, Any] = options
        ) -> BucketingSampler:
            return BucketingSampler(items, budget, **o)

        s = make()
        for _ in range(2):
            batches = list(s)
            seen = sorted(i.id for b in batches for i in b.items)
            assert seen == sorted(i.id for i in items)  # each item once per pass
            for b in batches:
                assert len(b) >= 1 and b.longest == max(i.duration for i in b.items)
                if b.oversize:
                    assert len(b) == 1 and budget.max_count(b.longest) == 0
                else:
                    assert budget.cost(len(b), b.longest) <= budget.limit
            assert s.stats.overruns == 0 and s.stats.items == n
        _resume_everywhere(make)


def test_a_state_is_refused_by_a_sampler_that_would_lose_or_reorder_items() -> None:
    items = _items(60)
    first = BucketingSampler(items, PaddedDuration(40.0), num_buckets=3, shuffle=True,
                             buffer_size=10, seed=1)  # fmt: skip
    it = iter(first)
    next(it)
    state = first.state_dict()
    assert state["buffer"]
    # Unshuffled, the buffered items would never come out; another seed, another order.
    others: list[dict[str, Any]] = [
        {"shuffle": False},
        {"shuffle": True, "buffer_size": 10, "seed": 2},
    ]
    for other in others:
        s = BucketingSampler(items, PaddedDuration(40.0), num_buckets=3, **other)
        with pytest.raises(BatchingError, match="order would differ"):
            s.load_state_dict(state)


def test_a_state_whose_open_batch_is_over_this_budget_is_refused() -> None:
    items = [Item(f"s{i}", 1.0, index=i) for i in range(10)] + [Item("huge", 100.0, index=10)]
    first = BucketingSampler(items, PaddedDuration(40.0), edges=[])
    it = iter(first)
    assert next(it).oversize  # the ten short items are still in the open batch
    state = first.state_dict()
    smaller = BucketingSampler(items, PaddedDuration(5.0), edges=[])
    with pytest.raises(BatchingError, match="budget allows 5"):
        smaller.load_state_dict(state)  # else its first batch would be 10 x 1 s under 5 s


def test_loading_a_state_keeps_the_edges_a_sampler_was_given() -> None:
    state = BucketingSampler(_items(10), PaddedDuration(10.0)).state_dict()  # no edges yet
    s = BucketingSampler(_items(10), PaddedDuration(10.0), edges=[5.0])
    s.load_state_dict(state)
    assert s.edges == [5.0]
    assert sum(len(b) for b in s) == 10 and s.edges == [5.0] and len(s.stats.per_bucket) == 2


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan")])
def test_an_item_without_a_positive_duration_is_an_error_not_an_empty_batch(bad: float) -> None:
    items = [Item("z", bad, index=0), Item("a", 2.0, index=1)]
    with pytest.raises(BatchingError, match=r"'z' .* duration"):
        list(BucketingSampler(items, PaddedDuration(10.0), edges=[]))


def test_nan_edges_are_refused() -> None:
    with pytest.raises(BatchingError, match="edges must be numbers"):
        BucketingSampler([], PaddedDuration(10), edges=[float("nan")])


def test_a_budget_that_is_not_monotone_in_the_length_gets_no_overrun() -> None:
    class Dip:
        """Items of 2-4 s cannot be batched at all; longer ones can (a custom budget)."""

        limit = 10.0

        def max_count(self, longest: float) -> int:
            return 0 if 2.0 <= longest <= 4.0 else int(self.limit // longest)

        def cost(self, count: int, longest: float) -> float:
            return count * longest * (100.0 if 2.0 <= longest <= 4.0 else 1.0)

    items = [Item("long", 5.0, index=0), Item("dip", 3.0, index=1), Item("x", 3.0, index=2),
             Item("y", 1.0, index=3)]  # fmt: skip
    s = BucketingSampler(items, Dip(), edges=[])
    batches = list(s)
    assert sorted(i.id for b in batches for i in b.items) == ["dip", "long", "x", "y"]
    assert s.stats.overruns == 0
    # "dip" joins the batch of "long" (padded to 5 s); "x" would open a batch of 3 s: alone.
    assert [(b.oversize, _ids([b])[0]) for b in batches] == [
        (True, ["x"]),
        (False, ["long", "dip"]),
        (False, ["y"]),
    ]


def test_a_memory_budget_never_lets_a_longer_item_cost_less() -> None:
    # A measured dip (allocator rounding) at the longer anchor is not trusted.
    mb = MemoryBudget(95, [(10.0, 100.0, 50.0), (20.0, 90.0, 40.0)])
    assert mb.max_count(10.0) == 0 and mb.max_count(15.0) == 0 and mb.max_count(20.0) == 0
    assert mb.peak(3, 20.0) >= mb.peak(3, 10.0)
    # Anchors at one length merge into the larger.
    twice = MemoryBudget(1000, [(10.0, 100.0, 50.0), (10.0, 300.0, 60.0)])
    assert twice.max_count(10.0) == 12 and len(twice.anchors) == 1
    with pytest.raises(BatchingError, match="max_items"):
        MemoryBudget(1000, [(10.0, 100.0, 50.0)], max_items=0)
