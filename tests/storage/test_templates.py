"""Tests for the template store and the default templates' root filesystems.

Rules: every store lives in `tmp_path`; unsafe names must be refused before
anything on disk is read or changed (checked by snapshotting the whole
`tmp_path` tree). Building the busybox root filesystem needs root (it chowns
`/home/user`) and Debian's busybox-static; the Debian `base` build also needs
the Debian mirror and is marked `slow`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
from e2b.api.client.models.template import Template as SdkTemplate
from e2b.api.client.models.template_build_status import TemplateBuildStatus

from aenv.proto.ids import InvalidName
from aenv.storage.rootfs import (
    BASE_PACKAGES,
    build_busybox_rootfs,
    build_debian_rootfs,
    ensure_default_templates,
    main,
)
from aenv.storage.templates import (
    Template,
    TemplateConflict,
    TemplateNotFound,
    TemplateStore,
)

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")
needs_busybox = pytest.mark.skipif(
    not Path("/bin/busybox").exists(), reason="needs Debian's busybox-static"
)

UNSAFE = ["../x", "/x", "a\0b", "..", "", "x" * 200, "a/b", ".hidden", "A", "x/../../y"]


def make_rootfs(parent: Path, name: str, marker: str = "hello") -> Path:
    root = parent / name
    (root / "etc").mkdir(parents=True)
    (root / "etc/marker").write_text(marker)
    return root


def snapshot(path: Path) -> dict[str, tuple[int, int, int]]:
    """Every path under `path` with its mode, size and mtime."""
    out = {}
    for dirpath, dirs, files in os.walk(path):
        for name in dirs + files:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            out[p] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out


@pytest.fixture
def store(tmp_path: Path) -> TemplateStore:
    return TemplateStore(tmp_path / "templates")


def test_add_list_resolve_delete_round_trip(tmp_path: Path, store: TemplateStore) -> None:
    src = make_rootfs(tmp_path, "src-a", "A")
    a = store.add(
        template_id="tpl-a",
        rootfs_dir=src,
        aliases=["alpha", "first"],
        cpu_count=4,
        memory_mb=1024,
        start_cmd="python3 -m http.server",
        ready_cmd="curl -sf localhost:8000",
    )
    b = store.add(template_id="tpl-b", rootfs_dir=make_rootfs(tmp_path, "src-b", "B"))

    assert not src.exists(), "the root filesystem is moved, not copied"
    assert a.rootfs == store.root / "tpl-a" / "rootfs"
    assert (a.rootfs / "etc/marker").read_text() == "A"
    assert (store.root / "tpl-a" / "template.json").is_file()
    assert a.aliases == ("alpha", "first")
    assert (a.cpu_count, a.memory_mb) == (4, 1024)
    assert (b.cpu_count, b.memory_mb, b.aliases) == (2, 512, ())
    assert a.disk_size_mb >= 1
    assert a.build_id != b.build_id
    assert a.created_at == a.updated_at > 0

    assert store.list() == [a, b]
    assert store.resolve("tpl-a") == a
    assert store.resolve("alpha") == a
    assert store.resolve("first") == a
    assert store.resolve("tpl-b") == b

    # A fresh store over the same directory sees the same templates.
    reopened = TemplateStore(store.root)
    assert reopened.list() == [a, b]
    assert reopened.resolve("alpha").start_cmd == "python3 -m http.server"
    assert reopened.resolve("alpha").ready_cmd == "curl -sf localhost:8000"

    store.delete("alpha")
    assert not (store.root / "tpl-a").exists()
    with pytest.raises(TemplateNotFound):
        store.resolve("tpl-a")
    with pytest.raises(TemplateNotFound):
        store.resolve("alpha")
    with pytest.raises(TemplateNotFound):
        store.delete("tpl-a")
    assert store.list() == [b]
    store.delete("tpl-b")
    assert store.list() == []
    assert sorted(p.name for p in store.root.iterdir()) == [".aliases", ".lock", ".share-pending"]
    assert sorted(p.name for p in (store.root / ".aliases").iterdir()) == [
        ".complete",
        ".snapshots",
    ]


def test_ids_and_aliases_are_unique(tmp_path: Path, store: TemplateStore) -> None:
    store.add(template_id="one", rootfs_dir=make_rootfs(tmp_path, "s1"), aliases=["uno"])
    for template_id, aliases in [("one", []), ("uno", []), ("two", ["uno"]), ("two", ["one"])]:
        src = make_rootfs(tmp_path, f"src-{template_id}-{len(aliases)}-{aliases}")
        with pytest.raises(TemplateConflict):
            store.add(template_id=template_id, rootfs_dir=src, aliases=aliases)
        assert (src / "etc/marker").exists(), "a refused add leaves its source alone"
        shutil.rmtree(src)
    assert [t.template_id for t in store.list()] == ["one"]
    # Repeated aliases collapse; an alias may equal its own template's ID.
    two = store.add(
        template_id="two", rootfs_dir=make_rootfs(tmp_path, "s2"), aliases=["two", "dos", "dos"]
    )
    assert two.aliases == ("two", "dos")
    assert store.resolve("dos") == two


def test_a_home_from_before_the_alias_index_resolves_its_aliases(
    tmp_path: Path, store: TemplateStore
) -> None:
    a = store.add(template_id="tpl-a", rootfs_dir=make_rootfs(tmp_path, "a"), aliases=["alpha"])
    b = store.add(template_id="tpl-b", rootfs_dir=make_rootfs(tmp_path, "b"), aliases=["beta"])
    shutil.rmtree(store.root / ".aliases")  # as a node from before the index left it
    with pytest.raises(TemplateNotFound):
        store.resolve("alpha")  # this process trusts the index it built
    reopened = TemplateStore(store.root)
    assert reopened.resolve("alpha") == a
    assert reopened.resolve("beta") == b
    with pytest.raises(TemplateConflict):
        reopened.add(template_id="tpl-c", rootfs_dir=make_rootfs(tmp_path, "c"), aliases=["beta"])


def test_a_crash_leaves_no_alias_pointing_at_the_wrong_template(
    tmp_path: Path, store: TemplateStore
) -> None:
    a = store.add(template_id="tpl-a", rootfs_dir=make_rootfs(tmp_path, "a"), aliases=["alpha"])
    # What a crash after an add's pointer and before its template leaves, and what one
    # after a delete's rename and before its unlinking leaves: pointers nothing confirms.
    os.symlink("tpl-x", store.root / ".aliases" / "ghost")
    os.symlink("tpl-a", store.root / ".aliases" / "not-alpha")
    os.symlink("../../etc", store.root / ".aliases" / "evil")
    for stale in ("ghost", "not-alpha", "evil"):
        with pytest.raises(TemplateNotFound):
            store.resolve(stale)
    # a stale pointer does not hold its alias: the next template takes it
    b = store.add(template_id="tpl-b", rootfs_dir=make_rootfs(tmp_path, "b"), aliases=["ghost"])
    assert store.resolve("ghost") == b
    # a crash mid-build of the index (no completion marker) builds it again
    (store.root / ".aliases" / ".complete").unlink()
    os.unlink(store.root / ".aliases" / "alpha")
    reopened = TemplateStore(store.root)
    assert reopened.resolve("alpha") == a
    assert reopened.resolve("ghost") == b
    assert sorted(p.name for p in (store.root / ".aliases").iterdir()) == [
        ".complete",
        ".snapshots",
        "alpha",
        "ghost",
    ]


def test_unfinished_shares_are_found_without_reading_every_template(
    tmp_path: Path, store: TemplateStore
) -> None:
    a = store.add(template_id="tpl-a", rootfs_dir=make_rootfs(tmp_path, "a"))
    b = store.add(template_id="tpl-b", rootfs_dir=make_rootfs(tmp_path, "b"))
    store.add(template_id="tpl-c", rootfs_dir=make_rootfs(tmp_path, "c"))
    store.mark_share_pending("tpl-b", True)
    assert TemplateStore(store.root).share_pending() == [b]
    store.mark_share_pending("tpl-b", False)
    assert store.share_pending() == []
    # a home from before the index kept the marker in the template's directory
    (store.root / "tpl-a" / "share-pending").touch()
    (store.root / ".aliases" / ".complete").unlink()
    reopened = TemplateStore(store.root)
    assert reopened.share_pending() == [a]
    assert not (store.root / "tpl-a" / "share-pending").exists()
    reopened.delete("tpl-a")  # a deleted template's share is not resumed
    assert reopened.share_pending() == []


def test_names_are_the_first_ids_and_aliases_without_reading_templates(
    tmp_path: Path, store: TemplateStore
) -> None:
    store.add(template_id="tpl-b", rootfs_dir=make_rootfs(tmp_path, "b"), aliases=["zz"])
    store.add(template_id="tpl-a", rootfs_dir=make_rootfs(tmp_path, "a"), aliases=["aa", "mm"])
    (store.root / "tpl-a" / "template.json").write_text("unreadable")  # never read
    assert store.names(10) == ["aa", "mm", "tpl-a", "tpl-b", "zz"]
    assert store.names(2) == ["aa", "mm"]
    # listed again once a template or an alias comes or goes
    store.add(template_id="tpl-c", rootfs_dir=make_rootfs(tmp_path, "c"), aliases=["ab"])
    assert store.names(3) == ["aa", "ab", "mm"]
    store.delete("tpl-b")
    assert store.names(10) == ["aa", "ab", "mm", "tpl-a", "tpl-c"]


def test_an_adopted_newer_build_moves_the_aliases_it_changed(
    tmp_path: Path, store: TemplateStore
) -> None:
    base = store.add(template_id="tpl-base", rootfs_dir=make_rootfs(tmp_path, "base"))
    built, _ = store.put_built(
        template_id="tpl-built",
        build_id="b1",
        aliases=["old-name"],
        base=base,
        snapshot_id="snap-1",
    )
    doc = built.to_json() | {"buildID": "b2", "aliases": ["new-name"], "updatedAt": 1e12}
    store.adopt(json.dumps(doc).encode())
    assert store.resolve("new-name").build_id == "b2"
    with pytest.raises(TemplateNotFound):
        store.resolve("old-name")
    store.delete("new-name")
    assert sorted(p.name for p in (store.root / ".aliases").iterdir()) == [
        ".complete",
        ".snapshots",
    ]


def test_resolve_known_answers_from_memory_until_a_file_it_read_changes(
    tmp_path: Path, store: TemplateStore
) -> None:
    """A create asks for its template on the event loop first (no thread): the last
    answer of `resolve`, unless the template, its alias or its target changed since,
    through this store or another one over the same directory."""
    a = store.add(template_id="tpl-a", rootfs_dir=make_rootfs(tmp_path, "a"), aliases=["al"])
    assert store.resolve_known("tpl-a") is None  # never resolved
    assert store.resolve("al") == a
    assert store.resolve_known("al") == a
    assert store.resolve_known("tpl-a") is None

    public = TemplateStore(store.root).set_public("tpl-a", False)  # another writer
    assert store.resolve_known("al") is None
    assert store.resolve("al") == public and store.resolve_known("al") == public

    # the alias names another template now
    store.delete("tpl-a")
    b = store.add(template_id="tpl-b", rootfs_dir=make_rootfs(tmp_path, "b"), aliases=["al"])
    assert store.resolve_known("al") is None
    assert store.resolve("al") == b

    store.delete("tpl-b")
    assert store.resolve_known("al") is None
    with pytest.raises(TemplateNotFound):
        store.resolve("al")


def test_the_template_a_snapshot_backs_is_one_read(tmp_path: Path, store: TemplateStore) -> None:
    base = store.add(template_id="tpl-base", rootfs_dir=make_rootfs(tmp_path, "base"))
    built, _ = store.put_built(
        template_id="tpl-built", build_id="b1", aliases=["app"], base=base, snapshot_id="snap-1"
    )
    assert store.backing("snap-1") == built
    assert store.backing("snap-x") is None
    rebuilt, replaced = store.put_built(
        template_id="tpl-built", build_id="b2", aliases=["app"], base=base, snapshot_id="snap-2"
    )
    assert replaced == "snap-1"
    assert store.backing("snap-1") is None
    assert store.backing("snap-2") == rebuilt
    # a home from before the index: built when the store opens
    shutil.rmtree(store.root / ".aliases")
    assert TemplateStore(store.root).backing("snap-2") == rebuilt
    store.delete("app")
    assert store.backing("snap-2") is None
    assert list((store.root / ".aliases" / ".snapshots").iterdir()) == []


@pytest.mark.parametrize("bad", UNSAFE)
def test_unsafe_names_are_refused_without_touching_disk(
    tmp_path: Path, store: TemplateStore, bad: str
) -> None:
    store.add(template_id="good", rootfs_dir=make_rootfs(tmp_path, "s"), aliases=["ok"])
    # A template-shaped directory outside the store that `../x` would reach.
    outside = tmp_path / "x"
    shutil.copytree(store.root / "good", outside, symlinks=True)
    src = make_rootfs(tmp_path, "src")
    before = snapshot(tmp_path)

    with pytest.raises(InvalidName):
        store.resolve(bad)
    with pytest.raises(InvalidName):
        store.delete(bad)
    with pytest.raises(InvalidName):
        store.add(template_id=bad, rootfs_dir=src)
    with pytest.raises(InvalidName):
        store.add(template_id="fresh", rootfs_dir=src, aliases=[bad])

    assert snapshot(tmp_path) == before
    assert [t.template_id for t in store.list()] == ["good"]


@needs_root
def test_add_copies_across_filesystems(tmp_path: Path, store: TemplateStore) -> None:
    other_fs = Path("/dev/shm")
    if not other_fs.is_dir() or other_fs.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("needs /dev/shm on another filesystem")
    src = make_rootfs(other_fs, f"aenv-test-{os.getpid()}", "far")
    try:
        (src / "home/user").mkdir(parents=True)
        os.chown(src / "home/user", 1000, 1000)
        (src / "bin").mkdir()
        (src / "bin/sh").symlink_to("busybox")
        tpl = store.add(template_id="far", rootfs_dir=src)
        assert not src.exists()
        assert (tpl.rootfs / "etc/marker").read_text() == "far"
        assert (tpl.rootfs / "home/user").stat().st_uid == 1000
        assert os.readlink(tpl.rootfs / "bin/sh") == "busybox"
    finally:
        shutil.rmtree(src, ignore_errors=True)


def test_aliases_must_be_a_sequence_of_names(tmp_path: Path, store: TemplateStore) -> None:
    src = make_rootfs(tmp_path, "src")
    with pytest.raises(TypeError):
        store.add(template_id="t", rootfs_dir=src, aliases="abc")
    with pytest.raises(NotADirectoryError):
        store.add(template_id="t", rootfs_dir=tmp_path / "missing")
    assert store.list() == []
    assert (src / "etc/marker").exists()


def test_corrupt_metadata_is_skipped_and_logged(
    tmp_path: Path, store: TemplateStore, caplog: pytest.LogCaptureFixture
) -> None:
    good = store.add(template_id="good", rootfs_dir=make_rootfs(tmp_path, "s"), aliases=["g"])
    meta = json.loads((store.root / "good/template.json").read_text())

    def plant(template_id: str, content: str | bytes) -> None:
        (store.root / template_id / "rootfs").mkdir(parents=True)
        data = content.encode() if isinstance(content, str) else content
        (store.root / template_id / "template.json").write_bytes(data)

    plant("garbage", "{not json")
    plant("binary", b"\xff\xfe\x00")
    plant("list", "[]")
    plant("wrong-id", json.dumps({**meta, "templateID": "other"}))
    plant("bool-cpu", json.dumps({**meta, "templateID": "bool-cpu", "cpuCount": True}))
    plant("bad-alias", json.dumps({**meta, "templateID": "bad-alias", "aliases": ["../up"]}))
    plant("no-build", json.dumps({k: v for k, v in meta.items() if k != "buildID"}))
    (store.root / "no-metadata").mkdir()
    (store.root / "stray-file").write_text("x")

    with caplog.at_level(logging.WARNING, logger="aenv.storage.templates"):
        assert store.list() == [good]
        with pytest.raises(TemplateNotFound):
            store.resolve("garbage")
    assert store.resolve("g") == good
    logged = caplog.text
    for name in ("garbage", "binary", "list", "wrong-id", "bool-cpu", "bad-alias", "no-build"):
        assert repr(name) in logged
    # A corrupt template still owns its ID: nothing may be installed over it.
    with pytest.raises(TemplateConflict):
        store.add(template_id="garbage", rootfs_dir=make_rootfs(tmp_path, "s2"))


def test_to_api_parses_with_the_sdk_model(tmp_path: Path, store: TemplateStore) -> None:
    tpl = store.add(
        template_id="base",
        rootfs_dir=make_rootfs(tmp_path, "s"),
        aliases=["base", "debian"],
        cpu_count=2,
        memory_mb=512,
    )
    wire = json.loads(json.dumps(tpl.to_api()))
    parsed = SdkTemplate.from_dict(wire)
    assert parsed.additional_properties == {}
    assert parsed.template_id == "base"
    assert parsed.build_id == tpl.build_id
    assert (parsed.cpu_count, parsed.memory_mb) == (2, 512)
    assert parsed.disk_size_mb == tpl.disk_size_mb
    assert parsed.public is True
    assert parsed.aliases == ["base", "debian"]
    assert parsed.names == ["base", "debian"]
    assert parsed.created_at.timestamp() == pytest.approx(tpl.created_at, abs=1e-3)
    assert parsed.updated_at.timestamp() == pytest.approx(tpl.updated_at, abs=1e-3)
    assert parsed.created_at.tzinfo is not None
    assert parsed.build_status is TemplateBuildStatus.READY
    assert parsed.build_count == 1
    assert parsed.spawn_count == 0
    assert parsed.last_spawned_at is None
    assert parsed.is_default is True
    # Whatever the SDK re-serialises is what we sent (no field lost or renamed).
    assert set(parsed.to_dict()) == set(wire)

    used = SdkTemplate.from_dict(
        tpl.to_api(envd_version="0.9.0", spawn_count=3, last_spawned_at=tpl.created_at + 60)
    )
    assert used.envd_version == "0.9.0"
    assert used.spawn_count == 3
    assert used.last_spawned_at is not None
    assert used.last_spawned_at.timestamp() == pytest.approx(tpl.created_at + 60, abs=1e-3)


def test_template_is_a_frozen_value(store: TemplateStore, tmp_path: Path) -> None:
    tpl = store.add(template_id="t", rootfs_dir=make_rootfs(tmp_path, "s"))
    with pytest.raises(AttributeError):
        tpl.cpu_count = 8  # type: ignore[misc]
    assert isinstance(tpl, Template)


@needs_root
@needs_busybox
def test_busybox_rootfs(tmp_path: Path) -> None:
    root = tmp_path / "bb"
    build_busybox_rootfs(root)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bb"], "no staging left behind"

    sh = root / "bin/sh"
    assert sh.is_symlink()
    assert sh.resolve() == (root / "bin/busybox").resolve()
    assert (root / "usr/bin/env").is_symlink()
    assert not (root / "bin/bash").exists()
    assert not any(root.glob("lib*")), "no libc: busybox is static"
    passwd = (root / "etc/passwd").read_text().splitlines()
    assert "root:x:0:0:root:/root:/bin/sh" in passwd
    assert "user:x:1000:1000:user:/home/user:/bin/sh" in passwd
    assert "user:x:1000:" in (root / "etc/group").read_text().splitlines()
    assert stat.S_IMODE((root / "tmp").stat().st_mode) == 0o1777
    home = (root / "home/user").stat()
    assert (home.st_uid, home.st_gid) == (1000, 1000)
    assert (root / "etc/resolv.conf").read_text().startswith("nameserver ")

    # It runs: the shell and applets work inside the root filesystem.
    out = subprocess.run(
        ["chroot", str(root), "/bin/sh", "-c", "echo hi; id -u user; ls /home"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out == ["hi", "1000", "user"]

    with pytest.raises(FileExistsError):
        build_busybox_rootfs(root)


@needs_root
@needs_busybox
def test_ensure_default_templates_installs_busybox_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--home", str(tmp_path), "--busybox-only"]) == 0
    out = capsys.readouterr().out
    assert "template 'busybox' ready" in out
    store = TemplateStore(tmp_path / "templates")
    (tpl,) = store.list()
    assert (tpl.template_id, tpl.aliases) == ("busybox", ("busybox",))
    assert (tpl.rootfs / "bin/busybox").is_file()

    lines: list[str] = []
    ensure_default_templates(store, progress=lines.append, with_base=False)
    assert lines == ["template 'busybox' present"]
    assert store.list() == [tpl]
    assert not list(store.root.glob(".build-*"))


@needs_root
@needs_busybox
def test_a_default_template_of_an_older_recipe_is_rebuilt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Templates in REBUILT_WHEN_CHANGED (code-interpreter-v1; busybox stands in
    for it here) record their recipe, and are built again when it changed."""
    import aenv.storage.rootfs as rootfs

    monkeypatch.setattr(rootfs, "REBUILT_WHEN_CHANGED", frozenset({"busybox"}))
    store = TemplateStore(tmp_path / "templates")
    ensure_default_templates(store, with_base=False)
    first = store.resolve("busybox")
    assert (store.root / "busybox" / "recipe").read_text().strip() == rootfs.recipe("busybox")
    lines: list[str] = []
    ensure_default_templates(store, progress=lines.append, with_base=False)
    assert lines == ["template 'busybox' present"]

    monkeypatch.setattr(rootfs, "RECIPE_VERSION", rootfs.RECIPE_VERSION + 1)
    lines.clear()
    ensure_default_templates(store, progress=lines.append, with_base=False)
    assert "template 'busybox' is of an older recipe: rebuilding it" in lines
    again = store.resolve("busybox")
    assert again.build_id != first.build_id and (again.rootfs / "bin/busybox").is_file()
    assert (store.root / "busybox" / "recipe").read_text().strip() == rootfs.recipe("busybox")


