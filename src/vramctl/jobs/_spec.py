"""A job's spec: what to run, where, and how much memory it needs (a dataclass, JSON, TOML).

Every problem of a spec is found at once and named by its field path, so that one
:class:`JobSpecError` says everything to fix:

>>> from vramctl.jobs import JobSpec, JobSpecError
>>> spec = JobSpec.from_dict(
...     {"name": "train", "command": ["python", "train.py"], "memory": "20GiB"}
... )
>>> spec.memory.size == 20 * 2**30
True
>>> try:
...     JobSpec.from_dict({"name": "train", "command": "python train.py", "memroy": "20GiB"})
... except JobSpecError as exc:
...     print(exc)
invalid job spec (3 problems):
  command: must be a list of arguments, not a shell string (vramctl never runs a shell); write ["python", "train.py"]
  memory: missing; give a size ("20GiB"), {estimate = {model = ...}} or {learned = {first = ...}}
  unknown field 'memroy' (did you mean 'memory'?)
"""  # noqa: E501

from __future__ import annotations

import copy
import difflib
import json
import math
import re
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from vramctl._errors import InvalidSizeError, VramctlError
from vramctl._units import parse_size
from vramctl.device import ComputeCapability

__all__ = [
    "MAX_SIZE",
    "DeviceConstraints",
    "GuardOptions",
    "JobSpec",
    "JobSpecError",
    "MemoryNeed",
    "ModelNeed",
    "load_spec",
    "parse_duration",
]

#: No memory need is larger than this (1 PiB): a larger one is a typo.
MAX_SIZE = 2**50

_KINDS = ("size", "estimate", "learned")
# \Z, not $: "$" also matches before a final newline, and "train\n" was a name.
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_ENTRY_RE = re.compile(rf"^{_IDENT}(?:\.{_IDENT})*:{_IDENT}(?:\.{_IDENT})*$")
_ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_DURATION_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(s|m|h|d|)\s*$", re.IGNORECASE)
_DURATION_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_MEMORY_FORMS = 'give a size ("20GiB"), {estimate = {model = ...}} or {learned = {first = ...}}'


class JobSpecError(VramctlError, ValueError):
    """A job spec with problems, or one no device can take.

    ``problems`` holds each problem as ``"field.path: what is wrong"``; the message
    lists them all, one per line.
    """

    def __init__(self, problems: list[str] | str, *, what: str = "invalid job spec") -> None:
        self.problems: list[str] = [problems] if isinstance(problems, str) else list(problems)
        self.what = what
        if len(self.problems) == 1:
            message = f"{what}: {self.problems[0]}"
        else:
            lines = "".join(f"\n  {p}" for p in self.problems)
            message = f"{what} ({len(self.problems)} problems):{lines}"
        super().__init__(message)


# -- checks shared by the constructors and the parser ---------------------------------


class _Bad:
    """A value that did not convert (its problem is already reported)."""


_BAD = _Bad()


def _unknown(path: str, data: Mapping[str, Any], known: tuple[str, ...]) -> list[str]:
    problems = []
    for key in data:
        if key in known:
            continue
        full = f"{path}.{key}" if path else str(key)
        close = difflib.get_close_matches(str(key), known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else f"; known: {', '.join(known)}"
        problems.append(f"unknown field {full!r}{hint}")
    return problems


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(float(value))
    )


#: The largest batch or sequence length a spec may ask for. Far past any step that runs, and
#: it keeps every product of them that pricing makes within what the store and the
#: estimator take (a batch of 2**63 was accepted and then failed every admission round).
MAX_COUNT = 2**31 - 1
#: The store keeps a priority as SQLite's signed 64-bit integer.
PRIORITY_RANGE = (-(2**63), 2**63 - 1)
#: The longest wait or run timeout: about 31 years.
MAX_SECONDS = 1e9


def _positive_int(path: str, value: object, problems: list[str]) -> None:
    if value is not None and not (_is_int(value) and value > 0):  # type: ignore[operator]
        problems.append(f"{path}: must be a positive integer, got {value!r}")
    elif value is not None and value > MAX_COUNT:  # type: ignore[operator]
        problems.append(f"{path}: must be at most {MAX_COUNT}, got {value!r}")


#: A size's JSON Schema (``_size`` decides: the string's unit, at most 1 PiB).
_SIZE_SCHEMA: dict[str, Any] = {"oneOf": [{"type": "string"}, {"type": "integer", "minimum": 1}]}


