"""Volumes on this node: a size-capped ext4 image each, loop-mounted on the host.

A volume lives under `<root>/<volume id>/`: `volume.json` (its record: name,
token, size; written atomically, so records survive a node restart),
`image.ext4` (a sparse file system image whose size is the volume's quota)
and `mnt/` (where the node mounts it). Sandboxes bind-mount `mnt/` at the
paths they asked for; gVisor reaches it through its gofer, so every sandbox
on the node that mounts the volume shares the host's page cache and sees
the others' writes at once, and a full volume answers `ENOSPC` inside. The
content API (`aenv.api.volumes`) reads and writes the same tree from the
host, resolving every path component with `O_NOFOLLOW` below the volume's
root: a symlink a sandbox planted can never lead the node outside it.

Who uses a volume is the caller's knowledge (`users`: the node's sandboxes
that mount it, paused ones included); a volume in use cannot be deleted.
`persist` copies a volume's tree to the object store as one content-addressed
layer index plus chunk blobs (`aenv.storage.snapstore`), uploading only the
chunks the store does not hold yet, and `fetch` brings a volume this node does
not have back from it: the way a volume moves between nodes.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import secrets
import shutil
import stat
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import trio

from aenv.kit.files import write_atomic
from aenv.proto import ids
from aenv.proto import volumes as pv
from aenv.proto.layerindex import CHUNK_SIZE, Chunk, Entry, Kind, LayerIndex, dumps
from aenv.storage.objstore import ObjectNotFound, ObjectStore, content_digest
from aenv.storage.snapstore.manifest import VOLUME_PREFIX, StoredLayer
from aenv.storage.snapstore.restore import materialise_layer
from aenv.storage.snapstore.trees import LAYER_MEDIA_TYPE

log = logging.getLogger("aenv.volumes")

T = TypeVar("T")

# who owns a new volume's root (and what the content API creates, unless
# told): the E2B images' default user, so the sandbox's user can write
DEFAULT_UID = 1000
DEFAULT_GID = 1000
IO_CHUNK = 1024 * 1024
_MOUNT_TRIES = 5
STORE_PREFIX = VOLUME_PREFIX + "/"


class VolumeError(Exception):
    """A volume operation refused; `status` is the HTTP status it answers."""

    status = 400


class VolumeNotFound(VolumeError, LookupError):
    status = 404


class VolumePathNotFound(VolumeError, LookupError):
    status = 404


class VolumeConflict(VolumeError):
    status = 409


class VolumeFull(VolumeError):
    """The volume's quota is used up (413: the body did not fit)."""

    status = 413


@dataclass(frozen=True, kw_only=True)
class VolumeRecord:
    volume_id: str
    name: str
    token: str
    size_mb: int
    created_at: float

    def to_doc(self) -> dict[str, Any]:
        return {
            "version": 1,
            "volumeID": self.volume_id,
            "name": self.name,
            "token": self.token,
            "sizeMB": self.size_mb,
            "createdAt": self.created_at,
        }

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> VolumeRecord:
        return cls(
            volume_id=str(doc["volumeID"]),
            name=str(doc["name"]),
            token=str(doc["token"]),
            size_mb=int(doc["sizeMB"]),
            created_at=float(doc["createdAt"]),
        )


def _no_users(_volume_id: str) -> list[str]:
    return []


