"""A bounded schemathesis run against the job service's served OpenAPI schema: no 5xx,
no response that breaks the schema (a real server, store and supervisors)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.specs.openapi.checks import positive_data_acceptance  # noqa: E402

from vramctl.server import JobServer, serve_jobs  # noqa: E402


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JobServer]:
    home = tmp_path_factory.mktemp("fuzz")
    old = os.environ.get("VRAMCTL_HOME")
    os.environ["VRAMCTL_HOME"] = str(home)
    try:
        with serve_jobs(
            port=0, store=Path(home) / "jobs.db", devices=["sim:8GiB"], token="fuzz-token"
        ) as srv:
            yield srv
    finally:
        if old is None:
            os.environ.pop("VRAMCTL_HOME", None)
        else:
            os.environ["VRAMCTL_HOME"] = old


@pytest.fixture(scope="module")
def api_schema(fuzzed: JobServer) -> Any:
    return schemathesis.openapi.from_url(f"{fuzzed.url}openapi.json")


# The event stream never ends (it is the dashboard's live feed, not a JSON route).
schema = schemathesis.pytest.from_fixture("api_schema").exclude(path="/api/stream")


@schema.parametrize()
@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
def test_no_server_errors_and_the_schema_holds(case: Any) -> None:
    # A job spec the schema allows may still be refused, and must be, with a 4xx: its
    # program must exist on the server, its need fit a device, its name be well formed
    # (rules a JSON schema cannot state); so "schema-valid is accepted" is not checked.
    excluded = [positive_data_acceptance] if case.operation.path == "/jobs" else []
    case.call_and_validate(
        headers={"Authorization": "Bearer fuzz-token"}, timeout=30, excluded_checks=excluded
    )
