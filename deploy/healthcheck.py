"""The container's health check: ``GET /health`` of the job service, with its token.

Exits 0 when the service answers ``{"status": "ok"}``, 1 otherwise (and prints why, which
``docker inspect`` shows). The token is ``$VRAMCTL_TOKEN``, else the file
``$VRAMCTL_HOME/token`` that ``vramctl serve`` writes on first start: a service bound to
0.0.0.0 asks for it on every route. Standard library only, so that a check every 30 s
does not import PyTorch.

    python healthcheck.py [URL]        # default: http://127.0.0.1:8765/health
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

URL = "http://127.0.0.1:8765/health"


def token() -> str | None:
    """``$VRAMCTL_TOKEN``, else the contents of ``$VRAMCTL_HOME/token``, else None."""
    if os.environ.get("VRAMCTL_TOKEN"):
        return os.environ["VRAMCTL_TOKEN"]
    home = os.environ.get("VRAMCTL_HOME")
    if not home:
        return None
    try:
        return (Path(home) / "token").read_text().strip() or None
    except OSError:
        return None


def main(argv: list[str]) -> int:
    url = argv[1] if len(argv) > 1 else URL
    request = urllib.request.Request(url)
    secret = token()
    if secret:
        request.add_header("Authorization", f"Bearer {secret}")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            body = json.load(response)
    except urllib.error.HTTPError as exc:
        print(f"unhealthy: HTTP {exc.code}: {exc.read(2000).decode(errors='replace')}")
        return 1
    except (OSError, ValueError) as exc:
        print(f"unhealthy: {exc}")
        return 1
    status = body.get("status") if isinstance(body, dict) else None
    print(status)
    return 0 if status == "ok" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
