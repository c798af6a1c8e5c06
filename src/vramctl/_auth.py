"""Tokens and who may ask: the one home of the HTTP servers' authentication.

The monitor's metrics endpoint, the dashboard and the job service check requests with
:func:`token_ok` and :func:`host_allowed`; the job service, its client and the CLI find the
service's token with :func:`find_token`.

>>> token_ok("s3cret", "Bearer s3cret"), token_ok("s3cret", None), token_ok(None, None)
(True, False, True)
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import os
import secrets
from pathlib import Path

from vramctl._errors import VramctlError

__all__ = ["TOKEN_ENV", "TOKEN_FILE", "find_token", "host_allowed", "is_loopback", "token_ok"]

#: The environment variable read for a token when none is given.
TOKEN_ENV = "VRAMCTL_TOKEN"
#: The job service's token file, under ``$VRAMCTL_HOME``.
TOKEN_FILE = "token"


def find_token(
    token: str | None = None,
    *,
    token_file: str | os.PathLike[str] | None = None,
    home: str | os.PathLike[str] | None = None,
    create: bool = False,
) -> str | None:
    """The token to use: ``token``, else ``$VRAMCTL_TOKEN``, else the file ``token_file``,
    else ``home/token`` (no file without ``home``); None when there is none.

    A ``token_file`` that cannot be read is an error. ``create`` is the service's own token:
    ``home/token`` is made (random, mode 0600) when it does not exist yet, and an empty file
    is an error; without it a missing or empty ``home/token`` is no token.
    """
    if token:
        return token
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV]
    if token_file is None and home is None:
        return None
    path = Path(token_file) if token_file is not None else Path(home or ".") / TOKEN_FILE
    if create and token_file is None and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):  # another process made it first
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(32) + "\n")
    try:
        text = path.read_text().strip()
    except OSError as exc:
        if token_file is None and not create:
            return None  # read-only routes on loopback need none
        raise VramctlError(f"cannot read the service token {path}: {exc.strerror}") from None
    if not text and create:
        raise VramctlError(f"the service token file {path} is empty")
    return text or None


def is_loopback(host: str) -> bool:
    """Whether ``host`` is ``localhost`` or a loopback address."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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