class Volumes:
    """This node's volumes (module docstring). Create with `open_volumes`."""

    def __init__(
        self,
        root: Path,
        *,
        node_tag: str = "node",
        users: Callable[[str], list[str]] = _no_users,
        store: ObjectStore | None = None,
    ) -> None:
        self.root = root
        self.node_tag = node_tag
        self.users = users
        self.store = store
        self._records: dict[str, VolumeRecord] = {}
        self._lock = trio.Lock()  # creates, deletes, mounts, fetches
        self._io = trio.CapacityLimiter(4)
        # changed (content API) or mounted since their last copy in the store
        self._dirty: set[str] = set()
        # per volume: path -> (inode, size, mtime, ctime) and the chunks it hashed to
        self._chunks: dict[str, dict[str, tuple[tuple[int, ...], tuple[Chunk, ...]]]] = {}
        self._persisting: dict[str, trio.Lock] = {}
        self._copied_at: dict[str, float] = {}  # trio time of each volume's last copy

    # -- records -------------------------------------------------------------

    def _dir(self, volume_id: str) -> Path:
        return self.root / volume_id

    def mountpoint(self, volume_id: str) -> Path:
        return self._dir(volume_id) / "mnt"

    async def load(self) -> None:
        """Read the records a node process left and mount their volumes."""
        docs = await trio.to_thread.run_sync(self._read_records)
        for doc in docs:
            rec = VolumeRecord.from_doc(doc)
            self._records[rec.volume_id] = rec
        for rec in list(self._records.values()):
            try:
                await self._ensure_mounted(rec.volume_id)
            except Exception:
                log.exception("mounting volume %s (%s) failed", rec.volume_id, rec.name)

    def _read_records(self) -> list[dict[str, Any]]:
        self.root.mkdir(parents=True, exist_ok=True)
        out = []
        for d in sorted(self.root.iterdir()):
            f = d / "volume.json"
            try:
                out.append(json.loads(f.read_bytes()))
            except FileNotFoundError:
                # a create that died before its record: nothing refers to it
                if not os.path.ismount(d / "mnt"):
                    shutil.rmtree(d, ignore_errors=True)
            except (OSError, ValueError):
                log.exception("volume record %s is unreadable", f)
        return out

    def all(self) -> list[VolumeRecord]:
        return sorted(self._records.values(), key=lambda r: (r.created_at, r.volume_id))

    def find(self, id_or_name: str) -> VolumeRecord | None:
        rec = self._records.get(id_or_name)
        if rec is not None:
            return rec
        return next((r for r in self._records.values() if r.name == id_or_name), None)

    def get(self, id_or_name: str) -> VolumeRecord:
        rec = self.find(id_or_name)
        if rec is None:
            raise VolumeNotFound(f"volume {id_or_name!r} not found")
        return rec

    def held(self) -> list[str]:
        """The IDs of the volumes on this node (a cluster's placement prefers it for them)."""
        return sorted(self._records)

    # -- lifecycle -------------------------------------------------------------

    async def create(self, name: str, size_mb: int = pv.DEFAULT_SIZE_MB) -> VolumeRecord:
        async with self._lock:
            if self.find(name) is not None:
                raise VolumeConflict(f"volume {name!r} already exists")
            rec = VolumeRecord(
                volume_id=ids.new_sandbox_id(self.node_tag),
                name=name,
                token=secrets.token_urlsafe(32),
                size_mb=size_mb,
                created_at=time.time(),
            )
            d = self._dir(rec.volume_id)
            try:
                await trio.to_thread.run_sync(_make_image, d / "image.ext4", size_mb)
                await self._mount(rec.volume_id)
                await trio.to_thread.run_sync(_prepare_root, self.mountpoint(rec.volume_id))
                await trio.to_thread.run_sync(
                    write_atomic, d / "volume.json", json.dumps(rec.to_doc()).encode()
                )
            except BaseException:
                with trio.CancelScope(shield=True):
                    await self._remove_files(rec.volume_id)
                raise
            self._records[rec.volume_id] = rec
            log.info("volume %s (%s) created, %d MiB", rec.volume_id, name, size_mb)
            return rec

    async def delete(self, id_or_name: str) -> VolumeRecord:
        async with self._lock:
            rec = self.get(id_or_name)
            users = self.users(rec.volume_id)
            if users:
                raise VolumeConflict(
                    f"volume {rec.name!r} is mounted by sandbox(es) {', '.join(sorted(users))}: "
                    "kill them first"
                )
            del self._records[rec.volume_id]
            self._dirty.discard(rec.volume_id)
            self._chunks.pop(rec.volume_id, None)
            self._copied_at.pop(rec.volume_id, None)
            await trio.to_thread.run_sync((self._dir(rec.volume_id) / "volume.json").unlink)
            # a copy under way finishes first: its manifest must not outlive this
            async with self._persisting.setdefault(rec.volume_id, trio.Lock()):
                await self._remove_files(rec.volume_id)
                if self.store is not None:
                    with contextlib.suppress(Exception):
                        await self.store.delete(STORE_PREFIX + rec.volume_id + ".json")
            self._persisting.pop(rec.volume_id, None)
            log.info("volume %s (%s) deleted", rec.volume_id, rec.name)
            return rec

    async def drop_local(self, volume_id: str) -> None:
        """Remove this node's copy of a volume whose sandboxes moved away with it
        (its copy in the object store stays: the node they went to fetched it)."""
        async with self._lock:
            rec = self.get(volume_id)
            if self.users(volume_id):
                raise VolumeConflict(f"volume {rec.name!r} is mounted here")
            del self._records[volume_id]
            self._dirty.discard(volume_id)
            self._chunks.pop(volume_id, None)
            await trio.to_thread.run_sync((self._dir(volume_id) / "volume.json").unlink)
            await self._remove_files(volume_id)
            log.info("volume %s (%s) left this node", volume_id, rec.name)

    async def host_path(self, volume_id: str) -> Path:
        """The host directory a sandbox bind-mounts for `volume_id` (mounted now if
        it was not; fetched from the object store if this node has no copy: a
        sandbox moved here from another node)."""
        if volume_id not in self._records and self.store is not None:
            await self.fetch(volume_id)
        async with self._lock:
            if volume_id not in self._records:
                raise VolumeNotFound(f"volume {volume_id!r} not found")
            await self._ensure_mounted(volume_id)
        self._dirty.add(volume_id)  # a sandbox may write to it from now on
        return self.mountpoint(volume_id)

    async def resolve(self, mounts: tuple[pv.VolumeMount, ...]) -> tuple[pv.VolumeMount, ...]:
        """`mounts` with their volume IDs (by name; the store's if this node has none)."""
        out = []
        for m in mounts:
            rec = self.find(m.volume_id or m.name)
            if rec is None and self.store is not None:
                rec = await self.fetch(m.name)
            if rec is None:
                raise VolumeNotFound(f"volume {m.name!r} not found")
            out.append(pv.VolumeMount(rec.name, m.path, rec.volume_id))
        return tuple(out)

    async def close(self) -> None:
        """Unmount every volume (the node stops with no sandbox left running)."""
        async with self._lock:
            for volume_id in list(self._records):
                mnt = self.mountpoint(volume_id)
                if await trio.to_thread.run_sync(os.path.ismount, mnt):
                    await _run("umount", str(mnt), check=False)

    async def _ensure_mounted(self, volume_id: str) -> None:
        if not await trio.to_thread.run_sync(os.path.ismount, self.mountpoint(volume_id)):
            await self._mount(volume_id)

    async def _mount(self, volume_id: str) -> None:
        """Mount the image through a loop device with direct IO (no second page
        cache for the image file: twice the write rate here). A loop device
        still attached to the image is mounted again rather than a second
        one: mount namespaces made while it was mounted (every runsc
        sandbox's) keep its file system alive after an unmount here, and two
        ext4 instances over one image would corrupt it."""
        d = self._dir(volume_id)
        image = str(d / "image.ext4")
        await trio.to_thread.run_sync(lambda: (d / "mnt").mkdir(parents=True, exist_ok=True))
        for attempt in range(_MOUNT_TRIES):
            attached = await _out(
                "losetup", "--list", "--associated", image, "--output", "NAME", "--noheadings"
            )
            dev = attached.split()[0] if attached.split() else ""
            if dev:
                try:
                    await _run("mount", "-o", "noatime", dev, str(d / "mnt"))
                    return
                except VolumeError:
                    # detached meanwhile (its last mount just went): look again
                    if attempt == _MOUNT_TRIES - 1:
                        raise
                    await trio.sleep(0.05 * (attempt + 1))
                    continue
            dev = (await _out("losetup", "--direct-io=on", "--find", "--show", image)).strip()
            try:
                await _run("mount", "-o", "noatime", dev, str(d / "mnt"))
            finally:  # detached once unmounted everywhere (autoclear)
                await _run("losetup", "--detach", dev, check=False)
            return

    async def _remove_files(self, volume_id: str) -> None:
        d = self._dir(volume_id)
        mnt = d / "mnt"
        if await trio.to_thread.run_sync(os.path.ismount, mnt):
            await _run("umount", str(mnt))
        await trio.to_thread.run_sync(lambda: shutil.rmtree(d, ignore_errors=True))

    # -- the content API (every path relative to the volume's root) -----------

    def _root(self, volume_id: str) -> Path:
        if volume_id not in self._records:
            raise VolumeNotFound(f"volume {volume_id!r} not found")
        return self.mountpoint(volume_id)

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        return await trio.to_thread.run_sync(fn, *args, limiter=self._io)

    async def stat(self, volume_id: str, rel: str) -> dict[str, Any]:
        return await self._call(_stat, self._root(volume_id), rel)

    async def list_dir(self, volume_id: str, rel: str, depth: int) -> list[dict[str, Any]]:
        return await self._call(_list_dir, self._root(volume_id), rel, max(depth, 1))

    async def make_dir(
        self, volume_id: str, rel: str, *, owner: Owner, force: bool
    ) -> dict[str, Any]:
        root = self._root(volume_id)
        self._dirty.add(volume_id)
        return await self._call(_make_dir, root, rel, owner, force)

    async def remove(self, volume_id: str, rel: str) -> None:
        root = self._root(volume_id)
        self._dirty.add(volume_id)
        await self._call(_remove, root, rel)

    async def update(self, volume_id: str, rel: str, owner: Owner) -> dict[str, Any]:
        root = self._root(volume_id)
        self._dirty.add(volume_id)
        return await self._call(_update, root, rel, owner)

    async def write_file(
        self,
        volume_id: str,
        rel: str,
        body: AsyncIterator[bytes],
        *,
        owner: Owner,
        force: bool,
    ) -> dict[str, Any]:
        """Write the file at `rel` from `body` (replacing it), `IO_CHUNK` at a time."""
        root = self._root(volume_id)
        self._dirty.add(volume_id)
        fd = await self._call(_open_for_write, root, rel, owner, force)
        try:
            buf = bytearray()
            async for piece in body:
                buf += piece
                if len(buf) >= IO_CHUNK:
                    await self._call(_write_all, fd, bytes(buf), rel)
                    buf.clear()
            if buf:
                await self._call(_write_all, fd, bytes(buf), rel)
        except BaseException:
            with trio.CancelScope(shield=True):
                await self._call(os.close, fd)
                fd = -1
                with contextlib.suppress(OSError, VolumeError):
                    await self._call(_remove, root, rel)  # never leave half a file behind
            raise
        finally:
            if fd >= 0:
                await self._call(os.close, fd)
        return await self._call(_stat, root, rel)

    async def read_file(self, volume_id: str, rel: str) -> tuple[int, AsyncIterator[bytes]]:
        """The size of the file at `rel` and its bytes, `IO_CHUNK` at a time."""
        fd, size = await self._call(_open_for_read, self._root(volume_id), rel)

        async def chunks() -> AsyncIterator[bytes]:
            try:
                while data := await self._call(os.read, fd, IO_CHUNK):
                    yield data
            finally:
                with trio.CancelScope(shield=True):
                    await self._call(os.close, fd)

        return size, chunks()

    # -- the object store ------------------------------------------------------

    def to_persist(self, *, in_use_every_s: float = 0.0) -> list[str]:
        """Volumes to copy to the store: changed or mounted since their last copy;
        one mounted now (a sandbox may be writing to it: a copy hashes the files
        it changed) at most every `in_use_every_s`."""
        now = trio.current_time()
        return sorted(
            v
            for v in self._records
            if (v in self._dirty or self.users(v))
            and not (self.users(v) and now - self._copied_at.get(v, -math.inf) < in_use_every_s)
        )

    async def persist_due(self, *, in_use_every_s: float = 0.0) -> None:
        """Copy every volume `to_persist` names (the node's persister calls this)."""
        for volume_id in self.to_persist(in_use_every_s=in_use_every_s):
            try:
                await self.persist(volume_id)
            except VolumeNotFound:
                pass  # deleted meanwhile
            except Exception:
                log.exception("persisting volume %s failed (retried next round)", volume_id)

    async def persist(self, volume_id: str) -> dict[str, Any]:
        """Copy the volume's tree to the object store (only chunks it lacks); its manifest.

        The tree is walked with directory fds, nothing followed (a sandbox may
        swap a directory for a symlink meanwhile), and a file whose inode,
        size and times did not change since the last walk is not hashed again.
        Each piece is checked against its digest as it is read: one changed
        since the walk is left for the next copy.
        """
        if self.store is None:
            raise VolumeError("this node has no object store")
        store = self.store
        lock = self._persisting.setdefault(volume_id, trio.Lock())
        async with lock:
            rec = self.get(volume_id)
            self._dirty.discard(volume_id)  # writes from now on: the next copy
            self._copied_at[volume_id] = trio.current_time()
            root = self.mountpoint(volume_id)
            cache = self._chunks.setdefault(volume_id, {})
            index = await self._call(_index_tree, root, cache)
            raw = dumps(index)
            digest = content_digest(raw)
            pieces: dict[str, tuple[str, int, int]] = {}
            for e in index.entries:
                for c in e.chunks:
                    pieces.setdefault(c.digest, (e.path, c.offset, c.size))
            sem = trio.Semaphore(8)
            uploaded = 0

            async def one(digest: str, where: tuple[str, int, int]) -> None:
                nonlocal uploaded
                async with sem:
                    if await store.blob_info(digest) is not None:
                        return
                    data = await self._call(_read_piece, root, *where)
                    if data is None or content_digest(data) != digest:
                        self._dirty.add(volume_id)  # changed since the walk
                        return
                    await store.put_blob(data, digest=digest)
                    uploaded += len(data)

            try:
                async with trio.open_nursery() as n:
                    for d, where in pieces.items():
                        n.start_soon(one, d, where)
                if await store.blob_info(digest) is None:
                    await store.put_blob(raw, digest=digest)
                doc = {**rec.to_doc(), "index": digest, "persistedAt": time.time()}
                await store.put(STORE_PREFIX + volume_id + ".json", json.dumps(doc).encode())
            except BaseException:
                self._dirty.add(volume_id)
                raise
            if uploaded:
                log.info("volume %s copied to the store: %d new bytes", volume_id, uploaded)
            return {**doc, "uploadedBytes": uploaded, "contentBytes": index.content_bytes}

    async def fetch(self, id_or_name: str) -> VolumeRecord | None:
        """A volume the object store holds and this node does not: made local (None if none)."""
        if self.store is None:
            return None
        doc = None
        with contextlib.suppress(ObjectNotFound, ValueError):  # by ID: one read
            doc = json.loads(await self.store.get(STORE_PREFIX + id_or_name + ".json"))
        for info in [] if doc is not None else await self.store.list(STORE_PREFIX):
            try:
                d = json.loads(await self.store.get(info.key))
            except (ObjectNotFound, ValueError):
                continue
            if id_or_name in (d.get("volumeID"), d.get("name")):
                doc = d
                break
        if doc is None:
            return None
        async with self._lock:
            rec = VolumeRecord.from_doc(doc)
            if rec.volume_id in self._records:
                return self._records[rec.volume_id]
            d = self._dir(rec.volume_id)
            staging = self.mountpoint(rec.volume_id) / ".aenv-fetch"  # same fs: renames
            try:
                await trio.to_thread.run_sync(_make_image, d / "image.ext4", rec.size_mb)
                await self._mount(rec.volume_id)
                await materialise_layer(
                    self.store,
                    f"volume {rec.volume_id}",
                    StoredLayer(id=rec.volume_id, below=(), index=str(doc["index"])),
                    staging,
                )
                await trio.to_thread.run_sync(_move_into, staging, self.mountpoint(rec.volume_id))
                await trio.to_thread.run_sync(
                    write_atomic, d / "volume.json", json.dumps(rec.to_doc()).encode()
                )
            except BaseException:
                with trio.CancelScope(shield=True):
                    await self._remove_files(rec.volume_id)
                raise
            self._records[rec.volume_id] = rec
            log.info("volume %s (%s) fetched from the object store", rec.volume_id, rec.name)
            return rec


