"""Layer conversion: one OCI layer blob in, a `LayerIndex` and its chunks out.

`LayerConverter` is fed the raw blob bytes as they arrive from the registry
(`feed`), detects the compression from the first bytes (gzip, zstd, or a
plain tar; the descriptor's media type is only a hint), checks the blob
against its descriptor digest, computes the diff_id, parses the tar stream
incrementally with `aenv.proto.tarstream`, cuts each regular file's content
into `CHUNK_SIZE` chunks and hands every chunk to the `put_chunk` callback as
soon as it is complete; `finish` returns the index. `ChunkCutter` is the
re-fetch path: fed the same blob again, it recovers the bytes of chosen
chunks by their offsets in the uncompressed stream, without parsing tar, and
verifies each one. Both are synchronous, hold O(CHUNK_SIZE) bytes at most,
and are meant to run in a worker thread; every failure is `ConversionError`.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Callable, Iterable
from typing import IO, cast

import zstandard

from aenv.proto.layerindex import CHUNK_SIZE, Chunk, Entry, Kind, LayerIndex
from aenv.proto.tarstream import (
    ArchiveEnd,
    Data,
    Member,
    MemberEnd,
    TarError,
    TarHeader,
    TarReader,
)

__all__ = [
    "ChunkCutter",
    "ConversionError",
    "LayerConverter",
    "normalise_path",
]

# Largest piece of uncompressed output produced per decompression step.
_OUT = 256 << 10
_GZIP_MAGIC = b"\x1f\x8b"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_OPAQUE = ".wh..wh..opq"
_WHITEOUT = ".wh."

_KINDS = {
    "0": Kind.FILE,
    "7": Kind.FILE,  # contiguous file: a regular file everywhere that matters
    "1": Kind.HARDLINK,
    "2": Kind.SYMLINK,
    "3": Kind.CHAR,
    "4": Kind.BLOCK,
    "5": Kind.DIR,
    "D": Kind.DIR,  # GNU dump directory: a directory plus a listing we ignore
    "6": Kind.FIFO,
}


class ConversionError(ValueError):
    """A layer blob cannot be converted (corrupt, truncated, wrong digest, bad tar)."""


def normalise_path(name: str) -> str:
    """A tar member name as a relative layer path: no leading "./" or "/", no "." or "..".

    ".." is resolved lexically; one that would climb above the root raises.
    """
    parts: list[str] = []
    for comp in name.split("/"):
        if comp in ("", "."):
            continue
        if comp == "..":
            if not parts:
                raise ConversionError(f"tar member {name!r} escapes the layer root")
            parts.pop()
        else:
            parts.append(comp)
    return "/".join(parts)


def _compression_of_media_type(media_type: str) -> str:
    if media_type.endswith(("+gzip", ".gzip")):
        return "gzip"
    if media_type.endswith(("+zstd", ".zstd")):
        return "zstd"
    if media_type.endswith(".tar"):
        return "tar"
    return "unknown"


class _ZstdFrames:
    """Follows zstd frame boundaries in the compressed input (headers only), so a
    stream cut short between or inside frames is told from a complete one."""

    def __init__(self) -> None:
        self._state = "magic"
        self._need = 4
        self._buf = bytearray()
        self._skip = 0
        self._checksum = False
        self.frames = 0

    @property
    def complete(self) -> bool:
        return self._state == "magic" and not self._buf and not self._skip and self.frames > 0

    def feed(self, data: memoryview) -> None:
        i, n = 0, len(data)
        while i < n:
            if self._skip:
                take = min(self._skip, n - i)
                i += take
                self._skip -= take
                continue
            take = min(self._need - len(self._buf), n - i)
            self._buf += data[i : i + take]
            i += take
            if len(self._buf) == self._need:
                field = bytes(self._buf)
                self._buf.clear()
                self._step(field)

    def _step(self, field: bytes) -> None:
        value = int.from_bytes(field, "little")
        if self._state == "magic":
            if value == 0xFD2FB528:
                self._state, self._need = "header", 1
            elif value & 0xFFFFFFF0 == 0x184D2A50:  # skippable frame
                self._state, self._need = "skippable", 4
            else:
                raise ConversionError("corrupt zstd stream: bad frame magic")
        elif self._state == "skippable":
            self._state, self._need, self._skip = "magic", 4, value
            self.frames += 1
        elif self._state == "header":
            single = bool(value & 0x20)
            self._checksum = bool(value & 0x04)
            fcs = ((1 if single else 0), 2, 4, 8)[value >> 6]
            self._skip = (0 if single else 1) + (0, 1, 2, 4)[value & 3] + fcs
            self._state, self._need = "block", 3
        else:  # block header: last flag, type, size
            btype, bsize = (value >> 1) & 3, value >> 3
            if btype == 3:
                raise ConversionError("corrupt zstd stream: reserved block type")
            self._skip = 1 if btype == 1 else bsize
            if value & 1:
                self._skip += 4 if self._checksum else 0
                self._state, self._need = "magic", 4
                self.frames += 1


class _Sink:
    """File-like adapter handing zstd's output pieces to a callback."""

    def __init__(self, out: Callable[[bytes], None]) -> None:
        self._out = out

    def write(self, data: bytes) -> int:
        self._out(data)
        return len(data)


