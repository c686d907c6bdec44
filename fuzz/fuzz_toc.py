"""Fuzz the eStargz / zstd:chunked TOC parsers, `aenv.images.toc` (sans-IO).

Inputs are arbitrary bytes and JSON, and real layers from the test writers
(`tests.toclayers`) with their footer, TOC bytes, TOC JSON or chunk spans
flipped, cut or rearranged. The rules: every parser returns or raises
`TocError`, nothing else; a footer parsed gives an offset inside the blob;
an index built has a span for every chunk, inside the layer's data, chunk
sizes that add up to each file's size and survives its serialised form; a
chunk cut from mangled bytes is either the TOC's bytes (its digest matches)
or a `TocError`. Runs under pytest (short: 200 examples; `AENV_FUZZ_LONG=1`:
50 000; `AENV_FUZZ_EXAMPLES=N`: N) or standalone with `python
fuzz/fuzz_toc.py` (atheris if importable, else repeated hypothesis rounds).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import sys
from collections.abc import Callable
from typing import Any

from _harness import FUZZ, main
from hypothesis import given
from hypothesis import strategies as st

from aenv.images import toc
from aenv.proto import layerindex
from aenv.proto.layerindex import LayerIndex
from tests.registry import directory, file, hardlink, random_file, symlink
from tests.toclayers import TocFormat, toc_layer

_DIGEST = "sha256:" + "1" * 64
_DIFF = "sha256:" + "2" * 64
_MT = {"estargz": "application/vnd.oci.image.layer.v1.tar+gzip"}
_MT["zstd:chunked"] = "application/vnd.oci.image.layer.v1.tar+zstd"


@functools.cache
def _real(fmt: TocFormat) -> tuple[bytes, toc.TocLayout, int, bytes]:
    """A small real layer of `fmt`: blob, layout, TOC start, TOC JSON."""
    layer = toc_layer(
        [
            directory("d"),
            file("d/a", b"alpha\n", xattrs={"user.x": b"1"}),
            random_file("d/b", 70_000, seed=1),
            symlink("d/l", "a"),
            hardlink("d/h", "d/a"),
        ],
        fmt=fmt,
        chunk_size=32 << 10,
    )
    blob = layer.path.read_bytes()
    layer.delete()

    class Desc:
        size = len(blob)
        media_type = _MT[fmt]

        def annotation(self, key: str) -> str | None:
            return layer.annotations.get(key)

    layout = toc.detect(Desc())
    assert layout is not None
    if fmt == "estargz":
        start = toc.parse_estargz_footer(blob[-toc.ESTARGZ_FOOTER_SIZE :], len(blob))
        raw = toc.decode_estargz_toc(blob[start : -toc.ESTARGZ_FOOTER_SIZE], layout)
    else:
        start = layout.offset
        raw = toc.decode_zstd_toc(blob[start : start + layout.length], layout)
    return blob, layout, start, raw


def _mangle(data: bytes, draw: Any) -> bytes:
    raw = bytearray(data)
    for _ in range(draw(st.integers(0, 4))):
        if raw:
            i = draw(st.integers(0, len(raw) - 1))
            raw[i] ^= draw(st.integers(1, 255))
    cut = draw(st.integers(0, len(raw)))
    return bytes(raw[:cut]) + draw(st.binary(max_size=8))


def _check(ix: LayerIndex, size: int, toc_start: int) -> None:
    for e in ix.entries:
        assert sum(c.size for c in e.chunks) == (e.size if e.chunks else 0)
        for c in e.chunks:
            s = ix.spans[c.digest]
            assert 0 <= s.start < s.end <= toc_start <= size
            assert 0 < c.size <= toc.MAX_CHUNK_BYTES
    assert layerindex.loads(layerindex.dumps(ix)) == ix


def _build(layout: toc.TocLayout, raw: bytes, size: int, toc_start: int) -> LayerIndex:
    return toc.build_index(
        layout,
        raw,
        digest=_DIGEST,
        size=size,
        media_type=_MT[layout.format],
        diff_id=_DIFF,
        toc_start=toc_start,
    )


@FUZZ
@given(raw=st.binary(min_size=51, max_size=51), size=st.integers(0, 1 << 40))
def test_footer_arbitrary(raw: bytes, size: int) -> None:
    with contextlib.suppress(toc.TocError):
        off = toc.parse_estargz_footer(raw, size)
        assert 0 < off < size - toc.ESTARGZ_FOOTER_SIZE


@FUZZ
@given(data=st.data())
def test_mangled_footer_and_toc_bytes(data: st.DataObject) -> None:
    blob, layout, start, _ = _real("estargz")
    footer = _mangle(blob[-51:], data.draw)
    with contextlib.suppress(toc.TocError):
        off = toc.parse_estargz_footer(footer, len(blob))
        assert 0 < off < len(blob) - 51
    with contextlib.suppress(toc.TocError):
        out = toc.decode_estargz_toc(_mangle(blob[start:-51], data.draw), layout)
        assert "sha256:" + hashlib.sha256(out).hexdigest() == layout.toc_digest
    zblob, zlayout, zstart, _ = _real("zstd:chunked")
    with contextlib.suppress(toc.TocError):
        out = toc.decode_zstd_toc(
            _mangle(zblob[zstart : zstart + zlayout.length], data.draw), zlayout
        )
        assert len(out) == zlayout.uncompressed


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 1 << 20) | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=12,
)
_KEYS = ["name", "type", "size", "offset", "endOffset", "chunkOffset", "chunkSize", "chunkDigest",
         "digest", "innerOffset", "mode", "uid", "gid", "modtime", "linkName", "xattrs",
         "devMajor", "devMinor"]  # fmt: skip
_WORDS = ["reg", "chunk", "dir", "symlink", "hardlink", "a", "a/b", "../x", ".wh.a",
          "2023-11-14T22:13:20Z", "sha256:" + "0" * 64, "bm90", ""]  # fmt: skip
_VALUES = st.one_of(st.integers(-2, 200_000), st.sampled_from(_WORDS), _JSON)


@FUZZ
@given(
    fmt=st.sampled_from(["estargz", "zstd:chunked"]),
    entries=st.lists(st.dictionaries(st.sampled_from(_KEYS), _VALUES, max_size=8), max_size=8),
    toc_start=st.integers(0, 300_000),
)
def test_build_index_from_arbitrary_entries(
    fmt: TocFormat, entries: list[dict[str, Any]], toc_start: int
) -> None:
    layout = toc.TocLayout(fmt, _DIGEST)
    raw = json.dumps({"version": 1, "entries": entries}).encode()
    with contextlib.suppress(toc.TocError):
        _check(_build(layout, raw, 400_000, toc_start), 400_000, toc_start)


@FUZZ
@given(fmt=st.sampled_from(["estargz", "zstd:chunked"]), data=st.data())
def test_mangled_real_tocs_and_spans(fmt: TocFormat, data: st.DataObject) -> None:
    blob, layout, start, raw = _real(fmt)
    doc = json.loads(raw)
    entries = doc["entries"]
    for _ in range(data.draw(st.integers(0, 3))):
        if not entries:
            break
        e = entries[data.draw(st.integers(0, len(entries) - 1))]
        key = data.draw(st.sampled_from(_KEYS))
        if data.draw(st.booleans()):
            e[key] = data.draw(_VALUES)
        else:
            e.pop(key, None)
    if data.draw(st.booleans()) and entries:
        entries.insert(data.draw(st.integers(0, len(entries))), entries.pop())
    with contextlib.suppress(toc.TocError):
        ix = _build(layout, json.dumps(doc).encode(), len(blob), start)
        _check(ix, len(blob), start)
        chunks = [c for e in ix.entries for c in e.chunks]
        if chunks:
            c = chunks[data.draw(st.integers(0, len(chunks) - 1))]
            s = ix.spans[c.digest]
            piece = blob[s.start : s.end]
            if data.draw(st.booleans()):
                piece = _mangle(piece, data.draw)
            with contextlib.suppress(toc.TocError):
                out = toc.cut_chunk(ix.toc, piece, s, c)
                assert "sha256:" + hashlib.sha256(out).hexdigest() == c.digest


TESTS: tuple[Callable[[], None], ...] = (
    test_footer_arbitrary,
    test_mangled_footer_and_toc_bytes,
    test_build_index_from_arbitrary_entries,
    test_mangled_real_tocs_and_spans,
)


if __name__ == "__main__":
    sys.exit(main(TESTS, __doc__ or ""))
