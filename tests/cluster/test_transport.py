"""Cluster links over real WebSocket servers on loopback (aenv.cluster.transport).

Rules: messages reach the peer with the sender's authenticated id and URL;
a node with another secret gets nothing through and is counted as refused;
a link to a peer that is down drops what it cannot send and carries on once
the peer is up again; sending never blocks. Over TLS (a CA made by the
test), a link reaches a peer whose certificate chains to the CA the sender
trusts, and nothing reaches one that does not.
"""

from __future__ import annotations

import ssl
from pathlib import Path

import trio

from aenv.cluster.transport import Received, Transport
from aenv.kit.tls import ServerTLS, client_context
from aenv.proto.clusterwire import ClusterKey
from tests.tlscerts import TestCA

KEY = ClusterKey.from_secret("shared")


async def _node(
    nursery: trio.Nursery, node_id: str, key: ClusterKey = KEY, port: int = 0
) -> Transport:
    # the URL is known once the port is: start with a placeholder, then set it
    t = Transport(key, node_id, "http://127.0.0.1:0", nursery)
    server = await nursery.start(t.serve, "127.0.0.1", port)
    t.url = f"http://127.0.0.1:{server.port}"
    return t


async def _next(t: Transport, within: float = 5.0) -> Received:
    with trio.fail_after(within):
        return await t.inbox.receive()


async def test_messages_go_both_ways_with_the_senders_identity() -> None:
    async with trio.open_nursery() as nursery:
        a, b = await _node(nursery, "a"), await _node(nursery, "b")
        a.send(b.url, b"ping")
        got = await _next(b)
        assert (got.peer, got.peer_url, got.payload) == ("a", a.url, b"ping")
        b.send(got.peer_url, b"ack")
        back = await _next(a)
        assert (back.peer, back.payload) == ("b", b"ack")
        for i in range(100):
            a.send(b.url, str(i).encode())
        assert [(await _next(b)).payload for _ in range(100)] == [
            str(i).encode() for i in range(100)
        ]
        nursery.cancel_scope.cancel()


async def test_a_node_with_another_secret_gets_nothing_through() -> None:
    async with trio.open_nursery() as nursery:
        a = await _node(nursery, "a", ClusterKey.from_secret("wrong"))
        b = await _node(nursery, "b")
        a.send(b.url, b"let me in")
        with trio.move_on_after(1.5):
            await b.inbox.receive()
            raise AssertionError("a message from a node without the secret arrived")
        assert b.statistics()["refused"] >= 1
        assert a.statistics()["sent"] == 0
        nursery.cancel_scope.cancel()


async def test_a_link_to_a_peer_that_was_down_carries_on_when_it_is_up() -> None:
    async with trio.open_nursery() as nursery:
        a = await _node(nursery, "a")
        b = Transport(KEY, "b", "http://127.0.0.1:0", nursery)
        async with trio.open_nursery() as up:
            server = await up.start(b.serve, "127.0.0.1", 0)
            port = server.port
            b.url = f"http://127.0.0.1:{port}"
            a.send(b.url, b"first")
            assert (await _next(b)).payload == b"first"
            up.cancel_scope.cancel()
        # b is down: sends (a sync call: it cannot block) are dropped
        for _ in range(1000):
            a.send(b.url, b"lost")
        await trio.sleep(1)
        assert a.statistics()["dropped"] > 0
        async with trio.open_nursery() as up:
            await up.start(b.serve, "127.0.0.1", port)
            got = None
            with trio.fail_after(15):
                while got is None:
                    a.send(b.url, b"again")
                    with trio.move_on_after(0.2):
                        got = await b.inbox.receive()
                        while got.payload != b"again":
                            got = await b.inbox.receive()
            assert got.peer == "a"
            up.cancel_scope.cancel()
        nursery.cancel_scope.cancel()


async def _tls_node(
    nursery: trio.Nursery, node_id: str, serve: ssl.SSLContext, trust: Path
) -> Transport:
    t = Transport(KEY, node_id, "https://127.0.0.1:0", nursery, peer_ssl=client_context(trust))
    server = await nursery.start(
        lambda task_status: t.serve("127.0.0.1", 0, ssl_context=serve, task_status=task_status)
    )
    t.url = f"https://127.0.0.1:{server.port}"
    return t


async def test_tls_links_reach_only_peers_whose_certificate_the_sender_trusts(
    tmp_path: Path,
) -> None:
    ca, other = TestCA(tmp_path / "ca"), TestCA(tmp_path / "other", name="another CA")
    cert = ServerTLS.load(*ca.issue("node", ips=["127.0.0.1"])).context
    async with trio.open_nursery() as nursery:
        a = await _tls_node(nursery, "a", cert, ca.pem)
        b = await _tls_node(nursery, "b", cert, ca.pem)
        stranger = await _tls_node(nursery, "s", cert, other.pem)
        a.send(b.url, b"over tls")
        got = await _next(b)
        assert (got.peer, got.peer_url, got.payload) == ("a", a.url, b"over tls")
        stranger.send(b.url, b"unverified")
        with trio.move_on_after(1.5):
            while True:
                assert (await b.inbox.receive()).payload != b"unverified"
        assert stranger.statistics()["sent"] == 0
        nursery.cancel_scope.cancel()
