"""The web dashboard: live memory charts, alerts and processes, served by FastAPI.

Needs FastAPI, uvicorn and prometheus-client (``pip install 'vramctl[server]'``).
:func:`serve_dashboard` serves it on 127.0.0.1 by default; any other address
needs a token. See ``docs/dashboard.md``.
"""

from __future__ import annotations

from importlib.util import find_spec

_missing = [m for m in ("fastapi", "uvicorn", "prometheus_client") if find_spec(m) is None]
if _missing:
    raise ModuleNotFoundError(
        f"the vramctl dashboard needs {', '.join(_missing)}: pip install 'vramctl[server]'",
        name=_missing[0],
    )

from vramctl.server._dashboard import (  # noqa: E402
    DashboardServer,
    create_app,
    dashboard_router,
    serve_dashboard,
)

__all__ = ["DashboardServer", "create_app", "dashboard_router", "serve_dashboard"]
