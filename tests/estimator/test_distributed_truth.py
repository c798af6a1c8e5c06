"""One rank's estimate against real ranks: DDP and FSDP2 with gloo on this machine's CPU.

Each rank is its own process; its peak is measured as ``estimate_accuracy`` measures one
process (what it holds between steps plus the peak of PyTorch's profiler memory timeline in a
steady-state step): ``benchmarks/_dist_truth.py``. ``benchmarks/distributed_estimate.py`` runs
the whole matrix; these are its cheapest rows, and one of each kind of peak it found.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from vramctl.estimator import Parallel, estimate

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))

import _dist_truth

T5 = {"seq_len": 32}
ROWS = [
    ("t5-small", "ddp:2,gradient_as_bucket_view", 1, T5),
    ("t5-small", "fsdp:2", 1, T5),
    ("t5-small", "fsdp:4", 1, T5),
    # peaks inside the last stage's reduce-scatter, where gloo holds a copy of its input
    ("resnet-50", "fsdp:2", 2, {}),
    # peaks in a grouped convolution's weight gradient: oneDNN's scratch per thread, and a
    # rank has one thread
    ("wav2vec2-base", "ddp:2", 2, {"seconds": 1.0}),
]


@pytest.mark.parametrize(("model", "layout", "batch", "lengths"), ROWS)
def test_estimate_matches_every_real_rank(
    model: str, layout: str, batch: int, lengths: dict[str, object]
) -> None:
    par = Parallel.parse(layout)
    est = estimate(model, batch_size=batch, device="cpu", parallel=par, **lengths)
    measured = _dist_truth.measure(model, par, batch_size=batch, lengths=lengths, timeout=240)
    assert len(measured) == par.world_size
    for _ in range(2):
        if abs(est.logical_peak - max(measured)) <= 0.01 * max(measured):
            break
        # gloo frees its reduce-scatter copies on its worker threads; on a loaded machine a
        # free can come after the rank's next allocation, which a run's peak then holds
        # (seen: +5.5% on one resnet-50 rank in a few runs, +3.1% in two runs in a row).
        # That only adds, so each rank's smallest over the runs is its own peak.
        again = _dist_truth.measure(model, par, batch_size=batch, lengths=lengths, timeout=240)
        measured = [min(a, b) for a, b in zip(measured, again, strict=True)]
    top = max(measured)
    # the benchmark's rows agree to 0.1%; allow 1% either way
    assert abs(est.logical_peak - top) <= 0.01 * top, (est.logical_peak, measured)
