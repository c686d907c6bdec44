"""Durable snapshots in an S3 store, with real nodes, moto's S3 server and the e2b SDK.

Rules: each test runs its own nodes (tests/e2e/nodes.py: private homes
linked to the built one, their own netns prefix and slot range,
AENV_TEST_DURABLE_PREFIX / AENV_TEST_DURABLE_CIDR to run beside another
suite) against its own moto server on
loopback (tests/s3.py), configured only through AENV_STORE_URL and the
AWS_* variables; faults are injected by killing that server mid-upload and
by overwriting stored objects behind the node's back. A snapshot must be
restorable on a node that has never seen it, listed durable only once
whole, and a broken store object must fail the create clearly and leave
nothing behind. Nothing of the nodes may leak at the end.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2b import Sandbox, Template
from e2b.exceptions import SandboxException

# Fixtures are imported by name, so test parameters shadow them (F811).
# ruff: noqa: F811
from aenv.storage.memimage import unpack_map
from tests.conftest import requires_node
from tests.e2e.counter import COUNTER, count, counts_on
from tests.e2e.nodes import Nodes
from tests.s3 import MotoS3, s3_faulty  # noqa: F401

pytestmark = [requires_node, pytest.mark.runsc]

# AENV_TEST_DURABLE_PREFIX / _CIDR: another pair for a run beside another suite
PREFIX = os.environ.get("AENV_TEST_DURABLE_PREFIX", "aenvo")
CIDR = os.environ.get("AENV_TEST_DURABLE_CIDR", "10.230.0.0/16")
TEMPLATE = "busybox"
MiB = 1 << 20


@pytest.fixture
def nodes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, s3_faulty: MotoS3) -> Iterator[Nodes]:
    with Nodes(
        tmp_path,
        s3_faulty,
        monkeypatch,
        net_prefix=PREFIX,
        cidr=CIDR,
        store_prefix="durable",
        env={"AENV_STORE_GC_GRACE": "0"},
    ) as n:
        yield n


def _blob_key(digest: str) -> str:
    hexd = digest.removeprefix("sha256:")
    return f"blobs/sha256/{hexd[:2]}/{hexd}"


def _sandbox_with_state() -> Sandbox:
    s = Sandbox.create(TEMPLATE, timeout=300)
    s.commands.run(COUNTER, background=True)
    s.files.write("/tmp/kept.txt", "written before the snapshot")
    s.commands.run("mkdir -p /tmp/data && head -c 3000000 /dev/urandom > /tmp/data/blob")
    counts_on(s)
    return s


def test_a_snapshot_restores_on_a_node_that_never_saw_it(nodes: Nodes) -> None:
    nodes.start("a")
    src = _sandbox_with_state()
    blob_sum = src.commands.run("md5sum /tmp/data/blob").stdout.split()[0]
    before = count(src)  # the source runs on after its snapshot: count first
    info = nodes.snapshot(src.sandbox_id, name="dur-a", durable=True)
    assert info["storage"] == "durable"  # it waited
    sid = info["snapshotID"]
    src.kill()
    nodes.stop()

    for attempt in ("fresh home", "home wiped but bundle and templates"):
        if attempt == "fresh home":
            nodes.start("b")
        else:  # the same node again, its local artefacts and caches gone
            for part in nodes.home("b").iterdir():
                if part.name in ("bundle", "templates", "node.log"):
                    continue
                if part.is_dir() and not part.is_symlink():
                    shutil.rmtree(part)
                else:
                    part.unlink()
            nodes.start("b")
        assert not (nodes.home("b") / "snapshots" / sid).exists()
        t0 = time.monotonic()
        s = Sandbox.create(sid if attempt == "fresh home" else "dur-a", timeout=120)
        took = time.monotonic() - t0
        print(f"{attempt}: restored from the store in {took:.2f}s")
        try:
            assert s.files.read("/tmp/kept.txt") == "written before the snapshot"
            assert s.commands.run("md5sum /tmp/data/blob").stdout.split()[0] == blob_sum
            assert count(s) >= before
            counts_on(s)  # the counter process itself came back, still running
        finally:
            s.kill()
        assert nodes.storage(sid) == "durable"
        # now local: a second create needs nothing from the store
        again = Sandbox.create(sid, timeout=120)
        again.kill()
        nodes.stop()

    # a node that never had it deletes it from the store
    nodes.start("c")
    assert nodes.delete(f"/snapshots/{sid}").status_code == 204
    assert nodes.get(f"/snapshots/{sid}").status_code == 404
    assert nodes.delete(f"/snapshots/{sid}").status_code == 404
    nodes.stop()


def test_killing_the_store_mid_upload_leaves_it_uploading_until_it_returns(
    nodes: Nodes,
) -> None:
    nodes.start("a")
    src = _sandbox_with_state()
    try:
        nodes.s3.kill_after(8)  # the server dies a few requests into the upload
        sid = nodes.snapshot(src.sandbox_id)["snapshotID"]  # returns without waiting
        # the store dies, the upload's retries give up on this attempt and say why
        # (how soon depends on the client's own retries and the machine's load)
        deadline = time.monotonic() + 30
        while True:
            detail = nodes.get(f"/snapshots/{sid}").json()
            assert detail["storage"] == "uploading", detail
            if "unavailable" in (detail.get("storageError") or ""):
                break
            assert time.monotonic() < deadline, detail
            time.sleep(0.3)
        assert not nodes.s3.running
        listed = {x["snapshotID"]: x["storage"] for x in nodes.get("/snapshots").json()}
        assert listed[sid] == "uploading"
        nodes.s3.start()
        assert f"snapshots/{sid}.json" not in nodes.objects("snapshots/")  # never half there
        nodes.wait_storage(sid, "durable")  # the upload resumed by itself
        assert f"snapshots/{sid}.json" in nodes.objects("snapshots/")
        assert not nodes.objects("pending/")

        # a node restart mid-upload resumes it
        nodes.s3.stop()
        sid2 = nodes.snapshot(src.sandbox_id)["snapshotID"]
        time.sleep(1)
        assert nodes.storage(sid2) == "uploading"
    finally:
        src.kill()
    nodes.stop()
    nodes.s3.start()
    assert f"snapshots/{sid2}.json" not in nodes.objects("snapshots/")
    nodes.start("a")
    nodes.wait_storage(sid2, "durable")
    child = Sandbox.create(sid2, timeout=120)
    try:
        assert child.files.read("/tmp/kept.txt") == "written before the snapshot"
    finally:
        child.kill()


def test_ten_snapshots_store_the_changes_not_ten_copies(nodes: Nodes) -> None:
    nodes.start("a")
    s = Sandbox.create(TEMPLATE, timeout=600)
    rows: list[tuple[str, int, int, int, int, int]] = []
    try:
        for i in range(10):
            s.commands.run(f"head -c {MiB} /dev/urandom > $HOME/new-{i}.bin")
            info = nodes.snapshot(s.sandbox_id, durable=True)
            up = nodes.get(f"/snapshots/{info['snapshotID']}").json()["storageUpload"]
            rows.append(
                (
                    info["snapshotID"],
                    up["layerBytes"],
                    up["imageBytes"],
                    up["bytes"],
                    up["imagePages"],
                    up["reusedPages"],
                )
            )
    finally:
        s.kill()
    layer = sum(r[1] for r in rows)
    image = sum(r[2] for r in rows)
    raw_image = sum(r[4] for r in rows) * 4096
    stored = sum(nodes.objects("blobs/").values())
    full_copies = sum((i + 1) * MiB for i in range(10))  # each stack holds every earlier MiB
    print("\nsnapshot                 layer bytes  image bytes  total        pages  reused")
    for sid, lb, ib, tb, pages, reused in rows:
        print(f"{sid}  {lb:>11}  {ib:>11}  {tb:>11}  {pages:>6}  {reused:>6}")
    print(
        f"sum: file data {layer / MiB:.2f} MiB (10 full copies would be "
        f"{full_copies / MiB:.0f} MiB), memory images {image / MiB:.2f} MiB stored for "
        f"{raw_image / MiB:.2f} MiB of images, store holds {stored / MiB:.2f} MiB of blobs"
    )
    assert 10 * MiB <= layer < 12 * MiB
    assert stored == sum(r[3] for r in rows)  # every byte uploaded once
    # memory: the first image whole (compressed), later ones only the pages that changed
    assert rows[0][5] == 0
    for _sid, _lb, ib, _tb, pages, reused in rows[1:]:
        assert reused > pages * 0.75, (reused, pages)
        assert ib < rows[0][2] * 0.4, (ib, rows[0][2])
    for sid, *_ in rows:
        assert nodes.delete(f"/snapshots/{sid}").status_code == 204


def test_a_corrupt_or_missing_object_fails_the_restore_and_leaves_nothing(
    nodes: Nodes,
) -> None:
    nodes.start("a")
    src = _sandbox_with_state()
    try:
        sid = nodes.snapshot(src.sandbox_id, durable=True)["snapshotID"]
    finally:
        src.kill()
    nodes.stop()
    m = nodes.manifest(sid)
    pages = next(f for f in m["image"] if f["name"] == "pages.img")
    got = nodes.s3.boto().get_object(
        Bucket=nodes.s3.bucket, Key=f"{nodes.prefix}/{_blob_key(pages['pagemap'])}"
    )
    chunk = unpack_map(got["Body"].read()).packs[0].digest  # a pack of guest memory pages
    nodes.overwrite(_blob_key(chunk), b"garbage")

    nodes.start("b")
    home = nodes.home("b")
    r = nodes.post("/sandboxes", {"templateID": sid})
    assert r.status_code == 500, r.text
    msg = r.json()["message"]
    assert sid in msg and _blob_key(chunk) in msg and "corrupt" in msg, msg
    with pytest.raises(SandboxException, match="corrupt"):
        Sandbox.create(sid)

    def leftovers() -> list[str]:
        found = [p.name for p in (home / "snapshots").iterdir()]
        found += [p.name for p in (home / "layers" / "layers").glob("*")]
        found += [p.name for p in (home / "layers" / "tmp").glob("*")]
        return found

    assert leftovers() == []
    assert sid not in [x["snapshotID"] for x in nodes.get("/snapshots").json()]

    # a missing layer blob: the same
    layer_index = m["layers"][0]["index"]
    nodes.s3.boto().delete_object(
        Bucket=nodes.s3.bucket, Key=f"{nodes.prefix}/{_blob_key(layer_index)}"
    )
    r = nodes.post("/sandboxes", {"templateID": sid})
    assert r.status_code == 500 and "missing" in r.json()["message"], r.text
    assert leftovers() == []


def test_gc_removes_what_only_deleted_snapshots_used(nodes: Nodes) -> None:
    nodes.start("a")
    src = _sandbox_with_state()
    try:
        x = nodes.snapshot(src.sandbox_id, durable=True)["snapshotID"]
        src.commands.run(f"head -c {2 * MiB} /dev/urandom > /tmp/only-y.bin")
        y = nodes.snapshot(src.sandbox_id, durable=True)["snapshotID"]
    finally:
        src.kill()
    keep = {_blob_key(d) for d in nodes.manifest(x)["blobs"]}
    only_y = {_blob_key(d) for d in nodes.manifest(y)["blobs"]} - keep
    assert only_y and keep
    assert nodes.delete(f"/snapshots/{y}").status_code == 204

    deadline = time.monotonic() + 30
    while set(nodes.objects("blobs/")) != keep:
        left = set(nodes.objects("blobs/"))
        assert keep <= left, f"a referenced blob was deleted: {keep - left}"
        assert time.monotonic() < deadline, f"{len(left & only_y)} blobs of {y} remain"
        time.sleep(0.3)
    assert f"snapshots/{y}.json" not in nodes.objects("snapshots/")

    assert nodes.delete(f"/snapshots/{x}").status_code == 204
    deadline = time.monotonic() + 30
    while nodes.objects("blobs/"):
        assert time.monotonic() < deadline, f"{len(nodes.objects('blobs/'))} blobs remain"
        time.sleep(0.3)
    assert not nodes.objects("snapshots/") and not nodes.objects("pending/")


def test_a_built_template_reaches_a_node_that_never_saw_it(nodes: Nodes) -> None:
    """A template built on node A (steps over `base`) is in the store once its
    snapshot is durable: node B, fresh home, starts it by name with the build's
    files and defaults."""
    nodes.start("a")
    info = Template.build(
        Template().from_template("base").run_cmd("echo built-on-a > /home/user/b.txt"),
        "shared-build",
    )
    nodes.wait_template(info.template_id, "the built template never reached the store")
    nodes.stop()

    nodes.start("b")
    s = Sandbox.create("shared-build", timeout=60)
    try:
        assert s.get_info().template_id == info.template_id
        assert s.commands.run("cat b.txt; whoami").stdout == "built-on-a\nuser\n"
    finally:
        s.kill()
    nodes.stop()


def test_a_template_share_cut_by_a_node_stop_finishes_after_the_restart(nodes: Nodes) -> None:
    """With the store down, a build finishes on node A but neither its snapshot nor
    the template reach the store; A stops. Once the store and A are back, A finishes
    both unasked, and node B (fresh home) starts the template by name."""
    nodes.start("a")
    nodes.s3.stop()
    try:
        info = Template.build(
            Template().from_template("base").run_cmd("echo shared-late > /home/user/b.txt"),
            "late-share",
        )
        time.sleep(1.0)  # the share is waiting for the snapshot's upload, which retries
    finally:
        nodes.stop()
        nodes.s3.start()
    assert f"templates/{info.template_id}.json" not in nodes.objects("templates/")
    nodes.start("a")
    nodes.wait_template(info.template_id, "the restarted node never shared the template")
    nodes.stop()

    nodes.start("b")
    s = Sandbox.create("late-share", timeout=60)
    try:
        assert s.commands.run("cat b.txt").stdout == "shared-late\n"
    finally:
        s.kill()
    nodes.stop()


def _metric(nodes: Nodes, name: str) -> float:
    for line in nodes.get("/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no metric {name}")


def test_a_cold_restore_serves_its_layers_on_demand_then_copies_them(nodes: Nodes) -> None:
    """Node B restores a snapshot whose layer holds 32 MiB it never saw: the sandbox
    starts with the layer served through the image mount, reading only what it
    touches from the store; after a crash (the sandbox paused on disk meanwhile)
    the layer is served again, then copied to B's disk, and reads the same."""
    nodes.start("a")
    src = Sandbox.create(TEMPLATE, timeout=300)
    try:
        # in $HOME, on the root filesystem (/tmp is the sandbox's own tmpfs)
        src.commands.run("head -c 33554432 /dev/urandom > $HOME/big.bin; echo small > $HOME/s")
        want = src.commands.run("sha256sum $HOME/big.bin").stdout.split()[0]
        rel = src.commands.run("echo $HOME").stdout.strip().lstrip("/")
        sid = nodes.snapshot(src.sandbox_id, durable=True)["snapshotID"]
    finally:
        src.kill()
    nodes.stop()

    nodes.start("b", AENV_LAZY_MATERIALISE_AFTER="3600", AENV_HIBERNATE_AFTER="0.5")
    home = nodes.home("b")
    before = _metric(nodes, "aenv_image_store_fetched_bytes_total")
    s = Sandbox.create(sid, timeout=300)
    assert s.commands.run("cat $HOME/s").stdout == "small\n"
    lazy = [p for p in (home / "layers" / "layers").iterdir() if (p / "tree").is_symlink()]
    assert lazy, "no layer is served on demand"
    fetched = _metric(nodes, "aenv_image_store_fetched_bytes_total") - before
    assert fetched < 4 * MiB, f"{fetched} bytes of layer content fetched before any read"
    assert s.commands.run("sha256sum $HOME/big.bin").stdout.split()[0] == want
    # gVisor restored its own page cache of the file; the node's view of the layer
    # (what any read the cache misses goes to) comes from the store, chunk by chunk
    served = [p / "tree" / rel / "big.bin" for p in lazy if (p / "tree" / rel).is_dir()]
    assert served and hashlib.sha256(served[0].read_bytes()).hexdigest() == want
    assert _metric(nodes, "aenv_image_store_fetched_bytes_total") - before >= 32 * MiB
    s.beta_pause()
    deadline = time.monotonic() + 60
    while nodes.get(f"/sandboxes/{s.sandbox_id}").json().get("pausedInMemory", True):
        assert time.monotonic() < deadline, "the paused sandbox never went to disk"
        time.sleep(0.2)
    nodes.stop(signal.SIGKILL)  # a crash; the layer is still not copied

    nodes.start("b")  # serves the layer again, copies it after AENV_LAZY_MATERIALISE_AFTER
    deadline = time.monotonic() + 60
    while any((p / "tree").is_symlink() for p in lazy):
        assert time.monotonic() < deadline, "the layer was never copied to disk"
        time.sleep(0.2)
    assert not served[0].parent.parent.is_symlink()  # the layer's own tree on disk
    assert hashlib.sha256(served[0].read_bytes()).hexdigest() == want
    s2 = Sandbox.connect(s.sandbox_id, timeout=300)
    try:
        assert s2.commands.run("sha256sum $HOME/big.bin; cat $HOME/s").stdout.split()[::2] == [
            want,
            "small",
        ]
    finally:
        s2.kill()
    nodes.stop()
