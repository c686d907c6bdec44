"""Volumes on a node's disk and in the object store (`aenv.storage.volumes`).

Rules: real ext4 images loop-mounted under the test's tmp_path (root only),
a real local object store; every volume made is deleted (unmounted) at the
end of its test. Two `Volumes` over one store stand for two nodes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from aenv.proto.volumes import VolumeMount, VolumeRequestError, content_path, parse_mounts
from aenv.storage.objstore import open_object_store
from aenv.storage.snapstore import collect_garbage
from aenv.storage.volumes import (
    Owner,
    VolumeConflict,
    VolumeFull,
    VolumePathNotFound,
    Volumes,
)

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("mkfs.ext4") is None, reason="needs root and mkfs.ext4"
)


async def _body(*pieces: bytes) -> AsyncIterator[bytes]:
    for p in pieces:
        yield p


async def _read(vols: Volumes, vid: str, rel: str) -> bytes:
    _size, chunks = await vols.read_file(vid, rel)
    return b"".join([c async for c in chunks])


def test_content_paths_stay_inside_and_mounts_are_checked() -> None:
    assert content_path("/a/./b/../c") == "a/c"
    assert content_path("") == content_path("/") == ""
    with pytest.raises(VolumeRequestError):
        content_path("/a/../../etc")
    assert parse_mounts([{"name": "v1", "path": "/mnt/x/"}]) == (VolumeMount("v1", "/mnt/x"),)
    for bad in (
        [{"name": "v", "path": "relative"}],
        [{"name": "v", "path": "/proc/x"}],
        [{"name": "v", "path": "/"}],
        [{"name": "../v", "path": "/m"}],
        [{"name": "a", "path": "/m"}, {"name": "b", "path": "/m/n"}],
    ):
        with pytest.raises(VolumeRequestError):
            parse_mounts(bad)


@needs_root
async def test_persist_is_incremental_and_fetch_moves_a_volume(tmp_path: Path) -> None:
    store = open_object_store((tmp_path / "store").as_uri())
    users: dict[str, list[str]] = {}
    here = Volumes(tmp_path / "a", node_tag="nodea", store=store, users=lambda v: users.get(v, []))
    there = Volumes(tmp_path / "b", node_tag="nodeb", store=store)
    await here.load()
    await there.load()
    rec = await here.create("data", 32)
    try:
        vid = rec.volume_id
        big = os.urandom(3 * 1024 * 1024)
        await here.make_dir(vid, "d/e", owner=Owner(mode=0o750), force=True)
        await here.write_file(vid, "d/e/big", _body(big), owner=Owner(), force=False)
        await here.write_file(vid, "small", _body(b"one"), owner=Owner(uid=0), force=False)
        # what a sandbox may plant: links out of the volume are kept as links
        os.symlink("/etc", here.mountpoint(vid) / "etc-link")
        os.symlink("/etc/hostname", here.mountpoint(vid) / "d/host-link")
        assert here.to_persist() == [vid]  # written since created
        first = await here.persist(vid)
        assert first["uploadedBytes"] >= len(big)
        assert here.to_persist() == []
        users[vid] = ["sbx1"]  # mounted: copied again, but not too often
        assert here.to_persist() == [vid]
        assert here.to_persist(in_use_every_s=600) == []
        users.clear()
        # only what changed goes up again
        await here.write_file(vid, "small", _body(b"two"), owner=Owner(uid=0), force=False)
        assert here.to_persist() == [vid]
        second = await here.persist(vid)
        assert 0 < second["uploadedBytes"] < 1024
        # the store's collection keeps what the volume's copy references, only
        # what no copy does goes (the first copy's index and "one")
        report = await collect_garbage(store, grace_s=0)
        assert report.deleted == 2

        moved = await there.fetch("data")
        assert moved is not None and (moved.volume_id, moved.token) == (vid, rec.token)
        try:
            assert await _read(there, vid, "d/e/big") == big
            assert await _read(there, vid, "small") == b"two"
            st = await there.stat(vid, "d/e")
            assert (st["mode"], st["uid"]) == (0o750, 1000)
            assert (await there.stat(vid, "small"))["uid"] == 0
            assert (await there.stat(vid, ""))["uid"] == 1000
            link = await there.stat(vid, "etc-link")
            assert (link["type"], link["target"]) == ("symlink", "/etc")
            assert (await there.stat(vid, "d/host-link"))["type"] == "symlink"
        finally:
            await there.delete(vid)
    finally:
        await here.delete(rec.volume_id)
    assert not list((tmp_path / "a").iterdir())  # unmounted and removed


@needs_root
async def test_records_survive_and_errors_are_clear(tmp_path: Path) -> None:
    users: dict[str, list[str]] = {}
    vols = Volumes(tmp_path / "v", users=lambda vid: users.get(vid, []))
    await vols.load()
    rec = await vols.create("keep", 16)
    try:
        with pytest.raises(VolumeConflict):
            await vols.create("keep", 16)
        await vols.write_file(rec.volume_id, "new/dir/f", _body(b"x"), owner=Owner(), force=False)
        with pytest.raises(VolumePathNotFound):  # a file where a directory should be
            await vols.write_file(
                rec.volume_id, "new/dir/f/g", _body(b"x"), owner=Owner(), force=False
            )
        with pytest.raises(VolumeFull):
            await vols.write_file(
                rec.volume_id, "huge", _body(*[b"\0" * (1 << 20)] * 24), owner=Owner(), force=False
            )
        with pytest.raises(VolumePathNotFound):
            await vols.stat(rec.volume_id, "huge")  # the partial file is gone
        await vols.write_file(rec.volume_id, "f", _body(b"kept"), owner=Owner(), force=False)
        users[rec.volume_id] = ["sbx1"]
        with pytest.raises(VolumeConflict, match="sbx1"):
            await vols.delete("keep")
        users.clear()
        await vols.close()  # a node stop: unmounted, records kept

        again = Volumes(tmp_path / "v")
        await again.load()  # a node start: mounted again
        assert [r.name for r in again.all()] == ["keep"]
        assert await _read(again, rec.volume_id, "f") == b"kept"
        vols = again
    finally:
        await vols.delete(rec.volume_id)


@needs_root
async def test_a_volume_pinned_elsewhere_is_mounted_again_from_its_loop_device(
    tmp_path: Path,
) -> None:
    """A mount namespace made while a volume was mounted (any runsc sandbox's)
    keeps its file system alive after the node unmounts it: the next mount
    must use that same loop device, never a second ext4 over one image."""
    vols = Volumes(tmp_path / "v")
    await vols.load()
    rec = await vols.create("pinned", 16)
    image = str(tmp_path / "v" / rec.volume_id / "image.ext4")

    async def devices() -> list[str]:
        out = await trio.run_process(
            ["losetup", "--list", "--associated", image, "--output", "NAME", "--noheadings"],
            capture_stdout=True,
        )
        return out.stdout.decode().split()

    pin = await trio.lowlevel.open_process(
        ["unshare", "--mount", "sh", "-c", "echo ready; exec sleep 60"], stdout=subprocess.PIPE
    )
    try:
        assert pin.stdout is not None
        assert await pin.stdout.receive_some(16) == b"ready\n"  # its copy of the mount is made
        (before,) = await devices()
        await vols.close()
        again = Volumes(tmp_path / "v")
        await again.load()
        assert await devices() == [before]
        await again.write_file(rec.volume_id, "f", _body(b"x"), owner=Owner(), force=False)
        await again.delete(rec.volume_id)
    finally:
        pin.kill()
        await pin.wait()
