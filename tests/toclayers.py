"""Test writers of TOC-indexed layers: eStargz and zstd:chunked, from `tests.registry` members.

`toc_layer(members, fmt=...)` writes the members as a plain tar first
(`Layer.build(..., compression="none")`), then re-encodes that tar the way
the formats lay it out (written from their public specs, not from their
code): every regular file's payload, cut into `chunk_size` pieces, is an
independent gzip member (eStargz) or zstd frame (zstd:chunked), and so is the
run of tar headers and padding between payloads; a TOC lists every entry
with its metadata and each chunk with its blob offset and SHA-256. eStargz
puts the TOC JSON as a last tar entry `stargz.index.json` in a gzip member of
its own and ends with the 51-byte footer naming its offset; zstd:chunked
puts the zstd-compressed TOC, a (here empty) tar-split and a 64-byte footer in
skippable frames. The result is a `TocLayer` `push_image` pushes with the
descriptor annotations that pin the TOC digest. The blob is still a valid
gzip / zstd tar layer (same diff_id as its plain tar plus, for eStargz, the
TOC entry), so runtimes that ignore the TOC unpack it as usual.

`corrupt` names files whose first chunk digest is recorded wrong in the TOC
(the TOC itself, and so its digest annotation, stays self-consistent): a
reader that verifies chunks must refuse their content.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import io
import json
import os
import struct
import tarfile
import tempfile
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Literal

import zstandard

from tests.registry import OCI_LAYER, Layer, Member, scratch_dir

__all__ = ["TocFormat", "TocLayer", "toc_layer"]

TocFormat = Literal["estargz", "zstd:chunked"]
MiB = 1 << 20
ESTARGZ_TOC_DIGEST = "containerd.io/snapshot/stargz/toc.digest"
ZSTD_CHECKSUM = "io.github.containers.zstd-chunked.manifest-checksum"
ZSTD_POSITION = "io.github.containers.zstd-chunked.manifest-position"
_WRONG = "sha256:" + hashlib.sha256(b"not these bytes").hexdigest()
_TYPES = {
    tarfile.REGTYPE: "reg",
    tarfile.AREGTYPE: "reg",
    tarfile.DIRTYPE: "dir",
    tarfile.SYMTYPE: "symlink",
    tarfile.LNKTYPE: "hardlink",
    tarfile.CHRTYPE: "char",
    tarfile.BLKTYPE: "block",
    tarfile.FIFOTYPE: "fifo",
}


@dataclass
class TocLayer:
    """A TOC-indexed layer blob on disk, its hashes and its descriptor annotations."""

    path: Path
    fmt: TocFormat
    digest: str
    size: int
    diff_id: str
    annotations: dict[str, str]
    contents: dict[str, str] = field(default_factory=dict)
    toc: dict[str, Any] = field(default_factory=dict)

    @property
    def compression(self) -> str:
        return "gzip" if self.fmt == "estargz" else "zstd"

    def media_type(self, *, docker: bool = False) -> str:
        return OCI_LAYER[self.compression]

    def delete(self) -> None:
        self.path.unlink(missing_ok=True)


class _Out:
    """The blob being written: hashes it and counts its bytes."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.pos = 0
        self.sha = hashlib.sha256()

    def write(self, b: bytes) -> None:
        self.f.write(b)
        self.sha.update(b)
        self.pos += len(b)


def _gzip_member(data: bytes, level: int) -> bytes:
    c = zlib.compressobj(level, zlib.DEFLATED, 31)
    return c.compress(data) + c.flush()


def _rfc3339(mtime: float) -> str:
    when = datetime.datetime.fromtimestamp(int(mtime), tz=datetime.UTC)
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def _xattrs(ti: tarfile.TarInfo) -> dict[str, str]:
    out = {}
    for k, v in ti.pax_headers.items():
        if k.startswith("SCHILY.xattr."):
            raw = v.encode("utf-8", "surrogateescape")
            out[k.removeprefix("SCHILY.xattr.")] = base64.b64encode(raw).decode()
    return out


