"""TOC-indexed layers (eStargz, zstd:chunked): detection, footer and TOC parsing, and
the `LayerIndex` built from a TOC; sans-IO.

Both formats keep a regular tar layer readable by any runtime and add a table
of contents (TOC): every tar entry's metadata, and for each regular file its
content as chunks, each compressed on its own (an independent gzip member in
eStargz, a zstd frame in zstd:chunked) at a recorded offset of the blob, with
the SHA-256 of its uncompressed bytes. A layer whose descriptor pins the TOC's
digest (annotation `containerd.io/snapshot/stargz/toc.digest` for eStargz;
`io.github.containers.zstd-chunked.manifest-checksum` and `...manifest-position`
for zstd:chunked) can therefore be indexed from a few range requests, and
each chunk fetched, decompressed and verified alone (`cut_chunk`).

`detect` reads the descriptor; `parse_estargz_footer` finds the TOC offset in
the last `ESTARGZ_FOOTER_SIZE` bytes of an eStargz blob; `decode_estargz_toc`
and `decode_zstd_toc` turn the TOC's bytes into its JSON, checked against the
pinned digest; `build_index` maps the TOC onto aenv's layer index (the same
entries `aenv.images.convert` produces from the tar stream, with the TOC's
chunks and their `Span`s). Anything that does not parse or does not fit
raises `TocError`; the caller then takes the full path (download and
convert). Trust: the manifest (verified by digest) pins the TOC digest, the
TOC pins every chunk's digest; the blob as a whole is never verified.
"""

from __future__ import annotations

import base64
import binascii
import bisect
import datetime
import hashlib
import json
import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import zstandard

from aenv.images.convert import ConversionError, normalise_path
from aenv.proto.layerindex import Chunk, Entry, Kind, LayerIndex, Span
from aenv.proto.tarstream import ArchiveEnd, Data, Member, MemberEnd, TarError, TarReader

__all__ = [
    "ESTARGZ_FOOTER_SIZE",
    "ESTARGZ_TOC_DIGEST",
    "MAX_CHUNK_BYTES",
    "ZSTD_MANIFEST_CHECKSUM",
    "ZSTD_MANIFEST_POSITION",
    "TocError",
    "TocLayout",
    "build_index",
    "cut_chunk",
    "decode_estargz_toc",
    "decode_zstd_toc",
    "detect",
    "parse_estargz_footer",
]

ESTARGZ_TOC_DIGEST = "containerd.io/snapshot/stargz/toc.digest"
ZSTD_MANIFEST_CHECKSUM = "io.github.containers.zstd-chunked.manifest-checksum"
ZSTD_MANIFEST_POSITION = "io.github.containers.zstd-chunked.manifest-position"
ESTARGZ_FOOTER_SIZE = 51
ESTARGZ_TOC_NAME = "stargz.index.json"
MAX_TOC_BYTES = 256 << 20  # a TOC (compressed or not) larger than this is refused
# A TOC chunk is fetched and held whole: a layer with larger chunks takes the full path.
MAX_CHUNK_BYTES = 32 << 20
MAX_SPAN_BYTES = 64 << 20  # compressed bytes fetched for one chunk, at most

_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_OPAQUE = ".wh..wh..opq"
_WHITEOUT = ".wh."
_KINDS = {
    "reg": Kind.FILE,
    "dir": Kind.DIR,
    "symlink": Kind.SYMLINK,
    "hardlink": Kind.HARDLINK,
    "char": Kind.CHAR,
    "block": Kind.BLOCK,
    "fifo": Kind.FIFO,
}


class TocError(ValueError):
    """A TOC-indexed layer cannot be used lazily (malformed, unverified, or unsupported)."""


class Described(Protocol):
    """What `detect` reads of a layer descriptor (an `oci.Descriptor` has it)."""

    @property
    def media_type(self) -> str: ...

    @property
    def size(self) -> int: ...

    def annotation(self, key: str) -> str | None: ...


