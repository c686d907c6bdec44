"""Converted image layers in the node's object store: key layout and background uploads.

A layer converted on this node is copied to the object store so that no
node converts it again: its chunks as content-addressed blobs (the store's
`blobs/sha256/...`, shared with snapshots), then its `LayerIndex` at
`images/layers/<blob hex>.json`, last, so an index in the store means every
chunk it names is there. While a layer uploads, its index also sits at
`images/pending/<hex>.json` so that the store's garbage collector keeps the
chunks already uploaded (see `aenv.storage.snapstore.collect_garbage`).

`LayerUploads` runs those uploads as supervised background tasks with
bounded concurrency, retried with capped exponential backoff for as long as
the node lives when the store fails; a pull or a sandbox start never waits
for them. Which layers still need uploading is kept as empty marker files
`<root>/<hex>`, written before the layer's index (so a crash leaves a marker
and the upload resumes at the next start, or a marker without an index,
which is dropped). Chunks come from the local cache; chunks evicted since
the conversion are cut again from the registry blob in one pass over it,
each handed to the store as it is found (the cache is not refilled).

The store is reached through `ChunkStore`, a protocol the node satisfies
with `aenv.storage.objstore.ObjectStore` (images/ never imports storage/):
a missing object is a `KeyError`, any other exception a store failure.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import trio

from aenv.kit.files import write_atomic
from aenv.kit.retry import Backoff
from aenv.proto import layerindex
from aenv.proto.layerindex import Chunk, LayerIndex

__all__ = [
    "LAYER_PREFIX",
    "PENDING_LAYER_PREFIX",
    "ChunkStore",
    "LayerOrphaned",
    "LayerUploads",
    "UploadStatistics",
    "layer_key",
    "pending_layer_key",
]

log = logging.getLogger("aenv.images")

LAYER_PREFIX = "images/layers"
PENDING_LAYER_PREFIX = "images/pending"
UPLOAD_BACKOFF = Backoff(base_s=0.5, max_s=10.0)  # between attempts of a layer's upload


def _hex(digest: str) -> str:
    algo, _, hexpart = digest.partition(":")
    if algo != "sha256" or len(hexpart) != 64 or any(c not in "0123456789abcdef" for c in hexpart):
        raise ValueError(f"not a sha256 digest: {digest!r}")
    return hexpart


def layer_key(digest: str) -> str:
    """Store key of the index of layer blob `digest`: `images/layers/<hex>.json`."""
    return f"{LAYER_PREFIX}/{_hex(digest)}.json"


def pending_layer_key(digest: str) -> str:
    """Store key of the index of a layer whose chunks are being uploaded."""
    return f"{PENDING_LAYER_PREFIX}/{_hex(digest)}.json"


class ChunkStore(Protocol):
    """What images need of the object store (`aenv.storage.objstore.ObjectStore` fits)."""

    async def put_blob(self, data: bytes, *, digest: str | None = None) -> str: ...

    async def get_blob(self, digest: str) -> bytes: ...

    async def has_blob(self, digest: str) -> bool: ...

    async def put(self, key: str, data: bytes, *, if_absent: bool = False) -> bool: ...

    async def get(self, key: str) -> bytes: ...

    async def delete(self, key: str) -> None: ...


class LayerOrphaned(Exception):
    """A chunk must be cut again but no pulled image has the layer (its pull failed)."""


ChunkSink = Callable[[Chunk, bytes], Awaitable[None]]
Recut = Callable[[str, Sequence[Chunk], ChunkSink], Awaitable[None]]


@dataclass(frozen=True, kw_only=True)
class UploadStatistics:
    layers_pending: int  # layers with a marker (uploading or waiting to)
    layers_uploaded: int  # by this process
    chunks_uploaded: int
    bytes_uploaded: int
    chunks_present: int  # found in the store already (another layer or node)
    chunks_recut: int  # evicted before their upload, cut again from the registry
    failures: int  # upload attempts that failed and were retried


class LayerUploads:
    """Background uploads of converted layers to the object store (one per node)."""

    def __init__(
        self,
        *,
        root: Path,
        load_index: Callable[[str], LayerIndex],
        cached: Callable[[str], bytes | None],
        recut: Recut,
        layer_concurrency: int = 2,
        chunk_concurrency: int = 4,
    ) -> None:
        self.root = root
        self._load_index = load_index
        self._cached = cached
        self._recut = recut
        self._layers = trio.CapacityLimiter(layer_concurrency)
        self._chunk_concurrency = chunk_concurrency
        self._store: ChunkStore | None = None
        self._nursery: trio.Nursery | None = None
        self._running: set[str] = set()
        self._idle = trio.Event()
        self._idle.set()
        self._layers_uploaded = self._chunks_uploaded = self._bytes_uploaded = 0
        self._chunks_present = self._chunks_recut = self._failures = 0
        root.mkdir(parents=True, exist_ok=True)
        for stray in root.glob(".*.tmp"):
            stray.unlink(missing_ok=True)
        self._pending = {f"sha256:{p.name}" for p in root.iterdir() if not p.name.startswith(".")}

    # -- markers (mark and _unmark block) --------------------------------------------------------------

    def mark(self, digest: str) -> None:
        """Record that layer `digest` needs uploading; call before writing its index."""
        write_atomic(self.root / _hex(digest), b"")
        self._pending.add(digest)

    def _unmark(self, digest: str) -> None:
        (self.root / _hex(digest)).unlink(missing_ok=True)
        self._pending.discard(digest)

    def marked(self) -> list[str]:
        """Digests of the layers still to upload."""
        return sorted(self._pending)

    # -- tasks -----------------------------------------------------------------------------

    def start(self, store: ChunkStore, nursery: trio.Nursery) -> None:
        """Upload to `store` from now on, in `nursery`; resumes every marked layer."""
        self._store, self._nursery = store, nursery
        for digest in self.marked():
            self.spawn(digest)

    def spawn(self, digest: str) -> None:
        """Upload layer `digest` in the background if it is marked (no-op if not started)."""
        if self._nursery is None or digest in self._running:
            return
        if digest not in self._pending:
            return
        self._running.add(digest)
        if self._idle.is_set():
            self._idle = trio.Event()
        self._nursery.start_soon(self._run, digest)

    async def wait_idle(self) -> None:
        """Until no upload is running (tests; a retrying upload keeps it busy)."""
        await self._idle.wait()

    async def _run(self, digest: str) -> None:
        delays = UPLOAD_BACKOFF.delays()
        try:
            while True:
                try:
                    async with self._layers:
                        await self.upload(digest)
                    return
                except (FileNotFoundError, layerindex.BadIndex) as exc:
                    log.warning("layer %s is not uploaded: its index is gone (%s)", digest, exc)
                    await trio.to_thread.run_sync(self._unmark, digest)
                    return
                except LayerOrphaned as exc:
                    log.info("layer %s waits for an image that has it: %s", digest[:19], exc)
                    return
                except Exception as exc:
                    self._failures += 1
                    delay = next(delays)
                    log.warning(
                        "upload of layer %s failed, retrying in %.1fs: %s",
                        digest[:19],
                        delay,
                        exc,
                    )
                    await trio.sleep(delay)
        finally:
            self._running.discard(digest)
            if not self._running:
                self._idle.set()

    async def upload(self, digest: str) -> None:
        """Upload layer `digest`'s chunks, then its index; clears its marker. One attempt."""
        store = self._store
        assert store is not None
        index = await trio.to_thread.run_sync(self._load_index, digest)
        raw = await trio.to_thread.run_sync(layerindex.dumps, index)
        await store.put(pending_layer_key(digest), raw)
        chunks: dict[str, Chunk] = {}
        for entry in index.entries:
            for c in entry.chunks:
                chunks.setdefault(c.digest, c)
        todo = iter(sorted(chunks.values(), key=lambda c: c.offset))
        evicted: list[Chunk] = []

        async def put(chunk: Chunk, data: bytes) -> None:
            await store.put_blob(data, digest=chunk.digest)
            self._chunks_uploaded += 1
            self._bytes_uploaded += len(data)

        async def worker() -> None:
            for chunk in todo:  # shared iterator: each chunk goes to one worker
                if await store.has_blob(chunk.digest):
                    self._chunks_present += 1
                    continue
                data = await trio.to_thread.run_sync(self._cached, chunk.digest)
                if data is None:
                    evicted.append(chunk)
                else:
                    await put(chunk, data)

        async with trio.open_nursery() as nursery:
            for _ in range(self._chunk_concurrency):
                nursery.start_soon(worker)
        if evicted:
            log.info(
                "layer %s: %d chunks left the cache before their upload; cutting them again",
                digest[:19],
                len(evicted),
            )

            async def recut(chunk: Chunk, data: bytes) -> None:
                await put(chunk, data)
                self._chunks_recut += 1

            await self._recut(digest, evicted, recut)
        await store.put(layer_key(digest), raw)
        await store.delete(pending_layer_key(digest))
        await trio.to_thread.run_sync(self._unmark, digest)
        self._layers_uploaded += 1
        log.info("layer %s is in the object store (%d chunks)", digest[:19], len(chunks))

    def statistics(self) -> UploadStatistics:
        return UploadStatistics(
            layers_pending=len(self._pending),
            layers_uploaded=self._layers_uploaded,
            chunks_uploaded=self._chunks_uploaded,
            bytes_uploaded=self._bytes_uploaded,
            chunks_present=self._chunks_present,
            chunks_recut=self._chunks_recut,
            failures=self._failures,
        )
