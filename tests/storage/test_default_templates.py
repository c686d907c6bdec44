"""Default templates in the object store (aenv.storage.snapstore.defaults, and the
`--from-store` path of aenv.storage.rootfs).

Rules: a real `file://` store in the test's temp dir, real root filesystems
(busybox's, built by the real builder; needs root and Debian's busybox-static
for owners and device-free trees). A build is stored by content: the same
build shared twice is uploaded once; a different build never replaces the
one the store names (the first shared wins, the loser's upload is removed);
what a node fetches is exactly what was shared, down to its index digest;
the store's garbage collector keeps a shared build.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import trio

from aenv.config import Config
from aenv.storage.objstore import ObjectStore, open_object_store
from aenv.storage.rootfs import (
    build_busybox_rootfs,
    ensure_default_templates,
    main,
    recipe,
    store_fetcher,
)
from aenv.storage.snapstore import collect_garbage, delete_snapshot, fetch_manifest
from aenv.storage.snapstore.defaults import (
    StoredRootfs,
    fetch_rootfs,
    find_rootfs,
    pointer_key,
    rootfs_index,
    share_rootfs,
)
from aenv.storage.templates import TemplateStore

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not Path("/bin/busybox").exists(),
    reason="needs root and Debian's busybox-static",
)

RECIPE = recipe("busybox")


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "built" / "rootfs"
    root.parent.mkdir()
    build_busybox_rootfs(root)
    return root


def _store(tmp_path: Path) -> ObjectStore:
    return open_object_store((tmp_path / "store").as_uri())


def _build(tree: Path, by: str) -> tuple[StoredRootfs, bytes]:
    raw, digest = rootfs_index(tree)
    build = StoredRootfs(
        template_id="busybox",
        recipe=RECIPE,
        index=digest,
        cpu_count=1,
        memory_mb=256,
        disk_size_mb=2,
        shared_at=1_700_000_000.0,
        shared_by=by,
    )
    return build, raw


def _other_build(tree: Path, tmp_path: Path) -> Path:
    """Another node's build: the same recipe, one file different."""
    other = tmp_path / "other" / "rootfs"
    other.parent.mkdir()
    shutil.copytree(tree, other, symlinks=True)
    (other / "etc" / "motd").write_text("built elsewhere\n")
    return other


def _blob_files(tmp_path: Path) -> set[str]:
    blobs = tmp_path / "store" / "blobs"
    return {str(p) for p in blobs.rglob("*") if p.is_file()} if blobs.exists() else set()


def test_recipe_names_the_architecture_and_differs_per_template() -> None:
    assert RECIPE.startswith(os.uname().machine.lower() + "-")
    assert recipe("base") != RECIPE
    assert recipe("busybox") == RECIPE  # stable: the key nodes meet at


async def test_shared_build_is_fetched_exactly(tree: Path, tmp_path: Path) -> None:
    store = _store(tmp_path)
    assert await find_rootfs(store, "busybox", RECIPE) is None
    build, raw = _build(tree, "node-a")
    assert await share_rootfs(store, build=build, tree=tree, index_raw=raw) == "shared"

    found = await find_rootfs(store, "busybox", RECIPE)
    assert found == build
    dest = tmp_path / "fetched"
    size = await fetch_rootfs(store, found, dest)
    assert size > 0
    # the same content, owners, modes, times and links: the same index digest
    assert rootfs_index(dest)[1] == build.index
    assert os.readlink(dest / "bin" / "sh") == os.readlink(tree / "bin" / "sh")
    assert (dest / "home" / "user").stat().st_uid == 1000


async def test_the_same_build_shared_twice_is_uploaded_once(tree: Path, tmp_path: Path) -> None:
    store = _store(tmp_path)
    build, raw = _build(tree, "node-a")
    assert await share_rootfs(store, build=build, tree=tree, index_raw=raw) == "shared"
    blobs = _blob_files(tmp_path)
    # a second node with the same build (it fetched it): nothing uploaded, nothing renamed
    again, raw2 = _build(tree, "node-b")
    before = store.statistics().bytes_uploaded
    assert await share_rootfs(store, build=again, tree=tree, index_raw=raw2) == "present"
    assert store.statistics().bytes_uploaded == before
    assert _blob_files(tmp_path) == blobs
    found = await find_rootfs(store, "busybox", RECIPE)
    assert found is not None and found.shared_by == "node-a"


async def test_a_different_build_never_replaces_the_named_one(tree: Path, tmp_path: Path) -> None:
    store = _store(tmp_path)
    first, raw = _build(tree, "node-a")
    assert await share_rootfs(store, build=first, tree=tree, index_raw=raw) == "shared"
    other_tree = _other_build(tree, tmp_path)
    second, raw2 = _build(other_tree, "node-b")
    assert second.index != first.index
    assert await share_rootfs(store, build=second, tree=other_tree, index_raw=raw2) == "other"
    assert await find_rootfs(store, "busybox", RECIPE) == first
    # the losing build is not left in the store as a root nobody names
    assert await fetch_manifest(store, second.snapshot_id, by_id=True) is None


