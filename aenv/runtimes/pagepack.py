"""Hibernated memory images stored as their difference from the image they came from.

A hibernated gVisor sandbox's memory image is mostly the memory image it was
restored from (its template's, or a snapshot's): an idle sandbox has written
to few of its pages since. Uncompressed (`AENV_CHECKPOINT_COMPRESSION=none`),
runsc writes the guest's memory as `pages.img`, whole pages one after the
other (`pages_meta.img` says where each goes). `pack` replaces it with:

- `pages.base`: a hard link to the base's `pages.img` (no space; it keeps the
  base alive when its snapshot is deleted, and travels with the directory
  when the image is linked or copied);
- `pages.pack`: for each page of `pages.img`, the index of an equal page of
  the base or of a page of its own, then its own pages, zlib-compressed
  (fast level), and the CRC-32 and size of the whole `pages.img`.

`unpack` writes a whole image (the other files linked, `pages.img` from
the pack and the base, checked against that CRC) into a directory of the
restore's own, which `runsc restore` reads and the driver removes once
restored: the packed image is never changed, so restores from it may run
at once (fork children). Every step of `pack` leaves a directory that
restores: `pages.img` is removed only once the pack and the base link are
in place, and where `pages.img` exists it is used as it is.

The format is `MAGIC`, then a little-endian header (page size, page count,
own pages, CRC-32 and size of `pages.img`, length of the compressed own
pages), the page map (`int32` each: >= 0 an index into the base, < 0 the
own page `-1 - n`), and the compressed own pages.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import struct
import sys
import zlib
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "PAGES",
    "PackError",
    "Packed",
    "base_of",
    "is_packed",
    "pack",
    "unpack",
]

PAGES = "pages.img"
PACK = "pages.pack"
BASE = "pages.base"
MAGIC = b"aenv-pagepack-1\n"
PAGE = 4096
_HEADER = struct.Struct("<IIIIQQ")  # page size, pages, own pages, crc32, size, packed own


class PackError(Exception):
    """A pack that cannot be unpacked (damaged, or its base is not the one it was made on)."""


@dataclass(frozen=True)
class Packed:
    """What `pack` did: pages in all, of them found in the base, bytes written."""

    pages: int
    shared: int
    written: int


def is_packed(image_dir: Path) -> bool:
    """Whether `image_dir` holds a pack and no `pages.img` (it needs `unpack`)."""
    return (image_dir / PACK).is_file() and not (image_dir / PAGES).exists()


def base_of(image_dir: Path) -> Path | None:
    """The page file an image of a sandbox restored from `image_dir` is packed
    against: that image's own base if it is packed (a pack is never stacked
    on a pack), else its `pages.img`; None if neither is there."""
    for name in (BASE, PAGES):
        path = image_dir / name
        if path.is_file():
            return path
    return None


def pack(image_dir: Path, base: Path) -> Packed | None:
    """Replace `image_dir`'s `pages.img` by its difference from `base` (blocking).

    None (and `pages.img` left) where it does not apply: no `pages.img`, a
    size that is not whole pages (a compressed image), or a base on another
    file system (no hard link).
    """
    pages_path = image_dir / PAGES
    try:
        size = pages_path.stat().st_size
        base_size = base.stat().st_size
    except FileNotFoundError:
        return None
    if size % PAGE or base_size % PAGE or size >= 1 << 44:
        return None
    base_link = image_dir / BASE
    tmp_link = image_dir / (BASE + ".tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp_link.unlink()
    try:
        os.link(base, tmp_link)
    except OSError:  # (another file system)
        return None
    try:
        # mapped, not read: the node's heap never holds the images
        with _mapped(pages_path) as data, _mapped(base) as base_data:
            body, own = _diff(data, base_data)
        tmp_pack = image_dir / (PACK + ".tmp")
        tmp_pack.write_bytes(body)
        tmp_pack.rename(image_dir / PACK)
        tmp_link.rename(base_link)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp_link.unlink()
        raise
    pages_path.unlink()
    n = size // PAGE
    return Packed(pages=n, shared=n - own, written=len(body))


def _diff(data: memoryview, base: memoryview) -> tuple[bytes, int]:
    """The pack of `data` against `base`, with its count of own pages."""
    index: dict[memoryview, int] = {}
    for i in range(len(base) // PAGE - 1, -1, -1):  # (the first of equal pages wins)
        index[base[i * PAGE : (i + 1) * PAGE]] = i
    pages = len(data) // PAGE
    page_map = array("i", bytes(4 * pages))
    own = zlib.compressobj(1)
    packed = []
    n_own = 0
    for i in range(pages):
        page = data[i * PAGE : (i + 1) * PAGE]
        at = index.get(page)
        if at is None:
            page_map[i] = -1 - n_own
            n_own += 1
            packed.append(own.compress(page))
        else:
            page_map[i] = at
    packed.append(own.flush())
    own_bytes = b"".join(packed)
    crc = zlib.crc32(data)
    if sys.byteorder != "little":  # pragma: no cover
        page_map.byteswap()
    header = _HEADER.pack(PAGE, pages, n_own, crc, len(data), len(own_bytes))
    return MAGIC + header + page_map.tobytes() + own_bytes, n_own


def unpack(image_dir: Path, dest: Path) -> None:
    """Make `dest` a whole image of packed `image_dir`, for one restore (blocking).

    `dest` (replaced if it exists) gets hard links to (or copies of) the
    image's other files and its `pages.img` written from the pack and the
    base; `image_dir` is not changed, so any number of restores may unpack
    it at once, each into a directory of its own. Raises PackError for a
    pack that does not give back the image it was made of.
    """
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for f in image_dir.iterdir():
        if f.name in (PACK, BASE) or not f.is_file():
            continue
        try:
            os.link(f, dest / f.name)
        except OSError:  # (another file system)
            shutil.copy2(f, dest / f.name)
    body = (image_dir / PACK).read_bytes()
    with _mapped(image_dir / BASE) as base:
        _write_unpacked(dest, body, base, name=image_dir / PACK)


@contextlib.contextmanager
def _mapped(path: Path) -> Iterator[memoryview]:
    """`path`'s bytes, mapped read-only (an empty file: empty)."""
    with path.open("rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            yield memoryview(b"")
            return
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    view = memoryview(m)
    try:
        yield view
    finally:
        # (slices still held by a traceback keep it mapped until collected)
        with contextlib.suppress(BufferError):
            view.release()
            m.close()


def _write_unpacked(dest: Path, body: bytes, base: memoryview, *, name: Path) -> None:
    head = len(MAGIC) + _HEADER.size
    if body[: len(MAGIC)] != MAGIC or len(body) < head:
        raise PackError(f"{name}: not a page pack")
    page, pages, n_own, crc, size, packed_len = _HEADER.unpack_from(body, len(MAGIC))
    if page != PAGE or size != pages * PAGE or len(body) != head + 4 * pages + packed_len:
        raise PackError(f"{name}: damaged header")
    page_map = array("i")
    page_map.frombytes(body[head : head + 4 * pages])
    if sys.byteorder != "little":  # pragma: no cover
        page_map.byteswap()
    try:
        own = zlib.decompress(body[head + 4 * pages :])
    except zlib.error as e:
        raise PackError(f"{name}: {e}") from None
    if len(own) != n_own * PAGE:
        raise PackError(f"{name}: {len(own)} bytes of own pages, not {n_own * PAGE}")
    own_view = memoryview(own)
    if any(at >= len(base) // PAGE for at in page_map):
        raise PackError(f"{name}: a page beyond its base")
    got = 0
    tmp = dest / (PAGES + ".tmp")
    with tmp.open("wb") as out:
        for source, start, count in _runs(page_map):
            with (base if source else own_view)[start * PAGE : (start + count) * PAGE] as chunk:
                got = zlib.crc32(chunk, got)
                out.write(chunk)
    if got != crc:
        tmp.unlink()
        raise PackError(f"{name}: pages do not match the image packed (CRC)")
    tmp.rename(dest / PAGES)


def _runs(page_map: array[int]) -> list[tuple[bool, int, int]]:
    """The page map as runs of consecutive pages: (from the base, first, count)."""
    runs: list[tuple[bool, int, int]] = []
    source, start, count = True, 0, 0
    for at in page_map:
        is_base, n = (True, at) if at >= 0 else (False, -1 - at)
        if count and is_base == source and n == start + count:
            count += 1
            continue
        if count:
            runs.append((source, start, count))
        source, start, count = is_base, n, 1
    if count:
        runs.append((source, start, count))
    return runs