@dataclass(frozen=True)
class Owner:
    """uid, gid and mode the content API sets (None: the default / unchanged)."""

    uid: int | None = None
    gid: int | None = None
    mode: int | None = None


async def _out(*argv: str, check: bool = True) -> str:
    proc = await trio.run_process(list(argv), capture_stdout=True, capture_stderr=True, check=False)
    if check and proc.returncode != 0:
        raise VolumeError(
            f"{argv[0]} failed ({proc.returncode}): {proc.stderr.decode(errors='replace').strip()}"
        )
    return proc.stdout.decode(errors="replace")


async def _run(*argv: str, check: bool = True) -> None:
    await _out(*argv, check=check)


# -- blocking helpers (worker threads) ---------------------------------------


def _make_image(image: Path, size_mb: int) -> None:
    image.parent.mkdir(parents=True, exist_ok=True)
    with open(image, "wb") as f:
        f.truncate(size_mb * 1024 * 1024)
    opts = f"root_owner={DEFAULT_UID}:{DEFAULT_GID},lazy_itable_init=1,lazy_journal_init=1"
    argv = ["mkfs.ext4", "-q", "-F", "-m", "0", "-E", opts, str(image)]
    subprocess.run(argv, check=True, capture_output=True)


def _prepare_root(mnt: Path) -> None:
    with contextlib.suppress(OSError):
        (mnt / "lost+found").rmdir()
    os.chmod(mnt, 0o755)


