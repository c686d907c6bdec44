"""Three real aenv nodes on loopback forming a cluster, for the e2e tests.

`three_nodes(root)` starts node-a (a new cluster), then node-b and node-c
joining through it, sharing a secret, an API key and a `file://` store
under `root`; each has its own home, net prefix and slot range. It points
the e2b SDK (E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY) at node-a for the
block, and on leaving kills what runs, stops the nodes and checks that
nothing of theirs leaked.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from tests.conftest import (
    NodeProc,
    built_home,
    leaks,
    link_home,
    sdk_pointed_at,
    start_node,
    stop_node,
)

TEMPLATE = "busybox"
SECRET = secrets.token_hex(16)
KEY = "aenv_test_" + secrets.token_hex(8)
PREFIX = os.environ.get("AENV_TEST_CLUSTER_PREFIX", "aenvk")
# one /16 of slots per node
CIDRS = os.environ.get("AENV_TEST_CLUSTER_CIDRS", "10.236.0.0/16,10.237.0.0/16,10.238.0.0/16")


class Cluster:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.nodes: dict[str, NodeProc] = {}

    def start(
        self,
        name: str,
        peers: list[str],
        cidr: str,
        *,
        secret: str | None = None,
        store: Path | None = None,
    ) -> NodeProc:
        home = self.root / name
        if not home.exists():
            home.mkdir()
            link_home(built_home(), home)  # type: ignore[arg-type]
        n = start_node(
            home,
            api_key=KEY,
            log_path=home / "node.log",
            extra_env={
                "AENV_NODE_ID": name,
                "AENV_NODE_TAG": "",  # derived from the node id: one per node
                "AENV_NET_PREFIX": f"{PREFIX}{name[-1]}",
                "AENV_SLOT_CIDR": cidr,
                "AENV_CLUSTER_SECRET": secret or SECRET,
                "AENV_CLUSTER_PEERS": ",".join(peers),
                "AENV_STORE_URL": f"file://{store or self.root / 'store'}",
                # the built templates stay on each node (tests/e2e/test_templates_from_store.py)
                "AENV_SHARE_DEFAULT_TEMPLATES": "off",
            },
        )
        self.nodes[name] = n
        return n

    def members(self, name: str) -> dict[str, str]:
        r = httpx.get(
            f"{self.nodes[name].url}/cluster/members", headers={"X-API-Key": KEY}, timeout=10
        )
        r.raise_for_status()
        return {m["nodeID"]: m["state"] for m in r.json()}

    def wait_members(self, want: dict[str, str], within: float = 30.0) -> None:
        deadline = time.monotonic() + within
        seen: dict[str, dict[str, str]] = {}
        while time.monotonic() < deadline:
            seen = {n: self.members(n) for n in self.nodes if n in want and want[n] == "alive"}
            if all(v == want for v in seen.values()):
                return
            time.sleep(0.3)
        raise AssertionError(f"members never became {want}: {seen}")


def owner(c: Cluster, sandbox_id: str) -> str:
    """The node that runs the sandbox (its clientID), asked through node-a."""
    r = httpx.get(
        f"{c.nodes['node-a'].url}/sandboxes/{sandbox_id}", headers={"X-API-Key": KEY}, timeout=10
    )
    r.raise_for_status()
    return str(r.json()["clientID"])


@contextlib.contextmanager
def three_nodes(root: Path) -> Iterator[Cluster]:
    c = Cluster(root)
    cidrs = CIDRS.split(",")
    try:
        a = c.start("node-a", [], cidrs[0])
        c.start("node-b", [a.url], cidrs[1])
        c.start("node-c", [a.url], cidrs[2])
        with sdk_pointed_at(a.url, KEY):
            yield c
    finally:
        for n in c.nodes.values():
            with contextlib.suppress(Exception):
                if n.proc.poll() is None:
                    for sb in httpx.get(
                        f"{n.url}/cluster/v1/sandboxes", headers={"X-API-Key": KEY}, timeout=10
                    ).json():
                        httpx.delete(
                            f"{n.url}/sandboxes/{sb['sandbox_id']}",
                            headers={"X-API-Key": KEY, "x-aenv-hop": "test"},
                            timeout=60,
                        )
            stop_node(n)
        left = [x for n in c.nodes.values() for x in leaks(n.home, PREFIX + n.home.name[-1])]
        assert not left, left
