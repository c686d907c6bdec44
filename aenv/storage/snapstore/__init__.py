"""Snapshots in the object store: layout, upload, download, garbage collection.

A snapshot goes to the store as content-addressed blobs plus one manifest.
Each frozen layer of its stack is described by a `LayerIndex`
(`aenv.proto.layerindex`: entries with modes, owners, times, xattrs, link
targets; whiteouts as WHITEOUT entries, opaque directories as OPAQUE ones),
serialised to JSON and stored as a blob itself; every regular file's content
is cut at fixed 1 MiB offsets into chunk blobs (`Chunk.offset` is the offset
in the file). The memory image's files are stored as 4 KiB pages in
zstd-compressed packs, with a page map blob per file (aenv.proto.pagemap,
aenv.storage.memimage); an upload reuses the pages its `image_bases`
stored. Blobs are only written when absent, so content shared by
snapshots (lower layers, unchanged files, unchanged pages) is uploaded
once. The layout:

    blobs/sha256/<2 hex>/<64 hex>   chunks and layer indexes (objstore)
    pending/<snapshot id>.json      the manifest of an upload in progress
    snapshots/<snapshot id>.json    the manifest of a complete snapshot
    names/<name>                    {"snapshotID", "createdAt"} of a name's newest
    images/layers/<64 hex>.json     a converted image layer's index (aenv.images.objects)
    images/pending/<64 hex>.json    the same while that layer's chunks upload

The parts, each importing only those before it:

- `manifest`: the key layout, the manifest format (versions 1 and 2) with
  its parsing and checks, and reading a manifest or name pointer back;
- `trees`: a frozen layer's tree as a `LayerIndex` and back (blocking);
- `upload`: `upload_snapshot`, visible in the store only once complete;
- `restore`: `fetch_layer_index`, `materialise_layer`, `download_image`,
  every blob verified, any missing, corrupt or malformed object a
  `SnapshotUnavailable` naming the snapshot and the object;
- `garbage`: `delete_snapshot` and `collect_garbage`, a mark-and-sweep that
  spares blobs of uploads in flight and image layers.

This package re-exports what the rest of aenv uses.
"""

from __future__ import annotations

from aenv.kit.errors import one_error
from aenv.storage.objstore import StoreUnavailable
from aenv.storage.snapstore.garbage import GcReport, collect_garbage, delete_snapshot
from aenv.storage.snapstore.manifest import (
    IMAGE_LAYER_PREFIX,
    IMAGE_PENDING_PREFIX,
    BadManifest,
    ImageFile,
    Manifest,
    SnapshotUnavailable,
    StoredLayer,
    dump_manifest,
    fetch_manifest,
    load_manifest,
    manifest_key,
    name_key,
    pending_key,
)
from aenv.storage.snapstore.restore import (
    LocalImage,
    download_image,
    fetch_layer_index,
    materialise_layer,
)
from aenv.storage.snapstore.trees import index_layer
from aenv.storage.snapstore.upload import LocalLayer, UploadReport, upload_snapshot

__all__ = [
    "IMAGE_LAYER_PREFIX",
    "IMAGE_PENDING_PREFIX",
    "BadManifest",
    "GcReport",
    "ImageFile",
    "LocalImage",
    "LocalLayer",
    "Manifest",
    "SnapshotUnavailable",
    "StoreUnavailable",
    "StoredLayer",
    "UploadReport",
    "collect_garbage",
    "delete_snapshot",
    "download_image",
    "dump_manifest",
    "fetch_layer_index",
    "fetch_manifest",
    "index_layer",
    "load_manifest",
    "manifest_key",
    "materialise_layer",
    "name_key",
    "one_error",
    "pending_key",
    "upload_snapshot",
]