def _size(path: str, value: object, problems: list[str]) -> int | _Bad:
    """A size in bytes from an int or a string such as "20GiB"; positive, at most 1 PiB."""
    if not isinstance(value, int | float | str) or isinstance(value, bool):
        problems.append(f'{path}: must be a size such as "20GiB", got {value!r}')
        return _BAD
    try:
        n = parse_size(value)
    except InvalidSizeError as exc:
        problems.append(f"{path}: {exc}")
        return _BAD
    return n if _size_ok(path, n, value, problems) else _BAD


def _size_ok(path: str, n: object, shown: object, problems: list[str]) -> bool:
    if not _is_int(n):
        problems.append(f"{path}: must be a size in bytes, got {shown!r}")
        return False
    if n <= 0:  # type: ignore[operator]
        problems.append(f"{path}: must be a positive size, got {shown!r}")
        return False
    if n > MAX_SIZE:  # type: ignore[operator]
        problems.append(f"{path}: {shown!r} is more than 1 PiB; check the unit")
        return False
    return True


#: A duration's JSON Schema (``_duration`` decides the string's form).
_DURATION_SCHEMA: dict[str, Any] = {"oneOf": [{"type": "string"}, {"type": "number", "minimum": 0}]}


def _duration(path: str, value: object, problems: list[str]) -> float | _Bad | None:
    """Seconds from a number or a string such as "90s", "30m", "2h", "1d"."""
    if value is None:
        return None
    if _is_number(value):
        seconds = float(value)  # type: ignore[arg-type]
    elif isinstance(value, str) and (m := _DURATION_RE.match(value)):
        seconds = float(m.group(1)) * _DURATION_UNITS[m.group(2).lower()]
    else:
        problems.append(
            f'{path}: must be seconds or a duration such as "90s", "30m", "2h", got {value!r}'
        )
        return _BAD
    if seconds < 0:
        problems.append(f"{path}: cannot be negative, got {value!r}")
        return _BAD
    return seconds


def parse_duration(value: object, path: str = "duration") -> float | None:
    """Seconds from a number or a string such as "90s", "30m", "2h", "1d" (None: None)."""
    problems: list[str] = []
    seconds = _duration(path, value, problems)
    if problems or isinstance(seconds, _Bad):
        raise JobSpecError(problems)
    return seconds


#: ``env``'s and ``labels``' JSON Schema (``_str_map`` decides the names).
_STR_MAP_SCHEMA: dict[str, Any] = {"type": "object", "additionalProperties": {"type": "string"}}


def _str_map(path: str, value: object, problems: list[str], *, env: bool) -> dict[str, str]:
    if not isinstance(value, Mapping):
        problems.append(f"{path}: must be a table of names to strings, got {value!r}")
        return {}
    out: dict[str, str] = {}
    for key, item in value.items():
        if not isinstance(key, str) or not key:
            problems.append(f"{path}: keys must be non-empty strings, got {key!r}")
        elif env and not _ENV_RE.match(key):
            problems.append(f"{path}.{key}: not an environment variable name (letters, digits, _)")
        elif not isinstance(item, str):
            problems.append(
                f"{path}.{key}: must be a string, got {item!r}"
                + (f' (write "{item}")' if _is_number(item) or isinstance(item, bool) else "")
            )
        else:
            out[key] = item
    return out


