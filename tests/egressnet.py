"""A small "internet" for egress tests: names, a resolver, HTTP and HTTPS servers.

`open_internet(tmp, prefix=...)` makes a network namespace `{prefix}` joined
to the host by a veth (`{prefix}0` on the host with `HOST_END`, `{prefix}1`
inside), with TEST-NET-3 addresses (203.0.113.160/28, never routed on the real
internet) and, inside the namespace, one process that serves:

- DNS (UDP 53 on `DNS_IP`) for the names in `NAMES`, through
  `aenv.proto.dnswire.answer`;
- HTTP (80) and HTTPS (443) on every address, answering
  `from <server address> host=<Host header> sni=<server name> peer=<client
  address>\\n` so a test sees where a request really went, and from where;
  the HTTPS certificate comes from a test CA (`Internet.ca_pem`) and names
  every host in `NAMES` and every address (`Internet.cert`, `Internet.key`);
- `GET /bytes/N` answers N zero bytes (a download for benchmarks);
- `GET /headers` answers the request head as received.

Leaving the block kills the process and deletes the namespace and veth.
Names only this module uses; nothing leaves the machine. Concurrent runs on
one machine set `AENV_TEST_EGRESS_PREFIX` (netns and veth names; the default
`aenvci`) and `AENV_TEST_EGRESS_SUBNET` (a /28 of TEST-NET ranges; the
default 203.0.113.160/28): every address below is an offset in it.
`PROXY_IP` is kept free for a SOCKS5 server (`tests.socksserver`).

`wrong.test` resolves but the certificate does not name it: a host that
cannot prove its name over TLS.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.tlscerts import TestCA

PREFIX = os.environ.get("AENV_TEST_EGRESS_PREFIX", "aenvci")
SUBNET = os.environ.get("AENV_TEST_EGRESS_SUBNET", "203.0.113.160/28")
# sandbox addresses of the egress tests' own nodes (never the session node's
# range: both run at once), split in four: two per test module
NODE_RANGES = list(
    ipaddress.IPv4Network(os.environ.get("AENV_TEST_EGRESS_NODE_SLOTS", "10.226.0.0/16")).subnets(
        prefixlen_diff=2
    )
)
_NET = ipaddress.IPv4Network(SUBNET)


def _at(offset: int) -> str:
    return str(_NET[offset])


HOST_END = _at(14)
DNS_IP = _at(5)
PROXY_IP = _at(6)
A, B, C = _at(1), _at(2), _at(3)
ADDRESSES = (A, B, C, DNS_IP, PROXY_IP)
NAMES: dict[str, list[str]] = {
    "allowed.test": [A],
    "api.cdn.test": [A],
    "deep.api.cdn.test": [A],
    "cdn.test": [A],
    "other.test": [B],
}
# resolves, but the internet's certificate does not name it
UNCERTIFIED: dict[str, list[str]] = {"wrong.test": [C]}

SERVER = r"""
import socket, socketserver, ssl, sys, threading
sys.path.insert(0, sys.argv[1])
from aenv.proto import dnswire
cert, key = sys.argv[2], sys.argv[3]
names = dict(a.split("=", 1) for a in sys.argv[4].split(","))
table = {}
for n, ip in names.items():
    table.setdefault(n, []).append(ip)

class Dns(socketserver.BaseRequestHandler):
    def handle(self):
        data, sock = self.request
        try:
            sock.sendto(dnswire.answer(data, table, ttl=5), self.client_address)
        except Exception:
            pass

class Http(socketserver.StreamRequestHandler):
    sni = ""
    def handle(self):
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.request.recv(4096)
            if not chunk:
                return
            head += chunk
        lines = head.decode("latin-1").split("\r\n")
        path = lines[0].split(" ")[1]
        host = next((l.split(":", 1)[1].strip() for l in lines[1:] if l.lower().startswith("host:")), "")
        if path.startswith("/bytes/"):
            n = int(path[len("/bytes/"):])
            self.request.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % n)
            block = bytes(1 << 20)
            while n > 0:
                self.request.sendall(block[: min(n, len(block))])
                n -= len(block)
            return
        if path == "/headers":  # the request head as the server received it
            self.request.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(head) + head)
            return
        me = self.request.getsockname()[0]
        peer = self.client_address[0]
        body = f"from {me} host={host} sni={getattr(self.request, 'aenv_sni', '')} peer={peer}\n".encode()
        self.request.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)

class Tls(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True
    def get_request(self):
        sock, addr = self.socket.accept()
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)
        seen = {}
        ctx.sni_callback = lambda s, name, c: seen.update(sni=name or "")
        tls = ctx.wrap_socket(sock, server_side=True)
        tls.aenv_sni = seen.get("sni", "")
        return tls, addr

class Plain(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True

class Udp(socketserver.ThreadingUDPServer):
    allow_reuse_address = True

servers = [Plain(("0.0.0.0", 80), Http), Tls(("0.0.0.0", 443), Http), Udp((sys.argv[5], 53), Dns)]
for s in servers:
    threading.Thread(target=s.serve_forever, daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
"""


@dataclass(frozen=True)
class Internet:
    netns: str
    ca_pem: Path
    cert: Path
    key: Path


def _sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True)


def _quiet(*args: str) -> None:
    subprocess.run(args, capture_output=True, check=False)


@contextlib.contextmanager
def open_internet(tmp: Path, *, prefix: str) -> Iterator[Internet]:
    prefix = PREFIX + prefix.removeprefix("aenvci")
    ns, host_if, ns_if = prefix, f"{prefix}0", f"{prefix}1"
    _quiet("ip", "link", "del", host_if)
    _quiet("ip", "netns", "del", ns)
    ca = TestCA(tmp / "ca")
    cert, key = ca.issue("internet", dns=[*NAMES, *(f"*.{n}" for n in NAMES)], ips=ADDRESSES)
    proc: subprocess.Popen[bytes] | None = None
    _sh("ip", "netns", "add", ns)
    try:
        _sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _sh("ip", "link", "set", ns_if, "netns", ns)
        _sh("ip", "addr", "add", f"{HOST_END}/{_NET.prefixlen}", "dev", host_if)
        _sh("ip", "link", "set", host_if, "up")
        for ip in ADDRESSES:
            _sh("ip", "-n", ns, "addr", "add", f"{ip}/{_NET.prefixlen}", "dev", ns_if)
        _sh("ip", "-n", ns, "link", "set", ns_if, "up")
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        _sh("ip", "-n", ns, "route", "add", "default", "via", HOST_END)
        every = {**NAMES, **UNCERTIFIED}
        names = ",".join(f"{n}={ip}" for n, ips in every.items() for ip in ips)
        root = str(Path(__file__).resolve().parent.parent)
        argv = [sys.executable, "-c", SERVER, root, str(cert), str(key), names, DNS_IP]
        proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, *argv], stdout=subprocess.PIPE, env=dict(os.environ)
        )
        assert proc.stdout is not None
        deadline = time.monotonic() + 20
        line = proc.stdout.readline()
        if b"ready" not in line or time.monotonic() > deadline:
            raise RuntimeError(f"the internet's servers did not start: {line!r}")
        yield Internet(netns=ns, ca_pem=ca.dir / "ca.pem", cert=cert, key=key)
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        _quiet("ip", "link", "del", host_if)
        _quiet("ip", "netns", "del", ns)
