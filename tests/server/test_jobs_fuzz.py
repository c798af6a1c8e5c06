"""A bounded schemathesis run against the job service's served OpenAPI schema: no 5xx,
no response that breaks the schema (a real server, store and supervisors)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis.specs.openapi.checks import positive_data_acceptance  # noqa: E402

from tests.server._service import job_service  # noqa: E402
from vramctl.server import JobServer  # noqa: E402


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[JobServer]:
    with job_service(tmp_path_factory.mktemp("fuzz"), token="fuzz-token") as srv:
        yield srv


@pytest.fixture(scope="module")
def api_schema(fuzzed: JobServer) -> Any:
    return schemathesis.openapi.from_url(f"{fuzzed.url}openapi.json")


# Each operation of the schema the repository documents (test_jobs_api.py holds it to the
# served one). The event stream never ends (it is the dashboard's live feed, not a JSON route).
OPERATIONS = [
    f"{method.upper()} {path}"
    for path, methods in json.loads(
        (Path(__file__).resolve().parents[2] / "docs" / "openapi.json").read_text()
    )["paths"].items()
    for method in methods
    if path != "/api/stream"
]


# The cases come from schemathesis' Hypothesis strategy for each operation, run here with
# Hypothesis' own ``given``, not through schemathesis' pytest plugin (its 4.32 parametrization
# reads a private attribute of pytest's test items that pytest 9.2 removed).
@pytest.mark.parametrize("label", OPERATIONS)
def test_no_server_errors_and_the_schema_holds(api_schema: Any, label: str) -> None:
    operation = api_schema.find_operation_by_label(label)
    assert operation is not None, f"{label} is documented but not served"
    # A job spec the schema allows may still be refused, and must be, with a 4xx: its
    # program must exist on the server, its need fit a device, its name be well formed
    # (rules a JSON schema cannot state); so "schema-valid is accepted" is not checked.
    excluded = [positive_data_acceptance] if operation.path == "/jobs" else []

    @given(case=operation.as_strategy())
    @settings(
        max_examples=25,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
        database=None,
    )
    def fuzz(case: Any) -> None:
        case.call_and_validate(
            headers={"Authorization": "Bearer fuzz-token"}, timeout=30, excluded_checks=excluded
        )

    fuzz()
