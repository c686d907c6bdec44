"""`network.egress_proxy` (SOCKS5, "bring your own proxy") on real gVisor sandboxes, through the e2b SDK.

Rules: the "internet" is `tests.egressnet` (netns `{egress prefix}e`) with
`tests.socksserver` on `PROXY_IP:1080` (credentials u/pw), which logs each
CONNECT and dials out from its own address; this file's node admits only the
internet's range and checks names against its resolver. A server answers
`from <its address> ... peer=<client address>`: through the proxy the peer is
`PROXY_IP`, direct it is the node's `HOST_END`. curl in the sandbox pins
names with `--resolve` and gives up after 5 s. The module's node takes the
third quarter of the egress tests' node range, the restarted node the fourth.
"""

from __future__ import annotations

import secrets
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2b import Sandbox

from tests.conftest import (
    NET_PREFIX,
    NodeProc,
    built_home,
    leaks,
    link_home,
    requires_node,
    sdk_pointed_at,
    start_node,
    stop_node,
)
from tests.egressnet import (
    DNS_IP,
    HOST_END,
    NAMES,
    NODE_RANGES,
    PROXY_IP,
    SUBNET,
    Internet,
    internet_fixture,
    socks_fixture,
)
from tests.socksserver import open_socks

pytestmark = [requires_node, pytest.mark.runsc]

CA_IN_SANDBOX = "/tmp/test-ca.pem"
OTHER = NAMES["other.test"][0]
PROXY = {"address": f"{PROXY_IP}:1080", "username": "u", "password": "pw"}
# the quarter of the egress tests' node range that test_egress.py's nodes do not use
SLOTS = NODE_RANGES[2]


internet = internet_fixture("e")
socks = socks_fixture()


@pytest.fixture(scope="module")
def snode(internet: Internet) -> Iterator[NodeProc]:
    home = built_home()
    assert home is not None
    private = Path(tempfile.mkdtemp(prefix="aenv-socks-node-"))
    link_home(home, private)
    env = {
        "AENV_EGRESS_CAP": SUBNET,
        "AENV_EGRESS_DNS": DNS_IP,
        "AENV_SLOT_CIDR": str(SLOTS),
        "AENV_NET_PREFIX": NET_PREFIX + "k",
    }
    try:
        n = start_node(
            private,
            api_key="aenv_test_" + secrets.token_hex(8),
            log_path=private / "node.log",
            extra_env=env,
        )
    except BaseException:
        shutil.rmtree(private, ignore_errors=True)
        raise
    try:
        with sdk_pointed_at(n.url, n.api_key):
            yield n
    finally:
        code = stop_node(n)
        left = leaks(private, NET_PREFIX + "k")
        assert code == 0, f"node exited with {code}:\n{n.log_tail()}"
        assert not left, f"node left behind: {left}"
        shutil.rmtree(private, ignore_errors=True)


def fetch(sbx: Sandbox, url: str) -> str:
    host = url.split("/")[2]
    port = "443" if url.startswith("https") else "80"
    args = ["curl", "-sS", "-m", "5", "--cacert", CA_IN_SANDBOX]
    if host in NAMES:
        args += ["--resolve", f"{host}:{port}:{NAMES[host][0]}"]
    return sbx.commands.run(
        " ".join([*args, url, "2>&1 || echo fail:$?"]), timeout=30
    ).stdout.strip()


def create(internet: Internet, network: dict[str, object]) -> Sandbox:
    sbx = Sandbox.create("base", network=network)  # type: ignore[arg-type]
    sbx.files.write(CA_IN_SANDBOX, internet.ca_pem.read_text())
    return sbx


