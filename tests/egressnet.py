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

Shared by the egress tests and bench/egress.py: `internet_fixture(suffix)`
(a module's internet), `socks_fixture()` (a SOCKS5 server in it),
`open_proxied_network` (the node's host network and egress proxy without
runsc), `policy` and `curl` (a request from a slot's namespace).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio

from aenv.node.egress import (
    EgressEvent,
    EgressProxy,
    Resolver,
    listener_port,
    open_egress_listener,
)
from aenv.proto.netpolicy import EgressPolicy
from aenv.runtimes.netns import HostNetwork, NetSlot, open_host_network
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
SOCKS_USER, SOCKS_PASSWORD = "u", "pw"
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


# -- what the egress tests and bench/egress.py share ---------------------------------


def internet_fixture(suffix: str) -> Any:
    """A module-scoped `internet` fixture: the internet in namespace `PREFIX + suffix`
    (one suffix per test module, so modules running at once never share one)."""

    @pytest.fixture(scope="module")
    def internet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Internet]:
        with open_internet(tmp_path_factory.mktemp("internet"), prefix=PREFIX + suffix) as net:
            yield net

    return internet


def socks_fixture() -> Any:
    """A `socks` fixture: `tests.socksserver` on `PROXY_IP:1080` in the module's
    internet, credentials `SOCKS_USER`/`SOCKS_PASSWORD`, for one test; the
    path of its log (one line per CONNECT)."""

    @pytest.fixture
    def socks(internet: Internet, tmp_path: Path) -> Iterator[Path]:
        from tests.socksserver import open_socks

        log = tmp_path / "socks.log"
        with open_socks(
            internet.netns, PROXY_IP, log, names=NAMES, user=SOCKS_USER, password=SOCKS_PASSWORD
        ):
            yield log

    return socks


def policy(**network: object) -> EgressPolicy:
    """The egress policy of a create body's `network` (E2B wire names)."""
    return EgressPolicy.from_request(allow_internet_access=None, network=network)


@dataclass
class Proxied:
    network: HostNetwork
    proxy: EgressProxy
    port: int


@contextlib.asynccontextmanager
async def open_proxied_network(
    *,
    prefix: str,
    slots: str,
    events: list[EgressEvent] | None = None,
    intercept: Any = None,
) -> AsyncIterator[Proxied]:
    """The node's host network without runsc: a `HostNetwork` (names `prefix`,
    sandbox addresses in `slots`, egress capped to the internet's `SUBNET`)
    whose host-name rules go to the node's `EgressProxy`, asking the
    internet's resolver, in this process."""
    async with (
        await open_egress_listener() as listener,
        open_host_network(
            cidr=slots,
            prefix=prefix,
            table=prefix,
            max_slots=4,
            egress_cap=[SUBNET],
            proxy_port=listener_port(listener),
        ) as network,
        trio.open_nursery() as nursery,
    ):
        proxy = EgressProxy(
            policies=network,
            resolver=Resolver([DNS_IP]),
            on_event=events.append if events is not None else (lambda _e: None),
            intercept=intercept,
        )
        await nursery.start(proxy.serve, listener)
        yield Proxied(network, proxy, listener_port(listener))
        nursery.cancel_scope.cancel()


async def curl(slot: NetSlot, ca: Path, url: str, *, to: str | None = None, host: str = "") -> str:
    """curl `url` in the slot's namespace, its name pinned to `to` (default: its
    real address), trusting `ca`, 5 s at most: the answer, or "refused"."""
    name = url.split("/")[2]
    port = "443" if url.startswith("https") else "80"
    argv = ["ip", "netns", "exec", slot.netns_name, "curl", "-sS", "-m", "5", "--cacert", str(ca)]
    if name in NAMES:
        argv += ["--resolve", f"{name}:{port}:{to or NAMES[name][0]}"]
    if host:
        argv += ["-H", f"Host: {host}"]
    done = await trio.run_process(
        [*argv, url], capture_stdout=True, capture_stderr=True, check=False
    )
    return (done.stdout or done.stderr).decode().strip() if done.returncode == 0 else "refused"
