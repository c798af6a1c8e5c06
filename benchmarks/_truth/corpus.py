"""Reading and writing a CUDA truth corpus (format ``vramctl.cuda_truth``, version 1).

A corpus folder holds ``index.json`` and ``cases/<case>.json.gz``. The index says where the
corpus came from (``source``: ``cuda``, ``simulated`` or ``summary``), the environment it was
recorded in, and each case: its spec (what the estimator needs to predict it), its figures
per step (``cold``: the first step in a fresh allocator; ``warm``: a steady step after it),
and its trace file with the file's SHA-256 and size. A ``summary`` corpus has figures
without traces.

A trace (one step) is a dict:

- ``ops``: the distinct aten operator names; ``calls``: each operator call of the step in
  order, as ``[op index, CUDA microseconds or null]``;
- ``segments_before``: the allocator's segments when the step began, each
  ``[address, size, stream, pool, [[block size, allocated 0/1], ...]]`` (pool ``small`` or
  ``large``, blocks in address order);
- ``actions``: the action names the events use (``alloc``, ``free_requested``,
  ``free_completed``, ``segment_alloc``, ``segment_free``, ``segment_map``,
  ``segment_unmap``, ``oom``);
- ``events``: columns of equal length: ``action`` (an index into ``actions``), ``addr``,
  ``size`` (an ``alloc``'s size is the bytes requested, as PyTorch's history records it),
  ``stream``, and ``call`` (the operator call that made it, or -1 for none).

Anything damaged (a checksum that does not match, a truncated or unreadable file, an unknown
format or version) raises :class:`CorpusError` with one line that names the file.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

FORMAT = "vramctl.cuda_truth"
VERSION = 1
SOURCES = ("cuda", "simulated", "summary")
ACTIONS = (
    "alloc",
    "free_requested",
    "free_completed",
    "segment_alloc",
    "segment_free",
    "segment_map",
    "segment_unmap",
    "oom",
)
COLUMNS = ("action", "addr", "size", "stream", "call")
STEPS = ("cold", "warm")
#: The figures a step may record (bytes, except ``wall_s`` and ``step_s``: the warm step's
#: time with nothing recorded around it, the median of three; ``plain_max_allocated`` and
#: ``plain_max_reserved``: the peaks of one more warm step with nothing recorded around it,
#: captures from 2026-11-29 on); any may be null.
FIGURES = (
    "max_allocated",
    "max_reserved",
    "plain_max_allocated",
    "plain_max_reserved",
    "nvml_bytes",
    "context_bytes",
    # the cold step only: NVML's reading less the reserved bytes before the case began
    # (what earlier cases of the capture left outside the allocator; from 2026-11-29 on)
    "context_before",
    "allocated_before",
    "reserved_before",
    "alloc_retries",
    "wall_s",
    "step_s",
    # a count: the cuBLAS workspaces the process held from earlier cases when the step
    # began, beyond those the step makes itself (a summary of a harness that ran every case
    # in one process and freed no workspace between them: the 2026-11-25 rows)
    "held_cublas_workspaces",
)


class CorpusError(Exception):
    """A corpus file that cannot be used; the message names it."""


def case_file(case_id: str) -> str:
    """The trace file's path in the corpus for a case id such as ``zoo/gpt2/train/fp32/b4``."""
    return "cases/" + case_id.replace("/", "__") + ".json.gz"


def new_index(source: str, environment: dict[str, Any], **extra: Any) -> dict[str, Any]:
    if source not in SOURCES:
        raise ValueError(f"source must be one of {', '.join(SOURCES)}, got {source!r}")
    return {
        "format": FORMAT,
        "version": VERSION,
        "source": source,
        "environment": environment,
        "cases": [],
        **extra,
    }


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def save_index(root: Path, index: dict[str, Any]) -> None:
    """Write ``index.json`` (atomically: a stopped capture keeps the last whole index)."""
    _atomic_write(root / "index.json", (json.dumps(index, indent=1) + "\n").encode())


