"""Persistent snapshots: a captured sandbox that outlives it and seeds new ones.

A snapshot is a layer stack (frozen, immutable layers in the node's
LayerStore) plus, for a full snapshot, the memory image, hard-linked into
`$AENV_HOME/snapshots/<id>/image` (no copy) with a SHA-256 of every file.
The record goes to SQLite last, after the files are complete and renamed
into place, so a crash leaves either no snapshot or a whole one; images are
verified against their checksums before a sandbox is restored from them.
Names are reusable: a new snapshot under an existing name is a new build,
and the name resolves to the newest.

Each record carries `storage`: `local` (only on this node), `uploading`
(being copied to the object store) or `durable` (its manifest is in the
store). `storage_for` decides a new record's initial state and `on_delete`
hears of deletions; both are set by the durable-storage actor
(`aenv.node.durable`), which also `adopt`s snapshots restored from the store.

`record_capture` is the workflow after a running sandbox's live capture
(`aenv.node.sandbox.LiveCapture`): record it, hand it to the uploads, and
remove the capture's image (the snapshot holds hard links to its files).

`resolve` answers from memory once a name or ID was looked up (hits and
misses alike: a create of a template first asks whether its name is a
snapshot), until the next write of any record: every write goes through this
class. A pool hit then does no SQLite read, so creates in a burst do not
queue behind the journal's writes on the store's one worker thread.
"""

from __future__ import annotations

import copy
import hashlib
import os
import secrets
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from aenv.kit.faults import crash_point
from aenv.storage.metadata import Metadata
from aenv.storage.templates import Template

# names and IDs whose lookup `Snapshots.resolve` remembers (emptied when full)
RESOLVED_MAX = 4096

SNAPSHOT_PREFIX = "snap-"
_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz"


# Names of templates' own snapshots (`aenv.node.warm`); callers cannot give
# names starting with "~", so these never collide with a user's.
TEMPLATE_PREFIX = "~template/"


def snapshot_name(template: Template) -> str:
    """The name of `template`'s own memory snapshot (for this build of it)."""
    return f"{TEMPLATE_PREFIX}{template.template_id}@{template.build_id}"


# Names of paused sandboxes' durable copies (a cluster's nodes resume them
# from the object store); internal, never listed, but uploaded.
PAUSED_PREFIX = "~paused/"


def paused_copy_name(sandbox_id: str) -> str:
    return f"{PAUSED_PREFIX}{sandbox_id}"


def is_paused_copy(doc: dict[str, Any]) -> bool:
    """Whether a snapshot record is a paused sandbox's durable copy."""
    return any(str(n).startswith(PAUSED_PREFIX) for n in doc.get("names") or ())


def is_template_own(doc: dict[str, Any]) -> bool:
    """Whether a snapshot record is a template's own."""
    return any(str(n).startswith(TEMPLATE_PREFIX) for n in doc.get("names") or ())


# Names of template builds' cached steps (`aenv.node.buildcache`): internal,
# kept on this node only.
BUILD_CACHE_PREFIX = "~build/"


def is_build_cache(doc: dict[str, Any]) -> bool:
    """Whether a snapshot record is a cached build step."""
    return any(str(n).startswith(BUILD_CACHE_PREFIX) for n in doc.get("names") or ())


def is_internal(doc: dict[str, Any]) -> bool:
    """Whether a snapshot record is the node's own (hidden from listings): a
    template's, a paused sandbox's durable copy or a cached build step."""
    return is_template_own(doc) or is_paused_copy(doc) or is_build_cache(doc)


class CorruptSnapshot(Exception):
    """A snapshot's files are missing or do not match their checksums."""


