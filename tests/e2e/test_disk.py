"""A sandbox's disk size with the real e2b SDK: ENOSPC inside, a bounded host,
`df` that tells the truth, /tmp on the disk, the quota kept across a pause, a
fork and a node restart.

Rules: loopback only; the session `node` (its sandboxes get
`TEST_DISK_MB`-MiB disks), but for the restart test, which runs a node of its
own (tests.e2e.test_restart's `node_home`) under a netns prefix and slot
range of its own; each test kills what it creates. A disk is filled with
`dd` from /dev/zero; what "full" means is read from `df` inside, in 1 KiB
blocks.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox
from e2b.sandbox.commands.command_handle import CommandExitException

from tests.conftest import NET_PREFIX, TEST_DISK_MB, NodeProc, requires_node
from tests.e2e.test_restart import Restartable, node_home  # noqa: F401 (fixture)

pytestmark = [requires_node, pytest.mark.runsc]

MIB = 1 << 20


def _run(s: Sandbox, cmd: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `cmd` as root, failing or not."""
    try:
        r = s.commands.run(cmd, user="root", timeout=300)
        return r.exit_code, r.stdout, r.stderr
    except CommandExitException as e:
        return e.exit_code, e.stdout, e.stderr


def _df(s: Sandbox, path: str = "/") -> tuple[int, int, int]:
    """(size, used, available) in bytes of the file system at `path`, as `df`
    in the sandbox says."""
    code, out, err = _run(s, f"df -k {path} | tail -1")
    assert code == 0, err
    fields = out.split()
    return int(fields[1]) * 1024, int(fields[2]) * 1024, int(fields[3]) * 1024


def _fill(s: Sandbox, path: str, mib: int) -> tuple[int, str]:
    """Write `mib` MiB of zeros to `path`: (dd's exit code, its stderr)."""
    code, _out, err = _run(s, f"dd if=/dev/zero of={path} bs=1M count={mib} status=none")
    return code, err


def _assert_full(s: Sandbox, path: str, mib: int) -> None:
    code, err = _fill(s, path, mib)
    assert code != 0 and "No space left on device" in err, (code, err)
    assert _df(s)[2] < 8 * MIB, _df(s)


def _disk_images(home: Path, sandbox_id: str) -> list[Path]:
    return sorted((home / "sandboxes" / sandbox_id).glob("disk*.img"))


def test_writing_past_the_disk_is_enospc_and_the_sandbox_lives_on(node: NodeProc) -> None:
    s = Sandbox.create("base", timeout=300)
    try:
        size, used, _ = _df(s)
        # the sandbox's own disk, not the host's (ext4 counts a little more)
        assert TEST_DISK_MB * MIB * 0.95 < size < TEST_DISK_MB * MIB * 1.05, size
        assert used < 32 * MIB
        s.commands.run("echo started > /home/user/before.txt")
        _assert_full(s, "/home/user/big", TEST_DISK_MB + 100)
        # the host holds no more than the disk's size for it
        images = _disk_images(node.home, s.sandbox_id)
        assert len(images) == 1, images
        st = os.stat(images[0])
        assert st.st_size == TEST_DISK_MB * MIB
        assert st.st_blocks * 512 <= st.st_size + MIB
        # alive and usable: envd answers, files read, and space comes back on delete
        assert s.files.read("/home/user/before.txt").strip() == "started"
        assert s.commands.run("rm /home/user/big && echo ok").stdout.strip() == "ok"
        s.files.write("/home/user/after.txt", "x" * 1000)
        assert s.commands.run("wc -c < /home/user/after.txt").stdout.strip() == "1000"
        assert _df(s)[1] < 32 * MIB
        info = httpx.get(
            f"{node.url}/sandboxes/{s.sandbox_id}", headers={"X-API-Key": node.api_key}, timeout=30
        ).json()
        assert info["diskSizeMB"] == TEST_DISK_MB
    finally:
        Sandbox.kill(s.sandbox_id)


def test_a_big_file_in_tmp_fills_the_disk_not_the_memory(node: NodeProc) -> None:
    s = Sandbox.create("base", timeout=300)
    try:
        code, out, _ = _run(s, "stat -f -c %T /tmp")
        assert code == 0 and out.strip() != "tmpfs", out
        assert _df(s, "/tmp")[0] == _df(s, "/")[0]
        # more than the sandbox's memory (512 MiB): in a tmpfs it would kill it
        _assert_full(s, "/tmp/big", TEST_DISK_MB + 100)
        assert _run(s, "rm /tmp/big && echo alive")[1].strip() == "alive"
    finally:
        Sandbox.kill(s.sandbox_id)


def test_fork_and_pause_keep_the_quota(node: NodeProc) -> None:
    s = Sandbox.create("base", timeout=300)
    children: list[Sandbox] = []
    try:
        assert _fill(s, "/home/user/keep", 200)[0] == 0
        # a child carries what its source wrote: the same quota, 200 MiB of it used
        children = [c for c in s.fork(count=1, timeout=120) if isinstance(c, Sandbox)]
        assert len(children) == 1
        child = children[0]
        assert _df(child)[1] >= 200 * MIB
        _assert_full(child, "/home/user/more", TEST_DISK_MB)
        assert child.commands.run("wc -c < /home/user/keep").stdout.strip() == str(200 * MIB)
        # a filesystem pause freezes the disk into a layer; the resumed sandbox
        # gets a new disk that counts it
        r = httpx.post(
            f"{node.url}/sandboxes/{s.sandbox_id}/pause",
            json={"memory": False},
            headers={"X-API-Key": node.api_key},
            timeout=120,
        )
        assert r.status_code == 204, r.text
        s = Sandbox.connect(s.sandbox_id, timeout=300)
        assert _df(s)[1] >= 200 * MIB
        _assert_full(s, "/home/user/more", TEST_DISK_MB)
        assert s.commands.run("echo alive").stdout.strip() == "alive"
    finally:
        for c in children:
            Sandbox.kill(c.sandbox_id)
        Sandbox.kill(s.sandbox_id)


@pytest.mark.slow
def test_quota_survives_hibernation_and_a_node_restart(node_home: Restartable) -> None:  # noqa: F811
    # a prefix of this test's own (the session node may be up) and a free
    # slot range, picked by the node
    node_home.env["AENV_NET_PREFIX"] = f"{NET_PREFIX}q"[:10]
    node_home.env["AENV_SLOT_CIDR"] = ""
    node_home.start()
    s = Sandbox.create("busybox", timeout=600)
    try:
        assert _fill(s, "/keep", 200)[0] == 0
        s.pause()  # frozen, then written to disk within a second (AENV_HIBERNATE_AFTER)
        time.sleep(4)
        s = Sandbox.connect(s.sandbox_id, timeout=300)
        assert _df(s)[1] >= 200 * MIB
        node_home.stop()  # the sandbox runs on, its disk with it
        node_home.start()
        s = Sandbox.connect(s.sandbox_id, timeout=300)  # the new node's address
        assert _df(s)[1] >= 200 * MIB
        _assert_full(s, "/more", TEST_DISK_MB)
    finally:
        Sandbox.kill(s.sandbox_id)
