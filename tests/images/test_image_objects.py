"""Converted image layers in the object store: shared between nodes, read back chunk by chunk.

Real parts only: Debian's docker-registry on loopback (tests/registry.py),
the real `ImageStore` with its `ChunkCache` on disk, and the real
`ObjectStore` over a local directory or moto's S3 server (tests/s3.py). A
"node" here is an ImageStore with its own root and cache over a shared
store. What came from the registry is its blob byte counter
(`bytes_downloaded`, the node's `aenv_image_registry_bytes_total`).
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from aenv.images import objects
from aenv.images.cache import ChunkCache
from aenv.images.objects import layer_key
from aenv.images.registry import RegistryConfig, RetryPolicy, open_registry_client
from aenv.images.store import ImageStore
from aenv.kit.retry import Backoff
from aenv.proto.layerindex import Entry
from aenv.storage import snapstore
from aenv.storage.objstore import ObjectStore, open_object_store
from aenv.storage.objstore import RetryPolicy as StoreRetry
from aenv.storage.snapstore import LocalLayer, collect_garbage, upload_snapshot

# Fixtures are imported by name, so test parameters shadow them (F811).
# ruff: noqa: F811
from tests.registry import LocalRegistry, PushedImage, push_big_image
from tests.s3 import MotoS3, s3_faulty, s3_store  # noqa: F401

MiB = 1 << 20
FAST = StoreRetry(attempts=2, base_delay=0.01, max_delay=0.05, transport_retries=0)


@asynccontextmanager
async def image_node(
    root: Path, objs: ObjectStore | None, *, cache_bytes: int = 256 * MiB
) -> AsyncIterator[ImageStore]:
    """An image store as a node has one: own root and cache, uploading to `objs`."""
    config = RegistryConfig(read_timeout=5, connect_timeout=5, retry=RetryPolicy(attempts=2))
    async with open_registry_client(config=config) as registry, trio.open_nursery() as nursery:
        box: list[ImageStore] = []

        async def fetch(chunk: object, layer: str) -> bytes:
            return await box[0].fetch_chunk(chunk, layer)  # type: ignore[arg-type]

        cache = ChunkCache(root=root / "cache", max_bytes=cache_bytes, fetch=fetch)
        store = ImageStore(root=root / "images", cache=cache, registry=registry)
        box.append(store)
        store.use_object_store(objs, nursery)
        try:
            yield store
        finally:
            nursery.cancel_scope.cancel()


def push_small(registry: LocalRegistry, tag: str, seed: int) -> PushedImage:
    return push_big_image(
        registry, "objs", tag, total_mb=8, files=4, layers=2, compression="zstd", seed=seed
    )


async def file_entry(store: ImageStore, layers: tuple[str, ...], path: str) -> tuple[str, Entry]:
    for digest in layers:
        index = await trio.to_thread.run_sync(store.load_index, digest)
        for e in index.entries:
            if e.path == path:
                return digest, e
    raise AssertionError(f"{path} not in the image")


async def read_file(store: ImageStore, layer: str, entry: Entry) -> bytes:
    parts = [await store.cache.read(c, layer, 0, c.size) for c in entry.chunks]
    return b"".join(parts)


async def wait_uploaded(store: ImageStore, objs: ObjectStore, layers: tuple[str, ...]) -> None:
    with trio.fail_after(30):
        await store.uploads.wait_idle()
    for digest in layers:
        assert await objs.exists(layer_key(digest)), digest
    assert store.uploads.statistics().layers_pending == 0


async def test_a_second_node_takes_layers_from_the_store_not_the_registry(
    registry: LocalRegistry, tmp_path: Path
) -> None:
    img = push_small(registry, "shared", seed=1)
    objs = open_object_store((tmp_path / "store").as_uri(), retry=FAST)
    async with image_node(tmp_path / "a", objs) as a:
        rec_a = await a.pull(img.ref)
        assert a.bytes_downloaded >= sum(la.size for la in img.layers)
        await wait_uploaded(a, objs, rec_a.layers)
        assert a.uploads.statistics().chunks_uploaded > 0
    # Another node (fresh disk), same store: no layer blob is downloaded.
    async with image_node(tmp_path / "b", objs) as b:
        rec_b = await b.pull(img.ref)
        assert rec_b.key == rec_a.key and rec_b.layers == rec_a.layers
        assert b.bytes_downloaded == 0
        assert b.layers_from_store == len(img.layers)
        assert b.cache.statistics().chunks == 0  # nothing cut or fetched yet
        tree = await b.tree(rec_b.key)  # metadata complete before any content
        assert tree is not None
        path, digest = sorted(img.contents.items())[2]
        layer, entry = await file_entry(b, rec_b.layers, path)
        data = await read_file(b, layer, entry)
        assert hashlib.sha256(data).hexdigest() == digest
        assert b.bytes_from_store == sum(c.size for c in entry.chunks)  # that file only
        assert b.bytes_downloaded == 0
        # nothing converted here, so nothing for this node to upload
        assert b.uploads.statistics().layers_pending == 0


async def test_evicted_chunks_are_uploaded_and_fetched_back_from_the_store(
    registry: LocalRegistry, tmp_path: Path
) -> None:
    """A cache far smaller than the image: the upload cuts evicted chunks again from the
    registry, and later misses are served by the store, not the registry."""
    img = push_small(registry, "evicted", seed=2)
    objs = open_object_store((tmp_path / "store").as_uri(), retry=FAST)
    async with image_node(tmp_path / "a", objs, cache_bytes=2 * MiB) as a:
        rec = await a.pull(img.ref)
        pulled = a.bytes_downloaded
        assert a.cache.statistics().evictions > 0
        await wait_uploaded(a, objs, rec.layers)
        stats = a.uploads.statistics()
        assert stats.chunks_recut > 0  # evicted before their upload: cut again
        assert a.bytes_downloaded > pulled
        for digest in rec.layers:  # every chunk of every uploaded index is in the store
            index = await trio.to_thread.run_sync(a.load_index, digest)
            for e in index.entries:
                for c in e.chunks:
                    assert await objs.has_blob(c.digest)
        after_upload = a.bytes_downloaded
        for path, digest in sorted(img.contents.items()):
            layer, entry = await file_entry(a, rec.layers, path)
            data = await read_file(a, layer, entry)
            assert hashlib.sha256(data).hexdigest() == digest, path
        assert a.bytes_downloaded == after_upload  # misses went to the store
        assert a.bytes_from_store >= 6 * MiB
        assert a.cache.statistics().bytes <= 2 * MiB + MiB


async def test_a_pull_with_the_store_down_succeeds_and_uploads_later(
    registry: LocalRegistry, tmp_path: Path, s3_faulty: MotoS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(objects, "UPLOAD_BACKOFF", Backoff(base_s=0.5, max_s=0.5))
    img = push_small(registry, "down", seed=3)
    objs = s3_store(s3_faulty, retry=FAST)
    s3_faulty.stop()
    async with image_node(tmp_path / "a", objs) as a:
        with trio.fail_after(20):
            rec = await a.pull(img.ref)  # the store lookup fails: converted from the registry
        path, digest = sorted(img.contents.items())[0]
        layer, entry = await file_entry(a, rec.layers, path)
        assert hashlib.sha256(await read_file(a, layer, entry)).hexdigest() == digest
        await trio.sleep(1)
        assert a.uploads.statistics().failures > 0
        assert a.uploads.statistics().layers_pending == len(rec.layers)
        s3_faulty.start()
        await wait_uploaded(a, objs, rec.layers)


async def test_uploads_resume_after_a_restart(registry: LocalRegistry, tmp_path: Path) -> None:
    img = push_small(registry, "resume", seed=4)
    async with image_node(tmp_path / "a", None) as a:  # no store yet: layers stay marked
        rec = await a.pull(img.ref)
        assert a.uploads.marked() == sorted(rec.layers)
    objs = open_object_store((tmp_path / "store").as_uri(), retry=FAST)
    async with image_node(tmp_path / "a", objs) as a:  # the same disk, now with a store
        await wait_uploaded(a, objs, rec.layers)
        assert a.uploads.marked() == []


async def test_gc_with_snapshots_never_deletes_image_chunks(
    registry: LocalRegistry, tmp_path: Path
) -> None:
    assert snapstore.IMAGE_LAYER_PREFIX == objects.LAYER_PREFIX
    assert snapstore.IMAGE_PENDING_PREFIX == objects.PENDING_LAYER_PREFIX
    img = push_small(registry, "gc", seed=5)
    objs = open_object_store((tmp_path / "store").as_uri(), retry=FAST)
    async with image_node(tmp_path / "a", objs) as a:
        rec = await a.pull(img.ref)
        await wait_uploaded(a, objs, rec.layers)
        chunks = {
            c.digest
            for d in rec.layers
            for e in (await trio.to_thread.run_sync(a.load_index, d)).entries
            for c in e.chunks
        }
    tree = tmp_path / "snap" / "tree"
    tree.mkdir(parents=True)
    (tree / "f").write_bytes(secrets.token_bytes(MiB))
    await upload_snapshot(
        objs,
        snapshot_id="snap-1",
        record={"name": "s", "createdAt": 1.0},
        layers=[LocalLayer(id="l1", below=(), tree=tree)],
        image=None,
        checksums={},
    )
    stray = await objs.put_blob(secrets.token_bytes(1000))
    report = await collect_garbage(objs, grace_s=0)
    assert report.deleted == 1 and report.image_layers == len(rec.layers)
    assert not await objs.has_blob(stray)  # the collector does delete garbage
    for d in chunks:
        assert await objs.has_blob(d)
    # a layer still uploading (pending index only) protects its chunks too
    raw = await objs.get(layer_key(rec.layers[0]))
    await objs.delete(layer_key(rec.layers[0]))
    await objs.put(objects.pending_layer_key(rec.layers[0]), raw)
    assert (await collect_garbage(objs, grace_s=0)).deleted == 0
