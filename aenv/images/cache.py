"""The node's bounded local cache of content-addressed chunks, refilled on demand.

Every regular file of a converted image is a sequence of chunks (see
`aenv.proto.layerindex`), each named `sha256:<hex>` and stored here as the
file `<root>/<hex[:2]>/<hex>`. `ChunkCache.put` (sync, thread-safe: layer
conversion calls it from worker threads) verifies and stores a chunk;
`ChunkCache.read` serves a byte range of one chunk to the FUSE file system,
and on a miss fetches the chunk once through the image store's `Fetcher`
(object storage or the registry) however many readers wait for it. The cache
holds at most `max_bytes`: when a put crosses `high_water * max_bytes`, the
least recently used unpinned chunks are deleted until `low_water * max_bytes`
is reached. Pinned chunks are never evicted, so the bound holds up to what is
pinned or being stored at that moment (counted as `over_limit`). Eviction may
delete a chunk of a file that a running sandbox has open through FUSE; that is
safe, because the next read of it is a miss that fetches it again (the bytes
are immutable, named by their hash). Files are written to a temporary name
and renamed, never fsynced: after a crash a chunk file is whole or absent
(stray temporaries are deleted by `load`), and a size mismatch on read is
treated as a miss. Fetched bytes are checked against size and hash before
they are served or stored. `load` rebuilds the index from disk at start, in
LRU order of file mtime (refreshed at most every `_TOUCH_INTERVAL_S` on hits).

Hits are read inline in the event loop when at most `INLINE_READ_MAX` bytes
are asked for: measured on the dev machine, open+pread+close of 128 KiB from
the page cache costs about 7 us (4 us for pread alone on a kept fd), well
below a FUSE round trip, so no fd cache is kept (it would also have to close
fds of chunks evicted by other threads). Larger reads go to a worker thread.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import trio

from aenv.proto.layerindex import Chunk

__all__ = [
    "INLINE_READ_MAX",
    "CacheStatistics",
    "ChunkCache",
    "ChunkUnavailable",
    "Fetcher",
    "open_chunk_cache",
]

log = logging.getLogger(__name__)

Fetcher = Callable[[Chunk, str], Awaitable[bytes]]
"""Fetches a chunk's bytes given the chunk and the digest of the layer blob holding it."""

INLINE_READ_MAX = 128 * 1024
_TMP_PREFIX = ".tmp-"
_HEX = re.compile(r"[0-9a-f]{64}")
_TOUCH_INTERVAL_S = 600.0


