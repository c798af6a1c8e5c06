"""The job queue on a Ray cluster: placement by memory, and a cap inside each job.

Ray schedules GPUs as logical fractions and leaves a fraction's memory to the task. Here
each node advertises, per GPU, its memory as a custom resource in MiB (``vramctl_gpu0_mib``;
``vramctl_simgpu0_mib`` for a simulated GPU): :func:`node_resources` gives them for
``ray start --resources``. A :class:`RayAgent` on the node keeps them true to memory used
outside vramctl by holding that much with a placeholder actor. The scheduler places jobs
on :func:`ray_devices` (the cluster's GPUs, with what Ray has free of each), and a
:class:`RayRunner` runs an admitted job as a Ray task pinned to its node that requests its
reservation of its GPU's resource and runs the job's supervisor there, with the same cap
as a local job. Ray so never lets two jobs' reservations overlap, whoever submits them,
and the cap keeps each job inside its reservation. The jobs' states live in the store.

The task's worker can die without the job: the supervisor runs in a session of its own.
Ray runs the task again (``max_retries``); the new task takes the reservation again and
waits for the supervisor that is still running. A job whose supervisor died too is left
to the scheduler's adoption, which queues it again while its retries last.

Only this module imports ``ray`` (``pip install 'vramctl[ray]'``), and only when called.
"""

from __future__ import annotations

import contextlib
import math
import re
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from vramctl._na import NA
from vramctl._optional import require
from vramctl.device import Device, DeviceHealth, MemoryState, ProcessMemory, gpus
from vramctl.jobs._need import device_capacity
from vramctl.jobs._store import Job, JobStore

__all__ = [
    "RayAgent",
    "RayGpu",
    "RayRunner",
    "connect",
    "hold_job",
    "node_resources",
    "outside_vramctl",
    "ray_devices",
    "resource_name",
]

MiB = 2**20
_SUPERVISE = str(Path(__file__).resolve().parent / "_supervise.py")
_RESOURCE_RE = re.compile(r"^vramctl_(sim)?gpu(\d+)_mib$")


def _ray() -> Any:
    return require("ray", extra="ray", what="the Ray backend")


def connect(address: str = "auto") -> None:
    """Connect this process to the Ray cluster at ``address`` (``"auto"``: the one this
    machine runs; ``ray://HOST:10001`` through Ray Client), once."""
    from vramctl._errors import VramctlError

    ray = _ray()
    if ray.is_initialized():
        return
    try:
        ray.init(address=address, log_to_driver=False)
    except ConnectionError as exc:
        raise VramctlError(
            f"cannot reach a Ray cluster at {address!r} ({exc}); start one with "
            "'ray start --head --resources \"$(vramctl ray resources)\"'"
        ) from None


def resource_name(index: int, simulated: bool = False) -> str:
    """The custom resource of a node's GPU ``index``: ``vramctl_gpu0_mib`` (or
    ``vramctl_simgpu0_mib`` for a simulated GPU)."""
    return f"vramctl_{'sim' if simulated else ''}gpu{index}_mib"


def _indexed(devices: Sequence[Device]) -> list[tuple[str, Device]]:
    """Each GPU with its resource name: a CUDA device by its index, a simulated one by
    its place in ``devices``."""
    out = []
    for k, dev in enumerate(devices):
        index = dev.index if dev.is_cuda and dev.index is not None else k
        out.append((resource_name(index, dev.is_simulated), dev))
    return out


