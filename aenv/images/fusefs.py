"""The node's lazy, read-only FUSE file system serving every image's merged root tree.

pyfuse3 allows one FUSE session per process, so one `ImageFS` is mounted per
node (`open_image_fs`) and serves many images: the mount root lists image
keys, each a directory that is the root of one `ImageTree` (`add`/`remove`).
Metadata comes from the tree alone; file contents are read chunk by chunk
from the `ChunkCache`, which fetches a chunk on its first read, so starting a
sandbox only pulls what it touches. Runtimes stack a writable overlayfs upper
on an image directory. Inode numbers are global: image slot << 32 | tree ino,
slots are never reused, and the mount root is `pyfuse3.ROOT_INODE`. Content
is immutable, so the kernel may cache attributes, entries and pages for long;
entries at the mount root (the image list) get short timeouts instead.

pyfuse3 runs its request loop as tasks of the caller's trio loop: the process
must never touch the mount from that loop's thread (a syscall there blocks
the very loop that would answer it); use worker threads or other processes.
Handlers raise only `FUSEError`: any other exception would end pyfuse3's main
loop, so it is logged and answered with EIO.
"""

from __future__ import annotations

import bisect
import errno
import functools
import logging
import os
import stat
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import pyfuse3
import trio

from aenv.images.cache import ChunkCache, ChunkUnavailable
from aenv.proto.imagetree import ROOT_INO, ImageTree, Inode
from aenv.proto.layerindex import Kind

__all__ = [
    "FSStatistics",
    "ImageBusy",
    "ImageFS",
    "open_image_fs",
    "reap_stale_image_mount",
]

log = logging.getLogger(__name__)

FSNAME = "aenv-images"
_SLOT_SHIFT = 32
_INO_MASK = (1 << _SLOT_SHIFT) - 1
_IMAGE_TIMEOUT_S = 3600.0  # image contents never change
_ROOT_TIMEOUT_S = 1.0  # the list of images does
_BLKSIZE = 128 * 1024
_TERMINATE_GRACE_S = 5.0
_MAX_LOGGED_FAILURES = 1024

_KIND_BITS = {
    Kind.FILE: stat.S_IFREG,
    Kind.DIR: stat.S_IFDIR,
    Kind.SYMLINK: stat.S_IFLNK,
    Kind.CHAR: stat.S_IFCHR,
    Kind.BLOCK: stat.S_IFBLK,
    Kind.FIFO: stat.S_IFIFO,
}

P = ParamSpec("P")
R = TypeVar("R")


