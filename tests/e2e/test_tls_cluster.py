"""Two real nodes serving TLS; the real e2b SDK finds sandboxes by host name under a wildcard domain.

Rules: the test makes a CA and a certificate for `*.aenv.test` (and
127.0.0.1, the nodes' advertise address); both nodes serve it, trust the
CA for each other (`AENV_TLS_CA`) and form a cluster over `https://` URLs;
`AENV_DOMAIN=aenv.test`. The SDK is configured as against E2B's cloud but
with `E2B_DOMAIN=aenv.test` (no `E2B_API_URL`, no `E2B_SANDBOX_URL`), so it
calls `https://api.aenv.test` and `https://{port}-{id}.aenv.test`, and
trusts the CA through `SSL_CERT_FILE`.

Names: no resolver on this machine knows `*.aenv.test` and /etc/hosts has no
wildcards, so each node is reached through an HTTP CONNECT proxy made by the
test (the SDK's `proxy` option), which stands in for wildcard DNS: it
connects any `*.aenv.test:443` tunnel to one node's port and sees only
ciphertext. TLS (SNI, the wildcard certificate's verification, h2 by ALPN)
is end to end between the SDK and the node. A sandbox is driven through its
own node and through the other one. SIGHUP makes a node serve a renewed
certificate. Nothing leaks.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox

from tests.conftest import (
    NodeProc,
    built_home,
    leaks,
    link_home,
    requires_node,
    start_node,
    stop_node,
)
from tests.tlscerts import TestCA, common_name

pytestmark = [requires_node, pytest.mark.runsc]

DOMAIN = "aenv.test"
TEMPLATE = os.environ.get("AENV_TEST_TEMPLATE", "base")
SECRET = secrets.token_hex(16)
KEY = "aenv_test_" + secrets.token_hex(8)
PREFIXES = os.environ.get("AENV_TEST_TLS_PREFIXES", "aenvt,aenvu").split(",")
CIDRS = os.environ.get("AENV_TEST_TLS_CIDRS", "10.234.0.0/16,10.235.0.0/16").split(",")


@dataclass
class ConnectProxy:
    """A CONNECT proxy that tunnels `*.{DOMAIN}:443` to one loopback port."""

    target: int
    port: int = 0
    tunnels: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._tunnel, args=(client,), daemon=True).start()

    def _tunnel(self, client: socket.socket) -> None:
        with client:
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = client.recv(4096)
                if not chunk:
                    return
                head += chunk
            method, authority, _ = head.split(b"\r\n", 1)[0].decode().split(" ", 2)
            host, _, port = authority.rpartition(":")
            if method != "CONNECT" or port != "443" or not host.endswith("." + DOMAIN):
                client.sendall(b"HTTP/1.1 403 Forbidden\r\ncontent-length: 0\r\n\r\n")
                return
            self.tunnels.append(host)
            with socket.create_connection(("127.0.0.1", self.target)) as upstream:
                client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
                back = threading.Thread(target=_pipe, args=(upstream, client), daemon=True)
                back.start()
                _pipe(client, upstream)
                back.join(timeout=5)


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)


@dataclass
class TLSCluster:
    root: Path
    ca: TestCA
    nodes: dict[str, NodeProc]
    proxies: dict[str, ConnectProxy]

    def port(self, name: str) -> int:
        return int(self.nodes[name].url.rsplit(":", 1)[1])

    def client(self, **kw: object) -> httpx.Client:
        ctx = ssl.create_default_context(cafile=str(self.ca.pem))
        return httpx.Client(verify=ctx, headers={"X-API-Key": KEY}, timeout=30, **kw)  # type: ignore[arg-type]


def _tls_files(ca: TestCA, name: str) -> tuple[Path, Path]:
    return ca.issue(name, dns=[f"*.{DOMAIN}", DOMAIN], ips=["127.0.0.1"])


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TLSCluster]:
    root = tmp_path_factory.mktemp("tls")
    ca = TestCA(root / "ca")
    c = TLSCluster(root, ca, {}, {})
    try:
        for i, name in enumerate(("node-a", "node-b")):
            home = root / name
            home.mkdir()
            link_home(built_home(), home)  # type: ignore[arg-type]
            cert, key = _tls_files(ca, name)  # one pair per node: SIGHUP tests renew one
            c.nodes[name] = start_node(
                home,
                api_key=KEY,
                log_path=home / "node.log",
                tls_ca=ca.pem,
                extra_env={
                    "AENV_TLS_CERT": str(cert),
                    "AENV_TLS_KEY": str(key),
                    "AENV_TLS_CA": str(ca.pem),
                    "AENV_DOMAIN": DOMAIN,
                    "AENV_NODE_ID": name,
                    "AENV_NODE_TAG": "",
                    "AENV_NET_PREFIX": PREFIXES[i],
                    "AENV_SLOT_CIDR": CIDRS[i],
                    "AENV_CLUSTER_SECRET": SECRET,
                    "AENV_CLUSTER_PEERS": c.nodes["node-a"].url if i else "",
                    "AENV_STORE_URL": f"file://{root / 'store'}",
                    "AENV_SHARE_DEFAULT_TEMPLATES": "off",
                },
            )
            c.proxies[name] = ConnectProxy(c.port(name))
        yield c
    finally:
        for p in c.proxies.values():
            p.close()
        codes = {name: stop_node(n) for name, n in c.nodes.items()}
        left = [x for i, n in enumerate(c.nodes.values()) for x in leaks(n.home, PREFIXES[i])]
        assert not left, left
        assert set(codes.values()) <= {0}, codes


@pytest.fixture
def sdk_env(tls_cluster: TLSCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """The SDK as against a cloud at DOMAIN, trusting the test's CA."""
    for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_DEBUG"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("E2B_DOMAIN", DOMAIN)
    monkeypatch.setenv("E2B_API_KEY", KEY)
    monkeypatch.setenv("SSL_CERT_FILE", str(tls_cluster.ca.pem))


