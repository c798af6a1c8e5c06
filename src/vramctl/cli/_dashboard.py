"""``vramctl dashboard``: the web dashboard, live memory charts in a browser."""

from __future__ import annotations

import threading
import webbrowser
from typing import Annotated

import typer

from vramctl import format_bytes
from vramctl._optional import EXTRAS, require
from vramctl.cli._common import app, check_seconds, console, err, user_errors

__all__ = ["dashboard_cmd"]


def _need_server() -> None:
    require(EXTRAS["server"], extra="server", what="the dashboard")


def _wait_for_interrupt() -> None:
    """Block until Ctrl-C (a wait that the signal can interrupt)."""
    forever = threading.Event()
    while not forever.wait(3600):
        pass


@app.command("dashboard")
@user_errors
def dashboard_cmd(
    host: Annotated[
        str,
        typer.Option(
            help="Address to listen on. Any address other than 127.0.0.1 (or localhost, ::1) "
            "makes the page reachable from other machines and needs --token."
        ),
    ] = "127.0.0.1",
    port: Annotated[
        int, typer.Option(min=0, max=65535, help="Port to listen on (0 picks a free one).")
    ] = 8765,
    interval: Annotated[
        float, typer.Option("--interval", "-i", help="Seconds between samples.")
    ] = 1.0,
    device: Annotated[
        list[str] | None,
        typer.Option(
            "--device",
            "-d",
            help="Show this device (repeatable): 0, cuda:1, cpu, a UUID, sim:NAME (a "
            "simulated GPU: its capacity, and nothing in use, as nothing runs on it). "
            "Default: every device.",
        ),
    ] = None,
    token: Annotated[
        str | None,
        typer.Option(
            envvar="VRAMCTL_TOKEN",
            help="Token every request must carry (as ?token= or 'Authorization: Bearer'). "
            "Needed on any address other than 127.0.0.1.",
        ),
    ] = None,
    open_browser: Annotated[
        bool, typer.Option("--open/--no-open", help="Open the page in a web browser.")
    ] = False,
) -> None:
    """Serve a web page with live memory charts per device, alerts and processes.

    The page charts each device's memory over time (in use, this process,
    PyTorch allocated and reserved, capacity), lists the processes on each
    device, the alerts as they fire (with what to do about them), and what
    vramctl did (OOMs the guard recovered, leaks). It updates live from the
    server and needs no internet access: its chart library is bundled.

    It serves /metrics for Prometheus too. Runs until Ctrl-C (or SIGTERM).

    Examples:

      vramctl dashboard                                  # http://127.0.0.1:8765/

      vramctl dashboard -d sim:T4-16GB -d cpu -i 0.5 --open

      vramctl dashboard --host 0.0.0.0 --token "$(openssl rand -hex 16)"
    """
    check_seconds("--interval", interval, "0.5")
    _need_server()
    from vramctl.monitor import Monitor
    from vramctl.server import serve_dashboard

    mon = Monitor(device or None, interval)
    server = serve_dashboard(mon, host, port, token=token)
    try:
        console.print(f"vramctl dashboard: [bold]{server.page_url}[/]", highlight=False)
        devices = ", ".join(d.id for d in mon.devices)
        err.print(
            f"[dim]showing {devices}, sampled every {interval:g} s; press Ctrl-C to stop[/]",
            highlight=False,
        )
        for dev in mon.devices:
            if dev.is_simulated:
                err.print(
                    f"[dim]{dev.id} is a simulated GPU: nothing runs on it in this process, "
                    f"so it shows 0 B in use of its {format_bytes(dev.capacity())}[/]",
                    highlight=False,
                )
        if open_browser:
            webbrowser.open(server.page_url)
        _wait_for_interrupt()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
        mon.stop()