def node_resources(devices: Sequence[Device] | None = None) -> dict[str, float]:
    """The custom resources a node offers, one per GPU (its capacity in whole MiB), for
    ``ray start --resources`` or ``ray.init(resources=...)``.

    >>> import vramctl
    >>> node_resources([vramctl.simulate("T4-16GB")])
    {'vramctl_simgpu0_mib': 14929.0}
    """
    devices = list(gpus() if devices is None else devices)
    return {name: float(device_capacity(d) // MiB) for name, d in _indexed(devices)}


# -- the cluster's GPUs as devices ------------------------------------------------------------


class _Cluster:
    """What Ray has free of each node's resources, read at most every ``ttl_s``."""

    def __init__(self, ttl_s: float = 0.05) -> None:
        self.ttl_s = ttl_s
        self._read_at = -math.inf
        self._free: dict[str, dict[str, float]] = {}
        self._lock = threading.Lock()

    def available(self, node_id: str, resource: str) -> float:
        with self._lock:
            now = time.monotonic()
            if now - self._read_at > self.ttl_s:
                from ray._private import state  # no public per-node reading

                self._free = dict(state.available_resources_per_node())  # type: ignore[no-untyped-call]
                self._read_at = now
            return float(self._free.get(node_id, {}).get(resource, 0.0))


class RayGpu(Device):
    """A GPU of a Ray cluster's node, as the scheduler places jobs on it: its capacity is
    its resource's total, and what it has free is what Ray has free of that resource
    (less the reservations of jobs running there and of memory used outside vramctl)."""

    kind = "ray"

    def __init__(self, cluster: _Cluster, node_id: str, resource: str, total_mib: float) -> None:
        found = _RESOURCE_RE.match(resource)
        if found is None:
            raise ValueError(f"{resource!r} is not a vramctl GPU resource")
        self.simulated = found[1] is not None
        self.index = int(found[2])
        self.node_id = node_id
        self.resource = resource
        #: The device as the node names it: ``cuda:1``, or ``sim:gpu0`` for a simulated GPU.
        self.local = f"sim:gpu{self.index}" if self.simulated else f"cuda:{self.index}"
        self.id = f"{self.local}@{node_id[:8]}"
        self.name = "simulated GPU" if self.simulated else "GPU"
        self.health = DeviceHealth(self.id)
        self.total_bytes = int(total_mib) * MiB
        self._cluster = cluster

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cpu")  # a remote device: no tensors of this process go there

    @property
    def is_gpu(self) -> bool:
        return True

    def capacity(self) -> int:
        return self.total_bytes

    def available(self) -> int:
        return int(self._cluster.available(self.node_id, self.resource) * MiB)

    def memory(self) -> MemoryState:
        free = self.available()
        return MemoryState(
            device=self.id, total=self.total_bytes, used=self.total_bytes - free, free=free
        )

    def processes(self, limit: int | None = None) -> list[ProcessMemory]:
        return []

    def _peak_begin(self) -> Any:
        raise NotImplementedError(f"{self.id} is a remote device: measure peaks on its node")

    def _peak_end(self, token: Any) -> tuple[int, int, int]:
        raise NotImplementedError(f"{self.id} is a remote device: measure peaks on its node")

    def job_usage(self, jobs: Sequence[Job]) -> dict[str, int]:
        """What each of ``jobs`` already takes out of :meth:`available`: a running job's
        task holds its whole reservation of the resource; an admitted one not yet."""
        return {j.id: (j.reserved_bytes or 0) if j.state == "running" else 0 for j in jobs}

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "node_id": self.node_id, "resource": self.resource}


def ray_devices(ttl_s: float = 0.05) -> list[RayGpu]:
    """The GPUs the cluster's alive nodes advertise (see :func:`node_resources`), in node
    then index order. Call it in a process connected to the cluster (``ray.init``)."""
    ray = _ray()
    cluster = _Cluster(ttl_s)
    out: list[RayGpu] = []
    for node in sorted(ray.nodes(), key=lambda n: n["NodeID"]):
        if not node.get("Alive"):
            continue
        resources = node.get("Resources", {})
        names = sorted((r for r in resources if _RESOURCE_RE.match(r)), key=_resource_order)
        out += [RayGpu(cluster, node["NodeID"], r, resources[r]) for r in names]
    return out


def _resource_order(name: str) -> tuple[int, str]:
    found = _RESOURCE_RE.match(name)
    return (int(found[2]) if found else 0, name)


# -- running jobs -----------------------------------------------------------------------------


def hold_job(argv: list[str]) -> int:
    """The body of a job's Ray task, on its node, while the task holds the reservation:
    runs ``_supervise.py --hold STORE JOB_ID`` (in a session of its own, so that it
    outlives this worker), which supervises an admitted job or waits for the supervisor
    already running it. Only the standard library: it is sent to the workers by value,
    so they import neither vramctl nor PyTorch to run it."""
    import os
    import subprocess

    env = dict(os.environ)
    if env.get("CUDA_VISIBLE_DEVICES") == "":
        del env["CUDA_VISIBLE_DEVICES"]  # Ray's for a task with no num_gpus
    done = subprocess.run(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
        check=False,
    )
    return done.returncode


# Pickled by value (a function of ``__main__`` is): a worker runs it without importing
# this module, which would import vramctl and PyTorch (seconds in every new worker).
hold_job.__module__ = "__main__"

_TASK: list[Any] = []


def _task() -> Any:
    if not _TASK:
        _TASK.append(_ray().remote(hold_job))
    return _TASK[0]


class RayRunner:
    """Runs admitted jobs on a Ray cluster: one task per job, pinned to its GPU's node,
    requesting its reservation (whole MiB) of the GPU's resource. Pass it and
    :func:`ray_devices` to a :class:`~vramctl.jobs.Scheduler`."""

    def __init__(self, devices: Sequence[RayGpu], *, max_retries: int = 3) -> None:
        self._by_id = {d.id: d for d in devices}
        self.max_retries = max_retries
        self._refs: dict[str, Any] = {}

    def start(self, store: JobStore, job: Job) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        dev = self._by_id[job.device or ""]
        mib = max(1, math.ceil((job.reserved_bytes or 0) / MiB))
        self._refs[job.id] = (
            _task()
            .options(
                num_cpus=0,
                resources={dev.resource: mib},
                scheduling_strategy=NodeAffinitySchedulingStrategy(dev.node_id, soft=False),
                max_retries=self.max_retries,
                name=f"vramctl-job-{job.id}",
            )
            .remote([sys.executable, _SUPERVISE, "--hold", str(store.path), job.id])
        )

    def holds(self, job_id: str) -> bool:
        ref = self._refs.get(job_id)
        if ref is None:
            return False
        ready, _ = _ray().wait([ref], timeout=0)
        if not ready:
            return True
        del self._refs[job_id]
        with contextlib.suppress(Exception):  # a task that failed for good: adoption decides
            _ray().get(ref)
        return False


# -- the node agent ---------------------------------------------------------------------------


class _Holder:
    """A placeholder actor: it holds memory used outside vramctl out of Ray's resource."""

    def ping(self) -> bool:
        return True


def outside_vramctl(device: Device) -> int:
    """Memory of ``device`` in use by processes that are not vramctl jobs (the device's
    used memory less that of processes with ``VRAMCTL_JOB_ID`` in their environment); 0
    for a simulated GPU."""
    if device.is_simulated:
        return 0
    import psutil

    state = device.memory()
    if state.used is NA:
        return 0
    jobs = 0
    for proc in device.processes():
        if proc.used is NA:
            continue
        with contextlib.suppress(psutil.Error):
            if "VRAMCTL_JOB_ID" in psutil.Process(proc.pid).environ():
                jobs += int(proc.used)
    return max(0, int(state.used) - jobs)


class RayAgent:
    """Keeps a node's vramctl resources true to the memory used outside vramctl: per GPU,
    a placeholder actor pinned to the node requests that much of the GPU's resource, and
    is replaced when the figure moves by ``step_bytes`` or more.

    ``outside(device)`` reads the memory a GPU has in use outside vramctl's jobs (default
    :func:`outside_vramctl`). Run it on the node, connected to the cluster:
    ``vramctl ray agent`` does.
    """

    def __init__(
        self,
        devices: Sequence[Device] | None = None,
        *,
        outside: Callable[[Device], int] | None = None,
        interval_s: float = 2.0,
        step_bytes: int = 256 * MiB,
        node_id: str | None = None,
    ) -> None:
        ray = _ray()
        self.gpus = _indexed(list(gpus() if devices is None else devices))
        self.outside = outside or outside_vramctl
        self.interval_s = interval_s
        self.step_mib = max(1, step_bytes // MiB)
        self.node_id = node_id or ray.get_runtime_context().get_node_id()
        #: MiB held per resource by its placeholder (0: none).
        self.held: dict[str, int] = {name: 0 for name, _ in self.gpus}
        self._actors: dict[str, Any] = {}

    def update(self) -> dict[str, int]:
        """One reading: replace the placeholders whose figure moved; returns the MiB held
        per resource."""
        ray = _ray()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        for name, dev in self.gpus:
            try:
                want = math.ceil(max(0, int(self.outside(dev))) / MiB)
            except Exception:  # an unreadable device keeps its last figure
                continue
            have = self.held[name]
            if abs(want - have) < self.step_mib and not (want == 0 and have):
                continue
            old = self._actors.pop(name, None)
            if old is not None:
                ray.kill(old)
            if want > 0:
                holder = ray.remote(_Holder).options(
                    num_cpus=0,
                    resources={name: want},
                    scheduling_strategy=NodeAffinitySchedulingStrategy(self.node_id, soft=False),
                    name=f"vramctl-outside-{name}-{self.node_id[:8]}",
                )
                self._actors[name] = holder.remote()
            self.held[name] = want
        return dict(self.held)

    def run(self, stop: threading.Event | None = None) -> None:
        """Readings every ``interval_s`` until ``stop`` is set; the placeholders go at the end."""
        stop = stop or threading.Event()
        try:
            while not stop.is_set():
                self.update()
                stop.wait(self.interval_s)
        finally:
            self.close()

    def close(self) -> None:
        ray = _ray()
        for actor in self._actors.values():
            with contextlib.suppress(Exception):
                ray.kill(actor)
        self._actors.clear()
        self.held = dict.fromkeys(self.held, 0)
