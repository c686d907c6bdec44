"""The image catalog: lookups by reference, digest and layer, the import of a
home from before it, and its state after a crash mid-write.

Real `ImageStore` over a real local registry (loopback, port 0) and a real
SQLite file; crashes are real: a child process arms a fault point
(`AENV_FAULT`) and is SIGKILLed in the middle of a write, then this process
opens what it left.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from aenv.images.cache import ChunkCache
from aenv.images.catalog import ImageCatalog
from aenv.images.registry import RegistryConfig, RetryPolicy, open_registry_client
from aenv.images.store import CATALOG_FILE, ImageConfigView, ImageRecord, ImageStore

# Fixtures are imported by name, so test parameters shadow them (F811).
from tests.registry import LocalRegistry, push_big_image

REPO_ROOT = Path(__file__).resolve().parents[2]


@asynccontextmanager
async def image_store(root: Path) -> AsyncIterator[ImageStore]:
    config = RegistryConfig(read_timeout=5, connect_timeout=5, retry=RetryPolicy(attempts=2))
    async with open_registry_client(config=config) as registry:

        async def fetch(chunk: object, layer: str) -> bytes:
            raise AssertionError("no chunk is read here")

        cache = ChunkCache(root=root / "cache", max_bytes=1 << 26, fetch=fetch)
        store = ImageStore(root=root / "images", cache=cache, registry=registry)
        try:
            yield store
        finally:
            store.catalog.close()


def record(n: int, *, reference: str, pulled_at: float, refs: tuple[str, ...] = ()) -> ImageRecord:
    digest = f"sha256:{n:064x}"
    return ImageRecord(
        key=f"{n:064x}",
        reference=reference,
        references=refs,
        registry="registry.example",
        repository=reference.split("/", 1)[1].split(":")[0].split("@")[0],
        manifest_digest=digest,
        platform="linux/amd64",
        config=ImageConfigView(env=(f"N={n}",)),
        layers=(f"sha256:{n + 1000:064x}", f"sha256:{n + 2000:064x}"),
        compressed_bytes=n,
        content_bytes=2 * n,
        pulled_at=pulled_at,
    )


def write_legacy(root: Path, *records: ImageRecord) -> None:
    """Records as a node from before the catalog wrote them: one JSON file each."""
    records_dir = root / "images" / "records"
    records_dir.mkdir(parents=True, exist_ok=True)
    for r in records:
        (records_dir / f"{r.key}.json").write_text(json.dumps(r.to_json(), indent=1))


async def test_a_moved_tag_names_the_newest_pull_and_each_digest_its_own_image(
    registry: LocalRegistry, tmp_path: Path
) -> None:
    old = push_big_image(registry, "cat", "v1", total_mb=1, files=2, layers=2, seed=1)
    async with image_store(tmp_path) as store:
        first = await store.pull(old.ref)
        new = push_big_image(registry, "cat", "v1", total_mb=1, files=2, layers=2, seed=2)
        assert new.manifest_digest != old.manifest_digest
        again = await store.pull(new.ref, missing_only=True)
        assert again.key == first.key  # already pulled under that tag: not pulled again
        second = await store.pull(new.ref)  # the tag moved
        assert second.manifest_digest == new.manifest_digest
        by_digest = f"{old.host}/cat@{old.manifest_digest}"
        found = await trio.to_thread.run_sync(store.find, old.ref)
        assert found is not None and found.key == second.key
        assert found.references == (old.ref,)
        was = await trio.to_thread.run_sync(store.find, by_digest)
        assert was is not None and was.key == first.key and was.references == ()
        assert store._source(first.layers[0]).digest == old.manifest_digest
        assert [r.key for r in store.records()] == [second.key, first.key]
    async with image_store(tmp_path) as reopened:  # the same from a store opened again
        found = await trio.to_thread.run_sync(reopened.find, old.ref)
        assert found is not None and found.key == second.key
        assert reopened.record(first.key).manifest_digest == old.manifest_digest
        assert reopened.find(f"{old.host}/cat:v2") is None


async def test_a_home_from_before_the_catalog_keeps_its_images(tmp_path: Path) -> None:
    now = time.time()
    older = record(1, reference="registry.example/app:latest", pulled_at=now - 100)
    newer = record(2, reference="registry.example/app:latest", pulled_at=now - 10)
    other = record(
        3,
        reference="registry.example/tool:1",
        pulled_at=now - 50,
        refs=("registry.example/tool:1", "registry.example/tool:stable"),
    )
    write_legacy(tmp_path, older, newer, other)
    (tmp_path / "images" / "records" / "broken.json").write_text("{not json")
    async with image_store(tmp_path) as store:
        # both old records claimed the tag: the newest pull has it, as before
        found = store.find("registry.example/app:latest")
        assert found is not None and found.key == newer.key
        assert found.config.env == ("N=2",)
        assert store.find(f"registry.example/app@{older.manifest_digest}") == dataclasses.replace(
            older, references=()
        )
        assert store.find("registry.example/tool:stable") == other
        assert store.record(older.key).layers == older.layers
        assert str(store._source(older.layers[1])).endswith(older.manifest_digest)
        assert [r.key for r in store.records()] == [newer.key, other.key, older.key]
        assert [r.key for r in store.records(limit=1, offset=1)] == [other.key]
    images = tmp_path / "images"
    assert not (images / "records").exists()
    assert sorted(p.name for p in (images / "records.migrated").iterdir()) == sorted(
        [f"{older.key}.json", f"{newer.key}.json", f"{other.key}.json", "broken.json"]
    )
    async with image_store(tmp_path) as reopened:  # imported once; still all there
        assert reopened.catalog.count() == 3
        found = reopened.find("registry.example/app:latest")
        assert found is not None and found.key == newer.key


def crash_child(root: Path, fault: str, code: str) -> None:
    """Run `code` (with `catalog` open on `root`) in a child that dies at `fault`."""
    script = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from aenv.images.catalog import ImageCatalog\n"
        f"catalog = ImageCatalog(Path({str(root / CATALOG_FILE)!r}))\n" + code
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO_ROOT,
        env={**os.environ, "AENV_FAULT": fault},
        capture_output=True,
        timeout=60,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()


def test_a_crash_mid_record_leaves_the_previous_catalog(tmp_path: Path) -> None:
    root = tmp_path / "images"
    old = record(1, reference="registry.example/app:latest", pulled_at=1.0)
    catalog = ImageCatalog(root / CATALOG_FILE)
    catalog.put(
        key=old.key,
        digest=old.manifest_digest,
        pulled_at=1.0,
        doc=old.to_json(),
        claim=old.reference,
    )
    catalog.close()
    new = record(2, reference="registry.example/app:latest", pulled_at=2.0)
    crash_child(
        root,
        "images.catalog.put",
        f"doc = json.loads({json.dumps(json.dumps(new.to_json()))})\n"
        f"catalog.put(key={new.key!r}, digest={new.manifest_digest!r}, pulled_at=2.0, "
        f"doc=doc, claim={new.reference!r})\n",
    )
    catalog = ImageCatalog(root / CATALOG_FILE)
    try:
        # the new image's row, layers and tag went together: none of them is there
        entry = catalog.by_reference("registry.example/app:latest")
        assert entry is not None and entry.key == old.key
        assert catalog.get(new.key) is None
        assert catalog.by_digest(new.manifest_digest) is None
        assert catalog.by_layer(new.layers[0]) is None
        assert catalog.count() == 1
    finally:
        catalog.close()


async def test_a_crash_mid_import_is_imported_again_at_the_next_start(tmp_path: Path) -> None:
    records = [
        record(n, reference=f"registry.example/app:{n % 7}", pulled_at=float(n))
        for n in range(1, 41)
    ]
    write_legacy(tmp_path, *records)
    root = tmp_path / "images"
    crash_child(
        root,
        "images.catalog.import",
        f"catalog.import_legacy(Path({str(root / 'records')!r}))\n",
    )
    assert len(list((root / "records").glob("*.json"))) == 40  # nothing moved
    catalog = ImageCatalog(root / CATALOG_FILE)
    assert catalog.count() == 0  # nothing half-imported
    catalog.close()
    async with image_store(tmp_path) as store:
        assert store.catalog.count() == 40
        for tag in range(7):
            newest = max(
                (r for r in records if r.reference.endswith(f":{tag}")), key=lambda r: r.pulled_at
            )
            found = store.find(f"registry.example/app:{tag}")
            assert found is not None and found.key == newest.key


def test_no_lookup_reads_the_whole_catalog(tmp_path: Path) -> None:
    """Every statement a lookup runs is answered from an index (SQLite's plan
    has no SCAN and no sort), with a shared base layer in every image."""
    catalog = ImageCatalog(tmp_path / CATALOG_FILE)
    base = f"sha256:{0:064x}"
    for n in range(1, 201):
        r = record(n, reference=f"registry.example/app:{n}", pulled_at=float(n))
        doc = r.to_json() | {"layers": [base, *r.layers]}
        catalog.put(
            key=r.key, digest=r.manifest_digest, pulled_at=r.pulled_at, doc=doc, claim=r.reference
        )
    statements: list[str] = []
    catalog._db.set_trace_callback(statements.append)
    newest = catalog.by_layer(base)
    assert newest is not None and newest.key == f"{200:064x}"
    assert catalog.by_reference("registry.example/app:7") is not None
    assert catalog.by_digest(f"sha256:{9:064x}") is not None
    assert catalog.get(f"{11:064x}") is not None
    catalog._db.set_trace_callback(None)
    assert len(statements) == 8  # the record and its references, for each lookup
    for sql in statements:
        plan = " / ".join(
            str(row[3]) for row in catalog._db.execute("EXPLAIN QUERY PLAN " + sql).fetchall()
        )
        assert "SCAN" not in plan and "TEMP B-TREE" not in plan, (sql, plan)
    catalog.close()
