"""Sandbox traffic proxy: an ASGI layer in front of the REST app.

A request routed to a sandbox (headers `E2b-Sandbox-Id`/`E2b-Sandbox-Port`,
or host `{port}-{id}.{domain}`, see `aenv.proto.routing`) is forwarded to that
port on the sandbox's network slot: HTTP with streaming bodies both ways
(Connect streams, SSE, large file transfers never buffered whole), and
WebSocket. Everything else falls through to the wrapped app. envd checks its
own access token; other ports of a sandbox created with
`allowPublicTraffic: false` need `e2b-traffic-access-token`. A sandbox's
`network.maskRequestHost` becomes the Host header of its HTTP requests, and
its `network.httpsPorts` are reached over TLS, unverified (`aenv.proto.ingress`).
"""

from __future__ import annotations

import hmac
import logging
import ssl

import httpx

from aenv.kit.asgiforward import (
    CONNECTION_HEADERS,
    ASGIApp,
    ForwardingClient,
    Receive,
    Scope,
    Send,
    forward_http,
    forward_websocket,
    send_error,
)
from aenv.kit.metrics import Metric
from aenv.node import service as sv
from aenv.proto.ingress import request_host
from aenv.proto.routing import Route, RoutingError, route
from aenv.runtimes.base import ENVD_PORT

log = logging.getLogger("aenv.proxy")


def _unverified_tls() -> ssl.SSLContext:
    """TLS to a sandbox port listed in `httpsPorts`: E2B documents that the
    backend certificate is not verified (a service's self-signed one works)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


# Not forwarded into a sandbox: the connection's own headers and the routing ones.
HOP_BY_HOP = CONNECTION_HEADERS | {
    "host",
    "e2b-sandbox-id",
    "e2b-sandbox-port",
    "e2b-traffic-access-token",
}


class SandboxProxy:
    """`app` behind the proxy; `proxied` counts the requests sent into sandboxes, by kind."""

    def __init__(
        self,
        app: ASGIApp,
        service: sv.SandboxService,
        *,
        domain: str | None,
        proxied: Metric,
    ) -> None:
        self.app = app
        self.service = service
        self.domain = domain
        self.proxied = proxied
        self._tls = _unverified_tls()
        # One client for every sandbox's `httpsPorts`, without keep-alive: the
        # per-sandbox clients are closed when a sandbox stops running, this one
        # outlives them, so it never keeps a connection to a sandbox address.
        self._https = ForwardingClient(
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=0),
            timeout=httpx.Timeout(30.0),
            verify=self._tls,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            target = route(headers, self.domain)
        except RoutingError as e:
            if scope["type"] == "http":
                await send_error(send, 400, str(e))
            else:
                await send({"type": "websocket.close", "code": 1008})
            return
        if target is None:
            await self.app(scope, receive, send)
            return
        found = await self._upstream(target, headers)
        if isinstance(found, tuple):
            status, message = found
            if scope["type"] == "http":
                await send_error(send, status, message, sandboxId=target.sandbox_id)
            else:
                await send({"type": "websocket.close", "code": 1008 if status == 403 else 1011})
            return
        if scope["type"] == "http":
            self.proxied.inc(kind="envd" if target.port == ENVD_PORT else "http")
            await self._http(scope, receive, send, found, headers)
        else:
            self.proxied.inc(kind="websocket")
            await self._websocket(scope, receive, send, found)

    async def _upstream(
        self, target: Route, headers: dict[str, str]
    ) -> sv.Endpoint | tuple[int, str]:
        """Where the request goes (a paused sandbox created with autoResume is
        resumed first), or the status and message of the refusal."""
        try:
            ep = await self.service.endpoint(target.sandbox_id, target.port, auto_resume=True)
        except sv.NotFound:
            return 502, f"The sandbox {target.sandbox_id} was not found"
        except sv.NotRunning as e:
            return 502, f"The sandbox {target.sandbox_id} is {e.state}"
        if not ep.allow_public_traffic and target.port != ENVD_PORT:
            token = headers.get("e2b-traffic-access-token", "")
            if not hmac.compare_digest(token.encode(), ep.traffic_access_token.encode()):
                return 403, "missing or invalid e2b-traffic-access-token"
        return ep

    async def _http(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        ep: sv.Endpoint,
        headers: dict[str, str],
    ) -> None:
        fwd = [(k, v) for k, v in headers.items() if k not in HOP_BY_HOP]
        if "host" in headers:
            fwd.append(("x-forwarded-host", headers["host"]))
        masked = request_host(ep.mask_request_host, ep.port)
        if masked is not None:
            fwd.append(("host", masked))
        https = ep.port in ep.https_ports
        await forward_http(
            scope,
            receive,
            send,
            base=f"{'https' if https else 'http'}://{ep.address}",
            client=self._https if https else ep.http,
            headers=fwd,
            drop_response=HOP_BY_HOP,
            what="sandbox port",
        )

    async def _websocket(self, scope: Scope, receive: Receive, send: Send, ep: sv.Endpoint) -> None:
        await forward_websocket(
            scope,
            receive,
            send,
            host=ep.host,
            port=ep.port,
            what=ep.address,
            ssl_context=self._tls if ep.port in ep.https_ports else None,
        )
