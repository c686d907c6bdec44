"""ImageTree: merging layer indexes the way Docker and the OCI image spec do.

Hand-written cases name each rule (whiteouts, opaque dirs, replacement, hard
links, implicit parents, xattr filtering); a Hypothesis property compares the
tree against `_model`, a naive restatement of the rules over a flat dict of
path -> object, for random small layer stacks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aenv.proto.imagetree import ROOT_INO, ImageTree, Inode, TreeError
from aenv.proto.layerindex import Chunk, Entry, Kind, LayerIndex

_n = 0


def layer(*entries: Entry) -> LayerIndex:
    global _n
    _n += 1
    digest = f"sha256:{_n:064x}"
    return LayerIndex(digest=digest, diff_id=digest, media_type="t", size=0, entries=entries)


def d(path: str, mode: int = 0o755, **kw: object) -> Entry:
    return Entry(path=path, kind=Kind.DIR, mode=mode, **kw)  # type: ignore[arg-type]


def f(path: str, content: str = "x", mode: int = 0o644, **kw: object) -> Entry:
    chunk = Chunk(f"sha256:{abs(hash(content)):064x}"[:71], len(content), 0)
    return Entry(path=path, kind=Kind.FILE, mode=mode, size=len(content), chunks=(chunk,), **kw)  # type: ignore[arg-type]


def ln(path: str, target: str) -> Entry:
    return Entry(path=path, kind=Kind.HARDLINK, link=target)


def sym(path: str, target: str) -> Entry:
    return Entry(path=path, kind=Kind.SYMLINK, link=target, mode=0o777)


def wh(path: str) -> Entry:
    return Entry(path=path, kind=Kind.WHITEOUT)


def opq(path: str) -> Entry:
    return Entry(path=path, kind=Kind.OPAQUE)


def paths(tree: ImageTree) -> list[str]:
    return [p for p, _ in tree.walk()]


def node(tree: ImageTree, path: str) -> Inode:
    got = tree.resolve(path)
    assert got is not None, path
    return got


# -- the rules, one by one -------------------------------------------------------


def test_whiteout_removes_lower_subtree_but_not_same_layer_additions() -> None:
    lower = layer(d("a"), f("a/x"), d("a/sub"), f("a/sub/y"), f("keep"))
    upper = layer(f("a/new"), wh("a"), wh("missing"))  # a whiteout never hits its own layer
    tree = ImageTree.build([lower, upper])
    assert paths(tree) == ["", "keep", "a", "a/new"]
    assert node(tree, "a").mode == 0o755 and node(tree, "a").uid == 0  # implicit parent


def test_whiteout_then_re_add_in_the_same_layer() -> None:
    lower = layer(f("x", "old"))
    upper = layer(f("x", "new"), wh("x"))
    tree = ImageTree.build([lower, upper])
    assert node(tree, "x").layer == upper.digest
    assert node(tree, "x").size == 3


def test_opaque_hides_lower_contents_keeps_own_regardless_of_order() -> None:
    lower = layer(d("etc", 0o700), f("etc/lower"), d("etc/sub"), f("etc/sub/z"), f("other"))
    upper = layer(f("etc/before"), opq("etc"), f("etc/after"))
    tree = ImageTree.build([lower, upper])
    assert paths(tree) == ["", "etc", "etc/before", "etc/after", "other"]
    assert node(tree, "etc").mode == 0o700  # the directory itself stays


def test_opaque_root_and_opaque_on_missing_dir() -> None:
    lower = layer(f("a"), d("b"), f("b/c"))
    tree = ImageTree.build([lower, layer(opq(""), f("new"))])
    assert paths(tree) == ["", "new"]
    # The directories holding markers exist in the marker's layer.
    tree = ImageTree.build([lower, layer(opq("nope/deeper"), wh("a/x"))])
    assert paths(tree) == ["", "b", "b/c", "nope", "nope/deeper", "a"]
    assert node(tree, "a").kind is Kind.DIR


def test_non_dir_replacing_dir_drops_subtree_and_dir_over_dir_merges() -> None:
    lower = layer(d("a", 0o700, uid=5), f("a/x"), d("b"), f("b/y"))
    upper = layer(f("a"), d("b", 0o750, uid=7), f("b/z"))
    tree = ImageTree.build([lower, upper])
    assert sorted(paths(tree)) == ["", "a", "b", "b/y", "b/z"]
    assert node(tree, "a").kind is Kind.FILE
    assert (node(tree, "b").mode, node(tree, "b").uid) == (0o750, 7)


def test_implicit_parent_replaces_a_lower_non_directory() -> None:
    tree = ImageTree.build([layer(f("a")), layer(f("a/b/c"))])
    assert node(tree, "a").kind is Kind.DIR and node(tree, "a/b").kind is Kind.DIR
    assert node(tree, "a/b/c").kind is Kind.FILE


def test_hard_links_share_inode_and_count_names() -> None:
    lower = layer(f("bin/a", "payload"), ln("bin/b", "bin/a"), ln("c", "bin/a"))
    tree = ImageTree.build([lower])
    a, b, c = node(tree, "bin/a"), node(tree, "bin/b"), node(tree, "c")
    assert a is b is c and a.nlink == 3
    assert tree.content_bytes == len("payload")  # one inode, counted once
    # Whiteout of one name or replacing another leaves the rest linked.
    tree = ImageTree.build([lower, layer(wh("bin/a"), f("c", "other"))])
    assert node(tree, "bin/b").nlink == 1 and node(tree, "bin/b").layer == lower.digest
    assert node(tree, "c").nlink == 1 and node(tree, "c").ino != node(tree, "bin/b").ino
    # A hard link over the last other name of its own target keeps the inode.
    tree = ImageTree.build([layer(d("x"), f("x/f")), layer(ln("x", "x/f"))])
    assert node(tree, "x").kind is Kind.FILE and node(tree, "x").nlink == 1


def test_hard_link_across_layers_and_to_a_symlink() -> None:
    tree = ImageTree.build([layer(f("a"), sym("s", "a")), layer(ln("b", "a"), ln("t", "s"))])
    assert node(tree, "a").ino == node(tree, "b").ino and node(tree, "b").nlink == 2
    assert node(tree, "t").kind is Kind.SYMLINK and node(tree, "t").nlink == 2


@pytest.mark.parametrize(
    "bad",
    [
        [layer(ln("a", "missing"))],
        [layer(d("dir"), ln("a", "dir"))],
        [layer(f("a"), ln("b", "a")), layer(wh("a"), ln("c", "a"))],  # gone from lower
        [layer(f("../x"))],
        [layer(f("/x"))],
        [layer(f("a//b"))],
        [layer(f("./a"))],
        [layer(f(""))],
        [layer(wh(""))],
    ],
)
def test_unmergeable_layers_raise(bad: list[LayerIndex]) -> None:
    with pytest.raises(TreeError):
        ImageTree.build(bad)


def test_dir_nlink_parents_and_metadata() -> None:
    tree = ImageTree.build(
        [
            layer(d("", 0o700, uid=1, mtime_ns=5), d("a"), d("a/b"), d("a/c"), f("a/f")),
            layer(sym("a/link", "../x"), Entry(path="dev", kind=Kind.CHAR, devmajor=1, devminor=3)),
        ]
    )
    root = tree[ROOT_INO]
    assert (root.mode, root.uid, root.mtime_ns, root.parent, root.nlink) == (0o700, 1, 5, 1, 3)
    a = node(tree, "a")
    assert a.nlink == 4 and a.parent == ROOT_INO and node(tree, "a/b").parent == a.ino
    link = node(tree, "a/link")
    assert (link.kind, link.link, link.size) == (Kind.SYMLINK, "../x", 4)
    dev = node(tree, "dev")
    assert (dev.kind, dev.devmajor, dev.devminor) == (Kind.CHAR, 1, 3)
    assert tree.lookup(a.ino, "b") is node(tree, "a/b")
    assert tree.lookup(a.ino, "nope") is None and tree.lookup(link.ino, "x") is None
    assert tree.resolve("a/link/x") is None and tree.resolve("a/../a") is None
    assert tree.resolve("/a/b/") is node(tree, "a/b")


def test_trusted_xattrs_are_dropped_others_kept() -> None:
    xattrs = {
        "trusted.overlay.opaque": b"y",
        "security.capability": b"\x01\x00\x00\x02",
        "user.k": b"\xff",
    }
    tree = ImageTree.build([layer(f("bin/ping", xattrs=xattrs), d("d", xattrs=xattrs))])
    for path in ("bin/ping", "d"):
        assert node(tree, path).xattrs == {
            "security.capability": b"\x01\x00\x00\x02",
            "user.k": b"\xff",
        }


def test_walk_lists_parents_first_in_insertion_order() -> None:
    tree = ImageTree.build([layer(f("z"), d("m"), f("m/b"), f("m/a"), f("a"))])
    assert paths(tree) == ["", "z", "m", "m/b", "m/a", "a"]
    seen: set[str] = set()
    for path, _ in tree.walk():
        assert path.rpartition("/")[0] in seen or path == ""
        seen.add(path)


# -- property: the tree equals a naive model --------------------------------------


@dataclass(eq=False)
class _Obj:
    kind: Kind
    mode: int = 0o755
    uid: int = 0
    mtime_ns: int = 0
    size: int = 0
    link: str = ""
    xattrs: dict[str, bytes] = field(default_factory=dict)
    chunks: tuple[Chunk, ...] = ()
    layer: str = ""


def _model(layers: list[LayerIndex]) -> dict[str, _Obj] | None:
    """Apply the layers to a flat dict; None where a hard link cannot resolve."""
    state: dict[str, _Obj] = {"": _Obj(Kind.DIR)}

    def remove(path: str, *, keep_self: bool = False) -> None:
        for p in list(state):
            if (p == path and not keep_self) or (p.startswith(path + "/") if path else p):
                del state[p]

    def meta(e: Entry, lay: LayerIndex) -> _Obj:
        file = e.kind is Kind.FILE
        return _Obj(
            e.kind,
            e.mode,
            e.uid,
            e.mtime_ns,
            e.size if file else len(e.link.encode()),
            e.link if e.kind is Kind.SYMLINK else "",
            {k: v for k, v in e.xattrs.items() if not k.startswith("trusted.")},
            e.chunks if file else (),
            lay.digest if file else "",
        )

    for lay in layers:
        for e in lay.entries:
            if e.kind is Kind.WHITEOUT:
                remove(e.path)
            elif e.kind is Kind.OPAQUE and e.path in state and state[e.path].kind is Kind.DIR:
                remove(e.path, keep_self=True)
        for e in lay.entries:
            parts = e.path.split("/") if e.path else []
            if e.kind is Kind.OPAQUE:
                parts.append("")  # the marker sits inside the directory
            elif e.path == "":
                state[""] = meta(e, lay)
                continue
            for k in range(1, len(parts)):
                p = "/".join(parts[:k])
                if p not in state or state[p].kind is not Kind.DIR:
                    remove(p)
                    state[p] = _Obj(Kind.DIR)
            if e.kind in (Kind.WHITEOUT, Kind.OPAQUE):
                continue
            if e.kind is Kind.HARDLINK:
                target = state.get(e.link)
                if target is None or target.kind is Kind.DIR:
                    return None
                remove(e.path)
                state[e.path] = target
            elif e.kind is Kind.DIR and e.path in state and state[e.path].kind is Kind.DIR:
                state[e.path] = meta(e, lay)
            else:
                remove(e.path)
                state[e.path] = meta(e, lay)
    return state


_names = st.sampled_from(["a", "b", "c"])
_paths = st.lists(_names, min_size=1, max_size=3).map("/".join)
_xattrs = st.dictionaries(
    st.sampled_from(["user.a", "trusted.b", "security.c"]), st.binary(max_size=2), max_size=2
)


@st.composite
def _entry(draw: st.DrawFn) -> Entry:
    kind = draw(
        st.sampled_from(
            [
                Kind.DIR,
                Kind.FILE,
                Kind.FILE,
                Kind.SYMLINK,
                Kind.FIFO,
                Kind.HARDLINK,
                Kind.WHITEOUT,
                Kind.OPAQUE,
            ]
        )
    )
    path = draw(_paths)
    if kind is Kind.OPAQUE:
        path = draw(st.sampled_from(["", path]))
    if kind is Kind.DIR:
        path = draw(st.sampled_from(["", path, path]))
    common: dict[str, object] = {
        "mode": draw(st.sampled_from([0o755, 0o644, 0o4711])),
        "uid": draw(st.integers(0, 2)),
        "mtime_ns": draw(st.integers(0, 3)),
        "xattrs": draw(_xattrs),
    }
    if kind is Kind.FILE:
        size = draw(st.integers(0, 3))
        chunks = (Chunk(f"sha256:{draw(st.integers(0, 9)):064x}", size, 0),) if size else ()
        return Entry(path=path, kind=kind, size=size, chunks=chunks, **common)  # type: ignore[arg-type]
    if kind is Kind.HARDLINK:
        return Entry(path=path, kind=kind, link=draw(_paths))
    if kind is Kind.SYMLINK:
        return Entry(path=path, kind=kind, link=draw(_paths), **common)  # type: ignore[arg-type]
    if kind in (Kind.WHITEOUT, Kind.OPAQUE):
        return Entry(path=path, kind=kind)
    return Entry(path=path, kind=kind, **common)  # type: ignore[arg-type]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.lists(_entry(), max_size=8), min_size=1, max_size=4))
def test_merge_matches_naive_model(stack: list[list[Entry]]) -> None:
    layers = [layer(*entries) for entries in stack]
    want = _model(layers)
    if want is None:
        with pytest.raises(TreeError):
            ImageTree.build(layers)
        return
    tree = ImageTree.build(layers)
    got = dict(tree.walk())
    assert set(got) == set(want)
    assert {i.ino for i in got.values()} == set(tree.inodes)  # nothing unreachable kept
    names: dict[int, int] = {}
    for ino in (i.ino for i in got.values()):
        names[ino] = names.get(ino, 0) + 1
    for path, inode in got.items():
        obj = want[path]
        assert (inode.kind, inode.mode, inode.uid, inode.mtime_ns) == (
            obj.kind,
            obj.mode,
            obj.uid,
            obj.mtime_ns,
        ), path
        assert inode.xattrs == obj.xattrs, path
        if inode.kind is Kind.DIR:
            subdirs = sum(1 for c in (inode.children or {}).values() if tree[c].kind is Kind.DIR)
            assert inode.nlink == 2 + subdirs
            assert inode.size == 0
            continue
        assert (inode.size, inode.link, inode.chunks, inode.layer) == (
            obj.size,
            obj.link,
            obj.chunks,
            obj.layer,
        ), path
        assert inode.nlink == names[inode.ino]
        # Two paths share an inode exactly when the model shares the object.
        for other, oinode in got.items():
            if oinode.kind is not Kind.DIR:
                assert (oinode.ino == inode.ino) == (want[other] is obj)
