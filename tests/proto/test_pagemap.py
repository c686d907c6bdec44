"""The page map and dedup plan of memory images (aenv.proto.pagemap), without a store.

Rules: plans are checked by replaying them - every page of the new file must
come from a slot holding exactly its bytes - and maps by an encode/decode
round trip; any mangled map must raise BadPageMap and nothing else.
"""

from __future__ import annotations

import hashlib
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aenv.proto.pagemap import (
    HASH_BYTES,
    PACK_PAGES,
    PAGE_SIZE,
    BadPageMap,
    Pack,
    PageMap,
    RestorePlan,
    decode,
    encode,
    known_from,
    local_offers,
    pages_of,
    plan,
    restore_plan,
)


def _hashes(data: bytes) -> bytes:
    return b"".join(
        hashlib.sha256(data[i : i + PAGE_SIZE]).digest()[:HASH_BYTES]
        for i in range(0, len(data), PAGE_SIZE)
    )


def _digest(n: int) -> str:
    return "sha256:" + hashlib.sha256(str(n).encode()).hexdigest()


class Store:
    """Packs by digest, as the store would hold them: padded pages."""

    def __init__(self) -> None:
        self.packs: dict[str, list[bytes]] = {}
        self.n = 0

    def save(self, data: bytes, known: dict[bytes, tuple[Pack, int]]) -> tuple[PageMap, int]:
        """Plan `data`, 'upload' its new packs; returns its map and the new pages stored."""
        p = plan(len(data), _hashes(data), known)
        new = []
        for group in p.groups:
            self.n += 1
            d = _digest(self.n)
            self.packs[d] = [
                data[i * PAGE_SIZE : (i + 1) * PAGE_SIZE].ljust(PAGE_SIZE, b"\0") for i in group
            ]
            new.append(d)
        return p.finish(new), sum(len(g) for g in p.groups)

    def load(self, m: PageMap) -> bytes:
        out = bytearray(m.size)
        for i in range(m.pages):
            p, slot = m.ref(i)
            page = self.packs[m.packs[p].digest][slot]
            out[i * PAGE_SIZE : i * PAGE_SIZE + m.page_len(i)] = page[: m.page_len(i)]
        return bytes(out)


def _pages(n: int) -> list[bytes]:
    return [os.urandom(PAGE_SIZE) for _ in range(n)]


def test_a_changed_image_stores_only_its_new_pages() -> None:
    store = Store()
    pages = _pages(600)
    first = b"".join(pages)
    m1, stored1 = store.save(first, {})
    assert stored1 == 600 and len(m1.packs) == pages_of(len(first)) // PACK_PAGES + 1
    assert store.load(m1) == first
    # 40 pages rewritten, 10 appended, the tail shifted by one page (pages move in gVisor's file)
    changed = pages[:100] + _pages(40) + pages[140:300] + [os.urandom(PAGE_SIZE)] + pages[300:]
    changed += _pages(10)
    second = b"".join(changed)
    m2, stored2 = store.save(second, known_from([m1]))
    assert store.load(m2) == second
    assert stored2 == 51
    assert decode(encode(m2)).refs == m2.refs


def test_a_page_repeated_in_the_file_is_stored_once() -> None:
    store = Store()
    page = os.urandom(PAGE_SIZE)
    data = page * 300 + b"tail"
    m, stored = store.save(data, {})
    assert stored == 2  # the page and the short tail
    assert store.load(m) == data


def test_a_pack_the_file_barely_uses_is_not_reused() -> None:
    store = Store()
    old = _pages(PACK_PAGES)
    m1, _ = store.save(b"".join(old), {})
    # reuses 1/16 of the old pack: below 1/SPARSE_REUSE, so the 16 pages are stored again
    data = b"".join(old[:16] + _pages(200))
    m2, stored = store.save(data, known_from([m1]))
    assert stored == 216 and m1.packs[0] not in m2.packs
    # reuses a half: kept
    data = b"".join(old[:128] + _pages(10))
    m3, stored = store.save(data, known_from([m1]))
    assert stored == 10 and m1.packs[0] in m3.packs
    assert store.load(m3) == data


def test_missing_packs_are_not_offered() -> None:
    store = Store()
    m1, _ = store.save(b"".join(_pages(10)), {})
    assert known_from([m1], missing=frozenset({m1.packs[0].digest})) == {}