def _exact_size(n: int) -> int | str:
    """A size as its exact, readable form: "20GiB" where a unit divides it, else bytes."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n % scale == 0:
            return f"{n // scale}{unit}"
    return n


# -- the parts -------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelNeed:
    """A model step for :func:`vramctl.estimate` to price on each candidate device.

    ``model`` is a built-in name (:func:`vramctl.estimator.zoo.names`), ``"module:factory"``
    or a Hugging Face id or config path; ``batch_size`` defaults to the job's. An inference
    job that generates (``mode="generate"``) is priced by its whole generation: ``seq_len``
    prompt tokens, ``max_new_tokens`` after them, with ``cache`` (``dynamic``, ``static``,
    ``quantized`` or ``offloaded``; ``kv_dtype`` ``int4`` or ``int2``: the quantized one's
    width).
    """

    model: str
    batch_size: int | None = None
    seq_len: int | None = None
    precision: str = "fp32"
    mode: str = "train"
    max_new_tokens: int | None = None
    cache: str | None = None
    kv_dtype: str | None = None

    FIELDS = (
        "model", "batch_size", "seq_len", "precision", "mode", "max_new_tokens", "cache",
        "kv_dtype",
    )  # fmt: skip

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise JobSpecError(problems)

    def problems(self, path: str = "memory.estimate") -> list[str]:
        return _model_problems(path, vars(self))

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.FIELDS if getattr(self, k) is not None}


def _model_problems(path: str, values: Mapping[str, Any]) -> list[str]:
    # The estimator (and PyTorch) only for a job priced by its model, not for every job.
    from vramctl.estimator import MODES, PRECISIONS, zoo
    from vramctl.estimator._shared import CACHES, QUANTIZED_KV

    problems: list[str] = []
    model = values.get("model")
    if model is None:
        problems.append(f"{path}.model: missing; name a built-in model or 'module:factory'")
    elif not isinstance(model, str) or not model.strip():
        problems.append(f"{path}.model: must be a model name, got {model!r}")
    elif ":" in model:
        if not _ENTRY_RE.match(model):
            problems.append(f"{path}.model: {model!r} is not of the form 'module:factory'")
    elif "/" not in model and model not in zoo.names():
        close = difflib.get_close_matches(model, zoo.names(), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        problems.append(
            f"{path}.model: unknown model {model!r}{hint}; use a built-in name "
            f"({', '.join(zoo.names())}), 'module:factory' or a Hugging Face id"
        )
    _positive_int(f"{path}.batch_size", values.get("batch_size"), problems)
    _positive_int(f"{path}.seq_len", values.get("seq_len"), problems)
    _positive_int(f"{path}.max_new_tokens", values.get("max_new_tokens"), problems)
    choices = (
        ("precision", PRECISIONS), ("mode", MODES), ("cache", CACHES),
        ("kv_dtype", tuple(QUANTIZED_KV)),
    )  # fmt: skip
    for key, allowed in choices:
        if values.get(key) is not None and values[key] not in allowed:
            problems.append(
                f"{path}.{key}: must be one of {', '.join(allowed)}, got {values[key]!r}"
            )
    generates = values.get("mode") == "generate"
    if generates and values.get("max_new_tokens") is None:
        problems.append(
            f"{path}.max_new_tokens: missing; a generate job is priced by the tokens it "
            "generates after its seq_len prompt tokens"
        )
    for key in ("max_new_tokens", "cache", "kv_dtype"):
        if not generates and values.get(key) is not None:
            problems.append(f'{path}.{key}: only with mode = "generate"')
    if generates and values.get("kv_dtype") is not None and values.get("cache") != "quantized":
        problems.append(f'{path}.kv_dtype: only with cache = "quantized" (its width)')
    return problems


@dataclass(frozen=True)
class MemoryNeed:
    """How much memory a job needs on each of its devices.

    - ``kind="size"``: ``size`` bytes;
    - ``kind="estimate"``: what :func:`vramctl.estimate` predicts for ``estimate`` on the
      device;
    - ``kind="learned"``: the peak recorded by earlier runs of the same job name, times
      ``1 + margin``; ``first`` bytes for the first run.
    """

    kind: str
    size: int | None = None
    estimate: ModelNeed | None = None
    first: int | None = None
    margin: float = 0.1

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise JobSpecError(problems)

    @classmethod
    def of_size(cls, size: int | str) -> MemoryNeed:
        """A fixed need: ``MemoryNeed.of_size("20GiB")``."""
        return cls.from_value(size)

    @classmethod
    def learned(cls, first: int | str, margin: float = 0.1) -> MemoryNeed:
        """A need learned from earlier runs, ``first`` for the first run."""
        return cls.from_value({"learned": {"first": first, "margin": margin}})

    @classmethod
    def from_value(cls, value: object, path: str = "memory") -> MemoryNeed:
        """Parse the spec's ``memory`` value (a size or a one-key table)."""
        problems: list[str] = []
        need = _parse_memory(path, value, problems)
        if problems or need is None:
            raise JobSpecError(problems)
        return need

    def problems(self, path: str = "memory") -> list[str]:
        problems: list[str] = []
        if self.kind not in _KINDS:
            return [f"{path}.kind: must be one of {', '.join(_KINDS)}, got {self.kind!r}"]
        if self.kind == "size":
            if self.size is None:
                problems.append(f"{path}: a size need has no size")
            else:
                _size_ok(path, self.size, self.size, problems)
        if self.kind == "estimate" and not isinstance(self.estimate, ModelNeed):
            problems.append(f"{path}.estimate: missing the model to estimate")
        if self.kind == "learned":
            if self.first is None:
                problems.append(f"{path}.learned.first: missing; the size for the first run")
            else:
                _size_ok(f"{path}.learned.first", self.first, self.first, problems)
            if not _is_number(self.margin) or not 0 <= self.margin <= 10:
                problems.append(
                    f"{path}.learned.margin: must be a fraction from 0 to 10 (0.1 is 10%), "
                    f"got {self.margin!r}"
                )
        for name, kind in (("size", "size"), ("estimate", "estimate"), ("first", "learned")):
            if getattr(self, name) is not None and self.kind != kind:
                problems.append(f"{path}.{name}: only goes with kind {kind!r}, not {self.kind!r}")
        return problems

    def to_value(self) -> object:
        """The spec's ``memory`` value: ``"20GiB"`` or a one-key table."""
        if self.kind == "size":
            assert self.size is not None
            return _exact_size(self.size)
        if self.kind == "estimate":
            assert self.estimate is not None
            return {"estimate": self.estimate.to_dict()}
        assert self.first is not None
        return {"learned": {"first": _exact_size(self.first), "margin": self.margin}}


