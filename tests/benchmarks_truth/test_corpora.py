"""The committed CUDA truth corpora, checked on every CI run (no GPU needed).

Every corpus under ``benchmarks/data/cuda_truth/`` must load, and each traced case's file
must match its checksum and replay through the allocator model (single-stream steps
exactly). The estimator is held to the figures it reached on each GPU's recorded truth, so
a change that makes it worse there fails here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

from _truth import corpus  # noqa: E402
from _truth.cases import estimate_case  # noqa: E402
from _truth.replay import replay  # noqa: E402

from _common import error_stats  # noqa: E402

DATA = BENCH / "data" / "cuda_truth"
CORPORA = sorted(p.parent for p in DATA.glob("*/index.json"))
H200 = DATA / "nvidia-h200-2026-11-25"


def test_there_is_a_corpus_and_a_readme() -> None:
    assert H200 in CORPORA
    assert (DATA / "README.md").is_file()


@pytest.mark.parametrize("root", CORPORA, ids=[p.name for p in CORPORA])
def test_every_committed_corpus_loads_and_replays(root: Path) -> None:
    index = corpus.load_index(root)
    assert index["cases"], f"{root.name} holds no cases"
    assert index["environment"].get("gpu"), f"{root.name} does not say which GPU"
    differs = []
    for case in index["cases"]:
        if not case.get("file") or case.get("status", "ok") != "ok":
            continue
        for step, trace in corpus.load_traces(root, case).items():
            r = replay(trace)
            if r.match is False:
                differs.append(f"{case['id']} {step}: {r.first_difference}")
    assert not differs, differs


def test_the_h200_rows_give_the_figures_the_gpu_run_printed() -> None:
    """The 20 quick rows measured on an H200 (2026-11-25), estimated here with its profile.

    The GPU run printed median 4.145% and worst under-estimate 37.414% for the allocated
    peak; the measured side is kept to 3 significant digits, so the figures agree to a few
    hundredths of a percent. A larger worst under-estimate means the estimator got worse.
    """
    from vramctl.estimator import load_calibration

    index = corpus.load_index(H200)
    cal = load_calibration(H200 / "calibration.json")
    pairs = []
    for case in index["cases"]:
        est = estimate_case(case["spec"], index["environment"]["gpu"], calibration=cal)
        pairs.append((est.peak_allocated, case["steps"]["warm"]["max_allocated"]))
    stats = error_stats(pairs)
    assert stats["rows"] == 20
    assert stats["median_pct"] == pytest.approx(4.145, abs=0.1)
    assert stats["worst_under_pct"] <= 37.5
