"""The one home of the HTTP servers' tokens (``vramctl._auth``): the service, its client
and the monitor's endpoints find a token by the same rule."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from vramctl import VramctlError
from vramctl._auth import find_token, token_ok
from vramctl.jobs import JobClient, JobClientError
from vramctl.monitor._http import check_bind
from vramctl.server import service_token


@pytest.fixture(autouse=True)
def _home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("VRAMCTL_TOKEN", raising=False)
    monkeypatch.setenv("VRAMCTL_HOME", str(tmp_path))
    return tmp_path


def test_the_order_is_argument_environment_file_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert find_token() is None and find_token(home=tmp_path) is None  # nothing: none
    (tmp_path / "token").write_text("from-home\n")
    assert find_token(home=tmp_path) == "from-home"
    given = tmp_path / "given"
    given.write_text("from-file\n")
    assert find_token(token_file=given, home=tmp_path) == "from-file"
    monkeypatch.setenv("VRAMCTL_TOKEN", "from-env")
    assert find_token(token_file=given, home=tmp_path) == "from-env"
    assert find_token("from-arg", token_file=given, home=tmp_path) == "from-arg"


def test_the_service_makes_its_token_and_the_client_reads_the_same(tmp_path: Path) -> None:
    assert JobClient("http://127.0.0.1:1").token is None  # not made yet: none
    made = service_token()
    assert (tmp_path / "token").read_text().strip() == made
    assert stat.S_IMODE((tmp_path / "token").stat().st_mode) == 0o600
    assert service_token() == made  # made once
    assert JobClient("http://127.0.0.1:1").token == made


def test_a_missing_or_empty_token_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(JobClientError, match="cannot read the token file"):
        JobClient("http://127.0.0.1:1", token_file=missing)
    with pytest.raises(VramctlError, match="cannot read the service token"):
        service_token(token_file=missing)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    assert JobClient("http://127.0.0.1:1", token_file=empty).token is None
    (tmp_path / "token").write_text("")
    with pytest.raises(VramctlError, match="is empty"):
        service_token()


def test_the_monitor_takes_the_environment_token(monkeypatch: pytest.MonkeyPatch) -> None:
    assert check_bind("127.0.0.1", 0, None) is None
    monkeypatch.setenv("VRAMCTL_TOKEN", "s3cret")
    assert check_bind("127.0.0.1", 0, None) == "s3cret"
    assert token_ok("s3cret", "Bearer s3cret") and token_ok("s3cret", None, "s3cret")
    assert not token_ok("s3cret", "Bearer nope") and token_ok(None, None)
