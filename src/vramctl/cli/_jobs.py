"""``vramctl run``, ``submit``, ``jobs``, ``logs``, ``cancel`` and ``scheduler``: the job queue."""

from __future__ import annotations

import contextlib
import re
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from vramctl import VramctlError, format_bytes
from vramctl.cli._common import app, console, emit_json, err, user_errors
from vramctl.device import Device, resolve
from vramctl.jobs import (
    POLICIES,
    STATES,
    Job,
    JobClient,
    JobSpec,
    JobStore,
    load_settings,
    load_spec,
)

if TYPE_CHECKING:  # the scheduler (placement, PyTorch) is imported by the commands that run it
    from vramctl.jobs import Runner

__all__ = ["app"]

StoreOption = Annotated[
    Path | None,
    typer.Option(
        "--store",
        help="The job store (default: $VRAMCTL_JOBS_STORE, else $VRAMCTL_HOME/jobs.db).",
        show_default=False,
    ),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON.")]
ServerOption = Annotated[
    str | None,
    typer.Option(
        "--server",
        envvar="VRAMCTL_SERVER",
        help="A job service's address (vramctl serve), e.g. http://127.0.0.1:8765; "
        "default: the local store.",
        show_default=False,
    ),
]
TokenFileOption = Annotated[
    Path | None,
    typer.Option(
        "--token-file",
        help="The service's token file (default: $VRAMCTL_TOKEN, else $VRAMCTL_HOME/token).",
        show_default=False,
    ),
]


def _pairs(option: str, items: list[str] | None) -> dict[str, str]:
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise VramctlError(f"{option} {item!r}: give KEY=VALUE")
        out[key] = value
    return out


def _spec(
    spec_file: Path | None,
    command: list[str] | None,
    *,
    memory: str | None,
    name: str | None,
    priority: int | None,
    retries: int | None,
    wait_timeout: float | None,
    run_timeout: float | None,
    labels: list[str] | None,
    overrun_retries: int | None = None,
    env: list[str] | None,
    cwd: Path | None,
    guard: str | None = None,
    guard_optimizer: str | None = None,
) -> JobSpec:
    """The job spec of a file, or of the command line, with the options laid over it."""
    if spec_file is not None and command:
        raise VramctlError("give a spec file (--spec) or a command after --, not both")
    doc: dict[str, Any] = {}
    if spec_file is not None:
        doc = load_spec(spec_file).to_dict()
    elif not command:
        raise VramctlError(
            "no command: put it after --, e.g. vramctl run --memory 4GiB -- python train.py"
        )
    else:
        if len(command) == 1 and " " in command[0] and not Path(command[0]).exists():
            words = " ".join(command[0].split())
            raise VramctlError(
                f"{command[0]!r} is one argument, and vramctl runs no shell: give the words "
                f"separately, e.g. -- {words}"
            )
        doc["command"] = list(command)
        doc["name"] = _name(command[0]) if name is None else name
    for key, value in (
        ("memory", memory),
        ("name", name),
        ("priority", priority),
        ("retries", retries),
        ("overrun_retries", overrun_retries),
        ("wait_timeout", wait_timeout),
        ("run_timeout", run_timeout),
        ("cwd", None if cwd is None else str(cwd)),
    ):
        if value is not None:
            doc[key] = value
    if labels:
        doc["labels"] = {**doc.get("labels", {}), **_pairs("--label", labels)}
    if env:
        doc["env"] = {**doc.get("env", {}), **_pairs("--env", env)}
    if guard is not None:
        doc["guard"] = {"function": guard}
    if guard_optimizer is not None:
        if "guard" not in doc:
            raise VramctlError("--guard-optimizer goes with --guard module:function")
        doc["guard"]["optimizer"] = guard_optimizer
    return load_settings().apply(JobSpec.from_dict(doc))


def _name(program: str) -> str:
    """A job name from its program: ``/usr/bin/python3`` -> ``python3``."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(program).name).strip("-._")[:128]
    return name or "job"


def _devices(text: str | None) -> list[Device] | None:
    """``--devices cuda:0,sim:A10G-24GB``: real devices resolved, ``sim:`` ones simulated."""
    if text is None:
        return None
    out: list[Device] = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        out.append(resolve(item))  # sim:NAME is a simulated GPU
    if not out:
        raise VramctlError("--devices: name at least one device, e.g. --devices cuda:0")
    return out


def _store(path: Path | None) -> JobStore:
    """The store named by --store, else by the settings (file, VRAMCTL_JOBS_STORE)."""
    return JobStore(path if path is not None else load_settings().store)


def _client(server: str | None, token_file: Path | None) -> JobClient | None:
    """The job service named by --server (or $VRAMCTL_SERVER); None: the local store."""
    if server is None:
        if token_file is not None:
            raise VramctlError("--token-file is for a job service: give --server URL too")
        return None
    return JobClient(server, token_file=token_file)


def _row(job: Job) -> dict[str, Any]:
    return {
        "id": job.id,
        "name": job.name,
        "state": job.state,
        "device": job.device,
        "reserved_bytes": job.reserved_bytes,
        "peak_bytes": job.peak_bytes,
        "exit_code": job.exit_code,
        "attempts": job.attempts,
        "reason": job.reason,
        "submitted_at": job.submitted_at,
        "finished_at": job.finished_at,
    }


def _size(n: int | None) -> str:
    return "" if n is None else format_bytes(n)


# -- commands -------------------------------------------------------------------------------

SpecOption = Annotated[
    Path | None,
    typer.Option("--spec", help="A job spec file (.toml or .json).", show_default=False),
]
MemoryOption = Annotated[
    str | None,
    typer.Option("--memory", "-m", help="The job's memory need, e.g. 20GiB.", show_default=False),
]
NameOption = Annotated[
    str | None, typer.Option("--name", help="The job's name.", show_default=False)
]
PriorityOption = Annotated[
    int | None, typer.Option("--priority", help="Higher goes first.", show_default=False)
]
RetriesOption = Annotated[
    int | None,
    typer.Option("--retries", help="Runs again after a failure.", show_default=False),
]
OverrunRetriesOption = Annotated[
    int | None,
    typer.Option(
        "--overrun-retries",
        help="Runs again, needing more, after it used more memory than its share [default: 1].",
        show_default=False,
    ),
]
WaitOption = Annotated[
    float | None,
    typer.Option("--wait-timeout", help="Seconds it may wait for room.", show_default=False),
]
RunOption = Annotated[
    float | None,
    typer.Option("--run-timeout", help="Seconds it may run.", show_default=False),
]
LabelOption = Annotated[
    list[str] | None,
    typer.Option("--label", help="KEY=VALUE (repeatable).", show_default=False),
]
EnvOption = Annotated[
    list[str] | None,
    typer.Option("--env", help="KEY=VALUE for the job (repeatable).", show_default=False),
]
CwdOption = Annotated[
    Path | None,
    typer.Option("--cwd", help="The job's working directory.", show_default=False),
]
GuardOption = Annotated[
    str | None,
    typer.Option(
        "--guard",
        help="module:function, a function of a batch the job imports: run it under "
        "vramctl.guarded, in pieces when a batch runs out of memory.",
        show_default=False,
    ),
]
GuardOptimizerOption = Annotated[
    str | None,
    typer.Option(
        "--guard-optimizer",
        help="module:attribute, the optimizer: makes the guarded function a training "
        "step that returns the loss.",
        show_default=False,
    ),
]
CommandArg = Annotated[
    list[str] | None,
    typer.Argument(help="The command, after --.", show_default=False),
]
DevicesOption = Annotated[
    str | None,
    typer.Option(
        "--devices",
        help="Devices to place jobs on, e.g. cuda:0,cuda:1 or sim:A10G-24GB "
        "(default: every GPU, else the CPU).",
        show_default=False,
    ),
]

SubmitDevicesOption = Annotated[
    str | None,
    typer.Option(
        "--devices",
        help="The devices the scheduler places jobs on, e.g. cuda:0,cuda:1: a job that "
        "could fit none of them is refused now (default: not checked here).",
        show_default=False,
    ),
]


@app.command("submit")
@user_errors
def submit(
    command: CommandArg = None,
    spec_file: SpecOption = None,
    memory: MemoryOption = None,
    name: NameOption = None,
    priority: PriorityOption = None,
    retries: RetriesOption = None,
    overrun_retries: OverrunRetriesOption = None,
    wait_timeout: WaitOption = None,
    run_timeout: RunOption = None,
    label: LabelOption = None,
    env: EnvOption = None,
    cwd: CwdOption = None,
    guard: GuardOption = None,
    guard_optimizer: GuardOptimizerOption = None,
    devices: SubmitDevicesOption = None,
    store: StoreOption = None,
    server: ServerOption = None,
    token_file: TokenFileOption = None,
    as_json: JsonOption = False,
) -> None:
    """Queue a job; a running 'vramctl scheduler' admits it when there is room.

    The command is an argv list, never run through a shell. A job that can never
    fit is refused at once by a job service, or with --devices here; otherwise
    the scheduler says why a job waits (vramctl jobs). Examples:

        vramctl submit --memory 20GiB -- python train.py --lr 3e-4
        vramctl submit --spec job.toml
        vramctl submit --devices cuda:0,cuda:1 -m 20GiB -- python train.py
        vramctl submit --server http://127.0.0.1:8765 -m 4GiB -- python eval.py
    """
    spec = _spec(
        spec_file,
        command,
        memory=memory,
        name=name,
        priority=priority,
        retries=retries,
        overrun_retries=overrun_retries,
        wait_timeout=wait_timeout,
        run_timeout=run_timeout,
        labels=label,
        env=env,
        cwd=cwd,
        guard=guard,
        guard_optimizer=guard_optimizer,
    )
    remote = _client(server, token_file)
    if remote is not None:
        if devices is not None:
            raise VramctlError("--devices is the service's choice: leave it out with --server")
        job = remote.submit(spec)
    else:
        placed_on = _devices(devices)
        with _store(store) as s:
            if placed_on is not None:
                _check_fits(spec, placed_on, s)
            job = s.submit(spec)
    if as_json:
        emit_json(_row(job), indent=True)
        return
    console.print(f"queued job {job.id} ({job.name})", highlight=False)


@app.command("run")
@user_errors
def run(
    command: CommandArg = None,
    spec_file: SpecOption = None,
    memory: MemoryOption = None,
    name: NameOption = None,
    priority: PriorityOption = None,
    retries: RetriesOption = None,
    overrun_retries: OverrunRetriesOption = None,
    wait_timeout: WaitOption = None,
    run_timeout: RunOption = None,
    label: LabelOption = None,
    env: EnvOption = None,
    cwd: CwdOption = None,
    guard: GuardOption = None,
    guard_optimizer: GuardOptimizerOption = None,
    devices: DevicesOption = None,
    store: StoreOption = None,
    server: ServerOption = None,
    token_file: TokenFileOption = None,
    as_json: JsonOption = False,
) -> None:
    """Run one job in the foreground: wait for room, run it, report.

    The job is admitted by its memory need like any queued job, runs on the
    device with room, and its output is shown as it comes. The exit status is
    the job's. Ctrl-C cancels it. With --server the job service runs it.
    Example:

        vramctl run --memory 4GiB -- python train.py
    """
    spec = _spec(
        spec_file,
        command,
        memory=memory,
        name=name,
        priority=priority,
        retries=retries,
        overrun_retries=overrun_retries,
        wait_timeout=wait_timeout,
        run_timeout=run_timeout,
        labels=label,
        env=env,
        cwd=cwd,
        guard=guard,
        guard_optimizer=guard_optimizer,
    )
    remote = _client(server, token_file)
    if remote is not None:
        if devices is not None:
            raise VramctlError("--devices is the service's choice: leave it out with --server")
        job = _run_remote(remote, spec)
    else:
        job = _run_local(spec, store, devices)
    _report(job, as_json)


def _run_remote(remote: JobClient, spec: JobSpec) -> Job:
    job = remote.submit(spec)
    try:
        for chunk in remote.logs(job.id, follow=True):
            sys.stdout.write(chunk.decode(errors="replace"))
            sys.stdout.flush()
    except KeyboardInterrupt:
        remote.cancel(job.id)
        err.print(f"cancelling job {job.id}", highlight=False)
    return remote.wait(job.id)


def _run_local(spec: JobSpec, store: Path | None, devices: str | None) -> Job:
    from vramctl.jobs import Scheduler

    with _store(store) as s:
        settings = load_settings()
        sched = Scheduler(
            s,
            devices=_devices(devices),
            only=frozenset(),
            policy=settings.policy,
            margin=settings.margin,
            max_concurrent_jobs=settings.max_concurrent_jobs,
        )
        assert sched.devices is not None
        _check_fits(spec, sched.devices, s)  # else it would wait for room that never comes
        job = s.submit(spec)
        sched.only = frozenset({job.id})
        shown = 0
        try:
            while not job.finished:
                sched.run_once()
                job = s.get(job.id)
                shown = _show_log(job, shown)
                time.sleep(0.1)
        except KeyboardInterrupt:
            s.cancel(job.id)
            err.print(f"cancelling job {job.id}", highlight=False)
            while not s.get(job.id).finished:
                sched.run_once()
                time.sleep(0.1)
            job = s.get(job.id)
        _show_log(job, shown)
    return job


def _check_fits(spec: JobSpec, devices: Sequence[Device], store: JobStore) -> None:
    """Refuse, before it is queued, a job that none of ``devices`` could take even when
    empty (its need plus the safety margin): one line, the need and the largest device."""
    from vramctl.jobs import check_placeable

    learned = store.learned_peak(spec.name) if spec.memory.kind == "learned" else None
    check_placeable(spec, devices, learned_peak=learned, margin=load_settings().margin)


def _report(job: Job, as_json: bool) -> None:
    if as_json:
        emit_json(_row(job), indent=True)
    else:
        where = f" on {job.device}" if job.device else ""
        reserved = f", {_size(job.reserved_bytes)} reserved" if job.reserved_bytes else ""
        peak = f", peak {_size(job.peak_bytes)}" if job.peak_bytes else ""
        why = f": {job.reason}" if job.reason and job.state != "succeeded" else ""
        err.print(
            f"job {job.id} {job.state}{where}{reserved}{peak}{why}",
            highlight=False,
            soft_wrap=True,
        )
    if job.state != "succeeded":
        raise typer.Exit(job.exit_code if job.exit_code not in (None, 0) else 1)


def _show_log(job: Job, shown: int) -> int:
    """Print what the job's log gained since ``shown`` bytes; returns the new offset."""
    if not job.log_path:
        return shown
    with contextlib.suppress(OSError), open(job.log_path, "rb") as f:
        f.seek(shown)
        data = f.read()
        if data:
            sys.stdout.write(data.decode(errors="replace"))
            sys.stdout.flush()
            return shown + len(data)
    return shown


@app.command("jobs")
@user_errors
def jobs(
    state: Annotated[
        list[str] | None,
        typer.Option(
            "--state", help=f"Only these states: {', '.join(STATES)}.", show_default=False
        ),
    ] = None,
    label: Annotated[
        str | None,
        typer.Option("--label", help="Only jobs with KEY or KEY=VALUE.", show_default=False),
    ] = None,
    limit: Annotated[int | None, typer.Option("--limit", min=1, show_default=False)] = None,
    store: StoreOption = None,
    server: ServerOption = None,
    token_file: TokenFileOption = None,
    as_json: JsonOption = False,
) -> None:
    """List the jobs: state, device, reservation, peak, exit status."""
    remote = _client(server, token_file)
    if remote is not None:
        found = remote.list(state, label=label)
    else:
        with _store(store) as s:
            found = s.list(state, label=label)
    if limit is not None:
        found = found[-limit:]
    if as_json:
        emit_json({"schema": "vramctl.jobs/1", "jobs": [_row(j) for j in found]}, indent=True)
        return
    if not found:
        console.print("no jobs", highlight=False)
        return
    table = Table(title_justify="left")
    # Ids whole, never cut with "…": what is shown can be pasted into logs and cancel.
    table.add_column("id", no_wrap=True, min_width=max((len(j.id) for j in found), default=2))
    for col in ("name", "state", "device", "reserved", "peak", "exit"):
        right = col in ("reserved", "peak", "exit")
        table.add_column(col, justify="right" if right else "left", overflow="fold")
    for j in found:
        table.add_row(
            j.id,
            j.name,
            j.state,
            j.device or "",
            _size(j.reserved_bytes),
            _size(j.peak_bytes),
            "" if j.exit_code is None else str(j.exit_code),
        )
    console.print(table)
    # Why a job waits, or how it failed: a line each under the table, whole at any width.
    for j in found:
        why = _why(j)
        if why:
            head = "" if why.startswith("waiting") else f"{j.state}: "
            console.print(f"{j.id} {head}{why}", highlight=False, soft_wrap=True)


def _why(job: Job) -> str:
    """The reason worth a column: why a queued job waits, why one failed (not the
    'cancelled' of a cancelled job)."""
    return job.reason if job.reason and job.reason != job.state else ""


@app.command("logs")
@user_errors
def logs(
    job_id: Annotated[
        str, typer.Argument(help="The job's id, or its first characters (4 or more).")
    ],
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing until the job ends.")
    ] = False,
    store: StoreOption = None,
    server: ServerOption = None,
    token_file: TokenFileOption = None,
) -> None:
    """Print a job's output (stdout and stderr together)."""
    remote = _client(server, token_file)
    if remote is not None:
        for chunk in remote.logs(job_id, follow=follow):
            sys.stdout.write(chunk.decode(errors="replace"))
            sys.stdout.flush()
        return
    with _store(store) as s:
        job = s.get(job_id)  # the id, or a prefix that names one job
        shown = _show_log(job, 0)
        while follow and not job.finished:
            time.sleep(0.2)
            job = s.get(job.id)
            shown = _show_log(job, shown)


