"""Volumes in a cluster of two real nodes, with the real `e2b` SDK pointed at the other one.

Rules: node-a and node-b (tests/e2e/cluster.py: own homes, net prefixes and
slot ranges, one `file://` store); the volume is made on node-a, and every
call after that goes to node-b: the list is cluster-wide, calls about the
volume (detail, content API, delete) reach node-a, and a sandbox that mounts
it is placed on node-a, where its files are. Everything made is removed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox, Volume

from tests.conftest import leaks, requires_node, sdk_pointed_at, stop_node
from tests.e2e.cluster import CIDRS, KEY, PREFIX, TEMPLATE, Cluster, owner

pytestmark = [requires_node, pytest.mark.runsc]


def _wait_holder(c: Cluster, on: str, volume_id: str, within: float = 30.0) -> None:
    """Until node `on` has heard (gossip) that node-a holds the volume."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        r = httpx.get(f"{c.nodes[on].url}/cluster/members", headers={"X-API-Key": KEY})
        loads = {m["nodeID"]: m.get("load") or {} for m in r.json()}
        if volume_id in (loads.get("node-a") or {}).get("volumes", []):
            return
        time.sleep(0.3)
    raise AssertionError(f"node {on} never heard that node-a holds {volume_id}")


@pytest.fixture
def two(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    cidrs = CIDRS.split(",")
    try:
        a = c.start("node-a", [], cidrs[0])
        c.start("node-b", [a.url], cidrs[1])
        c.wait_members({"node-a": "alive", "node-b": "alive"})
        yield c
    finally:
        for n in c.nodes.values():
            stop_node(n)
        left = [x for n in c.nodes.values() for x in leaks(n.home, PREFIX + n.home.name[-1])]
        assert not left, left


def test_calls_through_another_node_reach_the_volume(
    two: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = two.nodes["node-a"], two.nodes["node-b"]
    with sdk_pointed_at(a.url, KEY):
        vol = Volume.create("shared")
    _wait_holder(two, "node-b", vol.volume_id)
    monkeypatch.setenv("E2B_VOLUME_API_URL", b.url)
    with sdk_pointed_at(b.url, KEY):
        assert vol.volume_id in [v.volume_id for v in Volume.list()]
        with pytest.raises(Exception, match="already exists"):
            Volume.create("shared")  # names are the cluster's
        again = Volume.connect(vol.volume_id)
        assert again.token == vol.token
        again.write_file("/via-b.txt", "written through node-b")
        s = Sandbox.create(TEMPLATE, timeout=120, volume_mounts={"/mnt/s": "shared"})
        try:
            assert owner(two, s.sandbox_id) == "node-a"  # where the volume is
            assert s.commands.run("cat /mnt/s/via-b.txt").stdout == "written through node-b"
            with pytest.raises(Exception, match="mounted by"):
                Volume.destroy(vol.volume_id)
        finally:
            s.kill()
        assert Volume.destroy(vol.volume_id) is True
        assert os.path.exists(a.home / "volumes") and not list((a.home / "volumes").iterdir())


@pytest.mark.slow
def test_a_drain_moves_a_volume_with_the_sandboxes_sharing_it(
    two: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = two.nodes["node-a"], two.nodes["node-b"]
    with sdk_pointed_at(a.url, KEY):
        vol = Volume.create("moving")
        _wait_holder(two, "node-a", vol.volume_id)  # node-a has measured it: placed there
        s1 = Sandbox.create(TEMPLATE, timeout=300, volume_mounts={"/mnt/m": "moving"})
        s2 = Sandbox.create(TEMPLATE, timeout=300, volume_mounts={"/work": "moving"})
        assert {owner(two, s.sandbox_id) for s in (s1, s2)} == {"node-a"}
        s1.commands.run("echo one > /mnt/m/one")
        s2.commands.run("echo two > /work/two")
    r = httpx.post(f"{a.url}/cluster/nodes/self/drain", headers={"X-API-Key": KEY}, timeout=600)
    assert r.status_code == 200, r.text
    report = r.json()
    assert (report["moved"], report["failed"]) == (2, {}), report
    assert {m["to"] for m in report["sandboxes"]} == {"node-b"}  # together
    assert not list((a.home / "volumes").iterdir())  # the volume left node-a
    monkeypatch.setenv("E2B_VOLUME_API_URL", b.url)
    with sdk_pointed_at(b.url, KEY):
        t1, t2 = Sandbox.connect(s1.sandbox_id), Sandbox.connect(s2.sandbox_id)
        try:
            assert t1.commands.run("cat /mnt/m/one /mnt/m/two").stdout == "one\ntwo\n"
            t2.commands.run("echo after > /work/after")
            assert t1.commands.run("cat /mnt/m/after").stdout == "after\n"  # one copy
            moved = Volume.connect(vol.volume_id)
            assert (moved.token, moved.read_file("/after")) == (vol.token, "after\n")
        finally:
            t1.kill()
            t2.kill()
        assert Volume.destroy(vol.volume_id) is True
