"""``Queue``: the job queue from Python: submit, look up, list, cancel, wait."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from vramctl.jobs._settings import Settings, load_settings
from vramctl.jobs._spec import JobSpec
from vramctl.jobs._store import Job, JobStore, wait_finished

__all__ = ["Queue"]


class Queue:
    """The jobs of a store (``store``, else the settings' store, else
    ``$VRAMCTL_HOME/jobs.db``). A scheduler (``vramctl scheduler`` or
    :class:`~vramctl.jobs.Scheduler`) admits what is submitted.

    >>> import os, tempfile
    >>> q = Queue(os.path.join(tempfile.mkdtemp(), "jobs.db"))
    >>> job = q.submit({"name": "demo", "command": ["true"], "memory": "1GiB"})
    >>> q.get(job.id).state, q.cancel(job.id).state
    ('queued', 'cancelled')
    """

    def __init__(
        self, store: str | os.PathLike[str] | None = None, *, settings: Settings | None = None
    ) -> None:
        self.settings = settings if settings is not None else load_settings()
        self.store = JobStore(store if store is not None else self.settings.store)

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> Queue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(self, spec: JobSpec | Mapping[str, Any]) -> Job:
        """Queue a job (a :class:`JobSpec` or its dict); the settings' default timeouts
        fill in what the spec leaves unset."""
        made = spec if isinstance(spec, JobSpec) else JobSpec.from_dict(spec)
        return self.store.submit(self.settings.apply(made))

    def get(self, job_id: str) -> Job:
        return self.store.get(job_id)

    def list(
        self,
        states: Sequence[str] | None = None,
        *,
        label: str | None = None,
        limit: int | None = None,
        offset: int = 0,
    ) -> list[Job]:
        return self.store.list(states, label=label, limit=limit, offset=offset)

    def cancel(self, job_id: str) -> Job:
        return self.store.cancel(job_id)

    def wait(self, job_id: str, timeout: float | None = None, *, poll: float = 0.1) -> Job:
        """The job once it has ended; :class:`TimeoutError` after ``timeout`` seconds."""
        return wait_finished(self.store.get, job_id, timeout, poll)
