"""aenv's converted-layer format: the index of one OCI layer, sans-IO.

An OCI layer (a tar stream, maybe compressed) is converted once into a
`LayerIndex`: every tar entry as an `Entry` (metadata only) plus, for each
regular file, its content cut into `Chunk`s of at most `CHUNK_SIZE` bytes at
fixed offsets in the file. A chunk is named by the SHA-256 of its bytes, so
identical content is stored once across layers and images, and any file
range can be fetched on its own. Each chunk also records where its bytes sit
in the layer's uncompressed tar stream, so a chunk evicted from the local
cache can be cut again from the registry blob without re-parsing the tar.

Whiteouts (`.wh.NAME`) and opaque markers (`.wh..wh..opq`) are kept as
entries of kind WHITEOUT and OPAQUE; merging layers into one tree is
`aenv.proto.imagetree`'s job. Paths are relative, normalised, without a
leading `./` or `/`; the layer root itself is the path "".

A layer in a TOC-indexed format (eStargz, zstd:chunked) is indexed from its
table of contents without downloading the blob (`aenv.images.toc`): its
chunks are the TOC's, of any size, and `spans` says where each one's
compressed bytes sit in the blob (an independent gzip member or zstd frame,
so it can be fetched with one range request); `Chunk.offset` is then the
start of that span, not a tar stream offset, and `toc` names the format.

The serialised form is JSON (one object), versioned; `dumps`/`loads` round
trip exactly and `loads` rejects anything malformed with `BadIndex`.
"""

from __future__ import annotations

import base64
import enum
import json
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CHUNK_SIZE",
    "FORMAT_VERSION",
    "BadIndex",
    "Chunk",
    "Entry",
    "Kind",
    "LayerIndex",
    "Span",
    "dumps",
    "loads",
]

CHUNK_SIZE = 1 << 20
FORMAT_VERSION = 1


class BadIndex(ValueError):
    """A serialised layer index is malformed."""


class Kind(enum.Enum):
    FILE = "f"
    DIR = "d"
    SYMLINK = "l"
    HARDLINK = "h"  # `link` names the target path (this layer or a lower one)
    CHAR = "c"
    BLOCK = "b"
    FIFO = "p"
    WHITEOUT = "w"  # `path` is the entry removed from lower layers
    OPAQUE = "o"  # `path` is a directory whose lower contents are hidden


@dataclass(frozen=True, slots=True)
class Chunk:
    digest: str  # "sha256:<64 hex>" of the chunk's bytes
    size: int
    offset: int  # where the bytes start in the layer's uncompressed tar stream


@dataclass(frozen=True, slots=True, kw_only=True)
class Entry:
    path: str
    kind: Kind
    mode: int = 0o644  # permission bits, including setuid/setgid/sticky (0o7777)
    uid: int = 0
    gid: int = 0
    mtime_ns: int = 0
    size: int = 0  # regular files only
    link: str = ""  # symlink target, or hard-link target path
    devmajor: int = 0
    devminor: int = 0
    xattrs: dict[str, bytes] = field(default_factory=dict)
    chunks: tuple[Chunk, ...] = ()


@dataclass(frozen=True, slots=True)
class Span:
    """Where a TOC chunk's compressed bytes are in its layer blob."""

    start: int  # first byte of the gzip member(s) / zstd frame(s) holding the chunk
    end: int  # one past their last byte
    inner: int  # offset of the chunk in what [start, end) decompresses to


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerIndex:
    digest: str  # digest of the blob as the registry serves it (compressed)
    diff_id: str  # digest of the uncompressed tar stream
    media_type: str
    size: int  # compressed size
    entries: tuple[Entry, ...]
    toc: str = ""  # "estargz" or "zstd:chunked" when indexed from the blob's TOC
    toc_digest: str = ""  # the TOC digest the layer's descriptor pinned (toc only)
    spans: dict[str, Span] = field(default_factory=dict)  # chunk digest -> span (toc only)

    @property
    def content_bytes(self) -> int:
        return sum(c.size for e in self.entries for c in e.chunks)


def _entry_to_json(e: Entry) -> dict[str, Any]:
    out: dict[str, Any] = {"p": e.path, "k": e.kind.value}
    if e.kind not in (Kind.WHITEOUT, Kind.OPAQUE, Kind.HARDLINK):
        out.update(m=e.mode, u=e.uid, g=e.gid, t=e.mtime_ns)
    if e.size:
        out["s"] = e.size
    if e.link:
        out["l"] = e.link
    if e.devmajor or e.devminor:
        out["d"] = [e.devmajor, e.devminor]
    if e.xattrs:
        out["x"] = {k: base64.b64encode(v).decode() for k, v in sorted(e.xattrs.items())}
    if e.chunks:
        out["c"] = [[c.digest, c.size, c.offset] for c in e.chunks]
    return out


