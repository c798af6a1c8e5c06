"""The demo behind ``vramctl demo``: its shipped clip lengths, and a run that resumes."""

from __future__ import annotations

from pathlib import Path

import pytest

from vramctl.cli._demo import demo, demo_lengths


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
