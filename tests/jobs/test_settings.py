"""The queue's settings (file, variables) and the Python ``Queue``."""

from __future__ import annotations

from pathlib import Path

import pytest

import vramctl
from vramctl.jobs import JobSpec, JobSpecError, Queue, Scheduler, Settings, load_settings


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("VRAMCTL_HOME", str(tmp_path))
    for var in (
        "VRAMCTL_SETTINGS",
        "VRAMCTL_JOBS_STORE",
        "VRAMCTL_SAFETY_MARGIN",
        "VRAMCTL_MAX_CONCURRENT_JOBS",
        "VRAMCTL_PLACEMENT_POLICY",
        "VRAMCTL_WAIT_TIMEOUT",
        "VRAMCTL_RUN_TIMEOUT",
    ):
        monkeypatch.delenv(var, raising=False)
    return tmp_path


def test_defaults_then_the_file_then_the_variables(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert load_settings() == Settings()
    (home / "settings.toml").write_text(
        '[jobs]\nmargin = 0.25\npolicy = "most-free"\nwait_timeout = "30m"\n'
        f'store = "{home / "q.db"}"\n'
    )
    s = load_settings()
    assert (s.margin, s.policy, s.wait_timeout, s.store) == (0.25, "most-free", 1800, home / "q.db")
    monkeypatch.setenv("VRAMCTL_SAFETY_MARGIN", "0.05")
    monkeypatch.setenv("VRAMCTL_MAX_CONCURRENT_JOBS", "3")
    monkeypatch.setenv("VRAMCTL_RUN_TIMEOUT", "2h")
    s = load_settings()
    assert (s.margin, s.max_concurrent_jobs, s.run_timeout, s.policy) == (
        0.05,
        3,
        7200,
        "most-free",
    )


@pytest.mark.parametrize(
    ("text", "env", "message"),
    [
        ("[jobs]\nmargin = -1\n", {}, "jobs.margin: a share of the need from 0 to 10"),
        ("[jobs]\nmarign = 0.1\n", {}, "unknown setting jobs.marign"),
        ("[jobs]\npolicy = 'first-fit'\n", {}, "one of best-fit, most-free"),
        ("jobs = 3\n", {}, "[jobs] must be a table"),
        ("[jobs\n", {}, "settings.toml"),
        ("", {"VRAMCTL_MAX_CONCURRENT_JOBS": "0"}, "$VRAMCTL_MAX_CONCURRENT_JOBS: a whole number"),
        ("", {"VRAMCTL_WAIT_TIMEOUT": "soon"}, "$VRAMCTL_WAIT_TIMEOUT: must be seconds"),
    ],
)
def test_a_bad_setting_names_where_it_came_from(
    home: Path, monkeypatch: pytest.MonkeyPatch, text: str, env: dict[str, str], message: str
) -> None:
    (home / "settings.toml").write_text(text)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(JobSpecError, match="invalid job queue settings") as e:
        load_settings()
    assert message in str(e.value)


def test_a_named_settings_file_must_exist(home: Path) -> None:
    with pytest.raises(JobSpecError, match="no settings file"):
        load_settings(home / "missing.toml")


def test_the_queue_applies_default_timeouts_and_waits(home: Path) -> None:
    settings = Settings(wait_timeout=60.0, run_timeout=5.0)
    with Queue(home / "jobs.db", settings=settings) as q:
        job = q.submit({"name": "ok", "command": ["true"], "memory": "1GiB", "run_timeout": 9})
        assert (job.spec.wait_timeout, job.spec.run_timeout) == (60.0, 9.0)  # its own kept
        with pytest.raises(TimeoutError, match=f"job {job.id} is still queued after 0.1 s"):
            q.wait(job.id, timeout=0.1)
        with vramctl.simulate("4GiB") as gpu:
            Scheduler(q.store, devices=[gpu]).run(until_idle=True)
        assert q.wait(job.id, timeout=5).state == "succeeded"
        assert [j.id for j in q.list(["succeeded"])] == [job.id]
        assert isinstance(job.spec, JobSpec)
