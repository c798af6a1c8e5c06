"""Estimates that price jobs, run in a worker process: never in the job service's own.

A need of kind ``estimate`` runs :func:`vramctl.estimate` on the model its spec names. That
imports and calls a ``module:factory`` of the user's, builds inputs as large as the spec's
``seq_len`` asks, and looks a Hugging Face Hub id up over the network. In the job service
one request could so kill the service (a factory that aborts), grow it by gigabytes, or hold
it for many seconds. :class:`EstimateWorker` runs each estimate in one child process of its
own instead, started on the first estimate and kept for the next ones:

- one estimate at a time: a lock, as the service's request threads and its scheduler's
  thread share one worker;
- a time limit per estimate (``$VRAMCTL_ESTIMATE_TIMEOUT``, 60 s by default): past it the
  worker is killed, and the next estimate starts a new one;
- a memory limit (``RLIMIT_DATA``, ``$VRAMCTL_ESTIMATE_MEMORY``, 4 GiB by default): an
  estimate that needs more fails with a memory error;
- Hub lookups that give up after 5 s (``HF_HUB_ETAG_TIMEOUT``, ``HF_HUB_DOWNLOAD_TIMEOUT``,
  unless they are set already);
- a worker that dies (an abort, a signal) fails that estimate only; the next starts a new
  one.

The device is resolved here, in the caller's process (its reading, a calibration profile),
and sent as a target (``vramctl.estimator._target.Target``): a job is priced as in-process pricing
prices it. Requests and answers are pickled frames, each after its length (8 bytes,
big-endian), over the worker's stdin and stdout; what the model prints goes to its stderr.
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any

from vramctl._errors import InvalidSizeError, VramctlError
from vramctl._units import format_bytes, parse_size
from vramctl.jobs._spec import JobSpecError, parse_duration

if TYPE_CHECKING:
    from vramctl.estimator import Step

__all__ = [
    "ESTIMATE_MEMORY_ENV",
    "ESTIMATE_TIMEOUT_ENV",
    "EstimateWorker",
]

#: The variables that set an estimate's time limit (seconds or a duration such as "2m")
#: and its worker's memory limit (bytes or a size such as "4GiB").
ESTIMATE_TIMEOUT_ENV = "VRAMCTL_ESTIMATE_TIMEOUT"
ESTIMATE_MEMORY_ENV = "VRAMCTL_ESTIMATE_MEMORY"
DEFAULT_TIMEOUT = 60.0
DEFAULT_MEMORY = 4 << 30
#: The Hub's timeouts in the worker (seconds), where the environment sets none.
HUB_TIMEOUT = "5"
_HUB_TIMEOUTS = ("HF_HUB_ETAG_TIMEOUT", "HF_HUB_DOWNLOAD_TIMEOUT")
#: How long a new worker may take to import PyTorch and the estimator.
START_TIMEOUT = 120.0
_HEADER = struct.Struct(">Q")
#: The largest frame read: a request or an answer is a few kilobytes.
_MAX_FRAME = 16 << 20
_READY = "ready"
#: The folder vramctl's package is in.
_PACKAGES = str(Path(__file__).resolve().parents[2])


class _Died(Exception):
    """The worker's pipe ended: it exited or was killed."""


