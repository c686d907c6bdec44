"""Forward one ASGI request to an upstream server, streaming both ways.

Used by the sandbox proxy (a request into a sandbox's port) and the cluster
router (a request to the node that owns a sandbox). HTTP bodies are streamed
both ways, never buffered whole (Connect streams, SSE, large files), and a
client that goes away cancels the upstream request. WebSocket messages are
relayed both ways until either side closes. A response that has started
cannot become an error any more: a broken stream then just ends.

A request goes upstream with exactly the headers the caller gives, through
the connection pool of a `ForwardingClient` (`httpx`'s transport, below its
client layer): the client layer would add its default headers (an
`accept-encoding` the downstream client never sent), keep cookies from one
response and send them with a later request of anyone else, and costs
about a tenth of a forwarded request's CPU on top.
"""

from __future__ import annotations

import contextlib
import json
import logging
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping, Sequence
from typing import Any

import httpx
import trio
import trio_websocket

log = logging.getLogger("aenv.forward")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# Headers about one connection, never forwarded (RFC 9110 7.6.1, plus h2c's).
CONNECTION_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "http2-settings",
    }
)
UPSTREAM_TIMEOUT = httpx.Timeout(connect=10.0, read=None, write=60.0, pool=10.0)


class ForwardingClient(httpx.AsyncClient):
    """An `httpx.AsyncClient` whose pool `forward_http` uses directly (`pool`).

    Requests made through the client itself (`get`, `post`, ...) behave as
    any httpx client's; environment proxy settings are never used: upstreams
    are sandboxes and peer nodes, on this host or the cluster's network.
    """

    def __init__(
        self,
        *,
        limits: httpx.Limits,
        timeout: httpx.Timeout | float,
        verify: ssl.SSLContext | bool = True,
    ) -> None:
        self.pool = httpx.AsyncHTTPTransport(limits=limits, verify=verify, trust_env=False)
        super().__init__(transport=self.pool, timeout=timeout, trust_env=False)


class ClientGone(Exception):
    """The downstream client disconnected before its request body was complete."""


async def send_error(send: Send, status: int, message: str, **extra: str) -> None:
    """An E2B-shaped JSON error response."""
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


def target_of(scope: Scope) -> str:
    """The request's path and query, as received."""
    path: str = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1")
    if scope.get("query_string"):
        path += "?" + scope["query_string"].decode("latin-1")
    return path


async def forward_http(
    scope: Scope,
    receive: Receive,
    send: Send,
    *,
    base: str,
    client: ForwardingClient,
    headers: Sequence[tuple[str, str]],
    drop_response: frozenset[str] = CONNECTION_HEADERS,
    what: str = "upstream",
) -> None:
    """Send the request to `base` + its path with `headers`; relay the response.

    `what` names the upstream in errors ("sandbox port", "node b").
    """
    url = base + target_of(scope)
    has_body = scope["method"] not in ("GET", "HEAD", "OPTIONS") or any(
        k == "content-length" for k, _ in headers
    )
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

    request = httpx.Request(
        scope["method"],
        url,
        headers=list(headers),
        content=body() if has_body else None,
        extensions={"timeout": UPSTREAM_TIMEOUT.as_dict()},
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
                resp = await client.pool.handle_async_request(request)
            except httpx.TransportError as e:
                await send_error(send, 502, f"{what} unreachable: {e}")
                started = True
                nursery.cancel_scope.cancel()
                return
            try:
                out_headers = [
                    (k.encode("latin-1"), v.encode("latin-1"))
                    for k, v in resp.headers.multi_items()
                    if k.lower() not in drop_response
                ]
                await send(
                    {
                        "type": "http.response.start",
                        "status": resp.status_code,
                        "headers": out_headers,
                    }
                )
                started = True
                # with a known length the last chunk ends the response (one send less),
                # once the upstream response is done: its connection is back in the
                # pool before the client, done too, can send its next request
                left = _content_length(resp.headers)
                last = b""
                async for chunk in resp.aiter_raw():
                    if left is not None:
                        left -= len(chunk)
                        if left == 0:
                            last = chunk
                            continue
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": last, "more_body": False})
            finally:
                with trio.CancelScope(shield=True):
                    await resp.aclose()
            nursery.cancel_scope.cancel()
    except Exception as exc:
        # The client went away, or the upstream broke the stream mid-way: never let
        # it reach the server (a started response cannot become a 500).
        log.info("forwarding %s %s to %s ended early: %r", scope["method"], url, what, exc)
        if not started:
            with contextlib.suppress(Exception):
                await send_error(send, 502, f"{what} request failed: {exc}")


def _content_length(headers: httpx.Headers) -> int | None:
    raw = headers.get_list("content-length")
    if len(raw) != 1 or not raw[0].isdigit():
        return None
    n = int(raw[0])
    return n if n > 0 else None  # an empty body: the final send below ends it


async def forward_websocket(
    scope: Scope,
    receive: Receive,
    send: Send,
    *,
    host: str,
    port: int,
    headers: Sequence[tuple[str, str]] = (),
    what: str = "upstream",
    ssl_context: ssl.SSLContext | None = None,
) -> None:
    """Open the same WebSocket resource upstream and relay messages both ways
    (over TLS, verified with `ssl_context`, when one is given)."""
    msg = await receive()
    if msg["type"] != "websocket.connect":
        return
    try:
        ws_cm = trio_websocket.open_websocket(
            host,
            port,
            target_of(scope),
            use_ssl=ssl_context if ssl_context is not None else False,
            subprotocols=list(scope.get("subprotocols") or []),
            extra_headers=[(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers],
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
    except trio_websocket.ConnectionRejected as e:
        log.info("websocket %s refused the connection: %s", what, e.status_code)
        await send(
            {"type": "websocket.close", "code": 1008 if e.status_code in (401, 403) else 1011}
        )
    except (OSError, trio_websocket.HandshakeError, trio_websocket.ConnectionTimeout) as e:
        log.info("websocket %s failed: %s", what, e)
        await send({"type": "websocket.close", "code": 1011})