def test_an_empty_file() -> None:
    m, stored = Store().save(b"", {})
    assert stored == 0 and m.pages == 0 and decode(encode(m)).size == 0


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 3 * PACK_PAGES * PAGE_SIZE // 2), min_size=1, max_size=4),
    seed=st.integers(0, 2**32),
)
def test_any_sequence_of_images_round_trips(sizes: list[int], seed: int) -> None:
    store = Store()
    maps: list[PageMap] = []
    base = hashlib.sha256(str(seed).encode()).digest() * (1 + max(sizes) // 32)
    for k, size in enumerate(sizes):
        # mostly the same bytes, a few pages differing per image
        data = bytearray(base[:size])
        for i in range(0, size, 7 * PAGE_SIZE):
            data[i] = (data[i] + k) % 256
        m, _ = store.save(bytes(data), known_from(maps[-2:]))
        assert store.load(decode(encode(m))) == bytes(data)
        maps.append(m)


def _sample_map() -> bytes:
    return encode(Store().save(b"".join(_pages(300)) + b"x", {})[0])


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_a_mangled_map_raises_only_badpagemap(data: st.DataObject) -> None:
    raw = bytearray(SAMPLE)
    action = data.draw(st.sampled_from(["truncate", "flip", "extend"]))
    if action == "truncate":
        del raw[data.draw(st.integers(0, len(raw) - 1)) :]
    elif action == "extend":
        raw += data.draw(st.binary(min_size=1, max_size=64))
    else:
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] ^= data.draw(st.integers(1, 255))
    try:
        m = decode(bytes(raw))
    except BadPageMap:
        return
    # a flipped hash byte or digest still parses: every reference must stay in range
    for i in range(m.pages):
        p, slot = m.ref(i)
        assert slot < m.packs[p].pages


SAMPLE = _sample_map()


def test_garbage_is_not_a_map() -> None:
    for raw in (b"", b"AENVPM1\0", b"{}", SAMPLE[:-1], SAMPLE + b"\0"):
        with pytest.raises(BadPageMap):
            decode(raw)


def _rebuild(
    m: PageMap, store: Store, locals_: list[bytes], fetch: frozenset[int] = frozenset()
) -> tuple[bytes, RestorePlan]:
    """What a restore following `restore_plan` writes, and the packs it fetched."""
    rp = restore_plan(m, local_offers([_hashes(x) for x in locals_]), fetch=fetch)
    out = bytearray(m.size)
    for page, src, at in rp.local:
        n = m.page_len(page)
        out[page * PAGE_SIZE : page * PAGE_SIZE + n] = locals_[src][at * PAGE_SIZE :][:n]
    for p, pairs in rp.packs:
        for page, slot in pairs:
            n = m.page_len(page)
            out[page * PAGE_SIZE : page * PAGE_SIZE + n] = store.packs[m.packs[p].digest][slot][:n]
    return bytes(out), rp


def test_a_restore_copies_the_pages_a_local_image_holds_and_fetches_only_the_rest() -> None:
    store = Store()
    pages = _pages(3 * PACK_PAGES)
    first, _ = store.save(b"".join(pages), {})
    # later: 10 pages of the second pack changed, 5 inserted at the front (moving the rest)
    pages[300:310] = _pages(10)
    pages[0:0] = _pages(5)
    data = b"".join(pages) + b"tail"
    m, _ = store.save(data, known_from([first]))
    old = store.load(first)
    got, rp = _rebuild(m, store, [old])
    assert got == data
    assert rp.fetched_pages == 16  # the changed and inserted pages, and the short tail
    assert len(rp.local) == m.pages - 16
    # only packs that hold a page nothing local has are fetched, first page first
    firsts = [min(page for page, _slot in pairs) for _p, pairs in rp.packs]
    assert firsts == sorted(firsts)
    assert {m.packs[p].digest for p, _ in rp.packs} < {pk.digest for pk in m.packs}
    # with nothing local, every page comes from its pack
    got, rp = _rebuild(m, store, [])
    assert got == data and rp.fetched_pages == m.pages and not rp.local


def test_pages_a_local_copy_got_wrong_are_fetched_instead() -> None:
    store = Store()
    pages = _pages(PACK_PAGES + 3)
    m, _ = store.save(b"".join(pages), {})
    got, rp = _rebuild(m, store, [store.load(m)], fetch=frozenset({2, PACK_PAGES + 1}))
    assert got == store.load(m)
    assert sorted(page for _p, pairs in rp.packs for page, _slot in pairs) == [2, PACK_PAGES + 1]