def new_snapshot_id() -> str:
    return SNAPSHOT_PREFIX + "".join(secrets.choice(_ALPHABET) for _ in range(16))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _link_image(image: Path, dest: Path) -> dict[str, str]:
    """Hard-link every file of `image` into `dest`; return their checksums."""
    dest.mkdir(parents=True)
    sums: dict[str, str] = {}
    for f in sorted(image.iterdir()):
        if f.is_file():
            target = dest / f.name
            try:
                os.link(f, target)
            except OSError:
                shutil.copy2(f, target)
            sums[f.name] = _sha256(target)
    fd = os.open(dest, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return sums


def _verify(image: Path, sums: dict[str, str]) -> None:
    for name, want in sums.items():
        f = image / name
        if not f.is_file():
            raise CorruptSnapshot(f"snapshot image file {name} is missing")
        if _sha256(f) != want:
            raise CorruptSnapshot(f"snapshot image file {name} does not match its checksum")


def _local_only(doc: dict[str, Any]) -> str:
    return "local"


class Snapshots:
    def __init__(self, root: Path, meta: Metadata) -> None:
        self.root = root
        self.meta = meta
        self.storage_for: Callable[[dict[str, Any]], str] = _local_only
        self.on_delete: Callable[[dict[str, Any]], Awaitable[None]] | None = None
        # `resolve`'s answers, valid while `_writes` has not moved (see `_writing`)
        self._resolved: dict[str, dict[str, Any] | None] = {}
        self._writes = 0
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp-*"):  # a crash mid-record left these
            shutil.rmtree(stale, ignore_errors=True)

    async def record(self, *, doc: dict[str, Any], image: Path | None) -> dict[str, Any]:
        """Store a snapshot whose layers are already frozen; `doc` gets id and files."""
        snap_id = new_snapshot_id()
        tmp = self.root / f".tmp-{snap_id}"
        final = self.root / snap_id
        sums: dict[str, str] = {}
        try:
            if image is not None:
                sums = await trio.to_thread.run_sync(_link_image, image, tmp / "image")
            else:
                await trio.to_thread.run_sync(lambda: tmp.mkdir(parents=True))
            await trio.to_thread.run_sync(tmp.rename, final)
        except BaseException:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(shutil.rmtree, tmp, True)
            raise
        now = time.time()
        doc = {
            **doc,
            "snapshotID": snap_id,
            "createdAt": now,
            "image": str(final / "image") if image is not None else None,
            "checksums": sums,
        }
        doc["storage"] = self.storage_for(doc)
        async with self._writing():
            await self.meta.run(self.meta.store.put_snapshot, snap_id, doc.get("name"), now, doc)
        return doc

    async def adopt(self, *, doc: dict[str, Any], staged: Path | None) -> dict[str, Any]:
        """Record a snapshot brought from elsewhere under its own ID.

        `staged` is a directory holding its memory image as `image/` (None:
        filesystem only), renamed into place; local files of an earlier copy
        are replaced. `doc` must carry snapshotID, createdAt and checksums.
        """
        snap_id = str(doc["snapshotID"])
        final = self.root / snap_id

        def place() -> None:
            if final.exists():
                doomed = self.root / f".tmp-{snap_id}-old"
                shutil.rmtree(doomed, ignore_errors=True)
                final.rename(doomed)
                shutil.rmtree(doomed, ignore_errors=True)
            if staged is not None:
                staged.rename(final)
            else:
                final.mkdir(parents=True)

        await trio.to_thread.run_sync(place)
        doc = {**doc, "image": str(final / "image") if staged is not None else None}
        async with self._writing():
            await self.meta.run(
                self.meta.store.put_snapshot, snap_id, doc.get("name"), float(doc["createdAt"]), doc
            )
        return doc

    async def update(self, snap_id: str, **fields: Any) -> dict[str, Any] | None:
        """Set `fields` on a recorded snapshot; None (and nothing written) if it is gone."""
        store = self.meta.store

        def run() -> dict[str, Any] | None:
            doc = store.get_snapshot(snap_id)
            if doc is None:
                return None
            doc.update(fields)
            store.put_snapshot(snap_id, doc.get("name"), float(doc["createdAt"]), doc)
            return doc

        async with self._writing():
            return await self.meta.run(run)

    def local_gaps(self, doc: dict[str, Any], layers_dir: Path) -> list[str]:
        """What of `doc` is missing on disk (layers, image files); [] if whole (blocking)."""
        gaps = [
            f"layer {lid}"
            for lid in doc.get("layers") or ()
            if not (layers_dir / str(lid) / "layer.json").is_file()
        ]
        if doc.get("memory") and doc.get("image") is None:
            gaps.append("memory image")
        elif doc.get("image") is not None:
            image = Path(doc["image"])
            gaps += [
                f"image file {n}" for n in doc.get("checksums") or {} if not (image / n).is_file()
            ]
        return gaps

    async def resolve(self, name_or_id: str) -> dict[str, Any] | None:
        """The snapshot with this ID, else the newest of this name; None if neither."""
        if name_or_id in self._resolved:
            await trio.lowlevel.checkpoint()
            return copy.deepcopy(self._resolved[name_or_id])
        writes = self._writes
        doc = await self.meta.run(self.meta.store.get_snapshot, name_or_id)
        if doc is None:
            doc = await self.meta.run(self.meta.store.latest_snapshot_named, name_or_id)
        if writes == self._writes:  # no write began or ended meanwhile
            if len(self._resolved) >= RESOLVED_MAX:
                self._resolved.clear()
            self._resolved[name_or_id] = copy.deepcopy(doc)
        return doc

    @asynccontextmanager
    async def _writing(self) -> AsyncIterator[None]:
        """Around a write of a record: what `resolve` remembers is forgotten, and
        a lookup that overlaps the write is not remembered."""
        self._writes += 1
        self._resolved.clear()
        try:
            yield
        finally:
            self._writes += 1
            self._resolved.clear()

    async def verified_image(self, doc: dict[str, Any]) -> Path | None:
        if doc.get("image") is None:
            return None
        image = Path(doc["image"])
        await trio.to_thread.run_sync(_verify, image, dict(doc.get("checksums") or {}))
        return image

    async def of_template(self, template_id: str) -> list[dict[str, Any]]:
        """The snapshots of `template_id`'s sandboxes (its own ones included)."""
        return await self.meta.run(self.meta.store.snapshots_of_template, template_id)

    async def taken_from(self, sandbox_id: str) -> list[dict[str, Any]]:
        """The snapshots taken of sandbox `sandbox_id` (its paused copies included)."""
        return await self.meta.run(self.meta.store.snapshots_from, sandbox_id)

    async def uploading(self) -> list[dict[str, Any]]:
        """The snapshots whose upload has not finished."""
        return await self.meta.run(self.meta.store.snapshots_uploading)

    async def names(self, limit: int) -> list[str]:
        """The first `limit` IDs and names (sorted) of snapshots a user made."""
        return await self.meta.run(self.meta.store.snapshot_names, limit)

    async def list(self) -> list[dict[str, Any]]:
        """Every snapshot (listings and sweeps; lookups use the indexed calls)."""
        return await self.meta.run(self.meta.store.list_snapshots)

    async def delete(self, snap_id: str, *, local_only: bool = False) -> None:
        """Delete a snapshot here and (unless `local_only`) from the object store."""
        doc = await self.meta.run(self.meta.store.get_snapshot, snap_id)
        async with self._writing():
            await self.meta.run(self.meta.store.delete_snapshot, snap_id)
        await trio.to_thread.run_sync(shutil.rmtree, self.root / snap_id, True)
        if doc is not None and self.on_delete is not None and not local_only:
            await self.on_delete(doc)

    async def layer_ids(self) -> set[str]:
        return await self.meta.run(self.meta.store.snapshot_layer_ids)


async def record_capture(
    snapshots: Snapshots,
    doc: dict[str, Any],
    image: Path | None,
    *,
    then: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    """Record a live capture (`image`, None for files only, with the layers `doc`
    names) as snapshot `doc`, then `then(record)` (the node starts its upload);
    returns the record. The capture's image is removed either way."""
    try:
        recorded = await snapshots.record(doc=doc, image=image)
        crash_point("snapshot.recorded")
        then(recorded)
        return recorded
    finally:
        if image is not None:  # the snapshot holds hard links to its files
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(shutil.rmtree, image, True)
