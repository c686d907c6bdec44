"""Layer conversion: real layer tars (gzip, zstd, plain) in, index and chunks out.

Layers are written with Python's tarfile, compressed, and fed to
`LayerConverter` in random-sized pieces; the index must describe every member
and the chunks must reassemble every file byte for byte (and sit at their
recorded offsets in the uncompressed stream). Corrupt, truncated and
mislabelled blobs must fail with `ConversionError`; `ChunkCutter` must
recover exactly the chunks asked for. Finally converted layers merged by
`ImageTree` are compared with what `umoci` unpacks from the same OCI image.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import random
import shutil
import stat
import subprocess
import tarfile
import tracemalloc
from pathlib import Path

import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from aenv.images.convert import ChunkCutter, ConversionError, LayerConverter, normalise_path
from aenv.proto.imagetree import ImageTree
from aenv.proto.layerindex import CHUNK_SIZE, Chunk, Entry, Kind, LayerIndex, dumps, loads

GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"
TAR = "application/vnd.oci.image.layer.v1.tar"

Member = tuple[tarfile.TarInfo, bytes]


def ti(name: str, type_: bytes = tarfile.REGTYPE, data: bytes = b"", **kw: object) -> Member:
    info = tarfile.TarInfo(name)
    info.type = type_
    info.size = len(data) if type_ == tarfile.REGTYPE else 0
    info.mode = 0o755 if type_ == tarfile.DIRTYPE else 0o644
    info.mtime = 1_700_000_000
    for k, v in kw.items():
        setattr(info, k, v)
    return info, data


def tar(members: list[Member], fmt: int = tarfile.PAX_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for info, data in members:
            tf.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return buf.getvalue()


def compress(raw: bytes, media_type: str) -> bytes:
    if media_type == GZIP:
        return gzip.compress(raw, compresslevel=1, mtime=0)
    if media_type == ZSTD:
        return zstandard.ZstdCompressor(level=1).compress(raw)
    return raw


def sha(data: bytes) -> str:
    return f"sha256:{hashlib.sha256(data).hexdigest()}"


class Store(dict[str, bytes]):
    def put(self, digest: str, data: bytes) -> None:
        assert sha(data) == digest and 0 < len(data) <= CHUNK_SIZE
        self[digest] = data


def convert(
    blob: bytes,
    media_type: str = GZIP,
    *,
    store: Store | None = None,
    digest: str | None = None,
    size: int | None = None,
    rng: random.Random | None = None,
) -> LayerIndex:
    store = Store() if store is None else store
    conv = LayerConverter(
        digest=digest or sha(blob), media_type=media_type, put_chunk=store.put, size=size
    )
    rng = rng or random.Random(len(blob))
    pos = 0
    while pos < len(blob):
        n = rng.choice([1, 7, 512, 4096, 65536, 1 << 20])
        conv.feed(blob[pos : pos + n])
        pos += n
    return conv.finish()


def content(entry: Entry, store: Store) -> bytes:
    return b"".join(store[c.digest] for c in entry.chunks)


BIG = random.Random(1).randbytes(2 * CHUNK_SIZE + 12345)  # three chunks


def rich_layer() -> list[Member]:
    pax = {
        "SCHILY.xattr.user.comment": "hello",
        "SCHILY.xattr.security.capability": "\udc81\udc80\udcff",  # binary
    }
    return [
        ti("./", tarfile.DIRTYPE, mode=0o700),
        ti("./usr/", tarfile.DIRTYPE),
        ti("./usr/bin/", tarfile.DIRTYPE),
        ti("./usr/bin/ping", data=b"#!ping\n", mode=0o4755, uid=0, gid=0, pax_headers=pax),
        ti("./usr/bin/big", data=BIG, uid=1000, gid=1000),
        ti("./usr/bin/empty"),
        ti("./usr/bin/hard", tarfile.LNKTYPE, linkname="./usr/bin/ping"),
        ti("./usr/bin/sym", tarfile.SYMTYPE, linkname="ping", mode=0o777),
        ti("./deep/" + "d" * 120 + "/" + "n" * 130, data=b"long name"),
        ti("./long-link", tarfile.SYMTYPE, linkname="/" + "t" * 200, mode=0o777),
        ti("./dev/", tarfile.DIRTYPE),
        ti("./dev/null", tarfile.CHRTYPE, devmajor=1, devminor=3, mode=0o666),
        ti("./dev/sda", tarfile.BLKTYPE, devmajor=8, devminor=0, mode=0o660),
        ti("./dev/fifo", tarfile.FIFOTYPE),
        ti("./etc/.wh.removed"),
        ti("./var/.wh..wh..opq"),
        ti("./.wh..wh.plnk"),  # aufs bookkeeping: ignored
        ti("/abs//x/./y", data=b"y"),
    ]


@pytest.mark.parametrize("media_type", [GZIP, ZSTD, TAR])
def test_rich_layer_converts_in_random_pieces(media_type: str) -> None:
    raw = tar(rich_layer())
    blob = compress(raw, media_type)
    store = Store()
    index = convert(blob, media_type, store=store)
    assert (index.digest, index.diff_id, index.size) == (sha(blob), sha(raw), len(blob))
    assert index.media_type == media_type
    by_path = {e.path: e for e in index.entries}
    assert list(by_path) == [
        "",
        "usr",
        "usr/bin",
        "usr/bin/ping",
        "usr/bin/big",
        "usr/bin/empty",
        "usr/bin/hard",
        "usr/bin/sym",
        "deep/" + "d" * 120 + "/" + "n" * 130,
        "long-link",
        "dev",
        "dev/null",
        "dev/sda",
        "dev/fifo",
        "etc/removed",
        "var",
        "abs/x/y",
    ]
    assert by_path[""].kind is Kind.DIR and by_path[""].mode == 0o700
    ping = by_path["usr/bin/ping"]
    assert (ping.kind, ping.mode, ping.size, ping.mtime_ns) == (
        Kind.FILE,
        0o4755,
        7,
        1_700_000_000 * 10**9,
    )
    assert ping.xattrs == {"user.comment": b"hello", "security.capability": b"\x81\x80\xff"}
    assert content(ping, store) == b"#!ping\n"
    big = by_path["usr/bin/big"]
    assert (big.uid, big.gid, big.size) == (1000, 1000, len(BIG))
    assert [c.size for c in big.chunks] == [CHUNK_SIZE, CHUNK_SIZE, 12345]
    assert content(big, store) == BIG
    assert by_path["usr/bin/empty"].chunks == () and by_path["usr/bin/empty"].size == 0
    assert (by_path["usr/bin/hard"].kind, by_path["usr/bin/hard"].link) == (
        Kind.HARDLINK,
        "usr/bin/ping",
    )
    assert (by_path["usr/bin/sym"].kind, by_path["usr/bin/sym"].link) == (Kind.SYMLINK, "ping")
    assert by_path["long-link"].link == "/" + "t" * 200  # symlink targets stay verbatim
    assert content(by_path["deep/" + "d" * 120 + "/" + "n" * 130], store) == b"long name"
    null, sda, fifo = by_path["dev/null"], by_path["dev/sda"], by_path["dev/fifo"]
    assert (null.kind, null.devmajor, null.devminor, null.mode) == (Kind.CHAR, 1, 3, 0o666)
    assert (sda.kind, sda.devmajor, sda.devminor) == (Kind.BLOCK, 8, 0)
    assert fifo.kind is Kind.FIFO
    assert by_path["etc/removed"].kind is Kind.WHITEOUT
    assert by_path["var"].kind is Kind.OPAQUE
    # Every chunk's bytes sit at its recorded offset in the uncompressed stream.
    for e in index.entries:
        for c in e.chunks:
            assert raw[c.offset : c.offset + c.size] == store[c.digest]
    assert loads(dumps(index)) == index


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32), st.sampled_from([GZIP, ZSTD, TAR]))
def test_any_feeding_gives_the_same_index(seed: int, media_type: str) -> None:
    blob = compress(tar(rich_layer()[:6]), media_type)
    want = convert(blob, media_type, rng=random.Random(0))
    assert convert(blob, media_type, rng=random.Random(seed)) == want


def test_multi_member_gzip_and_multi_frame_zstd() -> None:
    raw = tar([ti("a", data=b"a" * 5000), ti("b", data=BIG[:100_000])])
    parts = [raw[:3000], raw[3000:7000], raw[7000:]]
    gz = b"".join(gzip.compress(p, mtime=0) for p in parts)
    zc = zstandard.ZstdCompressor()
    zs = b"".join(zc.compress(p) for p in parts)
    for blob, media_type in ((gz, GZIP), (zs, ZSTD)):
        store = Store()
        index = convert(blob, media_type, store=store)
        assert index.diff_id == sha(raw)
        assert [content(e, store) for e in index.entries] == [b"a" * 5000, BIG[:100_000]]


def test_magic_bytes_win_over_the_media_type() -> None:
    raw = tar([ti("f", data=b"x")])
    for blob, claimed in ((compress(raw, GZIP), ZSTD), (compress(raw, ZSTD), TAR), (raw, GZIP)):
        assert [e.path for e in convert(blob, claimed).entries] == ["f"]


def test_empty_layer() -> None:
    index = convert(compress(tar([]), GZIP))
    assert index.entries == ()


def test_wrong_digest_or_size_is_refused() -> None:
    blob = compress(tar([ti("f", data=b"x")]), GZIP)
    with pytest.raises(ConversionError, match="digest"):
        convert(blob, digest=sha(b"something else"))
    with pytest.raises(ConversionError, match="bytes"):
        convert(blob, size=len(blob) + 1)
    with pytest.raises(ConversionError, match="longer"):
        convert(blob, size=len(blob) - 1)
    with pytest.raises(ConversionError, match="digest"):
        LayerConverter(digest="md5:abc", media_type=GZIP, put_chunk=Store().put)


@pytest.mark.parametrize("media_type", [GZIP, ZSTD, TAR])
def test_truncated_blob_is_refused_even_when_its_digest_matches(media_type: str) -> None:
    raw = tar([ti("f", data=BIG[:300_000]), ti("g", data=b"g")])
    blob = compress(raw, media_type)
    for cut in (1, 3, len(blob) // 3, len(blob) - 5):
        if media_type == TAR and cut >= 512 + 300_000:
            continue  # a plain tar cut between members is a valid shorter tar
        with pytest.raises(ConversionError, match="truncated"):
            convert(blob[:cut], media_type)  # digest taken of the truncated blob
        with pytest.raises(ConversionError, match="digest"):
            convert(blob[:cut], media_type, digest=sha(blob))


@pytest.mark.parametrize("media_type", [GZIP, ZSTD])
def test_corrupt_compressed_stream_is_refused(media_type: str) -> None:
    raw = tar([ti("f", data=BIG[:200_000])])
    # zstd frames carry a content checksum only when asked (gzip always has a CRC).
    checked = zstandard.ZstdCompressor(write_checksum=True).compress(raw)
    blob = bytearray(checked if media_type == ZSTD else compress(raw, media_type))
    for i in range(len(blob) // 3, len(blob) // 3 + 64):
        blob[i] ^= 0x55
    with pytest.raises(ConversionError, match=f"corrupt {media_type[-4:]}"):
        convert(bytes(blob), media_type)


def test_bad_tar_is_refused() -> None:
    raw = bytearray(tar([ti("f", data=b"x")]))
    raw[0] ^= 1  # breaks the header checksum
    with pytest.raises(ConversionError, match="checksum"):
        convert(compress(bytes(raw), ZSTD), ZSTD)
    with pytest.raises(ConversionError, match="escapes"):
        convert(compress(tar([ti("../../etc/passwd", data=b"x")]), GZIP))
    with pytest.raises(ConversionError, match="escapes"):
        convert(compress(tar([ti("h", tarfile.LNKTYPE, linkname="../x")]), GZIP))
    with pytest.raises(ConversionError, match="root"):
        convert(compress(tar([ti("./", data=b"x")]), GZIP))
    bad_type = tar([ti("f", data=b"x")], fmt=tarfile.USTAR_FORMAT)
    block = bytearray(bad_type[:512])
    block[156:157] = b"Z"
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(block)
    with pytest.raises(ConversionError, match="unsupported tar member type 'Z'"):
        convert(bytes(block) + bad_type[512:], TAR)


def test_normalise_path() -> None:
    assert normalise_path("./a//b/./c/") == "a/b/c"
    assert normalise_path("/") == normalise_path("./") == normalise_path(".") == ""
    assert normalise_path("a/../b") == "b"
    with pytest.raises(ConversionError):
        normalise_path("a/../../b")


@pytest.mark.parametrize("media_type", [GZIP, ZSTD])
def test_memory_stays_bounded_on_a_highly_compressible_layer(media_type: str) -> None:
    zeros = 48 << 20
    blob = compress(tar([ti("zeros", data=bytes(zeros))]), media_type)
    assert len(blob) < zeros // 100
    chunks: list[int] = []
    conv = LayerConverter(
        digest=sha(blob), media_type=media_type, put_chunk=lambda d, data: chunks.append(len(data))
    )
    tracemalloc.start()
    try:
        conv.feed(blob)  # all at once: the converter must pace the decompression itself
        index = conv.finish()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert index.entries[0].size == zeros and sum(chunks) == zeros
    assert peak < 8 * CHUNK_SIZE, f"peak {peak} bytes"


# -- re-cutting chunks from the blob ---------------------------------------------


@pytest.mark.parametrize("media_type", [GZIP, ZSTD, TAR])
def test_chunk_cutter_recovers_exactly_the_wanted_chunks(media_type: str) -> None:
    blob = compress(tar(rich_layer()), media_type)
    store = Store()
    index = convert(blob, media_type, store=store)
    big = next(e for e in index.entries if e.path == "usr/bin/big")
    ping = next(e for e in index.entries if e.path == "usr/bin/ping")
    wanted = [big.chunks[2], ping.chunks[0], big.chunks[0], ping.chunks[0]]  # dup, unsorted
    got: list[tuple[Chunk, bytes]] = []
    cutter = ChunkCutter(
        wanted=wanted, on_chunk=lambda c, d: got.append((c, d)), media_type=media_type
    )
    rng = random.Random(3)
    pos = 0
    while pos < len(blob) and not cutter.done:
        n = rng.choice([1, 100, 5000, 300_000])
        cutter.feed(blob[pos : pos + n])
        pos += n
    cutter.finish()
    assert [c for c, _ in got] == sorted(set(wanted), key=lambda c: c.offset)
    assert all(store[c.digest] == d for c, d in got)
    if media_type == TAR:
        assert pos < len(blob)  # it stopped as soon as it had them all


def test_chunk_cutter_detects_wrong_bytes_and_missing_chunks() -> None:
    raw = tar([ti("f", data=BIG)])
    index = convert(raw, TAR)
    c = index.entries[0].chunks[1]
    shifted = Chunk(c.digest, c.size, c.offset + 1)
    with pytest.raises(ConversionError, match="hash to"):
        ChunkCutter(wanted=[shifted], on_chunk=lambda c, d: None).feed(raw)
    last = index.entries[0].chunks[2]
    beyond = Chunk(last.digest, last.size, len(raw) + 10)
    cutter = ChunkCutter(wanted=[c, beyond], on_chunk=lambda c, d: None, media_type=GZIP)
    cutter.feed(compress(raw, GZIP))
    with pytest.raises(ConversionError, match="1 chunks not found"):
        cutter.finish()
    assert cutter.missing == (beyond,)
    with pytest.raises(ValueError, match="overlap"):
        ChunkCutter(wanted=[c, Chunk("sha256:" + "0" * 64, 10, c.offset + 5)], on_chunk=print)


# -- merged layers against umoci ---------------------------------------------------


def _write_blob(layout: Path, data: bytes) -> dict[str, object]:
    digest = sha(data)
    (layout / "blobs" / "sha256" / digest.removeprefix("sha256:")).write_bytes(data)
    return {"digest": digest, "size": len(data)}


def _oci_image(layout: Path, layers: list[tuple[bytes, str]], tag: str) -> None:
    (layout / "blobs" / "sha256").mkdir(parents=True)
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    diff_ids = []
    descs = []
    for blob, media_type in layers:
        raw = blob
        if media_type == GZIP:
            raw = gzip.decompress(blob)
        elif media_type == ZSTD:
            raw = zstandard.ZstdDecompressor().decompressobj().decompress(blob)
        diff_ids.append(sha(raw))
        descs.append({"mediaType": media_type, **_write_blob(layout, blob)})
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {},
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    }
    config_desc = {
        "mediaType": "application/vnd.oci.image.config.v1+json",
        **_write_blob(layout, json.dumps(config).encode()),
    }
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": config_desc,
        "layers": descs,
    }
    manifest_desc = {
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        **_write_blob(layout, json.dumps(manifest).encode()),
        "annotations": {"org.opencontainers.image.ref.name": tag},
    }
    index = {"schemaVersion": 2, "manifests": [manifest_desc]}
    (layout / "index.json").write_text(json.dumps(index))


def _umoci_layers() -> list[tuple[bytes, str]]:
    base = [
        ti("./", tarfile.DIRTYPE),
        ti("bin/", tarfile.DIRTYPE),
        ti("bin/sh", data=b"#!/bin/sh\n" * 50, mode=0o755),
        ti("bin/ash", tarfile.LNKTYPE, linkname="bin/sh"),
        ti("bin/ls", tarfile.SYMTYPE, linkname="sh", mode=0o777),
        ti("etc/", tarfile.DIRTYPE),
        ti("etc/passwd", data=b"root:x:0:0::/root:/bin/sh\n"),
        ti("etc/shadow", data=b"secret", mode=0o600),
        ti("etc/conf.d/", tarfile.DIRTYPE, mode=0o750),
        ti("etc/conf.d/a", data=b"a"),
        ti("etc/conf.d/sub/", tarfile.DIRTYPE),
        ti("etc/conf.d/sub/b", data=b"b"),
        ti("var/", tarfile.DIRTYPE),
        ti("var/lib/", tarfile.DIRTYPE),
        ti("var/lib/old", data=b"old"),
        ti("opt/", tarfile.DIRTYPE),
        ti("opt/tool/", tarfile.DIRTYPE),
        ti("opt/tool/x", data=b"x"),
        ti("srv", data=b"srv was a file"),
        ti("usr/", tarfile.DIRTYPE),
        ti("usr/share/", tarfile.DIRTYPE),
        ti("usr/share/" + "long-" * 40, data=b"long"),
        ti("usr/big", data=BIG),
        ti("usr/empty"),
        ti("dev/", tarfile.DIRTYPE),
        ti("dev/fifo", tarfile.FIFOTYPE),
    ]
    if os.geteuid() == 0:
        base += [
            ti("dev/null", tarfile.CHRTYPE, devmajor=1, devminor=3, mode=0o666),
            ti("dev/loop0", tarfile.BLKTYPE, devmajor=7, devminor=0, mode=0o660),
        ]
    middle = [
        ti("etc/", tarfile.DIRTYPE, mode=0o700, uid=3),  # dir over dir: keeps children
        ti("etc/.wh.shadow"),
        ti("etc/conf.d/.wh..wh..opq"),
        ti("etc/conf.d/new", data=b"new"),
        ti("bin/sh", data=b"#!/bin/busybox\n", mode=0o755),  # bin/ash keeps the old inode
        ti("opt/tool", data=b"file replaces dir"),
        ti("srv/", tarfile.DIRTYPE),  # dir replaces file
        ti("srv/www", data=b"www"),
        ti("var/lib/.wh.old"),
        ti("var/lib/old", data=b"re-added in the same layer"),
        ti("usr/big2", tarfile.LNKTYPE, linkname="usr/big"),
    ]
    top = [
        ti("etc/conf.d/new2", data=b"n2"),
        ti("bin/.wh.ls"),
        ti("usr/.wh.share"),
        ti("home/user/deep/file", data=b"implicit parents", uid=1000, gid=1000),
    ]
    return [
        (compress(tar(base), GZIP), GZIP),
        (compress(tar(middle, fmt=tarfile.GNU_FORMAT), GZIP), GZIP),  # umoci 0.4 lacks zstd
        (tar(top, fmt=tarfile.USTAR_FORMAT), TAR),
    ]


def test_merged_tree_matches_umoci_unpack(tmp_path: Path) -> None:
    umoci = shutil.which("umoci")
    if umoci is None:
        pytest.skip("umoci is not installed (make test installs it)")
    layers = _umoci_layers()
    _oci_image(tmp_path / "image", layers, "t")
    rootless = os.geteuid() != 0
    cmd = [
        umoci,
        "unpack",
        *(["--rootless"] if rootless else []),
        "--image",
        f"{tmp_path / 'image'}:t",
    ]
    proc = subprocess.run(
        [*cmd, str(tmp_path / "bundle")], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    rootfs = tmp_path / "bundle" / "rootfs"

    store = Store()
    tree = ImageTree.build([convert(blob, mt, store=store) for blob, mt in layers])

    on_disk: dict[str, os.stat_result] = {}
    for dirpath, dirnames, filenames in os.walk(rootfs):
        for name in dirnames + filenames:
            entry = os.path.join(dirpath, name)
            on_disk[os.path.relpath(entry, rootfs)] = os.lstat(entry)
    mine = {path: inode for path, inode in tree.walk() if path}
    assert sorted(mine) == sorted(on_disk)
    kinds = {
        Kind.FILE: stat.S_ISREG,
        Kind.DIR: stat.S_ISDIR,
        Kind.SYMLINK: stat.S_ISLNK,
        Kind.CHAR: stat.S_ISCHR,
        Kind.BLOCK: stat.S_ISBLK,
        Kind.FIFO: stat.S_ISFIFO,
    }
    for path, inode in mine.items():
        st_ = on_disk[path]
        full = rootfs / path
        assert kinds[inode.kind](st_.st_mode), path
        if inode.kind is not Kind.SYMLINK:
            assert stat.S_IMODE(st_.st_mode) == inode.mode, path
        if not rootless:
            assert (st_.st_uid, st_.st_gid) == (inode.uid, inode.gid), path
        if inode.kind is Kind.FILE:
            assert full.read_bytes() == b"".join(store[c.digest] for c in inode.chunks), path
            assert st_.st_size == inode.size and st_.st_nlink == inode.nlink, path
        elif inode.kind is Kind.SYMLINK:
            assert os.readlink(full) == inode.link and st_.st_size == inode.size, path
        elif inode.kind is Kind.DIR:
            assert st_.st_nlink == inode.nlink, path
        elif inode.kind in (Kind.CHAR, Kind.BLOCK):
            assert (os.major(st_.st_rdev), os.minor(st_.st_rdev)) == (
                inode.devmajor,
                inode.devminor,
            )
    # Hard links: same inode on disk exactly when the same inode in the tree.
    for a in mine:
        for b in mine:
            if mine[a].kind is Kind.FILE and mine[b].kind is Kind.FILE:
                same_disk = on_disk[a].st_ino == on_disk[b].st_ino
                assert same_disk == (mine[a].ino == mine[b].ino), (a, b)
