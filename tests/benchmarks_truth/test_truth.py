"""The CUDA truth corpus tools (benchmarks/_truth, benchmarks/cuda_truth.py).

The replay is checked against traces built by hand, whose segments follow PyTorch's
caching-allocator rules worked out here (not by the model): 512-byte rounding; requests of at
most 1 MiB from 2 MiB small segments; larger ones under 10 MiB from 20 MiB segments; from
10 MiB on, the request rounded up to 2 MiB; best fit; a large block split when more than
1 MiB is left. Then the corpus format (round trip, damaged files), a simulated capture end to
end, and, on a real GPU, a real capture.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from vramctl.estimator import AllocatorConfig, CachingAllocatorModel

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))

import cuda_truth
from _truth import corpus
from _truth.corpus import CorpusError, TraceBuilder
from _truth.diff import diff, real_stream
from _truth.replay import replay

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "benchmarks" / "cuda_truth.py"
KiB, MiB = 2**10, 2**20
#: Where the hand-made traces put their segments (any addresses do; these look like CUDA's).
B = 0x7F00_0000_0000
C = 0x7F00_4000_0000
S = 0x7F00_8000_0000

Event = tuple[Any, ...]


def seg(addr: int, size: int) -> Event:
    return ("segment_alloc", addr, size)


def alloc(addr: int, size: int, stream: int = 0) -> Event:
    return ("alloc", addr, size, stream)


def free(addr: int, size: int, stream: int = 0) -> list[Event]:
    return [("free_requested", addr, size, stream), ("free_completed", addr, size, stream)]


def trace_of(*evs: Event | list[Event], before: list[list[Any]] | None = None) -> dict:
    tb = TraceBuilder()
    tb.segments_before = before or []
    for e in evs:
        for one in e if isinstance(e, list) else [e]:
            tb.event(*one)
    return tb.build()


def cli(*args: str | Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def last_json(text: str) -> dict[str, Any]:
    return json.loads(text.strip().splitlines()[-1])


def run_main(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    """``cuda_truth.py`` in this process (a subprocess pays for importing torch again)."""
    capsys.readouterr()
    rc = cuda_truth.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


# -- replay against traces with known answers -----------------------------------------------


@pytest.mark.parametrize(
    ("request_bytes", "segment", "pool"),
    [
        (1, 2 * MiB, "small"),
        (1 * MiB, 2 * MiB, "small"),  # at most 1 MiB is small
        (1 * MiB + 1, 20 * MiB, "large"),
        (10 * MiB - 512, 20 * MiB, "large"),  # under 10 MiB: a 20 MiB buffer
        (10 * MiB, 10 * MiB, "large"),  # from 10 MiB: its own segment
        (11 * MiB + 1, 12 * MiB, "large"),  # rounded up to 2 MiB
    ],
)
def test_one_request_makes_the_segment_the_rules_say(
    request_bytes: int, segment: int, pool: str
) -> None:
    r = replay(trace_of(seg(B, segment), alloc(B, request_bytes)))
    assert r.match is True, r.first_difference
    assert r.real_segments == r.model_segments == [segment]
    assert r.real_peak_reserved == r.model_peak_reserved == segment
    rounded = -(-request_bytes // 512) * 512
    assert r.real_peak_allocated == rounded


def test_one_byte_is_a_512_byte_block_in_a_2mib_segment() -> None:
    r = replay(trace_of(seg(B, 2 * MiB), alloc(B, 1)))
    assert r.match is True
    assert r.model_segments == [2 * MiB]
    assert r.model_peak_allocated == r.real_peak_allocated == 512
    assert (r.unknown_frees, r.single_stream, r.expandable) == (0, True, False)


def test_large_requests_share_a_20mib_segment_until_it_is_full() -> None:
    t = trace_of(
        seg(B, 20 * MiB),
        alloc(B, 5 * MiB),
        alloc(B + 5 * MiB, 5 * MiB),  # the 15 MiB left serves it: no new segment
        seg(C, 12 * MiB),  # 10 MiB left cannot hold 12 MiB
        alloc(C, 12 * MiB),
    )
    r = replay(t)
    assert r.match is True, r.first_difference
    assert r.model_segments == [20 * MiB, 12 * MiB]
    assert r.real_peak_reserved == r.model_peak_reserved == 32 * MiB
    assert r.model_peak_allocated == r.real_peak_allocated == 22 * MiB


def test_small_requests_share_a_2mib_segment() -> None:
    t = trace_of(
        seg(B, 2 * MiB),
        alloc(B, 1 * MiB),
        alloc(B + 1 * MiB, 1 * MiB - 512),  # fits the 1 MiB left
        alloc(B + 2 * MiB - 512, 100),  # and the last 512 bytes
        seg(C, 2 * MiB),  # the first is full
        alloc(C, 1),
    )
    r = replay(t)
    assert r.match is True, r.first_difference
    assert r.model_segments == [2 * MiB, 2 * MiB]
    assert r.model_peak_reserved == 4 * MiB


def test_a_freed_block_is_cached_and_used_again() -> None:
    t = trace_of(
        seg(B, 20 * MiB),
        alloc(B, 5 * MiB),
        free(B, 5 * MiB),
        alloc(B, 5 * MiB),  # from the cache
        seg(C, 2 * MiB),
        alloc(C, 700 * KiB),
        free(C, 700 * KiB),
        alloc(C, 600 * KiB),  # the small cache, too
        free(C, 600 * KiB),
        free(B, 5 * MiB),
        alloc(B, 19 * MiB),  # the 20 MiB segment whole again, merged
    )
    r = replay(t)
    assert r.match is True, r.first_difference
    assert r.model_segments == [20 * MiB, 2 * MiB]
    assert r.real_peak_reserved == r.model_peak_reserved == 22 * MiB
    assert r.real_peak_allocated == 19 * MiB
    # 19 MiB leaves 1 MiB: too little to split a large block, so all 20 MiB are allocated.
    assert r.model_peak_allocated == 20 * MiB


def test_the_smallest_free_block_that_fits_is_used() -> None:
    # [8 MiB | 6 MiB | 6 MiB] in one 20 MiB segment; the 8 MiB and last 6 MiB freed. Best fit
    # puts 6 MiB in the 6 MiB hole and 8 MiB in the 8 MiB hole: no new segment. (A first fit
    # by address would split the 8 MiB hole for the 6 MiB and need a new segment for 8.)
    t = trace_of(
        seg(B, 20 * MiB),
        alloc(B, 8 * MiB),
        alloc(B + 8 * MiB, 6 * MiB),
        alloc(B + 14 * MiB, 6 * MiB),
        free(B, 8 * MiB),
        free(B + 14 * MiB, 6 * MiB),
        alloc(B + 14 * MiB, 6 * MiB),
        alloc(B, 8 * MiB),
    )
    r = replay(t)
    assert r.match is True, r.first_difference
    assert r.model_segments == [20 * MiB]
    assert r.model_peak_reserved == 20 * MiB


def test_blocks_held_before_the_step_can_be_freed_by_it() -> None:
    before = [
        [S, 2 * MiB, 0, "small", [[512, 1], [2 * MiB - 512, 0]]],
        [B, 20 * MiB, 0, "large", [[6 * MiB, 1], [14 * MiB, 0]]],
    ]
    t = trace_of(
        free(B, 6 * MiB),  # a block the step did not allocate
        alloc(B, 18 * MiB),  # fits only if that block merged back into the 20 MiB
        alloc(S + 512, 1 * MiB),  # the small segment's free rest
        free(S, 512),
        alloc(S, 300),
        before=before,
    )
    r = replay(t)
    assert r.unknown_frees == 0
    assert r.match is True, r.first_difference
    assert r.real_segments == r.model_segments == []
    assert r.real_peak_reserved == r.model_peak_reserved == 22 * MiB
    # 6 MiB + 512 B held before; 18 MiB + 512 B + 1 MiB at most during the step.
    assert r.real_peak_allocated == 19 * MiB + 512
    assert r.model_peak_allocated == 19 * MiB + 512


def test_a_free_of_an_unknown_block_is_counted() -> None:
    r = replay(trace_of(seg(B, 2 * MiB), alloc(B, 512), free(C, 512)))
    assert r.unknown_frees == 1
    assert r.match is True


def test_a_segment_the_rules_do_not_make_is_a_difference() -> None:
    r = replay(trace_of(seg(B, 4 * MiB), alloc(B, 1)))
    assert r.match is False
    assert r.real_segments == [4 * MiB] and r.model_segments == [2 * MiB]
    assert r.first_difference == f"segment 0: real {4 * MiB} bytes, model {2 * MiB}"


def test_a_segment_too_many_is_a_difference() -> None:
    # The real allocator made a new segment although the cached block would have served.
    t = trace_of(
        seg(B, 20 * MiB), alloc(B, 5 * MiB), free(B, 5 * MiB), seg(C, 20 * MiB), alloc(C, 5 * MiB)
    )
    r = replay(t)
    assert r.match is False
    assert r.first_difference == "real made 2 segments, model 1"


def test_a_different_reserved_peak_is_a_difference() -> None:
    # Same segments in the same order, but the real step released the first before the second
    # (as an allocation retry does): its peak is 20 MiB, the model's 22 MiB.
    t = trace_of(
        seg(B, 20 * MiB),
        alloc(B, 5 * MiB),
        free(B, 5 * MiB),
        ("segment_free", B, 20 * MiB),
        seg(C, 2 * MiB),
        alloc(C, 512),
    )
    r = replay(t)
    assert r.real_segments == r.model_segments == [20 * MiB, 2 * MiB]
    assert (r.real_peak_reserved, r.model_peak_reserved) == (20 * MiB, 22 * MiB)
    assert r.match is False
    assert r.first_difference == f"reserved peak: real {20 * MiB}, model {22 * MiB}"


def test_steps_on_two_streams_are_reported_not_judged() -> None:
    t = trace_of(seg(B, 4 * MiB), alloc(B, 1), seg(C, 2 * MiB), alloc(C, 1, stream=7))
    assert not corpus.single_stream(t)
    r = replay(t)
    assert r.single_stream is False
    assert r.match is None and r.first_difference is None
    # A step whose events are on one stream but whose earlier segments are on another.
    before = [[S, 2 * MiB, 9, "small", [[2 * MiB, 0]]]]
    r = replay(trace_of(seg(B, 4 * MiB), alloc(B, 1), before=before))
    assert (r.single_stream, r.match) == (False, None)


def test_expandable_segments_are_judged_through_the_models_expandable_segments() -> None:
    # A 1 MiB + 1 B block maps a 20 MiB page; 3 MiB more come from the same page; 25 MiB
    # more take the 16 MiB left and one more page. The small pool maps a 2 MiB page.
    t = trace_of(
        ("segment_map", B, 20 * MiB),
        alloc(B, 1 * MiB + 1),
        alloc(B + MiB + 512, 3 * MiB),
        ("segment_map", B + 20 * MiB, 20 * MiB),
        alloc(B + 4 * MiB + 512, 25 * MiB),
        ("segment_map", S, 2 * MiB),
        alloc(S, 100),
        free(B + MiB + 512, 3 * MiB),
    )
    r = replay(t, AllocatorConfig(expandable_segments=True))
    assert r.expandable is True
    assert r.real_segments == r.model_segments == [20 * MiB, 20 * MiB, 2 * MiB]
    assert r.real_peak_reserved == r.model_peak_reserved == 42 * MiB
    assert r.match is True
    # With fixed segments the model cannot be held to such a step: reported, not judged.
    r = replay(t)
    assert r.match is None and r.first_difference is None
    assert r.real_segments == [20 * MiB, 20 * MiB, 2 * MiB]
    # A page the model would not have mapped is a difference.
    wrong = trace_of(("segment_map", B, 40 * MiB), alloc(B, 5 * MiB))
    r = replay(wrong, AllocatorConfig(expandable_segments=True))
    assert r.match is False and r.first_difference == (
        f"segment 0: real {40 * MiB} bytes, model {20 * MiB}"
    )


def test_expandable_segments_seed_a_model_that_goes_on_alike() -> None:
    cfg = AllocatorConfig(expandable_segments=True)
    m = CachingAllocatorModel(cfg, record_history=True)
    hs = [m.malloc(n) for n in (3 * MiB, 30 * MiB, 700 * KiB, 45 * MiB, 100, 12 * MiB)]
    m.free(hs[3])  # 45 MiB in the middle of the large segment: at 33-78 MiB
    m.empty_cache()  # its one whole page (40-60 MiB) is unmapped: two stretches left
    state = m.segments_state()
    assert [(s[3], s[1]) for s in state] == [
        ("large", 40 * MiB),
        ("large", 40 * MiB),
        ("small", 2 * MiB),
    ]
    m2 = CachingAllocatorModel(cfg, record_history=True)
    handles = m2.seed(state)
    assert _layout(m2.segments_state()) == _layout(state)
    assert (m2.allocated, m2.reserved) == (m.allocated, m.reserved)
    live = {i: m.address(h) for i, h in enumerate(hs) if i != 3}
    assert sorted(handles) == sorted(live.values())
    # The same frees and requests map the same pages: the hole first, then the end.
    for model, first in ((m, hs[0]), (m2, handles[live[0]])):
        model.free(first)
        model.history.clear()
        for n in (18 * MiB, 50 * MiB, 1 * MiB + 512):
            model.malloc(n)
    assert m2.history == m.history != []
    assert _layout(m2.segments_state()) == _layout(m.segments_state())


def test_events_name_the_operator_of_each_call() -> None:
    tb = TraceBuilder()
    mm = tb.call("mm")
    tb.call("add")
    again = tb.call("mm")
    tb.event("segment_alloc", B, 2 * MiB)
    tb.event("alloc", B, 64, call=mm)
    tb.event("alloc", B + 512, 64, call=again)
    t = tb.build()
    assert t["ops"] == ["mm", "add"] and t["calls"] == [[0, None], [1, None], [0, None]]
    assert [e[4] for e in corpus.events(t)] == [None, "mm", "mm"]
    assert real_stream(t) == [("mm", 64), ("mm", 64)]


def test_diff_finds_the_first_divergence_and_the_bytes_by_operator() -> None:
    real = [("mm", 100), ("add", 10), ("relu", 10)]
    predicted = [("mm", 100), ("add", 30), ("relu", 10)]
    d = diff(real, predicted)
    assert d.first == (1, 1, "real [add 10 B], predicted [add 30 B]")
    assert d.by_op[0] == ("add", 10, 30)
    out = d.to_dict()
    assert (out["real_bytes"], out["predicted_bytes"]) == (120, 140)
    assert diff(real, list(real)).first is None


def test_a_convolutions_workspace_is_what_it_freed_before_returning() -> None:
    from _truth.workspaces import pair, recorded

    tb = TraceBuilder()
    fwd = tb.call("convolution")
    bwd = tb.call("convolution_backward")
    plain = tb.call("convolution")
    tb.event("alloc", B, 4 * MiB, call=fwd)  # the output
    tb.event("alloc", B + 8 * MiB, 3 * MiB, call=fwd)  # the workspace
    tb.event("free_requested", B + 8 * MiB, 3 * MiB, call=fwd)
    tb.event("alloc", B + 16 * MiB, 2 * MiB, call=bwd)  # grad input
    tb.event("alloc", B + 24 * MiB, 5 * MiB, call=bwd)  # a temporary ...
    tb.event("free_requested", B + 24 * MiB, 5 * MiB, call=bwd)
    tb.event("alloc", B + 24 * MiB, MiB, call=bwd)  # ... whose address the weight grad takes
    tb.event("alloc", B + 32 * MiB, 4 * MiB, call=bwd)  # another, after the first
    tb.event("free_requested", B + 32 * MiB, 4 * MiB, call=bwd)
    tb.event("alloc", B + 40 * MiB, MiB, call=plain)  # no workspace
    calls = recorded(tb.build())
    want = [("convolution", 3 * MiB), ("convolution_backward", 5 * MiB), ("convolution", 0)]
    assert calls == want
    keys = ["convolution(a)", "convolution_backward(a)", "convolution(a)"]
    assert pair(keys, calls) == {"convolution(a)": 3 * MiB, "convolution_backward(a)": 5 * MiB}
    assert "2 traced" in str(pair(keys[:2], calls))
    assert "convolution_backward" in str(pair(list(reversed(keys)), calls))


# -- the model's segments, out and in ----------------------------------------------------


def _layout(state: list[list[Any]]) -> list[list[Any]]:
    return [[size, stream, pool, blocks] for _addr, size, stream, pool, blocks in state]


def test_segments_state_seeds_a_model_with_the_same_layout() -> None:
    m = CachingAllocatorModel(record_history=True)
    sizes = [100, 700 * KiB, 3 * MiB, 5 * MiB, 1 * MiB, 12 * MiB, 2000, 4 * MiB, 600 * KiB]
    hs = [m.malloc(n) for n in sizes]
    for i in (1, 3, 6):
        m.free(hs[i])
    state = m.segments_state()
    # Worked out by hand: 100 B, 700 KiB, 1 MiB and 2000 B share the first small segment;
    # 3, 5 and 12 MiB fill the first 20 MiB one; 4 MiB needs a second, and 600 KiB no longer
    # fits the 323.5 KiB left in the small one. The 2000 B block, freed, merged with the rest.
    small_rest = 2 * MiB - 512 - 700 * KiB - 1 * MiB
    assert _layout(state) == [
        [2 * MiB, 0, "small", [[512, 1], [700 * KiB, 0], [1 * MiB, 1], [small_rest, 0]]],
        [20 * MiB, 0, "large", [[3 * MiB, 1], [5 * MiB, 0], [12 * MiB, 1]]],
        [20 * MiB, 0, "large", [[4 * MiB, 1], [16 * MiB, 0]]],
        [2 * MiB, 0, "small", [[600 * KiB, 1], [2 * MiB - 600 * KiB, 0]]],
    ]
    assert [s[0] for s in state] == [0, 2 * MiB, 22 * MiB, 42 * MiB]
    assert m.reserved == 44 * MiB

    m2 = CachingAllocatorModel(record_history=True)
    handles = m2.seed(state)
    assert m2.segments_state() == state  # a fresh model's addresses start where m's did
    assert (m2.allocated, m2.reserved) == (m.allocated, m.reserved)
    live = {i: m.address(h) for i, h in enumerate(hs) if i not in (1, 3, 6)}
    assert sorted(handles) == sorted(live.values())
    # Both go on alike: the same frees and requests make the same segments.
    for i in (0, 4):
        m.free(hs[i])
        m2.free(handles[live[i]])
    for model in (m, m2):
        model.history.clear()
        for n in (6 * MiB, 9 * MiB, 1 * MiB, 30 * MiB):
            model.malloc(n)
    assert m2.history == m.history != []
    assert _layout(m2.segments_state()) == _layout(m.segments_state())


def test_seeding_after_empty_cache_keeps_the_layout() -> None:
    m = CachingAllocatorModel()
    # 16 MiB does not fit the 15 MiB that 5 MiB leaves of its 20 MiB segment: its own segment.
    a, _b, c = m.malloc(5 * MiB), m.malloc(16 * MiB), m.malloc(100)
    m.free(a)
    m.free(c)
    m.empty_cache()  # the 20 MiB and 2 MiB segments go; the 16 MiB one stays
    m.malloc(200)
    state = m.segments_state()
    m2 = CachingAllocatorModel()
    m2.seed(state)
    assert _layout(m2.segments_state()) == _layout(state)
    assert _layout(state) == [
        [16 * MiB, 0, "large", [[16 * MiB, 1]]],
        [2 * MiB, 0, "small", [[512, 1], [2 * MiB - 512, 0]]],
    ]
    assert [s[0] for s in state] == [20 * MiB, 38 * MiB]
    assert [s[0] for s in m2.segments_state()] == [0, 16 * MiB]


# -- the format --------------------------------------------------------------------------


def _sample_trace(n: int = 3) -> dict[str, Any]:
    tb = TraceBuilder()
    tb.segments_before = [[S, 2 * MiB, 0, "small", [[512, 1], [2 * MiB - 512, 0]]]]
    tb.event("segment_alloc", B, 20 * MiB)
    for i in range(n):
        call = tb.call("mm" if i % 2 else "add")
        tb.event("alloc", B + i * 2 * MiB, 2 * MiB, call=call)
    for i in range(n):
        tb.event("free_requested", B + i * 2 * MiB, 2 * MiB)
        tb.event("free_completed", B + i * 2 * MiB, 2 * MiB)
    t = tb.build()
    t["calls"][0][1] = 12.5
    return t


def _write_corpus(root: Path, n_cases: int = 2) -> dict[str, Any]:
    index = corpus.new_index("simulated", {"gpu": "simulated"}, note="test")
    for i in range(n_cases):
        case_id = f"rnn/lstm/train/fp32/b{i + 1}"
        steps = {"cold": _sample_trace(3 + i), "warm": _sample_trace(2)}
        entry = {"id": case_id, "spec": {"kind": "rnn"}, "status": "ok", "steps": {}}
        entry.update(corpus.write_trace_file(root, case_id, steps))
        index["cases"].append(entry)
    corpus.save_index(root, index)
    return index


def test_a_corpus_reads_back_as_written(tmp_path: Path) -> None:
    index = _write_corpus(tmp_path)
    assert corpus.load_index(tmp_path) == index
    case = index["cases"][1]
    assert case["file"] == "cases/rnn__lstm__train__fp32__b2.json.gz"
    data = (tmp_path / case["file"]).read_bytes()
    assert (case["bytes"], case["sha256"]) == (len(data), hashlib.sha256(data).hexdigest())
    steps = corpus.load_traces(tmp_path, case)
    assert steps == {"cold": _sample_trace(4), "warm": _sample_trace(2)}
    # The same traces write the same bytes (no time stamp in the gzip header).
    again = corpus.write_trace_file(tmp_path / "again", case["id"], steps)
    assert again["sha256"] == case["sha256"]
    assert not list(tmp_path.rglob("*.tmp"))


def test_writing_refuses_a_bad_trace(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="step must be one of"):
        corpus.write_trace_file(tmp_path, "x/y", {"hot": _sample_trace()})
    bad = _sample_trace()
    bad["events"]["call"][1] = 99
    with pytest.raises(ValueError, match="x/y warm: an event's operator call is out of range"):
        corpus.write_trace_file(tmp_path, "x/y", {"warm": bad})
    with pytest.raises(ValueError, match="source must be one of"):
        corpus.new_index("guessed", {})


# -- damaged input -----------------------------------------------------------------------


def test_a_flipped_byte_is_damage(tmp_path: Path) -> None:
    index = _write_corpus(tmp_path)
    case = index["cases"][0]
    path = tmp_path / case["file"]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(CorpusError, match="damaged") as err:
        corpus.load_traces(tmp_path, case)
    assert str(path) in str(err.value)
    # Without the checksum, gzip's own CRC (or the deflate stream) still catches it.
    del case["sha256"]
    with pytest.raises(CorpusError, match="unreadable") as err:
        corpus.load_traces(tmp_path, case)
    assert str(path) in str(err.value)


def test_a_truncated_file_is_named_truncated(tmp_path: Path) -> None:
    index = _write_corpus(tmp_path)
    case = index["cases"][0]
    path = tmp_path / case["file"]
    data = path.read_bytes()
    del case["sha256"]  # so that the checksum does not catch it first
    for keep in (len(data) - 4, len(data) // 2, 20):
        path.write_bytes(data[:keep])
        with pytest.raises(CorpusError) as err:
            corpus.load_traces(tmp_path, case)
        assert str(err.value) == f"{path}: truncated"


def test_an_unknown_version_is_named(tmp_path: Path) -> None:
    index = _write_corpus(tmp_path)
    raw = json.loads((tmp_path / "index.json").read_text())
    raw["version"] = 7
    (tmp_path / "index.json").write_text(json.dumps(raw))
    with pytest.raises(CorpusError, match="format version 7, this checkout reads version 1"):
        corpus.load_index(tmp_path)

    case = index["cases"][0]
    path = tmp_path / case["file"]
    doc = json.loads(gzip.decompress(path.read_bytes()))
    doc["version"] = 2
    data = gzip.compress(json.dumps(doc).encode(), mtime=0)
    path.write_bytes(data)
    case["sha256"] = hashlib.sha256(data).hexdigest()
    with pytest.raises(CorpusError) as err:
        corpus.load_traces(tmp_path, case)
    assert str(err.value) == f"{path}: format version 2, this checkout reads version 1"


def test_a_missing_index_is_named(tmp_path: Path) -> None:
    with pytest.raises(CorpusError) as err:
        corpus.load_index(tmp_path / "nowhere")
    assert str(err.value).startswith(str(tmp_path / "nowhere" / "index.json"))
    assert "no such file" in str(err.value)


def test_check_fails_on_a_damaged_file_and_lists_it(tmp_path: Path) -> None:
    index = _write_corpus(tmp_path)
    path = tmp_path / index["cases"][1]["file"]
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    proc = cli("check", tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    summary = last_json(proc.stdout)
    assert len(summary["damaged"]) == 1
    assert str(path) in summary["damaged"][0] and "damaged" in summary["damaged"][0]
    # The case that is whole is still replayed, and matches.
    assert summary["steps_replayed"] == summary["matched"] == 2
    assert f"DAMAGED {path}" in proc.stdout


# -- a simulated capture, end to end -------------------------------------------------------

ONLY = (
    "rnn/lstm/train/fp32/b1",
    "rnn/gru/infer/fp32/b16",
    # replayed through the model's expandable segments
    "zoo/gpt2/infer/fp32/b4/expandable_segments",
)


@pytest.fixture(scope="module")
def simulated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("simulated") / "corpus"
    proc = cli("capture", "--out", out, "--simulate", "--only", ",".join(ONLY))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = last_json(proc.stdout)
    assert summary["source"] == "simulated" and summary["errors"] == 0
    return out


def test_simulated_capture_writes_ok_cases_with_figures(simulated: Path) -> None:
    index = corpus.load_index(simulated)
    assert index["source"] == "simulated"
    assert index["environment"]["gpu"] == "simulated"
    by_id = {c["id"]: c for c in index["cases"]}
    # A whole case id names that case alone (rnn/lstm/train/fp32/b1, not .../b16 too).
    assert set(by_id) == set(ONLY)
    for case_id in ONLY:
        case = by_id[case_id]
        assert case["status"] == "ok"
        assert case["spec"]["id"] == case_id
        for step in corpus.STEPS:
            fig = case["steps"][step]
            assert fig["max_reserved"] >= fig["max_allocated"] > 0
            assert fig["reserved_before"] >= fig["allocated_before"] > 0
        traces = corpus.load_traces(simulated, case)
        assert set(traces) == set(corpus.STEPS)
        for trace in traces.values():
            assert any(a == "alloc" for a, *_ in corpus.events(trace))


def test_simulated_capture_checks_clean(
    simulated: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, err = run_main(capsys, "check", simulated)
    assert rc == 0, out + err
    summary = last_json(out)
    assert summary["damaged"] == [] and summary["differs"] == []
    assert summary["steps_replayed"] == 2 * summary["traced_cases"] >= 4
    assert summary["matched"] == summary["single_stream_steps"] == summary["steps_replayed"]


def test_simulated_capture_diffs_against_the_estimator(
    simulated: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, err = run_main(capsys, "diff", simulated, "rnn/lstm/train/fp32/b1", "--device", "cpu")
    assert rc == 0, out + err
    assert "rnn/lstm/train/fp32/b1 (warm step) on cpu:" in out
    summary = last_json(out)
    assert summary["case"] == "rnn/lstm/train/fp32/b1" and summary["step"] == "warm"
    assert summary["real_allocations"] > 0 and summary["predicted_allocations"] > 0
    assert summary["by_op"]
    # a warm step: the estimate's loop (its first step, then the steps after it), from a
    # fresh process and from the segments the recorded cold step began with
    reserved = summary["reserved"]
    assert set(reserved) == {"real", "fresh_process", "from_recorded_segments"}
    assert reserved["real"] > 0 and reserved["fresh_process"] > 0
    assert reserved["from_recorded_segments"] > 0
    # a cold step: the estimate's first step, from a fresh process and from the segments
    # the recorded step began with
    rc, out, err = run_main(
        capsys, "diff", simulated, "rnn/lstm/train/fp32/b1", "--device", "cpu", "--step", "cold"
    )
    assert rc == 0, out + err
    reserved = last_json(out)["reserved"]
    assert set(reserved) == {"real", "fresh_process", "from_recorded_segments"}
    assert reserved["from_recorded_segments"] > 0 and reserved["fresh_process"] > 0


def test_diff_at_the_peak_sets_what_was_live_side_by_side(
    simulated: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--at-peak``: each side's peak over what its step began with, and what was live then
    by operator. The operators' bytes add up to each peak."""
    rc, out, err = run_main(
        capsys,
        "diff",
        simulated,
        "rnn/lstm/train/fp32/b1",
        "--device",
        "cpu",
        "--at-peak",
        "--top",
        "1000",
    )
    assert rc == 0, out + err
    assert "at the peak (over what the step began with)" in out
    peak = last_json(out)["at_peak"]
    assert peak["real_bytes"] > 0 and peak["predicted_bytes"] > 0
    assert sum(r["real_bytes"] for r in peak["by_op"]) == peak["real_bytes"]
    assert sum(r["predicted_bytes"] for r in peak["by_op"]) == peak["predicted_bytes"]


