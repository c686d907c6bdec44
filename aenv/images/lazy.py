"""Lazy pulls of TOC-indexed layers (eStargz, zstd:chunked): the IO around `aenv.images.toc`.

`TocLayers.index` turns a layer whose descriptor pins a TOC digest into a
`LayerIndex` with two or three range requests (the eStargz footer, then the
TOC; zstd:chunked's annotation says where its TOC is), so a pull of such an
image downloads metadata only. `TocLayers.fetch` serves a chunk on its first
read: the compressed span the TOC names is fetched with one range request,
decompressed and checked against the TOC's chunk digest, together with the
spans right after it (read-ahead: a reader going through a file, or a
chunking that cuts small chunks, costs one request per `READ_AHEAD_BYTES`),
which go into the cache as ordinary verified chunks.

`TocLayers.prefetch` fetches an eStargz layer's prioritized files (those
before its `.prefetch.landmark` entry, the files an image optimiser saw read
first) into the cache in the background, in `READ_AHEAD_BYTES` requests.

Anything unexpected while indexing (a malformed annotation, footer or TOC, a
digest that does not match, a registry that ignores `Range`) returns None:
the caller downloads and converts the layer in full as for any other layer.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from dataclasses import dataclass

import trio

from aenv.images import toc
from aenv.images.registry import BlobInfo, RegistryClient, RegistryError
from aenv.proto.imageref import ImageRef
from aenv.proto.layerindex import Chunk, LayerIndex, Span

__all__ = ["PREFETCH_LANDMARK", "READ_AHEAD_BYTES", "TocLayers"]

log = logging.getLogger("aenv.images.lazy")

READ_AHEAD_BYTES = 4 << 20  # compressed bytes fetched at most per chunk miss
PREFETCH_LANDMARK = ".prefetch.landmark"


@dataclass(frozen=True)
class _Blob:
    digest: str
    size: int


class TocLayers:
    """Indexes TOC-indexed layers from their TOC and fetches their chunks by range."""

    def __init__(
        self,
        registry: RegistryClient,
        *,
        on_bytes: Callable[[int], None] = lambda n: None,
        limiter: trio.CapacityLimiter | None = None,
    ) -> None:
        self.registry = registry
        self._on_bytes = on_bytes
        self._limiter = limiter
        self._starts: dict[str, list[tuple[int, str]]] = {}  # layer -> sorted (start, chunk)
        self.layers_indexed = 0
        self.fallbacks = 0
        self.prefetched_bytes = 0

    async def _range(self, ref: ImageRef, blob: BlobInfo, start: int, end: int) -> bytes:
        data = await self.registry.blob_range(ref, blob, start, end)
        self._on_bytes(len(data))
        return data

    @staticmethod
    def reusable(index: LayerIndex, desc: toc.Described) -> bool:
        """Whether a kept index of `desc`'s blob may serve this descriptor.

        An index built from a TOC was checked against the TOC digest one
        manifest pinned, not against the blob's digest (never read whole): it
        serves only descriptors pinning that same TOC digest, so a manifest
        elsewhere naming the same blob digest with a TOC of its own cannot
        decide what another image's sandboxes read. Indexes converted from the
        whole (verified) blob serve every descriptor.
        """
        if not index.toc:
            return True
        try:
            layout = toc.detect(desc)
        except toc.TocError:
            return False
        return layout is not None and (layout.format, layout.toc_digest) == (
            index.toc,
            index.toc_digest,
        )

    async def index(self, ref: ImageRef, desc: toc.Described, diff_id: str) -> LayerIndex | None:
        """The index of layer `desc` from its TOC; None if it has none or it cannot be used."""
        digest = str(getattr(desc, "digest", ""))
        try:
            layout = toc.detect(desc)
        except toc.TocError as exc:
            log.warning("layer %s: %s; downloading it in full", digest[:19], exc)
            self.fallbacks += 1
            return None
        if layout is None:
            return None
        blob = _Blob(digest, desc.size)
        try:
            if layout.format == "estargz":
                tail = await self._range(ref, blob, desc.size - toc.ESTARGZ_FOOTER_SIZE, desc.size)
                start = toc.parse_estargz_footer(tail, desc.size)
                raw = await self._range(ref, blob, start, desc.size - toc.ESTARGZ_FOOTER_SIZE)
                toc_json = await trio.to_thread.run_sync(
                    toc.decode_estargz_toc, raw, layout, limiter=self._limiter
                )
            else:
                start = layout.offset
                raw = await self._range(ref, blob, start, start + layout.length)
                toc_json = await trio.to_thread.run_sync(
                    toc.decode_zstd_toc, raw, layout, limiter=self._limiter
                )

            def build() -> LayerIndex:
                return toc.build_index(
                    layout,
                    toc_json,
                    digest=digest,
                    size=desc.size,
                    media_type=desc.media_type,
                    diff_id=diff_id,
                    toc_start=start,
                )

            index = await trio.to_thread.run_sync(build, limiter=self._limiter)
        except (toc.TocError, RegistryError) as exc:
            log.warning(
                "layer %s (%s): %s; downloading it in full", digest[:19], layout.format, exc
            )
            self.fallbacks += 1
            return None
        self.layers_indexed += 1
        log.info(
            "layer %s: indexed from its %s TOC (%d entries), blob not downloaded",
            digest[:19],
            layout.format,
            len(index.entries),
        )
        return index

    def forget(self, layer: str) -> None:
        """Drop what is kept of `layer`'s index (it is being replaced)."""
        self._starts.pop(layer, None)

    def _order(self, index: LayerIndex) -> list[tuple[int, str]]:
        found = self._starts.get(index.digest)
        if found is None:
            found = sorted((s.start, d) for d, s in index.spans.items())
            self._starts[index.digest] = found
        return found

    def _plan(
        self, index: LayerIndex, chunk: Chunk, sizes: dict[str, int], cached: Callable[[str], bool]
    ) -> list[tuple[str, Span]]:
        """`chunk`'s span and the uncached spans right after it, within the read-ahead."""
        first = index.spans[chunk.digest]
        plan = [(chunk.digest, first)]
        order = self._order(index)
        end = first.end
        i = bisect.bisect_right(order, (first.start, chunk.digest))
        for start, digest in order[i:]:
            span = index.spans[digest]
            if start > end or span.end - first.start > READ_AHEAD_BYTES:
                break  # not contiguous, or too far
            if digest in sizes and not cached(digest):
                plan.append((digest, span))
                end = max(end, span.end)
        return plan

    async def fetch(
        self,
        ref: ImageRef,
        index: LayerIndex,
        chunk: Chunk,
        *,
        sizes: dict[str, int],
        cached: Callable[[str], bool],
        put: Callable[[str, bytes], object],
    ) -> bytes:
        """`chunk` of TOC-indexed layer `index`, verified; spans read ahead go to `put`.

        `sizes` maps the layer's chunk digests to their sizes, `cached` says
        whether one is in the cache already. Raises `toc.TocError` on bytes that
        do not match the TOC, `RegistryError` when the registry fails.
        """
        plan = self._plan(index, chunk, sizes, cached)
        lo = plan[0][1].start
        hi = max(s.end for _, s in plan)
        data = await self._range(ref, _Blob(index.digest, index.size), lo, hi)

        def cut() -> bytes:
            wanted = b""
            for digest, span in plan:
                piece = data[span.start - lo : span.end - lo]
                want = Chunk(digest, sizes.get(digest, chunk.size), span.start)
                if digest == chunk.digest:
                    wanted = toc.cut_chunk(index.toc, piece, span, want)
                    continue
                try:
                    put(digest, toc.cut_chunk(index.toc, piece, span, want))
                except toc.TocError as exc:  # only read ahead: its own read will say so
                    log.warning("layer %s: read-ahead: %s", index.digest[:19], exc)
            return wanted

        return await trio.to_thread.run_sync(cut, limiter=self._limiter)

    @staticmethod
    def prioritized(index: LayerIndex) -> list[Chunk]:
        """The chunks of the files before the layer's prefetch landmark, in blob order."""
        if index.toc != "estargz":
            return []
        landmark = next((e for e in index.entries if e.path == PREFETCH_LANDMARK), None)
        if landmark is None or not landmark.chunks:
            return []
        limit = index.spans[landmark.chunks[0].digest].start
        seen: dict[str, Chunk] = {}
        for e in index.entries:
            for c in e.chunks:
                if index.spans[c.digest].start < limit:
                    seen.setdefault(c.digest, c)
        return sorted(seen.values(), key=lambda c: index.spans[c.digest].start)

    async def prefetch(
        self,
        ref: ImageRef,
        index: LayerIndex,
        *,
        budget: int,
        cached: Callable[[str], bool],
        put: Callable[[str, bytes], object],
    ) -> None:
        """Fetch the prioritized chunks of `index` (at most `budget` compressed bytes)
        not in the cache yet, to `put`; failures are logged, never raised."""
        todo = [c for c in self.prioritized(index) if not cached(c.digest)]
        sizes = {c.digest: c.size for c in todo}
        done = 0
        try:
            while todo and done < budget:
                first = todo[0]
                plan = self._plan(index, first, sizes, cached)
                got = await self.fetch(ref, index, first, sizes=sizes, cached=cached, put=put)
                await trio.to_thread.run_sync(put, first.digest, got)
                planned = {d for d, _ in plan}
                done += max(s.end for _, s in plan) - plan[0][1].start
                todo = [c for c in todo if c.digest not in planned and not cached(c.digest)]
        except (toc.TocError, RegistryError) as exc:
            log.warning("layer %s: prefetch stopped: %s", index.digest[:19], exc)
        self.prefetched_bytes += done
        if done:
            log.info(
                "layer %s: prefetched %d KiB of prioritized files", index.digest[:19], done >> 10
            )
