"""Sandboxes from OCI images with the real e2b SDK, a real registry and a real node.

Rules: images are built and pushed by the tests to Debian's docker-registry
on loopback (`tests.registry`); the session `node` pulls them; the reference
tree comes from skopeo + umoci. Each test kills its sandboxes. What the node
fetched is read from its /metrics, never from its internals.
"""

from __future__ import annotations

import base64
import contextlib
import json
import re
import secrets
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox
from e2b.exceptions import SandboxException

from tests.conftest import (
    NodeProc,
    built_home,
    leaks,
    link_home,
    requires_node,
    start_node,
    stop_node,
)
from tests.e2e.counter import counts_on
from tests.registry import (
    Layer,
    LocalRegistry,
    busybox_layer,
    chardev,
    compare_trees,
    directory,
    fifo,
    file,
    hardlink,
    opaque,
    push_big_image,
    push_busybox,
    push_image,
    push_index,
    push_rootfs_dir,
    reference_unpack,
    symlink,
    whiteout,
)

pytestmark = [requires_node, pytest.mark.runsc]

PREFIX = "aenvc"  # the bounded-cache test's own node
CONFIG = {
    "Env": ["PATH=/usr/local/bin:/usr/bin:/bin", "GREETING=hello from the image"],
    "WorkingDir": "/data",
    "User": "app",
    "Cmd": ["sh"],
}


def metric(node: NodeProc, name: str) -> float:
    text = httpx.get(f"{node.url}/metrics", headers={"X-API-Key": node.api_key}, timeout=10).text
    m = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def api(node: NodeProc) -> httpx.Client:
    return httpx.Client(base_url=node.url, headers={"X-API-Key": node.api_key}, timeout=120)


def layered_image(registry: LocalRegistry, repo: str) -> object:
    """busybox, then a layer of every entry kind, then one that deletes and replaces."""
    kinds = Layer.build(
        [
            directory("data", mode=0o755, uid=1000, gid=1000),
            file("data/a.txt", b"alpha\n", mode=0o644),
            file("data/b.txt", b"bravo\n"),
            file("data/c.txt", b"charlie v1\n"),
            file("data/suid", b"#!/bin/sh\necho hi\n", mode=0o4755),
            file("data/mine", b"owned by app\n", mode=0o600, uid=1000, gid=1000),
            file("data/noted", b"with an xattr\n", xattrs={"user.note": b"kept"}),
            hardlink("data/a-link", "data/a.txt"),
            symlink("data/to-a", "a.txt"),
            symlink("data/dangling", "/nowhere"),
            directory("data/old"),
            file("data/old/x", b"hidden by an opaque dir\n"),
            fifo("data/pipe"),
            chardev("data/null2", 1, 3),
            file("data/big.bin", bytes(range(256)) * (3 * 4096 + 7)),  # crosses a chunk
        ],
        compression="zstd",
    )
    changes = Layer.build(
        [
            whiteout("data/b.txt"),
            opaque("data/old"),
            file("data/old/y", b"after the opaque marker\n"),
            file("data/c.txt", b"charlie v2\n"),
        ],
        compression="none",
    )
    return push_image(
        registry, repo, "v1", [busybox_layer(compression="gzip"), kinds, changes], config=CONFIG
    )