def test_the_nodes_form_a_cluster_over_verified_tls(tls_cluster: TLSCluster) -> None:
    deadline = time.monotonic() + 30
    with tls_cluster.client() as http:
        while True:
            seen = {
                name: {m["nodeID"]: (m["state"], m["url"]) for m in r.json()}
                for name, n in tls_cluster.nodes.items()
                if (r := http.get(f"{n.url}/cluster/members")).status_code == 200
            }
            want = {name: ("alive", n.url) for name, n in tls_cluster.nodes.items()}
            if all(v == want for v in seen.values()) and len(seen) == 2:
                break
            assert time.monotonic() < deadline, f"members never all alive over https: {seen}"
            time.sleep(0.3)
    assert all(n.url.startswith("https://") for n in tls_cluster.nodes.values())


def test_the_sdk_reaches_a_sandbox_by_host_name_through_either_node(
    tls_cluster: TLSCluster, sdk_env: None
) -> None:
    via_a, via_b = tls_cluster.proxies["node-a"], tls_cluster.proxies["node-b"]
    sbx = Sandbox.create(TEMPLATE, proxy=via_a.url, timeout=120)
    try:
        sid = sbx.sandbox_id
        assert sbx.commands.run("echo over tls").stdout == "over tls\n"
        assert f"49983-{sid}.{DOMAIN}" in via_a.tunnels  # envd by host, over the tunnel
        assert "api." + DOMAIN in via_a.tunnels
        sbx.files.write("/tmp/note.txt", "written via node-a")
        sbx.commands.run("python3 -m http.server 8080 -d /tmp", background=True)
        with tls_cluster.client() as http:
            owner = http.get(f"{tls_cluster.nodes['node-a'].url}/sandboxes/{sid}").json()
        assert owner["domain"] == DOMAIN
        # the same sandbox through the other node: one of the two is not its owner
        again = Sandbox.connect(sid, proxy=via_b.url)
        assert again.files.read("/tmp/note.txt") == "written via node-a"
        assert f"49983-{sid}.{DOMAIN}" in via_b.tunnels
        assert again.commands.run("cat /tmp/note.txt").stdout == "written via node-a"
        # a user's port by host name, h2 over TLS, through both nodes
        for proxy in (via_a, via_b):
            with tls_cluster.client(proxy=proxy.url, http2=True) as http:
                deadline = time.monotonic() + 20
                while (r := http.get(f"https://8080-{sid}.{DOMAIN}/note.txt")).status_code != 200:
                    assert time.monotonic() < deadline, r.text
                    time.sleep(0.3)
                assert (r.http_version, r.text) == ("HTTP/2", "written via node-a")
        assert owner["clientID"] in tls_cluster.nodes
    finally:
        sbx.kill()


def _served_name(port: int, ca: Path) -> str:
    ctx = ssl.create_default_context(cafile=str(ca))
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        ctx.wrap_socket(raw, server_hostname="api." + DOMAIN) as tls,
    ):
        der = tls.getpeercert(binary_form=True)
        assert der is not None
        return common_name(der)


def test_sighup_serves_a_renewed_certificate(tls_cluster: TLSCluster) -> None:
    node = tls_cluster.nodes["node-b"]
    port = tls_cluster.port("node-b")
    assert _served_name(port, tls_cluster.ca.pem) == "node-b"
    cert, key = _tls_files(tls_cluster.ca, "node-b-renewed")
    cert.replace(tls_cluster.ca.dir / "node-b.pem")
    key.replace(tls_cluster.ca.dir / "node-b.key")
    node.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while _served_name(port, tls_cluster.ca.pem) != "node-b-renewed":
        assert time.monotonic() < deadline, node.log_tail()
        time.sleep(0.2)
    assert node.proc.poll() is None
    assert "TLS certificate reloaded" in node.log_path.read_text()
