"""TOC-indexed layers (eStargz, zstd:chunked) against the full conversion of the same blob.

The test writers in `tests.toclayers` lay out a layer as each format does; the
index `aenv.images.toc` builds from its TOC alone must describe the same tree
as `LayerConverter` builds from the whole blob, and every chunk cut from its
span must be the file's bytes. Bad TOCs, digests and footers must raise
`TocError` (the store then takes the full path).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest

from aenv.images import toc
from aenv.images.convert import LayerConverter
from aenv.images.lazy import TocLayers
from aenv.proto import layerindex
from aenv.proto.layerindex import Kind, LayerIndex
from tests.registry import (
    chardev,
    directory,
    fifo,
    file,
    hardlink,
    opaque,
    random_bytes,
    random_file,
    symlink,
    whiteout,
)
from tests.toclayers import TocLayer, toc_layer

MEMBERS = [
    directory("etc", mode=0o755, xattrs={"user.note": b"\x00\xffbin"}),
    file("etc/hello", "hello world\n", mode=0o640, uid=7, gid=8),
    file("etc/empty", b""),
    random_file("data/big.bin", 3 * (1 << 20) + 12345, seed=3, mode=0o4755),
    random_file("data/odd.bin", 777_777, seed=4),
    symlink("data/link", "big.bin"),
    hardlink("data/hard", "etc/hello"),
    chardev("dev/null", 1, 3),
    fifo("run/pipe"),
    whiteout("old/thing"),
    opaque("var"),
    file("etc/setuid", b"x", mode=0o2711),
]


class _Desc:
    def __init__(self, layer: TocLayer) -> None:
        self.digest = layer.digest
        self.size = layer.size
        self.media_type = layer.media_type()
        self._notes = layer.annotations

    def annotation(self, key: str) -> str | None:
        return self._notes.get(key)


def _full(layer: TocLayer) -> LayerIndex:
    conv = LayerConverter(
        digest=layer.digest,
        size=layer.size,
        media_type=layer.media_type(),
        put_chunk=lambda d, b: None,
    )
    conv.feed(layer.path.read_bytes())
    return conv.finish()


def _lazy(layer: TocLayer, blob: bytes | None = None) -> LayerIndex:
    blob = layer.path.read_bytes() if blob is None else blob
    layout = toc.detect(_Desc(layer))
    assert layout is not None and layout.format == layer.fmt
    if layout.format == "estargz":
        start = toc.parse_estargz_footer(blob[-toc.ESTARGZ_FOOTER_SIZE :], len(blob))
        raw = toc.decode_estargz_toc(blob[start : -toc.ESTARGZ_FOOTER_SIZE], layout)
    else:
        start = layout.offset
        raw = toc.decode_zstd_toc(blob[start : start + layout.length], layout)
    return toc.build_index(
        layout,
        raw,
        digest=layer.digest,
        size=layer.size,
        media_type=layer.media_type(),
        diff_id=layer.diff_id,
        toc_start=start,
    )


def _meta(ix: LayerIndex) -> list[tuple[object, ...]]:
    return [
        dataclasses.astuple(dataclasses.replace(e, chunks=()))
        for e in ix.entries
        if e.path != toc.ESTARGZ_TOC_NAME
    ]


@pytest.fixture(scope="module", params=["estargz", "zstd:chunked"])
def layer(request: pytest.FixtureRequest) -> TocLayer:
    built = toc_layer(MEMBERS, fmt=request.param, chunk_size=1 << 20)
    yield built
    built.delete()


def test_toc_index_matches_the_full_conversion(layer: TocLayer) -> None:
    full = _full(layer)
    assert full.diff_id == layer.diff_id  # the blob is a valid ordinary layer
    lazy = _lazy(layer)
    assert _meta(lazy) == _meta(full)
    assert lazy.toc == layer.fmt
    kinds = {e.path: e.kind for e in lazy.entries}
    assert kinds["old/thing"] is Kind.WHITEOUT and kinds["var"] is Kind.OPAQUE
    # the index survives its serialised form
    assert layerindex.loads(layerindex.dumps(lazy)) == lazy


def test_every_chunk_cut_from_its_span_is_the_file(layer: TocLayer) -> None:
    blob = layer.path.read_bytes()
    lazy = _lazy(layer, blob)
    want = {
        "data/big.bin": random_bytes(3 * (1 << 20) + 12345, seed=3),
        "data/odd.bin": random_bytes(777_777, seed=4),
        "etc/hello": b"hello world\n",
        "etc/setuid": b"x",
    }
    for e in lazy.entries:
        if e.path in want:
            got = b""
            for c in e.chunks:
                s = lazy.spans[c.digest]
                got += toc.cut_chunk(lazy.toc, blob[s.start : s.end], s, c)
            assert got == want[e.path], e.path
    big = next(e for e in lazy.entries if e.path == "data/big.bin")
    assert [c.size for c in big.chunks] == [1 << 20] * 3 + [12345]


def test_a_chunk_whose_bytes_differ_from_the_toc_is_refused() -> None:
    layer = toc_layer(MEMBERS, fmt="estargz", corrupt=["data/odd.bin"])
    try:
        blob = layer.path.read_bytes()
        lazy = _lazy(layer, blob)
        odd = next(e for e in lazy.entries if e.path == "data/odd.bin")
        c = odd.chunks[0]
        s = lazy.spans[c.digest]
        with pytest.raises(toc.TocError, match="hashes to"):
            toc.cut_chunk(lazy.toc, blob[s.start : s.end], s, c)
    finally:
        layer.delete()


def test_a_toc_that_does_not_match_its_pinned_digest_is_refused(layer: TocLayer) -> None:
    blob = layer.path.read_bytes()
    d = _Desc(layer)
    other = "sha256:" + hashlib.sha256(b"x").hexdigest()
    d._notes = {k: (other if "digest" in k or "checksum" in k else v) for k, v in d._notes.items()}
    layout = toc.detect(d)
    assert layout is not None
    with pytest.raises(toc.TocError, match=r"digest|checksum"):
        if layout.format == "estargz":
            start = toc.parse_estargz_footer(blob[-51:], len(blob))
            toc.decode_estargz_toc(blob[start:-51], layout)
        else:
            toc.decode_zstd_toc(blob[layout.offset : layout.offset + layout.length], layout)


def test_detect_needs_the_pinning_annotation(layer: TocLayer) -> None:
    d = _Desc(layer)
    d._notes = {}
    assert toc.detect(d) is None
    d._notes = {k: "sha256:zz" for k in layer.annotations}
    with pytest.raises(toc.TocError):
        toc.detect(d)


@pytest.mark.parametrize(
    "footer",
    [b"", b"\x00" * 51, bytes(51), b"\x1f\x8b\x08\x04" + b"\x00" * 47],
)
def test_bad_footers_raise(footer: bytes) -> None:
    with pytest.raises(toc.TocError):
        toc.parse_estargz_footer(footer, 1000)


@pytest.mark.parametrize(
    "doc",
    [
        {"version": 2, "entries": []},
        {"version": 1, "entries": [{"type": "chunk", "name": "a"}]},
        {"version": 1, "entries": [{"type": "reg", "name": "../../x", "size": 1}]},
        {"version": 1, "entries": [{"type": "reg", "name": "a", "size": 5, "offset": 1,
                                     "chunkDigest": "sha256:" + "0" * 64, "chunkSize": 9}]},
        {"version": 1, "entries": [{"type": "reg", "name": "a", "size": 5, "offset": 99,
                                     "chunkDigest": "sha256:" + "0" * 64}]},
        {"version": 1, "entries": [{"type": "sock", "name": "a"}]},
    ],
)  # fmt: skip
def test_bad_tocs_raise(doc: dict[str, object]) -> None:
    layout = toc.TocLayout("estargz", "sha256:" + "0" * 64)
    with pytest.raises(toc.TocError):
        toc.build_index(
            layout,
            json.dumps(doc).encode(),
            digest="sha256:" + "1" * 64,
            size=100,
            media_type="application/vnd.oci.image.layer.v1.tar+gzip",
            diff_id="sha256:" + "2" * 64,
            toc_start=50,
        )


def test_prioritized_chunks_are_the_files_before_the_landmark() -> None:
    layer = toc_layer(
        [
            random_file("hot/a", 2 * (1 << 20) + 5, seed=21),
            file("hot/b", b"bee"),
            file(".prefetch.landmark", b"\x0f"),
            random_file("cold/c", 1 << 20, seed=22),
        ],
        fmt="estargz",
    )
    try:
        lazy = _lazy(layer)
    finally:
        layer.delete()
    by_path = {e.path: e for e in lazy.entries}
    want = [*by_path["hot/a"].chunks, *by_path["hot/b"].chunks]
    assert TocLayers.prioritized(lazy) == want
    # no landmark, or zstd:chunked: nothing is prioritized
    assert TocLayers.prioritized(dataclasses.replace(lazy, toc="zstd:chunked")) == []
    no_mark = tuple(e for e in lazy.entries if e.path != ".prefetch.landmark")
    assert TocLayers.prioritized(dataclasses.replace(lazy, entries=no_mark)) == []


def test_a_toc_index_serves_only_descriptors_pinning_its_toc(layer: TocLayer) -> None:
    lazy = _lazy(layer)
    same = _Desc(layer)
    assert TocLayers.reusable(lazy, same)
    other = _Desc(layer)
    other._notes = {
        k: (
            "sha256:" + "3" * 64
            if k != "io.github.containers.zstd-chunked.manifest-position"
            else v
        )
        for k, v in layer.annotations.items()
    }
    assert not TocLayers.reusable(lazy, other)  # another TOC for the same blob digest
    bare = _Desc(layer)
    bare._notes = {}
    assert not TocLayers.reusable(lazy, bare)  # a plain pull of the blob: convert it
    assert TocLayers.reusable(_full(layer), bare)  # a verified conversion serves anyone
    assert TocLayers.reusable(_full(layer), same)
