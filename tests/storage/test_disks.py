"""Writable roots on sized disks (sparse ext4 files, loop-mounted), and their removal.

Rules: every layer, workdir and disk file lives in `tmp_path`; mounting
needs root, so these tests are marked runsc like the other root-only tests.
After each block, /proc/mounts must hold nothing under `tmp_path` and the
disk's file must be gone. Disks are 64 MiB: filling one takes a fraction of
a second.
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import trio

from aenv.storage.disks import MIN_FREE_BYTES, disk_image
from aenv.storage.layers import LayerStack, LayerStore
from aenv.storage.overlay import open_writable_root, reap_stale_mounts, unmount_root
from aenv.storage.sparedisks import SpareDisks

pytestmark = pytest.mark.runsc

MIB = 1 << 20
SIZE = 64 * MIB
BIG = 4 * SIZE  # room for a carried SIZE and the free minimum


@pytest.fixture(autouse=True)
def _root_only() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root")


def mounts_under(path: Path) -> list[str]:
    return [m for m in Path("/proc/mounts").read_text().splitlines() if str(path) in m]


def lower(tmp_path: Path) -> Path:
    base = tmp_path / "l0"
    (base / "etc").mkdir(parents=True)
    (base / "etc" / "os").write_text("base")
    (base / "tmp").mkdir()
    return base


def fill(path: Path, limit: int) -> int:
    """Write zeros to `path` until ENOSPC (or `limit` bytes); returns bytes written."""
    chunk = b"\0" * MIB
    written = 0
    with open(path, "wb") as f:
        try:
            while written < limit:
                written += f.write(chunk)
                f.flush()
            os.fsync(f.fileno())
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
            return written
    raise AssertionError(f"{limit} bytes fitted on a {SIZE}-byte disk")


async def test_a_sized_root_ends_in_enospc_and_statfs_shows_its_size(tmp_path: Path) -> None:
    work = tmp_path / "sbx"
    async with open_writable_root([lower(tmp_path)], work, disk_bytes=SIZE) as root:
        st = os.statvfs(root)  # what `df /` in the sandbox reads
        assert SIZE * 0.9 < st.f_blocks * st.f_frsize < SIZE * 1.1
        written = await trio.to_thread.run_sync(fill, root / "tmp" / "big", 2 * SIZE)
        assert SIZE * 0.8 < written <= SIZE
        (root / "etc" / "os").unlink()  # whiteouts still fit, and space comes back
        (root / "tmp" / "big").unlink()
        (root / "etc" / "new").write_text("fits again")
        assert (work / "upper" / "etc" / "os").is_char_device()
        image = disk_image(work)
        assert image.stat().st_size == SIZE
        assert image.stat().st_blocks * 512 <= SIZE + MIB  # the host's cost
    assert not mounts_under(tmp_path)
    assert not image.exists() and not work.exists()


async def test_carried_bytes_are_used_from_the_start(tmp_path: Path) -> None:
    base = lower(tmp_path)
    async with open_writable_root(
        [base], tmp_path / "sbx", disk_bytes=4 * SIZE, carried_bytes=2 * SIZE
    ) as root:
        st = os.statvfs(root)
        assert (st.f_blocks - st.f_bfree) * st.f_frsize >= 2 * SIZE
        assert disk_image(tmp_path / "sbx").stat().st_blocks * 512 < 8 * MIB  # not written
        written = await trio.to_thread.run_sync(fill, root / "big", 4 * SIZE)
        assert written < 2 * SIZE
    # more carried than the disk holds: the period still gets its minimum
    async with open_writable_root(
        [base], tmp_path / "sbx2", disk_bytes=2 * SIZE, carried_bytes=10 * SIZE
    ) as root:
        written = await trio.to_thread.run_sync(fill, root / "big", 4 * SIZE)
        assert MIN_FREE_BYTES * 0.8 < written <= MIN_FREE_BYTES
    assert not mounts_under(tmp_path)


async def test_an_upper_on_a_disk_freezes_into_a_layer(tmp_path: Path) -> None:
    store = LayerStore(tmp_path / "store")
    base = lower(tmp_path)
    work = tmp_path / "sbx"
    async with open_writable_root([base], work, disk_bytes=SIZE) as root:
        (root / "etc" / "os").write_text("changed")
        (root / "etc" / "new").write_text("new")
        upper = await unmount_root(work)
        layer = await store.freeze(upper, below=LayerStack.of_base([base]))
    assert not mounts_under(tmp_path) and not disk_image(work).exists()
    assert (layer.path / "etc" / "os").read_text() == "changed"
    assert (layer.path / "etc" / "new").read_text() == "new"
    async with open_writable_root(store.chain(layer).lowers(), work, disk_bytes=SIZE) as root:
        assert (root / "etc" / "os").read_text() == "changed"


async def test_reap_unmounts_leftover_disks_but_kept_ones(tmp_path: Path) -> None:
    base = lower(tmp_path)
    sandboxes = tmp_path / "sandboxes"
    async with (
        open_writable_root([base], sandboxes / "a" / "disk1", disk_bytes=SIZE),
        open_writable_root([base], sandboxes / "b" / "disk1", disk_bytes=SIZE) as kept,
    ):
        assert len(mounts_under(sandboxes)) == 4
        await trio.to_thread.run_sync(reap_stale_mounts, sandboxes, [kept])
        # a crashed node's leftovers go, disk file included; the kept root stays
        assert not mounts_under(sandboxes / "a")
        assert not disk_image(sandboxes / "a" / "disk1").exists()
        assert (kept / "etc" / "os").read_text() == "base"
        assert len(mounts_under(sandboxes / "b")) == 2
    assert not mounts_under(tmp_path)


async def wait_for(check: Callable[[], bool], within_s: float = 20.0) -> None:
    with trio.fail_after(within_s):
        while not check():  # noqa: ASYNC110 - the host is polled
            await trio.sleep(0.02)


async def test_a_spare_disk_becomes_a_root_of_its_own(tmp_path: Path) -> None:
    base = lower(tmp_path)
    spares = SpareDisks(tmp_path / "spares", size_bytes=BIG, count=2, quiet_s=0.05, least=2)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(spares.keep)
        await wait_for(lambda: len(list((tmp_path / "spares").glob("*.img"))) == 2)
        assert spares.take(SIZE) is None  # (not of the spares' size)
        # a disk of the spares' size is one of them, moved: no mkfs on the way
        work = tmp_path / "sbx" / "disk1"
        async with open_writable_root(
            [base], work, disk_bytes=BIG, carried_bytes=SIZE, spares=spares
        ) as root:
            assert spares.taken == 1
            assert disk_image(work).stat().st_size == BIG
            st = os.statvfs(root)
            assert BIG * 0.9 < st.f_blocks * st.f_frsize < BIG * 1.1
            assert (st.f_blocks - st.f_bfree) * st.f_frsize >= SIZE  # carried
            (root / "etc" / "new").write_text("mine")
            assert (work / "upper" / "etc" / "new").read_text() == "mine"
            # ... and another sandbox's is another disk
            async with open_writable_root(
                [base], tmp_path / "sbx2" / "disk1", disk_bytes=BIG, spares=spares
            ) as other:
                assert not (other / "etc" / "new").exists()
            written = await trio.to_thread.run_sync(fill, root / "tmp" / "big", 2 * BIG)
            assert written < BIG - SIZE
        assert not disk_image(work).exists() and not mounts_under(tmp_path / "sbx")
        # made again once no disk was taken for a while
        await wait_for(lambda: len(spares._ready) == 2)
        nursery.cancel_scope.cancel()
    # the spares go with their keeper
    assert not mounts_under(tmp_path) and not (tmp_path / "spares").exists()


@pytest.fixture
def shared_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory on a tmpfs of its own whose mount is shared: a mount under it
    cannot move (`take_disk` is refused)."""
    shared = tmp_path / "spares"
    shared.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1g", "aenvtest", shared], check=True)
    try:
        subprocess.run(["mount", "--make-shared", shared], check=True)
        yield shared
    finally:
        subprocess.run(["umount", "-l", shared], check=False)


