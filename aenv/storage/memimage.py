"""Memory image files as pages and packs: the blocking file work (see aenv.proto.pagemap).

`hash_pages` names every page of a file; `build_pack` reads the pages a
plan groups into one new pack, pads each to a full page and compresses the
run with zstd (deterministic for the same input, so a retried upload makes
the same blob); `open_pack` reverses it and checks the page count;
`write_pages` puts a pack's pages at their offsets in a file being
restored. Page maps travel zstd-compressed too (`pack_map` / `unpack_map`).
Nothing here talks to the store.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

import zstandard

from aenv.proto.pagemap import HASH_BYTES, PAGE_SIZE, BadPageMap, Pack, PageMap, decode, encode

ZSTD_LEVEL = 3
_READ = 256 * PAGE_SIZE
_MAX_MAP_BYTES = 1 << 30


class BadPack(ValueError):
    """A pack that does not decompress to the pages its map says it holds."""


def hash_pages(path: Path) -> tuple[int, bytes]:
    """The file's size and the HASH_BYTES-long hash of each of its pages."""
    out = bytearray()
    size = 0
    with path.open("rb") as f:
        while block := f.read(_READ):
            size += len(block)
            for i in range(0, len(block), PAGE_SIZE):
                out += hashlib.sha256(block[i : i + PAGE_SIZE]).digest()[:HASH_BYTES]
    return size, bytes(out)


def build_pack(path: Path, pages: Sequence[int]) -> bytes:
    """The compressed blob of a new pack: `pages` of `path`, each padded to PAGE_SIZE."""
    raw = bytearray()
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        for i in pages:
            page = os.pread(fd, PAGE_SIZE, i * PAGE_SIZE)
            raw += page
            if len(page) < PAGE_SIZE:
                raw += bytes(PAGE_SIZE - len(page))
    finally:
        os.close(fd)
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(bytes(raw))


def open_pack(data: bytes, pack: Pack) -> bytes:
    """The padded pages of a pack blob (already verified against its digest)."""
    want = pack.pages * PAGE_SIZE
    try:
        raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=want)
    except zstandard.ZstdError as exc:
        raise BadPack(f"does not decompress: {exc}") from None
    if len(raw) != want:
        raise BadPack(f"holds {len(raw)} bytes, expected {pack.pages} pages")
    return raw


def write_pages(path: Path, m: PageMap, raw: bytes, placements: Sequence[tuple[int, int]]) -> None:
    """Write the (page, slot) pairs of one pack's pages `raw` into `path`."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        for i, slot in placements:
            at = slot * PAGE_SIZE
            os.pwrite(fd, raw[at : at + m.page_len(i)], i * PAGE_SIZE)
    finally:
        os.close(fd)


def pack_map(m: PageMap) -> bytes:
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(encode(m))


def unpack_map(data: bytes) -> PageMap:
    try:
        raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=_MAX_MAP_BYTES)
    except zstandard.ZstdError as exc:
        raise BadPageMap(f"does not decompress: {exc}") from None
    return decode(raw)


def blob_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


__all__ = [
    "BadPack",
    "blob_digest",
    "build_pack",
    "hash_pages",
    "open_pack",
    "pack_map",
    "unpack_map",
    "write_pages",
]
