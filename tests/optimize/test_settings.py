"""The environment's overrides: parsed, and a malformed value named."""

from __future__ import annotations

import pytest

from vramctl.optimize import OptimizeError
from vramctl.optimize._settings import ENV, Overrides, read_overrides


def test_nothing_set_is_no_override() -> None:
    assert read_overrides({}) == Overrides()
    assert read_overrides({v: "" for v in ENV.values()}) == Overrides()


def test_each_variable_is_read() -> None:
    got = read_overrides(
        {
            "VRAMCTL_AMP": "1",
            "VRAMCTL_AMP_DTYPE": "FP16",
            "VRAMCTL_TF32": "off",
            "VRAMCTL_CHECKPOINTING": "selective",
            "VRAMCTL_COMPILE": "true",
            "VRAMCTL_CHANNELS_LAST": "0",
        }
    )
    assert got == Overrides(
        amp=True,
        amp_dtype="fp16",
        tf32=False,
        checkpointing="selective",
        compile=True,
        channels_last=False,
    )
    assert got.source("tf32") == "VRAMCTL_TF32=0"
    assert got.source("checkpointing") == "VRAMCTL_CHECKPOINTING=selective"


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("VRAMCTL_AMP", "2", "VRAMCTL_AMP must be 0 or 1, got '2'"),
        ("VRAMCTL_AMP_DTYPE", "fp8", "VRAMCTL_AMP_DTYPE must be one of bf16, fp16, got 'fp8'"),
        ("VRAMCTL_TF32", "maybe", "VRAMCTL_TF32 must be 0 or 1"),
        ("VRAMCTL_CHECKPOINTING", "half", "VRAMCTL_CHECKPOINTING must be one of none, selective"),
        ("VRAMCTL_COMPILE", "yes please", "VRAMCTL_COMPILE must be 0 or 1"),
        ("VRAMCTL_CHANNELS_LAST", "nhwc", "VRAMCTL_CHANNELS_LAST must be 0 or 1"),
    ],
)
def test_a_malformed_value_names_its_variable(variable: str, value: str, expected: str) -> None:
    with pytest.raises(OptimizeError) as err:
        read_overrides({variable: value})
    assert str(err.value).startswith(expected)


def test_read_from_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VRAMCTL_COMPILE", "0")
    assert read_overrides().compile is False