async def test_a_host_that_refuses_the_move_turns_spares_off(
    tmp_path: Path, shared_dir: Path
) -> None:
    """Where a spare cannot move out of its directory (a mount under a shared
    mount cannot move, as on hosts whose mounts are shared), a start makes its
    disk as without spares, and the spares end for good: their keeper returns
    at its next look and removes the ones left."""
    base = lower(tmp_path)
    spares = SpareDisks(shared_dir, size_bytes=BIG, count=2, quiet_s=0.05, least=2)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(spares.keep)
            await wait_for(lambda: len(spares._ready) == 2)
            work = tmp_path / "sbx" / "disk1"
            async with open_writable_root([base], work, disk_bytes=BIG, spares=spares) as root:
                assert (spares.count, spares.taken) == (0, 1)
                assert disk_image(work).stat().st_size == BIG  # its own, made
                (root / "etc" / "new").write_text("mine")
            # a second start wakes the keeper, if the first did not end it
            async with open_writable_root(
                [base], tmp_path / "sbx2" / "disk1", disk_bytes=BIG, spares=spares
            ):
                pass
        # (the keeper returned: no cancel)
    assert not mounts_under(tmp_path / "sbx") and not mounts_under(tmp_path / "sbx2")
    assert os.listdir(shared_dir) == []
    assert [m for m in mounts_under(shared_dir) if "ext4" in m] == []
