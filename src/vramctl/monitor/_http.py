"""Addresses, tokens and ports for the monitor's HTTP endpoints (metrics, dashboard).

The rule: bind to 127.0.0.1 unless told otherwise, and require a token on any
other address.

>>> parse_address(":9400")
('127.0.0.1', 9400)
>>> parse_address("0.0.0.0:80")
('0.0.0.0', 80)
"""

from __future__ import annotations

import errno
import hmac
import ipaddress
import os
import socket

from vramctl._errors import VramctlError

__all__ = [
    "TOKEN_ENV",
    "AddressError",
    "check_bind",
    "host_allowed",
    "is_loopback",
    "parse_address",
    "token_ok",
]

#: The environment variable read for a token when none is given.
TOKEN_ENV = "VRAMCTL_TOKEN"


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


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, port: int, token: str | None) -> str | None:
    """Check that ``host:port`` may be served and is free; returns the token to require.

    A non-loopback host needs a token (``token``, else ``$VRAMCTL_TOKEN``). A port
    in use is a clear error, not a traceback from the server later.
    """
    token = token or os.environ.get(TOKEN_ENV) or None
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


def host_allowed(header: str | None, bound: str = "127.0.0.1") -> bool:
    """Whether a request's ``Host`` header names this machine's loopback (any port).

    A server on 127.0.0.1 without a token answers only requests addressed to
    ``localhost``, a loopback address or ``bound``: a web page that points a name
    of its own at 127.0.0.1 (DNS rebinding) cannot read it. No header (HTTP/1.0)
    is allowed.

    >>> host_allowed("localhost:8765"), host_allowed("[::1]:80"), host_allowed("evil.test:8765")
    (True, True, False)
    """
    if header is None:
        return True
    text = header.strip().lower()
    if text.startswith("["):
        name, sep, rest = text[1:].partition("]")
        if not sep or (rest and not (rest[:1] == ":" and rest[1:].isdigit())):
            return False
    else:
        name, sep, port = text.rpartition(":")
        if not sep:
            name = port
        elif not port.isdigit():
            return False
    return name == "localhost" or name == bound.lower() or is_loopback(name)


def token_ok(expected: str | None, header: str | None, query: str | None = None) -> bool:
    """True when no token is required, or ``Authorization: Bearer TOKEN`` / ``?token=`` match."""
    if not expected:
        return True
    given = None
    if header and header.lower().startswith("bearer "):
        given = header[7:].strip()
    elif query:
        given = query
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())
