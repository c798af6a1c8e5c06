"""The cuDNN workspace of each convolution a recorded step ran, keyed as the estimator keys it.

A recorded step's convolution calls allocate their outputs and, around the kernel, a
workspace they free before they return. The workspace of one call is the most bytes its
temporaries (what it allocated and freed itself) held at once. The estimator's trace of the
same case runs the same convolutions in the same order and names each by
``conv_key`` (its shapes and arguments), so the k-th recorded call's workspace belongs to
the k-th key. Over a corpus this gives the table a calibration profile carries
(``constants.cudnn_workspaces``): the workspace cuDNN's heuristics chose on that GPU for
each convolution seen there.
"""

from __future__ import annotations

from typing import Any

from _truth.corpus import COLUMNS

CONV_OPS = ("convolution", "convolution_backward")


def recorded(trace: dict[str, Any]) -> list[tuple[str, int]]:
    """``(operator, workspace bytes)`` for each convolution call of a recorded step, in order."""
    ev, actions, ops, calls = trace["events"], trace["actions"], trace["ops"], trace["calls"]
    by_call: dict[int, list[tuple[str, int, int]]] = {}
    for a, addr, size, _stream, call in zip(*(ev[c] for c in COLUMNS), strict=True):
        if call >= 0 and ops[calls[call][0]] in CONV_OPS:
            by_call.setdefault(call, []).append((actions[a], addr, size))
    out = []
    for call in sorted(by_call):
        # a temporary is an allocation freed within the call (an address can come back as
        # an output after a temporary at it was freed, so each free pairs with the latest
        # allocation at its address)
        opened: dict[int, tuple[int, int]] = {}
        spans: list[tuple[int, int, int]] = []
        for i, (action, addr, size) in enumerate(by_call[call]):
            if action == "alloc":
                opened[addr] = (i, size)
            elif action == "free_requested" and addr in opened:
                start, n = opened.pop(addr)
                spans.append((start, i, n))
        now = most = 0
        for _, delta in sorted([(s, n) for s, _, n in spans] + [(e, -n) for _, e, n in spans]):
            now += delta
            most = max(most, now)
        out.append((ops[calls[call][0]], most))
    return out


def pair(keys: list[str], calls: list[tuple[str, int]]) -> dict[str, int] | str:
    """The recorded workspace of each key, or why the two sequences do not line up."""
    if len(keys) != len(calls):
        return f"{len(calls)} recorded convolutions, {len(keys)} traced"
    out: dict[str, int] = {}
    for key, (op, ws) in zip(keys, calls, strict=True):
        if not key.startswith(f"{op}("):
            return f"a recorded {op} where the trace has {key.split('(')[0]}"
        out[key] = max(out.get(key, 0), ws)
    return out
