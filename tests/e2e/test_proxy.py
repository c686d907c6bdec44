"""The sandbox proxy: streaming (SSE), WebSocket and h2c, through the node.

Rules: loopback only; servers run inside a sandbox the test creates from the
`base` template and are reached only through the node's port with the
`E2b-Sandbox-Id`/`E2b-Sandbox-Port` headers. The WebSocket server is
Hypercorn from the envd bundle mounted in every sandbox at /opt/aenv.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
import trio
import trio_websocket
from e2b import Sandbox

from tests.conftest import NodeProc, requires_node

pytestmark = [requires_node, pytest.mark.runsc]

SSE_SERVER = r"""
import http.server, time
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for i in range(4):
            chunk = f"data: {i}\n\n".encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.flush()
            time.sleep(0.5)
        self.wfile.write(b"0\r\n\r\n")
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(("0.0.0.0", 8090), H).serve_forever()
"""

WS_SERVER = r"""
import trio
from hypercorn.config import Config
from hypercorn.trio import serve

async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            m = await receive()
            if m["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            else:
                await send({"type": "lifespan.shutdown.complete"}); return
    assert scope["type"] == "websocket"
    await receive()
    await send({"type": "websocket.accept"})
    while True:
        m = await receive()
        if m["type"] == "websocket.disconnect":
            return
        if m.get("text") is not None:
            await send({"type": "websocket.send", "text": "echo:" + m["text"]})
        else:
            await send({"type": "websocket.send", "bytes": m["bytes"][::-1]})

c = Config(); c.bind = ["0.0.0.0:8765"]
trio.run(serve, app, c)
"""
BUNDLE_PY = (
    "env PYTHONHOME=/opt/aenv PYTHONPATH=/opt/aenv/lib/aenv-site "
    "/opt/aenv/lib/ld-linux-x86-64.so.2 --library-path /opt/aenv/lib /opt/aenv/bin/python3 -S"
)


@pytest.fixture(scope="module")
def servers(node: NodeProc) -> Iterator[Sandbox]:
    s = Sandbox.create("base")
    try:
        s.files.write("/tmp/sse.py", SSE_SERVER)
        s.files.write("/tmp/ws.py", WS_SERVER)
        s.commands.run("python3 /tmp/sse.py", background=True)
        s.commands.run(f"{BUNDLE_PY} /tmp/ws.py", background=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            r = s.commands.run(
                "curl -s -o /dev/null -w '%{http_code}' -m 2 localhost:8090/; "
                "curl -s -o /dev/null -w ' %{http_code}' -m 2 localhost:8765/; true"
            )
            codes = r.stdout.split()
            if len(codes) == 2 and codes[0] == "200" and codes[1] != "000":
                break
            time.sleep(0.3)
        yield s
    finally:
        s.kill()


def _route(s: Sandbox, port: int) -> dict[str, str]:
    return {"E2b-Sandbox-Id": s.sandbox_id, "E2b-Sandbox-Port": str(port)}


@pytest.mark.parametrize("http2", [False, True], ids=["http1", "h2c"])
def test_server_sent_events_stream_through(node: NodeProc, servers: Sandbox, http2: bool) -> None:
    arrivals: list[tuple[float, str]] = []
    with httpx.Client(http1=not http2, http2=http2, timeout=10) as c:
        t0 = time.monotonic()
        with c.stream("GET", node.url + "/events", headers=_route(servers, 8090)) as r:
            assert r.status_code == 200
            assert r.http_version == ("HTTP/2" if http2 else "HTTP/1.1")
            for line in r.iter_lines():
                if line.startswith("data:"):
                    arrivals.append((time.monotonic() - t0, line))
    assert [a[1] for a in arrivals] == [f"data: {i}" for i in range(4)]
    # each event is forwarded as it is produced, not when the response ends
    assert arrivals[0][0] < arrivals[-1][0] - 1.0


def test_envd_over_h2c(node: NodeProc, servers: Sandbox) -> None:
    headers = {
        **_route(servers, 49983),
        "X-Access-Token": servers._envd_access_token or "",
        "content-type": "application/json",
        "connect-protocol-version": "1",
    }
    with httpx.Client(http1=False, http2=True) as c:
        r = c.post(node.url + "/process.Process/List", headers=headers, content=b"{}")
    assert r.status_code == 200 and r.http_version == "HTTP/2"
    assert isinstance(r.json().get("processes", []), list)


async def test_websocket_through_proxy(node: NodeProc, servers: Sandbox) -> None:
    host, port = node.url.removeprefix("http://").split(":")
    headers = [(k, v) for k, v in _route(servers, 8765).items()]
    async with trio_websocket.open_websocket(
        host, int(port), "/ws", use_ssl=False, extra_headers=headers
    ) as ws:
        with trio.fail_after(10):
            await ws.send_message("hello")
            assert await ws.get_message() == "echo:hello"
            await ws.send_message(b"\x01\x02\x03")
            assert await ws.get_message() == b"\x03\x02\x01"
