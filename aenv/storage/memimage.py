"""Memory image files as pages and packs: the blocking file work (see aenv.proto.pagemap).

`hash_pages` names every page of a file; `build_pack` reads the pages a
plan groups into one new pack, pads each to a full page and compresses the
run with zstd (deterministic for the same input, so a retried upload makes
the same blob); `open_pack` reverses it and checks the page count;
`write_pages` puts a pack's pages at their offsets in a file being
restored, and `place_pack` does all of it for one downloaded pack, each page
checked against its hash in the map first (`bad_page`); `copy_local_pages`
takes pages a restore finds in local files instead (checked the same way),
whose hashes `page_hashes_of` reads from beside them or computes. Page
maps travel zstd-compressed too (`pack_map` / `unpack_map`). Nothing here
talks to the store.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path

import zstandard

from aenv.proto.pagemap import (
    HASH_BYTES,
    PAGE_SIZE,
    BadPageMap,
    Pack,
    PageMap,
    decode,
    encode,
    pages_of,
)

ZSTD_LEVEL = 1  # 400 MB/s for 1/4 of the size of gVisor's pages here (level 3: 250, 0.23)
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


def _runs(pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(a, b) pairs as runs (a0, b0, n) where both go up by one page at a time."""
    runs: list[tuple[int, int, int]] = []
    for a, b in pairs:
        if runs and runs[-1][0] + runs[-1][2] == a and runs[-1][1] + runs[-1][2] == b:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((a, b, 1))
    return runs


def build_pack(path: Path, pages: Sequence[int]) -> bytes:
    """The compressed blob of a new pack: `pages` of `path`, each padded to PAGE_SIZE."""
    raw = bytearray(len(pages) * PAGE_SIZE)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        for first, slot, n in _runs([(i, k) for k, i in enumerate(pages)]):
            got = os.pread(fd, n * PAGE_SIZE, first * PAGE_SIZE)
            raw[slot * PAGE_SIZE : slot * PAGE_SIZE + len(got)] = got
    finally:
        os.close(fd)
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(raw)


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


def bad_page(m: PageMap, raw: bytes, placements: Sequence[tuple[int, int]]) -> int | None:
    """The first page of the (page, slot) pairs whose bytes in `raw` (a pack's pages)
    do not hash to the map's hash of that page; None if every one does."""
    view = memoryview(raw)
    for page, slot in placements:
        got = hashlib.sha256(view[slot * PAGE_SIZE : slot * PAGE_SIZE + m.page_len(page)])
        if got.digest()[:HASH_BYTES] != m.page_hash(page):
            return page
    return None


def place_pack(
    path: Path, m: PageMap, data: bytes, pack: Pack, placements: Sequence[tuple[int, int]]
) -> None:
    """Open a pack blob, check every page it gives `path` against its hash, write them."""
    raw = open_pack(data, pack)
    page = bad_page(m, raw, placements)
    if page is not None:
        raise BadPack(f"page {page} does not match its hash in the page map")
    write_pages(path, m, raw, placements)


def copy_local_pages(
    path: Path, m: PageMap, copies: Sequence[tuple[int, int, int]], sources: Sequence[Path]
) -> list[int]:
    """Copy pages from local files into `path`: (page, source, page in the source)
    triples, each checked against the map's hash of the page first. Returns
    the pages that were not copied (unreadable, or not what the map says)."""
    bad: list[int] = []
    fds: dict[int, int] = {}
    out = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        runs: list[tuple[int, int, int, int]] = []  # page, source, source page, n
        for page, src, at in copies:
            last = runs[-1] if runs else None
            if last and last[1] == src and last[0] + last[3] == page and last[2] + last[3] == at:
                runs[-1] = (last[0], src, last[2], last[3] + 1)
            else:
                runs.append((page, src, at, 1))
        for page, src, at, n in runs:
            try:
                if src not in fds:
                    fds[src] = os.open(sources[src], os.O_RDONLY | os.O_CLOEXEC)
                got = os.pread(fds[src], n * PAGE_SIZE, at * PAGE_SIZE)
            except OSError:
                bad.extend(range(page, page + n))
                continue
            view = memoryview(got)
            for k in range(n):
                want = m.page_len(page + k)
                piece = view[k * PAGE_SIZE : k * PAGE_SIZE + want]
                ok = len(piece) == want and (
                    hashlib.sha256(piece).digest()[:HASH_BYTES] == m.page_hash(page + k)
                )
                if ok:
                    os.pwrite(out, piece, (page + k) * PAGE_SIZE)
                else:
                    bad.append(page + k)
    finally:
        os.close(out)
        for fd in fds.values():
            os.close(fd)
    return bad


def page_hashes_of(path: Path, kept: Path | None) -> bytes:
    """The page hashes of local file `path`: those kept beside it when it was
    restored (`kept`, if there and of the right length), else computed."""
    if kept is not None:
        try:
            hashes = kept.read_bytes()
            if len(hashes) == pages_of(path.stat().st_size) * HASH_BYTES:
                return hashes
        except OSError:
            pass
    return hash_pages(path)[1]


def write_pages(path: Path, m: PageMap, raw: bytes, placements: Sequence[tuple[int, int]]) -> None:
    """Write the (page, slot) pairs of one pack's pages `raw` into `path`."""
    view = memoryview(raw)
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        for first, slot, n in _runs(placements):
            size = (n - 1) * PAGE_SIZE + m.page_len(first + n - 1)
            os.pwrite(fd, view[slot * PAGE_SIZE : slot * PAGE_SIZE + size], first * PAGE_SIZE)
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


__all__ = [
    "BadPack",
    "bad_page",
    "build_pack",
    "copy_local_pages",
    "hash_pages",
    "open_pack",
    "pack_map",
    "page_hashes_of",
    "place_pack",
    "unpack_map",
    "write_pages",
]
