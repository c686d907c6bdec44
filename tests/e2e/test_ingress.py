"""`network.maskRequestHost` and `network.httpsPorts` through the unmodified e2b SDK.

Rules: loopback only; one sandbox from the `base` template runs a plain HTTP
server and a TLS one (a throwaway self-signed certificate the node never
trusts), both answering with the Host header they received, reached through
the node's port with the `E2b-Sandbox-Id`/`E2b-Sandbox-Port` headers.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from e2b import Sandbox

from tests.conftest import NodeProc, requires_node
from tests.tlscerts import TestCA

pytestmark = [requires_node, pytest.mark.runsc]

HOST_ECHO = r"""
import http.server, ssl, sys, threading
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = ("host=" + self.headers.get("Host", "")).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
plain = http.server.ThreadingHTTPServer(("0.0.0.0", 8091), H)
tls = http.server.ThreadingHTTPServer(("0.0.0.0", 8443), H)
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain("/tmp/srv.pem", "/tmp/srv.key")
tls.socket = ctx.wrap_socket(tls.socket, server_side=True)
threading.Thread(target=tls.serve_forever, daemon=True).start()
plain.serve_forever()
"""
MASK = "${PORT}-app.example.com"


@pytest.fixture(scope="module")
def sandbox(node: NodeProc, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sandbox]:
    ca = TestCA(tmp_path_factory.mktemp("ingress-ca"))
    cert, key = ca.issue("sandbox", dns=["not-the-address.example"])
    s = Sandbox.create("base", network={"mask_request_host": MASK, "https_ports": [8443]})
    try:
        s.files.write("/tmp/srv.pem", cert.read_text())
        s.files.write("/tmp/srv.key", key.read_text())
        s.files.write("/tmp/echo.py", HOST_ECHO)
        s.commands.run("python3 /tmp/echo.py", background=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            r = s.commands.run(
                "curl -s -o /dev/null -w '%{http_code}' -m 2 localhost:8091/; "
                "curl -sk -o /dev/null -w ' %{http_code}' -m 2 https://localhost:8443/; true"
            )
            if r.stdout.split() == ["200", "200"]:
                break
            time.sleep(0.3)
        yield s
    finally:
        s.kill()


def _get(node: NodeProc, s: Sandbox, port: int) -> httpx.Response:
    headers = {"E2b-Sandbox-Id": s.sandbox_id, "E2b-Sandbox-Port": str(port)}
    return httpx.get(node.url + "/", headers=headers, timeout=10)


def test_requests_carry_the_masked_host(node: NodeProc, sandbox: Sandbox) -> None:
    r = _get(node, sandbox, 8091)
    assert r.status_code == 200 and r.text == "host=8091-app.example.com"


def test_https_port_reached_over_tls_with_a_self_signed_certificate(
    node: NodeProc, sandbox: Sandbox
) -> None:
    # the server speaks only TLS: a plain-HTTP hop would get no answer
    r = _get(node, sandbox, 8443)
    assert r.status_code == 200 and r.text == "host=8443-app.example.com"


def test_info_reports_them_and_an_update_keeps_them(node: NodeProc, sandbox: Sandbox) -> None:
    net = sandbox.get_info().network
    assert net is not None
    assert net.get("mask_request_host") == MASK and net.get("https_ports") == [8443]
    sandbox.update_network({"allow_out": ["198.51.100.7"]})
    net = sandbox.get_info().network
    assert net is not None and net.get("mask_request_host") == MASK
    assert _get(node, sandbox, 8443).text == "host=8443-app.example.com"
    sandbox.update_network({})


def test_envd_port_cannot_be_an_https_port(node: NodeProc) -> None:
    with pytest.raises(Exception, match="49983"):
        Sandbox.create("base", network={"https_ports": [49983]})


def test_kept_across_pause_and_fork(node: NodeProc, sandbox: Sandbox) -> None:
    sandbox.pause()
    again = Sandbox.connect(sandbox.sandbox_id)
    assert _get(node, again, 8443).text == "host=8443-app.example.com"
    (child,) = again.fork(count=1)
    assert isinstance(child, Sandbox), child
    try:
        # the fork runs the same servers (memory and all) under the same settings
        assert _get(node, child, 8091).text == "host=8091-app.example.com"
        assert _get(node, child, 8443).text == "host=8443-app.example.com"
    finally:
        child.kill()
