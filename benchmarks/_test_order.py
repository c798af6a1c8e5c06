"""A pytest plugin: run the tests in the order a JSON file gives.

The GPU suite's test steps load it (``-p _test_order``, with ``benchmarks/`` on the path) and
``VRAMCTL_TEST_ORDER`` naming a file of the form::

    {"first": ["tests/estimator/", "tests/fit/"], "last": ["tests/x.py::test_y"]}

Tests whose node id starts with a ``first`` prefix run first, in the prefixes' order; the
node ids in ``last`` (those that passed before on the same GPU model) run after every
other test. Within each group the collection order is kept. A step stopped at its budget
has then spent its seconds on what matters most and what no GPU has yet shown.
Without the variable, or with a file that cannot be read, the order is left alone.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

#: The environment variable that names the order file.
ORDER_ENV = "VRAMCTL_TEST_ORDER"


def read_order(path: str | os.PathLike[str]) -> tuple[list[str], set[str]]:
    """The ``first`` prefixes and the ``last`` node ids of an order file (empty where it
    cannot be read or has neither)."""
    try:
        got: Any = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return [], set()
    if not isinstance(got, dict):
        return [], set()
    first = [p for p in got.get("first") or [] if isinstance(p, str)]
    last = {n for n in got.get("last") or [] if isinstance(n, str)}
    return first, last


def rank(nodeid: str, first: list[str], last: set[str]) -> tuple[bool, int]:
    """Where a test goes: after the others if it is in ``last``, then by the first
    ``first`` prefix it starts with (tests under none come after those under one)."""
    area = next((i for i, p in enumerate(first) if nodeid.startswith(p)), len(first))
    return nodeid in last, area


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    path = os.environ.get(ORDER_ENV)
    if not path:
        return
    first, last = read_order(path)
    if first or last:
        items.sort(key=lambda item: rank(item.nodeid, first, last))  # stable
