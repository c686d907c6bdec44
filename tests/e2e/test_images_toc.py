"""Lazy pulls of eStargz and zstd:chunked images, with the real e2b SDK, registry and node.

The layers come from the test writers in `tests.toclayers` and are pushed to
Debian's docker-registry with the annotations that pin their TOC. A pull
must read the TOC and nothing else of them (the node's registry byte count
says so), the tree must match what skopeo + umoci unpack from the same blob,
file contents arrive chunk by chunk on first read, a chunk whose bytes do not
match the TOC is an I/O error (never wrong data), and a registry that ignores
`Range` gets the full download and conversion instead.
"""

from __future__ import annotations

import http.server
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox
from e2b.sandbox.commands.command_handle import CommandExitException

from tests.conftest import NodeProc, requires_node
from tests.registry import (
    LocalRegistry,
    busybox_layer,
    chardev,
    compare_trees,
    directory,
    fifo,
    file,
    hardlink,
    push_image,
    random_file,
    reference_unpack,
    symlink,
)
from tests.toclayers import TocFormat, TocLayer, toc_layer

pytestmark = [requires_node, pytest.mark.runsc]

MiB = 1 << 20
CONFIG = {"Env": ["PATH=/usr/local/bin:/usr/bin:/bin"], "WorkingDir": "/data", "Cmd": ["sh"]}


def metric(node: NodeProc, name: str) -> float:
    text = httpx.get(f"{node.url}/metrics", headers={"X-API-Key": node.api_key}, timeout=10).text
    m = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def members(seed: int) -> list[object]:
    return [
        directory("data", mode=0o755, uid=1000, gid=1000),
        file("data/hello.txt", b"hello from a TOC layer\n", mode=0o644),
        file("data/suid", b"#!/bin/sh\necho hi\n", mode=0o4755),
        file("data/noted", b"with an xattr\n", xattrs={"user.note": b"kept"}),
        hardlink("data/hello-link", "data/hello.txt"),
        symlink("data/to-hello", "hello.txt"),
        fifo("data/pipe"),
        chardev("data/null2", 1, 3),
        random_file("data/big.bin", 24 * MiB + 4321, seed=seed),
        random_file("data/mid.bin", 3 * MiB + 17, seed=seed + 1),
    ]


def toc_image(
    registry: LocalRegistry, repo: str, fmt: TocFormat, seed: int, **kw: object
) -> tuple[object, TocLayer]:
    """busybox + a layer of `members(seed)`: a seed per test, so no test finds its
    content in the node's cache already (identical chunks are stored once)."""
    layer = toc_layer(members(seed), fmt=fmt, chunk_size=MiB, **kw)  # type: ignore[arg-type]
    try:
        img = push_image(registry, repo, "v1", [busybox_layer(), layer], config=CONFIG)
    finally:
        layer.delete()
    return img, layer


@pytest.mark.parametrize("fmt", ["estargz", "zstd:chunked"])
def test_a_toc_image_starts_from_its_toc_and_reads_lazily(
    node: NodeProc, registry: LocalRegistry, tmp_path: Path, fmt: TocFormat
) -> None:
    repo = f"toc-{fmt.replace(':', '-')}"
    img, layer = toc_image(registry, repo, fmt, seed=100 if fmt == "estargz" else 200)
    got0 = metric(node, "aenv_image_registry_bytes_total")
    toc0 = metric(node, "aenv_image_toc_layers_total")
    s = Sandbox.create(img.ref, timeout=120)  # type: ignore[attr-defined]
    try:
        assert metric(node, "aenv_image_toc_layers_total") == toc0 + 1
        r = s.commands.run("pwd; cat hello.txt; cat to-hello; ls -l suid")
        lines = r.stdout.splitlines()
        assert lines[:3] == ["/data", "hello from a TOC layer", "hello from a TOC layer"]
        assert lines[3].startswith("-rwsr-xr-x")
        # the pull took the TOC, not the 27 MiB layer (busybox is a plain gzip layer)
        pulled = metric(node, "aenv_image_registry_bytes_total") - got0
        assert pulled < layer.size / 4, (pulled, layer.size)
        # a whole file, chunk by chunk from its spans, verified
        digest = img.contents["data/mid.bin"]  # type: ignore[attr-defined]
        assert s.commands.run("sha256sum mid.bin").stdout.split()[0] == digest
        read = metric(node, "aenv_image_registry_bytes_total") - got0 - pulled
        assert 3 * MiB <= read < 8 * MiB, read
    finally:
        s.kill()
    # the whole tree, through the node's mount, against skopeo + umoci of the same blob
    with httpx.Client(base_url=node.url, headers={"X-API-Key": node.api_key}) as c:
        images = {i["image"]: i for i in c.get("/images").json()}
    key = images[img.ref]["digest"].removeprefix("sha256:")  # type: ignore[attr-defined]
    reference = reference_unpack(registry, img.ref, tmp_path / "ref")  # type: ignore[attr-defined]
    # eStargz carries its TOC as a last tar entry: unaware runtimes unpack it as a file
    assert (
        compare_trees(reference, node.home / "run" / "images" / key, ignore=["stargz.index.json"])
        == []
    )


def test_a_chunk_that_does_not_match_the_toc_is_an_io_error(
    node: NodeProc, registry: LocalRegistry
) -> None:
    img, _ = toc_image(registry, "toc-corrupt", "estargz", 300, corrupt=["data/mid.bin"])
    s = Sandbox.create(img.ref, timeout=120)  # type: ignore[attr-defined]
    try:
        with pytest.raises(CommandExitException) as err:
            s.commands.run("cat mid.bin > /dev/null", timeout=60)
        assert "Input/output error" in err.value.stderr, err.value.stderr
        # the other files are fine
        assert s.commands.run("cat hello.txt").stdout == "hello from a TOC layer\n"
    finally:
        s.kill()
    assert "hashes to" in node.log_tail(200)  # the node says why


