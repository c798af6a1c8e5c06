"""The processing run on a real GPU (``cuda``-marked: skipped where none is usable)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import vramctl
from tests.batching.test_process import Frames, write_manifest
from vramctl.batching import ProcessStatus, process

pytestmark = pytest.mark.cuda


def _outputs(path: str) -> dict[str, dict[str, float]]:
    with open(path) as f:
        return {d["id"]: d["output"] for d in map(json.loads, f)}


def test_process_on_every_gpu_matches_the_cpu_and_survives_a_squeeze(tmp_path: Path) -> None:
    manifest = write_manifest(tmp_path / "m.jsonl", [2.0 + (i * 3.7) % 30 for i in range(60)])
    ballast: list[torch.Tensor] = []
    gpu = vramctl.gpus()[0]

    def squeeze(status: ProcessStatus) -> None:
        if status.batches == 2 and not ballast:  # another job takes most of what is free
            free, _ = torch.cuda.mem_get_info(gpu.index)
            ballast.append(torch.empty(int(free * 0.9), dtype=torch.uint8, device="cuda"))
        if status.batches == 6:
            ballast.clear()

    try:
        on_gpu = process(
            Frames, manifest, tmp_path / "gpu.jsonl", loader="synthetic", on_progress=squeeze
        )
    finally:
        ballast.clear()
        torch.cuda.empty_cache()
    assert on_gpu.devices[0]["device"].startswith(("cuda", "mig"))
    assert (on_gpu.done, on_gpu.failed, on_gpu.lost) == (60, 0, 0)
    assert on_gpu.ooms_recovered == on_gpu.ooms
    on_cpu = process(Frames, manifest, tmp_path / "cpu.jsonl", loader="synthetic", devices=["cpu"])
    a, b = _outputs(on_gpu.output), _outputs(on_cpu.output)
    assert a.keys() == b.keys()
    for key in a:
        assert a[key]["frames"] == b[key]["frames"]
        assert a[key]["mean"] == pytest.approx(b[key]["mean"], abs=1e-3)