async def test_two_builds_shared_at_once_agree_on_one(tree: Path, tmp_path: Path) -> None:
    store = _store(tmp_path)
    other_tree = _other_build(tree, tmp_path)
    builds = [(*_build(tree, "node-a"), tree), (*_build(other_tree, "node-b"), other_tree)]
    outcomes: dict[str, str] = {}

    async def share(build: StoredRootfs, raw: bytes, root: Path) -> None:
        outcomes[build.shared_by] = await share_rootfs(store, build=build, tree=root, index_raw=raw)

    async with trio.open_nursery() as n:
        for build, raw, root in builds:
            n.start_soon(share, build, raw, root)
    assert sorted(outcomes.values()) == ["other", "shared"]
    winner = next(b for b, _r, _t in builds if outcomes[b.shared_by] == "shared")
    loser = next(b for b, _r, _t in builds if outcomes[b.shared_by] == "other")
    assert await find_rootfs(store, "busybox", RECIPE) == winner
    assert await fetch_manifest(store, loser.snapshot_id, by_id=True) is None


async def test_a_pointer_whose_build_is_gone_is_replaced(tree: Path, tmp_path: Path) -> None:
    store = _store(tmp_path)
    first, raw = _build(tree, "node-a")
    await share_rootfs(store, build=first, tree=tree, index_raw=raw)
    await delete_snapshot(store, first.snapshot_id, None)
    assert await find_rootfs(store, "busybox", RECIPE) is None  # nothing to fetch
    other_tree = _other_build(tree, tmp_path)
    second, raw2 = _build(other_tree, "node-b")
    assert await share_rootfs(store, build=second, tree=other_tree, index_raw=raw2) == "shared"
    assert await find_rootfs(store, "busybox", RECIPE) == second


async def test_garbage_collection_keeps_a_shared_build(tree: Path, tmp_path: Path) -> None:
    store = _store(tmp_path)
    build, raw = _build(tree, "node-a")
    await share_rootfs(store, build=build, tree=tree, index_raw=raw)
    report = await collect_garbage(store, grace_s=0.0)
    assert report.deleted == 0
    await fetch_rootfs(store, build, tmp_path / "fetched")


async def test_another_recipe_is_another_pointer(tree: Path, tmp_path: Path) -> None:
    store = _store(tmp_path)
    build, raw = _build(tree, "node-a")
    await share_rootfs(store, build=build, tree=tree, index_raw=raw)
    assert await find_rootfs(store, "busybox", "aarch64-0000000000000000") is None
    assert pointer_key("busybox", RECIPE) != pointer_key("busybox", "aarch64-0000000000000000")


def test_from_store_fetches_instead_of_building(tree: Path, tmp_path: Path) -> None:
    store = _store(tmp_path)
    build, raw = _build(tree, "node-a")
    trio.run(lambda: share_rootfs(store, build=build, tree=tree, index_raw=raw))
    templates = TemplateStore(tmp_path / "home" / "templates")
    lines: list[str] = []
    url = (tmp_path / "store").as_uri()
    ensure_default_templates(
        templates,
        progress=lines.append,
        with_base=False,
        fetch=store_fetcher(url, progress=lines.append),
    )
    assert any("ready (fetched from the object store)" in line for line in lines), lines
    assert not any("building template" in line for line in lines), lines
    assert templates.rootfs_index("busybox") == build.index
    assert rootfs_index(templates.resolve("busybox").rootfs)[1] == build.index


def test_from_store_builds_what_the_store_lacks(tmp_path: Path) -> None:
    templates = TemplateStore(tmp_path / "home" / "templates")
    lines: list[str] = []
    url = (tmp_path / "empty-store").as_uri()
    ensure_default_templates(
        templates,
        progress=lines.append,
        with_base=False,
        fetch=store_fetcher(url, progress=lines.append),
    )
    assert any("has no build of template 'busybox'" in line for line in lines), lines
    assert any("ready (built)" in line for line in lines), lines
    assert (templates.resolve("busybox").rootfs / "bin" / "busybox").exists()


def test_the_command_fetches_with_from_store(
    tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = _store(tmp_path)
    build, raw = _build(tree, "node-a")
    trio.run(lambda: share_rootfs(store, build=build, tree=tree, index_raw=raw))
    home = tmp_path / "home"
    url = (tmp_path / "store").as_uri()
    assert main(["--home", str(home), "--busybox-only", "--from-store", url]) == 0
    out = capsys.readouterr().out
    assert "template 'busybox' ready (fetched from the object store)" in out, out
    assert main(["--home", str(home), "--busybox-only", "--from-store", url]) == 0
    assert "template 'busybox' present" in capsys.readouterr().out  # a second run: nothing
    # `make serve` without AENV_STORE_URL passes an empty URL: a build
    other = tmp_path / "other-home"
    assert main(["--home", str(other), "--busybox-only", "--from-store", ""]) == 0
    out = capsys.readouterr().out
    assert "ready (built)" in out and "object store" not in out, out


@pytest.mark.parametrize(
    ("env", "shares"),
    [
        ({}, False),  # the default store lives in the home: nobody to share with
        ({"AENV_STORE_URL": "file:///srv/shared"}, True),
        ({"AENV_STORE_URL": "none", "AENV_SHARE_DEFAULT_TEMPLATES": "on"}, False),
        ({"AENV_SHARE_DEFAULT_TEMPLATES": "on"}, True),
        ({"AENV_STORE_URL": "s3://b/p", "AENV_SHARE_DEFAULT_TEMPLATES": "off"}, False),
    ],
)
def test_which_nodes_share_their_default_templates(env: dict[str, str], shares: bool) -> None:
    assert Config.from_env({"AENV_HOME": "/tmp/h", **env}).shares_default_templates is shares


def test_a_bad_share_setting_is_refused() -> None:
    with pytest.raises(ValueError, match="AENV_SHARE_DEFAULT_TEMPLATES"):
        Config.from_env({"AENV_SHARE_DEFAULT_TEMPLATES": "sometimes"})