class _Decompressor:
    """Raw blob bytes in; uncompressed pieces of at most `_OUT` bytes to `out`."""

    def __init__(self, out: Callable[[bytes], None], *, media_type: str) -> None:
        self._out = out
        self.claimed = _compression_of_media_type(media_type)
        self.kind = ""  # gzip | zstd | tar, once the first bytes are seen
        self._head = b""
        self._gz: zlib._Decompress | None = None
        self._gz_members = 0
        self._zframes = _ZstdFrames()
        self._zwriter: zstandard.ZstdDecompressionWriter | None = None

    def hint(self) -> str:
        if self.kind and self.claimed not in ("unknown", self.kind):
            return f" (the media type says {self.claimed}, the bytes look like {self.kind})"
        return ""

    def feed(self, data: bytes) -> None:
        if not self.kind:
            self._head += data
            if len(self._head) < len(_ZSTD_MAGIC) and self._head in (
                _GZIP_MAGIC[: len(self._head)],
                _ZSTD_MAGIC[: len(self._head)],
            ):
                return
            data, self._head = self._head, b""
            self._start(data)
        if not data:
            return
        try:
            if self.kind == "tar":
                self._out(data)
            elif self.kind == "gzip":
                self._feed_gzip(data)
            else:
                self._zframes.feed(memoryview(data))
                assert self._zwriter is not None
                self._zwriter.write(data)
        except zlib.error as exc:
            raise ConversionError(f"corrupt gzip stream: {exc}{self.hint()}") from None
        except zstandard.ZstdError as exc:
            raise ConversionError(f"corrupt zstd stream: {exc}{self.hint()}") from None

    def _start(self, head: bytes) -> None:
        if head.startswith(_GZIP_MAGIC):
            self.kind = "gzip"
        elif head.startswith(_ZSTD_MAGIC):
            self.kind = "zstd"
            self._zwriter = zstandard.ZstdDecompressor().stream_writer(
                cast(IO[bytes], _Sink(self._out)),
                write_size=_OUT,
                write_return_read=True,
                closefd=False,
            )
        else:
            self.kind = "tar"

    def _feed_gzip(self, data: bytes) -> None:
        while True:
            if self._gz is None:
                self._gz = zlib.decompressobj(wbits=31)
                self._gz_members += 1
            out = self._gz.decompress(data, _OUT)
            if out:
                self._out(out)
            if self._gz.eof:  # a member ended; what follows starts another one
                data = self._gz.unused_data
                self._gz = None
                if not data:
                    return
                continue
            data = self._gz.unconsumed_tail
            if not data and len(out) < _OUT:
                return

    def finish(self) -> None:
        if not self.kind:
            self._start(self._head)
            data, self._head = self._head, b""
            if data:
                self.feed(data)
        if self.kind == "gzip":
            if self._gz is not None or not self._gz_members:
                raise ConversionError(f"gzip stream truncated{self.hint()}")
        elif self.kind == "zstd" and not self._zframes.complete:
            raise ConversionError(f"zstd stream truncated{self.hint()}")


def _hasher(digest: str) -> hashlib._Hash:
    algo, sep, hexpart = digest.partition(":")
    if not sep or algo not in ("sha256", "sha512") or not hexpart:
        raise ConversionError(f"unsupported or malformed digest {digest!r}")
    return hashlib.new(algo)