def _segments(plain: Path, chunk_size: int) -> Iterator[tuple[int, int, tarfile.TarInfo | None]]:
    """(start, end, member) pieces of the tar: a payload chunk has its member, the
    runs of headers and padding between payloads have None. Stops at the archive end."""
    pos = 0
    with tarfile.open(plain, "r:") as tar:
        members = tar.getmembers()
    for ti in members:
        if ti.isreg() and ti.size:
            if ti.offset_data > pos:
                yield pos, ti.offset_data, None
            for off in range(0, ti.size, chunk_size):
                yield ti.offset_data + off, ti.offset_data + min(off + chunk_size, ti.size), ti
            pos = ti.offset_data + ti.size
    end = 0
    if members:
        last = members[-1]
        end = last.offset_data + (-(-last.size // 512) * 512 if last.isreg() else 0)
    if end > pos:
        yield pos, end, None


def _entry(ti: tarfile.TarInfo) -> dict[str, Any]:
    e: dict[str, Any] = {"name": ti.name, "type": _TYPES[ti.type], "mode": ti.mode}
    if ti.uid:
        e["uid"] = ti.uid
    if ti.gid:
        e["gid"] = ti.gid
    e["modtime"] = _rfc3339(ti.mtime)
    if ti.linkname:
        e["linkName"] = ti.linkname
    if ti.ischr() or ti.isblk():
        e["devMajor"], e["devMinor"] = ti.devmajor, ti.devminor
    if xattrs := _xattrs(ti):
        e["xattrs"] = xattrs
    if ti.isreg() and ti.size:
        e["size"] = ti.size
    return e


def toc_layer(
    members: Iterable[Member],
    *,
    fmt: TocFormat = "estargz",
    chunk_size: int = MiB,
    level: int = 1,
    corrupt: Iterable[str] = (),
) -> TocLayer:
    """A `fmt` layer of `members` (in this order), chunks of at most `chunk_size` bytes."""
    plain = Layer.build(members, compression="none")
    bad = {m.strip("/") for m in corrupt}
    fd, name = tempfile.mkstemp(dir=scratch_dir(), suffix=".toclayer")
    try:
        with os.fdopen(fd, "wb", buffering=MiB) as f, plain.path.open("rb") as src:
            out = _Out(f)
            diff = hashlib.sha256()
            entries: list[dict[str, Any]] = []
            current: dict[str, Any] | None = None
            file_sha: dict[str, Any] = {}
            tar_end = 0
            with tarfile.open(plain.path, "r:") as tar:
                infos = tar.getmembers()
            headers_done = 0
            for start, end, ti in _segments(plain.path, chunk_size):
                # metadata entries for every member whose header lies before this point
                while headers_done < len(infos) and infos[headers_done].offset < end:
                    hti = infos[headers_done]
                    headers_done += 1
                    e = _entry(hti)
                    entries.append(e)
                    if hti.isreg() and hti.size:
                        current = e
                        file_sha[hti.name] = hashlib.sha256()
                src.seek(start)
                data = src.read(end - start)
                diff.update(data)
                tar_end = end
                offset = out.pos
                out.write(
                    _gzip_member(data, level)
                    if fmt == "estargz"
                    else zstandard.ZstdCompressor(level=level).compress(data)
                )
                if ti is None:
                    continue
                assert current is not None and current["name"] == ti.name
                file_sha[ti.name].update(data)
                chunk_off = start - ti.offset_data
                digest = "sha256:" + hashlib.sha256(data).hexdigest()
                if chunk_off == 0:
                    e = current
                else:
                    e = {"name": ti.name, "type": "chunk"}
                    entries.append(e)
                e.update(offset=offset, chunkOffset=chunk_off, chunkDigest=digest)
                if chunk_off == 0 and ti.name.strip("/") in bad:
                    e["chunkDigest"] = _WRONG
                e["chunkSize"] = end - start
                if end == ti.offset_data + ti.size:
                    current["digest"] = "sha256:" + file_sha[ti.name].hexdigest()
                    if fmt == "estargz":
                        e["chunkSize"] = 0  # the last chunk of a file: "the rest"
                    else:
                        current["endOffset"] = out.pos
            if fmt == "estargz":
                annotations, toc = _estargz_tail(out, entries, diff, level)
            else:
                annotations, toc = _zstd_tail(out, entries, src, tar_end, diff, level)
    except BaseException:
        os.unlink(name)
        plain.delete()
        raise
    plain.delete()
    final = Path(name).with_name(f"sha256-{out.sha.hexdigest()}.layer")
    os.replace(name, final)
    return TocLayer(
        path=final,
        fmt=fmt,
        digest="sha256:" + out.sha.hexdigest(),
        size=out.pos,
        diff_id="sha256:" + diff.hexdigest(),
        annotations=annotations,
        contents=plain.contents,
        toc=toc,
    )


def _clean(entries: list[dict[str, Any]], fmt: TocFormat) -> list[dict[str, Any]]:
    """The TOC's entries: bookkeeping keys dropped; in zstd:chunked a file of one
    chunk is described by its `digest` alone (chunk fields are for chunked files)."""
    chunks: dict[str, int] = {}
    for e in entries:
        if "chunkDigest" in e:
            chunks[e["name"]] = chunks.get(e["name"], 0) + 1
    out = []
    for e in entries:
        e = {k: v for k, v in e.items() if not k.startswith("_")}
        if fmt == "zstd:chunked" and e["type"] == "reg" and chunks.get(e["name"]) == 1:
            if e["chunkDigest"] == _WRONG:
                e["digest"] = _WRONG
            for k in ("chunkOffset", "chunkSize", "chunkDigest"):
                e.pop(k, None)
        out.append(e)
    return out


def _estargz_tail(
    out: _Out, entries: list[dict[str, Any]], diff: Any, level: int
) -> tuple[dict[str, str], dict[str, Any]]:
    toc = {"version": 1, "entries": _clean(entries, "estargz")}
    toc_json = json.dumps(toc, indent="\t").encode()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tw:
        ti = tarfile.TarInfo("stargz.index.json")
        ti.size = len(toc_json)
        ti.mtime = 0
        tw.addfile(ti, io.BytesIO(toc_json))
    tail = buf.getvalue()
    diff.update(tail)
    toc_off = out.pos
    out.write(_gzip_member(tail, level))
    out.write(_estargz_footer(toc_off))
    digest = "sha256:" + hashlib.sha256(toc_json).hexdigest()
    return {ESTARGZ_TOC_DIGEST: digest}, toc


def _estargz_footer(toc_off: int) -> bytes:
    sub = b"%016xSTARGZ" % toc_off
    extra = b"SG" + struct.pack("<H", len(sub)) + sub
    header = b"\x1f\x8b\x08\x04" + b"\x00" * 5 + b"\xff" + struct.pack("<H", len(extra)) + extra
    return header + b"\x01\x00\x00\xff\xff" + b"\x00" * 8


def _skippable(data: bytes) -> bytes:
    return b"\x50\x2a\x4d\x18" + struct.pack("<I", len(data)) + data


def _zstd_tail(
    out: _Out, entries: list[dict[str, Any]], src: BinaryIO, tar_end: int, diff: Any, level: int
) -> tuple[dict[str, str], dict[str, Any]]:
    src.seek(tar_end)
    rest = src.read()  # the end-of-archive blocks
    if rest:
        diff.update(rest)
        out.write(zstandard.ZstdCompressor(level=level).compress(rest))
    toc = {"version": 1, "entries": _clean(entries, "zstd:chunked")}
    toc_json = json.dumps(toc).encode()
    packed = zstandard.ZstdCompressor(level=level).compress(toc_json)
    manifest_off = out.pos + 8
    out.write(_skippable(packed))
    tarsplit = zstandard.ZstdCompressor(level=level).compress(b"")
    tarsplit_off = out.pos + 8
    out.write(_skippable(tarsplit))
    footer = struct.pack(
        "<7Q", manifest_off, len(packed), len(toc_json), 1, tarsplit_off, len(tarsplit), 0
    )
    out.write(_skippable(footer + b"GNUlInUx"))
    annotations = {
        ZSTD_CHECKSUM: "sha256:" + hashlib.sha256(packed).hexdigest(),
        ZSTD_POSITION: f"{manifest_off}:{len(packed)}:{len(toc_json)}:1",
    }
    return annotations, toc