@dataclass(frozen=True, slots=True)
class TocLayout:
    """A layer's TOC as its descriptor describes it."""

    format: str  # "estargz" | "zstd:chunked"
    toc_digest: str  # eStargz: of the TOC JSON; zstd:chunked: of the compressed TOC
    offset: int = 0  # zstd:chunked: where the compressed TOC starts in the blob
    length: int = 0  # zstd:chunked: its compressed length
    uncompressed: int = 0  # zstd:chunked: its JSON's length


def detect(desc: Described) -> TocLayout | None:
    """The TOC layout `desc` announces, None for a layer without one.

    A layer is only used lazily when its descriptor (in a manifest verified by
    digest) pins the TOC digest: an eStargz footer alone is not trusted.
    Malformed annotations raise `TocError`.
    """
    mt = desc.media_type
    esgz = desc.annotation(ESTARGZ_TOC_DIGEST)
    if esgz is not None and mt.endswith(("+gzip", ".gzip")):
        if not _DIGEST.fullmatch(esgz):
            raise TocError(f"bad {ESTARGZ_TOC_DIGEST} annotation {esgz!r}")
        if desc.size <= ESTARGZ_FOOTER_SIZE:
            raise TocError("eStargz blob is smaller than its footer")
        return TocLayout("estargz", esgz)
    checksum = desc.annotation(ZSTD_MANIFEST_CHECKSUM)
    position = desc.annotation(ZSTD_MANIFEST_POSITION)
    if checksum is not None and position is not None and mt.endswith(("+zstd", ".zstd")):
        if not _DIGEST.fullmatch(checksum):
            raise TocError(f"bad {ZSTD_MANIFEST_CHECKSUM} annotation {checksum!r}")
        parts = position.split(":")
        if len(parts) != 4 or not all(p.isdigit() for p in parts):
            raise TocError(f"bad {ZSTD_MANIFEST_POSITION} annotation {position!r}")
        offset, length, uncompressed, kind = (int(p) for p in parts)
        if kind != 1:
            raise TocError(f"zstd:chunked manifest type {kind} is not supported")
        if not length or offset + length > desc.size:
            raise TocError(f"zstd:chunked manifest at {offset}+{length} is outside the blob")
        if length > MAX_TOC_BYTES or uncompressed > MAX_TOC_BYTES:
            raise TocError(f"zstd:chunked manifest of {uncompressed} bytes is too large")
        return TocLayout("zstd:chunked", checksum, offset, length, uncompressed)
    return None


def parse_estargz_footer(footer: bytes, blob_size: int) -> int:
    """The TOC's offset, from the last `ESTARGZ_FOOTER_SIZE` bytes of an eStargz blob.

    The footer is an empty gzip member whose extra field holds an "SG"
    subfield of 16 hex digits and "STARGZ".
    """
    if len(footer) != ESTARGZ_FOOTER_SIZE:
        raise TocError(f"eStargz footer is {len(footer)} bytes, not {ESTARGZ_FOOTER_SIZE}")
    if footer[:3] != b"\x1f\x8b\x08" or not footer[3] & 0x04:
        raise TocError("eStargz footer is not a gzip header with an extra field")
    xlen = int.from_bytes(footer[10:12], "little")
    extra = footer[12 : 12 + xlen]
    if xlen != 26 or extra[:2] != b"SG" or int.from_bytes(extra[2:4], "little") != 22:
        raise TocError("eStargz footer has no STARGZ subfield")
    sub = extra[4:26]
    if sub[16:] != b"STARGZ" or not re.fullmatch(rb"[0-9a-fA-F]{16}", sub[:16]):
        raise TocError("eStargz footer subfield is malformed")
    offset = int(sub[:16], 16)
    if not 0 < offset < blob_size - ESTARGZ_FOOTER_SIZE:
        raise TocError(f"eStargz TOC offset {offset} is outside the blob")
    return offset


def _gunzip(data: bytes, limit: int) -> bytes:
    """Every gzip member in `data`, decompressed, at most `limit` bytes of it."""
    out = bytearray()
    view = data
    try:
        while view:
            d = zlib.decompressobj(wbits=31)
            out += d.decompress(view, limit + 1 - len(out))
            if len(out) > limit:
                raise TocError(f"decompresses to more than {limit} bytes")
            if not d.eof:
                if d.unconsumed_tail:
                    raise TocError(f"decompresses to more than {limit} bytes")
                raise TocError("gzip member is truncated")
            view = d.unused_data
    except zlib.error as exc:
        raise TocError(f"corrupt gzip data: {exc}") from None
    return bytes(out)