def test_image_tree_matches_umoci_and_runs_as_configured(
    node: NodeProc, registry: LocalRegistry, tmp_path: Path
) -> None:
    img = layered_image(registry, "layered")
    s = Sandbox.create(img.ref, timeout=120)  # type: ignore[attr-defined]
    try:
        r = s.commands.run("pwd; id -u; echo $GREETING; cat c.txt; ls old; ls -l a.txt suid")
        lines = r.stdout.splitlines()
        assert lines[:5] == ["/data", "1000", "hello from the image", "charlie v2", "y"]
        assert lines[5].startswith("-rw-r--r--    2 root")  # a.txt and its hard link
        assert lines[6].startswith("-rwsr-xr-x")
        assert not s.files.exists("/data/b.txt")
        assert s.commands.run("readlink to-a; cat to-a").stdout == "a.txt\nalpha\n"
        assert s.commands.run("cat mine").stdout == "owned by app\n"  # runs as app (1000)
        # the image is the lower layer: the sandbox writes over it
        s.files.write("/data/c.txt", "changed in the sandbox")
        assert s.files.read("/data/c.txt") == "changed in the sandbox"
    finally:
        s.kill()

    # The lazy tree on the node's image mount, compared with skopeo + umoci.
    with api(node) as c:
        images = {i["image"]: i for i in c.get("/images").json()}
    key = images[img.ref]["digest"].removeprefix("sha256:")  # type: ignore[attr-defined]
    reference = reference_unpack(registry, img.ref, tmp_path / "ref")  # type: ignore[attr-defined]
    lazy = node.home / "run" / "images" / key
    assert compare_trees(reference, lazy) == []
    # a fresh sandbox does not see the first one's writes
    s2 = Sandbox.create(img.ref, timeout=60)  # type: ignore[attr-defined]
    try:
        assert s2.files.read("/data/c.txt") == "charlie v2\n"
    finally:
        s2.kill()


def test_pull_with_a_name_makes_a_template(node: NodeProc, registry: LocalRegistry) -> None:
    img = push_busybox(registry, "named", "1.0", config={"Env": ["FROM_IMAGE=yes"]})
    with api(node) as c:
        r = c.post("/images", json={"image": img.ref, "name": "named-busybox", "memoryMB": 256})
        assert r.status_code == 201, r.text
        body = r.json()
        assert body["digest"] == img.manifest_digest
        assert body["template"]["aliases"] == ["named-busybox"]
        assert body["template"]["memoryMB"] == 256
        again = c.post("/images", json={"image": img.ref, "name": "named-busybox"})
        assert again.status_code == 409
        bad = c.post("/images", json={"image": img.ref, "name": "Not A Name"})
        assert bad.status_code == 400
    s = Sandbox.create("named-busybox", timeout=60)
    try:
        assert s.commands.run("echo $FROM_IMAGE; pwd").stdout == "yes\n/\n"
    finally:
        s.kill()
    with api(node) as c:
        assert c.delete("/templates/named-busybox").status_code == 204


def _create_error(ref: str) -> str:
    with pytest.raises(SandboxException) as info:
        Sandbox.create(ref, timeout=30)
    return str(info.value)


def _state(node: NodeProc) -> tuple[set[str], set[str], float]:
    with api(node) as c:
        images = {i["image"] for i in c.get("/images").json()}
        templates = {t["templateID"] for t in c.get("/templates").json()}
    return images, templates, metric(node, "aenv_image_cache_bytes")


