"""envd's HTTP server, in process: how its connections end.

Rules: loopback only, port 0; `serve_envd` runs in the test's nursery
without signal handling and is cancelled at the end. Time is trio's mock
clock, which jumps only once nothing has happened for a while of real time,
so a server that waits for its keep-alive timeout (75 s) shows as a jump,
not as a slow test. The client closes first.
"""

from __future__ import annotations

from functools import partial
from urllib.parse import urlsplit

import pytest
import trio
from trio.testing import MockClock

from aenv.envd.server import serve_envd


@pytest.fixture
def clock() -> MockClock:
    # jump only when idle for this long in real time: socket I/O completes well within it
    return MockClock(autojump_threshold=0.3)


async def test_a_connection_its_client_closes_while_idle_is_closed_at_once(
    clock: MockClock,
) -> None:
    """The node closes its keep-alive connections before a sandbox's memory is
    captured and waits for envd to close its side: envd must not wait for the
    keep-alive timeout (an image with a socket envd still holds restores an envd
    that never answers)."""
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(
            partial(serve_envd, host="127.0.0.1", port=0, handle_signals=False)
        )
        address = urlsplit(binds[0])
        assert address.hostname is not None and address.port is not None
        stream = await trio.open_tcp_stream(address.hostname, address.port)
        async with stream:
            await stream.send_all(b"GET /health HTTP/1.1\r\nHost: envd\r\n\r\n")
            head = b""
            while b"\r\n\r\n" not in head:
                head += await stream.receive_some()
            assert head.startswith(b"HTTP/1.1 204")
            await trio.sleep(5)  # idle: the server's keep-alive timer runs
            await stream.send_eof()
            closed_at = trio.current_time()
            assert await stream.receive_some() == b""
            assert trio.current_time() - closed_at < 1
        nursery.cancel_scope.cancel()
