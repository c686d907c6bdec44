"""Cold restores from the object store when things break: real nodes, runsc, moto, e2b SDK.

Rules: each test runs its own nodes (tests/e2e/nodes.py: private homes
linked to the built one) against its own moto server on loopback
(tests/s3.py), on a netns prefix and slot range of their own
(AENV_TEST_COLD_PREFIX / AENV_TEST_COLD_CIDR, to run beside another suite).
Faults: the store server killed a few requests into a restore, and a node's
local copy of a restored memory image torn behind its back, as a crash
before the kernel flushed it would leave it (a restore does not flush the
image it fetched: the store holds it). Either way the user sees a clear
error or a sandbox with its state, never a wrong one, and nothing of the
nodes leaks. A node holding an earlier image of a sandbox restores its later
snapshot mostly from that image.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2b import Sandbox

# Fixtures are imported by name, so test parameters shadow them (F811).
# ruff: noqa: F811
from tests.conftest import requires_node
from tests.e2e.counter import COUNTER, count, counts_on
from tests.e2e.nodes import Nodes
from tests.s3 import MotoS3, s3_faulty  # noqa: F401

pytestmark = [requires_node, pytest.mark.runsc]

PREFIX = os.environ.get("AENV_TEST_COLD_PREFIX", "aenvm")
CIDR = os.environ.get("AENV_TEST_COLD_CIDR", "10.218.0.0/16")


@pytest.fixture
def nodes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, s3_faulty: MotoS3) -> Iterator[Nodes]:
    with Nodes(
        tmp_path, s3_faulty, monkeypatch, net_prefix=PREFIX, cidr=CIDR, store_prefix="cold"
    ) as n:
        yield n


def test_a_store_lost_mid_restore_fails_clearly_and_every_later_restore_is_whole(
    nodes: Nodes,
) -> None:
    nodes.start("a")
    src = Sandbox.create("busybox", timeout=300)
    try:
        src.commands.run(COUNTER, background=True)
        src.commands.run("head -c 2000000 /dev/urandom > /tmp/blob")
        blob_sum = src.commands.run("md5sum /tmp/blob").stdout.split()[0]
        counts_on(src)
        before = count(src)
        info = nodes.snapshot(src.sandbox_id, durable=True)
        assert info["storage"] == "durable", info
        sid = info["snapshotID"]
        src.commands.run("echo later > /tmp/later")
        info = nodes.snapshot(src.sandbox_id, durable=True)
        assert info["storage"] == "durable", info
        sid2 = info["snapshotID"]
    finally:
        src.kill()
    nodes.stop()

    # the store dies a few requests into the restore (manifest, layer index, page
    # maps, then the memory packs): the create fails naming the snapshot
    nodes.start("b")
    home = nodes.home("b")
    nodes.s3.kill_after(4)
    r = nodes.post("/sandboxes", {"templateID": sid})
    assert r.status_code == 500, r.text
    assert sid in r.json()["message"], r.text
    assert not nodes.s3.running
    assert [p.name for p in (home / "snapshots").iterdir()] == []  # nothing half there
    assert list((home / "layers" / "layers").glob("*")) == []

    # the store is back: the same node restores it, whole
    nodes.s3.start()
    s = Sandbox.create(sid, timeout=120)
    try:
        assert s.commands.run("md5sum /tmp/blob").stdout.split()[0] == blob_sum
        assert count(s) >= before
        counts_on(s)
    finally:
        s.kill()
    nodes.stop()

    # a crash tore the local copy of the image (never flushed): the next node
    # process notices (it checks a snapshot once before its first use) and
    # fetches the image again rather than restore garbage
    pages = home / "snapshots" / sid / "image" / "pages.img"
    size = pages.stat().st_size
    with pages.open("r+b") as f:
        f.seek(size // 2)
        f.write(bytes(min(1 << 20, size - size // 2)))
    nodes.start("b")
    s = Sandbox.create(sid, timeout=120)
    try:
        assert s.commands.run("md5sum /tmp/blob").stdout.split()[0] == blob_sum
        counts_on(s)
    finally:
        s.kill()
    log = (home / "node.log").read_text()
    assert log.count(f"restored snapshot {sid} from the object store") == 2, log[-3000:]

    # the sandbox's later snapshot: most of its memory pages are in the image
    # this node holds, copied from it (each checked) rather than fetched
    s = Sandbox.create(sid2, timeout=120)
    try:
        assert s.files.read("/tmp/later").strip() == "later"
        assert s.commands.run("md5sum /tmp/blob").stdout.split()[0] == blob_sum
        counts_on(s)
    finally:
        s.kill()
    line = next(
        x
        for x in (home / "node.log").read_text().splitlines()
        if f"restored snapshot {sid2} from the object store" in x
    )
    words = line.split("(")[-1].rstrip(')"}').split()
    phases = dict(zip(words[::2], words[1::2], strict=True))
    assert int(phases["pages_local"]) > 2 * int(phases["pages_fetched"]), line
    nodes.stop()