@pytest.fixture
def hung_registry() -> Iterator[str]:
    """A TCP server on loopback that accepts connections and never answers."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        yield f"127.0.0.1:{srv.getsockname()[1]}"
    finally:
        stop.set()
        t.join()
        for conn in held:
            conn.close()
        srv.close()


def _corrupt_blob(registry: LocalRegistry, digest: str, *, truncate: bool) -> None:
    hexd = digest.removeprefix("sha256:")
    data = registry.root / "docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"
    raw = data.read_bytes()
    if truncate:
        data.write_bytes(raw[: len(raw) // 2])
    else:
        data.write_bytes(raw[:100] + bytes([raw[100] ^ 0xFF]) + raw[101:])


def test_bad_images_fail_clearly_and_leave_nothing(
    node: NodeProc, registry: LocalRegistry, hung_registry: str
) -> None:
    before = _state(node)
    host = registry.host
    push_busybox(registry, "present", "1")

    msg = _create_error(f"{host}/absent:1")
    assert "absent" in msg and "not found" in msg.lower()
    msg = _create_error(f"{host}/present:no-such-tag")
    assert "no-such-tag" in msg and "not found" in msg.lower()

    corrupt = push_busybox(
        registry,
        "corrupt",
        "1",
        extra_layers=[Layer.build([file("x", b"x" * 3_000_000)], compression="gzip")],
    )
    _corrupt_blob(registry, corrupt.layers[-1].digest, truncate=False)
    msg = _create_error(corrupt.ref)
    assert "digest" in msg.lower() or "corrupt" in msg.lower() or "gzip" in msg.lower(), msg

    short = push_busybox(
        registry,
        "short",
        "1",
        extra_layers=[Layer.build([file("y", b"y" * 3_000_000)], compression="none")],
    )
    _corrupt_blob(registry, short.layers[-1].digest, truncate=True)
    msg = _create_error(short.ref)
    assert msg  # a clear error, checked below to have left nothing

    started = time.monotonic()
    msg = _create_error(f"{hung_registry}/stuck:1")
    assert hung_registry in msg, msg
    # the node's own retries (4 attempts, 3 s timeout) and no more: the answer
    # says Should-Retry: false, so the SDK does not ask again
    assert time.monotonic() - started < 30

    images, templates, cache_bytes = _state(node)
    assert images == before[0]
    assert templates == before[1]
    # the layers that failed verification left no chunk behind
    assert cache_bytes <= before[2] + 2 * 2**20  # (busybox's own chunks may be new)


def test_registry_credentials_are_read_when_they_change(
    node: NodeProc, registry_auth: LocalRegistry
) -> None:
    creds = registry_auth.credentials
    assert creds is not None
    user, password = creds
    img = push_busybox(registry_auth, "private", "1", auth=(user, password))
    path = node.home / "secrets" / "registries.json"
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(pw: str) -> None:
        token = base64.b64encode(f"{user}:{pw}".encode()).decode()
        path.write_text(json.dumps({"auths": {registry_auth.host: {"auth": token}}}))

    try:
        path.unlink(missing_ok=True)
        msg = _create_error(img.ref)
        assert "credential" in msg.lower() or "auth" in msg.lower() or "denied" in msg.lower(), msg
        write("wrong-password")
        msg = _create_error(img.ref)
        assert registry_auth.host in msg, msg
        write(password)
        s = Sandbox.create(img.ref, timeout=60)
        try:
            assert s.commands.run("busybox true").exit_code == 0
        finally:
            s.kill()
    finally:
        path.unlink(missing_ok=True)


def test_first_command_reads_a_small_fraction_of_a_big_image(
    node: NodeProc, registry: LocalRegistry
) -> None:
    img = push_big_image(
        registry,
        "big",
        "1",
        total_mb=320,
        files=16,
        layers=2,
        compression="zstd",
        base=[busybox_layer()],
    )
    with api(node) as c:
        r = c.post("/images", json={"image": img.ref})
        assert r.status_code == 201, r.text
        content = r.json()["contentBytes"]
    assert content >= 320 * 2**20
    read0 = metric(node, "aenv_image_fs_read_bytes_total")
    s = Sandbox.create(img.ref, timeout=120)
    try:
        assert s.commands.run("true").exit_code == 0
        read1 = metric(node, "aenv_image_fs_read_bytes_total")
        fraction = (read1 - read0) / content
        print(f"\nlazy start: {read1 - read0} of {content} image bytes read ({fraction:.2%})")
        assert fraction < 0.05
        # reading one file reads that file's chunks, not the image
        path, digest = sorted(img.contents.items())[3]
        size = int(s.commands.run(f"stat -c %s /{path}").stdout)
        assert s.commands.run(f"sha256sum /{path}").stdout.split()[0] == digest
        read2 = metric(node, "aenv_image_fs_read_bytes_total")
        print(f"one {size}-byte file: {read2 - read1} bytes read")
        assert size <= read2 - read1 <= size + 2**20
    finally:
        s.kill()


@pytest.mark.parametrize(
    ("limit_mb", "count", "image_mb", "compression"),
    [
        pytest.param(64, 4, 96, "none", id="64MiB-cache-4x96MiB"),
        # the sizes: a 256 MiB cache, images totalling about 3 GiB
        pytest.param(256, 6, 512, "zstd", id="256MiB-cache-6x512MiB", marks=pytest.mark.slow),
    ],
)
def test_a_bounded_cache_serves_images_far_larger_than_itself(
    registry: LocalRegistry,
    monkeypatch: pytest.MonkeyPatch,
    limit_mb: int,
    count: int,
    image_mb: int,
    compression: str,
) -> None:
    """A small cache, several images far larger, sandboxes started one after another.

    The first sandbox keeps running while the others push its chunks out;
    it still reads every one of its files correctly (re-cut from the registry),
    and the cache never holds more than its limit plus one chunk.
    """
    home = built_home()
    assert home is not None
    limit = limit_mb * 2**20
    images = [
        push_big_image(
            registry,
            "fill",
            f"{limit_mb}-v{i}",
            total_mb=image_mb,
            files=6,
            layers=2,
            compression=compression,  # type: ignore[arg-type]
            seed=100 + i,
            base=[busybox_layer()],
        )
        for i in range(count)
    ]
    private = Path(tempfile.mkdtemp(prefix="aenv-test-cache-"))
    link_home(home, private)
    n = start_node(
        private,
        api_key="k" + secrets.token_hex(8),
        log_path=private / "node.log",
        extra_env={
            "AENV_CACHE_MAX_BYTES": str(limit),
            "AENV_NET_PREFIX": PREFIX,
            "AENV_SLOT_CIDR": "10.234.0.0/16",
        },
    )
    for var, value in (
        ("E2B_API_URL", n.url),
        ("E2B_SANDBOX_URL", n.url),
        ("E2B_API_KEY", n.api_key),
    ):
        monkeypatch.setenv(var, value)
    made: list[Sandbox] = []
    try:
        for img in images:
            s = Sandbox.create(img.ref, timeout=300)
            made.append(s)
            path, digest = next(iter(sorted(img.contents.items())))
            assert s.commands.run(f"sha256sum /{path}").stdout.split()[0] == digest
            assert metric(n, "aenv_image_cache_bytes") <= limit + 2**20
        first, img = made[0], images[0]
        for path, digest in sorted(img.contents.items()):
            got = first.commands.run(f"sha256sum /{path}", timeout=120).stdout.split()[0]
            assert got == digest, path
        assert metric(n, "aenv_image_cache_bytes") <= limit + 2**20
        assert metric(n, "aenv_image_cache_evictions_total") > 0
        assert metric(n, "aenv_image_cache_fetched_bytes_total") > 0
        assert metric(n, "aenv_image_fs_read_errors_total") == 0
    finally:
        for s in made:
            s.kill()
        assert stop_node(n) == 0
        left = leaks(private, PREFIX)
        shutil.rmtree(private, ignore_errors=True)
        assert not left, left


def test_a_debian_image_and_a_multi_arch_index(
    node: NodeProc, registry: LocalRegistry, tmp_path: Path
) -> None:
    home = built_home()
    assert home is not None
    debian = push_rootfs_dir(
        registry,
        "debian",
        "12",
        home / "templates" / "base" / "rootfs",
        compression="none",
        config={"Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]},
    )
    s = Sandbox.create(debian.ref, timeout=120)
    try:
        r = s.commands.run("cat /etc/debian_version; id -un; dpkg -s coreutils")
        assert r.stdout.splitlines()[1:3] == ["root", "Package: coreutils"]
        assert "Status: install ok installed" in r.stdout
        assert r.stdout.split(".")[0] == "12"
    finally:
        s.kill()
    with api(node) as c:
        key = {i["image"]: i for i in c.get("/images").json()}[debian.ref]["digest"][7:]
    reference = reference_unpack(registry, debian.ref, tmp_path / "ref")
    assert compare_trees(reference, node.home / "run" / "images" / key) == []

    arches = {
        "linux/amd64": push_busybox(
            registry, "multi", None, extra_layers=[Layer.build([file("arch", b"amd64\n")])]
        ),
        "linux/arm64/v8": push_busybox(
            registry,
            "multi",
            None,
            arch="arm64",
            variant="v8",
            extra_layers=[Layer.build([file("arch", b"arm64\n")])],
        ),
    }
    index = push_index(registry, "multi", "latest", arches)
    s = Sandbox.create(index.ref, timeout=60)
    try:
        assert s.files.read("/arch") == "amd64\n"  # this node's platform
    finally:
        s.kill()


def test_a_node_killed_mid_pull_recovers(
    registry: LocalRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGKILL while a layer converts: after a restart nothing half-pulled is listed,
    the dead image mount is cleared, and the same pull then succeeds."""
    home = built_home()
    assert home is not None
    img = push_big_image(
        registry,
        "killed",
        "1",
        total_mb=160,
        files=4,
        layers=2,
        compression="gzip",
        base=[busybox_layer()],
    )
    private = Path(tempfile.mkdtemp(prefix="aenv-test-pullkill-"))
    link_home(home, private)
    extra = {"AENV_NET_PREFIX": PREFIX, "AENV_SLOT_CIDR": "10.234.0.0/16"}
    key = "k" + secrets.token_hex(8)
    n = start_node(private, api_key=key, log_path=private / "node.log", extra_env=extra)
    try:

        def pull() -> None:
            with contextlib.suppress(httpx.HTTPError):  # the node dies under it
                httpx.post(
                    f"{n.url}/images",
                    json={"image": img.ref},
                    headers={"X-API-Key": key},
                    timeout=60,
                )

        pulling = threading.Thread(target=pull, daemon=True)
        pulling.start()
        deadline = time.monotonic() + 30
        while metric(n, "aenv_image_registry_bytes_total") < 8 * 2**20:
            assert time.monotonic() < deadline, "the pull never started"
            time.sleep(0.05)
        stop_node(n, signal.SIGKILL)
        pulling.join(10)
        n = start_node(private, api_key=key, log_path=private / "node.log", extra_env=extra)
        with api(n) as c:
            assert c.get("/images").json() == []
            r = c.post("/images", json={"image": img.ref, "name": "after-kill"})
            assert r.status_code == 201, r.text
        monkeypatch.setenv("E2B_API_URL", n.url)
        monkeypatch.setenv("E2B_SANDBOX_URL", n.url)
        monkeypatch.setenv("E2B_API_KEY", key)
        s = Sandbox.create("after-kill", timeout=60)
        try:
            path, digest = sorted(img.contents.items())[0]
            assert s.commands.run(f"sha256sum /{path}").stdout.split()[0] == digest
        finally:
            s.kill()
    finally:
        if n.proc.poll() is None:
            assert stop_node(n) == 0
        left = leaks(private, PREFIX)
        shutil.rmtree(private, ignore_errors=True)
        assert not left, left


def test_pull_with_the_image_command_running(node: NodeProc, registry: LocalRegistry) -> None:
    """`startCmd: true` runs the image's Entrypoint + Cmd and captures it running."""
    config = {
        "Entrypoint": ["/bin/sh", "-c"],
        "Cmd": ["i=0; while true; do i=$((i+1)); echo $i > /tmp/counter; sleep 0.1; done"],
    }
    img = push_busybox(registry, "service", "1", config=config)
    with api(node) as c:
        r = c.post(
            "/images",
            json={
                "image": img.ref,
                "name": "with-service",
                "startCmd": True,
                "readyCmd": "test -s /tmp/counter",
            },
        )
        assert r.status_code == 201, r.text
        assert r.json()["template"]["aliases"] == ["with-service"]
        bad = c.post("/images", json={"image": img.ref, "startCmd": True})
        assert bad.status_code == 400  # a start command needs a template name
    s = Sandbox.create("with-service", timeout=60)
    try:
        counts_on(s)  # the image's command came back running
    finally:
        s.kill()
    with api(node) as c:
        assert c.delete("/templates/with-service").status_code == 204
