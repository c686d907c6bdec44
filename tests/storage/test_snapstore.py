"""Snapshots in the object store (aenv.storage.snapstore) against real backends.

Rules: real parts only - frozen layers are real directories with what
overlayfs uppers hold (whiteouts as 0/0 character devices, the opaque
xattr, hard links, symlinks, owners, modes, times, xattrs; needs root), the
store is a local directory or moto's S3 server on loopback (tests/s3.py),
faults are injected by stopping that server or overwriting stored objects
behind the store's back. A layer must come back exactly as it was frozen;
a snapshot must be listed in the store only once whole; garbage collection
must never remove a blob a manifest references.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
import stat
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio

from aenv.storage.objstore import (
    MiB,
    ObjectStore,
    RetryPolicy,
    StoreUnavailable,
    blob_key,
    open_object_store,
)
from aenv.storage.snapstore import (
    LocalImage,
    LocalLayer,
    SnapshotUnavailable,
    UploadReport,
    collect_garbage,
    delete_snapshot,
    download_image,
    dump_manifest,
    fetch_manifest,
    manifest_key,
    materialise_layer,
    pending_key,
    upload_snapshot,
)

# Fixtures are imported by name, so test parameters shadow them (F811).
# ruff: noqa: F811
from tests.s3 import MotoS3, s3_faulty, s3_server, s3_store  # noqa: F401

FAST = RetryPolicy(attempts=2, base_delay=0.01, max_delay=0.05, transport_retries=0)

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="whiteouts and trusted xattrs need root")


@dataclass
class Backend:
    store: ObjectStore
    tamper: Callable[[str, bytes], None]
    list_keys: Callable[[], list[str]]


@pytest.fixture(params=["local", "s3"])
async def backend(
    request: pytest.FixtureRequest, tmp_path: Path, s3_server: MotoS3
) -> AsyncIterator[Backend]:
    if request.param == "local":
        root = tmp_path / "store"
        store = open_object_store(root.as_uri(), retry=FAST)

        def tamper_local(key: str, data: bytes) -> None:
            (root / key).write_bytes(data)

        def keys_local() -> list[str]:
            return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())

        yield Backend(store, tamper_local, keys_local)
    else:
        store = s3_store(s3_server, retry=FAST)
        prefix = store.where.split(" ")[0].split("/", 3)[3]
        client = s3_server.boto()

        def tamper_s3(key: str, data: bytes) -> None:
            client.put_object(Bucket=s3_server.bucket, Key=f"{prefix}/{key}", Body=data)

        def keys_s3() -> list[str]:
            got = client.list_objects_v2(Bucket=s3_server.bucket, Prefix=prefix + "/")
            return sorted(o["Key"][len(prefix) + 1 :] for o in got.get("Contents", []))

        yield Backend(store, tamper_s3, keys_s3)


# -- a frozen layer with everything an overlay upper can hold ------------------------


def make_layer(root: Path, *, big: bytes = b"") -> Path:
    tree = root / "tree"
    tree.mkdir(parents=True)
    (tree / "etc").mkdir(mode=0o755)
    (tree / "etc" / "hosts").write_text("127.0.0.1 here\n")
    os.chmod(tree / "etc" / "hosts", 0o640)
    os.chown(tree / "etc" / "hosts", 1000, 1001)
    (tree / "big.bin").write_bytes(big or os.urandom(2 * MiB + 12345))
    os.link(tree / "big.bin", tree / "etc" / "big-link")
    (tree / "empty").write_bytes(b"")
    os.symlink("etc/hosts", tree / "hosts-link")
    os.mknod(tree / "gone", stat.S_IFCHR | 0o000, os.makedev(0, 0))  # a whiteout
    (tree / "opaque").mkdir(mode=0o700)
    os.setxattr(tree / "opaque", "trusted.overlay.opaque", b"y")
    (tree / "opaque" / "only").write_text("only me\n")
    os.setxattr(tree / "etc" / "hosts", "user.note", b"\x00binary\xff")
    os.mkfifo(tree / "fifo", 0o620)
    (tree / "setuid").write_bytes(b"#!/bin/sh\n")
    os.chmod(tree / "setuid", 0o4755)
    os.utime(tree / "etc", ns=(1, 1_600_000_000_123_456_789))
    return tree


def describe(tree: Path) -> dict[str, Any]:
    """Everything that must survive a round trip, by relative path."""
    out: dict[str, Any] = {}
    inodes: dict[int, str] = {}
    for dirpath, dirs, files in os.walk(tree):
        for name in sorted([*dirs, *files]) + ([""] if dirpath == str(tree) else []):
            p = os.path.join(dirpath, name) if name else dirpath
            rel = os.path.relpath(p, tree)
            st = os.lstat(p)
            xattrs = {
                n: os.getxattr(p, n, follow_symlinks=False)
                for n in os.listxattr(p, follow_symlinks=False)
            }
            info: dict[str, Any] = {
                "mode": st.st_mode,
                "uid": st.st_uid,
                "gid": st.st_gid,
                "rdev": st.st_rdev,
                "xattrs": xattrs,
            }
            whiteout = stat.S_ISCHR(st.st_mode) and st.st_rdev == 0
            if not stat.S_ISLNK(st.st_mode) and not whiteout:  # (what overlayfs ignores)
                info["mtime"] = st.st_mtime_ns
            if stat.S_ISREG(st.st_mode):
                info["data"] = Path(p).read_bytes()
                if st.st_nlink > 1:
                    info["linked_to"] = inodes.setdefault(st.st_ino, rel)
            if stat.S_ISLNK(st.st_mode):
                info["target"] = os.readlink(p)
            out[rel] = info
    return out


def image_dir(root: Path, size: int) -> tuple[Path, dict[str, str]]:
    import hashlib

    d = root / "image"
    d.mkdir(parents=True)
    (d / "checkpoint.img").write_bytes(os.urandom(size))
    (d / "meta").write_text("{}")
    sums = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in d.iterdir()}
    return d, sums


RECORD = {"name": "demo", "names": ["demo"], "templateID": "base", "memory": True, "createdAt": 1.0}


async def _upload_files(
    store: ObjectStore,
    snapshot_id: str,
    *layers: LocalLayer,
    record: dict[str, Any] = RECORD,
    refresh_after_s: float | None = None,
) -> UploadReport:
    """Upload a snapshot of file layers only (`layers` topmost first), no memory image."""
    return await upload_snapshot(
        store,
        snapshot_id=snapshot_id,
        record=record,
        layers=layers,
        image=None,
        checksums={},
        refresh_after_s=refresh_after_s,
    )


# -- tests ----------------------------------------------------------------------------


@needs_root
async def test_a_layer_and_image_come_back_exactly(backend: Backend, tmp_path: Path) -> None:
    tree = make_layer(tmp_path / "l1")
    image, sums = image_dir(tmp_path / "s", 3 * MiB + 7)
    before = describe(tree)
    report = await upload_snapshot(
        backend.store,
        snapshot_id="snap-a",
        record=RECORD,
        layers=[LocalLayer(id="l1", below=(), tree=tree)],
        image=image,
        checksums=sums,
    )
    assert report.uploaded == report.blobs  # a fresh store: everything went up
    m = await fetch_manifest(backend.store, "demo", by_id=False)
    assert m is not None and m.snapshot_id == "snap-a" and m.record["templateID"] == "base"
    out = tmp_path / "restored"
    await materialise_layer(backend.store, "snap-a", m.layers[0], out)
    assert describe(out) == before
    got = await download_image(backend.store, m, tmp_path / "image-back")
    assert got == sums
    assert (tmp_path / "image-back" / "checkpoint.img").read_bytes() == (
        image / "checkpoint.img"
    ).read_bytes()
    assert not [k for k in backend.list_keys() if k.startswith("pending/")]


@needs_root
async def test_shared_content_is_uploaded_once(backend: Backend, tmp_path: Path) -> None:
    base = make_layer(tmp_path / "l1")
    upper = tmp_path / "l2" / "tree"
    upper.mkdir(parents=True)
    (upper / "new.bin").write_bytes(os.urandom(MiB))
    (upper / "copy.bin").write_bytes((base / "big.bin").read_bytes())  # same content
    first = await _upload_files(backend.store, "snap-1", LocalLayer(id="l1", below=(), tree=base))
    second = await _upload_files(
        backend.store,
        "snap-2",
        LocalLayer(id="l2", below=("l1",), tree=upper),
        LocalLayer(id="l1", below=(), tree=base),
        record={**RECORD, "createdAt": 2.0},
    )
    print(f"first {first.bytes_uploaded} B, second {second.bytes_uploaded} B")
    assert first.layer_bytes > 2 * MiB
    # only the new MiB and the new layer index: the copy and the lower layer were there
    assert MiB <= second.bytes_uploaded < MiB + 64 * 1024
    m = await fetch_manifest(backend.store, "demo", by_id=False)
    assert m is not None and m.snapshot_id == "snap-2"  # the name points at the newest


async def test_a_snapshot_is_listed_only_once_complete(s3_faulty: MotoS3, tmp_path: Path) -> None:
    store = s3_store(s3_faulty, retry=FAST)
    image, sums = image_dir(tmp_path, 6 * MiB)
    s3_faulty.kill_after(10)  # dies after the pending manifest, the HEADs, two chunks
    with pytest.raises(StoreUnavailable):
        await upload_snapshot(
            store, snapshot_id="snap-k", record=RECORD, layers=[], image=image, checksums=sums
        )
    s3_faulty.start()
    assert await fetch_manifest(store, "snap-k", by_id=True) is None
    assert await store.exists(pending_key("snap-k"))  # the upload's intent protects its blobs
    report = await upload_snapshot(
        store, snapshot_id="snap-k", record=RECORD, layers=[], image=image, checksums=sums
    )
    assert 0 < report.uploaded < report.blobs  # resumed: what was there stays
    assert await store.exists(manifest_key("snap-k"))
    assert not await store.exists(pending_key("snap-k"))


async def test_a_corrupt_or_missing_blob_fails_naming_it(backend: Backend, tmp_path: Path) -> None:
    tree = tmp_path / "l1" / "tree"
    tree.mkdir(parents=True)
    (tree / "data").write_bytes(os.urandom(MiB + 5))
    await _upload_files(backend.store, "snap-c", LocalLayer(id="l1", below=(), tree=tree))
    m = await fetch_manifest(backend.store, "snap-c", by_id=True)
    assert m is not None
    chunk = next(d for d in m.blobs if d != m.layers[0].index)
    backend.tamper(blob_key(chunk), b"not what was stored")
    with pytest.raises(SnapshotUnavailable, match=rf"snap-c.*{blob_key(chunk)}.*corrupt"):
        await materialise_layer(backend.store, "snap-c", m.layers[0], tmp_path / "out")
    await backend.store.delete(blob_key(chunk))
    with pytest.raises(SnapshotUnavailable, match=rf"snap-c.*{blob_key(chunk)}.*missing"):
        await materialise_layer(backend.store, "snap-c", m.layers[0], tmp_path / "out2")
    backend.tamper(manifest_key("snap-c"), b"{not json")
    with pytest.raises(SnapshotUnavailable, match="malformed"):
        await fetch_manifest(backend.store, "snap-c", by_id=True)


async def test_gc_keeps_what_is_referenced_and_young(backend: Backend, tmp_path: Path) -> None:
    shared = tmp_path / "shared" / "tree"
    shared.mkdir(parents=True)
    (shared / "s").write_bytes(os.urandom(MiB))
    own = tmp_path / "own" / "tree"
    own.mkdir(parents=True)
    (own / "o").write_bytes(os.urandom(MiB))
    lshared = LocalLayer(id="ls", below=(), tree=shared)
    for sid, layers in (
        ("snap-x", [lshared]),
        ("snap-y", [LocalLayer(id="lo", below=("ls",), tree=own), lshared]),
    ):
        await _upload_files(backend.store, sid, *layers)
    y = await fetch_manifest(backend.store, "snap-y", by_id=True)
    x = await fetch_manifest(backend.store, "snap-x", by_id=True)
    assert x is not None and y is not None

    # nothing unreferenced: nothing goes, even with no grace
    assert (await collect_garbage(backend.store, grace_s=0)).deleted == 0
    await delete_snapshot(backend.store, "snap-y", "demo")
    # within the grace period, the unreferenced blobs stay
    young = await collect_garbage(backend.store, grace_s=3600)
    assert young.deleted == 0 and young.kept_young == len(set(y.blobs) - set(x.blobs))
    report = await collect_garbage(backend.store, grace_s=0)
    assert report.deleted == len(set(y.blobs) - set(x.blobs))
    for d in x.blobs:  # every blob of the remaining snapshot is still there, and whole
        await backend.store.get_blob(d)
    await materialise_layer(backend.store, "snap-x", x.layers[0], tmp_path / "back")
    assert (tmp_path / "back" / "s").read_bytes() == (shared / "s").read_bytes()

    # a pending upload's blobs are kept too (an upload in flight)
    await delete_snapshot(backend.store, "snap-x", None)
    await backend.store.put(pending_key("snap-x"), dump_manifest(x))
    assert (await collect_garbage(backend.store, grace_s=0)).deleted == 0
    # ...unless it was abandoned long ago
    later = dt.datetime.now(dt.UTC) + dt.timedelta(days=30)
    gone = await collect_garbage(backend.store, grace_s=0, now=later)
    assert gone.deleted == len(x.blobs)
    await backend.store.delete(pending_key("snap-x"))
    assert not [k for k in backend.list_keys() if k.startswith("blobs/")]


async def test_two_collectors_at_once(backend: Backend, tmp_path: Path) -> None:
    tree = tmp_path / "t" / "tree"
    tree.mkdir(parents=True)
    for i in range(6):
        (tree / f"f{i}").write_bytes(os.urandom(300_000))
    keep = tmp_path / "k" / "tree"
    keep.mkdir(parents=True)
    (keep / "k").write_bytes(os.urandom(200_000))
    for sid, t in (("snap-1", tree), ("snap-2", keep)):
        await _upload_files(
            backend.store, sid, LocalLayer(id=sid, below=(), tree=t), record={"createdAt": 1.0}
        )
    await delete_snapshot(backend.store, "snap-1", None)
    async with trio.open_nursery() as n:
        for _ in range(2):
            n.start_soon(lambda: collect_garbage(backend.store, grace_s=0))
    left = [k for k in backend.list_keys() if k.startswith("blobs/")]
    m = await fetch_manifest(backend.store, "snap-2", by_id=True)
    assert m is not None
    assert sorted(left) == sorted(blob_key(d) for d in m.blobs)


async def test_deleting_a_names_newest_points_the_name_at_the_one_before(
    backend: Backend, tmp_path: Path
) -> None:
    upper = tmp_path / "l1" / "tree"
    upper.mkdir(parents=True)
    (upper / "f").write_text("f")
    for i, sid in enumerate(("snap-old", "snap-mid", "snap-new"), start=1):
        await _upload_files(
            backend.store,
            sid,
            LocalLayer(id="l1", below=(), tree=upper),
            record={**RECORD, "createdAt": float(i)},
        )
    await _upload_files(  # another name: never what "demo" resolves to
        backend.store,
        "snap-other",
        LocalLayer(id="l1", below=(), tree=upper),
        record={**RECORD, "name": "other", "names": ["other"], "createdAt": 9.0},
    )

    async def demo() -> str | None:
        m = await fetch_manifest(backend.store, "demo", by_id=False)
        return None if m is None else m.snapshot_id

    assert await demo() == "snap-new"
    await delete_snapshot(backend.store, "snap-mid", "demo")  # not the newest: no change
    assert await demo() == "snap-new"
    await delete_snapshot(backend.store, "snap-new", "demo")
    assert await demo() == "snap-old"
    await delete_snapshot(backend.store, "snap-old", "demo")
    assert await demo() is None
    assert "names/demo" not in backend.list_keys()
    assert await fetch_manifest(backend.store, "other", by_id=False) is not None


# -- memory images as pages ------------------------------------------------------------


def _sums(d: Path) -> dict[str, str]:
    import hashlib

    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in d.iterdir()}


def _guest_image(root: Path, pages: list[bytes], state: bytes) -> Path:
    root.mkdir(parents=True)
    (root / "pages.img").write_bytes(b"".join(pages))
    (root / "checkpoint.img").write_bytes(state)
    return root


async def _upload_image(
    backend: Backend, sid: str, image: Path, bases: tuple[str, ...] = ()
) -> Any:
    return await upload_snapshot(
        backend.store,
        snapshot_id=sid,
        record={**RECORD, "name": None, "names": []},
        layers=[],
        image=image,
        checksums=_sums(image),
        image_bases=bases,
    )


async def test_a_later_image_stores_only_the_pages_that_changed(
    backend: Backend, tmp_path: Path
) -> None:
    pages = [os.urandom(4096) for _ in range(2048)]  # 8 MiB of guest memory
    state = b"kernel state " * 5000
    first = await _upload_image(backend, "snap-1", _guest_image(tmp_path / "i1", pages, state))
    assert first.reused_pages == 0 and first.image_bytes > 8 * MiB
    # 64 pages rewritten, one inserted (moving the rest), the state file grown
    pages[100:164] = [os.urandom(4096) for _ in range(64)]
    pages.insert(1000, os.urandom(4096))
    image = _guest_image(tmp_path / "i2", pages, state + b"more")
    second = await _upload_image(backend, "snap-2", image, ("snap-1", "snap-gone"))
    print(f"first {first.image_bytes} B, second {second.image_bytes} B")
    assert second.reused_pages >= 2048 - 64
    assert second.image_bytes < 65 * 4096 + 64 * 1024  # the new pages, the state, the maps
    m = await fetch_manifest(backend.store, "snap-2", by_id=True)
    assert m is not None
    got = await download_image(backend.store, m, tmp_path / "back")
    assert got == _sums(image)
    assert (tmp_path / "back" / "pages.img").read_bytes() == b"".join(pages)
    # the first snapshot deleted and collected: the second keeps every page it uses
    await delete_snapshot(backend.store, "snap-1", None)
    await collect_garbage(backend.store, grace_s=0)
    got = await download_image(backend.store, m, tmp_path / "back2", sync=False)
    assert got == _sums(image) == _sums(tmp_path / "back2")


async def test_a_base_whose_packs_are_gone_is_stored_afresh(
    backend: Backend, tmp_path: Path
) -> None:
    pages = [os.urandom(4096) for _ in range(512)]
    await _upload_image(backend, "snap-1", _guest_image(tmp_path / "i1", pages, b"s"))
    await delete_snapshot(backend.store, "snap-1", None)
    await collect_garbage(backend.store, grace_s=0)
    # this process still remembers snap-1's map, whose packs the collector removed
    image = _guest_image(tmp_path / "i2", pages, b"s")
    report = await _upload_image(backend, "snap-2", image, ("snap-1",))
    assert report.reused_pages == 0 and report.image_bytes > 2 * MiB
    m = await fetch_manifest(backend.store, "snap-2", by_id=True)
    assert m is not None
    assert await download_image(backend.store, m, tmp_path / "back") == _sums(image)


async def test_a_corrupt_pack_or_map_fails_naming_it(backend: Backend, tmp_path: Path) -> None:
    from aenv.storage.memimage import unpack_map

    image = _guest_image(tmp_path / "i", [os.urandom(4096) for _ in range(300)], b"s")
    await _upload_image(backend, "snap-p", image)
    m = await fetch_manifest(backend.store, "snap-p", by_id=True)
    assert m is not None and m.image is not None
    f = next(f for f in m.image if f.name == "pages.img")
    assert f.pagemap is not None
    pack = unpack_map(await backend.store.get_blob(f.pagemap)).packs[1].digest
    backend.tamper(blob_key(pack), b"not a pack")
    with pytest.raises(SnapshotUnavailable, match=rf"snap-p.*{blob_key(pack)}.*corrupt"):
        await download_image(backend.store, m, tmp_path / "b1")
    await backend.store.delete(blob_key(pack))
    with pytest.raises(SnapshotUnavailable, match=rf"snap-p.*{blob_key(pack)}.*missing"):
        await download_image(backend.store, m, tmp_path / "b2")
    backend.tamper(blob_key(f.pagemap), b"garbage")
    with pytest.raises(SnapshotUnavailable, match=rf"snap-p.*{blob_key(f.pagemap)}.*corrupt"):
        await download_image(backend.store, m, tmp_path / "b3")


async def test_a_page_that_does_not_match_its_map_fails_naming_its_pack(
    backend: Backend, tmp_path: Path
) -> None:
    """Pages are checked against the map's hashes as they are written (the file is
    not read back): a map whose hash of one page lies (a well-formed blob of its
    own, so its digest checks out) fails the download, naming the pack."""
    from aenv.proto.pagemap import HASH_BYTES, PageMap
    from aenv.storage.memimage import pack_map, unpack_map

    image = _guest_image(tmp_path / "i", [os.urandom(4096) for _ in range(300)], b"s")
    await _upload_image(backend, "snap-h", image)
    m = await fetch_manifest(backend.store, "snap-h", by_id=True)
    assert m is not None and m.image is not None
    f = next(f for f in m.image if f.name == "pages.img")
    assert f.pagemap is not None
    pmap = unpack_map(await backend.store.get_blob(f.pagemap))
    at = 270 * HASH_BYTES  # a page of the second pack
    hashes = pmap.hashes[:at] + bytes(HASH_BYTES) + pmap.hashes[at + HASH_BYTES :]
    lying = PageMap(size=pmap.size, packs=pmap.packs, hashes=hashes, refs=pmap.refs)
    digest = await backend.store.put_blob(pack_map(lying))
    files = tuple(dataclasses.replace(x, pagemap=digest) if x is f else x for x in m.image)
    bad = dataclasses.replace(m, image=files)
    pack = blob_key(pmap.packs[pmap.ref(270)[0]].digest)
    with pytest.raises(SnapshotUnavailable, match=rf"snap-h.*{pack}.*page 270 does not match"):
        await download_image(backend.store, bad, tmp_path / "back")
    # the honest map still restores the same bytes
    assert await download_image(backend.store, m, tmp_path / "ok") == _sums(tmp_path / "ok")


async def test_pages_a_local_image_holds_are_copied_not_fetched(
    backend: Backend, tmp_path: Path
) -> None:
    """A node holding an earlier image of a sandbox fetches only the packs of the
    pages that changed; a local copy that lies (torn) costs fetches, never bytes."""
    pages = [os.urandom(4096) for _ in range(1024)]
    i1 = _guest_image(tmp_path / "i1", pages, b"kernel state")
    await _upload_image(backend, "snap-1", i1)
    m1 = await fetch_manifest(backend.store, "snap-1", by_id=True)
    assert m1 is not None
    (tmp_path / "r1").mkdir()
    await download_image(
        backend.store, m1, tmp_path / "r1" / "image", keep_hashes=tmp_path / "r1" / "hashes"
    )
    assert (tmp_path / "r1" / "hashes" / "pages.img").stat().st_size == 1024 * 16
    pages[500:510] = [os.urandom(4096) for _ in range(10)]
    i2 = _guest_image(tmp_path / "i2", pages, b"kernel state 2")
    await _upload_image(backend, "snap-2", i2, ("snap-1",))
    m2 = await fetch_manifest(backend.store, "snap-2", by_id=True)
    assert m2 is not None

    async def restore(into: str, local: list[LocalImage]) -> tuple[dict[str, float], int]:
        t: dict[str, float] = {}
        before = backend.store.statistics().requests
        got = await download_image(backend.store, m2, tmp_path / into, local=local, timings=t)
        assert got == _sums(i2) == _sums(tmp_path / into)
        return t, backend.store.statistics().requests - before

    cold, cold_gets = await restore("cold", [])
    assert cold["pages_local"] == 0 and cold["pages_fetched"] == 1024 + 1
    # the image restored earlier, with the hashes kept beside it
    near = LocalImage(files=tmp_path / "r1" / "image", hashes=tmp_path / "r1" / "hashes")
    warm, warm_gets = await restore("near", [near])
    assert warm["pages_fetched"] == 10 + 1  # the changed pages, the new state file
    assert warm_gets <= cold_gets - 3  # 2 of the 4 packs of guest memory stay in the store
    # an image without kept hashes (taken on this node): hashed, the same
    assert (await restore("bare", [LocalImage(files=i1)]))[0]["pages_fetched"] == 11
    # an image deleted meanwhile is no source, and no failure
    assert (await restore("gone", [LocalImage(files=tmp_path / "gone-image")]))[0][
        "pages_local"
    ] == 0
    # a torn local copy: its bad pages are fetched instead
    with (tmp_path / "r1" / "image" / "pages.img").open("r+b") as f:
        f.seek(100 * 4096)
        f.write(bytes(3 * 4096))
    torn, _ = await restore("torn", [near])
    assert torn["pages_fetched"] == 11 + 3


async def test_a_version_1_manifest_with_chunked_images_still_restores(
    backend: Backend, tmp_path: Path
) -> None:
    import hashlib
    import json

    data = os.urandom(2 * MiB + 10)
    chunks = [await backend.store.put_blob(data[i : i + MiB]) for i in range(0, len(data), MiB)]
    doc = {
        "version": 1,
        "snapshotID": "snap-v1",
        "record": RECORD,
        "layers": [],
        "image": [
            {
                "name": "checkpoint.img",
                "size": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
                "chunks": chunks,
            }
        ],
        "blobs": sorted(chunks),
    }
    await backend.store.put(manifest_key("snap-v1"), json.dumps(doc).encode())
    m = await fetch_manifest(backend.store, "snap-v1", by_id=True)
    assert m is not None
    await download_image(backend.store, m, tmp_path / "back")
    assert (tmp_path / "back" / "checkpoint.img").read_bytes() == data


class _UploadOnFirstDeleteCheck:
    """The collector's view of the store: just before its first delete (the HEAD of a
    candidate), an upload that reuses the candidate runs to completion."""

    def __init__(self, store: ObjectStore, upload: Callable[[], Any]) -> None:
        self._store = store
        self._upload: Callable[[], Any] | None = upload

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def head(self, key: str) -> Any:
        if key.startswith("blobs/") and self._upload is not None:
            upload, self._upload = self._upload, None
            await upload()
        return await self._store.head(key)


async def test_an_upload_reusing_garbage_while_it_is_collected_keeps_it(
    backend: Backend, tmp_path: Path
) -> None:
    tree = tmp_path / "l1" / "tree"
    tree.mkdir(parents=True)
    (tree / "data").write_bytes(os.urandom(MiB + 5))
    layer = LocalLayer(id="l1", below=(), tree=tree)
    await _upload_files(backend.store, "snap-1", layer)
    await delete_snapshot(backend.store, "snap-1", "demo")  # its blobs are garbage now
    await trio.sleep(2.2)  # ... and older than the collector's grace

    reports = []

    async def upload() -> None:
        reports.append(await _upload_files(backend.store, "snap-2", layer, refresh_after_s=1.0))

    collector = _UploadOnFirstDeleteCheck(backend.store, upload)
    gc = await collect_garbage(collector, grace_s=2.0)  # type: ignore[arg-type]
    assert reports and reports[0].rewritten >= 2 and reports[0].bytes_uploaded == 0
    assert gc.deleted == 0, gc
    m = await fetch_manifest(backend.store, "snap-2", by_id=True)
    assert m is not None
    await materialise_layer(backend.store, "snap-2", m.layers[0], tmp_path / "back")
    assert (tmp_path / "back" / "data").read_bytes() == (tree / "data").read_bytes()