class ChunkUnavailable(Exception):
    """A chunk is not cached and could not be fetched (the cause is chained)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheStatistics:
    bytes: int
    chunks: int
    max_bytes: int
    hits: int
    misses: int
    fetches: int
    bytes_fetched: int
    evictions: int
    bytes_evicted: int
    pinned: int
    over_limit: int


@dataclass(slots=True)
class _Entry:
    size: int
    touched: float  # time.monotonic() of the last mtime refresh on disk


class _Flight:
    """One fetch in progress that other readers of the same chunk wait for."""

    __slots__ = ("data", "done", "error")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.data: bytes | None = None
        self.error: BaseException | None = None  # None with data None: leader cancelled


def _hex_of(digest: str) -> str:
    algo, _, hexd = digest.partition(":")
    if algo != "sha256" or not _HEX.fullmatch(hexd):
        raise ValueError(f"not a sha256 chunk digest: {digest!r}")
    return hexd


class ChunkCache:
    def __init__(
        self,
        *,
        root: Path,
        max_bytes: int,
        high_water: float = 0.95,
        low_water: float = 0.80,
        fetch: Fetcher,
        thread_limiter: trio.CapacityLimiter | None = None,
    ) -> None:
        if max_bytes <= 0 or not 0 < low_water <= high_water <= 1:
            raise ValueError("need max_bytes > 0 and 0 < low_water <= high_water <= 1")
        self.root = root
        self.max_bytes = max_bytes
        self._high = int(max_bytes * high_water)
        self._low = int(max_bytes * low_water)
        self._fetch = fetch
        self._limiter = thread_limiter or trio.CapacityLimiter(4)
        # Guarded by _lock (put runs in worker threads):
        self._lock = threading.Lock()
        self._lru: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._pins: dict[str, int] = {}
        self._hits = self._misses = self._fetches = self._bytes_fetched = 0
        self._evictions = self._bytes_evicted = self._over_limit = 0
        # Event-loop only:
        self._flights: dict[str, _Flight] = {}

    # -- lifecycle ---------------------------------------------------------

    async def load(self) -> None:
        """Index the chunk files already on disk (oldest mtime least recent), then trim."""
        found = await trio.to_thread.run_sync(self._scan, limiter=self._limiter)
        with self._lock:
            known = self._lru
            self._lru = OrderedDict()
            for hexd, size in found:
                if hexd not in known:
                    self._lru[hexd] = _Entry(size, time.monotonic())
                    self._bytes += size
            self._lru.update(known)  # whatever was put meanwhile stays most recent
            victims = self._pick_victims()
        await trio.to_thread.run_sync(self._unlink, victims, limiter=self._limiter)

    def _scan(self) -> list[tuple[str, int]]:
        self.root.mkdir(parents=True, exist_ok=True)
        found: list[tuple[int, str, int]] = []
        for sub in os.scandir(self.root):
            if not (sub.is_dir(follow_symlinks=False) and len(sub.name) == 2):
                continue
            for f in os.scandir(sub.path):
                if f.name.startswith(_TMP_PREFIX):
                    with suppress(FileNotFoundError):
                        os.unlink(f.path)
                    continue
                if not (_HEX.fullmatch(f.name) and f.name[:2] == sub.name):
                    continue
                try:
                    st = f.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                found.append((st.st_mtime_ns, f.name, st.st_size))
        found.sort()
        return [(hexd, size) for _, hexd, size in found]

    # -- storing -----------------------------------------------------------

    def put(self, digest: str, data: bytes, *, verified: bool = False) -> bool:
        """Store one chunk; True if it was not cached before. Blocking, thread-safe.

        The bytes are hashed against `digest` unless the caller just did
        (`verified`, as the layer converter does for every chunk it cuts).
        """
        hexd = _hex_of(digest)
        with self._lock:
            if hexd in self._lru:
                self._lru.move_to_end(hexd)
                return False
        if not verified and hashlib.sha256(data).hexdigest() != hexd:
            raise ValueError(f"content does not match {digest}")
        self._store(hexd, data)
        return True

    def discard(self, digests: Iterable[str]) -> None:
        """Drop these chunks now unless pinned (what a failed conversion stored)."""
        victims = []
        with self._lock:
            for hexd in (_hex_of(d) for d in digests):
                entry = None if hexd in self._pins else self._lru.pop(hexd, None)
                if entry is not None:
                    self._bytes -= entry.size
                    victims.append(hexd)
        self._unlink(victims)

    def _path(self, hexd: str) -> Path:
        return self.root / hexd[:2] / hexd

    def _store(self, hexd: str, data: bytes) -> None:
        """Write verified bytes, index them as most recent and trim (blocking)."""
        path = self._path(hexd)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f"{_TMP_PREFIX}{hexd}-{secrets.token_hex(4)}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            with suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        with self._lock:
            if hexd in self._lru:
                self._lru.move_to_end(hexd)
                return
            self._lru[hexd] = _Entry(len(data), time.monotonic())
            self._bytes += len(data)
            victims = self._pick_victims()
        self._unlink(victims)

    def _pick_victims(self) -> list[str]:
        """Unindex LRU unpinned chunks if over the high watermark (call with _lock held)."""
        if self._bytes <= self._high:
            return []
        victims = []
        for hexd, entry in list(self._lru.items()):
            if self._bytes <= self._low:
                break
            if hexd in self._pins:
                continue
            del self._lru[hexd]
            self._bytes -= entry.size
            self._evictions += 1
            self._bytes_evicted += entry.size
            victims.append(hexd)
        if self._bytes > self.max_bytes:
            self._over_limit += 1
            log.warning(
                "chunk cache over its limit: %d of %d bytes, %d chunks pinned",
                self._bytes,
                self.max_bytes,
                len(self._pins),
            )
        return victims

    def _unlink(self, victims: Iterable[str]) -> None:
        # Outside the lock: a chunk put again meanwhile may lose its file here;
        # `read` then finds it missing and treats it as a miss.
        for hexd in victims:
            with suppress(FileNotFoundError):
                os.unlink(self._path(hexd))

    def _forget(self, hexd: str) -> None:
        """Drop an entry whose file is gone or damaged."""
        with self._lock:
            entry = self._lru.pop(hexd, None)
            if entry is not None:
                self._bytes -= entry.size
        with suppress(FileNotFoundError):
            os.unlink(self._path(hexd))

    # -- pinning -----------------------------------------------------------

    def pin(self, digests: Iterable[str]) -> None:
        """Keep these chunks from eviction until as many `unpin` calls (refcounted)."""
        hexes = [_hex_of(d) for d in digests]
        with self._lock:
            for hexd in hexes:
                self._pins[hexd] = self._pins.get(hexd, 0) + 1

    def unpin(self, digests: Iterable[str]) -> None:
        hexes = [_hex_of(d) for d in digests]
        with self._lock:
            for hexd in hexes:
                self._unpin_hex(hexd)

    def _unpin_hex(self, hexd: str) -> None:
        n = self._pins.get(hexd, 0) - 1
        if n > 0:
            self._pins[hexd] = n
        else:
            self._pins.pop(hexd, None)

    # -- reading -----------------------------------------------------------

    async def read(self, chunk: Chunk, layer: str, offset: int, size: int) -> bytes:
        """Bytes [offset, offset+size) of `chunk`, fetched first if not cached.

        Raises `ChunkUnavailable` if the chunk is missing and the fetch fails.
        """
        hexd = _hex_of(chunk.digest)
        if offset < 0 or size < 0 or offset + size > chunk.size:
            raise ValueError(f"range {offset}+{size} outside chunk of {chunk.size} bytes")
        while True:
            data = await self._read_cached(hexd, chunk.size, offset, size)
            if data is not None:
                return data
            flight = self._flights.get(hexd)
            if flight is None:
                full = await self._lead_fetch(hexd, chunk, layer)
                return full[offset : offset + size]
            await flight.done.wait()
            if flight.data is not None:
                return flight.data[offset : offset + size]
            if flight.error is not None:
                raise ChunkUnavailable(f"fetching {chunk.digest}: {flight.error}") from (
                    flight.error
                )
            # The leader was cancelled: look again, maybe lead a new fetch.

    async def _read_cached(
        self, hexd: str, chunk_size: int, offset: int, size: int
    ) -> bytes | None:
        with self._lock:
            entry = self._lru.get(hexd)
            if entry is None:
                self._misses += 1
                return None
            self._lru.move_to_end(hexd)
            self._pins[hexd] = self._pins.get(hexd, 0) + 1
            now = time.monotonic()
            touch = now - entry.touched > _TOUCH_INTERVAL_S
            if touch:
                entry.touched = now
            damaged = entry.size != chunk_size
        data: bytes | None = b""
        try:
            if not damaged:
                if size <= INLINE_READ_MAX:
                    data = self._pread(hexd, offset, size, touch)
                else:
                    data = await trio.to_thread.run_sync(
                        self._pread, hexd, offset, size, touch, limiter=self._limiter
                    )
                damaged = data is None or len(data) != size
        finally:
            with self._lock:
                self._unpin_hex(hexd)
        if damaged:
            # A file gone is normal (evicted by another thread meanwhile); a short one is not.
            level = logging.DEBUG if data is None else logging.WARNING
            log.log(level, "chunk sha256:%s missing or damaged on disk; fetching it", hexd)
            self._forget(hexd)
            with self._lock:
                self._misses += 1
            return None
        with self._lock:
            self._hits += 1
        return data

    def _pread(self, hexd: str, offset: int, size: int, touch: bool) -> bytes | None:
        try:
            fd = os.open(self._path(hexd), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            if touch:
                os.utime(fd)
            return os.pread(fd, size, offset)
        finally:
            os.close(fd)

    async def _lead_fetch(self, hexd: str, chunk: Chunk, layer: str) -> bytes:
        flight = self._flights[hexd] = _Flight()
        try:
            with self._lock:
                self._fetches += 1
            try:
                data = await self._fetch(chunk, layer)
                if len(data) != chunk.size:
                    raise ValueError(f"fetched {len(data)} bytes, expected {chunk.size}")
                await trio.to_thread.run_sync(self._verify_store, hexd, data, limiter=self._limiter)
            except Exception as exc:
                flight.error = exc
                raise ChunkUnavailable(f"fetching {chunk.digest}: {exc}") from exc
            with self._lock:
                self._bytes_fetched += len(data)
            flight.data = data
            return data
        finally:
            del self._flights[hexd]
            flight.done.set()

    def _verify_store(self, hexd: str, data: bytes) -> None:
        if hashlib.sha256(data).hexdigest() != hexd:
            raise ValueError(f"fetched bytes do not match sha256:{hexd}")
        try:
            self._store(hexd, data)
        except OSError as exc:  # still serve the verified bytes
            log.warning("cannot store chunk sha256:%s: %s", hexd, exc)

    # -- introspection -----------------------------------------------------

    def peek(self, digest: str) -> bytes | None:
        """A cached chunk's verified bytes, or None (blocking; no hit counted, LRU untouched).

        For copying chunks elsewhere (the object store): a chunk evicted or
        damaged meanwhile is None, never wrong bytes.
        """
        hexd = _hex_of(digest)
        with self._lock:
            if hexd not in self._lru:
                return None
        try:
            data = self._path(hexd).read_bytes()
        except FileNotFoundError:
            return None
        return data if hashlib.sha256(data).hexdigest() == hexd else None

    def __contains__(self, digest: str) -> bool:
        with self._lock:
            return _hex_of(digest) in self._lru

    def lru_order(self) -> list[str]:
        """Cached digests, least recently used first."""
        with self._lock:
            return [f"sha256:{h}" for h in self._lru]

    def statistics(self) -> CacheStatistics:
        with self._lock:
            return CacheStatistics(
                bytes=self._bytes,
                chunks=len(self._lru),
                max_bytes=self.max_bytes,
                hits=self._hits,
                misses=self._misses,
                fetches=self._fetches,
                bytes_fetched=self._bytes_fetched,
                evictions=self._evictions,
                bytes_evicted=self._bytes_evicted,
                pinned=len(self._pins),
                over_limit=self._over_limit,
            )


@asynccontextmanager
async def open_chunk_cache(
    *,
    root: Path,
    max_bytes: int,
    fetch: Fetcher,
    high_water: float = 0.95,
    low_water: float = 0.80,
) -> AsyncIterator[ChunkCache]:
    """A `ChunkCache` over `root`, its index rebuilt from disk before use."""
    cache = ChunkCache(
        root=root, max_bytes=max_bytes, high_water=high_water, low_water=low_water, fetch=fetch
    )
    await cache.load()
    yield cache