class LayerConverter:
    """Converts one layer blob, fed in pieces, into a `LayerIndex`.

    `digest` and `size` come from the layer's descriptor; the blob must match
    both. `put_chunk(digest, data)` receives each file chunk once it is cut
    (the same content may be offered more than once; storing it is idempotent).
    """

    def __init__(
        self,
        *,
        digest: str,
        media_type: str,
        put_chunk: Callable[[str, bytes], None],
        size: int | None = None,
    ) -> None:
        self._digest = digest
        self._size = size
        self._media_type = media_type
        self._put_chunk = put_chunk
        self._blob_hash = _hasher(digest)
        self._blob_size = 0
        self._diff_hash = hashlib.sha256()
        self._decompressor = _Decompressor(self._on_tar_bytes, media_type=media_type)
        self._tar = TarReader()
        self._entries: list[Entry] = []
        # The member being read: its header, the path/kind it maps to, and for a
        # regular file the chunks cut so far and the bytes of the current one.
        self._header: TarHeader | None = None
        self._path = ""
        self._link = ""
        self._kind: Kind | None = None
        self._chunks: list[Chunk] = []
        self._buf = bytearray()
        self._finished = False

    def feed(self, data: bytes) -> None:
        if self._finished:
            raise ConversionError("feed() after finish()")
        self._blob_hash.update(data)
        self._blob_size += len(data)
        if self._size is not None and self._blob_size > self._size:
            raise ConversionError(
                f"blob {self._digest} is longer than its descriptor's {self._size} bytes"
            )
        self._decompressor.feed(data)

    def finish(self) -> LayerIndex:
        if self._finished:
            raise ConversionError("finish() called twice")
        self._finished = True
        if self._size is not None and self._blob_size != self._size:
            raise ConversionError(
                f"blob {self._digest} has {self._blob_size} bytes, its descriptor says {self._size}"
            )
        algo = self._digest.partition(":")[0]
        actual = f"{algo}:{self._blob_hash.hexdigest()}"
        if actual != self._digest:
            raise ConversionError(f"blob digest is {actual}, expected {self._digest}")
        self._decompressor.finish()
        try:
            self._tar.close()
        except TarError as exc:
            raise ConversionError(
                f"layer {self._digest}: {exc}{self._decompressor.hint()}"
            ) from None
        return LayerIndex(
            digest=self._digest,
            diff_id=f"sha256:{self._diff_hash.hexdigest()}",
            media_type=self._media_type,
            size=self._blob_size,
            entries=tuple(self._entries),
        )

    # -- uncompressed side -------------------------------------------------------

    def _on_tar_bytes(self, data: bytes) -> None:
        self._diff_hash.update(data)
        try:
            events = self._tar.feed(data)
        except TarError as exc:
            raise ConversionError(
                f"layer {self._digest}: {exc}{self._decompressor.hint()}"
            ) from None
        for ev in events:
            if isinstance(ev, Data):
                if self._kind is Kind.FILE:
                    self._file_data(ev.data)
            elif isinstance(ev, Member):
                self._begin(ev.header)
            elif isinstance(ev, MemberEnd):
                self._end()
            else:
                assert isinstance(ev, ArchiveEnd)

    def _begin(self, h: TarHeader) -> None:
        self._header, self._kind, self._link = h, None, ""
        self._chunks = []
        if h.typeflag == "V":  # a volume label, not a file
            return
        kind = _KINDS.get(h.typeflag)
        if kind is None:
            raise ConversionError(f"unsupported tar member type {h.typeflag!r} for {h.name!r}")
        path = normalise_path(h.name)
        parent, _, base = path.rpartition("/")
        if base.startswith(_WHITEOUT):
            if base == _OPAQUE:
                self._kind, self._path = Kind.OPAQUE, parent
            elif not base.startswith(_WHITEOUT + _WHITEOUT):  # others are aufs bookkeeping
                name = base[len(_WHITEOUT) :]
                if name in ("", ".", ".."):
                    raise ConversionError(f"bad whiteout name {h.name!r}")
                self._kind, self._path = Kind.WHITEOUT, f"{parent}/{name}" if parent else name
            return
        if kind is not Kind.DIR and not path:
            raise ConversionError(f"tar member {h.name!r} names the layer root but is no directory")
        if kind is Kind.HARDLINK:
            self._link = normalise_path(h.linkname)
            if not self._link:
                raise ConversionError(f"hard link {h.name!r} points at the layer root")
        elif kind is Kind.SYMLINK:
            self._link = h.linkname
        self._kind, self._path = kind, path

    def _file_data(self, data: memoryview) -> None:
        while data:
            room = CHUNK_SIZE - len(self._buf)
            if not self._buf and len(data) >= CHUNK_SIZE:
                self._cut(bytes(data[:CHUNK_SIZE]))
            else:
                self._buf += data[:room]
                if len(self._buf) == CHUNK_SIZE:
                    self._cut(bytes(self._buf))
                    self._buf.clear()
            data = data[room:]

    def _cut(self, data: bytes) -> None:
        assert self._header is not None
        digest = f"sha256:{hashlib.sha256(data).hexdigest()}"
        offset = self._header.offset + CHUNK_SIZE * len(self._chunks)
        self._chunks.append(Chunk(digest, len(data), offset))
        self._put_chunk(digest, data)

    def _end(self) -> None:
        h, kind, path = self._header, self._kind, self._path
        assert h is not None
        if kind is Kind.FILE and self._buf:
            self._cut(bytes(self._buf))
            self._buf.clear()
        self._header = self._kind = None
        if kind is None:
            return
        if kind in (Kind.WHITEOUT, Kind.OPAQUE):
            self._entries.append(Entry(path=path, kind=kind))
            return
        if kind is Kind.HARDLINK:  # the target's inode carries all the metadata
            self._entries.append(Entry(path=path, kind=kind, link=self._link))
            return
        self._entries.append(
            Entry(
                path=path,
                kind=kind,
                mode=h.mode & 0o7777,
                uid=h.uid,
                gid=h.gid,
                mtime_ns=max(h.mtime_ns, 0),
                size=h.size if kind is Kind.FILE else 0,
                link=self._link,
                devmajor=h.devmajor,
                devminor=h.devminor,
                xattrs=dict(h.xattrs),
                chunks=tuple(self._chunks),
            )
        )


