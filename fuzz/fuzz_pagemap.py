"""Fuzz memory-image page maps, `aenv.proto.pagemap` (sans-IO).

Inputs are arbitrary bytes, real encoded maps with bytes flipped, cut or
appended, and sequences of images whose pages repeat, move and change.
The rules: `decode` returns a `PageMap` or raises `BadPageMap`, nothing
else, and a map it returns only points at packs and slots that exist; a
plan against any earlier maps, replayed from its packs, gives back the
image byte for byte, never stores a page twice, and reuses a stored pack
only for at least 1/SPARSE_REUSE of its pages. Runs under pytest (short:
200 examples; `AENV_FUZZ_LONG=1`: 50 000; `AENV_FUZZ_EXAMPLES=N`: N) or
standalone with `python fuzz/fuzz_pagemap.py` (atheris if importable, else
repeated hypothesis rounds).
"""

from __future__ import annotations

import contextlib
import hashlib
import sys
from collections.abc import Callable

from _harness import FUZZ, main
from hypothesis import given
from hypothesis import strategies as st

from aenv.proto.pagemap import (
    HASH_BYTES,
    PAGE_SIZE,
    SPARSE_REUSE,
    BadPageMap,
    PageMap,
    decode,
    encode,
    known_from,
    plan,
)

# Small distinct page contents: page k is k repeated; images are lists of k.
_PAGE = {k: bytes([k]) * PAGE_SIZE for k in range(64)}


def _image(ks: list[int], tail: int) -> bytes:
    return b"".join(_PAGE[k] for k in ks) + b"t" * tail


def _hashes(data: bytes) -> bytes:
    return b"".join(
        hashlib.sha256(data[i : i + PAGE_SIZE]).digest()[:HASH_BYTES]
        for i in range(0, len(data), PAGE_SIZE)
    )


def _check_refs(m: PageMap) -> None:
    for i in range(m.pages):
        p, slot = m.ref(i)
        assert p < len(m.packs) and slot < m.packs[p].pages


@FUZZ
@given(raw=st.binary(max_size=512))
def test_decode_arbitrary(raw: bytes) -> None:
    with contextlib.suppress(BadPageMap):
        _check_refs(decode(raw))


images = st.lists(
    st.tuples(st.lists(st.integers(0, 63), max_size=700), st.integers(0, PAGE_SIZE - 1)),
    min_size=1,
    max_size=4,
)


@FUZZ
@given(seq=images, data=st.data())
def test_plans_replay_and_mangled_maps_fail_cleanly(
    seq: list[tuple[list[int], int]], data: st.DataObject
) -> None:
    packs: dict[str, bytes] = {}
    maps: list[PageMap] = []
    for ks, tail in seq:
        img = _image(ks, tail)
        known = known_from(maps[-2:])
        p = plan(len(img), _hashes(img), known)
        new = []
        for group in p.groups:
            blob = b"".join(
                img[i * PAGE_SIZE : (i + 1) * PAGE_SIZE].ljust(PAGE_SIZE, b"\0") for i in group
            )
            digest = "sha256:" + hashlib.sha256(blob).hexdigest()
            packs.setdefault(digest, blob)
            new.append(digest)
        stored = [
            h
            for g in p.groups
            for h in (_hashes(img)[i * HASH_BYTES : (i + 1) * HASH_BYTES] for i in g)
        ]
        assert len(stored) == len(set(stored)), "a page stored twice"
        m = decode(encode(p.finish(new)))
        used: dict[int, int] = {}
        out = bytearray(m.size)
        for i in range(m.pages):
            pk, slot = m.ref(i)
            used[pk] = used.get(pk, 0) + 1
            page = packs[m.packs[pk].digest][slot * PAGE_SIZE : (slot + 1) * PAGE_SIZE]
            out[i * PAGE_SIZE : i * PAGE_SIZE + m.page_len(i)] = page[: m.page_len(i)]
        assert bytes(out) == img
        for pk, n in used.items():
            if pk < len(p.old):  # a pack of an earlier image
                assert n * SPARSE_REUSE >= m.packs[pk].pages
        maps.append(m)
    raw = bytearray(encode(maps[-1]))
    if raw:
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] ^= data.draw(st.integers(1, 255))
    cut = data.draw(st.integers(0, len(raw)))
    with contextlib.suppress(BadPageMap):
        _check_refs(decode(bytes(raw[:cut])))


TESTS: tuple[Callable[[], None], ...] = (
    test_decode_arbitrary,
    test_plans_replay_and_mangled_maps_fail_cleanly,
)


if __name__ == "__main__":
    sys.exit(main(TESTS, __doc__ or ""))
