"""Default templates' root filesystems in the store, shared once and fetched by any node.

The default templates (`base`, `busybox`) are built by
`aenv.storage.rootfs`; a node with a store shares its build so that a node
joining with an empty home fetches it instead of building it again. A
build is stored by content: its root filesystem is one layer (a
`LayerIndex` blob and its file chunks, as snapshot layers are) under a
filesystem-only manifest `snapshots/rootfs-<template>-<index hex>.json`,
so two nodes sharing the same build upload it once, a retry resumes, and
the store's garbage collector keeps its blobs (a manifest is a root).

Which build a fetching node takes is named by a pointer,
`default-templates/<template>/<recipe>.json`; the recipe (from
`aenv.storage.rootfs.recipe`) names what the builder makes on this
architecture, so nodes of another architecture or another recipe never
take a build that is not theirs. Conflicts resolve by the first share: the
pointer is written create-if-absent after the build's manifest, so the
first build shared for a recipe is the one every fetching node takes; a
node whose own build differs keeps it (its sandboxes run on it) and its
upload, having lost, is deleted from the store again rather than left as a
root nobody names. A pointer whose build is gone from the store is
replaced (compare-and-swap) by the next node that shares one.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from aenv.proto.ids import InvalidName, check_name
from aenv.proto.layerindex import dumps
from aenv.storage.objstore import ObjectStore, Version, blob_key, content_digest
from aenv.storage.snapstore.garbage import delete_snapshot
from aenv.storage.snapstore.manifest import SnapshotUnavailable, fetch_manifest
from aenv.storage.snapstore.restore import materialise_layer
from aenv.storage.snapstore.trees import index_layer
from aenv.storage.snapstore.upload import LocalLayer, upload_snapshot

log = logging.getLogger("aenv.storage")

DEFAULTS_PREFIX = "default-templates"
ROOTFS_SNAPSHOT_PREFIX = "rootfs-"
POINTER_VERSION = 1

ShareOutcome = Literal["shared", "present", "other"]


def pointer_key(template_id: str, recipe: str) -> str:
    return f"{DEFAULTS_PREFIX}/{check_name(template_id)}/{check_name(recipe, 'recipe')}.json"


def rootfs_snapshot_id(template_id: str, index_digest: str) -> str:
    """The manifest ID of a build: the template and its root filesystem's index digest."""
    return f"{ROOTFS_SNAPSHOT_PREFIX}{template_id}-{blob_key(index_digest).rsplit('/', 1)[-1]}"


def rootfs_index(tree: Path) -> tuple[bytes, str]:
    """The root filesystem's layer index, serialised, and its digest: the build's
    content identity (blocking: reads every file)."""
    raw = dumps(index_layer(tree))
    return raw, content_digest(raw)


