"""The web dashboard: live memory charts, alerts and processes, served by FastAPI.

Needs FastAPI, uvicorn and prometheus-client (``pip install 'vramctl[server]'``).
:func:`serve_dashboard` serves it on 127.0.0.1 by default; any other address
needs a token. See ``docs/dashboard.md``.
"""

from __future__ import annotations

from vramctl import _optional

_optional.require(_optional.EXTRAS["server"], extra="server", what="the vramctl dashboard")

from vramctl.server._dashboard import (  # noqa: E402
    DashboardServer,
    create_app,
    dashboard_router,
    serve_dashboard,
)
from vramctl.server._jobs import ApiError, JobService, jobs_router, service_token  # noqa: E402
from vramctl.server._service import JobServer, serve_jobs  # noqa: E402

__all__ = [
    "ApiError",
    "DashboardServer",
    "JobServer",
    "JobService",
    "create_app",
    "dashboard_router",
    "jobs_router",
    "serve_dashboard",
    "serve_jobs",
    "service_token",
]
