"""The cluster router: an ASGI layer that sends each request to the node it belongs on.

It sits in front of the node's own app (the sandbox proxy and the REST API)
and sorts every request with `aenv.proto.clusterroute.classify`:

- about one sandbox: served here when this node runs it, else forwarded
  whole to the node that does (REST, envd traffic, SSE and WebSocket alike,
  streamed both ways) with `HOP_HEADER` set, so the owner serves it and never
  forwards again. A sandbox on a node that is dead or has left answers 503
  at once, naming the node; one no node claims is this node's to answer
  (404).
- a create: placed (`Cluster.placement`) and served here or forwarded to
  the chosen node; a node that cannot be reached or answers 503/507 is
  skipped for the next candidate, with the request body replayed.
- about one volume (its content API, detail, delete): forwarded to the node
  that holds it on its disk (gossiped in its load) when that is not this one.
- anything else: served here (lists are cluster-wide in the service layer).
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

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
    target_of,
)
from aenv.proto.clusterroute import HOP_HEADER, Create, Local, ToSandbox, classify
from aenv.proto.routing import route
from aenv.proto.volumes import volume_of_route

log = logging.getLogger("aenv.cluster.router")

MAX_CREATE_BODY = 1 << 20
# a node answering these to a create has no room or is going away: try the next
RETRY_CREATE = frozenset({502, 503, 507})


@dataclass(frozen=True)
class Peer:
    """A node as the router needs it."""

    id: str
    url: str
    state: str  # alive | suspect | dead | left


class ClusterView(Protocol):
    """What the router asks of the cluster."""

    node_id: str

    def runs_here(self, sandbox_id: str) -> bool:
        """Whether this node runs (or holds paused) the sandbox."""
        ...

    async def owner_of(self, sandbox_id: str) -> Peer | None:
        """The other node that holds the sandbox, if any is known to."""
        ...

    def not_serving(self) -> str | None:
        """Why this node may not serve its sandboxes now (None: it may)."""
        ...

    def placement(self, body: bytes) -> Sequence[Peer]:
        """Nodes to try for a create, best first (this node among them)."""
        ...

    async def adopt(self, sandbox_id: str) -> str | None:
        """Take up here a paused sandbox whose node is dead or has left: None once
        it is here, else why not."""
        ...

    async def moved_to(self, sandbox_id: str) -> Peer | None:
        """The node a sandbox this node made has moved to (None: not moved)."""
        ...

    async def arrived(self, sandbox_id: str) -> None:
        """Return once the sandbox is no longer being taken up here (its restore
        after this node took its claim over)."""
        ...

    async def make_room(self, sandbox_id: str) -> Peer | None:
        """Before a resume of a sandbox here: the node it was moved to because
        this node has no memory to resume it (None: resume it here)."""
        ...

    def volume_holder(self, volume: str) -> Peer | None:
        """The other live node that holds a volume (by ID or name) this node does not."""
        ...


class ClusterRouter:
    def __init__(
        self,
        app: ASGIApp,
        cluster: ClusterView,
        *,
        http: ForwardingClient,
        domain: str | None,
        ssl_context: ssl.SSLContext | None = None,
        counter: Callable[[str], None] = lambda kind: None,
    ) -> None:
        self.app = app
        self.ssl_context = ssl_context  # verifies peers at https:// URLs
        self.cluster = cluster
        self.http = http
        self.domain = domain
        self.counter = counter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        method = scope.get("method", "GET")
        volume = volume_of_route(method, scope["path"]) if scope["type"] == "http" else None
        if volume is not None and HOP_HEADER not in headers:
            holder = self.cluster.volume_holder(volume)
            if holder is not None:  # its files are on that node's disk
                self.counter("volume")
                await self._forward(holder, scope, receive, send)
                return
        decision = classify(method, scope["path"], headers, self.domain)
        if isinstance(decision, Local) and HOP_HEADER in headers:
            # forwarded here by the sandbox's tag: it may have moved on (a drain)
            unhopped = {k: v for k, v in headers.items() if k != HOP_HEADER}
            target = classify(method, scope["path"], unhopped, self.domain)
            if isinstance(target, ToSandbox):
                moved = await self.cluster.moved_to(target.sandbox_id)
                if moved is not None and moved.state in ("alive", "suspect"):
                    self.counter(scope["type"])
                    await self._forward(moved, scope, receive, send)
                    return
                if moved is not None:
                    await self._refuse(target.sandbox_id, moved, scope, send)
                    return
                await self._here(scope, receive, send, target.sandbox_id)
                return
        if isinstance(decision, Local):
            await self.app(scope, receive, send)
        elif isinstance(decision, ToSandbox):
            await self._to_owner(decision.sandbox_id, scope, receive, send)
        elif isinstance(decision, Create):
            await self._create(scope, receive, send)

    async def _here(self, scope: Scope, receive: Receive, send: Send, sandbox_id: str) -> None:
        """Serve a call about a sandbox here, unless this node may not serve now."""
        await self.cluster.arrived(sandbox_id)
        why = self.cluster.not_serving() if self.cluster.runs_here(sandbox_id) else None
        if why is None and _resumes(scope, sandbox_id):
            roomier = await self.cluster.make_room(sandbox_id)
            if roomier is not None:  # no memory here to resume it: moved there
                self.counter(scope["type"])
                await self._forward(roomier, scope, receive, send)
                return
        if why is None:
            await self.app(scope, receive, send)
        elif scope["type"] == "http":
            await send_error(send, 503, why, sandboxId=sandbox_id)
        else:
            await send({"type": "websocket.close", "code": 1011, "reason": why[:120]})

    async def _refuse(self, sandbox_id: str, owner: Peer, scope: Scope, send: Send) -> None:
        if owner.state == "unknown":
            message = (
                f"which node holds sandbox {sandbox_id} cannot be read from the object store "
                "now; try again"
            )
        else:
            message = (
                f"sandbox {sandbox_id} runs on node {owner.id}, which is {owner.state} "
                "(unreachable); try again once it is back"
            )
        if scope["type"] == "http":
            await send_error(send, 503, message, sandboxId=sandbox_id)
        else:
            await send({"type": "websocket.close", "code": 1011, "reason": message[:120]})

    async def _to_owner(self, sandbox_id: str, scope: Scope, receive: Receive, send: Send) -> None:
        if self.cluster.runs_here(sandbox_id):
            await self._here(scope, receive, send, sandbox_id)
            return
        owner = await self.cluster.owner_of(sandbox_id)
        if owner is None:
            await self.app(scope, receive, send)  # nobody claims it: not found, here
            return
        if owner.state == "unknown":
            await self._refuse(sandbox_id, owner, scope, send)
            return
        if owner.state in ("dead", "left"):
            message = (
                f"sandbox {sandbox_id} runs on node {owner.id}, which is {owner.state} "
                "(unreachable); try again once it is back"
            )
            if _resumes(scope, sandbox_id):
                # a paused sandbox whose copy is in the store resumes here
                why = await self.cluster.adopt(sandbox_id)
                if why is None:
                    await self.app(scope, receive, send)
                    return
                moved = await self.cluster.owner_of(sandbox_id)
                if moved is not None and moved.state in ("alive", "suspect"):
                    # another node took it up first (its own adoption)
                    self.counter(scope["type"])
                    await self._forward(moved, scope, receive, send)
                    return
                message = f"{message} ({why})"
            if scope["type"] == "http":
                await send_error(send, 503, message, sandboxId=sandbox_id)
            else:
                await send({"type": "websocket.close", "code": 1011, "reason": message[:120]})
            return
        self.counter(scope["type"])
        await self._forward(owner, scope, receive, send)

    async def _forward(self, peer: Peer, scope: Scope, receive: Receive, send: Send) -> None:
        fwd = _forwarded_headers(scope, self.cluster.node_id)
        if scope["type"] == "http":
            await forward_http(
                scope,
                receive,
                send,
                base=peer.url,
                client=self.http,
                headers=fwd,
                what=f"node {peer.id}",
            )
        else:
            # the WebSocket handshake is made anew upstream, with its own Host:
            # data-plane traffic routed by host keeps its route as headers
            ws_headers = [
                (k, v) for k, v in fwd if k != "host" and not k.startswith("sec-websocket-")
            ]
            target = route(dict(fwd), self.domain)
            if target is not None and not any(k == "e2b-sandbox-id" for k, _ in fwd):
                ws_headers += [
                    ("e2b-sandbox-id", target.sandbox_id),
                    ("e2b-sandbox-port", str(target.port)),
                ]
            u = urlsplit(peer.url)
            tls = u.scheme == "https"
            await forward_websocket(
                scope,
                receive,
                send,
                host=u.hostname or "",
                port=u.port or (443 if tls else 80),
                ssl_context=(self.ssl_context or ssl.create_default_context()) if tls else None,
                headers=ws_headers,
                what=f"node {peer.id}",
            )

    async def _create(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await _read_body(receive)
        if body is None:
            await send_error(send, 413, f"request body larger than {MAX_CREATE_BODY} bytes")
            return
        candidates = self.cluster.placement(body)
        last_error = "no node of the cluster has room for another sandbox"
        for peer in candidates:
            if peer.id == self.cluster.node_id:
                await self.app(scope, _replay(body, receive), send)
                return
            try:
                resp = await self.http.request(
                    scope["method"],
                    peer.url + target_of(scope),
                    headers=_forwarded_headers(scope, self.cluster.node_id),
                    content=body,
                    timeout=httpx.Timeout(connect=3.0, read=600.0, write=30.0, pool=10.0),
                )
            except httpx.TransportError as e:
                log.warning("create on node %s failed (%s); trying the next", peer.id, e)
                last_error = f"node {peer.id} unreachable: {e}"
                continue
            if resp.status_code in RETRY_CREATE or (
                resp.status_code == 404 and peer is not candidates[-1]
            ):
                # full, going away, or without the template (it may be on the next)
                log.warning(
                    "node %s refused a create (%d); trying the next", peer.id, resp.status_code
                )
                last_error = f"node {peer.id}: {resp.text[:200]}"
                continue
            self.counter("create")
            out = [
                (k.encode("latin-1"), v.encode("latin-1"))
                for k, v in resp.headers.multi_items()
                if k.lower() not in CONNECTION_HEADERS and k.lower() != "content-encoding"
            ]
            await send({"type": "http.response.start", "status": resp.status_code, "headers": out})
            await send({"type": "http.response.body", "body": resp.content})
            return
        await send_error(send, 503, last_error)


def _resumes(scope: Scope, sandbox_id: str) -> bool:
    """Whether the request connects to or resumes the sandbox (REST)."""
    if scope["type"] != "http" or scope.get("method") != "POST":
        return False
    path = str(scope["path"]).rstrip("/")
    return any(
        path == f"{base}/sandboxes/{sandbox_id}/{verb}"
        for base in ("", "/v2")
        for verb in ("connect", "resume")
    )


def _forwarded_headers(scope: Scope, node_id: str) -> list[tuple[str, str]]:
    out = [
        (k.decode("latin-1").lower(), v.decode("latin-1"))
        for k, v in scope["headers"]
        if k.decode("latin-1").lower() not in CONNECTION_HEADERS
    ]
    out.append((HOP_HEADER, node_id))
    return out


async def _read_body(receive: Receive) -> bytes | None:
    chunks: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return b""
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > MAX_CREATE_BODY:
            return None
        chunks.append(chunk)
        if not msg.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def again() -> MutableMapping[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again