def _move_into(staging: Path, mnt: Path) -> None:
    """Move a fetched tree's entries into the mounted volume (and its root's owner and mode)."""
    for child in staging.iterdir():
        os.rename(child, mnt / child.name)
    _prepare_root(mnt)
    s = os.lstat(staging)
    os.chown(mnt, s.st_uid, s.st_gid)
    os.chmod(mnt, stat.S_IMODE(s.st_mode))
    staging.rmdir()


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@contextlib.contextmanager
def _parent(root: Path, rel: str, *, create: Owner | None = None) -> Iterator[tuple[int, str]]:
    """An fd of the directory holding `rel` and its last component, every
    component opened without following symlinks (with `create`, missing
    directories are made, owned as it says)."""
    parts = rel.split("/") if rel else []
    fd = os.open(root, _DIR_FLAGS)
    try:
        for part in parts[:-1]:
            try:
                nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if create is None:
                    raise VolumePathNotFound(f"path /{rel} not found") from None
                os.mkdir(part, 0o755 if create.mode is None else create.mode, dir_fd=fd)
                _chown(fd, part, create)
                nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except (NotADirectoryError, OSError) as exc:
                if exc.errno in (errno.ENOTDIR, errno.ELOOP):
                    raise VolumePathNotFound(
                        f"path /{rel}: a component is not a directory"
                    ) from None
                raise
            os.close(fd)
            fd = nfd
        yield fd, parts[-1] if parts else "."
    finally:
        os.close(fd)


