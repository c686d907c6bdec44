"""The cluster lab itself: real nodes in network namespaces, a shared S3 store, real faults.

Rules: one lab of three nodes for the module (tests/cluster/lab.py), healthy
at the start of each test; the e2b SDK is pointed at one node per call
(`**node.sdk()`), never through the environment. Reachability between
nodes is checked with curl from inside a node's namespace (`Lab.probe`),
with short limits: a partitioned peer is silent, so a probe fails by its
timeout. The lab's "internet" is a listener this file binds to the lab's
internet address in the root namespace; sandboxes reach nothing else.
Every sandbox a test creates is killed by that test.
"""

from __future__ import annotations

import socketserver
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from ipaddress import ip_address, ip_network

import httpx
import pytest
from e2b import Sandbox

from tests.cluster.lab import GATEWAY_IP, INTERNET_IP, OFF_CAP_IP, Lab, LabNode, requires_lab

# independent nodes: these tests are about the lab itself (each node, its faults)
pytestmark = [
    requires_lab,
    pytest.mark.runsc,
    pytest.mark.lab(nodes=3, store="s3", cluster=False),
]


class _Whoami(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        self.request.sendall(f"HTTP/1.0 200 OK\r\n\r\nfrom {self.client_address[0]}\n".encode())


@pytest.fixture
def internet(lab: Lab) -> Iterator[tuple[str, str]]:
    """HTTP servers on free ports that answer with the caller's address: one at the
    lab's internet address (inside the nodes' egress cap), one outside it; their URLs."""
    servers = [
        socketserver.ThreadingTCPServer((ip, 0), _Whoami) for ip in (INTERNET_IP, OFF_CAP_IP)
    ]
    threads = [
        threading.Thread(target=s.serve_forever, kwargs={"poll_interval": 0.05}) for s in servers
    ]
    for thread in threads:
        thread.start()
    try:
        inside, outside = (
            f"http://{ip}:{s.server_address[1]}/"
            for ip, s in zip((INTERNET_IP, OFF_CAP_IP), servers, strict=True)
        )
        yield inside, outside
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()
        for thread in threads:
            thread.join()


def _curl(sbx: Sandbox, url: str) -> str:
    return sbx.commands.run(f"curl -s -m 3 {url} || echo fail:$?", timeout=20).stdout.strip()


def _health(node: LabNode, timeout: float = 2.0) -> int | None:
    try:
        return httpx.get(f"{node.url}/health", timeout=timeout).status_code
    except httpx.TransportError:
        return None


def test_three_nodes_each_run_sandboxes_through_the_sdk(lab: Lab) -> None:
    def on(node: LabNode) -> tuple[str, str, str]:
        sbx = Sandbox.create("base", timeout=120, **node.sdk())
        try:
            out = sbx.commands.run("echo hello from $(hostname); ip -4 -o addr show eth0").stdout
            sbx.files.write("/tmp/where", node.node_id)
            return sbx.sandbox_id, out, sbx.files.read("/tmp/where")
        finally:
            sbx.kill()

    with ThreadPoolExecutor(len(lab.nodes)) as pool:
        results = list(pool.map(on, lab.nodes))
    for node, (sandbox_id, out, where) in zip(lab.nodes, results, strict=True):
        assert sandbox_id.endswith(node.env["AENV_NODE_TAG"])  # made by the node it was sent to
        assert "hello from" in out
        address = out.split(" inet ")[1].split("/")[0]
        assert ip_address(address) in ip_network(node.slot_cidr), (node.slot_cidr, out)
        assert where == node.node_id


def test_sandbox_egress_leaves_through_its_node_and_stays_off_the_lab(
    lab: Lab, internet: tuple[str, str]
) -> None:
    inside_cap, outside_cap = internet
    node, other = lab.node(1), lab.node(0)
    sbx = Sandbox.create("base", timeout=120, **node.sdk())
    try:
        # masqueraded by the node's namespace: the internet sees the node's lab address
        assert _curl(sbx, inside_cap) == f"from {node.ip}"
        # the lab network is private and the rest is beyond the egress cap: another
        # node, the gateway, the store and the other internet host refuse at once
        assert lab.s3 is not None
        for url in (f"{other.url}/health", f"http://{GATEWAY_IP}/", lab.s3.endpoint, outside_cap):
            t0 = time.monotonic()
            assert _curl(sbx, url).startswith("fail:"), url
            assert time.monotonic() - t0 < 3, f"{url}: a refused destination must fail at once"
    finally:
        sbx.kill()


def test_a_partition_cuts_nodes_from_each_other_not_from_the_rest(lab: Lab) -> None:
    assert lab.reachable(1, 0) and lab.reachable(0, 1)
    lab.partition(0, 1)
    assert not lab.reachable(1, 0, timeout=1)
    assert not lab.reachable(0, 1, timeout=1)
    # a third node, the test process and the store still reach both
    assert lab.reachable(2, 0) and lab.reachable(2, 1)
    assert _health(lab.node(0)) == 200 and _health(lab.node(1)) == 200
    assert lab.s3 is not None
    assert lab.probe(0, lab.s3.endpoint) is not None
    lab.heal()
    assert lab.reachable(1, 0) and lab.reachable(0, 1)

    lab.isolate(2)
    assert not any(lab.reachable(2, i, timeout=1) for i in (0, 1))
    assert lab.reachable(0, 1)
    lab.heal(2, [0, 1])
    assert all(lab.reachable(2, i) for i in (0, 1))


def test_a_node_cut_from_the_store_cannot_reach_it_until_restored(lab: Lab) -> None:
    assert lab.s3 is not None
    store = lab.s3.endpoint
    lab.cut_store(0)
    assert lab.probe(0, store, timeout=1) is None
    assert lab.probe(1, store) is not None
    assert lab.reachable(1, 0)  # only the store is cut
    lab.restore_store(0)
    assert lab.probe(0, store) is not None


def test_a_durable_snapshot_from_one_node_starts_on_another(lab: Lab) -> None:
    """The nodes share the store: what node 0 uploads, node 2 restores."""
    src = Sandbox.create("base", timeout=120, **lab.node(0).sdk())
    try:
        src.files.write("/tmp/kept.txt", "made on node 0")
        with lab.node(0).client(timeout=120) as api:
            r = api.post(f"/sandboxes/{src.sandbox_id}/snapshots", json={"durable": True})
        assert r.status_code == 201, r.text
        assert r.json()["storage"] == "durable"
        snapshot_id = r.json()["snapshotID"]
    finally:
        src.kill()
    child = Sandbox.create(snapshot_id, timeout=120, **lab.node(2).sdk())
    try:
        assert child.sandbox_id.endswith(lab.node(2).env["AENV_NODE_TAG"])
        assert child.files.read("/tmp/kept.txt") == "made on node 0"
    finally:
        child.kill()


def test_kill_9_and_restart_keeps_the_nodes_sandbox(lab: Lab) -> None:
    node = lab.node(2)
    sbx = Sandbox.create("base", timeout=300, **node.sdk())
    try:
        sbx.files.write("/tmp/kept.txt", "before the crash")
        sbx.commands.run("sleep 600", background=True)
        lab.kill_node(2)
        assert _health(node, timeout=1) is None
        lab.start_node(2)
        again = Sandbox.connect(sbx.sandbox_id, **node.sdk())
        assert again.files.read("/tmp/kept.txt") == "before the crash"
        assert "sleep 600" in again.commands.run("ps -o args").stdout
    finally:
        sbx.kill()


def test_a_stopped_node_times_out_and_continues(lab: Lab) -> None:
    lab.pause_node(1)
    with pytest.raises(httpx.ReadTimeout):  # the kernel accepts, nobody answers
        httpx.get(f"{lab.node(1).url}/health", timeout=1)
    assert not lab.reachable(0, 1, timeout=1)
    lab.resume_node(1)
    assert _health(lab.node(1)) == 200
    assert lab.reachable(0, 1)


def test_loss_fails_some_requests_and_retries_get_through(lab: Lab) -> None:
    node = lab.node(1)
    lab.set_loss(1, 30)
    # a lost SYN is sent again after 1 s: a new connection with a shorter limit fails
    results = [_health(node, timeout=0.5) for _ in range(20)]
    failed = results.count(None)
    assert 0 < failed < 20, results
    # retried, every request gets through
    for _ in range(5):
        for _attempt in range(10):
            if _health(node, timeout=2) == 200:
                break
        else:
            raise AssertionError("ten tries of a request all failed at 30 % loss")
    lab.set_loss(1, 0)
    assert [_health(node, timeout=0.5) for _ in range(20)] == [200] * 20


def test_delay_slows_a_nodes_link(lab: Lab) -> None:
    if not lab.has_netem:
        pytest.skip("this kernel has no sch_netem (loss works without it)")
    node = lab.node(0)
    lab.set_delay(0, 200)
    t0 = time.monotonic()
    assert _health(node) == 200
    assert time.monotonic() - t0 >= 0.4  # two round trips: connect, request
    lab.set_delay(0, 0)
