"""Bringing a snapshot back from the store: layer trees and the memory image.

`fetch_layer_index` reads a stored layer's index, `materialise_layer`
builds the layer's tree from it (chunks fetched in parallel), and
`download_image` reassembles the memory image's files from their chunks
(manifest version 1, each file then checked against its sha256) or page
packs (version 2, each page checked against its hash as it is written).
Every blob read is verified against its digest; a missing, corrupt or
malformed object raises `SnapshotUnavailable` naming the snapshot and the
object. Callers stage into temporary directories and rename last.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import trio

from aenv.kit.errors import one_error
from aenv.kit.files import fsync_tree
from aenv.proto import pagemap
from aenv.proto.layerindex import CHUNK_SIZE, BadIndex, Chunk, LayerIndex, loads
from aenv.storage.memimage import (
    BadPack,
    copy_local_pages,
    page_hashes_of,
    place_pack,
    unpack_map,
)
from aenv.storage.objstore import CorruptObject, ObjectNotFound, ObjectStore, blob_key
from aenv.storage.snapstore.manifest import (
    ImageFile,
    Manifest,
    SnapshotUnavailable,
    StoredLayer,
    unavailable,
)
from aenv.storage.snapstore.trees import build_skeleton, finish_tree, write_piece


async def _blob(store: ObjectStore, snapshot_id: str, digest: str) -> bytes:
    try:
        return await store.get_blob(digest)
    except ObjectNotFound as exc:
        raise unavailable(snapshot_id, f"object {blob_key(digest)!r} is missing", exc) from None
    except CorruptObject as exc:
        raise unavailable(snapshot_id, f"object {blob_key(digest)!r} is corrupt", exc) from None


async def fetch_layer_index(
    store: ObjectStore, snapshot_id: str, layer: StoredLayer
) -> tuple[bytes, LayerIndex]:
    """A stored layer's index: the blob (verified) and what it says."""
    raw = await _blob(store, snapshot_id, layer.index)
    try:
        return raw, await trio.to_thread.run_sync(loads, raw)
    except BadIndex as exc:
        raise unavailable(
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
        raise unavailable(snapshot_id, f"layer index {blob_key(layer.index)!r}", exc) from None
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


@dataclass(frozen=True)
class LocalImage:
    """A memory image already on this node whose pages a restore may copy rather
    than fetch: its directory of files and, if kept, the directory holding the
    page hashes of those files (one file of HASH_BYTES per page each, by name)."""

    files: Path
    hashes: Path | None = None


async def download_image(
    store: ObjectStore,
    m: Manifest,
    dest: Path,
    *,
    concurrency: int = 8,
    sync: bool = True,
    local: Sequence[LocalImage] = (),
    keep_hashes: Path | None = None,
    timings: dict[str, float] | None = None,
) -> dict[str, str]:
    """Fetch the memory image into the new directory `dest`; returns its checksums.

    A paged file (version 2) is checked page by page as its packs arrive (each
    pack against its digest, each page against its hash in the page map, itself
    fetched by digest), so it is not read back; its checksum is the manifest's.
    Pages a `local` image holds (same file name, same page hash: an earlier
    snapshot of the same sandbox, say) are copied from it, each checked
    against its hash, and only the packs holding the other pages are
    fetched. `keep_hashes` (a new directory) receives the page hashes of the
    paged files, for later restores to find pages in this one without
    reading it. A chunked file (version 1) is read back and checked against
    its checksum.
    With `sync` the files are flushed to disk before returning; a caller that
    can fetch the image again when a crash tears the copy (the node's restores,
    which check a snapshot's checksums once per process) passes False and keeps
    the flush off the restore's critical path. `timings` receives seconds per
    phase (maps, fetch, verify, fsync).
    """
    assert m.image is not None
    io = trio.CapacityLimiter(2)
    clock = _Phases(timings)
    await trio.to_thread.run_sync(dest.mkdir)
    pieces: list[tuple[Path, Chunk]] = []
    maps: dict[str, pagemap.PageMap] = {}

    async def prepare(f: ImageFile) -> None:
        path = dest / f.name

        def create() -> None:
            with path.open("wb") as out:
                out.truncate(f.size)

        await trio.to_thread.run_sync(create, limiter=io)
        if f.pagemap is not None:
            maps[f.name] = await _stored_map(store, m.snapshot_id, f)

    with one_error():
        async with trio.open_nursery() as n:
            for f in m.image:
                n.start_soon(prepare, f)
    for f in m.image:
        offset = 0
        for i, digest in enumerate(f.chunks):
            size = min(CHUNK_SIZE, f.size - i * CHUNK_SIZE)
            pieces.append((dest / f.name, Chunk(digest, size, offset)))
            offset += size
    clock.lap("maps")
    if keep_hashes is not None and maps:

        def keep() -> None:
            keep_hashes.mkdir()
            for name, pmap in maps.items():
                (keep_hashes / name).write_bytes(pmap.hashes)

        await trio.to_thread.run_sync(keep, limiter=io)
    counts = [0, 0]  # pages copied from local images, pages fetched
    with one_error():
        async with trio.open_nursery() as n:
            n.start_soon(_fill, store, m.snapshot_id, pieces, concurrency, io)
            for name, pmap in maps.items():
                sources = [
                    (li.files / name, None if li.hashes is None else li.hashes / name)
                    for li in local
                ]
                n.start_soon(
                    _fill_paged,
                    store,
                    m.snapshot_id,
                    dest / name,
                    pmap,
                    sources,
                    counts,
                    io,
                    concurrency,
                )
    if timings is not None and maps:
        timings["pages_local"], timings["pages_fetched"] = map(float, counts)
    clock.lap("fetch")
    sums: dict[str, str] = {}
    for f in m.image:
        if f.pagemap is not None:
            sums[f.name] = f.sha256  # every page checked against the map as it came
            continue
        actual = await trio.to_thread.run_sync(_file_sha256, dest / f.name, limiter=io)
        if actual != f.sha256:
            raise SnapshotUnavailable(
                f"snapshot {m.snapshot_id}: image file {f.name} reassembled from the store "
                "does not match its checksum"
            )
        sums[f.name] = actual
    clock.lap("verify")
    if sync:
        await trio.to_thread.run_sync(fsync_tree, dest, limiter=io)
        clock.lap("fsync")
    return sums


class _Phases:
    def __init__(self, into: dict[str, float] | None) -> None:
        self.into = into
        self.t = trio.current_time()

    def lap(self, name: str) -> None:
        now = trio.current_time()
        if self.into is not None:
            self.into[name] = self.into.get(name, 0.0) + now - self.t
        self.t = now


async def _stored_map(store: ObjectStore, snapshot_id: str, f: ImageFile) -> pagemap.PageMap:
    assert f.pagemap is not None
    raw = await _blob(store, snapshot_id, f.pagemap)
    try:
        pmap = await trio.to_thread.run_sync(unpack_map, raw)
    except pagemap.BadPageMap as exc:
        raise unavailable(
            snapshot_id, f"page map {blob_key(f.pagemap)!r} of {f.name} is malformed", exc
        ) from None
    if pmap.size != f.size:
        raise SnapshotUnavailable(
            f"snapshot {snapshot_id}: page map {blob_key(f.pagemap)!r} describes "
            f"{pmap.size} bytes, the manifest {f.size} for {f.name}"
        )
    return pmap


async def _fill_paged(
    store: ObjectStore,
    snapshot_id: str,
    path: Path,
    pmap: pagemap.PageMap,
    sources: Sequence[tuple[Path, Path | None]],
    counts: list[int],
    io: trio.CapacityLimiter,
    concurrency: int = 8,
) -> None:
    """Rebuild one paged file: pages local files offer are copied while the
    packs of the others download; a copy that fails its check is fetched after."""

    def offered() -> tuple[list[Path], dict[bytes, tuple[int, int]]]:
        files: list[Path] = []
        hashes: list[bytes] = []
        for p, h in sources:
            try:
                hashes.append(page_hashes_of(p, h))
            except OSError:
                continue  # gone (deleted meanwhile) or unreadable: not a source
            files.append(p)
        return files, pagemap.local_offers(hashes)

    files, offers = await trio.to_thread.run_sync(offered, limiter=io) if sources else ([], {})
    plan = pagemap.restore_plan(pmap, offers)
    bad: list[int] = []

    async def copy() -> None:
        bad.extend(
            await trio.to_thread.run_sync(
                copy_local_pages, path, pmap, plan.local, files, limiter=io
            )
        )

    with one_error():
        async with trio.open_nursery() as n:
            if plan.local:
                n.start_soon(copy)
            n.start_soon(_fill_pages, store, snapshot_id, path, pmap, plan.packs, concurrency, io)
    fetched = plan.fetched_pages
    if bad:  # not what the map says (a torn local copy): from the store after all
        again = pagemap.restore_plan(pmap, {}, fetch=frozenset(bad))
        wanted = set(bad)
        packs = [
            (p, tuple(pair for pair in pairs if pair[0] in wanted)) for p, pairs in again.packs
        ]
        packs = [(p, pairs) for p, pairs in packs if pairs]
        await _fill_pages(store, snapshot_id, path, pmap, packs, concurrency, io)
        fetched += len(bad)
    counts[0] += pmap.pages - fetched
    counts[1] += fetched


async def _fill_pages(
    store: ObjectStore,
    snapshot_id: str,
    path: Path,
    pmap: pagemap.PageMap,
    packs: Sequence[tuple[int, Sequence[tuple[int, int]]]],
    concurrency: int,
    io: trio.CapacityLimiter,
) -> None:
    sem = trio.Semaphore(concurrency)

    async def one(p: int, placements: Sequence[tuple[int, int]]) -> None:
        pack = pmap.packs[p]
        async with sem:
            data = await _blob(store, snapshot_id, pack.digest)
        try:
            await trio.to_thread.run_sync(
                place_pack, path, pmap, data, pack, placements, limiter=io
            )
        except BadPack as exc:
            raise unavailable(snapshot_id, f"pack {blob_key(pack.digest)!r}", exc) from None

    with one_error():
        async with trio.open_nursery() as n:
            for p, placements in packs:
                n.start_soon(one, p, placements)