@app.command("cancel")
@user_errors
def cancel(
    job_id: Annotated[
        str, typer.Argument(help="The job's id, or its first characters (4 or more).")
    ],
    store: StoreOption = None,
    server: ServerOption = None,
    token_file: TokenFileOption = None,
    as_json: JsonOption = False,
) -> None:
    """Cancel a job: a queued one at once, a running one by stopping its processes."""
    remote = _client(server, token_file)
    if remote is not None:
        job = remote.cancel(job_id)
    else:
        with _store(store) as s:
            job = s.cancel(job_id)
    if as_json:
        emit_json(_row(job), indent=True)
        return
    if job.state == "cancelled":
        console.print(f"cancelled job {job.id}", highlight=False)
    elif job.finished:
        console.print(f"job {job.id} had already {job.state}", highlight=False)
    else:
        console.print(f"stopping job {job.id} ({job.state})", highlight=False)


@app.command("scheduler")
@user_errors
def scheduler(
    devices: DevicesOption = None,
    policy: Annotated[
        str | None,
        typer.Option(
            "--policy",
            help=f"Placement: {', '.join(POLICIES)} (default: best-fit).",
            show_default=False,
        ),
    ] = None,
    margin: Annotated[
        float | None,
        typer.Option(
            "--margin",
            min=0.0,
            help="Extra room per job, a share of its need (default: 0.1).",
            show_default=False,
        ),
    ] = None,
    max_concurrent: Annotated[
        int | None,
        typer.Option(
            "--max-concurrent", min=1, help="Jobs per device at most.", show_default=False
        ),
    ] = None,
    ray_address: Annotated[
        str | None,
        typer.Option(
            "--ray",
            metavar="ADDRESS",
            help="Run the jobs on a Ray cluster ('auto': this machine's), placed on "
            "the GPUs its nodes advertise (see vramctl ray).",
            show_default=False,
        ),
    ] = None,
    store: StoreOption = None,
) -> None:
    """Run the queue in the foreground until Ctrl-C: admit queued jobs by memory.

    Jobs keep running if the scheduler stops; a scheduler started later adopts
    them. Examples:

        vramctl scheduler --devices cuda:0,cuda:1
        vramctl scheduler --ray auto
    """
    from vramctl.jobs import EstimateWorker, RayRunner, Scheduler, connect, ray_devices

    runner: Runner | None = None
    placed_on = _devices(devices)
    if ray_address is not None:
        if devices is not None:
            raise VramctlError("--devices and --ray: the cluster's nodes say their GPUs")
        connect(ray_address)
        found = ray_devices()
        if not found:
            raise VramctlError(
                "the Ray cluster's nodes advertise no GPU memory: start each with "
                'ray start --resources "$(vramctl ray resources)"'
            )
        placed_on, runner = list(found), RayRunner(found)
    # Estimates that price jobs run in a worker process: a job's model (a module:factory
    # of its submitter's) is never imported into the scheduler.
    with _store(store) as s, _interrupted() as stop, EstimateWorker() as worker:
        settings = load_settings()
        sched = Scheduler(
            s,
            devices=placed_on,
            runner=runner,
            estimate_worker=worker,
            policy=policy if policy is not None else settings.policy,
            margin=margin if margin is not None else settings.margin,
            max_concurrent_jobs=(
                max_concurrent if max_concurrent is not None else settings.max_concurrent_jobs
            ),
        )
        names = ", ".join(d.id for d in sched.devices or [])
        err.print(f"scheduling the jobs of {s.path} on {names}", highlight=False)
        events = _Events(s, sched.margin)
        while not stop.is_set():
            sched.run_once()
            events.poll()
            stop.wait(sched.interval_s)