def dumps(index: LayerIndex) -> bytes:
    doc: dict[str, Any] = {
        "version": FORMAT_VERSION,
        "digest": index.digest,
        "diffID": index.diff_id,
        "mediaType": index.media_type,
        "size": index.size,
        "entries": [_entry_to_json(e) for e in index.entries],
    }
    if index.toc:
        doc["toc"] = {
            "format": index.toc,
            "digest": index.toc_digest,
            "spans": {d: [s.start, s.end, s.inner] for d, s in sorted(index.spans.items())},
        }
    return json.dumps(doc, separators=(",", ":")).encode()


def _int(raw: Any, what: str) -> int:
    if not isinstance(raw, int) or isinstance(raw, bool) or raw < 0:
        raise BadIndex(f"{what} is not a non-negative integer")
    return raw


def _str(raw: Any, what: str) -> str:
    if not isinstance(raw, str):
        raise BadIndex(f"{what} is not a string")
    return raw


def _entry_from_json(raw: Any) -> Entry:
    if not isinstance(raw, dict):
        raise BadIndex("entry is not an object")
    try:
        kind = Kind(raw.get("k"))
    except ValueError:
        raise BadIndex(f"unknown entry kind {raw.get('k')!r}") from None
    path = _str(raw.get("p"), "path")
    chunks = []
    for c in raw.get("c", []):
        if not isinstance(c, list) or len(c) != 3:
            raise BadIndex("chunk is not [digest, size, offset]")
        digest = _str(c[0], "chunk digest")
        if not digest.startswith("sha256:") or len(digest) != 71:
            raise BadIndex(f"bad chunk digest {digest!r}")
        chunks.append(Chunk(digest, _int(c[1], "chunk size"), _int(c[2], "chunk offset")))
    xattrs = raw.get("x", {})
    if not isinstance(xattrs, dict):
        raise BadIndex("xattrs is not an object")
    try:
        decoded = {
            _str(k, "xattr name"): base64.b64decode(_str(v, "xattr"), validate=True)
            for k, v in xattrs.items()
        }
    except ValueError as exc:
        raise BadIndex(f"bad xattr value: {exc}") from None
    dev = raw.get("d", [0, 0])
    if not isinstance(dev, list) or len(dev) != 2:
        raise BadIndex("device is not [major, minor]")
    size = _int(raw.get("s", 0), "size")
    if sum(c.size for c in chunks) != (size if chunks else 0):
        raise BadIndex(f"chunks of {path!r} do not add up to its size")
    return Entry(
        path=path,
        kind=kind,
        mode=_int(raw.get("m", 0o644), "mode") & 0o7777,
        uid=_int(raw.get("u", 0), "uid"),
        gid=_int(raw.get("g", 0), "gid"),
        mtime_ns=_int(raw.get("t", 0), "mtime"),
        size=size,
        link=_str(raw.get("l", ""), "link"),
        devmajor=_int(dev[0], "devmajor"),
        devminor=_int(dev[1], "devminor"),
        xattrs=decoded,
        chunks=tuple(chunks),
    )


def loads(raw: bytes) -> LayerIndex:
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadIndex(f"not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise BadIndex("not a JSON object")
    if doc.get("version") != FORMAT_VERSION:
        raise BadIndex(f"unknown layer index version {doc.get('version')!r}")
    entries = doc.get("entries")
    if not isinstance(entries, list):
        raise BadIndex("entries is not a list")
    index = LayerIndex(
        digest=_str(doc.get("digest"), "digest"),
        diff_id=_str(doc.get("diffID"), "diffID"),
        media_type=_str(doc.get("mediaType"), "mediaType"),
        size=_int(doc.get("size"), "size"),
        entries=tuple(_entry_from_json(e) for e in entries),
        **_toc_from_json(doc.get("toc")),
    )
    if index.toc:
        for e in index.entries:
            for c in e.chunks:
                if c.digest not in index.spans:
                    raise BadIndex(f"chunk {c.digest} of {e.path!r} has no span")
    return index


def _toc_from_json(raw: Any) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise BadIndex("toc is not an object")
    fmt = _str(raw.get("format"), "toc format")
    if fmt not in ("estargz", "zstd:chunked"):
        raise BadIndex(f"unknown toc format {fmt!r}")
    spans_raw = raw.get("spans")
    if not isinstance(spans_raw, dict):
        raise BadIndex("toc spans is not an object")
    spans = {}
    for digest, s in spans_raw.items():
        if not isinstance(s, list) or len(s) != 3:
            raise BadIndex("span is not [start, end, inner]")
        start, end, inner = (_int(v, "span offset") for v in s)
        if end <= start:
            raise BadIndex(f"span of {digest!r} is empty")
        spans[digest] = Span(start, end, inner)
    return {"toc": fmt, "toc_digest": _str(raw.get("digest"), "toc digest"), "spans": spans}
