"""Three real nodes on loopback form a cluster; the real e2b SDK talks to one of them.

Rules: the nodes share a secret and find each other from one peer URL; every
node lists every member alive; creates through one node land on several;
a sandbox on another node is driven through the node the SDK talks to
(commands, files, pause and resume, kill) and lists span the cluster; a
node that dies is reported, and calls for its sandboxes fail at once with
a clear error instead of hanging. Nothing leaks.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
from e2b import Sandbox

from aenv.proto.ownership import SandboxClaim
from tests.conftest import leaks, requires_node, stop_node
from tests.e2e.cluster import CIDRS, KEY, PREFIX, TEMPLATE, Cluster, owner, three_nodes

pytestmark = [requires_node, pytest.mark.runsc]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with three_nodes(tmp_path_factory.mktemp("cluster")) as c:
        yield c


def test_nodes_find_each_other_from_one_peer(cluster: Cluster) -> None:
    everyone = {"node-a": "alive", "node-b": "alive", "node-c": "alive"}
    cluster.wait_members(everyone)
    r = httpx.get(
        f"{cluster.nodes['node-b'].url}/cluster/members", headers={"X-API-Key": KEY}, timeout=10
    )
    me = next(m for m in r.json() if m["nodeID"] == "node-b")
    assert me["url"] == cluster.nodes["node-b"].url
    assert me["load"]["maxSandboxes"] > 0 and me["load"]["memTotal"] > 0
    # the CLI, pointed at any node
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AENV_", "E2B_"))}
    env.update({"AENV_URL": cluster.nodes["node-c"].url, "AENV_API_KEY": KEY, "TERM": "xterm"})
    out = subprocess.run(
        [sys.executable, "-m", "aenv", "cluster", "members", "--output", "json"],
        env=env,
        capture_output=True,
        timeout=60,
        check=True,
    ).stdout
    assert {m["nodeID"]: m["state"] for m in json.loads(out)} == everyone


def test_secrets_and_oidc_keys_are_the_clusters(cluster: Cluster) -> None:
    """A secret created through one node is listed (never its value) by the
    others; every node names one issuer and serves one JWKS (one key ring in
    the store, so a token minted anywhere verifies against any node's JWKS)."""
    value = "sk-cluster-" + os.urandom(8).hex()
    a, b, c = (cluster.nodes[n].url for n in ("node-a", "node-b", "node-c"))
    headers = {"X-API-Key": KEY}
    r = httpx.post(f"{a}/secrets", json={"name": "shared-key", "value": value}, headers=headers)
    assert r.status_code == 201, r.text
    sid = r.json()["secretID"]
    try:
        for url in (b, c):
            listed = httpx.get(f"{url}/secrets", headers=headers)
            assert [s["secretID"] for s in listed.json() if s["name"] == "shared-key"] == [sid]
            assert value not in listed.text
        issuers = {
            httpx.get(f"{u}/.well-known/openid-configuration").json()["issuer"] for u in (a, b, c)
        }
        assert issuers == {a.rstrip("/")}
        jwks = [httpx.get(f"{u}/.well-known/jwks.json").json() for u in (a, b, c)]
        assert jwks[0] == jwks[1] == jwks[2] and jwks[0]["keys"]
        stored = b"".join(
            p.read_bytes() for p in (cluster.root / "store").rglob("*") if p.is_file()
        )
        assert value.encode() not in stored and b"PRIVATE KEY" not in stored
    finally:
        assert httpx.delete(f"{b}/secrets/{sid}", headers=headers).status_code == 204
    assert httpx.get(f"{c}/secrets/{sid}", headers=headers).status_code == 404


def test_a_node_without_the_secret_gets_no_membership(cluster: Cluster) -> None:
    everyone = {"node-a": "alive", "node-b": "alive", "node-c": "alive"}
    cluster.wait_members(everyone)
    a = cluster.nodes["node-a"]
    wrong = "not-" + "s" * 16
    # On the cluster's store, the wrong secret cannot open the cluster's key
    # ring: the node refuses to start and says why.
    with pytest.raises(RuntimeError, match="AENV_CLUSTER_SECRET"):
        cluster.start("node-y", [a.url], "10.239.0.0/16", secret=wrong)
    assert not leaks(cluster.root / "node-y", f"{PREFIX}y")
    # With a store of its own it starts, and the cluster will not have it.
    own = cluster.root / "intruder-store"
    own.mkdir()
    intruder = cluster.start("node-x", [a.url], "10.239.0.0/16", secret=wrong, store=own)
    try:
        deadline = time.monotonic() + 20
        while "refused a cluster connection" not in a.log_path.read_text():
            assert time.monotonic() < deadline, "node-a never logged the refusal"
            time.sleep(0.3)
        time.sleep(2)  # a few probe rounds: nobody learns of it, it learns of nobody
        assert cluster.members("node-a") == everyone
        assert cluster.members("node-x") == {"node-x": "alive"}
    finally:
        stop_node(intruder)
        del cluster.nodes["node-x"]
    assert not leaks(intruder.home, f"{PREFIX}x")


def test_a_sandbox_on_another_node_is_driven_through_this_one(cluster: Cluster) -> None:
    cluster.wait_members({"node-a": "alive", "node-b": "alive", "node-c": "alive"})
    boxes = [Sandbox.create(TEMPLATE, timeout=120, metadata={"suite": "cluster"}) for _ in range(6)]
    try:
        owners = {b.sandbox_id: owner(cluster, b.sandbox_id) for b in boxes}
        assert set(owners.values()) <= {"node-a", "node-b", "node-c"}
        assert len(set(owners.values())) >= 2, owners  # creates spread
        # each sandbox is claimed in the shared store by the node that runs it
        claims = cluster.root / "store" / "cluster" / "sandboxes"
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            held = {
                p.name: SandboxClaim.decode(p.read_bytes()).node
                for p in claims.glob("*")
                if p.name in owners
            }
            if held == owners:
                break
            time.sleep(0.2)
        assert held == owners
        remote = next(b for b in boxes if owners[b.sandbox_id] != "node-a")
        # commands, files, through node-a to the owner
        assert remote.commands.run("echo hi").stdout.strip() == "hi"
        remote.files.write("/tmp/x.txt", "kept")
        remote.commands.run("sleep 600 >/dev/null 2>&1 &", background=True)
        # pause and resume on its node, through node-a
        remote.pause()
        listed = {s.sandbox_id: s.state for s in Sandbox.list(query=None).next_items()}
        assert set(listed) >= {b.sandbox_id for b in boxes}, listed
        again = Sandbox.connect(remote.sandbox_id)
        assert again.files.read("/tmp/x.txt") == "kept"
        # every node lists every sandbox
        for n in cluster.nodes.values():
            ids = {
                s["sandboxID"]
                for s in httpx.get(
                    f"{n.url}/sandboxes", headers={"X-API-Key": KEY}, timeout=10
                ).json()
            }
            assert ids >= set(owners), (n.url, ids)
    finally:
        for b in boxes:
            with contextlib.suppress(Exception):
                b.kill()
    for b in boxes:
        assert (
            httpx.get(
                f"{cluster.nodes['node-a'].url}/sandboxes/{b.sandbox_id}",
                headers={"X-API-Key": KEY},
                timeout=10,
            ).status_code
            == 404
        )


def test_a_dead_nodes_sandboxes_fail_fast_and_it_is_reported(cluster: Cluster) -> None:
    cluster.wait_members({"node-a": "alive", "node-b": "alive", "node-c": "alive"})
    c = cluster.nodes["node-c"]
    sb = Sandbox.create(TEMPLATE, timeout=120)  # until one lands on node-c
    tries = [sb]
    while owner(cluster, sb.sandbox_id) != "node-c" and len(tries) < 12:
        sb = Sandbox.create(TEMPLATE, timeout=120)
        tries.append(sb)
    for other in tries[:-1]:
        other.kill()
    if owner(cluster, sb.sandbox_id) != "node-c":
        sb.kill()
        pytest.fail("no create landed on node-c in 12 tries")
    stop_node(c, signal.SIGKILL)
    cluster.wait_members({"node-a": "alive", "node-b": "alive", "node-c": "dead"}, within=30)
    url = cluster.nodes["node-a"].url
    t0 = time.monotonic()
    r = httpx.get(f"{url}/sandboxes/{sb.sandbox_id}", headers={"X-API-Key": KEY}, timeout=30)
    assert time.monotonic() - t0 < 5
    assert r.status_code == 503 and "node-c" in r.json()["message"], r.text
    # it comes back (same home): the sandbox kept running and is served again
    cluster.start("node-c", [url], CIDRS.split(",")[2])
    cluster.wait_members({"node-a": "alive", "node-b": "alive", "node-c": "alive"}, within=30)
    assert Sandbox.connect(sb.sandbox_id).commands.run("echo back").stdout.strip() == "back"
    Sandbox.kill(sb.sandbox_id)
