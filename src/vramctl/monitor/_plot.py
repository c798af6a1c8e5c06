"""Plots of a history: one self-contained HTML page (vendored uPlot), or a PNG (matplotlib)."""

from __future__ import annotations

import html
import json
from importlib import resources
from pathlib import Path
from typing import Any

from vramctl._optional import require
from vramctl.monitor._history import ExportError, History

__all__ = ["plot", "static_file"]

#: Series drawn per device, in bytes.
SERIES = (
    ("used", "used (device)"),
    ("process_used", "this process"),
    ("allocated", "allocated (PyTorch)"),
    ("reserved", "reserved (PyTorch)"),
)


def static_file(name: str) -> str:
    """The text of a vendored front-end file (``uPlot.iife.min.js``, ``uPlot.min.css``)."""
    return resources.files("vramctl.monitor").joinpath("static").joinpath(name).read_text("utf-8")


def _device_data(history: History, device: str) -> dict[str, Any]:
    cols = history.columns(device, [name for name, _ in SERIES] + ["total"])
    series = [
        {"label": label, "values": cols[name]}
        for name, label in SERIES
        if any(v is not None for v in cols[name])
    ]
    total = next((v for v in reversed(cols["total"]) if v is not None), None)
    return {"device": device, "x": cols["t"], "series": series, "total": total}


_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>{css}
body{{font-family:system-ui,sans-serif;margin:1.5rem;color:#222}}
h2{{font-size:1.05rem;margin:1.2rem 0 .3rem}}</style>
<script>{js}</script></head>
<body><h1>{title}</h1><div id="plots"></div>
<script>
const DATA = {data};
const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"];
const mib = (u, v) => v == null ? "" : (v / 1048576).toFixed(0) + " MiB";
for (const d of DATA) {{
  const box = document.createElement("div");
  const h = document.createElement("h2");
  h.textContent = d.device + (d.total ? " (" + mib(null, d.total) + ")" : "");
  box.appendChild(h);
  document.getElementById("plots").appendChild(box);
  const opts = {{
    width: Math.min(1100, window.innerWidth - 40), height: 260,
    series: [{{}}].concat(d.series.map((s, i) => ({{label: s.label, stroke: COLORS[i % 4],
      value: mib}}))),
    axes: [{{}}, {{values: (u, vals) => vals.map(v => mib(u, v)), size: 80}}],
  }};
  new uPlot(opts, [d.x].concat(d.series.map(s => s.values)), box);
}}
</script></body></html>
"""


def _html(history: History, title: str) -> str:
    data = [_device_data(history, d) for d in history.devices]
    return _PAGE.format(
        title=html.escape(title),
        css=static_file("uPlot.min.css"),
        js=static_file("uPlot.iife.min.js"),
        data=json.dumps(data).replace("</", "<\\/"),
    )


def _png(history: History, target: Path, title: str) -> None:
    matplotlib = require(
        "matplotlib",
        extra="plot",
        what="a PNG plot",
        hint="(or export .html, which needs nothing)",
        error=ExportError,
    )

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    devices = history.devices
    fig, axes = plt.subplots(
        max(1, len(devices)), 1, figsize=(10, 3 * max(1, len(devices))), squeeze=False
    )
    t0 = min((s.timestamp for s in history), default=0.0)
    for ax, device in zip(axes[:, 0], devices, strict=False):
        d = _device_data(history, device)
        xs = [x - t0 for x in d["x"]]
        for s in d["series"]:
            ax.plot(xs, [None if v is None else v / 2**20 for v in s["values"]], label=s["label"])
        if d["total"]:
            ax.axhline(d["total"] / 2**20, color="grey", linestyle="--", label="capacity")
        ax.set_title(device)
        ax.set_ylabel("MiB")
        ax.legend(loc="upper left", fontsize="small")
    axes[-1, 0].set_xlabel("seconds")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(target)
    plt.close(fig)


def plot(history: History, path: str | Path, *, title: str = "vramctl memory history") -> Path:
    """Plot every device's memory over time: ``.html`` (self-contained) or ``.png``."""
    target = Path(path)
    suffix = target.suffix.lower()
    if suffix not in (".html", ".htm", ".png"):
        raise ExportError(f"cannot plot to {str(target)!r}: use a .html or .png file name")
    try:
        if suffix == ".png":
            _png(history, target, title)
        else:
            target.write_text(_html(history, title), encoding="utf-8")
    except OSError as exc:
        raise ExportError(
            f"cannot write the plot to {str(target)!r}: {exc.strerror or exc}; "
            "choose a path in a writable directory"
        ) from exc
    return target
