"""The cluster router over real HTTP servers on loopback (aenv.cluster.router).

Two Hypercorn servers: "here" runs the router in front of a small app of its
own, "there" is another node's app that echoes what it received. The
cluster view is a table (who holds which sandbox, which nodes are dead).

Rules: a call about a sandbox another node holds reaches that node whole
(method, path, query, body, headers, Host) with the hop header, streamed
both ways, WebSocket included; one held here, one nobody claims, and
everything else are served here; a dead owner is a 503 naming it at once,
except for a connect or resume of a paused sandbox the view can take up
here; a hop for a sandbox that moved away from here goes on to its node;
a create goes to the first candidate that takes it, its body replayed. A
forwarded request carries the client's headers and nothing the forwarder's
HTTP client would add: no default headers, no cookie an earlier response set
for someone else.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import trio
import trio_websocket
from hypercorn.config import Config as HyperConfig
from hypercorn.trio import serve

from aenv.cluster.router import ClusterRouter, Peer
from aenv.kit.asgiforward import ForwardingClient, Receive, Scope, Send
from aenv.proto.clusterroute import HOP_HEADER
from tests.asgiapps import lifespan

HERE_SID = "aaaaaaaaaaaaaaaahere"
THERE_SID = "bbbbbbbbbbbbbbbbther"
DEAD_SID = "ccccccccccccccccdead"
NOBODY_SID = "dddddddddddddddd0000"
PARKED_SID = "eeeeeeeeeeeeeeeedead"  # paused on the dead node, its copy in the store
MOVED_SID = "ffffffffffffffffhere"  # made here, moved to "there" (a drain)
STALE_SID = "gggggggggggggggghere"  # a copy here that is not this node's; the store is down
CRAMPED_SID = "hhhhhhhhhhhhhhhhhere"  # paused here, where there is no memory to resume it


def _echo_app(name: str, *, refuse_creates: bool = False) -> Any:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] == "websocket":
            await receive()
            await send({"type": "websocket.accept"})
            headers = {k.decode(): v.decode() for k, v in scope["headers"]}
            await send({"type": "websocket.send", "text": json.dumps({"node": name, **headers})})
            while True:
                m = await receive()
                if m["type"] == "websocket.disconnect":
                    return
                await send({"type": "websocket.send", "text": f"{name}:{m.get('text')}"})
        body = b""
        while True:
            m = await receive()
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
        if scope["path"] == "/login":  # a cookie for this client, with a known length
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"set-cookie", b"session=alice; Path=/"),
                        (b"content-length", b"2"),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": b"ok"})
            return
        if refuse_creates and scope["method"] == "POST":
            await send({"type": "http.response.start", "status": 503, "headers": []})
            await send({"type": "http.response.body", "body": b"full"})
            return
        doc = {
            "node": name,
            "method": scope["method"],
            "path": scope["path"],
            "query": scope["query_string"].decode(),
            "body": body.decode(),
            "headers": {k.decode(): v.decode() for k, v in scope["headers"]},
        }
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        if scope["path"] == "/stream":
            for i in range(3):
                await send({"type": "http.response.body", "body": b"%d\n" % i, "more_body": True})
                await trio.sleep(0.05)
        await send({"type": "http.response.body", "body": json.dumps(doc).encode()})

    return app


class View:
    node_id = "here"

    def __init__(self, there: Peer, full: Peer) -> None:
        self.there, self.full = there, full
        self.adopted: set[str] = set()

    def runs_here(self, sandbox_id: str) -> bool:
        return sandbox_id in (HERE_SID, CRAMPED_SID) or sandbox_id in self.adopted

    async def adopt(self, sandbox_id: str) -> str | None:
        if sandbox_id != PARKED_SID:
            return "it is running: its memory is only on its node"
        self.adopted.add(sandbox_id)
        return None

    async def moved_to(self, sandbox_id: str) -> Peer | None:
        if sandbox_id == STALE_SID:
            return Peer("here", "", "unknown")
        return self.there if sandbox_id == MOVED_SID else None

    async def arrived(self, sandbox_id: str) -> None:
        pass

    async def make_room(self, sandbox_id: str) -> Peer | None:
        return self.there if sandbox_id == CRAMPED_SID else None

    def not_serving(self) -> str | None:
        return None

    async def owner_of(self, sandbox_id: str) -> Peer | None:
        if sandbox_id == THERE_SID:
            return self.there
        if sandbox_id in (DEAD_SID, PARKED_SID):
            return Peer("gone", "http://127.0.0.1:9", "dead")
        if sandbox_id == STALE_SID:
            return Peer("here", "", "unknown")
        return None

    def placement(self, body: bytes) -> Sequence[Peer]:
        return [self.full, self.there, Peer("here", "", "alive")]

    def volume_holder(self, volume: str) -> Peer | None:
        return self.there if volume == "vol-there" else None


@asynccontextmanager
async def _serving(nursery: trio.Nursery, app: Any) -> AsyncIterator[str]:
    hc = HyperConfig()
    hc.bind = ["127.0.0.1:0"]
    async with trio.open_nursery() as inner:
        binds = await inner.start(serve, app, hc)
        yield binds[0]
        inner.cancel_scope.cancel()


@pytest.fixture
async def nodes() -> AsyncIterator[tuple[str, httpx.AsyncClient]]:
    async with (
        trio.open_nursery() as nursery,
        httpx.AsyncClient() as http,
        ForwardingClient(limits=httpx.Limits(), timeout=30) as forwarder,
        _serving(nursery, _echo_app("there")) as there,
        _serving(nursery, _echo_app("full", refuse_creates=True)) as full,
    ):
        view = View(Peer("there", there, "alive"), Peer("full", full, "alive"))
        router = ClusterRouter(_echo_app("here"), view, http=forwarder, domain="sb.test")
        async with _serving(nursery, router) as here:
            yield here, http
        nursery.cancel_scope.cancel()


async def test_calls_about_another_nodes_sandbox_reach_it_whole(
    nodes: tuple[str, httpx.AsyncClient],
) -> None:
    here, http = nodes
    r = await http.post(
        f"{here}/sandboxes/{THERE_SID}/timeout?x=1",
        content=b'{"timeout": 30}',
        headers={"X-API-Key": "k", "content-type": "application/json"},
    )
    doc = r.json()
    assert doc["node"] == "there" and doc["method"] == "POST"
    assert (doc["path"], doc["query"], doc["body"]) == (
        f"/sandboxes/{THERE_SID}/timeout",
        "x=1",
        '{"timeout": 30}',
    )
    assert doc["headers"]["x-api-key"] == "k" and doc["headers"][HOP_HEADER] == "here"
    # data-plane traffic routed by host keeps its Host
    r = await http.get(f"{here}/files", headers={"Host": f"49983-{THERE_SID}.sb.test"})
    assert r.json()["node"] == "there"
    assert r.json()["headers"]["host"] == f"49983-{THERE_SID}.sb.test"


async def test_a_forwarded_request_carries_only_what_its_client_sent(
    nodes: tuple[str, httpx.AsyncClient],
) -> None:
    here, _ = nodes
    headers = {"e2b-sandbox-id": THERE_SID, "e2b-sandbox-port": "8080"}
    async with httpx.AsyncClient() as alice:
        r = await alice.get(f"{here}/login", headers=headers)
        assert (r.status_code, r.text, r.headers["set-cookie"]) == (
            200,
            "ok",
            "session=alice; Path=/",
        )
    async with httpx.AsyncClient() as bob:
        del bob.headers["accept-encoding"]
        r = await bob.get(f"{here}/", headers=headers)
    seen = r.json()["headers"]
    assert "cookie" not in seen, seen  # alice's session never reaches bob's request
    assert "accept-encoding" not in seen, seen  # bob asked for no compression
    sent = {k.lower() for k in r.request.headers} - {"connection"}
    assert set(seen) == sent | {HOP_HEADER}, (seen, sent)


async def test_responses_stream_through(nodes: tuple[str, httpx.AsyncClient]) -> None:
    here, http = nodes
    headers = {"e2b-sandbox-id": THERE_SID, "e2b-sandbox-port": "8080"}
    async with http.stream("GET", f"{here}/stream", headers=headers) as r:
        first = await r.aiter_raw().__anext__()
    assert first.startswith(b"0\n")


async def test_the_rest_is_served_here(nodes: tuple[str, httpx.AsyncClient]) -> None:
    here, http = nodes
    for path in (f"/sandboxes/{HERE_SID}", f"/sandboxes/{NOBODY_SID}", "/templates"):
        assert (await http.get(here + path)).json()["node"] == "here", path
    # a request that already hopped is never forwarded again
    r = await http.get(f"{here}/sandboxes/{THERE_SID}", headers={HOP_HEADER: "x"})
    assert r.json()["node"] == "here"


async def test_a_dead_owner_answers_503_naming_it(nodes: tuple[str, httpx.AsyncClient]) -> None:
    here, http = nodes
    with trio.fail_after(2):
        r = await http.get(f"{here}/sandboxes/{DEAD_SID}")
    assert r.status_code == 503
    assert "node gone" in r.json()["message"] and "dead" in r.json()["message"]


async def test_a_dead_owners_paused_sandbox_is_resumed_here(
    nodes: tuple[str, httpx.AsyncClient],
) -> None:
    here, http = nodes
    # only a connect or resume takes it up; anything else still answers 503
    assert (await http.get(f"{here}/sandboxes/{PARKED_SID}")).status_code == 503
    r = await http.post(f"{here}/sandboxes/{PARKED_SID}/connect", json={"timeout": 30})
    assert r.status_code == 200 and r.json()["node"] == "here"
    # a running one cannot move: 503 with why
    r = await http.post(f"{here}/sandboxes/{DEAD_SID}/resume", json={"timeout": 30})
    assert r.status_code == 503 and "memory is only on its node" in r.json()["message"]


async def test_a_hop_for_a_moved_sandbox_goes_on_to_its_new_node(
    nodes: tuple[str, httpx.AsyncClient],
) -> None:
    here, http = nodes
    r = await http.get(f"{here}/sandboxes/{MOVED_SID}", headers={HOP_HEADER: "x"})
    assert r.json()["node"] == "there" and r.json()["headers"][HOP_HEADER] == "here"


async def test_a_resume_with_no_room_here_goes_to_the_node_given_the_sandbox(
    nodes: tuple[str, httpx.AsyncClient],
) -> None:
    here, http = nodes
    # other calls about it are served here; a connect or resume goes on, whole
    assert (await http.get(f"{here}/sandboxes/{CRAMPED_SID}")).json()["node"] == "here"
    for verb in ("connect", "resume"):
        r = await http.post(f"{here}/sandboxes/{CRAMPED_SID}/{verb}", json={"timeout": 30})
        doc = r.json()
        assert (doc["node"], doc["path"]) == ("there", f"/sandboxes/{CRAMPED_SID}/{verb}")
        assert json.loads(doc["body"]) == {"timeout": 30}
    # ... also when another node sent it here
    r = await http.post(
        f"{here}/sandboxes/{CRAMPED_SID}/connect", json={"timeout": 30}, headers={HOP_HEADER: "x"}
    )
    assert r.json()["node"] == "there"
    # a sandbox with room here resumes here
    r = await http.post(f"{here}/sandboxes/{HERE_SID}/connect", json={"timeout": 30})
    assert r.json()["node"] == "here"


async def test_a_copy_here_whose_holder_cannot_be_read_is_not_served(
    nodes: tuple[str, httpx.AsyncClient],
) -> None:
    here, http = nodes
    for headers in ({}, {HOP_HEADER: "x"}):
        r = await http.post(f"{here}/sandboxes/{STALE_SID}/connect", headers=headers)
        assert r.status_code == 503 and "cannot be read" in r.json()["message"], r.text


async def test_a_create_goes_to_the_first_node_that_takes_it(
    nodes: tuple[str, httpx.AsyncClient],
) -> None:
    here, http = nodes
    r = await http.post(f"{here}/sandboxes", json={"templateID": "base"})
    assert r.status_code == 200
    assert r.json()["node"] == "there"  # "full" answered 503 first
    assert json.loads(r.json()["body"]) == {"templateID": "base"}


async def test_websockets_reach_the_owner(nodes: tuple[str, httpx.AsyncClient]) -> None:
    here, _ = nodes
    host, port = here.removeprefix("http://").split(":")
    async with trio_websocket.open_websocket(
        host,
        int(port),
        "/ws",
        use_ssl=False,
        extra_headers=[(b"e2b-sandbox-id", THERE_SID.encode()), (b"e2b-sandbox-port", b"8080")],
    ) as ws:
        hello = json.loads(await ws.get_message())
        assert hello["node"] == "there"
        assert hello["e2b-sandbox-id"] == THERE_SID and hello[HOP_HEADER] == "here"
        await ws.send_message("hi")
        assert await ws.get_message() == "there:hi"


async def test_volume_calls_reach_the_node_holding_the_volume(
    nodes: tuple[str, httpx.AsyncClient],
) -> None:
    here, http = nodes
    body = b"x" * 100_000
    r = await http.put(f"{here}/volumecontent/vol-there/file?path=/a", content=body)
    assert (r.json()["node"], len(r.json()["body"])) == ("there", len(body))
    assert (await http.get(f"{here}/volumes/vol-there")).json()["node"] == "there"
    assert (await http.delete(f"{here}/volumes/vol-there")).json()["node"] == "there"
    # its own volumes, the list and creates are this node's; a hop is never forwarded
    for method, path in (
        ("GET", "/volumes/vol-here"),
        ("GET", "/volumecontent/vol-here/dir?path=/"),
        ("GET", "/volumes"),
        ("POST", "/volumes"),
    ):
        assert (await http.request(method, here + path)).json()["node"] == "here", path
    r = await http.get(f"{here}/volumes/vol-there", headers={HOP_HEADER: "x"})
    assert r.json()["node"] == "here"
