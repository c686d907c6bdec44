"""Images through the object store, with real nodes, a real registry, moto's S3 and the e2b SDK.

Rules: each test runs its own nodes (private homes linked to the built one,
the `aenvx` netns prefix and their own slot range) against its own moto
server (tests/s3.py), configured only through AENV_STORE_URL and the AWS_*
variables. What a node fetched, and from where, is read from its /metrics:
`aenv_image_registry_bytes_total` (layer blob bytes from registries),
`aenv_image_store_fetched_bytes_total` (chunk bytes from the store) and
`aenv_image_fs_read_bytes_total` (what the sandbox read). Nothing of the
nodes may leak at the end.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox

# Fixtures are imported by name, so test parameters shadow them (F811).
# ruff: noqa: F811
from tests.conftest import NodeProc, built_home, leaks, link_home, requires_node, start_node
from tests.conftest import stop_node as stop
from tests.e2e.test_images import metric
from tests.registry import LocalRegistry, busybox_layer, push_big_image, running_registry
from tests.s3 import MotoS3, s3_faulty  # noqa: F401

pytestmark = [requires_node, pytest.mark.runsc]

PREFIX = "aenvx"
MiB = 1 << 20


class Nodes:
    """Nodes with private homes sharing one S3 store; the SDK points at the current one."""

    def __init__(self, s3: MotoS3, monkeypatch: pytest.MonkeyPatch) -> None:
        self.s3 = s3
        self.prefix = f"images/{secrets.token_hex(4)}"
        self.monkeypatch = monkeypatch
        self.homes: list[Path] = []
        self.node: NodeProc | None = None

    def start(self, **env: str) -> NodeProc:
        built = built_home()
        assert built is not None
        home = Path(tempfile.mkdtemp(prefix="aenv-test-imgstore-"))
        link_home(built, home)
        self.homes.append(home)
        extra = {
            "AENV_NET_PREFIX": PREFIX,
            "AENV_SLOT_CIDR": "10.228.0.0/16",
            **self.s3.env(),
            "AENV_STORE_URL": self.s3.url(self.prefix),
            "AENV_SHARE_DEFAULT_TEMPLATES": "off",  # not what these tests are about
            **env,
        }
        key = "k" + secrets.token_hex(8)
        n = start_node(home, api_key=key, log_path=home / "node.log", extra_env=extra)
        for var, value in (("E2B_API_URL", n.url), ("E2B_SANDBOX_URL", n.url)):
            self.monkeypatch.setenv(var, value)
        self.monkeypatch.setenv("E2B_API_KEY", key)
        self.node = n
        return n

    def stop(self) -> None:
        assert self.node is not None
        assert stop(self.node) == 0, self.node.log_tail()
        self.node = None

    def stored(self, key: str) -> bool:
        client = self.s3.boto()
        got = client.list_objects_v2(Bucket=self.s3.bucket, Prefix=f"{self.prefix}/{key}")
        return bool(got.get("Contents"))


@pytest.fixture
def nodes(monkeypatch: pytest.MonkeyPatch, s3_faulty: MotoS3) -> Iterator[Nodes]:
    n = Nodes(s3_faulty, monkeypatch)
    try:
        yield n
    finally:
        if n.node is not None:
            print(n.node.log_tail())
            stop(n.node)
        for home in n.homes:
            left = leaks(home, PREFIX)
            shutil.rmtree(home, ignore_errors=True)
            assert not left, left


def test_a_node_starts_an_image_from_the_store_without_its_blobs(
    nodes: Nodes, registry: LocalRegistry
) -> None:
    """Node A pulls (and uploads) an image; node B, fresh disk, same store, never downloads
    a layer blob: the sandbox starts lazily, each file's chunks come from the store on
    first read, and chunks evicted from B's small cache come back from the store."""
    img = push_big_image(
        registry,
        "storeimg",
        "1",
        total_mb=48,
        files=6,
        layers=2,
        compression="zstd",
        seed=77,
        base=[busybox_layer()],
    )
    a = nodes.start()
    r = httpx.post(
        f"{a.url}/images", json={"image": img.ref}, headers={"X-API-Key": a.api_key}, timeout=120
    )
    assert r.status_code == 201, r.text
    pulled = metric(a, "aenv_image_registry_bytes_total")
    assert pulled >= sum(la.size for la in img.layers)
    deadline = time.monotonic() + 60
    for digest in img.layer_digests:  # uploaded in the background, index last
        key = f"images/layers/{digest.removeprefix('sha256:')}.json"
        while not nodes.stored(key):
            assert time.monotonic() < deadline, f"{key} never reached the store"
            time.sleep(0.2)
    nodes.stop()

    limit = 16 * MiB
    b = nodes.start(AENV_CACHE_MAX_BYTES=str(limit))
    t0 = time.monotonic()
    s = Sandbox.create(img.ref, timeout=120)  # pulls: manifest and config, no blob
    started = time.monotonic() - t0
    try:
        assert s.commands.run("true").exit_code == 0
        assert metric(b, "aenv_image_registry_bytes_total") == 0
        boot = metric(b, "aenv_image_store_fetched_bytes_total")
        print(f"\nstart from the store: {started:.2f}s, {boot:.0f} bytes from the store to boot")
        assert boot < 8 * MiB  # busybox's chunks, not the image's 48 MiB

        path, digest = sorted(img.contents.items())[1]
        size = int(s.commands.run(f"stat -c %s /{path}").stdout)
        store0 = metric(b, "aenv_image_store_fetched_bytes_total")
        read0 = metric(b, "aenv_image_fs_read_bytes_total")
        assert s.commands.run(f"sha256sum /{path}").stdout.split()[0] == digest
        got = metric(b, "aenv_image_store_fetched_bytes_total") - store0
        read = metric(b, "aenv_image_fs_read_bytes_total") - read0
        print(f"one {size}-byte file: {got:.0f} bytes from the store, {read:.0f} read")
        # (/metrics prints 6 significant digits: allow for the rounding)
        assert size - 1000 <= got <= size + MiB
        assert size - 1000 <= read <= size + MiB

        # Every file (48 MiB through a 16 MiB cache), then the first again in a new
        # sandbox (the first one's own page cache would answer): its chunks were
        # evicted and come back from the store, never from the registry.
        for p, d in sorted(img.contents.items()):
            assert s.commands.run(f"sha256sum /{p}", timeout=120).stdout.split()[0] == d, p
        p, d = sorted(img.contents.items())[0]
        # ...and out of the host's page cache over the image mount, which answers
        # re-reads without asking the node
        mounted = b.home / "run" / "images" / img.manifest_digest.removeprefix("sha256:") / p
        fd = os.open(mounted, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        before = metric(b, "aenv_image_store_fetched_bytes_total")
        again = Sandbox.create(img.ref, timeout=120)
        try:
            assert again.commands.run(f"sha256sum /{p}", timeout=120).stdout.split()[0] == d
        finally:
            again.kill()
        assert metric(b, "aenv_image_cache_evictions_total") > 0
        size0 = int(s.commands.run(f"stat -c %s /{p}").stdout)
        assert metric(b, "aenv_image_store_fetched_bytes_total") - before >= size0 - 1000
        assert metric(b, "aenv_image_registry_bytes_total") == 0
        assert metric(b, "aenv_image_cache_bytes") <= limit + MiB
        assert metric(b, "aenv_image_fs_read_errors_total") == 0
    finally:
        s.kill()


@pytest.fixture
def own_registry(tmp_path: Path) -> Iterator[LocalRegistry]:
    """A registry of this test's own, which it may stop."""
    with running_registry(tmp_path / "registry", auth=False) as reg:
        yield reg


def test_a_named_template_reaches_a_node_that_never_saw_it(
    nodes: Nodes, own_registry: LocalRegistry
) -> None:
    """A template named on node A is in the store: node B, fresh disk, with the
    registry gone, starts it by name from the store alone; deleting it on B
    removes it from the store."""
    registry = own_registry
    img = push_big_image(
        registry, "tplshare", "1", total_mb=4, files=2, layers=1, seed=5, base=[busybox_layer()]
    )
    a = nodes.start()
    r = httpx.post(
        f"{a.url}/images",
        json={"image": img.ref, "name": "shared-tpl", "memoryMB": 256},
        headers={"X-API-Key": a.api_key},
        timeout=120,
    )
    assert r.status_code == 201, r.text
    template_id = r.json()["template"]["templateID"]
    deadline = time.monotonic() + 60
    keys = [f"templates/{template_id}.json"] + [
        f"images/layers/{d.removeprefix('sha256:')}.json" for d in img.layer_digests
    ]
    for key in keys:  # shared in the background
        while not nodes.stored(key):
            assert time.monotonic() < deadline, f"{key} never reached the store"
            time.sleep(0.2)
    nodes.stop()
    registry.stop()

    b = nodes.start()
    s = Sandbox.create("shared-tpl", timeout=120)
    try:
        path, digest = sorted(img.contents.items())[0]
        assert s.commands.run(f"sha256sum /{path}").stdout.split()[0] == digest
        info = httpx.get(
            f"{b.url}/sandboxes/{s.sandbox_id}", headers={"X-API-Key": b.api_key}
        ).json()
        assert info["templateID"] == template_id and info["memoryMB"] == 256
        assert metric(b, "aenv_image_registry_bytes_total") == 0
    finally:
        s.kill()
    missing = httpx.post(
        f"{b.url}/sandboxes",
        json={"templateID": "never-made"},
        headers={"X-API-Key": b.api_key},
    )
    assert missing.status_code == 404, missing.text
    gone = httpx.delete(f"{b.url}/templates/shared-tpl", headers={"X-API-Key": b.api_key})
    assert gone.status_code == 204, gone.text
    assert not nodes.stored(f"templates/{template_id}.json")
