"""Sized disks for sandbox roots: a sparse file holding an ext4 file system,
loop-mounted where the sandbox's overlay keeps its upper and work directories.

A sandbox writes only to its overlay's upper directory (`aenv.storage.overlay`),
so putting that directory on a file system of its own bounds what the sandbox
can write: past the size, the kernel answers ENOSPC inside the sandbox, and
the host holds at most the file's size (it is sparse: blocks are taken only
as they are written, and freed when the disk is removed). overlayfs reports
its upper's file system to statfs(2), so `df /` inside shows the sandbox's
size and use, not the host's.

The disk of a sandbox that resumes from frozen layers (a pause, a fork, a
snapshot) must count what those layers already hold, so the quota is one
for the sandbox's whole life, not one per period: `make_disk` reserves
`carried_bytes` of it with a preallocated file outside the upper
(fallocate(2) marks ext4 blocks used without writing them, so the host pays
nothing for it). Making a disk is a few milliseconds: a truncate, `mkfs.ext4`
with a small journal written only as it is used (`lazy_journal_init`; without
one, ext4 passes over every inode freed in the last minute when it allocates
one, its guard for journal-less crashes, and creating files after deleting
many slowed to a twentieth) and a mount with
`noinit_itable` (inode tables are never zeroed: a new sparse file reads as
zeros already); the loop device then does direct I/O to the file, so the
host caches the sandbox's data once, not twice. Blocking; run in a worker thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
from pathlib import Path

__all__ = [
    "DISK_SUFFIX",
    "MIN_FREE_BYTES",
    "DiskError",
    "disk_image",
    "disk_mounts",
    "is_disk",
    "make_disk",
    "remove_disk",
    "take_disk",
]

_MS_MOVE = 8192
_libc = ctypes.CDLL(None, use_errno=True)
_libc_mount = _libc.mount
_libc_mount.argtypes = (
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_ulong,
    ctypes.c_void_p,
)

# The disk's backing file is the mount point's name with this suffix, beside it.
DISK_SUFFIX = ".img"
# Where the bytes of the layers under the upper are reserved, on the disk.
_CARRIED = ".carried"
# A disk keeps at least this much room for its new period whatever it carries,
# so a sandbox whose layers filled its quota still starts (and can delete).
MIN_FREE_BYTES = 64 << 20
# mkfs.ext4 refuses smaller file systems than this.
MIN_SIZE_BYTES = 16 << 20


class DiskError(RuntimeError):
    """The disk could not be made or mounted (no loop device, no mkfs.ext4)."""


def make_disk(workdir: Path, size_bytes: int, carried_bytes: int = 0) -> None:
    """Make a disk of `size_bytes` in the empty directory `workdir` and mount it
    there, with `carried_bytes` of it already used (see the module docstring).

    The backing file is `disk_image(workdir)`, beside it; `remove_disk`
    unmounts the disk (the loop device goes with its last user) and removes
    that file.
    """
    size = max(int(size_bytes), MIN_SIZE_BYTES)
    image = disk_image(workdir)
    with contextlib.suppress(FileNotFoundError):
        image.unlink()  # a crash's: its disk is not mounted any more
    with open(image, "xb") as f:
        f.truncate(size)
    # the journal (MiB; the host holds at most this much of it): small disks keep
    # their room
    journal = 16 if size >= 4 << 30 else 4 if size >= 512 << 20 else 1
    _run(
        ["mkfs.ext4", "-q", "-F", "-m", "0", "-J", f"size={journal}",
         "-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard,root_owner=0:0",
         "-L", "aenv-disk", str(image)],
        "making the file system",
    )  # fmt: skip
    _run(
        ["mount", "-t", "ext4", "-o", "loop,noinit_itable,nodev,nosuid", str(image), str(workdir)],
        "mounting the disk",
    )
    try:
        # direct I/O to the file: one page cache (the disk's), not two, and
        # fsync at the host's speed; where the host refuses, buffered it is
        device = _source_of(workdir)
        if device is not None:
            subprocess.run(["losetup", "--direct-io=on", device], capture_output=True, check=False)
        os.chmod(workdir, 0o755)
        _reserve(workdir, carried_bytes)
    except BaseException:
        remove_disk(workdir)
        raise


def take_disk(disk: Path, workdir: Path, carried_bytes: int = 0) -> None:
    """Move the disk `make_disk` mounted at `disk` (made ahead, unused) to the
    empty directory `workdir`, its file with it (same file system), as if
    `make_disk(workdir, its size, carried_bytes)` had made it there: one
    mount move and a rename instead of a mkfs and a loop mount. Raises
    DiskError, leaving `disk` as it was, if the move is refused (a mount
    under a shared mount cannot move)."""
    if _libc_mount(os.fsencode(disk), os.fsencode(workdir), None, _MS_MOVE, None) != 0:
        errno = ctypes.get_errno()
        raise DiskError(f"moving the disk at {disk}: {os.strerror(errno)}")
    try:
        os.rename(disk_image(disk), disk_image(workdir))
        _reserve(workdir, carried_bytes)
    except BaseException:
        remove_disk(workdir)
        with contextlib.suppress(FileNotFoundError):
            disk_image(disk).unlink()
        raise


def _reserve(workdir: Path, carried_bytes: int) -> None:
    st = os.statvfs(workdir)
    carried = min(int(carried_bytes), st.f_bavail * st.f_frsize - MIN_FREE_BYTES)
    if carried > 0:
        fd = os.open(workdir / _CARRIED, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        try:
            os.posix_fallocate(fd, 0, carried)
        except OSError:
            pass  # a full reservation is not worth failing a start for
        finally:
            os.close(fd)


def disk_image(workdir: Path) -> Path:
    """The backing file of the disk mounted (or to be mounted) at `workdir`."""
    return workdir.with_name(workdir.name + DISK_SUFFIX)


def remove_disk(workdir: Path) -> None:
    """Unmount the disk mounted at `workdir` (lazily if a process still holds it)
    and remove its file (its blocks are freed once the loop device lets it go)."""
    if is_disk(workdir):
        proc = subprocess.run(["umount", str(workdir)], capture_output=True, check=False)
        if proc.returncode != 0 and is_disk(workdir):
            subprocess.run(["umount", "-l", str(workdir)], capture_output=True, check=False)
    with contextlib.suppress(FileNotFoundError):
        disk_image(workdir).unlink()


def is_disk(path: Path) -> bool:
    """Whether a disk (`make_disk`) is mounted at `path`."""
    target = Path(os.path.abspath(path))
    return target in disk_mounts()


def disk_mounts() -> list[Path]:
    """Every disk `make_disk` mounted (in this mount namespace): loop-mounted
    ext4 whose file is `disk_image` of its mount point (not, say, a volume's)."""
    return [mp for mp, dev in _loop_mounts().items() if _backing_file(dev) == disk_image(mp)]


def _backing_file(device: str) -> Path | None:
    name = Path(device).name
    try:
        text = Path(f"/sys/block/{name}/loop/backing_file").read_text().strip()
    except OSError:
        return None
    return Path(text.removesuffix(" (deleted)"))


def _source_of(workdir: Path) -> str | None:
    return _loop_mounts().get(Path(os.path.abspath(workdir)))


def _loop_mounts() -> dict[Path, str]:
    """{mount point: loop device} of the loop-mounted ext4 file systems."""
    found: dict[Path, str] = {}
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            fstype, source = fields[sep + 1], fields[sep + 2]
            if fstype == "ext4" and source.startswith("/dev/loop"):
                mountpoint = fields[4]
                if "\\" in mountpoint:
                    mountpoint = mountpoint.encode().decode("unicode_escape")
                found[Path(mountpoint)] = source
    return found


def _run(argv: list[str], what: str) -> None:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    except FileNotFoundError as exc:
        raise DiskError(f"{what}: {exc}") from None
    if proc.returncode != 0:
        raise DiskError(f"{what} failed: {(proc.stderr or proc.stdout).strip()}")