#: ``memory``'s JSON Schema: a size, or a table (``_parse_memory`` decides its forms).
_MEMORY_SCHEMA: dict[str, Any] = {"oneOf": [_SIZE_SCHEMA, {"type": "object"}]}


def _parse_memory(path: str, value: object, problems: list[str]) -> MemoryNeed | None:
    if value is None:
        problems.append(f"{path}: missing; {_MEMORY_FORMS}")
        return None
    if not isinstance(value, Mapping):
        size = _size(path, value, problems)
        return None if isinstance(size, _Bad) else MemoryNeed("size", size=size)
    keys = [k for k in value if k in _KINDS]
    before = len(problems)
    problems += _unknown(path, value, _KINDS)
    if len(keys) != 1:
        if not keys and len(problems) == before:
            problems.append(f"{path}: empty; {_MEMORY_FORMS}")
        elif keys:
            problems.append(f"{path}: give one of {', '.join(keys)}, not {len(keys)}")
        return None
    kind = keys[0]
    inner = value[kind]
    sub = f"{path}.{kind}"
    if kind == "size":
        size = _size(sub, inner, problems)
        return None if isinstance(size, _Bad) else MemoryNeed("size", size=size)
    if kind == "estimate":
        if isinstance(inner, str):
            inner = {"model": inner}
        if not isinstance(inner, Mapping):
            problems.append(f"{sub}: must be a table (model, batch_size, ...), got {inner!r}")
            return None
        found = _unknown(sub, inner, ModelNeed.FIELDS) + _model_problems(sub, inner)
        problems += found
        if found or len(problems) > before:
            return None
        return MemoryNeed("estimate", estimate=ModelNeed(**inner))
    if not isinstance(inner, Mapping):
        problems.append(f"{sub}: must be a table (first, margin), got {inner!r}")
        return None
    problems += _unknown(sub, inner, ("first", "margin"))
    if "first" not in inner:
        problems.append(f"{sub}.first: missing; the size to reserve for the first run")
        first: int | _Bad = _BAD
    else:
        first = _size(f"{sub}.first", inner["first"], problems)
    margin = inner.get("margin", 0.1)
    if not _is_number(margin) or not 0 <= margin <= 10:
        problems.append(
            f"{sub}.margin: must be a fraction from 0 to 10 (0.1 is 10%), got {margin!r}"
        )
        return None
    if isinstance(first, _Bad) or len(problems) > before:
        return None
    return MemoryNeed("learned", first=first, margin=float(margin))


@dataclass(frozen=True)
class DeviceConstraints:
    """Which devices a job may run on, and how many it needs at once.

    ``model`` matches the GPU's name or catalog name, ignoring case ("A100" matches
    "NVIDIA A100-SXM4-80GB"); ``min_capability`` is the lowest compute capability.
    """

    model: str | None = None
    count: int = 1
    min_capability: ComputeCapability | None = None

    FIELDS = ("model", "count", "min_capability")

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise JobSpecError(problems)

    def problems(self, path: str = "devices") -> list[str]:
        problems: list[str] = []
        if self.model is not None and (not isinstance(self.model, str) or not self.model.strip()):
            problems.append(f"{path}.model: must be part of a GPU name, got {self.model!r}")
        if not (_is_int(self.count) and self.count >= 1):
            problems.append(f"{path}.count: must be a positive integer, got {self.count!r}")
        cap: object = self.min_capability
        if cap is not None and not isinstance(cap, ComputeCapability):
            problems.append(f"{path}.min_capability: must be a ComputeCapability, got {cap!r}")
        return problems

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.model is not None:
            out["model"] = self.model
        out["count"] = self.count
        if self.min_capability is not None:
            out["min_capability"] = str(self.min_capability)
        return out


#: ``devices``' JSON Schema (``_parse_devices`` decides its fields).
_DEVICES_SCHEMA: dict[str, Any] = {"type": "object"}


