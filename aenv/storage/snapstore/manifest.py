"""A snapshot's manifest: the store's key layout, the format, parsing and reading one back.

The keys: `snapshots/<id>.json` (a complete snapshot's manifest),
`pending/<id>.json` (the same while its upload runs), `names/<name>` (a
name's newest snapshot, `{"snapshotID", "createdAt"}`) and the image layer
prefixes the collector also reads. A `Manifest` lists the snapshot's
portable record fields, its layers (topmost first, each with the digest of
its layer index blob), its memory image files and every blob it
references. `dump_manifest` writes version 2 (image files as page maps);
`load_manifest` reads versions 1 (image files as CHUNK_SIZE chunks) and 2
and checks every digest and name it returns, raising `BadManifest`
otherwise. `fetch_manifest` reads a complete manifest from the store, by
snapshot ID or through a name pointer; a malformed one is a
`SnapshotUnavailable`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from aenv.storage.objstore import ObjectNotFound, ObjectStore, blob_key

MANIFEST_PREFIX = "snapshots"
PENDING_PREFIX = "pending"
NAME_PREFIX = "names"
# Image layer indexes, written by aenv.images.objects (same strings; storage never imports images).
IMAGE_LAYER_PREFIX = "images/layers"
IMAGE_PENDING_PREFIX = "images/pending"
# volumes/<volume id>.json: a persisted volume (aenv.storage.volumes), its tree one layer index
VOLUME_PREFIX = "volumes"
MANIFEST_VERSION = 2  # 2: memory image files as page maps; 1 (chunked images) still reads
_READABLE_VERSIONS = (1, 2)

# Fields of a snapshot record that travel with it (the rest are local paths and state).
PORTABLE_FIELDS = (
    "name",
    "names",
    "sourceSandboxID",
    "templateID",
    "layers",
    "memory",
    "cpuCount",
    "memoryMB",
    "envdToken",
    "createdAt",
    # a paused sandbox's durable copy (a cluster's nodes resume it): its record and pause
    "sandbox",
    "pausedKey",
)


class SnapshotUnavailable(Exception):
    """A snapshot cannot be restored from the store: an object is missing, corrupt or malformed."""


class BadManifest(ValueError):
    """A manifest is not one this version understands."""


def manifest_key(snapshot_id: str) -> str:
    return f"{MANIFEST_PREFIX}/{snapshot_id}.json"


def pending_key(snapshot_id: str) -> str:
    return f"{PENDING_PREFIX}/{snapshot_id}.json"


def name_key(name: str) -> str:
    return f"{NAME_PREFIX}/{name}"


# -- manifests ------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class StoredLayer:
    id: str
    below: tuple[str, ...]
    index: str  # digest of the layer index blob


@dataclass(frozen=True, kw_only=True)
class ImageFile:
    name: str
    size: int
    sha256: str  # hex digest of the whole file (the local checksum)
    chunks: tuple[str, ...] = ()  # version 1: digests of its CHUNK_SIZE pieces, in order
    pagemap: str | None = None  # version 2: digest of its page map blob (aenv.proto.pagemap)


@dataclass(frozen=True, kw_only=True)
class Manifest:
    snapshot_id: str
    record: dict[str, Any]  # the portable fields of the snapshot record
    layers: tuple[StoredLayer, ...]  # topmost first
    image: tuple[ImageFile, ...] | None  # None: a filesystem-only snapshot
    blobs: tuple[str, ...]  # every blob it references, sorted (what GC marks)

    @property
    def name(self) -> str | None:
        name = self.record.get("name")
        return name if isinstance(name, str) else None

    @property
    def created_at(self) -> float:
        return float(self.record.get("createdAt") or 0.0)


def dump_manifest(m: Manifest) -> bytes:
    doc = {
        "version": MANIFEST_VERSION,
        "snapshotID": m.snapshot_id,
        "record": m.record,
        "layers": [{"id": la.id, "below": list(la.below), "index": la.index} for la in m.layers],
        "image": None
        if m.image is None
        else [
            {
                "name": f.name,
                "size": f.size,
                "sha256": f.sha256,
                "chunks": list(f.chunks),
                "pagemap": f.pagemap,
            }
            for f in m.image
        ],
        "blobs": list(m.blobs),
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def _digest(raw: Any, what: str) -> str:
    if not isinstance(raw, str):
        raise BadManifest(f"{what} is not a digest")
    try:
        blob_key(raw)
    except ValueError:
        raise BadManifest(f"{what} {raw!r} is not a sha256 digest") from None
    return raw


def _safe_name(raw: Any, what: str) -> str:
    if not isinstance(raw, str) or not raw or "/" in raw or raw in (".", "..") or "\0" in raw:
        raise BadManifest(f"{what} {raw!r} is not a plain name")
    return raw


def load_manifest(raw: bytes) -> Manifest:
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadManifest(f"not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("version") not in _READABLE_VERSIONS:
        raise BadManifest(
            f"not a snapshot manifest of version {' or '.join(map(str, _READABLE_VERSIONS))}"
        )
    try:
        record = doc["record"]
        if not isinstance(record, dict):
            raise BadManifest("record is not an object")
        layers = tuple(
            StoredLayer(
                id=_safe_name(la["id"], "layer id"),
                below=tuple(_safe_name(b, "layer id") for b in la["below"]),
                index=_digest(la["index"], "layer index"),
            )
            for la in doc["layers"]
        )
        image = None
        if doc["image"] is not None:
            image = tuple(
                ImageFile(
                    name=_safe_name(f["name"], "image file"),
                    size=int(f["size"]),
                    sha256=str(f["sha256"]),
                    chunks=tuple(_digest(c, "image chunk") for c in f["chunks"]),
                    pagemap=None
                    if f.get("pagemap") is None
                    else _digest(f["pagemap"], "image page map"),
                )
                for f in doc["image"]
            )
        blobs = tuple(_digest(b, "blob") for b in doc["blobs"])
        return Manifest(
            snapshot_id=_safe_name(doc["snapshotID"], "snapshot id"),
            record=record,
            layers=layers,
            image=image,
            blobs=blobs,
        )
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, BadManifest):
            raise
        raise BadManifest(f"malformed manifest: {exc!r}") from None


def unavailable(snapshot_id: str, what: str, exc: BaseException) -> SnapshotUnavailable:
    return SnapshotUnavailable(
        f"snapshot {snapshot_id} cannot be restored from the store: {what}: {exc}"
    )


async def fetch_manifest(store: ObjectStore, name_or_id: str, *, by_id: bool) -> Manifest | None:
    """The complete manifest of a snapshot ID (`by_id`) or of a name's newest; None if absent.

    StoreUnavailable passes through; a malformed manifest or name pointer is
    a SnapshotUnavailable.
    """
    snapshot_id = name_or_id
    if not by_id:
        try:
            raw = await store.get(name_key(name_or_id))
        except ObjectNotFound:
            return None
        except ValueError:
            return None  # not a valid key: not a name the store can hold
        try:
            snapshot_id = str(json.loads(raw)["snapshotID"])
        except (ValueError, KeyError, TypeError) as exc:
            raise unavailable(
                name_or_id, f"name pointer {name_key(name_or_id)!r} is malformed", exc
            ) from None
    try:
        raw = await store.get(manifest_key(snapshot_id))
    except ObjectNotFound:
        return None
    except ValueError:
        return None
    try:
        m = load_manifest(raw)
    except BadManifest as exc:
        raise unavailable(
            snapshot_id, f"manifest {manifest_key(snapshot_id)!r} is malformed", exc
        ) from None
    if m.snapshot_id != snapshot_id:
        raise SnapshotUnavailable(f"manifest {manifest_key(snapshot_id)!r} names {m.snapshot_id}")
    return m
