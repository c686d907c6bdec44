"""Cold restores from the object store when things break: real nodes, runsc, moto, e2b SDK.

Rules: each test runs its own nodes (private homes linked to the built one)
against its own moto server on loopback (tests/s3.py), on a netns prefix and
slot range of their own (AENV_TEST_COLD_PREFIX / AENV_TEST_COLD_CIDR, to run
beside another suite). Faults: the store server killed a few requests into
a restore, and a node's local copy of a restored memory image torn behind
its back, as a crash before the kernel flushed it would leave it (a restore
does not flush the image it fetched: the store holds it). Either way the
user sees a clear error or a sandbox with its state, never a wrong one, and
nothing of the nodes leaks. A node holding an earlier image of a sandbox
restores its later snapshot mostly from that image.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox

# Fixtures are imported by name, so test parameters shadow them (F811).
# ruff: noqa: F811
from tests.conftest import NodeProc, built_home, leaks, link_home, requires_node, start_node
from tests.conftest import stop_node as _stop_node
from tests.e2e.counter import COUNTER, count, counts_on
from tests.s3 import MotoS3, s3_faulty  # noqa: F401

pytestmark = [requires_node, pytest.mark.runsc]

PREFIX = os.environ.get("AENV_TEST_COLD_PREFIX", "aenvm")
CIDR = os.environ.get("AENV_TEST_COLD_CIDR", "10.218.0.0/16")


class Lab:
    def __init__(self, root: Path, s3: MotoS3, monkeypatch: pytest.MonkeyPatch) -> None:
        self.root, self.s3, self.monkeypatch = root, s3, monkeypatch
        self.prefix = f"cold/{secrets.token_hex(4)}"
        self.key = "k" + secrets.token_hex(8)
        self.node: NodeProc | None = None
        self.homes: list[Path] = []

    def home(self, name: str) -> Path:
        home = self.root / name
        if not home.exists():
            home.mkdir()
            built = built_home()
            assert built is not None
            link_home(built, home)
            self.homes.append(home)
        return home

    def start(self, name: str) -> NodeProc:
        env = {
            "AENV_NET_PREFIX": PREFIX,
            "AENV_SLOT_CIDR": CIDR,
            **self.s3.env(),
            "AENV_STORE_URL": self.s3.url(self.prefix),
            "AENV_SHARE_DEFAULT_TEMPLATES": "off",
        }
        home = self.home(name)
        n = start_node(home, api_key=self.key, log_path=home / "node.log", extra_env=env)
        for var, value in (("E2B_API_URL", n.url), ("E2B_SANDBOX_URL", n.url)):
            self.monkeypatch.setenv(var, value)
        self.monkeypatch.setenv("E2B_API_KEY", self.key)
        self.node = n
        return n

    def stop(self) -> None:
        assert self.node is not None
        code = _stop_node(self.node, signal.SIGTERM)
        assert code == 0, self.node.log_tail()
        self.node = None

    def post(self, path: str, body: object = None) -> httpx.Response:
        assert self.node is not None
        return httpx.post(
            self.node.url + path, json=body, headers={"X-API-Key": self.key}, timeout=300
        )


@pytest.fixture
def lab(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, s3_faulty: MotoS3) -> Iterator[Lab]:
    lab = Lab(tmp_path, s3_faulty, monkeypatch)
    try:
        yield lab
    finally:
        if lab.node is not None:
            with contextlib.suppress(Exception):
                lab.stop()
        for home in lab.homes:
            left = leaks(home, PREFIX)
            assert not left, left


def test_a_store_lost_mid_restore_fails_clearly_and_every_later_restore_is_whole(
    lab: Lab,
) -> None:
    lab.start("a")
    src = Sandbox.create("busybox", timeout=300)
    try:
        src.commands.run(COUNTER, background=True)
        src.commands.run("head -c 2000000 /dev/urandom > /tmp/blob")
        blob_sum = src.commands.run("md5sum /tmp/blob").stdout.split()[0]
        counts_on(src)
        before = count(src)
        r = lab.post(f"/sandboxes/{src.sandbox_id}/snapshots", {"durable": True})
        assert r.status_code == 201 and r.json()["storage"] == "durable", r.text
        sid = r.json()["snapshotID"]
        src.commands.run("echo later > /tmp/later")
        r = lab.post(f"/sandboxes/{src.sandbox_id}/snapshots", {"durable": True})
        assert r.status_code == 201 and r.json()["storage"] == "durable", r.text
        sid2 = r.json()["snapshotID"]
    finally:
        src.kill()
    lab.stop()

    # the store dies a few requests into the restore (manifest, layer index, page
    # maps, then the memory packs): the create fails naming the snapshot
    lab.start("b")
    home = lab.home("b")
    lab.s3.kill_after(4)
    r = lab.post("/sandboxes", {"templateID": sid})
    assert r.status_code == 500, r.text
    assert sid in r.json()["message"], r.text
    assert not lab.s3.running
    assert [p.name for p in (home / "snapshots").iterdir()] == []  # nothing half there
    assert list((home / "layers" / "layers").glob("*")) == []

    # the store is back: the same node restores it, whole
    lab.s3.start()
    s = Sandbox.create(sid, timeout=120)
    try:
        assert s.commands.run("md5sum /tmp/blob").stdout.split()[0] == blob_sum
        assert count(s) >= before
        counts_on(s)
    finally:
        s.kill()
    lab.stop()

    # a crash tore the local copy of the image (never flushed): the next node
    # process notices (it checks a snapshot once before its first use) and
    # fetches the image again rather than restore garbage
    pages = home / "snapshots" / sid / "image" / "pages.img"
    size = pages.stat().st_size
    with pages.open("r+b") as f:
        f.seek(size // 2)
        f.write(bytes(min(1 << 20, size - size // 2)))
    lab.start("b")
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
    lab.stop()
