"""Addresses and ports for the monitor's HTTP endpoints (metrics, dashboard); their tokens
are :mod:`vramctl._auth`'s.

The rule: bind to 127.0.0.1 unless told otherwise, and require a token on any
other address.

>>> parse_address(":9400")
('127.0.0.1', 9400)
>>> parse_address("0.0.0.0:80")
('0.0.0.0', 80)
"""

from __future__ import annotations

import errno
import os
import socket

from vramctl._auth import TOKEN_ENV, find_token, is_loopback
from vramctl._errors import VramctlError

__all__ = ["AddressError", "check_bind", "parse_address"]


class AddressError(VramctlError, ValueError):
    """An address to serve on is malformed, taken, or needs a token."""


def parse_address(text: str | int, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """``"PORT"``, ``":PORT"``, ``"HOST:PORT"`` or ``"[V6]:PORT"`` to ``(host, port)``."""
    raw = str(text).strip()
    host, sep, port_text = raw.rpartition(":")
    if not sep:
        host, port_text = "", raw
    host = host.strip("[]") or default_host
    try:
        port = int(port_text)
    except ValueError:
        raise AddressError(
            f"{raw!r} is not an address: write PORT, :PORT or HOST:PORT (e.g. :9400)"
        ) from None
    if not 0 <= port <= 65535:
        raise AddressError(f"port {port} is out of range: use 1-65535 (0 picks a free one)")
    return host, port


def check_bind(host: str, port: int, token: str | None) -> str | None:
    """Check that ``host:port`` may be served and is free; returns the token to require.

    A non-loopback host needs a token (``token``, else ``$VRAMCTL_TOKEN``). A port
    in use is a clear error, not a traceback from the server later.
    """
    token = find_token(token)
    if not is_loopback(host) and not token:
        raise AddressError(
            f"serving on {host} makes the endpoint reachable from other machines: give a "
            f"token (--token, or the {TOKEN_ENV} environment variable), or bind to 127.0.0.1"
        )
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        if os.name == "posix":
            # As the servers themselves bind: a port whose last connections are in TIME_WAIT
            # (a server just stopped) is free, while one that something listens on is not.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise AddressError(
                    f"port {port} on {host} is already in use: choose another port "
                    f"(e.g. {port + 1}), or stop what holds it"
                ) from None
            raise AddressError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return token
