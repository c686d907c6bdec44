"""Sandbox traffic proxy: an ASGI layer in front of the REST app.

A request routed to a sandbox (headers `E2b-Sandbox-Id`/`E2b-Sandbox-Port`,
or host `{port}-{id}.{domain}`, see `aenv.proto.routing`) is forwarded to that
port on the sandbox's network slot: HTTP with streaming bodies both ways
(Connect streams, SSE, large file transfers never buffered whole), and
WebSocket. Everything else falls through to the wrapped app. envd checks its
own access token; other ports of a sandbox created with
`allowPublicTraffic: false` need `e2b-traffic-access-token`.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any

import httpx
import trio
import trio_websocket

from aenv.kit.metrics import Metric
from aenv.node import service as sv
from aenv.proto.routing import Route, RoutingError, route
from aenv.runtimes.base import ENVD_PORT

log = logging.getLogger("aenv.proxy")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "http2-settings",
        "e2b-sandbox-id",
        "e2b-sandbox-port",
        "e2b-traffic-access-token",
    }
)
UPSTREAM_TIMEOUT = httpx.Timeout(connect=10.0, read=None, write=60.0, pool=10.0)


async def _send_error(send: Send, status: int, message: str, **extra: str) -> None:
    body = json.dumps({"code": status, "message": message, **extra}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class ClientGone(Exception):
    """The downstream client disconnected before its request body was complete."""


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

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            target = route(headers, self.domain)
        except RoutingError as e:
            if scope["type"] == "http":
                await _send_error(send, 400, str(e))
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
                await _send_error(send, status, message, sandboxId=target.sandbox_id)
            else:
                await send({"type": "websocket.close", "code": 1008 if status == 403 else 1011})
            return
        if scope["type"] == "http":
            self.proxied.inc(kind="envd" if target.port == ENVD_PORT else "http")
            await self._http(scope, receive, send, found.address, found.http, headers)
        else:
            self.proxied.inc(kind="websocket")
            await self._websocket(scope, receive, send, found.address)

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
        upstream: str,
        client: httpx.AsyncClient,
        headers: dict[str, str],
    ) -> None:
        path = scope.get("raw_path") or scope["path"].encode()
        url = f"http://{upstream}{path.decode('latin-1')}"
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode("latin-1")
        fwd = [(k, v) for k, v in headers.items() if k not in HOP_BY_HOP]
        if "host" in headers:
            fwd.append(("x-forwarded-host", headers["host"]))
        body_done = trio.Event()

        async def body() -> AsyncIterator[bytes]:
            try:
                while True:
                    msg = await receive()
                    if msg["type"] == "http.disconnect":
                        raise ClientGone()
                    chunk = msg.get("body", b"")
                    if chunk:
                        yield chunk
                    if not msg.get("more_body", False):
                        return
            finally:
                body_done.set()

        has_body = scope["method"] not in ("GET", "HEAD", "OPTIONS") or "content-length" in headers
        request = client.build_request(
            scope["method"],
            url,
            headers=fwd,
            content=body() if has_body else None,
            timeout=UPSTREAM_TIMEOUT,
        )
        if not has_body:
            body_done.set()
        started = False
        try:
            async with trio.open_nursery() as nursery:

                async def watch_disconnect() -> None:
                    await body_done.wait()
                    while (await receive())["type"] != "http.disconnect":
                        pass
                    nursery.cancel_scope.cancel()

                nursery.start_soon(watch_disconnect)
                try:
                    resp = await client.send(request, stream=True)
                except httpx.TransportError as e:
                    await _send_error(send, 502, f"sandbox port unreachable: {e}")
                    started = True
                    nursery.cancel_scope.cancel()
                    return
                try:
                    out_headers = [
                        (k.encode("latin-1"), v.encode("latin-1"))
                        for k, v in resp.headers.multi_items()
                        if k.lower() not in HOP_BY_HOP
                    ]
                    await send(
                        {
                            "type": "http.response.start",
                            "status": resp.status_code,
                            "headers": out_headers,
                        }
                    )
                    started = True
                    async for chunk in resp.aiter_raw():
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                finally:
                    with trio.CancelScope(shield=True):
                        await resp.aclose()
                nursery.cancel_scope.cancel()
        except Exception as exc:
            # The client went away, or the sandbox broke the stream mid-way: never let
            # it reach the server (a started response cannot become a 500).
            log.info("proxy %s %s to %s ended early: %r", scope["method"], url, upstream, exc)
            if not started:
                with contextlib.suppress(Exception):
                    await _send_error(send, 502, f"sandbox request failed: {exc}")

    async def _websocket(self, scope: Scope, receive: Receive, send: Send, upstream: str) -> None:
        msg = await receive()
        if msg["type"] != "websocket.connect":
            return
        path = scope.get("raw_path") or scope["path"].encode()
        resource = path.decode("latin-1")
        if scope.get("query_string"):
            resource += "?" + scope["query_string"].decode("latin-1")
        host, port = upstream.rsplit(":", 1)
        try:
            ws_cm = trio_websocket.open_websocket(
                host,
                int(port),
                resource,
                use_ssl=False,
                subprotocols=list(scope.get("subprotocols") or []),
                connect_timeout=10,
                disconnect_timeout=5,
            )
            async with ws_cm as ws:
                await send({"type": "websocket.accept", "subprotocol": ws.subprotocol})
                async with trio.open_nursery() as nursery:

                    async def client_to_upstream() -> None:
                        while True:
                            m = await receive()
                            if m["type"] == "websocket.disconnect":
                                nursery.cancel_scope.cancel()
                                return
                            data = m.get("bytes")
                            await ws.send_message(data if data is not None else m.get("text", ""))

                    async def upstream_to_client() -> None:
                        try:
                            while True:
                                data = await ws.get_message()
                                key = "bytes" if isinstance(data, bytes) else "text"
                                await send({"type": "websocket.send", key: data})
                        except trio_websocket.ConnectionClosed as closed:
                            code = closed.reason.code if closed.reason else 1000
                            await send({"type": "websocket.close", "code": code})
                            nursery.cancel_scope.cancel()

                    nursery.start_soon(client_to_upstream)
                    nursery.start_soon(upstream_to_client)
        except (OSError, trio_websocket.HandshakeError, trio_websocket.ConnectionTimeout) as e:
            log.info("websocket upstream %s failed: %s", upstream, e)
            await send({"type": "websocket.close", "code": 1011})
