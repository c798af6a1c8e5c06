"""The demo behind ``vramctl demo``: its shipped clip lengths, and a run that resumes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.estimator.real_steps import cpu_infer_peak
from vramctl.cli._batch import _print_demo
from vramctl.cli._demo import _make_batch, build_model, demo, demo_lengths


def test_the_shipped_lengths_are_librispeech_utterances() -> None:
    lengths = demo_lengths()
    seconds = [s for _, s in lengths]
    assert (len(lengths), round(min(seconds), 2), round(max(seconds), 2)) == (2000, 1.95, 19.3)


@pytest.mark.slow
def test_a_demo_run_again_on_its_folder_resumes(tmp_path: Path) -> None:
    first = demo(6, output=tmp_path, squeeze=False)
    assert first.result.done == 6
    again = demo(6, output=tmp_path, squeeze=False)
    assert (again.result.done, again.result.skipped, again.result.lost) == (0, 6, 0)
    assert again.output_lines == 6


def test_the_report_shows_each_buckets_difference_and_what_it_is(
    capsys: pytest.CaptureFixture[str],
) -> None:
    fit = [
        {"seconds": 4.0, "count": 26, "predicted_bytes": 122, "measured_bytes": 100},
        {"seconds": 16.0, "count": 6, "predicted_bytes": 118, "measured_bytes": 100},
    ]
    doc: dict[str, Any] = {
        "model": "wav2vec2-mini",
        "parameters": 3_500_000,
        "device": "sim:256MiB",
        "simulated": True,
        "capacity_bytes": 256 * 2**20,
        "batch_sizes": {"4.0s": 26, "16.0s": 6},
        "fit": fit,
        "fit_note": "what the two figures are",
        "clips": 4,
        "audio_seconds": 40.0,
        "clips_per_s": 1.0,
        "audio_hours_per_hour": 10.0,
        "peak_bytes": 100,
        "peak_of_capacity": 0.0,
        "squeeze_bytes": 0,
        "ooms_recovered": 0,
        "ooms": 0,
        "padding_pct": 1.0,
        "batches": 2,
        "done": 4,
        "failed": 0,
        "lost": 0,
        "notes": [],
        "output": None,
    }
    _print_demo(doc)
    out = " ".join(capsys.readouterr().out.split())
    assert "difference" in out and "+22%" in out and "+18%" in out
    assert "predicted vs measured: what the two figures are." in out


@pytest.mark.slow
def test_the_demo_says_why_its_prediction_is_above_the_simulated_count() -> None:
    report = demo(4, squeeze=False)
    assert report.simulated and "simulated GPU counts only the tensors" in report.fit_note
    assert "scratch" in report.to_dict()["fit_note"]
    for row in report.fit:
        assert row["measured_bytes"] < row["predicted_bytes"], row
    # What the note says: the prediction is the step as the CPU kernels take memory (the
    # profiler's count, scratch included); the simulated GPU saw only the returned tensors.
    row = report.fit[0]
    profiled = cpu_infer_peak(build_model(report.model), _make_batch(row["count"], row["seconds"]))
    assert abs(profiled - row["predicted_bytes"]) <= 0.02 * row["predicted_bytes"], (profiled, row)
    assert profiled > 1.1 * row["measured_bytes"], (profiled, row)