def _parse_devices(path: str, value: object, problems: list[str]) -> DeviceConstraints | None:
    if value is None:
        return DeviceConstraints()
    if not isinstance(value, Mapping):
        problems.append(f"{path}: must be a table (model, count, min_capability), got {value!r}")
        return None
    before = len(problems)
    problems += _unknown(path, value, DeviceConstraints.FIELDS)
    cap: ComputeCapability | None = None
    raw = value.get("min_capability")
    if raw is not None:
        text = str(raw) if _is_number(raw) else raw
        try:
            if not isinstance(text, str):
                raise ValueError
            cap = ComputeCapability.parse(text)
        except ValueError:
            problems.append(
                f'{path}.min_capability: must be a compute capability such as "8.0", got {raw!r}'
            )
    values = {k: value[k] for k in ("model", "count") if k in value}
    try:
        made = DeviceConstraints(**values, min_capability=cap)
    except JobSpecError as exc:
        problems += [p.replace("devices.", f"{path}.", 1) for p in exc.problems]
        return None
    return None if len(problems) > before else made


# -- the guard -------------------------------------------------------------------------


@dataclass(frozen=True)
class GuardOptions:
    """A function of the job's code to run under :func:`vramctl.guarded`.

    ``function`` (``"module:function"``) is a function of a batch in a module the job
    imports (not the script run as ``__main__``); the job's bootstrap replaces it with a
    guarded one when its module is imported, so a batch that runs out of memory is run
    in pieces instead of failing the job. Without ``optimizer`` it is an inference step
    (outputs joined back in order); with ``optimizer`` (``"module:attribute"``, read at
    the first call) it is a training step that returns the loss, and the guard runs
    backward and the optimizer step, accumulating gradients over the pieces. ``model``
    (``"module:attribute"``) names the model, for a training step with no optimizer.
    """

    function: str
    optimizer: str | None = None
    model: str | None = None

    FIELDS = ("function", "optimizer", "model")

    def __post_init__(self) -> None:
        problems = self.problems()
        if problems:
            raise JobSpecError(problems)

    def problems(self, path: str = "guard") -> list[str]:
        problems: list[str] = []
        for key in self.FIELDS:
            value: object = getattr(self, key)
            if value is None and key != "function":
                continue
            what = "function" if key == "function" else "attribute"
            if not isinstance(value, str) or not _ENTRY_RE.match(value):
                problems.append(f"{path}.{key}: must be of the form 'module:{what}', got {value!r}")
            elif value.startswith("__main__:"):
                problems.append(
                    f"{path}.{key}: the script run as __main__ cannot be reached before it runs; "
                    "put the function in a module the script imports"
                )
        return problems

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.FIELDS if getattr(self, k) is not None}


#: ``guard``'s JSON Schema: a function's name, or the table of :class:`GuardOptions`.
_GUARD_SCHEMA: dict[str, Any] = {
    "oneOf": [
        {"type": "string"},
        {
            "type": "object",
            "properties": {k: {"type": "string"} for k in GuardOptions.FIELDS},
            "required": ["function"],
            "additionalProperties": False,
        },
    ]
}


def _parse_guard(path: str, value: object, problems: list[str]) -> GuardOptions | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = {"function": value}
    if not isinstance(value, Mapping):
        problems.append(
            f"{path}: must be 'module:function' or a table (function, optimizer, model), "
            f"got {value!r}"
        )
        return None
    problems += _unknown(path, value, GuardOptions.FIELDS)
    if "function" not in value:
        problems.append(f"{path}.function: missing; name the function of a batch to guard")
        return None
    try:
        return GuardOptions(**{k: value[k] for k in GuardOptions.FIELDS if k in value})
    except JobSpecError as exc:
        problems += [p.replace("guard.", f"{path}.", 1) for p in exc.problems]
        return None


# -- the spec --------------------------------------------------------------------------


def _frozen(m: Mapping[str, str]) -> Mapping[str, str]:
    return MappingProxyType(dict(m))