class ImageBusy(RuntimeError):
    """The image still has open files or directories and cannot be removed."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FSStatistics:
    images: int
    open_handles: int
    reads: int
    bytes_served: int
    read_errors: int


@dataclass(slots=True)
class _Image:
    key: str
    slot: int
    tree: ImageTree
    content_bytes: int
    handles: int = 0
    # Where a copy of the tree lies on local disk (`serve_local`): files opened
    # from then on are read from it, not through the chunk cache.
    local: Path | None = None
    paths: dict[int, str] = field(default_factory=dict)


@dataclass(slots=True)
class _File:
    image: _Image
    inode: Inode
    starts: list[int]  # offset in the file of each chunk
    fd: int | None = None  # the local copy's file, when the image has one


@dataclass(slots=True)
class _Dir:
    image: _Image | None  # None: the mount root
    entries: list[tuple[bytes, int]] = field(default_factory=list)  # name, global ino


def _guarded(fn: Callable[P, Awaitable[R]]) -> Callable[P, Coroutine[Any, Any, R]]:
    """Answer unexpected exceptions with EIO instead of letting them end the main loop."""

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await fn(*args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except Exception:
            log.exception("FUSE %s failed", fn.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None

    return wrapper


class ImageFS(pyfuse3.Operations):
    def __init__(self, *, cache: ChunkCache) -> None:
        super().__init__()
        self.cache = cache
        self._images: dict[int, _Image] = {}
        self._slots: dict[str, int] = {}
        self._next_slot = 1
        self._handles: dict[int, _File | _Dir] = {}
        self._next_fh = 1
        self._root_mtime_ns = time.time_ns()
        self._reads = self._bytes_served = self._read_errors = 0
        self._logged_failures: set[str] = set()

    # -- the image list ----------------------------------------------------

    def add(self, key: str, tree: ImageTree) -> None:
        """Serve `tree` as the directory `key` of the mount root."""
        if not key or "/" in key or key in (".", "..") or "\0" in key:
            raise ValueError(f"bad image key {key!r}")
        if key in self._slots:
            raise ValueError(f"image {key!r} is already served")
        if ROOT_INO not in tree.inodes or max(tree.inodes) > _INO_MASK:
            raise ValueError("tree has no root or inode numbers beyond 32 bits")
        slot = self._next_slot
        if slot >= 1 << (64 - _SLOT_SHIFT):
            raise RuntimeError("image slots exhausted")
        self._next_slot += 1
        self._images[slot] = _Image(key, slot, tree, tree.content_bytes)
        self._slots[key] = slot
        self._root_mtime_ns = time.time_ns()

    def remove(self, key: str) -> None:
        """Stop serving `key`; raises `ImageBusy` while files or dirs of it are open.

        The kernel may still resolve the name for up to a second (the mount
        root's entry timeout); any use of its inodes then fails with ENOENT.
        """
        slot = self._slots.get(key)
        if slot is None:
            raise KeyError(key)
        image = self._images[slot]
        if image.handles:
            raise ImageBusy(f"image {key!r} has {image.handles} open handles")
        del self._slots[key]
        del self._images[slot]
        self._root_mtime_ns = time.time_ns()

    def serve_local(self, key: str, root: Path) -> None:
        """Read the files of `key` opened from now on from `root`, a local copy of its
        tree (same paths, same contents), instead of through the chunk cache."""
        image = self._images[self._slots[key]]
        image.paths = {node.ino: path for path, node in image.tree.walk()}
        image.local = root

    def keys(self) -> list[str]:
        return list(self._slots)

    def statistics(self) -> FSStatistics:
        return FSStatistics(
            images=len(self._images),
            open_handles=len(self._handles),
            reads=self._reads,
            bytes_served=self._bytes_served,
            read_errors=self._read_errors,
        )

    # -- inode helpers -----------------------------------------------------

    def _resolve(self, ino: int) -> tuple[_Image, Inode]:
        image = self._images.get(ino >> _SLOT_SHIFT)
        if image is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        inode = image.tree.inodes.get(ino & _INO_MASK)
        if inode is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return image, inode

    def _root_attr(self) -> pyfuse3.EntryAttributes:
        attr = pyfuse3.EntryAttributes()
        attr.st_ino = pyfuse3.ROOT_INODE
        attr.st_mode = stat.S_IFDIR | 0o755
        attr.st_nlink = 2 + len(self._images)
        attr.st_uid = attr.st_gid = 0
        attr.st_size = 0
        attr.st_blksize = _BLKSIZE
        attr.st_blocks = 0
        attr.st_atime_ns = attr.st_mtime_ns = attr.st_ctime_ns = self._root_mtime_ns
        attr.entry_timeout = attr.attr_timeout = _ROOT_TIMEOUT_S
        return attr

    def _attr(self, image: _Image, inode: Inode) -> pyfuse3.EntryAttributes:
        attr = pyfuse3.EntryAttributes()
        attr.st_ino = image.slot << _SLOT_SHIFT | inode.ino
        attr.st_mode = _KIND_BITS[inode.kind] | (inode.mode & 0o7777)
        attr.st_nlink = inode.nlink
        attr.st_uid = inode.uid
        attr.st_gid = inode.gid
        attr.st_rdev = (
            os.makedev(inode.devmajor, inode.devminor)
            if inode.kind in (Kind.CHAR, Kind.BLOCK)
            else 0
        )
        attr.st_size = inode.size
        attr.st_blksize = _BLKSIZE
        attr.st_blocks = (inode.size + 511) // 512 if inode.kind is Kind.FILE else 0
        attr.st_atime_ns = attr.st_mtime_ns = attr.st_ctime_ns = inode.mtime_ns
        timeout = _ROOT_TIMEOUT_S if inode.ino == ROOT_INO else _IMAGE_TIMEOUT_S
        attr.entry_timeout = attr.attr_timeout = timeout
        return attr

    def _attr_of(self, ino: int) -> pyfuse3.EntryAttributes:
        if ino == pyfuse3.ROOT_INODE:
            return self._root_attr()
        return self._attr(*self._resolve(ino))

    def _parent_of(self, ino: int) -> int:
        if ino == pyfuse3.ROOT_INODE:
            return ino
        image, inode = self._resolve(ino)
        if inode.ino == ROOT_INO:
            return pyfuse3.ROOT_INODE
        return image.slot << _SLOT_SHIFT | inode.parent

    def _dir_entries(self, ino: int) -> tuple[_Image | None, list[tuple[bytes, int]]]:
        entries = [(b".", ino), (b"..", self._parent_of(ino))]
        if ino == pyfuse3.ROOT_INODE:
            entries += [
                (os.fsencode(k), s << _SLOT_SHIFT | ROOT_INO) for k, s in self._slots.items()
            ]
            return None, entries
        image, inode = self._resolve(ino)
        if inode.children is None:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        base = image.slot << _SLOT_SHIFT
        entries += [(os.fsencode(n), base | c) for n, c in inode.children.items()]
        return image, entries

    def _new_handle(self, handle: _File | _Dir) -> int:
        fh = self._next_fh
        self._next_fh += 1
        self._handles[fh] = handle
        if handle.image is not None:
            handle.image.handles += 1
        return fh

    def _drop_handle(self, fh: int) -> None:
        handle = self._handles.pop(fh, None)
        if handle is not None and handle.image is not None:
            handle.image.handles -= 1

    # -- metadata operations -----------------------------------------------

    @_guarded
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._attr_of(inode)

    @_guarded
    async def lookup(
        self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        if name == b".":
            return self._attr_of(parent_inode)
        if name == b"..":
            return self._attr_of(self._parent_of(parent_inode))
        if parent_inode == pyfuse3.ROOT_INODE:
            slot = self._slots.get(os.fsdecode(name))
            if slot is None:
                raise pyfuse3.FUSEError(errno.ENOENT)
            image = self._images[slot]
            return self._attr(image, image.tree.inodes[ROOT_INO])
        image, inode = self._resolve(parent_inode)
        if inode.children is None:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        child = inode.children.get(os.fsdecode(name))
        if child is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attr(image, image.tree.inodes[child])

    @_guarded
    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        _, node = self._resolve(inode)
        if node.kind is not Kind.SYMLINK:
            raise pyfuse3.FUSEError(errno.EINVAL)
        return os.fsencode(node.link)

    @_guarded
    async def access(self, inode: int, mode: int, ctx: pyfuse3.RequestContext) -> bool:
        # Only consulted without `default_permissions` (the kernel checks otherwise).
        attr = self._attr_of(inode)
        if mode & os.W_OK:
            return False
        if ctx.uid == 0:
            return not mode & os.X_OK or bool(attr.st_mode & 0o111 or stat.S_ISDIR(attr.st_mode))
        if ctx.uid == attr.st_uid:
            bits = attr.st_mode >> 6
        elif ctx.gid == attr.st_gid or attr.st_gid in pyfuse3.get_sup_groups(ctx.pid):
            bits = attr.st_mode >> 3
        else:
            bits = attr.st_mode
        return mode & bits & 0o7 == mode & 0o7

    @_guarded
    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        if inode == pyfuse3.ROOT_INODE:
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        _, node = self._resolve(inode)
        value = node.xattrs.get(os.fsdecode(name))
        if value is None:
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        return value

    @_guarded
    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> Sequence[bytes]:
        if inode == pyfuse3.ROOT_INODE:
            return []
        _, node = self._resolve(inode)
        return [os.fsencode(k) for k in node.xattrs]

    @_guarded
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        out = pyfuse3.StatvfsData()
        out.f_bsize = _BLKSIZE
        out.f_frsize = 4096
        content = sum(i.content_bytes for i in self._images.values())
        out.f_blocks = (content + 4095) // 4096
        out.f_bfree = out.f_bavail = 0
        out.f_files = 1 + sum(len(i.tree.inodes) for i in self._images.values())
        out.f_ffree = out.f_favail = 0
        out.f_namemax = 255
        return out

    # -- directories -------------------------------------------------------

    @_guarded
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        image, entries = self._dir_entries(inode)
        return self._new_handle(_Dir(image, entries))

    @_guarded
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        handle = self._handles.get(fh)
        if not isinstance(handle, _Dir):
            raise pyfuse3.FUSEError(errno.EBADF)
        # `start_id` is the index of the next entry: what we passed as next_id.
        for index in range(start_id, len(handle.entries)):
            name, ino = handle.entries[index]
            try:
                attr = self._attr_of(ino)
            except pyfuse3.FUSEError:
                continue  # its image was removed meanwhile
            if not pyfuse3.readdir_reply(token, name, attr, index + 1):
                return

    @_guarded
    async def releasedir(self, fh: int) -> None:
        self._drop_handle(fh)

    # -- files -------------------------------------------------------------

    @_guarded
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        if flags & os.O_ACCMODE != os.O_RDONLY or flags & os.O_TRUNC:
            raise pyfuse3.FUSEError(errno.EROFS)
        if inode == pyfuse3.ROOT_INODE:
            raise pyfuse3.FUSEError(errno.EISDIR)
        image, node = self._resolve(inode)
        if node.kind is Kind.DIR:
            raise pyfuse3.FUSEError(errno.EISDIR)
        if node.kind is not Kind.FILE:
            raise pyfuse3.FUSEError(errno.EINVAL)
        starts, pos = [], 0
        for chunk in node.chunks:
            starts.append(pos)
            pos += chunk.size
        fd = None
        if image.local is not None:
            local = image.local / image.paths[node.ino]
            try:
                fd = await trio.to_thread.run_sync(os.open, local, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as exc:
                log.error("the local copy of %s lacks %s: %s", image.key, local, exc)
                raise pyfuse3.FUSEError(errno.EIO) from None
        fh = self._new_handle(_File(image, node, starts, fd))
        return pyfuse3.FileInfo(fh=fh, keep_cache=True, direct_io=False)

    @_guarded
    async def read(self, fh: int, off: int, size: int) -> bytes:
        handle = self._handles.get(fh)
        if not isinstance(handle, _File):
            raise pyfuse3.FUSEError(errno.EBADF)
        node = handle.inode
        end = min(off + size, node.size)
        if off >= end:
            return b""
        self._reads += 1
        if handle.fd is not None:
            data = await trio.to_thread.run_sync(os.pread, handle.fd, end - off, off)
            self._bytes_served += len(data)
            return data
        pieces = []
        i = bisect.bisect_right(handle.starts, off) - 1
        pos = off
        while pos < end:
            chunk, start = node.chunks[i], handle.starts[i]
            n = min(end, start + chunk.size) - pos
            try:
                pieces.append(await self.cache.read(chunk, node.layer, pos - start, n))
            except ChunkUnavailable as exc:
                self._read_errors += 1
                if chunk.digest not in self._logged_failures:
                    if len(self._logged_failures) >= _MAX_LOGGED_FAILURES:
                        self._logged_failures.clear()
                    self._logged_failures.add(chunk.digest)
                    log.error("read of %s: %s (cause: %r)", handle.image.key, exc, exc.__cause__)
                raise pyfuse3.FUSEError(errno.EIO) from None
            pos += n
            i += 1
        data = b"".join(pieces)
        self._bytes_served += len(data)
        return data

    @_guarded
    async def release(self, fh: int) -> None:
        handle = self._handles.get(fh)
        if isinstance(handle, _File) and handle.fd is not None:
            os.close(handle.fd)
        self._drop_handle(fh)


_active = False


@asynccontextmanager
async def open_image_fs(mountpoint: Path, fs: ImageFS) -> AsyncIterator[ImageFS]:
    """Mount `fs` read-only at `mountpoint` and serve it until the block exits.

    One per process (a pyfuse3 limit). The request loop runs as tasks of the
    current trio loop: do not touch the mount from this thread.
    """
    global _active
    if _active:
        raise RuntimeError("an image file system is already mounted by this process")
    await trio.to_thread.run_sync(functools.partial(mountpoint.mkdir, parents=True, exist_ok=True))
    options = {f"fsname={FSNAME}", "ro", "allow_other", "default_permissions"}
    pyfuse3.init(fs, str(mountpoint), options)
    _active = True
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pyfuse3.main)
            try:
                yield fs
            finally:
                pyfuse3.terminate()
                # Requests still in flight (a slow fetch) get a grace period.
                nursery.cancel_scope.deadline = trio.current_time() + _TERMINATE_GRACE_S
    finally:
        _active = False
        pyfuse3.close(unmount=True)


def reap_stale_image_mount(mountpoint: Path) -> bool:
    """Lazily unmount a dead FUSE mount (its server was killed) at `mountpoint`.

    Blocking; for a node starting after SIGKILL. Returns whether it unmounted.
    """
    try:
        os.statvfs(mountpoint)  # always asks the server (stat may be answered from cache)
    except OSError as exc:
        if exc.errno != errno.ENOTCONN:
            return False
    else:
        return False
    for cmd in (["fusermount3", "-u", "-z", str(mountpoint)], ["umount", "-l", str(mountpoint)]):
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        except FileNotFoundError:
            continue
        if proc.returncode == 0:
            log.info("unmounted the stale image file system at %s", mountpoint)
            return True
        log.warning("%s: %s", " ".join(cmd), proc.stderr.strip())
    return False