def _fd_xattrs(fd: int) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    with contextlib.suppress(OSError):
        for name in os.listxattr(fd):
            with contextlib.suppress(OSError):
                out[name] = os.getxattr(fd, name)
    return out


def _hash_chunks(fd: int) -> tuple[Chunk, ...]:
    chunks: list[Chunk] = []
    offset = 0
    while block := os.pread(fd, CHUNK_SIZE, offset):
        chunks.append(Chunk(content_digest(block), len(block), offset))
        offset += len(block)
    return tuple(chunks)


def _index_tree(
    root: Path, cache: dict[str, tuple[tuple[int, ...], tuple[Chunk, ...]]]
) -> LayerIndex:
    """A volume's tree as one layer index (`aenv.proto.layerindex`), walked by
    directory fds without following anything; files unchanged since `cache`
    was filled keep their chunks (the cache is updated in place)."""
    entries: list[Entry] = []
    seen: dict[int, str] = {}
    fresh: dict[str, tuple[tuple[int, ...], tuple[Chunk, ...]]] = {}

    def node(path: str, kind: Kind, s: os.stat_result, **kw: Any) -> Entry:
        return Entry(
            path=path,
            kind=kind,
            mode=stat.S_IMODE(s.st_mode),
            uid=s.st_uid,
            gid=s.st_gid,
            mtime_ns=s.st_mtime_ns,
            **kw,
        )

    def walk(fd: int, rel: str) -> None:
        for name in sorted(os.listdir(fd)):
            p = f"{rel}/{name}" if rel else name
            try:
                s = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if stat.S_ISDIR(s.st_mode):
                    sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
                    try:
                        entries.append(node(p, Kind.DIR, os.fstat(sub), xattrs=_fd_xattrs(sub)))
                        walk(sub, p)
                    finally:
                        os.close(sub)
                elif stat.S_ISREG(s.st_mode):
                    if s.st_nlink > 1 and s.st_ino in seen:
                        entries.append(Entry(path=p, kind=Kind.HARDLINK, link=seen[s.st_ino]))
                        continue
                    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
                    ffd = os.open(name, flags, dir_fd=fd)
                    try:
                        f = os.fstat(ffd)
                        if not stat.S_ISREG(f.st_mode):
                            continue
                        key = (f.st_ino, f.st_size, f.st_mtime_ns, f.st_ctime_ns)
                        hit = cache.get(p)
                        chunks = hit[1] if hit is not None and hit[0] == key else _hash_chunks(ffd)
                        fresh[p] = (key, chunks)
                        seen[f.st_ino] = p
                        entries.append(
                            node(
                                p,
                                Kind.FILE,
                                f,
                                size=f.st_size,
                                chunks=chunks,
                                xattrs=_fd_xattrs(ffd),
                            )
                        )
                    finally:
                        os.close(ffd)
                elif stat.S_ISLNK(s.st_mode):
                    entries.append(node(p, Kind.SYMLINK, s, link=os.readlink(name, dir_fd=fd)))
                elif stat.S_ISFIFO(s.st_mode):
                    entries.append(node(p, Kind.FIFO, s))
                # sockets and devices are left out: nothing restores them
            except (FileNotFoundError, NotADirectoryError):
                continue  # gone or swapped meanwhile: the next copy has it
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    continue
                raise

    fd = os.open(root, _DIR_FLAGS)
    try:
        entries.append(node("", Kind.DIR, os.fstat(fd), xattrs=_fd_xattrs(fd)))
        walk(fd, "")
    finally:
        os.close(fd)
    cache.clear()
    cache.update(fresh)
    return LayerIndex(
        digest="", diff_id="", media_type=LAYER_MEDIA_TYPE, size=0, entries=tuple(entries)
    )


