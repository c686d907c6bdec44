"""Persistent snapshots with the real e2b SDK: create, list, create-from, delete, corruption.

Rules: loopback only; the session `node`; each test kills its sandboxes and
deletes its snapshots. Snapshot images live in the node's private home,
which the corruption test edits on purpose.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import time
from pathlib import Path

import pytest
from e2b import Sandbox
from e2b.exceptions import SandboxException

from tests.conftest import (
    NET_PREFIX,
    NodeProc,
    built_home,
    link_home,
    requires_node,
    sdk_pointed_at,
    start_node,
    stop_node,
)
from tests.e2e.counter import COUNTER, counts_on
from tests.e2e.nodes import wait_storage

pytestmark = [requires_node, pytest.mark.runsc]

NO_STORE_CIDR = os.environ.get("AENV_TEST_NOSTORE_CIDR", "10.216.0.0/16")


def test_snapshot_then_create_from_it_by_id_and_name(node: NodeProc) -> None:
    src = Sandbox.create("base")
    made: list[Sandbox] = []
    try:
        src.commands.run(COUNTER, background=True)
        src.files.write("/home/user/snap.txt", "in the snapshot")
        time.sleep(1)
        info = src.create_snapshot(name="snap-test-a")
        assert info.snapshot_id and info.names == ["snap-test-a"]
        # the source carries on
        counts_on(src)
        src.files.write("/home/user/after.txt", "not in the snapshot")
        src.kill()  # snapshots outlive their sandbox
        for ref in (info.snapshot_id, "snap-test-a"):
            s = Sandbox.create(ref)
            made.append(s)
            assert s.files.read("/home/user/snap.txt") == "in the snapshot"
            assert not s.files.exists("/home/user/after.txt")
            assert counts_on(s) > 0  # the counter process came along
        listed = Sandbox.list_snapshots().next_items()
        assert info.snapshot_id in [x.snapshot_id for x in listed]
        # a reused name is a new build; the name resolves to the newest
        again = made[0].create_snapshot(name="snap-test-a")
        assert again.snapshot_id != info.snapshot_id
        assert Sandbox.delete_snapshot(again.snapshot_id)
        assert Sandbox.delete_snapshot(info.snapshot_id)
        assert not Sandbox.delete_snapshot(info.snapshot_id)
        with pytest.raises(SandboxException):
            Sandbox.create(info.snapshot_id)
    finally:
        for s in made:
            Sandbox.kill(s.sandbox_id)
        Sandbox.kill(src.sandbox_id)


def test_filesystem_snapshot_boots_fresh(node: NodeProc) -> None:
    src = Sandbox.create("base")
    try:
        src.commands.run("sleep 1000", background=True)
        src.files.write("/home/user/fs.txt", "files only")
        info = src.create_snapshot(mode="filesystem")
        s = Sandbox.create(info.snapshot_id)
        try:
            assert s.files.read("/home/user/fs.txt") == "files only"
            assert "sleep 1000" not in s.commands.run("ps -eo args").stdout
        finally:
            s.kill()
        assert Sandbox.delete_snapshot(info.snapshot_id)
    finally:
        src.kill()


def _corrupt_a_snapshot(node: NodeProc, *, stored: bool) -> str:
    """A busybox snapshot whose local memory image has one byte flipped (once
    it is in the node's store, if it has one)."""
    src = Sandbox.create("busybox")
    try:
        info = src.create_snapshot()
    finally:
        src.kill()
    if stored:
        wait_storage(node.url, node.api_key, info.snapshot_id, "durable")
    home = Path(node.home)
    image = home / "snapshots" / info.snapshot_id / "image"
    victim = next(p for p in sorted(image.iterdir()) if p.is_file())
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.unlink()  # the file is hard-linked: write a new one, never the shared inode
    victim.write_bytes(bytes(data))
    return info.snapshot_id


def test_a_corrupt_local_image_is_fetched_again_from_the_store(node: NodeProc) -> None:
    """The node's store (the default one in its home) holds the snapshot: the
    torn local copy is replaced by a checked one and the create works."""
    snapshot_id = _corrupt_a_snapshot(node, stored=True)
    s = Sandbox.create(snapshot_id)
    try:
        assert s.commands.run("echo whole").stdout.strip() == "whole"
    finally:
        s.kill()
    assert Sandbox.delete_snapshot(snapshot_id)


def test_a_corrupt_snapshot_without_a_store_is_refused(tmp_path: Path) -> None:
    home = built_home()
    assert home is not None
    private = Path(tempfile.mkdtemp(prefix="aenv-test-nostore-"))
    link_home(home, private)
    n = start_node(
        private,
        api_key="aenv_test_" + secrets.token_hex(8),
        log_path=private / "node.log",
        # a node of its own beside the session's: its own names and range
        extra_env={
            "AENV_STORE_URL": "none",
            "AENV_NET_PREFIX": NET_PREFIX + "n",
            "AENV_SLOT_CIDR": NO_STORE_CIDR,
        },
    )
    try:
        with sdk_pointed_at(n.url, n.api_key):
            snapshot_id = _corrupt_a_snapshot(n, stored=False)
            with pytest.raises(SandboxException, match=r"intact memory image|checksum"):
                Sandbox.create(snapshot_id)
            assert Sandbox.delete_snapshot(snapshot_id)
    finally:
        assert stop_node(n) == 0, n.log_tail()
        shutil.rmtree(private, ignore_errors=True)


def test_pausing_a_sandbox_keeps_the_snapshot_it_came_from(node: NodeProc) -> None:
    """A sandbox restored from a snapshot (or a template) writes its own image
    or layer when it pauses; the image it came from stays whole."""
    src = Sandbox.create("base")
    made: list[Sandbox] = []
    info = None
    try:
        src.files.write("/home/user/origin.txt", "origin")
        info = src.create_snapshot()
        for ref in (info.snapshot_id, "base"):
            s = Sandbox.create(ref)
            made.append(s)
            images = _snapshot_images(node.home)
            s.pause(mode="filesystem")  # writes to disk at once
            # (the node would fetch a lost image back from its object store:
            # look at its files, not only at the next create)
            assert _snapshot_images(node.home) == images
            again = Sandbox.create(ref)
            made.append(again)
            assert again.commands.run("true").exit_code == 0
            if ref == info.snapshot_id:
                assert again.files.read("/home/user/origin.txt") == "origin"
            resumed = Sandbox.connect(s.sandbox_id)
            assert resumed.commands.run("true").exit_code == 0
    finally:
        for s in made:
            Sandbox.kill(s.sandbox_id)
        Sandbox.kill(src.sandbox_id)
        if info is not None:
            Sandbox.delete_snapshot(info.snapshot_id)


def _snapshot_images(home: Path) -> dict[str, int]:
    """Every file of every snapshot image on the node, with its size."""
    return {
        str(f.relative_to(home)): f.stat().st_size
        for f in sorted((home / "snapshots").glob("*/image/*"))
    }


def test_a_failed_capture_leaves_the_sandbox_running(node: NodeProc) -> None:
    """When the memory image cannot be written, snapshot and fork answer an
    error and the source runs on, its processes and its envd reachable."""
    s = Sandbox.create("base")
    blockers = []
    try:
        s.commands.run(COUNTER, background=True)
        time.sleep(1)
        workdir = node.home / "sandboxes" / s.sandbox_id
        assert workdir.is_dir()
        # files where the next memory images are staged: the captures cannot start
        for n in range(1, 6):
            blocker = workdir / f"image{n}.tmp"
            blocker.write_text("in the way")
            blockers.append(blocker)
        before = counts_on(s)
        with pytest.raises(SandboxException, match="capturing the sandbox failed"):
            s.create_snapshot()
        with pytest.raises(SandboxException, match="capturing the sandbox failed"):
            s.fork(count=1)
        assert counts_on(s) > before  # the same process, counting on
        assert s.commands.run("echo still here").stdout == "still here\n"
        for blocker in blockers:
            blocker.unlink()
        info = s.create_snapshot()  # and a capture works again
        Sandbox.delete_snapshot(info.snapshot_id)
    finally:
        for blocker in blockers:
            blocker.unlink(missing_ok=True)
        Sandbox.kill(s.sandbox_id)
