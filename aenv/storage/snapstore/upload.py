"""Uploading a snapshot: its layers' indexes and chunks, its memory image as pages, its manifest.

`upload_snapshot` hashes everything first, writes the pending manifest (so
a collector sees the blobs it is about to reference), uploads the missing
blobs (each layer's chunks before its index, each page map after its
packs), then writes the manifest, the name pointer, and removes the
pending one: a snapshot is visible in the store only once complete, and a
retry resumes. Blobs are only written when absent, so content shared by
snapshots is uploaded once; the memory image reuses the pages its
`image_bases` stored (`base_maps`). A blob the upload relies on that is old
enough for a collector to take it is written again (`_Refresh`). Layer
indexes and page maps this process computed or read are kept (they are
immutable).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import json
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from aenv.kit.errors import one_error
from aenv.proto import pagemap
from aenv.proto.layerindex import Chunk, LayerIndex, dumps, loads
from aenv.storage.memimage import build_pack, hash_pages, pack_map, unpack_map
from aenv.storage.objstore import (
    CorruptObject,
    ObjectInfo,
    ObjectNotFound,
    ObjectStore,
    StoreError,
    blob_key,
    content_digest,
)
from aenv.storage.snapstore.manifest import (
    PORTABLE_FIELDS,
    ImageFile,
    Manifest,
    SnapshotUnavailable,
    StoredLayer,
    dump_manifest,
    fetch_manifest,
    manifest_key,
    name_key,
    pending_key,
)
from aenv.storage.snapstore.trees import index_layer, read_piece


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

        with one_error():  # (a file removed under it, the snapshot deleted: OSError alone)
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
