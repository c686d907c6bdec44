"""Forwarding one ASGI request to a real upstream server (aenv.kit.asgiforward).

The upstream is a Hypercorn server on loopback that tells, in each answer,
which of its connections (the client's port) the request came on. The
downstream side is `forward_http` called as an ASGI server would call it.

Rule: a response of known length ends, downstream, only once the upstream
response is done, so its pooled connection is already back in the pool when
a client that has the whole response sends its next request: that request
goes on the same upstream connection, not a new one (a new one costs a
connect, and the sandbox or node behind it one more connection to serve).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import trio
from hypercorn.config import Config as HyperConfig
from hypercorn.trio import serve

from aenv.kit.asgiforward import ForwardingClient, Message, Receive, Scope, Send, forward_http
from tests.asgiapps import lifespan


async def _upstream(scope: Scope, receive: Receive, send: Send) -> None:
    """Answers each request with the port its connection came from, of known length."""
    if scope["type"] == "lifespan":
        await lifespan(receive, send)
        return
    body = str(scope["client"][1]).encode().rjust(64)  # a small fixed-length body
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


@pytest.fixture
async def upstream() -> AsyncIterator[str]:
    hc = HyperConfig()
    hc.bind = ["127.0.0.1:0"]
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(serve, _upstream, hc)
        yield binds[0]
        nursery.cancel_scope.cancel()


def _get(path: str) -> Scope:
    return {
        "type": "http",
        "http_version": "1.1",
        "method": "GET",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": [],
    }


async def _receive_nothing_more() -> Message:
    """A client that sent its whole (empty) request, then stays connected."""
    await trio.sleep_forever()
    raise AssertionError("unreachable")


def _request_then_wait() -> Receive:
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": b"", "more_body": False}
        return await _receive_nothing_more()

    return receive


async def test_the_next_request_right_after_a_response_reuses_its_upstream_connection(
    upstream: str,
) -> None:
    # The fastest client there is: it sends its next request the moment its
    # response has ended, inside the very send that ends it.
    ports: list[str] = []

    async def forward(path: str, send: Send) -> None:
        await forward_http(
            _get(path),
            _request_then_wait(),
            send,
            base=upstream,
            client=forwarder,
            headers=[("host", "upstream.test")],
        )

    def client(path: str, then: str | None) -> Send:
        body = b""

        async def send(msg: Any) -> None:
            nonlocal body
            if msg["type"] == "http.response.start":
                assert msg["status"] == 200
                return
            body += msg.get("body", b"")
            if not msg.get("more_body", False):
                assert len(body) == 64, body  # the response is whole when it ends
                ports.append(body.decode().strip())
                if then is not None:
                    await forward(then, client(then, None))

        return send

    async with ForwardingClient(limits=httpx.Limits(), timeout=30) as forwarder:
        await forward("/first", client("/first", "/second"))
    assert len(ports) == 2
    assert ports[0] == ports[1], "the second request opened a new upstream connection"
