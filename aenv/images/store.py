"""ImageStore: pulls OCI images, converts each layer once, and serves image trees.

A pull resolves a reference at its registry, then converts every layer not
converted before: the blob streams from the registry into a
`LayerConverter` in a worker thread, whose chunks land in the bounded
`ChunkCache` and whose `LayerIndex` is written under `<root>/layers/` only
once the blob's digest has been verified. The image record (reference,
manifest digest, config, layer digests) is written last, in one transaction,
to the `ImageCatalog` (`<root>/catalog.db`, indexed by reference, digest and
layer, so no lookup reads every record), so a failed or cancelled pull
leaves no image behind; chunks it cached are ordinary cache entries that
age out.

With an object store (`use_object_store`), converted layers are shared:
each is uploaded in the background once its image is recorded (chunks, then
its index; see `aenv.images.objects`), and a layer whose index is already
in the store (converted by another node, or by this one before its disk was
wiped) is not downloaded or converted at all: its index is fetched, checked
against the manifest's digest and size and the config's diff_id, and kept.

A layer in a TOC-indexed format (eStargz, zstd:chunked) whose descriptor
pins its TOC digest is not downloaded either: `TocLayers` builds its index
from the TOC with a few range requests, and its chunks are fetched by range
on first read (`aenv.images.lazy`); anything unexpected there falls back to
the full download. Such layers are not uploaded (any node indexes them as
cheaply from the registry).

Trees are built on demand from the layer indexes (`tree(key)`) and handed to
the FUSE file system, which reads content through the cache. A chunk that is
not in the cache is fetched from the object store (one blob, verified), else
cut again from its layer's blob at the registry it came from
(`fetch_chunk`): concurrent misses on one layer share one pass over the
blob where they can. Layer indexes are small metadata and are never evicted.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import platform as platform_module
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from aenv.images.cache import ChunkCache
from aenv.images.catalog import CatalogEntry, ImageCatalog
from aenv.images.convert import ChunkCutter, ConversionError, LayerConverter
from aenv.images.lazy import TocLayers
from aenv.images.objects import ChunkSink, ChunkStore, LayerOrphaned, LayerUploads, layer_key
from aenv.images.registry import RegistryClient, RegistryError
from aenv.images.toc import TocError
from aenv.kit.errors import first_leaf
from aenv.kit.files import write_atomic
from aenv.proto import layerindex
from aenv.proto.imageref import ImageRef, InvalidReference, parse_reference
from aenv.proto.imagetree import ImageTree
from aenv.proto.layerindex import Chunk, LayerIndex

__all__ = [
    "ChunkRefetchError",
    "ImageConfigView",
    "ImageNotPulled",
    "ImageRecord",
    "ImageStore",
    "PullError",
]

log = logging.getLogger("aenv.images")

RECORD_VERSION = 1
CATALOG_FILE = "catalog.db"
_FEED_BYTES = 1 << 20  # hand the converter at least this much per thread hop
_BATCH_WINDOW_S = 0.005  # misses on one layer this close together share a pass
_READ_AHEAD_BYTES = 32 << 20  # cut this much more of a layer in a re-fetch pass
_STORE_LOOKUP_S = 10.0  # longest wait for a layer index from the object store in a pull
_STORE_BACKOFF_S = 30.0  # after a store failure, skip the store for this long


class PullError(Exception):
    """Pulling an image failed; nothing of it was recorded."""


class ChunkRefetchError(Exception):
    """An evicted chunk could not be cut again from its registry blob."""


class ImageNotPulled(LookupError):
    """No image with this reference or key has been pulled."""


@dataclass(frozen=True, kw_only=True)
class ImageConfigView:
    """What a sandbox takes from the image config."""

    env: tuple[str, ...] = ()
    workdir: str = ""
    user: str = ""
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "env": list(self.env),
            "workdir": self.workdir,
            "user": self.user,
            "entrypoint": list(self.entrypoint),
            "cmd": list(self.cmd),
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> ImageConfigView:
        return cls(
            env=tuple(str(e) for e in doc.get("env") or ()),
            workdir=str(doc.get("workdir") or ""),
            user=str(doc.get("user") or ""),
            entrypoint=tuple(str(e) for e in doc.get("entrypoint") or ()),
            cmd=tuple(str(e) for e in doc.get("cmd") or ()),
        )


@dataclass(frozen=True, kw_only=True)
class ImageRecord:
    key: str  # hex of the manifest digest: the image's directory name on the FUSE mount
    reference: str  # canonical reference it was pulled as
    registry: str
    repository: str
    manifest_digest: str
    platform: str
    config: ImageConfigView
    layers: tuple[str, ...]  # layer blob digests, bottom first
    compressed_bytes: int
    content_bytes: int
    pulled_at: float
    references: tuple[str, ...] = field(default=())

    def to_json(self) -> dict[str, Any]:
        return {
            "version": RECORD_VERSION,
            "key": self.key,
            "reference": self.reference,
            "references": list(self.references or (self.reference,)),
            "registry": self.registry,
            "repository": self.repository,
            "manifestDigest": self.manifest_digest,
            "platform": self.platform,
            "config": self.config.to_json(),
            "layers": list(self.layers),
            "compressedBytes": self.compressed_bytes,
            "contentBytes": self.content_bytes,
            "pulledAt": self.pulled_at,
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> ImageRecord:
        if doc.get("version") != RECORD_VERSION:
            raise ValueError(f"unknown image record version {doc.get('version')!r}")
        return cls(
            key=str(doc["key"]),
            reference=str(doc["reference"]),
            references=tuple(str(r) for r in doc.get("references") or ()),
            registry=str(doc["registry"]),
            repository=str(doc["repository"]),
            manifest_digest=str(doc["manifestDigest"]),
            platform=str(doc.get("platform") or "linux/amd64"),
            config=ImageConfigView.from_json(doc.get("config") or {}),
            layers=tuple(str(x) for x in doc["layers"]),
            compressed_bytes=int(doc.get("compressedBytes") or 0),
            content_bytes=int(doc.get("contentBytes") or 0),
            pulled_at=float(doc.get("pulledAt") or 0.0),
        )

    def to_api(self) -> dict[str, Any]:
        return {
            "image": self.reference,
            "digest": self.manifest_digest,
            "platform": self.platform,
            "layers": len(self.layers),
            "compressedBytes": self.compressed_bytes,
            "contentBytes": self.content_bytes,
            "env": list(self.config.env),
            "workdir": self.config.workdir,
            "user": self.config.user,
            "entrypoint": list(self.config.entrypoint),
            "cmd": list(self.config.cmd),
        }


_ARCHES = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}


def _from_entry(entry: CatalogEntry) -> ImageRecord:
    record = ImageRecord.from_json(entry.doc)
    return dataclasses.replace(record, references=entry.references)


def host_platform() -> str:
    """The OCI platform of this machine ("linux/amd64", "linux/arm64")."""
    machine = platform_module.machine().lower()
    return f"linux/{_ARCHES.get(machine, machine)}"


def _hex(digest: str) -> str:
    algo, _, hexpart = digest.partition(":")
    if algo != "sha256" or len(hexpart) != 64 or any(c not in "0123456789abcdef" for c in hexpart):
        raise ValueError(f"not a sha256 digest: {digest!r}")
    return hexpart


@dataclass
class PullProgress:
    """One pull as `GET /images/pulls` shows it."""

    reference: str
    started_at: float = field(default_factory=time.time)
    layers: list[tuple[str, int]] = field(default_factory=list)  # (digest, compressed size)
    done: set[str] = field(default_factory=set)
    error: str | None = None
    finished_at: float | None = None


_PULLS_KEPT_S = 600.0  # finished pulls stay listed this long


@dataclass
class _Refetch:
    """One pass over a layer blob cutting the chunks misses asked for."""

    layer: str
    wanted: dict[str, Chunk] = field(default_factory=dict)
    results: dict[str, bytes] = field(default_factory=dict)
    started: bool = False
    done: trio.Event = field(default_factory=trio.Event)
    error: BaseException | None = None


class ImageStore:
    """Images pulled on this node: records, layer indexes, trees (one instance per node)."""

    def __init__(
        self,
        *,
        root: Path,
        cache: ChunkCache,
        registry: RegistryClient,
        convert_limiter: trio.CapacityLimiter | None = None,
    ) -> None:
        self.root = root
        self.cache = cache
        self.registry = registry
        self._limiter = convert_limiter or trio.CapacityLimiter(2)
        (root / "layers").mkdir(parents=True, exist_ok=True)
        for stray in root.joinpath("layers").glob(".*.tmp"):
            stray.unlink(missing_ok=True)
        self.catalog = ImageCatalog(root / CATALOG_FILE)
        self.catalog.import_legacy(root / "records")  # a home from before the catalog
        self._trees: dict[str, ImageTree] = {}
        self._layer_locks: dict[str, trio.Lock] = {}
        self._pull_locks: dict[str, trio.Lock] = {}
        self._refetches: dict[str, _Refetch] = {}
        self._chunk_lists: dict[str, tuple[LayerIndex, list[Chunk]]] = {}
        self._pulls: dict[str, PullProgress] = {}
        self._layer_bytes: dict[str, int] = {}  # blob bytes received per converting layer
        self.bytes_downloaded = 0
        self.bytes_from_store = 0  # chunk bytes fetched from the object store
        self.layers_from_store = 0  # layer indexes taken from the store instead of converting
        self.objects: ChunkStore | None = None
        self._store_down_until = 0.0
        self.uploads = LayerUploads(
            root=root / "uploads", load_index=self.load_index, cached=cache.peek, recut=self.recut
        )
        self.toc_layers = TocLayers(registry, on_bytes=self._downloaded, limiter=self._limiter)
        self._chunk_sizes: dict[str, dict[str, int]] = {}  # TOC layer -> chunk digest -> size
        self._background: trio.Nursery | None = None  # prefetches (set with the object store)

    def _downloaded(self, n: int) -> None:
        self.bytes_downloaded += n

    def use_object_store(self, objects: ChunkStore | None, nursery: trio.Nursery) -> None:
        """Share converted layers through `objects` (None: keep them local).

        Uploads run in `nursery`; layers converted earlier and not uploaded yet
        are resumed now.
        """
        self.objects = objects
        self._background = nursery
        if objects is not None:
            self.uploads.start(objects, nursery)

    def _store_usable(self) -> ChunkStore | None:
        if self.objects is None or time.monotonic() < self._store_down_until:
            return None
        return self.objects

    def _store_failed(self, what: str, exc: BaseException) -> None:
        log.warning(
            "object store failed (%s); using the registry for %.0fs: %s",
            what,
            _STORE_BACKOFF_S,
            exc,
        )
        self._store_down_until = time.monotonic() + _STORE_BACKOFF_S

    # -- records -------------------------------------------------------------

    def records(self, *, limit: int | None = None, offset: int = 0) -> list[ImageRecord]:
        """Pulled images, newest first: `limit` of them from `offset` (None: all;
        blocking). For listings only: lookups use `find`, `record` and `_source`."""
        found = []
        for entry in self.catalog.page(limit=limit, offset=offset):
            try:
                found.append(_from_entry(entry))
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("skipping image record %s: %s", entry.key, exc)
        return found

    def find(self, ref: ImageRef | str) -> ImageRecord | None:
        """The image this reference names (by its digest if it has one: the newest
        pull with that manifest digest; else the last image recorded under it), or
        None (blocking: one indexed lookup)."""
        ref = parse_reference(ref) if isinstance(ref, str) else ref
        entry = self.catalog.by_digest(ref.digest) if ref.digest else None
        if not ref.digest:
            entry = self.catalog.by_reference(str(ref))
        return None if entry is None else _from_entry(entry)

    def record(self, key: str) -> ImageRecord:
        try:
            entry = self.catalog.get(_hex("sha256:" + key))
        except ValueError:
            entry = None
        if entry is None:
            raise ImageNotPulled(f"image {key!r} is not on this node")
        return _from_entry(entry)

    # -- pulling -------------------------------------------------------------

    async def pull(
        self, reference: str, *, platform: str | None = None, missing_only: bool = False
    ) -> ImageRecord:
        """Resolve `reference`, convert its new layers and record it; returns the record.

        With `missing_only`, an image already pulled under this reference is
        returned as is (like `docker run`'s default pull policy).
        """
        try:
            ref = parse_reference(reference)
        except InvalidReference as exc:
            raise PullError(str(exc)) from None
        if missing_only and (found := await trio.to_thread.run_sync(self.find, ref)) is not None:
            return found
        lock = self._pull_locks.setdefault(str(ref), trio.Lock())
        async with lock:
            progress = self._pulls[str(ref)] = PullProgress(reference=str(ref))
            try:
                return await self._pull(ref, platform or host_platform(), progress)
            except BaseException as exc:
                progress.error = str(exc) or type(exc).__name__
                raise
            finally:
                progress.finished_at = time.time()

    def pulls(self) -> list[dict[str, Any]]:
        """Pulls in progress, and those that ended in the last minutes (with their error)."""
        now = time.time()
        for key, p in list(self._pulls.items()):
            if p.finished_at is not None and now - p.finished_at > _PULLS_KEPT_S:
                del self._pulls[key]
        out = []
        for p in self._pulls.values():
            total = sum(size for _, size in p.layers)
            got = sum(
                size if d in p.done else min(size, self._layer_bytes.get(d, 0))
                for d, size in p.layers
            )
            out.append(
                {
                    "image": p.reference,
                    "state": "error"
                    if p.error
                    else ("done" if p.finished_at is not None else "pulling"),
                    "layers": len(p.layers),
                    "layersDone": len(p.done),
                    "bytes": total,
                    "bytesDone": got,
                    "error": p.error,
                    "startedAt": p.started_at,
                }
            )
        return out

    async def _pull(self, ref: ImageRef, platform: str, progress: PullProgress) -> ImageRecord:
        os_name, _, arch = platform.partition("/")
        started = time.monotonic()
        try:
            resolved = await self.registry.resolve(ref, platform=(os_name, arch or "amd64"))
            indexes: list[LayerIndex | None] = [None] * len(resolved.layers)
            progress.layers = [(d.digest, d.size) for d in resolved.layers]

            diff_ids = list(resolved.config.diff_ids)

            async def one(i: int) -> None:
                indexes[i] = await self._layer(ref, resolved.layers[i], diff_ids[i])
                progress.done.add(resolved.layers[i].digest)

            try:
                async with trio.open_nursery() as nursery:
                    for i in range(len(resolved.layers)):
                        nursery.start_soon(one, i)
            except BaseExceptionGroup as group:
                # the first pull error (the others are usually the same cause, or the
                # cancellations it caused), else the group as it is
                raise first_leaf(group, (RegistryError, ConversionError)) or group from None
        except (RegistryError, ConversionError) as exc:
            raise PullError(f"pulling {ref}: {exc}") from exc
        done = [ix for ix in indexes if ix is not None]
        config = resolved.config
        record = ImageRecord(
            key=_hex(resolved.manifest_digest),
            reference=str(ref),
            registry=ref.registry,
            repository=ref.repository,
            manifest_digest=resolved.manifest_digest,
            platform=platform,
            config=ImageConfigView(
                env=tuple(config.env),
                workdir=config.working_dir or "",
                user=config.user or "",
                entrypoint=tuple(config.entrypoint or ()),
                cmd=tuple(config.cmd or ()),
            ),
            layers=tuple(ix.digest for ix in done),
            compressed_bytes=sum(ix.size for ix in done),
            content_bytes=sum(ix.content_bytes for ix in done),
            pulled_at=time.time(),
        )
        await trio.to_thread.run_sync(self._save_record, record)
        for digest in record.layers:  # converted here: share them (in the background)
            self.uploads.spawn(digest)
        log.info(
            "pulled %s (%s, %d layers, %d MiB) in %.2fs",
            ref,
            resolved.manifest_digest[:19],
            len(done),
            record.content_bytes >> 20,
            time.monotonic() - started,
        )
        return record

    def _save_record(self, record: ImageRecord) -> None:
        """Record `record`: it takes its reference from any other image (a tag
        moves) and keeps the ones it had (blocking)."""
        self.catalog.put(
            key=record.key,
            digest=record.manifest_digest,
            pulled_at=record.pulled_at,
            doc=record.to_json(),
            claim=record.reference,
        )

    def adopt(self, record: ImageRecord, indexes: dict[str, bytes]) -> None:
        """Record an image another node pulled, from its record and layer indexes
        (from the object store; blocking). Each index must be the layer's."""
        for digest in record.layers:
            raw = indexes.get(digest)
            if raw is None:
                if not self._index_path(digest).is_file():
                    raise PullError(f"image {record.reference}: layer {digest} has no index")
                continue
            try:
                index = layerindex.loads(raw)
            except layerindex.BadIndex as exc:
                raise PullError(f"image {record.reference}: layer {digest}: {exc}") from None
            if index.digest != digest:
                raise PullError(
                    f"image {record.reference}: the stored index of layer {digest} "
                    f"describes {index.digest}"
                )
            write_atomic(self._index_path(digest), raw)
        self._save_record(record)

    def _index_path(self, digest: str) -> Path:
        return self.root / "layers" / f"{_hex(digest)}.json"

    def load_index(self, digest: str) -> LayerIndex:
        """A converted layer's index (blocking)."""
        return layerindex.loads(self._index_path(digest).read_bytes())

    async def _layer(self, ref: ImageRef, desc: Any, diff_id: str) -> LayerIndex:
        """The index of layer `desc`: local, else from the object store, else converted."""
        lock = self._layer_locks.setdefault(desc.digest, trio.Lock())
        async with lock:
            path = self._index_path(desc.digest)
            try:
                kept = await trio.to_thread.run_sync(self.load_index, desc.digest)
            except FileNotFoundError:
                pass
            except layerindex.BadIndex as exc:
                log.warning("layer index %s is corrupt (%s); converting again", path.name, exc)
            else:
                if self.toc_layers.reusable(kept, desc):
                    return kept
                log.warning(
                    "layer %s: the kept index was built from a TOC this image does not pin; "
                    "indexing it again",
                    desc.digest[:19],
                )
                self._chunk_lists.pop(desc.digest, None)
                self._chunk_sizes.pop(desc.digest, None)
                self.toc_layers.forget(desc.digest)
            index = await self._index_from_store(desc, diff_id)
            if index is not None:
                return index
            # eStargz / zstd:chunked: the index from the TOC, the blob fetched by range on
            # reads. Not uploaded: any node indexes it from the registry as cheaply.
            index = await self.toc_layers.index(ref, desc, diff_id)
            if index is not None:
                await trio.to_thread.run_sync(write_atomic, path, layerindex.dumps(index))
                if self._background is not None and self.toc_layers.prioritized(index):
                    self._background.start_soon(self._prefetch, ref, index)
                return index
            stored: list[str] = []  # chunks new to the cache, dropped if this fails

            def put_chunk(digest: str, data: bytes) -> None:
                if self.cache.put(digest, data, verified=True):
                    stored.append(digest)

            converter = LayerConverter(
                digest=desc.digest,
                size=desc.size,
                media_type=desc.media_type,
                put_chunk=put_chunk,
            )
            try:
                return await self._convert(ref, desc, converter, path)
            except BaseException:
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(self.cache.discard, stored)
                raise

    async def _convert(
        self, ref: ImageRef, desc: Any, converter: LayerConverter, path: Path
    ) -> LayerIndex:
        pending = bytearray()
        self._layer_bytes[desc.digest] = 0
        async with aclosing(self.registry.blob_stream(ref, desc)) as stream:
            async for piece in stream:
                self.bytes_downloaded += len(piece)
                self._layer_bytes[desc.digest] += len(piece)
                pending += piece
                if len(pending) >= _FEED_BYTES:
                    data, pending = bytes(pending), bytearray()
                    await trio.to_thread.run_sync(converter.feed, data, limiter=self._limiter)
        if pending:
            await trio.to_thread.run_sync(converter.feed, bytes(pending), limiter=self._limiter)
        index = await trio.to_thread.run_sync(converter.finish, limiter=self._limiter)
        raw = layerindex.dumps(index)
        await trio.to_thread.run_sync(self.uploads.mark, desc.digest)  # before the index
        await trio.to_thread.run_sync(write_atomic, path, raw)
        return index

    async def _index_from_store(self, desc: Any, diff_id: str) -> LayerIndex | None:
        """Layer `desc`'s index from the object store, checked and kept locally; else None.

        Its chunks are all in the store (an index is uploaded last), so the
        blob is never downloaded: content arrives chunk by chunk on first read.
        """
        store = self._store_usable()
        if store is None:
            return None
        raw = None
        with trio.move_on_after(_STORE_LOOKUP_S):
            try:
                raw = await store.get(layer_key(desc.digest))
            except KeyError:
                return None
            except Exception as exc:
                self._store_failed(f"looking up layer {desc.digest[:19]}", exc)
                return None
        if raw is None:
            self._store_failed(f"looking up layer {desc.digest[:19]}", TimeoutError("timed out"))
            return None
        try:
            index = await trio.to_thread.run_sync(layerindex.loads, raw)
        except layerindex.BadIndex as exc:
            log.warning("layer index of %s in the object store is corrupt: %s", desc.digest, exc)
            return None
        if (index.digest, index.size, index.diff_id) != (desc.digest, desc.size, diff_id):
            log.warning(
                "layer index of %s in the object store does not match the image "
                "(digest %s size %d diff_id %s); converting the layer",
                desc.digest,
                index.digest,
                index.size,
                index.diff_id,
            )
            return None
        await trio.to_thread.run_sync(write_atomic, self._index_path(desc.digest), raw)
        self.layers_from_store += 1
        log.info("layer %s: index from the object store, blob not downloaded", desc.digest[:19])
        return index

    # -- trees ---------------------------------------------------------------

    async def tree(self, key: str) -> ImageTree:
        """The merged tree of pulled image `key` (built once, then kept)."""
        tree = self._trees.get(key)
        if tree is None:
            record = await trio.to_thread.run_sync(self.record, key)

            def build() -> ImageTree:
                return ImageTree.build([self.load_index(d) for d in record.layers])

            tree = await trio.to_thread.run_sync(build)
            tree = self._trees.setdefault(key, tree)
        return tree

    # -- re-fetching evicted chunks -------------------------------------------

    def _source(self, layer: str) -> ImageRef:
        """Where `layer`'s blob can be fetched again: the newest image that has it."""
        entry = self.catalog.by_layer(layer)
        if entry is None:
            raise ImageNotPulled(f"no pulled image has layer {layer}")
        record = _from_entry(entry)
        return parse_reference(f"{record.registry}/{record.repository}@{record.manifest_digest}")

    async def fetch_chunk(self, chunk: Chunk, layer: str) -> bytes:
        """`chunk`'s bytes from the object store, else cut again from `layer`'s blob.

        The cache's fetcher. A chunk not in the store (or a store that fails)
        goes to the registry, where misses on one layer within a short window
        share one pass over the blob.
        """
        data = await self._chunk_from_store(chunk)
        if data is not None:
            return data
        index, _ = await trio.to_thread.run_sync(self._layer_chunks, layer)
        if index.toc:
            return await self._chunk_from_toc(chunk, index)
        return await self._chunk_from_registry(chunk, layer)

    def _put_verified(self, digest: str, data: bytes) -> None:
        self.cache.put(digest, data, verified=True)

    async def _prefetch(self, ref: ImageRef, index: LayerIndex) -> None:
        """A TOC layer's prioritized files into the cache (at most an eighth of it)."""
        await self.toc_layers.prefetch(
            ref,
            index,
            budget=self.cache.max_bytes // 8,
            cached=self.cache.__contains__,
            put=self._put_verified,
        )

    async def _chunk_from_toc(self, chunk: Chunk, index: LayerIndex) -> bytes:
        """`chunk` of a TOC-indexed layer: its span (and the next ones) by range."""
        ref = await trio.to_thread.run_sync(self._source, index.digest)
        sizes = self._chunk_sizes.get(index.digest)
        if sizes is None:
            sizes = {c.digest: c.size for e in index.entries for c in e.chunks}
            self._chunk_sizes[index.digest] = sizes

        try:
            return await self.toc_layers.fetch(
                ref,
                index,
                chunk,
                sizes=sizes,
                cached=self.cache.__contains__,
                put=self._put_verified,
            )
        except (TocError, RegistryError) as exc:
            raise ChunkRefetchError(
                f"chunk {chunk.digest[:19]} of layer {index.digest[:19]} ({index.toc}): {exc}"
            ) from exc

    async def _chunk_from_store(self, chunk: Chunk) -> bytes | None:
        store = self._store_usable()
        if store is None:
            return None
        try:
            data = await store.get_blob(chunk.digest)  # verified against the digest
        except KeyError:
            return None
        except Exception as exc:
            self._store_failed(f"fetching chunk {chunk.digest[:19]}", exc)
            return None
        if len(data) != chunk.size:
            log.warning("chunk %s in the object store has the wrong size", chunk.digest)
            return None
        self.bytes_from_store += len(data)
        return data

    async def _chunk_from_registry(self, chunk: Chunk, layer: str) -> bytes:
        job = self._refetches.get(layer)
        if job is None or job.started:
            job = _Refetch(layer=layer)
            self._refetches[layer] = job
            job.wanted[chunk.digest] = chunk
            try:
                await trio.sleep(_BATCH_WINDOW_S)
            finally:
                job.started = True
                if self._refetches.get(layer) is job:
                    del self._refetches[layer]
            # The pass runs in this task so cancellation and errors stay structured.
            await self._run_refetch(job)
        else:
            job.wanted[chunk.digest] = chunk
            await job.done.wait()
        if chunk.digest in job.results:
            return job.results[chunk.digest]
        raise ChunkRefetchError(
            f"chunk {chunk.digest[:19]} of layer {layer[:19]} could not be fetched again: "
            f"{job.error or 'not found in the blob'}"
        )

    def _layer_chunks(self, layer: str) -> tuple[LayerIndex, list[Chunk]]:
        """A layer's index and its distinct chunks by stream offset (blocking; kept)."""
        found = self._chunk_lists.get(layer)
        if found is None:
            index = self.load_index(layer)
            seen: dict[str, Chunk] = {}
            for entry in index.entries:
                for c in entry.chunks:
                    seen.setdefault(c.digest, c)
            found = (index, sorted(seen.values(), key=lambda c: c.offset))
            self._chunk_lists[layer] = found
        return found

    def _read_ahead(self, chunks: list[Chunk], wanted: dict[str, Chunk]) -> list[Chunk]:
        """Chunks after the wanted ones, not cached, worth cutting in the same pass.

        A pass over a compressed blob costs everything before the chunk, so a
        reader going through a file would pay it once per chunk; cutting what
        follows (up to a slice of the cache) makes sequential re-reads linear.
        """
        last = max(c.offset for c in wanted.values())
        budget = min(_READ_AHEAD_BYTES, self.cache.max_bytes // 8)
        extra: list[Chunk] = []
        for c in chunks[bisect.bisect_right([x.offset for x in chunks], last) :]:
            if c.digest in wanted or c.digest in self.cache:
                continue
            budget -= c.size
            if budget < 0:
                break
            extra.append(c)
        return extra

    async def _run_refetch(self, job: _Refetch) -> None:
        try:
            ref = await trio.to_thread.run_sync(self._source, job.layer)
            index, chunks = await trio.to_thread.run_sync(self._layer_chunks, job.layer)
            desc = _LayerDesc(digest=index.digest, size=index.size, media_type=index.media_type)
            ahead = await trio.to_thread.run_sync(self._read_ahead, chunks, dict(job.wanted))

            def found(chunk: Chunk, data: bytes) -> None:  # in a worker thread
                if chunk.digest in job.wanted:
                    job.results[chunk.digest] = data
                else:
                    self.cache.put(chunk.digest, data, verified=True)

            cutter = ChunkCutter(
                wanted=[*job.wanted.values(), *ahead], on_chunk=found, media_type=desc.media_type
            )
            await self._cut(ref, desc, cutter)
        except Exception as exc:
            job.error = exc
            raise
        except BaseException:
            job.error = RuntimeError("the fetch was cancelled")
            raise
        finally:
            job.done.set()

    async def recut(self, layer: str, chunks: Sequence[Chunk], sink: ChunkSink) -> None:
        """Cut `chunks` of `layer` from its registry blob in one pass, each into `sink`.

        `sink` runs in this loop while the cutting thread waits for it, so at
        most one chunk is held at a time. `LayerOrphaned` if no pulled image
        has the layer.
        """
        try:
            ref = await trio.to_thread.run_sync(self._source, layer)
        except ImageNotPulled as exc:
            raise LayerOrphaned(str(exc)) from None
        index = await trio.to_thread.run_sync(self.load_index, layer)
        desc = _LayerDesc(digest=index.digest, size=index.size, media_type=index.media_type)

        def found(chunk: Chunk, data: bytes) -> None:  # in a worker thread
            trio.from_thread.run(sink, chunk, data)

        cutter = ChunkCutter(wanted=chunks, on_chunk=found, media_type=desc.media_type)
        await self._cut(ref, desc, cutter)

    async def _cut(self, ref: ImageRef, desc: _LayerDesc, cutter: ChunkCutter) -> None:
        """Stream `desc`'s blob through `cutter` until it has every chunk it wants.

        Not under the conversion limiter: a cutter's callback may wait (on the
        object store, for `recut`) while it holds its thread.
        """
        async with aclosing(self.registry.blob_stream(ref, desc)) as stream:
            async for piece in stream:
                self.bytes_downloaded += len(piece)
                await trio.to_thread.run_sync(cutter.feed, piece)
                if cutter.done:
                    break
        if not cutter.done:
            await trio.to_thread.run_sync(cutter.finish)


@dataclass(frozen=True)
class _LayerDesc:
    digest: str
    size: int
    media_type: str


@asynccontextmanager
async def open_image_store(**kwargs: Any) -> AsyncIterator[ImageStore]:
    yield ImageStore(**kwargs)
