"""Authenticated message links between the nodes of a cluster, over WebSocket.

A node sends a peer a message by its URL: `Transport.send(url, payload)`
queues it on that peer's link and returns at once. A link dials
`{url}/cluster/v1/link` lazily (trio-websocket), runs the handshake of
`aenv.proto.clusterwire` and then writes sealed binary frames; it redials
with capped backoff after a failure, dropping what could not be sent
(gossip tolerates loss and must never wait on a slow or dead peer). A full
queue drops the newest message too.

Accepting is `Transport.accept(socket)`, called with each incoming WebSocket
(by the API's route, or by `serve` on a port of its own). The accepting side
only reads: replies travel on the replier's own outbound link, so each pair
of nodes talking both ways holds two connections.

A peer at an `https://` URL is dialled over `wss://` and its certificate
verified with the `peer_ssl` context given (the system's store if none).

Received messages, with the authenticated peer's id and URL, come out of
`Transport.inbox` (bounded; a full inbox drops, logged once in a while).
Readers drain their sockets continuously so a slow consumer never looks
like a dead peer. A peer that fails authentication gets nothing but a
closed connection and a log line.
"""

from __future__ import annotations

import logging
import secrets
import ssl
from contextlib import AbstractAsyncContextManager, suppress
from dataclasses import dataclass
from typing import Protocol

import trio
import trio_websocket

from aenv.kit.retry import Backoff
from aenv.proto.clusterwire import (
    MAX_FRAME,
    NONCE_BYTES,
    ClientHandshake,
    ClusterKey,
    ServerHandshake,
    Session,
    WireError,
)

log = logging.getLogger("aenv.cluster.transport")

LINK_PATH = "/cluster/v1/link"
QUEUE = 256  # messages waiting for one peer's link
INBOX = 1024  # messages received, waiting for the consumer
HANDSHAKE_S = 5.0
CONNECT_S = 3.0


class MessageSocket(Protocol):
    """One accepted WebSocket (Quart's or trio-websocket's, adapted)."""

    async def send(self, data: str | bytes) -> None: ...

    async def receive(self) -> str | bytes:
        """The next message; raises when the connection closes."""
        ...


@dataclass(frozen=True)
class Received:
    peer: str
    peer_url: str
    payload: bytes


class _TrioSocket:
    def __init__(self, ws: trio_websocket.WebSocketConnection) -> None:
        self.ws = ws

    async def send(self, data: str | bytes) -> None:
        await self.ws.send_message(data)

    async def receive(self) -> str | bytes:
        return await self.ws.get_message()


