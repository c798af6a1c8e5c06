"""``vramctl ray resources`` and ``vramctl ray agent``: a Ray node's side of the Ray backend."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from vramctl.cli._common import app, err, user_errors
from vramctl.cli._jobs import DevicesOption, _devices, _interrupted

__all__ = ["ray_app"]

ray_app = typer.Typer(
    help="Run the job queue on a Ray cluster: each node offers its GPUs' memory.",
    no_args_is_help=True,
)
app.add_typer(ray_app, name="ray")


@ray_app.command("resources")
@user_errors
def resources(devices: DevicesOption = None) -> None:
    """Print this node's GPU memory as Ray resources (JSON).

    One resource per GPU, vramctl_gpu<N>_mib, in MiB, for ray start:

        ray start --head --resources "$(vramctl ray resources)"
    """
    from vramctl.jobs import node_resources

    found = node_resources(_devices(devices))
    if not found:
        err.print("no GPU here: this node offers no GPU memory", highlight=False)
    print(json.dumps(found))


@ray_app.command("agent")
@user_errors
def agent(
    address: Annotated[
        str, typer.Option("--address", help="The Ray cluster ('auto': this machine's).")
    ] = "auto",
    interval: Annotated[
        float, typer.Option("--interval", min=0.1, help="Seconds between readings.")
    ] = 2.0,
    devices: DevicesOption = None,
) -> None:
    """Hold memory used outside vramctl out of Ray's figures.

    Run it on each node after ray start, until Ctrl-C: a placeholder per GPU
    holds, out of the GPU's resource, the memory other processes use there.
    """
    from vramctl.jobs import RayAgent, connect

    connect(address)
    running = RayAgent(_devices(devices), interval_s=interval)
    names = ", ".join(name for name in running.held)
    err.print(f"holding memory used outside vramctl out of {names}", highlight=False)
    with _interrupted("agent stopped; its placeholders are gone") as stop:
        running.run(stop)