def test_prioritized_files_are_prefetched_after_the_pull(
    node: NodeProc, registry: LocalRegistry
) -> None:
    # seeds of their own: content another test cached would not be fetched again
    hot, cold = (
        random_file("data/hot.bin", 6 * MiB, seed=9001),
        random_file("data/cold.bin", 6 * MiB, seed=9002),
    )
    layer = toc_layer(
        [directory("data"), hot, file(".prefetch.landmark", b"\x0f"), cold],
        fmt="estargz",
        chunk_size=MiB,
    )
    try:
        img = push_image(registry, "toc-prefetch", "v1", [busybox_layer(), layer], config=CONFIG)
    finally:
        layer.delete()
    got0 = metric(node, "aenv_image_registry_bytes_total")
    with httpx.Client(base_url=node.url, headers={"X-API-Key": node.api_key}, timeout=120) as c:
        assert c.post("/images", json={"image": img.ref}).status_code == 201
    # the files before the landmark arrive in the background, the ones after it do not
    deadline = time.monotonic() + 60
    while metric(node, "aenv_image_registry_bytes_total") - got0 < 6 * MiB:
        assert time.monotonic() < deadline, "the prioritized file was not prefetched"
        time.sleep(0.2)
    time.sleep(1)
    prefetched = metric(node, "aenv_image_registry_bytes_total") - got0
    assert prefetched < 9 * MiB, prefetched
    s = Sandbox.create(img.ref, timeout=120)  # type: ignore[attr-defined]
    try:
        digests = img.contents  # type: ignore[attr-defined]
        assert s.commands.run("sha256sum hot.bin").stdout.split()[0] == digests["data/hot.bin"]
        after_hot = metric(node, "aenv_image_registry_bytes_total") - got0
        assert after_hot - prefetched < MiB, (prefetched, after_hot)  # from the cache
        assert s.commands.run("sha256sum cold.bin").stdout.split()[0] == digests["data/cold.bin"]
        assert metric(node, "aenv_image_registry_bytes_total") - got0 - after_hot >= 6 * MiB
    finally:
        s.kill()


def test_the_same_blob_without_its_toc_annotation_is_downloaded_and_verified(
    node: NodeProc, registry: LocalRegistry
) -> None:
    layer = toc_layer(members(500), fmt="estargz", chunk_size=MiB)
    try:
        pinned = push_image(registry, "toc-pinned", "v1", [busybox_layer(), layer], config=CONFIG)
        layer.annotations = {}  # another manifest naming the same blob digest, no TOC pinned
        bare = push_image(registry, "toc-bare", "v1", [busybox_layer(), layer], config=CONFIG)
    finally:
        layer.delete()
    with httpx.Client(base_url=node.url, headers={"X-API-Key": node.api_key}, timeout=120) as c:
        got0 = metric(node, "aenv_image_registry_bytes_total")
        assert c.post("/images", json={"image": pinned.ref}).status_code == 201
        got1 = metric(node, "aenv_image_registry_bytes_total")
        assert got1 - got0 < layer.size / 4  # from the TOC
        assert c.post("/images", json={"image": bare.ref}).status_code == 201
        # not the first image's TOC index: the blob, downloaded and checked whole
        assert metric(node, "aenv_image_registry_bytes_total") - got1 >= layer.size
    s = Sandbox.create(bare.ref, timeout=120)
    try:
        digest = bare.contents["data/mid.bin"]
        assert s.commands.run("sha256sum mid.bin").stdout.split()[0] == digest
    finally:
        s.kill()


class _NoRange(http.server.BaseHTTPRequestHandler):
    """Forwards GETs to the registry without their Range header (a registry that
    always answers with the whole blob)."""

    upstream = ""
    ranges_seen = 0

    def do_GET(self) -> None:
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "range")}
        if "Range" in self.headers:
            type(self).ranges_seen += 1
        with httpx.stream("GET", self.upstream + self.path, headers=headers, timeout=60) as r:
            self.send_response(r.status_code)
            for k, v in r.headers.items():
                if k.lower() not in ("transfer-encoding", "connection", "content-range"):
                    self.send_header(k, v)
            self.end_headers()
            for piece in r.iter_raw():
                self.wfile.write(piece)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def no_range(registry: LocalRegistry) -> Iterator[str]:
    handler = type("NoRange", (_NoRange,), {"upstream": registry.url, "ranges_seen": 0})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
        assert handler.ranges_seen > 0  # the node did ask for a range
    finally:
        server.shutdown()
        server.server_close()


def test_a_registry_without_range_support_gets_the_full_pull(
    node: NodeProc, registry: LocalRegistry, no_range: str
) -> None:
    img, layer = toc_image(registry, "toc-norange", "zstd:chunked", 400)
    ref = img.ref.replace(registry.host, no_range)  # type: ignore[attr-defined]
    got0 = metric(node, "aenv_image_registry_bytes_total")
    s = Sandbox.create(ref, timeout=180)
    try:
        digest = img.contents["data/big.bin"]  # type: ignore[attr-defined]
        assert s.commands.run("sha256sum big.bin").stdout.split()[0] == digest
        assert metric(node, "aenv_image_registry_bytes_total") - got0 >= layer.size
    finally:
        s.kill()