def _sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def decode_estargz_toc(data: bytes, layout: TocLayout) -> bytes:
    """The TOC JSON from the blob's bytes between the TOC offset and the footer.

    They are a gzip member holding a tar entry `stargz.index.json`; its content
    must hash to the pinned TOC digest.
    """
    tar = TarReader()
    name = None
    body = bytearray()
    try:
        for ev in tar.feed(_gunzip(data, MAX_TOC_BYTES + (64 << 10))):
            if isinstance(ev, Member):
                if name is not None:
                    break
                name = ev.header.name
                if name != ESTARGZ_TOC_NAME:
                    raise TocError(f"eStargz TOC entry is named {name!r}")
            elif isinstance(ev, Data):
                body += ev.data
            elif isinstance(ev, (MemberEnd, ArchiveEnd)) and name is not None:
                break
    except TarError as exc:
        raise TocError(f"eStargz TOC: {exc}") from None
    if name is None:
        raise TocError("eStargz TOC entry not found")
    actual = _sha256(bytes(body))
    if actual != layout.toc_digest:
        raise TocError(f"eStargz TOC digest is {actual}, the manifest says {layout.toc_digest}")
    return bytes(body)


def decode_zstd_toc(data: bytes, layout: TocLayout) -> bytes:
    """The TOC JSON from the compressed manifest bytes named by the annotation."""
    actual = _sha256(data)
    if actual != layout.toc_digest:
        raise TocError(
            f"zstd:chunked manifest checksum is {actual}, the manifest says {layout.toc_digest}"
        )
    try:
        out = zstandard.ZstdDecompressor().decompress(
            data, max_output_size=layout.uncompressed or MAX_TOC_BYTES
        )
    except zstandard.ZstdError as exc:
        raise TocError(f"zstd:chunked manifest: {exc}") from None
    if layout.uncompressed and len(out) != layout.uncompressed:
        raise TocError(
            f"zstd:chunked manifest is {len(out)} bytes, the annotation says {layout.uncompressed}"
        )
    return out


# -- the index ----------------------------------------------------------------------


_I64 = (1 << 63) - 1
_U32 = (1 << 32) - 1


def _int(raw: Any, what: str, limit: int = _I64) -> int:
    if raw is None:
        return 0
    if not isinstance(raw, int) or isinstance(raw, bool) or not 0 <= raw <= limit:
        raise TocError(f"{what} is not an integer in 0..{limit}")
    return raw


def _text(raw: Any, what: str) -> str:
    if raw is None:
        return ""
    if not isinstance(raw, str):
        raise TocError(f"{what} is not a string")
    return raw


