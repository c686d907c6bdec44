"""Which sandbox and port a data-plane request is for.

The SDKs address sandbox traffic two ways: headers (`E2b-Sandbox-Id`,
`E2b-Sandbox-Port`, used when `E2B_SANDBOX_URL` is set) and hosts
(`{port}-{sandboxID}.{domain}`). `route()` looks at a request's headers and
Host and returns a `Route` or None (a control-plane request). Malformed
routing input raises `RoutingError`, which the proxy answers with 400; so
does a Host no server could have (`check_host`), which every request passes
through first.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from aenv.proto.ids import is_sandbox_id

# the Host a client sends names the node's port when it is not the scheme's
# default (`https://8080-id.domain:8443/`): the route ignores it
_HOST_RE = re.compile(
    r"^(?P<port>[0-9]{1,5})-(?P<sid>[a-z0-9]{1,64})\.(?P<rest>[^:]+)(?::[0-9]{1,5})?$"
)


# RFC 1035's bounds on a name (a port may follow the host)
MAX_HOST = 253 + len(":65535")
MAX_LABEL = 63


class RoutingError(ValueError):
    pass


def check_host(host: str) -> None:
    """Refuse a Host header no server could have (RoutingError): longer than
    a DNS name, a label longer than 63 or empty, or not ASCII-encodable."""
    if len(host) > MAX_HOST:
        raise RoutingError(f"Host header longer than {MAX_HOST} characters")
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    if name.startswith("["):  # an IPv6 literal
        return
    try:
        name.encode("idna")
    except UnicodeError:
        raise RoutingError("malformed Host header") from None
    if any(len(label) > MAX_LABEL for label in name.split(".")):
        raise RoutingError(f"Host header label longer than {MAX_LABEL} characters")


@dataclass(frozen=True)
class Route:
    sandbox_id: str
    port: int


def _port(value: str) -> int:
    if not value.isascii() or not value.isdigit() or len(value) > 5:
        raise RoutingError(f"invalid sandbox port {value!r}")
    port = int(value)
    if not 1 <= port <= 65535:
        raise RoutingError(f"sandbox port {port} out of range")
    return port


def _sandbox(value: str) -> str:
    if not is_sandbox_id(value):
        raise RoutingError(f"invalid sandbox ID {value!r}")
    return value


def route(headers: Mapping[str, str], domain: str | None) -> Route | None:
    """`headers` keys must be lowercase (ASGI/h11 style)."""
    check_host(headers.get("host", ""))
    sid = headers.get("e2b-sandbox-id")
    port = headers.get("e2b-sandbox-port")
    if sid is not None or port is not None:
        if sid is None or port is None:
            raise RoutingError("E2b-Sandbox-Id and E2b-Sandbox-Port must be sent together")
        return Route(_sandbox(sid.strip()), _port(port.strip()))
    if domain is None:
        return None
    host = headers.get("host", "").strip().lower()
    m = _HOST_RE.match(host)
    if m is None or m.group("rest") != domain.lower():
        return None
    return Route(_sandbox(m.group("sid")), _port(m.group("port")))
