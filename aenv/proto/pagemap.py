"""Memory images in the store as pages: the page map and the dedup plan (sans-IO).

A memory image file is cut into PAGE_SIZE pages (gVisor's `pages.img` is a
run of 4 KiB guest pages; its state file is cut the same way). Each page is
named by the first HASH_BYTES of its SHA-256. Pages are stored in packs: a
pack holds up to PACK_PAGES pages, each padded to PAGE_SIZE, and is one
content-addressed blob (compressed by the storage layer). A `PageMap` says,
for one file, which pack and slot each page comes from, so a later snapshot
of the same sandbox stores only the pages that changed and points at the
packs of earlier snapshots for the rest.

`plan` is the dedup decision: given the page hashes of a new file and what
earlier maps offer (`known`), it reuses stored pages, packs the new ones in
file order (a page repeated within the file is packed once), and declines a
stored pack the file would use for less than 1/SPARSE_REUSE of its pages,
so a restore never downloads a pack mostly for pages it does not need.

`restore_plan` is the restore's decision: pages a local file already holds
(found by hash through `local_offers`: an earlier snapshot of the same
sandbox on this node) are copied from it, and only the packs holding the
other pages are fetched, in the order of the file's first page from each.

The encoded map (`encode` / `decode`) is binary:

    b"AENVPM1\\0", u64 size, u32 pages, u32 packs     (little-endian)
    packs x (32-byte raw sha256 digest, u32 pages)
    pages x HASH_BYTES page hash
    pages x (u32 pack index, u32 slot)
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

PAGE_SIZE = 4096
PACK_PAGES = 256
HASH_BYTES = 16
SPARSE_REUSE = 8
MAGIC = b"AENVPM1\0"
_HEAD = struct.Struct("<QII")
_PACK = struct.Struct("<32sI")
_MAX_PAGES = 1 << 28  # 1 TiB of 4 KiB pages: anything larger is not a map we wrote


class BadPageMap(ValueError):
    """Bytes that are not a well-formed page map."""


@dataclass(frozen=True)
class Pack:
    digest: str  # "sha256:<64 hex>" of the stored blob
    pages: int  # pages it holds (slots 0 .. pages-1)


@dataclass(frozen=True, eq=False)
class PageMap:
    """Where every page of one file lives; see the module docstring."""

    size: int  # bytes of the file
    packs: tuple[Pack, ...]
    hashes: bytes  # pages * HASH_BYTES
    refs: array[int]  # pages * 2 unsigned ints: pack index, slot

    @property
    def pages(self) -> int:
        return len(self.hashes) // HASH_BYTES

    def page_hash(self, i: int) -> bytes:
        return self.hashes[i * HASH_BYTES : (i + 1) * HASH_BYTES]

    def ref(self, i: int) -> tuple[int, int]:
        return self.refs[2 * i], self.refs[2 * i + 1]

    def page_len(self, i: int) -> int:
        """Bytes of page `i` in the file (the last one may be short)."""
        return min(PAGE_SIZE, self.size - i * PAGE_SIZE)

    def placements(self) -> dict[int, list[tuple[int, int]]]:
        """For each pack index used: (page, slot) pairs, in page order."""
        out: dict[int, list[tuple[int, int]]] = {}
        for i in range(self.pages):
            p, slot = self.ref(i)
            out.setdefault(p, []).append((i, slot))
        return out

    def offers(self) -> Iterator[tuple[bytes, Pack, int]]:
        """(page hash, pack, slot) for every page: what a later plan may reuse."""
        for i in range(self.pages):
            p, slot = self.ref(i)
            yield self.page_hash(i), self.packs[p], slot


def pages_of(size: int) -> int:
    return -(-size // PAGE_SIZE)


def encode(m: PageMap) -> bytes:
    out = bytearray(MAGIC)
    out += _HEAD.pack(m.size, m.pages, len(m.packs))
    for pk in m.packs:
        out += _PACK.pack(bytes.fromhex(pk.digest.removeprefix("sha256:")), pk.pages)
    out += m.hashes
    refs = array("I", m.refs)
    if refs.itemsize != 4:  # pragma: no cover - every platform we run on
        raise RuntimeError("array('I') is not 32-bit here")
    if struct.pack("=I", 1) != struct.pack("<I", 1):  # pragma: no cover - big-endian host
        refs.byteswap()
    out += refs.tobytes()
    return bytes(out)


def decode(raw: bytes) -> PageMap:
    """Parse and check a map: every reference names a pack and a slot it has."""
    if not raw.startswith(MAGIC):
        raise BadPageMap("not a page map")
    pos = len(MAGIC)
    try:
        size, pages, npacks = _HEAD.unpack_from(raw, pos)
    except struct.error:
        raise BadPageMap("truncated header") from None
    pos += _HEAD.size
    if pages > _MAX_PAGES or pages != pages_of(size):
        raise BadPageMap(f"{pages} pages cannot hold {size} bytes")
    if npacks > pages:
        raise BadPageMap(f"{npacks} packs for {pages} pages")
    want = pos + npacks * _PACK.size + pages * (HASH_BYTES + 8)
    if len(raw) != want:
        raise BadPageMap(f"{len(raw)} bytes, expected {want}")
    packs = []
    for _ in range(npacks):
        digest, n = _PACK.unpack_from(raw, pos)
        pos += _PACK.size
        if not 0 < n <= PACK_PAGES:
            raise BadPageMap(f"a pack of {n} pages")
        packs.append(Pack("sha256:" + digest.hex(), n))
    hashes = raw[pos : pos + pages * HASH_BYTES]
    pos += pages * HASH_BYTES
    refs = array("I")
    refs.frombytes(raw[pos:])
    if struct.pack("=I", 1) != struct.pack("<I", 1):  # pragma: no cover - big-endian host
        refs.byteswap()
    for i in range(pages):
        p, slot = refs[2 * i], refs[2 * i + 1]
        if p >= npacks or slot >= packs[p].pages:
            raise BadPageMap(f"page {i} points at pack {p} slot {slot}, which does not exist")
    return PageMap(size=size, packs=tuple(packs), hashes=hashes, refs=refs)


@dataclass(frozen=True)
class Plan:
    """A file's pages: reused from stored packs, or new and grouped into packs to write.

    `groups[k]` lists the file's page numbers that form new pack k, in slot
    order. `finish` turns the plan into a PageMap once the new packs are
    built and their digests known.
    """

    size: int
    hashes: bytes
    old: tuple[Pack, ...]  # stored packs the file reuses
    groups: tuple[tuple[int, ...], ...]
    # per page: ("old", index into `old`, slot) or ("new", group, slot)
    where: tuple[tuple[bool, int, int], ...]

    @property
    def reused_pages(self) -> int:
        return sum(1 for is_old, _p, _s in self.where if is_old)

    def finish(self, new: Sequence[str]) -> PageMap:
        if len(new) != len(self.groups):
            raise ValueError(f"{len(new)} digests for {len(self.groups)} new packs")
        packs = self.old + tuple(Pack(d, len(g)) for d, g in zip(new, self.groups, strict=True))
        refs = array("I")
        base = len(self.old)
        for is_old, p, slot in self.where:
            refs.append(p if is_old else base + p)
            refs.append(slot)
        return PageMap(size=self.size, packs=packs, hashes=self.hashes, refs=refs)


def plan(size: int, hashes: bytes, known: Mapping[bytes, tuple[Pack, int]]) -> Plan:
    """Decide, page by page, what a file reuses and what it must store; see the module."""
    npages = pages_of(size)
    if len(hashes) != npages * HASH_BYTES:
        raise ValueError(f"{len(hashes)} hash bytes for {npages} pages")
    page = [hashes[i * HASH_BYTES : (i + 1) * HASH_BYTES] for i in range(npages)]
    sizes = {pk.digest: pk.pages for pk, _slot in known.values()}
    uses: dict[str, int] = {}
    for h in page:
        hit = known.get(h)
        if hit is not None:
            uses[hit[0].digest] = uses.get(hit[0].digest, 0) + 1
    keep = {d for d, n in uses.items() if n * SPARSE_REUSE >= sizes[d]}
    old: list[Pack] = []
    old_index: dict[str, int] = {}
    groups: list[list[int]] = []
    new_at: dict[bytes, tuple[int, int]] = {}
    where: list[tuple[bool, int, int]] = []
    for i, h in enumerate(page):
        hit = known.get(h)
        if hit is not None and hit[0].digest in keep:
            pk, slot = hit
            if pk.digest not in old_index:
                old_index[pk.digest] = len(old)
                old.append(pk)
            where.append((True, old_index[pk.digest], slot))
            continue
        seen = new_at.get(h)
        if seen is not None:
            where.append((False, *seen))
            continue
        if not groups or len(groups[-1]) == PACK_PAGES:
            groups.append([])
        at = (len(groups) - 1, len(groups[-1]))
        groups[-1].append(i)
        new_at[h] = at
        where.append((False, *at))
    return Plan(
        size=size,
        hashes=hashes,
        old=tuple(old),
        groups=tuple(tuple(g) for g in groups),
        where=tuple(where),
    )


@dataclass(frozen=True)
class RestorePlan:
    """How to rebuild one file from its map: some pages copied from local files
    (`local`: page, source, page in the source), the rest from their packs
    (`packs`: pack index and the (page, slot) pairs it gives, in the order of
    the file's first page from each pack, the order a runtime reads the file)."""

    local: tuple[tuple[int, int, int], ...]
    packs: tuple[tuple[int, tuple[tuple[int, int], ...]], ...]

    @property
    def fetched_pages(self) -> int:
        return sum(len(pairs) for _p, pairs in self.packs)


def local_offers(sources: Sequence[bytes]) -> dict[bytes, tuple[int, int]]:
    """Page hash -> (source, page) for the page hashes of local files (`sources`,
    HASH_BYTES per page each); the first offer of a hash wins."""
    out: dict[bytes, tuple[int, int]] = {}
    for k, hashes in enumerate(sources):
        for i in range(len(hashes) // HASH_BYTES):
            out.setdefault(hashes[i * HASH_BYTES : (i + 1) * HASH_BYTES], (k, i))
    return out


def restore_plan(
    m: PageMap,
    offers: Mapping[bytes, tuple[int, int]],
    *,
    fetch: frozenset[int] = frozenset(),
) -> RestorePlan:
    """Which pages of `m` come from local files and which packs must be fetched:
    a page a local file offers (same hash) is copied unless it is in `fetch`
    (a copy that turned out not to match); a pack is fetched only for the
    pages nothing local offers, and writes only those."""
    local: list[tuple[int, int, int]] = []
    packs: dict[int, list[tuple[int, int]]] = {}
    for i in range(m.pages):
        hit = None if i in fetch else offers.get(m.page_hash(i))
        if hit is not None:
            local.append((i, *hit))
            continue
        p, slot = m.ref(i)
        packs.setdefault(p, []).append((i, slot))
    return RestorePlan(
        local=tuple(local), packs=tuple((p, tuple(pairs)) for p, pairs in packs.items())
    )


def known_from(
    maps: Sequence[PageMap], *, missing: frozenset[str] = frozenset()
) -> dict[bytes, tuple[Pack, int]]:
    """The pages `maps` offer (first offer wins), leaving out packs in `missing`."""
    out: dict[bytes, tuple[Pack, int]] = {}
    for m in maps:
        for h, pk, slot in m.offers():
            if pk.digest not in missing and h not in out:
                out[h] = (pk, slot)
    return out


__all__ = [
    "HASH_BYTES",
    "PACK_PAGES",
    "PAGE_SIZE",
    "SPARSE_REUSE",
    "BadPageMap",
    "Pack",
    "PageMap",
    "Plan",
    "RestorePlan",
    "decode",
    "encode",
    "known_from",
    "local_offers",
    "pages_of",
    "plan",
    "restore_plan",
]
