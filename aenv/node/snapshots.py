"""Persistent snapshots: a captured sandbox that outlives it and seeds new ones.

A snapshot is a layer stack (frozen, immutable layers in the node's
LayerStore) plus, for a full snapshot, the memory image, hard-linked into
`$AENV_HOME/snapshots/<id>/image` (no copy) with a SHA-256 of every file.
The record goes to SQLite last, after the files are complete and renamed
into place, so a crash leaves either no snapshot or a whole one; images are
verified against their checksums before a sandbox is restored from them.
Names are reusable: a new snapshot under an existing name is a new build,
and the name resolves to the newest.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

import trio

from aenv.storage.metadata import Metadata

SNAPSHOT_PREFIX = "snap-"
_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz"


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


class Snapshots:
    def __init__(self, root: Path, meta: Metadata) -> None:
        self.root = root
        self.meta = meta
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
        await self.meta.run(self.meta.store.put_snapshot, snap_id, doc.get("name"), now, doc)
        return doc

    async def resolve(self, name_or_id: str) -> dict[str, Any] | None:
        doc = await self.meta.run(self.meta.store.get_snapshot, name_or_id)
        if doc is None:
            doc = await self.meta.run(self.meta.store.latest_snapshot_named, name_or_id)
        return doc

    async def verified_image(self, doc: dict[str, Any]) -> Path | None:
        if doc.get("image") is None:
            return None
        image = Path(doc["image"])
        await trio.to_thread.run_sync(_verify, image, dict(doc.get("checksums") or {}))
        return image

    async def list(self) -> list[dict[str, Any]]:
        return await self.meta.run(self.meta.store.list_snapshots)

    async def delete(self, snap_id: str) -> None:
        await self.meta.run(self.meta.store.delete_snapshot, snap_id)
        await trio.to_thread.run_sync(shutil.rmtree, self.root / snap_id, True)

    async def layer_ids(self) -> set[str]:
        return {lid for d in await self.list() for lid in d.get("layers", [])}
