"""Memory image packs on disk (aenv.storage.memimage): building, opening and placing.

Real files in tmp_path; packs are built from random pages, so nothing
compresses or repeats by chance.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import zstandard

from aenv.proto.pagemap import PAGE_SIZE, plan


def test_a_pack_places_only_pages_that_match_their_hashes(tmp_path: Path) -> None:
    """`place_pack` checks every page it writes against the map (the last one short)."""
    from aenv.storage.memimage import BadPack, bad_page, build_pack, hash_pages, place_pack

    data = os.urandom(3 * PAGE_SIZE + 100)
    src = tmp_path / "src"
    src.write_bytes(data)
    size, hashes = hash_pages(src)
    p = plan(size, hashes, {})
    blob = build_pack(src, p.groups[0])
    m = p.finish(["sha256:" + "0" * 64])
    raw = zstandard.ZstdDecompressor().decompress(blob, max_output_size=4 * PAGE_SIZE)
    placements = m.placements()[0]
    assert bad_page(m, raw, placements) is None
    out = tmp_path / "out"
    out.write_bytes(bytes(size))
    place_pack(out, m, blob, m.packs[0], placements)
    assert out.read_bytes() == data
    flipped = bytearray(raw)
    flipped[3 * PAGE_SIZE + 5] ^= 1  # in the short last page
    assert bad_page(m, bytes(flipped), placements) == 3
    lying = zstandard.ZstdCompressor().compress(bytes(flipped))
    out.write_bytes(bytes(size))
    with pytest.raises(BadPack, match="page 3 does not match"):
        place_pack(out, m, lying, m.packs[0], placements)
