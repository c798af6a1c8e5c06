"""max_batch_size's searches: lengths without a limit, and sizes too big to trace."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import vramctl
from vramctl.estimator import EstimateError, zoo
from vramctl.estimator._maxbatch import LENGTH_BOUND, _confirm, _search_length

BUDGET = 10**9


def fake_at(
    peak: Callable[[float], float], untraceable_above: float | None = None
) -> tuple[Callable[..., Any], list[float]]:
    """An ``at(batch, length)`` whose traces follow ``peak`` of the length (or, with no
    length, of the batch size); the sizes it was asked for."""
    asked: list[float] = []

    def at(b: int, n: float | None = None) -> Any:
        x = b if n is None else n
        asked.append(x)
        if untraceable_above is not None and x > untraceable_above:
            raise EstimateError(f"could not trace the model: {x} is too long")
        p = int(peak(x))
        return SimpleNamespace(peak_device=p, fits=p <= BUDGET, headroom=BUDGET - p)

    return at, asked


def test_length_without_a_limit_is_searched_not_overflowed() -> None:
    # lstm has no max_length: its ceiling was infinity, and rounding it overflowed.
    at, asked = fake_at(lambda n: 10**8 + 4000 * n)  # fits up to 225,000 tokens
    n, curve, at_ceiling = _search_length(zoo.get("lstm"), "seq_len", at, BUDGET)
    assert isinstance(n, int) and not at_ceiling
    assert n <= 225_000 < n * 1.05
    assert (n, 10**8 + 4000 * n, True) in curve
    assert len(set(asked)) < 20


def test_length_that_always_fits_stops_at_the_bound_and_says_so() -> None:
    at, asked = fake_at(lambda n: 10**8)
    n, _curve, at_ceiling = _search_length(zoo.get("lstm"), "seq_len", at, BUDGET)
    assert n == LENGTH_BOUND["seq_len"] and at_ceiling
    assert len(set(asked)) < 30
    # wav2vec2-base has no limit either: its bound is in seconds.
    at, _ = fake_at(lambda s: 10**8)
    s, _curve, at_ceiling = _search_length(zoo.get("wav2vec2-base"), "seconds", at, BUDGET)
    assert s == LENGTH_BOUND["seconds"] and at_ceiling


def test_length_too_long_to_trace_does_not_fit() -> None:
    # Everything that traces fits; past 61 s the trace fails (as a long CTC loss does).
    at, _ = fake_at(lambda s: 10**8 + 1000 * s * s, untraceable_above=61.0)
    s, curve, at_ceiling = _search_length(zoo.get("wav2vec2-base"), "seconds", at, BUDGET)
    assert 58.0 <= s <= 61.0 and not at_ceiling
    assert all(x <= 61.0 for x, _p, _f in curve)


def test_length_that_cannot_be_traced_at_its_shortest_is_an_error() -> None:
    at, _ = fake_at(lambda s: 10**8, untraceable_above=0.5)
    with pytest.raises(EstimateError, match="could not trace"):
        _search_length(zoo.get("wav2vec2-base"), "seconds", at, BUDGET)


def test_length_that_does_not_fit_at_its_shortest_is_zero() -> None:
    at, _ = fake_at(lambda n: 2 * BUDGET)
    n, _curve, at_ceiling = _search_length(zoo.get("lstm"), "seq_len", at, BUDGET)
    assert n == 0 and not at_ceiling


def test_length_with_a_limit_stops_at_it() -> None:
    at, asked = fake_at(lambda n: 10**8)
    n, _curve, at_ceiling = _search_length(zoo.get("gpt2"), "seq_len", at, BUDGET)
    assert n == 1024 and at_ceiling and max(asked) == 1024


def test_batch_too_big_to_trace_does_not_fit() -> None:
    at, _ = fake_at(lambda b: 10**8 + 10**6 * b, untraceable_above=50)
    assert _confirm(at, 500, 1 << 16, 10**6, [1, 2, 4]) == (50, 51)


def test_max_length_of_a_model_without_a_limit() -> None:
    # 3 GiB: the LSTM's fp32 cuDNN workspace holds its 64 MiB of weights, and its loop's
    # second step needs a segment of its own (the first step's cuBLAS workspace is cut from
    # the one it freed), so at its safe end batch 1 no longer fits in 2 GiB
    res = vramctl.max_batch_size("lstm", device="3GiB", mode="infer", lengths=True)
    assert res.length_arg == "seq_len" and not res.length_at_ceiling
    assert isinstance(res.max_length, int) and res.max_length > 256
    fits = [n for n, _p, f in res.length_curve if f]
    assert max(fits) == res.max_length
    assert any(not f and n <= res.max_length * 1.05 + 1 for n, _p, f in res.length_curve)
    assert res.to_dict()["length_at_ceiling"] is False


# -- the batch search never reports a size it did not bracket ---------------------------


def wide_mlp() -> torch.nn.Module:
    """Small inputs, 40 KB of activations a sample: the peaks of its probes (batches 1, 2
    and 4) round to the same bytes, and memory binds far above 65,536 samples on a T4."""
    return torch.nn.Sequential(
        torch.nn.Linear(64, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 64)
    )


def mlp_batch(b: int) -> torch.Tensor:
    return torch.zeros(b, 64)


def test_probes_that_round_to_one_peak_double_until_memory_binds() -> None:
    # The case: on a T4 it said "65536 (0 bytes per sample, confirmed by a trace)",
    # the search's cap, though nothing above it had been traced.
    res = vramctl.max_batch_size(wide_mlp(), mlp_batch, device="T4-16GB")
    probes = {b: p for b, p, _ in res.curve if b <= 4}
    assert len(set(probes.values())) == 1  # the case: no slope from the probes
    assert res.limit_found and res.stopped_by is None
    assert 65536 < res.batch_size < res.search_ceiling
    assert res.per_sample > 4 * 4096  # the activations, not 0
    curve = {b: f for b, _p, f in res.curve}
    assert curve[res.batch_size] and curve[res.batch_size + 1] is False
    size = res.batch_size
    assert vramctl.estimate(wide_mlp(), mlp_batch, batch_size=size, device="T4-16GB").fits
    assert not vramctl.estimate(wide_mlp(), mlp_batch, batch_size=size + 1, device="T4-16GB").fits
    doc = res.to_dict()
    assert doc["limit_found"] is True and doc["max_batch_size"] == size
    # A limit above the answer changes nothing.
    again = vramctl.max_batch_size(wide_mlp(), mlp_batch, device="T4-16GB", limit=1 << 20)
    assert again.limit_found and again.batch_size == size


def test_no_limit_found_up_to_the_limit_says_so() -> None:
    res = vramctl.max_batch_size(wide_mlp(), mlp_batch, device="T4-16GB", limit=65536)
    assert res.batch_size == 65536 and not res.limit_found
    assert res.stopped_by == "limit" and res.search_ceiling == 65536
    assert all(f for _b, _p, f in res.curve)
    doc = res.to_dict()
    assert doc["limit_found"] is False and doc["stopped_by"] == "limit"


def test_no_limit_found_up_to_the_bound_or_the_host_memory_of_its_batches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import vramctl.estimator._maxbatch as mb

    monkeypatch.setattr(mb, "BATCH_BOUND", 256)
    res = vramctl.max_batch_size(wide_mlp(), mlp_batch, device="T4-16GB")
    assert (res.batch_size, res.limit_found, res.stopped_by) == (256, False, "bound")
    # Each traced size is a real batch from the callable: 256 bytes a sample here.
    monkeypatch.setattr(mb, "BATCH_BOUND", 1 << 24)
    monkeypatch.setattr(mb, "SEARCH_INPUT_BYTES", 1 << 16)
    res = vramctl.max_batch_size(wide_mlp(), mlp_batch, device="T4-16GB")
    assert res.search_ceiling == 256 and res.stopped_by == "input" and not res.limit_found
    assert max(b for b, _p, _f in res.curve) == 256


def test_jumpy_peaks_near_the_edge_do_not_creep_one_by_one() -> None:
    # Fits up to 7300 while the headroom always says one more sample (peaks that fit
    # only after the allocator frees its cache): the old search crept up by one, ran out
    # of traces, and reported an unbracketed size.
    asked: list[int] = []

    def at(b: int, n: float | None = None) -> Any:
        asked.append(b)
        return SimpleNamespace(peak_device=10**6 * b, fits=b <= 7300, headroom=10**6)

    assert _confirm(at, 7000, 1 << 24, 10**6, [1, 2, 4]) == (7300, 7301)
    assert len(set(asked)) < 40


def test_doubling_from_flat_probes_brackets_the_edge() -> None:
    # Flat up to 64 samples (the allocator's rounding), then 10 MB a sample.
    at, asked = fake_at(lambda b: 5 * 10**8 + 10**7 * max(0, b - 64))
    lo, hi = _confirm(at, 8, 1 << 24, 0.0, [1, 2, 4])
    assert (lo, hi) == (114, 115)
    assert len(set(asked)) < 30


def test_a_bracket_made_by_a_batch_that_could_not_be_traced_says_so() -> None:
    def mk(b: int) -> torch.Tensor:
        if b > 50:
            raise ValueError("the dataset has 50 samples")
        return torch.zeros(b, 64)

    res = vramctl.max_batch_size(wide_mlp(), mk, device="T4-16GB")
    assert res.batch_size == 50 and res.limit_found
    assert len(res.notes) == 1 and "batch 51 could not be traced" in res.notes[0]
    assert "50 samples" in res.notes[0] and res.to_dict()["notes"] == list(res.notes)