class EstimateWorker:
    """Runs :func:`vramctl.estimate` for job pricing in one child process (see the module).

    Call it as ``worker(model, step, batch_size=, seq_len=)`` (``step`` a
    :class:`vramctl.Step`): the estimate's ``judged_peak`` in bytes (what
    :func:`~vramctl.jobs.price` returns), or :class:`~vramctl.estimator.EstimateError` with
    the reason. ``timeout`` (seconds) and ``memory`` (bytes or a size) default to
    ``$VRAMCTL_ESTIMATE_TIMEOUT`` and ``$VRAMCTL_ESTIMATE_MEMORY``, else 60 s and 4 GiB.
    :meth:`close` (or ``with``) stops the worker. Thread-safe: estimates run one at a time.
    """

    def __init__(self, *, timeout: float | None = None, memory: int | str | None = None) -> None:
        self.timeout = _timeout(timeout)
        self.memory = _memory(memory)
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._closed = threading.Event()  # set by close(), from any thread

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (an estimate it cut short is not the job's fault)."""
        return self._closed.is_set()

    @property
    def pid(self) -> int | None:
        """The worker's process id while one runs."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def __call__(
        self,
        model: str,
        step: Step,
        *,
        batch_size: int | None = None,
        seq_len: int | None = None,
    ) -> int:
        from vramctl.estimator import EstimateError
        from vramctl.estimator._shared import resolve_target

        request = {
            "model": model,
            # The device is resolved here (its reading, a calibration profile).
            "step": step.replace(device=resolve_target(step.device, step.calibration)),
            "batch_size": batch_size,
            "seq_len": seq_len,
            # Where `module:factory` is imported from, as in this process.
            "cwd": os.getcwd(),
            "path": list(sys.path),
        }
        payload = pickle.dumps(request)
        with self._lock:
            if self._closed.is_set():
                raise EstimateError("the estimate's worker process is closed")
            proc = self._running()
            try:
                _send(proc, payload)
                answer = _receive(proc, time.monotonic() + self.timeout)
            except TimeoutError:
                self._stop(proc)
                raise EstimateError(
                    f"the estimate took longer than {self.timeout:g} s (its worker process was"
                    f" stopped; ${ESTIMATE_TIMEOUT_ENV} sets the limit)"
                ) from None
            except _Died:
                status = self._stop(proc)
                if self._closed.is_set():
                    raise EstimateError("the estimate's worker process was closed") from None
                raise EstimateError(f"the estimate's worker process died ({status})") from None
            if self._closed.is_set():  # closed while it started: it stops now
                self._stop(proc)
        kind, value = answer
        if kind == "ok":
            return int(value)
        raise EstimateError(str(value))

    def close(self) -> None:
        """Stop the worker (an estimate it runs fails); later estimates are refused."""
        self._closed.set()
        proc = self._proc
        if proc is None:
            return
        if self._lock.acquire(blocking=False):
            try:
                self._stop(proc)
            finally:
                self._lock.release()
        else:  # an estimate runs: it ends at once, and its thread reaps the worker
            _kill(proc)

    def __enter__(self) -> EstimateWorker:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- the process -----------------------------------------------------------------

    def _running(self) -> subprocess.Popen[bytes]:
        """The worker, started (and waited for) where none runs."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            return proc
        if proc is not None:
            self._stop(proc)
        from vramctl.estimator import EstimateError

        proc = subprocess.Popen(  # argv, no shell
            [sys.executable, "-m", "vramctl.jobs._pricing", str(self.memory)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,  # the worker's warnings and tracebacks go where this process's go
            env=_environment(os.environ),
            # Started where vramctl's package lies (`-m` puts it first on the import path,
            # not this process's folder, whose files could shadow PyTorch's); each request
            # says the folder and path its model is imported from.
            cwd=_PACKAGES,
            start_new_session=True,  # its own process group: a timeout kills all of it
        )
        self._proc = proc
        try:
            ready = _receive(proc, time.monotonic() + START_TIMEOUT)
        except (TimeoutError, _Died):
            status = self._stop(proc)
            if self._closed.is_set():
                raise EstimateError("the estimate's worker process was closed") from None
            raise EstimateError(
                f"the estimate's worker process did not start ({status}; its error is in"
                f" this process's stderr; ${ESTIMATE_MEMORY_ENV} is"
                f" {format_bytes(self.memory)})"
            ) from None
        if ready != (_READY, None):
            self._stop(proc)
            raise EstimateError(f"the estimate's worker process said {ready!r} at its start")
        return proc

    def _stop(self, proc: subprocess.Popen[bytes]) -> str:
        """Kill the worker's process group and reap it; its exit status in words."""
        _kill(proc)
        try:
            code = proc.wait(10)
        except subprocess.TimeoutExpired:  # pragma: no cover - a process SIGKILL missed
            code = None
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()
        if self._proc is proc:
            self._proc = None
        return _status(code)


def _environment(base: Mapping[str, str]) -> dict[str, str]:
    """The worker's environment: ``base`` with the Hub's timeouts where it sets none (the
    names ``huggingface_hub.constants`` reads: a lookup of the Hub's then gives up in
    seconds, not after its default retries)."""
    env = dict(base)
    for name in _HUB_TIMEOUTS:
        if not env.get(name):
            env[name] = HUB_TIMEOUT
    return env


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL to the worker's process group (what its model started goes with it), while
    its process is not reaped yet (its id, the group's, is not anyone else's)."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)


def _status(code: int | None) -> str:
    """An exit status in words: ``signal 6: SIGABRT``, ``exit status 1``."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
        return f"signal {-code}: {name}"
    return f"exit status {code}"


def _timeout(value: float | None) -> float:
    raw: object = value if value is not None else os.environ.get(ESTIMATE_TIMEOUT_ENV) or None
    where = "timeout" if value is not None else f"${ESTIMATE_TIMEOUT_ENV}"
    try:
        seconds = parse_duration(raw, where)
    except JobSpecError as exc:
        raise JobSpecError(exc.problems, what="invalid estimate worker settings") from None
    if seconds is None:
        return DEFAULT_TIMEOUT
    if seconds <= 0:
        raise JobSpecError(
            f"{where}: must be more than 0 seconds, got {raw!r}",
            what="invalid estimate worker settings",
        )
    return seconds


def _memory(value: int | str | None) -> int:
    raw: int | str | None = value if value is not None else os.environ.get(ESTIMATE_MEMORY_ENV)
    where = "memory" if value is not None else f"${ESTIMATE_MEMORY_ENV}"
    if raw is None or raw == "":
        return DEFAULT_MEMORY
    try:
        size = parse_size(raw)
    except InvalidSizeError as exc:
        raise JobSpecError(f"{where}: {exc}", what="invalid estimate worker settings") from None
    if size < 256 << 20:
        raise JobSpecError(
            f"{where}: at least 256 MiB (the worker imports PyTorch), got {raw!r}",
            what="invalid estimate worker settings",
        )
    return size


# -- frames ------------------------------------------------------------------------------


def _send(proc: subprocess.Popen[bytes], payload: bytes) -> None:
    assert proc.stdin is not None
    try:
        proc.stdin.write(_HEADER.pack(len(payload)) + payload)
        proc.stdin.flush()
    except (BrokenPipeError, ValueError, OSError):
        raise _Died from None


def _receive(proc: subprocess.Popen[bytes], deadline: float) -> Any:
    """One answer of the worker, or TimeoutError past ``deadline``."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    (size,) = _HEADER.unpack(_read(fd, _HEADER.size, deadline))
    if size > _MAX_FRAME:
        raise _Died
    return pickle.loads(_read(fd, size, deadline))


def _read(fd: int, n: int, deadline: float) -> bytes:
    got = bytearray()
    poller = select.poll()  # not select(): a service's descriptors may pass 1024
    poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    while len(got) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        if not poller.poll(max(1, math.ceil(left * 1000))):
            continue
        try:
            chunk = os.read(fd, n - len(got))
        except OSError:
            raise _Died from None
        if not chunk:
            raise _Died
        got += chunk
    return bytes(got)


def _read_frame(pipe: IO[bytes]) -> Any:
    """The next request, or None at the end of the pipe (the caller has gone)."""
    header = pipe.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    body = pipe.read(size)
    if len(body) < size:
        return None
    return pickle.loads(body)


def _write_frame(pipe: IO[bytes], value: Any) -> None:
    payload = pickle.dumps(value)
    pipe.write(_HEADER.pack(len(payload)) + payload)
    pipe.flush()


# -- the worker's side -------------------------------------------------------------------


def _answer(request: dict[str, Any], memory: int) -> tuple[str, Any]:
    """``("ok", judged_peak)`` or ``("error", its one-line reason)``."""
    from vramctl.estimator import EstimateError, estimate

    with contextlib.suppress(OSError):
        os.chdir(request["cwd"])
    path = list(request["path"])
    sys.path[:] = path + [p for p in sys.path if p not in path]
    try:
        est = estimate(
            request["model"],
            batch_size=request["batch_size"],
            seq_len=request["seq_len"],
            step=request["step"],
        )
    except BaseException as exc:  # the model's own code: any error is the estimate's
        if isinstance(exc, EstimateError):
            reason = str(exc)
        else:
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            reason = f"{type(exc).__name__}: {first}".rstrip(": ")
        if _out_of_memory(exc):
            reason = (
                "the estimate needed more memory than its worker process may use"
                f" ({format_bytes(memory)}, ${ESTIMATE_MEMORY_ENV}): {reason}"
            )
        return "error", reason.rstrip(": ")
    return "ok", int(est.judged_peak)


def _out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` or an error it came from is an allocation that failed (Python's
    ``MemoryError``, PyTorch's CPU allocator's)."""
    seen: BaseException | None = exc
    for _ in range(10):
        if seen is None:
            return False
        if isinstance(seen, MemoryError) or "can't allocate memory" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _watch_parent() -> None:
    """Exit when the process that started the worker is gone (its pipes may outlive it)."""
    parent = os.getppid()
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(0)


def main(argv: list[str]) -> int:
    """The worker: ``python -m vramctl.jobs._pricing MEMORY_BYTES``."""
    import resource

    memory = int(argv[0])
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = memory if hard == resource.RLIM_INFINITY else min(memory, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    # The pipes are the worker's own: the model's code reads no request and prints no answer.
    requests = os.fdopen(os.dup(0), "rb")
    answers = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    threading.Thread(target=_watch_parent, name="vramctl-parent-watch", daemon=True).start()
    import vramctl.estimator  # noqa: F401 (PyTorch and the estimator, before the first request)

    _write_frame(answers, (_READY, None))
    while True:
        request = _read_frame(requests)
        if request is None:
            return 0
        _write_frame(answers, _answer(request, limit))


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except VramctlError as exc:  # pragma: no cover - reported to the caller as its status
        print(f"vramctl estimate worker: {exc}", file=sys.stderr)
        sys.exit(1)
