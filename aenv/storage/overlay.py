"""Per-sandbox writable root filesystems as host overlayfs mounts.

A sandbox's root is its image layers (read-only lower directories, topmost
first) with one writable upper directory on top, merged by the kernel's
overlayfs. gVisor's gofer then writes through to that upper directory, which
is what pause, snapshot and fork freeze into a new layer. `open_writable_root`
owns one such mount for the length of an `async with` block and removes it,
and its scratch directory, on the way out, also when cancelled;
`adopt_writable_root` takes over such a mount that an earlier node process
made (a sandbox that ran on while the node restarted), and
`reap_stale_mounts` clears the others it left behind. mount(8) and
umount(8) run in worker threads. To keep the upper (pause, snapshot, fork),
`unmount_root` unmounts the overlay inside the block and hands back the
upper directory for `aenv.storage.layers.LayerStore.freeze` to move away.
`OverlayRoots` is the same four as one object, the node's `WritableRoots`.

With a disk size, the upper and work directories live on a disk of that size
of their own (`aenv.storage.disks`: a sparse ext4 file loop-mounted over the
scratch directory, its file beside it), which is what bounds a sandbox's
writes; the disk goes when the block is left, after the overlay.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Collection, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path

import trio

from aenv.storage.disks import DiskError, disk_mounts, make_disk, remove_disk, take_disk
from aenv.storage.sparedisks import SpareDisks

__all__ = [
    "MAX_MOUNT_OPTIONS",
    "OverlayError",
    "OverlayRoots",
    "adopt_writable_root",
    "open_writable_root",
    "reap_stale_mounts",
    "unmount_root",
]

log = logging.getLogger("aenv.overlay")

# The kernel copies mount options into a single page; longer strings fail.
MAX_MOUNT_OPTIONS = 4000

# Bound on the whole teardown (unmount + removal) once the block is left.
_TEARDOWN_DEADLINE = 30.0


class OverlayError(RuntimeError):
    """The overlay could not be mounted (bad layer paths, too many layers, kernel refusal)."""


@asynccontextmanager
async def open_writable_root(
    lowers: Sequence[Path],
    workdir: Path,
    *,
    disk_bytes: int = 0,
    carried_bytes: int = 0,
    spares: SpareDisks | None = None,
) -> AsyncIterator[Path]:
    """Mount `lowers` (topmost first) under a fresh upper at `workdir/merged`.

    `workdir` must not exist yet or be empty; it receives `upper/`, `work/`
    and `merged/`, and is removed entirely when the block is left, so the
    caller keeps nothing of the upper unless it moved it away first (after
    unmounting) -- snapshotting is a separate step. With `disk_bytes`, they
    are on a disk of that size mounted at `workdir`, `carried_bytes` of it
    counted as used already (what `lowers` hold of the sandbox's own writes),
    one of `spares` if one of that size is ready.
    """
    if not lowers:
        raise OverlayError("an overlay needs at least one lower layer")
    await trio.to_thread.run_sync(_check_empty, workdir)
    async with _owned(workdir):
        if disk_bytes > 0:
            spare = spares.take(disk_bytes) if spares is not None else None
            try:
                await trio.to_thread.run_sync(
                    _make_disk, workdir, disk_bytes, carried_bytes, spare, spares
                )
            except DiskError as exc:
                raise OverlayError(f"the disk of {workdir}: {exc}") from None
        await trio.to_thread.run_sync(_prepare, workdir)
        await trio.to_thread.run_sync(_mount, [Path(p) for p in lowers], workdir)
        yield workdir / "merged"


@asynccontextmanager
async def adopt_writable_root(workdir: Path) -> AsyncIterator[Path]:
    """Own the overlay an earlier node process mounted at `workdir/merged`, as
    `open_writable_root` owns a new one. Raises OverlayError if it is not mounted."""
    merged = workdir / "merged"
    if not await trio.to_thread.run_sync(_is_mountpoint, merged):
        raise OverlayError(f"{merged} is not mounted any more")
    async with _owned(workdir):
        yield merged


@asynccontextmanager
async def _owned(workdir: Path) -> AsyncIterator[None]:
    """Unmount `workdir/merged` (if mounted) and remove `workdir` when the block is left."""
    try:
        try:
            yield
        finally:
            with trio.CancelScope(shield=True, deadline=trio.current_time() + _TEARDOWN_DEADLINE):
                await trio.to_thread.run_sync(_unmount, workdir / "merged", abandon_on_cancel=True)
    finally:
        with trio.CancelScope(shield=True, deadline=trio.current_time() + _TEARDOWN_DEADLINE):
            await trio.to_thread.run_sync(_remove, workdir, abandon_on_cancel=True)


async def unmount_root(workdir: Path) -> Path:
    """Unmount the overlay of an `open_writable_root(lowers, workdir)` block now.

    Returns its upper directory, which nothing writes to any more; the
    caller may move it away (freeze it) before the block is left. Raises
    OverlayError if the overlay stays mounted (a process still uses it).
    """
    merged = workdir / "merged"
    await trio.to_thread.run_sync(_unmount_strict, merged)
    return workdir / "upper"


def _unmount_strict(mountpoint: Path, retry_s: float = 2.0) -> None:
    # Processes that just exited (a checkpointed sandbox's gofer) may pin
    # the mount for a moment: retry briefly, never detach lazily.
    deadline = time.monotonic() + retry_s
    while _is_mountpoint(mountpoint):
        proc = subprocess.run(
            ["umount", str(mountpoint)], capture_output=True, text=True, check=False
        )
        if proc.returncode == 0 or not _is_mountpoint(mountpoint):
            return
        if time.monotonic() > deadline:
            raise OverlayError(f"unmounting {mountpoint} failed: {proc.stderr.strip()}")
        time.sleep(0.05)


def reap_stale_mounts(root: Path, keep: Collection[Path] = ()) -> list[Path]:
    """Unmount every overlay mounted at or below `root` but those in `keep`,
    and their disks (blocking; run it in a thread); returns what it unmounted.

    For a node restarting: those mounts belong to sandboxes that no longer
    exist (the ones in `keep` are being taken over). Deepest mounts go first;
    busy ones are detached lazily. Directories are left in place.
    """
    root = Path(os.path.abspath(root))
    kept = {Path(os.path.abspath(p)) for p in keep}
    stale = [mp for mp in _overlay_mounts_under(root) if mp not in kept]
    # a kept root's disk (mounted over its scratch directory) is kept with it
    disks = [d for d in disk_mounts() if d.is_relative_to(root) and d / "merged" not in kept]
    for mountpoint in sorted(stale + disks, key=lambda p: len(p.parts), reverse=True):
        if mountpoint in disks:
            remove_disk(mountpoint)
        else:
            _unmount(mountpoint)
    return stale + disks


def _make_disk(
    workdir: Path, size: int, carried: int, spare: Path | None, spares: SpareDisks | None
) -> None:
    """The disk at `workdir`: `spare` moved there, else a new one (blocking)."""
    if spare is not None:
        try:
            take_disk(spare, workdir, carried)
            return
        except (DiskError, OSError) as exc:
            log.warning("a spare disk could not be used (no more spares): %s", exc)
            if spares is not None:
                spares.count = 0
            remove_disk(spare)
    make_disk(workdir, size, carried)


class OverlayRoots:
    """Sandbox roots as overlay mounts (`aenv.node.host.WritableRoots`), their
    disks taken from `spares` where one is ready."""

    def __init__(self, spares: SpareDisks | None = None) -> None:
        self.spares = spares

    def open_root(
        self, lowers: Sequence[Path], workdir: Path, *, disk_bytes: int = 0, carried_bytes: int = 0
    ) -> AbstractAsyncContextManager[Path]:
        return open_writable_root(
            lowers,
            workdir,
            disk_bytes=disk_bytes,
            carried_bytes=carried_bytes,
            spares=self.spares,
        )

    def adopt_root(self, workdir: Path) -> AbstractAsyncContextManager[Path]:
        return adopt_writable_root(workdir)

    async def unmount(self, workdir: Path) -> Path:
        return await unmount_root(workdir)

    async def reap(self, root: Path, keep: Collection[Path] = ()) -> list[Path]:
        return await trio.to_thread.run_sync(reap_stale_mounts, root, keep)


def _check_empty(workdir: Path) -> None:
    workdir.mkdir(parents=True, exist_ok=True)
    if any(workdir.iterdir()):
        raise OverlayError(f"{workdir} is not empty")


def _prepare(workdir: Path) -> None:
    for name in ("upper", "work", "merged"):
        (workdir / name).mkdir()
    # The upper's root becomes the guest's "/": keep it world-traversable.
    os.chmod(workdir / "upper", 0o755)


def mount_options(lowers: Sequence[Path], workdir: Path) -> tuple[str, Path]:
    """Return (options, cwd): overlay options with paths relative to `cwd`.

    Relative paths (resolved by the kernel against the mounting process's
    working directory) keep long layer stacks under the option-size limit.
    """
    paths = [Path(os.path.abspath(p)) for p in (*lowers, workdir)]
    for p in paths:
        if any(c in str(p) for c in ":,\n"):
            raise OverlayError(f"layer path {p} contains ':' ',' or a newline")
    cwd = Path(os.path.commonpath([str(p) for p in paths]))

    def rel(p: Path) -> str:
        return os.path.relpath(p, cwd)

    lowerdir = ":".join(rel(Path(os.path.abspath(p))) for p in lowers)
    wd = Path(os.path.abspath(workdir))
    options = f"lowerdir={lowerdir},upperdir={rel(wd / 'upper')},workdir={rel(wd / 'work')}"
    if len(options) > MAX_MOUNT_OPTIONS:
        raise OverlayError(
            f"{len(lowers)} layers need {len(options)} bytes of mount options "
            f"(limit {MAX_MOUNT_OPTIONS}); flatten some layers"
        )
    return options, cwd


def _mount(lowers: Sequence[Path], workdir: Path) -> None:
    for lower in lowers:
        if not lower.is_dir():
            raise OverlayError(f"lower layer {lower} is not a directory")
    options, cwd = mount_options(lowers, workdir)
    merged = Path(os.path.abspath(workdir / "merged"))
    proc = subprocess.run(
        ["mount", "-t", "overlay", "overlay", "-o", options, str(merged)],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise OverlayError(f"mounting overlay at {merged} failed: {proc.stderr.strip()}")


def _unmount(mountpoint: Path) -> None:
    if not _is_mountpoint(mountpoint):
        return
    proc = subprocess.run(["umount", str(mountpoint)], capture_output=True, text=True, check=False)
    if proc.returncode != 0 and _is_mountpoint(mountpoint):
        # Busy (a process still has a file open or its cwd inside): detach it
        # now; the kernel frees it when the last user goes away.
        subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True, check=False)


def _remove(workdir: Path) -> None:
    merged = workdir / "merged"
    if _is_mountpoint(merged):
        # Never recurse into a still-mounted tree: that would delete layer data.
        _unmount(merged)
        if _is_mountpoint(merged):
            raise OverlayError(f"{merged} is still mounted; not removing {workdir}")
    remove_disk(workdir)  # detached at worst: its blocks are freed after its last user
    if _is_mountpoint(workdir):
        raise OverlayError(f"the disk at {workdir} is still mounted; not removing it")
    shutil.rmtree(workdir, ignore_errors=True)


def _mountinfo() -> list[tuple[Path, str]]:
    """(mountpoint, fstype) of every mount in this mount namespace."""
    out: list[tuple[Path, str]] = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            mountpoint = _unescape(fields[4])
            out.append((Path(mountpoint), fields[sep + 1]))
    return out


def _unescape(field: str) -> str:
    return field.encode().decode("unicode_escape") if "\\" in field else field


def _is_mountpoint(path: Path) -> bool:
    target = Path(os.path.abspath(path))
    return any(mp == target for mp, _ in _mountinfo())


def _overlay_mounts_under(root: Path) -> list[Path]:
    return [mp for mp, fstype in _mountinfo() if fstype == "overlay" and mp.is_relative_to(root)]
