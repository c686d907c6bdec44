"""Volumes across node restarts, with the real `e2b` SDK.

Rules: the test runs its own node (its own home; netns prefix and slot range
from AENV_TEST_VOLUMES_PREFIX / AENV_TEST_VOLUMES_CIDR, so parallel runs
can keep apart) and restarts it: a volume keeps its ID, token and files; a
sandbox paused to disk with the volume mounted resumes with it, and one left
running over the restart keeps writing to it. Nothing may leak at the end.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox, Volume

from tests.conftest import built_home, leaks, link_home, requires_node
from tests.e2e.test_restart import Restartable, _on_disk

pytestmark = [requires_node, pytest.mark.runsc]

PREFIX = os.environ.get("AENV_TEST_VOLUMES_PREFIX", "aenvv")
CIDR = os.environ.get("AENV_TEST_VOLUMES_CIDR", "10.241.0.0/16")


@pytest.fixture
def restartable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Restartable]:
    built = built_home()
    assert built is not None
    home = tmp_path / "home"
    home.mkdir()
    link_home(built, home)
    r = Restartable(home, monkeypatch)
    r.env.update({"AENV_NET_PREFIX": PREFIX, "AENV_SLOT_CIDR": CIDR})
    try:
        yield r
    finally:
        with contextlib.suppress(Exception):
            if r.node is None:
                r.start()
            assert r.node is not None
            h = {"X-API-Key": r.key}
            for sb in r.get("/v2/sandboxes?state=running,paused").json():
                httpx.delete(f"{r.node.url}/sandboxes/{sb['sandboxID']}", headers=h, timeout=60)
            for v in r.get("/volumes").json():
                httpx.delete(f"{r.node.url}/volumes/{v['volumeID']}", headers=h, timeout=60)
        if r.node is not None:
            with contextlib.suppress(Exception):
                r.stop()
        left = leaks(home, PREFIX)
        assert not left, left


def test_volume_and_its_sandboxes_survive_a_restart(
    restartable: Restartable, monkeypatch: pytest.MonkeyPatch
) -> None:
    r = restartable
    n = r.start()
    monkeypatch.setenv("E2B_VOLUME_API_URL", n.url)
    vol = Volume.create("kept")
    vol.write_file("/api.txt", "from the API")
    paused = Sandbox.create("base", timeout=300, volume_mounts={"/mnt/v": vol})
    paused.commands.run("echo paused-wrote > /mnt/v/p.txt")
    running = Sandbox.create("base", timeout=300, volume_mounts={"/data": "kept"})
    paused.pause()
    _on_disk(r, paused.sandbox_id)  # checkpointed with the volume mounted

    r.stop()  # the running sandbox runs on; the node comes back
    n = r.start()
    monkeypatch.setenv("E2B_VOLUME_API_URL", n.url)
    again = Volume.connect(vol.volume_id)
    assert (again.name, again.token) == ("kept", vol.token)
    assert again.read_file("/p.txt") == "paused-wrote\n"

    # taken back running: its mount still the volume's
    run2 = Sandbox.connect(running.sandbox_id)
    run2.commands.run("echo still-running > /data/r.txt")
    assert again.read_file("/r.txt") == "still-running\n"
    # resumed from disk: the volume mounted again
    res = Sandbox.connect(paused.sandbox_id)
    assert res.commands.run("cat /mnt/v/api.txt /mnt/v/r.txt").stdout == (
        "from the API" + "still-running\n"
    )
    with pytest.raises(Exception, match="mounted by"):
        Volume.destroy(vol.volume_id)
    res.kill()
    run2.kill()
    assert Volume.destroy(vol.volume_id) is True