class _Events:
    """The foreground scheduler's log: a line per job event of the store, with its time:
    admitted (device, need, reservation), finished (exit status, duration), failed,
    cancelled, timed out, queued again, and why a queued job waits (once per job)."""

    def __init__(self, store: JobStore, margin: float) -> None:
        self.store = store
        self.margin = margin
        #: When the states were last read, less a second: a job whose admission is
        #: stamped after this (and was queued then) was admitted since.
        self.since = time.time() - 1.0
        self.seen = self._states()
        #: Queued jobs whose waiting reason is not told yet (read again each round).
        self.untold: set[str] = {i for i, (state, _) in self.seen.items() if state == "queued"}

    def _states(self) -> dict[str, tuple[str, int]]:
        """(state, attempts) of every queued, admitted or running job, by id."""
        return {
            row[0]: (state, row[1])
            for state in ("queued", "admitted", "running")
            for row in self.store.keys([state])
        }

    def poll(self) -> None:
        read_at = time.time()
        now = self._states()
        self.untold |= {i for i, (state, _) in now.items() if state == "queued"} - set(self.seen)
        # A job submitted since the last look was queued then, with no attempt made.
        before = {**dict.fromkeys(now, ("queued", 0)), **self.seen}
        changed = [i for i, was in before.items() if now.get(i) != was]
        for job in self.store.get_many(changed):
            was, tries = before[job.id]
            starts = job.attempts - tries  # a supervisor's start counts an attempt
            # Failed with retries left and queued again, maybe admitted again since.
            again = (was == "running" and (starts > 0 or job.state in ("queued", "admitted"))) or (
                was == "admitted" and (starts > 1 or (starts > 0 and job.state == "admitted"))
            )
            if again:
                why = f": {job.reason}" if job.reason and not job.finished else ""
                attempt = tries if was == "running" else tries + 1
                # An overrun's retries are its own (its reason says which one it was).
                overran = "queued again needing" in (job.reason or "")
                made = f"attempt {attempt}" + ("" if overran else f" of {job.spec.retries + 1}")
                self._say(time.time(), job, f"queued again after {made}{why}")
            if (was == "queued" or again) and (job.admitted_at or 0) >= self.since:
                self._admitted(job)
            if job.finished:
                self._finished(job)
        self.untold &= {i for i, (state, _) in now.items() if state == "queued"}
        for job in self.store.get_many(sorted(self.untold)):
            if job.state == "queued" and (job.reason or "").startswith("waiting"):
                self._say(time.time(), job, job.reason or "")
                self.untold.discard(job.id)
        self.seen, self.since = now, read_at - 1.0

    def _admitted(self, job: Job) -> None:
        reserved = job.reserved_bytes or 0
        need = f"needs {_size(round(reserved / (1 + self.margin)))}, " if reserved else ""
        self._say(
            job.admitted_at or time.time(),
            job,
            f"admitted on {job.device}: {need}{_size(reserved)} reserved with the margin",
        )

    def _finished(self, job: Job) -> None:
        begun = job.started_at or job.admitted_at
        took = (
            f" after {job.finished_at - begun:.1f} s"
            if begun is not None and job.finished_at is not None
            else ""
        )
        code = "" if job.exit_code is None else f" with exit code {job.exit_code}"
        peak = f", peak {_size(job.peak_bytes)}" if job.peak_bytes else ""
        why = f": {job.reason}" if job.reason and job.reason != job.state else ""
        verb = {"succeeded": "finished", "timed-out": "timed out"}.get(job.state, job.state)
        self._say(job.finished_at or time.time(), job, f"{verb}{code}{took}{peak}{why}")

    def _say(self, when: float, job: Job, what: str) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(when))
        err.print(f"{stamp} job {job.id} ({job.name}) {what}", highlight=False, soft_wrap=True)


@contextlib.contextmanager
def _interrupted(
    message: str = "scheduler stopped; running jobs go on",
) -> Iterator[threading.Event]:
    stop = threading.Event()
    try:
        yield stop
    except KeyboardInterrupt:
        err.print(message, highlight=False)
