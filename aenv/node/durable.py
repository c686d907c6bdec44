"""Durable snapshots: the node's uploads to the object store and restores from it.

`Durable` owns the node's `ObjectStore` (`Config.effective_store_url`; none
when durable storage is off) and, under the node's `services` supervisor,
one cancellable upload job per snapshot: a new snapshot is recorded
`uploading` (in the same SQLite write as the rest of its record, so a crash
cannot lose the intent), its task uploads it with
`aenv.storage.snapstore.upload_snapshot` under a node-wide bound on
concurrent uploads, retries with capped exponential backoff for as long as
the node lives when the store fails, and marks it `durable` once the
manifest is written. On start, every snapshot still `uploading` resumes
(uploads are idempotent: blobs already there are skipped, so an upload that
crashes is restarted by its supervisor, `UPLOAD_RESTARTS`, and one given up
on stays `uploading`, its error recorded, for the next start). Internal
snapshots (a template's warm snapshot) stay `local`. Template shares, layer
copies (`_materialise`) and the store's garbage collection are jobs of the
same supervisor, restarted likewise after an unexpected failure.

An upload names the node's closest durable snapshots (`image_bases`) so
the memory pages they stored are referenced, not uploaded again.

Restores: `locate` finds a snapshot this node does not know in the store
(by ID, or by name through its name pointer; a template of that name wins),
and `ensure_local` brings back whatever of a snapshot is missing on disk:
the memory image into the snapshot directory (whole: runsc reads it all),
and each missing layer by its index alone, served on demand on the image
mount (`_serve_lazy`: contents through the chunk cache from the store) and
adopted by the `LayerStore` as a symlink there, then copied to disk in the
background (`_materialise`) and swapped in; `serve_lazy_layers` serves the
uncopied ones again at start. Staging happens in temporary directories,
published only once every object is fetched and verified. Failures become
`CorruptSnapshot` with a message naming the snapshot and the object.
Deleting a snapshot removes its manifest and name pointer, then a
background mark-and-sweep (`collect`) deletes the blobs nothing references
any more once older than the grace period.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import logging
import secrets
import shutil
from pathlib import Path
from typing import Any

import trio

from aenv.config import Config
from aenv.images.objects import layer_key
from aenv.images.service import Images
from aenv.images.store import ImageNotPulled, ImageRecord
from aenv.kit.faults import crash_point
from aenv.kit.retry import Backoff
from aenv.kit.supervisor import ChildHandle, RestartPolicy, StopToken, Strategy, Supervisor
from aenv.node.snapshots import (
    SNAPSHOT_PREFIX,
    CorruptSnapshot,
    Snapshots,
    is_internal,
    is_paused_copy,
)
from aenv.proto.ids import InvalidName, check_name
from aenv.proto.imagetree import ImageTree, TreeError
from aenv.proto.layerindex import BadIndex, LayerIndex
from aenv.proto.layerindex import loads as load_index
from aenv.storage.layers import LayerError, LayerStore
from aenv.storage.metadata import Metadata
from aenv.storage.objstore import (
    ObjectStore,
    StoreError,
    StoreUnavailable,
    content_digest,
    open_object_store,
)
from aenv.storage.sharedtemplates import (
    find_template,
    index_aliases,
    put_template,
    template_key,
    template_record,
)
from aenv.storage.snapstore import (
    GcReport,
    LocalImage,
    LocalLayer,
    Manifest,
    SnapshotUnavailable,
    StoredLayer,
    collect_garbage,
    delete_snapshot,
    download_image,
    fetch_layer_index,
    fetch_manifest,
    materialise_layer,
    one_error,
    upload_snapshot,
)
from aenv.storage.templates import (
    DEFAULT_TEMPLATE_IDS,
    Template,
    TemplateNotFound,
    TemplateStore,
)

log = logging.getLogger("aenv.durable")

IMAGE_RECORD_PREFIX = "images/records"


def image_record_key(key: str) -> str:
    return f"{IMAGE_RECORD_PREFIX}/{key}.json"


UPLOAD_CONCURRENCY = 2  # snapshots uploading at once
LOCAL_IMAGE_SOURCES = 2  # local memory images a restore looks for its pages in
LAZY_KEY_PREFIX = "layer-"  # image mount directories of layers served on demand
RETRY_BASE_S = 0.5
RETRY_MAX_S = 10.0
WAIT_DURABLE_S = 600.0
# Store errors are retried inside each job; these restart a job that failed otherwise
# (all of them are idempotent): 3 times within 10 minutes, after about 1, 2 and 4 s.
UPLOAD_RESTARTS = RestartPolicy(max_restarts=3, window_s=600.0, backoff_base_s=1.0)
JOB_RESTARTS = UPLOAD_RESTARTS


class Durable:
    def __init__(
        self,
        *,
        config: Config,
        snapshots: Snapshots,
        meta: Metadata,
        layers: LayerStore,
        templates: TemplateStore,
        images: Images,
        services: Supervisor,
    ) -> None:
        self._config = config
        self._snapshots = snapshots
        self._meta = meta
        self._layers = layers
        self._templates = templates
        self._images = images
        url = config.effective_store_url
        self.store: ObjectStore | None = open_object_store(url) if url else None
        self.grace_s = config.store_gc_grace_s
        self._services = services
        self._jobs = itertools.count(1)  # numbers jobs that may run more than once at a time
        self._uploads: dict[str, ChildHandle[None]] = {}  # by snapshot ID
        self._limiter = trio.CapacityLimiter(UPLOAD_CONCURRENCY)
        self._restoring: dict[str, trio.Lock] = {}
        self._found: dict[str, Manifest] = {}
        self._gc_lock = trio.Lock()
        self._serving: dict[str, trio.Lock] = {}
        self._gc_again = False
        snapshots.storage_for = self._initial_storage
        snapshots.on_delete = self._deleted

    # -- uploads -------------------------------------------------------------------

    def _initial_storage(self, doc: dict[str, Any]) -> str:
        shared = not is_internal(doc) or is_paused_copy(doc)  # a template's own stays here
        return "uploading" if self.store is not None and shared else "local"

    def spawn(self, doc: dict[str, Any]) -> None:
        """Start uploading a snapshot recorded `uploading` (no-op otherwise)."""
        snap_id = str(doc["snapshotID"])
        running = self._uploads.get(snap_id)
        if self.store is None or doc.get("storage") != "uploading":
            return
        if running is not None and not running.done:
            return
        self._uploads[snap_id] = self._services.start_soon(
            f"upload {snap_id}",
            functools.partial(self._upload, snap_id),
            policy=UPLOAD_RESTARTS,
            give_up=Strategy.FAIL,
            grace_s=0.0,  # resumed at the next start
        )

    def _job(self, what: str, afn: Any) -> None:
        """Run `afn(stop)` as a job of the services, restarted after a failure."""
        self._services.start_soon(
            f"{what} #{next(self._jobs)}",
            afn,
            policy=JOB_RESTARTS,
            give_up=Strategy.FAIL,
            grace_s=0.0,
        )

    async def resume(self) -> None:
        """Restart the uploads and template shares an earlier node process left unfinished."""
        for doc in await self._snapshots.uploading():
            if doc.get("storage") == "uploading":
                if self.store is None:
                    await self._snapshots.update(str(doc["snapshotID"]), storage="local")
                    continue
                log.info("resuming the upload of snapshot %s", doc["snapshotID"])
                self.spawn(doc)
        if self.store is not None:  # templates shared by nodes from before the alias index
            store = self.store

            async def index(_stop: StopToken) -> None:
                await index_aliases(store)

            self._job("index template aliases", index)
        if self.store is not None:  # after the uploads: a built template waits for its snapshot
            for template in await trio.to_thread.run_sync(self._templates.share_pending):
                log.info("resuming the share of template %s", template.template_id)
                self.share_template(template)

    async def _upload(self, snap_id: str, _stop: StopToken) -> None:
        """Upload snapshot `snap_id`, retrying store errors for as long as it takes;
        another failure is recorded in the snapshot and raised to the supervisor."""
        try:
            await self._upload_until_stored(snap_id)
        except Exception as exc:
            with contextlib.suppress(Exception):
                await self._snapshots.update(snap_id, storageError=f"the upload failed: {exc!r}")
            raise
        if self._uploads.get(snap_id) is self._services.get(f"upload {snap_id}"):
            del self._uploads[snap_id]  # (a failed one stays, done, for `wait_durable`)

    async def _upload_until_stored(self, snap_id: str) -> None:
        assert self.store is not None
        delays = Backoff(base_s=RETRY_BASE_S, max_s=RETRY_MAX_S).delays()
        while True:
            doc = await self._meta.run(self._meta.store.get_snapshot, snap_id)
            if doc is None:
                return  # deleted
            try:
                async with self._limiter:
                    report = await self._upload_once(doc)
                crash_point("upload.stored")
            except StoreError as exc:
                delay = next(delays)
                level = logging.WARNING if isinstance(exc, StoreUnavailable) else logging.ERROR
                log.log(
                    level,
                    "upload of snapshot %s failed, retrying in %.1fs: %s",
                    snap_id,
                    delay,
                    exc,
                )
                await self._snapshots.update(snap_id, storageError=str(exc))
                await trio.sleep(delay)
                continue
            except (OSError, LayerError) as exc:
                if await self._meta.run(self._meta.store.get_snapshot, snap_id) is None:
                    log.info("snapshot %s was deleted while it was uploading", snap_id)
                    return
                log.error("snapshot %s cannot be uploaded: %r", snap_id, exc)
                await self._snapshots.update(
                    snap_id, storage="local", storageError=f"cannot upload: {exc}"
                )
                return
            await self._snapshots.update(
                snap_id,
                storage="durable",
                storageError=None,
                upload={
                    "bytes": report.bytes_uploaded,
                    "layerBytes": report.layer_bytes,
                    "imageBytes": report.image_bytes,
                    "blobs": report.blobs,
                    "uploadedBlobs": report.uploaded,
                    "imagePages": report.image_pages,
                    "reusedPages": report.reused_pages,
                },
            )
            log.info(
                "snapshot %s is durable: %d of %d blobs uploaded, %d bytes",
                snap_id,
                report.uploaded,
                report.blobs,
                report.bytes_uploaded,
            )
            return

    async def _upload_once(self, doc: dict[str, Any]) -> Any:
        assert self.store is not None
        layers = self._layers
        stack = []
        for lid in doc.get("layers") or ():
            layer = await trio.to_thread.run_sync(layers.get, str(lid))
            stored = await trio.to_thread.run_sync(layers.stored_index, layer.id)
            stack.append(LocalLayer(id=layer.id, below=layer.below, tree=layer.path, index=stored))
        image = Path(doc["image"]) if doc.get("image") else None
        bases = (
            image_bases(doc, await self._snapshots.of_template(str(doc.get("templateID"))))
            if image is not None
            else []
        )
        return await upload_snapshot(
            self.store,
            snapshot_id=str(doc["snapshotID"]),
            record=doc,
            layers=stack,
            image=image,
            checksums=dict(doc.get("checksums") or {}),
            image_bases=bases,
            # blobs about to be reused that a collector could soon take as garbage
            refresh_after_s=self.grace_s / 2 if self.grace_s > 0 else None,
        )

    async def wait_durable(
        self, snap_id: str, *, within_s: float = WAIT_DURABLE_S
    ) -> dict[str, Any]:
        """The snapshot's record once it is no longer `uploading` (or once `within_s` pass)."""
        doc: dict[str, Any] | None = None
        with trio.move_on_after(within_s):
            while True:
                upload = self._uploads.get(snap_id)
                doc = await self._meta.run(self._meta.store.get_snapshot, snap_id)
                if doc is None:
                    raise CorruptSnapshot(f"snapshot {snap_id} was deleted")
                if doc.get("storage") != "uploading" or upload is None or upload.done:
                    return doc
                await upload.wait()
        assert doc is not None
        return doc

    # -- templates -----------------------------------------------------------------

    def share_template(self, template: Template) -> None:
        """Put `template` (and the image record it stands on) in the store, in the
        background and retrying, so that any node sharing the store can start it."""
        if self.store is None or template.template_id in DEFAULT_TEMPLATE_IDS:
            return
        self._job(
            f"share {template.template_id}", functools.partial(self._share_template, template)
        )

    async def _share_template(self, template: Template, _stop: StopToken) -> None:
        assert self.store is not None
        templates = self._templates
        await trio.to_thread.run_sync(templates.mark_share_pending, template.template_id, True)
        if template.snapshot_id is not None:  # a built template: its snapshot first
            while True:
                try:
                    doc = await self.wait_durable(template.snapshot_id)
                except CorruptSnapshot:
                    doc = {"storage": "local"}  # deleted (a rebuild replaced it)
                if doc.get("storage") == "durable":
                    break
                if doc.get("storage") == "local":  # kept on this node only
                    await trio.to_thread.run_sync(
                        templates.mark_share_pending, template.template_id, False
                    )
                    return
                await trio.sleep(RETRY_MAX_S)
        delays = Backoff(base_s=RETRY_BASE_S, max_s=RETRY_MAX_S).delays()
        while True:
            try:
                if template.image_key is not None:
                    images = self._images.store
                    with contextlib.suppress(ImageNotPulled):
                        record = await trio.to_thread.run_sync(images.record, template.image_key)
                        body = json.dumps(record.to_json()).encode()
                        await self.store.put(image_record_key(record.key), body)
                body = json.dumps(template.to_json()).encode()
                await put_template(self.store, template.template_id, body, template.aliases)
                break
            except StoreError as exc:
                log.warning("sharing template %s failed, retrying: %s", template.template_id, exc)
                await trio.sleep(next(delays))
        try:  # deleted meanwhile: not in the store either
            await trio.to_thread.run_sync(templates.resolve, template.template_id)
        except TemplateNotFound:
            await self.unshare_template(template.template_id)
        else:
            await trio.to_thread.run_sync(templates.mark_share_pending, template.template_id, False)
            log.info("template %s is in the object store", template.template_id)

    async def unshare_template(self, template_id: str) -> None:
        """Remove a deleted template from the store (its image record stays: others may use it)."""
        if self.store is None:
            return
        try:
            await self.store.delete(template_key(template_id))
        except StoreError as exc:
            log.warning("template %s stays in the object store: %s", template_id, exc)

    async def find_template(self, name: str) -> Template | None:
        """A template another node put in the store under ID or alias `name`, made
        usable here (its image record and layer indexes fetched); None if absent."""
        if self.store is None:
            return None
        try:
            check_name(name, "template name")
        except InvalidName:
            return None
        try:
            found = await find_template(self.store, name)  # by ID, else by alias: a few reads
        except StoreError as exc:
            log.warning("cannot look up template %r in the object store: %s", name, exc)
            return None
        return None if found is None else await self._adopt_template(*found)

    async def fresh_template(self, template: Template) -> Template:
        """`template`, or the newer build of it another node shared since (a
        template rebuilt under the same ID elsewhere). One read of the store
        for a template that is not one of the node's default ones."""
        if self.store is None or template.template_id in DEFAULT_TEMPLATE_IDS:
            return template
        found = await self._template_record(template_key(template.template_id))
        if found is None:
            return template
        doc = found[1]
        if doc.get("buildID") in (None, template.build_id):
            return template
        if float(doc.get("updatedAt") or 0) <= template.updated_at:
            return template  # ours is the newer one (its share is on its way)
        log.info(
            "template %s was rebuilt on another node (build %s): taking it",
            template.template_id,
            doc.get("buildID"),
        )
        return await self._adopt_template(*found)

    async def _template_record(self, key: str) -> tuple[bytes, dict[str, Any]] | None:
        """A template record from the store, raw and parsed; None if absent or unreadable."""
        assert self.store is not None
        try:
            return await template_record(self.store, key)
        except StoreError as exc:
            log.warning("template record %s in the object store: %s", key, exc)
            return None

    async def _adopt_template(self, raw: bytes, doc: dict[str, Any]) -> Template:
        assert self.store is not None
        image = doc.get("image")
        if isinstance(image, dict) and isinstance(image.get("key"), str):
            images = self._images.store
            key = str(image["key"])
            try:
                await trio.to_thread.run_sync(images.record, key)
            except ImageNotPulled:
                try:
                    record = ImageRecord.from_json(
                        json.loads(await self.store.get(image_record_key(key)))
                    )
                    indexes = {
                        digest: await self.store.get(layer_key(digest)) for digest in record.layers
                    }
                except (StoreError, ValueError, KeyError, TypeError) as exc:
                    raise TemplateNotFound(
                        f"template {doc.get('templateID')!r} is in the object store but its "
                        f"image {key[:12]} is not usable: {exc}"
                    ) from None
                await trio.to_thread.run_sync(images.adopt, record, indexes)
        return await trio.to_thread.run_sync(self._templates.adopt, raw)

    # -- restores ------------------------------------------------------------------

    async def locate(self, name_or_id: str) -> dict[str, Any] | None:
        """A snapshot record from the store for a name or ID this node has no record of."""
        if self.store is None:
            return None
        by_id = name_or_id.startswith(SNAPSHOT_PREFIX)
        if not by_id:
            try:
                check_name(name_or_id, "snapshot name")
            except InvalidName:
                return None  # an image reference, say: never a stored name
            try:
                await trio.to_thread.run_sync(self._templates.resolve, name_or_id)
                return None  # a template of that name wins
            except (TemplateNotFound, InvalidName):
                pass
        t0 = trio.current_time()
        try:
            m = await fetch_manifest(self.store, name_or_id, by_id=by_id)
            if m is None and by_id:
                m = await fetch_manifest(self.store, name_or_id, by_id=False)
        except StoreUnavailable as exc:
            if by_id:
                raise CorruptSnapshot(f"snapshot {name_or_id} cannot be looked up: {exc}") from None
            log.warning("cannot look up %r in the object store: %s", name_or_id, exc)
            return None
        except SnapshotUnavailable as exc:
            raise CorruptSnapshot(str(exc)) from None
        if m is None:
            return None
        log.info(
            "found snapshot %s in the object store in %.3fs",
            m.snapshot_id,
            trio.current_time() - t0,
        )
        self._found[m.snapshot_id] = m
        return {
            **m.record,
            "snapshotID": m.snapshot_id,
            "image": None,
            "checksums": {f.name: f.sha256 for f in m.image or ()},
            "storage": "durable",
        }

    async def ensure_local(
        self, doc: dict[str, Any], template: Template, *, torn: bool = False
    ) -> dict[str, Any]:
        """`doc` if its layers and image are all on disk, else a restored copy of it
        (a new record, whose memory image was verified as it came from the store).

        With `torn` (its image on disk failed its checksums) a durable snapshot's
        image is fetched again: a restore does not flush the image it writes (a
        cache of the store, checked once per node process before it is used), so
        a crash may leave it torn."""
        snap_id = str(doc["snapshotID"])
        snapshots, layers = self._snapshots, self._layers
        gaps = await trio.to_thread.run_sync(snapshots.local_gaps, doc, layers.layers_dir)
        if torn:
            gaps.append("an intact memory image")
        if not gaps:
            return doc
        if self.store is None:
            raise CorruptSnapshot(f"snapshot {snap_id} lacks {', '.join(gaps)} on this node")
        lock = self._restoring.setdefault(snap_id, trio.Lock())
        async with lock:
            local = await self._meta.run(self._meta.store.get_snapshot, snap_id)
            if (
                not torn
                and local is not None
                and not await trio.to_thread.run_sync(
                    snapshots.local_gaps, local, layers.layers_dir
                )
            ):
                return local  # restored by a concurrent create
            try:
                m = self._found.pop(snap_id, None) or await fetch_manifest(
                    self.store, snap_id, by_id=True
                )
                if m is None:
                    raise CorruptSnapshot(
                        f"snapshot {snap_id} lacks {', '.join(gaps)} on this node and is not "
                        f"in the object store {self.store.where}"
                    )
                restored = await self._restore(m, template)
            except (SnapshotUnavailable, StoreError) as exc:
                raise CorruptSnapshot(f"snapshot {snap_id}: {exc}") from None
        self._restoring.pop(snap_id, None)
        return restored

    async def _restore(self, m: Manifest, template: Template) -> dict[str, Any]:
        assert self.store is not None
        layers, snapshots = self._layers, self._snapshots
        present = await trio.to_thread.run_sync(layers.ids)
        staged: list[tuple[Path, Any]] = []
        lazy: list[StoredLayer] = []
        image_dir: Path | None = None
        start = trio.current_time()
        took: dict[str, float] = {}  # seconds per phase, for the log
        store = self.store
        try:
            for sl in m.layers:
                if sl.id in present:
                    continue
                if self._config.lazy_restore:
                    lazy.append(sl)
                else:
                    staged.append((await trio.to_thread.run_sync(layers.new_staging), sl))
            sums: dict[str, str] = {}
            if m.image is not None:
                image_dir = snapshots.root / f".tmp-{m.snapshot_id}-{secrets.token_hex(4)}"
                await trio.to_thread.run_sync(image_dir.mkdir)

            async def image(into: Path) -> None:
                local = await self._local_images(m)
                t0 = trio.current_time()
                # not flushed: a crash that tears it is caught by the checksums
                # (`ensure_local(torn=True)` fetches it again)
                sums.update(
                    await download_image(
                        store,
                        m,
                        into,
                        sync=False,
                        local=local,
                        keep_hashes=into.parent / "hashes",
                        timings=took,
                    )
                )
                took["image"] = trio.current_time() - t0

            served: list[tuple[StoredLayer, bytes, LayerIndex, Path]] = []

            async def serve(sl: StoredLayer) -> None:
                t0 = trio.current_time()
                raw, index = await fetch_layer_index(store, m.snapshot_id, sl)
                served.append((sl, raw, index, await self._serve_lazy(sl.id, sl.index, raw, index)))
                took["layers"] = max(took.get("layers", 0.0), trio.current_time() - t0)

            # every missing layer (or its index, to serve it on demand) and the memory
            # image at once
            with one_error():
                async with trio.open_nursery() as nursery:
                    for staging, sl in staged:
                        nursery.start_soon(
                            materialise_layer, store, m.snapshot_id, sl, staging / "tree"
                        )
                    for sl in lazy:
                        nursery.start_soon(serve, sl)
                    if image_dir is not None:
                        nursery.start_soon(image, image_dir / "image")
            for staging, sl in staged:
                await layers.adopt(staging, sl.id, below=sl.below, base=[template.rootfs])
            staged.clear()
            for sl, raw, index, target in served:
                await layers.adopt_lazy(
                    sl.id,
                    below=sl.below,
                    base=[template.rootfs],
                    target=target,
                    index=raw,
                    size_bytes=index.content_bytes,
                )
                self._job(f"copy layer {sl.id}", functools.partial(self._materialise, sl.id))
            doc = await snapshots.adopt(
                doc={
                    **m.record,
                    "snapshotID": m.snapshot_id,
                    "checksums": sums,
                    "storage": "durable",
                },
                staged=image_dir,
            )
            image_dir = None
        except BaseException:
            with trio.CancelScope(shield=True):
                for staging, _sl in staged:
                    await trio.to_thread.run_sync(_remove, staging)
                if image_dir is not None:
                    await trio.to_thread.run_sync(_remove, image_dir)
            raise
        log.info(
            "restored snapshot %s from the object store in %.3fs (%s)",
            m.snapshot_id,
            trio.current_time() - start,
            " ".join(
                f"{k} {v:.0f}" if k.startswith("pages") else f"{k} {v:.3f}" for k, v in took.items()
            ),
        )
        return doc

    async def _local_images(self, m: Manifest) -> list[LocalImage]:
        """The memory images on this node a restore of `m` may take pages from:
        of snapshots of the same template with layers in common (an earlier
        snapshot of the same sandbox, or of its fork parent), most in common
        and newest first."""
        docs = await self._snapshots.of_template(str(m.record.get("templateID")))
        mine = {sl.id for sl in m.layers}
        ranked = sorted(
            (
                (len(mine.intersection(d.get("layers") or ())), float(d.get("createdAt") or 0), d)
                for d in docs
                if d.get("image") and d.get("snapshotID") != m.snapshot_id
            ),
            key=lambda t: (t[0], t[1]),
            reverse=True,
        )
        return [
            LocalImage(files=Path(d["image"]), hashes=Path(d["image"]).parent / "hashes")
            for common, _t, d in ranked[:LOCAL_IMAGE_SOURCES]
            if common > 0
        ]

    # -- layers served on demand ---------------------------------------------------------

    async def _serve_lazy(self, layer_id: str, digest: str, raw: bytes, index: LayerIndex) -> Path:
        """Show a stored layer's index raw on the image mount (once); its directory there."""
        images = self._images
        key = LAZY_KEY_PREFIX + layer_id
        lock = self._serving.setdefault(key, trio.Lock())
        async with lock:
            if key not in await images.mount.call(images.mount.fs.keys):
                try:
                    tree = await trio.to_thread.run_sync(
                        ImageTree.of_layer, dataclasses.replace(index, digest=digest)
                    )
                except TreeError as exc:
                    raise SnapshotUnavailable(
                        f"layer {layer_id}: its index cannot be served: {exc}"
                    ) from None
                await images.mount.call(images.mount.fs.add, key, tree)
        return images.path(key)

    async def serve_lazy_layers(self) -> None:
        """At start: serve again the layers an earlier process restored on demand and
        had not copied to disk yet (before any sandbox mounts them), and copy them."""
        layers = self._layers
        for layer_id in sorted(await trio.to_thread.run_sync(layers.lazy_ids)):
            raw = await trio.to_thread.run_sync(layers.stored_index, layer_id)
            try:
                if raw is None:
                    raise SnapshotUnavailable("its index is missing")
                index = await trio.to_thread.run_sync(load_index, raw)
                await self._serve_lazy(layer_id, content_digest(raw), raw, index)
            except (BadIndex, SnapshotUnavailable) as exc:
                log.error("layer %s cannot be served: %s", layer_id, exc)
                continue
            if self.store is not None:
                self._job(f"copy layer {layer_id}", functools.partial(self._materialise, layer_id))

    async def _materialise(self, layer_id: str, _stop: StopToken) -> None:
        """Copy a layer served on demand to local disk, retrying while the store fails;
        then its open-from-now-on files are read from disk, not through the store."""
        assert self.store is not None
        layers, images = self._layers, self._images
        await trio.sleep(self._config.lazy_materialise_after_s)
        delays = Backoff(base_s=RETRY_BASE_S, max_s=RETRY_MAX_S).delays()
        while True:
            try:
                layer = await trio.to_thread.run_sync(layers.get, layer_id)
                raw = await trio.to_thread.run_sync(layers.stored_index, layer_id)
                if raw is None:
                    return
                # the index kept when the layer was restored (verified then): no new fetch
                index = await trio.to_thread.run_sync(load_index, raw)
                sl = StoredLayer(id=layer_id, below=layer.below, index=content_digest(raw))
                staging = await trio.to_thread.run_sync(layers.new_staging)
                try:
                    await materialise_layer(
                        self.store, f"(layer {layer_id})", sl, staging / "tree", index=index
                    )
                except BaseException:
                    with trio.CancelScope(shield=True):
                        await trio.to_thread.run_sync(_remove, staging)
                    raise
                layer = await layers.materialise(layer_id, staging)
                await images.mount.call(
                    images.mount.fs.serve_local, LAZY_KEY_PREFIX + layer_id, layer.path
                )
                log.info("layer %s is on disk", layer_id)
                return
            except LayerError as exc:
                log.info("layer %s is not copied to disk: %s", layer_id, exc)
                return  # deleted, or copied by another task
            except BadIndex as exc:
                log.error("layer %s cannot be copied to disk: %s", layer_id, exc)
                return
            except (StoreError, SnapshotUnavailable, OSError) as exc:
                delay = next(delays)
                log.warning("copying layer %s failed, retrying in %.1fs: %s", layer_id, delay, exc)
                await trio.sleep(delay)

    # -- deletion and garbage collection --------------------------------------------------

    async def delete_remote(self, doc: dict[str, Any]) -> None:
        """Delete a snapshot only the object store holds (a `locate` result)."""
        self._found.pop(str(doc["snapshotID"]), None)
        await self._deleted({**doc, "storage": "durable"})

    async def _deleted(self, doc: dict[str, Any]) -> None:
        snap_id = str(doc["snapshotID"])
        upload = self._uploads.pop(snap_id, None)
        if upload is not None:
            await upload.stop("its snapshot was deleted", grace_s=0.0)
        if self.store is None or doc.get("storage", "local") == "local":
            return
        try:
            await delete_snapshot(self.store, snap_id, doc.get("name"))
        except StoreError as exc:
            log.error("snapshot %s stays in the object store: %s", snap_id, exc)
            return
        self.start_collect()

    def start_collect(self) -> None:
        """Run `collect` as a job of the services (one more pass if one runs now)."""
        if self._services.get("store gc") is not None:
            self._gc_again = True
            return

        async def gc(_stop: StopToken) -> None:
            await self.collect()

        self._services.start_soon(
            "store gc", gc, policy=JOB_RESTARTS, give_up=Strategy.FAIL, grace_s=0.0
        )

    async def collect(self) -> GcReport | None:
        """One mark-and-sweep of the store (coalesced: one more run if asked meanwhile)."""
        if self.store is None:
            return None
        if self._gc_lock.locked():
            self._gc_again = True
            return None
        report: GcReport | None = None
        async with self._gc_lock:
            while True:
                self._gc_again = False
                try:
                    report = await collect_garbage(self.store, grace_s=self.grace_s)
                    log.info(
                        "store gc: %d manifests, %d blobs, %d deleted (%d bytes), %d young kept",
                        report.manifests,
                        report.blobs,
                        report.deleted,
                        report.bytes_deleted,
                        report.kept_young,
                    )
                except (StoreError, SnapshotUnavailable) as exc:
                    log.error("store garbage collection failed: %s", exc)
                if not self._gc_again:
                    return report


IMAGE_BASES = 2  # earlier snapshots whose memory pages an upload may reuse


def image_bases(doc: dict[str, Any], others: list[dict[str, Any]]) -> list[str]:
    """The durable snapshots of this node closest to `doc`, whose stored memory
    pages its upload may reference instead of storing again: same template, most
    layers in common (a later snapshot of the same sandbox, or of one restored
    or forked from it, shares its lower layers), then newest."""
    mine = set(doc.get("layers") or ())
    snap_id = doc.get("snapshotID")
    ranked = sorted(
        (
            (len(mine.intersection(o.get("layers") or ())), float(o.get("createdAt") or 0), o)
            for o in others
            if o.get("snapshotID") != snap_id
            and o.get("storage") == "durable"
            and o.get("memory")
            and o.get("templateID") == doc.get("templateID")
        ),
        key=lambda t: (t[0], t[1]),
        reverse=True,
    )
    return [str(o["snapshotID"]) for _n, _t, o in ranked[:IMAGE_BASES]]


def _remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.chmod(0o700)
    shutil.rmtree(path, ignore_errors=True)
