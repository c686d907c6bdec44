"""Egress policy on real gVisor sandboxes, driven through the e2b SDK.

Rules: the "internet" is a test host this file creates: a network namespace
`aenvfake` with 198.51.100.1 (TEST-NET-2), attached to the host by a veth whose
host end is 198.51.100.254; the test node's egress cap admits only that range,
so no packet ever leaves the machine. Host-side listeners bind 0.0.0.0 on a
free port and are closed by the fixture. Probes use curl with a 3 s limit; a
refused or unreachable destination fails fast because the firewall rejects.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
from e2b import Sandbox

from tests.conftest import NodeProc, requires_node

pytestmark = [requires_node, pytest.mark.runsc]

INET_NS = "aenvfake"
INET_IP = "198.51.100.1"
HOST_END = "198.51.100.254"
SERVER = r"""
import socketserver
class H(socketserver.BaseRequestHandler):
    def handle(self):
        self.request.sendall(("HTTP/1.0 200 OK\r\n\r\nfrom " + self.client_address[0] + "\n").encode())
socketserver.ThreadingTCPServer.allow_reuse_address = True
socketserver.ThreadingTCPServer(("0.0.0.0", 8000), H).serve_forever()
"""


def _sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True)


@pytest.fixture(scope="module")
def internet_host() -> Iterator[str]:
    subprocess.run(["ip", "netns", "del", INET_NS], capture_output=True)
    subprocess.run(["ip", "link", "del", "aenvfake0"], capture_output=True)
    _sh("ip", "netns", "add", INET_NS)
    proc = None
    try:
        _sh("ip", "link", "add", "aenvfake0", "type", "veth", "peer", "name", "aenvfake1")
        _sh("ip", "link", "set", "aenvfake1", "netns", INET_NS)
        _sh("ip", "addr", "add", f"{HOST_END}/24", "dev", "aenvfake0")
        _sh("ip", "link", "set", "aenvfake0", "up")
        _sh("ip", "-n", INET_NS, "addr", "add", f"{INET_IP}/24", "dev", "aenvfake1")
        _sh("ip", "-n", INET_NS, "link", "set", "aenvfake1", "up")
        _sh("ip", "-n", INET_NS, "link", "set", "lo", "up")
        proc = subprocess.Popen(["ip", "netns", "exec", INET_NS, sys.executable, "-c", SERVER])
        time.sleep(0.5)
        yield INET_IP
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        subprocess.run(["ip", "link", "del", "aenvfake0"], capture_output=True)
        subprocess.run(["ip", "netns", "del", INET_NS], capture_output=True)


def probe(sbx: Sandbox, ip: str, port: int = 8000) -> str:
    r = sbx.commands.run(f"curl -s -m 3 http://{ip}:{port}/ || echo fail:$?", timeout=20)
    return r.stdout.strip()


def test_default_egress_is_nated(node: NodeProc, internet_host: str) -> None:
    s = Sandbox.create("base")
    try:
        assert probe(s, internet_host) == f"from {HOST_END}"
    finally:
        s.kill()


def test_no_internet_allow_out_and_deny_out(node: NodeProc, internet_host: str) -> None:
    s = Sandbox.create("base", allow_internet_access=False)
    try:
        t0 = time.monotonic()
        assert probe(s, internet_host).startswith("fail:")
        assert time.monotonic() - t0 < 3, "a refused destination must fail at once"
        s.update_network({"allow_out": [f"{internet_host}/32"], "deny_out": ["0.0.0.0/0"]})
        assert probe(s, internet_host) == f"from {HOST_END}"
        s.update_network({"deny_out": ["198.51.100.0/24"]})
        assert probe(s, internet_host).startswith("fail:")
        s.update_network({})
        assert probe(s, internet_host) == f"from {HOST_END}"
    finally:
        s.kill()
    d = Sandbox.create("base", network={"deny_out": [f"{internet_host}/32"]})
    try:
        assert probe(d, internet_host).startswith("fail:")
        assert d.get_info().network.get("deny_out") == [f"{internet_host}/32"]
    finally:
        d.kill()


@pytest.fixture
def host_listener() -> Iterator[int]:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", 0))
    srv.listen(16)
    srv.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                c, _ = srv.accept()
            except OSError:
                continue
            c.sendall(b"HTTP/1.0 200 OK\r\n\r\nhost\n")
            c.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield int(srv.getsockname()[1])
    finally:
        stop.set()
        t.join()
        srv.close()


def _host_addresses() -> list[str]:
    out = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
    return [line.split()[3].split("/")[0] for line in out.splitlines() if " lo " not in line]


def test_host_and_private_ranges_never_reachable(
    node: NodeProc, internet_host: str, host_listener: int
) -> None:
    everything = ["0.0.0.0/0", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "127.0.0.0/8"]
    s = Sandbox.create("base", network={"allow_out": everything})
    other = Sandbox.create("base")
    try:
        other.commands.run("python3 -m http.server 8000 --bind 0.0.0.0", background=True)
        other_ip = other.commands.run("hostname -I").stdout.split()[0]
        targets = [a for a in _host_addresses() if a != HOST_END] + [other_ip]
        assert targets
        for ip in targets:
            port = 8000 if ip == other_ip else host_listener
            assert probe(s, ip, port).startswith("fail:"), ip
        # the one allowed destination still works from the same sandbox
        assert probe(s, internet_host) == f"from {HOST_END}"
    finally:
        s.kill()
        other.kill()
