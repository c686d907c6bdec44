"""Minimal ASGI plumbing for envd: requests, responses, disconnect watching.

envd is a raw ASGI application (no framework, to keep its import time low
under gVisor). `Request` wraps one HTTP scope with lower-cased headers, the
query string and a body reader; `Response` writes status, headers and body
chunks; `watch_disconnect` turns the client going away into cancellation of
the handler, which hypercorn does not do by itself.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, MutableMapping
from typing import Any
from urllib.parse import parse_qs

import trio

Scope = MutableMapping[str, Any]
ASGIMessage = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[ASGIMessage]]
Send = Callable[[ASGIMessage], Awaitable[None]]

CORS_HEADERS = [
    (b"access-control-allow-origin", b"*"),
    (b"access-control-expose-headers", b"*"),
]


class BodyTooLarge(Exception):
    pass


class ClientDisconnected(Exception):
    pass


class Request:
    def __init__(self, scope: Scope, receive: Receive) -> None:
        self.scope = scope
        self._receive = receive
        self.method: str = scope.get("method", "GET")
        self.path: str = scope.get("path", "/")
        self.headers: dict[str, str] = {}
        self.header_list: list[tuple[str, str]] = []
        for raw_name, raw_value in scope.get("headers", []):
            name = raw_name.decode("latin-1").lower()
            value = raw_value.decode("latin-1")
            self.header_list.append((name, value))
            self.headers.setdefault(name, value)
        self.query: dict[str, list[str]] = parse_qs(
            scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True
        )
        self.body_done = False
        self.disconnected = False

    def query_one(self, name: str) -> str | None:
        values = self.query.get(name)
        return values[0] if values else None

    async def receive(self) -> ASGIMessage:
        # Hypercorn's `receive` is a trio channel's: a message already queued (a
        # small request's body, queued with its headers) is taken without the
        # scheduling round a checkpoint costs
        queue = getattr(self._receive, "__self__", None)
        if isinstance(queue, trio.MemoryReceiveChannel):
            try:
                message: ASGIMessage = queue.receive_nowait()
            except trio.WouldBlock:
                message = await self._receive()
        else:
            message = await self._receive()
        if message["type"] == "http.disconnect":
            self.disconnected = True
            self.body_done = True
        return message

    async def iter_body(self) -> AsyncIterator[bytes]:
        """Body chunks as they arrive; raises ClientDisconnected if cut off."""
        while not self.body_done:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                raise ClientDisconnected
            chunk = message.get("body", b"")
            if not message.get("more_body", False):
                self.body_done = True
            if chunk:
                yield chunk

    async def read_body(self, limit: int) -> bytes:
        buf = bytearray()
        async for chunk in self.iter_body():
            buf += chunk
            if len(buf) > limit:
                raise BodyTooLarge
        return bytes(buf)

    async def wait_disconnect(self) -> None:
        """Return once the client has gone (drains any unread body)."""
        while not self.disconnected:
            await self.receive()


async def watch_disconnect(request: Request, scope: trio.CancelScope) -> None:
    """Cancel `scope` when the client disconnects."""
    await request.wait_disconnect()
    scope.cancel()


class Response:
    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False

    async def start(self, status: int, headers: Iterable[tuple[str, str]] = ()) -> None:
        raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers]
        raw.extend(CORS_HEADERS)
        await self._send({"type": "http.response.start", "status": status, "headers": raw})
        self.started = True

    async def write(self, data: bytes, *, more: bool = True) -> None:
        await self._send({"type": "http.response.body", "body": data, "more_body": more})

    async def end(self) -> None:
        await self.write(b"", more=False)

    async def full(
        self, status: int, body: bytes = b"", headers: Iterable[tuple[str, str]] = ()
    ) -> None:
        hdrs = list(headers)
        if status not in (204, 304):
            hdrs.append(("content-length", str(len(body))))
        await self.start(status, hdrs)
        await self.write(body, more=False)

    async def json(self, status: int, obj: Any, headers: Iterable[tuple[str, str]] = ()) -> None:
        body = json.dumps(obj, separators=(",", ":")).encode()
        hdrs = [("content-type", "application/json"), ("cache-control", "no-store"), *headers]
        await self.full(status, body, hdrs)

    async def error(self, status: int, message: str) -> None:
        """An envd REST error: JSON {"code": status, "message": ...}."""
        await self.json(status, {"code": status, "message": message})