@dataclass(frozen=True)
class JobSpec:
    """One job: what to run, where, and the memory it needs.

    Exactly one of ``command`` (an argv list; never a shell string) and
    ``entry_point`` (``"module:function"``, called with ``args``) is given.
    ``batch_size`` and ``effective_batch`` let the admission lower the batch to fit
    the free memory, keeping ``batch × accumulation == effective_batch``.
    """

    name: str
    memory: MemoryNeed
    command: tuple[str, ...] | None = None
    entry_point: str | None = None
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    batch_size: int | None = None
    effective_batch: int | None = None
    priority: int = 0
    #: Seconds to wait for a device before giving up (None: wait as long as it takes).
    wait_timeout: float | None = None
    #: Seconds a run may take (None: no limit).
    run_timeout: float | None = None
    retries: int = 0
    #: Queue the job again (while retries last) when its supervisor died while it ran, so
    #: its exit status is unknown: its run may have finished, so it may run twice. Off by
    #: default: such a job fails.
    rerun_lost: bool = False
    #: Times the job is queued again after it used more memory than its share (stopped by
    #: the watch, or out of memory under its cap), each time needing at least what it was
    #: measured to use (see ``docs/jobs.md``). 0: such a job fails.
    overrun_retries: int = 1
    devices: DeviceConstraints = field(default_factory=DeviceConstraints)
    #: A function of the job's code to run under :func:`vramctl.guarded` (None: none).
    guard: GuardOptions | None = None

    FIELDS = (
        "name",
        "command",
        "entry_point",
        "args",
        "env",
        "cwd",
        "labels",
        "memory",
        "batch_size",
        "effective_batch",
        "priority",
        "wait_timeout",
        "run_timeout",
        "retries",
        "rerun_lost",
        "overrun_retries",
        "devices",
        "guard",
    )

    def __post_init__(self) -> None:
        # Lists as given by hand become tuples (the spec is frozen).
        for key in ("command", "args"):
            value: object = getattr(self, key)
            if isinstance(value, list):
                object.__setattr__(self, key, tuple(value))
        problems = _spec_problems(vars(self))
        if problems:
            raise JobSpecError(problems)
        object.__setattr__(self, "env", _frozen(self.env))
        object.__setattr__(self, "labels", _frozen(self.labels))

    # -- reading --------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> JobSpec:
        """A spec from a table as JSON or TOML give it; every problem in one error."""
        if not isinstance(data, Mapping):
            raise JobSpecError(f"a job spec must be a table of fields, got {data!r}")
        problems = _unknown("", data, cls.FIELDS)
        values: dict[str, Any] = {
            k: data[k]
            for k in (
                "name",
                "entry_point",
                "cwd",
                "batch_size",
                "effective_batch",
                "priority",
                "retries",
                "rerun_lost",
                "overrun_retries",
            )
            if k in data
        }
        values["command"] = _parse_argv("command", data.get("command"), problems)
        if "args" in data:
            values["args"] = _parse_argv("args", data["args"], problems)
        for key in ("env", "labels"):
            if key in data:
                values[key] = _str_map(key, data[key], problems, env=key == "env")
        for key in ("wait_timeout", "run_timeout"):
            values[key] = _duration(key, data.get(key), problems)
        values["memory"] = _parse_memory("memory", data.get("memory"), problems) or _BAD
        values["devices"] = _parse_devices("devices", data.get("devices"), problems) or _BAD
        if "guard" in data:
            values["guard"] = _parse_guard("guard", data["guard"], problems) or _BAD
        problems += _spec_problems(values)
        if problems:
            raise JobSpecError(sorted(problems, key=_field_order))
        return cls(**values)

    @classmethod
    def from_json(cls, text: str) -> JobSpec:
        """A spec from JSON text (an object of fields)."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise JobSpecError(
                f"invalid JSON: {exc.msg} (at line {exc.lineno}, column {exc.colno})"
            ) from None
        if not isinstance(data, dict):
            raise JobSpecError(f"a job spec must be a JSON object, got {type(data).__name__}")
        return cls.from_dict(data)

    @classmethod
    def from_toml(cls, text: str) -> JobSpec:
        """A spec from TOML text (its top-level table)."""
        if sys.version_info >= (3, 11):
            import tomllib
        else:  # pragma: no cover - Python 3.10
            import tomli as tomllib
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise JobSpecError(f"invalid TOML: {exc}") from None
        return cls.from_dict(data)

    # -- writing --------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The spec as JSON- and TOML-ready fields; ``from_dict`` gives it back."""
        out: dict[str, Any] = {"name": self.name}
        if self.command is not None:
            out["command"] = list(self.command)
        if self.entry_point is not None:
            out["entry_point"] = self.entry_point
            out["args"] = list(self.args)
        out["memory"] = self.memory.to_value()
        if self.env:
            out["env"] = dict(self.env)
        if self.cwd is not None:
            out["cwd"] = self.cwd
        if self.labels:
            out["labels"] = dict(self.labels)
        for key in ("batch_size", "effective_batch", "wait_timeout", "run_timeout"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        out["priority"] = self.priority
        out["retries"] = self.retries
        out["overrun_retries"] = self.overrun_retries
        if self.rerun_lost:
            out["rerun_lost"] = True
        out["devices"] = self.devices.to_dict()
        if self.guard is not None:
            out["guard"] = self.guard.to_dict()
        return out

    def to_json(self, *, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def json_schema(cls) -> dict[str, Any]:
        """The spec's fields as JSON Schema (the job service's OpenAPI document): each field's
        entry sits next to the parser that checks it, and that check decides."""
        fields = _field_schemas()
        if set(fields) != set(cls.FIELDS):  # pragma: no cover - a field without its schema
            raise VramctlError(f"the job spec's schema and FIELDS differ: {sorted(fields)}")
        return {
            "type": "object",
            "properties": {k: copy.deepcopy(fields[k]) for k in cls.FIELDS},
            "required": ["name", "memory"],
            "additionalProperties": False,
        }

    @property
    def target_batch(self) -> int | None:
        """The batch each optimizer step sees: ``effective_batch``, else ``batch_size``."""
        return self.effective_batch if self.effective_batch is not None else self.batch_size


def _field_schemas() -> dict[str, dict[str, Any]]:
    """Each of :attr:`JobSpec.FIELDS`' JSON Schema, from its parser's."""
    positive = {"type": "integer", "minimum": 1}
    return {
        "name": {"type": "string"},
        "command": {**_ARGV_SCHEMA, "minItems": 1},
        "entry_point": {"type": "string"},
        "args": _ARGV_SCHEMA,
        "env": _STR_MAP_SCHEMA,
        "cwd": {"type": "string"},
        "labels": _STR_MAP_SCHEMA,
        "memory": _MEMORY_SCHEMA,
        "batch_size": positive,
        "effective_batch": positive,
        "priority": {"type": "integer"},
        "wait_timeout": _DURATION_SCHEMA,
        "run_timeout": _DURATION_SCHEMA,
        "retries": {"type": "integer", "minimum": 0},
        "rerun_lost": {"type": "boolean"},
        "overrun_retries": {"type": "integer", "minimum": 0},
        "devices": _DEVICES_SCHEMA,
        "guard": _GUARD_SCHEMA,
    }


def _field_order(problem: str) -> tuple[int, str]:
    head = problem.removeprefix("unknown field '").split(":")[0].split(".")[0].split("'")[0]
    unknown = problem.startswith("unknown field")
    index = JobSpec.FIELDS.index(head) if head in JobSpec.FIELDS and not unknown else 99
    return index, problem


#: ``command``'s and ``args``' JSON Schema (``_parse_argv`` refuses a shell string).
_ARGV_SCHEMA: dict[str, Any] = {"type": "array", "items": {"type": "string"}}


def _parse_argv(path: str, value: object, problems: list[str]) -> tuple[str, ...] | _Bad | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            suggestion = json.dumps(shlex.split(value))
        except ValueError:
            suggestion = '["program", "arg", ...]'
        problems.append(
            f"{path}: must be a list of arguments, not a shell string (vramctl never runs "
            f"a shell); write {suggestion}"
        )
        return _BAD
    if not isinstance(value, list | tuple):
        problems.append(f"{path}: must be a list of strings, got {value!r}")
        return _BAD
    bad = [i for i, a in enumerate(value) if not isinstance(a, str) or "\0" in a]
    for i in bad:
        problems.append(f"{path}[{i}]: must be a string, got {value[i]!r}")
    return _BAD if bad else tuple(value)


def _spec_problems(values: Mapping[str, Any]) -> list[str]:
    """The problems of a spec's typed values (a ``_BAD`` value is already reported)."""
    problems: list[str] = []
    name = values.get("name")
    if name is None:
        problems.append("name: missing; name the job (letters, digits, '.', '_', '-')")
    elif not isinstance(name, str) or not _NAME_RE.match(name):
        problems.append(
            f"name: must be 1 to 128 letters, digits, '.', '_' or '-' "
            f"(starting with a letter or digit), got {name!r}"
        )
    command, entry = values.get("command"), values.get("entry_point")
    if command is None and entry is None:
        problems.append(
            "command: missing; give the command as a list of arguments, or an "
            "entry_point 'module:function'"
        )
    elif command is not None and entry is not None:
        problems.append("command: give either command or entry_point, not both")
    if isinstance(command, tuple):
        if not command:
            problems.append("command: empty; give the program and its arguments")
        elif not all(isinstance(a, str) for a in command):
            problems.append(f"command: must be a list of strings, got {list(command)!r}")
        elif not command[0]:
            problems.append("command[0]: the program cannot be an empty string")
    elif command is not None and not isinstance(command, _Bad):
        problems.append(f"command: must be a list of strings, got {command!r}")
    if entry is not None and (not isinstance(entry, str) or not _ENTRY_RE.match(entry)):
        problems.append(f"entry_point: must be of the form 'module:function', got {entry!r}")
    args = values.get("args", ())
    if isinstance(args, tuple):
        if args and entry is None and not isinstance(entry, _Bad):
            problems.append("args: only go with entry_point; put a command's arguments in it")
        if not all(isinstance(a, str) for a in args):
            problems.append(f"args: must be a list of strings, got {list(args)!r}")
    elif not isinstance(args, _Bad):
        problems.append(f"args: must be a list of strings, got {args!r}")
    for key in ("env", "labels"):
        mapping = values.get(key, {})
        if not isinstance(mapping, Mapping):
            problems.append(f"{key}: must be a table of names to strings, got {mapping!r}")
        elif not all(isinstance(k, str) and isinstance(v, str) for k, v in mapping.items()):
            bad = [k for k, v in mapping.items() if not isinstance(v, str)]
            problems.append(f"{key}: every value must be a string ({', '.join(map(str, bad))})")
        elif key == "env":
            # The operating system cannot pass a NUL in an environment (it crashed the
            # supervisor with a misleading reason), nor a name with "=" or an empty one.
            nul = [k for k, v in mapping.items() if "\0" in k or "\0" in v]
            if nul:
                problems.append(f"env: a name or value holds a NUL character ({nul[0]!r})")
            odd = [k for k in mapping if not k or "=" in k]
            if odd:
                problems.append(f"env: {odd[0]!r} is not a variable name (empty, or has '=')")
    cwd = values.get("cwd")
    if cwd is not None and (not isinstance(cwd, str) or not cwd):
        problems.append(f"cwd: must be a directory path, got {cwd!r}")
    memory = values.get("memory")
    if not isinstance(memory, MemoryNeed | _Bad):
        problems.append(f"memory: must be a MemoryNeed, got {memory!r}")
    devices = values.get("devices", DeviceConstraints())
    if not isinstance(devices, DeviceConstraints | _Bad):
        problems.append(f"devices: must be a DeviceConstraints, got {devices!r}")
    guard = values.get("guard")
    if guard is not None and not isinstance(guard, GuardOptions | _Bad):
        problems.append(f"guard: must be a GuardOptions, got {guard!r}")
    batch, effective = values.get("batch_size"), values.get("effective_batch")
    _positive_int("batch_size", batch, problems)
    _positive_int("effective_batch", effective, problems)
    if effective is not None and _is_int(effective) and effective > 0:
        if batch is None:
            problems.append("effective_batch: needs batch_size, the batch of one forward pass")
        elif _is_int(batch) and batch > 0:
            if effective < batch:
                problems.append(f"effective_batch: {effective} is smaller than batch_size {batch}")
            elif effective % batch:
                problems.append(
                    f"effective_batch: {effective} is not a multiple of batch_size {batch}"
                )
    priority = values.get("priority", 0)
    if not _is_int(priority):
        problems.append(f"priority: must be an integer, got {priority!r}")
    elif not PRIORITY_RANGE[0] <= priority <= PRIORITY_RANGE[1]:
        problems.append(
            f"priority: must be a signed 64-bit integer "
            f"({PRIORITY_RANGE[0]} to {PRIORITY_RANGE[1]}), got {priority!r}"
        )
    for key, default in (("retries", 0), ("overrun_retries", 1)):
        retries = values.get(key, default)
        if not (_is_int(retries) and retries >= 0):
            problems.append(f"{key}: must be a whole number, 0 or more, got {retries!r}")
        elif retries > 1000:
            problems.append(f"{key}: must be at most 1000, got {retries!r}")
    rerun_lost = values.get("rerun_lost", False)
    if not isinstance(rerun_lost, bool):
        problems.append(f"rerun_lost: must be true or false, got {rerun_lost!r}")
    for key in ("wait_timeout", "run_timeout"):
        t = values.get(key)
        if t is not None and not isinstance(t, _Bad):
            if not _is_number(t):
                problems.append(f"{key}: must be a number of seconds, got {t!r}")
            elif t < 0:
                problems.append(f"{key}: cannot be negative, got {t!r}")
            elif t > MAX_SECONDS:
                problems.append(f"{key}: must be at most {MAX_SECONDS:g} seconds, got {t!r}")
            elif key == "run_timeout" and t == 0:
                problems.append("run_timeout: must be more than 0 seconds (omit it for no limit)")
    return problems


def load_spec(path: str | Path) -> JobSpec:
    """A spec from a ``.json`` or ``.toml`` file; errors name the file."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in (".json", ".toml"):
        raise JobSpecError(
            f"{p}: unknown spec format {suffix or '(no suffix)'!r}; use a .toml or .json file"
        )
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise JobSpecError(f"{p}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise JobSpecError(f"{p}: cannot read it ({exc})") from None
    try:
        return JobSpec.from_toml(text) if suffix == ".toml" else JobSpec.from_json(text)
    except JobSpecError as exc:
        raise JobSpecError(exc.problems, what=f"{exc.what} {p}") from None
