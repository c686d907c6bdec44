"""Deleting snapshots from the store and collecting the blobs nothing references.

`delete_snapshot` removes a snapshot's manifests and moves its name to the
newest other snapshot of that name. `collect_garbage` is a mark-and-sweep:
blobs no manifest (complete or pending) and no image layer index (complete
or pending) references and older than a grace period are deleted; two
collectors at once only delete the same unreferenced blobs twice, and young
blobs of uploads in flight survive. Image layers are never collected: they
are roots, like manifests of snapshots nobody deleted.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
from dataclasses import dataclass

import trio

from aenv.proto.layerindex import BadIndex, loads
from aenv.storage.objstore import BLOB_PREFIX, ObjectNotFound, ObjectStore
from aenv.storage.snapstore.manifest import (
    IMAGE_LAYER_PREFIX,
    IMAGE_PENDING_PREFIX,
    MANIFEST_PREFIX,
    PENDING_PREFIX,
    VOLUME_PREFIX,
    BadManifest,
    Manifest,
    SnapshotUnavailable,
    load_manifest,
    manifest_key,
    name_key,
    pending_key,
)

DEFAULT_PENDING_TTL_S = 7 * 24 * 3600.0
RELIST_S = 1.0  # a collector re-reads pending manifests this often while it deletes


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
    await _mark_volumes(store, marked)
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


async def _mark_volumes(store: ObjectStore, marked: set[str]) -> None:
    """Keep what persisted volumes reference: each one's layer index and its chunks."""
    for info in await store.list(VOLUME_PREFIX + "/"):
        try:
            doc = json.loads(await store.get(info.key))
            digest = str(doc["index"])
            raw = await store.get_blob(digest)
        except ObjectNotFound:
            continue  # deleted meanwhile
        except (ValueError, KeyError, TypeError) as exc:
            raise SnapshotUnavailable(f"garbage collection stopped: {info.key!r}: {exc}") from None
        try:
            index = await trio.to_thread.run_sync(loads, raw)
        except BadIndex as exc:
            raise SnapshotUnavailable(f"garbage collection stopped: {info.key!r}: {exc}") from None
        marked.add(digest)
        marked.update(c.digest for e in index.entries for c in e.chunks)


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
