"""The CUDA recorder's conversions, on snapshots in the shape PyTorch writes them.

``torch.cuda.memory._snapshot()`` gives ``segments`` (each with ``address``,
``total_size``, ``stream``, ``segment_type`` and ``blocks`` of ``size`` and ``state``) and
``device_traces`` (per device, entries with ``action``, ``addr``, ``size`` and ``stream``).
The real capture runs only on a GPU (its ``cuda`` test); what it does with those is pure
and checked here.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))

from _truth.corpus import TraceBuilder, events
from _truth.record import add_history, snapshot_segments
from _truth.replay import replay

MiB = 2**20
BASE = 0x7F00_0000_0000


def test_a_snapshots_segments_become_the_steps_starting_state() -> None:
    snap = {
        "segments": [
            {
                "device": 0,
                "address": BASE + 40 * MiB,
                "total_size": 2 * MiB,
                "stream": 0,
                "segment_type": "small",
                "blocks": [
                    {"address": BASE + 40 * MiB, "size": 512, "state": "active_allocated"},
                    {"address": BASE + 40 * MiB + 512, "size": 2 * MiB - 512, "state": "inactive"},
                ],
            },
            {
                "device": 0,
                "address": BASE,
                "total_size": 20 * MiB,
                "stream": 0,
                "segment_type": "large",
                "blocks": [
                    {"address": BASE, "size": 4 * MiB, "state": "active_pending_free"},
                    {"address": BASE + 4 * MiB, "size": 16 * MiB, "state": "inactive"},
                ],
            },
            {
                "device": 1,
                "address": 1,
                "total_size": 2 * MiB,
                "stream": 0,
                "segment_type": "small",
                "blocks": [],
            },
        ],
        "device_traces": [[], []],
    }
    got = snapshot_segments(snap, 0)
    # In address order, this device's only; a block waiting on another stream still holds.
    assert got == [
        [BASE, 20 * MiB, 0, "large", [[4 * MiB, 1], [16 * MiB, 0]]],
        [BASE + 40 * MiB, 2 * MiB, 0, "small", [[512, 1], [2 * MiB - 512, 0]]],
    ]


def test_each_allocation_and_free_is_tied_to_the_call_it_happened_in() -> None:
    a, b = BASE, BASE + 4 * MiB
    entries = [
        {"action": "segment_alloc", "addr": a, "size": 20 * MiB, "stream": 0},
        {"action": "alloc", "addr": a, "size": 4 * MiB, "stream": 0},  # alloc 0: call 0
        {"action": "alloc", "addr": b, "size": 4 * MiB, "stream": 0},  # alloc 1: call 2
        {"action": "snapshot", "addr": 0, "size": 0, "stream": 0},  # not kept
        {"action": "free_requested", "addr": a, "size": 4 * MiB, "stream": 0},  # free 0: none
        {"action": "free_completed", "addr": a, "size": 4 * MiB, "stream": 0},
        {"action": "free_requested", "addr": b, "size": 4 * MiB, "stream": 0},  # free 1: call 3
        {"action": "free_completed", "addr": b, "size": 4 * MiB, "stream": 0},
    ]
    builder = TraceBuilder()
    for op in ("mm", "view", "add", "sum"):
        builder.call(op)
    # (allocations before, after, frees before, after) each call, from the step's start;
    # "view" allocates nothing, and the first free happens between calls.
    marks = {0: (0, 1, 0, 0), 1: (1, 1, 0, 0), 2: (1, 2, 0, 0), 3: (2, 2, 1, 2)}
    dropped = add_history(builder, entries, marks)
    assert dropped == 1
    trace = builder.build()
    got = [(action, addr - BASE, op) for action, addr, _, _, op in events(trace)]
    assert got == [
        ("segment_alloc", 0, None),
        ("alloc", 0, "mm"),
        ("alloc", 4 * MiB, "add"),
        ("free_requested", 0, None),
        ("free_completed", 0, None),
        ("free_requested", 4 * MiB, "sum"),
        ("free_completed", 4 * MiB, None),
    ]
    # The converted trace replays: both blocks in the one 20 MiB segment PyTorch made.
    r = replay(trace)
    assert r.match is True and r.real_segments == r.model_segments == [20 * MiB]
