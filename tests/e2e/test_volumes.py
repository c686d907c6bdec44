"""Volumes with the real `e2b` SDK: CRUD, the content API, mounts in sandboxes.

Rules: loopback only; the session `node` owns the node process (restart
cases start their own, in a home of their own); every test deletes the
volumes and kills the sandboxes it makes, so the session's leak check (no
mount left under the node's home) covers volumes too. The SDK's content
client reaches the node through `E2B_VOLUME_API_URL`.
"""

from __future__ import annotations

import contextlib
import io
import os
import secrets
from collections.abc import Iterator

import httpx
import pytest
from e2b import Sandbox, Volume
from e2b.exceptions import NotFoundException, VolumeException

from tests.conftest import NodeProc, requires_node

pytestmark = [requires_node, pytest.mark.runsc]

TEMPLATE = os.environ.get("AENV_TEST_TEMPLATE", "base")


@pytest.fixture(autouse=True)
def volume_api(node: NodeProc) -> Iterator[None]:
    old = os.environ.get("E2B_VOLUME_API_URL")
    os.environ["E2B_VOLUME_API_URL"] = node.url
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("E2B_VOLUME_API_URL", None)
        else:
            os.environ["E2B_VOLUME_API_URL"] = old


def _name() -> str:
    return "vol-" + secrets.token_hex(4)


@pytest.fixture
def vol(node: NodeProc) -> Iterator[Volume]:
    v = Volume.create(_name())
    try:
        yield v
    finally:
        with contextlib.suppress(Exception):
            Volume.destroy(v.volume_id)


@contextlib.contextmanager
def sandbox(**kw: object) -> Iterator[Sandbox]:
    s = Sandbox.create(TEMPLATE, timeout=300, **kw)  # type: ignore[arg-type]
    try:
        yield s
    finally:
        with contextlib.suppress(Exception):
            s.kill()


def test_crud(node: NodeProc) -> None:
    name = _name()
    v = Volume.create(name)
    assert v.name == name and v.token
    try:
        assert (v.volume_id, name) in [(i.volume_id, i.name) for i in Volume.list()]
        info = Volume.get_info(v.volume_id)
        assert (info.name, info.token) == (name, v.token)
        again = Volume.connect(v.volume_id)
        assert again.token == v.token
        with pytest.raises(VolumeException, match="already exists"):
            Volume.create(name)
    finally:
        assert Volume.destroy(v.volume_id) is True
    assert Volume.destroy(v.volume_id) is False
    assert v.volume_id not in [i.volume_id for i in Volume.list()]
    with pytest.raises(NotFoundException):
        Volume.get_info(v.volume_id)


def test_content_round_trip(vol: Volume) -> None:
    d = vol.make_dir("/data/nested", force=True)
    assert (d.type.value, d.path, d.uid) == ("directory", "/data/nested", 1000)
    st = vol.write_file("/data/nested/a.txt", "hello volume")
    assert (st.type.value, st.size, st.name) == ("file", 12, "a.txt")
    big = os.urandom(3 * 1024 * 1024 + 17)
    vol.write_file("/data/big.bin", io.BytesIO(big))  # streamed from a file object
    assert vol.read_file("/data/nested/a.txt") == "hello volume"
    assert vol.read_file("/data/big.bin", format="bytes") == big
    assert b"".join(vol.read_file("/data/big.bin", format="stream")) == big
    top = vol.list("/data")
    assert sorted(e.name for e in top) == ["big.bin", "nested"]
    deep = vol.list("/", depth=3)
    assert "/data/nested/a.txt" in [e.path for e in deep]
    assert vol.exists("/data/big.bin") and not vol.exists("/nope")
    assert vol.get_info("/data/big.bin").size == len(big)
    upd = vol.update_metadata("/data/nested/a.txt", mode=0o600, uid=1234)
    assert (upd.mode, upd.uid) == (0o600, 1234)
    vol.remove("/data/nested")
    assert not vol.exists("/data/nested/a.txt")
    with pytest.raises(NotFoundException):
        vol.read_file("/data/nested/a.txt")
    # a path can never leave the volume
    with pytest.raises(VolumeException):
        vol.read_file("/../../etc/passwd")


def test_content_needs_the_volume_token(node: NodeProc, vol: Volume) -> None:
    url = f"{node.url}/volumecontent/{vol.volume_id}/path"
    assert httpx.get(url, params={"path": "/"}).status_code == 401
    bad = {"Authorization": "Bearer nope"}
    assert httpx.get(url, params={"path": "/"}, headers=bad).status_code == 401
    good = {"Authorization": f"Bearer {vol.token}"}
    assert httpx.get(url, params={"path": "/"}, headers=good).json()["type"] == "directory"


