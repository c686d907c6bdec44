"""The bounded chunk cache: storing, LRU eviction between watermarks, pinning,
single-flight refetch, and rebuilding its index from disk after a restart.

Rules: every cache lives in `tmp_path` (or a fresh temporary directory per
Hypothesis example); the "origin" a cache refetches from is a dict of real
chunk bytes behind a counting fetcher; waiting uses trio's autojump clock.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections import OrderedDict
from pathlib import Path

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from aenv.images.cache import ChunkCache, ChunkUnavailable, open_chunk_cache
from aenv.proto.layerindex import Chunk

LAYER = "sha256:" + "ab" * 32


def make_chunk(data: bytes) -> Chunk:
    return Chunk("sha256:" + hashlib.sha256(data).hexdigest(), len(data), 0)


def blob(i: int, size: int = 100) -> bytes:
    return (f"chunk-{i}-".encode() * size)[:size]


class Origin:
    """Where a cache refetches chunks from: real bytes, counted, optionally slow or failing."""

    def __init__(self, *datas: bytes) -> None:
        self.chunks = {make_chunk(d).digest: d for d in datas}
        self.calls = 0
        self.layers: list[str] = []
        self.delay = 0.0
        self.error: Exception | None = None
        self.corrupt = False

    async def fetch(self, chunk: Chunk, layer: str) -> bytes:
        self.calls += 1
        self.layers.append(layer)
        await trio.sleep(self.delay)
        if self.error is not None:
            raise self.error
        data = self.chunks[chunk.digest]
        return data[::-1] if self.corrupt else data


def chunk_files(root: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in root.glob("*/*")}


def new_cache(root: Path, origin: Origin, max_bytes: int = 1000) -> ChunkCache:
    return ChunkCache(root=root, max_bytes=max_bytes, fetch=origin.fetch)


async def test_put_stores_file_by_digest_and_read_hits(tmp_path: Path) -> None:
    data = os.urandom(5000)
    c = make_chunk(data)
    origin = Origin()
    cache = new_cache(tmp_path, origin, max_bytes=1 << 20)
    cache.put(c.digest, data)
    cache.put(c.digest, data)  # again: no-op
    hexd = c.digest.removeprefix("sha256:")
    assert (tmp_path / hexd[:2] / hexd).read_bytes() == data
    assert await cache.read(c, LAYER, 100, 300) == data[100:400]
    assert await cache.read(c, LAYER, 0, 5000) == data
    assert await cache.read(c, LAYER, 5000, 0) == b""
    stats = cache.statistics()
    assert (stats.chunks, stats.bytes, stats.hits, stats.fetches) == (1, 5000, 3, 0)
    with pytest.raises(ValueError):
        await cache.read(c, LAYER, 4000, 2000)


async def test_put_with_wrong_digest_raises_and_stores_nothing(tmp_path: Path) -> None:
    cache = new_cache(tmp_path, Origin())
    wrong = make_chunk(b"other bytes").digest
    with pytest.raises(ValueError, match="does not match"):
        cache.put(wrong, b"some bytes")
    with pytest.raises(ValueError):
        cache.put("md5:1234", b"some bytes")
    assert wrong not in cache
    assert chunk_files(tmp_path) == {}
    assert cache.statistics().bytes == 0


async def test_eviction_starts_at_high_water_and_stops_at_low_water(tmp_path: Path) -> None:
    cache = new_cache(tmp_path, Origin())  # 1000 bytes: high 950, low 800
    chunks = [make_chunk(blob(i)) for i in range(10)]
    for i, c in enumerate(chunks[:9]):
        cache.put(c.digest, blob(i))
    assert cache.statistics().bytes == 900
    assert cache.statistics().evictions == 0
    cache.put(chunks[9].digest, blob(9))  # 1000 > 950: evict down to 800
    stats = cache.statistics()
    assert (stats.bytes, stats.chunks, stats.evictions, stats.bytes_evicted) == (800, 8, 2, 200)
    assert cache.lru_order() == [c.digest for c in chunks[2:]]
    on_disk = chunk_files(tmp_path)
    assert sorted(on_disk) == sorted(c.digest.removeprefix("sha256:") for c in chunks[2:])
    assert sum(on_disk.values()) == 800


async def test_reads_refresh_lru_position(tmp_path: Path) -> None:
    origin = Origin(*(blob(i) for i in range(10)))
    cache = new_cache(tmp_path, origin)
    chunks = [make_chunk(blob(i)) for i in range(10)]
    for i, c in enumerate(chunks[:9]):
        cache.put(c.digest, blob(i))
    assert await cache.read(chunks[0], LAYER, 0, 10) == blob(0)[:10]  # 0 becomes most recent
    cache.put(chunks[9].digest, blob(9))
    assert chunks[0].digest in cache
    assert chunks[1].digest not in cache
    assert chunks[2].digest not in cache
    # An evicted chunk is a miss that refetches it, with the layer it came from.
    assert await cache.read(chunks[1], LAYER, 0, 100) == blob(1)
    assert origin.calls == 1
    assert origin.layers == [LAYER]


async def test_pinned_chunks_survive_eviction_and_overflow_is_counted(tmp_path: Path) -> None:
    cache = new_cache(tmp_path, Origin(), max_bytes=300)  # high 285, low 240
    chunks = [make_chunk(blob(i)) for i in range(5)]
    cache.pin([chunks[0].digest, chunks[1].digest])
    cache.pin([chunks[0].digest])  # refcounted
    for i in range(3):
        cache.put(chunks[i].digest, blob(i))
    cache.put(chunks[3].digest, blob(3))  # 400: evicts 2 (oldest unpinned), then 3
    assert [c.digest in cache for c in chunks[:4]] == [True, True, False, False]
    assert cache.statistics().over_limit == 0

    cache.pin([chunks[2].digest, chunks[3].digest, chunks[4].digest])
    for i in (2, 3, 4):
        cache.put(chunks[i].digest, blob(i))  # nothing evictable: still stored
    stats = cache.statistics()
    assert stats.bytes == 500
    assert stats.over_limit >= 1
    assert stats.pinned == 5

    cache.unpin([c.digest for c in chunks])  # chunk 0 is still pinned once
    cache.put(make_chunk(blob(5)).digest, blob(5))
    assert chunks[0].digest in cache
    assert cache.statistics().bytes <= 240


async def test_concurrent_misses_share_one_fetch(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    data = os.urandom(64 * 1024)
    c = make_chunk(data)
    origin = Origin(data)
    origin.delay = 1.0
    cache = new_cache(tmp_path, origin, max_bytes=1 << 20)
    results: dict[int, bytes] = {}

    async def reader(i: int) -> None:
        results[i] = await cache.read(c, LAYER, i * 1000, 1000)

    async with trio.open_nursery() as nursery:
        for i in range(10):
            nursery.start_soon(reader, i)
    assert results == {i: data[i * 1000 : (i + 1) * 1000] for i in range(10)}
    assert origin.calls == 1
    stats = cache.statistics()
    assert (stats.fetches, stats.bytes_fetched, stats.misses) == (1, len(data), 10)
    assert c.digest in cache
    assert await cache.read(c, LAYER, 0, 10) == data[:10]  # now a hit
    assert origin.calls == 1


async def test_failed_fetch_raises_to_every_waiter_and_leaves_nothing(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    data = blob(1)
    c = make_chunk(data)
    origin = Origin(data)
    origin.delay = 1.0
    origin.error = ConnectionError("registry unreachable")
    cache = new_cache(tmp_path, origin)
    errors: list[BaseException] = []

    async def reader() -> None:
        try:
            await cache.read(c, LAYER, 0, 10)
        except ChunkUnavailable as exc:
            errors.append(exc)

    async with trio.open_nursery() as nursery:
        for _ in range(5):
            nursery.start_soon(reader)
    assert len(errors) == 5
    assert all(isinstance(e.__cause__, ConnectionError) for e in errors)
    assert origin.calls == 1
    assert c.digest not in cache
    assert chunk_files(tmp_path) == {}
    origin.error = None  # the next read fetches again
    assert await cache.read(c, LAYER, 0, 10) == data[:10]
    assert origin.calls == 2


async def test_fetched_bytes_that_do_not_match_are_rejected(tmp_path: Path) -> None:
    data = blob(1)
    c = make_chunk(data)
    origin = Origin(data)
    origin.corrupt = True
    cache = new_cache(tmp_path, origin)
    with pytest.raises(ChunkUnavailable, match="do not match"):
        await cache.read(c, LAYER, 0, 10)
    short = Chunk(c.digest, c.size + 1, 0)
    origin.corrupt = False
    with pytest.raises(ChunkUnavailable, match="expected"):
        await cache.read(short, LAYER, 0, 10)
    assert c.digest not in cache
    assert chunk_files(tmp_path) == {}


async def test_cancelled_fetcher_hands_over_to_a_waiter(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    data = blob(7)
    c = make_chunk(data)
    origin = Origin(data)
    origin.delay = 10.0
    cache = new_cache(tmp_path, origin)
    got: list[bytes] = []

    async def waiter() -> None:
        got.append(await cache.read(c, LAYER, 0, 100))

    async with trio.open_nursery() as nursery:
        with trio.move_on_after(1):  # the first reader gives up mid-fetch
            nursery.start_soon(waiter)
            await cache.read(c, LAYER, 0, 100)
    assert got == [data]
    assert origin.calls == 2
    assert c.digest in cache


async def test_vanished_or_truncated_file_is_a_miss(tmp_path: Path) -> None:
    a, b = blob(1), blob(2)
    ca, cb = make_chunk(a), make_chunk(b)
    origin = Origin(a, b)
    cache = new_cache(tmp_path, origin)
    cache.put(ca.digest, a)
    cache.put(cb.digest, b)
    ha, hb = ca.digest.removeprefix("sha256:"), cb.digest.removeprefix("sha256:")
    (tmp_path / ha[:2] / ha).unlink()
    (tmp_path / hb[:2] / hb).write_bytes(b[:50])
    assert await cache.read(ca, LAYER, 0, 100) == a
    assert await cache.read(cb, LAYER, 40, 60) == b[40:]
    assert origin.calls == 2
    assert (tmp_path / hb[:2] / hb).read_bytes() == b
    assert cache.statistics().bytes == 200


async def test_restart_rebuilds_index_in_mtime_order_and_removes_temporaries(
    tmp_path: Path,
) -> None:
    origin = Origin()
    first = new_cache(tmp_path, origin)
    chunks = [make_chunk(blob(i)) for i in range(6)]
    for i, c in enumerate(chunks):
        first.put(c.digest, blob(i))
    # Make chunk 5 the oldest on disk, the rest in put order.
    for age, c in zip([5, 0, 1, 2, 3, 4], chunks, strict=True):
        h = c.digest.removeprefix("sha256:")
        os.utime(tmp_path / h[:2] / h, ns=(age * 10**9, (1000 + age) * 10**9))
    h0 = chunks[0].digest.removeprefix("sha256:")
    stray = tmp_path / h0[:2] / f".tmp-{h0}-deadbeef"
    stray.write_bytes(b"half a chu")
    (tmp_path / "README").write_text("not a chunk")

    async with open_chunk_cache(root=tmp_path, max_bytes=1000, fetch=origin.fetch) as cache:
        assert not stray.exists()
        expected = [chunks[i].digest for i in (1, 2, 3, 4, 5, 0)]
        assert cache.lru_order() == expected
        assert cache.statistics().bytes == 600
        assert await cache.read(chunks[3], LAYER, 0, 100) == blob(3)
        assert origin.calls == 0

    # A smaller limit is enforced at load: the least recently written go first.
    async with open_chunk_cache(root=tmp_path, max_bytes=400, fetch=origin.fetch) as small:
        assert small.lru_order() == [chunks[i].digest for i in (4, 5, 0)]
        assert sum(chunk_files(tmp_path).values()) == 300


async def test_puts_from_many_threads_keep_index_and_disk_in_step(tmp_path: Path) -> None:
    cache = new_cache(tmp_path, Origin(), max_bytes=5000)

    def writer(base: int) -> None:
        for i in range(base, base + 100):
            cache.put(make_chunk(blob(i)).digest, blob(i))

    async with trio.open_nursery() as nursery:
        for t in range(4):
            nursery.start_soon(trio.to_thread.run_sync, writer, t * 1000)
    stats = cache.statistics()
    on_disk = chunk_files(tmp_path)
    assert stats.bytes == sum(on_disk.values()) <= 5000
    assert sorted(on_disk) == sorted(d.removeprefix("sha256:") for d in cache.lru_order())
    assert stats.evictions == 400 - stats.chunks


@settings(max_examples=40, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["put", "read"]), st.integers(0, 14), st.integers(1, 300)),
        max_size=60,
    )
)
async def test_matches_an_lru_model(ops: list[tuple[str, int, int]]) -> None:
    """After any sequence of puts and reads, the cache holds what an LRU with watermarks would."""
    with tempfile.TemporaryDirectory() as tmp:
        origin = Origin()
        cache = ChunkCache(
            root=Path(tmp), max_bytes=1000, high_water=0.9, low_water=0.5, fetch=origin.fetch
        )
        model: OrderedDict[int, int] = OrderedDict()
        sizes: dict[int, int] = {}
        for op, key, size in ops:
            size = sizes.setdefault(key, size)
            data = bytes([key]) * size
            c = make_chunk(data)
            origin.chunks[c.digest] = data
            if op == "put":
                cache.put(c.digest, data)
            else:
                assert await cache.read(c, LAYER, 0, size) == data
            model[key] = size
            model.move_to_end(key)
            if sum(model.values()) > 900:
                while sum(model.values()) > 500:
                    model.popitem(last=False)
        assert cache.lru_order() == [make_chunk(bytes([k]) * s).digest for k, s in model.items()]
        assert (
            cache.statistics().bytes == sum(model.values()) == sum(chunk_files(Path(tmp)).values())
        )
