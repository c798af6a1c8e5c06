"""The image, built and run: the ``Dockerfile`` on a Debian base with podman and runc.

The NVIDIA CUDA base image cannot be fetched everywhere, so the build takes a Debian base
(``--build-arg BASE=...``) made here with ``debootstrap --variant=minbase bookworm`` and
brought in with ``podman import`` (kept between runs), and the CPU build of PyTorch from a
folder of wheels that this environment's pip downloads (``PIP_FIND_LINKS``, ``PIP_NO_INDEX``).
Everything else is the image users build: its user, its volume, its command, its health
check. The container runs ``vramctl serve`` on its volume with the token the service made
there, takes a job with that token, and still has the job after a restart.

Without a container engine that can run (podman with runc, as root for debootstrap) the
tests are skipped, unless ``VRAMCTL_REQUIRE_CONTAINER=1`` (set in CI) makes that a failure.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BASE = "localhost/vramctl-test-base:bookworm"
#: This run's image (a tag of its own: two runs at once do not remove each other's).
IMAGE = f"localhost/vramctl-test:{secrets.token_hex(4)}"
REQUIRED = os.environ.get("VRAMCTL_REQUIRE_CONTAINER") == "1"

pytestmark = [pytest.mark.container, pytest.mark.timeout(1500)]


def _cannot(why: str) -> None:
    if REQUIRED:
        pytest.fail(f"VRAMCTL_REQUIRE_CONTAINER=1 but {why}")
    pytest.skip(why)


#: podman's settings for these tests: no default ulimits (raising them fails in an
#: unprivileged or nested container with "setrlimit ... Operation not permitted").
CONF = "[containers]\ndefault_ulimits = []\n"


def _environment() -> dict[str, str]:
    if os.environ.get("CONTAINERS_CONF"):
        return dict(os.environ)  # the caller's own settings
    conf = Path(tempfile.gettempdir()) / f"vramctl-test-containers-{os.getuid()}.conf"
    if not conf.exists() or conf.read_text() != CONF:
        conf.write_text(CONF)
    return {**os.environ, "CONTAINERS_CONF": str(conf)}


def podman(
    *args: str, timeout: float = 120, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """``podman --runtime runc ARGS`` (crun refuses some kernels' hybrid cgroups)."""
    done = subprocess.run(
        ["podman", "--runtime", "runc", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=_environment(),
    )
    if check and done.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} failed ({done.returncode}):\n{done.stderr}")
    return done


def _base(work: Path) -> None:
    """The Debian base image, made once with debootstrap and kept in podman's store."""
    if podman("image", "exists", BASE, check=False).returncode == 0:
        return
    if shutil.which("debootstrap") is None or os.geteuid() != 0:
        _cannot("no Debian base image, and debootstrap (as root) is not there to make one")
    rootfs = work / "rootfs"
    _needed(["debootstrap", "--variant=minbase", "bookworm", str(rootfs)], "make a Debian base")
    archive = work / "rootfs.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(rootfs, arcname=".")
    podman("import", str(archive), BASE, timeout=600)
    shutil.rmtree(rootfs, ignore_errors=True)
    archive.unlink()


def _wheels(folder: Path) -> None:
    """The image's Python packages, downloaded by this environment's pip: the PyTorch build
    installed here (the CPU one where this runs without a GPU), and what ``vramctl[cli,server]``
    and its build need."""
    version = torch.__version__.split("+")[0]
    pip = [sys.executable, "-m", "pip", "download", "-q", "-d", str(folder)]
    wanted = [f"{ROOT}[cli,server]", f"torch=={version}", "setuptools>=69", "wheel"]
    _needed([*pip, *wanted], "download the image's packages")


def _needed(argv: list[str], what: str) -> None:
    """Run ``argv``, a step the image needs; where it fails the engine cannot be used here."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=False)
    if done.returncode != 0:
        _cannot(f"{argv[0]} could not {what}: {done.stderr.strip()[-500:]}")


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if shutil.which("podman") is None:
        _cannot("no container engine: podman is not installed (apt-get install podman runc)")
    info = podman("info", check=False, timeout=60)
    if info.returncode != 0:
        _cannot(f"podman cannot run here: {info.stderr.strip().splitlines()[-1:]}")
    work = tmp_path_factory.mktemp("image")
    _base(work)
    wheels = work / "wheels"
    _wheels(wheels)
    podman(
        "build",
        "--format",
        "docker",  # keeps the HEALTHCHECK (the OCI format has none)
        "--network=host",
        "-v",
        f"{wheels}:/wheels:ro",
        "--build-arg",
        f"BASE={BASE}",
        "--build-arg",
        "PIP_FIND_LINKS=/wheels",
        "--build-arg",
        "PIP_NO_INDEX=1",
        "-t",
        IMAGE,
        str(ROOT),
        timeout=1200,
    )
    shutil.rmtree(wheels, ignore_errors=True)
    try:
        yield IMAGE
    finally:
        podman("rmi", "-f", IMAGE, check=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _call(url: str, token: str | None, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")
    request.add_header("Content-Type", "application/json")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def _up(url: str, name: str, token: str | None, timeout: float = 120) -> None:
    """Wait for ``/health`` to answer (any status: the token may be missing)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            _call(f"{url}health", token)
            return
        except OSError:
            time.sleep(0.5)
    logs = podman("logs", name, check=False).stdout
    raise AssertionError(f"the container's service never answered:\n{logs[-2000:]}")


def test_the_image_serves_jobs_on_its_volume_with_its_token_across_a_restart(
    image: str,
) -> None:
    name = f"vramctl-test-{secrets.token_hex(4)}"
    volume = f"{name}-data"
    port = _free_port()
    url = f"http://127.0.0.1:{port}/"
    podman("volume", "create", volume)
    try:
        # As compose.yaml runs it: an init as PID 1, the port on loopback, the named volume,
        # the image's own command (vramctl serve on 0.0.0.0:8765), no token given.
        podman(
            "run",
            "-d",
            "--init",
            "--name",
            name,
            "-p",
            f"127.0.0.1:{port}:8765",
            "-v",
            f"{volume}:/data",
            image,
        )
        _up(url, name, None)
        # On 0.0.0.0 every route needs the token, which the service wrote to its volume.
        assert _call(f"{url}health", None)[0] == 401
        token = podman("exec", name, "cat", "/data/token").stdout.strip()
        assert len(token) >= 32
        status, health = _call(f"{url}health", token)
        assert (status, health["status"]) == (200, "ok"), health
        # It runs as its own user, not root, and the image's health check passes.
        assert podman("exec", name, "id", "-u").stdout.strip() == "10001"
        assert podman("healthcheck", "run", name, check=False).returncode == 0

        spec = {"name": "hello", "command": ["python", "-c", "print(6 * 7)"], "memory": "64MiB"}
        assert _call(f"{url}jobs", None, spec)[0] == 401  # nothing is taken without it
        status, job = _call(f"{url}jobs", token, spec)
        assert status in (200, 201), job
        deadline = time.monotonic() + 120
        while job["state"] not in ("succeeded", "failed") and time.monotonic() < deadline:
            time.sleep(0.5)
            job = _call(f"{url}jobs/{job['id']}", token)[1]
        assert job["state"] == "succeeded", job
        assert job["device"] == "cpu"  # no GPU here: the CPU, as on any machine without one

        # A job still running when the container stops ends with it: its supervisor and its
        # processes are gone, and the next service, whose processes are numbered from 1
        # again, must not take one of them for the job's.
        long = {**spec, "name": "long", "command": ["python", "-c", "import time; time.sleep(600)"]}
        status, running = _call(f"{url}jobs", token, long)
        assert status in (200, 201), running
        deadline = time.monotonic() + 60
        while running["state"] != "running" and time.monotonic() < deadline:
            time.sleep(0.2)
            running = _call(f"{url}jobs/{running['id']}", token)[1]
        assert running["state"] == "running" and running["pid_started"] is not None, running

        podman("restart", name, timeout=120)
        _up(url, name, token)
        deadline = time.monotonic() + 60
        while running["state"] == "running" and time.monotonic() < deadline:
            time.sleep(0.5)
            running = _call(f"{url}jobs/{running['id']}", token)[1]
        assert running["state"] == "failed", running
        assert "exit status is unknown" in (running["reason"] or ""), running
        # The same token (kept on the volume) and the same job, as it ended.
        status, again = _call(f"{url}jobs/{job['id']}", token)
        assert status == 200, again
        assert (again["state"], again["submitted_at"]) == ("succeeded", job["submitted_at"])
        assert again["finished_at"] == job["finished_at"]
        listed = _call(f"{url}jobs", token)[1]
        assert [j["id"] for j in listed["jobs"]] == [job["id"], running["id"]]
    finally:
        podman("rm", "-f", name, check=False)
        podman("volume", "rm", "-f", volume, check=False)