class ChunkCutter:
    """Recovers chosen chunks from a layer blob fed again, by stream offset.

    `wanted` chunks (as recorded in the layer's index) are found by their
    `offset` in the uncompressed stream; each is checked against its digest and
    passed to `on_chunk(chunk, data)`. Once `done`, the rest of the blob is not
    needed and `feed` ignores it. `finish` raises if some wanted chunk was not
    found (the blob ended first).
    """

    def __init__(
        self,
        *,
        wanted: Iterable[Chunk],
        on_chunk: Callable[[Chunk, bytes], None],
        media_type: str = "",
    ) -> None:
        by_digest: dict[str, Chunk] = {}
        for c in sorted(wanted, key=lambda c: c.offset):
            by_digest.setdefault(c.digest, c)
        self._todo = sorted(by_digest.values(), key=lambda c: c.offset)
        for a, b in zip(self._todo, self._todo[1:], strict=False):
            if a.offset + a.size > b.offset:
                raise ValueError(f"wanted chunks overlap at offset {b.offset}")
        if any(c.size > CHUNK_SIZE for c in self._todo):
            raise ValueError(f"a wanted chunk is larger than {CHUNK_SIZE} bytes")
        self._next = 0
        self._on_chunk = on_chunk
        self._pos = 0  # uncompressed bytes seen
        self._buf = bytearray()
        self._decompressor = _Decompressor(self._on_bytes, media_type=media_type)

    @property
    def done(self) -> bool:
        return self._next == len(self._todo)

    @property
    def missing(self) -> tuple[Chunk, ...]:
        return tuple(self._todo[self._next :])

    def feed(self, data: bytes) -> None:
        if not self.done:
            self._decompressor.feed(data)

    def finish(self) -> None:
        if self.done:
            return
        self._decompressor.finish()
        c = self._todo[self._next]
        raise ConversionError(
            f"blob ended at uncompressed byte {self._pos} before chunk {c.digest} "
            f"at offset {c.offset} ({len(self.missing)} chunks not found)"
        )

    def _on_bytes(self, data: bytes) -> None:
        view = memoryview(data)
        start = self._pos
        self._pos += len(view)
        while self._next < len(self._todo):
            c = self._todo[self._next]
            have = len(self._buf)
            lo = c.offset + have - start  # where the next needed byte sits in `view`
            if lo >= len(view):
                return
            piece = view[lo : lo + c.size - have]
            if not have and len(piece) == c.size:
                found = bytes(piece)
            else:
                self._buf += piece
                if len(self._buf) < c.size:
                    return
                found = bytes(self._buf)
                self._buf.clear()
            actual = f"sha256:{hashlib.sha256(found).hexdigest()}"
            if actual != c.digest:
                raise ConversionError(
                    f"bytes at uncompressed offset {c.offset} hash to {actual}, not {c.digest}"
                )
            self._next += 1
            self._on_chunk(c, found)