class Transport:
    """This node's links to its peers; see the module docstring."""

    def __init__(
        self,
        key: ClusterKey,
        node_id: str,
        url: str,
        nursery: trio.Nursery,
        *,
        peer_ssl: ssl.SSLContext | None = None,
    ) -> None:
        self.key = key
        self.peer_ssl = peer_ssl
        self.node_id = node_id
        self.url = url
        self._nursery = nursery
        self._links: dict[str, trio.MemorySendChannel[bytes]] = {}
        self._inbox_send, self.inbox = trio.open_memory_channel[Received](INBOX)
        self.sent = 0
        self.received = 0
        self.dropped = 0
        self.refused = 0  # connections that failed authentication
        self._closed = False

    def statistics(self) -> dict[str, int]:
        return {
            "links": len(self._links),
            "sent": self.sent,
            "received": self.received,
            "dropped": self.dropped,
            "refused": self.refused,
        }

    # -- sending ------------------------------------------------------------------

    def send(self, url: str, payload: bytes) -> None:
        """Queue `payload` for the peer at `url` (never blocks; drops when full)."""
        if self._closed or url == self.url:
            return
        link = self._links.get(url)
        if link is None:
            link_send, link_recv = trio.open_memory_channel[bytes](QUEUE)
            self._links[url] = link = link_send
            self._nursery.start_soon(self._run_link, url, link_recv, name=f"cluster link {url}")
        try:
            link.send_nowait(payload)
        except trio.WouldBlock:
            self.dropped += 1

    def forget(self, url: str) -> None:
        """Close the link to `url` (a peer that left or died for good)."""
        link = self._links.pop(url, None)
        if link is not None:
            link.close()

    async def _run_link(self, url: str, queue: trio.MemoryReceiveChannel[bytes]) -> None:
        backoff = Backoff(base_s=0.2, max_s=5.0, jitter=0.5)
        attempt = 0
        failing = False
        async with queue:
            while True:
                try:
                    async with _open(url, self.peer_ssl) as ws:
                        with trio.fail_after(HANDSHAKE_S):
                            session = await self._client_handshake(ws)
                        if failing:
                            log.info("cluster link to %s (%s) is up again", session.peer, url)
                        failing, attempt = False, 0
                        async for payload in queue:
                            await ws.send_message(session.sealer.seal(payload))
                            self.sent += 1
                        return  # forgotten
                except (
                    OSError,
                    trio.TooSlowError,
                    trio_websocket.HandshakeError,
                    trio_websocket.ConnectionClosed,
                    WireError,
                ) as e:
                    if not failing:
                        log.warning("cluster link to %s failed: %s", url, _why(e))
                    failing = True
                # what was queued while the link was down is stale gossip: drop it
                while True:
                    try:
                        queue.receive_nowait()
                        self.dropped += 1
                    except trio.WouldBlock:
                        break
                    except trio.EndOfChannel:
                        return
                await trio.sleep(backoff.draw(attempt))
                attempt += 1

    async def _client_handshake(self, ws: trio_websocket.WebSocketConnection) -> Session:
        hs = ClientHandshake(self.key, self.node_id, self.url, secrets.token_bytes(NONCE_BYTES))
        await ws.send_message(hs.challenge(await ws.get_message()))
        return hs.welcome(await ws.get_message())

    # -- receiving ------------------------------------------------------------------

    async def accept(self, sock: MessageSocket, remote: str = "?") -> None:
        """Serve one incoming connection until it closes (runs in the caller's task)."""
        hs = ServerHandshake(self.key, self.node_id, self.url, secrets.token_bytes(NONCE_BYTES))
        try:
            with trio.fail_after(HANDSHAKE_S):
                await sock.send(hs.challenge())
                welcome, session = hs.hello(await sock.receive())
                await sock.send(welcome)
        except WireError as e:
            self.refused += 1
            log.warning("refused a cluster connection from %s: %s", remote, e)
            return
        except trio.TooSlowError:
            log.warning("a cluster connection from %s did not complete its handshake", remote)
            return
        while True:
            frame = await sock.receive()
            if isinstance(frame, str):
                log.warning("cluster peer %s sent a text frame; closing", session.peer)
                return
            try:
                payload = session.opener.open(frame)
            except WireError as e:
                log.warning("cluster peer %s: %s; closing", session.peer, e)
                return
            self.received += 1
            try:
                self._inbox_send.send_nowait(Received(session.peer, session.peer_url, payload))
            except trio.WouldBlock:
                self.dropped += 1

    async def serve(
        self,
        host: str,
        port: int,
        *,
        ssl_context: ssl.SSLContext | None = None,
        task_status: trio.TaskStatus[trio_websocket.WebSocketServer] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Accept links on a port of their own (`AENV_CLUSTER_LISTEN`) until cancelled,
        over TLS with `ssl_context`."""

        async def handler(request: trio_websocket.WebSocketRequest) -> None:
            if request.path != LINK_PATH:
                await request.reject(404)
                return
            ws = await request.accept()
            remote = getattr(ws.remote, "address", "?")
            with suppress(trio_websocket.ConnectionClosed):
                await self.accept(_TrioSocket(ws), str(remote))

        await trio_websocket.serve_websocket(
            handler,
            host,
            port,
            ssl_context=ssl_context,
            max_message_size=MAX_FRAME + 64,
            task_status=task_status,
        )

    def close(self) -> None:
        self._closed = True
        for url in list(self._links):
            self.forget(url)


def _open(
    url: str, peer_ssl: ssl.SSLContext | None
) -> AbstractAsyncContextManager[trio_websocket.WebSocketConnection]:
    ws_url = url.replace("http://", "ws://", 1).replace("https://", "wss://", 1)
    ssl_context = None
    if ws_url.startswith("wss://"):
        ssl_context = peer_ssl or ssl.create_default_context()
    return trio_websocket.open_websocket_url(
        ws_url.rstrip("/") + LINK_PATH,
        ssl_context=ssl_context,
        max_message_size=MAX_FRAME + 64,
        connect_timeout=CONNECT_S,
        disconnect_timeout=1.0,
    )


def _why(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return text.splitlines()[0][:200]