def test_through_the_proxy_and_kept_across_pause_and_fork(
    snode: NodeProc, internet: Internet, socks: Path
) -> None:
    only = {"allow_out": ["allowed.test", OTHER], "deny_out": ["0.0.0.0/0"], "egress_proxy": PROXY}
    s = create(internet, only)
    forks: list[Sandbox] = []
    try:
        out = fetch(s, "https://allowed.test/")
        assert "sni=allowed.test" in out and out.endswith(f"peer={PROXY_IP}"), out
        assert fetch(s, f"http://{OTHER}/").endswith(f"peer={PROXY_IP}")
        assert "fail:" in fetch(s, "https://cdn.test/")  # filtered before the proxy
        info = (s.get_info().network or {}).get("egress_proxy")
        assert info == {"address": f"{PROXY_IP}:1080", "username": "u"}  # no password
        s.pause()
        s = Sandbox.connect(s.sandbox_id)
        assert fetch(s, f"http://{OTHER}/").endswith(f"peer={PROXY_IP}")
        (child,) = s.fork(count=1)
        assert isinstance(child, Sandbox), child
        forks.append(child)
        assert fetch(child, f"http://{OTHER}/").endswith(f"peer={PROXY_IP}")
        # an update without egress_proxy stops tunnelling (E2B's replace semantics)
        s.update_network({"allow_out": [OTHER], "deny_out": ["0.0.0.0/0"]})
        assert fetch(s, f"http://{OTHER}/").endswith(f"peer={HOST_END}")
        assert "egress_proxy" not in (s.get_info().network or {})
        s.update_network({"egress_proxy": PROXY})  # type: ignore[typeddict-item]
        assert fetch(s, f"http://{OTHER}/").endswith(f"peer={PROXY_IP}")
    finally:
        for f in forks:
            f.kill()
        s.kill()
    log = socks.read_text().splitlines()
    assert log[0] == "CONNECT allowed.test 443 user=u ok", log
    assert log[1:] == [f"CONNECT {OTHER} 80 user=u ok"] * 4, log


def test_fails_closed(snode: NodeProc, internet: Internet, socks: Path, tmp_path: Path) -> None:
    wrong = {"egress_proxy": {**PROXY, "password": "nope"}}
    s = create(internet, wrong)
    try:
        assert "fail:" in fetch(s, f"http://{OTHER}/")
        s.update_network({"egress_proxy": PROXY})  # type: ignore[typeddict-item]
        assert fetch(s, f"http://{OTHER}/").endswith(f"peer={PROXY_IP}")
        with open_socks(internet.netns, PROXY_IP, tmp_path / "b.log", port=1081) as proc:
            s.update_network({"egress_proxy": {"address": f"{PROXY_IP}:1081"}})
            assert fetch(s, f"http://{OTHER}/").endswith(f"peer={PROXY_IP}")
            proc.kill()
            proc.wait()
            assert "fail:" in fetch(s, f"http://{OTHER}/")  # proxy down: nothing goes direct
            assert "fail:" in fetch(s, "https://allowed.test/")
    finally:
        s.kill()
    assert socks.read_text().splitlines() == ["AUTH-FAILED user=u", f"CONNECT {OTHER} 80 user=u ok"]


def test_kept_across_a_node_restart(internet: Internet, socks: Path, tmp_path: Path) -> None:
    home = built_home()
    assert home is not None
    private = tmp_path / "home"
    private.mkdir()
    link_home(home, private)
    prefix = NET_PREFIX + "t"
    env = {
        "AENV_EGRESS_CAP": SUBNET,
        "AENV_EGRESS_DNS": DNS_IP,
        "AENV_SLOT_CIDR": str(NODE_RANGES[3]),
        "AENV_NET_PREFIX": prefix,
        "AENV_ON_STOP": "keep",  # a crashed node's sandboxes run on
    }
    key = "aenv_test_" + secrets.token_hex(8)

    def start() -> NodeProc:
        return start_node(private, api_key=key, log_path=private / "node.log", extra_env=env)

    n = start()
    try:
        with sdk_pointed_at(n.url, key):
            s = create(internet, {"egress_proxy": PROXY})
            assert fetch(s, f"http://{OTHER}/").endswith(f"peer={PROXY_IP}")
        stop_node(n, signal.SIGKILL)
        n = start()
        with sdk_pointed_at(n.url, key):
            s = Sandbox.connect(s.sandbox_id)
            assert fetch(s, f"http://{OTHER}/").endswith(f"peer={PROXY_IP}")
            info = (s.get_info().network or {}).get("egress_proxy")
            assert info == {"address": f"{PROXY_IP}:1080", "username": "u"}
            s.kill()
    finally:
        env["AENV_ON_STOP"] = "stop"
        code = stop_node(n)
        left = leaks(private, prefix)
        assert code == 0, n.log_tail()
        assert not left, left
    assert socks.read_text().splitlines() == [f"CONNECT {OTHER} 80 user=u ok"] * 2
