"""How the node's traffic proxy reaches a sandbox's ports: E2B's
`network.maskRequestHost` and `network.httpsPorts`, sans-IO.

`maskRequestHost` is the `Host` header a request forwarded into the sandbox
carries instead of the sandbox's address, with `${PORT}` replaced by the port
it goes to (`"${PORT}-myapp.example.com"` makes port 3000 see
`Host: 3000-myapp.example.com`). `httpsPorts` lists the sandbox ports whose
service speaks TLS itself: the proxy still terminates the client's
connection, then opens TLS to the port without verifying its certificate
(self-signed ones work, as E2B documents). envd's port cannot be listed.
"""

from __future__ import annotations

import re
from typing import Final

ENVD_PORT: Final = 49983
PORT_VARIABLE: Final = "${PORT}"
MAX_HTTPS_PORTS: Final = 64
# a host, optionally with a port, once `${PORT}` is replaced: what a Host header may hold
_HOST_RE: Final = re.compile(r"^[A-Za-z0-9_.\-\[\]:]{1,255}$")


class IngressError(ValueError):
    """A `maskRequestHost` or `httpsPorts` the node refuses (a 400)."""


def parse_mask(raw: object) -> str | None:
    """`maskRequestHost`: None when not given; refused when it could not be a Host header."""
    if raw is None:
        return None
    if not isinstance(raw, str) or not raw:
        raise IngressError("network.maskRequestHost must be a non-empty string")
    if not _HOST_RE.match(raw.replace(PORT_VARIABLE, "65535")):
        raise IngressError(
            "network.maskRequestHost must be a host name (with an optional :port), "
            "where ${PORT} stands for the sandbox port"
        )
    return raw


def parse_https_ports(raw: object) -> tuple[int, ...]:
    """`httpsPorts`: sorted, without duplicates; envd's port is refused."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise IngressError("network.httpsPorts must be a list of ports")
    if len(raw) > MAX_HTTPS_PORTS:
        raise IngressError(f"network.httpsPorts has more than {MAX_HTTPS_PORTS} entries")
    ports: set[int] = set()
    for p in raw:
        if isinstance(p, bool) or not isinstance(p, int) or not 1 <= p <= 65535:
            raise IngressError(f"network.httpsPorts: {p!r} is not a port (1-65535)")
        if p == ENVD_PORT:
            raise IngressError(f"network.httpsPorts cannot list envd's port {ENVD_PORT}")
        ports.add(p)
    return tuple(sorted(ports))


def request_host(mask: str | None, port: int) -> str | None:
    """The Host header a request to `port` carries into the sandbox (None: its address)."""
    return None if mask is None else mask.replace(PORT_VARIABLE, str(port))