def write_trace_file(root: Path, case_id: str, steps: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Write a case's traces; returns the index entry's ``file``, ``sha256`` and ``bytes``."""
    for name, trace in steps.items():
        if name not in STEPS:
            raise ValueError(f"step must be one of {', '.join(STEPS)}, got {name!r}")
        check_trace(trace, f"{case_id} {name}")
    doc = {"format": FORMAT, "version": VERSION, "id": case_id, "steps": steps}
    raw = json.dumps(doc, separators=(",", ":")).encode()
    data = gzip.compress(raw, compresslevel=9, mtime=0)
    rel = case_file(case_id)
    _atomic_write(root / rel, data)
    return {"file": rel, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def load_index(root: Path | str) -> dict[str, Any]:
    root = Path(root)
    path = root / "index.json"
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CorpusError(f"{path}: no such file (not a CUDA truth corpus)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorpusError(f"{path}: unreadable ({exc})") from None
    _check_header(index, path)
    if index.get("source") not in SOURCES:
        raise CorpusError(f"{path}: unknown source {index.get('source')!r}")
    cases = index.get("cases")
    if not isinstance(cases, list):
        raise CorpusError(f"{path}: 'cases' is not a list")
    seen: set[str] = set()
    for i, case in enumerate(cases):
        if not isinstance(case, dict) or not isinstance(case.get("id"), str):
            raise CorpusError(f"{path}: case {i} has no id")
        if case["id"] in seen:
            raise CorpusError(f"{path}: case {case['id']} is listed twice")
        seen.add(case["id"])
        if not isinstance(case.get("spec"), dict):
            raise CorpusError(f"{path}: case {case['id']} has no spec")
    return index


def _check_header(doc: Any, path: Path) -> None:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CorpusError(f"{path}: not a {FORMAT} file")
    if doc.get("version") != VERSION:
        raise CorpusError(
            f"{path}: format version {doc.get('version')!r}, this checkout reads version {VERSION}"
        )


def load_traces(root: Path | str, case: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A case's traces by step, checked against the index's checksum and the format."""
    root = Path(root)
    rel = case.get("file")
    if not rel:
        raise CorpusError(f"{root / 'index.json'}: case {case['id']} has no trace (summary only)")
    path = root / rel
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CorpusError(f"{path}: unreadable ({exc.strerror or exc})") from None
    want = case.get("sha256")
    if want and hashlib.sha256(data).hexdigest() != want:
        raise CorpusError(f"{path}: damaged (its SHA-256 is not the index's)")
    try:
        doc = json.loads(gzip.decompress(data))
    except EOFError:
        raise CorpusError(f"{path}: truncated") from None
    except (OSError, zlib.error, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorpusError(f"{path}: unreadable ({exc})") from None
    _check_header(doc, path)
    steps = doc.get("steps")
    if not isinstance(steps, dict) or not steps:
        raise CorpusError(f"{path}: no steps")
    for name, trace in steps.items():
        if name not in STEPS:
            raise CorpusError(f"{path}: unknown step {name!r}")
        try:
            check_trace(trace, name)
        except ValueError as exc:
            raise CorpusError(f"{path}: {exc}") from None
    return steps


def check_trace(trace: Any, where: str) -> None:
    """Raise ``ValueError`` (naming ``where``) unless ``trace`` has the version-1 shape."""
    if not isinstance(trace, dict):
        raise ValueError(f"{where}: a trace is an object")
    for key in ("ops", "calls", "segments_before", "actions", "events"):
        if key not in trace:
            raise ValueError(f"{where}: the trace has no {key!r}")
    unknown = [a for a in trace["actions"] if a not in ACTIONS]
    if unknown:
        raise ValueError(f"{where}: unknown action(s) {', '.join(map(str, unknown))}")
    ev = trace["events"]
    if not isinstance(ev, dict) or any(not isinstance(ev.get(c), list) for c in COLUMNS):
        raise ValueError(f"{where}: events need the columns {', '.join(COLUMNS)}")
    n = len(ev["action"])
    if any(len(ev[c]) != n for c in COLUMNS):
        raise ValueError(f"{where}: the event columns differ in length")
    if any(not 0 <= a < len(trace["actions"]) for a in ev["action"]):
        raise ValueError(f"{where}: an event's action is out of range")
    calls = len(trace["calls"])
    if any(not -1 <= c < calls for c in ev["call"]):
        raise ValueError(f"{where}: an event's operator call is out of range")
    if any(not 0 <= c[0] < len(trace["ops"]) for c in trace["calls"]):
        raise ValueError(f"{where}: an operator call's name is out of range")


def events(trace: dict[str, Any]) -> Iterator[tuple[str, int, int, int, str | None]]:
    """``(action, addr, size, stream, operator or None)`` for each event, in order."""
    ev, actions, ops, calls = trace["events"], trace["actions"], trace["ops"], trace["calls"]
    for a, addr, size, stream, call in zip(*(ev[c] for c in COLUMNS), strict=True):
        yield actions[a], addr, size, stream, (ops[calls[call][0]] if call >= 0 else None)


def single_stream(trace: dict[str, Any]) -> bool:
    """Whether every event and starting segment of the step is on one stream."""
    streams = set(trace["events"]["stream"]) | {s[2] for s in trace["segments_before"]}
    return len(streams) <= 1


class TraceBuilder:
    """Builds a trace event by event (the recorders use it)."""

    def __init__(self) -> None:
        self.ops: list[str] = []
        self._op_index: dict[str, int] = {}
        self.calls: list[list[Any]] = []
        self.segments_before: list[list[Any]] = []
        self.columns: dict[str, list[int]] = {c: [] for c in COLUMNS}

    def call(self, op: str) -> int:
        i = self._op_index.get(op)
        if i is None:
            i = self._op_index[op] = len(self.ops)
            self.ops.append(op)
        self.calls.append([i, None])
        return len(self.calls) - 1

    def event(self, action: str, addr: int, size: int, stream: int = 0, call: int = -1) -> None:
        cols = self.columns
        cols["action"].append(ACTIONS.index(action))
        cols["addr"].append(int(addr))
        cols["size"].append(int(size))
        cols["stream"].append(int(stream))
        cols["call"].append(int(call))

    def build(self) -> dict[str, Any]:
        return {
            "ops": list(self.ops),
            "calls": [list(c) for c in self.calls],
            "segments_before": [list(s) for s in self.segments_before],
            "actions": list(ACTIONS),
            "events": {c: list(v) for c, v in self.columns.items()},
        }


def builtin_calibration(index: dict[str, Any]) -> Any:
    """The built-in constants of the corpus' GPU (by its name and compute capability)."""
    from vramctl.device import ComputeCapability
    from vramctl.estimator._cuda_model import builtin

    env = index["environment"]
    cc = ComputeCapability.parse(env["capability"]) if env.get("capability") else None
    return builtin(env.get("gpu") or "unknown", cc)


def calibration(root: Path | str, index: dict[str, Any]) -> tuple[Any, str]:
    """The corpus' own profile, or the built-in constants with the context it measured."""
    import dataclasses
    import statistics

    from vramctl import format_bytes
    from vramctl.estimator import load_calibration

    path = Path(root) / "calibration.json"
    if path.is_file():
        return load_calibration(path), "the corpus' calibration.json"
    env = index["environment"]
    cal = builtin_calibration(index)
    contexts = [
        (c.get("steps") or {}).get("warm", {}).get("context_bytes")
        for c in index["cases"]
        if c.get("status", "ok") == "ok"
    ]
    contexts = [c for c in contexts if isinstance(c, int) and c > 0]
    if not contexts:
        return cal, "built-in constants (the corpus measured no context)"
    context = int(statistics.median(contexts))
    software = {k: str(env.get(k) or "") for k in ("torch", "cuda", "cudnn", "driver")}
    return (
        dataclasses.replace(cal, context_bytes=context, software=software),
        f"built-in constants with the corpus' measured context ({format_bytes(context)})",
    )