def _read_piece(root: Path, rel: str, offset: int, size: int) -> bytes | None:
    """`size` bytes at `offset` of the regular file at `rel` (None if it is not one now)."""
    try:
        with _parent(root, rel) as (pfd, name):
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            fd = os.open(name, flags, dir_fd=pfd)
    except (OSError, VolumeError):
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.pread(fd, size, offset)
    finally:
        os.close(fd)


def _chown(dir_fd: int, name: str, owner: Owner) -> None:
    os.chown(
        name,
        DEFAULT_UID if owner.uid is None else owner.uid,
        DEFAULT_GID if owner.gid is None else owner.gid,
        dir_fd=dir_fd,
        follow_symlinks=False,
    )


def _stat_at(dir_fd: int, name: str, rel: str) -> dict[str, Any]:
    try:
        s = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        raise VolumePathNotFound(f"path /{rel} not found") from None
    target = os.readlink(name, dir_fd=dir_fd) if stat.S_ISLNK(s.st_mode) else None
    return pv.entry_stat(rel, s, target)


def _stat(root: Path, rel: str) -> dict[str, Any]:
    with _parent(root, rel) as (fd, name):
        return _stat_at(fd, name, rel)


def _list_dir(root: Path, rel: str, depth: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    with _parent(root, rel) as (pfd, name):
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=pfd)
        except FileNotFoundError:
            raise VolumePathNotFound(f"path /{rel} not found") from None
        except OSError as exc:
            if exc.errno in (errno.ENOTDIR, errno.ELOOP):
                raise pv.VolumeRequestError(f"path /{rel} is not a directory") from None
            raise
        try:
            _walk_dir(fd, rel, depth, out)
        finally:
            os.close(fd)
    return out


