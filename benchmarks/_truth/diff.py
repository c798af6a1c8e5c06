"""The estimator's predicted request stream against a recorded one, operator by operator.

The real stream is a step's ``alloc`` events with the operator each is tied to; the
predicted one is the allocations of the estimator's trace of the same case, with the
operator that made each (its workspaces and stand-ins under their own names). Both are
sequences of ``(operator, bytes)``; the first place where they part is found by aligning
them (``difflib``), and the bytes each operator allocates in all are set side by side.
"""

from __future__ import annotations

import difflib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from _truth.cases import estimate_args, options_applied
from _truth.corpus import events

NONE = "(no operator)"


@dataclass
class Diff:
    real: list[tuple[str, int]]
    predicted: list[tuple[str, int]]
    #: ``(index in real, index in predicted, what differs)`` at the first divergence, or None.
    first: tuple[int, int, str] | None = None
    #: op -> (real bytes, predicted bytes), every op in either, largest difference first.
    by_op: list[tuple[str, int, int]] = field(default_factory=list)

    def to_dict(self, top: int = 20) -> dict[str, Any]:
        return {
            "real_allocations": len(self.real),
            "predicted_allocations": len(self.predicted),
            "real_bytes": sum(n for _, n in self.real),
            "predicted_bytes": sum(n for _, n in self.predicted),
            "first_divergence": None
            if self.first is None
            else {
                "real_index": self.first[0],
                "predicted_index": self.first[1],
                "what": self.first[2],
            },
            "by_op": [
                {"op": op, "real_bytes": r, "predicted_bytes": p, "difference": p - r}
                for op, r, p in self.by_op[:top]
            ],
        }


def real_stream(trace: dict[str, Any]) -> list[tuple[str, int]]:
    return [(op or NONE, size) for action, _, size, _, op in events(trace) if action == "alloc"]


def allocations(trace: Any) -> list[tuple[str, int]]:
    """The allocations, in order, of an estimator's trace: ``(operator, bytes)``. What
    exists before the step (parameters, optimizer state, the batch) is not in a real step's
    history either."""
    records = trace.records
    return [
        (records[e].op or NONE, records[e].nbytes)
        for e in trace.events
        if e >= 0 and records[e].op != "preexisting"
    ]


def real_peak(trace: dict[str, Any]) -> tuple[int, Counter[str]]:
    """A recorded step's peak over what it started with, and what was live at that moment
    (bytes by the operator that allocated each)."""
    live: dict[int, tuple[str, int]] = {}
    now = peak = 0
    at: Counter[str] = Counter()
    for action, addr, size, _stream, op in events(trace):
        if action == "alloc":
            live[addr] = (op or NONE, size)
            now += size
            if now > peak:
                peak, at = now, _by_op(live.values())
        elif action == "free_requested" and addr in live:
            now -= live.pop(addr)[1]
    return peak, at


def predicted_peak(trace: Any) -> tuple[int, Counter[str]]:
    """The same for the estimator's trace: its peak over what existed before the step."""
    records = trace.records
    live: dict[int, tuple[str, int]] = {}
    now = peak = 0
    at: Counter[str] = Counter()
    for e in trace.events:
        if e >= 0:
            if records[e].op == "preexisting":
                continue
            live[e] = (records[e].op or NONE, records[e].nbytes)
            now += records[e].nbytes
            if now > peak:
                peak, at = now, _by_op(live.values())
        elif ~e in live:
            now -= live.pop(~e)[1]
    return peak, at


def _by_op(items: Any) -> Counter[str]:
    out: Counter[str] = Counter()
    for op, n in items:
        out[op] += n
    return out


def predicted_trace(spec: dict[str, Any], device: Any, calibration: Any = False) -> Any:
    """The estimator's trace of the case's step on ``device``, as a recorded step ran."""
    from vramctl import Step
    from vramctl.estimator._rates import RATES
    from vramctl.estimator._session import make_batch_for, open_session
    from vramctl.estimator._trace import sums_out_of_place

    source, batch, lengths, opts = estimate_args(spec)
    step = Step(device=device, calibration=calibration, **opts)
    session = open_session(source, step, RATES)
    try:
        real, size = make_batch_for(
            session, batch, spec["batch_size"], lengths.get("seq_len"), lengths.get("seconds")
        )
        # a recorded step: autograd summed its gradients out of place (``recorded_per_call``)
        with options_applied(spec, "cpu"), sums_out_of_place():
            traced = session.trace(real, size)
    finally:
        session.close()
    return traced.trace


def diff(real: list[tuple[str, int]], predicted: list[tuple[str, int]]) -> Diff:
    out = Diff(real, predicted)
    matcher = difflib.SequenceMatcher(a=real, b=predicted, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        if tag == "delete":
            what = f"real {_show(real[i1:i2])} not predicted"
        elif tag == "insert":
            what = f"predicted {_show(predicted[j1:j2])} not in the real step"
        else:
            what = f"real {_show(real[i1:i2])}, predicted {_show(predicted[j1:j2])}"
        out.first = (i1, j1, what)
        break
    r: Counter[str] = Counter()
    p: Counter[str] = Counter()
    for op, n in real:
        r[op] += n
    for op, n in predicted:
        p[op] += n
    ops = set(r) | set(p)
    out.by_op = sorted(((op, r[op], p[op]) for op in ops), key=lambda x: -abs(x[2] - x[1]))
    return out


def _show(items: list[tuple[str, int]], most: int = 3) -> str:
    shown = ", ".join(f"{op} {n} B" for op, n in items[:most])
    more = f" and {len(items) - most} more" if len(items) > most else ""
    return f"[{shown}{more}]"
