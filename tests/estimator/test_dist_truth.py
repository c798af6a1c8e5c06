"""The distributed truth (``benchmarks/_dist_truth.py``) checked against itself, on real ranks.

``measure`` adds what Python can see a rank hold (parameters, buffers, optimizer state, the
batch, DDP's buckets) to the step's peak; ``measure_whole`` takes the allocator's own count
of live bytes over the rank's whole life. They agree only if the baseline misses nothing.
``measure_both`` reads both from the same two gloo processes (on CPU), at half the cost.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest

from vramctl.estimator._parallel import Parallel

BENCHMARKS = str(Path(__file__).parents[2] / "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)

import _dist_truth  # noqa: E402

pytestmark = pytest.mark.slow

#: A small LSTM step: starting the ranks and building the model are most of the time.
KW: dict[str, Any] = {"batch_size": 1, "lengths": {"seq_len": 16}, "timeout": 120.0}


@pytest.mark.parametrize(
    "parallel",
    [Parallel("ddp", 2), Parallel("fsdp", 2)],
    ids=lambda p: p.strategy,
)
def test_measured_baseline_misses_nothing(parallel: Parallel) -> None:
    got, whole = _dist_truth.measure_both("lstm", parallel, **KW)
    assert len(got) == len(whole) == 2
    for g, w in zip(got, whole, strict=True):
        assert w > 100 * 2**20  # the LSTM's weights and AdamW's state, at least
        assert abs(g - w) <= 0.005 * w, (got, whole)
    assert got[0] == got[1]  # the same batch and equal shards on both ranks


def test_a_failed_rank_raises_with_its_traceback() -> None:
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="no-such-model") as info:
        _dist_truth.measure("no-such-model", Parallel("ddp", 2), **KW)
    assert "Traceback" in str(info.value)
    assert time.monotonic() - start < 60