def _walk_dir(fd: int, rel: str, depth: int, out: list[dict[str, Any]]) -> None:
    for name in sorted(os.listdir(fd)):
        child = f"{rel}/{name}" if rel else name
        entry = _stat_at(fd, name, child)
        out.append(entry)
        if depth > 1 and entry["type"] == "directory":
            sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
            try:
                _walk_dir(sub, child, depth - 1, out)
            finally:
                os.close(sub)


def _make_dir(root: Path, rel: str, owner: Owner, force: bool) -> dict[str, Any]:
    if not rel:
        raise VolumeConflict("the volume's root exists")
    with _parent(root, rel, create=owner if force else None) as (fd, name):
        try:
            os.mkdir(name, 0o755 if owner.mode is None else owner.mode, dir_fd=fd)
        except FileExistsError:
            if not force:
                raise VolumeConflict(f"path /{rel} already exists") from None
            return _stat_at(fd, name, rel)
        except OSError as exc:
            _raise_full(exc)
            raise
        _chown(fd, name, owner)
        if owner.mode is not None:
            os.chmod(name, owner.mode, dir_fd=fd)
        return _stat_at(fd, name, rel)


def _raise_full(exc: OSError) -> None:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        raise VolumeFull("the volume is full (its size quota is used up)") from None