def test_symlink_planted_inside_never_leads_outside(vol: Volume) -> None:
    with sandbox(volume_mounts={"/mnt/v": vol}) as s:
        s.commands.run("ln -s /etc /mnt/v/etc && ln -s /etc/hostname /mnt/v/h")
        with pytest.raises(NotFoundException):  # not a directory of the volume
            vol.read_file("/etc/passwd")
        with pytest.raises(VolumeException):
            vol.read_file("/h")
        with pytest.raises(VolumeException):
            vol.write_file("/h", "x")
        assert vol.get_info("/h").type.value == "symlink"


def test_mounted_read_write_for_the_user_and_shared(vol: Volume) -> None:
    vol.write_file("/from-api.txt", "written through the API")
    with (
        sandbox(volume_mounts={"/mnt/data": vol}) as a,
        sandbox(volume_mounts={"/mnt/data": vol.name}) as b,
    ):
        assert a.get_info().volume_mounts == [{"name": vol.name, "path": "/mnt/data"}]
        # files the content API writes are there, in running sandboxes too
        assert a.files.read("/mnt/data/from-api.txt") == "written through the API"
        r = a.commands.run("echo from-a > /mnt/data/a.txt && id -un && stat -c %U /mnt/data/a.txt")
        assert r.stdout.split() == ["user", "user"]
        assert b.commands.run("cat /mnt/data/a.txt").stdout == "from-a\n"  # at once
        b.commands.run("echo from-b >> /mnt/data/a.txt")
        assert a.commands.run("cat /mnt/data/a.txt").stdout == "from-a\nfrom-b\n"
        vol.write_file("/later.txt", "while they run")
        assert b.commands.run("cat /mnt/data/later.txt").stdout == "while they run"
        assert vol.read_file("/a.txt") == "from-a\nfrom-b\n"
        # deleting a mounted volume is refused, naming who mounts it
        with pytest.raises(VolumeException, match="mounted by"):
            Volume.destroy(vol.volume_id)
    assert Volume.destroy(vol.volume_id) is True


def test_unknown_volume_refused_at_create(node: NodeProc) -> None:
    with pytest.raises(Exception, match="not found"):
        Sandbox.create(TEMPLATE, volume_mounts={"/mnt/x": "no-such-volume"})


def test_pause_resume_and_fork_keep_the_volume(vol: Volume) -> None:
    with sandbox(volume_mounts={"/mnt/v": vol}) as s:
        s.commands.run("echo before > /mnt/v/f")
        s.pause()
        vol.write_file("/while-paused", "api")
        r = Sandbox.connect(s.sandbox_id)
        assert r.commands.run("cat /mnt/v/f /mnt/v/while-paused").stdout == "before\napi"
        (child,) = r.fork(count=1, timeout=120)
        try:
            # the fork mounts the same volume, not a copy
            child.commands.run("echo from-child > /mnt/v/c")
            assert r.commands.run("cat /mnt/v/c").stdout == "from-child\n"
            r.commands.run("echo from-parent > /mnt/v/p")
            assert child.commands.run("cat /mnt/v/p").stdout == "from-parent\n"
        finally:
            child.kill()


def test_snapshot_restores_with_the_volume(vol: Volume) -> None:
    """A sandbox started from a snapshot mounts the volume its source had."""
    with sandbox(volume_mounts={"/mnt/v": vol}) as s:
        s.commands.run("echo snap > /mnt/v/s")
        snap = s.create_snapshot()
    try:
        t = Sandbox.create(snap.snapshot_id, timeout=120)
        try:
            t.commands.run("echo restored >> /mnt/v/s")
            assert vol.read_file("/s") == "snap\nrestored\n"
        finally:
            t.kill()
    finally:
        with contextlib.suppress(Exception):
            Sandbox.delete_snapshot(snap.snapshot_id)


def test_quota_enospc_inside_and_413_outside(node: NodeProc) -> None:
    r = httpx.post(
        f"{node.url}/volumes",
        json={"name": _name(), "sizeMB": 16},
        headers={"X-API-Key": node.api_key},
    )
    assert r.status_code == 201, r.text
    vol = Volume.connect(r.json()["volumeID"])
    try:
        with pytest.raises(VolumeException, match="full"):
            vol.write_file("/too-big", os.urandom(20 * 1024 * 1024))
        assert not vol.exists("/too-big")  # never half a file
        with sandbox(volume_mounts={"/mnt/q": vol}) as s:
            out = s.commands.run(
                "dd if=/dev/zero of=/mnt/q/fill bs=1M count=32 2>&1; echo rc=$?",
            ).stdout
            assert "No space left on device" in out and "rc=1" in out
    finally:
        Volume.destroy(vol.volume_id)
