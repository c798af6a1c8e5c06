"""The environment's overrides of :func:`vramctl.optimize`'s choices.

Each variable wins over the function's arguments and its ``level`` (a job's settings can
then be changed without touching its code); an unset or empty variable leaves the choice
to them:

===========================  ==================================================
``VRAMCTL_AMP``              ``0``: no autocast (fp32); ``1``: autocast, the dtype
                             by ``VRAMCTL_AMP_DTYPE`` or the device
``VRAMCTL_AMP_DTYPE``        ``bf16`` or ``fp16``: autocast in that dtype
``VRAMCTL_TF32``             ``0`` or ``1``: TF32 matmul and cuDNN on a GPU
``VRAMCTL_CHECKPOINTING``    ``none``, ``selective`` or ``full``
``VRAMCTL_COMPILE``          ``0`` or ``1``: ``torch.compile``
``VRAMCTL_CHANNELS_LAST``    ``0`` or ``1``: channels-last weights for convolutions
===========================  ==================================================

``1``/``0`` may also be written ``true``/``false``, ``yes``/``no`` or ``on``/``off``.
A value that is none of these is an :class:`~vramctl.optimize.OptimizeError` naming the
variable.

>>> read_overrides({"VRAMCTL_AMP": "1", "VRAMCTL_AMP_DTYPE": "fp16"}).amp_dtype
'fp16'
>>> read_overrides({"VRAMCTL_TF32": "maybe"})
Traceback (most recent call last):
...
vramctl.optimize._errors.OptimizeError: VRAMCTL_TF32 must be 0 or 1, got 'maybe'
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from vramctl.optimize._checkpoint import KINDS
from vramctl.optimize._errors import OptimizeError

__all__ = ["ENV", "Overrides", "read_overrides"]

#: Each override's variable.
ENV = {
    "amp": "VRAMCTL_AMP",
    "amp_dtype": "VRAMCTL_AMP_DTYPE",
    "tf32": "VRAMCTL_TF32",
    "checkpointing": "VRAMCTL_CHECKPOINTING",
    "compile": "VRAMCTL_COMPILE",
    "channels_last": "VRAMCTL_CHANNELS_LAST",
}

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_DTYPES = ("bf16", "fp16")


@dataclass(frozen=True)
class Overrides:
    """What the environment sets (None: not set)."""

    amp: bool | None = None
    amp_dtype: str | None = None
    tf32: bool | None = None
    checkpointing: str | None = None
    compile: bool | None = None
    channels_last: bool | None = None

    def source(self, name: str) -> str:
        """``VARIABLE=value`` for an override that is set, for a report's reason."""
        value = getattr(self, name)
        if isinstance(value, bool):
            value = int(value)
        return f"{ENV[name]}={value}"


def _flag(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise OptimizeError(f"{name} must be 0 or 1, got {raw!r}")


def _choice(name: str, raw: str, choices: tuple[str, ...]) -> str:
    value = raw.strip().lower()
    if value not in choices:
        raise OptimizeError(f"{name} must be one of {', '.join(choices)}, got {raw!r}")
    return value


def read_overrides(environ: Mapping[str, str] | None = None) -> Overrides:
    """The overrides ``environ`` (``os.environ`` by default) sets; an empty value is unset."""
    env = os.environ if environ is None else environ
    raw = {key: env.get(var, "").strip() for key, var in ENV.items()}

    def flag(key: str) -> bool | None:
        return _flag(ENV[key], raw[key]) if raw[key] else None

    return Overrides(
        amp=flag("amp"),
        amp_dtype=_choice(ENV["amp_dtype"], raw["amp_dtype"], _DTYPES)
        if raw["amp_dtype"]
        else None,
        tf32=flag("tf32"),
        checkpointing=(
            _choice(ENV["checkpointing"], raw["checkpointing"], KINDS)
            if raw["checkpointing"]
            else None
        ),
        compile=flag("compile"),
        channels_last=flag("channels_last"),
    )
