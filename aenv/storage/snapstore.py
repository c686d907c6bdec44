"""Snapshots in the object store: layout, upload, download, garbage collection.

A snapshot goes to the store as content-addressed blobs plus one manifest.
Each frozen layer of its stack is described by a `LayerIndex`
(`aenv.proto.layerindex`: entries with modes, owners, times, xattrs, link
targets; whiteouts as WHITEOUT entries, opaque directories as OPAQUE ones),
serialised to JSON and stored as a blob itself; every regular file's content
is cut at fixed 1 MiB offsets into chunk blobs (`Chunk.offset` is the offset
in the file). The memory image's files are stored as 4 KiB pages in
zstd-compressed packs, with a page map blob per file (aenv.proto.pagemap,
aenv.storage.memimage); an upload reuses the pages its `image_bases`
stored. Blobs are only written when absent, so content shared by
snapshots (lower layers, unchanged files, unchanged pages) is uploaded
once. The layout:

    blobs/sha256/<2 hex>/<64 hex>   chunks and layer indexes (objstore)
    pending/<snapshot id>.json      the manifest of an upload in progress
    snapshots/<snapshot id>.json    the manifest of a complete snapshot
    names/<name>                    {"snapshotID", "createdAt"} of a name's newest
    images/layers/<64 hex>.json     a converted image layer's index (aenv.images.objects)
    images/pending/<64 hex>.json    the same while that layer's chunks upload

`upload_snapshot` hashes everything first, writes the pending manifest (so
a collector sees the blobs it is about to reference), uploads the missing
blobs (each layer's chunks before its index), then writes the manifest, the
name pointer, and removes the pending one: a snapshot is visible in the
store only once complete. `fetch_manifest`, `materialise_layer` and
`download_image` bring one back; every blob read is verified against its
digest and any missing, corrupt or malformed object raises
`SnapshotUnavailable` naming the snapshot and the object. Callers stage
into temporary directories and rename last. `collect_garbage` is a
mark-and-sweep: blobs no manifest (complete or pending) and no image
layer index (complete or pending) references and older than a grace period
are deleted; two collectors at once only delete the same unreferenced blobs
twice, and young blobs of uploads in flight survive. Image layers are never
collected: they are roots, like manifests of snapshots nobody deleted.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import hashlib
import json
import os
import stat
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from aenv.kit.errors import one_error
from aenv.kit.files import fsync_tree
from aenv.proto import pagemap
from aenv.proto.layerindex import (
    CHUNK_SIZE,
    BadIndex,
    Chunk,
    Entry,
    Kind,
    LayerIndex,
    dumps,
    loads,
)
from aenv.storage.memimage import (
    BadPack,
    build_pack,
    hash_pages,
    open_pack,
    pack_map,
    unpack_map,
    write_pages,
)
from aenv.storage.objstore import (
    BLOB_PREFIX,
    CorruptObject,
    ObjectInfo,
    ObjectNotFound,
    ObjectStore,
    StoreError,
    StoreUnavailable,
    blob_key,
    content_digest,
)

MANIFEST_PREFIX = "snapshots"
PENDING_PREFIX = "pending"
NAME_PREFIX = "names"
# Image layer indexes, written by aenv.images.objects (same strings; storage never imports images).
IMAGE_LAYER_PREFIX = "images/layers"
IMAGE_PENDING_PREFIX = "images/pending"
MANIFEST_VERSION = 2  # 2: memory image files as page maps; 1 (chunked images) still reads
_READABLE_VERSIONS = (1, 2)
LAYER_MEDIA_TYPE = "application/vnd.aenv.frozen-layer.v1+json"
# Fields of a snapshot record that travel with it (the rest are local paths and state).
PORTABLE_FIELDS = (
    "name",
    "names",
    "sourceSandboxID",
    "templateID",
    "layers",
    "memory",
    "cpuCount",
    "memoryMB",
    "envdToken",
    "createdAt",
)
_OVL_PREFIX = "trusted.overlay."
_OPAQUE = "trusted.overlay.opaque"
DEFAULT_PENDING_TTL_S = 7 * 24 * 3600.0
RELIST_S = 1.0  # a collector re-reads pending manifests this often while it deletes


class SnapshotUnavailable(Exception):
    """A snapshot cannot be restored from the store: an object is missing, corrupt or malformed."""


class BadManifest(ValueError):
    """A manifest is not one this version understands."""


def manifest_key(snapshot_id: str) -> str:
    return f"{MANIFEST_PREFIX}/{snapshot_id}.json"


def pending_key(snapshot_id: str) -> str:
    return f"{PENDING_PREFIX}/{snapshot_id}.json"


def name_key(name: str) -> str:
    return f"{NAME_PREFIX}/{name}"


# -- manifests ------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class StoredLayer:
    id: str
    below: tuple[str, ...]
    index: str  # digest of the layer index blob


@dataclass(frozen=True, kw_only=True)
class ImageFile:
    name: str
    size: int
    sha256: str  # hex digest of the whole file (the local checksum)
    chunks: tuple[str, ...] = ()  # version 1: digests of its CHUNK_SIZE pieces, in order
    pagemap: str | None = None  # version 2: digest of its page map blob (aenv.proto.pagemap)


@dataclass(frozen=True, kw_only=True)
class Manifest:
    snapshot_id: str
    record: dict[str, Any]  # the portable fields of the snapshot record
    layers: tuple[StoredLayer, ...]  # topmost first
    image: tuple[ImageFile, ...] | None  # None: a filesystem-only snapshot
    blobs: tuple[str, ...]  # every blob it references, sorted (what GC marks)

    @property
    def name(self) -> str | None:
        name = self.record.get("name")
        return name if isinstance(name, str) else None

    @property
    def created_at(self) -> float:
        return float(self.record.get("createdAt") or 0.0)


def dump_manifest(m: Manifest) -> bytes:
    doc = {
        "version": MANIFEST_VERSION,
        "snapshotID": m.snapshot_id,
        "record": m.record,
        "layers": [{"id": la.id, "below": list(la.below), "index": la.index} for la in m.layers],
        "image": None
        if m.image is None
        else [
            {
                "name": f.name,
                "size": f.size,
                "sha256": f.sha256,
                "chunks": list(f.chunks),
                "pagemap": f.pagemap,
            }
            for f in m.image
        ],
        "blobs": list(m.blobs),
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def _digest(raw: Any, what: str) -> str:
    if not isinstance(raw, str):
        raise BadManifest(f"{what} is not a digest")
    try:
        blob_key(raw)
    except ValueError:
        raise BadManifest(f"{what} {raw!r} is not a sha256 digest") from None
    return raw


def _safe_name(raw: Any, what: str) -> str:
    if not isinstance(raw, str) or not raw or "/" in raw or raw in (".", "..") or "\0" in raw:
        raise BadManifest(f"{what} {raw!r} is not a plain name")
    return raw


def load_manifest(raw: bytes) -> Manifest:
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadManifest(f"not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("version") not in _READABLE_VERSIONS:
        raise BadManifest(
            f"not a snapshot manifest of version {' or '.join(map(str, _READABLE_VERSIONS))}"
        )
    try:
        record = doc["record"]
        if not isinstance(record, dict):
            raise BadManifest("record is not an object")
        layers = tuple(
            StoredLayer(
                id=_safe_name(la["id"], "layer id"),
                below=tuple(_safe_name(b, "layer id") for b in la["below"]),
                index=_digest(la["index"], "layer index"),
            )
            for la in doc["layers"]
        )
        image = None
        if doc["image"] is not None:
            image = tuple(
                ImageFile(
                    name=_safe_name(f["name"], "image file"),
                    size=int(f["size"]),
                    sha256=str(f["sha256"]),
                    chunks=tuple(_digest(c, "image chunk") for c in f["chunks"]),
                    pagemap=None
                    if f.get("pagemap") is None
                    else _digest(f["pagemap"], "image page map"),
                )
                for f in doc["image"]
            )
        blobs = tuple(_digest(b, "blob") for b in doc["blobs"])
        return Manifest(
            snapshot_id=_safe_name(doc["snapshotID"], "snapshot id"),
            record=record,
            layers=layers,
            image=image,
            blobs=blobs,
        )
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, BadManifest):
            raise
        raise BadManifest(f"malformed manifest: {exc!r}") from None


# -- indexing (blocking) --------------------------------------------------------------


def _xattrs(path: str) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    with contextlib.suppress(OSError):
        for name in os.listxattr(path, follow_symlinks=False):
            if name.startswith(_OVL_PREFIX):
                continue
            with contextlib.suppress(OSError):
                out[name] = os.getxattr(path, name, follow_symlinks=False)
    return out


def _is_opaque(path: str) -> bool:
    try:
        return os.getxattr(path, _OPAQUE, follow_symlinks=False) == b"y"
    except OSError:
        return False


def file_chunks(path: Path | str) -> tuple[Chunk, ...]:
    """The fixed-offset CHUNK_SIZE pieces of a file, hashed (blocking)."""
    chunks: list[Chunk] = []
    with open(path, "rb") as f:
        offset = 0
        while block := f.read(CHUNK_SIZE):
            chunks.append(Chunk("sha256:" + hashlib.sha256(block).hexdigest(), len(block), offset))
            offset += len(block)
    return tuple(chunks)


def read_piece(path: Path | str, offset: int, size: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(size)


def index_layer(tree: Path) -> LayerIndex:
    """Describe a frozen overlay upper directory as a LayerIndex (blocking).

    Whiteouts (0/0 character devices) become WHITEOUT entries and the opaque
    xattr an OPAQUE entry after its directory; a regular file with several
    links appears once as a FILE, then as HARDLINKs to that path. Sockets
    are left out (nothing can restore one).
    """
    entries: list[Entry] = []
    seen: dict[tuple[int, int], str] = {}

    def node(path: str, kind: Kind, st: os.stat_result, full: str, **kw: Any) -> Entry:
        return Entry(
            path=path,
            kind=kind,
            mode=stat.S_IMODE(st.st_mode),
            uid=st.st_uid,
            gid=st.st_gid,
            mtime_ns=st.st_mtime_ns,
            xattrs=_xattrs(full),
            **kw,
        )

    def walk(rel: str, full: str) -> None:
        for name in sorted(os.listdir(full)):
            p = f"{rel}/{name}" if rel else name
            f = os.path.join(full, name)
            st = os.lstat(f)
            mode = st.st_mode
            if stat.S_ISCHR(mode) and st.st_rdev == 0:
                entries.append(Entry(path=p, kind=Kind.WHITEOUT))
            elif stat.S_ISDIR(mode):
                entries.append(node(p, Kind.DIR, st, f))
                if _is_opaque(f):
                    entries.append(Entry(path=p, kind=Kind.OPAQUE))
                walk(p, f)
            elif stat.S_ISREG(mode):
                key = (st.st_dev, st.st_ino)
                if st.st_nlink > 1 and key in seen:
                    entries.append(Entry(path=p, kind=Kind.HARDLINK, link=seen[key]))
                    continue
                seen[key] = p
                entries.append(node(p, Kind.FILE, st, f, size=st.st_size, chunks=file_chunks(f)))
            elif stat.S_ISLNK(mode):
                entries.append(node(p, Kind.SYMLINK, st, f, link=os.readlink(f)))
            elif stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISFIFO(mode):
                kind = (
                    Kind.CHAR
                    if stat.S_ISCHR(mode)
                    else Kind.BLOCK
                    if stat.S_ISBLK(mode)
                    else Kind.FIFO
                )
                dev = {"devmajor": os.major(st.st_rdev), "devminor": os.minor(st.st_rdev)}
                entries.append(node(p, kind, st, f, **dev))

    root = str(tree)
    entries.append(node("", Kind.DIR, os.lstat(root), root))
    if _is_opaque(root):
        entries.append(Entry(path="", kind=Kind.OPAQUE))
    walk("", root)
    return LayerIndex(
        digest="", diff_id="", media_type=LAYER_MEDIA_TYPE, size=0, entries=tuple(entries)
    )


def _check_rel(path: str) -> str:
    if path.startswith("/") or any(seg in ("", ".", "..") for seg in path.split("/")):
        raise BadIndex(f"unsafe path {path!r} in a layer index")
    return path


def build_skeleton(index: LayerIndex, tree: Path) -> list[tuple[Path, Chunk]]:
    """Create every entry but file contents and hard links; return the pieces to fill.

    Files are created empty at their final size; metadata comes later
    (`finish_tree`), once contents are written. Blocking.
    """
    pieces: list[tuple[Path, Chunk]] = []
    tree.mkdir(mode=0o700)
    for e in index.entries:
        if e.path == "":
            continue
        dest = tree / _check_rel(e.path)
        if e.kind is Kind.DIR:
            dest.mkdir(mode=0o700)
        elif e.kind is Kind.FILE:
            fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                os.ftruncate(fd, e.size)
            finally:
                os.close(fd)
            pieces.extend((dest, c) for c in e.chunks)
        elif e.kind is Kind.SYMLINK:
            os.symlink(e.link, dest)
        elif e.kind is Kind.WHITEOUT:
            os.mknod(dest, stat.S_IFCHR | 0o000, os.makedev(0, 0))
        elif e.kind in (Kind.CHAR, Kind.BLOCK, Kind.FIFO):
            fmt = {Kind.CHAR: stat.S_IFCHR, Kind.BLOCK: stat.S_IFBLK, Kind.FIFO: stat.S_IFIFO}
            os.mknod(dest, fmt[e.kind] | 0o600, os.makedev(e.devmajor, e.devminor))
    return pieces


def write_piece(path: Path, offset: int, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def finish_tree(index: LayerIndex, tree: Path) -> None:
    """Hard links, owners, modes, xattrs, opaque markers and times (blocking)."""
    by_path = {e.path: e for e in index.entries if e.kind not in (Kind.OPAQUE, Kind.HARDLINK)}
    for e in index.entries:
        dest = tree / e.path if e.path else tree
        if e.kind is Kind.HARDLINK:
            os.link(tree / _check_rel(e.link), dest)
        elif e.kind is Kind.OPAQUE:
            os.setxattr(dest, _OPAQUE, b"y", follow_symlinks=False)
        elif e.kind is not Kind.WHITEOUT:
            os.chown(dest, e.uid, e.gid, follow_symlinks=False)
            if e.kind is not Kind.SYMLINK:
                os.chmod(dest, e.mode)
            for name, value in e.xattrs.items():
                os.setxattr(dest, name, value, follow_symlinks=False)
    # times last, children before parents, so writing an entry never bumps its directory's
    for path in sorted(by_path, key=lambda p: p.count("/") if p else -1, reverse=True):
        e = by_path[path]
        if e.kind is Kind.WHITEOUT:
            continue
        dest = tree / path if path else tree
        os.utime(dest, ns=(e.mtime_ns, e.mtime_ns), follow_symlinks=False)


# -- uploading ----------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class LocalLayer:
    """A frozen layer to upload: its id, what it was frozen over, its tree; for a
    layer restored from the store, the index it was stored with (not computed again)."""

    id: str
    below: tuple[str, ...]
    tree: Path
    index: bytes | None = None


@dataclass
class UploadReport:
    blobs: int = 0  # referenced
    uploaded: int = 0  # written by this upload (absent before)
    bytes_uploaded: int = 0
    layer_bytes: int = 0  # of those, file contents and layer indexes
    image_bytes: int = 0  # of those, memory image packs and page maps
    image_pages: int = 0  # pages of the memory image
    reused_pages: int = 0  # of those, found in the store already (not uploaded)
    rewritten: int = 0  # blobs present but old, written again (see _Refresh)


# Layer indexes computed by this process, by layer id and tree (layers are immutable).
_index_cache: dict[tuple[str, str], tuple[LayerIndex, bytes, str]] = {}


def _encoded_index(layer: LocalLayer) -> tuple[LayerIndex, bytes, str]:
    key = (layer.id, str(layer.tree))
    cached = _index_cache.get(key)
    if cached is not None:
        return cached
    if layer.index is not None:
        raw = layer.index
        index = loads(raw)
    else:
        index = index_layer(layer.tree)
        raw = dumps(index)
    digest = content_digest(raw)
    _index_cache[key] = (index, raw, digest)
    return index, raw, digest


def _age_s(info: ObjectInfo) -> float:
    return (dt.datetime.now(dt.UTC) - info.last_modified).total_seconds()


class _Refresh:
    """Blobs an upload relies on that a collector could take as garbage: present,
    but older than `after_s` (a grace period's half). The upload writes them again,
    which makes them young, and checks them once more after its manifest."""

    def __init__(self, after_s: float | None) -> None:
        self.after_s = after_s
        self.rewritten: list[tuple[str, Callable[[], bytes] | None]] = []

    def old(self, info: ObjectInfo | None) -> bool:
        return info is not None and self.after_s is not None and _age_s(info) >= self.after_s


async def _put_missing(
    store: ObjectStore,
    digest: str,
    read: Callable[[], bytes],
    limiter: trio.CapacityLimiter,
    refresh: _Refresh,
) -> int:
    """Upload a blob unless the store has it (rewriting it if old); the new bytes written."""
    info = await store.blob_info(digest)
    if info is not None and not refresh.old(info):
        return 0
    data = await trio.to_thread.run_sync(read, limiter=limiter)
    await store.put_blob(data, digest=digest, rewrite=info is not None)
    if info is not None:
        refresh.rewritten.append((digest, read))
        return 0
    return len(data)


async def _recheck(store: ObjectStore, snapshot_id: str, refresh: _Refresh) -> None:
    """After the manifest: every rewritten blob must still be there (a collector that
    read it as old just before the rewrite may have deleted it since)."""
    for digest, read in refresh.rewritten:
        if await store.has_blob(digest):
            continue
        if read is None:
            raise StoreError(
                f"snapshot {snapshot_id}: blob {blob_key(digest)} was collected during the "
                "upload; uploading again"
            )
        await store.put_blob(await trio.to_thread.run_sync(read), digest=digest)


@dataclass(frozen=True)
class PagedFile:
    """One memory image file planned as pages: what it reuses, what it must store."""

    name: str
    path: Path
    plan: pagemap.Plan
    new: tuple[str, ...]  # digests of the new packs, by group
    map: pagemap.PageMap
    map_blob: bytes
    map_digest: str

    def blobs(self) -> set[str]:
        return {pk.digest for pk in self.map.packs} | {self.map_digest}


# Page maps by blob digest, and the map digests of snapshot manifests, that this
# process has read or written (both immutable); bounded, oldest dropped first.
_MAP_CACHE_SIZE = 16
_KEPT_PACK_BYTES = 256 * 1024 * 1024  # new packs kept from planning to upload, at most
_maps: OrderedDict[str, pagemap.PageMap] = OrderedDict()
_manifest_maps: OrderedDict[str, tuple[str, ...]] = OrderedDict()


def _remember(cache: OrderedDict[str, Any], key: str, value: Any) -> None:
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > _MAP_CACHE_SIZE:
        cache.popitem(last=False)


async def _page_map(store: ObjectStore, digest: str) -> pagemap.PageMap:
    cached = _maps.get(digest)
    if cached is None:
        cached = await trio.to_thread.run_sync(unpack_map, await store.get_blob(digest))
        _remember(_maps, digest, cached)
    return cached


async def base_maps(store: ObjectStore, snapshot_ids: Sequence[str]) -> list[pagemap.PageMap]:
    """The page maps of those snapshots' memory images: pages a new upload may reuse.

    A snapshot gone from the store, or one whose image is not paged, offers
    nothing; an unreadable map is skipped (the upload then stores those pages
    itself). StoreUnavailable passes through.
    """
    maps: list[pagemap.PageMap] = []
    for sid in snapshot_ids:
        digests = _manifest_maps.get(sid)
        if digests is None:
            try:
                m = await fetch_manifest(store, sid, by_id=True)
            except SnapshotUnavailable:
                continue
            if m is None:
                continue
            digests = tuple(f.pagemap for f in m.image or () if f.pagemap is not None)
            _remember(_manifest_maps, sid, digests)
        for digest in digests:
            try:
                maps.append(await _page_map(store, digest))
            except (ObjectNotFound, CorruptObject, pagemap.BadPageMap):
                continue
    return maps


async def _plan_image(
    image: Path,
    names: Iterable[str],
    known: dict[bytes, tuple[pagemap.Pack, int]],
    io: trio.CapacityLimiter,
    packs: dict[str, bytes],
) -> list[PagedFile]:
    """Plan every file of the image; new packs are built (on `io`'s threads) to learn
    their digests, and kept in `packs` while they fit in _KEPT_PACK_BYTES."""
    out = []
    kept = [sum(map(len, packs.values()))]
    for name in sorted(names):
        path = image / name
        size, hashes = await trio.to_thread.run_sync(hash_pages, path, limiter=io)
        plan = await trio.to_thread.run_sync(pagemap.plan, size, hashes, known, limiter=io)
        new = [""] * len(plan.groups)

        async def build(
            k: int, group: tuple[int, ...], path: Path = path, new: list[str] = new
        ) -> None:
            blob = await trio.to_thread.run_sync(build_pack, path, group, limiter=io)
            new[k] = content_digest(blob)
            if kept[0] + len(blob) <= _KEPT_PACK_BYTES:
                kept[0] += len(blob)
                packs[new[k]] = blob

        async with trio.open_nursery() as n:
            for k, group in enumerate(plan.groups):
                n.start_soon(build, k, group)
        pmap = plan.finish(new)
        raw = await trio.to_thread.run_sync(pack_map, pmap, limiter=io)
        out.append(PagedFile(name, path, plan, tuple(new), pmap, raw, content_digest(raw)))
    return out


async def upload_snapshot(
    store: ObjectStore,
    *,
    snapshot_id: str,
    record: dict[str, Any],
    layers: Sequence[LocalLayer],
    image: Path | None,
    checksums: dict[str, str],
    image_bases: Sequence[str] = (),
    refresh_after_s: float | None = None,
    concurrency: int = 8,
) -> UploadReport:
    """Upload one snapshot and write its manifest last; idempotent, so a retry resumes.

    `layers` is the snapshot's whole stack, topmost first; `image` the
    directory of its memory image (None: filesystem only) whose files have
    the sha256 hex digests `checksums`. The image is stored as pages
    (aenv.proto.pagemap): pages the images of the snapshots `image_bases`
    already have in the store (say, earlier snapshots of the same sandbox)
    are referenced, not uploaded again. Blobs already stored but older than
    `refresh_after_s` (half the collector's grace period) are written again
    (see `_Refresh`): an upload never relies on a blob a collector could
    take for garbage because nothing referenced it when it listed manifests.
    """
    io = trio.CapacityLimiter(2)
    refresh = _Refresh(refresh_after_s)
    report = UploadReport()
    indexes = []
    for layer in layers:
        indexes.append(await trio.to_thread.run_sync(_encoded_index, layer, limiter=io))
    known: dict[bytes, tuple[pagemap.Pack, int]] = {}
    maps: list[pagemap.PageMap] = []
    if image is not None and image_bases:
        maps = await base_maps(store, image_bases)
        known = await trio.to_thread.run_sync(pagemap.known_from, maps, limiter=io)
    packs: dict[str, bytes] = {}  # new packs built while planning, by digest
    paged = [] if image is None else await _plan_image(image, checksums, known, io, packs)
    stored_layers = tuple(
        StoredLayer(id=la.id, below=la.below, index=digest)
        for la, (_i, _raw, digest) in zip(layers, indexes, strict=True)
    )
    layer_blobs: set[str] = set()
    for index, _raw, digest in indexes:
        layer_blobs.add(digest)
        layer_blobs.update(c.digest for e in index.entries for c in e.chunks)

    def manifest_of(paged: Sequence[PagedFile]) -> Manifest:
        blobs = set(layer_blobs)
        for f in paged:
            blobs |= f.blobs()
        return Manifest(
            snapshot_id=snapshot_id,
            record={k: record[k] for k in PORTABLE_FIELDS if k in record},
            layers=stored_layers,
            image=None
            if image is None
            else tuple(
                ImageFile(
                    name=f.name, size=f.map.size, sha256=checksums[f.name], pagemap=f.map_digest
                )
                for f in paged
            ),
            blobs=tuple(sorted(blobs)),
        )

    manifest = manifest_of(paged)
    await store.put(pending_key(snapshot_id), dump_manifest(manifest))
    # Reused packs are checked only now that the pending manifest protects them from a
    # collector; one gone since its snapshot was deleted is stored afresh.
    reused = {pk.digest for f in paged for pk in f.plan.old}
    gone = frozenset([d for d in sorted(reused) if not await _keep_pack(store, d, refresh)])
    if gone:
        known = await trio.to_thread.run_sync(
            functools.partial(pagemap.known_from, maps, missing=gone), limiter=io
        )
        if image is not None:
            paged = await _plan_image(image, checksums, known, io, packs)
        manifest = manifest_of(paged)
        await store.put(pending_key(snapshot_id), dump_manifest(manifest))
    report.blobs = len(manifest.blobs)
    report.reused_pages = sum(f.plan.reused_pages for f in paged)
    report.image_pages = sum(f.map.pages for f in paged)

    sem = trio.Semaphore(concurrency)

    async def one(digest: str, read: Callable[[], bytes], kind: str) -> None:
        async with sem:
            n = await _put_missing(store, digest, read, io, refresh)
        if n:
            report.uploaded += 1
            report.bytes_uploaded += n
            if kind == "image":
                report.image_bytes += n
            else:
                report.layer_bytes += n

    done: set[str] = set()

    def chunk_jobs(
        pairs: Iterable[tuple[Path, Chunk]],
    ) -> list[tuple[str, Callable[[], bytes]]]:
        jobs: list[tuple[str, Callable[[], bytes]]] = []
        for path, c in pairs:
            if c.digest in done:
                continue
            done.add(c.digest)

            jobs.append((c.digest, functools.partial(read_piece, path, c.offset, c.size)))
        return jobs

    for layer, (index, raw, digest) in zip(layers, indexes, strict=True):
        if digest in done:
            continue
        if (info := await store.blob_info(digest)) is not None and not refresh.old(info):
            continue  # an index is stored after its chunks: they are there too
        pairs = [(layer.tree / e.path, c) for e in index.entries for c in e.chunks]
        with one_error():
            async with trio.open_nursery() as n:
                for d, read in chunk_jobs(pairs):
                    n.start_soon(one, d, read, "layer")
        await one(digest, functools.partial(bytes, raw), "layer")
        done.add(digest)
    with one_error():
        async with trio.open_nursery() as n:
            for f in paged:
                for d, group in zip(f.new, f.plan.groups, strict=True):
                    if d not in done:
                        done.add(d)
                        kept = packs.pop(d, None)
                        read = (
                            functools.partial(build_pack, f.path, group)
                            if kept is None
                            else functools.partial(bytes, kept)
                        )
                        n.start_soon(one, d, read, "image")
    for f in paged:  # a map after its packs
        if f.map_digest not in done:
            done.add(f.map_digest)
            await one(f.map_digest, functools.partial(bytes, f.map_blob), "image")
        _remember(_maps, f.map_digest, f.map)
    if image is not None:
        _remember(_manifest_maps, snapshot_id, tuple(f.map_digest for f in paged))

    await store.put(manifest_key(snapshot_id), dump_manifest(manifest))
    await _recheck(store, snapshot_id, refresh)
    report.rewritten = len(refresh.rewritten)
    if manifest.name:
        await _point_name(store, manifest)
    await store.delete(pending_key(snapshot_id))
    return report


async def _keep_pack(store: ObjectStore, digest: str, refresh: _Refresh) -> bool:
    """Whether an upload may reference a stored pack: present, and rewritten if old
    (fetched and put back: the pack holds other images' pages too)."""
    info = await store.blob_info(digest)
    if info is None:
        return False
    if refresh.old(info):
        try:
            await store.put_blob(await store.get_blob(digest), digest=digest, rewrite=True)
        except (ObjectNotFound, CorruptObject):
            return False
        refresh.rewritten.append((digest, None))
    return True


async def _point_name(store: ObjectStore, m: Manifest) -> None:
    """Point `names/<name>` at `m` unless it already names a newer snapshot."""
    assert m.name is not None
    key = name_key(m.name)
    with contextlib.suppress(ObjectNotFound, ValueError, KeyError, TypeError):
        current = json.loads(await store.get(key))
        if float(current["createdAt"]) > m.created_at:
            return
    body = {"snapshotID": m.snapshot_id, "createdAt": m.created_at}
    await store.put(key, json.dumps(body).encode())


# -- downloading ---------------------------------------------------------------------


def _unavailable(snapshot_id: str, what: str, exc: BaseException) -> SnapshotUnavailable:
    return SnapshotUnavailable(
        f"snapshot {snapshot_id} cannot be restored from the store: {what}: {exc}"
    )


async def fetch_manifest(store: ObjectStore, name_or_id: str, *, by_id: bool) -> Manifest | None:
    """The complete manifest of a snapshot ID (`by_id`) or of a name's newest; None if absent.

    StoreUnavailable passes through; a malformed manifest or name pointer is
    a SnapshotUnavailable.
    """
    snapshot_id = name_or_id
    if not by_id:
        try:
            raw = await store.get(name_key(name_or_id))
        except ObjectNotFound:
            return None
        except ValueError:
            return None  # not a valid key: not a name the store can hold
        try:
            snapshot_id = str(json.loads(raw)["snapshotID"])
        except (ValueError, KeyError, TypeError) as exc:
            raise _unavailable(
                name_or_id, f"name pointer {name_key(name_or_id)!r} is malformed", exc
            ) from None
    try:
        raw = await store.get(manifest_key(snapshot_id))
    except ObjectNotFound:
        return None
    except ValueError:
        return None
    try:
        m = load_manifest(raw)
    except BadManifest as exc:
        raise _unavailable(
            snapshot_id, f"manifest {manifest_key(snapshot_id)!r} is malformed", exc
        ) from None
    if m.snapshot_id != snapshot_id:
        raise SnapshotUnavailable(f"manifest {manifest_key(snapshot_id)!r} names {m.snapshot_id}")
    return m


async def _blob(store: ObjectStore, snapshot_id: str, digest: str) -> bytes:
    try:
        return await store.get_blob(digest)
    except ObjectNotFound as exc:
        raise _unavailable(snapshot_id, f"object {blob_key(digest)!r} is missing", exc) from None
    except CorruptObject as exc:
        raise _unavailable(snapshot_id, f"object {blob_key(digest)!r} is corrupt", exc) from None


async def fetch_layer_index(
    store: ObjectStore, snapshot_id: str, layer: StoredLayer
) -> tuple[bytes, LayerIndex]:
    """A stored layer's index: the blob (verified) and what it says."""
    raw = await _blob(store, snapshot_id, layer.index)
    try:
        return raw, await trio.to_thread.run_sync(loads, raw)
    except BadIndex as exc:
        raise _unavailable(
            snapshot_id, f"layer index {blob_key(layer.index)!r} is malformed", exc
        ) from None


async def materialise_layer(
    store: ObjectStore,
    snapshot_id: str,
    layer: StoredLayer,
    tree: Path,
    *,
    index: LayerIndex | None = None,
    concurrency: int = 8,
) -> int:
    """Build `tree` (which must not exist) from the layer's index (fetched unless
    given, e.g. kept from an earlier fetch); returns content bytes."""
    if index is None:
        _raw, index = await fetch_layer_index(store, snapshot_id, layer)
    io = trio.CapacityLimiter(2)
    try:
        pieces = await trio.to_thread.run_sync(build_skeleton, index, tree, limiter=io)
    except BadIndex as exc:
        raise _unavailable(snapshot_id, f"layer index {blob_key(layer.index)!r}", exc) from None
    await _fill(store, snapshot_id, pieces, concurrency, io)
    await trio.to_thread.run_sync(finish_tree, index, tree, limiter=io)
    await trio.to_thread.run_sync(fsync_tree, tree, limiter=io)
    return index.content_bytes


async def _fill(
    store: ObjectStore,
    snapshot_id: str,
    pieces: Sequence[tuple[Path, Chunk]],
    concurrency: int,
    io: trio.CapacityLimiter,
) -> None:
    sem = trio.Semaphore(concurrency)

    async def one(path: Path, c: Chunk) -> None:
        async with sem:
            data = await _blob(store, snapshot_id, c.digest)
        if len(data) != c.size:
            raise SnapshotUnavailable(
                f"snapshot {snapshot_id}: object {blob_key(c.digest)!r} has {len(data)} bytes, "
                f"expected {c.size}"
            )
        await trio.to_thread.run_sync(write_piece, path, c.offset, data, limiter=io)

    with one_error():
        async with trio.open_nursery() as n:
            for path, c in pieces:
                n.start_soon(one, path, c)


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(CHUNK_SIZE):
            h.update(block)
    return h.hexdigest()


async def download_image(
    store: ObjectStore, m: Manifest, dest: Path, *, concurrency: int = 8
) -> dict[str, str]:
    """Fetch the memory image into the new directory `dest`; returns its checksums."""
    assert m.image is not None
    io = trio.CapacityLimiter(2)
    await trio.to_thread.run_sync(dest.mkdir)
    pieces: list[tuple[Path, Chunk]] = []
    paged: list[tuple[Path, pagemap.PageMap]] = []
    for f in m.image:
        path = dest / f.name

        def create(path: Path = path, size: int = f.size) -> None:
            with path.open("wb") as out:
                out.truncate(size)

        await trio.to_thread.run_sync(create, limiter=io)
        if f.pagemap is not None:
            paged.append((path, await _stored_map(store, m.snapshot_id, f)))
            continue
        offset = 0
        for i, digest in enumerate(f.chunks):
            size = min(CHUNK_SIZE, f.size - i * CHUNK_SIZE)
            pieces.append((path, Chunk(digest, size, offset)))
            offset += size
    with one_error():
        async with trio.open_nursery() as n:
            n.start_soon(_fill, store, m.snapshot_id, pieces, concurrency, io)
            for path, pmap in paged:
                n.start_soon(_fill_pages, store, m.snapshot_id, path, pmap, concurrency, io)
    sums: dict[str, str] = {}
    for f in m.image:
        actual = await trio.to_thread.run_sync(_file_sha256, dest / f.name, limiter=io)
        if actual != f.sha256:
            raise SnapshotUnavailable(
                f"snapshot {m.snapshot_id}: image file {f.name} reassembled from the store "
                "does not match its checksum"
            )
        sums[f.name] = actual
    await trio.to_thread.run_sync(fsync_tree, dest, limiter=io)
    return sums


async def _stored_map(store: ObjectStore, snapshot_id: str, f: ImageFile) -> pagemap.PageMap:
    assert f.pagemap is not None
    raw = await _blob(store, snapshot_id, f.pagemap)
    try:
        pmap = await trio.to_thread.run_sync(unpack_map, raw)
    except pagemap.BadPageMap as exc:
        raise _unavailable(
            snapshot_id, f"page map {blob_key(f.pagemap)!r} of {f.name} is malformed", exc
        ) from None
    if pmap.size != f.size:
        raise SnapshotUnavailable(
            f"snapshot {snapshot_id}: page map {blob_key(f.pagemap)!r} describes "
            f"{pmap.size} bytes, the manifest {f.size} for {f.name}"
        )
    return pmap


async def _fill_pages(
    store: ObjectStore,
    snapshot_id: str,
    path: Path,
    pmap: pagemap.PageMap,
    concurrency: int,
    io: trio.CapacityLimiter,
) -> None:
    sem = trio.Semaphore(concurrency)

    async def one(p: int, placements: list[tuple[int, int]]) -> None:
        pack = pmap.packs[p]
        async with sem:
            data = await _blob(store, snapshot_id, pack.digest)
        try:
            raw = await trio.to_thread.run_sync(open_pack, data, pack, limiter=io)
        except BadPack as exc:
            raise _unavailable(snapshot_id, f"pack {blob_key(pack.digest)!r}", exc) from None
        await trio.to_thread.run_sync(write_pages, path, pmap, raw, placements, limiter=io)

    with one_error():
        async with trio.open_nursery() as n:
            for p, placements in pmap.placements().items():
                n.start_soon(one, p, placements)


# -- deleting and garbage collection ----------------------------------------------------


async def delete_snapshot(store: ObjectStore, snapshot_id: str, name: str | None) -> None:
    """Remove a snapshot's manifests (its blobs go at the next GC).

    If its name pointed here, the name moves to the newest other complete
    snapshot of that name, or goes when there is none.
    """
    await store.delete(pending_key(snapshot_id))
    await store.delete(manifest_key(snapshot_id))
    if name is None:
        return
    with contextlib.suppress(ObjectNotFound, ValueError, KeyError, TypeError):
        if json.loads(await store.get(name_key(name)))["snapshotID"] != snapshot_id:
            return
    newest: Manifest | None = None
    for info in await store.list(MANIFEST_PREFIX):
        with contextlib.suppress(ObjectNotFound, BadManifest, ValueError):
            m = load_manifest(await store.get(info.key))
            later = newest is None or m.created_at > newest.created_at
            if m.name == name and m.snapshot_id != snapshot_id and later:
                newest = m
    if newest is None:
        await store.delete(name_key(name))
    else:
        body = {"snapshotID": newest.snapshot_id, "createdAt": newest.created_at}
        await store.put(name_key(name), json.dumps(body).encode())


@dataclass
class GcReport:
    manifests: int = 0
    blobs: int = 0  # seen
    deleted: int = 0
    bytes_deleted: int = 0
    kept_young: int = 0  # unreferenced but within the grace period
    image_layers: int = 0  # image layer indexes marked (their chunks are kept)


async def collect_garbage(
    store: ObjectStore,
    *,
    grace_s: float,
    pending_ttl_s: float = DEFAULT_PENDING_TTL_S,
    now: dt.datetime | None = None,
) -> GcReport:
    """Delete blobs no manifest or image layer references that are older than `grace_s`.

    Blobs are listed before manifests, so a blob uploaded and referenced
    after the listing is either not a candidate or marked. Pending manifests
    are listed again before the deletes and every RELIST_S during them (an
    upload that began meanwhile marks what it reuses), and each candidate is
    looked at once more just before its delete: one an upload rewrote
    (`upload_snapshot`'s refresh of old blobs) is young again and stays. A
    pending manifest or image layer index older than `pending_ttl_s` (an
    upload abandoned by a node that never came back) no longer protects its
    blobs. An unreadable manifest or layer index stops the collection
    (StoreUnavailable or SnapshotUnavailable): never guess what it referenced.
    """
    report = GcReport()
    blobs = await store.list(BLOB_PREFIX)
    report.blobs = len(blobs)
    fixed_now = now
    now = now or dt.datetime.now(dt.UTC)
    marked: set[str] = set()
    read: set[str] = set()
    for prefix in (MANIFEST_PREFIX, PENDING_PREFIX):
        await _mark_manifests(store, prefix, now, pending_ttl_s, marked, read, report)
    # Pending first: an upload writes the layer's index before it deletes the pending one.
    for prefix in (IMAGE_PENDING_PREFIX, IMAGE_LAYER_PREFIX):
        for info in await store.list(prefix):
            if (
                prefix == IMAGE_PENDING_PREFIX
                and (now - info.last_modified).total_seconds() > pending_ttl_s
            ):
                continue
            try:
                raw = await store.get(info.key)
            except ObjectNotFound:
                if prefix == IMAGE_LAYER_PREFIX:
                    continue
                # finished meanwhile: the complete index may not have been listed yet
                name = info.key.rsplit("/", 1)[-1]
                try:
                    raw = await store.get(f"{IMAGE_LAYER_PREFIX}/{name}")
                except ObjectNotFound:
                    continue
            try:
                index = await trio.to_thread.run_sync(loads, raw)
            except BadIndex as exc:
                raise SnapshotUnavailable(
                    f"garbage collection stopped: {info.key!r}: {exc}"
                ) from None
            report.image_layers += 1
            marked.update(c.digest for e in index.entries for c in e.chunks)
    candidates = []
    for info in blobs:
        digest = "sha256:" + info.key.rsplit("/", 1)[-1]
        if digest in marked:
            continue
        if (now - info.last_modified).total_seconds() < grace_s:
            report.kept_young += 1
            continue
        candidates.append((digest, info))
    listed_at = -RELIST_S
    for digest, info in candidates:
        if trio.current_time() - listed_at >= RELIST_S:
            await _mark_manifests(store, PENDING_PREFIX, now, pending_ttl_s, marked, read, report)
            listed_at = trio.current_time()
        if digest in marked:
            continue
        current = await store.head(info.key)
        if current is None:
            continue
        at = fixed_now or dt.datetime.now(dt.UTC)
        if (at - current.last_modified).total_seconds() < grace_s:
            report.kept_young += 1  # rewritten by an upload since the listing
            continue
        await store.delete(info.key)
        report.deleted += 1
        report.bytes_deleted += info.size
    return report


async def _mark_manifests(
    store: ObjectStore,
    prefix: str,
    now: dt.datetime,
    pending_ttl_s: float,
    marked: set[str],
    read: set[str],
    report: GcReport,
) -> None:
    """Mark the blobs of the manifests under `prefix` not `read` yet."""
    for info in await store.list(prefix):
        if info.key in read:
            continue
        if prefix == PENDING_PREFIX and (now - info.last_modified).total_seconds() > pending_ttl_s:
            continue
        try:
            raw = await store.get(info.key)
        except ObjectNotFound:
            continue  # deleted meanwhile: its blobs are garbage now
        try:
            m = load_manifest(raw)
        except BadManifest as exc:
            raise SnapshotUnavailable(f"garbage collection stopped: {info.key!r}: {exc}") from None
        read.add(info.key)
        report.manifests += 1
        marked.update(m.blobs)


__all__ = [
    "BadManifest",
    "GcReport",
    "ImageFile",
    "LocalLayer",
    "Manifest",
    "SnapshotUnavailable",
    "StoreUnavailable",
    "StoredLayer",
    "UploadReport",
    "collect_garbage",
    "delete_snapshot",
    "download_image",
    "dump_manifest",
    "fetch_layer_index",
    "fetch_manifest",
    "index_layer",
    "load_manifest",
    "manifest_key",
    "materialise_layer",
    "name_key",
    "one_error",
    "pending_key",
    "upload_snapshot",
]