@dataclass(frozen=True, kw_only=True)
class StoredRootfs:
    """A pointer's contents: which build of a default template nodes take, and its
    template's settings."""

    template_id: str
    recipe: str
    index: str  # digest of the root filesystem's layer index
    cpu_count: int
    memory_mb: int
    disk_size_mb: int
    shared_at: float
    shared_by: str

    @property
    def snapshot_id(self) -> str:
        return rootfs_snapshot_id(self.template_id, self.index)

    def to_json(self) -> bytes:
        doc = {"version": POINTER_VERSION, **dataclasses.asdict(self)}
        return json.dumps(doc, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> StoredRootfs:
        """Parse a pointer; ValueError when it is not one this version reads."""
        try:
            doc = json.loads(raw)
            if not isinstance(doc, dict) or doc.get("version") != POINTER_VERSION:
                raise ValueError(f"not a pointer of version {POINTER_VERSION}")
            found = cls(
                template_id=check_name(str(doc["template_id"])),
                recipe=check_name(str(doc["recipe"]), "recipe"),
                index=str(doc["index"]),
                cpu_count=int(doc["cpu_count"]),
                memory_mb=int(doc["memory_mb"]),
                disk_size_mb=int(doc["disk_size_mb"]),
                shared_at=float(doc["shared_at"]),
                shared_by=str(doc["shared_by"]),
            )
            blob_key(found.index)
        except (KeyError, TypeError, UnicodeDecodeError, InvalidName) as exc:
            raise ValueError(f"malformed pointer: {exc!r}") from None
        if found.cpu_count < 1 or found.memory_mb < 1 or found.disk_size_mb < 0:
            raise ValueError("malformed pointer: resources out of range")
        return found


async def find_rootfs(store: ObjectStore, template_id: str, recipe: str) -> StoredRootfs | None:
    """The build the store names for this template and recipe, if its manifest is
    there; None otherwise. StoreError passes through; a malformed pointer is logged
    and taken as absent."""
    got = await _pointer(store, template_id, recipe)
    if got is None:
        return None
    found, _raw, _version = got
    if found is None or await fetch_manifest(store, found.snapshot_id, by_id=True) is None:
        return None
    return found


async def _pointer(
    store: ObjectStore, template_id: str, recipe: str
) -> tuple[StoredRootfs | None, bytes, Version] | None:
    """The pointer (None: malformed), its bytes and version; None when absent."""
    key = pointer_key(template_id, recipe)
    got = await store.get_versioned(key)
    if got is None:
        return None
    try:
        found = StoredRootfs.from_json(got.data)
    except ValueError as exc:
        log.warning("%s in the object store: %s", key, exc)
        return None, got.data, got.version
    if found.template_id != template_id or found.recipe != recipe:
        log.warning("%s in the object store names another template or recipe", key)
        return None, got.data, got.version
    return found, got.data, got.version


async def share_rootfs(
    store: ObjectStore,
    *,
    build: StoredRootfs,
    tree: Path,
    index_raw: bytes,
    refresh_after_s: float | None = None,
) -> ShareOutcome:
    """Put this node's build of a default template in the store and name it, unless
    the store names one already.

    Returns "present" when the store names this very build (nothing was
    uploaded), "other" when it names another one (this build stays local:
    see the module docstring) and "shared" when this call stored and named
    it. Idempotent; StoreError passes through for the caller to retry.
    """
    if content_digest(index_raw) != build.index:
        raise ValueError("the index does not match the build's digest")
    key = pointer_key(build.template_id, build.recipe)
    current = await _pointer(store, build.template_id, build.recipe)
    if current is not None and current[0] is not None:
        named = current[0]
        if await fetch_manifest(store, named.snapshot_id, by_id=True) is not None:
            return "present" if named.index == build.index else "other"
        # a dangling pointer (its build deleted): replace it below
    sid = build.snapshot_id
    await upload_snapshot(
        store,
        snapshot_id=sid,
        record={
            "templateID": build.template_id,
            "layers": [sid],
            "cpuCount": build.cpu_count,
            "memoryMB": build.memory_mb,
            "createdAt": build.shared_at,
        },
        layers=[LocalLayer(id=sid, below=(), tree=tree, index=index_raw)],
        image=None,
        checksums={},
        refresh_after_s=refresh_after_s,
    )
    body = build.to_json()
    if current is None:
        won = await store.create(key, body) is not None
    else:
        won = await store.compare_and_swap(key, body, expect=current[2]) is not None
    if won:
        return "shared"
    # another node named a build first (or an earlier attempt of this call did)
    again = await _pointer(store, build.template_id, build.recipe)
    if again is not None and again[0] is not None and again[0].index == build.index:
        return "shared"
    await delete_snapshot(store, sid, None)
    return "other"


async def fetch_rootfs(store: ObjectStore, build: StoredRootfs, dest: Path) -> int:
    """Build `dest` (which must not exist) from the stored build; its content bytes.

    Every object is verified as it arrives; a build gone from the store, or a
    manifest that is not one layer with the pointer's index, is a
    SnapshotUnavailable. StoreUnavailable passes through.
    """
    sid = build.snapshot_id
    m = await fetch_manifest(store, sid, by_id=True)
    if m is None:
        raise SnapshotUnavailable(
            f"template {build.template_id}: build {sid} is no longer in the store"
        )
    if len(m.layers) != 1 or m.layers[0].index != build.index:
        raise SnapshotUnavailable(f"template {build.template_id}: manifest {sid} is not the build")
    started = time.monotonic()
    size = await materialise_layer(store, sid, m.layers[0], dest)
    log.info(
        "template %s: %d MiB fetched from the object store in %.1f s",
        build.template_id,
        size >> 20,
        time.monotonic() - started,
    )
    return size
