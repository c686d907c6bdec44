"""The intercepting relay's TLS end (`aenv.node.egresstls._TlsEnd`) against trio's
own `SSLStream` on the other side: bytes arrive whole and in order both ways,
in chunks of many records, and an end without close_notify is an end of stream.

Rules: a socket pair on this host, a throwaway CA (`tests.tlscerts`).
"""

from __future__ import annotations

import hashlib
import os
import ssl
from pathlib import Path

import trio

from aenv.node.egresstls import RELAY_READ, _TlsEnd
from tests.tlscerts import TestCA


def contexts(tmp: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    ca = TestCA(tmp / "ca")
    cert, key = ca.issue("srv", dns=["relay.test"])
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(cert, key)
    client = ssl.create_default_context(cafile=str(ca.pem))
    return server, client


async def test_bulk_both_ways_then_a_ragged_eof(tmp_path: Path) -> None:
    server_ctx, client_ctx = contexts(tmp_path)
    a, b = trio.socket.socketpair()
    raw_server, raw_client = trio.SocketStream(a), trio.SocketStream(b)
    payload = os.urandom(5 << 20)
    end = _TlsEnd(raw_server, server_ctx, server_side=True)
    peer = trio.SSLStream(raw_client, client_ctx, server_hostname="relay.test")
    got_by_end = bytearray()
    got_by_peer = bytearray()
    sizes: list[int] = []

    async def end_side() -> None:
        await end.do_handshake()
        async with trio.open_nursery() as both:
            both.start_soon(end.send_all, payload)
            await end_reads()

    async def end_reads() -> None:
        while len(got_by_end) < len(payload):
            data = await end.receive_some()
            assert data
            sizes.append(len(data))
            got_by_end.extend(data)
        # the peer's socket closes without close_notify: an end of stream
        assert await end.receive_some() == b""
        assert await end.receive_some() == b""

    async def peer_side() -> None:
        await peer.do_handshake()
        async with trio.open_nursery() as both:
            both.start_soon(peer.send_all, payload)
            while len(got_by_peer) < len(payload):
                got_by_peer.extend(await peer.receive_some(1 << 20))
        await raw_client.aclose()

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(end_side)
            nursery.start_soon(peer_side)
    digest = hashlib.sha256(payload).digest()
    assert hashlib.sha256(got_by_end).digest() == digest
    assert hashlib.sha256(got_by_peer).digest() == digest
    # several 16 KiB records per receive, never more than asked
    assert max(sizes) > 16 * 1024 and max(sizes) <= RELAY_READ
    await raw_server.aclose()
