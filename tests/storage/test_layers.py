"""Frozen layers: freeze without copying, fork stacks, compaction, gc, crash leftovers.

Rules: every layer, store and overlay lives in `tmp_path`; layers are made
by the kernel (writes through a real overlay mount, then freeze), so the
whiteouts and opaque directories tested are the ones overlayfs writes.
Compaction is checked by mounting both stacks read-only over the same base
and comparing everything a guest could observe (types, contents, link
targets, modes, owners, mtimes, user xattrs, hard-link groups). Mounting
needs root: marked runsc like the other root-only tests. No test leaves a
mount under `tmp_path`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from aenv.storage.layers import LayerError, LayerStack, LayerStore
from aenv.storage.overlay import open_writable_root, unmount_root

pytestmark = pytest.mark.runsc


@pytest.fixture(autouse=True)
def _root_only(tmp_path: Path) -> Iterator[None]:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    yield
    assert [m for m in Path("/proc/mounts").read_text().splitlines() if str(tmp_path) in m] == []


def make_base(path: Path) -> Path:
    files = {
        "etc/os": "base",
        "etc/gone": "to be deleted",
        "etc/becomes-dir": "a file in the base",
        "var/log/syslog": "log",
        "var/lib/state": "state",
        "opq/base-only": "hidden once opaque",
        "home/user/.profile": "profile",
    }
    for name, content in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(content)
    (path / "dir-becomes-file").mkdir()
    (path / "dir-becomes-file" / "inner").write_text("x")
    return path


async def frozen(
    store: LayerStore, below: LayerStack, work: Path, change: Callable[[Path], object]
) -> LayerStack:
    """Mount a fresh upper over `below`, apply `change` through it, freeze it."""
    async with open_writable_root(below.lowers(), work) as root:
        change(root)
        upper = await unmount_root(work)
        layer = await store.freeze(upper, below=below)
        assert not upper.exists()  # moved, not copied
    return store.chain(layer)


@contextlib.contextmanager
def mounted_view(lowers: list[Path], mountpoint: Path) -> Iterator[Path]:
    mountpoint.mkdir(parents=True)
    opts = "lowerdir=" + ":".join(str(p) for p in lowers)
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", opts, str(mountpoint)], check=True)
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", str(mountpoint)], check=True)


def observe(root: Path) -> dict[str, Any]:
    """Everything a guest sees of a tree, hard links as groups of paths."""
    view: dict[str, Any] = {}
    inodes: dict[int, list[str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted(dirnames + filenames):
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            st = os.lstat(p)
            entry: dict[str, Any] = {
                "type": stat.S_IFMT(st.st_mode),
                "mode": stat.S_IMODE(st.st_mode),
                "owner": (st.st_uid, st.st_gid),
            }
            if not stat.S_ISDIR(st.st_mode):
                entry["mtime"] = st.st_mtime_ns
            if stat.S_ISREG(st.st_mode):
                entry["data"] = p.read_bytes()
                if st.st_nlink > 1:
                    inodes.setdefault(st.st_ino, []).append(rel)
            if stat.S_ISLNK(st.st_mode):
                entry["target"] = os.readlink(p)
            else:
                entry["xattrs"] = {
                    n: os.getxattr(p, n) for n in os.listxattr(p) if n.startswith("user.")
                }
            view[rel] = entry
    view["<hardlinks>"] = sorted(sorted(g) for g in inodes.values() if len(g) > 1)
    return view


def change_1(root: Path) -> None:
    (root / "etc" / "os").write_text("layer 1")
    (root / "etc" / "gone").unlink()  # whiteout over a base file
    (root / "app").mkdir()
    (root / "app" / "main.py").write_text("print('hi')")
    (root / "app" / "run").write_text("#!/bin/sh\n")
    os.chmod(root / "app" / "run", 0o750)
    os.chown(root / "app" / "run", 1000, 1000)
    os.symlink("main.py", root / "app" / "link")
    os.link(root / "app" / "main.py", root / "app" / "hardlink")
    os.setxattr(root / "app" / "main.py", "user.note", b"kept")
    os.mkfifo(root / "app" / "fifo")
    (root / "etc" / "becomes-dir").unlink()
    (root / "etc" / "becomes-dir").mkdir()  # a file below becomes a directory
    (root / "etc" / "becomes-dir" / "now").write_text("dir")
    (root / "opq" / "from-layer-1").write_text("hidden once opaque")


def change_2(root: Path) -> None:
    subprocess.run(["rm", "-rf", str(root / "var")], check=True)  # whiteout over a base dir
    (root / "app" / "run").unlink()  # whiteout over a layer-1 file
    subprocess.run(["rm", "-rf", str(root / "opq")], check=True)
    (root / "opq").mkdir()  # recreated: opaque, hides base-only
    (root / "opq" / "fresh").write_text("fresh")
    subprocess.run(["rm", "-rf", str(root / "dir-becomes-file")], check=True)
    (root / "dir-becomes-file").write_text("now a file")
    (root / "home" / "user" / "notes").write_text("layer 2")


def change_3(root: Path) -> None:
    (root / "var").mkdir()  # over a whiteout: opaque again
    (root / "var" / "new").write_text("new var")
    (root / "app" / "run").write_text("back")
    (root / "etc" / "os").write_text("layer 3")
    (root / "app" / "main.py").write_text("print('changed')")  # breaks the hard link


async def three_layers(tmp_path: Path) -> tuple[LayerStore, Path, LayerStack]:
    base = make_base(tmp_path / "base")
    store = LayerStore(tmp_path / "store")
    stack = LayerStack.of_base([base])
    for i, change in enumerate((change_1, change_2, change_3)):
        stack = await frozen(store, stack, tmp_path / f"sbx{i}", change)
    return store, base, stack


async def test_freeze_moves_the_upper_and_children_fork_from_it(tmp_path: Path) -> None:
    base = make_base(tmp_path / "base")
    store = LayerStore(tmp_path / "store")
    stack = await frozen(store, LayerStack.of_base([base]), tmp_path / "sbx", change_1)
    layer = stack.top
    assert layer is not None
    assert stack.lowers() == [layer.path, base]
    assert layer.path.is_relative_to(store.root)
    assert stat.S_IMODE(os.stat(layer.path.parent).st_mode) == 0o555  # read-only layer dir
    assert store.get(layer.id) == layer
    assert (layer.path / "etc" / "gone").is_char_device()  # the whiteout was kept
    assert layer.size_bytes > 0

    # Three children over the frozen layer: each sees the parent's state and
    # only its own writes.
    async with (
        open_writable_root(stack.lowers(), tmp_path / "c0") as r0,
        open_writable_root(stack.lowers(), tmp_path / "c1") as r1,
        open_writable_root(stack.lowers(), tmp_path / "c2") as r2,
    ):
        for i, r in enumerate((r0, r1, r2)):
            assert (r / "etc" / "os").read_text() == "layer 1"
            assert not (r / "etc" / "gone").exists()
            (r / "mine").write_text(str(i))
        assert [(r / "mine").read_text() for r in (r0, r1, r2)] == ["0", "1", "2"]
        (r1 / "app" / "main.py").write_text("child 1")
        assert (r0 / "app" / "main.py").read_text() == "print('hi')"
    assert (layer.path / "app" / "main.py").read_text() == "print('hi')"
    assert not (layer.path / "mine").exists()


async def test_freeze_refuses_a_mounted_upper(tmp_path: Path) -> None:
    base = make_base(tmp_path / "base")
    store = LayerStore(tmp_path / "store")
    async with open_writable_root([base], tmp_path / "sbx") as root:
        (root / "f").write_text("x")
        with pytest.raises(LayerError, match="still mounted"):
            await store.freeze(tmp_path / "sbx" / "upper", below=LayerStack.of_base([base]))
        assert (root / "f").read_text() == "x"
    assert store.ids() == set()


async def test_compaction_keeps_whiteouts_opaque_dirs_and_metadata(tmp_path: Path) -> None:
    store, base, stack = await three_layers(tmp_path)
    assert stack.depth == 3
    flat = await store.compact(stack)
    assert flat.below == () and flat.base == (base,)
    compacted = store.chain(flat)
    assert compacted.lowers() == [flat.path, base]

    with (
        mounted_view(stack.lowers(), tmp_path / "view-stack") as a,
        mounted_view(compacted.lowers(), tmp_path / "view-flat") as b,
    ):
        expected, got = observe(a), observe(b)
        assert got == expected
        # What that equality covers, spelled out:
        assert not (b / "etc" / "gone").exists()  # base file deleted in layer 1
        assert sorted(os.listdir(b / "var")) == ["new"]  # deleted dir, recreated
        assert sorted(os.listdir(b / "opq")) == ["fresh"]  # opaque dir
        assert (b / "etc" / "becomes-dir" / "now").read_text() == "dir"
        assert (b / "dir-becomes-file").read_text() == "now a file"
        assert (b / "app" / "run").read_text() == "back"
        assert (b / "app" / "hardlink").read_text() == "print('hi')"
        assert os.getxattr(b / "app" / "main.py", "user.note") == b"kept"
        assert os.readlink(b / "app" / "link") == "main.py"
        assert (b / "home" / "user" / ".profile").read_text() == "profile"
    # Nothing of the base was copied into the compacted layer.
    assert not (flat.path / "home" / "user" / ".profile").exists()
    assert not (flat.path / "var" / "lib").exists()


async def test_hard_links_within_a_layer_survive_compaction(tmp_path: Path) -> None:
    base = make_base(tmp_path / "base")
    store = LayerStore(tmp_path / "store")

    def links(root: Path) -> None:
        (root / "a").write_text("shared")
        os.link(root / "a", root / "b")
        os.link(root / "a", root / "etc" / "c")

    stack = await frozen(store, LayerStack.of_base([base]), tmp_path / "s0", links)
    stack = await frozen(store, stack, tmp_path / "s1", lambda r: (r / "z").write_text("z"))
    flat = await store.compact(stack)
    ino = {os.lstat(flat.path / p).st_ino for p in ("a", "b", "etc/c")}
    assert len(ino) == 1
    assert os.lstat(flat.path / "a").st_nlink == 3


async def test_depth_limit_flattens_long_chains(tmp_path: Path) -> None:
    base = make_base(tmp_path / "base")
    store = LayerStore(tmp_path / "store")
    stack = LayerStack.of_base([base])
    for i in range(6):

        def change(root: Path, i: int = i) -> None:
            (root / "counter").write_text(str(i))
            (root / f"file{i}").write_text(str(i))
            if i >= 1:
                (root / f"file{i - 1}").unlink()

        stack = await frozen(store, stack, tmp_path / f"s{i}", change)
    assert stack.depth == 6
    assert await store.limit_depth(stack, 8) is stack
    limited = await store.limit_depth(stack, 4)
    assert limited.depth == 1
    with (
        mounted_view(stack.lowers(), tmp_path / "va") as a,
        mounted_view(limited.lowers(), tmp_path / "vb") as b,
    ):
        assert observe(a) == observe(b)
        assert (b / "counter").read_text() == "5"
        assert sorted(p.name for p in b.glob("file*")) == ["file5"]
    # A child of the compacted stack freezes on top of it like any other.
    child = await frozen(store, limited, tmp_path / "child", lambda r: (r / "x").write_text("x"))
    assert child.depth == 2
    assert child.ids()[1] == limited.ids()[0]


async def test_gc_never_removes_a_referenced_layer(tmp_path: Path) -> None:
    store, base, stack = await three_layers(tmp_path)
    top, middle, bottom = stack.layers
    other = await frozen(
        store, LayerStack.of_base([base]), tmp_path / "other", lambda r: (r / "o").write_text("o")
    )
    flat = await store.compact(stack)
    assert store.ids() == {top.id, middle.id, bottom.id, other.top.id, flat.id}  # type: ignore[union-attr]

    # The top layer is live: everything it was frozen over stays.
    removed = await store.gc({top.id})
    assert sorted(removed) == sorted([other.top.id, flat.id])  # type: ignore[union-attr]
    assert store.ids() == {top.id, middle.id, bottom.id}
    assert all(layer.path.is_dir() for layer in stack.layers)
    with mounted_view(stack.lowers(), tmp_path / "view") as v:
        assert (v / "etc" / "os").read_text() == "layer 3"

    # Young layers survive a gc that asks for a minimum age.
    assert await store.gc(set(), min_age_s=3600) == []
    assert await store.gc({"no-such-layer"}) != []
    assert store.ids() == set()
    assert not any((store.root / "tmp").iterdir())


async def test_interrupted_work_is_removed_on_open(tmp_path: Path) -> None:
    store, _base, stack = await three_layers(tmp_path)
    # A freeze and a gc interrupted by a crash leave staging directories.
    (store.tmp_dir / "half-frozen" / "tree" / "etc").mkdir(parents=True)
    (store.tmp_dir / "abc.gc").mkdir()
    reopened = LayerStore(store.root)
    assert list(reopened.tmp_dir.iterdir()) == []
    assert reopened.ids() == set(stack.ids())
    top = stack.top
    assert top is not None
    assert reopened.chain(top.id) == stack
    with pytest.raises(LayerError):
        reopened.get("missing")


async def test_live_captures_copy_only_changes_and_match_the_running_view(
    tmp_path: Path,
) -> None:
    """Snapshots of a still-mounted upper: each captured stack shows exactly
    what the live root showed at that moment, and each capture copies only
    what changed since the previous one."""
    base = make_base(tmp_path / "base")
    store = LayerStore(tmp_path / "store")
    below = LayerStack.of_base([base])
    work = tmp_path / "sbx"
    big = b"x" * (4 << 20)
    captured = None
    stacks = []
    async with open_writable_root(below.lowers(), work) as root:
        (root / "big").write_bytes(big)  # copied once, by the first capture only
        for i, change in enumerate((change_1, change_2, change_3)):
            change(root)
            captured = await store.capture(work / "upper", below=below, since=captured)
            if i == 0:
                assert captured.copied_bytes >= len(big)
            else:
                assert captured.copied_bytes < 1 << 20, "an unchanged big file was copied again"
            assert captured.stack.depth == i + 1
            with mounted_view(captured.stack.lowers(), tmp_path / f"view{i}") as v:
                assert observe(v) == observe(root)
            stacks.append(captured.stack)
        # later changes reach neither earlier captures nor their layers
        (root / "etc" / "os").write_text("after")
        with mounted_view(stacks[-1].lowers(), tmp_path / "view-last") as v:
            assert (v / "etc" / "os").read_text() == "layer 3"
        # a directory renamed, a file moved away, a hard link added, a file
        # whose size and mtime are kept but whose bytes changed
        (root / "app").rename(root / "app2")
        os.link(root / "app2" / "main.py", root / "app2" / "second")
        st = os.stat(root / "big")
        fd = os.open(root / "big", os.O_WRONLY)
        os.pwrite(fd, b"y", 0)
        os.close(fd)
        os.utime(root / "big", ns=(st.st_atime_ns, st.st_mtime_ns))
        captured = await store.capture(work / "upper", below=below, since=captured)
        assert captured.copied_bytes < 6 << 20
        with mounted_view(captured.stack.lowers(), tmp_path / "view-rename") as v:
            assert observe(v) == observe(root)
            assert not (v / "app").exists()
            assert (v / "big").read_bytes()[:1] == b"y"
        # a directory only the upper has, removed and made again: the new
        # one must hide what the captured one held
        shutil.rmtree(root / "app2")
        (root / "app2").mkdir()
        (root / "app2" / "only").write_text("only")
        captured = await store.capture(work / "upper", below=below, since=captured)
        with mounted_view(captured.stack.lowers(), tmp_path / "view-again") as v:
            assert observe(v) == observe(root)
            assert os.listdir(v / "app2") == ["only"]
    # the captured stacks outlive the sandbox's upper
    assert captured is not None
    assert await store.gc([captured.stack.ids()[0]]) == []
    flat = store.chain(await store.compact(captured.stack))
    with (
        mounted_view(captured.stack.lowers(), tmp_path / "view-a") as a,
        mounted_view(flat.lowers(), tmp_path / "view-b") as b,
    ):
        assert observe(b) == observe(a)


async def test_compaction_writes_no_whiteout_where_the_base_has_nothing(tmp_path: Path) -> None:
    """A file made in one layer and deleted in the next leaves nothing behind
    after compaction: overlayfs would list a whiteout in a directory that no
    lower merges with."""
    base = make_base(tmp_path / "base")
    store = LayerStore(tmp_path / "store")
    stack = LayerStack.of_base([base])

    def make(root: Path) -> None:
        (root / "new").mkdir()
        (root / "new" / "f").write_text("f")
        (root / "new" / "g").write_text("g")

    def remove(root: Path) -> None:
        (root / "new" / "f").unlink()
        (root / "etc" / "os").unlink()

    stack = await frozen(store, stack, tmp_path / "a", make)
    stack = await frozen(store, stack, tmp_path / "b", remove)
    flat = store.chain(await store.compact(stack))
    with (
        mounted_view(stack.lowers(), tmp_path / "view-stack") as a,
        mounted_view(flat.lowers(), tmp_path / "view-flat") as b,
    ):
        assert os.listdir(b / "new") == ["g"]
        assert not (b / "etc" / "os").exists()  # the base's file stays hidden
        assert observe(b) == observe(a)


async def test_a_capture_with_nothing_changed_adds_no_layer(tmp_path: Path) -> None:
    base = make_base(tmp_path / "base")
    store = LayerStore(tmp_path / "store")
    below = LayerStack.of_base([base])
    work = tmp_path / "sbx"
    async with open_writable_root(below.lowers(), work) as root:
        first = await store.capture(work / "upper", below=below)
        assert first.stack == below and store.ids() == set()  # nothing written yet
        (root / "etc" / "os").write_text("changed")
        second = await store.capture(work / "upper", below=below, since=first)
        assert second.stack.depth == 1
        third = await store.capture(work / "upper", below=below, since=second)
        assert third.stack == second.stack and len(store.ids()) == 1
        (root / "etc" / "os").unlink()
        fourth = await store.capture(work / "upper", below=below, since=third)
        assert fourth.stack.depth == 2
        with mounted_view(fourth.stack.lowers(), tmp_path / "view") as v:
            assert observe(v) == observe(root)


async def test_a_lazy_layer_is_swapped_for_its_copy_atomically(tmp_path: Path) -> None:
    """A layer restored on demand: its tree a symlink to where it is served, its
    stored index kept; `materialise` swaps the real tree in (a crash mid-swap
    leaves the symlink, and the next look clears the half-done copy)."""
    store = LayerStore(tmp_path / "store")
    served = tmp_path / "served"
    served.mkdir()
    (served / "f").write_text("served")
    layer = await store.adopt_lazy(
        "restored1", below=(), base=[tmp_path], target=served, index=b"{}", size_bytes=6
    )
    assert layer.path.is_symlink() and (layer.path / "f").read_text() == "served"
    assert store.lazy_ids() == {"restored1"} and store.stored_index("restored1") == b"{}"
    assert store.stored_index("restored1") is not None
    # a crash after the copy was moved in beside the symlink, before the swap
    (layer.path.parent / "tree.new").mkdir()
    assert store.lazy_ids() == {"restored1"}
    assert not (layer.path.parent / "tree.new").exists()

    staging = store.new_staging()
    (staging / "tree").mkdir()
    (staging / "tree" / "f").write_text("on disk")
    after = await store.materialise("restored1", staging)
    assert not after.path.is_symlink() and (after.path / "f").read_text() == "on disk"
    assert store.lazy_ids() == set() and not staging.exists()
    assert store.stored_index("restored1") == b"{}"  # uploads still use the stored index
    with pytest.raises(LayerError, match="not lazy"):
        staging = store.new_staging()
        (staging / "tree").mkdir()
        await store.materialise("restored1", staging)
    assert store.get("restored1").size_bytes == 6
    assert await store.gc([]) == ["restored1"] and served.exists()  # never follows the link
