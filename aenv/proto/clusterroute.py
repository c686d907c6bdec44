"""Which node a request to any node of a cluster belongs on, sans-IO.

Every node accepts every call. `classify` sorts a request into:

- `ToSandbox`: it is about one sandbox (a REST call under
  `/sandboxes/{id}` or `/v2/sandboxes/{id}`, the exec WebSocket, or
  data-plane traffic routed by `E2b-Sandbox-Id` or by host
  `{port}-{id}.{domain}`): it runs on the node that owns the sandbox.
- `Create`: a new sandbox (`POST /sandboxes`, `POST /v2/sandboxes`): it runs
  where placement puts it.
- `Local`: anything else, and every request that already made its hop
  (`HOP_HEADER`), so a request is forwarded at most once and never loops.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from aenv.proto.ids import is_sandbox_id
from aenv.proto.routing import RoutingError, route

# Set on a request one node forwards to another: the receiver serves it itself.
HOP_HEADER = "x-aenv-hop"

_SANDBOX_PATH = re.compile(r"^/(?:v2/)?sandboxes/([a-z0-9]+)(?:/.*)?$")
_CREATE_PATHS = frozenset({"/sandboxes", "/v2/sandboxes"})


@dataclass(frozen=True)
class ToSandbox:
    sandbox_id: str


@dataclass(frozen=True)
class Create:
    pass


@dataclass(frozen=True)
class Local:
    pass


Decision = ToSandbox | Create | Local


def classify(method: str, path: str, headers: Mapping[str, str], domain: str | None) -> Decision:
    """Sort a request; `headers` have lower-case names."""
    if HOP_HEADER in headers:
        return Local()
    try:
        target = route(headers, domain)
    except RoutingError:
        return Local()  # the local proxy answers it with a 400
    if target is not None:
        return ToSandbox(target.sandbox_id)
    m = _SANDBOX_PATH.match(path)
    if m and is_sandbox_id(m.group(1)):
        return ToSandbox(m.group(1))
    if method == "POST" and path.rstrip("/") in _CREATE_PATHS:
        return Create()
    return Local()