def _mtime_ns(raw: Any) -> int:
    text = _text(raw, "modtime")
    if not text:
        return 0
    try:
        when = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise TocError(f"bad modtime {text!r}") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.UTC)
    frac = re.search(r"\.(\d+)", text)  # keep nanoseconds fromisoformat drops
    nanos = int((frac.group(1) + "000000000")[:9]) if frac else 0
    secs = int(when.timestamp() // 1)
    return min(max(secs * 1_000_000_000 + nanos, 0), _I64)


def _xattrs(raw: Any) -> dict[str, bytes]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise TocError("xattrs is not an object")
    try:
        return {
            _text(k, "xattr name"): base64.b64decode(_text(v, "xattr"), validate=True)
            for k, v in raw.items()
        }
    except binascii.Error as exc:
        raise TocError(f"bad xattr value: {exc}") from None


def _path(name: str) -> str:
    try:
        return normalise_path(name)
    except ConversionError as exc:
        raise TocError(str(exc)) from None


@dataclass
class _File:
    """A regular file being assembled from its `reg` entry and `chunk` entries."""

    meta: dict[str, Any]
    path: str
    size: int
    pieces: list[tuple[str, int, int, int, int]]  # digest, size, start, end (0: not yet), inner


def build_index(
    layout: TocLayout,
    toc_json: bytes,
    *,
    digest: str,
    size: int,
    media_type: str,
    diff_id: str,
    toc_start: int,
) -> LayerIndex:
    """The layer index of a TOC-indexed layer (blob `digest` of `size` bytes).

    `diff_id` comes from the image config (unverifiable without the whole
    blob). `toc_start` is where the TOC's bytes begin in the blob: no chunk
    reaches past it, and in eStargz it ends the last chunk's span.
    """
    try:
        doc = json.loads(toc_json)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TocError(f"TOC is not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("version") != 1:
        raise TocError("TOC is not a version 1 TOC object")
    raw_entries = doc.get("entries")
    if not isinstance(raw_entries, list):
        raise TocError("TOC entries is not a list")
    estargz = layout.format == "estargz"
    out: list[Entry | _File] = []
    current: _File | None = None
    for raw in raw_entries:
        if not isinstance(raw, dict):
            raise TocError("TOC entry is not an object")
        typ = _text(raw.get("type"), "type")
        name = _text(raw.get("name"), "name")
        if typ == "chunk":
            if current is None or _path(name) != current.path:
                raise TocError(f"chunk entry {name!r} follows no regular file of that name")
            _add_piece(current, raw, estargz)
            continue
        current = None
        kind = _KINDS.get(typ)
        if kind is None:
            raise TocError(f"TOC entry {name!r} has unsupported type {typ!r}")
        path = _path(name)
        if estargz and path == ESTARGZ_TOC_NAME:
            continue
        parent, _, base = path.rpartition("/")
        if base.startswith(_WHITEOUT):
            if base == _OPAQUE:
                out.append(Entry(path=parent, kind=Kind.OPAQUE))
            elif not base.startswith(_WHITEOUT + _WHITEOUT):
                gone = base[len(_WHITEOUT) :]
                if gone in ("", ".", ".."):
                    raise TocError(f"bad whiteout name {name!r}")
                out.append(Entry(path=f"{parent}/{gone}" if parent else gone, kind=Kind.WHITEOUT))
            continue
        if kind is not Kind.DIR and not path:
            raise TocError(f"TOC entry {name!r} names the layer root but is no directory")
        if kind is Kind.FILE:
            fsize = _int(raw.get("size"), "size")
            current = _File(meta=raw, path=path, size=fsize, pieces=[])
            if fsize:
                _add_piece(current, raw, estargz)
            out.append(current)
            continue
        link = _text(raw.get("linkName"), "linkName")
        if kind is Kind.HARDLINK:
            link = _path(link)
            if not link:
                raise TocError(f"hard link {name!r} points at the layer root")
            out.append(Entry(path=path, kind=kind, link=link))
            continue
        out.append(_entry(raw, path, kind, link=link))
    spans: dict[str, Span] = {}
    starts = sorted({p[2] for f in out if isinstance(f, _File) for p in f.pieces} | {toc_start})
    entries = tuple(
        _file_entry(f, spans, starts, toc_start, estargz) if isinstance(f, _File) else f
        for f in out
    )
    return LayerIndex(
        digest=digest,
        diff_id=diff_id,
        media_type=media_type,
        size=size,
        entries=entries,
        toc=layout.format,
        toc_digest=layout.toc_digest,
        spans=spans,
    )


def _entry(raw: dict[str, Any], path: str, kind: Kind, **more: Any) -> Entry:
    return Entry(
        path=path,
        kind=kind,
        mode=_int(raw.get("mode"), "mode", _U32) & 0o7777,
        uid=_int(raw.get("uid"), "uid", _U32),
        gid=_int(raw.get("gid"), "gid", _U32),
        mtime_ns=_mtime_ns(raw.get("modtime")),
        devmajor=_int(raw.get("devMajor"), "devMajor", _U32),
        devminor=_int(raw.get("devMinor"), "devMinor", _U32),
        xattrs=_xattrs(raw.get("xattrs")),
        **more,
    )


def _add_piece(f: _File, raw: dict[str, Any], estargz: bool) -> None:
    done = sum(p[1] for p in f.pieces)
    if _int(raw.get("chunkOffset"), "chunkOffset") != done:
        raise TocError(f"chunks of {f.path!r} are not contiguous")
    size = _int(raw.get("chunkSize"), "chunkSize") or f.size - done
    if size <= 0 or done + size > f.size:
        raise TocError(f"chunks of {f.path!r} do not add up to its size")
    if size > MAX_CHUNK_BYTES:
        raise TocError(f"a chunk of {f.path!r} has {size} bytes (at most {MAX_CHUNK_BYTES})")
    digest = _text(raw.get("chunkDigest"), "chunkDigest")
    if not digest and not estargz and not f.pieces and size == f.size:
        digest = _text(raw.get("digest"), "digest")  # zstd:chunked: an unchunked file
    if not _DIGEST.fullmatch(digest):
        raise TocError(f"chunk of {f.path!r} has no sha256 chunk digest")
    start = _int(raw.get("offset"), "offset")
    if f.pieces and not estargz:
        # zstd:chunked: a chunk's frame ends where the next one starts
        d, s, st, _, inner = f.pieces[-1]
        f.pieces[-1] = (d, s, st, start, inner)
    inner = _int(raw.get("innerOffset"), "innerOffset") if estargz else 0
    f.pieces.append((digest, size, start, 0, inner))


def _file_entry(
    f: _File, spans: dict[str, Span], starts: Sequence[int], toc_start: int, estargz: bool
) -> Entry:
    if sum(p[1] for p in f.pieces) != f.size:
        raise TocError(f"chunks of {f.path!r} do not add up to its size")
    if not estargz and f.pieces:
        end = _int(f.meta.get("endOffset"), "endOffset")  # the file's frames end here
        d, s, st, _, inner = f.pieces[-1]
        f.pieces[-1] = (d, s, st, end, inner)
    chunks = []
    for digest, size, start, end, inner in f.pieces:
        if estargz:
            end = starts[bisect.bisect_right(starts, start)] if start < toc_start else 0
        if not start < end <= toc_start or end - start > MAX_SPAN_BYTES:
            raise TocError(f"chunk of {f.path!r} at {start}..{end} is outside the layer's data")
        spans.setdefault(digest, Span(start, end, inner))
        chunks.append(Chunk(digest, size, start))
    return _entry(f.meta, f.path, Kind.FILE, size=f.size, chunks=tuple(chunks))


def cut_chunk(fmt: str, data: bytes, span: Span, chunk: Chunk) -> bytes:
    """`chunk`'s bytes from its span's compressed `data`, verified against its digest."""
    if len(data) != span.end - span.start:
        raise TocError(f"span {span.start}..{span.end} came back with {len(data)} bytes")
    want = span.inner + chunk.size
    if fmt == "estargz":
        out = _gunzip_prefix(data, want)
    else:
        try:
            with zstandard.ZstdDecompressor().stream_reader(data, read_across_frames=True) as r:
                out = r.read(want)
                while len(out) < want and (more := r.read(want - len(out))):
                    out += more
        except zstandard.ZstdError as exc:
            raise TocError(f"chunk {chunk.digest}: corrupt zstd data: {exc}") from None
    piece = out[span.inner : want]
    if len(piece) != chunk.size:
        raise TocError(
            f"chunk {chunk.digest}: its span decompresses to {len(out)} bytes, {want} expected"
        )
    actual = _sha256(piece)
    if actual != chunk.digest:
        raise TocError(f"chunk at blob offset {span.start} hashes to {actual}, not {chunk.digest}")
    return piece


def _gunzip_prefix(data: bytes, want: int) -> bytes:
    """The first `want` bytes `data`'s gzip members decompress to (fewer if they end)."""
    out = bytearray()
    view = data
    try:
        while view and len(out) < want:
            d = zlib.decompressobj(wbits=31)
            out += d.decompress(view, want - len(out))
            if not d.eof:
                break
            view = d.unused_data
    except zlib.error as exc:
        raise TocError(f"corrupt gzip data: {exc}") from None
    return bytes(out)
