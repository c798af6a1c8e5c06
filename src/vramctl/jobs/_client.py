"""``JobClient``: the queue of a running job service (``vramctl serve``), over HTTP.

The same calls as :class:`~vramctl.jobs.Queue` (``submit``, ``get``, ``list``,
``cancel``, ``wait``) and ``logs``, with the standard library only. The token is
``token``, else ``$VRAMCTL_TOKEN``, else the file ``token_file``, else
``$VRAMCTL_HOME/token`` (what the service wrote there on its first start).
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from vramctl._auth import find_token
from vramctl._errors import VramctlError
from vramctl.jobs._spec import JobSpec
from vramctl.jobs._store import Job, vramctl_home, wait_finished

__all__ = ["JobClient", "JobClientError", "job_from_dict"]

#: The environment variable naming the service for the CLI's ``--server``.
SERVER_ENV = "VRAMCTL_SERVER"


class JobClientError(VramctlError):
    """The service refused a request (its status and message), or could not be reached."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def job_from_dict(doc: Mapping[str, Any]) -> Job:
    """A :class:`Job` from its JSON form (:meth:`Job.to_dict`)."""
    values = dict(doc)
    values["spec"] = JobSpec.from_dict(values["spec"])
    return Job(**values)


def _token(token: str | None, token_file: str | os.PathLike[str] | None) -> str | None:
    try:  # no token at all: read-only routes on loopback need none
        return find_token(token, token_file=token_file, home=vramctl_home())
    except VramctlError:
        raise JobClientError(f"cannot read the token file {Path(token_file or '')}") from None


class JobClient:
    """The jobs of the service at ``url`` (``http://127.0.0.1:8765``)."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        token_file: str | os.PathLike[str] | None = None,
        timeout: float = 30.0,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise JobClientError(f"{url!r}: give the service's address, http://HOST:PORT")
        self.url = url.rstrip("/") + "/"
        self.token = _token(token, token_file)
        self.timeout = timeout

    def _open(
        self, method: str, path: str, body: Any = None, *, timeout: float | None = -1.0
    ) -> Any:
        import urllib.request  # http.client and ssl: only for a job service, not the local store

        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            wait = self.timeout if timeout == -1.0 else timeout
            return urllib.request.urlopen(req, timeout=wait)
        except urllib.error.HTTPError as exc:
            text = exc.read().decode(errors="replace")
            try:
                doc = json.loads(text)
                message = doc.get("error", text)
                problems = doc.get("problems") or []
            except ValueError:
                message, problems = text, []
            lines = "".join(f"\n  {p}" for p in problems)
            raise JobClientError(f"{message}{lines}", exc.code) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise JobClientError(f"cannot reach the job service at {self.url}: {reason}") from None

    def _json(self, method: str, path: str, body: Any = None) -> Any:
        with self._open(method, path, body) as resp:
            return json.loads(resp.read())

    def submit(self, spec: JobSpec | Mapping[str, Any]) -> Job:
        """Queue a job (a :class:`JobSpec` or its dict); the service checks it."""
        doc = spec.to_dict() if isinstance(spec, JobSpec) else dict(spec)
        return job_from_dict(self._json("POST", "jobs", doc))

    def get(self, job_id: str) -> Job:
        return job_from_dict(self._json("GET", f"jobs/{urllib.parse.quote(job_id, safe='')}"))

    def list(
        self,
        states: Sequence[str] | None = None,
        *,
        label: str | None = None,
        limit: int | None = None,
        offset: int = 0,
    ) -> list[Job]:
        """Jobs in submission order (every page of them, or ``limit``)."""
        out: list[Job] = []
        while True:
            query: dict[str, Any] = {"offset": offset + len(out), "limit": 1000}
            if states:
                query["state"] = ",".join(states)
            if label:
                query["label"] = label
            page = self._json("GET", "jobs?" + urllib.parse.urlencode(query))
            out += [job_from_dict(j) for j in page["jobs"]]
            if not page["jobs"] or len(out) + offset >= page["total"]:
                break
            if limit is not None and len(out) >= limit:
                break
        return out if limit is None else out[:limit]

    def cancel(self, job_id: str) -> Job:
        return job_from_dict(self._json("DELETE", f"jobs/{urllib.parse.quote(job_id, safe='')}"))

    def logs(self, job_id: str, *, follow: bool = False) -> Iterator[bytes]:
        """The job's output, in chunks; ``follow`` streams it until the job ends."""
        path = f"jobs/{urllib.parse.quote(job_id, safe='')}/logs" + (
            "?follow=true" if follow else ""
        )
        # A followed log may stay quiet for long: no read timeout then.
        with self._open("GET", path, timeout=None if follow else -1.0) as resp:
            while True:
                chunk = resp.read1(65536) if hasattr(resp, "read1") else resp.read(65536)
                if not chunk:
                    return
                yield chunk

    def wait(self, job_id: str, timeout: float | None = None, *, poll: float = 0.2) -> Job:
        """The job once it has ended; :class:`TimeoutError` after ``timeout`` seconds."""
        return wait_finished(self.get, job_id, timeout, poll)