def test_diff_names_an_unknown_case(simulated: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _out, err = run_main(capsys, "diff", simulated, "rnn/lstm/train")
    assert rc == 2
    assert "no case 'rnn/lstm/train'" in err and "did you mean rnn/lstm/train/fp32/b1" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_capture_without_a_gpu_says_so_in_one_line(tmp_path: Path) -> None:
    proc = cli("capture", "--out", tmp_path / "corpus")
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no usable CUDA device" in lines[0]
    assert not (tmp_path / "corpus").exists()


# -- a real GPU ----------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.timeout(660)  # the capture may take its 120 s budget, and the models load first
def test_real_capture_ties_allocations_to_operators_and_replays(tmp_path: Path) -> None:
    out = tmp_path / "corpus"
    only = ("zoo/gpt2/infer/fp32/b1", "rnn/lstm/train/fp32/b1")
    proc = cli("capture", "--out", out, "--only", ",".join(only), "--budget", "120", timeout=540)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    index = corpus.load_index(out)
    assert index["source"] == "cuda"
    assert index["environment"]["gpu"] == torch.cuda.get_device_name(0)
    by_id = {c["id"]: c for c in index["cases"]}
    for case_id in only:
        case = by_id[case_id]
        assert case["status"] == "ok", case.get("error")
        for step in corpus.STEPS:
            fig = case["steps"][step]
            assert fig["max_reserved"] >= fig["max_allocated"] > 0
        traces = corpus.load_traces(out, case)
        assert set(traces) == set(corpus.STEPS)
        for step, trace in traces.items():
            actions = trace["actions"]
            calls = [
                c
                for a, c in zip(trace["events"]["action"], trace["events"]["call"], strict=True)
                if actions[a] == "alloc"
            ]
            assert calls, f"{case_id} {step}: no allocations recorded"
            tied = sum(1 for c in calls if c >= 0)
            assert tied >= 0.9 * len(calls), f"{case_id} {step}: {tied} of {len(calls)} tied"
        timed = [us for _, us in traces["warm"]["calls"] if us is not None]
        assert len(timed) >= 0.9 * len(traces["warm"]["calls"]) > 0
        assert all(us >= 0 for us in timed)
        assert all(us is None for _, us in traces["cold"]["calls"])
    proc = cli("check", out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = last_json(proc.stdout)
    assert summary["damaged"] == [] and summary["differs"] == []
    assert summary["single_stream_steps"] > 0
    assert summary["matched"] == summary["single_stream_steps"]


def test_a_capture_runs_what_no_corpus_traced_on_its_gpu_model_first() -> None:
    data = ROOT / "benchmarks" / "data" / "cuda_truth"
    traced = cuda_truth.traced_before("NVIDIA H200", data)
    # the traced H200 corpus' cases (the summary corpus kept no traces)
    assert "zoo/gpt2/train/fp32/b1" in traced and "zoo/lstm/infer/fp32/b1" not in traced
    assert cuda_truth.traced_before("NVIDIA H100 80GB HBM3", data) == set()
    cases = [{"id": i} for i in ("a", "b", "c", "d")]
    ordered, moved = cuda_truth.untraced_first(cases, {"a", "c"})
    assert [c["id"] for c in ordered] == ["b", "d", "a", "c"] and moved == 2
