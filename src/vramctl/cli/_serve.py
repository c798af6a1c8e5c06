"""``vramctl serve``: the job service (the queue over HTTP, its scheduler, the dashboard)."""

from __future__ import annotations

import webbrowser
from pathlib import Path
from typing import Annotated

import typer

from vramctl.cli._common import app, check_seconds, console, err, user_errors
from vramctl.cli._dashboard import _need_server, _wait_for_interrupt
from vramctl.cli._jobs import DevicesOption, StoreOption, _devices

__all__ = ["serve_cmd"]


@app.command("serve")
@user_errors
def serve_cmd(
    host: Annotated[
        str,
        typer.Option(
            help="Address to listen on. On any address other than 127.0.0.1 (or "
            "localhost, ::1) every route needs the token.",
        ),
    ] = "127.0.0.1",
    port: Annotated[
        int, typer.Option(min=0, max=65535, help="Port to listen on (0 picks a free one).")
    ] = 8765,
    devices: DevicesOption = None,
    store: StoreOption = None,
    token_file: Annotated[
        Path | None,
        typer.Option(
            "--token-file",
            help="Read the token from this file (default: $VRAMCTL_TOKEN, else "
            "$VRAMCTL_HOME/token, made on first start).",
            show_default=False,
        ),
    ] = None,
    interval: Annotated[
        float, typer.Option("--interval", "-i", help="Seconds between memory samples.")
    ] = 1.0,
    open_browser: Annotated[
        bool, typer.Option("--open/--no-open", help="Open the dashboard in a browser.")
    ] = False,
    request_timeout: Annotated[
        float,
        typer.Option(
            "--request-timeout",
            help="Seconds a client has to send a whole request; a slower or half-sent "
            "one is closed.",
        ),
    ] = 30.0,
) -> None:
    """Serve the job queue over HTTP, run its scheduler, and show the dashboard.

    Jobs come in as JSON (POST /jobs), run under their supervisors and are
    admitted by memory as with 'vramctl scheduler'. Submitting, cancelling and
    reading logs need the token, on loopback too; the CLI and curl read it from
    $VRAMCTL_HOME/token. The API is described at /openapi.json. Runs until
    Ctrl-C; running jobs go on and a later service adopts them. Examples:

      vramctl serve                                   # http://127.0.0.1:8765/

      vramctl serve --devices sim:T4-16GB,sim:A10G-24GB

      curl -H "Authorization: Bearer $(cat ~/.local/share/vramctl/token)" \\
           -d '{"name": "hi", "command": ["echo", "hi"], "memory": "1GiB"}' \\
           http://127.0.0.1:8765/jobs
    """
    check_seconds("--interval", interval, "0.5")
    check_seconds("--request-timeout", request_timeout, "30")
    _need_server()
    from vramctl.server import serve_jobs

    server = serve_jobs(
        host,
        port,
        store=store,
        devices=_devices(devices),
        token_file=token_file,
        interval=interval,
        request_timeout=request_timeout,
    )
    try:
        console.print(f"vramctl serve: [bold]{server.url}[/]", highlight=False)
        names = ", ".join(d.id for d in server.service.devices)
        err.print(
            f"[dim]jobs of {server.service.path} on {names}; the API at "
            f"{server.url}openapi.json; press Ctrl-C to stop[/]",
            highlight=False,
        )
        if open_browser:
            webbrowser.open(server.dashboard.page_url)
        _wait_for_interrupt()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