def _remove(root: Path, rel: str) -> None:
    if not rel:
        raise pv.VolumeRequestError("the volume's root cannot be removed")
    with _parent(root, rel) as (fd, name):
        try:
            _remove_entry(fd, name)
        except FileNotFoundError:
            raise VolumePathNotFound(f"path /{rel} not found") from None


def _remove_entry(fd: int, name: str) -> None:
    """Remove `name` in directory `fd`, a directory with all it holds (never
    following a link)."""
    s = os.stat(name, dir_fd=fd, follow_symlinks=False)
    if stat.S_ISDIR(s.st_mode):
        sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
        try:
            for child in os.listdir(sub):
                _remove_entry(sub, child)
        finally:
            os.close(sub)
        os.rmdir(name, dir_fd=fd)
    else:
        os.unlink(name, dir_fd=fd)


def _update(root: Path, rel: str, owner: Owner) -> dict[str, Any]:
    with _parent(root, rel) as (fd, name):
        try:
            s = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            raise VolumePathNotFound(f"path /{rel} not found") from None
        if owner.uid is not None or owner.gid is not None:
            os.chown(
                name,
                s.st_uid if owner.uid is None else owner.uid,
                s.st_gid if owner.gid is None else owner.gid,
                dir_fd=fd,
                follow_symlinks=False,
            )
        if owner.mode is not None and not stat.S_ISLNK(s.st_mode):
            os.chmod(name, owner.mode, dir_fd=fd)
        return _stat_at(fd, name, rel)


def _open_for_write(root: Path, rel: str, owner: Owner, force: bool) -> int:
    if not rel:
        raise pv.VolumeRequestError("path names the volume's root, not a file")
    # like envd's files.write: missing parents are made, an existing file is
    # replaced (`force` changes nothing: the SDKs document both behaviours)
    del force
    with _parent(root, rel, create=Owner(owner.uid, owner.gid)) as (pfd, name):
        mode = 0o644 if owner.mode is None else owner.mode
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(name, flags, mode, dir_fd=pfd)
        except IsADirectoryError:
            raise VolumeConflict(f"path /{rel} is a directory") from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise VolumeConflict(f"path /{rel} is a symlink") from None
            _raise_full(exc)
            raise
        try:
            _chown(pfd, name, owner)
            if owner.mode is not None:
                os.fchmod(fd, owner.mode)
        except BaseException:
            os.close(fd)
            raise
        return fd


def _write_all(fd: int, data: bytes, rel: str) -> None:
    view = memoryview(data)
    try:
        while view:
            n = os.write(fd, view)
            view = view[n:]
    except OSError as exc:
        _raise_full(exc)
        raise


def _open_for_read(root: Path, rel: str) -> tuple[int, int]:
    with _parent(root, rel) as (pfd, name):
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pfd)
        except FileNotFoundError:
            raise VolumePathNotFound(f"path /{rel} not found") from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise VolumeConflict(f"path /{rel} is a symlink") from None
            raise
        s = os.fstat(fd)
        if not stat.S_ISREG(s.st_mode):
            os.close(fd)
            raise VolumeConflict(f"path /{rel} is not a regular file")
        return fd, s.st_size


__all__ = [
    "Owner",
    "VolumeConflict",
    "VolumeError",
    "VolumeFull",
    "VolumeNotFound",
    "VolumePathNotFound",
    "VolumeRecord",
    "Volumes",
]