@pytest.mark.slow
@needs_root
def test_debian_base_rootfs(tmp_path: Path) -> None:
    """Bootstraps Debian from deb.debian.org (about a minute and 250 MiB)."""
    root = tmp_path / "base"
    lines: list[str] = []
    build_debian_rootfs(root, progress=lines.append)
    try:
        check_debian_rootfs(tmp_path, root, lines)
    finally:
        shutil.rmtree(root)


def check_debian_rootfs(tmp_path: Path, root: Path, lines: list[str]) -> None:
    assert any("debootstrap" in line for line in lines)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base"]

    def inside(script: str, user: str = "root") -> str:
        argv = ["chroot", str(root), "bash", "-lc", script]
        if user != "root":
            argv = ["chroot", "--userspec=1000:1000", str(root), "env", "HOME=/home/user"]
            argv += ["bash", "-lc", script]
        return subprocess.run(argv, capture_output=True, text=True, check=True).stdout

    assert inside("id user").startswith("uid=1000(user) gid=1000(user) groups=1000(user),27(sudo)")
    assert inside("python3 -V").startswith("Python 3.")
    assert inside("curl --version").startswith("curl ")
    assert inside("git --version").startswith("git version")
    assert inside("sudo -n true && whoami", user="user").strip() == "user"
    assert inside("sudo -n id -u 2>/dev/null", user="user").strip() == "0"
    assert inside("cd ~ && pwd", user="user").strip() == "/home/user"
    assert (root / "etc/hostname").read_text() == "sandbox\n"
    assert not list((root / "var/lib/apt/lists").glob("*_Packages"))
    assert not list((root / "usr/share/man").iterdir())
    for pkg in BASE_PACKAGES:
        status = inside(f"dpkg-query -W -f='${{Status}}' {pkg}")
        assert status == "install ok installed", pkg
